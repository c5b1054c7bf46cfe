"""mha_ext.plot_heads: one heatmap per head, shared colour scale, PNG out.

Legend: B batch, H heads, Sq/Sk query/key length.
"""

import io
import os
import subprocess
import sys

import numpy as np
import pytest

import mha_ext
from mha_ext.plot import plot_heads
from _support import PKG_ROOT, has, need



@pytest.fixture
def mpl():
    return need("matplotlib")


def attention(B=2, S=7, E=24, H=6, seed=0, **kw):
    m = mha_ext.MultiHeadAttention(E, H, seed=seed).eval()
    x = np.random.default_rng(seed).standard_normal((B, S, E))
    return m(x, **kw)[1]


def heatmaps(fig):
    return [ax for ax in fig.axes if ax.images and ax.get_title()]


def test_one_panel_per_head(mpl):
    from matplotlib.figure import Figure
    w = attention()                                   # (2, 6, 7, 7)
    tokens = "the cat sat on the mat .".split()
    fig = plot_heads(w, tokens=tokens)
    assert isinstance(fig, Figure)
    panels = heatmaps(fig)
    assert len(panels) == 6
    assert [ax.get_title() for ax in panels] == ["head %d" % h
                                                 for h in range(6)]
    for h, ax in enumerate(panels):
        np.testing.assert_allclose(ax.images[0].get_array(), w[0, h])
    # one shared colour scale, shown by one colour bar
    clims = {ax.images[0].get_clim() for ax in panels}
    assert len(clims) == 1
    lo, hi = clims.pop()
    assert lo == 0 and hi == pytest.approx(w[0].max())
    bars = [ax for ax in fig.axes if ax not in panels and ax.get_visible()]
    assert len(bars) == 1 and bars[0].get_ylabel() == "attention weight"
    assert panels[-1].images[0].colorbar.ax is bars[0]
    # token labels on both axes (left column: queries, bottom row: keys)
    ys = [t.get_text() for t in panels[0].get_yticklabels()]
    xs = [t.get_text() for t in panels[-1].get_xticklabels()]
    assert ys == tokens and xs == tokens
    assert "batch 0" in fig._suptitle.get_text()


def test_saves_png(mpl, tmp_path):
    w = attention(S=9, H=8, E=32, is_causal=True)
    fig = plot_heads(w, batch=1, tokens=["t%d" % i for i in range(9)])
    path = tmp_path / "heads.png"
    fig.savefig(path, dpi=60)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image
    img = matplotlib.image.imread(str(path))
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    assert img[..., :3].std() > 0.05                  # not a blank canvas


def test_labels_are_text_and_may_come_from_a_generator(mpl, tmp_path):
    # tokens are drawn as given: "$" is not matplotlib's math (which raised
    # at savefig for "$$" or "$_$"); a generator labels both axes
    w = np.full((1, 4, 4), 0.25)
    toks = ["$$", "$_$", "$x$", "a&b"]
    fig = plot_heads(w, tokens=(t for t in toks))
    fig.savefig(tmp_path / "labels.png", dpi=40)
    ax = heatmaps(fig)[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == toks
    assert [t.get_text() for t in ax.get_yticklabels()] == toks


def test_batch_index_and_unbatched(mpl):
    w = attention(B=3, H=4, E=16)
    fig = plot_heads(w, batch=2)
    for h, ax in enumerate(heatmaps(fig)):
        np.testing.assert_allclose(ax.images[0].get_array(), w[2, h])
    fig = plot_heads(w, batch=-1)
    np.testing.assert_allclose(heatmaps(fig)[0].images[0].get_array(),
                               w[2, 0])
    fig = plot_heads(w[1])                            # unbatched (H, Sq, Sk)
    assert len(heatmaps(fig)) == 4
    np.testing.assert_allclose(heatmaps(fig)[3].images[0].get_array(),
                               w[1, 3])


def test_cross_attention_labels_and_options(mpl):
    m = mha_ext.MultiHeadAttention(12, 3, seed=1).eval()
    rng = np.random.default_rng(1)
    _, w = m(rng.standard_normal((1, 2, 12)), rng.standard_normal((1, 5, 12)))
    fig = plot_heads(w, query_tokens=["q0", "q1"],
                     key_tokens=list("abcde"), ncols=2, title="cross",
                     cmap="magma", figsize=(6, 5))
    panels = heatmaps(fig)
    assert len(panels) == 3
    assert [t.get_text() for t in panels[0].get_yticklabels()] == ["q0", "q1"]
    bottom = [t.get_text() for t in panels[-1].get_xticklabels()]
    assert bottom == list("abcde")
    assert fig._suptitle.get_text() == "cross"
    assert tuple(fig.get_size_inches()) == (6, 5)
    assert panels[0].images[0].get_cmap().name.startswith("magma")


def test_nan_rows_and_dropout_scale(mpl):
    mask = np.zeros((4, 4))
    mask[1] = 1                                     # query 1 sees nothing
    w = attention(S=4, H=2, E=8, mask=mask)
    assert np.isnan(w[0, :, 1]).all()
    fig = plot_heads(w)
    arr = heatmaps(fig)[0].images[0].get_array()
    assert np.ma.getmaskarray(arr)[1].all()         # drawn as "bad" (grey)
    assert np.isfinite(heatmaps(fig)[0].images[0].get_clim()).all()
    # weights after dropout exceed 1: the scale follows the data
    w2 = np.full((1, 2, 3, 3), 0.5)
    w2[0, 1, 0, 0] = 2.0
    assert heatmaps(plot_heads(w2))[0].images[0].get_clim() == (0, 2.0)


def test_accepts_a_trace_and_torch(mpl):
    m = mha_ext.MultiHeadAttention(16, 4, seed=2).eval()
    tr = m.trace(np.random.default_rng(2).standard_normal((1, 3, 16)))
    assert len(heatmaps(plot_heads(tr))) == 4


def test_bad_arguments(mpl):
    w = attention(B=2, H=2, E=8, S=3)
    with pytest.raises(ValueError, match="shape"):
        plot_heads(w[0, 0])                               # 2-D
    with pytest.raises(IndexError, match="batch") as info:
        plot_heads(w, batch=2)
    assert isinstance(info.value, ValueError)  # API.md §7's type, and indexing's
    for ncols in (0, -3):  # (silently one panel a row before)
        with pytest.raises(ValueError, match="ncols must be an int >= 1"):
            plot_heads(w, ncols=ncols)
    with pytest.raises(TypeError, match="ncols"):
        plot_heads(w, ncols=1.5)
    with pytest.raises(ValueError, match="tokens"):
        plot_heads(w, tokens=["a", "b"])
    with pytest.raises(ValueError, match="key_tokens"):
        plot_heads(w, key_tokens=["a"])
    with pytest.raises(TypeError):
        plot_heads(np.array([["a"]]))


def test_missing_matplotlib_says_how_to_install(monkeypatch):
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # import fails
    with pytest.raises(ImportError, match=r'pip install "mha_ext\[plot\]"'):
        plot_heads(np.full((1, 2, 2, 2), 0.5))
    # a HeadReport's plot names itself, not plot_heads
    m = mha_ext.MultiHeadAttention(8, 2, seed=0)
    report = mha_ext.heads.analyze(m.trace(np.ones((1, 4, 8), np.float32)))
    with pytest.raises(ImportError, match=r'^HeadReport.plot needs matplotlib'):
        report.plot()


def test_positions_without_tokens_are_whole_numbers(mpl):
    """A few queries or keys without tokens: the axes count whole positions
    (matplotlib's own ticks said "query -0.25")."""
    for shape in ((1, 2, 5), (1, 5, 1), (2, 3, 3)):
        fig = plot_heads(np.full(shape, 1.0 / shape[-1]))
        ax = fig.axes[0]
        for ticks, lim in ((ax.get_xticks(), ax.get_xlim()), (ax.get_yticks(), ax.get_ylim())):
            shown = [t for t in ticks if min(lim) <= t <= max(lim)]
            assert shown and all(float(t).is_integer() for t in shown), (shape, ticks)


def test_import_does_not_import_matplotlib(tmp_path):
    code = ("import sys, mha_ext, mha_ext.plot; "
            "print('matplotlib' in sys.modules)")
    env = dict(os.environ)
    env["PYTHONPATH"] = PKG_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, env=env, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def hatched_cells(ax, shape):
    """The cells the panel's hatching covers (a count per cell: 1 = once),
    and its number of rectangles: one path of rectangles, 5 vertices each."""
    from matplotlib.patches import PathPatch
    hatched = [p for p in ax.patches if isinstance(p, PathPatch) and p.get_hatch() == "////"]
    assert len(hatched) == 1
    rects = hatched[0].get_path().vertices.reshape(-1, 5, 2) + 0.5
    cells = np.zeros(shape, dtype=int)
    for r in rects:
        (x0, y0), (x1, y1) = r[0].astype(int), r[2].astype(int)
        cells[y0:y1, x0:x1] += 1
    return cells, len(rects)


def test_blocked_cells_hatched_row_scale_and_thinned_labels(mpl):
    m = mha_ext.MultiHeadAttention(16, 2, seed=3).eval()
    S = 40
    tr = m.trace(np.random.default_rng(3).standard_normal((1, S, 16)), is_causal=True)
    tokens = ["t%d" % i for i in range(S)]
    fig = plot_heads(tr, tokens=tokens, scale="row")
    panels = heatmaps(fig)
    blocked = np.triu(np.ones((S, S), dtype=bool), 1)
    for h, ax in enumerate(panels):
        arr = ax.images[0].get_array()
        # blocked cells are not drawn as weight 0 but hatched on top
        assert np.array_equal(np.ma.getmaskarray(arr), blocked)
        cells, n = hatched_cells(ax, (S, S))
        assert np.array_equal(cells, blocked.astype(int))  # each blocked cell once
        assert n == S - 1   # a rectangle per row's run, not a patch per cell (that
        #                     took ~0.2 ms a cell: minutes for a long causal trace)
        # per-row scale: every row's largest weight is the top of the scale
        np.testing.assert_allclose(arr.max(axis=1), 1.0, rtol=1e-6)
        np.testing.assert_allclose(arr[5, :6], tr.weights[0, h, 5, :6] / tr.weights[0, h, 5].max(),
                                   rtol=1e-5)
    assert panels[-1].images[0].colorbar.ax.get_ylabel() == "weight / largest in its row"
    ys = [t.get_text() for t in panels[0].get_yticklabels()]
    assert 10 <= len(ys) <= 24 and ys[:2] == ["t0", "t2"]
    # an explicit mask for plain weights; the default scale stays shared
    w = np.asarray(tr.weights)
    arr = heatmaps(plot_heads(w, blocked=blocked))[0].images[0].get_array()
    assert np.array_equal(np.ma.getmaskarray(arr), blocked)
    assert len(heatmaps(plot_heads(w))[0].patches) == 0
    # scattered cells: the rectangles cover exactly them
    scattered = np.random.default_rng(4).random((S, S)) < 0.4
    cells, _ = hatched_cells(heatmaps(plot_heads(w, blocked=scattered))[0], (S, S))
    assert np.array_equal(cells, scattered.astype(int))
    with pytest.raises(ValueError, match='scale must be "shared" or "row"'):
        plot_heads(w, scale="rows")
    with pytest.raises(ValueError, match="blocked must broadcast"):
        plot_heads(w, blocked=np.ones(3))


def test_a_trace_of_averaged_weights_is_one_panel_not_a_head_per_batch_item(mpl):
    m = mha_ext.MultiHeadAttention(16, 4, seed=0).eval()
    t = m.trace(np.ones((3, 5, 16)), average_weights=True, is_causal=True)
    panels = heatmaps(plot_heads(t, batch=2))
    assert [ax.get_title() for ax in panels] == ["mean over heads"]
    cells, _ = hatched_cells(panels[0], (5, 5))      # the causal mask's cells
    assert np.array_equal(cells, np.triu(np.ones((5, 5), dtype=int), 1))


@pytest.mark.parametrize("kwargs, exc, words", [
    ({"blocked": "abc"}, TypeError, "blocked must be a BlockLayout"),
    ({"blocked": object()}, TypeError, "blocked must be a BlockLayout"),
    ({"tokens": "abcdefg"}, TypeError, "split it first"),
    ({"tokens": list("abc")}, ValueError, "has 3 labels but the weights have 7 queries"),
    ({"query_tokens": list("abcdefg"), "key_tokens": list("ab")}, ValueError,
     "key_tokens has 2 labels but the weights have 7 keys"),
])
def test_bad_labels_and_blocked_are_clear_errors(mpl, kwargs, exc, words):
    with pytest.raises(exc) as e:
        plot_heads(attention(), **kwargs)
    assert words in str(e.value)


def test_row_scale_of_a_fully_blocked_row_warns_nothing(mpl):
    import warnings
    w = attention(S=4)
    blocked = np.zeros((4, 4), dtype=bool)
    blocked[1] = True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plot_heads(w, scale="row", blocked=blocked)


def test_hatching_comes_from_the_masks_not_from_minus_inf_scores(mpl):
    """scale=+inf sends finite scores to -inf: only the causal cells are
    hatched (they were read back from -inf scores once)."""
    m = mha_ext.MultiHeadAttention(16, 2, seed=3).eval()
    S = 6
    tr = m.trace(np.random.default_rng(3).standard_normal((1, S, 16)), is_causal=True,
                 scale=float("inf"))
    causal = np.triu(np.ones((S, S), dtype=bool), 1)
    assert np.isneginf(tr["masked scores"].array[..., ~causal]).any()
    for ax in heatmaps(plot_heads(tr)):
        cells, _ = hatched_cells(ax, (S, S))
        assert np.array_equal(cells, causal.astype(int))


def test_nothing_to_plot_is_a_clear_error(mpl):
    with pytest.raises(ValueError, match="nothing to plot: the weights have no queries"):
        plot_heads(np.zeros((2, 0, 3)))
    with pytest.raises(ValueError, match="nothing to plot: the weights have no keys"):
        plot_heads(np.zeros((1, 2, 3, 0)))
    # no batch element (an IndexError, "batch 0 is out of range", before)
    with pytest.raises(ValueError, match="nothing to plot: the weights have no batch elements"):
        plot_heads(np.zeros((0, 2, 3, 3)))
    m = mha_ext.MultiHeadAttention(16, 2, seed=0).eval()
    with pytest.raises(ValueError, match=r"no weights \(need_weights=False\): trace the call"):
        plot_heads(m.trace(np.ones((1, 3, 16)), need_weights=False))


def test_the_figure_is_a_matplotlib_figure_with_a_png_for_notebooks(mpl):
    import pickle
    from matplotlib.figure import Figure
    fig = plot_heads(attention(S=4))
    assert isinstance(fig, Figure)
    png = fig._repr_png_()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
    again = pickle.loads(pickle.dumps(fig))      # a figure pickles, as matplotlib's do
    assert len(heatmaps(again)) == len(heatmaps(fig)) == 6


@pytest.mark.parametrize("kw, err, says", [
    (dict(vmin=float("nan")), ValueError, "vmin must be a finite real number"),
    (dict(vmax=float("inf")), ValueError, "vmax must be a finite real number"),
    (dict(vmin=0.5, vmax=0.1), ValueError, "vmin must not exceed vmax"),
    (dict(vmin="a"), TypeError, "vmin must be a real number or None, got str"),
    (dict(vmax=True), TypeError, "vmax must be a real number or None, got bool"),
    (dict(vmin=10 ** 400), OverflowError, "vmin must be a finite real number"),
    (dict(vmax=np.array(True)), TypeError, "vmax must be a real number or None, got ndarray"),
    (dict(vmax=np.array([0.5])), TypeError, "vmax must be a real number or None, got ndarray"),
    (dict(vmax=1j), TypeError, "vmax must be a real number or None, got complex"),
])
def test_a_colour_scale_limit_that_cannot_draw_is_refused_by_name(mpl, kw, err, says):
    # (before: NaN or inf drew every cell in one colour, vmin > vmax failed
    # only when drawn, in matplotlib's words, a string with a bare TypeError)
    w = np.random.default_rng(0).random((1, 2, 3, 3))
    with pytest.raises(err, match=says):
        mha_ext.plot_heads(w, **kw)


def test_a_limit_float_takes_draws_0_d_arrays_and_tensors_too(mpl):
    # vmax=w.max() of the weights plot_heads draws (a 0-d array, or tensor)
    import decimal
    w = np.random.default_rng(0).random((1, 2, 3, 3))
    limits = [w.max(), np.array(0.5), np.float16(0.25), decimal.Decimal("0.75")]
    if has("torch"):
        import torch
        limits.append(torch.from_numpy(w).max())
    for v in limits:
        fig = mha_ext.plot_heads(w, vmax=v)
        assert fig.axes[0].images[0].get_clim()[1] == float(v)


def test_a_vmax_below_every_weight_still_draws(mpl):
    w = np.random.default_rng(0).random((1, 2, 3, 3))
    fig = mha_ext.plot_heads(w, vmax=-5.0)
    assert fig.axes[0].images[0].get_clim() == (-6.0, -5.0)
    fig.savefig(io.BytesIO())                       # draws (matplotlib checks vmin <= vmax)
