"""mha_ext.torch.multi_head_attention_forward: the twin of
torch.nn.functional.multi_head_attention_forward, computed by mha_ext.

torch's nn.MultiheadAttention calls that functional on its ordinary
(unfused) path, and code with attention modules of its own calls it
directly with its own parameter tensors (fair-esm's and fairseq's
MultiheadAttention, for two).  Such code is run through mha_ext by putting
this twin in its place:

    torch.nn.functional.multi_head_attention_forward = \\
        mha_ext.torch.multi_head_attention_forward

Each call builds an mha_ext.torch.MultiheadAttention on the meta device
(no memory) holding the call's tensors in place of its parameters, so the
gradients reach those tensors, and runs its forward on torch's unfused path
(a query that sees no key: NaN with weights, out_proj_bias without, as
torch's functional gives).  The C modules doing the work are kept between
calls, a few per configuration.

Legend: L query length, S key length, B batch, E = embed_dim, H = num_heads.
"""
from __future__ import annotations

import numbers
from typing import Any

import numpy as np
import torch

from . import _convert
from ._torch_errors import TypeErrorAndRuntimeError, ValueErrorAndRuntimeError, metas, torchs
from ._torch_fn import refuse_transformed
from ._torch_mha import MultiheadAttention

__all__ = ["multi_head_attention_forward"]

# torch's own function, taken when mha_ext.torch is imported: the one the
# refusals (and data-less meta tensors) run, also after a user put the twin
# in its place in torch.nn.functional
_TORCH_MHA_FORWARD = torch.nn.functional.multi_head_attention_forward


class _Call(MultiheadAttention):
    """The drop-in holding one call's tensors, on torch's unfused path."""

    _checks_hint_mask = False  # torch's functional drops the hint's mask unread
    _tail = None  # (out_proj_weight, out_proj_bias) of another width than E, for torch's linear

    def _torch_fast_path(self, query, key, value, attn_mask, key_padding_mask):
        return False                                 # the functional is never fused

    def _in_fused_layer(self, query):
        return False


def _refuse_fake(tensors):
    """torch.compile's fake tensors (no data): the exception torch.compile
    turns into a graph break, so that the call runs outside the graph, on
    the real tensors.  (torch.compile takes torch.nn.functional's function
    of this name, as it finds it on its first compilation, for one of its
    own: where this twin was put in its place by then, it runs the twin on
    fake tensors to learn the result's shape.)"""
    from torch._subclasses.fake_tensor import FakeTensor, UnsupportedFakeTensorException
    if any(isinstance(t, FakeTensor) for t in tensors):
        raise UnsupportedFakeTensorException(
            "mha_ext.torch.multi_head_attention_forward computes on real tensors")


def _tensor(x, name, required=True):
    if x is None and not required:
        return None
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor"
                        + ("" if required else " or None") + f", got {type(x).__name__}")
    return x


def _shape(x, name, want):
    if x is not None and tuple(x.shape) != want:
        raise ValueError(f"{name} must have shape {want}, got {tuple(x.shape)}")


def _out_bias(x, n):
    """out_proj_bias of n values, (n,) or (1, n) (torch's linear broadcasts
    the row: the same numbers), as (n,); the gradient reaches the caller's
    shape through the reshape.  (in_proj_bias takes a row in self-attention
    only: torch splits it on its first dimension otherwise; see _module.)"""
    x = _tensor(x, "out_proj_bias", False)
    if x is not None and tuple(x.shape) == (1, n):
        return x.reshape(n)
    _shape(x, "out_proj_bias", (n,))
    return x


def _size(x, name):
    """embed_dim_to_check or num_heads: an int, or a 0-d integer tensor or
    NumPy array, as torch's functional takes one (it only compares and
    divides them); _convert.as_int's rule."""
    return _convert.integer(x, name)


def _check_inputs(query, key, value, kdim, vdim, separate):
    """query (L, B, E), key (S, B, kdim), value (S, B, vdim), or unbatched
    (L, E), (S, kdim), (S, vdim): said in the functional's own layout"""
    q, k, v = tuple(query.shape), tuple(key.shape), tuple(value.shape)
    shapes = f"query {q}, key {k}, value {v}"
    if len(q) not in (2, 3):
        raise ValueError(f"query must be 3-D (L, B, E), or 2-D (L, E) unbatched, got {shapes}")
    if len(k) != len(q) or len(v) != len(q):
        raise ValueError(f"key and value must be {len(q)}-D like query, got {shapes}")
    if len(q) == 3 and not q[1] == k[1] == v[1]:
        raise ValueError(f"query, key and value must have one batch size (dimension 1), got "
                         f"{shapes}")
    if k[0] != v[0]:
        raise ValueError(f"key and value must have one length (dimension 0), got {shapes}")
    whose = "k_proj_weight's and v_proj_weight's input widths" if separate else "embed_dim"
    if k[-1] != kdim or v[-1] != vdim:
        raise ValueError(f"key and value must be {kdim} and {vdim} wide ({whose}), got "
                         f"{shapes}")


def _set(module, name, tensor):
    # the call's tensor (a Parameter or not) where the module's parameter was
    module._parameters[name] = tensor


def multi_head_attention_forward(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, embed_dim_to_check: int,
        num_heads: int, in_proj_weight: torch.Tensor | None, in_proj_bias: torch.Tensor | None,
        bias_k: torch.Tensor | None, bias_v: torch.Tensor | None, add_zero_attn: bool,
        dropout_p: float, out_proj_weight: torch.Tensor, out_proj_bias: torch.Tensor | None,
        training: bool = True, key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True, attn_mask: torch.Tensor | None = None,
        use_separate_proj_weight: bool = False, q_proj_weight: torch.Tensor | None = None,
        k_proj_weight: torch.Tensor | None = None, v_proj_weight: torch.Tensor | None = None,
        static_k: torch.Tensor | None = None, static_v: torch.Tensor | None = None,
        average_attn_weights: bool = True, is_causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """torch.nn.functional.multi_head_attention_forward, computed by mha_ext.

    The same arguments and results as torch's: query (L, B, E), key (S, B,
    kdim), value (S, B, vdim) (sequence first, as torch's functional; or
    unbatched (L, E), ...); in_proj_weight (3E, E), or with
    use_separate_proj_weight q_proj_weight (E, E), k_proj_weight (E, kdim),
    v_proj_weight (E, vdim) (in_proj_weight then unread); in_proj_bias
    (3E, or a (1, 3E) row in batched self-attention: query, key and value
    one tensor) or None; out_proj_weight (E, E), or (Eo, E) for an output
    of width Eo (OpenAI CLIP's attention pooling), and out_proj_bias (Eo,
    or a (1, Eo) row) or None; bias_k and bias_v (1, 1, E) or None
    (appended to every sequence's keys and values, then add_zero_attn's
    zero key); embed_dim_to_check and num_heads ints or 0-d integer
    tensors; dropout_p applied (and checked, as torch's paths check it)
    when training only; the masks and is_causal as
    torch.nn.MultiheadAttention's forward takes them.  Returns (output
    (L, B, Eo), weights (B, L, S') averaged over the heads, (B, H, L, S')
    with average_attn_weights=False, or None with need_weights=False),
    S' counting bias_k's and the zero key.

    Gradients reach every tensor passed that requires grad (the weights
    and biases too, a float mask: the masked scores' gradient, summed over
    its broadcast), from mha_ext's C backward; query, key and value have the
    weights' dtype (another is a TypeError, as torch raises, except under
    CPU autocast).  Under torch.compile the call is a graph break (see
    _refuse_fake).  float32 and float64 on
    the CPU; float16 and bfloat16 computed in float32 and rounded back
    once, as mha_ext.torch.MultiheadAttention does.  static_k and static_v
    (keys and values given per head, past the projections) are not taken:
    a ValueError.  Tensors on the meta device (no data) go to torch's own
    function, which checks them and gives the results' shapes.  Arguments
    torch refuses too are refused with torch's exception type as well as
    ours, with both messages (docs/API.md §7).
    """
    args = (query, key, value, embed_dim_to_check, num_heads, in_proj_weight, in_proj_bias,
            bias_k, bias_v, add_zero_attn, dropout_p, out_proj_weight, out_proj_bias)
    kwargs: dict[str, Any] = dict(
        training=training, key_padding_mask=key_padding_mask, need_weights=need_weights,
        attn_mask=attn_mask, use_separate_proj_weight=use_separate_proj_weight,
        q_proj_weight=q_proj_weight, k_proj_weight=k_proj_weight,
        v_proj_weight=v_proj_weight, static_k=static_k, static_v=static_v,
        average_attn_weights=average_attn_weights, is_causal=is_causal)
    tensors = [x for x in list(args) + list(kwargs.values()) if isinstance(x, torch.Tensor)]
    _refuse_fake(tensors)
    if any(t.device.type == "meta" for t in tensors):
        return _TORCH_MHA_FORWARD(*args, **kwargs)  # no data to compute: torch's shapes
    # before the call's module is made (its initialisation draws: under vmap,
    # torch's randomness error, which named no one)
    refuse_transformed({"attn_mask": attn_mask, "key_padding_mask": key_padding_mask},
                       (query, key, value, in_proj_weight, q_proj_weight, k_proj_weight,
                        v_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias, bias_k,
                        bias_v))
    try:
        module = _module(*args, training, need_weights, use_separate_proj_weight, q_proj_weight,
                         k_proj_weight, v_proj_weight, static_k, static_v)
        out, weights = module._forward_call(query, key, value, key_padding_mask, need_weights,
                                            attn_mask, average_attn_weights, is_causal, None,
                                            None)
        if module._tail is not None:  # an output projection to another width
            out = torch.nn.functional.linear(out, *module._tail)
        return out, weights
    except (ValueError, TypeError) as exc:
        if static_k is not None or static_v is not None:
            raise                                    # ours alone: torch takes them
        raise torchs(exc, lambda: _probe(args, kwargs)) from exc.__cause__


def _probe(args, kwargs):
    """torch's own function on meta twins of the call's arguments (the same
    tensor passed twice stays one: torch's self-attention path reads that).
    A 0-d bias_k / bias_v gets its meta twin too (metas keeps 0-d tensors,
    whose values torch may read; these it repeats unread): on the CPU beside
    meta keys it met the probe's device error, not torch's refusal."""
    twins = metas(*args, *kwargs.values())
    for i in (7, 8):  # bias_k, bias_v
        if isinstance(args[i], torch.Tensor) and args[i].dim() == 0:
            twins[i] = torch.empty((), dtype=args[i].dtype, device="meta")
    return _TORCH_MHA_FORWARD(*twins[:len(args)], **dict(zip(kwargs, twins[len(args):])))


def _module(query, key, value, embed_dim_to_check, num_heads, in_proj_weight, in_proj_bias,
            bias_k, bias_v, add_zero_attn, dropout_p, out_proj_weight, out_proj_bias, training,
            need_weights, separate, q_proj_weight, k_proj_weight, v_proj_weight, static_k,
            static_v):
    """The call's _Call module, its arguments checked as torch's functional
    checks them (with our messages)."""
    if static_k is not None or static_v is not None:
        raise ValueError("static_k and static_v (per-head keys and values past the "
                         "projections) are not taken by mha_ext's "
                         "multi_head_attention_forward: call torch's function for them")
    for name, x in (("query", query), ("key", key), ("value", value)):
        _tensor(x, name)
    E = _size(embed_dim_to_check, "embed_dim_to_check")
    H = _size(num_heads, "num_heads")
    if query.shape[-1:] != (E,):
        raise ValueError(f"query's last dimension must be embed_dim_to_check = {E}, got "
                         f"shape {tuple(query.shape)}")
    if H < 1 or E % H:
        raise ValueError(f"embed_dim ({E}) must be divisible by num_heads ({H})")
    out_w = _tensor(out_proj_weight, "out_proj_weight")
    if not out_w.is_floating_point() or out_w.is_complex():
        # (torch's linear refuses it: its RuntimeError too, which its meta
        # tensors, checked for shapes alone, do not raise)
        raise TypeErrorAndRuntimeError(f"the weights must be float32 or float64 (float16 and "
                                       f"bfloat16 are computed in float32), got {out_w.dtype}")
    if out_w.dim() != 2 or out_w.shape[1] != E:
        raise ValueError(f"out_proj_weight must have shape (output width, embed_dim = {E}), "
                         f"got {tuple(out_w.shape)}")
    out_b = _out_bias(out_proj_bias, int(out_w.shape[0]))
    # out_proj_weight (Eo, E), Eo != E (OpenAI CLIP's attention pooling): the
    # module projects by the identity and torch's linear does the rest
    tail = None if out_w.shape[0] == E else (out_w, out_b)
    if tail is not None:
        out_w, out_b = torch.eye(E, dtype=out_w.dtype, device=out_w.device), None
    in_b = _tensor(in_proj_bias, "in_proj_bias", False)
    if (in_b is not None and tuple(in_b.shape) == (1, 3 * E) and not separate
            and query is key and key is value and query.dim() == 3):
        # torch's batched self-attention: one linear, the row broadcast (unbatched
        # inputs become three tensors there, and the row is split)
        in_b = in_b.reshape(3 * E)
    _shape(in_b, "in_proj_bias", (3 * E,))
    if separate:
        q_w = _tensor(q_proj_weight, "q_proj_weight (use_separate_proj_weight=True)")
        k_w = _tensor(k_proj_weight, "k_proj_weight (use_separate_proj_weight=True)")
        v_w = _tensor(v_proj_weight, "v_proj_weight (use_separate_proj_weight=True)")
        for name, w in (("q_proj_weight", q_w), ("k_proj_weight", k_w),
                        ("v_proj_weight", v_w)):
            if w.dim() != 2 or w.shape[0] != E:
                raise ValueError(f"{name} must have shape ({E}, its input's width), got "
                                 f"{tuple(w.shape)}")
        _shape(q_w, "q_proj_weight", (E, E))
        kdim, vdim = int(k_w.shape[1]), int(v_w.shape[1])
    else:
        in_w = _tensor(in_proj_weight, "in_proj_weight (use_separate_proj_weight=False)")
        _shape(in_w, "in_proj_weight", (3 * E, E))
        kdim = vdim = E
    _check_inputs(query, key, value, kdim, vdim, separate)
    if (bias_k is None) != (bias_v is None):
        raise ValueError("bias_k and bias_v are given together or not at all (one is None)")
    if bias_k is not None:
        for name, b in (("bias_k", bias_k), ("bias_v", bias_v)):
            _tensor(b, name)
            if b.numel() != E or (b.dim() > 0 and b.shape[-1] != E):
                raise ValueError(f"{name} must hold embed_dim = {E} values, shape (1, 1, "
                                 f"{E}), got shape {tuple(b.shape)}")
    p = 0.0  # unread outside training, as torch's functional leaves it unchecked
    if training:
        value = dropout_p
        if isinstance(dropout_p, np.ndarray) or (isinstance(dropout_p, torch.Tensor)
                                                 and dropout_p.dim() != 0):
            # torch's SDPA (need_weights=False) and, above 0, its dropout take
            # a float: an array or a tensor with dimensions is its TypeError
            # there; its weights path compares one element with 0 first
            n = dropout_p.numel() if isinstance(dropout_p, torch.Tensor) else dropout_p.size
            value = dropout_p.item() if need_weights and n == 1 else None
            if not isinstance(value, numbers.Real) or value > 0.0:  # (torch's test: > 0)
                raise TypeError(f"dropout_p must be a float (or a 0-d tensor) in training, "
                                f"not a {type(dropout_p).__module__}."
                                f"{type(dropout_p).__name__} of shape "
                                f"{tuple(dropout_p.shape)} (torch: argument 'dropout_p' must "
                                f"be float)")
        p = _convert.as_float(value, "dropout_p", "a probability in [0, 1]")
        words = f"dropout probability has to be between 0 and 1, but got {p} (dropout_p)"
        if p > 1.0:   # torch's dropout's ValueError; its SDPA's RuntimeError
            raise (ValueError if need_weights else ValueErrorAndRuntimeError)(words)
        if not p >= 0.0:  # below 0, or NaN
            if not need_weights:  # torch's SDPA path raises a RuntimeError (of its own words)
                raise ValueErrorAndRuntimeError(words)
            p = 0.0  # torch's weights path drops only for p > 0
    module = _Call(E, H, p, bias=in_b is not None or out_b is not None,
                   add_bias_kv=bias_k is not None, add_zero_attn=bool(add_zero_attn),
                   kdim=kdim, vdim=vdim, batch_first=False, device="meta",
                   dtype=out_w.dtype)
    module._qkv_same_embed_dim = not separate
    if separate:
        for name, w in (("in_proj_weight", None), ("q_proj_weight", q_w),
                        ("k_proj_weight", k_w), ("v_proj_weight", v_w)):
            _set(module, name, w)
    else:
        for name, w in (("in_proj_weight", in_w), ("q_proj_weight", None),
                        ("k_proj_weight", None), ("v_proj_weight", None)):
            _set(module, name, w)
    _set(module, "in_proj_bias", in_b)
    _set(module.out_proj, "weight", out_w)
    _set(module.out_proj, "bias", out_b)
    module._tail = tail
    if bias_k is not None:
        _set(module, "bias_k", bias_k)
        _set(module, "bias_v", bias_v)
    return module.train(bool(training))
