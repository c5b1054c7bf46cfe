"""mha_ext.scaled_dot_product_attention against torch.nn.functional's
(issue 12 point 3, issue 15 point 1's GQA): forward and every gradient in
float32 (2e-5) and float64 (1e-10), on NumPy arrays and on tensors through
the C backward; torch's semantics: any leading dimensions, broadcast
shapes, bool masks True = attend, float masks added, is_causal, scale,
enable_gqa, fully masked rows 0; our "lower_right" against torch's
causal_lower_right; the private _sdpa / _sdpa_backward against the core's
references; errors named.

Legend: L query length, S key length, E query/key width, Ev value width.
"""
import numpy as np
import pytest

import mha_ext
from mha_ext import _core
from _support import require_torch

TOL = {"float32": 2e-5, "float64": 1e-10}
DTYPES = ["float32", "float64"]


@pytest.fixture(scope="module")
def torch():
    return require_torch()


def _inputs(torch, dtype, qs, ks, vs, seed=0):
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    return tuple(torch.randn(s, generator=g, dtype=dt).requires_grad_() for s in (qs, ks, vs))


def _compare(torch, dtype, qs, ks, vs, **kw):
    """ours vs torch: output on tensors and on arrays, and d query, d key,
    d value through autograd"""
    F = torch.nn.functional
    q, k, v = _inputs(torch, dtype, qs, ks, vs)
    want = F.scaled_dot_product_attention(q, k, v, **kw)
    got = mha_ext.scaled_dot_product_attention(q, k, v, **kw)
    assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape
    tol = TOL[dtype]
    np.testing.assert_allclose(got.detach().numpy(), want.detach().numpy(), atol=tol, rtol=tol)
    npkw = {a: (b.numpy() if isinstance(b, torch.Tensor) else b) for a, b in kw.items()}
    arr = mha_ext.scaled_dot_product_attention(q.detach().numpy(), k.detach().numpy(),
                                               v.detach().numpy(), **npkw)
    assert isinstance(arr, np.ndarray) and arr.dtype == np.dtype(dtype)
    np.testing.assert_allclose(arr, want.detach().numpy(), atol=tol, rtol=tol)
    g = torch.randn_like(want)
    gw = torch.autograd.grad(want, (q, k, v), g)
    gg = torch.autograd.grad(got, (q, k, v), g)
    for name, a, b in zip(("query", "key", "value"), gg, gw):
        assert a.shape == b.shape, name
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=tol, rtol=tol, err_msg=name)


SHAPES = [  # query, key, value
    ((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 8)),
    ((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 4)),        # Ev != E
    ((5, 8), (7, 8), (7, 3)),                          # 2-D
    ((4, 5, 8), (4, 7, 8), (4, 7, 8)),                 # 3-D
    ((2, 2, 3, 5, 8), (2, 2, 3, 7, 8), (2, 2, 3, 7, 6)),  # 5-D
    ((2, 3, 5, 8), (1, 3, 7, 8), (1, 3, 7, 8)),        # k, v broadcast over the batch
    ((1, 2, 130, 16), (1, 2, 300, 16), (1, 2, 300, 16)),  # several blocks
    ((2, 1, 5, 8), (2, 1, 7, 8), (1, 1, 7, 4)),        # value broadcast, key not
    ((1, 5, 8), (2, 1, 7, 8), (1, 2, 7, 8)),           # all three broadcast: (2, 2)
    ((2, 5, 8), (7, 8), (2, 7, 8)),                    # key 2-D, value 3-D
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shapes", SHAPES)
@pytest.mark.parametrize("case", ["plain", "causal", "scale", "scale0", "bool", "float"])
def test_matches_torch(torch, dtype, shapes, case):
    qs, ks, vs = shapes
    L, S = qs[-2], ks[-2]
    g = torch.Generator().manual_seed(3)
    kw = {}
    if case == "causal":
        kw["is_causal"] = True
    elif case == "scale":
        kw["scale"] = 0.37
    elif case == "scale0":
        kw["scale"] = 0.0
    elif case == "bool":  # True = attend; broadcast over the leading dimensions
        m = torch.rand(L, S, generator=g) > 0.3
        m[:, 0] = True
        kw["attn_mask"] = m
    elif case == "float":  # added; one per batch entry, broadcast over the heads
        lead = qs[:-2]
        shape = (lead[0],) + (1,) * (len(lead) - 1) + (L, S) if lead else (L, S)
        kw["attn_mask"] = torch.randn(shape, generator=g, dtype=getattr(torch, dtype))
    _compare(torch, dtype, qs, ks, vs, **kw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", [(6, 2), (4, 1), (3, 3)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa(torch, dtype, hq, hkv, causal):
    _compare(torch, dtype, (2, hq, 5, 8), (2, hkv, 9, 8), (2, hkv, 9, 4), enable_gqa=True,
             is_causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_lead,k_lead,v_lead", [
    ((2, 4), (2, 2), (2, 1)), ((2, 4), (1, 1), (2, 2)), ((1, 6), (2, 3), (1, 2)),
    ((2, 12), (1, 2), (2, 3)), ((4,), (2,), (1,))])
def test_gqa_key_and_value_heads_differ(torch, dtype, q_lead, k_lead, v_lead):
    # torch repeats key's and value's heads each to query's count (their
    # counts may differ); the batch axes broadcast as usual
    _compare(torch, dtype, q_lead + (5, 8), k_lead + (9, 8), v_lead + (9, 4),
             enable_gqa=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L,S", [(3, 8), (8, 8), (8, 3), (1, 50)])
def test_lower_right_is_torchs_causal_lower_right(torch, dtype, L, S):
    from torch.nn.attention.bias import causal_lower_right
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about L > S (rows without keys)
        bias = causal_lower_right(L, S)
    F = torch.nn.functional
    q, k, v = _inputs(torch, dtype, (2, 3, L, 8), (2, 3, S, 8), (2, 3, S, 5))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    got = mha_ext.scaled_dot_product_attention(q, k, v, is_causal="lower_right")
    tol = TOL[dtype]
    np.testing.assert_allclose(got.detach().numpy(), want.detach().numpy(), atol=tol, rtol=tol)
    g = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g)):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=tol, rtol=tol)
    # with a mask too (our extension): the mask's blocks and the alignment's
    m = torch.ones(L, S, dtype=torch.bool)
    m[:, -1] = False
    dense = torch.ones(L, S, dtype=torch.bool).tril(S - L) & m
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    got = mha_ext.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal="lower_right")
    np.testing.assert_allclose(got.detach().numpy(), want.detach().numpy(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant,L,S", [("upper_left", 3, 8), ("upper_left", 8, 8),
                                         ("upper_left", 8, 3), ("lower_right", 3, 8),
                                         ("lower_right", 8, 8)])
def test_causal_bias_is_its_pattern(torch, dtype, variant, L, S):
    # torch's CausalBias (torch.nn.attention.bias) as attn_mask: a tensor
    # with no mask values in it, which torch's SDPA dispatches as its causal
    # pattern (read as a mask it was uninitialised memory: wrong numbers)
    from torch.nn.attention import bias as tb
    F = torch.nn.functional
    b = getattr(tb, "causal_" + variant)(L, S)
    q, k, v = _inputs(torch, dtype, (2, 3, L, 8), (2, 3, S, 8), (2, 3, S, 5))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=b)
    got = mha_ext.scaled_dot_product_attention(q, k, v, attn_mask=b)
    tol = TOL[dtype]
    np.testing.assert_allclose(got.detach().numpy(), want.detach().numpy(), atol=tol, rtol=tol)
    g = torch.randn_like(want)
    ours, theirs = (torch.autograd.grad(y, (q, k, v), g) for y in (got, want))
    for a, c in zip(ours, theirs):
        np.testing.assert_allclose(a.numpy(), c.numpy(), atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="CausalBias should not be used with causal=True"):
        mha_ext.scaled_dot_product_attention(q, k, v, attn_mask=b, is_causal=True)
    with pytest.raises(ValueError, match="CausalBias for"):
        mha_ext.scaled_dot_product_attention(q[..., :1, :], k, v, attn_mask=b)
    m = mha_ext.MultiHeadAttention(8, 2)  # a module's masks: refused, never read
    with pytest.raises(TypeError, match="CausalBias"):
        m(np.ones((1, L, 8), np.float32), np.ones((1, S, 8), np.float32), attn_mask=b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_masked_rows_are_zero_as_in_torch(torch, dtype):
    m = torch.ones(5, 7, dtype=torch.bool)
    m[1] = False  # query 1 attends to nothing
    _compare(torch, dtype, (2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 8), attn_mask=m)
    out = mha_ext.scaled_dot_product_attention(*(x.detach().numpy() for x in _inputs(
        torch, dtype, (2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 8))), attn_mask=m.numpy())
    assert np.all(out[:, :, 1] == 0)


def test_bool_polarity_is_attend(torch):
    # SDPA's True = attend: the opposite of MultiHeadAttention's masks
    q = np.ones((1, 1, 2, 4))
    k = np.zeros((1, 1, 3, 4))
    v = np.arange(12, dtype=np.float64).reshape(1, 1, 3, 4)
    m = np.array([[True, False, False], [False, False, True]])
    out = mha_ext.scaled_dot_product_attention(q, k, v, attn_mask=m)
    np.testing.assert_array_equal(out[0, 0], v[0, 0, [0, 2]])


@pytest.mark.parametrize("dtype", DTYPES)
def test_dropout(torch, dtype):
    q, k, v = (x.detach().numpy() for x in _inputs(torch, dtype, (2, 2, 5, 4), (2, 2, 6, 4),
                                                    (2, 2, 6, 3)))
    f = mha_ext.scaled_dot_product_attention
    a = f(q, k, v, dropout_p=0.5, seed=7)
    np.testing.assert_array_equal(a, f(q, k, v, dropout_p=0.5, seed=7))  # one stream per seed
    assert not np.array_equal(a, f(q, k, v, dropout_p=0.5, seed=8))
    assert not np.array_equal(a, f(q, k, v))
    np.testing.assert_array_equal(f(q, k, v, dropout_p=1.0), np.zeros_like(a))


def test_dropout_gradient_replays_the_mask(torch):
    # with a fixed seed the dropped entries are fixed: gradcheck holds
    q, k, v = _inputs(torch, "float64", (1, 2, 4, 3), (1, 2, 5, 3), (1, 2, 5, 2))
    torch.autograd.gradcheck(lambda a, b, c: mha_ext.scaled_dot_product_attention(
        a, b, c, dropout_p=0.4, seed=11), (q, k, v))


@pytest.mark.parametrize("kw", [dict(), dict(is_causal="lower_right", scale=-0.5),
                                dict(enable_gqa=True)])
def test_gradcheck(torch, kw):
    q, k, v = _inputs(torch, "float64", (2, 4, 3, 3), (2, 2, 5, 3), (2, 2, 5, 2))
    if not kw.get("enable_gqa"):
        k, v = (x.detach().repeat(1, 2, 1, 1).requires_grad_() for x in (k, v))
    torch.autograd.gradcheck(lambda a, b, c: mha_ext.scaled_dot_product_attention(
        a, b, c, **kw), (q, k, v))


def test_double_backward_raises(torch):
    q, k, v = _inputs(torch, "float64", (1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 4))
    out = mha_ext.scaled_dot_product_attention(q, k, v)
    (gq,) = torch.autograd.grad(out.sum(), (q,), create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        gq.sum().backward()
    # the head mask the only tensor that requires grad (a frozen model's head
    # importance): its gradient came back as a constant, and a second-order
    # loss silently lost its second-order term
    q, k, v = (t.detach() for t in (q, k, v))
    hm = torch.tensor([0.5, 1.5], dtype=torch.float64, requires_grad=True)
    out = mha_ext.scaled_dot_product_attention(q, k, v, head_mask=hm)
    (g,) = torch.autograd.grad(out.square().sum(), (hm,), create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        (g.square().sum() + hm.sum()).backward()


def test_batched_gradients_raise_a_clear_error(torch):
    # autograd.grad(is_grads_batched=True) (gradcheck's check_batched_grad)
    # hands the backward a batched tensor the C kernels cannot read: an error
    # that says so, not torch's "Batching rule not implemented for aten::detach"
    q, k, v = _inputs(torch, "float64", (1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 4))
    out = mha_ext.scaled_dot_product_attention(q, k, v)
    g = torch.randn((3,) + tuple(out.shape), dtype=torch.float64)
    with pytest.raises(RuntimeError, match="batched tensor.*loop over the batch"):
        torch.autograd.grad(out, (q,), g, is_grads_batched=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True, "lower_right"])
@pytest.mark.parametrize("zero_rows, p", [(True, 0.2), (False, 0.0), (False, 0.2)])
def test_private_calls_against_the_reference(dtype, causal, zero_rows, p):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 4, 7, 5)).astype(dtype)
    k = rng.standard_normal((2, 2, 9, 5)).astype(dtype)
    v = rng.standard_normal((2, 2, 9, 3)).astype(dtype)
    go = rng.standard_normal((2, 4, 7, 3)).astype(dtype)
    gw = rng.standard_normal((2, 4, 7, 9)).astype(dtype)
    masks = [(1, rng.standard_normal((7, 9)).astype(dtype)), (0, rng.random((2, 1, 1, 9)) < 0.2)]
    kw = dict(masks=masks, is_causal=causal, scale=0.3, dropout=p, seed=5, counter=2,
              zero_rows=zero_rows)
    tol = TOL[dtype] * 10
    fast = _core._sdpa(q, k, v, need_weights=True, **kw)
    ref = _core._sdpa(q, k, v, need_weights=True, reference=True, **kw)
    for a, b in zip(fast, ref):
        np.testing.assert_allclose(a, b, atol=tol, rtol=tol)
    fast = _core._sdpa_backward(q, k, v, go, grad_weights=gw, **kw)
    ref = _core._sdpa_backward(q, k, v, go, grad_weights=gw, reference=True, **kw)
    for a, b in zip(fast, ref):
        np.testing.assert_allclose(a, b, atol=tol, rtol=tol)


def test_gqa_head_count_that_does_not_divide_raises_when_empty(torch):
    # torch returns an empty or zero result when L or S is 0 (a RuntimeError
    # otherwise); a head count that does not divide is a ValueError either way
    F = torch.nn.functional
    q = torch.randn(1, 1, 4, 8)
    k, v = torch.randn(1, 3, 0, 8), torch.randn(1, 1, 0, 8)
    assert F.scaled_dot_product_attention(q, k, v, enable_gqa=True).shape == (1, 1, 4, 8)
    for args in ((q, k, v), (q[:, :, :0], torch.randn(1, 3, 2, 8), torch.randn(1, 1, 2, 8)),
                 (q.numpy(), k.numpy(), v.numpy())):
        with pytest.raises(ValueError, match="enable_gqa|multiple|heads"):
            mha_ext.scaled_dot_product_attention(*args, enable_gqa=True)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_row_blocked_by_the_lowest_finite_value_has_the_softmax_gradients(torch, dtype):
    # T5 folds padding into its position bias with finfo.min: such a row is
    # a uniform average (every score shifted alike), and its gradients are
    # the softmax's, 1/S per key.  torch 2.13's SDPA backward gives 1 each
    # (its logsumexp loses log S next to finfo.min); eager attention and
    # ours agree with the explicit softmax
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 2, 4, generator=g, dtype=dt)
    k, v = (torch.randn(1, 1, 3, 4, generator=g, dtype=dt) for _ in range(2))
    mask = torch.zeros(1, 1, 2, 3, dtype=dt)
    mask[..., 0, :] = torch.finfo(dt).min
    grads = []
    for f in (mha_ext.scaled_dot_product_attention,
              lambda q, k, v, attn_mask: torch.softmax(
                  q @ k.transpose(-1, -2) / 2 + attn_mask, -1) @ v):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = f(qq, kk, vv, attn_mask=mask)
        (out * torch.arange(1.0, 9.0, dtype=dt).reshape(2, 4)).sum().backward()
        grads.append((out.detach(), qq.grad, kk.grad, vv.grad))
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == "float32" else dict(rtol=1e-10, atol=1e-12)
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(grads[0][0][0, 0, 0], v[0, 0].mean(0), **tol)  # uniform


def test_errors(torch):
    f = mha_ext.scaled_dot_product_attention
    q, k, v = np.ones((2, 4, 3, 8)), np.ones((2, 2, 5, 8)), np.ones((2, 2, 5, 8))
    with pytest.raises(ValueError, match="enable_gqa"):
        f(q, k, v)
    with pytest.raises(ValueError, match="multiple"):
        f(q, np.ones((2, 3, 5, 8)), np.ones((2, 3, 5, 8)), enable_gqa=True)
    with pytest.raises(ValueError, match=r"value's \(3\)"):
        f(q, np.ones((2, 2, 5, 8)), np.ones((2, 3, 5, 8)), enable_gqa=True)
    with pytest.raises(ValueError, match="do not broadcast"):  # torch: a RuntimeError
        f(np.ones((2, 3, 8)), np.ones((3, 5, 8)), np.ones((5, 8)))
    with pytest.raises(RuntimeError, match="should not be set when is_causal=True"):  # torch's
        f(q, q, q, attn_mask=np.ones((3, 3), bool), is_causal=True)
    with pytest.raises(TypeError, match="attn_mask"):
        f(q, q, q, attn_mask=np.ones((3, 3), np.int64))
    with pytest.raises(ValueError, match="attn_mask"):
        f(q, q, q, attn_mask=np.ones((4, 3), bool))
    with pytest.raises(TypeError, match="is_causal"):
        f(q, q, q, is_causal="upper_left")
    with pytest.raises(TypeError, match="scale"):
        f(q, q, q, scale="0.5")
    # the head mask's (B, H) is the result's: the query's, key's and value's broadcast
    with pytest.raises(ValueError, match=r"the result's leading shape \(2, 3\) \(the query's, "
                                         r"key's and value's broadcast\), got \(1, 3\)"):
        f(np.ones((1, 3, 4, 8)), np.ones((2, 3, 5, 8)), np.ones((2, 3, 5, 8)),
          head_mask=np.ones((1, 3)))
    with pytest.raises(ValueError, match=r"leading shape \(3, 2\)"):  # value's batch counts
        f(np.ones((1, 2, 4, 8)), np.ones((1, 2, 5, 8)), np.ones((3, 2, 5, 8)),
          head_mask=np.ones((1, 2)))
    for nan in (float("nan"), np.float32("nan")):  # torch: zeros on one path, NaN on another
        with pytest.raises(ValueError, match="scale must be a real number, not NaN"):
            f(q, q, q, scale=nan)
        with pytest.raises(ValueError, match="not NaN"):
            mha_ext.MultiHeadAttention(8, 2)(np.ones((2, 3, 8)), scale=nan)
    with pytest.raises(ValueError, match="key's last dimension"):
        f(q, np.ones((2, 4, 5, 7)), np.ones((2, 4, 5, 7)))
    with pytest.raises(ValueError, match="dropout_p"):
        f(q, q, q, dropout_p=1.5)
    # seed: the constructor's rule, whatever dropout_p (it was int(seed):
    # 1.5 ran as 1, "a" gave int()'s message)
    for bad in ("a", 1.5, True, np.ones(2)):
        for p in (0.0, 0.5):
            with pytest.raises(TypeError, match="seed must be an int in"):
                f(q, q, q, dropout_p=p, seed=bad)
    for bad in (-1, 2 ** 64):
        with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*64\)"):
            f(q, q, q, dropout_p=0.5, seed=bad)
    assert f(q, q, q, dropout_p=0.5, seed=np.uint64(2 ** 64 - 1)).shape == q.shape
    with pytest.raises(ValueError, match="q .*k .*v"):
        _core._sdpa(q, k, np.ones((2, 2, 6, 8)))
    t = torch.ones(1, 2, 3, 4)
    with pytest.raises(TypeError, match="float32, float64, float16 or bfloat16"):
        f(t.int(), t.int(), t.int())
    with pytest.raises(TypeError, match="one dtype"):
        f(t.half(), t, t)


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_half_tensors_are_computed_in_float32(torch, half):
    # torch's CPU SDPA takes float16 and bfloat16, computes in float32 and
    # rounds its output back; ours too: the output and every gradient in the
    # inputs' dtype, within one rounding of that dtype of the float32 result
    # (and of torch's own half call)
    F = torch.nn.functional
    dt = getattr(torch, half)
    eps = torch.finfo(dt).eps
    q, k, v = (x.detach().to(dt).requires_grad_() for x in _inputs(
        torch, "float32", (2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 4)))
    m = torch.randn(5, 7, generator=torch.Generator().manual_seed(3)).to(dt)
    kw = dict(attn_mask=m, scale=0.3)
    got = mha_ext.scaled_dot_product_attention(q, k, v, **kw)
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    want = F.scaled_dot_product_attention(q32, k32, v32, attn_mask=m.float(), scale=0.3)
    theirs = F.scaled_dot_product_attention(q, k, v, **kw)
    assert got.dtype == dt
    torch.testing.assert_close(got.float(), want.detach(), atol=eps, rtol=eps)
    torch.testing.assert_close(got.float(), theirs.detach().float(), atol=2 * eps, rtol=2 * eps)
    g = torch.randn(got.shape, generator=torch.Generator().manual_seed(4))
    got.backward(g.to(dt))
    want.backward(g.to(dt).float())
    for a, b in ((q, q32), (k, k32), (v, v32)):
        assert a.grad.dtype == dt
        torch.testing.assert_close(a.grad.float(), b.grad, atol=4 * eps, rtol=4 * eps)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shapes", [((2, 3, 5, 8), (2, 3, 0, 8), (2, 3, 0, 4)),   # S = 0
                                    ((2, 3, 0, 8), (2, 3, 7, 8), (2, 3, 7, 4)),   # L = 0
                                    ((0, 3, 5, 8), (0, 3, 7, 8), (0, 3, 7, 4)),   # B = 0
                                    ((2, 0, 5, 8), (2, 0, 7, 8), (2, 0, 7, 4)),   # H = 0
                                    ((0, 5, 8), (0, 7, 8), (0, 7, 4)),            # 3-D, H = 0
                                    ((2, 0, 5, 8), (2, 1, 7, 8), (2, 1, 7, 4)),   # H = 0, Hkv 1
                                    ((2, 3, 5, 0), (2, 3, 7, 0), (2, 3, 7, 4)),   # E = 0
                                    ((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 0)),   # Ev = 0
                                    ((2, 3, 5, 0), (2, 3, 7, 0), (2, 3, 7, 0))])  # both
@pytest.mark.parametrize("case", ["plain", "causal", "scale", "bool", "float"])
def test_empty_shapes(torch, dtype, shapes, case):
    # torch's results: empty ones, and for E = 0 every score 0 whatever the
    # scale (softmax of the mask alone: the mean of the visible values);
    # these were a ValueError (zero heads or a zero width)
    L, S = shapes[0][-2], shapes[1][-2]
    g = torch.Generator().manual_seed(5)
    kw = {"plain": {}, "causal": {"is_causal": True}, "scale": {"scale": 2.5},
          "bool": {"attn_mask": torch.rand(L, S, generator=g) > 0.4},
          "float": {"attn_mask": torch.randn(L, S, generator=g, dtype=getattr(torch, dtype))}}
    _compare(torch, dtype, *shapes, **kw[case])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shapes", [((2, 3, 5, 0), (2, 3, 7, 0), (2, 3, 7, 4)),
                                    ((5, 0), (7, 0), (7, 3))])
def test_a_zero_width_with_an_infinite_scale_still_scores_zero(torch, dtype, shapes):
    # E = 0: every score is an empty sum, 0 whatever the scale (torch: the
    # mean of the values), not inf·0 = NaN
    _compare(torch, dtype, *shapes, scale=float("inf"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shapes", [((2, 0, 5, 8), (2, 0, 7, 8), (2, 0, 7, 4)),
                                    ((2, 0, 5, 8), (2, 2, 7, 8), (2, 0, 7, 4)),
                                    ((2, 4, 5, 0), (2, 2, 7, 0), (2, 1, 7, 3))])
def test_empty_shapes_with_gqa(torch, dtype, shapes):
    # no query head is a multiple of any count of key or value heads (an
    # empty result, as torch's); a zero width with repeated heads
    _compare(torch, dtype, *shapes, enable_gqa=True)


def test_long_sequences_without_weights_are_not_refused_for_memory():
    """The memory check counted the (B, H, L, S) weights, which the SDPA
    never returns: 68.7 GB at L = S = 2**17 was a MemoryError on any machine
    with less, though the call needs 17 MiB (a window keeps it quick)."""
    q = np.random.default_rng(0).standard_normal((1, 1, 2 ** 17, 8)).astype(np.float32)
    out = mha_ext.scaled_dot_product_attention(q, q, q, window=(0, 0))
    np.testing.assert_array_equal(out, q)      # each query sees itself alone


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_nan_key_that_a_bool_mask_or_causality_blocks_is_left_out(torch, dtype):
    """The twin: a NaN key at a position the bool mask (True = attend) or
    is_causal blocks is left out, as with any finite key there; torch 2.13
    gives NaN rows for the bool mask (it adds -inf) and, on its fused
    kernel with is_causal, zeros.  A float mask's -inf: NaN as torch's."""
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 4, 8, generator=g, dtype=dt) for _ in range(3))
    bad, fine = k.clone(), k.clone()
    bad[0, 1, 3] = float("nan")
    fine[0, 1, 3] = 7.0
    F = torch.nn.functional.scaled_dot_product_attention
    f = mha_ext.scaled_dot_product_attention
    keep = (torch.arange(4) != 3).expand(4, 4)           # key 3 blocked for every query
    tol = dict(rtol=TOL[dtype], atol=TOL[dtype])
    torch.testing.assert_close(f(q, bad, v, attn_mask=keep), F(q, fine, v, attn_mask=keep), **tol)
    assert torch.isnan(F(q, bad, v, attn_mask=keep)[0, 1]).all()
    got = f(q, bad, v, is_causal=True)
    want = F(q, fine, v, is_causal=True)
    torch.testing.assert_close(got[..., :3, :], want[..., :3, :], **tol)  # rows 0-2 never see key 3
    assert torch.isnan(got[0, 1, 3]).all()               # row 3 sees it: NaN
    add = torch.where(keep, 0.0, float("-inf")).to(dt)
    assert torch.isnan(f(q, bad, v, attn_mask=add)[0, 1]).all()
    assert torch.isnan(F(q, bad, v, attn_mask=add)[0, 1]).all()


@pytest.mark.parametrize("case", ["1-D query", "mixed dtypes", "4-D mask of another shape"])
def test_what_torch_refuses_is_refused_with_torchs_type_and_message_too(torch, case):
    """On tensors the twin's refusals of what torch refuses too are also of
    torch's type (a RuntimeError) and quote its argument checks' message;
    still the ValueError or TypeError of API.md §7.  (A mask that does not
    broadcast fails in torch inside an operation, whose message on the
    meta tensors the check runs on differs: its type is checked.)"""
    q = torch.randn(2, 3, 4, 8)
    args, kw = {
        "1-D query": ((torch.randn(8), q, q), {}),
        "mixed dtypes": ((q, q.half(), q.half()), {}),
        "4-D mask of another shape": ((q, q, q), {"attn_mask": torch.ones(2, 3, 5, 5,
                                                                          dtype=torch.bool)}),
    }[case]
    F = torch.nn.functional.scaled_dot_product_attention
    with pytest.raises(RuntimeError) as theirs:
        F(*args, **kw)
    with pytest.raises(RuntimeError) as got:
        mha_ext.scaled_dot_product_attention(*args, **kw)
    assert isinstance(got.value, (ValueError, TypeError))
    if case != "4-D mask of another shape":
        assert str(theirs.value) in str(got.value)


def test_a_patched_functional_refuses_without_recursion(torch, monkeypatch):
    """Code is run through the twin by putting it in place of
    torch.nn.functional.scaled_dot_product_attention; a refusal then still
    runs torch's own function (not the patched name, which was the twin
    itself: it recursed until a RecursionError, a 33 KB message claiming
    torch refused), for the twin's direct calls and for torch's
    MultiheadAttention reaching it through its functional."""
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        mha_ext.scaled_dot_product_attention)
    q = torch.randn(2, 4, 5, 8)
    with pytest.raises(RuntimeError) as got:
        torch.nn.functional.scaled_dot_product_attention(q, q.double(), q.double())
    assert isinstance(got.value, TypeError) and not isinstance(got.value, RecursionError)
    assert str(got.value).count("(torch:") == 1 and len(str(got.value)) < 400
    assert "same dtype" in str(got.value)
    # the drop-in's refusals run torch's module, whose functional calls the
    # patched name on meta tensors
    import mha_ext.torch as mt
    m = mt.MultiheadAttention(8, 2, batch_first=True)
    with pytest.raises(AssertionError) as got:
        m(torch.randn(2, 3, 8), torch.randn(2, 4, 8), torch.randn(2, 5, 8))
    assert isinstance(got.value, ValueError) and str(got.value).count("(torch:") == 1


@pytest.mark.parametrize("layout", ["strided", "jagged"])
def test_nested_tensors_are_refused_saying_what_to_do(torch, layout):
    """A nested tensor (which torch's SDPA takes) is a TypeError saying to pad
    it (to_padded_tensor) and mask the padding: the jagged one was told to
    call .to_dense(), which torch refuses for that layout, and the strided
    one met a torch-internal "NestedTensorImpl doesn't support sizes"."""
    import warnings
    parts = [torch.randn(4, 3, 8), torch.randn(4, 5, 8)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's prototype-stage warning
        nt = torch.nested.nested_tensor(parts, layout=getattr(torch, layout))
    for args in ((nt, nt, nt), (parts[0][None], nt, nt)):
        with pytest.raises(TypeError, match="nested tensor.*to_padded_tensor"):
            mha_ext.scaled_dot_product_attention(*args)
