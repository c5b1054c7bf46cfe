"""The argument rules and the C calls of mha_ext.scaled_dot_product_attention
(mha_ext._sdpa_api; its autograd on tensors: mha_ext._sdpa_torch): torch's
scaled_dot_product_attention computed by the C core on already-projected
heads (_core._sdpa / _core._sdpa_backward, src/sdpa_forward_impl.h).

Shapes (torch's): query (..., Hq, L, E), key (..., Hk, S, E), value
(..., Hv, S, Ev); leading dims broadcast as torch broadcasts them (Hq, Hk
and Hv too, or with enable_gqa each of Hk and Hv divides Hq); the result is
(..., Hq, L, Ev).  2-D inputs (L, E) work too.

Legend: L query length, S key length, E query/key width, Ev value width,
Hq query heads, Hk key heads, Hv value heads.
"""
from __future__ import annotations

import math
import os

import numpy as np

from . import _core
from ._calls import causal, score_scale
from ._convert import ValueErrorAndRuntimeError, as_real, flag
from ._convert import seed as seed_value
from ._masks import block_layout

__all__ = ["sdpa_arrays", "sdpa_check", "sdpa_forward", "sdpa_backward", "sdpa_layout",
           "sdpa_head_mask", "sdpa_output"]


def _dtype(*arrays):
    # float64 when any input is a float of 8 bytes or more (float64 in either
    # byte order: '>f8' != np.float64; np.longdouble), else float32
    return np.float64 if any(a.dtype.kind == "f" and a.dtype.itemsize >= 8
                             for a in arrays) else np.float32


def sdpa_check(query, key, value, attn_mask, is_causal, scale, enable_gqa,
               causal_and_mask=False):
    """sdpa_arrays' checks alone, nothing copied: (q, k, v, mask, is_causal,
    scale, (lead, lead_kv), dtype), q, k, v and mask (None without one) as
    arrays of the caller's shapes and dtypes; lead and lead_kv are the
    broadcast leading shapes of q and of k, v (enable_gqa's heads: their
    least common multiple).  attn_mask with is_causal=True is torch's
    RuntimeError unless causal_and_mask (both then apply)."""
    q, k, v = (as_real(x, n) for x, n in ((query, "query"), (key, "key"), (value, "value")))
    for name, x in (("query", q), ("key", k), ("value", v)):
        if x.ndim < 2:
            raise ValueError(f"{name} must have at least 2 dimensions (..., length, width), "
                             f"got shape {x.shape}")
    dtype = _dtype(q, k, v)
    L, E = q.shape[-2:]
    S, Ek = k.shape[-2:]
    Sv, Ev = v.shape[-2:]
    if Ek != E:
        raise ValueError(f"key's last dimension must be query's ({E}), got key {k.shape}, "
                         f"query {q.shape}")
    if Sv != S:
        raise ValueError(f"value must have key's length {S}, got value {v.shape}, key {k.shape}")
    gqa = flag(enable_gqa, "enable_gqa")
    lq, lk, lv = q.shape[:-2], k.shape[:-2], v.shape[:-2]
    try:
        if gqa and len(lq) >= 1 and len(lk) >= 1 and len(lv) >= 1:
            # torch repeats key's and value's heads each to query's count
            # (repeat_interleave): key head h // (Hq / Hk) for query head
            # h, the same for value.  sdpa_arrays repeats both to their
            # least common multiple Hkv, and query head h takes head
            # h // (Hq / Hkv): the same pairs
            Hq, Hk, Hv = lq[-1], lk[-1], lv[-1]
            # (no query head: an empty result whatever key's and value's
            # counts)
            if Hq != 0 and (Hk == 0 or Hv == 0 or Hq % Hk != 0 or Hq % Hv != 0):
                raise ValueError(f"enable_gqa=True: query's heads ({Hq}, dimension -3) must "
                                 f"be a multiple of key's ({Hk}) and value's ({Hv})")
            batch = np.broadcast_shapes(lq[:-1], lk[:-1], lv[:-1])
            lead, lead_kv = batch + (Hq,), batch + (math.lcm(Hk, Hv),)
        else:
            # (equal shapes, the usual case, need no broadcast: a fifth of
            # these checks' time)
            lead = lq if lq == lk == lv else np.broadcast_shapes(lq, lk, lv)
            lead_kv = lead
    except ValueError as e:
        if "enable_gqa" in str(e):
            raise
        raise ValueError(f"the leading dimensions of query {q.shape}, key {k.shape} and "
                         f"value {v.shape} do not broadcast"
                         + ("" if gqa else " (different numbers of heads need "
                            "enable_gqa=True)")) from None
    c = causal(is_causal)
    m = None
    if attn_mask is not None:
        if c is True and not causal_and_mask:
            # torch's rule where torch keeps it (see fused_causal_and_mask in
            # mha_ext._sdpa_torch), with its exception type and words
            # (a ValueError too: docs/API.md §7's types for bad input)
            raise ValueErrorAndRuntimeError(
                "Explicit attn_mask should not be set when is_causal=True (torch's rule, kept "
                "by its math path: '_scaled_dot_product_attention: Explicit attn_mask should "
                "not be set when is_causal=True'; only its fused CPU kernel applies both, for "
                "4-D tensors with a unit last stride, no dropout and a mask that does not "
                "require grad, unless sdpa_kernel rules it out): put the causal mask into "
                "attn_mask, or use is_causal='lower_right' with it")
        m = as_real(attn_mask, "attn_mask")
        if m.dtype != np.bool_ and m.dtype.kind != "f":
            raise TypeError(f"attn_mask must be bool (True = attend) or floating (added to "
                            f"the scores), got dtype {m.dtype}")
        try:
            full = np.broadcast_shapes(m.shape, lead + (L, S))
        except ValueError:
            full = None
        if full != lead + (L, S):
            msg = f"attn_mask of shape {m.shape} does not broadcast to {lead + (L, S)} " \
                "(..., heads, L, S)"
            if full is None:  # (torch's own error on tensors: _sdpa_api's probe)
                raise ValueError(msg)
            # it would widen the scores: torch's kernels refuse it adding the
            # mask in place, also where a meta probe computes (more axes)
            raise ValueErrorAndRuntimeError(
                f"{msg} (torch: output with shape {_listed(lead + (L, S))} doesn't match "
                f"the broadcast shape {_listed(full)})")
    return q, k, v, m, c, score_scale(scale), (lead, lead_kv), dtype


def _listed(shape):
    """A shape as torch writes it in its messages: [2, 3, 5, 7]."""
    return "[" + ", ".join(map(str, shape)) + "]"


def _to(x, shape):
    """x broadcast to shape (x itself when it has it: a call's usual case,
    where np.broadcast_to's checks were a tenth of a small call's time)."""
    return x if x.shape == shape else np.broadcast_to(x, shape)


def sdpa_arrays(query, key, value, attn_mask, is_causal, scale, enable_gqa,
                causal_and_mask=False):
    """The arguments checked (sdpa_check) and brought to the C side's form:
    (q (B, H, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev) contiguous of one
    dtype, masks [(kind, array)] over (B, H, L, S), is_causal, scale, (lead,
    lead_kv), shape): q and k, v are brought to lead and lead_kv before their
    reshape to (B, H) and (B, Hkv); the output's shape is (*lead, L, Ev),
    or where torch's SDPA returns zeros before computing (no query row, or
    no value element) query's own leading shape, not broadcast (sdpa_output
    makes it)."""
    q, k, v, m, c, s, (lead, lead_kv), dtype = sdpa_check(
        query, key, value, attn_mask, is_causal, scale, enable_gqa, causal_and_mask)
    L, E = q.shape[-2:]
    S, Ev = v.shape[-2:]
    H = lead[-1] if lead else 1
    Hkv = lead_kv[-1] if lead_kv else 1
    B = math.prod(lead[:-1]) if lead else 1
    # enable_gqa's heads repeated to Hkv (a head of 1 broadcast the same way)
    k, v = (np.repeat(x, Hkv // x.shape[-3], axis=-3)
            if x.ndim >= 3 and x.shape[-3] not in (0, Hkv) else x for x in (k, v))
    q4 = np.ascontiguousarray(_to(q, lead + (L, E)), dtype=dtype).reshape(B, H, L, E)
    k4 = np.ascontiguousarray(_to(k, lead_kv + (S, E)), dtype=dtype).reshape(B, Hkv, S, E)
    v4 = np.ascontiguousarray(_to(v, lead_kv + (S, Ev)), dtype=dtype).reshape(B, Hkv, S, Ev)
    masks = []
    if m is not None:
        if m.dtype == np.bool_:
            kind, m = 0, ~m  # SDPA's True = attend; the core's blocking mask: True = blocked
        else:
            kind, m = 1, m.astype(dtype, copy=False)
        if len(lead) > 2 or m.ndim > 4:
            m = np.broadcast_to(m, lead + (L, S)).reshape(B, H, L, S)
        masks.append((kind, m))
    early = L == 0 or v.size == 0
    shape = q.shape[:-1] + (Ev,) if early else lead + (L, Ev)
    return q4, k4, v4, masks, c, s, (lead, lead_kv), shape


def sdpa_output(out, shape):
    """The C side's (B, H, L, Ev) output as the call's result of `shape`
    (sdpa_arrays'); where torch returns early (no query row or no value
    element: out holds zeros or nothing, of the broadcast shape), zeros of
    `shape` when the sizes differ."""
    return out.reshape(shape) if out.size == math.prod(shape) else np.zeros(shape, out.dtype)


def _seed(seed, p, draw=None):
    """The dropout stream's seed for a call of dropout probability p: seed
    checked (an int in [0, 2**64) or None) whatever p; None draws one, from
    draw() when given (the torch path: torch's generator), else fresh."""
    if seed is not None:
        seed = seed_value(seed, "seed")
    if p <= 0:
        return 0
    if seed is None:
        return draw() if draw is not None else int.from_bytes(os.urandom(8), "little")
    return seed


def sdpa_layout(layout, q4, k4):
    """layout (None or a mha_ext.layout.BlockLayout) checked against the call
    of q4 (B, H, L, D), k4 (B, Hkv, S, D), in the C side's form."""
    return block_layout(layout, q4.shape[0], q4.shape[1], q4.shape[2], k4.shape[2])


def sdpa_head_mask(head_mask, q4, lead):
    """head_mask checked: None, or real numbers of shape (Hq,) (every
    batch) or the result's leading shape (..., Hq) (the query's, key's and
    value's broadcast), as the C side's contiguous
    (B, Hq) of q4's dtype; finite values only."""
    if head_mask is None:
        return None
    m = as_real(head_mask, "head_mask")
    B, H = q4.shape[:2]
    lead = tuple(lead) if lead else (1,)
    if m.shape not in ((H,), lead):
        raise ValueError(f"head_mask must have shape (heads,) = ({H},) or the result's leading "
                         f"shape {lead} (the query's, key's and value's broadcast), got {m.shape}")
    with np.errstate(over="ignore"):  # a float64 value too large for float32: refused below
        m = np.array(np.broadcast_to(m, lead).reshape(B, H), dtype=q4.dtype, order="C",
                     copy=True)
    if not np.isfinite(m).all():
        raise ValueError("head_mask must hold finite numbers")
    return m


def _widened(q4, k4, v4, scale):
    """q4, k4, v4 and scale as the C core takes them (a head and a width of
    at least one): a zero width E or Ev becomes one column of zeros.  E = 0
    gives every score 0 whatever the scale (an empty sum; torch scales q and
    k by sqrt(scale) before their product), so the scale becomes 1 there (the
    default 1/sqrt(0) would make 0·inf = NaN); Ev = 0 gives an empty output,
    the weights unchanged."""
    if q4.shape[3] == 0:
        q4 = np.zeros(q4.shape[:3] + (1,), q4.dtype)
        k4 = np.zeros(k4.shape[:3] + (1,), k4.dtype)
        scale = 1.0
    if v4.shape[3] == 0:
        v4 = np.zeros(v4.shape[:3] + (1,), v4.dtype)
    return q4, k4, v4, scale


def sdpa_forward(q4, k4, v4, masks, is_causal, scale, p, seed, need_weights=False,
                 reference=False, window=None, layout=None, head_mask=None):
    """_core._sdpa: (out (B, H, L, Ev), weights (B, H, L, S) or None).
    Rows with no visible key give 0, as torch's SDPA does.  window: None or
    a pair checked by mha_ext._calls.sliding_window; layout: None or
    sdpa_layout's; head_mask: None or sdpa_head_mask's.  No head (H or Hkv
    0) gives empty results; a zero width, _widened's."""
    B, H, L = q4.shape[:3]
    S, Ev = k4.shape[2], v4.shape[3]
    if H == 0 or k4.shape[1] == 0:
        return (np.zeros((B, H, L, Ev), q4.dtype),
                np.zeros((B, H, L, S), q4.dtype) if need_weights else None)
    q4, k4, v4, scale = _widened(q4, k4, v4, scale)
    out, w = _core._sdpa(q4, k4, v4, masks=masks, is_causal=is_causal, scale=scale,
                         dropout=p, seed=seed, counter=0, need_weights=need_weights,
                         zero_rows=True, reference=reference, window=window, layout=layout,
                         head_mask=head_mask)
    return out[..., :Ev], w


def sdpa_backward(q4, k4, v4, grad_out, masks, is_causal, scale, p, seed, reference=False,
                  window=None, layout=None, head_mask=None, scores_grad=False):
    """_core._sdpa_backward: (dq, dk, dv) of the sdpa_forward call with the
    same arguments (zeros where sdpa_forward computed nothing); scores_grad
    adds dL/d scores (B, H, L, S), the scores after the masks are added
    (an additive mask's gradient, before its broadcast is summed)."""
    shapes = (q4.shape, k4.shape, v4.shape)
    if scores_grad:
        shapes += (q4.shape[:3] + k4.shape[2:3],)
    if q4.shape[1] == 0 or k4.shape[1] == 0:
        return tuple(np.zeros(sh, q4.dtype) for sh in shapes)
    q4, k4, v4, scale = _widened(q4, k4, v4, scale)
    if grad_out.shape[3] != v4.shape[3]:  # Ev = 0: the widened column's gradient is 0
        grad_out = np.zeros(grad_out.shape[:3] + (1,), grad_out.dtype)
    grads = _core._sdpa_backward(q4, k4, v4, grad_out, masks=masks, is_causal=is_causal,
                                 scale=scale, dropout=p, seed=seed, counter=0, zero_rows=True,
                                 reference=reference, window=window, layout=layout,
                                 head_mask=head_mask, scores_grad=scores_grad)
    # a widened input's gradient: its real columns (none)
    return tuple(g if g.shape == sh else np.zeros(sh, g.dtype) for g, sh in zip(grads, shapes))
