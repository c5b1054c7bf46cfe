"""Training with mha_ext: an explicit forward that returns what the backward
needs, and the backward that turns it into gradients.

    ctx = mha.forward_train(query, key, value, mask=..., ...)
    loss_grad = ...                      # dL/d ctx.output, same shape
    grads = mha.backward(ctx, loss_grad) # {'W_q.weight': ..., 'query': ...}

Nothing is kept in the module between the two calls: ``ctx`` (a
:class:`ForwardContext`) holds a copy of the parameters, the inputs, the
masks and the dropout stream (probability and counter) of the forward, and
the forward's projections Q, K, V (per head, as the attention reads them:
(B, H, Sq, Dk), K transposed (B, H, Dk, Sk), (B, H, Sk, Dk)) and its context
before W_o (B, Sq, E) and, when it is no larger than those four together (or
at most four times as large and within a quarter of the output cache's limit,
``memory_info()``), the softmax P (B, H, Sq, Sk); ``save_projections=False``
drops them to save memory, and the backward then recomputes them.  The
backward recomputes the rest in C (the softmax block by block when P was
not kept, the replayed dropout mask).  The copies of the inputs and parameters are made in C by
the forward's projection tasks as they read them.  So several forwards may be in flight
at once, from any number of threads, and each backward differentiates
exactly the forward that made its ``ctx``, even if the module's parameters
changed in between (an optimiser step).

Legend: B batch, Sq query length, Sk key length, E = d_model, H = n_heads.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np
from numpy.typing import ArrayLike

from . import _calls, _habits, _params
from ._convert import contiguous, counter as _counter, flag, probability
from ._types import Causal, Flag, Int, MaskedRows, Real, Window

if TYPE_CHECKING:
    from ._core import _Saved
    from .layout import BlockLayout
    from .module import MultiHeadAttention

__all__ = ["ForwardContext", "forward_train", "backward"]


class ForwardContext:
    """What :func:`forward_train` returns: the results of the call and what
    :func:`backward` needs to differentiate it.

    output : (B, Sq, E) (unbatched: (Sq, E)), as the module's call returns it.
    weights : the attention weights after dropout as the call returns them,
        or None with need_weights=False.
    dropout, counter : the dropout probability used (0.0 without dropout) and
        the counter of its random stream: the backward replays that mask.
    The rest (parameters, inputs, masks, flags) is private.
    """

    __slots__ = ("output", "weights", "dropout", "counter", "_params", "_query", "_key",
                 "_value", "_saved", "_masks", "_is_causal", "_zero_rows", "_batched",
                 "_need_weights", "_average_weights", "_seed", "_scale", "_window",
                 "_head_mask", "_head_mask_shape", "_layout", "_config")
    # declarations only (no values: those would clash with __slots__)
    output: np.ndarray
    weights: np.ndarray | None
    dropout: float
    counter: int
    # the private rest, as _calls.Call and the C forward give them
    _params: np.ndarray              # the flat parameter block
    _query: np.ndarray               # the inputs, 3-D
    _key: np.ndarray
    _value: np.ndarray
    _saved: _Saved | None            # (Q, K, V, ctx, P | None), or None: recompute
    _masks: tuple[tuple[int, np.ndarray], ...]
    _is_causal: bool | str
    _zero_rows: bool
    _batched: bool
    _need_weights: bool
    _average_weights: bool
    _seed: int
    _scale: float | None
    _window: tuple[int | None, int | None] | None
    _head_mask: np.ndarray | None    # (B, H)
    _head_mask_shape: tuple[int, ...] | None  # as given: (H,) or (B, H)
    _layout: tuple[np.ndarray, int, int] | None
    _config: dict[str, Any]          # the module's configuration (_config_of)

    def __init__(self, **kw: Any) -> None:
        for k, v in kw.items():
            setattr(self, k, v)

    def __repr__(self) -> str:
        w = None if self.weights is None else self.weights.shape
        return (f"ForwardContext(output={self.output.shape}, weights={w}, "
                f"dropout={self.dropout!r}, counter={self.counter})")


_CONFIG = ("d_model", "n_heads", "n_kv_heads", "kdim", "vdim", "bias", "add_bias_kv",
           "add_zero_attn")


def _config_of(mha: MultiHeadAttention) -> dict[str, Any]:
    """What a module's call computes besides its parameters' values: two
    modules of one parameter count may differ here (4 heads or 2)."""
    return {k: getattr(mha, k) for k in _CONFIG}


def forward_train(mha: MultiHeadAttention, query: ArrayLike, key: ArrayLike | None = None,
                  value: ArrayLike | None = None, mask: ArrayLike | None = None, *,
                  attn_mask: ArrayLike | None = None,
                  key_padding_mask: ArrayLike | None = None, is_causal: Causal = False,
                  need_weights: Flag = True, average_weights: Flag = False,
                  masked_rows: MaskedRows = "nan",
                  params: Mapping[str, ArrayLike] | ArrayLike | None = None,
                  dropout: Real | None = None, dropout_counter: Int | None = None,
                  save_projections: Flag = True, scale: Real | None = None,
                  window: Window = None, head_mask: ArrayLike | None = None,
                  layout: BlockLayout | None = None,
                  **unknown: NoReturn) -> ForwardContext:
    """The forward pass of ``mha`` (a MultiHeadAttention), returning a
    :class:`ForwardContext` with ``.output`` and ``.weights`` (what the call
    returns) and what :func:`backward` needs.

    Arguments as for the module's call, plus:
      params: None (the module's parameters, copied now), a mapping like
        state_dict() or the flat block: the parameters to use.
      dropout: None (the module's ``dropout`` in training mode, none in eval
        mode) or an explicit probability in [0, 1].
      dropout_counter: None (reserve a fresh random stream, as every training
        call does) or the ``counter`` of an earlier context: replays its mask.
      save_projections: keep Q, K, V and the context (4 arrays of B·S·E)
        in the context, and the softmax P (B, H, Sq, Sk) when it is no larger
        than those four, or at most four times as large and within a quarter
        of the output cache's limit (``mha_ext.memory_info()``), so that the
        backward need not recompute them (default); False keeps only the
        inputs and the backward recomputes.

    ``mha.forward_train(...)`` is this function.  A batch-first,
    block-polarity module only (ValueError otherwise: the steps read the
    inputs as (B, S, E) and 1 as blocked); another keyword is a TypeError.
    """
    _habits.plain_layout_only(mha, "forward_train")
    if unknown:
        _habits.call_keywords(unknown, "forward_train")
    # no copies here: the C forward copies the inputs as its projections read them
    call = _calls.prepare(mha, query, key, value, mask, attn_mask, key_padding_mask,
                          is_causal, need_weights, average_weights, masked_rows,
                          dtype=mha.dtype, scale=scale, window=window, head_mask=head_mask,
                          layout=layout)
    # private copies: the backward must see the masks of this call
    masks = tuple((kind, np.array(m, copy=True)) for kind, m in call.masks)
    call = call._replace(masks=list(masks))

    if dropout is None:
        p = float(mha.dropout) if mha.training else 0.0
    else:
        p = probability(dropout, "dropout")
    if p > 0.0:
        if dropout_counter is None:
            counter = mha._take_counter()
        else:
            counter = _counter(dropout_counter, "dropout_counter")
    else:
        counter = 0
    block = _params.params_block(mha, params)
    keep = _calls.keep_level(mha, call, save_projections)
    out, weights, saved, copies = _calls.c_forward_train(mha, call, block, p, counter, keep)
    block_copy, q3, k3, v3 = copies
    if block is None or isinstance(block, _params.Parts):
        block = block_copy
    out, weights = _calls.shape_output(call, out, weights)
    return ForwardContext(output=out, weights=weights, dropout=p, counter=counter,
                          _params=block, _query=q3, _key=k3, _value=v3, _saved=saved,
                          _masks=masks, _is_causal=call.is_causal, _zero_rows=call.zero_rows,
                          _batched=call.batched, _need_weights=call.need_weights,
                          _average_weights=call.average_weights, _seed=mha.seed,
                          _scale=call.scale, _window=call.window,
                          _head_mask=call.head_mask, _layout=call.layout,
                          _config=_config_of(mha),
                          _head_mask_shape=None if head_mask is None else
                          tuple(getattr(head_mask, "shape", np.shape(head_mask))))


def hollow(ctx: ForwardContext) -> tuple[ForwardContext, list[np.ndarray | None]]:
    """(a copy of ctx without its arrays, those arrays): the parameters, the
    inputs, the saved projections and the masks (mha_ext.torch keeps them
    as autograd's saved tensors); output and weights become zero-stride
    stand-ins of their shape and dtype (the backward reads nothing else of
    them).  filled() puts the arrays back."""
    sv = ctx._saved
    arrays = [ctx._params, ctx._query, ctx._key, ctx._value, *(sv or ()),
              *(m for _, m in ctx._masks)]
    h = ForwardContext(**{k: getattr(ctx, k) for k in ForwardContext.__slots__})
    h._params = h._query = h._key = h._value = None  # type: ignore[assignment]
    h._saved = None if sv is None else len(sv)  # type: ignore[assignment]
    h._masks = tuple((kind, None) for kind, _ in ctx._masks)  # type: ignore[misc]
    h.output = np.broadcast_to(np.zeros((), ctx.output.dtype), ctx.output.shape)
    if ctx.weights is not None:
        h.weights = np.broadcast_to(np.zeros((), ctx.weights.dtype), ctx.weights.shape)
    return h, arrays


# the value path: what the attention weights do not depend on
VALUE_PATH = ("W_v.weight", "W_v.bias", "W_o.weight", "W_o.bias", "bias_v")


def without_value_path(mha: Any, ctx: ForwardContext) -> ForwardContext:
    """ctx, or, where a NaN or infinity sits on its value path (the value,
    its projection, the output projection, bias_v, a saved V), a copy with
    that path zeroed: the backward of a loss on the weights alone (a zero
    output gradient) then forms no 0·NaN there, as torch's graph, which has
    no such term, forms none.  The gradients it gives of the value path are
    not the call's; the caller leaves them out."""
    block = _params.grads(mha, ctx._params)
    path = [ctx._value, *(block[k] for k in VALUE_PATH if k in block)]
    if ctx._saved is not None:
        path.append(ctx._saved[2])
    if all(np.isfinite(a).all() for a in path):
        return ctx                        # as it is: the same bits as before
    clean = ForwardContext(**{k: getattr(ctx, k) for k in ForwardContext.__slots__})
    clean._params = ctx._params.copy()
    for k, a in _params.grads(mha, clean._params).items():
        if k in VALUE_PATH:
            a[...] = 0
    clean._value = np.zeros_like(ctx._value)
    if ctx._saved is not None:
        q, k, v, context, p = ctx._saved
        clean._saved = (q, k, np.zeros_like(v), context, p)
    return clean


def filled(h: ForwardContext, arrays: list[Any]) -> ForwardContext:
    """hollow()'s context with its arrays back (a new object)."""
    ctx = ForwardContext(**{k: getattr(h, k) for k in ForwardContext.__slots__})
    ctx._params, ctx._query, ctx._key, ctx._value = arrays[:4]
    n = 0 if h._saved is None else int(h._saved)  # type: ignore[call-overload]
    ctx._saved = None if h._saved is None else tuple(arrays[4:4 + n])  # type: ignore[assignment]
    ctx._masks = tuple((kind, m) for (kind, _), m in zip(h._masks, arrays[4 + n:]))
    return ctx


def backward(mha: MultiHeadAttention, ctx: ForwardContext, grad_output: ArrayLike,
             grad_weights: ArrayLike | None = None, *,
             head_mask_grad: Flag = False, scores_grad: Flag = False) -> dict[str, np.ndarray]:
    """The gradients of a loss L from dL/d output (``grad_output``, the shape of
    ``ctx.output``) and optionally dL/d weights (``grad_weights``, the shape of
    ``ctx.weights``).

    Returns a dict of new arrays in the module's dtype: the keys of
    state_dict() ('W_q.weight', 'W_q.bias', ... 'W_o.bias') and 'query',
    'key', 'value' (shaped like the inputs).  When key or value was the query
    itself (self-attention), the gradient of that one array is the sum of the
    entries.  Rows whose every key was blocked give zero gradients with
    masked_rows="zero" and NaN ones with "nan" (their output is NaN).

    head_mask_grad=True (with a forward_train call given a head_mask) adds
    'head_mask': dL/d head_mask, shaped like the head_mask given ((H,):
    summed over the batch).  For head (b, h) it is Σ_i dctx_i · (A·V)_i +
    Σ_ij dL/dweights_ij · A_ij, A the head's weights after dropout before the
    head mask (Michel et al.'s head-importance score); A·V and A come from
    one more forward without the head mask (same stream), so this costs a
    forward call.

    scores_grad=True adds 'scores': dL/dS', S' the scores after the masks
    were added, before the softmax ((B, H, Sq, Sk'), unbatched (H, Sq, Sk');
    Sk' with add_bias_kv's and add_zero_attn's keys).  A float attn_mask or
    key_padding_mask is added to S', so its gradient is this summed over
    the axes it was broadcast along (an (Sq, Sk) attn_mask: over B and H);
    0 where a key was blocked, NaN in a row whose output is NaN.
    """
    if not isinstance(ctx, ForwardContext):
        raise TypeError(f"ctx must be the ForwardContext of forward_train, not "
                        f"{type(ctx).__name__}")
    made = getattr(ctx, "_config", None) or {}  # (a context pickled before it was kept)
    other = [f"{k} {made[k]!r}, not {v!r}" for k, v in _config_of(mha).items()
             if k in made and made[k] != v]
    if (other or ctx._seed != mha.seed or ctx._params.dtype != mha.dtype
            or ctx._params.size != mha.num_parameters
            or ctx._query.shape[2] != mha.d_model or ctx._key.shape[2] != mha.kdim
            or ctx._value.shape[2] != mha.vdim):
        raise ValueError("ctx was made by forward_train of a different module (another "
                         "configuration, dtype or seed%s)"
                         % (": " + ", ".join(other) if other else ""))
    dtype = mha.dtype
    go = contiguous(grad_output, "grad_output", dtype)
    if go.shape != ctx.output.shape:
        raise ValueError(f"grad_output must have the output's shape {ctx.output.shape}, "
                         f"got {go.shape}")
    gw = None
    if grad_weights is not None:
        if ctx.weights is None:
            raise ValueError("grad_weights given, but the forward returned no weights "
                             "(need_weights=False)")
        gw = contiguous(grad_weights, "grad_weights", dtype)
        if gw.shape != ctx.weights.shape:
            raise ValueError(f"grad_weights must have the weights' shape {ctx.weights.shape}, "
                             f"got {gw.shape}")
    go, gw = _calls.grads_for_c(go, gw, ctx._batched, ctx._average_weights, mha.n_heads)
    scores = flag(scores_grad, "scores_grad")
    gp, gq, gk, gv, *gs = _calls.c_backward(mha, ctx._params, ctx._query, ctx._key,
                                            ctx._value, ctx._masks, ctx._is_causal,
                                            ctx._zero_rows, ctx.dropout, ctx.counter, go, gw,
                                            ctx._saved, ctx._scale, ctx._window,
                                            ctx._head_mask, ctx._layout, scores)
    grads = _params.grads(mha, gp)
    if not ctx._batched:
        gq, gk, gv = gq[0], gk[0], gv[0]
        gs = [g[0] for g in gs]
    grads["query"] = gq
    grads["key"] = gk
    grads["value"] = gv
    if scores:
        grads["scores"] = gs[0]
    if flag(head_mask_grad, "head_mask_grad"):
        if ctx._head_mask is None:
            raise ValueError("head_mask_grad=True, but forward_train had no head_mask")
        grads["head_mask"] = _head_mask_grad(mha, ctx, go, gw)
    return grads


def _head_mask_grad(mha: MultiHeadAttention, ctx: ForwardContext, go: np.ndarray,
                    gw: np.ndarray | None) -> np.ndarray:
    # dL/dm[b, h] = Σ_i dctx[b, i, h] · (A·V)[b, i, h] + Σ_ij gw[b, h] · A[b, h]
    # (ctx = concat_h m[b, h]·(A·V)_h, weights m·A); A·V and A recomputed
    # without the head mask, with the same dropout stream
    call = _calls.Call(ctx._query, ctx._key, ctx._value, list(ctx._masks), True,
                       ctx._is_causal, gw is not None, False, ctx._zero_rows, ctx._scale,
                       ctx._window, None, ctx._layout)
    _, w, saved, _ = _calls.c_forward_train(mha, call, ctx._params, ctx.dropout, ctx.counter, 1)
    B, Sq, E = ctx._query.shape
    H = mha.n_heads
    wo = _params.grads(mha, ctx._params)["W_o.weight"]           # out = ctx·W_oᵀ + b_o
    dctx = (go @ wo).reshape(B, Sq, H, E // H)
    g = np.einsum("bihd,bihd->bh", dctx, saved[3].reshape(B, Sq, H, E // H))
    if gw is not None:
        g = g + np.einsum("bhij,bhij->bh", gw, w)
    if ctx._head_mask_shape is not None and len(ctx._head_mask_shape) == 1:  # (H,)
        g = g.sum(axis=0)
    return np.ascontiguousarray(g, dtype=mha.dtype)
