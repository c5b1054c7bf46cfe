"""mha_ext.scaled_dot_product_attention, the public face: NumPy arrays go to
the C core through mha_ext._sdpa, torch tensors through the autograd
Function of mha_ext._sdpa_torch (imported only then: it needs torch).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, TypeVar, overload

import numpy as np
from numpy.typing import ArrayLike

from ._convert import (ValueErrorAndRuntimeError, is_causal_bias, is_tensor, probability,
                       refuse_fx_proxies)
from ._calls import LOWER_RIGHT, sliding_window
from ._sdpa import _seed, sdpa_arrays, sdpa_forward, sdpa_head_mask, sdpa_layout, sdpa_output
from ._types import Causal, Flag, Int, Real, Window

if TYPE_CHECKING:
    from .layout import BlockLayout

__all__ = ["scaled_dot_product_attention"]

_T_co = TypeVar("_T_co", covariant=True)
_T = TypeVar("_T")


class _Tensor(Protocol[_T_co]):
    """A torch tensor as the overloads tell it from an array, without
    importing torch (a NumPy user's checker needs no torch): detach() gives
    the plain tensor type, which the call returns (torch.Tensor)."""

    @property
    def requires_grad(self) -> bool: ...
    def detach(self) -> _T_co: ...


@overload
def scaled_dot_product_attention(
        query: _Tensor[_T], key: _Tensor[Any], value: _Tensor[Any],
        attn_mask: _Tensor[Any] | ArrayLike | None = None,
        dropout_p: Real | _Tensor[Any] = 0.0, is_causal: Causal = False,
        scale: Real | _Tensor[Any] | None = None, enable_gqa: Flag = False, *,
        seed: Int | None = None, window: Window = None, layout: BlockLayout | None = None,
        head_mask: _Tensor[Any] | ArrayLike | None = None) -> _T: ...
@overload
def scaled_dot_product_attention(
        query: ArrayLike, key: ArrayLike, value: ArrayLike, attn_mask: ArrayLike | None = None,
        dropout_p: Real = 0.0, is_causal: Causal = False, scale: Real | None = None,
        enable_gqa: Flag = False, *, seed: Int | None = None, window: Window = None,
        layout: BlockLayout | None = None, head_mask: ArrayLike | None = None) -> np.ndarray: ...


def scaled_dot_product_attention(query: Any, key: Any, value: Any, attn_mask: Any = None,
                                 dropout_p: Any = 0.0, is_causal: Causal = False,
                                 scale: Any = None, enable_gqa: Flag = False, *,
                                 seed: Int | None = None, window: Window = None,
                                 layout: BlockLayout | None = None, head_mask: Any = None,
                                 ) -> Any:
    """torch.nn.functional.scaled_dot_product_attention, computed by mha_ext's C core.

        out = softmax(query @ keyᵀ · scale + mask) @ value

    query (..., Hq, L, E), key (..., Hk, S, E), value (..., Hv, S, Ev): any
    leading dimensions, broadcast as torch broadcasts them; returns
    (..., Hq, L, Ev).  NumPy arrays (or anything NumPy reads) in -> a NumPy
    array out, float64 when an input is float64, else float32; CPU torch
    tensors in -> a tensor out, differentiable through mha_ext's C backward
    (double backward raises a RuntimeError); float16 and bfloat16 tensors
    are computed in float32 and the output rounded back, as torch's CPU
    SDPA does.

    attn_mask: broadcastable to (..., Hq, L, S).
        BOOL MASKS: True = ATTEND (take part in the attention), False =
        blocked.  This is SDPA's polarity and the OPPOSITE of
        nn.MultiheadAttention's attn_mask and of mha_ext.MultiHeadAttention's
        masks, where True = blocked.
        Float masks are added to the scores (-inf blocks); a float mask
        tensor that requires grad (a learned position bias) gets its
        gradient, as from torch (the C backward's gradient of the masked
        scores, summed over the mask's broadcast).
    dropout_p: probability of dropping a weight (applied whenever > 0, as
        torch's functional does); the stream is mha_ext's own (seed=, a
        keyword of ours, an int in [0, 2**64); None draws one: from torch's
        default generator with tensors, as torch's dropout does, so that
        torch.manual_seed and torch.utils.checkpoint repeat the mask; a
        fresh one with arrays), so the dropped entries differ from torch's.
        With tensors a 0-d real tensor without grad is read as its value,
        as torch reads it.
    is_causal: True: query i sees keys j <= i (top-left, torch's).  Given
        with attn_mask, tensors follow torch: both apply where torch's own
        choice takes its fused CPU kernel (4-D, unit last stride, no
        dropout, a mask that does not require grad) or there is no query
        or key, else torch's RuntimeError;
        arrays always raise it.  "lower_right": query i sees keys
        j <= i + S - L (torch's causal_lower_right), and may be combined
        with attn_mask.
    scale: None (1/sqrt(E)) or any real number (a 0-d tensor too).
    enable_gqa: query head h reads key head h // (Hq // Hk) and value head
        h // (Hq // Hv) (Hq a multiple of both), as torch's grouped-query
        attention does.
    window: (left, right), a sliding window (a keyword of ours): query i
        sees keys j with i - left <= j <= i + right (None = unbounded on
        that side; the diagonal shifted by S - L with is_causal=
        "lower_right").  The C kernels skip the key blocks outside it.
    layout: a mha_ext.layout.BlockLayout (a keyword of ours): block-sparse
        attention, query block qb sees key block kb only where
        layout.keep[..., qb, kb] is True (True = KEPT; shape (nqb, nkb),
        (Hq, nqb, nkb) or (B, Hq, nqb, nkb) with B the leading dimensions
        flattened).  The C kernels skip the key ranges it leaves empty.
    head_mask: (Hq,) or the result's leading shape (..., Hq), the query's,
        key's and value's broadcast (a keyword of ours): finite factors multiplying
        each head's attention weights after dropout, so its output (Hugging
        Face's head_mask: 0 switches a head off).  A tensor that requires
        grad gets dL/d head_mask.

    On tensors, arguments torch refuses too are refused with torch's
    exception type as well as ours (a RuntimeError for a 1-D query, say, is
    also our ValueError), with both messages.

    A query with no visible key gives a zero output row (and zero
    gradients), as torch's SDPA does.  Empty shapes (zero batches, heads,
    L, S, E or Ev) give torch's results; with E = 0 every score is 0.
    Tensors on the meta device (no data) go to torch's own function, which
    checks them and gives the result's shape (window, layout and head_mask
    leave it unchanged).
    """
    refuse_fx_proxies(query, key, value, attn_mask)
    attn_mask, is_causal = _causal_bias(attn_mask, is_causal, query, key)
    named = dict(query=query, key=key, value=value, attn_mask=attn_mask)
    meta = [n for n, x in named.items() if getattr(x, "is_meta", False)]
    if meta:
        real = [n for n, x in named.items() if is_tensor(x) and n not in meta]
        if real:  # (torch's function would read the meta ones as undefined data)
            raise ValueErrorAndRuntimeError(    # (torch's type for devices that differ)
                f"{', '.join(meta)} on the meta device (no data) with {', '.join(real)} "
                f"holding data: put them on one device")
        import torch  # torch's own function: F's may be this twin, patched in
        return torch._C._nn.scaled_dot_product_attention(
            query, key, value, attn_mask, float(dropout_p), is_causal is True,
            scale=None if scale is None else float(scale), enable_gqa=bool(enable_gqa))
    if any(is_tensor(x) for x in (query, key, value)):
        from ._sdpa_torch import sdpa_torch  # needs torch: imported on first use only
        try:
            return sdpa_torch(query, key, value, attn_mask, dropout_p, is_causal, scale,
                              enable_gqa, seed, window, layout, head_mask)
        except (ValueError, TypeError) as exc:
            if window is not None or layout is not None or head_mask is not None \
                    or not isinstance(is_causal, bool) \
                    or any(getattr(x, "is_nested", False) for x in (query, key, value)):
                raise                                   # ours alone: torch has no such call
            if enable_gqa and any(getattr(x, "ndim", 0) >= 3 and x.shape[-3] == 0
                                  for x in (key, value)):
                raise  # torch's own function dies of SIGFPE there (a key head count of 0)
            # arguments torch refuses too: its exception type as well (_torch_errors);
            # torch's own function, which F.scaled_dot_product_attention may no longer
            # be (a user's patch putting this twin in its place: no recursion)
            import torch
            from ._torch_errors import metas, torchs
            torch_sdpa = torch._C._nn.scaled_dot_product_attention
            mq, mk, mv, mm = metas(query, key, value, attn_mask)
            raise torchs(exc, lambda: torch_sdpa(
                mq, mk, mv, attn_mask=mm,
                dropout_p=float(dropout_p), is_causal=is_causal,
                scale=None if scale is None else float(scale),
                enable_gqa=bool(enable_gqa))) from exc.__cause__
    w = sliding_window(window)
    p = probability(dropout_p, "dropout_p")
    q4, k4, v4, masks, c, s, (lead, _), shape = sdpa_arrays(query, key, value, attn_mask,
                                                            is_causal, scale, enable_gqa)
    out, _ = sdpa_forward(q4, k4, v4, masks, c, s, p, _seed(seed, p), window=w,
                          layout=sdpa_layout(layout, q4, k4),
                          head_mask=sdpa_head_mask(head_mask, q4, lead))
    return sdpa_output(out, shape)


def _causal_bias(attn_mask, is_causal, query, key):
    """torch's CausalBias (torch.nn.attention.bias.causal_upper_left /
    causal_lower_right) as attn_mask, as torch's SDPA takes it: its pattern
    as is_causal (True or "lower_right"), the object holding no mask values
    to read; with is_causal too, torch's ValueError."""
    if not is_causal_bias(attn_mask):
        return attn_mask, is_causal
    if is_causal is not False:
        raise ValueError("CausalBias should not be used with causal=True")
    L, S = (tuple(getattr(x, "shape", ())) for x in (query, key))
    L, S = (x[-2] if len(x) >= 2 else None for x in (L, S))  # else refused later
    if None not in (L, S) and (attn_mask.seq_len_q, attn_mask.seq_len_kv) != (L, S):
        raise ValueError(f"attn_mask is a CausalBias for {attn_mask.seq_len_q} queries and "
                         f"{attn_mask.seq_len_kv} keys, the call has {L} and {S}")
    upper_left = attn_mask.variant == type(attn_mask.variant).UPPER_LEFT
    return None, True if upper_left else LOWER_RIGHT
