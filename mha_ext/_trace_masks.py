"""The masks of one traced call as pictures (trace.py's "masked scores"
step): each mask of API.md §3.1 as the cells it blocks or the values it
adds over (B, H, Sq, Sk), and in words where each came from.

Legend: B batch, H heads, Sq query length, Sk key length; i a query, j a key.
"""
from __future__ import annotations

import numpy as np

from ._calls import sliding_window
from ._convert import to_numpy
from ._masks import block_layout

__all__ = ["masks"]


def _as_mask(x):
    return np.asarray(to_numpy(x))


def masks(mask, kwargs, unbatched, B, H, Sq, Sk, dtype, causal=False, coff=0):
    """The masks of API.md §3.1 (causal: is_causal's, query i's diagonal at
    key i + coff) as (blocked, added, why_blocked, why_added):
    blocked is a bool array broadcastable to (B, H, Sq, Sk) or None, added a
    float array of dtype broadcastable likewise or None, and the two lists
    say in words where they came from."""
    blocked, added = None, None
    why_blocked, why_added = [], []

    def block(m, why):
        nonlocal blocked
        blocked = m if blocked is None else (blocked | m)
        why_blocked.append(why)

    def add(m, why):
        nonlocal added
        m = m.astype(dtype)
        added = m if added is None else (added + m)
        why_added.append(why)

    if mask is not None:
        m = _as_mask(mask) != 0                         # 1 / True = blocked
        m = np.broadcast_to(m, (H, Sq, Sk) if unbatched else (B, H, Sq, Sk))
        block(m[None] if unbatched else m, "mask = 1")

    am = kwargs.get("attn_mask")
    if am is not None:
        am = _as_mask(am)
        if am.ndim == 2:                                # (Sq, Sk)
            am = am[None, None]
        elif unbatched:                                 # (H, Sq, Sk)
            am = am[None]
        else:                                           # (B·H, Sq, Sk)
            am = am.reshape(B, H, Sq, Sk)
        if am.dtype == np.bool_:
            block(am, "attn_mask")
        else:
            add(am, "attn_mask")

    kpm = kwargs.get("key_padding_mask")
    if kpm is not None:
        kpm = _as_mask(kpm).reshape(1 if unbatched else B, 1, 1, Sk)
        if kpm.dtype == np.bool_:
            block(kpm, "key_padding_mask")
        else:
            add(kpm, "key_padding_mask")

    def at(k):                                          # "i + k", signs folded
        return "i" if k == 0 else f"i + {k}" if k > 0 else f"i − {-k}"
    where = at(coff)
    if causal:
        tri = np.triu(np.ones((Sq, Sk), dtype=bool), k=1 + coff)[None, None]
        block(tri, f"j > {where} (causal" + (", lower right)" if coff else ")"))

    window = sliding_window(kwargs.get("window"))
    if window is not None:
        left, right = window
        d = np.arange(Sk)[None, :] - np.arange(Sq)[:, None] - coff   # j - (i + coff)
        out = np.zeros((Sq, Sk), dtype=bool)
        words = []
        if left is not None:
            out |= d < -left
            words.append(f"j < {at(coff - left)}")
        if right is not None:
            out |= d > right
            words.append(f"j > {at(coff + right)}")
        block(out[None, None], " or ".join(words) + " (window)")

    lay = kwargs.get("layout")
    if lay is not None:
        keep = block_layout(lay, 1 if unbatched else B, H, Sq, Sk)[0]
        dense = ~lay.to_dense(Sq, Sk)                       # True = blocked
        block(dense.reshape((1,) * (4 - dense.ndim) + dense.shape),
              f"block (i // {lay.q_block}, j // {lay.k_block}) not kept (layout "
              f"{keep.shape[-2]}×{keep.shape[-1]} blocks of {lay.q_block}×{lay.k_block}, "
              f"density {lay.density:.2f})")

    return blocked, added, why_blocked, why_added
