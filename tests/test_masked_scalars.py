"""A 0-d NumPy masked array with its value masked, where one value is taken
(docs/API.md §3): a TypeError naming the argument, as for masked arrays
wherever arrays are taken (float() would read NaN, a flag the hidden
value).  Unmasked, it is read as its value.  And BlockLayout's block sizes
beyond the C core's int64 (§3.1): a ValueError at construction, not a
layout every call refuses or an OverflowError from to_dense."""
import numpy as np
import pytest

import mha_ext
from _support import need
from mha_ext.layout import BlockLayout, local_blocks

X = np.random.default_rng(0).standard_normal((1, 3, 8))
HIDDEN = np.ma.masked_array(0.5, mask=True)
HIDDEN_TRUE = np.ma.masked_array(True, mask=True)
SHOWN = np.ma.masked_array(0.5, mask=False)


def _m():
    return mha_ext.MultiHeadAttention(8, 2, seed=0)


CALLS = {
    "scale": lambda: _m()(X, scale=HIDDEN),
    "dropout": lambda: mha_ext.MultiHeadAttention(8, 2, dropout=HIDDEN),
    "dropout ": lambda: setattr(_m(), "dropout", HIDDEN),
    "is_causal": lambda: _m()(X, is_causal=HIDDEN_TRUE),
    "need_weights": lambda: _m()(X, need_weights=HIDDEN_TRUE),
    "dropout_p": lambda: mha_ext.scaled_dot_product_attention(X, X, X, dropout_p=HIDDEN),
    "scale ": lambda: mha_ext.scaled_dot_product_attention(X, X, X, scale=HIDDEN),
    "is_causal ": lambda: mha_ext.scaled_dot_product_attention(X, X, X, is_causal=HIDDEN_TRUE),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_a_masked_value_is_refused(name):
    with pytest.raises(TypeError, match=name.strip() + ".*masked"):
        CALLS[name]()


def test_a_masked_plot_limit_is_refused():
    need("matplotlib")  # plot_heads' own dependency (the test extra has it)
    with pytest.raises(TypeError, match="vmin"):
        mha_ext.plot_heads(_m()(X)[1], vmin=HIDDEN)


def test_an_unmasked_value_is_its_value():
    m = _m()
    np.testing.assert_array_equal(m(X, scale=SHOWN)[0], m(X, scale=0.5)[0])
    np.testing.assert_array_equal(
        mha_ext.scaled_dot_product_attention(X, X, X, scale=SHOWN),
        mha_ext.scaled_dot_product_attention(X, X, X, scale=0.5))
    assert mha_ext.MultiHeadAttention(8, 2, dropout=SHOWN).dropout == 0.5
    shown_true = np.ma.masked_array(True, mask=False)
    np.testing.assert_array_equal(m(X, is_causal=shown_true)[0], m(X, is_causal=True)[0])


@pytest.mark.parametrize("block", [2**63, (1, 2**63), (2**70, 1)])
def test_a_block_size_past_int64_is_refused_at_construction(block):
    with pytest.raises(ValueError, match="too large"):
        BlockLayout(np.ones((1, 1), bool), block)
    with pytest.raises(ValueError, match="too large"):
        local_blocks(3, 3, block)


def test_the_largest_block_size_works():
    layout = BlockLayout(np.ones((1, 1), bool), 2**63 - 1)
    assert layout.to_dense(3, 3).all()
    m = _m()
    np.testing.assert_array_equal(m(X, layout=layout)[0], m(X)[0])


def test_train_takes_a_bool_as_torchs():
    m = _m()
    assert m.train(np.bool_(False)).training is False
    for mode in (None, 0, np.array(True)):
        with pytest.raises(ValueError, match="must be a bool"):
            m.train(mode)


@pytest.mark.parametrize("where", ["seed", "window", "d_model"])
def test_a_masked_0d_int_is_refused_where_an_int_is_taken(where):
    # a 0-d integer array is an int (as torch reads one); masked with its
    # value masked it is a TypeError naming the argument, not NumPy's MaskError
    m = np.ma.masked_array(np.array(3), mask=True)
    q = np.ones((1, 2, 4, 8), np.float32)
    with pytest.raises(TypeError, match="masked"):
        if where == "seed":
            mha_ext.scaled_dot_product_attention(q, q, q, dropout_p=0.5, seed=m)
        elif where == "window":
            mha_ext.scaled_dot_product_attention(q, q, q, window=(m, 0))
        else:
            mha_ext.MultiHeadAttention(m, 1)
