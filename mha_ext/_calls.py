"""Call arguments and output shaping, and the only place that calls the C
type's private methods ``_forward``, ``_forward_train`` and ``_backward``
(keyword arguments, one result shape each; their protocol: _core_calls.c).

A call's life in Python: :func:`prepare` checks the arguments and brings
them to the C side's form (a :class:`Call`: 3-D inputs, key/value defaults
kept as the same array for self-attention, masks as (kind, array) pairs,
flags as bools); one of the ``c_*`` functions below runs it in C (one small
function per private C method, holding that method's protocol); and
:func:`shape_output` gives the results the shapes the caller asked for
(unbatched, mean over heads).  :func:`grads_for_c` is its inverse for the
backward's incoming gradients.

Legend: B batch, Sq query length, Sk key length, E = d_model, H = n_heads.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import _core
from ._convert import as_int, as_real, contiguous, flag, too_large, unmasked
from ._habits import causal_call
from ._masks import block_layout, masks as _masks
from .cache import KVCache

# is_causal: the one spelling of the lower-right alignment in every API
LOWER_RIGHT = "lower_right"

__all__ = ["Call", "prepare", "shape_output", "grads_for_c", "keep_level", "c_forward",
           "c_forward_train", "c_backward"]


class Call(NamedTuple):
    """One call's arguments in the C side's form."""
    query: np.ndarray        # (B, Sq, E)
    key: np.ndarray          # (B, Sk, kdim); the query array itself for self-attention
    value: np.ndarray        # (B, Sk, vdim); the key (or query) array itself when defaulted
    masks: list              # [(kind, array)], kind 0 blocking, 1 additive (see _masks)
    batched: bool            # False: the caller's inputs were 2-D
    is_causal: bool | str    # False, True (top-left) or "lower_right"
    need_weights: bool
    average_weights: bool
    zero_rows: bool          # masked_rows == "zero"
    scale: float | None      # None: 1 / sqrt(Dk)
    window: tuple | None     # None, or (left, right), each int >= 0 or None
    head_mask: np.ndarray | None  # (B, H) of the module's dtype, finite
    layout: tuple | None     # None, or (keep (1|B, 1|H, nqb, nkb) bool, q_block, k_block)
    cache: object = None     # None, or the KVCache (mha_ext.cache) the call extends


def causal(is_causal):
    """is_causal checked: False, True (top-left: query i sees keys j <= i) or
    "lower_right" (query i sees keys j <= i + Sk - Sq, torch's
    causal_lower_right: the decoding alignment)."""
    if isinstance(is_causal, str):
        if is_causal != LOWER_RIGHT:
            raise TypeError(f"is_causal must be True or False (top-left), or {LOWER_RIGHT!r}, "
                            f"got {is_causal!r}")
        return LOWER_RIGHT
    try:
        return flag(is_causal, "is_causal")
    except TypeError as e:
        raise TypeError(f"{e}, or {LOWER_RIGHT!r}") from None


def score_scale(scale):
    """scale checked: None (1 / sqrt(head width)) or one real number (0 and
    +-inf too, as torch allows any float; NaN is refused: torch's fused path
    turns every score NaN into a row of zeros, its other paths into NaN)."""
    if scale is None:
        return None
    scale = unmasked(scale, "scale")  # a masked 0-d array: float() would read NaN
    boolean = isinstance(scale, (bool, np.bool_)) or \
        str(getattr(scale, "dtype", "")) in ("bool", "torch.bool")  # 0-d bool arrays too
    bad = (boolean or isinstance(scale, (str, bytes, complex, np.complexfloating))
           or getattr(scale, "ndim", 0) != 0)
    if getattr(scale, "requires_grad", False) is True:  # torch's TypeError too
        raise TypeError("scale must be a number or a 0-d tensor without grad (its gradient "
                        "would be lost): detach it, or scale the query")
    if not bad:
        try:
            value = float(scale)
        except OverflowError:  # torch's error too, which this one also is
            raise too_large(scale, "scale") from None
        except (TypeError, ValueError):
            pass
        else:
            if value != value:
                raise ValueError("scale must be a real number, not NaN (every score would be "
                                 "NaN; torch gives zeros on one path and NaN on another)")
            return value
    kind = "a bool" if boolean else type(scale).__name__
    raise TypeError(f"scale must be None or a real number, not {kind}")


def _window_bound(x, side):
    # an int as _convert.as_int reads one (a 0-d integer array or tensor
    # too; never a bool)
    if x is None:
        return None
    i = as_int(x, f"window's {side} bound")
    if i is None or i < 0:
        raise ValueError(f"window's {side} bound must be None (unbounded) or an int >= 0, "
                         f"got {x!r}")
    return i


def sliding_window(window):
    """window checked: None (no window) or (left, right), each None
    (unbounded on that side) or an int >= 0: query i sees keys j with
    i - left <= j <= i + right (the diagonal shifted by Sk - Sq with
    is_causal="lower_right").  (None, None) is no window."""
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be None or a pair (left, right) of ints >= 0 or None "
                        f"(query i sees keys i - left .. i + right), got {window!r}")
    w = (_window_bound(window[0], "left"), _window_bound(window[1], "right"))
    return None if w == (None, None) else w


def head_mask_array(head_mask, B, H, dtype):
    """head_mask checked: None, or real numbers of shape (H,) (every batch)
    or (B, H), as a contiguous (B, H) array of dtype.  Finite values only
    (0 switches a head off, 1 keeps it; any other factor scales it)."""
    if head_mask is None:
        return None
    m = as_real(head_mask, "head_mask")
    if m.shape not in ((H,), (B, H)):
        raise ValueError(f"head_mask must have shape (n_heads,) = ({H},) or (batch, n_heads) "
                         f"= ({B}, {H}), got {m.shape}")
    with np.errstate(over="ignore", invalid="ignore"):  # too large for dtype: said below
        m = np.array(np.broadcast_to(m, (B, H)), dtype=dtype, order="C", copy=True)  # kept
    if not np.isfinite(m).all():
        raise ValueError(f"head_mask must hold finite numbers (in the module's "
                         f"{np.dtype(dtype).name})")
    return m


def _cache_check(mha, cache, key, value, is_causal):
    """A call's cache checked (a KVCache of this module); returns is_causal
    as the cached call reads it: a self-attention cache is causal with the
    lower-right alignment (the new queries follow the cached keys), so
    is_causal may be left False or be True or "lower_right"; a cross cache
    is never causal and takes the query alone."""
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be None or a KVCache (from new_cache or cache_memory), "
                        f"not {type(cache).__name__}")
    cache._check_owner(mha)
    c = causal(is_causal)
    if cache.cross:
        if key is not None or value is not None:
            raise ValueError("a cross-attention cache (cache_memory) already holds the "
                             "memory's keys and values: pass the query alone")
        if c:
            raise ValueError("a cross-attention cache's memory is not causal: leave "
                             "is_causal False")
        return False
    return LOWER_RIGHT


def prepare(mha, query, key=None, value=None, mask=None, attn_mask=None,
            key_padding_mask=None, is_causal=False, need_weights=True,
            average_weights=False, masked_rows="nan", dtype=None, scale=None,
            window=None, head_mask=None, layout=None, cache=None) -> Call:
    """A call's arguments checked and brought to the C side's form.  key
    defaults to query, value to key.  With dtype None the inputs are arrays
    as given (no copy for an ndarray; the C side converts); with a dtype they
    are C-contiguous arrays of it (no copy when they already are).  With a
    cache (a KVCache), key and value are the new keys (a cross cache: none),
    the masks cover the cached keys and the new ones, and the call is
    causal as _cache_check says.  A module with causal = True (from_torch
    of a module applying its own causal mask) makes a false is_causal True."""
    is_causal = causal_call(mha, is_causal, cache)
    if cache is not None:
        is_causal = _cache_check(mha, cache, key, value, is_causal)
        if layout is not None:  # its blocks count queries from the call's first
            raise ValueError("layout= and cache= do not combine: a block layout's query "
                             "blocks count from the call's first query, not from the "
                             "cached positions; give the keys as a mask (attn_mask) instead")
    if dtype is None:  # real data checked here: a 0-d string is a TypeError, not a shape's
        convert = as_real
    else:
        def convert(x, name):
            return contiguous(x, name, dtype)
    q = convert(query, "query")
    k = q if key is None else convert(key, "key")
    v = k if value is None else convert(value, "value")
    if q.ndim == 2:
        for name, x in (("key", k), ("value", v)):
            if x.ndim != 2:
                raise ValueError(f"query is unbatched (2-D, shape {q.shape}), so {name} "
                                 f"must be 2-D too, got shape {x.shape}")
        batched = False
        # keep self-attention visible to the C side (no second copy)
        q3 = q[None]
        k3 = q3 if k is q else k[None]
        v3 = k3 if v is k else (q3 if v is q else v[None])
    else:
        batched = True
        q3, k3, v3 = q, k, v
    if q3.ndim != 3:
        raise ValueError(f"query must be 3-D (batch, seq, d_model) or 2-D (seq, d_model), "
                         f"got shape {q.shape}")
    if k3.ndim != 3 or v3.ndim != 3:
        bad, x = ("key", k) if k3.ndim != 3 else ("value", v)
        raise ValueError(f"{bad} must be 3-D like query (shape {q.shape}), got shape {x.shape}")
    B, Sq, Sk = q3.shape[0], q3.shape[1], k3.shape[1]
    if not isinstance(masked_rows, str) or masked_rows not in ("nan", "zero"):
        raise ValueError(f"masked_rows must be 'nan' or 'zero', got {masked_rows!r}")
    Sk_all = Sk
    if cache is not None:
        if B != cache.batch_size:
            raise ValueError(f"the cache was made for batch_size {cache.batch_size}, the "
                             f"call has batch {B}")
        if cache.cross:  # no new keys: the memory is cached
            k3 = np.zeros((B, 0, mha.kdim), dtype=mha.dtype)
            v3 = np.zeros((B, 0, mha.vdim), dtype=mha.dtype)
            Sk = 0
        if cache.length + Sk > cache.capacity:
            raise ValueError(f"the cache holds {cache.length} of {cache.capacity} keys: "
                             f"{Sk} more do not fit (make it with a larger max_len)")
        Sk_all = cache.length + Sk
    ms = _masks(mask, attn_mask, key_padding_mask, batched, B, mha.n_heads, Sq, Sk_all)
    return Call(q3, k3, v3, ms, batched, causal(is_causal),
                flag(need_weights, "need_weights"), flag(average_weights, "average_weights"),
                masked_rows == "zero", score_scale(scale), sliding_window(window),
                head_mask_array(head_mask, B, mha.n_heads, mha.dtype),
                block_layout(layout, B, mha.n_heads, Sq, Sk_all), cache)


def head_mean(weights):
    """The mean over the heads (axis 1) of (B, H, Sq, Sk) weights, summed
    head by head in order, then divided by H: the same order for every
    shape.  NumPy's own mean sums a reduced axis that ends up innermost
    (one query and one key: a decode step's first token) pairwise, so such
    a row would get other bits than in a longer call (docs/API.md §3.4)."""
    B, H = weights.shape[:2]
    total = np.empty((B,) + weights.shape[2:], weights.dtype)
    # a few batches at a time, so that their running sums (about 1 MiB)
    # stay in cache across the heads
    step = max(1, (1 << 20) // max(1, total[:1].nbytes))
    for b in range(0, B, step):
        t = total[b:b + step]
        t[...] = weights[b:b + step, 0]
        for h in range(1, H):
            t += weights[b:b + step, h]
    total /= weights.dtype.type(H)
    return total


def shape_output(call, out, weights):
    """(output, weights) as the caller asked: weights averaged over heads with
    average_weights (c_forward's and c_forward_train's come averaged by the
    core, 3-D: only 4-D ones are averaged here), the batch axis dropped for
    unbatched inputs."""
    if weights is not None and call.average_weights and weights.ndim == 4:
        weights = head_mean(weights)
    if not call.batched:
        out = out[0]
        weights = None if weights is None else weights[0]
    return out, weights


def grads_for_c(grad_output, grad_weights, batched, average_weights, n_heads):
    """The inverse of shape_output for the backward's incoming gradients:
    dL/d output as (B, Sq, E) and dL/d weights as (B, H, Sq, Sk') (or None;
    Sk' counts add_bias_kv's and add_zero_attn's extra keys)."""
    go, gw = grad_output, grad_weights
    if gw is not None:
        if not batched:
            gw = gw[None]
        if average_weights:  # weights = mean over heads
            gw = np.repeat(gw[:, None] / gw.dtype.type(n_heads), n_heads, axis=1)
    if not batched:
        go = go[None]
    return go, gw


def keep_level(mha, call, save_projections):
    """What forward_train's C call keeps for the backward: 0 nothing, 1 the
    projections Q, K, V and the context, 2 also the softmax P when it costs
    no more memory than those four, or at most four times theirs while it
    takes at most a quarter of the output cache's limit (memory_info()):
    reading P back is then faster than recomputing it (a training step at
    B 4, S 1024, E 1024, H 16 on Zen 4: 805-858 ms against 865-885), and
    the cache keeps its memory from one step to the next (a P the cache
    cannot hold is mapped and faulted in afresh each step, and the gain is
    gone: 3485-3516 ms against 3420-3477 at B 16)."""
    if not flag(save_projections, "save_projections"):
        return 0
    B, Sq, E = call.query.shape[0], call.query.shape[1], mha.d_model
    Sk = call.key.shape[1] + int(mha.add_bias_kv) + int(mha.add_zero_attn)
    p, four = mha.n_heads * Sq * Sk, 2 * E * (Sq + Sk)  # per batch entry, in scalars
    if p <= four:
        return 2
    p_bytes = B * p * np.dtype(mha.dtype).itemsize
    return 2 if p <= 4 * four and 4 * p_bytes <= _core.memory_info()["limit_bytes"] else 1


# ---------------------------------------------------------------- the C calls
# Each function below holds one private C method's protocol (_core_calls.c).

def c_forward(mha, call, reference=False, params=None):
    """The module's call: (output (B, Sq, E), weights (B, H, Sq, Sk') or None,
    Sk' = Sk plus the extra keys of add_bias_kv and add_zero_attn; with
    call.average_weights (B, Sq, Sk'), the heads' mean, which the core forms
    with head_mean's bits);
    reference=True runs the core's plain reference forward (the tests' oracle).
    params: None (the module's own) or _params.Parts (read in place).
    With call.cache, the call writes its keys and values into the cache and
    attends over all of it (Sk' = the cache's length after the call); the
    cache's length advances only when the call succeeds."""
    cache = call.cache
    average = bool(call.need_weights and call.average_weights)
    if cache is None:
        return mha._forward(call.query, call.key, call.value, params=params,
                            masks=call.masks, is_causal=call.is_causal,
                            need_weights=call.need_weights, zero_rows=call.zero_rows,
                            reference=bool(reference),
                            scale=call.scale, window=call.window, head_mask=call.head_mask,
                            layout=call.layout, average_weights=average)
    # a cross cache is read, never extended: calls share it.  Otherwise one
    # call at a time (see KVCache._busy)
    with cache._held():
        result = mha._forward(call.query, call.key, call.value, params=params,
                              masks=call.masks, is_causal=call.is_causal,
                              need_weights=call.need_weights, zero_rows=call.zero_rows,
                              reference=bool(reference),
                              scale=call.scale, window=call.window, head_mask=call.head_mask,
                              layout=call.layout, cache=cache._c_tuple(),
                              average_weights=average)
        if not cache.cross:
            cache._length += call.key.shape[1]
            cache._epoch += 1
    return result


def c_forward_train(mha, call, block, dropout, counter, keep):
    """The training forward with parameters `block` (None: the module's,
    copied under its lock; a _params.Parts, copied as the projections read
    them): (output, weights, saved, (block, query, key,
    value) copies) with the shapes of c_forward's results (the weights
    averaged by the core with call.average_weights, P per head); saved is
    None with keep 0, else (Q, K, V, ctx, P or None) (P with keep 2)."""
    return mha._forward_train(call.query, call.key, call.value, params=block,
                              masks=list(call.masks), is_causal=call.is_causal,
                              need_weights=call.need_weights, zero_rows=call.zero_rows,
                              dropout=dropout, counter=counter, save=keep >= 1,
                              save_p=keep == 2, scale=call.scale, window=call.window,
                              head_mask=call.head_mask, layout=call.layout,
                              average_weights=bool(call.need_weights and call.average_weights))


def c_backward(mha, block, query, key, value, masks, is_causal, zero_rows, dropout,
               counter, grad_output, grad_weights, saved, scale=None, window=None,
               head_mask=None, layout=None, scores_grad=False):
    """The backward of one c_forward_train call: (parameter gradient block,
    d query, d key, d value), the inputs' gradients 3-D; with scores_grad,
    then d masked scores (B, H, Sq, Sk')."""
    return mha._backward(query, key, value, grad_output, params=block, masks=list(masks),
                         is_causal=is_causal, zero_rows=zero_rows, dropout=dropout,
                         counter=counter, grad_weights=grad_weights, saved=saved,
                         scale=scale, window=window, head_mask=head_mask, layout=layout,
                         scores_grad=scores_grad)
