"""torch interop, the one home for it: MultiHeadAttention.from_torch for a
torch.nn.MultiheadAttention or a module with W_q/W_k/W_v/W_o linear
children (the seed notebook's layout), and the discovery of dtype, dropout
and training mode.

torch is never imported here: the torch module is read through its
attributes, its tensors converted by _convert.to_numpy.  The class to build
is passed in (``cls``), so this module does not import module.py.
"""
from __future__ import annotations

import numpy as np

from ._convert import to_numpy
from ._params import LINEARS

__all__ = ["from_torch"]


def from_torch(cls, module, dtype=None, seed=None):
    """A `cls` (a MultiHeadAttention class) holding a copy of `module`."""
    _check_materialised(module)
    if hasattr(module, "in_proj_weight") and hasattr(module, "out_proj"):
        return _from_torch_mha(cls, module, dtype, seed)
    if all(hasattr(module, n) for n in LINEARS):
        return _from_torch_seed(cls, module, dtype, seed)
    raise TypeError(f"from_torch expects a torch.nn.MultiheadAttention or a module with "
                    f"W_q, W_k, W_v, W_o linear children, not {type(module).__name__}")


def _check_materialised(module):
    # parameters on the meta device have a shape but no data to copy
    named = getattr(module, "named_parameters", None)
    if not callable(named):
        return
    for name, p in named():
        if getattr(getattr(p, "device", None), "type", None) == "meta":
            raise ValueError(
                f"from_torch: the parameters of this {type(module).__name__} are on the "
                f"meta device ({name!r} first), which holds shapes but no data; materialise "
                f"them first, e.g. module.to_empty(device='cpu') and then initialise them "
                f"(module.reset_parameters() or _reset_parameters()) or "
                f"module.load_state_dict(...), or build the module on the CPU")


def _dtype(tensor, dtype):
    # the dtype of the copy: given, or the module's when mha_ext computes in it
    if dtype is not None:
        return dtype
    name = str(tensor.dtype).replace("torch.", "")
    if name in ("float32", "float64"):
        return name
    raise ValueError(f"from_torch: the module's parameters are {name}; mha_ext computes "
                     f"in float32 or float64, so pass dtype='float32' or 'float64'")


def _dropout(module):
    p = getattr(module, "dropout", 0.0)
    p = getattr(p, "p", p)  # an nn.Dropout child, or a float
    if p is None:
        return 0.0
    return float(p)


def _from_torch_mha(cls, module, dtype, seed):
    # torch.nn.MultiheadAttention: packed in_proj_weight, or q/k/v_proj_weight
    if getattr(module, "bias_k", None) is not None or getattr(module, "bias_v", None) is not None:
        raise ValueError("from_torch: torch.nn.MultiheadAttention with add_bias_kv=True "
                         "is not supported (mha_ext has no learned extra key/value)")
    if getattr(module, "add_zero_attn", False):
        raise ValueError("from_torch: torch.nn.MultiheadAttention with add_zero_attn=True "
                         "is not supported (mha_ext adds no zero key/value)")
    E, H = int(module.embed_dim), int(module.num_heads)
    kdim, vdim = int(module.kdim), int(module.vdim)
    w_out = module.out_proj.weight
    in_bias, out_bias = module.in_proj_bias, module.out_proj.bias
    bias = in_bias is not None or out_bias is not None
    m = cls(E, H, _dropout(module), bias=bias, kdim=kdim, vdim=vdim,
            dtype=_dtype(w_out, dtype), seed=seed)
    if module.in_proj_weight is not None:
        w = to_numpy(module.in_proj_weight, "in_proj_weight")
        ws = (w[:E], w[E:2 * E], w[2 * E:])
    else:
        ws = tuple(to_numpy(getattr(module, f"{n}_proj_weight"), f"{n}_proj_weight")
                   for n in "qkv")
    state = {"W_q.weight": ws[0], "W_k.weight": ws[1], "W_v.weight": ws[2],
             "W_o.weight": to_numpy(w_out, "out_proj.weight")}
    if bias:
        b = np.zeros(3 * E) if in_bias is None else to_numpy(in_bias, "in_proj_bias")
        state.update({"W_q.bias": b[:E], "W_k.bias": b[E:2 * E], "W_v.bias": b[2 * E:],
                      "W_o.bias": np.zeros(E) if out_bias is None
                      else to_numpy(out_bias, "out_proj.bias")})
    m.load_state_dict(state)
    m.train(bool(module.training))
    return m


def _from_torch_seed(cls, module, dtype, seed):
    # the seed notebook's layout: W_q, W_k, W_v, W_o linear children
    lins = [getattr(module, n) for n in LINEARS]
    for n, lin in zip(LINEARS, lins):
        if getattr(lin, "weight", None) is None or getattr(lin.weight, "ndim", 0) != 2:
            raise TypeError(f"from_torch: {type(module).__name__}.{n} must be a linear "
                            f"layer with a 2-D .weight")
    E = int(lins[0].weight.shape[0])
    H = getattr(module, "n_heads", None) or getattr(module, "num_heads", None)
    if H is None:
        d_k = getattr(module, "d_k", None)
        if d_k is None:
            raise ValueError(f"from_torch: {type(module).__name__} has no n_heads, "
                             f"num_heads or d_k attribute, so the number of heads is unknown")
        H = E // int(d_k)
    biases = [getattr(lin, "bias", None) for lin in lins]
    bias = any(b is not None for b in biases)
    m = cls(E, int(H), _dropout(module), bias=bias,
            kdim=int(lins[1].weight.shape[1]), vdim=int(lins[2].weight.shape[1]),
            dtype=_dtype(lins[0].weight, dtype), seed=seed)
    state = {}
    for n, lin, b in zip(LINEARS, lins, biases):
        state[f"{n}.weight"] = to_numpy(lin.weight, f"{n}.weight")
        if bias:
            state[f"{n}.bias"] = np.zeros(E) if b is None else to_numpy(b, f"{n}.bias")
    m.load_state_dict(state)
    m.train(bool(module.training))
    return m
