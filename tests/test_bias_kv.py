"""The module's options of issue 12 against torch.nn.MultiheadAttention:
add_bias_kv and add_zero_attn (forward, weights over Sk + extra keys, every
gradient, bias_k / bias_v included; load_state_dict of torch's state dict,
from_torch), is_causal="lower_right" (against torch with the lower-right
mask written out), scale= (against torch with W_q scaled to match), in
float32 (2e-5) and float64 (1e-10); masks never block the extra keys;
state dicts, pickle, errors.

Legend: B batch, Sq query length, Sk key length, E = d_model, H = n_heads,
Dk = E / H.
"""
import math
import pickle

import numpy as np
import pytest

from mha_ext import MultiHeadAttention
from _support import require_torch

TOL = {"float32": 2e-5, "float64": 1e-10}
DTYPES = ["float32", "float64"]
E, H, B, SQ, SK = 16, 4, 2, 5, 7


@pytest.fixture(scope="module")
def torch():
    return require_torch()


def _pair(torch, dtype, **kw):
    """a torch module and our copy through load_state_dict of its state dict"""
    torch.manual_seed(0)
    t = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=getattr(torch, dtype), **kw)
    m = MultiHeadAttention(E, H, dtype=dtype, add_bias_kv=kw.get("add_bias_kv", False),
                           add_zero_attn=kw.get("add_zero_attn", False), seed=1)
    m.load_state_dict({k: v.detach().numpy() for k, v in t.state_dict().items()})
    return t, m


def _grads_torch(torch, t, q, k, v, G, GW, **call):
    out, w = t(q, k, v, need_weights=True, average_attn_weights=False, **call)
    loss = (out * G).sum() + (w * GW).sum()
    params = dict(t.named_parameters())
    names = list(params)
    gs = torch.autograd.grad(loss, [q, k, v] + [params[n] for n in names])
    return out, w, dict(zip(["query", "key", "value"] + names, gs))


def _check_grads(ours, theirs, E, tol, scale_q=1.0):
    """ours (seed keys) against torch's names"""
    ip = theirs["in_proj_weight"].numpy()
    ib = theirs["in_proj_bias"].numpy()
    pairs = [("W_q.weight", ip[:E] * scale_q), ("W_k.weight", ip[E:2 * E]),
             ("W_v.weight", ip[2 * E:]), ("W_q.bias", ib[:E] * scale_q),
             ("W_k.bias", ib[E:2 * E]), ("W_v.bias", ib[2 * E:]),
             ("W_o.weight", theirs["out_proj.weight"].numpy()),
             ("W_o.bias", theirs["out_proj.bias"].numpy())]
    for k in ("bias_k", "bias_v"):
        if k in theirs:
            pairs.append((k, theirs[k].numpy().reshape(-1)))
    for k in ("query", "key", "value"):
        pairs.append((k, theirs[k].numpy()))
    for k, want in pairs:
        np.testing.assert_allclose(ours[k], want, atol=tol, rtol=tol, err_msg=k)


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("opts", [dict(add_bias_kv=True), dict(add_zero_attn=True),
                                  dict(add_bias_kv=True, add_zero_attn=True)])
@pytest.mark.parametrize("masks", ["none", "kpm", "attn", "both"])
def test_bias_kv_zero_attn_match_torch(torch, dtype, opts, masks):
    t, m = _pair(torch, dtype, **opts)
    g = torch.Generator().manual_seed(2)
    dt = getattr(torch, dtype)
    q = torch.randn(B, SQ, E, generator=g, dtype=dt, requires_grad=True)
    k = torch.randn(B, SK, E, generator=g, dtype=dt, requires_grad=True)
    v = torch.randn(B, SK, E, generator=g, dtype=dt, requires_grad=True)
    call = {}
    if masks in ("kpm", "both"):
        kpm = torch.zeros(B, SK, dtype=torch.bool)
        kpm[0, :] = True  # batch 0: every given key blocked, only the extra keys left
        kpm[1, 2] = True
        call["key_padding_mask"] = kpm
    if masks in ("attn", "both"):
        call["attn_mask"] = torch.randn(SQ, SK, generator=g, dtype=dt)
    extra = int(opts.get("add_bias_kv", False)) + int(opts.get("add_zero_attn", False))
    G = torch.randn(B, SQ, E, generator=g, dtype=dt)
    GW = torch.randn(B, H, SQ, SK + extra, generator=g, dtype=dt)
    out, w, theirs = _grads_torch(torch, t, q, k, v, G, GW, **call)
    npcall = {a: b.numpy() for a, b in call.items()}
    qn, kn, vn = (x.detach().numpy() for x in (q, k, v))
    tol = TOL[dtype]
    ours_out, ours_w = m(qn, kn, vn, **npcall)
    assert ours_w.shape == (B, H, SQ, SK + extra) == tuple(w.shape)
    np.testing.assert_allclose(ours_out, out.detach().numpy(), atol=tol, rtol=tol)
    np.testing.assert_allclose(ours_w, w.detach().numpy(), atol=tol, rtol=tol)
    for save in (True, False):
        ctx = m.forward_train(qn, kn, vn, save_projections=save, **npcall)
        np.testing.assert_allclose(ctx.output, out.detach().numpy(), atol=tol, rtol=tol)
        _check_grads(m.backward(ctx, G.numpy(), GW.numpy()), theirs, E, tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sq,sk", [(3, 8), (6, 6), (1, 9)])
@pytest.mark.parametrize("zero_attn", [False, True])
def test_lower_right_matches_torch(torch, dtype, sq, sk, zero_attn):
    t, m = _pair(torch, dtype, add_zero_attn=zero_attn)
    g = torch.Generator().manual_seed(4)
    dt = getattr(torch, dtype)
    q = torch.randn(B, sq, E, generator=g, dtype=dt, requires_grad=True)
    k = torch.randn(B, sk, E, generator=g, dtype=dt, requires_grad=True)
    v = torch.randn(B, sk, E, generator=g, dtype=dt, requires_grad=True)
    blocked = ~torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)  # torch: True = blocked
    G = torch.randn(B, sq, E, generator=g, dtype=dt)
    GW = torch.randn(B, H, sq, sk + zero_attn, generator=g, dtype=dt)
    out, w, theirs = _grads_torch(torch, t, q, k, v, G, GW, attn_mask=blocked)
    qn, kn, vn = (x.detach().numpy() for x in (q, k, v))
    tol = TOL[dtype]
    ours_out, ours_w = m(qn, kn, vn, is_causal="lower_right")
    np.testing.assert_allclose(ours_out, out.detach().numpy(), atol=tol, rtol=tol)
    np.testing.assert_allclose(ours_w, w.detach().numpy(), atol=tol, rtol=tol)
    ctx = m.forward_train(qn, kn, vn, is_causal="lower_right")
    _check_grads(m.backward(ctx, G.numpy(), GW.numpy()), theirs, E, tol)
    if sq == sk and not zero_attn:  # square: lower-right is top-left, bit for bit
        np.testing.assert_array_equal(ours_out, m(qn, kn, vn, is_causal=True)[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [0.37, 0.0, -1.5])
def test_scale_matches_torch(torch, dtype, scale):
    # scores q·k · scale are torch's (c q)·k / sqrt(Dk) with c = scale · sqrt(Dk):
    # torch's module with W_q, b_q multiplied by c
    t, m = _pair(torch, dtype, add_bias_kv=True)
    c = scale * math.sqrt(E // H)
    with torch.no_grad():
        t.in_proj_weight[:E] *= c
        t.in_proj_bias[:E] *= c
    g = torch.Generator().manual_seed(5)
    dt = getattr(torch, dtype)
    q = torch.randn(B, SQ, E, generator=g, dtype=dt, requires_grad=True)
    k = torch.randn(B, SK, E, generator=g, dtype=dt, requires_grad=True)
    v = torch.randn(B, SK, E, generator=g, dtype=dt, requires_grad=True)
    G = torch.randn(B, SQ, E, generator=g, dtype=dt)
    GW = torch.randn(B, H, SQ, SK + 1, generator=g, dtype=dt)
    out, w, theirs = _grads_torch(torch, t, q, k, v, G, GW)
    qn, kn, vn = (x.detach().numpy() for x in (q, k, v))
    tol = TOL[dtype]
    ours_out, ours_w = m(qn, kn, vn, scale=scale)
    np.testing.assert_allclose(ours_out, out.detach().numpy(), atol=tol, rtol=tol)
    np.testing.assert_allclose(ours_w, w.detach().numpy(), atol=tol, rtol=tol)
    ctx = m.forward_train(qn, kn, vn, scale=scale)
    # dL/dW_q (ours) = c · dL/d(c W_q) (torch's)
    _check_grads(m.backward(ctx, G.numpy(), GW.numpy()), theirs, E, tol, scale_q=c)
    # the default scale given explicitly: bit for bit
    np.testing.assert_array_equal(m(qn, kn, vn)[0], m(qn, kn, vn, scale=1 / math.sqrt(E // H))[0])


def test_from_torch_and_state_dicts(torch):
    t = torch.nn.MultiheadAttention(E, H, add_bias_kv=True, add_zero_attn=True,
                                    batch_first=True, dtype=torch.float64)
    m = MultiHeadAttention.from_torch(t)
    assert m.add_bias_kv and m.add_zero_attn
    sd = m.state_dict()
    assert sd["bias_k"].shape == (E,) and "bias_v" in sd
    np.testing.assert_array_equal(sd["bias_k"], t.bias_k.detach().numpy().reshape(-1))
    m2 = MultiHeadAttention(E, H, dtype="float64", add_bias_kv=True, add_zero_attn=True)
    m2.load_state_dict(sd)  # our keys
    x = np.random.default_rng(0).standard_normal((B, SQ, E))
    np.testing.assert_array_equal(m2(x)[0], m(x)[0])
    m3 = pickle.loads(pickle.dumps(m))
    assert m3.add_bias_kv and m3.add_zero_attn
    np.testing.assert_array_equal(m3(x)[0], m(x)[0])
    assert "add_bias_kv=True" in repr(m) and "add_zero_attn=True" in repr(m)
    m.bias_k[...] = 0  # live memory
    assert np.all(m.state_dict()["bias_k"] == 0)
    plain = MultiHeadAttention(E, H)
    assert plain.bias_k is None and plain.bias_v is None and "bias_k" not in plain.state_dict()
    with pytest.raises(ValueError, match="bias_k.*add_bias_kv"):
        plain.load_state_dict(t.state_dict())
    with pytest.raises(AttributeError, match="add_bias_kv"):
        plain.bias_k = np.zeros(E)


def test_extra_keys_never_blocked():
    # every given key blocked: only the zero key is left, weight 1, context 0
    m = MultiHeadAttention(E, H, add_zero_attn=True, dtype="float64", seed=0)
    x = np.random.default_rng(1).standard_normal((B, SQ, E))
    out, w = m(x, mask=np.ones((SQ, SQ)), is_causal=True)
    assert np.all(w[..., -1] == 1) and np.all(w[..., :-1] == 0)
    np.testing.assert_array_equal(out, np.broadcast_to(m.W_o.bias, out.shape))


def test_errors():
    m = MultiHeadAttention(E, H, seed=0)
    x = np.ones((B, SQ, E), np.float32)
    with pytest.raises(TypeError, match="is_causal"):
        m(x, is_causal="upper_left")
    with pytest.raises(TypeError, match="scale"):
        m(x, scale="1")
    with pytest.raises(TypeError, match="scale"):
        m(x, scale=np.ones(2))
    with pytest.raises(TypeError, match="add_bias_kv"):
        MultiHeadAttention(E, H, add_bias_kv=[1, 2])
    with pytest.raises(TypeError, match="is_causal"):
        m._forward(x, x, x, is_causal="yes")
    with pytest.raises(TypeError, match="scale"):
        m._forward(x, x, x, scale="1")
    with pytest.raises(NotImplementedError, match="add_bias_kv"):
        MultiHeadAttention(E, H, add_bias_kv=True).trace(x)


def test_torch_module_takes_scale_and_lower_right(torch):
    # mha_ext.torch.MultiHeadAttention passes both to the core, forward and backward
    import mha_ext.torch as mt
    t = mt.MultiHeadAttention(E, H, dtype=torch.float64, seed=3)
    m = MultiHeadAttention(E, H, dtype="float64", seed=3)
    g = torch.Generator().manual_seed(6)
    q = torch.randn(B, 3, E, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, 8, E, generator=g, dtype=torch.float64, requires_grad=True)
    out, w = t(q, k, k, is_causal="lower_right", scale=0.25)
    ref, ref_w = m(q.detach().numpy(), k.detach().numpy(), is_causal="lower_right", scale=0.25)
    np.testing.assert_allclose(out.detach().numpy(), ref, atol=1e-12)
    np.testing.assert_allclose(w.detach().numpy(), ref_w, atol=1e-12)
    G = torch.randn(B, 3, E, generator=g, dtype=torch.float64)
    (gq,) = torch.autograd.grad(out, (q,), G)
    ctx = m.forward_train(q.detach().numpy(), k.detach().numpy(), is_causal="lower_right",
                          scale=0.25)
    np.testing.assert_allclose(gq.numpy(), m.backward(ctx, G.numpy())["query"], atol=1e-12)
