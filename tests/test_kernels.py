"""The fast kernels against the plain C reference, on every instruction set
this CPU can run (portable, avx2, avx512; `MHA_EXT_ISA=portable` forces the
portable one for a whole process, `_core._set_isa` switches inside one).

Sizes are chosen to be multiples of no tile: 1, 7, 15, 17, 33, 63, 65, 127,
129 in every dimension (batch, query and key length, d_model, head width,
kdim, vdim), with and without masks, causal, fully blocked rows and dropout.
`_forward(q, k, v, *, masks, is_causal, need_weights, zero_rows, reference)`
runs the fast core, or the reference with reference=True.
"""
import numpy as np
import pytest

import mha_ext
from _support import ISAS
from mha_ext import _core

EDGE = [1, 7, 15, 17, 33, 63, 65, 127, 129]
TOL = {"float32": 2e-5, "float64": 1e-12}


def make(E, H, dtype="float32", kdim=None, vdim=None, seed=0):
    m = mha_ext.MultiHeadAttention(E, H, kdim=kdim, vdim=vdim, dtype=dtype, seed=seed)
    return m.eval()


def inputs(m, B, Sq, Sk, seed=1):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Sq, m.d_model)).astype(m.dtype)
    k = rng.standard_normal((B, Sk, m.kdim)).astype(m.dtype)
    v = rng.standard_normal((B, Sk, m.vdim)).astype(m.dtype)
    return q, k, v


def assert_same(m, q, k, v, masks=(), causal=False, zero_rows=False, counter=None):
    """fast == reference, with and without weights, NaN where it is NaN"""
    tol = TOL[np.dtype(m.dtype).name]
    for need_weights in (True, False):
        if counter is not None:
            m._counter = counter
        kw = dict(masks=list(masks), is_causal=causal, need_weights=need_weights,
                  zero_rows=zero_rows)
        out_ref, w_ref = m._forward(q, k, v, reference=True, **kw)
        if counter is not None:
            m._counter = counter
        out, w = m._forward(q, k, v, reference=False, **kw)
        np.testing.assert_array_equal(np.isnan(out), np.isnan(out_ref))
        np.testing.assert_allclose(out, out_ref, rtol=0, atol=tol, equal_nan=True)
        if need_weights:
            np.testing.assert_array_equal(np.isnan(w), np.isnan(w_ref))
            np.testing.assert_allclose(w, w_ref, rtol=0, atol=tol, equal_nan=True)
        else:
            assert w is None


@pytest.mark.parametrize("n", EDGE)
def test_lengths(isa, n):
    """Sq and Sk of every edge size, and both together"""
    m = make(16, 2)
    for B, Sq, Sk in ((2, n, 9), (2, 9, n), (1, n, n)):
        assert_same(m, *inputs(m, B, Sq, Sk))


@pytest.mark.parametrize("n", EDGE)
def test_widths(isa, n):
    """d_model, head width (E/H), kdim and vdim of every edge size"""
    m = make(n, 1, kdim=EDGE[(EDGE.index(n) + 3) % 9], vdim=EDGE[(EDGE.index(n) + 5) % 9])
    assert_same(m, *inputs(m, 2, 17, 15))
    if n > 1:  # several heads of width n
        m = make(2 * n, 2)
        assert_same(m, *inputs(m, 1, 33, 65))


@pytest.mark.parametrize("B", [1, 7, 17])
def test_batch(isa, B):
    m = make(24, 3)
    assert_same(m, *inputs(m, B, 15, 7))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("Sq,Sk", [(7, 33), (65, 63), (129, 127), (33, 1)])
def test_masks(isa, dtype, Sq, Sk):
    """blocking and additive masks, causal, fully blocked rows (NaN or zero)"""
    m = make(32, 4, dtype=dtype)
    q, k, v = inputs(m, 2, Sq, Sk)
    rng = np.random.default_rng(Sq * 1000 + Sk)
    block = rng.random((2, 4, Sq, Sk)) < 0.3
    block[0, 1, Sq // 2, :] = True                       # a fully blocked row
    add = rng.standard_normal((Sq, Sk)).astype(dtype)
    add[rng.random((Sq, Sk)) < 0.2] = -np.inf
    pad = rng.random((2, 1, 1, Sk)) < 0.25
    pad[1, 0, 0, 0] = False
    for masks in ([], [(0, block.view(np.uint8))], [(1, add)], [(0, pad.view(np.uint8)), (1, add)]):
        for causal in (False, True):
            for zero_rows in (False, True):
                assert_same(m, q, k, v, masks, causal, zero_rows)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_huge_negative_additive_masks(isa, dtype):
    """additive masks of -1e7, -1e10, -6e15, -1e30: score gaps far below
    exp's underflow, where the vector exp's exponent conversion overflowed
    (defect 4, undefined behaviour that the CI's ASan+UBSan stage, running
    this test, reports); the weights there are exactly 0, as in the
    reference"""
    m = make(16, 2, dtype=dtype)
    Sq, Sk = 9, 37
    q, k, v = inputs(m, 2, Sq, Sk)
    rng = np.random.default_rng(11)
    for value in (-1e7, -1e10, -6e15, -1e30):
        add = np.zeros((Sq, Sk), dtype)
        add[rng.random((Sq, Sk)) < 0.4] = value
        add[2, :] = value  # a whole row shifted: an ordinary softmax again
        add[3, 1:] = value  # one visible key
        add[3, 0] = 0
        assert_same(m, q, k, v, [(1, add)])
        assert_same(m, q, k, v, [(1, add)], causal=True)
        _, w = m._forward(q, k, v, masks=[(1, add)])
        hidden = np.broadcast_to(add == value, w.shape).copy()
        hidden[:, :, 2, :] = False
        assert np.all(w[hidden] == 0)
        np.testing.assert_allclose(w[:, :, 3, 0], 1.0, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_tile_boundaries(isa, dtype):
    """past one KC/NC block (257), a projection task (M = 400) and an online
    key block (Sk = 300)"""
    m = make(257, 1, dtype=dtype)
    assert_same(m, *inputs(m, 1, 20, 300))
    m = make(64, 2, dtype=dtype)
    assert_same(m, *inputs(m, 2, 200, 300), causal=True)


@pytest.mark.parametrize("depth", range(1, 18))
def test_depth_remainders(isa, depth):
    """every depth mod 8 and 16 (the AVX-512 float64 kernel's assembly loop
    runs 8 steps a pass, then single steps; float's joins every 128): the
    projections' depth (d_model, kdim), S = Q·Kᵀ's (head width) and P·V's
    (Sk; Kᵀ's rows read in place, V's packed: narrower than a panel),
    float64 and float32"""
    for dtype in ("float64", "float32"):
        m = make(2 * depth, 2, kdim=depth + 1, vdim=3 * depth, dtype=dtype)
        assert_same(m, *inputs(m, 2, 13, depth + 128 + 5))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_nonfinite_inputs(isa, dtype):
    """NaN and inf in the inputs reach the same places as in the reference,
    with causal block skipping too (a NaN in a late value)"""
    m = make(16, 2, dtype=dtype)
    q, k, v = inputs(m, 2, 70, 70)
    q[0, 3, 0] = np.nan
    k[1, 5, 2] = np.inf
    v[0, 69, 1] = np.nan
    for causal in (False, True):
        assert_same(m, q, k, v, causal=causal)


def test_dropout_same_mask(isa):
    """the dropout stream is element-indexed: fast and reference drop the
    same weights"""
    m = make(32, 4)
    m.train()
    m.dropout = 0.3
    q, k, v = inputs(m, 2, 33, 65)
    assert_same(m, q, k, v, counter=5)
    assert_same(m, q, k, v, causal=True, counter=6)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_threads_do_not_change_results(isa, dtype):
    m = make(128, 4, dtype=dtype)
    q, k, v = inputs(m, 3, 130, 70)
    before = mha_ext.get_num_threads()
    try:
        got = []
        for n in (1, 2, 3):
            mha_ext.set_num_threads(n)
            got.append(m._forward(q, k, v))
            got.append(m._forward(q, k, v, is_causal=True, need_weights=False))
    finally:
        mha_ext.set_num_threads(before)
    for i in range(2, len(got)):
        a, b = got[i % 2], got[i]
        np.testing.assert_array_equal(a[0], b[0])
        if a[1] is not None:
            np.testing.assert_array_equal(a[1], b[1])


def test_isa_switch_errors():
    with pytest.raises(ValueError, match="instruction set"):
        _core._set_isa("sse9")
    with pytest.raises(TypeError):
        _core._set_isa(3)
    assert _core._get_isa() in ISAS


@pytest.mark.parametrize("value", ["bogus", "AVX2", "amx", "avx2", "portable"])
def test_an_isa_the_core_cannot_follow_is_a_warning_not_silence(value):
    """MHA_EXT_ISA naming no ISA (a typo, another case) or one this CPU or
    build lacks is ignored by the core (the widest one runs): the import
    warns, naming what runs; a value it follows imports quietly."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, MHA_EXT_ISA=value)
    out = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c",
                          "import mha_ext; print(mha_ext._core._get_isa())"],
                         env=env, capture_output=True, text=True, timeout=120)
    follows = _core._isa_available(value) if value in ("portable", "avx2", "avx512", "amx") \
        else False
    if follows:
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == [value]
    else:
        assert out.returncode != 0
        assert "RuntimeWarning: MHA_EXT_ISA=%r is ignored" % value in out.stderr, out.stderr
        widest = [i for i in ("amx", "avx512", "avx2", "portable") if _core._isa_available(i)][0]
        assert "mha_ext uses %r" % widest in out.stderr, out.stderr
