"""The gradient of a head mask (issue 14 point 3, "with gradients"):
dL/d head_mask from ``backward(..., head_mask_grad=True)`` and from the
torch classes when the head mask is a tensor that requires grad, against
torch autograd on the same formula (softmax, times the head mask, A·V,
W_o), float32 and float64, (H,) and (B, H) head masks, heads switched off
(m = 0: their gradient is still the head's importance), with masks, a
layout, causality and dL/d weights; the SDPA twin's head mask against a
torch reference too.

Legend: B batch, Sq/Sk query/key length, E = d_model, H = n_heads.
"""
import math

import numpy as np
import pytest

import mha_ext
from mha_ext import layout as L
from _support import require_torch
from test_head_mask import close, DTYPES


@pytest.fixture(scope="module")
def torch():
    return require_torch()


def torch_reference(torch, state, H, q, k, v, head_mask, blocked, g, gw):
    """out, A and the gradients of <out, g> + <A, gw> (gw may be None),
    head_mask included, by torch autograd."""
    params = {n: torch.tensor(x, requires_grad=True) for n, x in state.items()}
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    hm = torch.tensor(head_mask, requires_grad=True)

    def lin(x, n):
        return x @ params[f"{n}.weight"].T + params[f"{n}.bias"]

    B, Sq, E = q.shape
    Sk, Dk = k.shape[1], E // H
    Q = lin(tq, "W_q").view(B, Sq, H, Dk).transpose(1, 2)
    K = lin(tk, "W_k").view(B, Sk, H, Dk).transpose(1, 2)
    V = lin(tv, "W_v").view(B, Sk, H, Dk).transpose(1, 2)
    S = (Q @ K.transpose(-2, -1) / math.sqrt(Dk)).masked_fill(torch.tensor(blocked), -math.inf)
    m = hm[None, :, None, None] if hm.dim() == 1 else hm[:, :, None, None]
    A = torch.softmax(S, dim=-1) * m
    out = lin((A @ V).transpose(1, 2).reshape(B, Sq, E), "W_o")
    loss = (out * torch.tensor(g)).sum()
    if gw is not None:
        loss = loss + (A * torch.tensor(gw)).sum()
    loss.backward()
    grads = {n: t.grad.numpy() for n, t in params.items()}
    grads.update(query=tq.grad.numpy(), key=tk.grad.numpy(), value=tv.grad.numpy(),
                 head_mask=hm.grad.numpy())
    return out.detach().numpy(), A.detach().numpy(), grads


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ["H", "BH"])
@pytest.mark.parametrize("extra", ["none", "causal+padding", "layout", "weights"])
def test_backward_head_mask_grad_matches_torch(torch, dtype, shape, extra):
    B, Sq, Sk, E, H = 2, 7, 9, 12, 3
    m = mha_ext.MultiHeadAttention(E, H, dtype=dtype, seed=2)
    rng = np.random.default_rng(3)
    q = rng.standard_normal((B, Sq, E)).astype(dtype)
    k = rng.standard_normal((B, Sk, E)).astype(dtype)
    v = rng.standard_normal((B, Sk, E)).astype(dtype)
    hm = np.array([1.0, 0.0, 0.5]) if shape == "H" else np.array([[1.0, 0.0, 0.5],
                                                                    [0.0, 2.0, 1.0]])
    hm = hm.astype(dtype)
    kw = {}
    blocked = np.zeros((B, H, Sq, Sk), bool)
    if extra == "causal+padding":
        kpm = np.zeros((B, Sk), bool)
        kpm[1, :2] = True
        kw.update(is_causal="lower_right", key_padding_mask=kpm)
        i, j = np.arange(Sq)[:, None], np.arange(Sk)[None, :]
        blocked = blocked | (j > i + Sk - Sq) | kpm[:, None, None, :]
    elif extra == "layout":
        lay = L.bigbird(Sq, Sk, (2, 3), random_blocks=1, seed=4, heads=H)
        kw["layout"] = lay
        blocked = blocked | ~lay.to_dense(Sq, Sk)[None]
    assert not blocked.all(-1).any()
    g = rng.standard_normal((B, Sq, E)).astype(dtype)
    gw = rng.standard_normal((B, H, Sq, Sk)).astype(dtype) if extra == "weights" else None
    out_t, a_t, grads_t = torch_reference(torch, m.state_dict(), H, q, k, v, hm, blocked, g, gw)
    ctx = m.forward_train(q, k, v, head_mask=hm, **kw)
    close(ctx.output, out_t, dtype, "output")
    close(ctx.weights, a_t, dtype, "weights")
    grads = m.backward(ctx, g, gw, head_mask_grad=True)
    assert grads["head_mask"].shape == hm.shape
    assert np.abs(grads["head_mask"]).min() > 0          # heads off have a gradient too
    for name, want in grads_t.items():
        close(grads[name], want, dtype, name)


def test_head_mask_grad_with_dropout_uses_the_same_stream():
    """With dropout, dL/d m equals the finite difference of the loss in m
    with the same stream replayed (dropout_counter): float64 central
    differences."""
    m = mha_ext.MultiHeadAttention(8, 2, dtype="float64", seed=5)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 6, 8))
    hm = np.array([0.7, 0.0])
    g = rng.standard_normal((2, 6, 8))
    ctx = m.forward_train(x, head_mask=hm, dropout=0.3, dropout_counter=11)
    got = m.backward(ctx, g, head_mask_grad=True)["head_mask"]
    eps = 1e-6
    for h in range(2):
        d = np.zeros(2)
        d[h] = eps
        lp = (m.forward_train(x, head_mask=hm + d, dropout=0.3, dropout_counter=11).output
              * g).sum()
        lm = (m.forward_train(x, head_mask=hm - d, dropout=0.3, dropout_counter=11).output
              * g).sum()
        assert abs(got[h] - (lp - lm) / (2 * eps)) < 1e-7 * max(1.0, abs(got[h]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_class_returns_the_head_mask_gradient(torch, dtype):
    """mha_ext.torch.MultiHeadAttention: a head mask tensor that requires
    grad gets dL/d head_mask (torch autograd on the reference formula); one
    that does not is a constant as before."""
    from mha_ext.torch import MultiHeadAttention
    dt = getattr(torch, dtype)
    B, S, E, H = 2, 5, 8, 2
    mod = MultiHeadAttention(E, H, dtype=dt, seed=1).eval()
    state = {k: v.detach().numpy() for k, v in mod.state_dict().items()}
    x = np.random.default_rng(2).standard_normal((B, S, E)).astype(dtype)
    g = np.random.default_rng(3).standard_normal((B, S, E)).astype(dtype)
    for hm_np in (np.array([0.0, 1.5], dtype), np.array([[1.0, 0.0], [0.5, 1.0]], dtype)):
        hm = torch.tensor(hm_np, requires_grad=True)
        xt = torch.tensor(x, requires_grad=True)
        out, w = mod(xt, head_mask=hm)
        (out * torch.tensor(g)).sum().backward()
        _, _, want = torch_reference(torch, state, H, x, x, x, hm_np,
                                     np.zeros((B, H, S, S), bool), g, None)
        close(hm.grad.numpy(), want["head_mask"], dtype, "head_mask")
        close(xt.grad.numpy(), want["query"] + want["key"] + want["value"], dtype, "x")
    const = torch.tensor([1.0, 0.0], dtype=dt)
    out, _ = mod(torch.tensor(x), head_mask=const)
    assert const.grad is None


def test_head_mask_grad_needs_a_head_mask():
    m = mha_ext.MultiHeadAttention(8, 2)
    x = np.zeros((1, 3, 8), np.float32)
    ctx = m.forward_train(x)
    with pytest.raises(ValueError, match="no head_mask"):
        m.backward(ctx, np.ones_like(x), head_mask_grad=True)
    with pytest.raises(TypeError, match="head_mask_grad"):
        m.backward(m.forward_train(x, head_mask=[1, 0]), np.ones_like(x),
                   head_mask_grad=[True])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hm_shape", ["H", "lead"])
@pytest.mark.parametrize("case", ["plain", "gqa+causal", "layout+mask", "online"])
def test_sdpa_head_mask_matches_torch(torch, dtype, hm_shape, case):
    """mha_ext.scaled_dot_product_attention(head_mask=...) (issue 14 point
    B): output, d query, d key, d value and dL/d head_mask equal torch
    autograd on softmax(...)·m @ V, on tensors; the arrays path gives the
    same output and leaves its inputs unchanged."""
    F = torch.nn.functional
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(1)
    B, Hq, Hk, Lq, S, D = 2, 4, 2 if case == "gqa+causal" else 4, 7, 9, 8
    if case == "online":
        Lq, S = 130, 300
    q = torch.randn(B, Hq, Lq, D, generator=g, dtype=dt, requires_grad=True)
    k = torch.randn(B, Hk, S, D, generator=g, dtype=dt, requires_grad=True)
    v = torch.randn(B, Hk, S, 5, generator=g, dtype=dt, requires_grad=True)
    m_np = (np.array([1.0, 0.0, 0.5, 2.0]) if hm_shape == "H"
            else np.array([[1.0, 0.0, 0.5, 2.0], [0.0, 1.0, 1.0, 0.25]])).astype(dtype)
    kw, allow = {}, torch.ones(Lq, S, dtype=torch.bool)
    if case == "gqa+causal":
        kw.update(is_causal="lower_right", enable_gqa=True)
        allow = torch.tensor(np.arange(S)[None, :] <= np.arange(Lq)[:, None] + S - Lq)
    elif case in ("layout+mask", "online"):
        lay = L.global_local(Lq, S, (3, 4) if case == "layout+mask" else (40, 50), width=1)
        extra = torch.rand(Lq, S, generator=g) > 0.2
        kw.update(layout=lay, attn_mask=extra)
        allow = torch.tensor(lay.to_dense(Lq, S)) & extra
    assert allow.any(-1).all()
    m_ref = torch.tensor(m_np, requires_grad=True)
    kr, vr = k, v
    if Hk != Hq:
        kr, vr = k.repeat_interleave(Hq // Hk, 1), v.repeat_interleave(Hq // Hk, 1)
    sc = (q @ kr.transpose(-2, -1)) / math.sqrt(D)
    a = torch.softmax(sc.masked_fill(~allow, -math.inf), -1)
    mm = m_ref[None, :, None, None] if m_ref.dim() == 1 else m_ref[:, :, None, None]
    want = (a * mm) @ vr
    go = torch.randn(want.shape, generator=g, dtype=dt)
    gw = torch.autograd.grad(want, (q, k, v, m_ref), go)
    m_t = torch.tensor(m_np, requires_grad=True)
    got = mha_ext.scaled_dot_product_attention(q, k, v, head_mask=m_t, **kw)
    close(got.detach().numpy(), want.detach().numpy(), dtype, "output")
    gg = torch.autograd.grad(got, (q, k, v, m_t), go)
    for name, x, y in zip(("query", "key", "value", "head_mask"), gg, gw):
        close(x.numpy(), y.numpy(), dtype, name)
    npkw = {a_: (b.numpy() if isinstance(b, torch.Tensor) else b) for a_, b in kw.items()}
    arrs = [x.detach().numpy().copy() for x in (q, k, v)]
    arr = mha_ext.scaled_dot_product_attention(*arrs, head_mask=m_np, **npkw)
    close(arr, want.detach().numpy(), dtype, "output on arrays")
    for x, y in zip(arrs, (q, k, v)):
        np.testing.assert_array_equal(x, y.detach().numpy())
    # the C backward scales a copy of grad_output, never the caller's
    from mha_ext import _core
    go_np = go.numpy().copy()                 # contiguous, of the dtype: not copied by the binding
    before = go_np.copy()
    _core._sdpa_backward(*arrs, go_np, head_mask=np.broadcast_to(m_np, (B, Hq)))
    np.testing.assert_array_equal(go_np, before)


def test_sdpa_head_mask_errors():
    x = np.zeros((2, 3, 4, 8), np.float32)
    with pytest.raises(ValueError, match="head_mask must have shape"):
        mha_ext.scaled_dot_product_attention(x, x, x, head_mask=np.ones(2))
    with pytest.raises(ValueError, match="finite"):
        mha_ext.scaled_dot_product_attention(x, x, x, head_mask=[1.0, np.nan, 1.0])
    from mha_ext import _core
    with pytest.raises(ValueError, match="head_mask must have the shape"):
        _core._sdpa(x, x, x, head_mask=np.ones((3, 2)))
