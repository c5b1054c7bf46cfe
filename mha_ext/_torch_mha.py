"""mha_ext.torch.MultiheadAttention: torch.nn.MultiheadAttention's exact
surface (constructor, attributes, parameters, state_dict keys, forward),
computed by mha_ext's C forward and backward.  It can be assigned into
nn.TransformerEncoderLayer / DecoderLayer / Encoder / Transformer.

torch's fused fast paths: nn.MultiheadAttention (in eval, without grad, on
batch-first self-attention) and nn.TransformerEncoderLayer (the same, whole
layer in one kernel, ``torch._transformer_encoder_layer_fwd``) would read
our parameters and compute with torch's kernels, bypassing our forward.
Every instance registers a no-op forward pre-hook: the layer's fast-path
check refuses modules with hooks, so the layer calls our forward, which
computes in mha_ext's C core.  nn.TransformerEncoder's nested-tensor path
(eval, no grad, a src_key_padding_mask) hands the layers nested tensors:
our forward pads them, attends with the padding as key_padding_mask and
returns a nested tensor again.  What torch's own path would give for a
query row that sees no key (NaN or out_proj.bias) is reproduced, also the
layer's fused kernel's NaN: its conditions are checked on the calling
layer, found on the call stack (see :meth:`forward`).

Legend: B batch, L query length, S key length, E = embed_dim, H = num_heads.
"""
from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn
from torch.nn.init import constant_, xavier_normal_, xavier_uniform_
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear
from torch.nn.parameter import Parameter

from . import _convert
from .module import MultiHeadAttention as _Core
from ._calls import causal as _causal
from ._habits import seq_first_shapes
from ._nested import forward_nested
from ._params import kv_tail, widen_empty
from ._torch_mask_rules import check_hint_mask_rank, check_mask_dtype, warn_mismatched_masks
from ._torch_errors import (TORCH_MHA, TypeErrorAndRuntimeError, ValueErrorAndRuntimeError,
                            metas, own_shapes, refuse_mixed_dtypes, torchs)
from ._torch_fn import (COMPILE_REASON, HALF, attention, attention_kept, holds,
                        refuse_script, refuse_transformed, register_our_pre_hook)
from ._types import Int, Window

if TYPE_CHECKING:
    from .layout import BlockLayout

__all__ = ["MultiheadAttention"]

_DTYPES = {torch.float32: "float32", torch.float64: "float64"}
# the C modules doing the work of every module and functional call (their
# parameters unused: each call passes its tensors), per configuration
# (made _empty: its parameter block is never touched, next to no memory and
# no initialisation; kept for the 64 configurations used last)
_CORES: OrderedDict[tuple[Any, ...], _Core] = OrderedDict()
_KEEP = 64
_LOCK = threading.Lock()  # calls from several threads share the dict


def _use_our_forward(module, args):
    """The forward pre-hook every instance carries (a no-op): with it,
    nn.TransformerEncoderLayer's fast-path check refuses the layer and calls
    our forward instead of torch's fused kernel."""


_SA_BLOCK = nn.TransformerEncoderLayer._sa_block.__code__


def _layer_would_fuse(layer, src):
    """nn.TransformerEncoderLayer.forward's fast-path conditions (torch
    2.13), with our own pre-hook not counted as a hook."""
    attn = layer.self_attn
    if not torch.backends.mha.get_fastpath_enabled() or src.dim() != 3 or layer.training:
        return False
    if not attn.batch_first or attn.in_proj_bias is None or not attn._qkv_same_embed_dim:
        return False
    if not layer.activation_relu_or_gelu or layer.norm1.eps != layer.norm2.eps:
        return False
    if attn.num_heads % 2 or torch.is_autocast_enabled():
        return False
    for m in layer.modules():
        hooks = list(getattr(m, "_forward_pre_hooks", {}).values())
        if m is attn:
            hooks = [h for h in hooks if h is not _use_our_forward]
        if hooks or getattr(m, "_forward_hooks", {}):
            return False
    tensors = (src, attn.in_proj_weight, attn.in_proj_bias, attn.out_proj.weight,
               attn.out_proj.bias, layer.norm1.weight, layer.norm1.bias, layer.norm2.weight,
               layer.norm2.bias, layer.linear1.weight, layer.linear1.bias,
               layer.linear2.weight, layer.linear2.bias)
    if any(t is None for t in tensors) or torch.overrides.has_torch_function(tensors):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


class MultiheadAttention(nn.MultiheadAttention):
    """torch.nn.MultiheadAttention, computed by mha_ext's C core.

    A subclass of torch's class, so that code choosing a branch by
    ``isinstance(m, nn.MultiheadAttention)`` (torch_geometric's GPSConv, for
    one) takes the same branch with it; its
    constructor, forward and initialisation are its own, torch's
    merge_masks (which nn.TransformerEncoderLayer's fused path calls) and
    __setstate__ (old checkpoints) are inherited.

    MultiheadAttention(embed_dim, num_heads, dropout=0.0, bias=True,
                       add_bias_kv=False, add_zero_attn=False, kdim=None,
                       vdim=None, batch_first=False, device=None, dtype=None)

    Arguments, attributes, parameters (in_proj_weight, or q_proj_weight /
    k_proj_weight / v_proj_weight when kdim or vdim differ; in_proj_bias;
    bias_k and bias_v (1, 1, E) with add_bias_kv=True; out_proj), their
    initialisation and the state_dict keys are torch's, so
    ``load_state_dict(torch_mha.state_dict())`` works both ways.
    add_bias_kv appends the learned key bias_k and value bias_v to every
    sequence's keys and values, add_zero_attn then a zero key and value,
    as torch does (the weights have S + 1 or S + 2 keys).  float32 and
    float64 on the CPU; kdim=0 or vdim=0 as torch's (_params.widen_empty).

    forward(query, key, value, key_padding_mask=None, need_weights=True,
            attn_mask=None, average_attn_weights=True, is_causal=False)
    as torch's (see :meth:`forward`); gradients come from mha_ext's C
    backward.  ``MultiheadAttention.from_torch(module)`` copies a torch one.
    """

    __constants__ = ["batch_first"]
    # the is_causal hint's attn_mask has its dtype checked before the causal
    # pattern replaces it, as torch's module does (its functional does not)
    _checks_hint_mask = True
    # None without add_bias_kv (declared: the constructor assigns either)
    bias_k: Parameter | None
    bias_v: Parameter | None

    def __init__(self, embed_dim: Int, num_heads: Int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False,
                 kdim: Int | None = None, vdim: Int | None = None, batch_first: bool = False,
                 device: torch.device | str | int | None = None,
                 dtype: torch.dtype | None = None) -> None:
        embed_dim = _convert.integer(embed_dim, "embed_dim")
        num_heads = _convert.integer(num_heads, "num_heads")
        if embed_dim % num_heads:
            raise torchs(ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads "
                                    f"({num_heads})"),
                         lambda: TORCH_MHA(embed_dim, num_heads, device="meta"))
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        nn.Module.__init__(self)  # not torch's constructor: the parameters are made below
        self.embed_dim = embed_dim
        # kdim or vdim 0 as torch's: the C core's 1 (_params.widen_empty)
        self.kdim = embed_dim if kdim is None else _convert.integer(kdim, "kdim", low=0)
        self.vdim = embed_dim if vdim is None else _convert.integer(vdim, "vdim", low=0)
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads
        if self._qkv_same_embed_dim:
            self.in_proj_weight = Parameter(torch.empty((3 * embed_dim, embed_dim), **factory))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = Parameter(torch.empty((embed_dim, embed_dim), **factory))
            self.k_proj_weight = Parameter(torch.empty((embed_dim, self.kdim), **factory))
            self.v_proj_weight = Parameter(torch.empty((embed_dim, self.vdim), **factory))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = Parameter(torch.empty(3 * embed_dim, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = NonDynamicallyQuantizableLinear(embed_dim, embed_dim, bias=bias,
                                                        **factory)
        if add_bias_kv:
            self.bias_k = Parameter(torch.empty((1, 1, embed_dim), **factory))
            self.bias_v = Parameter(torch.empty((1, 1, embed_dim), **factory))
        else:
            self.bias_k = self.bias_v = None
        self.add_zero_attn = bool(add_zero_attn)
        self._reset_parameters()
        self.register_forward_pre_hook(_use_our_forward)

    def _reset_parameters(self) -> None:
        """torch's initialisation: xavier_uniform_ projections, zero biases,
        xavier_normal_ bias_k and bias_v."""
        if self._qkv_same_embed_dim:
            xavier_uniform_(self.in_proj_weight)
        else:
            xavier_uniform_(self.q_proj_weight)
            xavier_uniform_(self.k_proj_weight)
            xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            constant_(self.in_proj_bias, 0.0)
            constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None:
            xavier_normal_(self.bias_k)
        if self.bias_v is not None:
            xavier_normal_(self.bias_v)

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention) -> MultiheadAttention:
        """A copy of a torch.nn.MultiheadAttention: the same configuration,
        dtype, device, training mode and parameter values (its own memory),
        add_bias_kv's bias_k / bias_v and add_zero_attn included."""
        if not isinstance(module, TORCH_MHA):
            raise TypeError(f"from_torch expects a torch.nn.MultiheadAttention, not "
                            f"{type(module).__name__}")
        if (module.bias_k is None) != (module.bias_v is None):
            raise ValueError("from_torch: the module has one of bias_k and bias_v but not the "
                             "other (torch's add_bias_kv sets both)")
        ref = module.out_proj.weight
        new = cls(module.embed_dim, module.num_heads, module.dropout,
                  bias=module.in_proj_bias is not None, add_bias_kv=module.bias_k is not None,
                  add_zero_attn=module.add_zero_attn, kdim=module.kdim, vdim=module.vdim,
                  batch_first=module.batch_first, device=ref.device, dtype=ref.dtype)
        new.load_state_dict(module.state_dict())
        return new.train(module.training)

    # ------------------------------------------------------------ the call
    def _core(self, dtype, extra=None):
        """The C module doing the work in `dtype` (its parameters unused: ours
        are passed to every call), made once per dtype and options.  extra:
        (add_bias_kv, add_zero_attn) of the core, default this module's."""
        name = _DTYPES.get(dtype)
        if name is None:
            raise TypeError(f"mha_ext computes in float32 or float64 (float16 and bfloat16 "
                            f"in float32); the parameters are {dtype}")
        if extra is None:
            extra = (holds(self, "bias_k"), bool(self.add_zero_attn))
        return self._core_for(name, extra)

    def _core_for(self, name, extra):
        """_core's module, shared by every module and functional call of its
        configuration (its parameters and dropout are never read: each call
        passes its own, and draws its dropout stream from torch's generator),
        so that no module carries one: a model's memory, torch.save, pickle
        and deepcopy hold the parameters once, as torch's do."""
        bias = self._has_bias()
        kdim, vdim = max(self.kdim, 1), max(self.vdim, 1)  # (0: see __init__)
        config = (self.embed_dim, self.num_heads, bias, kdim, vdim, name, extra)
        with _LOCK:
            core = _CORES.get(config)
            if core is not None:
                _CORES.move_to_end(config)  # used last: dropped last
                return core
        # seed 0: the dropout mask depends on torch's generator alone
        # (_torch_fn.torch_stream draws each call's), as torch's does
        core = _Core.__new__(_Core, self.embed_dim, self.num_heads, bias=bias,
                             kdim=kdim, vdim=vdim, dtype=name, seed=0,
                             add_bias_kv=extra[0], add_zero_attn=extra[1], _empty=True)
        with _LOCK:
            while len(_CORES) >= _KEEP:
                _CORES.popitem(last=False)
            return _CORES.setdefault(config, core)

    def __getstate__(self):
        # without our own pre-hook: a pickle (torch.save) then names nothing of
        # mha_ext but the class, so torch.load(weights_only=True) takes it with
        # the globals torch's module needs (the class, NonDynamicallyQuantizableLinear)
        state = super().__getstate__()
        hooks = state["_forward_pre_hooks"]
        if any(h is _use_our_forward for h in hooks.values()):
            state["_forward_pre_hooks"] = OrderedDict(
                (k, h) for k, h in hooks.items() if h is not _use_our_forward)
        return state

    def __setstate__(self, state):
        # checkpoints of earlier versions carried their cores: dropped
        state.pop("_cores", None)
        super().__setstate__(state)
        if not any(h is _use_our_forward for h in self._forward_pre_hooks.values()):
            register_our_pre_hook(self, _use_our_forward)

    def _has_bias(self):
        return holds(self, "in_proj_bias") or holds(self.out_proj, "bias")

    def _sources(self):
        """_params()'s tensors in _torch_errors.PARAMETERS' order (None where absent)."""
        out = self.out_proj
        return (self.in_proj_weight, self.q_proj_weight, self.k_proj_weight,
                self.v_proj_weight, self.in_proj_bias, out.weight, out.bias, self.bias_k,
                self.bias_v)

    def _params(self, sources=None):
        """[W_q.weight, W_q.bias, ... W_o.bias, then bias_k, bias_v with
        add_bias_kv] as views of our parameters (the C block's order), so
        that gradients reach the parameters; made from `sources` (those of
        _sources(), by default read now: a parametrized weight is computed
        once for both)."""
        in_w, q_w, k_w, v_w, in_b, out_w, out_b, bias_k, bias_v = \
            self._sources() if sources is None else sources
        E = self.embed_dim
        if self._qkv_same_embed_dim:
            ws = (in_w[:E], in_w[E:2 * E], in_w[2 * E:])
        else:
            ws = (q_w, k_w, v_w)
        ws = ws + (out_w,)
        kv = kv_tail(bias_k, bias_v)
        if in_b is None and out_b is None:
            return list(ws) + kv
        if in_b is None:
            in_b = torch.zeros(3 * E, dtype=out_w.dtype, device=out_w.device)
        if out_b is None:
            out_b = torch.zeros(E, dtype=out_w.dtype, device=out_w.device)
        bs = (in_b[:E], in_b[E:2 * E], in_b[2 * E:], out_b)
        return [t for pair in zip(ws, bs) for t in pair] + kv

    def _packed(self, sources):
        """The parameters as AttentionFunction's opts["packed"] takes them:
        in_proj_weight and in_proj_bias whole (split there as NumPy views),
        out_proj's weight and bias (the biases only if the module has them),
        then bias_k, bias_v.  _params' slices of in_proj_weight cost a zero
        (3E, E) tensor each in the backward, and their sum (a sixth of a
        training step at B 8, S 128, E 512).  None where the module does not
        hold them so (separate weights, one bias missing, another shape)."""
        in_w, _, _, _, in_b, out_w, out_b, bias_k, bias_v = sources
        E = self.embed_dim
        if not self._qkv_same_embed_dim or in_w is None or tuple(in_w.shape) != (3 * E, E) \
                or (in_b is None) != (out_b is None) \
                or (in_b is not None and tuple(in_b.shape) != (3 * E,)):
            return None
        kv = kv_tail(bias_k, bias_v)
        return ([in_w, out_w] if in_b is None else [in_w, in_b, out_w, out_b]) + kv

    def _torch_fast_path(self, query, key, value, attn_mask, key_padding_mask):
        """Whether torch.nn.MultiheadAttention would take its fused path for
        this call; that path gives NaN for a query that sees no key even
        with need_weights=False.  torch's conditions in torch's order, and
        checked on every call as torch's forward checks them: each read of
        a parametrized weight computes it (spectral_norm's power iteration
        in training), so this reads the parameters where torch's checks
        read them (their last read is _sources()', as torch's functional
        call's)."""
        floats = attn_mask is not None and torch.is_floating_point(attn_mask)
        # key_padding_mask asked also after a float attn_mask: torch's
        # _canonical_mask asks it next (a NumPy one is torch's TypeError)
        floats = (key_padding_mask is not None
                  and torch.is_floating_point(key_padding_mask)) or floats
        if not torch.backends.mha.get_fastpath_enabled() or query.dim() != 3:
            return False
        if query is not key or key is not value:
            return False
        if self.in_proj_bias is not None and query.dtype != self.in_proj_bias.dtype:
            return False
        if self.in_proj_weight is None or query.dtype != self.in_proj_weight.dtype:
            return False
        if self.training or self.num_heads % 2 or not self.batch_first:
            return False
        if self.bias_k is not None or self.bias_v is not None or self.add_zero_attn:
            return False
        if floats or not self._qkv_same_embed_dim or torch.is_autocast_enabled():
            return False
        args = (query, self.in_proj_weight, self.in_proj_bias, self.out_proj.weight,
                self.out_proj.bias)
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in args):
            return False
        return self.in_proj_bias is not None and self.in_proj_weight is not None

    def _in_fused_layer(self, query):
        """Whether an nn.TransformerEncoderLayer calling us (found on the call
        stack) would have run torch's fused layer kernel but for our hook;
        that kernel gives NaN for a query that sees no key."""
        frame = sys._getframe(1)
        for _ in range(16):  # (the layer's call, hooks, torch.compiler.disable's wrapper)
            frame = frame.f_back
            if frame is None:
                return False
            if frame.f_code is _SA_BLOCK:
                layer = frame.f_locals.get("self")
                return isinstance(layer, nn.TransformerEncoderLayer) \
                    and layer.self_attn is self and _layer_would_fuse(layer, query)
        return False

    def __prepare_scriptable__(self):
        """torch.jit.script's first step on each module: refused (see
        _torch_fn.refuse_script)."""
        refuse_script("MultiheadAttention")

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool | Literal["lower_right"] = False, *,
                window: Window = None, layout: BlockLayout | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """torch.nn.MultiheadAttention.forward, computed by mha_ext.

        query (L, B, E), key (S, B, kdim), value (S, B, vdim); (B, L, E) etc.
        with batch_first=True; unbatched (L, E), (S, kdim), (S, vdim).
        key_padding_mask (B, S) (unbatched (S,)): bool True = ignore that key,
        or float added.  attn_mask (L, S) or (B*H, L, S): bool True = blocked,
        or float added.  is_causal is torch's hint that attn_mask is the
        causal mask: it needs attn_mask (RuntimeError otherwise, as torch),
        and, as torch does, without key_padding_mask and with
        need_weights=False the causal pattern is applied instead of the mask
        (top-left over the keys with add_bias_kv's and add_zero_attn's
        appended: query i < S sees none of them, as torch's SDPA call).

        Returns (output shaped like query with width E, weights): weights are
        (B, L, S) averaged over heads (average_attn_weights=True, the
        default) or (B, H, L, S), None with need_weights=False.

        A query row that sees no key is NaN (output and weights) where torch
        takes its weights path (need_weights=True) or a fused path (this
        module's: eval, no grad, batch-first self-attention, bool or no
        masks; or, called from an nn.TransformerEncoderLayer, the layer's
        fused kernel, whose conditions are checked on the calling layer);
        on torch's SDPA path (need_weights=False otherwise) the row's output
        is out_proj.bias, as torch gives.

        Keywords of ours (not torch's): window=(left, right), a sliding
        window, and layout=, a mha_ext.layout.BlockLayout (block-sparse:
        True = the block is kept), as in mha_ext.MultiHeadAttention's call;
        both over the S given keys, never bias_k's or the zero key.  And
        is_causal="lower_right" (torch takes a bool only): no hint but the
        pattern itself, query i sees keys j <= i + S - L, on every path and
        together with any masks given (none needed), as in
        mha_ext.MultiHeadAttention's call; bias_k's and the zero key stay
        visible.  Another string is a TypeError.

        Arguments torch refuses too are refused with torch's exception type
        as well as ours (mha_ext._torch_errors: an AssertionError for a
        key of another rank, say, is also our ValueError), with both messages.
        """
        _convert.refuse_fx_proxies(query, key, value, key_padding_mask, attn_mask)
        refuse_transformed({}, (query, key, value))
        if any(getattr(x, "is_meta", False) for x in (query, key, value)):
            if not all(p.is_meta for p in self.parameters()):  # torch: a RuntimeError
                raise ValueErrorAndRuntimeError(
                    "query, key and value are on the meta device and the parameters are not: "
                    "mha_ext computes CPU tensors (for the results' shapes, put the module "
                    "on the meta device too)")
            # no data to compute: torch's forward gives the results' shapes on
            # the meta device (and its refusals), as torch's module does
            return TORCH_MHA.forward(
                self, query, key, value, key_padding_mask, need_weights, attn_mask,
                average_attn_weights, is_causal is True)
        try:
            return self._forward_call(query, key, value, key_padding_mask, need_weights,
                                      attn_mask, average_attn_weights, is_causal, window, layout)
        except (ValueError, TypeError) as exc:
            if window is not None or layout is not None or not isinstance(is_causal, bool):
                raise                                   # ours alone: torch has no such call
            raise torchs(exc, lambda: self._torch_refuses(
                query, key, value, key_padding_mask, need_weights, attn_mask,
                average_attn_weights, is_causal)) from exc.__cause__

    if not TYPE_CHECKING:  # torch.compile calls it as it is (Dynamo compiled each function
        # it calls, per kind of tensor met: a DETR-like model's first call 31 s, not 4)
        forward = torch.compiler.disable(forward, reason=COMPILE_REASON)

    def _torch_refuses(self, *args):
        """torch.nn.MultiheadAttention's forward with this configuration on
        meta twins of the arguments: raises what torch raises for them.
        In eval mode with nothing to record (no grad mode, or no tensor that
        requires grad), where torch's forward may try its fused fast path
        (whose checks, its merge_masks among them, meta tensors never reach),
        its forward runs on this module and the call's own tensors instead:
        no dropout, nothing drawn, nothing recorded."""
        tensors = [a for a in args[:3] if isinstance(a, torch.Tensor)]
        tensors += [p for p in self._sources() if p is not None]
        if not self.training and not (torch.is_grad_enabled()
                                      and any(t.requires_grad for t in tensors)):
            with torch.no_grad():
                TORCH_MHA.forward(self, *args)
            return
        ref = TORCH_MHA(
            self.embed_dim, self.num_heads, dropout=self.dropout, bias=self._has_bias(),
            add_bias_kv=holds(self, "bias_k"), add_zero_attn=self.add_zero_attn,
            kdim=self.kdim, vdim=self.vdim, batch_first=self.batch_first, device="meta",
            dtype=self.out_proj.weight.dtype).train(self.training)
        own_shapes(ref, self._sources())(*metas(*args))

    def _forward_call(self, query, key, value, key_padding_mask, need_weights, attn_mask,
                      average_attn_weights, is_causal, window, layout):
        warn_mismatched_masks(key_padding_mask, attn_mask)
        if query.is_nested:
            return forward_nested(self, query, key, value, key_padding_mask, need_weights,
                                  attn_mask, average_attn_weights, is_causal, window, layout)
        # which of torch's paths would run decides only need_weights=False
        # calls (masked_rows, and is_causal's mask): with weights both give
        # NaN; its conditions are read on every call, as torch reads them
        torch_fast = self._torch_fast_path(query, key, value, attn_mask, key_padding_mask)
        fast = not need_weights and (torch_fast or self._in_fused_layer(query))
        causal = False
        if isinstance(is_causal, str):  # ours: lower-right causality, no hint
            causal = _causal(is_causal)
        elif is_causal:
            if attn_mask is None:
                # torch checks key_padding_mask's dtype first (_canonical_mask)
                check_mask_dtype(key_padding_mask, "key_padding_mask")
                raise RuntimeError("Need attn_mask if specifying the is_causal hint. You may "
                                   "use the Transformer module method "
                                   "`generate_square_subsequent_mask` to create this mask.")
            if key_padding_mask is None and not need_weights and not fast:
                # torch applies the pattern, not the mask, but checks the
                # mask's rank (its _mha_shape_check) and the module its dtype
                # (its _canonical_mask) first: so do we
                check_hint_mask_rank(attn_mask, query, key, self.num_heads)
                if self._checks_hint_mask:
                    check_mask_dtype(attn_mask, "attn_mask")
                attn_mask, causal = None, True
        sources = self._sources()
        dtype = (sources[0] if self._qkv_same_embed_dim else sources[1]).dtype
        refuse_mixed_dtypes(sources, dtype, (query, key, value), self.batch_first)
        half = dtype if dtype in HALF else None
        if half is not None:
            # torch computes a float16 / bfloat16 module in that dtype; we
            # compute in float32 (where every such value is exact) and round
            # the results back once, as torch's CPU SDPA does for such
            # tensors; the gradients reach the parameters through the casts
            sources = tuple(None if t is None else t.float() for t in sources)
            dtype = torch.float32
        core = self._core(dtype)
        for name, x in (("query", query), ("key", key), ("value", value)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
            if x.device.type != "cpu":
                raise ValueError(f"{name} must be a CPU tensor, got device {x.device}")
        for p in sources:
            if p is not None and not isinstance(p, torch.Tensor):
                raise TypeError(f"a parameter is a {type(p).__name__}, not a tensor (a "
                                f"quantized out_proj, torch.ao.quantization.convert?): mha_ext "
                                f"computes in float; leave the attention unquantized (its "
                                f"qconfig None)")
            if p is not None and p.device.type != "cpu":  # torch: its device RuntimeError
                raise ValueErrorAndRuntimeError(f"parameters must be on the CPU, got device "
                                                f"{p.device}")
        own = half or dtype  # the parameters' dtype
        for name, x in (("query", query), ("key", key), ("value", value)):
            # torch's module refuses another dtype (its linear's RuntimeError);
            # under CPU autocast the call computes in the parameters' dtype
            if x.dtype != own and not torch.is_autocast_enabled("cpu"):
                raise TypeErrorAndRuntimeError(
                    f"{name} is {x.dtype} but the parameters are {own}: torch's module "
                    f"computes in one dtype and raises a RuntimeError here; cast the input "
                    f"(x.to({own})) or the module (module.to({own}))")
        batched = query.dim() == 3
        q, k, v = (x.to(dtype) for x in (query, key, value))
        if batched and not self.batch_first:  # (S, B, E) -> (B, S, E)
            q, k, v = (x.transpose(0, 1) for x in (q, k, v))
        k, v, sources = widen_empty(k, v, sources, self.kdim, self.vdim)  # kdim or vdim 0
        opts = dict(attn_mask=attn_mask, key_padding_mask=key_padding_mask, is_causal=causal,
                    need_weights=bool(need_weights),
                    average_weights=bool(average_attn_weights),
                    masked_rows="nan" if need_weights or fast else "zero",
                    dropout=(_convert.as_float(self.dropout, "dropout", "a probability in [0, 1]")
                             if self.training else 0.0),
                    window=window, layout=layout)
        if causal is True and (holds(self, "bias_k") or self.add_zero_attn):
            if window is not None or layout is not None:
                raise ValueError("window and layout are not taken with the is_causal hint "
                                 "on torch's SDPA path with add_bias_kv or add_zero_attn "
                                 "(its causal pattern covers the appended keys)")
            out, weights = self._causal_over_extra_keys(dtype, opts, q, k, v,
                                                         self._params(sources)), None
        else:
            try:
                out, weights = attention_kept(self, core, opts, q, k, v, sources,
                                               lambda: self._params(sources),
                                               lambda: self._packed(sources))
            except ValueError as exc:
                if not batched or self.batch_first:
                    raise
                raise ValueError(seq_first_shapes(exc, (query, key, value))) from None
        if half is not None:
            out = out.to(half)
            weights = None if weights is None else weights.to(half)
        if batched and not self.batch_first:  # torch's (L, B, E), contiguous
            out = _convert.dense(out.transpose(0, 1))
        elif batched and not torch_fast:
            # torch's unfused path gives batch_first its (L, B, E) result
            # transposed: the same memory order here, so that what follows
            # (a dropout drawing over empty_like(out), a .view) does as with
            # torch's; its fused path gives a contiguous (B, L, E), as ours
            out = _convert.dense(out.transpose(0, 1)).transpose(0, 1)
        if torch_fast and query.numel() == 0:
            weights = None  # torch's fused path returns no weights for an empty query
        return out, (weights if need_weights else None)

    def _causal_over_extra_keys(self, dtype, opts, q, k, v, params):
        # torch's SDPA path with the is_causal hint applies its top-left
        # causal pattern to the keys *after* bias_k / the zero key were
        # appended: query i sees key j (extra keys at S, S + 1) iff j <= i.
        # Our causal mask never blocks the extra keys, so the queries are
        # computed in row blocks, each by a core with the extra keys it sees:
        # rows [0, S) causal over the S keys and no extra key; row S + e the
        # first e + 1 extra keys and every key (the last block: to L).
        L, S = q.shape[-2], k.shape[-2]
        kv = holds(self, "bias_k")
        extras = ([(True, False)] if kv else []) + ([(kv, True)] if self.add_zero_attn else [])
        blocks = [(0, min(L, S), (False, False), True)]
        for e, extra in enumerate(extras):
            stop = S + e + 1 if e < len(extras) - 1 else L
            if S + e < min(stop, L):
                blocks.append((S + e, min(stop, L), extra, False))
        outs = [attention(self._core(dtype, extra), dict(opts, is_causal=c),
                                        q[..., a:b, :], k, v, *params)[0]
                for a, b, extra, c in blocks]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)
