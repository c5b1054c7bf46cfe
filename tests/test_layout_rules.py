"""mha_ext.layout rules tests/test_layout.py leaves open: non-square
blocks keep their (q_block, k_block) order through the pattern helpers and
from_dense (the elementwise mask follows the index rule i // q_block,
j // k_block), bigbird's base is global_local with its own arguments, a
layout copies the caller's keep, the refusals of odd counts, block sizes,
dtypes and ranks, and the density of an empty layout.
"""
import numpy as np
import pytest

from mha_ext import layout as L
from mha_ext.layout import BlockLayout

HELPERS = {
    "local_blocks": lambda Sq, Sk, b: L.local_blocks(Sq, Sk, b),
    "strided": lambda Sq, Sk, b: L.strided(Sq, Sk, b, stride=2),
    "global_local": lambda Sq, Sk, b: L.global_local(Sq, Sk, b),
    "bigbird": lambda Sq, Sk, b: L.bigbird(Sq, Sk, b, seed=0),
}


def _ceil(n, b):
    return -(-n // b)


# ---------------------------------------------------------------- block order

@pytest.mark.parametrize("name", sorted(HELPERS))
def test_the_helpers_keep_the_block_size_order(name):
    lay = HELPERS[name](8, 12, (2, 4))
    assert lay.block_size == (2, 4)
    assert (lay.q_block, lay.k_block) == (2, 4)
    assert lay.shape == (_ceil(8, 2), _ceil(12, 4))


def test_a_diagonal_of_non_square_blocks_follows_the_index_rule():
    i, j = np.arange(6)[:, None], np.arange(6)[None, :]
    dense = L.local_blocks(6, 6, (3, 4), width=0).to_dense(6, 6)
    np.testing.assert_array_equal(dense, (i // 3) == (j // 4))


@pytest.mark.parametrize("Sq,Sk,bs", [(8, 12, (2, 4)), (6, 6, (3, 4)), (7, 5, (4, 2))])
def test_from_dense_keeps_the_block_size_order_and_round_trips(Sq, Sk, bs):
    # a dense mask constant on each block: from_dense then to_dense is exact
    rng = np.random.default_rng(Sq * 100 + Sk)
    blocks = rng.random((_ceil(Sq, bs[0]), _ceil(Sk, bs[1]))) < 0.5
    i, j = np.arange(Sq)[:, None], np.arange(Sk)[None, :]
    dense = blocks[i // bs[0], j // bs[1]]
    lay = BlockLayout.from_dense(dense, bs)
    assert lay.block_size == bs
    np.testing.assert_array_equal(lay.keep, blocks)
    np.testing.assert_array_equal(lay.to_dense(Sq, Sk), dense)


# ---------------------------------------------------------------- bigbird

def test_bigbird_without_random_blocks_is_global_local():
    for g, w in [(0, 3), (3, 0), (2, 1)]:
        bb = L.bigbird(64, 64, 8, global_blocks=g, width=w, random_blocks=0)
        np.testing.assert_array_equal(bb.keep, L.global_local(64, 64, 8, g, w).keep)
        i, j = np.arange(8)[:, None], np.arange(8)[None, :]
        np.testing.assert_array_equal(bb.keep, (np.abs(i - j) <= w) | (i < g) | (j < g))


@pytest.mark.parametrize("r", [-1, 2.7, True, np.True_, "2"])
def test_bigbird_takes_only_a_count_of_random_blocks(r):
    with pytest.raises(ValueError, match="random_blocks must be an int >= 0"):
        L.bigbird(64, 64, 8, random_blocks=r)


# ---------------------------------------------------------------- copies

def test_a_layout_copies_the_callers_keep():
    keep = np.array([[True, False], [False, True]])
    lay = BlockLayout(keep, 4)
    assert keep.flags.writeable                 # the caller's array untouched
    assert not np.shares_memory(keep, lay.keep)
    keep[0, 1] = True
    np.testing.assert_array_equal(lay.keep, np.eye(2, dtype=bool))
    assert not lay.keep.flags.writeable


# ---------------------------------------------------------------- refusals

def test_from_dense_takes_only_bools():
    with pytest.raises(TypeError, match="from_dense takes a bool array"):
        BlockLayout.from_dense(np.ones((4, 4), dtype=np.int64), 2)
    with pytest.raises(TypeError, match="from_dense takes a bool array"):
        BlockLayout.from_dense(np.ones(4, dtype=bool), 2)


@pytest.mark.parametrize("bs,name", [(True, "q_block"), ((True, 2), "q_block"),
                                     ((2, True), "k_block"), ((np.True_, 1), "q_block")])
def test_a_bool_block_size_is_refused(bs, name):
    with pytest.raises(TypeError, match="block_size's %s must be an int > 0" % name):
        BlockLayout(np.ones((2, 2), bool), bs)
    with pytest.raises(TypeError, match="block_size's %s must be an int > 0" % name):
        L.local_blocks(8, 8, bs)


def test_keep_of_five_axes_is_refused():
    with pytest.raises(ValueError, match="keep must have shape"):
        BlockLayout(np.ones((1, 1, 1, 2, 2), bool), 2)
    for shape in [(2, 2), (3, 2, 2), (1, 3, 2, 2)]:     # the ranks taken
        assert BlockLayout(np.ones(shape, bool), 2).shape == shape


# ---------------------------------------------------------------- density

@pytest.mark.parametrize("Sq,Sk", [(0, 8), (8, 0), (0, 0)])
def test_an_empty_layout_has_density_zero(Sq, Sk):
    lay = L.local_blocks(Sq, Sk, 4)
    assert lay.shape == (_ceil(Sq, 4), _ceil(Sk, 4))
    assert lay.density == 0.0
    assert "density=0.000" in repr(lay)
