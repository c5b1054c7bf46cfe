"""Step-by-step trace of one multi-head attention call, for teaching.

Legend: B batch, Sq query length, Sk key length, E d_model, H heads,
Dk = E / H head width, Ek kdim, Ev vdim; with a cache L the keys cached
before the call and Sn the call's own; with grouped heads Hkv key/value
heads and Ekv = Hkv·Dk.

``trace(module, query, ...)`` (also ``module.trace(query, ...)``) redoes the
computation of ``module(query, ...)`` in plain NumPy, one step at a time, and
keeps every intermediate array::

    query            x_q                        [B, Sq, E]
    Q projection     Q = x_q·W_qᵀ + b_q         [B, Sq, E]
    Q heads          Q → [B, H, Sq, Dk]         [B, H, Sq, Dk]
    raw scores       S = Q·Kᵀ / √Dk             [B, H, Sq, Sk]
    masked scores    S, −∞ where blocked        [B, H, Sq, Sk]
    softmax          A = softmax(S) along Sk    [B, H, Sq, Sk]
    dropout          (training and p > 0 only)  [B, H, Sq, Sk]
    context          C = A·V                    [B, H, Sq, Dk]
    concat heads     C → [B, Sq, H·Dk]          [B, Sq, E]
    output projection  out = C·W_oᵀ + b_o       [B, Sq, E]

The module itself is also called, exactly once, with the same arguments, and
``Trace.output`` / ``Trace.weights`` (and the arrays of the final
"output projection" step and of the "dropout" step) are what that call
returned, bit for bit.  The other steps are NumPy's arithmetic in the
module's dtype and agree with the module to float rounding.

This module is plain Python and NumPy; it imports nothing optional.
"""
from __future__ import annotations

import html
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn, SupportsIndex

import numpy as np
from numpy.typing import ArrayLike

from . import _habits, _teach
from ._core import MultiHeadAttention as _CoreModule
from ._calls import head_mean, score_scale
from .cache import KVCache
from ._trace_masks import masks as _masks
from ._trace_reads import cache_state as _cache_state, call_and_parameters
from ._convert import ValueErrorAndIndexError, flag, to_numpy
from ._types import Causal, Flag, MaskedRows, Real, Window

if TYPE_CHECKING:
    from .layout import BlockLayout
    from .module import MultiHeadAttention

__all__ = ["Step", "Trace", "trace"]


class Step(NamedTuple):
    """One step of a :class:`Trace`.

    ``name``     short name, unique within the trace ("Q projection", ...)
    ``formula``  what the step computes, in the notation of the legend
    ``shape``    the array's shape, a tuple of ints
    ``array``    the NumPy array itself (read-only: steps may share memory)
    ``dims``     the symbolic shape, a tuple of legend names ("B", "H", ...)
    """

    name: str
    formula: str
    shape: tuple[int, ...]
    array: np.ndarray
    dims: tuple[str, ...]

    def __repr__(self) -> str:
        return "Step(name=%r, formula=%r, shape=%s, dims=%s)" % (
            self.name, self.formula, _fmt_shape(self.shape),
            _fmt_dims(self.dims))


# Long names of the legend symbols, used in the first row of the table.
_LONG = {"B": "batch", "Sq": "seq_q", "Sk": "seq_k", "E": "d_model",
         "H": "n_heads", "Dk": "d_k", "Ek": "kdim", "Ev": "vdim", "Sn": "new_keys"}


def _fmt_shape(shape: Iterable[int]) -> str:
    return "[" + ", ".join(str(int(n)) for n in shape) + "]"


def _fmt_dims(dims: Iterable[str]) -> str:
    return "[" + ", ".join(dims) + "]"


class Trace:
    """The steps of one attention call.  Build it with ``module.trace(...)``.

    - ``trace.steps``: list of :class:`Step` (name, formula, shape, array,
      dims), in computation order; also ``len(trace)``, ``iter(trace)``,
      ``trace[i]`` and ``trace["softmax"]`` (by step name).
    - ``trace.output``, ``trace.weights``: exactly what the module call
      returned (``weights`` is ``None`` for ``need_weights=False`` and the
      mean over heads for ``average_weights=True``).
    - ``trace.sizes``: the legend values, e.g. ``{"B": 2, "Sq": 10, ...}``.
    - ``trace.info``: dtype, training, dropout, which masks blocked or were
      added (in words), ``"blocked"`` (a read-only bool array of the masked
      scores' shape, True where a mask blocked the cell: a bool mask's True
      or a float mask's -inf, causal, window, layout; ``None`` when the
      call had no blocking mask, all False when its masks block nothing),
      ``"query_position"`` (the key position of query 0: Sk - Sq for a
      cached or lower-right call, else 0) and ``"numpy_output"``,
      the NumPy steps' own output (it agrees with ``trace.output`` to float
      rounding).
    - The steps' arrays are read-only: steps share memory ("masked scores"
      is "raw scores" when no mask is given, "K heads" a view of "K
      projection"); ``.copy()`` one to change it.
    - ``print(trace)`` shows the shape flow as a table; in Jupyter the trace
      renders as an HTML table with its own CSS and a values preview per
      step (``to_html()``); ``save_html(path)`` writes it as a page.
    - ``mha_ext.explore(trace)`` opens the scores and weights in the
      interactive explorer (mha_ext.explorer).
    """

    def __init__(self, steps: Iterable[Step], output: np.ndarray, weights: np.ndarray | None,
                 sizes: Mapping[str, int], info: Mapping[str, Any],
                 unbatched: bool = False) -> None:
        self.steps = list(steps)
        self.output = output
        self.weights = weights
        self.sizes = dict(sizes)
        self.info = dict(info)
        self.unbatched = bool(unbatched)

    # -- container protocol ----------------------------------------------
    def __len__(self) -> int:
        return len(self.steps)

    def __iter__(self) -> Iterator[Step]:
        return iter(self.steps)

    def __contains__(self, name: object) -> bool:
        return any(s.name == name for s in self.steps)

    @property
    def names(self) -> list[str]:
        """The step names, in order."""
        return [s.name for s in self.steps]

    def __getitem__(self, key: str | SupportsIndex) -> Step:
        if isinstance(key, str):
            for s in self.steps:
                if s.name == key:
                    return s
            raise KeyError("no step named %r; the steps are: %s"
                           % (key, ", ".join(self.names)))
        try:
            return self.steps[key]
        except IndexError:
            raise ValueErrorAndIndexError("step %r is out of range for a trace of %d steps "
                                          "(the steps are: %s)"
                                          % (key, len(self.steps), ", ".join(self.names))) from None

    # -- display -----------------------------------------------------------
    def _header(self) -> tuple[str, str]:
        z = self.sizes
        parts = ["%s=%d" % (k, z[k]) for k in ("B", "Sq", "Sk", "Sn", "L", "E", "H", "Hkv",
                                               "Dk", "Ekv") if k in z]
        for k in ("Ek", "Ev"):
            if k in z and z[k] != z["E"]:
                parts.append("%s=%d" % (k, z[k]))
        i = self.info
        mode = "training" if i.get("training") else "eval"
        if i.get("dropout_active"):
            mode += ", dropout p=%g" % i["dropout"]
        title = "MultiHeadAttention trace (%s, %s%s)" % (
            i.get("dtype", "?"), mode, ", unbatched" if self.unbatched else "")
        return title, ", ".join(parts)

    def _first_shape(self, step: Step) -> str:
        # "[batch=2, seq_q=10, d_model=512]" for the input rows
        return "[" + ", ".join("%s=%d" % (_LONG.get(d, d), n)
                               for d, n in zip(step.dims, step.shape)) + "]"

    def _rows(self) -> list[tuple[str, str, str, str]]:
        rows = []
        for s in self.steps:
            if s.name in ("query", "key", "value"):
                shape = self._first_shape(s)
            else:
                shape = _fmt_shape(s.shape)
            rows.append((s.name, s.formula, _fmt_dims(s.dims), shape))
        return rows

    def shape_flow(self) -> str:
        """The symbolic shapes of the query path, joined by arrows:
        ``[B, Sq, E] → [B, H, Sq, Dk] → [B, H, Sq, Sk] → …``."""
        flow: list[str] = []
        for s in self.steps:
            if s.name.startswith(("K ", "V ", "K/V", "key", "value")):
                continue
            d = _fmt_dims(s.dims)
            if not flow or flow[-1] != d:
                flow.append(d)
        return " → ".join(flow)

    def __str__(self) -> str:
        title, sizes = self._header()
        head = ("step", "formula", "dims", "shape")
        rows = self._rows()
        w = [max(len(r[c]) for r in rows + [head]) for c in range(3)]

        def line(r: tuple[str, str, str, str]) -> str:
            return "  ".join(r[c].ljust(w[c]) for c in range(3)) + "  " + r[3]

        out = [title, sizes, "", line(head),
               "  ".join("-" * n for n in w) + "  " + "-" * 5]
        out += [line(r) for r in rows]
        out += ["", "shape flow: " + self.shape_flow()]
        return "\n".join(out)

    def __repr__(self) -> str:
        return self.__str__()

    def _repr_html_(self) -> str:
        return self.to_html()

    def to_html(self, values: Flag = True, full_page: Flag = False) -> str:
        """The trace as an HTML table with its own CSS (left-aligned, one
        shape notation: the dims column is symbolic, the shape column
        numeric), each step's formula, and with ``values`` a collapsed
        preview of a small slice of each step's array.  ``full_page`` gives
        a standalone page (``save_html`` writes it)."""
        title, sizes = self._header()
        e = html.escape
        cell = 'style="text-align:left;vertical-align:top"'
        parts = ['<table class="mha-trace" %s>' % _TABLE_STYLE,
                 "<caption %s><style>%s</style><b>%s</b><br><small>%s</small></caption>"
                 % (cell, _CSS, e(title), e(sizes)),
                 "<thead><tr>" + "".join("<th %s>%s</th>" % (cell, h) for h in
                                         ("step", "formula", "dims", "shape"))
                 + "</tr></thead>", "<tbody>"]
        for s in self.steps:
            preview = _preview(s.array) if values else ""
            parts.append(
                "<tr><td %s>%s</td><td %s><code>%s</code></td><td %s><code>%s</code></td>"
                "<td %s><code>%s</code>%s</td></tr>"
                % (cell, e(s.name), cell, e(s.formula), cell, e(_fmt_dims(s.dims)),
                   cell, e(_fmt_shape(s.shape)), preview))
        parts.append("</tbody></table>")
        parts.append('<p class="mha-trace-flow" '
                     'style="text-align:left;font-family:system-ui,sans-serif"><small>shape flow: '
                     "<code>%s</code></small></p>" % e(self.shape_flow()))
        body = "\n".join(parts)
        if not full_page:
            return body
        return ('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
                '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
                'style-src \'unsafe-inline\'">'
                "<title>%s</title></head><body>\n%s\n</body></html>" % (e(title), body))

    def save_html(self, path: str | os.PathLike[str], values: Flag = True) -> str:
        """Write the trace as a standalone HTML page; returns path."""
        return _teach.write_page(path, self.to_html(values=values, full_page=True))


# The table's look, scoped to .mha-trace: readable outside Jupyter (a plain
# browser) and the same inside it (JupyterLab right-aligns table cells).
_TABLE_STYLE = ('style="border-collapse:collapse;text-align:left;'
                'font-family:system-ui,sans-serif;font-size:13px"')
_CSS = (".mha-trace{border-collapse:collapse;margin:4px 0}"
        ".mha-trace caption{text-align:left;padding:0 0 6px 0}"
        ".mha-trace th,.mha-trace td{text-align:left!important;vertical-align:top;"
        "padding:3px 12px 3px 0;border-bottom:1px solid #e2e2e2}"
        ".mha-trace th{border-bottom:2px solid #999}"
        ".mha-trace code{font-family:ui-monospace,Menlo,Consolas,monospace;"
        "white-space:nowrap;background:none}"
        ".mha-trace details{margin:2px 0 0 0}"
        ".mha-trace summary{cursor:pointer;color:#555;font-size:12px}"
        ".mha-trace pre{margin:2px 0;font-size:11px;line-height:1.25;text-align:left}")


def _preview(a, rows=4, cols=6):
    """A collapsed <details> with a small slice of a: index 0 on every
    leading axis, at most rows x cols of the last two."""
    a = np.asarray(a)
    if a.ndim == 0 or a.size == 0:
        return ""
    lead = (0,) * max(a.ndim - 2, 0)
    if a.ndim == 1:
        part, where = a[:cols], "[:%d]" % cols
    else:
        part = a[lead + (slice(0, rows), slice(0, cols))]
        where = "[" + ", ".join(["0"] * len(lead) + [":%d" % rows, ":%d" % cols]) + "]"
    text = np.array2string(part, precision=3, suppress_small=True, max_line_width=200)
    return ("<details><summary>values %s</summary><pre>%s</pre></details>"
            % (html.escape(where), html.escape(text)))


# ---------------------------------------------------------------------------
# The computation


def _as_array(x, dtype):
    """x as an ndarray of dtype (torch tensors, also ones needing grad)."""
    return np.array(to_numpy(x), dtype=dtype)     # a copy: steps never alias inputs


def _read_only(x: np.ndarray) -> np.ndarray:
    """A read-only view of x: steps share memory ("masked scores" is "raw
    scores" when no mask blocks, "K heads" a view of "K projection"), so
    writing into one would change another; the caller's arrays stay as
    they were."""
    v = x.view()
    v.flags.writeable = False
    return v


def _linear(x, weight, bias):
    # x (..., in), weight (out, in), bias (out,) or None -> (..., out)
    with np.errstate(invalid="ignore", over="ignore"):  # inf in: NaN, silent as the call
        y = x @ weight.T
    if bias is not None:
        y = y + bias
    return y


def _softmax(s, zero_rows):
    # s (B, H, Sq, Sk) with -inf where blocked; rows with every key blocked
    # give NaN, or 0 when zero_rows (Sk == 0 leaves nothing to fill: the
    # context is an empty sum, as in the module)
    with np.errstate(invalid="ignore", over="ignore"):
        m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
        dead = np.isneginf(m)
        e = np.exp(s - np.where(dead, 0, m))
        a = e / np.sum(e, axis=-1, keepdims=True)
    if zero_rows:
        a = np.where(dead, 0, a)
    else:
        a = np.where(dead, np.nan, a)
    return a.astype(s.dtype, copy=False)


def trace(module: MultiHeadAttention, query: ArrayLike, key: ArrayLike | None = None,
          value: ArrayLike | None = None, mask: ArrayLike | None = None, *,
          attn_mask: ArrayLike | None = None, key_padding_mask: ArrayLike | None = None,
          is_causal: Causal = False, need_weights: Flag = True, average_weights: Flag = False,
          masked_rows: MaskedRows = "nan", scale: Real | None = None, window: Window = None,
          head_mask: ArrayLike | None = None, layout: BlockLayout | None = None,
          cache: KVCache | None = None, **unknown: NoReturn) -> Trace:
    """Run ``module(query, key, value, mask, **keywords)`` step by step.

    Takes exactly the arguments of a call (``attn_mask``,
    ``key_padding_mask``, ``is_causal``, ``window``, ``need_weights``,
    ``average_weights``, ``masked_rows``, ``scale``, ``head_mask``,
    ``layout``, ``cache``) and returns a :class:`Trace`.
    A sliding ``window`` is shown in the "masked scores" step as the keys
    it blocks (the trace builds the (Sq, Sk) picture; the call does not);
    a ``head_mask`` as a "head mask" step after the softmax (with dropout
    active: in the "dropout" step, which holds the call's weights).

    The module is called once with the same arguments; ``trace.output`` and
    ``trace.weights`` are that call's results, bit for bit (but see dropout
    below).  Errors in the arguments are the call's own errors, raised
    before anything else.  ``module`` is a batch-first, block-polarity
    mha_ext.MultiHeadAttention (TypeError, ValueError otherwise).

    Dropout: in training mode with ``dropout > 0`` a trace consumes one draw
    of the module's dropout stream, exactly like one call, so
    ``m.trace(x); m(x)`` gives the same second result as ``m(x); m(x)``.  In
    that mode the "dropout" step holds the weights after dropout as the call
    drew them; the call is then made with ``need_weights=True,
    average_weights=False`` (the draw does not depend on them) and
    ``trace.weights`` is reduced afterwards: ``None`` for
    ``need_weights=False``, the mean over heads for ``average_weights=True``
    (the call's own: the heads summed in order).  ``trace.output`` is then
    the output of that call with weights, which may differ in the last bit
    from a call with ``need_weights=False`` (which rounds the softmax in
    blocks).  In eval
    mode (or with p = 0) the call is made with exactly the given keywords.

    Unbatched inputs (query (Sq, E)) are traced with the batch dimension
    dropped from every step.
    """
    if not isinstance(module, _CoreModule):
        raise TypeError("trace takes a mha_ext.MultiHeadAttention, got %s (for a torch "
                        "module: mha_ext.MultiHeadAttention.from_torch(module))"
                        % type(module).__name__)
    _habits.plain_layout_only(module, "trace")
    if unknown:  # torch's names named with ours, as the call does
        _habits.call_keywords(unknown, "trace")
    is_causal = _habits.causal_call(module, is_causal, cache)  # a causal module's calls
    kwargs: dict[str, Any] = dict(
        attn_mask=attn_mask, key_padding_mask=key_padding_mask, is_causal=is_causal,
        need_weights=need_weights, average_weights=average_weights, masked_rows=masked_rows,
        scale=scale, window=window, head_mask=head_mask, layout=layout, cache=cache)
    # the steps below are the plain computation: refuse what they do not show
    if getattr(module, "add_bias_kv", False) or getattr(module, "add_zero_attn", False):
        raise NotImplementedError("trace() does not show add_bias_kv's or add_zero_attn's "
                                  "extra keys yet: trace a module without them")
    cache = kwargs.get("cache")
    # keys cached before the call (another type: the call's TypeError below)
    L0, epoch0 = _cache_state(cache, False)[:2] if isinstance(cache, KVCache) else (0, 0)
    dtype = np.dtype(module.dtype)
    need_weights = flag(kwargs.get("need_weights", True), "need_weights")
    average = flag(kwargs.get("average_weights", False), "average_weights")
    p = float(module.dropout)
    dropout_active = bool(module.training) and p > 0.0

    call_kw = dict(kwargs)
    if dropout_active:
        call_kw["need_weights"] = True
        call_kw["average_weights"] = False
    (output, weights), params = call_and_parameters(module, (query, key, value, mask), call_kw)
    if cache is not None:  # the cache as the call left it, read at once
        L1, epoch1, kh, vh = _cache_state(cache)
    dropped = None
    if dropout_active:
        dropped = weights
        if not need_weights:
            weights = None
        elif average and dropped is not None:  # not None: need_weights=True above
            weights = head_mean(dropped[None])[0] if dropped.ndim == 3 else head_mean(dropped)

    # The call has validated everything; now redo it in NumPy.
    key_defaulted = key is None
    value_defaulted = value is None
    if key is None:
        key = query
    if value is None:
        value = key
    xq = _as_array(query, dtype)
    xk = _as_array(key, dtype)
    xv = _as_array(value, dtype)
    unbatched = xq.ndim == 2
    if unbatched:
        xq, xk, xv = xq[None], xk[None], xv[None]

    B, Sq, E = xq.shape
    Sk = xk.shape[1]
    if cache is not None:  # the keys attended: the cached ones and the new ones
        if not cache.cross and epoch1 != epoch0 + 1:  # one change: the traced call's
            raise RuntimeError(f"trace(): another call changed the cache while trace() ran "
                               f"(length {L0} before, {L1} after, {Sk} new keys): trace with "
                               f"a cache no other thread uses meanwhile")
        Sk = L1
    H = int(module.n_heads)
    Hkv = int(module.n_kv_heads)  # grouped-query attention: fewer K/V heads
    G = H // Hkv
    Dk = E // H
    sizes = {"B": B, "Sq": Sq, "Sk": Sk, "E": E, "H": H, "Dk": Dk,  # (a cross cache's
             "Ek": int(module.kdim), "Ev": int(module.vdim)}          # call has no key)
    if G > 1:
        sizes.update({"Hkv": Hkv, "Ekv": Hkv * Dk})
    if cache is not None:
        sizes["L"] = L0
        if not cache.cross:  # the call's own keys (Sk counts the cached ones too)
            sizes["Sn"] = int(xk.shape[1])
    kvH, kvE = ("Hkv", "Ekv") if G > 1 else ("H", "E")

    wq, wk, wv, wo = ((params[n + ".weight"], params.get(n + ".bias"))
                      for n in ("W_q", "W_k", "W_v", "W_o"))
    bias = wq[1] is not None
    steps = []

    def add(name, formula, dims, array):
        steps.append((name, formula, dims, array))

    add("query", "x_q", ("B", "Sq", "E"), xq)
    new = "Sn" if cache is not None else "Sk"  # the call's own keys
    cross = cache is not None and cache.cross
    if not cross:
        add("key", "x_k = x_q" if key_defaulted else "x_k", ("B", new, "Ek"), xk)
        add("value", "x_v = x_k" if value_defaulted else "x_v", ("B", new, "Ev"), xv)

    b = (lambda n: " + b_" + n) if bias else (lambda n: "")
    q = _linear(xq, *wq)
    add("Q projection", "Q = x_q·W_qᵀ" + b("q"), ("B", "Sq", "E"), q)
    if not cross:
        k = _linear(xk, *wk)
        v = _linear(xv, *wv)
        add("K projection", "K = x_k·W_kᵀ" + b("k"), ("B", new, kvE), k)
        add("V projection", "V = x_v·W_vᵀ" + b("v"), ("B", new, kvE), v)

    qh = q.reshape(B, Sq, H, Dk).transpose(0, 2, 1, 3)
    add("Q heads", "Q → [B, H, Sq, Dk]", ("B", "H", "Sq", "Dk"), qh)
    if cache is None:
        kh = k.reshape(B, Sk, Hkv, Dk).transpose(0, 2, 1, 3)
        vh = v.reshape(B, Sk, Hkv, Dk).transpose(0, 2, 1, 3)
        add("K heads", f"K → [B, {kvH}, Sk, Dk]", ("B", kvH, "Sk", "Dk"), kh)
        add("V heads", f"V → [B, {kvH}, Sk, Dk]", ("B", kvH, "Sk", "Dk"), vh)
    else:  # the cache after the call: its L keys, then the call's new ones
        grow = ("the cached memory" if cross else
                f"[{L0} cached | {Sk - L0} new] → length {Sk}")
        add("K cache", f"K cache: {grow}", ("B", kvH, "Sk", "Dk"), kh)
        add("V cache", f"V cache: {grow}", ("B", kvH, "Sk", "Dk"), vh)
    if G > 1:  # grouped-query attention: each K/V head serves G query heads
        kh = np.repeat(kh, G, axis=1)
        vh = np.repeat(vh, G, axis=1)
        add("K groups", f"query head h reads K head h // {G}: K → [B, H, Sk, Dk]",
            ("B", "H", "Sk", "Dk"), kh)
        add("V groups", f"query head h reads V head h // {G}: V → [B, H, Sk, Dk]",
            ("B", "H", "Sk", "Dk"), vh)

    given = score_scale(kwargs.get("scale"))
    scale = dtype.type(1.0 / np.sqrt(Dk) if given is None else given)
    with np.errstate(invalid="ignore", over="ignore"):  # silent, as the call is
        raw = (qh @ kh.transpose(0, 1, 3, 2)) * scale
    add("raw scores", "S = Q·Kᵀ / √Dk" if given is None else f"S = Q·Kᵀ · {given:g}",
        ("B", "H", "Sq", "Sk"), raw)

    # causality: top-left, or lower-right (a self-attention cache's rule:
    # query i of Sq sees keys j <= i + Sk - Sq)
    lower_right = (cache is not None and not cross) or kwargs.get("is_causal") == "lower_right"
    causal = lower_right or (cache is None and flag(kwargs.get("is_causal", False), "is_causal"))
    blocked, added, why_blocked, why_added = _masks(
        mask, kwargs, unbatched, B, H, Sq, Sk, dtype, causal, Sk - Sq if lower_right else 0)
    masked = raw
    formula = "S"
    if added is not None:
        with np.errstate(invalid="ignore"):  # +inf score + -inf: NaN, silent as the call
            masked = masked + added
        formula = "S + " + " + ".join(why_added)
    if blocked is not None:
        masked = np.where(blocked, dtype.type(-np.inf), masked)
        formula += ", −∞ where " + " or ".join(why_blocked)
    if added is None and blocked is None:
        formula = "S (no mask given)"
    masked = masked.astype(dtype, copy=False)
    add("masked scores", formula, ("B", "H", "Sq", "Sk"), masked)
    # the cells a mask blocked (a bool mask's True, a float mask's -inf): not
    # read back from the -inf scores, which a scale of ±inf also makes
    cut = blocked
    neg = None if added is None else np.isneginf(added)
    if neg is not None and neg.any():
        cut = neg if cut is None else (cut | neg)
    # (a copy: a single bool mask passes through as the caller's array)
    cells = None if cut is None else np.broadcast_to(np.array(cut, dtype=bool), (B, H, Sq, Sk))

    zero_rows = kwargs.get("masked_rows", "nan") == "zero"
    a = _softmax(masked, zero_rows)
    add("softmax", "A = softmax(S) along Sk" +
        (" (blocked rows → 0)" if zero_rows else ""),
        ("B", "H", "Sq", "Sk"), a)

    hm = kwargs.get("head_mask")
    if hm is not None:
        hm = np.broadcast_to(_as_array(hm, dtype), (B, H))[:, :, None, None]
    if dropout_active:
        a = np.asarray(dropped)[None] if unbatched else np.asarray(dropped)
        add("dropout", "A = A·keep / (1 − p)" + (" · head_mask[h]" if hm is not None else "") +
            ", p = %g" % p, ("B", "H", "Sq", "Sk"), a)
    elif hm is not None:
        with np.errstate(invalid="ignore", over="ignore"):
            a = (a * hm).astype(dtype, copy=False)
        add("head mask", "A = A · head_mask[h] (0: head off)", ("B", "H", "Sq", "Sk"), a)

    with np.errstate(invalid="ignore", over="ignore"):
        ctx = (a @ vh).astype(dtype, copy=False)
    add("context", "C = A·V (per head)", ("B", "H", "Sq", "Dk"), ctx)
    cat = ctx.transpose(0, 2, 1, 3).reshape(B, Sq, E)
    add("concat heads", "C → [B, Sq, H·Dk]", ("B", "Sq", "E"), cat)
    out_np = _linear(cat, *wo)
    add("output projection", "out = C·W_oᵀ" + b("o"), ("B", "Sq", "E"), out_np)

    final = []
    for name, formula, dims, arr in steps:
        arr = np.asarray(arr)
        if unbatched:
            arr, dims = arr[0], dims[1:]
            formula = formula.replace("[B, ", "[")
        # the call's own output and weights after dropout, copied: trace.output
        # and trace.weights stay the caller's to change
        if name == "output projection":
            arr = np.array(output)
        elif name == "dropout":
            arr = np.array(dropped)
        final.append(Step(name, formula, tuple(arr.shape), _read_only(arr), tuple(dims)))
    if cells is not None and unbatched:
        cells = cells[0]            # broadcast_to's view: read-only already

    info = {"dtype": dtype.name, "training": bool(module.training),
            "dropout": p, "dropout_active": dropout_active,
            "blocked_by": list(why_blocked), "added": list(why_added),
            # True where a mask blocked the cell, the masked scores' shape; None: none did
            "blocked": cells,
            # the keys' position of query 0 (a cached or lower-right call: L or Sk - Sq)
            "query_position": int(Sk - Sq) if lower_right else 0,
            "numpy_output": out_np[0] if unbatched else out_np}
    if unbatched:
        sizes.pop("B")
    return Trace(final, output, weights, sizes, info, unbatched=unbatched)
