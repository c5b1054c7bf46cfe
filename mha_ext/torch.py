"""mha_ext.torch: our attention as a torch.nn.Module, trainable with torch.

Two classes, a context manager and a function:

  MultiheadAttention   torch.nn.MultiheadAttention's exact surface (torch's
                       spelling, lowercase h), a drop-in inside
                       nn.Transformer* models (see mha_ext._torch_mha)
  MultiHeadAttention   mha_ext.MultiHeadAttention's surface (below)
  swapped(model)       every nn.MultiheadAttention of a model computed by
                       mha_ext inside a with-block (see mha_ext._swap)
  multi_head_attention_forward
                       torch.nn.functional.multi_head_attention_forward's
                       twin, for code calling torch's functional itself
                       (see mha_ext._torch_functional)

    from mha_ext.torch import MultiHeadAttention
    attn = MultiHeadAttention(64, 4, dropout=0.1, seed=0)
    out, weights = attn(x)                  # x a (B, S, 64) CPU tensor
    out.sum().backward()                    # gradients from our C backward
    torch.optim.Adam(attn.parameters())     # torch's optimisers just work

The parameters are torch ``nn.Linear`` children ``W_q``, ``W_k``, ``W_v``,
``W_o`` (the seed module's names, so ``state_dict()`` keys match
mha_ext.MultiHeadAttention's), used as parameter holders: the computation is
a ``torch.autograd.Function`` whose forward is mha_ext's forward_train and
whose backward is mha_ext's backward, both in C on mha_ext's thread pool.
CPU tensors of float32 or float64 only; calls are batch-first, like
mha_ext.MultiHeadAttention's.  Double backward is not supported: differentiating
a gradient computed with create_graph=True raises a RuntimeError.

This module is imported only on request (``import mha_ext.torch``); it needs
torch.  Inside it ``import torch`` is the real torch (absolute imports).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, NoReturn

if __name__ == "torch":  # this file, found as torch itself: see the message
    import os as _os
    raise ImportError(
        "torch is hidden by mha_ext's own torch.py: Python was started in mha_ext's package "
        "folder (%s), which then comes first on sys.path; start it in another folder (the "
        "repository root, say)" % _os.path.dirname(_os.path.abspath(__file__)), name="torch")

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

try:
    import torch
except ModuleNotFoundError as _exc:
    from ._need_torch import needs_torch
    needs_torch(_exc, "mha_ext.torch")
from torch import nn

from . import _habits
from ._convert import as_real, check_tensor, refuse_fx_proxies
from ._params import LINEARS
from ._torch_fn import attention_kept as _attention_kept
from ._torch_fn import COMPILE_REASON, refuse_mask_grads, refuse_script, refuse_transformed
from ._swap import swapped
from ._torch_functional import multi_head_attention_forward
from ._torch_mha import MultiheadAttention
from ._types import Causal, Flag, Int, MaskedRows, Real, Window
from .module import MultiHeadAttention as _Core

if TYPE_CHECKING:
    from .layout import BlockLayout

__all__ = ["MultiHeadAttention", "MultiheadAttention", "multi_head_attention_forward",
           "swapped"]

_DTYPES = {torch.float32: "float32", torch.float64: "float64"}


def _config(core: _Core) -> dict[str, Any]:
    """What rebuilds `core` (_built): its configuration, dropout and seed."""
    return dict(d_model=core.d_model, n_heads=core.n_heads, dropout=core.dropout,
                bias=core.bias, kdim=core.kdim, vdim=core.vdim, dtype=core.dtype.name,
                seed=core.seed, n_kv_heads=core.n_kv_heads)


def _built(config: dict[str, Any]) -> _Core:
    """A core of that configuration whose parameters are never initialised
    nor touched (next to no memory: each call passes the module's own).  In
    eval mode for good: each call passes its dropout (the module's training
    flag decides), so the core's own never applies."""
    return _Core.__new__(_Core, **config, _empty=True).eval()


def _refuse_mixed_dtypes(module: nn.Module, params: list[Any], inputs: tuple[Any, ...]) -> None:
    """torch's nn.Linear computes in one dtype: a parameter of another dtype
    than the module's others (the most common one; W_q.weight's on a tie) is
    torch's RuntimeError here too, not converted (other numbers than torch,
    which has none).  Taken as nn.Linear takes it: a W_q / W_k / W_v bias
    whose input is a 3-D tensor that is not contiguous (added with add_,
    which takes another dtype, not with addmm).  params: module._params();
    inputs: query, key, value (key and value defaulted)"""
    if all(getattr(p, "dtype", None) == params[0].dtype for p in params):
        return
    from ._torch_errors import TypeErrorAndRuntimeError, linear_adds_bias
    named: list[tuple[str, torch.Tensor]] = []
    for n, x in zip(LINEARS, (*inputs, None)):
        for a in ("weight", "bias"):
            p = getattr(getattr(module, n), a, None)
            if isinstance(p, torch.Tensor) and not (a == "bias" and linear_adds_bias(x)):
                named.append((f"{n}.{a}", p))
    dtypes = [p.dtype for _, p in named]
    dtype = max(dtypes, key=lambda d: (dtypes.count(d), d == dtypes[0]))
    for name, p in named:
        if p.dtype != dtype:
            raise TypeErrorAndRuntimeError(
                f"{name} is {p.dtype} but the module's other parameters are {dtype}: torch's "
                f"nn.Linear computes in one dtype and raises a RuntimeError here; cast the "
                f"parameter or the module (module.to({dtype}))")


class MultiHeadAttention(nn.Module):
    """Multi-head attention computed by mha_ext's C core, forward and
    backward, as a torch module.

    MultiHeadAttention(d_model, n_heads, dropout=0.0, *, bias=True, kdim=None,
                       vdim=None, dtype=torch.float32, seed=None, n_kv_heads=None)

    Arguments as mha_ext.MultiHeadAttention's (n_kv_heads: grouped-query
    attention, W_k and W_v then nn.Linear(in, n_kv_heads * d_k)); ``dtype`` may be a torch or
    NumPy dtype or its name.  ``seed`` fixes the initialisation (the same
    numbers as mha_ext.MultiHeadAttention with that seed) and the dropout
    stream; each training call draws its place in that stream from torch's
    default generator, as torch's dropout draws its mask, so that
    torch.manual_seed repeats a run and torch.utils.checkpoint recomputes
    the same mask.  Dropout is active in training mode (``train()``, the
    default), like torch's modules.

    forward(query, key=None, value=None, mask=None, *, attn_mask=None,
            key_padding_mask=None, is_causal=False, need_weights=True,
            average_weights=False, masked_rows="nan", scale=None, window=None,
            head_mask=None, layout=None) -> (output, weights)
    as mha_ext.MultiHeadAttention's call (is_causal True or "lower_right",
    scale None or a number, window None or a sliding window (left, right),
    head_mask None or (H,) / (B, H) factors (a tensor that requires grad
    gets dL/d head_mask), layout None or a
    mha_ext.layout.BlockLayout), on (B, S, E) or (S, E) CPU tensors;
    weights is None with need_weights=False.  The parameters share one
    dtype, the module's: one of another dtype is refused (a TypeError that
    is also torch's RuntimeError, as the seed module's nn.Linear raises;
    a W_q / W_k / W_v bias is taken where nn.Linear takes it, on a 3-D
    input that is not contiguous), except under CPU autocast.  Gradients flow to query, key,
    value, every parameter and a float attn_mask or key_padding_mask that
    requires grad (``mask``, 0/1 blocking, has none: a ValueError then).
    """

    def __init__(self, d_model: Int, n_heads: Int, dropout: Real = 0.0, *, bias: Flag = True,
                 kdim: Int | None = None, vdim: Int | None = None,
                 dtype: torch.dtype | DTypeLike = torch.float32, seed: Int | None = None,
                 n_kv_heads: Int | None = None) -> None:
        super().__init__()
        np_dtype: DTypeLike
        if isinstance(dtype, torch.dtype):
            if dtype not in _DTYPES:
                raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
            np_dtype = _DTYPES[dtype]
        else:
            np_dtype = dtype
        # the initialisation of the NumPy module with this seed, copied into
        # torch's Linears; then a core holding no parameters of its own
        core = _Core(d_model, n_heads, dropout, bias=bias, kdim=kdim, vdim=vdim,
                     dtype=np_dtype, seed=seed, n_kv_heads=n_kv_heads)
        self._core = _built(_config(core))
        tdtype = torch.float64 if core.dtype == np.float64 else torch.float32
        ins = (core.d_model, core.kdim, core.vdim, core.d_model)
        ekv = core.n_kv_heads * core.d_k
        outs = (core.d_model, ekv, ekv, core.d_model)
        state = core.state_dict()
        for name, fan_in, fan_out in zip(LINEARS, ins, outs):
            lin = nn.Linear(fan_in, fan_out, bias=core.bias, dtype=tdtype)
            with torch.no_grad():
                lin.weight.copy_(torch.from_numpy(state[f"{name}.weight"]))
                if core.bias:
                    lin.bias.copy_(torch.from_numpy(state[f"{name}.bias"]))
            setattr(self, name, lin)

    # the configuration, read from the core
    @property
    def d_model(self) -> int:
        """The model width E (the query's last axis and the output's)."""
        return self._core.d_model

    @property
    def n_heads(self) -> int:
        """The number of query heads H (d_k = d_model // n_heads each)."""
        return self._core.n_heads

    @property
    def n_kv_heads(self) -> int:
        """The number of key/value heads (n_heads unless grouped-query attention)."""
        return self._core.n_kv_heads

    @property
    def kdim(self) -> int:
        """The width of the key input (d_model unless given)."""
        return self._core.kdim

    @property
    def vdim(self) -> int:
        """The width of the value input (d_model unless given)."""
        return self._core.vdim

    @property
    def dropout(self) -> float:
        """Dropout probability on the attention weights (training mode)."""
        return self._core.dropout

    @dropout.setter
    def dropout(self, p: Real) -> None:
        self._core.dropout = p

    def extra_repr(self) -> str:
        """The configuration in print(module): d_model, n_heads, dropout and
        kdim, vdim, n_kv_heads where they differ from the defaults."""
        c = self._core
        s = f"d_model={c.d_model}, n_heads={c.n_heads}, dropout={c.dropout!r}"
        if c.kdim != c.d_model:
            s += f", kdim={c.kdim}"
        if c.vdim != c.d_model:
            s += f", vdim={c.vdim}"
        if c.n_kv_heads != c.n_heads:
            s += f", n_kv_heads={c.n_kv_heads}"
        return s

    def _params(self):
        out = []
        for name in LINEARS:
            lin = getattr(self, name)
            out.append(lin.weight)
            if lin.bias is not None:
                out.append(lin.bias)
        return out

    def _core_for(self, dtype):
        """The C module for parameters of dtype (rebuilt after .double() or
        .float(), keeping the seed)."""
        core = self._core
        want = _DTYPES.get(dtype)
        if want is None:
            raise TypeError(f"parameters must be float32 or float64, got {dtype}")
        if core.dtype != np.dtype(want):
            self._core = core = _built(dict(_config(core), dtype=want))
        return core

    def __getstate__(self) -> dict[str, Any]:
        """pickle, copy.deepcopy, torch.save: the core's configuration instead
        of the core (whose parameters are never read: the calls pass this
        module's), so that a copy holds the parameters once."""
        state = super().__getstate__()
        state["_core"] = _config(state["_core"])
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        if isinstance(state["_core"], dict):
            state["_core"] = _built(state["_core"])
        super().__setstate__(state)

    def __prepare_scriptable__(self):
        """torch.jit.script's first step on each module: refused (see
        _torch_fn.refuse_script)."""
        refuse_script("MultiHeadAttention")

    def forward(self, query: torch.Tensor | ArrayLike, key: torch.Tensor | ArrayLike | None = None,
                value: torch.Tensor | ArrayLike | None = None,
                mask: torch.Tensor | ArrayLike | None = None, *,
                attn_mask: torch.Tensor | ArrayLike | None = None,
                key_padding_mask: torch.Tensor | ArrayLike | None = None,
                is_causal: Causal = False, need_weights: Flag = True,
                average_weights: Flag = False, masked_rows: MaskedRows = "nan",
                scale: Real | None = None, window: Window = None,
                head_mask: torch.Tensor | ArrayLike | None = None,
                layout: BlockLayout | None = None,
                **unknown: NoReturn,  # none taken: checkers flag a misspelt keyword
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention of query over key and value: (output, weights), as
        mha_ext.MultiHeadAttention's call (see the class docstring), on
        (B, S, E) or (S, E) CPU tensors (arrays are converted), differentiable
        through mha_ext's C backward.  key defaults to query, value to key;
        weights is None with need_weights=False."""
        if unknown:  # torch's names (average_attn_weights, ...) named with ours
            _habits.call_keywords(unknown, "forward")
        refuse_fx_proxies(query, key, value, mask, attn_mask, key_padding_mask, head_mask)
        # a torch.func transform's tensors refused as given, by name: converted
        # below, every input would be the transform's (naming query for key)
        refuse_transformed({"mask": mask, "attn_mask": attn_mask,
                            "key_padding_mask": key_padding_mask, "head_mask": head_mask},
                           (query, key, value))
        params = self._params()
        if not torch.is_autocast_enabled("cpu"):  # autocast: the call computes in dtype
            k = query if key is None else key
            _refuse_mixed_dtypes(self, params, (query, k, k if value is None else value))
        dtype = params[0].dtype
        core = self._core_for(dtype)
        key = query if key is None else key
        value = key if value is None else value
        tensors = []
        for name, x in (("query", query), ("key", key), ("value", value)):
            if isinstance(x, torch.Tensor):
                check_tensor(x, name)   # dense, with data
                # torch's module refuses another dtype (its linear's RuntimeError);
                # arrays are converted, as the NumPy class converts them; under
                # CPU autocast the call computes in the parameters' dtype
                if x.dtype != dtype and not x.is_complex() \
                        and not torch.is_autocast_enabled("cpu"):
                    from ._torch_errors import TypeErrorAndRuntimeError
                    raise TypeErrorAndRuntimeError(
                        f"{name} is {x.dtype} but the parameters are {dtype}: torch's module "
                        f"computes in one dtype and raises a RuntimeError here; cast the "
                        f"input (x.to({dtype})) or the module (module.to({dtype}))")
            else:
                x = torch.as_tensor(as_real(x, name))
            if x.device.type != "cpu":
                raise ValueError(f"{name} must be a CPU tensor, got device {x.device}")
            if x.is_complex():
                raise TypeError(f"{name} must hold real numbers, got {x.dtype}")
            tensors.append(x.to(dtype))
        for p in params:
            if p.device.type != "cpu":
                raise ValueError(f"parameters must be on the CPU, got device {p.device}")
        refuse_mask_grads(mask=mask)
        opts = dict(mask=mask, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                    is_causal=is_causal, need_weights=need_weights,
                    average_weights=average_weights, masked_rows=masked_rows,
                    dropout=core.dropout if self.training else 0.0, scale=scale,
                    window=window, head_mask=head_mask, layout=layout)
        extra = []
        if isinstance(head_mask, torch.Tensor) and head_mask.requires_grad:
            # a head mask that requires grad: an input of the Function, which
            # returns dL/d head_mask
            opts.update(head_mask=head_mask.detach(), head_mask_input=True)
            extra = [head_mask]
        query, key, value = tensors
        out, weights = _attention_kept(self, core, opts, query, key, value, params,
                                       lambda: params + extra)
        return out, (weights if need_weights else None)

    if not TYPE_CHECKING:  # torch.compile calls it as it is (the drop-in's forward says why)
        forward = torch.compiler.disable(forward, reason=COMPILE_REASON)
