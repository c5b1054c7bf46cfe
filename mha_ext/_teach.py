"""The arguments the teaching tools share (plot_heads, explore,
heads.analyze): attention weights given as a Trace or an array, token
labels, blocked cells.

Legend: B batch, H heads, Sq query length, Sk key length.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import numpy as np

from ._convert import as_array
from .layout import BlockLayout


def is_trace(x: object) -> bool:
    return hasattr(x, "steps") and hasattr(x, "weights")


def weights_of(source: Any) -> tuple[np.ndarray, bool]:
    """(weights as a float64 array, averaged): a Trace's weights (averaged:
    made with average_weights=True, so one fewer axis than its per-head
    scores) or an array of real numbers as given (averaged False)."""
    averaged = False
    if is_trace(source):
        if source.weights is None:
            raise ValueError("this trace has no weights (need_weights=False): trace the "
                             "call with need_weights=True (explore(trace) shows its "
                             "\"softmax\" step either way)")
        averaged = ("masked scores" in source and
                    np.ndim(source.weights) < np.ndim(source["masked scores"].array))
        source = source.weights
    w = as_array(source, "weights")
    if w.dtype.kind not in "biuf":
        raise TypeError("weights must be real numbers, got dtype %s" % w.dtype)
    return w.astype(np.float64), averaged


def trace_blocked(tr: Any) -> np.ndarray | None:
    """A trace's blocked cells (True where a mask blocked the cell), the
    masked scores' shape, or None: its info["blocked"], else (an object
    like a trace without it) the masked scores' -inf cells."""
    info = getattr(tr, "info", None)
    if isinstance(info, dict) and "blocked" in info:
        b = info["blocked"]
        return None if b is None else np.asarray(b, dtype=bool)
    if "masked scores" not in tr:
        return None
    return np.asarray(np.isneginf(np.asarray(tr["masked scores"].array)))


def write_page(path: str | os.PathLike[str], page: str) -> str:
    """Write an HTML page as UTF-8; encoded before the file is made (a lone
    surrogate: an error, no half-written file).  Returns the path as a str."""
    path = os.fspath(path)
    data = page.encode("utf-8")
    with open(path, "wb") as f:
        f.write(data)
    return path


def shared_labels(tokens: Iterable[object] | None) -> Iterable[object] | None:
    """tokens read once (a generator labels both axes), a str left for
    labels() to refuse."""
    if tokens is None or isinstance(tokens, str):
        return tokens
    return list(tokens)


def labels(tokens: Iterable[object] | None, n: int, what: str,
           axis: str) -> list[str] | None:
    """tokens as n strings, or None; `what` names the argument, `axis` the
    weights' axis it labels ("queries" or "keys")."""
    if tokens is None:
        return None
    if isinstance(tokens, str):
        raise TypeError("%s must be a sequence of labels, got a str (split it first: "
                        "text.split())" % what)
    out = [str(t) for t in tokens]
    if len(out) != n:
        raise ValueError("%s has %d labels but the weights have %d %s"
                         % (what, len(out), n, axis))
    return out


def blocked_cells(blocked: object, shape: tuple[int, ...]) -> np.ndarray | None:
    """True where a cell of weights of `shape` is blocked, from `blocked`: a
    BlockLayout (its blocks not kept) or an array of bools or numbers
    broadcastable to shape (nonzero: blocked); None stays None."""
    if blocked is None:
        return None
    if isinstance(blocked, BlockLayout):
        b = ~blocked.to_dense(shape[-2], shape[-1])
    else:
        b = as_array(blocked, "blocked")
        if b.dtype.kind not in "biuf":
            raise TypeError("blocked must be a BlockLayout or an array of bools (True where "
                            "blocked) broadcastable to the weights, got dtype %s" % b.dtype)
        b = b != 0
    try:
        return np.broadcast_to(b, shape)
    except ValueError:
        raise ValueError("blocked must broadcast to the weights' shape %s, got %s"
                         % (shape, b.shape)) from None
