"""Moving weights between torch and mha_ext (API.md §4): from_torch for
nn.MultiheadAttention and for the seed layout, load_state_dict with torch's
packed and separate layouts, and pickle / copy.deepcopy.

Parity is checked against torch in eval mode with random non-zero biases:
float32 within 2e-5, float64 within 1e-10 (largest absolute difference).

Legend: B batch, Sq/Sk query/key length, E = d_model, H = n_heads, Dk = E/H.
"""
import copy
import pickle

import numpy as np
import pytest

from mha_ext import MultiHeadAttention
from _support import require_torch

DTYPES = ("float32", "float64")
TOL = {"float32": 2e-5, "float64": 1e-10}
E, H, B, SQ, SK = 16, 4, 2, 5, 6
SEED_KEYS = ("W_q.weight", "W_q.bias", "W_k.weight", "W_k.bias",
             "W_v.weight", "W_v.bias", "W_o.weight", "W_o.bias")


@pytest.fixture(scope="module")
def torch():
    return require_torch()


@pytest.fixture(params=DTYPES)
def dtype(request):
    return request.param


def random_biases(torch, module, seed=1):
    """Non-zero biases, |b| in [0.05, 0.5] with random signs."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("bias"):
                mag = torch.rand(p.shape, generator=gen, dtype=p.dtype) * 0.45 + 0.05
                sign = torch.randint(0, 2, p.shape, generator=gen).to(p.dtype) * 2 - 1
                p.copy_(mag * sign)
    return module


def make_torch_mha(torch, dtype, seed=0, **kw):
    torch.manual_seed(seed)
    kw.setdefault("batch_first", True)
    t = torch.nn.MultiheadAttention(E, H, **kw).to(getattr(torch, dtype))
    return random_biases(torch, t).eval()


def seed_module_class(torch):
    nn = torch.nn

    class Seed(nn.Module):
        """The seed notebook's layout: W_q, W_k, W_v, W_o and a Dropout."""

        def __init__(self, d_model, n_heads, dropout=0.0, bias=True):
            super().__init__()
            self.n_heads, self.d_k = n_heads, d_model // n_heads
            self.W_q = nn.Linear(d_model, d_model, bias=bias)
            self.W_k = nn.Linear(d_model, d_model, bias=bias)
            self.W_v = nn.Linear(d_model, d_model, bias=bias)
            self.W_o = nn.Linear(d_model, d_model, bias=bias)
            self.dropout = nn.Dropout(dropout)

        def forward(self, q, k, v):
            split = lambda x: x.unflatten(-1, (self.n_heads, self.d_k)).transpose(1, 2)  # noqa
            Q, K, V = split(self.W_q(q)), split(self.W_k(k)), split(self.W_v(v))
            w = torch.softmax(Q @ K.transpose(-2, -1) / self.d_k ** 0.5, dim=-1)
            ctx = self.dropout(w) @ V
            return self.W_o(ctx.transpose(1, 2).flatten(-2)), w

    return Seed


def inputs(dtype, kdim=E, vdim=E, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, SQ, E)).astype(dtype),
            rng.standard_normal((B, SK, kdim)).astype(dtype),
            rng.standard_normal((B, SK, vdim)).astype(dtype))


def torch_run(torch, t, q, k, v, batch_first=True):
    q, k, v = (torch.from_numpy(x) for x in (q, k, v))
    if not batch_first:
        q, k, v = (x.transpose(0, 1) for x in (q, k, v))
    with torch.no_grad():
        out, w = t(q, k.clone(), v.clone(), average_attn_weights=False)
    if not batch_first:
        out = out.transpose(0, 1)
    return out.numpy(), w.numpy()


def assert_close(dtype, got, want):
    assert got.shape == want.shape and got.dtype == np.dtype(dtype)
    err = float(np.abs(got - want).max())
    assert err <= TOL[dtype], f"error {err:.3g} > {TOL[dtype]}"
    return err


def assert_same_numbers(torch, t, m, dtype, batch_first=True):
    q, k, v = inputs(dtype, m.kdim, m.vdim)
    out, w = m(q, k, v)
    t_out, t_w = torch_run(torch, t, q, k, v, batch_first)
    assert_close(dtype, out, t_out)
    assert_close(dtype, w, t_w)


# ------------------------------------------------------------------ from_torch

@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("kw", [{}, dict(bias=False), dict(kdim=8, vdim=12),
                                dict(kdim=8, vdim=12, bias=False)])
def test_from_torch_mha(torch, dtype, batch_first, kw):
    t = make_torch_mha(torch, dtype, batch_first=batch_first, **kw)
    m = MultiHeadAttention.from_torch(t)
    assert isinstance(m, MultiHeadAttention)
    assert (m.d_model, m.n_heads, m.kdim, m.vdim) == (E, H, t.kdim, t.vdim)
    assert m.bias == kw.get("bias", True)
    assert m.dtype == np.dtype(dtype)
    assert m.training is False and m.dropout == 0.0
    # issue 12: the copy takes torch's layout of the inputs
    assert m.batch_first is batch_first
    if not batch_first:
        q, k, v = (x.transpose(1, 0, 2) for x in inputs(dtype, m.kdim, m.vdim))
        out, w = m(q, k, v)
        with torch.no_grad():
            t_out, t_w = t(*(torch.from_numpy(np.ascontiguousarray(x)) for x in (q, k, v)),
                           average_attn_weights=False)
        assert_close(dtype, out, t_out.numpy())
        assert_close(dtype, w, t_w.numpy())
        m.batch_first = True  # and batch-first calls on request
    assert_same_numbers(torch, t, m, dtype, batch_first)


def test_from_torch_takes_dropout_and_training_mode(torch):
    t = torch.nn.MultiheadAttention(E, H, dropout=0.25, batch_first=True)
    m = MultiHeadAttention.from_torch(t)
    assert m.dropout == 0.25 and m.training is True
    m = MultiHeadAttention.from_torch(t.eval())
    assert m.dropout == 0.25 and m.training is False


def test_from_torch_seed_layout(torch, dtype):
    Seed = seed_module_class(torch)
    torch.manual_seed(0)
    s = random_biases(torch, Seed(E, H, dropout=0.1)).to(getattr(torch, dtype))
    m = MultiHeadAttention.from_torch(s)
    assert (m.d_model, m.n_heads, m.dropout, m.training, m.dtype) == (E, H, 0.1, True, dtype)
    s.eval()
    m.eval()
    q, k, v = inputs(dtype)
    with torch.no_grad():
        t_out, t_w = s(*(torch.from_numpy(x) for x in (q, k, v)))
    out, w = m(q, k, v)
    assert_close(dtype, out, t_out.numpy())
    assert_close(dtype, w, t_w.numpy())
    for name in ("W_q", "W_k", "W_v", "W_o"):
        assert np.array_equal(getattr(m, name).weight, getattr(s, name).weight.detach().numpy())
        assert np.array_equal(getattr(m, name).bias, getattr(s, name).bias.detach().numpy())


def test_from_torch_seed_layout_no_bias(torch):
    Seed = seed_module_class(torch)
    s = Seed(E, H, bias=False).eval()
    m = MultiHeadAttention.from_torch(s)
    assert m.bias is False and m.W_q.bias is None
    q, k, v = inputs("float32")
    with torch.no_grad():
        t_out, _ = s(*(torch.from_numpy(x) for x in (q, k, v)))
    assert_close("float32", m(q, k, v)[0], t_out.numpy())


def test_from_torch_copy_owns_memory(torch):
    t = make_torch_mha(torch, "float32")
    m = MultiHeadAttention.from_torch(t)
    before = m.state_dict()
    with torch.no_grad():
        t.in_proj_weight.mul_(2)
        t.out_proj.bias.add_(1)
    after = m.state_dict()
    assert all(np.array_equal(before[k], after[k]) for k in SEED_KEYS)
    m.W_q.weight[...] = 0  # torch's weights stay as they were
    assert not np.array_equal(t.in_proj_weight[:E].detach().numpy(), m.W_q.weight)


def test_from_torch_requires_grad_parameters(torch):
    t = make_torch_mha(torch, "float64")
    assert t.in_proj_weight.requires_grad
    m = MultiHeadAttention.from_torch(t)
    assert np.array_equal(m.W_k.weight, t.in_proj_weight[E:2 * E].detach().numpy())


@pytest.mark.parametrize("kw", [dict(add_bias_kv=True), dict(add_zero_attn=True),
                                dict(add_bias_kv=True, add_zero_attn=True)])
def test_from_torch_bias_kv_zero_attn(torch, kw):
    # once refused (issue 12): now copied, bias_k / bias_v included, and the
    # copy computes torch's numbers (tests/test_bias_kv.py checks them widely)
    t = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64, **kw).eval()
    m = MultiHeadAttention.from_torch(t)
    assert m.add_bias_kv == kw.get("add_bias_kv", False)
    assert m.add_zero_attn == kw.get("add_zero_attn", False)
    if m.add_bias_kv:
        assert np.array_equal(m.bias_k, t.bias_k.detach().numpy().reshape(-1))
        assert np.array_equal(m.bias_v, t.bias_v.detach().numpy().reshape(-1))
    x = torch.randn(2, 5, E, dtype=torch.float64)
    out, w = t(x, x, x, average_attn_weights=False)
    ours, ours_w = m(x.numpy())
    assert ours_w.shape == w.shape
    np.testing.assert_allclose(ours, out.detach().numpy(), atol=1e-12)
    np.testing.assert_allclose(ours_w, w.detach().numpy(), atol=1e-12)


def test_from_torch_half_precision_needs_dtype(torch):
    t = torch.nn.MultiheadAttention(E, H, batch_first=True).to(torch.bfloat16).eval()
    with pytest.raises(ValueError, match="dtype"):
        MultiHeadAttention.from_torch(t)
    m = MultiHeadAttention.from_torch(t, dtype="float32")
    assert m.dtype == np.float32
    assert np.array_equal(m.W_v.weight, t.in_proj_weight[2 * E:].float().detach().numpy())


def test_from_torch_not_a_module(torch):
    for bad in (None, 3, torch.nn.Linear(4, 4), {"in_proj_weight": 1}):
        with pytest.raises(TypeError, match="MultiheadAttention"):
            MultiHeadAttention.from_torch(bad)


# ------------------------------------------------------------------ load_state_dict, torch layouts

def test_load_state_dict_packed(torch, dtype):
    t = make_torch_mha(torch, dtype)
    sd = t.state_dict()
    assert set(sd) == {"in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"}
    m = MultiHeadAttention(E, H, dtype=dtype, seed=0)
    result = m.load_state_dict(sd)
    assert list(result.missing_keys) == [] and list(result.unexpected_keys) == []
    m.eval()
    w = t.in_proj_weight.detach().numpy()
    assert np.array_equal(m.W_q.weight, w[:E]) and np.array_equal(m.W_v.weight, w[2 * E:])
    assert_same_numbers(torch, t, m, dtype)


@pytest.mark.parametrize("bias", [True, False])
def test_load_state_dict_separate(torch, dtype, bias):
    t = make_torch_mha(torch, dtype, kdim=8, vdim=12, bias=bias)
    sd = t.state_dict()
    assert "q_proj_weight" in sd and ("in_proj_bias" in sd) == bias
    m = MultiHeadAttention(E, H, kdim=8, vdim=12, bias=bias, dtype=dtype, seed=0).eval()
    m.load_state_dict(sd)
    assert_same_numbers(torch, t, m, dtype)


def test_load_state_dict_separate_when_dims_agree(torch):
    """q/k/v_proj_weight also load into a module with kdim == vdim == E."""
    t = make_torch_mha(torch, "float64")
    w = t.in_proj_weight.detach()
    sd = {"q_proj_weight": w[:E], "k_proj_weight": w[E:2 * E], "v_proj_weight": w[2 * E:],
          "in_proj_bias": t.in_proj_bias, "out_proj.weight": t.out_proj.weight,
          "out_proj.bias": t.out_proj.bias}
    m = MultiHeadAttention(E, H, dtype="float64").eval()
    m.load_state_dict(sd)
    assert_same_numbers(torch, t, m, "float64")


def test_load_state_dict_tensor_kinds(torch):
    """Values that require grad, non-contiguous and of another dtype."""
    t = make_torch_mha(torch, "float32")
    w = t.in_proj_weight
    non_contig = w.detach().t().contiguous().t()
    assert not non_contig.is_contiguous()
    sd = {"in_proj_weight": non_contig, "in_proj_bias": t.in_proj_bias,  # requires grad
          "out_proj.weight": t.out_proj.weight.double(), "out_proj.bias": t.out_proj.bias}
    assert sd["in_proj_bias"].requires_grad
    m = MultiHeadAttention(E, H).eval()
    m.load_state_dict(sd)
    assert np.array_equal(m.W_q.weight, w[:E].detach().numpy())
    assert_same_numbers(torch, t, m, "float32")
    assert t.in_proj_bias.requires_grad and t.in_proj_bias.grad is None


def unchanged(m, before):
    return all(np.array_equal(m.state_dict()[k], before[k]) for k in before)


@pytest.mark.parametrize("drop", ["in_proj_weight", "in_proj_bias", "out_proj.weight",
                                  "out_proj.bias"])
def test_load_state_dict_missing_torch_key(torch, drop):
    sd = dict(make_torch_mha(torch, "float32").state_dict())
    del sd[drop]
    m = MultiHeadAttention(E, H, seed=0)
    before = m.state_dict()
    with pytest.raises(KeyError, match=drop.replace(".", r"\.")):
        m.load_state_dict(sd)
    assert unchanged(m, before)
    # strict=False loads the rest and reports the missing key
    result = m.load_state_dict(sd, strict=False)
    assert list(result.missing_keys) == [drop]


def test_load_state_dict_missing_separate_key(torch):
    sd = dict(make_torch_mha(torch, "float32", kdim=8, vdim=12).state_dict())
    del sd["v_proj_weight"]
    m = MultiHeadAttention(E, H, kdim=8, vdim=12, seed=0)
    before = m.state_dict()
    with pytest.raises(KeyError, match="v_proj_weight"):
        m.load_state_dict(sd)
    assert unchanged(m, before)


@pytest.mark.parametrize("key,shape", [("in_proj_weight", (2 * E, E)),
                                       ("in_proj_weight", (E, 3 * E)),
                                       ("in_proj_bias", (E,)),
                                       ("out_proj.weight", (E, E + 1)),
                                       ("out_proj.bias", (1, E))])
def test_load_state_dict_wrong_shape_is_atomic(torch, key, shape):
    sd = dict(make_torch_mha(torch, "float32").state_dict())
    sd[key] = torch.ones(shape)
    m = MultiHeadAttention(E, H, seed=0)
    before = m.state_dict()
    with pytest.raises(ValueError) as e:
        m.load_state_dict(sd)
    assert key in str(e.value) and str(shape) in str(e.value)
    assert unchanged(m, before)


def test_load_state_dict_packed_into_kdim_module(torch):
    sd = make_torch_mha(torch, "float32").state_dict()
    m = MultiHeadAttention(E, H, kdim=8, vdim=12, seed=0)
    before = m.state_dict()
    with pytest.raises(ValueError, match="in_proj_weight.*k_proj_weight"):
        m.load_state_dict(sd)
    assert unchanged(m, before)


def test_load_state_dict_separate_wrong_shape(torch):
    sd = dict(make_torch_mha(torch, "float32", kdim=8, vdim=12).state_dict())
    m = MultiHeadAttention(E, H, kdim=8, vdim=10, seed=0)
    with pytest.raises(ValueError, match=r"v_proj_weight.*\(16, 10\).*\(16, 12\)"):
        m.load_state_dict(sd)


def test_load_state_dict_bias_kv_rejected(torch):
    sd = torch.nn.MultiheadAttention(E, H, add_bias_kv=True).state_dict()
    m = MultiHeadAttention(E, H, seed=0)
    before = m.state_dict()
    for strict in (True, False):
        with pytest.raises(ValueError, match="bias_k.*add_bias_kv"):
            m.load_state_dict(sd, strict=strict)
    assert unchanged(m, before)


def test_load_state_dict_torch_bias_into_biasless_module(torch):
    sd = make_torch_mha(torch, "float32").state_dict()
    m = MultiHeadAttention(E, H, bias=False, seed=0)
    with pytest.raises(KeyError, match="in_proj_bias"):
        m.load_state_dict(sd)
    result = m.load_state_dict(sd, strict=False)
    assert set(result.unexpected_keys) == {"in_proj_bias", "out_proj.bias"}


def test_load_state_dict_mixed_layouts_rejected(torch):
    sd = dict(make_torch_mha(torch, "float32").state_dict())
    sd["W_q.weight"] = np.zeros((E, E), np.float32)
    m = MultiHeadAttention(E, H, seed=0)
    before = m.state_dict()
    with pytest.raises(KeyError):
        m.load_state_dict(sd)
    assert unchanged(m, before)


def test_seed_state_dict_into_torch_seed_module(torch):
    """Our state_dict() has the seed module's keys: torch loads it as is."""
    Seed = seed_module_class(torch)
    m = MultiHeadAttention(E, H, seed=3).eval()
    s = Seed(E, H).eval()
    s.load_state_dict({k: torch.from_numpy(v) for k, v in m.state_dict().items()})
    q, k, v = inputs("float32")
    with torch.no_grad():
        t_out, _ = s(*(torch.from_numpy(x) for x in (q, k, v)))
    assert_close("float32", m(q, k, v)[0], t_out.numpy())


# ------------------------------------------------------------------ pickle and deepcopy

def copies(m):
    yield copy.deepcopy(m)
    yield copy.copy(m)
    for proto in range(pickle.HIGHEST_PROTOCOL + 1):
        yield pickle.loads(pickle.dumps(m, protocol=proto))


@pytest.mark.parametrize("kw", [{}, dict(bias=False, kdim=8, vdim=12, dtype="float64"),
                                dict(dropout=0.3)])
def test_copies_are_equal_and_own_their_memory(kw):
    m = MultiHeadAttention(E, H, seed=5, **kw).eval()
    q, k, v = inputs(m.dtype, m.kdim, m.vdim)
    out, w = m(q, k, v)
    for c in copies(m):
        assert type(c) is MultiHeadAttention and c is not m
        assert repr(c) == repr(m)
        for name in ("d_model", "n_heads", "kdim", "vdim", "bias", "dtype", "dropout",
                     "training", "seed", "num_parameters"):
            assert getattr(c, name) == getattr(m, name), name
        c_out, c_w = c(q, k, v)
        assert np.array_equal(c_out, out) and np.array_equal(c_w, w)
        assert not np.shares_memory(c._block(), m._block())
        c.W_q.weight[...] = 0
        assert np.array_equal(m(q, k, v)[0], out)


def test_copy_keeps_loaded_weights_and_mode(torch):
    t = make_torch_mha(torch, "float64")
    m = MultiHeadAttention.from_torch(t)
    m.W_o.bias[...] += 1  # not what the seed would give
    for c in copies(m):
        assert all(np.array_equal(c.state_dict()[k], m.state_dict()[k]) for k in SEED_KEYS)
        assert c.training is False
    m.train()
    assert all(c.training for c in copies(m))


def test_copy_continues_the_dropout_stream():
    """A copy in training mode draws the same dropout masks as the original
    from then on: seed and the stream counter travel with it."""
    m = MultiHeadAttention(E, H, dropout=0.5, seed=7)
    q, k, v = inputs("float32")
    m(q, k, v)
    m(q, k, v)
    assert m._counter == 2
    made = list(copies(m))
    after_two = [m(q, k, v)[1] for _ in range(2)]
    assert not np.array_equal(after_two[0], after_two[1])
    for c in made:
        assert c._counter == 2
        assert np.array_equal(c(q, k, v)[1], after_two[0])
        assert np.array_equal(c(q, k, v)[1], after_two[1])


def test_copy_of_a_subclass_keeps_its_attributes():
    m = Tagged(E, H, seed=1)
    m.tag = {"name": "layer 3"}
    for c in copies(m):
        assert type(c) is Tagged and c.tag == {"name": "layer 3"}
    d = copy.deepcopy(m)
    assert d.tag is not m.tag


class Tagged(MultiHeadAttention):
    """A user's subclass (module level, so pickle can find it)."""


@pytest.mark.parametrize("bad,exc", [("abc", TypeError), ([[1, 2], [3]], ValueError),
                                     ("complex", TypeError)])
def test_load_state_dict_bad_value_is_atomic(torch, bad, exc):
    sd = dict(make_torch_mha(torch, "float32").state_dict())
    if bad == "complex":
        bad = torch.zeros(E, dtype=torch.complex64)
    sd["out_proj.bias"] = bad  # after the other keys: they must not be loaded either
    m = MultiHeadAttention(E, H, seed=0)
    before = m.state_dict()
    with pytest.raises(exc, match=r"out_proj\.bias"):
        m.load_state_dict(sd)
    assert unchanged(m, before)


def test_from_torch_of_one_bias_of_k_and_v_says_which(torch):
    from mha_ext.torch import MultiheadAttention as DropIn
    ref = torch.nn.MultiheadAttention(8, 2, add_bias_kv=True)
    ref.bias_v = None
    with pytest.raises(ValueError, match="has one of bias_k and bias_v but not the other"):
        DropIn.from_torch(ref)


def _seed_style(torch, E, *, d_k=None, n_heads=None, o_bias=True):
    class Seed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            if d_k is not None:
                self.d_k = d_k
            if n_heads is not None:
                self.n_heads = n_heads
            self.W_q, self.W_k, self.W_v = (torch.nn.Linear(E, E, dtype=torch.float64)
                                            for _ in range(3))
            self.W_o = torch.nn.Linear(E, E, bias=o_bias, dtype=torch.float64)
    return Seed()


def test_a_seed_style_modules_head_count_from_its_head_width(torch):
    torch.manual_seed(0)
    assert MultiHeadAttention.from_torch(_seed_style(torch, 8, d_k=2)).n_heads == 4


def test_a_seed_style_module_without_one_bias_copies_zeros_there(torch):
    # W_o without a bias: the copy's W_o.bias is 0, and its output torch's
    torch.manual_seed(0)
    seed = _seed_style(torch, 8, n_heads=2, o_bias=False)
    m = MultiHeadAttention.from_torch(seed)
    np.testing.assert_array_equal(m.state_dict()["W_o.bias"], np.zeros(8))
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    ref = torch.nn.MultiheadAttention(8, 2, batch_first=True, dtype=torch.float64)
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([seed.W_q.weight, seed.W_k.weight, seed.W_v.weight]))
        ref.in_proj_bias.copy_(torch.cat([seed.W_q.bias, seed.W_k.bias, seed.W_v.bias]))
        ref.out_proj.weight.copy_(seed.W_o.weight)
        ref.out_proj.bias.zero_()
        want = ref(x, x, x, need_weights=False)[0].numpy()
    np.testing.assert_allclose(m(x.numpy())[0], want, rtol=0, atol=1e-12)
