"""mha_ext.plot_heads rules tests/test_plot.py leaves open: the blocked
cells of the batch item drawn (not of item 0), a trace of averaged weights
hatching only the cells blocked in every head (batched or not), the colour
scale's edges (vmin == vmax, constant weights, scale="row" over the largest
finite weight), the grid (ncols capped at H, up to 4 by default), where a
blocked column's hatching lies, and a negative batch index in the title.

Legend: B batch, H heads, Sq/Sk query/key length.
"""
import math

import numpy as np
import pytest

import mha_ext
from mha_ext.plot import plot_heads

from _support import need


@pytest.fixture
def mpl(monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    return need("matplotlib")


def heatmaps(fig):
    return [ax for ax in fig.axes if ax.images and ax.get_title()]


def hatches(ax):
    from matplotlib.patches import PathPatch
    return [p for p in ax.patches if isinstance(p, PathPatch) and p.get_hatch() == "////"]


def _weights(B, H, Sq, Sk, seed=0):
    w = np.random.default_rng(seed).random((B, H, Sq, Sk))
    return w / w.sum(-1, keepdims=True)


# ---------------------------------------------------------------- blocked cells

def test_the_blocked_cells_of_the_batch_item_drawn(mpl):
    w = _weights(2, 1, 4, 5)
    blk = np.zeros(w.shape, dtype=bool)
    blk[1, :, :, 3] = True                     # only batch item 1 blocks key 3
    (ax,) = heatmaps(plot_heads(w, batch=1, blocked=blk))
    assert len(hatches(ax)) == 1
    shown = np.ma.getmaskarray(ax.images[0].get_array())
    np.testing.assert_array_equal(shown, blk[1, 0])
    (ax0,) = heatmaps(plot_heads(w, batch=0, blocked=blk))
    assert hatches(ax0) == []
    assert not np.ma.getmaskarray(ax0.images[0].get_array()).any()


def test_averaged_weights_hatch_only_cells_blocked_in_every_head(mpl):
    m = mha_ext.MultiHeadAttention(16, 2, seed=0).eval()
    x = np.random.default_rng(0).standard_normal((1, 4, 16))
    mask = np.zeros((1, 2, 4, 4), dtype=bool)
    mask[0, 0, :, 0] = True                    # key 0 blocked in head 0 only
    tr = m.trace(x, mask=mask, average_weights=True)
    (ax,) = heatmaps(plot_heads(tr))
    assert ax.get_title() == "mean over heads"
    assert hatches(ax) == []
    mask[0, 1, :, 0] = True                    # now in every head
    (ax,) = heatmaps(plot_heads(m.trace(x, mask=mask, average_weights=True)))
    assert len(hatches(ax)) == 1
    want = np.zeros((4, 4), dtype=bool)
    want[:, 0] = True
    np.testing.assert_array_equal(np.ma.getmaskarray(ax.images[0].get_array()), want)


def test_an_unbatched_averaged_trace_is_hatched(mpl):
    m = mha_ext.MultiHeadAttention(16, 2, seed=0).eval()
    x = np.random.default_rng(1).standard_normal((3, 16))      # (Sq, E): unbatched
    tr = m.trace(x, is_causal=True, average_weights=True)
    (ax,) = heatmaps(plot_heads(tr))
    assert len(hatches(ax)) == 1
    i, j = np.arange(3)[:, None], np.arange(3)[None, :]
    np.testing.assert_array_equal(np.ma.getmaskarray(ax.images[0].get_array()), j > i)


def test_a_blocked_column_is_hatched_over_its_cells(mpl):
    w = _weights(1, 1, 4, 6)
    blk = np.zeros((4, 6), dtype=bool)
    blk[:, 3] = True
    (ax,) = heatmaps(plot_heads(w, blocked=blk))
    (patch,) = hatches(ax)
    xs = patch.get_path().vertices[:, 0]
    ys = patch.get_path().vertices[:, 1]
    # imshow's cell k spans k - 0.5 .. k + 0.5
    assert (xs.min(), xs.max()) == (3 - 0.5, 3 + 0.5)
    assert (ys.min(), ys.max()) == (-0.5, 4 - 0.5)


# ---------------------------------------------------------------- colour scale

def test_vmin_equal_to_vmax_is_taken(mpl):
    w = _weights(1, 2, 3, 3)
    fig = plot_heads(w, vmin=0.5, vmax=0.5)
    # one scale for every panel: the colour bar's widening of equal limits
    # (matplotlib's) reaches them all, so no panel shows a scale of its own
    clims = {ax.images[0].get_clim() for ax in heatmaps(fig)}
    assert len(clims) == 1
    lo, hi = clims.pop()
    assert lo <= 0.5 <= hi
    with pytest.raises(ValueError, match="vmin must not exceed vmax"):
        plot_heads(w, vmin=0.6, vmax=0.5)


def test_constant_zero_weights_get_a_scale_of_one(mpl):
    fig = plot_heads(np.zeros((1, 2, 3, 3)))
    assert {ax.images[0].get_clim() for ax in heatmaps(fig)} == {(0.0, 1.0)}


def test_row_scale_divides_by_the_largest_finite_weight(mpl):
    w = np.array([[[[0.5, 0.25, np.inf]]]])
    (ax,) = heatmaps(plot_heads(w, scale="row"))
    arr = ax.images[0].get_array()
    np.testing.assert_array_equal(np.ma.getmaskarray(arr), [[False, False, True]])
    np.testing.assert_array_equal(arr.data[0, :2], [0.5 / 0.5, 0.25 / 0.5])


# ---------------------------------------------------------------- grid and title

def test_ncols_is_capped_at_the_number_of_heads(mpl):
    fig = plot_heads(_weights(1, 2, 3, 3), ncols=6)
    assert len(heatmaps(fig)) == 2
    assert len(fig.axes) == 2 + 1               # the panels and the colour bar


@pytest.mark.parametrize("H", [1, 3, 4, 5, 8])
def test_the_default_grid_has_up_to_four_columns(mpl, H):
    fig = plot_heads(_weights(1, H, 3, 3))
    panels = heatmaps(fig)
    assert len(panels) == H
    ncols = min(H, 4)
    rows = {ax.get_subplotspec().rowspan.start for ax in panels}
    cols = {ax.get_subplotspec().colspan.start for ax in panels}
    assert len(rows) == math.ceil(H / ncols) and len(cols) == ncols


def test_a_negative_batch_names_its_item_in_the_title(mpl):
    w = _weights(3, 1, 3, 3)
    fig = plot_heads(w, batch=-1)
    assert fig._suptitle.get_text() == "attention weights, batch %d" % (3 - 1)
    np.testing.assert_allclose(heatmaps(fig)[0].images[0].get_array(), w[-1, 0])
