"""Head masks (issue 14 point 3): ``head_mask`` of shape (H,) or (B, H)
multiplies each head's attention weights after dropout (Hugging Face's
semantics: 0 switches a head off).  Against torch autograd on the same
formula: output, weights and every gradient (no gradient for head_mask
itself: it is a constant, like the masks), float32 and float64, combined
with masks, causality, a window and dropout; the torch adapter; the
trace; errors named.

Legend: B batch, Sq/Sk query/key length, E = d_model, H = n_heads.
"""
import math
import warnings

import numpy as np
import pytest

import mha_ext
from _support import require_torch

TOL = {"float32": 2e-5, "float64": 1e-10}
DTYPES = ["float32", "float64"]


@pytest.fixture(scope="module")
def torch():
    return require_torch()


def close(got, want, dtype, what=""):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, what
    scale = max(1.0, float(np.abs(np.nan_to_num(want)).max(initial=0.0)))
    np.testing.assert_allclose(got, want, atol=TOL[dtype] * scale, rtol=TOL[dtype],
                               err_msg=what)


def torch_attention(torch, state, H, q, k, v, head_mask, blocked, g, gw):
    """HF's order in torch ops: P = softmax(masked scores), A = P · m[b, h],
    ctx = A·V, out = ctx·W_oᵀ + b_o; returns out, A and the gradients of
    <out, g> + <A, gw>."""
    params = {n: torch.tensor(x, requires_grad=True) for n, x in state.items()}
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))

    def lin(x, n):
        return x @ params[f"{n}.weight"].T + params[f"{n}.bias"]

    B, Sq, E = q.shape
    Sk, Dk = k.shape[1], E // H
    Q = lin(tq, "W_q").view(B, Sq, H, Dk).transpose(1, 2)
    K = lin(tk, "W_k").view(B, Sk, H, Dk).transpose(1, 2)
    V = lin(tv, "W_v").view(B, Sk, H, Dk).transpose(1, 2)
    S = (Q @ K.transpose(-2, -1) / math.sqrt(Dk)).masked_fill(torch.tensor(blocked), -math.inf)
    A = torch.softmax(S, dim=-1) * torch.tensor(head_mask)[:, :, None, None]
    out = lin((A @ V).transpose(1, 2).reshape(B, Sq, E), "W_o")
    ((out * torch.tensor(g)).sum() + (A * torch.tensor(gw)).sum()).backward()
    grads = {n: t.grad.numpy() for n, t in params.items()}
    grads.update(query=tq.grad.numpy(), key=tk.grad.numpy(), value=tv.grad.numpy())
    return out.detach().numpy(), A.detach().numpy(), grads


def window_blocked(Sq, Sk, left, right):
    d = np.arange(Sk)[None, :] - np.arange(Sq)[:, None]
    return (d < -left) | (d > right)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_batch", [False, True])
@pytest.mark.parametrize("extra", [None, "causal", "window", "padding"])
@pytest.mark.parametrize("S", [6, 300])
def test_head_mask_matches_torch(torch, dtype, per_batch, extra, S):
    """Output, weights and every gradient against torch autograd, with a
    head switched off, one halved, one kept; (H,) and (B, H)."""
    B, E, H = 2, 16, 4
    m = mha_ext.MultiHeadAttention(E, H, dtype=dtype, seed=4).eval()
    rng = np.random.default_rng(S)
    q = rng.standard_normal((B, S, E)).astype(dtype)
    k = rng.standard_normal((B, S, E)).astype(dtype)
    v = rng.standard_normal((B, S, E)).astype(dtype)
    hm = np.array([[1.0, 0.0, 0.5, 1.0], [0.0, 1.0, 1.0, 2.0]], dtype=dtype)
    given = hm if per_batch else hm[0]
    full = hm if per_batch else np.broadcast_to(hm[0], (B, H))
    blocked = np.zeros((B, 1, S, S), dtype=bool)
    kw = {}
    if extra == "causal":
        kw["is_causal"] = True
        blocked |= np.triu(np.ones((S, S), dtype=bool), 1)
    elif extra == "window":
        kw["window"] = (3, 1)
        blocked |= window_blocked(S, S, 3, 1)
    elif extra == "padding":
        kpm = np.zeros((B, S), dtype=bool)
        kpm[1, :2] = True
        kw["key_padding_mask"] = kpm
        blocked |= kpm[:, None, None, :]
    g = rng.standard_normal((B, S, E)).astype(dtype)
    gw = rng.standard_normal((B, H, S, S)).astype(dtype)
    out_t, w_t, want = torch_attention(torch, m.state_dict(), H, q, k, v, full, blocked, g, gw)

    out, w = m(q, k, v, head_mask=given, **kw)
    close(out, out_t, dtype, "output")
    close(w, w_t, dtype, "weights")
    out2, none = m(q, k, v, head_mask=given, need_weights=False, **kw)
    assert none is None
    close(out2, out_t, dtype, "output without weights")
    for keep in (True, False):
        ctx = m.forward_train(q, k, v, head_mask=given, save_projections=keep, **kw)
        close(ctx.output, out_t, dtype, "forward_train output")
        grads = m.backward(ctx, g, gw)
        for name, want_g in want.items():
            close(grads[name], want_g, dtype, f"{name} (saved {keep})")


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_mask_multiplies_after_dropout(dtype):
    """With dropout, the weights are dropout(P) · m: the same draws as
    without the head mask (replayed stream), times m; the gradients are
    those of that product (finite differences through the replayed call)."""
    m = mha_ext.MultiHeadAttention(8, 2, dropout=0.3, dtype=dtype, seed=0).train()
    x = np.random.default_rng(0).standard_normal((2, 5, 8)).astype(dtype)
    hm = np.array([0.5, 0.0], dtype=dtype)
    plain = m.forward_train(x)
    masked = m.forward_train(x, head_mask=hm, dropout_counter=plain.counter)
    close(masked.weights, plain.weights * hm[None, :, None, None], dtype)
    assert np.all(masked.weights[:, 1] == 0)


def test_head_mask_gradients_match_finite_differences():
    """float64: d query of <out, g> with a head mask and dropout against
    central differences of the call (the dropout mask replayed)."""
    m = mha_ext.MultiHeadAttention(8, 2, dropout=0.25, dtype="float64", seed=1).train()
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 4, 8))
    kv = rng.standard_normal((1, 6, 8))
    g = rng.standard_normal((1, 4, 8))
    hm = np.array([[0.7, 1.3]])
    ctx = m.forward_train(x, kv, kv, head_mask=hm)
    dq = m.backward(ctx, g)["query"]
    eps = 1e-6
    for idx in [(0, 0, 0), (0, 2, 5), (0, 3, 7)]:
        xp, xm = x.copy(), x.copy()
        xp[idx] += eps
        xm[idx] -= eps
        fp = (m.forward_train(xp, kv, kv, head_mask=hm,
                              dropout_counter=ctx.counter).output * g).sum()
        fm = (m.forward_train(xm, kv, kv, head_mask=hm,
                              dropout_counter=ctx.counter).output * g).sum()
        assert abs((fp - fm) / (2 * eps) - dq[idx]) < 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
def test_heads_off_and_ones(dtype):
    """All heads off: the output is W_o.bias on every row; all ones: the
    call without a head mask, bit for bit (weights too)."""
    m = mha_ext.MultiHeadAttention(12, 3, dtype=dtype, seed=5).eval()
    x = np.random.default_rng(3).standard_normal((2, 70, 12)).astype(dtype)
    out, w = m(x, head_mask=np.zeros(3))
    np.testing.assert_array_equal(out, np.broadcast_to(m.W_o.bias, out.shape))
    assert not w.any()
    for nw in (True, False):
        base = m(x, need_weights=nw)
        got = m(x, need_weights=nw, head_mask=np.ones((2, 3)))
        np.testing.assert_array_equal(got[0], base[0])
        if nw:
            np.testing.assert_array_equal(got[1], base[1])


def test_torch_adapter_head_mask(torch):
    """mha_ext.torch.MultiHeadAttention(head_mask=...): the output and the
    input gradient equal the NumPy module's forward_train/backward."""
    from mha_ext.torch import MultiHeadAttention
    m = MultiHeadAttention(8, 2, dtype=torch.float64, seed=3).eval()
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    hm = torch.tensor([1.0, 0.0], dtype=torch.float64)
    out, _ = m(x, head_mask=hm)
    out.square().sum().backward()
    ref = mha_ext.MultiHeadAttention(8, 2, dtype="float64", seed=3).eval()
    ctx = ref.forward_train(x.detach().numpy(), head_mask=hm.numpy())
    np.testing.assert_allclose(out.detach().numpy(), ctx.output, rtol=1e-12, atol=1e-12)
    grads = ref.backward(ctx, 2 * ctx.output)
    total = grads["query"] + grads["key"] + grads["value"]   # x was all three
    np.testing.assert_allclose(x.grad.numpy(), total, rtol=1e-10, atol=1e-12)


def test_trace_shows_the_head_mask():
    m = mha_ext.MultiHeadAttention(8, 2, seed=0).eval()
    x = np.random.default_rng(0).standard_normal((1, 5, 8)).astype(np.float32)
    tr = m.trace(x, head_mask=[1.0, 0.0])
    step = next(s for s in tr.steps if s.name == "head mask")
    assert "head_mask" in step.formula
    assert not step.array[0, 1].any() and step.array[0, 0].any()
    np.testing.assert_allclose(tr.info["numpy_output"], tr.output, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad,err,words", [
    (np.ones(3), ValueError, r"head_mask must have shape \(n_heads,\)"),
    (np.ones((3, 2)), ValueError, r"head_mask must have shape"),
    (np.array([1.0, np.nan]), ValueError, "head_mask must hold finite numbers"),
    (np.array([1.0, np.inf]), ValueError, "head_mask must hold finite numbers"),
    # finite in float64, infinite in the module's float32: the error, no NumPy warning
    (np.array([1.0, 1e308]), ValueError, "head_mask must hold finite numbers .*float32"),
    ("ab", (TypeError, ValueError), "head_mask"),
])
def test_head_mask_errors_name_the_argument(bad, err, words):
    m = mha_ext.MultiHeadAttention(8, 2)
    x = np.zeros((2, 3, 8), np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(err, match=words):
            m(x, head_mask=bad)


def test_c_method_checks_the_head_mask():
    """The private C method refuses what the Python layer would have caught."""
    m = mha_ext.MultiHeadAttention(8, 2)
    x = np.zeros((2, 3, 8), np.float32)
    with pytest.raises(ValueError, match=r"head_mask must have the shape \(batch, heads\)"):
        m._forward(x, x, x, head_mask=np.ones(2, np.float32))
    with pytest.raises(ValueError, match="finite"):
        m._forward(x, x, x, head_mask=np.full((2, 2), np.nan, np.float32))
