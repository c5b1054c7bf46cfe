"""Heatmaps of attention weights, one panel per head.

Legend: B batch, H heads, Sq query length, Sk key length.

matplotlib is an optional extra (``pip install "mha_ext[plot]"``); it is
imported only when :func:`plot_heads` is called, and the figure is built
with ``matplotlib.figure.Figure`` directly (no pyplot, no GUI backend), so it
works headless and never opens a window.  The figure is a Figure subclass
that gives IPython a PNG (``_repr_png_``): as a notebook cell's last
expression it is drawn even where ``%matplotlib inline`` was never run.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING, Literal, SupportsFloat, cast

import numpy as np
from numpy.typing import ArrayLike

from . import _teach
from ._convert import ValueErrorAndIndexError, as_float
from ._types import Int, Real
from .layout import BlockLayout

if TYPE_CHECKING:  # matplotlib is optional: imported when plot_heads runs
    from matplotlib.figure import Figure

    from .trace import Trace

__all__ = ["plot_heads"]

_INSTALL = ('%s needs matplotlib, an optional extra of mha_ext: '
            'pip install "mha_ext[plot]" (or: pip install matplotlib)')


def _limit(value, name):
    """vmin or vmax: None or a finite real number (a NaN or infinite one
    would draw every cell in one colour), as a float: anything float()
    takes but a bool or text, 0-d arrays and tensors too (w.max())."""
    if value is None:
        return None
    kind = str(getattr(value, "dtype", ""))
    if isinstance(value, (bool, np.bool_, str, bytes)) or kind in ("bool", "torch.bool") or \
            getattr(value, "ndim", 0) != 0:
        raise TypeError("%s must be a real number or None, got %s" % (name, type(value).__name__))
    try:
        v = as_float(value, name, "a finite real number")
    except (TypeError, ValueError) as exc:
        if isinstance(exc, OverflowError):      # too large for a float: as_float's error
            raise
        raise TypeError("%s must be a real number or None, got %s"
                        % (name, type(value).__name__)) from None
    if not math.isfinite(v):
        raise ValueError("%s must be a finite real number or None, got %r" % (name, v))
    return v


def _matplotlib(who="plot_heads"):
    try:
        import matplotlib

        from ._figure import HeadsFigure
    except ImportError as exc:
        raise ImportError(_INSTALL % who) from exc
    return matplotlib, HeadsFigure


def _blocked(weights: object, blocked: object,
             shape: tuple[int, ...]) -> np.ndarray | None:
    # True where a mask blocked the cell: given, or a Trace's masks (for
    # weights averaged over heads: the cells blocked in every head)
    if blocked is None and _teach.is_trace(weights):
        m = _teach.trace_blocked(cast("Trace", weights))
        if m is None:
            return None
        if m.shape != shape and m.ndim >= 3:
            m = np.asarray(m.all(axis=-3, keepdims=True))
        return m if m.shape == shape else None
    return _teach.blocked_cells(blocked, shape)


def _ticks(n):
    # at most about 24 labels per axis: every k-th one for long sequences
    return range(0, n, max(1, math.ceil(n / 24)))


def plot_heads(weights: Trace | ArrayLike, batch: Int = 0,
               tokens: Iterable[object] | None = None, *,
               query_tokens: Iterable[object] | None = None,
               key_tokens: Iterable[object] | None = None, cmap: str = "viridis",
               ncols: Int | None = None, figsize: tuple[Real, Real] | None = None,
               title: str | None = None, vmin: SupportsFloat | None = None,
               vmax: SupportsFloat | None = None,
               scale: Literal["shared", "row"] = "shared",
               blocked: ArrayLike | BlockLayout | None = None) -> Figure:
    """Draw one heatmap per head and return the matplotlib ``Figure`` (in a
    notebook, the last expression of a cell shows it as a picture).

    weights       attention weights (B, H, Sq, Sk), as returned by a call, or
                  unbatched (H, Sq, Sk); a :class:`~mha_ext.Trace` works too
                  (made with average_weights=True: one panel, the mean over
                  heads; such weights as an array: add the head axis,
                  w[:, None]).  A NumPy array, a torch tensor or nested lists.
    batch         which batch element to draw (ignored for 3-D weights).
    tokens        labels of the sequence, put on both axes (self-attention).
    query_tokens, key_tokens
                  labels for the rows (queries) and columns (keys) when they
                  differ (cross-attention); they override ``tokens``.
    cmap          a matplotlib colour map name.
    ncols         panels per row (default: up to 4).
    figsize       (width, height) in inches (default: from the grid).
    title         the figure's title (default: "attention weights, batch b").
    vmin, vmax    the shared colour scale (default: 0 to the largest weight):
                  finite real numbers, vmin <= vmax (else a ValueError).
    scale         "shared" (default): every panel uses the same colour scale,
                  shown by one colour bar; "row": each row is divided by its
                  largest weight, so rows with many keys (late queries of a
                  causal mask) are as readable as row 0 (vmin/vmax then
                  apply to that ratio, 0 to 1 by default).
    blocked       True where a mask blocked the cell, broadcastable to the
                  weights, or a mha_ext.layout.BlockLayout (its blocks not
                  kept); taken from a Trace's masks (the layout's too) when a
                  Trace is given.  Blocked cells are drawn hatched, not as
                  weight 0.

    Rows that are NaN (a query with every key blocked) are drawn in grey.
    Long sequences get every k-th label (about 24 per axis).  Save the
    figure with ``fig.savefig("heads.png")``.
    """
    if scale not in ("shared", "row"):
        raise ValueError('scale must be "shared" or "row", got %r' % (scale,))
    w, averaged = _teach.weights_of(weights)
    if averaged:                                    # one panel: the mean over heads
        w = w[..., None, :, :]
    blk = _blocked(weights, blocked, w.shape)
    if w.ndim == 4:
        nb = w.shape[0]
        if not isinstance(batch, (int, np.integer)) or isinstance(batch, bool):
            raise TypeError("batch must be an int, got %r" % (batch,))
        if nb == 0:  # (as explore says it, and plot_heads for no query or key)
            raise ValueError("there is nothing to plot: the weights have no batch elements "
                             "(shape %s)" % (w.shape,))
        if not -nb <= batch < nb:
            raise ValueErrorAndIndexError("batch %d is out of range for %d batch elements"
                                          % (batch, nb))
        w = w[batch]
        blk = None if blk is None else blk[batch]
        label_b = "batch %d" % (batch % nb)
    elif w.ndim == 3:
        label_b = None
    else:
        raise ValueError("weights must be (B, H, Sq, Sk) or (H, Sq, Sk), got "
                         "shape %s" % (w.shape,))
    H, Sq, Sk = w.shape
    if H == 0:
        raise ValueError("weights have no heads (shape %s)" % (w.shape,))
    if Sq == 0 or Sk == 0:
        raise ValueError("there is nothing to plot: the weights have no %s (shape %s)"
                         % ("queries" if Sq == 0 else "keys", w.shape))
    tokens = _teach.shared_labels(tokens)
    ylab = _teach.labels(query_tokens if query_tokens is not None else tokens, Sq,
                         "query_tokens" if query_tokens is not None else "tokens", "queries")
    xlab = _teach.labels(key_tokens if key_tokens is not None else tokens, Sk,
                         "key_tokens" if key_tokens is not None else "tokens", "keys")

    matplotlib, Figure = _matplotlib()
    from matplotlib.colors import Normalize
    from matplotlib.ticker import MaxNLocator

    if ncols is None:
        ncols = min(H, 4)
    if isinstance(ncols, (bool, np.bool_)) or not isinstance(ncols, (int, np.integer)):
        raise TypeError("ncols must be an int >= 1, got %r" % (ncols,))
    if ncols < 1:
        raise ValueError("ncols must be an int >= 1 (panels per row), got %d" % ncols)
    ncols = min(int(ncols), H)
    nrows = math.ceil(H / ncols)
    if figsize is None:
        cell = 2.6 if max(Sq, Sk) <= 16 else 3.2
        figsize = (cell * ncols + 1.2, cell * nrows + 0.8)

    if blk is not None:
        w = np.where(blk, np.nan, w)                # not drawn as weight 0
    if scale == "row":
        with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)     # a row all NaN: blocked
            top = np.nanmax(np.where(np.isfinite(w), w, np.nan), axis=-1,
                            keepdims=True) if w.size else w
            w = np.where(top > 0, w / np.where(top > 0, top, 1), w)
    lo, hi = _limit(vmin, "vmin"), _limit(vmax, "vmax")
    if lo is not None and hi is not None and lo > hi:
        raise ValueError("vmin must not exceed vmax (the colour scale runs from vmin to "
                         "vmax), got vmin=%g, vmax=%g" % (lo, hi))
    finite = w[np.isfinite(w)]
    if lo is None:
        lo = min(0.0, float(finite.min())) if finite.size else 0.0
        if hi is not None and lo > hi:    # a given vmax below every weight
            lo = hi - 1.0
    if hi is None:
        hi = float(finite.max()) if finite.size else 1.0
        if hi <= lo:
            hi = lo + 1.0

    try:
        cm = matplotlib.colormaps[cmap]
    except (AttributeError, TypeError):             # matplotlib < 3.5
        cm = matplotlib.cm.get_cmap(cmap)
    cm = cm.with_extremes(bad="0.8")

    fig = Figure(figsize=figsize, layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    # one scale object for every panel and the colour bar: where the bar
    # widens equal limits (vmin == vmax) every panel follows
    norm = Normalize(vmin=lo, vmax=hi)
    image = None
    shown = []
    for h in range(nrows * ncols):
        ax = axes[h // ncols][h % ncols]
        if h >= H:
            ax.set_visible(False)
            continue
        image = ax.imshow(np.ma.masked_invalid(w[h]), cmap=cm, norm=norm, aspect="auto",
                          interpolation="nearest")
        if blk is not None and blk[h].any():
            _hatch(ax, blk[h])
        shown.append(ax)
        ax.set_title("mean over heads" if averaged else "head %d" % h, fontsize=10)
        left = h % ncols == 0
        bottom = h + ncols >= H           # no panel below this one
        if xlab is not None:
            xt = _ticks(Sk)
            ax.set_xticks(xt)
            ax.set_xticklabels([xlab[k] for k in xt] if bottom else [],  # tokens are
                               rotation=90, fontsize=8, parse_math=False)  # text, not $math$
        else:  # positions: whole numbers (matplotlib's own give -0.25, 0.5 ...)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
            if not bottom:
                ax.set_xticklabels([])
        if ylab is not None:
            yt = _ticks(Sq)
            ax.set_yticks(yt)
            ax.set_yticklabels([ylab[k] for k in yt] if left else [], fontsize=8,
                               parse_math=False)
        else:
            ax.yaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
            if not left:
                ax.set_yticklabels([])
        if bottom:
            ax.set_xlabel("key")
        if left:
            ax.set_ylabel("query")
    fig.colorbar(image, ax=shown, shrink=0.9,
                 label="attention weight" if scale == "shared"
                 else "weight / largest in its row")
    if title is None:
        title = "attention weights" + (", " + label_b if label_b else "")
    if title:
        fig.suptitle(title)
    return fig


def _runs(blocked: np.ndarray) -> list[tuple[int, int, int, int]]:
    """Rectangles (y0, y1, x0, x1), half-open, covering exactly the True
    cells of blocked (Sq, Sk): each row's runs of True, a run that repeats
    in the rows below merged into one rectangle (a causal mask: one per
    row; the rectangles never overlap)."""
    b = np.asarray(blocked, dtype=bool)
    edge = np.zeros((b.shape[0], 1), dtype=np.int8)
    d = np.diff(np.concatenate([edge, b.astype(np.int8), edge], axis=1), axis=1)
    open_runs: dict[tuple[int, int], int] = {}  # (x0, x1) -> its first row
    out: list[tuple[int, int, int, int]] = []
    for y in range(b.shape[0]):
        row = set(zip(np.flatnonzero(d[y] == 1).tolist(), np.flatnonzero(d[y] == -1).tolist()))
        for run in [r for r in open_runs if r not in row]:
            out.append((open_runs.pop(run), y) + run)
        for run in row:
            open_runs.setdefault(run, y)
    out += [(y0, b.shape[0]) + run for run, y0 in open_runs.items()]
    return out


def _hatch(ax, blocked):
    # blocked (Sq, Sk) bool: grey hatched cells, as one path of rectangles
    # (a patch per cell took ~0.2 ms each: 40 s for a causal S 600 head)
    from matplotlib.patches import PathPatch
    from matplotlib.path import Path
    verts, codes = [], []
    for y0, y1, x0, x1 in _runs(blocked):
        verts += [(x0 - 0.5, y0 - 0.5), (x1 - 0.5, y0 - 0.5), (x1 - 0.5, y1 - 0.5),
                  (x0 - 0.5, y1 - 0.5), (x0 - 0.5, y0 - 0.5)]
        codes += [Path.MOVETO, Path.LINETO, Path.LINETO, Path.LINETO, Path.CLOSEPOLY]
    ax.add_patch(PathPatch(Path(verts, codes), facecolor="0.93", edgecolor="0.6",
                           hatch="////", linewidth=0))
