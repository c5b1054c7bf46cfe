"""Batch invariance (issue 17), a documented guarantee (docs/API.md): on a
given instruction set, a query row's output (and weights) are the same bits
whatever the batch size, whatever the other rows of the batch hold, however
far the sequence is padded beyond the row's causal prefix, and at any
thread count.  torch makes no such promise (its users file bugs about
results that change with the batch size).

Each test computes the same row two ways and asks for equal bits: a test
that fails on any change of the order of a sum (before issue 17's fix, E64
S10 differed by 9.7e-8: small shapes took a different projection kernel).

Legend: B batch, S sequence length, E = d_model, H = n_heads.
"""
import numpy as np
import pytest

import mha_ext
from mha_ext import MultiHeadAttention

SHAPES = [(64, 4, 10), (64, 1, 3), (96, 8, 17), (512, 8, 10), (512, 8, 130),
          (1088, 8, 6)]  # E, H, S (1088: two depth blocks of the projections)


def _data(B, S, E, dtype, seed=0):
    return np.random.default_rng(seed).standard_normal((B, S, E)).astype(dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("E,H,S", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_batch_invariance_batch_size(isa, dtype, E, H, S, causal):
    # each batch row alone gives the bits it gives inside a batch of 5
    m = MultiHeadAttention(E, H, dtype=dtype, seed=1).eval()
    x = _data(5, S, E, dtype)
    out, w = m(x, is_causal=causal)
    for b in range(5):
        ob, wb = m(x[b:b + 1], is_causal=causal)
        assert np.array_equal(ob[0], out[b]), (b, np.abs(ob[0] - out[b]).max())
        assert np.array_equal(wb[0], w[b])
    # and without weights (the online-softmax path)
    out2, _ = m(x, is_causal=causal, need_weights=False)
    ob, _ = m(x[2:3], is_causal=causal, need_weights=False)
    assert np.array_equal(ob[0], out2[2])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("E,H,S", SHAPES)
def test_batch_invariance_other_rows(isa, dtype, E, H, S):
    # changing the other batch rows changes nothing of row 0
    m = MultiHeadAttention(E, H, dtype=dtype, seed=2).eval()
    x = _data(3, S, E, dtype)
    y = x.copy()
    y[1:] = _data(2, S, E, dtype, seed=9) * 100
    for nw in (True, False):
        a, _ = m(x, is_causal=True, need_weights=nw)
        b, _ = m(y, is_causal=True, need_weights=nw)
        assert np.array_equal(a[0], b[0])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("E,H,S", SHAPES)
def test_batch_invariance_padding_beyond_the_causal_prefix(isa, dtype, E, H, S):
    # a causal call over the first k tokens gives the bits of those rows of
    # the call over all S tokens, whatever follows (here: large numbers)
    m = MultiHeadAttention(E, H, n_kv_heads=H // 2 if H > 1 else None, dtype=dtype,
                           seed=3).eval()
    x = _data(2, S, E, dtype)
    x[:, S // 2:] *= 1000
    for nw in (True, False):
        full, fw = m(x, is_causal=True, need_weights=nw)
        for k in sorted({1, S // 2, S - 1}):
            part, pw = m(x[:, :k], is_causal=True, need_weights=nw)
            assert np.array_equal(part, full[:, :k])
            if nw:
                assert np.array_equal(pw, fw[:, :, :k, :k])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("need_weights", [True, False])
def test_batch_invariance_last_column_panel(isa, dtype, need_weights):
    # A product's last panel of at most one vector of columns takes the
    # one-vector micro-kernel (ukr_narrow, src/ukr_impl.h), a wider one the
    # full kernel.  In a causal call the block of queries 48 .. 95 computes
    # S = Q·Kᵀ up to its last visible key: in a call of 128 tokens over 96
    # keys (on avx512 a float32 panel of 64 columns, then one of 32: the
    # full kernel on a part panel; on avx2 whole 16-column panels), in a
    # prefix of 65 .. 80 tokens over 65 .. 80 keys (a last panel of 1 .. 16
    # columns: the narrow kernel where that is at most one vector, 16 float32
    # lanes on avx512, 8 for its float64 and avx2's float32).  The rows of
    # the prefix give the bits of those rows of the whole call.  Head size
    # 160: the scores' depth runs over two float chains (UKR_KB 128).
    m = MultiHeadAttention(640, 4, dtype=dtype, seed=7).eval()
    x = _data(1, 128, 640, dtype, seed=3)
    full, fw = m(x, is_causal=True, need_weights=need_weights)
    for k in (65, 66, 70, 72, 79, 80):
        part, pw = m(x[:, :k], is_causal=True, need_weights=need_weights)
        assert np.array_equal(part, full[:, :k]), (k, np.abs(part - full[:, :k]).max())
        if need_weights:
            assert np.array_equal(pw, fw[:, :, :k, :k])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("extra", ["add_bias_kv", "add_zero_attn"])
def test_batch_invariance_with_extra_keys(isa, dtype, extra):
    # the extra keys follow the last real key: a row's bits still do not
    # depend on the batch, its other rows or the threads (the causal prefix
    # is the documented exception: the extra keys' place moves with S)
    m = MultiHeadAttention(96, 8, dtype=dtype, seed=5, **{extra: True}).eval()
    x = _data(4, 17, 96, dtype)
    y = x.copy()
    y[1:] = _data(3, 17, 96, dtype, seed=8) * 100
    before = mha_ext.get_num_threads()
    try:
        for nw in (True, False):
            mha_ext.set_num_threads(1)
            out, w = m(x, is_causal=True, need_weights=nw)
            for b in range(4):
                ob, wb = m(x[b:b + 1], is_causal=True, need_weights=nw)
                assert np.array_equal(ob[0], out[b]), (b, np.abs(ob[0] - out[b]).max())
                assert wb is None or np.array_equal(wb[0], w[b])
            assert np.array_equal(m(y, is_causal=True, need_weights=nw)[0][0], out[0])
            mha_ext.set_num_threads(2)
            assert np.array_equal(m(x, is_causal=True, need_weights=nw)[0], out)
    finally:
        mha_ext.set_num_threads(before)


@pytest.mark.parametrize("E,H,S", SHAPES)
def test_batch_invariance_thread_count(isa, E, H, S):
    m = MultiHeadAttention(E, H, seed=4).eval()
    x = _data(4, S, E, "float32")
    before = mha_ext.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3, 4):
            mha_ext.set_num_threads(n)
            results.append(m(x, is_causal=True) + m(x, need_weights=False))
    finally:
        mha_ext.set_num_threads(before)
    for r in results[1:]:
        for a, b in zip(results[0], r):
            assert (a is None and b is None) or np.array_equal(a, b)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_batch_invariance_last_row_panel(isa, dtype):
    # A product's last panel of rows takes the half-height micro-kernel
    # when at most MR / 2 rows are left (ukr_tail, src/ukr_impl.h), the full
    # one otherwise: prefixes of 19 .. 23 tokens of a 24-token causal call
    # (above the dot kernel's 16 rows, so packed; a last panel of 1 .. 5
    # rows) give the bits of those rows of the whole call.
    m = MultiHeadAttention(320, 4, dtype=dtype, seed=6).eval()  # depth 320: 3 float chains
    x = _data(1, 24, 320, dtype)
    full, fw = m(x, is_causal=True)
    for k in range(19, 24):
        part, pw = m(x[:, :k], is_causal=True)
        assert np.array_equal(part, full[:, :k]), (k, np.abs(part - full[:, :k]).max())
        assert np.array_equal(pw, fw[:, :, :k, :k])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("need_weights", [False, True])
def test_batch_invariance_sign_of_zero(isa, dtype, need_weights):
    # query 1 sees keys 0 and 1 (causal); its sum is p0·0 + p1·v1 with p1·v1
    # below the smallest subnormal and negative: -0 alone.  With query 2
    # in the call (it sees key 2 too) query 1's run of rows takes key 2 as
    # well, p·1 = 0 for it, and its sum ends as 0 + -0 = +0.  The bits,
    # the sign included, must not depend on that: compared as integers
    from mha_ext import _core
    tiny = np.finfo(dtype).tiny
    q = np.array([0.0, 1.0, 0.0], dtype).reshape(1, 1, 3, 1)
    k = np.array([0.0, -69.0 if dtype == "float32" else -700.0, 0.0],
                 dtype).reshape(1, 1, 3, 1)
    v = np.array([0.0, -float(tiny) * 1e-3, 1.0], dtype).reshape(1, 1, 3, 1)
    uint = np.uint32 if dtype == "float32" else np.uint64
    rows = {}
    for L in (2, 3):
        out, _ = _core._sdpa(q[:, :, :L], k, v, is_causal=True, scale=1.0,
                             need_weights=need_weights)
        rows[L] = out[0, 0, 1].view(uint)
        assert out[0, 0, 1, 0] == 0  # the sum is a zero, of some sign
    assert np.array_equal(rows[2], rows[3]), (rows[2], rows[3])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_batch_invariance_averaged_weights(isa, dtype):
    # averaged weights (the mean over 8 heads, each scaled by a head_mask
    # entry so that the order of the sum shows) of query 0: alone (one
    # query, one key), in the longer causal call, in a batch, and from a
    # cache's first decode step.  NumPy's mean summed the one-key case
    # pairwise and the others head by head: 1 ulp apart.
    H = 8
    m = MultiHeadAttention(16, H, dtype=dtype, seed=0).eval()
    x = _data(3, 4, 16, dtype)
    hm = np.random.default_rng(4).uniform(0, 2, H).astype(dtype)
    _, full = m(x, is_causal=True, average_weights=True, head_mask=hm)
    # the precondition: NumPy's mean of such a one-key call is not the
    # in-order sum here (else this test could not tell the two apart)
    _, one_heads = m(x[:1, :1], is_causal=True, head_mask=hm)
    in_order = one_heads[:, 0].copy()
    for h in range(1, H):
        in_order += one_heads[:, h]
    in_order /= one_heads.dtype.type(H)
    assert not np.array_equal(one_heads.mean(axis=1), in_order)
    uint = np.uint32 if dtype == "float32" else np.uint64
    for b in range(3):
        _, one = m(x[b:b + 1, :1], is_causal=True, average_weights=True, head_mask=hm)
        assert one.shape == (1, 1, 1)
        assert one[0, 0, 0].view(uint) == full[b, 0, 0].view(uint), (one[0, 0, 0], full[b, 0, 0])
    _, ones = m(x[:, :1], is_causal=True, average_weights=True, head_mask=hm)
    assert np.array_equal(ones[:, 0, 0].view(uint), full[:, 0, 0].view(uint))
    cache = m.new_cache(1, 4)
    _, step = m(x[:1, :1], cache=cache, average_weights=True, head_mask=hm)
    assert step[0, 0, 0].view(uint) == full[0, 0, 0].view(uint)
    # the mean itself: the per-head weights summed in head order, over H
    _, per_head = m(x, is_causal=True, head_mask=hm)
    expect = per_head[:, 0].copy()
    for h in range(1, H):
        expect += per_head[:, h]
    expect /= per_head.dtype.type(H)
    assert np.array_equal(full, expect)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("D", [8, 64, 600])  # 600: two depth blocks of a product
def test_batch_invariance_decode_shaped_sdpa(isa, dtype, D):
    # a decode step's query row (L 1: its keys transposed a panel at a time
    # into the thread's scratch and read there, one-row kernels), the same
    # row in a block of 5 and in a call of 60 rows (K transposed whole, the
    # full kernels): the same bits, at key counts around the kernels' panel
    # widths (4 to 64 keys) and past them
    r = np.random.default_rng(D)
    for S in (1, 3, 15, 16, 17, 33, 63, 64, 65, 130):
        q = r.standard_normal((2, 2, 60, D)).astype(dtype)
        k = r.standard_normal((2, 2, S, D)).astype(dtype)
        v = r.standard_normal((2, 2, S, D)).astype(dtype)
        full = mha_ext.scaled_dot_product_attention(q, k, v)
        for i in (0, 41, 59):
            one = mha_ext.scaled_dot_product_attention(q[:, :, i:i + 1], k, v)
            assert np.array_equal(one[:, :, 0], full[:, :, i]), (S, i)
        blk = mha_ext.scaled_dot_product_attention(q[:, :, 50:55], k, v)
        assert np.array_equal(blk, full[:, :, 50:55]), S


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_batch_invariance_many_small_heads(isa, dtype):
    # many heads of little work (a decode step over a few keys) run several
    # to a task on the pool: each head's bits are those it has alone, at 1,
    # 2 and 3 threads
    r = np.random.default_rng(3)
    B, H, S, D = 512, 4, 5, 16
    q = r.standard_normal((B, H, 1, D)).astype(dtype)
    k = r.standard_normal((B, H, S, D)).astype(dtype)
    v = r.standard_normal((B, H, S, D)).astype(dtype)
    before = mha_ext.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            mha_ext.set_num_threads(n)
            outs.append(mha_ext.scaled_dot_product_attention(q, k, v))
        for b in (0, 1, 255, 511):
            alone = mha_ext.scaled_dot_product_attention(q[b:b + 1], k[b:b + 1],
                                                         v[b:b + 1])
            for out in outs:
                assert np.array_equal(alone[0], out[b]), b
    finally:
        mha_ext.set_num_threads(before)
