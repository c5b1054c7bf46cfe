"""Masks, the one home for them: the seed notebook's ``mask``, torch's
``attn_mask`` and ``key_padding_mask`` checked and brought to the C side's
form, a list of (kind, array) pairs, kind 0 blocking (nonzero = blocked), 1
additive; each array broadcastable to (B, H, Sq, Sk) (unbatched: (H, Sq, Sk)).

Legend: B batch, Sq query length, Sk key length, H = n_heads.
"""
from __future__ import annotations

import numpy as np

from ._convert import as_array, refuse_huge_ints

__all__ = ["BLOCKING", "ADDITIVE", "masks", "block_layout"]

BLOCKING, ADDITIVE = 0, 1


def masks(mask, attn_mask, key_padding_mask, batched, B, H, Sq, Sk):
    """The given masks as the C side's (kind, array) pairs, in this order."""
    out = []
    if mask is not None:
        out.append(_seed_mask(mask, batched, (B, H, Sq, Sk)))
    if attn_mask is not None:
        out.append(_attn_mask(attn_mask, batched, B, H, Sq, Sk))
    if key_padding_mask is not None:
        out.append(_padding_mask(key_padding_mask, batched, B, Sk))
    return out


def block_layout(layout, B, H, Sq, Sk):
    """layout checked: None, or a mha_ext.layout.BlockLayout fitting (B, H,
    Sq, Sk), as the C side's (keep (1 or B, 1 or H, nqb, nkb) bool, q_block,
    k_block).  A layout is never a mask: anything else is a TypeError."""
    from .layout import BlockLayout
    if layout is None:
        return None
    if not isinstance(layout, BlockLayout):
        raise TypeError(f"layout must be None or a mha_ext.layout.BlockLayout (True = the "
                        f"block is kept), got {type(layout).__name__}")
    return (layout.fitted(B, H, Sq, Sk), layout.q_block, layout.k_block)


def _seed_mask(mask, batched, dims):
    # mask broadcasts to (B, H, Sq, Sk) (unbatched: (H, Sq, Sk)), 0/1 values
    m = as_array(mask, "mask")
    if m.dtype.kind not in "biuf":
        refuse_huge_ints(m, "mask")
        raise TypeError(f"mask must be bool, int or float with 0/1 values (1 = blocked), "
                        f"got dtype {m.dtype}")
    if m.ndim > (4 if batched else 3):
        raise ValueError(f"mask must broadcast to (B, H, Sq, Sk) (unbatched: (H, Sq, Sk)), "
                         f"got shape {m.shape}")
    target = dims if batched else dims[1:]
    try:
        fits = np.broadcast_shapes(m.shape, target) == target
    except ValueError:
        fits = False
    if not fits:
        names = ("batch", "heads", "query length", "key length")[-len(target):]
        bad = [f"its {n} axis is {d}, not {t}" for n, d, t in
               zip(names[-m.ndim:], m.shape, target[-m.ndim:]) if d not in (1, t)]
        raise ValueError(f"mask of shape {m.shape} does not broadcast to "
                         f"{'(B, H, Sq, Sk)' if batched else '(H, Sq, Sk)'} = {target}"
                         + (f": {', '.join(bad)}" if bad else ""))
    if m.dtype.kind == "b":
        return (BLOCKING, m.view(np.uint8))
    if not np.all((m == 0) | (m == 1)):
        raise ValueError("mask must hold only 0 and 1 (1 = blocked); for additive float "
                         "masks (-inf to block) use attn_mask")
    return (BLOCKING, m != 0)


def _kind(m, name):
    # torch's masks: bool blocks, float adds
    if m.dtype.kind == "b":
        return BLOCKING
    if m.dtype.kind == "f":
        return ADDITIVE
    refuse_huge_ints(m, name)
    raise TypeError(f"{name} must be bool (True = blocked) or float (added to the "
                    f"scores), got dtype {m.dtype}")


def _attn_mask(attn_mask, batched, B, H, Sq, Sk):
    # attn_mask is (Sq, Sk), or (B*H, Sq, Sk) (unbatched: (H, Sq, Sk))
    m = as_array(attn_mask, "attn_mask")
    kind = _kind(m, "attn_mask")
    if m.shape == (Sq, Sk):
        return (kind, m)
    if batched and m.shape == (B * H, Sq, Sk):
        return (kind, m.reshape(B, H, Sq, Sk))
    if not batched and m.shape == (H, Sq, Sk):
        return (kind, m)
    third = f"(B*H, Sq, Sk) = ({B * H}, {Sq}, {Sk})" if batched else \
        f"(H, Sq, Sk) = ({H}, {Sq}, {Sk})"
    raise ValueError(f"attn_mask must have shape (Sq, Sk) = ({Sq}, {Sk}) or {third}, "
                     f"got {m.shape}")


def _padding_mask(key_padding_mask, batched, B, Sk):
    # key_padding_mask is (B, Sk) (unbatched: (Sk,))
    m = as_array(key_padding_mask, "key_padding_mask")
    kind = _kind(m, "key_padding_mask")
    want = (B, Sk) if batched else (Sk,)
    if m.shape != want:
        raise ValueError(f"key_padding_mask must have shape "
                         f"{'(B, Sk)' if batched else '(Sk,)'} = {want}, got {m.shape}")
    return (kind, m.reshape(B, 1, 1, Sk) if batched else m)
