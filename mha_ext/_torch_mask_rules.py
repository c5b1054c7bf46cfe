"""torch's rules for nn.MultiheadAttention's masks that the drop-in
(_torch_mha.py) applies before it computes: the dtype and rank checks torch
makes of a mask it may then drop for the is_causal hint, and its
deprecation warning for masks of two dtypes."""
from __future__ import annotations

import warnings

import torch

__all__ = ["check_mask_dtype", "warn_mismatched_masks", "check_hint_mask_rank"]


def check_mask_dtype(mask, name):
    """torch's dtype rule for a mask tensor it may then drop (the is_causal
    hint): bool (True = blocked) or floating (added to the scores)."""
    if isinstance(mask, torch.Tensor) and mask.dtype != torch.bool \
            and not mask.is_floating_point():
        raise TypeError(f"{name} must be bool (True = blocked) or float (added to the "
                        f"scores), got dtype {mask.dtype}")


def warn_mismatched_masks(key_padding_mask, attn_mask):
    """torch's deprecation warning (its _canonical_mask) for a
    key_padding_mask and an attn_mask of different dtypes: the numbers are
    the same either way (both read as masks), the warning too."""
    # torch checks key_padding_mask's dtype first (an integer one: its
    # AssertionError, no warning), then compares attn_mask's, whatever it is
    if (isinstance(key_padding_mask, torch.Tensor) and isinstance(attn_mask, torch.Tensor)
            and (key_padding_mask.dtype == torch.bool or key_padding_mask.is_floating_point())
            and key_padding_mask.dtype != attn_mask.dtype):
        warnings.warn("Support for mismatched key_padding_mask and attn_mask is deprecated. "
                      "Use same type for both instead.", stacklevel=4)


def check_hint_mask_rank(mask, query, key, num_heads):
    """torch's rank rule for attn_mask (its _mha_shape_check), which it
    applies before dropping the mask for the is_causal hint: 2-D or 3-D,
    and an unbatched query's 3-D mask (num_heads, L, S)."""
    if not isinstance(mask, torch.Tensor):
        return
    if mask.dim() not in (2, 3):
        raise ValueError(f"attn_mask must be 2-D (L, S) or 3-D, got {mask.dim()}-D shape "
                         f"{tuple(mask.shape)} (it is checked before the is_causal hint "
                         f"replaces it)")
    if query.dim() == 2 and mask.dim() == 3:
        want = (num_heads, query.shape[0], key.shape[0])
        if tuple(mask.shape) != want:
            raise ValueError(f"attn_mask of an unbatched call must be 2-D or {want} "
                             f"(num_heads, L, S), got {tuple(mask.shape)}")
