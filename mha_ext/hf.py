"""mha_ext inside Hugging Face transformers models: the models' attention
computed by mha_ext.scaled_dot_product_attention (the C core, forward and
backward) in place of torch's SDPA.

    import mha_ext.hf
    mha_ext.hf.register()                       # once: the name "mha_ext"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="mha_ext")
    # or, for a model already built:  model.set_attn_implementation("mha_ext")

register() adds the attention function under the name "mha_ext" to
transformers' AttentionInterface, with the masks transformers builds for
its "sdpa" implementation (bool, True = attend: SDPA's polarity).  The
function follows transformers' own SDPA integration: grouped-query
attention without repeating K/V heads (enable_gqa), the module's scaling
(T5's 1.0 too), top-left is_causal when no mask is given, a position bias
added to the mask.  It needs transformers (tested with 5.23.0); nothing is
downloaded.

Legend: B batch, H heads, L query length, S key length, D head width.
"""
from __future__ import annotations

__all__ = ["NAME", "register", "attention_forward"]

NAME = "mha_ext"


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      is_causal=None, position_bias=None, **kwargs):
    """transformers' attention function signature: query (B, H, L, D), key,
    value (B, Hkv, S, D) -> (output (B, L, H, D), None)."""
    from ._sdpa_api import scaled_dot_product_attention

    if kwargs.get("softcap") is not None:
        raise ValueError("mha_ext attention does not support softcap")
    L = query.shape[2]
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    is_causal = bool(L > 1 and attention_mask is None and is_causal)
    mask = attention_mask
    if mask is not None and mask.shape[-1] != key.shape[2]:
        mask = mask[..., : key.shape[2]]
    if position_bias is not None:  # T5: a float bias added to the scores
        import torch

        S = key.shape[2]
        bias = position_bias[..., :S]
        if mask is None and is_causal:
            mask = torch.ones(L, S, dtype=torch.bool, device=query.device).tril()
            is_causal = False
        if mask is None:
            mask = bias
        elif mask.dtype == torch.bool:  # True = attend
            mask = bias.masked_fill(~mask, float("-inf"))
        else:
            mask = bias + mask
    out = scaled_dot_product_attention(query, key, value, attn_mask=mask,
                                       dropout_p=dropout if module.training else 0.0,
                                       is_causal=is_causal, scale=scaling,
                                       enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def register(name: str = NAME) -> str:
    """Register the attention function (and transformers' SDPA masks) under
    `name` (default "mha_ext"); returns the name for attn_implementation=."""
    from transformers import AttentionInterface
    try:
        from transformers import AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask
        AttentionMaskInterface.register(name, sdpa_mask)
    except ImportError:  # older transformers: the masks are chosen by name alone
        pass
    AttentionInterface.register(name, attention_forward)
    return name
