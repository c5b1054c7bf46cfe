"""Keys whose transposed rows get a padded stride, against torch.

When Sk keys of Kᵀ would lie a multiple of 2 KiB apart (512 float32 keys, 256
float64 ones) on a narrow kernel (AVX2, portable), or a multiple of 4 KiB on
a wide one (AVX-512: 1024 float32 keys, 512 float64 ones), the module's
forward and the SDPA entry point lay Kᵀ out a line further apart
(internal.h's mha_kt_ld) and SDPA then reads V with its own stride
(attend_impl.h's vld).  The other tests use fewer keys, so only these reach
that layout; a stride mixed up between K and V gives wrong numbers here.
Each ISA the machine has runs, at 2 KiB and at 4 KiB (the plain stride on
AVX-512 at 2 KiB: the comparison holds there too).
"""
import numpy as np
import pytest

import mha_ext

TOL = {"float32": 2e-5, "float64": 1e-10}
KEYS = {"float32": 512, "float64": 256}  # 2 KiB of one row of Kᵀ


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("keys", ["one", "two"], ids=["S-2KiB", "S-4KiB"])
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_module_forward(torch, isa, dtype, keys, need_weights, causal):
    S = KEYS[dtype] * (1 if keys == "one" else 2)
    E, H, B = 32, 2, 2
    tdt = getattr(torch, dtype)
    torch.manual_seed(0)
    tm = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=tdt).eval()
    x = torch.randn(B, S, E, dtype=tdt)
    mask = torch.triu(torch.ones(S, S, dtype=torch.bool), 1) if causal else None
    with torch.inference_mode():
        want, want_w = tm(x, x, x, attn_mask=mask, need_weights=need_weights,
                          average_attn_weights=False)
    ours = mha_ext.MultiHeadAttention.from_torch(tm).eval()
    xn = x.numpy()
    out, w = ours(xn, xn, xn, is_causal=causal, need_weights=need_weights)
    tol = TOL[dtype]
    np.testing.assert_allclose(out, want.numpy(), atol=tol, rtol=tol)
    if need_weights:
        np.testing.assert_allclose(w, want_w.numpy(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 2)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("keys", ["one", "two"], ids=["S-2KiB", "S-4KiB"])
def test_sdpa(torch, isa, dtype, hq, hkv, causal, keys):
    S = KEYS[dtype] * (1 if keys == "one" else 2)
    L, D, Dv = 37, 16, 8  # Dv != D: V's rows differ from Kᵀ's
    g = torch.Generator().manual_seed(1)
    tdt = getattr(torch, dtype)
    q = torch.randn(2, hq, L, D, generator=g, dtype=tdt)
    k = torch.randn(2, hkv, S, D, generator=g, dtype=tdt)
    v = torch.randn(2, hkv, S, Dv, generator=g, dtype=tdt)
    kw = dict(is_causal=causal, enable_gqa=hq != hkv)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw).numpy()
    got = mha_ext.scaled_dot_product_attention(q.numpy(), k.numpy(), v.numpy(), **kw)
    tol = TOL[dtype]
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("chunks", [[1, 24, 60, 15], [48, 1, 51]], ids=["1-24-60", "48-1-51"])
def test_cache_capacity_4kib(isa, dtype, chunks):
    """A key/value cache whose capacity puts Kᵀ's rows 4 KiB apart (1024
    float32 keys, 512 float64): S = Q·Kᵀ reads the cache's Kᵀ in place for
    a chunk of fewer than 48 new tokens and packs it for more on the wide
    kernel (gemm_impl.h's pack_far), at 2 KiB on a narrow one whatever the
    chunk.  Decoding in chunks gives the full causal call's bits (the
    same sums: the layout and the packing change no order), on every ISA
    this CPU has."""
    cap = KEYS[dtype] * 2
    m = mha_ext.MultiHeadAttention(64, 4, dtype=dtype, seed=3).eval()
    x = np.random.default_rng(4).standard_normal((2, sum(chunks), 64)).astype(dtype)
    full, _ = m(x, is_causal=True, need_weights=False)
    cache = m.new_cache(2, cap)
    outs, L = [], 0
    for n in chunks:
        o, _ = m(x[:, L:L + n], cache=cache, need_weights=False)
        outs.append(o)
        L += n
    got = np.concatenate(outs, axis=1)
    assert np.array_equal(got, full), np.abs(got - full).max()
