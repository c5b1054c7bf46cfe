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
before W_o (B, Sq, E) and, when it is no larger than those four together, the
softmax P (B, H, Sq, Sk); ``save_projections=False`` drops them to save
memory, and the backward then recomputes them.  The backward recomputes the
rest in C (the softmax block by block when P was not kept, the replayed
dropout mask).  The copies of the inputs and parameters are made in C by
the forward's projection tasks as they read them.  So several forwards may be in flight
at once, from any number of threads, and each backward differentiates
exactly the forward that made its ``ctx``, even if the module's parameters
changed in between (an optimiser step).

Legend: B batch, Sq query length, Sk key length, E = d_model, H = n_heads.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

__all__ = ["ForwardContext", "forward_train", "backward"]

_KEYS = ("W_q.weight", "W_q.bias", "W_k.weight", "W_k.bias",
         "W_v.weight", "W_v.bias", "W_o.weight", "W_o.bias")


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
                 "_need_weights", "_average_weights", "_seed")

    def __init__(self, **kw):
        for k, v in kw.items():
            setattr(self, k, v)

    def __repr__(self):
        w = None if self.weights is None else self.weights.shape
        return (f"ForwardContext(output={self.output.shape}, weights={w}, "
                f"dropout={self.dropout!r}, counter={self.counter})")


def _param_block(mha, params):
    """The flat parameter block (a private copy) from a state_dict-like
    mapping or a 1-D block; None (the module's parameters) stays None: the
    forward copies those itself, under the module's lock."""
    from .module import _as_array, _check_real

    if params is None:
        return None
    block = np.array(mha._block(), copy=True)
    layout = mha._layout()
    if isinstance(params, Mapping):
        for i, k in enumerate(_KEYS):
            offset, size = layout[i]
            if size == 0:
                continue
            if k not in params:
                raise KeyError(f"params is missing {k!r}")
            value = _as_array(params[k], f"params[{k!r}]")
            _check_real(value, f"params[{k!r}]")
            want = mha._tensor(i).shape
            if value.shape != want:
                raise ValueError(f"params[{k!r}] must have shape {want}, got {value.shape}")
            block[offset:offset + size] = value.reshape(-1)
        return block
    value = _as_array(params, "params")
    _check_real(value, "params")
    if value.shape != block.shape:
        raise ValueError(f"params must be a mapping like state_dict() or a 1-D block of "
                         f"{block.size} scalars, got shape {value.shape}")
    block[...] = value
    return block


def _input(x, name, dtype):
    """x as a C-contiguous array of dtype: the array itself when it already
    is one (the forward's C core makes the context's private copies)."""
    from .module import _as_array, _check_real

    arr = _as_array(x, name)
    _check_real(arr, name)
    return np.ascontiguousarray(arr, dtype=dtype)


def forward_train(mha, query, key=None, value=None, mask=None, *, attn_mask=None,
                  key_padding_mask=None, is_causal=False, need_weights=True,
                  average_weights=False, masked_rows="nan", params=None, dropout=None,
                  dropout_counter=None, save_projections=True) -> ForwardContext:
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
        than those four, so that the backward need not recompute them
        (default); False keeps only the inputs and the backward recomputes.
    """
    dtype = mha.dtype
    # no copies here: the C forward copies the inputs as its projections read them
    q3, k3, v3, masks, batched = mha._call_args(
        query, key, value, mask, attn_mask, key_padding_mask, masked_rows,
        convert=lambda x, name: _input(x, name, dtype))
    # private copies: the backward must see the masks of this call
    masks = tuple((kind, np.array(m, copy=True)) for kind, m in masks)

    if dropout is None:
        p = float(mha.dropout) if mha.training else 0.0
    else:
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or \
                not 0.0 <= float(dropout) <= 1.0:
            raise ValueError(f"dropout must be a probability in [0, 1], got {dropout!r}")
        p = float(dropout)
    if p > 0.0:
        if dropout_counter is None:
            counter = mha._take_counter()
        else:
            if isinstance(dropout_counter, bool) or not isinstance(dropout_counter, int) \
                    or not 0 <= dropout_counter < 2 ** 64:
                raise ValueError(f"dropout_counter must be an int in [0, 2**64), "
                                 f"got {dropout_counter!r}")
            counter = dropout_counter
    else:
        counter = 0
    block = _param_block(mha, params)
    zero_rows = masked_rows == "zero"
    save_p = False
    if save_projections:
        Sq, Sk, E = q3.shape[1], k3.shape[1], mha.d_model
        # P as well when it costs no more memory than Q, K, V and ctx
        save_p = mha.n_heads * Sq * Sk <= 2 * E * (Sq + Sk)
    out, weights, saved, copies = mha._forward_train(
        q3, k3, v3, params=block, masks=list(masks), is_causal=bool(is_causal),
        need_weights=bool(need_weights), zero_rows=zero_rows, dropout=p, counter=counter,
        save=bool(save_projections), save_p=save_p)
    block_copy, q3, k3, v3 = copies
    if block is None:
        block = block_copy
    if weights is not None and average_weights:
        weights = weights.mean(axis=1)
    if not batched:
        out = out[0]
        weights = None if weights is None else weights[0]
    return ForwardContext(output=out, weights=weights, dropout=p, counter=counter,
                          _params=block, _query=q3, _key=k3, _value=v3, _saved=saved,
                          _masks=masks,
                          _is_causal=bool(is_causal), _zero_rows=zero_rows, _batched=batched,
                          _need_weights=bool(need_weights),
                          _average_weights=bool(average_weights), _seed=mha.seed)


def backward(mha, ctx: ForwardContext, grad_output, grad_weights=None) -> dict:
    """The gradients of a loss L from dL/d output (``grad_output``, the shape of
    ``ctx.output``) and optionally dL/d weights (``grad_weights``, the shape of
    ``ctx.weights``).

    Returns a dict of new arrays in the module's dtype: the keys of
    state_dict() ('W_q.weight', 'W_q.bias', ... 'W_o.bias') and 'query',
    'key', 'value' (shaped like the inputs).  When key or value was the query
    itself (self-attention), the gradient of that one array is the sum of the
    entries.  Rows whose every key was blocked give zero gradients with
    masked_rows="zero" and NaN ones with "nan" (their output is NaN).
    """
    if not isinstance(ctx, ForwardContext):
        raise TypeError(f"ctx must be the ForwardContext of forward_train, not "
                        f"{type(ctx).__name__}")
    if (ctx._seed != mha.seed or ctx._params.dtype != mha.dtype
            or ctx._params.size != mha.num_parameters
            or ctx._query.shape[2] != mha.d_model or ctx._key.shape[2] != mha.kdim
            or ctx._value.shape[2] != mha.vdim):
        raise ValueError("ctx was made by forward_train of a different module (another "
                         "configuration, dtype or seed)")
    dtype = mha.dtype
    go = _input(grad_output, "grad_output", dtype)
    if go.shape != ctx.output.shape:
        raise ValueError(f"grad_output must have the output's shape {ctx.output.shape}, "
                         f"got {go.shape}")
    gw = None
    if grad_weights is not None:
        if ctx.weights is None:
            raise ValueError("grad_weights given, but the forward returned no weights "
                             "(need_weights=False)")
        gw = _input(grad_weights, "grad_weights", dtype)
        if gw.shape != ctx.weights.shape:
            raise ValueError(f"grad_weights must have the weights' shape {ctx.weights.shape}, "
                             f"got {gw.shape}")
        if not ctx._batched:
            gw = gw[None]
        if ctx._average_weights:  # weights = mean over heads
            gw = np.repeat(gw[:, None] / dtype.type(mha.n_heads), mha.n_heads, axis=1)
    if not ctx._batched:
        go = go[None]
    gp, gq, gk, gv = mha._backward(ctx._query, ctx._key, ctx._value, go, params=ctx._params,
                                   masks=list(ctx._masks), is_causal=ctx._is_causal,
                                   zero_rows=ctx._zero_rows, dropout=ctx.dropout,
                                   counter=ctx.counter, grad_weights=gw, saved=ctx._saved)
    grads = {}
    layout = mha._layout()
    for i, k in enumerate(_KEYS):
        offset, size = layout[i]
        if size == 0:
            continue
        shape = mha._tensor(i).shape
        grads[k] = gp[offset:offset + size].reshape(shape)
    if not ctx._batched:
        gq, gk, gv = gq[0], gk[0], gv[0]
    grads["query"] = gq
    grads["key"] = gk
    grads["value"] = gv
    return grads
