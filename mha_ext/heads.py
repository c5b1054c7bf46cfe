"""What each attention head does: statistics of its weights, and what the
loss loses when the head is switched off.

Legend: B batch, H heads, Sq query length, Sk key length, Dk = E / H.

    report = mha_ext.heads.analyze(weights)                   # (B, H, Sq, Sk)
    report = mha_ext.heads.analyze(weights, module=mha, loss=lambda: f(mha))
    print(report)          # a text table; in a notebook an HTML table
    report.plot()          # a matplotlib Figure (the optional "plot" extra)

Per head, averaged over the batch and over the query rows that have weights
(a row with every key blocked is NaN, or 0 under masked_rows="zero", and is
left out):

``entropy``    -Σ_j a_ij·ln a_ij in nats: 0 for a head that looks at one key,
               ln Sk for one that spreads evenly.
``distance``   mean attention distance Σ_j a_ij·|i - j| in positions.
``previous``   weight on key i-1 (queries i >= 1).
``same``       weight on key i (the query's own position).
``first``      weight on key 0.
``mirror``     weight on key Sk-1-i (the mirror position; reversing needs it).
``loss_delta`` with ``module`` and ``loss``: loss with the head switched off
               minus the loss as it is.  Switching a head off zeroes its
               context C[:, h] before the output projection, which is done
               exactly by zeroing the columns h·Dk:(h+1)·Dk of W_o.weight
               for the duration of one ``loss()`` call; the module's
               parameters are restored afterwards (also when ``loss``
               raises).

Positions are those of the query and key axes (self-attention: i and j index
the same sequence); in a trace of a cached or lower-right call query i sits at
key position i + Sk - Sq (its info["query_position"] for i = 0).  A trace
whose weights went through dropout or a head mask is read through its
"softmax" step: the pattern, before those factors.  This module is plain
NumPy; ``plot`` imports matplotlib.
"""
from __future__ import annotations

import html
import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, SupportsFloat, Union

import numpy as np
from numpy.typing import ArrayLike

from . import _teach
from ._convert import too_large
from ._types import Real

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from .trace import Trace

__all__ = ["HeadReport", "analyze", "head_stats", "ablate"]

COLUMNS = ("entropy", "distance", "previous", "same", "first", "mirror")
_ABOUT = {"entropy": "attention entropy (nats)",
          "distance": "mean attention distance (positions)",
          "previous": "weight on the previous token",
          "same": "weight on the same token",
          "first": "weight on the first token",
          "mirror": "weight on the mirror position",
          "loss_delta": "loss increase when the head is switched off"}


class _OurHeads(Protocol):
    """mha_ext.MultiHeadAttention, mha_ext.torch.MultiHeadAttention (W_o
    checked at run time)."""

    @property
    def n_heads(self) -> int: ...


class _TorchHeads(Protocol):
    """torch.nn.MultiheadAttention, mha_ext.torch.MultiheadAttention
    (out_proj checked at run time)."""

    @property
    def num_heads(self) -> int: ...


_Heads = Union[_OurHeads, _TorchHeads]  # what ablate takes (_heads_and_out)


def _heads_and_out(module):
    """(H, the output projection's weight (E_out, E)), its columns the heads'
    contexts side by side, of a module ablate takes; else a TypeError."""
    for heads, out in (("n_heads", "W_o"), ("num_heads", "out_proj")):
        H = getattr(module, heads, None)
        w = getattr(getattr(module, out, None), "weight", None)
        if isinstance(H, (int, np.integer)) and not isinstance(H, bool) and H > 0 \
                and w is not None and len(getattr(w, "shape", ())) == 2:
            if "weight" in getattr(getattr(module, out), "parametrizations", {}):
                raise TypeError(f"{out}.weight is parametrized (torch.nn.utils.parametrize): "
                                f"it is computed at each call, so zeroing its columns would "
                                f"switch no head off; ablate a copy without the "
                                f"parametrization (parametrize.remove_parametrizations)")
            return int(H), w
    raise TypeError("module must be an attention module with n_heads and W_o.weight "
                    "(mha_ext's) or num_heads and out_proj.weight (torch's "
                    "nn.MultiheadAttention, mha_ext.torch.MultiheadAttention), got %r"
                    % (type(module).__name__,))


def _weights(weights):
    """(weights (B, H, Sq, Sk) as float64, the key position of query 0): a
    trace's softmax when its weights went through dropout or a head mask
    (the pattern, not those factors), its query_position (a cached or
    lower-right call); an array as given, queries at positions 0.."""
    w, averaged = _teach.weights_of(weights)
    if averaged:
        raise ValueError("this trace's weights are averaged over heads "
                         "(average_weights=True): trace with per-head weights")
    offset = 0
    if _teach.is_trace(weights):
        offset = int(weights.info.get("query_position", 0))
        if "softmax" in weights and (weights.info.get("dropout_active")
                                     or "head mask" in weights):
            w = np.asarray(weights["softmax"].array, dtype=np.float64)
    w = _with_rank_4(w)
    return w, offset


def _with_rank_4(w):
    if w.ndim == 3:
        w = w[None]
    if w.ndim != 4:
        raise ValueError("weights must be (B, H, Sq, Sk) or (H, Sq, Sk), got "
                         "shape %s" % (w.shape,))
    if w.shape[1] == 0:
        raise ValueError("weights have no heads (shape %s)" % (w.shape,))
    return w


def head_stats(weights: Trace | ArrayLike) -> dict[str, np.ndarray]:
    """The statistics of the module docstring: a dict column -> (H,) array.

    weights: (B, H, Sq, Sk) or (H, Sq, Sk), a NumPy array, torch tensor,
    nested lists or a Trace.  A head with no valid row gets NaN."""
    return _stats(*_weights(weights))


def _stats(w: np.ndarray, offset: int) -> dict[str, np.ndarray]:
    # head_stats of _weights' (B, H, Sq, Sk) float64 weights, query 0 at key offset
    B, H, Sq, Sk = w.shape
    # a row is left out when a value is NaN/inf or it is all 0 (every key
    # blocked under masked_rows="zero", or every weight dropped)
    valid = np.all(np.isfinite(w), axis=-1) & np.any(w != 0, axis=-1)  # (B, H, Sq)
    a = np.where(valid[..., None], w, 0.0)
    pos = np.arange(Sq) + offset                            # query i's key position
    i = pos[:, None]
    j = np.arange(Sk)[None, :]

    def mean_rows(per_row, rows=None):
        # per_row (B, H, Sq) -> (H,), over valid rows (and rows selected)
        ok = valid if rows is None else valid & rows
        n = ok.sum(axis=(0, 2))
        s = np.where(ok, per_row, 0.0).sum(axis=(0, 2))
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(n > 0, s / np.maximum(n, 1), np.nan)

    def at(offset_of_row):
        # weight on key k(i) for each query i; rows whose k(i) is outside Sk
        # are left out
        k = offset_of_row(pos)
        inside = (k >= 0) & (k < Sk)
        picked = a[..., np.arange(Sq), np.clip(k, 0, max(Sk - 1, 0))] \
            if Sk else np.zeros(a.shape[:-1])
        return mean_rows(picked, np.broadcast_to(inside, valid.shape))

    with np.errstate(divide="ignore", invalid="ignore"):
        plogp = np.where(a > 0, a * np.log(np.where(a > 0, a, 1.0)), 0.0)
    return {
        "entropy": mean_rows(-plogp.sum(-1)),
        "distance": mean_rows((a * np.abs(i - j)).sum(-1)),
        "previous": at(lambda q: q - 1),
        "same": at(lambda q: q),
        "first": at(lambda q: np.zeros_like(q)),
        "mirror": at(lambda q: Sk - 1 - q),
    }


def _required_arguments(fn: Callable[..., object]) -> bool:
    """Whether fn needs an argument (a loss written as loss(out)); False
    when its signature cannot be read (a builtin): the call then says."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    return any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD,
                                                   p.KEYWORD_ONLY)
               for p in sig.parameters.values())


def _loss_value(loss: Callable[[], SupportsFloat]) -> float:
    """loss() as a float, or a TypeError saying loss() must return a number
    (an int too large for a float: the ValueError that is also an
    OverflowError)"""
    value: Any = loss()
    if callable(getattr(value, "detach", None)):
        value = value.detach()  # a loss tensor that requires grad: its value
    try:  # (what asks about the value raises too: a tensor of many, RuntimeError)
        is_complex = getattr(value, "is_complex", None)  # a tensor's
        # float() reads '1.5', and drops a complex number's imaginary part
        refused = isinstance(value, (str, bytes, complex, np.complexfloating)) or (
            isinstance(value, np.ndarray) and value.dtype.kind == "c") or (
            callable(is_complex) and is_complex())
        if not refused:
            return float(value)
    except OverflowError:  # an int past a float's range: the error of docs/API.md §7
        raise too_large(value, "the value loss() returns") from None
    except (TypeError, ValueError, RuntimeError):
        pass
    raise TypeError("loss() must return a real number (a float, a 0-d array or a "
                    "one-element tensor), got %s" % (repr(value)[:80],))


def ablate(module: _Heads, loss: Callable[[], SupportsFloat]) -> tuple[float, np.ndarray]:
    """The loss with each head switched off: returns (base, per_head) where
    base = loss() as the module is and per_head[h] = loss() with head h's
    context zeroed (W_o.weight[:, h·Dk:(h+1)·Dk] = 0 during that call; put
    back after it, also when loss raised or a Ctrl-C landed on any step).

    module: an ``mha_ext.MultiHeadAttention``, ``mha_ext.torch``'s modules or
    ``torch.nn.MultiheadAttention`` (anything with ``n_heads`` and
    ``W_o.weight``, or ``num_heads`` and ``out_proj.weight``: its columns
    h·Dk:(h+1)·Dk are zeroed, torch's under ``torch.no_grad``).  loss: a
    callable with no arguments returning a number, that uses the module."""
    if not callable(loss) or _required_arguments(loss):
        raise TypeError("loss must be a callable with no arguments returning a number "
                        "(it runs the model itself, e.g. lambda: float(mha(x)[0].sum())), "
                        "got %r" % (loss,))
    H, w_o = _heads_and_out(module)
    E = int(w_o.shape[1])
    Dk = E // H
    base = _loss_value(loss)
    per_head = np.empty(H)
    for h in range(H):
        cols = slice(h * Dk, (h + 1) * Dk)
        with _editing(module):
            saved = _copy(w_o[:, cols])
        try:  # zeroed inside: an interrupt anywhere after the copy restores it
            with _editing(module):
                w_o[:, cols] = 0
            per_head[h] = _loss_value(loss)
        finally:
            # W_o's columns back; done again if an exception (a Ctrl-C
            # landing in this very step) stopped it, that exception then raised
            try:
                with _editing(module):
                    w_o[:, cols] = saved
            except BaseException:
                with _editing(module):
                    w_o[:, cols] = saved
                raise
    return base, per_head


def _editing(module):
    # mha_ext modules: atomic writes; torch parameters: outside autograd
    if hasattr(module, "editing"):
        return module.editing()
    import torch
    return torch.no_grad()


def _copy(x):
    return x.clone() if hasattr(x, "clone") else np.array(x, copy=True)


class HeadReport:
    """One row per head: ``report.columns`` names, ``report.values[c]`` an
    (H,) array per column, ``report.rows()`` a list of dicts, ``str()`` a
    text table, ``_repr_html_()`` an HTML table, ``plot()`` a Figure, and
    ``report.top(column)`` the head with the largest value of a column."""

    values: dict[str, np.ndarray]
    columns: list[str]
    base_loss: float | None
    shape: tuple[int, ...] | None
    n_heads: int

    def __init__(self, values: Mapping[str, ArrayLike], base_loss: float | None = None,
                 shape: tuple[int, ...] | None = None) -> None:
        self.values = {k: np.asarray(v, dtype=np.float64) for k, v in values.items()}
        self.columns = [c for c in COLUMNS + ("loss_delta",) if c in self.values]
        self.base_loss = base_loss
        self.shape = shape
        self.n_heads = len(next(iter(self.values.values())))

    def rows(self) -> list[dict[str, float]]:
        """One dict per head: "head" (its index, an int) and each column's value."""
        return [dict(head=h, **{c: float(self.values[c][h]) for c in self.columns})
                for h in range(self.n_heads)]

    def top(self, column: str) -> int | None:
        """The head with the largest value in column (NaN ignored)."""
        if column not in self.values:
            raise KeyError("no column %r; the columns are: %s"
                           % (column, ", ".join(self.columns)))
        v = self.values[column]
        if np.all(np.isnan(v)):
            return None
        return int(np.nanargmax(v))

    def roles(self, threshold: Real = 0.5) -> list[str]:
        """A short description per head: the positions (previous, same,
        first, mirror) that get more than threshold of its weight."""
        out = []
        for h in range(self.n_heads):
            r = [c for c in ("previous", "same", "first", "mirror")
                 if self.values[c][h] > threshold]
            out.append(", ".join(r) if r else "spread")
        return out

    def _cells(self) -> tuple[list[str], list[list[str]]]:
        roles = self.roles()
        rows = []
        for h in range(self.n_heads):
            rows.append(["%d" % h] + ["%.3f" % self.values[c][h] for c in self.columns]
                        + [roles[h]])
        return ["head"] + self.columns + ["looks at"], rows

    def __str__(self) -> str:
        head, rows = self._cells()
        w = [max(len(r[c]) for r in rows + [head]) for c in range(len(head))]
        line = lambda r: "  ".join(  # noqa: E731
            r[c].rjust(w[c]) if 0 < c < len(r) - 1 else r[c].ljust(w[c])
            for c in range(len(r))).rstrip()
        out = ["attention heads" + ("" if self.shape is None else
                                    " (weights %s)" % (list(self.shape),)),
               line(head), "  ".join("-" * n for n in w)]
        out += [line(r) for r in rows]
        if self.base_loss is not None:
            out.append("loss with every head on: %.4f" % self.base_loss)
        return "\n".join(out)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        e = html.escape
        head, rows = self._cells()
        td = 'style="text-align:%s;padding:2px 8px;font-family:monospace"'
        parts = ['<table class="mha-heads" style="border-collapse:collapse">',
                 '<caption style="text-align:left">attention heads</caption>',
                 "<thead><tr>"]
        for c in head:
            parts.append('<th %s title="%s">%s</th>'
                         % (td % "left", e(_ABOUT.get(c, c)), e(c)))
        parts.append("</tr></thead><tbody>")
        for r in rows:
            parts.append("<tr>" + "".join(
                "<td %s>%s</td>" % (td % ("right" if 0 < k < len(r) - 1 else "left"),
                                     e(c)) for k, c in enumerate(r)) + "</tr>")
        parts.append("</tbody></table>")
        if self.base_loss is not None:
            parts.append("<p>loss with every head on: %.4f</p>" % self.base_loss)
        return "\n".join(parts)

    def plot(self, figsize: tuple[float, float] | None = None) -> Figure:
        """Bars per head for each column: a matplotlib Figure."""
        from .plot import _matplotlib
        _, Figure = _matplotlib("HeadReport.plot")
        n = len(self.columns)
        ncols = min(n, 4)
        nrows = -(-n // ncols)
        fig = Figure(figsize=figsize or (3.0 * ncols, 2.4 * nrows), layout="constrained")
        axes = fig.subplots(nrows, ncols, squeeze=False)
        heads = np.arange(self.n_heads)
        for k in range(nrows * ncols):
            ax = axes[k // ncols][k % ncols]
            if k >= n:
                ax.set_visible(False)
                continue
            c = self.columns[k]
            ax.bar(heads, np.nan_to_num(self.values[c]),
                   color="C3" if c == "loss_delta" else "C0")
            ax.set_title(_ABOUT[c], fontsize=9)
            ax.set_xticks(heads)
            ax.set_xlabel("head", fontsize=8)
        fig.suptitle("what each head does")
        return fig


def analyze(weights: Trace | ArrayLike, module: _Heads | None = None,
            loss: Callable[[], SupportsFloat] | None = None) -> HeadReport:
    """A :class:`HeadReport` of the weights (B, H, Sq, Sk) or (H, Sq, Sk)
    (a 3-D array is read as heads: pass per-head weights, not the mean over
    heads of ``average_weights=True``), or of a trace; with ``module`` and
    ``loss``, a callable with no arguments that runs the model (see
    :func:`ablate`), it adds the column ``loss_delta``."""
    w, offset = _weights(weights)
    values = _stats(w, offset)
    base = None
    if (module is None) != (loss is None):
        raise ValueError("give both module and loss (to switch heads off), or neither")
    if module is not None and loss is not None:  # both or neither, as checked
        H, _ = _heads_and_out(module)
        if H != w.shape[1]:
            raise ValueError("the weights have %d heads but the module has %s"
                             % (w.shape[1], H))
        base, per_head = ablate(module, loss)
        values["loss_delta"] = per_head - base
    return HeadReport(values, base, w.shape)
