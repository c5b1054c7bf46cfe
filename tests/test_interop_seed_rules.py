"""mha_ext._interop (from_torch) and mha_ext.torch.MultiHeadAttention, the
seed-style torch class: the rules mutation testing of those files found no
test holding (a mutant of each passed the tests of those files before).
from_torch's names= taken over a torch-looking module, a path ending in a
star, the causal-buffer detection (a tril beyond one 256-row chunk, a
constant buffer and a 1x1 one not causal), a given dtype over the module's,
a dropout of None, torch's packed module with one of in_proj_bias and
out_proj.bias, out_proj preferred to o_proj, an empty head list, per-head
lists mixing biases, a bool head count and a zero head width; the torch
class's dtype refusal, its repr, its dropout setter, its initialisation (the
NumPy module's with that seed), value defaulting to key, array inputs
converted, need_weights=False and a mask that requires grad (docs/API.md
§4 from_torch, §3, §8).  The oracle is torch (torch.nn.MultiheadAttention,
or the seed module of tests/torch_seed.py).

Legend: B batch, S length, E width, H heads.
"""
import numpy as np
import pytest

from mha_ext import MultiHeadAttention
from _support import require_torch

torch = require_torch()
from torch import nn  # noqa: E402
from mha_ext.torch import MultiHeadAttention as TorchMHA  # noqa: E402
from torch_seed import make_seed_module  # noqa: E402

B, S, E, H = 2, 5, 8, 2
TOL = {torch.float32: 1e-5, torch.float64: 1e-10}


def _x(*shape, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype)


def _close(got, want, dtype=torch.float64):
    got = got.detach().numpy() if hasattr(got, "detach") else np.asarray(got)
    want = want.detach().numpy() if hasattr(want, "detach") else np.asarray(want)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL[dtype])


class _Heads(nn.Module):
    """Per-head attention: each head its q/k/v linears, outputs concatenated
    and projected by `proj`."""

    def __init__(self, n=H, bias=(True,) * H):
        super().__init__()
        dk = E // n
        self.qs = nn.ModuleList(nn.Linear(E, dk, bias=b) for b in bias)
        self.ks = nn.ModuleList(nn.Linear(E, dk, bias=b) for b in bias)
        self.vs = nn.ModuleList(nn.Linear(E, dk, bias=b) for b in bias)
        self.proj = nn.Linear(E, E)
        self.dk = dk

    def forward(self, x):
        outs = []
        for q, k, v in zip(self.qs, self.ks, self.vs):
            s = q(x) @ k(x).transpose(-2, -1) / self.dk ** 0.5
            outs.append(torch.softmax(s, -1) @ v(x))
        return self.proj(torch.cat(outs, -1))


_STAR = {"W_q": "qs.*", "W_k": "ks.*", "W_v": "vs.*", "W_o": "proj"}


# ---------------------------------------------------------------- names=

class _TorchLooking(nn.Module):
    """A seed-style module with torch's attribute names in_proj_weight and
    out_proj (its out projection), which names= must still read as given."""

    def __init__(self):
        super().__init__()
        seed = make_seed_module(E, H, seed=3, dtype="float64")
        self.a, self.b, self.c = seed.W_q, seed.W_k, seed.W_v
        self.out_proj = seed.W_o
        self.in_proj_weight = None
        self.n_heads = H
        self.seed = seed


def test_names_win_over_torch_looking_attributes():
    mod = _TorchLooking().double().eval()
    names = {"W_q": "a", "W_k": "b", "W_v": "c", "W_o": "out_proj"}
    m = MultiHeadAttention.from_torch(mod, names=names)
    x = _x(B, S, E)
    with torch.no_grad():
        want = mod.seed(x, x, x)[0]
    _close(m(x.numpy())[0], want)


def test_names_path_ending_in_a_star_takes_the_list_items():
    torch.manual_seed(0)
    mod = _Heads().double().eval()
    m = MultiHeadAttention.from_torch(mod, names=_STAR, n_heads=H)
    x = _x(B, S, E)
    with torch.no_grad():
        want = mod(x)
    _close(m(x.numpy())[0], want)


# ---------------------------------------------------------------- causal buffers

class _WithBuffer(nn.Module):
    def __init__(self, buf):
        super().__init__()
        seed = make_seed_module(E, H, seed=1)
        self.W_q, self.W_k, self.W_v, self.W_o = seed.W_q, seed.W_k, seed.W_v, seed.W_o
        self.n_heads = H
        self.register_buffer("tril", buf)


def test_a_causal_buffer_longer_than_one_chunk_is_found():
    # the detection reads the buffer in chunks of 256 rows: each chunk
    # compared against its own rows
    mod = _WithBuffer(torch.tril(torch.ones(300, 300)))
    with pytest.raises(ValueError, match="'tril' shaped as a causal mask"):
        MultiHeadAttention.from_torch(mod)
    assert MultiHeadAttention.from_torch(mod, causal=True).causal is True


def _heads_of(mod, x):
    # the seed notebook's attention on mod's projections, without its out projection
    q, k, v = (lin(x).view(B, S, H, E // H).transpose(1, 2) for lin in (mod.W_q, mod.W_k,
                                                                       mod.W_v))
    w = torch.softmax(q @ k.transpose(-2, -1) / (E // H) ** 0.5, -1)
    return (w @ v).transpose(1, 2).reshape(B, S, E)


@pytest.mark.parametrize("buf", [torch.ones(6, 6), torch.ones(1, 1), torch.zeros(3, 1, 1)],
                         ids=["constant", "1x1", "heads-of-1x1"])
def test_buffers_not_shaped_as_a_causal_mask_are_not_one(buf):
    mod = _WithBuffer(buf)
    m = MultiHeadAttention.from_torch(mod)
    assert m.causal is False
    x = _x(B, S, E, dtype=torch.float32)
    with torch.no_grad():
        want = mod.W_o(_heads_of(mod, x))
    _close(m(x.numpy())[0], want, torch.float32)


def test_a_causal_buffer_with_causal_true_is_taken_without_a_word():
    mod = _WithBuffer(torch.tril(torch.ones(S, S)))
    m = MultiHeadAttention.from_torch(mod, causal=True)
    assert m.causal is True


# ---------------------------------------------------------------- dtype, dropout

def test_a_given_dtype_wins_over_the_modules():
    mod = make_seed_module(E, H, seed=2, dtype="float64")
    m = MultiHeadAttention.from_torch(mod, dtype="float32")
    assert m.dtype == np.float32
    x = _x(B, S, E)
    with torch.no_grad():
        want = mod(x, x, x)[0]
    np.testing.assert_allclose(m(x.numpy().astype(np.float32))[0], want.numpy(), atol=1e-5)


def test_a_float64_module_gives_a_float64_copy():
    mod = make_seed_module(E, H, seed=2, dtype="float64")
    assert MultiHeadAttention.from_torch(mod).dtype == np.float64


def test_a_dropout_attribute_of_none_is_no_dropout():
    mod = make_seed_module(E, H, seed=2)
    mod.dropout = None
    m = MultiHeadAttention.from_torch(mod)
    assert m.dropout == 0.0


def test_a_seed_module_in_eval_mode_gives_a_copy_without_dropout():
    mod = make_seed_module(E, H, dropout=0.5, seed=2, dtype="float64")  # eval mode
    m = MultiHeadAttention.from_torch(mod)
    assert m.training is False
    x = _x(B, S, E)
    with torch.no_grad():
        want = mod(x, x, x)[0]
    _close(m(x.numpy())[0], want)


# ---------------------------------------------------------------- torch's module

@pytest.mark.parametrize("kind", ["torch", "seed"])
def test_a_module_on_the_meta_device_says_materialise_it(kind):
    with torch.device("meta"):
        mod = (nn.MultiheadAttention(E, H, batch_first=True) if kind == "torch"
               else make_seed_module(E, H))
    with pytest.raises(ValueError, match="meta device.*materialise them first"):
        MultiHeadAttention.from_torch(mod)


@pytest.mark.parametrize("drop", ["out_proj.bias", "in_proj_bias"])
def test_torch_mha_with_one_of_its_two_biases(drop):
    torch.manual_seed(0)
    t = nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64).eval()
    with torch.no_grad():
        t.in_proj_bias.uniform_(-0.5, 0.5)
        t.out_proj.bias.uniform_(-0.5, 0.5)
    if drop == "out_proj.bias":
        t.out_proj.bias = None
    else:
        t.in_proj_bias = None
    x = _x(B, S, E)
    with torch.no_grad():
        # key a copy of the query: torch's unfused path (its fused one needs both biases)
        want = t(x, x.clone(), x.clone(), average_attn_weights=False)[0]
    m = MultiHeadAttention.from_torch(t)
    _close(m(x.numpy())[0], want)


# ---------------------------------------------------------------- seed-style layouts

class _BothOuts(nn.Module):
    """q_proj/k_proj/v_proj with out_proj (the output projection) and an
    unrelated o_proj: out_proj comes first."""

    def __init__(self):
        super().__init__()
        seed = make_seed_module(E, H, seed=4, dtype="float64")
        self.q_proj, self.k_proj, self.v_proj = seed.W_q, seed.W_k, seed.W_v
        self.out_proj = seed.W_o
        self.o_proj = nn.Linear(E, E).double()
        self.num_heads = H
        self.seed = seed


def test_out_proj_comes_before_o_proj():
    mod = _BothOuts().eval()
    x = _x(B, S, E)
    with torch.no_grad():
        want = mod.seed(x, x, x)[0]
    _close(MultiHeadAttention.from_torch(mod)(x.numpy())[0], want)


class _EmptyHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleList()
        self.proj = nn.Linear(E, E)


class _HeadsNoOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleList(_OneHead() for _ in range(H))


class _OneHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.query, self.key, self.value = (nn.Linear(E, E // H) for _ in range(3))


@pytest.mark.parametrize("cls", [_EmptyHeads, _HeadsNoOut])
def test_head_lists_without_heads_or_out_projection_ask_for_names(cls):
    with pytest.raises(TypeError, match="from_torch expects.*pass names="):
        MultiHeadAttention.from_torch(cls())


class _HalfListed(nn.Module):
    """W_q a per-head list, W_k and W_v plain linears: no layout."""

    def __init__(self):
        super().__init__()
        self.W_q = nn.ModuleList(nn.Linear(E, E // H) for _ in range(H))
        self.W_k, self.W_v, self.W_o = (nn.Linear(E, E) for _ in range(3))


def test_a_layout_half_in_per_head_lists_asks_for_names():
    with pytest.raises(TypeError, match="from_torch expects.*pass names="):
        MultiHeadAttention.from_torch(_HalfListed())


class _Numbered(nn.Module):
    """Projections as children named "0".."3" of a plain module (not a list:
    no indexing), as add_module names them."""

    def __init__(self):
        super().__init__()
        seed = make_seed_module(E, H, seed=6, dtype="float64")
        self.blocks = nn.Module()
        for i, lin in enumerate((seed.W_q, seed.W_k, seed.W_v, seed.W_o)):
            self.blocks.add_module(str(i), lin)
        self.seed = seed


def test_names_read_numbered_attributes_of_a_plain_module():
    mod = _Numbered().eval()
    names = {n: f"blocks.{i}" for i, n in enumerate(("W_q", "W_k", "W_v", "W_o"))}
    m = MultiHeadAttention.from_torch(mod, names=names, n_heads=H)
    x = _x(B, S, E)
    with torch.no_grad():
        want = mod.seed(x, x, x)[0]
    _close(m(x.numpy())[0], want)


def test_per_head_lists_mixing_biases_are_refused():
    mod = _Heads(bias=(True, False))
    with pytest.raises(ValueError, match="some heads of W_q have a bias and some not"):
        MultiHeadAttention.from_torch(mod, names=_STAR, n_heads=H)


class _Counted(nn.Module):
    def __init__(self, **attrs):
        super().__init__()
        seed = make_seed_module(E, 4, seed=5, dtype="float64")
        self.W_q, self.W_k, self.W_v, self.W_o = seed.W_q, seed.W_k, seed.W_v, seed.W_o
        self.seed = seed
        for k, v in attrs.items():
            setattr(self, k, v)


def test_a_bool_head_count_is_not_a_count():
    # `h = True` (a flag) is skipped; the head width d_k gives the count
    mod = _Counted(h=True, d_k=2).eval()
    x = _x(B, S, E)
    with torch.no_grad():
        want = mod.seed(x, x, x)[0]
    m = MultiHeadAttention.from_torch(mod)
    assert m.n_heads == 4
    _close(m(x.numpy())[0], want)


@pytest.mark.parametrize("ev", [E, E // H])
def test_a_key_and_value_of_other_widths_are_not_grouped_query(ev):
    # W_k to E features, W_v to ev: grouped-query needs both n_kv_heads * d_k
    mod = _Counted(n_heads=H)
    mod.W_k, mod.W_v = nn.Linear(E, E // H if ev == E else E), nn.Linear(E, ev)
    with pytest.raises(ValueError, match="n_kv_heads dividing 2"):
        MultiHeadAttention.from_torch(mod)


def test_a_zero_head_width_asks_for_n_heads():
    with pytest.raises(ValueError, match="pass n_heads="):
        MultiHeadAttention.from_torch(_Counted(d_k=0))


# ---------------------------------------------------------------- the torch class

def test_torch_class_refuses_other_torch_dtypes():
    with pytest.raises(ValueError, match="dtype must be torch.float32 or torch.float64"):
        TorchMHA(E, H, dtype=torch.float16)


def test_torch_class_starts_from_the_numpy_modules_initialisation():
    a = TorchMHA(E, H, seed=7, dtype=torch.float64, kdim=6, vdim=4)
    b = MultiHeadAttention(E, H, seed=7, dtype="float64", kdim=6, vdim=4)
    got = a.state_dict()
    for k, v in b.state_dict().items():
        assert got[k].dtype == torch.float64
        np.testing.assert_array_equal(got[k].numpy(), v)


@pytest.mark.parametrize("kw,text", [
    ({}, "d_model=8, n_heads=2, dropout=0.0"),
    ({"vdim": 4}, "d_model=8, n_heads=2, dropout=0.0, vdim=4"),
    ({"kdim": 6}, "d_model=8, n_heads=2, dropout=0.0, kdim=6"),
    ({"n_kv_heads": 1}, "d_model=8, n_heads=2, dropout=0.0, n_kv_heads=1"),
])
def test_torch_class_repr_shows_what_differs_from_the_defaults(kw, text):
    assert TorchMHA(E, H, seed=0, **kw).extra_repr() == text


def _seed_twin(a):
    # the seed module holding a's parameters
    t = make_seed_module(E, H, dtype="float64")
    t.load_state_dict(a.state_dict())
    return t


def test_torch_class_dropout_setter_reaches_the_calls():
    a = TorchMHA(E, H, seed=0, dtype=torch.float64)
    a.dropout = 0.5
    assert a.dropout == 0.5
    x = _x(B, S, E)
    torch.manual_seed(0)
    out = a(x)[0]
    a.eval()  # no dropout in eval mode: the seed module's numbers
    with torch.no_grad():
        want = _seed_twin(a)(x, x, x)[0]
    _close(a(x)[0], want)
    assert (out - want).abs().max() > 1e-3  # dropout applied in training


def test_torch_class_value_defaults_to_key():
    a = TorchMHA(E, H, seed=1, dtype=torch.float64)
    q, k = _x(B, S, E, seed=1), _x(B, S + 1, E, seed=2)
    with torch.no_grad():
        want = _seed_twin(a)(q, k, k)
    out, w = a(q, k)
    _close(out, want[0])
    _close(w, want[1])


def test_torch_class_converts_arrays_to_its_dtype():
    a = TorchMHA(E, H, seed=1, dtype=torch.float64)
    x = _x(B, S, E)
    with torch.no_grad():
        want = _seed_twin(a)(x, x, x)[0]
    out = a(x.numpy().astype(np.float32))[0]
    assert out.dtype == torch.float64
    x32 = x.float().double()
    with torch.no_grad():
        want = _seed_twin(a)(x32, x32, x32)[0]
    _close(out, want)


def test_torch_class_need_weights_false_gives_none():
    a = TorchMHA(E, H, seed=1, dtype=torch.float64).eval()
    x = _x(B, S, E)
    out, w = a(x, need_weights=False)
    assert w is None
    with torch.no_grad():
        _close(out, _seed_twin(a)(x, x, x)[0])


def test_torch_class_refuses_a_blocking_mask_that_requires_grad():
    a = TorchMHA(E, H, seed=1, dtype=torch.float64)
    x = _x(B, S, E)
    mask = torch.zeros(S, S, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError, match="mask"):
        a(x, mask=mask)


def test_torch_class_refuses_a_tensor_of_another_dtype_as_torch_does():
    a = TorchMHA(E, H, seed=1)  # float32
    x = _x(B, S, E)  # float64
    with pytest.raises(RuntimeError):  # the seed module's nn.Linear: a RuntimeError
        _seed_twin(a).float()(x, x, x)
    with pytest.raises(RuntimeError, match="query is torch.float64 but the parameters"):
        a(x)
    with pytest.raises(TypeError):
        a(x)
