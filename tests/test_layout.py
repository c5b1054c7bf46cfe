"""mha_ext.layout on its own: BlockLayout (to_dense, from_dense, density),
the pattern helpers (local_blocks, strided, global_local, bigbird) against
the index rules their docstrings state, and their refusals.  The layouts
in calls, against torch given the dense mask: tests/test_block_sparse.py.
"""
import numpy as np
import pytest

from mha_ext import layout as L
from mha_ext.layout import BlockLayout


def test_to_dense_from_dense_and_density():
    keep = np.array([[1, 0, 1], [0, 1, 0]], bool)
    lay = BlockLayout(keep, (2, 3))
    d = lay.to_dense(3, 7)                      # blocks: rows 0-1 | 2; cols 0-2 | 3-5 | 6
    want = np.array([[1, 1, 1, 0, 0, 0, 1]] * 2 + [[0, 0, 0, 1, 1, 1, 0]], bool)
    np.testing.assert_array_equal(d, want)
    back = BlockLayout.from_dense(d, (2, 3))
    np.testing.assert_array_equal(back.keep, keep)
    assert lay.density == pytest.approx(0.5)
    # from_dense keeps a block with any visible element
    dd = np.zeros((3, 7), bool)
    dd[2, 4] = True
    np.testing.assert_array_equal(BlockLayout.from_dense(dd, (2, 3)).keep,
                                  [[0, 0, 0], [0, 1, 0]])
    assert not lay.keep.flags.writeable
    with pytest.raises(ValueError, match="does not fit"):
        lay.to_dense(5, 7)


def test_pattern_helpers():
    i, j = np.arange(6)[:, None], np.arange(6)[None, :]
    band = L.local_blocks(60, 60, 10, width=1)
    np.testing.assert_array_equal(band.keep, np.abs(i - j) <= 1)
    np.testing.assert_array_equal(L.local_blocks(60, 60, 10, width=2, causal=True).keep,
                                  (j <= i) & (j >= i - 2))
    st = L.strided(60, 60, 10, stride=3, width=0, causal=True)
    np.testing.assert_array_equal(st.keep, ((i == j) | (j % 3 == 2)) & (j <= i))
    gl = L.global_local(60, 60, 10, global_blocks=1, width=1)
    np.testing.assert_array_equal(gl.keep, (np.abs(i - j) <= 1) | (i == 0) | (j == 0))
    bb = L.bigbird(60, 60, 10, global_blocks=1, width=1, random_blocks=2, seed=7, heads=4)
    assert bb.shape == (4, 6, 6)
    assert (bb.keep >= gl.keep).all()                       # global + local kept
    extra = bb.keep & ~gl.keep
    # 2 random blocks per row, drawn among those the band and the global
    # blocks leave (BigBird's rule), all of them where fewer are left
    np.testing.assert_array_equal(extra.sum(-1),
                                  np.broadcast_to(np.minimum(2, (~gl.keep).sum(-1)), (4, 6)))
    big = L.bigbird(4096, 4096, 64, random_blocks=2, seed=0)
    free = ~L.global_local(4096, 4096, 64).keep
    np.testing.assert_array_equal((big.keep & free).sum(-1), np.minimum(2, free.sum(-1)))
    assert not (bb.keep[0] == bb.keep[1]).all() or not (bb.keep[1] == bb.keep[2]).all()
    again = L.bigbird(60, 60, 10, global_blocks=1, width=1, random_blocks=2, seed=7, heads=4)
    np.testing.assert_array_equal(bb.keep, again.keep)      # the seed fixes the draw
    bc = L.bigbird(60, 60, 10, random_blocks=3, seed=1, causal=True)
    assert not (bc.keep & (j > i)).any()
    free = ~L.global_local(60, 60, 10, causal=True).keep & (j <= i)
    np.testing.assert_array_equal((bc.keep & free).sum(-1), np.minimum(3, free.sum(-1)))
    # block sizes not dividing S: the last block partial
    assert L.local_blocks(61, 45, (10, 8)).shape == (7, 6)
    # a 10 % pattern as in the benchmark
    lay = L.global_local(8192, 8192, 128, global_blocks=1, width=2)
    assert 0.05 < lay.density < 0.15


@pytest.mark.parametrize("make,err,words", [
    (lambda: BlockLayout(np.ones((2, 2), np.uint8), 4), TypeError, "bool array"),
    (lambda: BlockLayout(np.ones(3, bool), 4), ValueError, "keep must have shape"),
    (lambda: BlockLayout(np.ones((2, 2), bool), 0), ValueError, "q_block must be an int > 0"),
    (lambda: BlockLayout(np.ones((2, 2), bool), (4, -1)), ValueError, "k_block"),
    (lambda: BlockLayout(np.ones((2, 2), bool), 2.5), TypeError, "q_block"),
    (lambda: BlockLayout(np.ones((2, 2), bool), (1, 2, 3)), TypeError, "block_size"),
    (lambda: L.strided(8, 8, 2, stride=0), ValueError, "stride must be an int >= 1, got 0"),
    (lambda: L.strided(8, 8, 2, stride=-1), ValueError, "stride must be an int >= 1, got -1"),
    # causal= cuts block indices: True or False only ("lower_right" read as
    # True would silently be the top-left cut)
    (lambda: L.local_blocks(8, 8, 2, causal="lower_right"), TypeError,
     "causal must be True or False.*is_causal='lower_right'"),
    (lambda: L.strided(8, 8, 2, 2, causal=1), TypeError, "causal must be True or False"),
    (lambda: L.global_local(8, 8, 2, causal=None), TypeError, "causal must be True or False"),
    (lambda: L.bigbird(8, 8, 2, causal="yes"), TypeError, "causal must be True or False"),
    # the lengths of the pattern helpers and to_dense: ints >= 0
    (lambda: L.local_blocks(-1, 8, 2), ValueError, "Sq must be an int >= 0"),
    (lambda: L.strided(8, -3, 2, 2), ValueError, "Sk must be an int >= 0"),
    (lambda: L.global_local(8.5, 8, 2), ValueError, "Sq must be an int >= 0"),
    (lambda: L.local_blocks(True, 8, 2), ValueError, "Sq must be an int >= 0"),
    (lambda: L.bigbird(8, 8, 2, heads=0), ValueError, "heads must be an int >= 1"),
    # seed: the constructors' rule (numpy's own messages never named it)
    (lambda: L.bigbird(8, 8, 2, seed=-1), ValueError, r"seed must be in \[0, 2\*\*64\)"),
    (lambda: L.bigbird(8, 8, 2, seed=1.5), TypeError, "seed must be an int"),
    (lambda: L.bigbird(8, 8, 2, seed="a"), TypeError, "seed must be an int"),
    (lambda: L.local_blocks(8, 8, 2).to_dense(-1, 8), ValueError, "Sq must be an int >= 0"),
])
def test_bad_layouts_are_refused(make, err, words):
    with pytest.raises(err, match=words):
        make()


@pytest.mark.parametrize("big", [2**62, 2**63, 10**30])
def test_counts_past_every_block_index_mean_every_block_within_reach(big):
    """A width, stride or global_blocks past int64 means what a count past
    every block index means (NumPy's int64 arithmetic raised OverflowError
    from 2**63 on)."""
    i, j = np.arange(6)[:, None], np.arange(6)[None, :]
    everything = np.ones((6, 6), bool)
    np.testing.assert_array_equal(L.local_blocks(60, 60, 10, width=big).keep, everything)
    np.testing.assert_array_equal(L.local_blocks(60, 60, 10, width=big, causal=True).keep,
                                  j <= i)
    np.testing.assert_array_equal(L.strided(60, 60, 10, stride=big, width=1).keep,
                                  np.abs(i - j) <= 1)     # no summary column in reach
    np.testing.assert_array_equal(L.strided(60, 60, 10, stride=2, width=big).keep, everything)
    np.testing.assert_array_equal(L.global_local(60, 60, 10, global_blocks=big, width=0).keep,
                                  everything)
    np.testing.assert_array_equal(L.bigbird(60, 60, 10, width=big, seed=0).keep, everything)
