"""Swapping mha_ext into a torch model: every torch.nn.MultiheadAttention
submodule replaced by an mha_ext.torch.MultiheadAttention that shares its
parameters (the same Parameter objects and out_proj), and put back after.

Because the parameters are shared, gradients computed inside the swap land
in the model's own parameters and an optimiser built on
``model.parameters()`` keeps working.
"""
from __future__ import annotations

import contextlib

from torch import nn

from ._torch_mha import MultiheadAttention

__all__ = ["attention_modules", "swap_in", "restore", "swapped", "sharing"]


def attention_modules(model):
    """[(qualified name, module)] of every stock nn.MultiheadAttention in
    model (the model itself included), in named_modules() order."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, nn.MultiheadAttention)]


def sharing(module):
    """An mha_ext.torch.MultiheadAttention computing with `module`'s own
    parameters (shared, not copied), add_bias_kv's bias_k / bias_v too."""
    ref = module.out_proj.weight
    new = MultiheadAttention(module.embed_dim, module.num_heads, module.dropout,
                             bias=module.in_proj_bias is not None,
                             add_bias_kv=module.bias_k is not None,
                             add_zero_attn=module.add_zero_attn, kdim=module.kdim,
                             vdim=module.vdim, batch_first=module.batch_first,
                             device="meta", dtype=ref.dtype)
    for name in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight",
                 "in_proj_bias", "bias_k", "bias_v"):
        setattr(new, name, getattr(module, name))
    new.out_proj = module.out_proj
    return new.train(module.training)


def _parent(model, name):
    parent = model
    *path, last = name.split(".")
    for part in path:
        parent = getattr(parent, part)
    return parent, last


def swap_in(model):
    """Replace every stock nn.MultiheadAttention below `model` by one of ours
    sharing its parameters; returns what restore() needs.  Raises (and
    changes nothing) if one of them cannot be swapped."""
    found = attention_modules(model)
    if any(name == "" for name, _ in found):
        raise TypeError("swap the attention module itself by "
                        "mha_ext.torch.MultiheadAttention.from_torch(module); swapped() "
                        "replaces attention modules inside a model")
    new = [(name, old, sharing(old)) for name, old in found]
    for name, old, ours in new:
        parent, last = _parent(model, name)
        setattr(parent, last, ours)
    return [(name, old) for name, old, _ in new]


def restore(model, record):
    """Put back the modules swap_in replaced."""
    for name, old in record:
        parent, last = _parent(model, name)
        setattr(parent, last, old)


@contextlib.contextmanager
def swapped(model):
    """``with mha_ext.torch.swapped(model): model(x)`` -- inside the block
    every torch.nn.MultiheadAttention of model is computed by mha_ext (the
    same parameters, shared); after it the original modules are back, also
    when the block raised.  Yields the model."""
    record = swap_in(model)
    try:
        yield model
    finally:
        restore(model, record)
