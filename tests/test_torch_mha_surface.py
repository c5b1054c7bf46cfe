"""mha_ext.torch.MultiheadAttention's surface against torch.nn.MultiheadAttention:
constructor, attributes, parameters and their initialisation, state_dict
keys both ways, forward's defaults, layouts, masks, the is_causal hint, the
rows that see no key on each of torch's paths, errors, copies.

Legend: B batch, L query length, S key length, E = embed_dim, H = num_heads.
"""
import copy
import inspect
import pickle
import warnings

import pytest

from _support import require_torch

torch = require_torch()
from torch import nn  # noqa: E402

import mha_ext.torch as mt  # noqa: E402
from mha_ext.torch import MultiheadAttention  # noqa: E402

E, H, B, L, S = 8, 2, 3, 4, 5
TOL = {torch.float32: 2e-5, torch.float64: 1e-10}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)


def pair(dtype=torch.float64, seed=0, heads=H, **kw):
    """(stock, ours) with the same random parameters and non-zero biases."""
    torch.manual_seed(seed)
    t = nn.MultiheadAttention(E, heads, dtype=dtype, **kw)
    with torch.no_grad():
        for n, p in t.named_parameters():
            if "bias" in n:
                p.uniform_(-0.5, 0.5)
    return t, MultiheadAttention.from_torch(t)


def close(a, b, dtype):
    if a is None or b is None:
        assert a is None and b is None
        return
    a, b = a.detach(), b.detach()
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(torch.isnan(a), torch.isnan(b)), "NaN in different places"
    ok = ~torch.isnan(a)
    if ok.any():
        assert float((a[ok] - b[ok]).abs().max()) <= TOL[dtype]


def call_both(t, m, *args, dtype=torch.float64, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = t(*args, **kw)
        b = m(*args, **kw)
    close(a[0], b[0], dtype)
    close(a[1], b[1], dtype)
    return a, b


def x(*shape, dtype=torch.float64, seed=1):
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- construction

def test_constructor_signature_is_torchs():
    ours = inspect.signature(MultiheadAttention.__init__)
    theirs = inspect.signature(nn.MultiheadAttention.__init__)
    assert [(p.name, p.default) for p in ours.parameters.values()] == \
        [(p.name, p.default) for p in theirs.parameters.values()]
    ours = inspect.signature(MultiheadAttention.forward)
    theirs = inspect.signature(nn.MultiheadAttention.forward)
    # torch's parameters in torch's order and kinds; after them only keywords
    # of ours (issue 14: window=, layout=), keyword-only and None by default,
    # so that every torch call binds exactly as on torch's class
    n = len(theirs.parameters)
    mine = [(p.name, p.default, p.kind) for p in ours.parameters.values()]
    assert mine[:n] == [(p.name, p.default, p.kind) for p in theirs.parameters.values()]
    assert [(name, d, k) for name, d, k in mine[n:]] == \
        [("window", None, inspect.Parameter.KEYWORD_ONLY),
         ("layout", None, inspect.Parameter.KEYWORD_ONLY)]


@pytest.mark.parametrize("kw", [{}, dict(kdim=3, vdim=5), dict(bias=False),
                                dict(batch_first=True, dropout=0.25),
                                dict(add_bias_kv=True), dict(add_zero_attn=True),
                                dict(kdim=3, vdim=5, bias=False, add_bias_kv=True,
                                     add_zero_attn=True)])
def test_attributes_parameters_and_keys_match(kw):
    torch.manual_seed(0)
    t = nn.MultiheadAttention(E, H, **kw)
    torch.manual_seed(0)
    m = MultiheadAttention(E, H, **kw)
    for a in ("embed_dim", "kdim", "vdim", "num_heads", "head_dim", "dropout", "batch_first",
              "_qkv_same_embed_dim", "add_zero_attn", "training"):
        assert getattr(m, a) == getattr(t, a), a
    for a in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight",
              "in_proj_bias", "bias_k", "bias_v"):
        assert (getattr(m, a) is None) == (getattr(t, a) is None), a
    assert [n for n, _ in m.named_parameters()] == [n for n, _ in t.named_parameters()]
    for n, p in t.named_parameters():
        assert dict(m.named_parameters())[n].shape == p.shape, n
    assert isinstance(m.out_proj, nn.modules.linear.NonDynamicallyQuantizableLinear)
    assert list(m.state_dict()) == list(t.state_dict())
    # the same initialisation: xavier_uniform_ in the same order, zero biases,
    # xavier_normal_ bias_k and bias_v
    for (n, a), b in zip(t.state_dict().items(), m.state_dict().values()):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("kw", [{}, dict(kdim=3, vdim=5, bias=False),
                                dict(add_bias_kv=True, add_zero_attn=True),
                                dict(kdim=3, vdim=5, bias=False, add_bias_kv=True)])
def test_state_dict_both_ways(kw):
    t, _ = pair(**kw)
    m = MultiheadAttention(E, H, dtype=torch.float64, **kw)
    m.load_state_dict(t.state_dict())
    t2 = nn.MultiheadAttention(E, H, dtype=torch.float64, **kw)
    t2.load_state_dict(m.state_dict())
    q = x(L, B, E)
    k, v = x(S, B, t.kdim, seed=2), x(S, B, t.vdim, seed=3)
    call_both(t, m, q, k, v)
    call_both(t2, m, q, k, v)


def test_state_dict_without_bias_kv_refused_by_a_module_with_it():
    # torch's strict load_state_dict: a key missing or unexpected either way
    plain = nn.MultiheadAttention(E, H).state_dict()
    with pytest.raises(RuntimeError, match="bias_k"):
        MultiheadAttention(E, H, add_bias_kv=True).load_state_dict(plain)
    with pytest.raises(RuntimeError, match="bias_k"):
        MultiheadAttention(E, H).load_state_dict(
            nn.MultiheadAttention(E, H, add_bias_kv=True).state_dict())


@pytest.mark.parametrize("args,exc,word", [((8, 3), ValueError, "divisible"),
                                           ((0, 2), ValueError, "embed_dim"),
                                           ((8, -1), ValueError, "num_heads"),
                                           ((8.0, 2), TypeError, "embed_dim")])
def test_bad_constructor_arguments(args, exc, word):
    with pytest.raises(exc, match=word):
        MultiheadAttention(*args)


def test_copies_and_pickle():
    t, m = pair()
    q = x(L, B, E)
    for c in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        call_both(t, c, q, q, q)


# ---------------------------------------------------------------- forward

@DTYPES
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("need_weights,average", [(True, True), (True, False), (False, True)])
def test_forward_layouts_and_weights(dtype, batch_first, need_weights, average):
    t, m = pair(dtype, batch_first=batch_first)
    shape = (B, L, E) if batch_first else (L, B, E)
    kshape = (B, S, E) if batch_first else (S, B, E)
    q, k, v = x(*shape, dtype=dtype), x(*kshape, dtype=dtype, seed=2), \
        x(*kshape, dtype=dtype, seed=3)
    (out, w), _ = call_both(t, m, q, k, v, need_weights=need_weights,
                            average_attn_weights=average, dtype=dtype)
    assert out.shape == shape


@DTYPES
def test_unbatched(dtype):
    t, m = pair(dtype)
    q, k = x(L, E, dtype=dtype), x(S, E, dtype=dtype, seed=2)
    am = torch.rand(H, L, S, generator=torch.Generator().manual_seed(4)) < 0.3
    kpm = torch.tensor([False, True, False, False, True])
    call_both(t, m, q, k, k, key_padding_mask=kpm, attn_mask=am, dtype=dtype,
              average_attn_weights=False)


@DTYPES
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_masks(dtype, kind):
    t, m = pair(dtype)
    g = torch.Generator().manual_seed(5)
    q, k = x(L, B, E, dtype=dtype), x(S, B, E, dtype=dtype, seed=2)
    am3 = torch.rand(B * H, L, S, generator=g) < 0.3
    am3[..., 0] = False
    kpm = torch.rand(B, S, generator=g) < 0.3
    kpm[:, 1] = False
    if kind == "float":
        am3 = torch.zeros(am3.shape, dtype=dtype).masked_fill(am3, float("-inf")) \
            + torch.rand(am3.shape, generator=g, dtype=dtype)
        kpm = torch.zeros(kpm.shape, dtype=dtype).masked_fill(kpm, float("-inf"))
    for kw in (dict(attn_mask=am3), dict(key_padding_mask=kpm), dict(attn_mask=am3[0]),
               dict(attn_mask=am3, key_padding_mask=kpm)):
        for nw in (True, False):
            call_both(t, m, q, k, k, need_weights=nw, dtype=dtype, **kw)


def test_is_causal_is_torchs_hint():
    t, m = pair()
    q = x(L, B, E)
    with pytest.raises(RuntimeError, match="Need attn_mask"):
        m(q, q, q, is_causal=True)
    # a hint: with need_weights=False and no padding mask torch applies the
    # causal pattern whatever attn_mask holds; otherwise it uses the mask
    wrong = torch.zeros(L, L, dtype=torch.bool)
    for nw in (False, True):
        (a, _), (b, _) = call_both(t, m, q, q.clone(), q.clone(), attn_mask=wrong,
                                   is_causal=True, need_weights=nw)
    causal = nn.Transformer.generate_square_subsequent_mask(L, dtype=torch.float64)
    ref, _ = m(q, q.clone(), q.clone(), attn_mask=causal)
    hinted, _ = m(q, q.clone(), q.clone(), attn_mask=wrong, is_causal=True, need_weights=False)
    close(ref, hinted, torch.float64)


@pytest.mark.parametrize("mask_dtype", [torch.uint8, torch.int64], ids=str)
def test_is_causal_hint_still_checks_the_mask_dtype(mask_dtype):
    # the hint drops attn_mask (need_weights=False, no padding mask), but
    # torch checks its dtype first (only bool and float masks): an integer
    # mask is refused on that path too, not silently dropped
    t, m = pair()
    q = x(L, B, E)
    mask = torch.ones(L, L, dtype=mask_dtype).triu(1)
    with pytest.raises(AssertionError, match="only bool and floating"):
        t(q, q, q, attn_mask=mask, is_causal=True, need_weights=False)
    with pytest.raises(TypeError, match="attn_mask must be bool .* or float") as got:
        m(q, q, q, attn_mask=mask, is_causal=True, need_weights=False)
    assert isinstance(got.value, AssertionError)          # torch's type too
    assert "only bool and floating" in str(got.value)


def test_is_causal_without_a_mask_is_refused_on_the_fast_path_too():
    # torch's fused path (eval, no grad, batch-first self-attention) ignores
    # the hint without attn_mask and returns the non-causal result; ours
    # raises torch's error there as on its other paths (README's table)
    t, m = pair(batch_first=True)
    t.eval()
    m.eval()
    q = x(B, L, E)
    with torch.no_grad(), pytest.raises(RuntimeError, match="Need attn_mask"):
        m(q, q, q, is_causal=True, need_weights=False)


@pytest.mark.parametrize("lq, lk", [(L, S), (S, L), (L, L)], ids=["L<S", "L>S", "L=S"])
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("masks", ["none", "padding", "additive"])
def test_is_causal_lower_right_is_the_pattern_on_every_path(lq, lk, need_weights, masks):
    # torch's module takes a bool only; ours takes "lower_right" as in every
    # API of mha_ext: the pattern itself (no hint), with any masks given.
    # torch with the same pattern as a bool mask is the reference: a
    # top-left reading of the string (what a truthy hint would give) fails
    # at L != S, and rows that see no key (L > S) follow torch's path
    t, m = pair(batch_first=True)
    q, kv = x(B, lq, E), x(B, lk, E, seed=2)
    if lq == lk:  # self-attention: torch's fused path in eval without grad
        kv = q
    blocked = torch.ones(lq, lk, dtype=torch.bool).triu(1 + lk - lq)
    kw = {}
    if masks == "padding":
        kw["key_padding_mask"] = torch.zeros(B, lk, dtype=torch.bool)
        kw["key_padding_mask"][1, -1] = True
    ref_mask = blocked
    if masks == "additive":
        kw["attn_mask"] = x(lq, lk, seed=3)
        ref_mask = kw["attn_mask"].masked_fill(blocked, float("-inf"))
    t.eval()
    m.eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = t(q, kv, kv, need_weights=need_weights, **dict(kw, attn_mask=ref_mask))
        b = m(q, kv, kv, need_weights=need_weights, is_causal="lower_right", **kw)
    close(a[0], b[0], torch.float64)
    close(a[1], b[1], torch.float64)
    with pytest.raises(TypeError, match="lower_right"):
        m(q, kv, kv, is_causal="upper_left")


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("self_attention", [True, False])
def test_rows_that_see_no_key_follow_torchs_path(training, need_weights, grad,
                                                 self_attention):
    # torch: NaN on the weights path and on the fused path (eval, no grad,
    # batch-first self-attention), out_proj.bias on the SDPA path
    t, m = pair(batch_first=True)
    t.train(training)
    m.train(training)
    q = x(B, S, E)
    k = q if self_attention else q.clone()
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[1] = True
    with torch.set_grad_enabled(grad):
        (a, _), (b, _) = call_both(t, m, q, k, k, key_padding_mask=kpm,
                                   need_weights=need_weights)
    fused = not training and not grad and self_attention
    assert torch.isnan(b[1]).all() == (need_weights or fused)


def test_gradients_reach_every_parameter():
    t, m = pair(kdim=3, vdim=5)
    q, k, v = x(B, L, E).transpose(0, 1), x(S, B, 3, seed=2), x(S, B, 5, seed=3)
    for mod in (t, m):
        out, w = mod(q, k, v)
        (out.square().sum() + w.sum()).backward()
    for (n, a), b in zip(t.named_parameters(), m.parameters()):
        close(a.grad, b.grad, torch.float64)


def test_double_backward_raises():
    _, m = pair()
    q = x(L, B, E).requires_grad_()
    out, _ = m(q, q, q, need_weights=False)
    g, = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        g.sum().backward()
    # and through the older adapter too
    a = mt.MultiHeadAttention(E, H, dtype=torch.float64, seed=0)
    out, _ = a(q.detach().transpose(0, 1).requires_grad_())
    p = next(a.parameters())
    g, = torch.autograd.grad(out.square().sum(), p, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        torch.autograd.grad(g.sum(), p)
    # a frozen module and input: the head mask alone requires grad (it came
    # back as a constant, and the second-order term was silently lost)
    a.requires_grad_(False)
    hm = torch.tensor([0.5, 1.5], dtype=torch.float64, requires_grad=True)  # (H,)
    out, _ = a(q.detach().transpose(0, 1), head_mask=hm)
    g, = torch.autograd.grad(out.square().sum(), hm, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        (g.square().sum() + hm.sum()).backward()


@pytest.mark.parametrize("bad,exc,word", [("cuda", ValueError, "CPU"),
                                          (torch.complex64, TypeError, "float32 or float64")])
def test_refuses_what_it_cannot_compute(bad, exc, word):
    m = MultiheadAttention(E, H)
    q = x(L, B, E, dtype=torch.float32)
    if bad == "cuda":  # (no CUDA here) a query on another device than the parameters
        q = q.to("meta")
        word = "mha_ext computes CPU tensors"
    else:
        m = m.to(bad)
    with pytest.raises(exc, match=word):
        m(q, q, q)


# ------------------------------------------- README "Differences from torch", rows
# where torch 2.13 raises or its paths disagree (found by a differential fuzz)

@pytest.mark.parametrize("need_weights", [True, False])
def test_a_float_mask_of_another_dtype_is_taken_in_the_modules(need_weights):
    # torch: the weights path raises, its SDPA path may compute other
    # numbers (0.27 off at this shape: head width 3, L 30, S 21); ours: the
    # mask's values in the module's dtype, on every path
    torch.manual_seed(0)
    t = nn.MultiheadAttention(12, 4, dtype=torch.float64)
    m = MultiheadAttention.from_torch(t)
    q, k = x(30, 2, 12), x(21, 2, 12, seed=2)
    kpm = x(2, 21, dtype=torch.float32, seed=3) * 5
    want, _ = t(q, k, k, key_padding_mask=kpm.double(), need_weights=True)
    got, _ = m(q, k, k, key_padding_mask=kpm, need_weights=need_weights)
    close(want, got, torch.float64)
    if need_weights:
        with pytest.raises(RuntimeError, match="dtypes must be the same"):
            t(q, k, k, key_padding_mask=kpm, need_weights=True)


def test_inputs_of_another_dtype_are_refused_as_torch_refuses_them():
    # they were computed in the parameters' dtype (a float64 query gave
    # float32 numbers); torch raises, and so do we, with its type too
    t, m = pair(dtype=torch.float32)
    q = x(L, B, E)  # float64
    with pytest.raises(RuntimeError, match="same dtype"):
        t(q, q, q)  # (mat1 and mat2 must have the same dtype)
    with pytest.raises(RuntimeError, match="float64 but the parameters are torch.float32"):
        m(q, q, q)
    got, w = m(q.float(), q.float(), q.float())
    assert got.dtype == w.dtype == torch.float32


@pytest.mark.parametrize("mask", ["key_padding_mask", "attn_mask"])
@pytest.mark.parametrize("empty", ["batch", "keys"])
def test_empty_batch_or_keys_with_a_mask_without_weights(empty, mask):
    t, m = pair(batch_first=True)
    b, s = (0, S) if empty == "batch" else (B, 0)
    q, k = x(b, L, E), x(b, s, E, seed=2)
    kw = ({"key_padding_mask": torch.zeros(b, s, dtype=torch.bool)} if mask == "key_padding_mask"
          else {"attn_mask": torch.zeros(b * H, L, s, dtype=torch.bool)})  # 3-D
    with pytest.raises(RuntimeError, match="0 elements"):
        t(q, k, k, need_weights=False, **kw)
    got, _ = m(q, k, k, need_weights=False, **kw)
    assert got.shape == (b, L, E)
    if empty == "keys":  # the context is an empty sum: out_proj.bias
        close(got, m.out_proj.bias.expand(B, L, E), torch.float64)


def test_swapped_encoder_layer_adds_a_finite_float_mask():
    # torch's fused encoder-layer kernel (eval, no grad) blocks every
    # non-zero entry of a float src_mask; its other path adds it, as ours
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=16, dropout=0.0,
                                       batch_first=True).eval()
    src = x(1, 3, E, dtype=torch.float32)
    mask = torch.tensor([[0.0, 0.5, -1.0], [0.3, 0.0, 0.2], [-0.7, 0.4, 0.0]])
    with torch.no_grad():
        fused = layer(src, src_mask=mask)
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            plain = layer(src, src_mask=mask)
        finally:
            torch.backends.mha.set_fastpath_enabled(True)
        with mt.swapped(layer):
            ours = layer(src, src_mask=mask)
    assert float((fused - plain).abs().max()) > 1e-2  # torch's two paths disagree
    close(plain, ours, torch.float32)


@DTYPES
@pytest.mark.parametrize("how", ["key_padding_mask", "attn_mask"])
def test_a_nan_key_that_a_bool_mask_blocks_is_left_out(dtype, how):
    """A NaN in a key whose position a bool mask blocks: the mask replaces
    the score (masked_fill), so the rows are those of any finite key there;
    torch 2.13 adds its bool masks as -inf (NaN + -inf: NaN rows).  A float
    mask's -inf is added by both: NaN rows alike (README's differences)."""
    t, m = pair(dtype, batch_first=True)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, S, E, generator=g, dtype=dtype)
    k = x.clone()
    k[1, 3] = float("nan")
    finite = x.clone()
    finite[1, 3] = 1e3                                  # any finite key: blocked anyway
    kw = {"key_padding_mask": torch.arange(S).expand(B, S) == 3} if how == "key_padding_mask" \
        else {"attn_mask": (torch.arange(S) == 3).expand(S, S)}
    with torch.no_grad():
        got = m(x, k, x, **kw)
        want = t(x, finite, x, **kw)
        stock = t(x, k, x, **kw)
    close(got[0], want[0], dtype)
    close(got[1], want[1], dtype)
    assert torch.isfinite(got[0]).all() and torch.isnan(stock[0][1]).all()
    add = torch.zeros(S, S, dtype=dtype)
    add[:, 3] = float("-inf")
    with torch.no_grad():
        got, want = m(x, k, x, attn_mask=add)[0], t(x, k, x, attn_mask=add)[0]
    assert torch.isnan(got[1]).all() and torch.isnan(want[1]).all()
    close(got[0], want[0], dtype)


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("batch_first", [False, True])
def test_half_modules_compute_in_float32_and_round_back(half, batch_first):
    """A float16 / bfloat16 module (torch computes in that dtype): ours is
    the float32 computation on the same (exact) values, rounded back once,
    output, weights and every gradient, so within a rounding of the float32
    module's results; and close to torch's own half module."""
    t, _ = pair(torch.float32, batch_first=batch_first)
    t = t.to(half)
    m = MultiheadAttention.from_torch(t)
    assert m.in_proj_weight.dtype == half
    t32 = copy.deepcopy(t).float()                     # the same values, exactly
    shape = (B, L, E) if batch_first else (L, B, E)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=g).to(half)
    kpm = torch.zeros(B, L, dtype=torch.bool)
    kpm[1, -1] = True
    xh, x32 = x.clone().requires_grad_(), x.float().requires_grad_()
    out, w = m(xh, xh, xh, key_padding_mask=kpm)
    ref, rw = t32(x32, x32, x32, key_padding_mask=kpm)
    assert out.dtype == w.dtype == half
    eps = torch.finfo(half).eps
    tol = dict(rtol=eps, atol=eps * 1e-2)
    torch.testing.assert_close(out, ref.to(half), **tol)
    torch.testing.assert_close(w, rw.to(half), **tol)
    (out.float() * torch.arange(out.numel()).reshape(out.shape) / out.numel()).sum().backward()
    (ref * torch.arange(ref.numel()).reshape(ref.shape) / ref.numel()).sum().backward()
    assert xh.grad.dtype == half and m.in_proj_weight.grad.dtype == half
    for a, b in ((xh.grad, x32.grad), (m.in_proj_weight.grad, t32.in_proj_weight.grad),
                 (m.out_proj.weight.grad, t32.out_proj.weight.grad)):
        torch.testing.assert_close(a.float(), b, rtol=4 * eps, atol=4 * eps * b.abs().max().item())
    with torch.no_grad():                              # torch's own half module: close
        theirs = t(x, x, x, key_padding_mask=kpm)[0]
    torch.testing.assert_close(out.detach(), theirs, rtol=8 * eps, atol=8 * eps)


def _mismatch_warnings(fn):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(x.message) for x in w if "mismatched key_padding_mask" in str(x.message)]


@pytest.mark.parametrize("kpm_dtype, mask_dtype", [
    (torch.float32, torch.bool), (torch.bool, torch.float32),
    (torch.bool, torch.bool), (torch.float32, torch.float32), (torch.int64, torch.bool),
    (torch.bool, torch.uint8)], ids=str)
@pytest.mark.parametrize("how", ["module", "functional"])
def test_masks_of_mismatched_dtypes_warn_as_torch_warns(kpm_dtype, mask_dtype, how):
    # torch's _canonical_mask: "Support for mismatched key_padding_mask and
    # attn_mask is deprecated", from the module and from the functional
    t, d = pair(torch.float32)
    x = torch.randn(L, B, E)
    g = torch.Generator().manual_seed(1)
    am = torch.rand(L, L, generator=g) > 0.7
    kpm = torch.rand(B, L, generator=g) > 0.7
    am = am if mask_dtype == torch.bool else torch.zeros(L, L, dtype=mask_dtype).masked_fill(
        am, float("-inf") if mask_dtype.is_floating_point else 1)
    kpm = kpm if kpm_dtype == torch.bool else torch.zeros(B, L, dtype=kpm_dtype).masked_fill(
        kpm, -1.5 if kpm_dtype.is_floating_point else 1)
    F = torch.nn.functional
    args = lambda: (x, x, x, E, H, t.in_proj_weight, t.in_proj_bias, None, None,  # noqa: E731
                    False, 0.0, t.out_proj.weight, t.out_proj.bias)
    runs = {"module": (lambda: t(x, x, x, attn_mask=am, key_padding_mask=kpm),
                       lambda: d(x, x, x, attn_mask=am, key_padding_mask=kpm)),
            "functional": (lambda: F.multi_head_attention_forward(
                               *args(), key_padding_mask=kpm, attn_mask=am),
                           lambda: mt.multi_head_attention_forward(
                               *args(), key_padding_mask=kpm, attn_mask=am))}[how]
    if torch.int64 in (kpm_dtype, mask_dtype) or torch.uint8 in (kpm_dtype, mask_dtype):
        # torch refuses an integer mask (AssertionError), warning first only
        # when key_padding_mask is bool or float (it checks that one first)
        warned = []
        for f in runs:
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                with pytest.raises(AssertionError):
                    f()
            warned.append(any("mismatched" in str(x.message) for x in w))
        assert warned[0] == warned[1] == (kpm_dtype == torch.bool)
        return
    (want, want_w), (got, got_w) = (_mismatch_warnings(f) for f in runs)
    assert bool(got_w) == bool(want_w) == (kpm_dtype != mask_dtype)
    close(got[0], want[0], torch.float32)


@pytest.mark.parametrize("shape", [(0, 3), (2, 0)], ids=["no batch", "no query"])
def test_an_empty_query_on_torchs_fused_path_gives_no_weights_as_torch(shape):
    # torch's fused path (eval, no grad, batch_first self-attention) returns
    # None for the weights of an empty query, whatever need_weights says;
    # the same call with a cross-attention key (its unfused path) returns them
    t, d = pair(torch.float32, batch_first=True)
    t.eval(), d.eval()
    x = torch.randn(*shape, E)
    y = torch.randn(shape[0], 2, E)
    with torch.no_grad():
        for kw in ({}, {"average_attn_weights": False}):
            want, got = t(x, x, x, **kw), d(x, x, x, **kw)
            assert want[1] is None and got[1] is None
            assert got[0].shape == want[0].shape
            want, got = t(x, y, y, **kw), d(x, y, y, **kw)
            assert want[1] is not None and got[1] is not None
            assert got[1].shape == want[1].shape


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("mode", ["train", "eval", "eval no grad"])
def test_the_output_is_laid_out_in_memory_as_torchs(batch_first, mode):
    # torch's unfused path returns (L, B, E) memory (batch_first: its
    # transpose), its fused path (eval, no grad, batch_first) a contiguous
    # (B, L, E): code after the attention sees the same strides, so a
    # .view works where it works with torch's, and a dropout drawing over
    # empty_like(out) (torchvision's ViT, nn.TransformerEncoderLayer's
    # dropout1) draws the same mask after torch.manual_seed (it drew
    # another: outputs 0.43 off)
    t, d = pair(torch.float32, batch_first=batch_first)
    t.train(mode == "train"), d.train(mode == "train")
    t.dropout = d.dropout = 0.0
    x = torch.randn((B, L, E) if batch_first else (L, B, E))
    drop = nn.Dropout(0.5)
    with torch.set_grad_enabled(mode != "eval no grad"):
        outs = []
        for m in (t, d):
            out = m(x, x, x)[0]
            torch.manual_seed(7)
            outs.append((out, drop(out)))
    (want, want_drop), (got, got_drop) = outs
    assert got.stride() == want.stride()
    close(got, want, torch.float32)
    close(got_drop, want_drop, torch.float32)  # the same entries dropped
    if want.is_contiguous():
        assert got.view(-1, E).shape == want.view(-1, E).shape
