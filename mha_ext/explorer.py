"""An interactive attention explorer that works offline: plain HTML, CSS and
JavaScript with the data embedded, nothing fetched at run time.

Legend: B batch, H heads, Sq query length, Sk key length.

    ex = mha_ext.explore(mha.trace(x, is_causal=True), tokens=words)
    ex                        # in a notebook: the explorer (HTML + JS output)
    ex.save("attention.html") # a standalone page for any browser

From a :class:`~mha_ext.Trace` it can show the raw scores, the masked scores,
the softmax and (in training with dropout) the weights after dropout, with the
cells a mask blocked hatched; from a weights array (B, H, Sq, Sk) or
(H, Sq, Sk) it shows the weights (pass ``blocked=`` to hatch blocked cells).
The page lets you pick the batch item, one head or all heads, a query token
(its row is outlined and its largest weights listed), the colour scale (per
row, shared per head, shared by all heads) and the zoom; hovering a cell shows
its query and key tokens and its value in every layer.  Long sequences get
thinned labels and a scrolling view.

Front-ends: any that runs the JavaScript of an HTML output (Jupyter Notebook
and Lab for a trusted notebook, VS Code).  Where scripts are stripped (an
untrusted notebook in JupyterLab) the output says so and points to ``save``.
The JavaScript and CSS live in ``mha_ext/_html/`` and are inlined into each
output; this module is plain Python and NumPy.
"""
from __future__ import annotations

import html
import itertools
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from numpy.typing import ArrayLike

from . import _teach
from ._types import Flag, Int

if TYPE_CHECKING:
    from .layout import BlockLayout
    from .trace import Trace

__all__ = ["Explorer", "explore"]

_HERE = Path(__file__).resolve().parent / "_html"
_ids = itertools.count()

# the largest number of values (B·H·Sq·Sk times the layers) an explorer embeds
MAX_VALUES = 2_000_000

# the standalone page may load nothing: inline scripts and styles, data: images
_CSP = ("default-src 'none'; script-src 'unsafe-inline'; "
        "style-src 'unsafe-inline'; img-src data:")


def _asset(name):
    try:
        return (_HERE / name).read_text(encoding="utf-8")
    except OSError as exc:
        raise RuntimeError("mha_ext/_html/%s is missing from this installation: the "
                           "package data was not installed (reinstall mha_ext)"
                           % name) from exc


def _encode(a):
    """A float array as a JSON list: 4 significant digits, ±1e999 for ±inf
    (JSON has no infinity; JSON.parse and json.loads read these as ±inf),
    null for NaN."""
    flat = np.asarray(a, dtype=np.float64).ravel()
    fin = np.isfinite(flat)
    out = np.full(flat.shape, "null", dtype=object)
    # 4 digits, unless they round past the largest double (json: infinity)
    out[fin] = [("%.4g" % v) if abs(v) < 1.7975e308 else repr(float(v)) for v in flat[fin]]
    out[np.isposinf(flat)] = "1e999"
    out[np.isneginf(flat)] = "-1e999"
    return "[" + ",".join(out) + "]"


def _batched(a, ndim_batched):
    a = np.asarray(a)
    return a[None] if a.ndim == ndim_batched - 1 else a


# (name, values (B, H, Sq, Sk), kind: "scores", "masked" (the scores the masks
# blocked cells of: -inf there) or "probability")
_Layer = tuple[str, np.ndarray, str]


class Explorer:
    """The explorer of one trace or weights array; see :func:`explore`.

    ``_repr_html_()`` is what a notebook shows, ``to_html(full_page=True)``
    a standalone page, ``save(path)`` writes that page and returns the path.
    ``layers`` lists the layer names, ``shape`` is (B, H, Sq, Sk)."""

    layers: list[str]
    shape: tuple[int, ...]
    q_tokens: list[str]
    k_tokens: list[str]
    title: str

    def __init__(self, layers: list[_Layer], blocked: np.ndarray | None, q_tokens: list[str],
                 k_tokens: list[str], title: str, layer: str,
                 head: Literal["all"] | int) -> None:
        self.layers = [name for name, _, _ in layers]
        self._layers = layers
        self._blocked = blocked
        self.shape = tuple(int(n) for n in layers[0][1].shape)
        self.q_tokens, self.k_tokens = q_tokens, k_tokens
        self.title = title
        self._first = layer
        self._head = head

    def _json(self) -> str:
        B, H, Sq, Sk = self.shape
        parts = ['{"B":%d,"H":%d,"Sq":%d,"Sk":%d' % (B, H, Sq, Sk),
                 '"qTokens":' + json.dumps(self.q_tokens),
                 '"kTokens":' + json.dumps(self.k_tokens),
                 '"title":' + json.dumps(self.title),
                 '"layer":' + json.dumps(self._first),
                 '"allHeads":' + ("true" if self._head == "all" else "false"),
                 '"head":%d' % (0 if self._head == "all" else self._head),
                 '"blocked":' + ("null" if self._blocked is None else
                                 "[" + ",".join("1" if b else "0"
                                                for b in self._blocked.ravel()) + "]")]
        layers = []
        for name, arr, kind in self._layers:
            layers.append('{"name":%s,"masked":%s,"probability":%s,"values":%s}'
                          % (json.dumps(name), "true" if kind == "masked" else "false",
                             "true" if kind == "probability" else "false", _encode(arr)))
        parts.append('"layers":[' + ",".join(layers) + "]}")
        text = ",".join(parts)
        # inside <script>: no "</script>", no "<!--"
        return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")

    def _fragment(self) -> str:
        uid = "mha-explorer-%d-%d" % (os.getpid(), next(_ids))
        nojs = ("Interactive attention explorer: its JavaScript did not run here "
                "(an untrusted notebook output?). Trust the notebook, or open the page "
                "that <code>Explorer.save(\"attention.html\")</code> writes in a browser.")
        return "\n".join([
            '<div class="mha-explorer" id="%s">' % uid,
            "<style>%s</style>" % _asset("explorer.css"),
            '<p class="mha-nojs">%s</p>' % nojs,
            '<script type="application/json" class="mha-data">%s</script>' % self._json(),
            "<script>(function () {\n%s\n"
            "var s = document.currentScript;\n"
            "var root = (s && s.closest && s.closest('.mha-explorer')) || "
            "document.getElementById(%s);\n"
            "var data = JSON.parse(root.querySelector('script.mha-data').textContent);\n"
            "mhaExplorer(root, data);\n})();</script>" % (_asset("explorer.js"), json.dumps(uid)),
            "</div>"])

    def _repr_html_(self) -> str:
        return self._fragment()

    def to_html(self, full_page: Flag = False) -> str:
        """The explorer as HTML: a fragment for a notebook, or (full_page) a
        standalone page whose Content-Security-Policy forbids every request."""
        if not full_page:
            return self._fragment()
        return "\n".join([
            "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
            '<meta http-equiv="Content-Security-Policy" content="%s">' % _CSP,
            "<title>%s</title>" % html.escape(self.title or "attention explorer"),
            "</head><body>", self._fragment(), "</body></html>"])

    def save(self, path: str | os.PathLike[str]) -> str:
        """Write the standalone page to path (str or path-like); returns path."""
        return _teach.write_page(path, self.to_html(full_page=True))

    def __repr__(self) -> str:
        return "Explorer(shape=%s, layers=%s)" % (list(self.shape), self.layers)


def explore(source: Trace | ArrayLike, tokens: Iterable[object] | None = None, *,
            query_tokens: Iterable[object] | None = None,
            key_tokens: Iterable[object] | None = None,
            blocked: ArrayLike | BlockLayout | None = None,
            title: object = None, layer: str | None = None,
            head: Literal["all"] | Int = "all",
            max_values: Int | None = MAX_VALUES) -> Explorer:
    """An :class:`Explorer` of a trace or of attention weights.

    source        a :class:`~mha_ext.Trace` (layers: raw scores, masked scores,
                  softmax, and dropout when the trace has that step; blocked
                  cells from its masks), or weights (B, H, Sq, Sk) / (H, Sq, Sk)
                  as a NumPy array, torch tensor or nested lists.
    tokens        labels of the sequence on both axes (self-attention);
    query_tokens, key_tokens  labels of the rows / columns when they differ.
    blocked       weights only: a bool array broadcastable to the weights,
                  True where a mask blocked the cell (drawn hatched), or a
                  mha_ext.layout.BlockLayout (its blocks not kept).
    title         a caption (default: from the source's shape).
    layer         the layer shown first (default: "softmax" / "weights").
    head          "all" (default: one small heatmap per head) or a head index.
    max_values    refuse to embed more numbers than this (ValueError; every
                  head and layer is embedded, whatever `head` shows first):
                  pick a batch slice of the weights or trace fewer tokens
                  instead of a huge page, or None for no limit.
    """
    if hasattr(source, "steps") and hasattr(source, "sizes"):
        if blocked is not None:
            raise ValueError("blocked is for weights arrays; a trace knows its masks")
        tr: Any = source  # a Trace, or an object like it

        def step(name: str) -> np.ndarray:
            return _batched(tr[name].array, 4).astype(np.float64)
        raw, masked, soft = step("raw scores"), step("masked scores"), step("softmax")
        layers = [("raw scores", raw, "scores"), ("masked scores", masked, "masked"),
                  ("softmax", soft, "probability")]
        if "dropout" in tr:
            layers.append(("dropout", step("dropout"), "probability"))
        cut = _teach.trace_blocked(tr)   # None: no mask blocked a cell
        mask: np.ndarray | None = np.zeros(masked.shape, dtype=bool) if cut is None else \
            _batched(np.broadcast_to(cut, tr["masked scores"].array.shape), 4)
        first = layer or "softmax"
    else:
        w, _ = _teach.weights_of(source)
        if w.ndim not in (3, 4):
            raise ValueError("weights must be (B, H, Sq, Sk) or (H, Sq, Sk), got shape %s"
                             % (w.shape,))
        w = _batched(w, 4)
        layers = [("weights", w, "probability")]
        mask = _teach.blocked_cells(blocked, w.shape)
        first = layer or "weights"
    B, H, Sq, Sk = layers[0][1].shape
    if H == 0:
        raise ValueError("there are no heads to explore (shape %s)" % (layers[0][1].shape,))
    if B == 0 or Sq == 0 or Sk == 0:
        raise ValueError("there is nothing to explore: %s (shape %s as (B, H, Sq, Sk))"
                         % ("no batch items" if B == 0 else "no queries" if Sq == 0
                            else "no keys", layers[0][1].shape))
    names = [n for n, _, _ in layers]
    if first not in names:
        raise ValueError("layer must be one of %s, got %r" % (names, first))
    if head != "all":
        if not isinstance(head, (int, np.integer)) or isinstance(head, bool):
            raise TypeError('head must be "all" or an int, got %r' % (head,))
        if not 0 <= head < H:
            raise ValueError("head %d is out of range for %d heads" % (head, H))
    n = B * H * Sq * Sk * (len(layers) + (mask is not None))
    if max_values is not None and (isinstance(max_values, bool)
                                   or not isinstance(max_values, (int, np.integer))):
        raise TypeError("max_values must be an int or None, got %r" % (max_values,))
    if max_values is not None and n > max_values:
        raise ValueError("the explorer would embed %d values (more than max_values=%d: "
                         "B x H x Sq x Sk for each of %s): explore fewer batch items "
                         "(weights[:1]) or a shorter sequence, or pass max_values=None "
                         "to embed them all"
                         % (n, max_values, ("%d layer%s" % (len(layers), "s" * (len(layers) > 1)))
                            + (" and the blocked cells" if mask is not None else "")))
    tokens = _teach.shared_labels(tokens)
    q_tokens = _teach.labels(query_tokens if query_tokens is not None else tokens, Sq,
                             "query_tokens" if query_tokens is not None else "tokens",
                             "queries") or [str(i) for i in range(Sq)]
    k_tokens = _teach.labels(key_tokens if key_tokens is not None else tokens, Sk,
                             "key_tokens" if key_tokens is not None else "tokens",
                             "keys") or [str(i) for i in range(Sk)]
    if title is None:
        title = "attention, B=%d, H=%d, Sq=%d, Sk=%d" % (B, H, Sq, Sk)
    return Explorer(layers, mask, q_tokens, k_tokens, str(title), first,
                    "all" if head == "all" else int(head))
