"""The backward pass: gradients against torch autograd, masked rows, the
saved projections and the context's copies.  The dropout mask replayed, the
torch adapter and the training example: tests/test_backward_dropout.py.

Legend: B batch, Sq/Sk query/key length, E = d_model, H = n_heads, Dk = E/H.
Contract (the issue): float64 within 1e-9 and float32 within 1e-4, relative
to the largest entry of each reference gradient.
"""
import math
import os
import pathlib
import subprocess
import sys
import threading

import numpy as np
import pytest

import mha_ext
from _support import need

# the folder holding the mha_ext the tests imported (installed or built in place)
PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(mha_ext.__file__)))

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOL = {"float32": 1e-4, "float64": 1e-9}
KEYS = ("W_q.weight", "W_q.bias", "W_k.weight", "W_k.bias",
        "W_v.weight", "W_v.bias", "W_o.weight", "W_o.bias")


def need_torch():
    """torch, or a skip on a developer machine; a failure when CI is set."""
    return need("torch")


def rel_err(ours, ref, scale=0.0):
    """max |ours - ref| / max |ref| (or / scale when that is larger)."""
    ours = np.asarray(ours, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    scale = max(float(np.abs(ref).max(initial=0.0)), scale, 1e-30)
    return float(np.abs(ours - ref).max(initial=0.0)) / scale


def assert_grads(ours, ref, dtype, what=""):
    """Every gradient in ref (name -> array) matches ours within the contract.
    A bias is measured on the scale of its weight's gradient: W_k.bias's
    gradient is exactly 0 in theory (a constant added to every score of a row
    does not change the softmax), so only rounding noise is left to compare."""
    worst = {}
    for name, r in ref.items():
        scale = 0.0
        if name.endswith(".bias"):
            scale = float(np.abs(ref[name.replace(".bias", ".weight")]).max())
        e = rel_err(ours[name], r, scale)
        worst[name] = e
        assert e <= TOL[dtype], f"{what} {name}: relative error {e:.3e} > {TOL[dtype]}"
    return max(worst.values())


def torch_reference(torch, state, H, query, key, value, *, block=None, add=None,
                    causal=False, keep=None, p=0.0, zero_rows=False, grad_out=None,
                    grad_weights=None, average=False):
    """Attention with torch ops and autograd; returns the gradients (NumPy) of
    L = <out, grad_out> + <weights, grad_weights> keyed like ours.

    block: bool (B or 1, H or 1, Sq, Sk), True = blocked; add: float, added;
    keep: the dropout mask (1 kept, 0 dropped), scaled by 1/(1-p);
    zero_rows: a fully blocked row has zero weights (a softmax that is safe
    for such rows) instead of NaN."""
    params = {k: torch.tensor(v, requires_grad=True) for k, v in state.items()}
    q = torch.tensor(query, requires_grad=True)
    k = torch.tensor(key, requires_grad=True)
    v = torch.tensor(value, requires_grad=True)

    def lin(x, n):
        y = x @ params[f"{n}.weight"].T
        return y + params[f"{n}.bias"] if f"{n}.bias" in params else y

    B, Sq, E = q.shape
    Sk, Dk = k.shape[1], E // H
    Q = lin(q, "W_q").view(B, Sq, H, Dk).transpose(1, 2)
    K = lin(k, "W_k").view(B, Sk, H, Dk).transpose(1, 2)
    V = lin(v, "W_v").view(B, Sk, H, Dk).transpose(1, 2)
    S = Q @ K.transpose(-2, -1) / math.sqrt(Dk)
    if add is not None:
        S = S + torch.tensor(add)
    blocked = torch.zeros(S.shape, dtype=torch.bool)
    if block is not None:
        blocked = blocked | torch.tensor(block)
    if causal:
        blocked = blocked | torch.ones(Sq, Sk, dtype=torch.bool).triu(1)
    S = S.masked_fill(blocked, -math.inf)
    if zero_rows:
        m = S.amax(-1, keepdim=True).detach()
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        e = torch.exp(S - m)
        s = e.sum(-1, keepdim=True)
        P = e / torch.where(s == 0, torch.ones_like(s), s)
    else:
        P = torch.softmax(S, dim=-1)
    A = P if keep is None else P * torch.tensor(keep) / (1.0 - p)
    ctx = (A @ V).transpose(1, 2).reshape(B, Sq, E)
    out = lin(ctx, "W_o")
    loss = (out * torch.tensor(grad_out)).sum()
    if grad_weights is not None:
        w = A.mean(1) if average else A
        loss = loss + (w * torch.tensor(grad_weights)).sum()
    loss.backward()
    grads = {n: t.grad.numpy() for n, t in params.items()}
    grads.update(query=q.grad.numpy(), key=k.grad.numpy(), value=v.grad.numpy())
    return out.detach().numpy(), grads


def make(E, H, dtype, seed=0, **kw):
    return mha_ext.MultiHeadAttention(E, H, dtype=dtype, seed=seed, **kw)


def inputs(rng, B, Sq, Sk, E, dtype, kdim=None, vdim=None):
    q = rng.standard_normal((B, Sq, E)).astype(dtype)
    k = rng.standard_normal((B, Sk, kdim or E)).astype(dtype)
    v = rng.standard_normal((B, Sk, vdim or E)).astype(dtype)
    return q, k, v


# ---------------------------------------------------------------- vs torch

@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("masked", [False, True])
def test_grads_match_torch_seed_module(dtype, masked):
    """The seed configuration (B=2, S=10, E=512, H=8) against the seed
    notebook's module in torch with identical weights, cross-attention
    inputs, the gradient of the weights included."""
    torch = need_torch()
    sys.path.insert(0, str(ROOT / "tests"))
    import torch_seed

    ref = torch_seed.make_seed_module(512, 8, seed=3, dtype=dtype)
    ours = make(512, 8, dtype).eval()
    ours.load_state_dict({k: v.detach().numpy() for k, v in ref.state_dict().items()})
    rng = np.random.default_rng(1)
    q, k, v = inputs(rng, 2, 10, 10, 512, dtype)
    mask = np.triu(np.ones((10, 10), dtype=dtype), 1) if masked else None
    g_out = rng.standard_normal((2, 10, 512)).astype(dtype)
    g_w = rng.standard_normal((2, 8, 10, 10)).astype(dtype)

    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    out_t, w_t = ref(tq, tk, tv, None if mask is None else torch.tensor(mask))
    ((out_t * torch.tensor(g_out)).sum() + (w_t * torch.tensor(g_w)).sum()).backward()
    want = {n: p.grad.numpy() for n, p in ref.named_parameters()}
    want.update(query=tq.grad.numpy(), key=tk.grad.numpy(), value=tv.grad.numpy())

    ctx = ours.forward_train(q, k, v, mask=mask)
    assert rel_err(ctx.output, out_t.detach().numpy()) <= TOL[dtype]
    grads = ours.backward(ctx, g_out, g_w)
    assert set(grads) == set(KEYS) | {"query", "key", "value"}
    for name, g in grads.items():
        assert g.dtype == np.dtype(dtype) and g.shape == want[name].shape
    assert_grads(grads, want, dtype, f"seed module {dtype}")


@pytest.mark.parametrize("isa", [n for n in ("portable", "avx2", "avx512", "amx")
                                 if mha_ext._core._isa_available(n)])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_deep_weight_gradients_match_torch(isa, dtype):
    """The weight gradients dW = dYᵀ·X sum over the B·Sq rows: at B 3,
    S 300 a depth of 900, two blocks of 512 and 388, which the 256-bit and
    portable kernels run in sub-blocks of 256, each going on from the one
    before's partial sums (gemm_impl.h's gemm_nest_nb); E 40 leaves ragged
    panels.  Against torch autograd on every ISA this CPU has."""
    torch = need_torch()
    before = mha_ext._core._get_isa()
    mha_ext._core._set_isa(isa)
    try:
        ours = make(40, 2, dtype, seed=5)
        rng = np.random.default_rng(7)
        q, k, v = inputs(rng, 3, 300, 300, 40, dtype)
        g_out = rng.standard_normal((3, 300, 40)).astype(dtype)
        ctx = ours.forward_train(q, k, v, need_weights=False)
        grads = ours.backward(ctx, g_out)
    finally:
        mha_ext._core._set_isa(before)
    state = {n: np.asarray(a) for n, a in ours.state_dict().items()}
    out, want = torch_reference(torch, state, 2, q, k, v, grad_out=g_out)
    assert rel_err(ctx.output, out) <= TOL[dtype]
    assert_grads(grads, want, dtype, f"deep products {isa} {dtype}")


@pytest.mark.parametrize("isa", [n for n in ("portable", "avx2", "avx512", "amx")
                                 if mha_ext._core._isa_available(n)])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("kib", [2, 4])
def test_packed_weight_input_gradients_match_torch(isa, dtype, kib):
    """The input gradients dX = dY·W where W's rows lie 2 KiB apart (E 512
    float32, E 256 float64): the narrow kernels pack W's blocks (asking for
    its rows ahead of the copy) in tiles of every row by a packed block's
    columns, two per thread at 2 threads (bwd_tasks_impl.h's prod_add);
    4 KiB apart (E 1024, 512), the wide kernel (AVX-512) packs them too,
    its 80 rows of dY being more than 48 (gemm_impl.h's pack_far).
    Against torch autograd on every ISA this CPU has."""
    torch = need_torch()
    E = (512 if dtype == "float32" else 256) * kib // 2
    before, threads = mha_ext._core._get_isa(), mha_ext.get_num_threads()
    mha_ext._core._set_isa(isa)
    mha_ext.set_num_threads(2)
    try:
        ours = make(E, 4, dtype, seed=6)
        rng = np.random.default_rng(8)
        q, k, v = inputs(rng, 2, 40, 40, E, dtype)
        g_out = rng.standard_normal((2, 40, E)).astype(dtype)
        ctx = ours.forward_train(q, k, v, need_weights=False)
        grads = ours.backward(ctx, g_out)
    finally:
        mha_ext._core._set_isa(before)
        mha_ext.set_num_threads(threads)
    state = {n: np.asarray(a) for n, a in ours.state_dict().items()}
    out, want = torch_reference(torch, state, 4, q, k, v, grad_out=g_out)
    assert rel_err(ctx.output, out) <= TOL[dtype]
    assert_grads(grads, want, dtype, f"packed W {isa} {dtype}")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_cross_attention_kdim_vdim_and_torch_masks(dtype):
    """Sq != Sk, kdim and vdim, a float attn_mask (with -inf), a bool
    key_padding_mask, averaged weights with their gradient; shapes large
    enough for several query blocks and threads."""
    torch = need_torch()
    B, Sq, Sk, E, H, Ek, Ev = 3, 70, 45, 32, 4, 24, 20
    ours = make(E, H, dtype, kdim=Ek, vdim=Ev).eval()
    rng = np.random.default_rng(2)
    q, k, v = inputs(rng, B, Sq, Sk, E, dtype, Ek, Ev)
    attn = rng.standard_normal((Sq, Sk)).astype(dtype)
    attn[rng.random((Sq, Sk)) < 0.1] = -np.inf
    pad = np.zeros((B, Sk), dtype=bool)
    pad[1, -5:] = True
    g_out = rng.standard_normal((B, Sq, E)).astype(dtype)
    g_w = rng.standard_normal((B, Sq, Sk)).astype(dtype)
    ctx = ours.forward_train(q, k, v, attn_mask=attn, key_padding_mask=pad,
                             average_weights=True)
    grads = ours.backward(ctx, g_out, g_w)
    out, want = torch_reference(torch, ours.state_dict(), H, q, k, v, add=attn,
                                block=pad[:, None, None, :], grad_out=g_out,
                                grad_weights=g_w, average=True)
    assert rel_err(ctx.output, out) <= TOL[dtype]
    assert_grads(grads, want, dtype, "cross-attention")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_causal_no_bias_unbatched(dtype):
    torch = need_torch()
    E, H, S = 16, 2, 9
    ours = make(E, H, dtype, bias=False).eval()
    rng = np.random.default_rng(3)
    x = rng.standard_normal((S, E)).astype(dtype)
    g_out = rng.standard_normal((S, E)).astype(dtype)
    ctx = ours.forward_train(x, is_causal=True, need_weights=False)
    assert ctx.weights is None
    grads = ours.backward(ctx, g_out)
    assert "W_q.bias" not in grads and grads["query"].shape == (S, E)
    _, want = torch_reference(torch, ours.state_dict(), H, x[None], x[None], x[None],
                              causal=True, grad_out=g_out[None])
    for n in ("query", "key", "value"):
        want[n] = want[n][0]
    assert_grads(grads, want, dtype, "causal unbatched")
    # self-attention: the gradient of x is the sum of the three
    total = grads["query"] + grads["key"] + grads["value"]
    assert total.shape == x.shape


def test_threads_do_not_change_the_gradients(restore_threads):
    ours = make(64, 4, "float64", dropout=0.2)
    rng = np.random.default_rng(4)
    q, k, v = inputs(rng, 2, 150, 300, 64, "float64")
    g_out = rng.standard_normal(q.shape)
    results = []
    for n in (1, 2, 3):
        mha_ext.set_num_threads(n)
        ctx = ours.forward_train(q, k, v, dropout_counter=7, is_causal=True)
        results.append(ours.backward(ctx, g_out))
    for r in results[1:]:
        for name in r:
            np.testing.assert_array_equal(r[name], results[0][name], err_msg=name)


# ---------------------------------------------------------------- masked rows

@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fully_masked_rows_zero(dtype):
    """masked_rows="zero": a query that sees no key has zero weights, no NaN
    anywhere, and gives the gradients of a softmax that is 0 on that row."""
    torch = need_torch()
    ours = make(16, 2, dtype).eval()
    rng = np.random.default_rng(9)
    q, k, v = inputs(rng, 2, 5, 6, 16, dtype)
    mask = np.zeros((2, 1, 5, 6), dtype=bool)
    mask[0, 0, 1, :] = True   # row 1 of batch 0 sees nothing
    mask[1, 0, 4, :] = True
    mask[1, 0, 0, 2] = True
    g_out = rng.standard_normal(q.shape).astype(dtype)
    g_w = rng.standard_normal((2, 2, 5, 6)).astype(dtype)
    ctx = ours.forward_train(q, k, v, mask=mask, masked_rows="zero")
    assert not np.isnan(ctx.output).any() and not ctx.weights[0, :, 1].any()
    grads = ours.backward(ctx, g_out, g_w)
    for name, g in grads.items():
        assert np.isfinite(g).all(), name
    # a blocked query row gets no gradient (its output is W_o.bias alone)
    assert not grads["query"][0, 1].any() and not grads["query"][1, 4].any()
    _, want = torch_reference(torch, ours.state_dict(), 2, q, k, v, block=mask,
                              zero_rows=True, grad_out=g_out, grad_weights=g_w)
    assert_grads(grads, want, dtype, "zero rows")


def test_fully_masked_rows_nan_and_no_keys():
    ours = make(8, 2, "float64").eval()
    rng = np.random.default_rng(10)
    q, k, v = inputs(rng, 1, 3, 4, 8, "float64")
    mask = np.zeros((3, 4), dtype=bool)
    mask[2] = True
    ctx = ours.forward_train(q, k, v, mask=mask)
    g = ours.backward(ctx, np.ones_like(ctx.output))
    assert np.isnan(g["W_o.weight"]).all() and np.isnan(g["key"]).any()
    # Sk == 0: every row blocked
    e = np.zeros((1, 0, 8))
    ctx = ours.forward_train(q, e, e, masked_rows="zero")
    g = ours.backward(ctx, np.ones_like(ctx.output))
    assert g["key"].shape == (1, 0, 8) and not g["query"].any()
    np.testing.assert_array_equal(g["W_o.bias"], np.full(8, 3.0))


def test_empty_batch_and_queries():
    ours = make(8, 2, "float32")
    for B, Sq in ((0, 3), (2, 0)):
        q = np.zeros((B, Sq, 8), np.float32)
        kv = np.ones((B, 4, 8), np.float32)
        ctx = ours.forward_train(q, kv, kv)
        g = ours.backward(ctx, np.zeros_like(ctx.output))
        assert g["query"].shape == (B, Sq, 8) and g["key"].shape == (B, 4, 8)
        assert not any(x.any() for x in g.values())


# ---------------------------------------------------------------- API

def test_backward_uses_the_forward_parameters():
    """ctx holds a copy of the parameters: an optimiser step between forward
    and backward does not change the gradients."""
    ours = make(8, 2, "float64")
    x = np.random.default_rng(11).standard_normal((2, 3, 8))
    ctx = ours.forward_train(x)
    g1 = ours.backward(ctx, np.ones_like(ctx.output))
    ours.W_q.weight[...] += 1.0
    g2 = ours.backward(ctx, np.ones_like(ctx.output))
    for name in g1:
        np.testing.assert_array_equal(g1[name], g2[name])


@pytest.mark.parametrize("cache_mb, keeps", [("", True), ("0", False), ("1", False),
                                             ("64", True)])
def test_p_kept_within_a_quarter_of_the_cache(cache_mb, keeps):
    """P four times the size of Q, K, V and ctx (H 4, Sq 70, Sk 90, E 64,
    B 3, float64: 2.4 MB) is kept only while it is at most a quarter of the
    output cache's limit (MHA_EXT_CACHE_MB: 0 turns the cache off, 1 MiB is
    too small, 64 MiB and the default 1 GiB hold it)"""
    code = ("import numpy as np, mha_ext\n"
            "m = mha_ext.MultiHeadAttention(64, 4, dtype='float64')\n"
            "q = np.ones((3, 70, 64)); k = np.ones((3, 90, 64))\n"
            "print(m.forward_train(q, k, k)._saved[4] is not None,"
            " mha_ext.memory_info()['limit_bytes'])\n")
    env = dict(os.environ, MHA_EXT_CACHE_MB=cache_mb)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    kept, limit = out.stdout.split()
    if limit == "0" and cache_mb != "0":  # a sanitizer build: the cache is always off
        keeps = False
    assert kept == str(keeps), (cache_mb, limit)


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("heads", [16, 4, 2])
@pytest.mark.parametrize("masked_rows", ["nan", "zero"])
def test_saved_projections_match_recomputing(need_weights, heads, masked_rows):
    """forward_train keeps Q, K, V and the context by default, and the softmax
    P when it is no larger than those four (H·Sq·Sk <= 2·E·(Sq + Sk): here
    2·70·90 <= 2·64·160), or at most four times as large within a quarter of
    the output cache's limit (4·70·90; with the cache off, as in a sanitizer
    build, not kept), never when larger (16·70·90 > 4·2·64·160); the
    backward reads them.
    save_projections=False recomputes them instead: the gradients agree to
    rounding, and calling backward twice on one ctx gives the same gradients
    (the kept arrays are only read).  Dropout, a mask and a fully blocked
    query row are in play."""
    ours = make(64, heads, "float64", kdim=40, vdim=24)
    rng = np.random.default_rng(12)
    q = rng.standard_normal((3, 70, 64))
    k = rng.standard_normal((3, 90, 40))
    v = rng.standard_normal((3, 90, 24))
    g_out = rng.standard_normal(q.shape)
    mask = rng.random((70, 90)) < 0.2
    mask[5] = True  # query 5 sees no key
    opts = dict(attn_mask=mask, need_weights=need_weights, dropout=0.3, dropout_counter=5,
                masked_rows=masked_rows)
    kept = ours.forward_train(q, k, v, **opts)
    fresh = ours.forward_train(q, k, v, save_projections=False, **opts)
    assert kept._saved is not None and fresh._saved is None
    # (Q, K, V, ctx, P | None): P kept only when no larger than the four
    # H 4: P is 3·4·70·90 float64 (1.2 times the four), kept while 4 times its
    # bytes fit the output cache's limit
    keeps_p = heads == 2 or (heads == 4 and
                             4 * 3 * 4 * 70 * 90 * 8 <= mha_ext.memory_info()["limit_bytes"])
    assert len(kept._saved) == 5 and (kept._saved[4] is not None) == keeps_p
    Q, K, V, C = kept._saved[:4]  # per head: (B, H, Sq, Dk), (B, H, Dk, Sk), (B, H, Sk, Dk)
    assert Q.shape == (3, heads, 70, 64 // heads) and K.shape == (3, heads, 64 // heads, 90)
    assert V.shape == (3, heads, 90, 64 // heads) and C.shape == (3, 70, 64)
    W = ours.state_dict()
    np.testing.assert_allclose(Q.transpose(0, 2, 1, 3).reshape(3, 70, 64),
                               q @ W["W_q.weight"].T + W["W_q.bias"], atol=1e-12)
    np.testing.assert_allclose(K.transpose(0, 3, 1, 2).reshape(3, 90, 64),
                               k @ W["W_k.weight"].T + W["W_k.bias"], atol=1e-12)
    np.testing.assert_allclose(V.transpose(0, 2, 1, 3).reshape(3, 90, 64),
                               v @ W["W_v.weight"].T + W["W_v.bias"], atol=1e-12)
    np.testing.assert_allclose(C @ W["W_o.weight"].T + W["W_o.bias"], kept.output, atol=1e-12,
                               equal_nan=True)
    np.testing.assert_allclose(kept.output, fresh.output, atol=1e-12, equal_nan=True)
    if need_weights:
        np.testing.assert_allclose(kept.weights, fresh.weights, atol=1e-14, equal_nan=True)
    if keeps_p:  # P: the softmax before dropout, the weights of the call without it
        P = kept._saved[4]
        want = ours.forward_train(q, k, v, attn_mask=mask, dropout=0.0,
                                  masked_rows=masked_rows).weights
        np.testing.assert_allclose(P, want, atol=1e-14, equal_nan=True)
    g1 = ours.backward(kept, g_out)
    g2 = ours.backward(kept, g_out)
    g3 = ours.backward(fresh, g_out)
    for name in g1:
        np.testing.assert_array_equal(g1[name], g2[name], err_msg=name)
        nan = np.isnan(g3[name])  # the blocked row's NaN output reaches the gradients
        assert (np.isnan(g1[name]) == nan).all(), name
        assert nan.any() == (masked_rows == "nan" and name != "W_o.bias"), name
        assert rel_err(np.where(nan, 0, g1[name]), np.where(nan, 0, g3[name]), 1e-3) < 1e-12, name


def test_context_keeps_copies_of_the_inputs():
    """The forward copies its inputs (in C, as its projections read them):
    writing into query, key or value after forward_train does not change the
    gradients, and the context never holds the caller's own arrays."""
    ours = make(16, 2, "float32", kdim=12, vdim=8)
    rng = np.random.default_rng(21)
    q = rng.standard_normal((2, 5, 16)).astype(np.float32)
    k = rng.standard_normal((2, 7, 12)).astype(np.float32)
    v = rng.standard_normal((2, 7, 8)).astype(np.float32)
    g_out = rng.standard_normal(q.shape).astype(np.float32)
    ctx = ours.forward_train(q, k, v)
    for mine, kept in ((q, ctx._query), (k, ctx._key), (v, ctx._value)):
        assert not np.shares_memory(mine, kept)
        np.testing.assert_array_equal(mine, kept)
    assert not np.shares_memory(ctx._params, ours._block())
    np.testing.assert_array_equal(ctx._params, ours._block())
    g1 = ours.backward(ctx, g_out)
    for x in (q, k, v):
        x += 1.0
    g2 = ours.backward(ctx, g_out)
    for name in g1:
        np.testing.assert_array_equal(g1[name], g2[name], err_msg=name)


@pytest.mark.parametrize("which", ["qkv", "qk", "kv"])
def test_context_copies_an_aliased_input_once(which):
    """Self-attention (query is key is value, or two of them the same
    array) copies that array once: the context's copies are one array, not
    the caller's, and writing into it after forward_train changes no
    gradient (which equal those of three distinct equal arrays)."""
    ours = make(16, 2, "float32")
    rng = np.random.default_rng(22)
    x = rng.standard_normal((2, 6, 16)).astype(np.float32)
    y = rng.standard_normal((2, 6, 16)).astype(np.float32)
    q, k, v = {"qkv": (x, x, x), "qk": (x, x, y), "kv": (y, x, x)}[which]
    g_out = rng.standard_normal((2, 6, 16)).astype(np.float32)
    originals = (q.copy(), k.copy(), v.copy())
    ctx = ours.forward_train(q, k, v)
    kept = (ctx._query, ctx._key, ctx._value)
    for mine, copy in zip((q, k, v), kept):
        assert not np.shares_memory(mine, copy)
        np.testing.assert_array_equal(mine, copy)
    same = {"qkv": [(0, 1), (0, 2)], "qk": [(0, 1)], "kv": [(1, 2)]}[which]
    for i, j in same:
        assert kept[i] is kept[j]
    g1 = ours.backward(ctx, g_out)
    x += 1.0
    y += 1.0
    g2 = ours.backward(ctx, g_out)
    distinct = ours.backward(ours.forward_train(*originals), g_out)
    for name in g1:
        np.testing.assert_array_equal(g1[name], g2[name], err_msg=name)
        np.testing.assert_array_equal(g1[name], distinct[name], err_msg=name)


def test_errors():
    ours = make(8, 2, "float32")
    x = np.zeros((2, 3, 8), np.float32)
    ctx = ours.forward_train(x, need_weights=False)
    with pytest.raises(ValueError, match="grad_output"):
        ours.backward(ctx, np.zeros((2, 3, 7)))
    with pytest.raises(ValueError, match="need_weights"):
        ours.backward(ctx, np.zeros((2, 3, 8)), np.zeros((2, 2, 3, 3)))
    with pytest.raises(ValueError, match="different module"):
        make(8, 2, "float32", seed=1).backward(ctx, np.zeros((2, 3, 8)))
    with pytest.raises(TypeError):
        ours.backward("ctx", np.zeros((2, 3, 8)))
    with pytest.raises(TypeError):
        ours.forward_train(np.zeros((2, 3, 8), complex))
    with pytest.raises(ValueError):
        ours.forward_train(x, np.zeros((2, 3, 5)))
    with pytest.raises(KeyError):
        ours.forward_train(x, params={"W_q.weight": np.zeros((8, 8))})
    # a parameter of the right size in another shape (kdim != d_model: W_k
    # transposed) is refused, not read in the wrong order
    cross = mha_ext.MultiHeadAttention(4, 2, kdim=6, dtype="float64", seed=0)
    p = {k: np.array(v) for k, v in cross.state_dict().items()}
    p["W_k.weight"] = p["W_k.weight"].T
    with pytest.raises(ValueError, match=r"W_k.weight'\] must have shape \(4, 6\), got \(6, 4\)"):
        cross.forward_train(np.ones((1, 3, 4)), np.ones((1, 5, 6)), np.ones((1, 5, 4)), params=p)


def test_concurrent_training_calls(restore_threads):
    """Forward/backward pairs from several Python threads at once each give
    what they give alone (no state shared between calls)."""
    ours = make(32, 4, "float64", dropout=0.1)
    rng = np.random.default_rng(12)
    xs = [rng.standard_normal((2, 40, 32)) for _ in range(4)]
    alone = []
    for i, x in enumerate(xs):
        c = ours.forward_train(x, dropout_counter=100 + i)
        alone.append(ours.backward(c, np.ones_like(c.output)))
    got = [None] * 4

    def work(i):
        for _ in range(3):
            c = ours.forward_train(xs[i], dropout_counter=100 + i)
            got[i] = ours.backward(c, np.ones_like(c.output))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for a, g in zip(alone, got):
        for name in a:
            np.testing.assert_array_equal(a[name], g[name])
