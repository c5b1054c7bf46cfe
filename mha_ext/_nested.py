"""A nested query of mha_ext.torch.MultiheadAttention (nn.TransformerEncoder's
sparsity path hands its layers one): taken where torch's own module takes
it, on its fast path, padded, attended with the padding ignored and
nested again; refused elsewhere as torch refuses it.

Legend: B batch, L query length (ragged), E = embed_dim.
"""
from __future__ import annotations

from typing import Any

import torch

from ._torch_errors import ValueErrorAndAssertionError


def forward_nested(module: Any, query: Any, key: Any, value: Any, key_padding_mask: Any,
                   need_weights: bool, attn_mask: Any, average_attn_weights: bool,
                   is_causal: Any, window: Any, layout: Any) -> tuple[Any, Any]:
    """module's forward on a nested (B, ragged L, E) query: self-attention
    without masks; its weights (need_weights=True) padded as torch's, 0 on
    the padding's rows and columns."""
    # (a jagged one is a tensor subclass: torch's fast path refuses it)
    if query.layout != torch.strided or \
            not module._torch_fast_path(query, key, value, attn_mask, key_padding_mask):
        raise ValueErrorAndAssertionError(
            "a nested tensor is taken only where torch's own module takes it, on its fast "
            "path: eval mode, no grad (or nothing requiring it), a 3-D batch-first "
            "self-attention call (query is key is value), an even num_heads, packed in_proj "
            "with biases, no bias_k, bias_v or add_zero_attn, no float mask, not a jagged "
            "layout")
    if window is not None or layout is not None or isinstance(is_causal, str):
        raise ValueError("window, layout and is_causal='lower_right' are not taken with a "
                         "nested query")
    # (the fast path is batch-first self-attention: masks alone are left)
    if key_padding_mask is not None or attn_mask is not None:
        raise ValueError("mha_ext.torch.MultiheadAttention takes a nested tensor only for "
                         "batch-first self-attention without masks (as nn.TransformerEncoder "
                         "passes it)")
    lengths = [t.shape[0] for t in query.unbind()]
    padded = query.to_padded_tensor(0.0)
    pad = torch.arange(padded.shape[1])[None, :] >= torch.tensor(lengths)[:, None]
    out, weights = module.forward(padded, padded, padded, key_padding_mask=pad,
                                  need_weights=need_weights,
                                  average_attn_weights=average_attn_weights)
    if weights is not None:
        rows = pad[:, :, None] if average_attn_weights else pad[:, None, :, None]
        weights = weights.masked_fill(rows, 0.0)
    return torch.nested.nested_tensor([o[:n] for o, n in zip(out, lengths)]), weights
