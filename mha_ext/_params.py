"""Parameter keys and the block layout, the one home for them.

The C type keeps all parameters in one flat block (src/mha.h,
mha_param_layout): W_q.weight, W_q.bias, W_k.weight, ... W_o.bias, bias_k,
bias_v, tensor i at ``mha._layout()[i] = (offset, size)`` (size 0 for the
biases of a module built with bias=False, and for bias_k and bias_v unless
add_bias_kv=True).  This module names those tensors (the seed module's
keys, torch.nn.MultiheadAttention's packed and separate keys and which block
tensors each one stacks) and converts between state dicts and blocks.

Legend: E = d_model; tensor i < 8 is a weight (out, fan_in) for even i, a
bias (out,) for odd i, out = E for W_q and W_o and Ekv = n_kv_heads * d_k
for W_k and W_v (E unless grouped-query attention); tensors 8 and 9
(bias_k, bias_v) are (Ekv,) (torch keeps them as (1, 1, E): either shape
loads).
"""
from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from ._convert import as_real, flag

__all__ = ["kv_width", "LINEARS", "SEED_KEYS", "BIAS_KV", "BLOCK_KEYS", "TORCH_PACKED",
           "TORCH_SEPARATE", "TORCH_KEYS", "TORCH_PARTS", "TORCH_UNSUPPORTED", "IncompatibleKeys",
           "seed_keys", "shape", "tensor", "state_dict", "load_block", "params_block", "grads",
           "Parts", "parts", "groups", "unpacked", "kv_tail", "widen_empty"]

# the four projections, in the order of the C block
LINEARS = ("W_q", "W_k", "W_v", "W_o")
# the seed module's parameter names: the four projections, in block order
SEED_KEYS = tuple(f"{n}.{part}" for n in LINEARS for part in ("weight", "bias"))
# the extra key/value of add_bias_kv, as torch names them
BIAS_KV = ("bias_k", "bias_v")
# every tensor of the C block, in its order (src/mha.h, mha_param_layout)
BLOCK_KEYS = SEED_KEYS + BIAS_KV

# torch.nn.MultiheadAttention's keys: packed (kdim == vdim == d_model) or separate
TORCH_PACKED = ("in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias")
TORCH_SEPARATE = ("q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias",
                  "out_proj.weight", "out_proj.bias")
TORCH_KEYS = frozenset(TORCH_PACKED + TORCH_SEPARATE)
# torch key -> the block tensors it stacks along its first axis
TORCH_PARTS = {"in_proj_weight": (0, 2, 4), "in_proj_bias": (1, 3, 5),
               "q_proj_weight": (0,), "k_proj_weight": (2,), "v_proj_weight": (4,),
               "out_proj.weight": (6,), "out_proj.bias": (7,), "bias_k": (8,), "bias_v": (9,)}
# torch keys of options a module may lack -> the option (bias_k, bias_v need
# a module built with it)
TORCH_UNSUPPORTED = {"bias_k": "add_bias_kv=True", "bias_v": "add_bias_kv=True"}

def kv_tail(bias_k, bias_v):
    """The last parameters of a call, torch's classes' (their _params and
    _packed): bias_k, bias_v (tensors or arrays) as (Ekv,) vectors; none
    without them."""
    return [] if bias_k is None else [bias_k.reshape(-1), bias_v.reshape(-1)]


def widen_empty(k, v, sources, kdim, vdim):
    """The key and value tensors of a call of torch's classes and their
    sources (_torch_mha's _sources() order) as the C core takes them when
    kdim or vdim is 0 (torch's module takes them, and projects a key (S, 0)
    to its bias alone, bias + key @ k_proj_weight.T being a sum of no
    terms): the C core takes widths >= 1, so the empty key (value) and
    k_proj_weight (v_proj_weight) get one zero column each, which adds 0
    to the bias, torch's numbers; the gradients reach the caller's empty
    tensors through the pads.  Unchanged otherwise."""
    if kdim and vdim:
        return k, v, sources
    pad = sys.modules["torch"].nn.functional.pad  # (tensors: torch is imported)
    in_w, q_w, k_w, v_w, *rest = sources
    for name, x, dim in (("key", k, kdim), ("value", v, vdim)):
        if dim == 0 and x.shape[-1] != 0:  # (padded, it would be refused as 1 wide)
            raise ValueError(f"{name} must be 0 wide ({name[0]}dim = 0), got "
                             f"{x.shape[-1]} wide")
    if kdim == 0:
        k, k_w = pad(k, (0, 1)), pad(k_w, (0, 1))
    if vdim == 0:
        v, v_w = pad(v, (0, 1)), pad(v_w, (0, 1))
    return k, v, (in_w, q_w, k_w, v_w, *rest)


class IncompatibleKeys(NamedTuple):
    """What load_state_dict returns, as torch's: (missing_keys, unexpected_keys)."""
    missing_keys: list[str]
    unexpected_keys: list[str]


def seed_keys(mha):
    """The seed keys this module has (no bias keys with bias=False; bias_k
    and bias_v only with add_bias_kv=True)."""
    layout = mha._layout()
    return tuple(k for i, k in enumerate(BLOCK_KEYS) if layout[i][1] != 0)


def kv_width(mha):
    """Ekv = n_kv_heads * d_k: the output width of W_k and W_v (d_model
    unless grouped-query attention)."""
    return mha.n_kv_heads * mha.d_k


def shape(mha, i):
    """The shape of block tensor i: (out, fan_in) for a weight, (out,) for a
    bias, bias_k or bias_v; out = Ekv for W_k, W_v, bias_k and bias_v."""
    out = kv_width(mha) if 2 <= i < 6 or i >= 8 else mha.d_model
    if i % 2 == 1 or i >= 8:
        return (out,)
    return (out, (mha.d_model, mha.kdim, mha.vdim, mha.d_model)[i // 2])


def tensor(mha, i, block=None):
    """Block tensor i as a view of `block` (default: the module's live
    memory), shaped; None for an absent bias."""
    offset, size = mha._layout()[i]
    if size == 0:
        return None
    flat = (mha._block() if block is None else block)[offset:offset + size]
    return flat.reshape(shape(mha, i))


def state_dict(mha):
    """A dict of NumPy copies under the seed keys: views of one snapshot of
    the parameters (a new array, taken atomically for load_state_dict and
    editing() in other threads), each its own part of it."""
    block = mha._snapshot()
    return {k: tensor(mha, BLOCK_KEYS.index(k), block) for k in seed_keys(mha)}


def _torch_layout(mha, state):
    """The keys torch.nn.MultiheadAttention would have for this module, given
    which of its layouts `state` uses."""
    E = mha.d_model
    same = mha.kdim == E and mha.vdim == E
    separate = any(k in state for k in ("q_proj_weight", "k_proj_weight", "v_proj_weight"))
    if "in_proj_weight" in state and not same:
        raise ValueError(
            f"state_dict['in_proj_weight'] is torch's packed layout, which needs "
            f"kdim == vdim == d_model; this module has d_model={E}, kdim={mha.kdim}, "
            f"vdim={mha.vdim}, so torch stores 'q_proj_weight' ({E}, {E}), "
            f"'k_proj_weight' ({E}, {mha.kdim}) and 'v_proj_weight' ({E}, {mha.vdim})")
    if "in_proj_weight" in state or (same and not separate):
        keys = TORCH_PACKED
    else:
        keys = TORCH_SEPARATE
    if not mha.bias:
        keys = [k for k in keys if not k.endswith("_bias") and not k.endswith(".bias")]
    if mha.add_bias_kv:
        keys = list(keys) + list(BIAS_KV)
    return tuple(keys)


def load_block(mha, state, strict=True):
    """The new block for load_state_dict: a copy of the module's block with
    the values of `state` (seed or torch keys) written in, and
    IncompatibleKeys(missing, unexpected).  Nothing of the module changes."""
    if not isinstance(state, Mapping):
        raise TypeError(f"state_dict must be a mapping of names to arrays, "
                        f"not {type(state).__name__}")
    strict = flag(strict, "strict")
    for k, option in TORCH_UNSUPPORTED.items():
        if k in state and not mha.add_bias_kv:
            raise ValueError(f"state_dict has {k!r} (torch.nn.MultiheadAttention with "
                             f"{option}), but this module was built without add_bias_kv: "
                             f"build it with {option}")
    ours = seed_keys(mha)
    # bias_k and bias_v are in both layouts: the other keys tell which it is
    if (any(k in TORCH_KEYS for k in state)
            and not any(k in ours and k not in BIAS_KV for k in state)):
        if mha.n_kv_heads != mha.n_heads:
            raise ValueError(f"state_dict has torch.nn.MultiheadAttention's keys, which has "
                             f"no grouped-query attention; this module has n_kv_heads="
                             f"{mha.n_kv_heads} < n_heads={mha.n_heads}: use its own keys "
                             f"(state_dict())")
        keys, parts = _torch_layout(mha, state), TORCH_PARTS
    else:
        keys, parts = ours, {k: (BLOCK_KEYS.index(k),) for k in ours}
    missing = [k for k in keys if k not in state]
    unexpected = [k for k in state if k not in keys]
    if strict and missing:
        raise KeyError(f"state_dict is missing {missing[0]!r} "
                       f"(expected keys: {', '.join(keys)})")
    if strict and unexpected:
        raise KeyError(f"state_dict has an unexpected key {unexpected[0]!r} "
                       f"(expected keys: {', '.join(keys)})")
    block = np.array(mha._block(), copy=True)
    layout = mha._layout()
    for k in keys:
        if k not in state:
            continue
        value = as_real(state[k], f"state_dict[{k!r}]")
        # a key holds one tensor, or several stacked along the first axis
        shapes = [shape(mha, i) for i in parts[k]]
        want = (sum(sh[0] for sh in shapes),) + shapes[0][1:]
        if k in BIAS_KV and value.shape == (1, 1, kv_width(mha)):  # torch's shape
            value = value.reshape(-1)
        if value.shape != want:
            raise ValueError(f"state_dict[{k!r}] must have shape {want}, got {value.shape}")
        row = 0
        for i, sh in zip(parts[k], shapes):
            offset, size = layout[i]
            block[offset:offset + size] = value[row:row + sh[0]].reshape(-1)
            row += sh[0]
    return block, IncompatibleKeys(missing, unexpected)


class Parts(tuple):
    """The parameters as one array per block tensor, in the block's order,
    None where the layout has none: the C call reads each in place (no block
    is assembled; a training forward copies them as its projections read
    them).  The torch classes' path (_torch_fn)."""

    __slots__ = ()


def parts(mha, arrays):
    """Parts from the module's tensors in block order (those of seed_keys)."""
    layout = mha._layout()
    it = iter(arrays)
    return Parts(next(it) if layout[i][1] != 0 else None for i in range(len(BLOCK_KEYS)))


def params_block(mha, params):
    """The flat parameter block (a private copy) from forward_train's
    params=: a mapping with every seed key or a 1-D block; None (the
    module's parameters) stays None: the forward copies those itself, under
    the module's lock; Parts stay as they are."""
    if params is None or isinstance(params, Parts):
        return params
    block = np.array(mha._block(), copy=True)
    layout = mha._layout()
    if isinstance(params, Mapping):
        for i, k in enumerate(BLOCK_KEYS):
            offset, size = layout[i]
            if size == 0:
                continue
            if k not in params:
                raise KeyError(f"params is missing {k!r}")
            value = as_real(params[k], f"params[{k!r}]")
            want = shape(mha, i)
            if k in BIAS_KV and value.shape == (1, 1, kv_width(mha)):  # torch's shape
                value = value.reshape(-1)
            if value.shape != want:
                raise ValueError(f"params[{k!r}] must have shape {want}, got {value.shape}")
            block[offset:offset + size] = value.reshape(-1)
        return block
    value = as_real(params, "params")
    if value.shape != block.shape:
        raise ValueError(f"params must be a mapping like state_dict() or a 1-D block of "
                         f"{block.size} scalars, got shape {value.shape}")
    block[...] = value
    return block


def grads(mha, block):
    """A gradient block as a dict under the seed keys (views of `block`)."""
    layout = mha._layout()
    return {k: tensor(mha, i, block) for i, k in enumerate(BLOCK_KEYS) if layout[i][1] != 0}


def groups(mha, packed):
    """The block tensors (seed keys) each parameter of the torch autograd
    Function (mha_ext._torch_fn.AttentionFunction) stands for, in its
    order: one each, or with `packed` torch's packed tensors (TORCH_PACKED,
    then bias_k, bias_v), in_proj's stacking three; those mha's block has."""
    keys = seed_keys(mha)
    if not packed:
        return [(k,) for k in keys]
    stacks = (tuple(BLOCK_KEYS[i] for i in TORCH_PARTS[k]) for k in TORCH_PACKED + BIAS_KV)
    return [g for g in stacks if g[0] in keys]


def unpacked(mha, groups, arrays):
    """The block's arrays (seed_keys order) from arrays of the tensors
    `groups` names: one that stacks several split along its first axis
    (views)."""
    block = {}
    for group, a in zip(groups, arrays):
        n = a.shape[0] // len(group) if a.ndim else 0
        block.update(zip(group, [a] if len(group) == 1 else
                         [a[i * n:(i + 1) * n] for i in range(len(group))]))
    return [block[k] for k in seed_keys(mha)]
