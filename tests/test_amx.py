"""The float products on Intel's AMX tiles (src/amx_impl.h, ISA "amx").

Each float is cut into three bfloat16 pieces and six piece products are
summed per pair of floats: these tests check that the path is really taken
(its bits differ from AVX-512's), that it is as accurate as torch's float32
against a float64 truth on ragged shapes (sizes that are not multiples of
the tiles' 16 rows, 16 columns or 32 of depth), that an infinity or NaN in a
row of the input reaches the output as it does in torch (the row is then
computed by float FMAs) without touching the other rows' bits, and that one
in the weights sends its column to float FMAs, the other columns keeping
their tile bits at any thread count.  Skipped where the CPU or
the kernel has no AMX (an AMD EPYC, a Linux before 5.16).  No timing.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

import mha_ext
from mha_ext import MultiHeadAttention, _core

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(not _core._isa_available("amx"),
                                reason="this CPU or kernel has no AMX tiles")


@pytest.fixture
def amx():
    before = _core._get_isa()
    _core._set_isa("amx")
    yield
    _core._set_isa(before)


def _on(isa, fn):
    before = _core._get_isa()
    _core._set_isa(isa)
    try:
        return fn()
    finally:
        _core._set_isa(before)


def test_amx_is_the_default():
    # a fresh process picks it where the CPU and kernel allow (no MHA_EXT_ISA)
    env = {k: v for k, v in os.environ.items() if k != "MHA_EXT_ISA"}
    out = subprocess.run([sys.executable, "-c",
                          "import mha_ext; print(mha_ext.cpu_info()['isa'])"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["amx"]


def test_amx_path_taken(amx):
    # not the AVX-512 kernels' bits
    assert mha_ext.cpu_info()["isa"] == "amx"
    m = MultiHeadAttention(512, 8, seed=3).eval()
    x = np.random.default_rng(0).standard_normal((2, 40, 512)).astype(np.float32)
    a = m(x, need_weights=False)[0]
    b = _on("avx512", lambda: m(x, need_weights=False)[0])
    assert not np.array_equal(a, b)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


# (B, Sq, Sk, E, H, kdim, vdim): rows, columns and depths off the tiles'
# multiples, one projection of a single row and one of three depth blocks
RAGGED = [(3, 37, 21, 200, 5, 77, 45), (1, 1, 5, 96, 4, 33, 1), (2, 19, 19, 1040, 8, 1040, 1040),
          (5, 17, 50, 48, 3, 48, 48)]


@pytest.mark.parametrize("B,Sq,Sk,E,H,kdim,vdim", RAGGED)
def test_amx_accuracy_ragged(amx, B, Sq, Sk, E, H, kdim, vdim):
    # against torch's float64 on the same float32 weights: at most torch's
    # own float32 error (plus 20%: the spread between seeds), elementwise
    # within the parity tolerance
    torch.manual_seed(B * 1000 + E)
    tm = torch.nn.MultiheadAttention(E, H, batch_first=True, kdim=kdim, vdim=vdim).eval()
    t64 = torch.nn.MultiheadAttention(E, H, batch_first=True, kdim=kdim, vdim=vdim,
                                      dtype=torch.float64).eval()
    t64.load_state_dict({k: v.double() for k, v in tm.state_dict().items()})
    q, k, v = torch.randn(B, Sq, E), torch.randn(B, Sk, kdim), torch.randn(B, Sk, vdim)
    with torch.inference_mode():
        truth = t64(q.double(), k.double(), v.double(), need_weights=False)[0].numpy()
        theirs = tm(q, k, v, need_weights=False)[0].double().numpy()
    ours = MultiHeadAttention.from_torch(tm).eval()
    out = ours(q.numpy(), k.numpy(), v.numpy(), need_weights=False)[0].astype(np.float64)
    np.testing.assert_allclose(out, truth, rtol=1e-5, atol=1e-5)
    err_ours, err_torch = np.abs(out - truth).max(), np.abs(theirs - truth).max()
    assert err_ours <= 1.2 * err_torch + 1e-7, (err_ours, err_torch)


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_amx_nonfinite_input_row(amx, bad):
    # a row holding one gives torch's NaNs and infinities; the other rows
    # keep the bits they have without it
    E, H, S = 512, 8, 24
    torch.manual_seed(1)
    tm = torch.nn.MultiheadAttention(E, H, batch_first=True).eval()
    m = MultiHeadAttention.from_torch(tm).eval()
    x = np.random.default_rng(1).standard_normal((2, S, E)).astype(np.float32)
    clean = m(x, need_weights=False)[0]
    xb = x.copy()
    xb[1, 5, 17] = bad
    out = m(xb, xb, xb, need_weights=False)[0]
    with torch.inference_mode():
        t = torch.from_numpy(xb)
        ref = tm(t, t, t, need_weights=False)[0].numpy()
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    np.testing.assert_array_equal(np.isinf(out), np.isinf(ref))
    assert np.isnan(out[1]).any()
    assert np.array_equal(out[0], clean[0])  # the other batch row, bit for bit


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_amx_nonfinite_weight(amx, bad):
    # one in W_o: its output column is torch's (+-inf times a context, or
    # NaN), the others torch's within the tolerance, whatever the threads
    E, H, S = 256, 4, 20
    torch.manual_seed(2)
    tm = torch.nn.MultiheadAttention(E, H, batch_first=True).eval()
    with torch.no_grad():
        tm.out_proj.weight[7, 100] = float(bad)
    m = MultiHeadAttention.from_torch(tm).eval()
    x = np.random.default_rng(2).standard_normal((2, S, E)).astype(np.float32)
    with torch.inference_mode():
        t = torch.from_numpy(x)
        ref = tm(t, t, t, need_weights=False)[0].numpy()
    before = mha_ext.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            mha_ext.set_num_threads(n)
            outs.append(m(x, need_weights=False)[0])
    finally:
        mha_ext.set_num_threads(before)
    out = outs[0]
    np.testing.assert_array_equal(out[..., 7], ref[..., 7])  # the same infinities / NaNs
    keep = np.arange(E) != 7
    assert np.isfinite(out[..., keep]).all()
    np.testing.assert_allclose(out[..., keep], ref[..., keep], rtol=1e-5, atol=1e-5)
    for o in outs[1:]:
        assert np.array_equal(o, out, equal_nan=True)


def test_amx_training_matches_torch(amx):
    # the backward's products on the tiles too: input and weight gradients
    # (a transposed left side over 600 tokens: two depth blocks, a tail)
    E, H, B, S = 96, 4, 3, 200
    torch.manual_seed(4)
    tm = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64)
    m = MultiHeadAttention.from_torch(tm.float())
    tm = tm.double()
    rng = np.random.default_rng(4)
    x = rng.standard_normal((B, S, E)).astype(np.float32)
    g = rng.standard_normal((B, S, E)).astype(np.float32)
    ctx = m.forward_train(x, x, x, need_weights=False)
    grads = m.backward(ctx, g)
    t = torch.from_numpy(x.astype(np.float64)).requires_grad_()
    out = tm(t, t, t, need_weights=False)[0]
    out.backward(torch.from_numpy(g.astype(np.float64)))
    tol = dict(rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(grads["W_o.weight"], tm.out_proj.weight.grad.numpy(), **tol)
    np.testing.assert_allclose(grads["W_q.weight"], tm.in_proj_weight.grad.numpy()[:E], **tol)
    np.testing.assert_allclose(grads["W_v.weight"], tm.in_proj_weight.grad.numpy()[2 * E:],
                               **tol)
    dx = grads["query"] + grads["key"] + grads["value"]  # x was all three
    np.testing.assert_allclose(dx, t.grad.numpy(), **tol)


@pytest.mark.parametrize("big", [3e38, 3.4e38])  # 3.4e38 rounds to inf in bfloat16
def test_amx_infinite_row_keeps_torchs_infinities(amx, big):
    # an overflow in V's column 5 (3e38 x 10) puts +inf in that column of
    # every context row, so the output projection's rows each hold one
    # infinity: torch gives +-inf there (inf times a nonzero weight), and so
    # must we (the cut pieces would give NaN: inf - inf); the row goes to
    # the float FMAs
    E, H, S = 64, 2, 6
    torch.manual_seed(5)
    tm = torch.nn.MultiheadAttention(E, H, batch_first=True).eval()
    with torch.no_grad():
        tm.in_proj_weight[2 * E:, 17] = 1e-3
        tm.in_proj_weight[2 * E + 5, 17] = 10.0
    m = MultiHeadAttention.from_torch(tm).eval()
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, S, E)).astype(np.float32)
    xv = rng.standard_normal((1, S, E)).astype(np.float32)
    xv[0, 2, 17] = big
    out = m(x, x, xv, need_weights=False)[0]
    with torch.inference_mode():
        ref = tm(*(torch.from_numpy(a) for a in (x, x, xv)), need_weights=False)[0].numpy()
    assert np.isinf(ref).all()
    np.testing.assert_array_equal(out, ref)  # the same signed infinities



def test_amx_attention_products_stay_on_the_float_kernels(amx):
    # Q·Kᵀ and P·V of the forward take the float kernels on amx too: a
    # decode step over a cache must give the full call's bits (docs/API.md
    # §3.3), and on the tiles it would cut the whole cache into pieces at
    # every step; so the SDPA (no projection) is AVX-512's bit for bit, with
    # and without weights, many queries and one
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 4, 300, 40)).astype(np.float32)
    k = rng.standard_normal((2, 2, 250, 40)).astype(np.float32)
    v = rng.standard_normal((2, 2, 250, 40)).astype(np.float32)
    for qq in (q, q[:, :, :1]):
        a = mha_ext.scaled_dot_product_attention(qq, k, v, enable_gqa=True)
        b = _on("avx512", lambda: mha_ext.scaled_dot_product_attention(qq, k, v,
                                                                        enable_gqa=True))
        np.testing.assert_array_equal(a, b)


def test_amx_product_by_one_is_exact(amx):
    # the piece products are summed in the order lh, mh, mm, hm, hh,
    # hl, so x times 1 is x whichever side the 1 is on: one-hot value rows
    # (an embedding lookup's kind) through W_v give W_v's columns plus b_v,
    # and an identity output projection over a single key passes the
    # context through, bit for bit, as torch does
    E, H = 64, 4
    torch.manual_seed(0)
    tm = torch.nn.MultiheadAttention(E, H, batch_first=True).eval()
    # 2 - 2^-9 + 2^-23 is cut into 2, -2^-9 and 2^-23: hl first (the order
    # before) rounded 2 + 2^-23 to 2 and gave 2 - 2^-9
    g = torch.Generator().manual_seed(3)
    sign = torch.randint(0, 2, (E, E), generator=g) * 2 - 1
    scale = 2.0 ** torch.randint(-20, 21, (E, E), generator=g)
    with torch.no_grad():
        tm.in_proj_weight[2 * E:] = sign * scale * (2 - 2 ** -9 + 2 ** -23)
        tm.in_proj_bias.zero_()
        tm.out_proj.weight.copy_(torch.eye(E))
        tm.out_proj.bias.zero_()
    m = MultiHeadAttention.from_torch(tm).eval()
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 5, E)).astype(np.float32)
    v = np.zeros((3, 1, E), np.float32)
    v[np.arange(3), 0, rng.integers(0, E, 3)] = 1.0
    out = m(x, v, v, need_weights=False)[0]
    with torch.inference_mode():
        ref = tm(*(torch.from_numpy(a) for a in (x, v, v)), need_weights=False)[0].numpy()
    col = (tm.in_proj_weight[2 * E:].detach().numpy() @ v[:, 0].T).T
    np.testing.assert_array_equal(ref, np.broadcast_to(col[:, None], ref.shape))
    np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("Hkv,mask,window,save", [(4, False, None, False),
                                                (2, True, None, True),
                                                (2, False, (100, None), False)])
def test_amx_backward_cut_once_matches_each_block_alone(amx, Hkv, mask, window, save):
    # 300 queries: three blocks of the backward's 128, so each head's K and
    # V are cut into the tiles' pieces once for all of them (bwd_cut_len);
    # 100 queries: one block, each product cutting its own.  A query's
    # input gradient depends on its own row alone, so its bits must agree;
    # and every gradient must be torch's to float32 rounding.  640 keys:
    # two depth blocks of the tiles (512); a width of 40; nothing kept
    # (save_projections=False: S and the context recomputed on the tiles)
    # or everything; a window whose blocks start between multiples of 32
    # and run to the last key (those read K and V's pieces only from a
    # multiple of 32, else cut their own)
    E, H, Sk = 160, 4, 640
    m = MultiHeadAttention(E, H, n_kv_heads=Hkv, seed=2)
    rng = np.random.default_rng(4)
    q = rng.standard_normal((2, 300, E)).astype(np.float32)
    kv = rng.standard_normal((2, Sk, E)).astype(np.float32)
    g = rng.standard_normal((2, 300, E)).astype(np.float32)
    kpm = rng.random((2, Sk)) < 0.2 if mask else None

    def grads(n):
        ctx = m.forward_train(q[:, :n], kv, kv, key_padding_mask=kpm, window=window,
                              need_weights=False, save_projections=save)
        return m.backward(ctx, g[:, :n])

    full, part = grads(300), grads(100)
    np.testing.assert_array_equal(full["query"][:, :100], part["query"])
    # torch in float64 on the same parameters: the truth
    t = [torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (q, kv)]
    w = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True)
         for k, v in m.state_dict().items()}
    Dk = E // H

    def heads(x, n):
        return x.reshape(2, -1, n, Dk).transpose(1, 2)

    Q = heads(t[0] @ w["W_q.weight"].T + w["W_q.bias"], H)
    K = heads(t[1] @ w["W_k.weight"].T + w["W_k.bias"], Hkv)
    V = heads(t[1] @ w["W_v.weight"].T + w["W_v.bias"], Hkv)
    am = torch.ones(2, 1, 300, Sk, dtype=torch.bool)
    if kpm is not None:
        am &= ~torch.from_numpy(kpm)[:, None, None, :]
    if window is not None:
        i, j = torch.arange(300)[:, None], torch.arange(Sk)[None, :]
        am &= (j >= i - window[0])
    C = torch.nn.functional.scaled_dot_product_attention(Q, K, V, attn_mask=am,
                                                         enable_gqa=True)
    y = C.transpose(1, 2).reshape(2, 300, E) @ w["W_o.weight"].T + w["W_o.bias"]
    y.backward(torch.from_numpy(g).double())
    tol = {"rtol": 1e-4, "atol": 2e-5}
    np.testing.assert_allclose(full["query"], t[0].grad.numpy(), **tol)
    np.testing.assert_allclose(full["key"] + full["value"], t[1].grad.numpy(), **tol)
    for name in ("W_q.weight", "W_k.weight", "W_v.weight", "W_o.weight", "W_o.bias"):
        np.testing.assert_allclose(full[name], w[name].grad.numpy(), err_msg=name, **tol)
