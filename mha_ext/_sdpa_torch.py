"""mha_ext.scaled_dot_product_attention on torch tensors: a
torch.autograd.Function whose forward is the C core's _sdpa and whose
backward is its _sdpa_backward (mha_ext._sdpa holds the argument rules).

Imported only when a tensor reaches scaled_dot_product_attention; needs
torch.  Double backward raises a RuntimeError (the C backward is not itself
differentiable), as for mha_ext.torch's modules.

Legend as in mha_ext._sdpa: L query length, S key length, E width, Hq / H
query / key-value heads.
"""
from __future__ import annotations

import numbers

import numpy as np
import torch

from . import _sdpa
from . import _calls
from ._convert import broadcast_copy, probability, to_numpy, to_tensor
from ._torch_fn import (COMPILE_REASON, HALF, _has_tangent, _NoDoubleBackward,
                        refuse_traced_tensors, refuse_unrecordable, refused_draws_nothing,
                        save_arrays, saved_arrays, torch_stream)

__all__ = ["sdpa_torch", "SDPAFunction"]

_DTYPES = (torch.float32, torch.float64)


class SDPAFunction(torch.autograd.Function):
    """forward(plan, query, key, value[, attn_mask][, head_mask]) -> output;
    plan holds the arguments in the C side's form except q, k, v (computed
    here from the tensors), the mask (plan["attn_mask"], or the next tensor
    when plan["mask_input"]: a float mask that requires grad, which gets
    dL/d mask, the C backward's gradient of the masked scores summed over
    the mask's broadcast) and the head mask (plan["head_mask"], or the last
    tensor when it requires grad: then its gradient is returned too)."""

    @staticmethod
    def forward(ctx, plan, query, key, value, *extra):
        mask_input = plan.get("mask_input", False)
        head_mask = extra[1:] if mask_input else extra
        out, (q4, k4, v4, masks, c, s, lead, lead_kv, lay, hm) = _forward(plan, query, key,
                                                                          value, extra)
        # q4, k4, v4 and the masks' arrays go through autograd's saved tensors
        # (save_arrays: freed by torch.utils.checkpoint, seen by saved-tensor hooks)
        ctx.args = (None, None, None, [(kind, None) for kind, _ in masks], c, s, plan["p"],
                    plan["seed"], plan["window"], lay, hm)
        ctx.hm_shape = tuple(head_mask[0].shape) if head_mask else None
        ctx.mask = (tuple(extra[0].shape), extra[0].dtype) if mask_input else None
        ctx.leads = (lead, lead_kv, lead_kv)
        ctx.shapes = (query.shape, key.shape, value.shape)
        ctx.set_materialize_grads(False)
        # anchors: create_graph's guard, and torch's check that no input was
        # changed in place before the backward (q4, k4, v4 may be views of
        # them), as torch's SDPA saves them (not a tensor made under
        # inference_mode that needs no grad: it may not be saved)
        # (a float mask that needs no grad too: its values, read by the C
        # backward, may be a view of it, as torch's fused SDPA saves it)
        anchor = plan.get("mask_anchor")
        save_arrays(ctx, [t if t.requires_grad or not t.is_inference() else None
                          for t in (query, key, value, *extra)] +
                    ([anchor] if anchor is not None and not anchor.is_inference() else []),
                    [q4, k4, v4, *(m for _, m in masks)])
        return out

    @staticmethod
    def backward(ctx, grad_out):
        anchors, arrays = saved_arrays(ctx, ctx.saved_tensors)
        _, _, _, masks, c, s, p, seed, window, lay, hm = ctx.args
        q4, k4, v4 = arrays[:3]
        masks = [(kind, m) for (kind, _), m in zip(masks, arrays[3:])]
        need = ctx.needs_input_grad
        if grad_out is None:
            return (None,) * len(need)
        dt = torch.float64 if q4.dtype == np.float64 else torch.float32
        if grad_out.numel() == 0 or q4.shape[2] == 0 or v4.size == 0:
            # an empty output (Ev, L or a batch dimension 0), or torch's early
            # zeros (no value element): no loss depends on the inputs; zeros,
            # not the NaN a blocked row's 0 * NaN would give
            shapes = list(ctx.shapes) + ([ctx.mask[0]] if ctx.mask else []) + \
                ([ctx.hm_shape] if ctx.hm_shape is not None else [])
            return (None, *(torch.zeros(shape, dtype=dt) if need[1 + i] else None
                            for i, shape in enumerate(shapes)))
        with torch.no_grad():
            go = np.ascontiguousarray(to_numpy(grad_out, "grad_output"),
                                      dtype=q4.dtype).reshape(q4.shape[:3] + v4.shape[3:])
            want_mask = ctx.mask is not None and need[4]
            dq, dk, dv, *ds = _sdpa.sdpa_backward(q4, k4, v4, go, masks, c, s, p, seed,
                                                  window=window, layout=lay, head_mask=hm,
                                                  scores_grad=want_mask)
            grads = [_unbroadcast(g, lead, shape) if need[1 + i] else None
                     for i, (g, lead, shape) in enumerate(zip((dq, dk, dv), ctx.leads,
                                                               ctx.shapes))]
            if ctx.mask is not None:  # dL/d mask: the masked scores' gradient, summed
                grads.append(_unbroadcast(ds[0], ctx.leads[0], ctx.mask[0]).to(ctx.mask[1])
                             if want_mask else None)
            if ctx.hm_shape is not None:
                # out_bh = m[b, h]·(A·V)_bh: dL/dm = Σ dout · (A·V), A·V from the
                # call without the head mask (the same dropout stream)
                plain, _ = _sdpa.sdpa_forward(q4, k4, v4, masks, c, s, p, seed,
                                              window=window, layout=lay)
                g = np.einsum("bhld,bhld->bh", go, plain)
                g = g.sum(axis=0) if len(ctx.hm_shape) == 1 else g.reshape(ctx.hm_shape)
                grads.append(torch.from_numpy(np.ascontiguousarray(g)) if need[-1] else None)
        if torch.is_grad_enabled():
            # create_graph=True: make a later differentiation of these fail
            # loudly, also one through grad_out (a loss on the layers after
            # this one, torch.autograd.functional.jvp)
            anchors = [t for t in anchors if t is not None] + \
                ([grad_out] if grad_out.requires_grad else [])
            have = [i for i, g in enumerate(grads) if g is not None]
            if anchors and have:
                guarded = _NoDoubleBackward.apply(len(have), *[grads[i] for i in have],
                                                  *anchors)
                for i, g in zip(have, guarded):
                    grads[i] = g
        return (None, *grads)


def _forward(plan, query, key, value, extra):
    """SDPAFunction's forward without autograd (also the call that needs no
    recording: sdpa_torch's plain path): (output tensor, (q4, k4, v4, masks,
    is_causal, scale, lead, lead_kv, layout, head mask) as the C side took
    them)."""
    mask_input = plan.get("mask_input", False)
    mask = to_numpy(extra[0].detach(), "attn_mask") if mask_input else plan["attn_mask"]
    head_mask = extra[1:] if mask_input else extra
    q4, k4, v4, masks, c, s, (lead, lead_kv), shape = _sdpa.sdpa_arrays(
        to_numpy(query, "query"), to_numpy(key, "key"), to_numpy(value, "value"),
        mask, plan["is_causal"], plan["scale"], plan["enable_gqa"],
        causal_and_mask=plan["causal_and_mask"])
    lay = _sdpa.sdpa_layout(plan["layout"], q4, k4)
    hm = head_mask[0] if head_mask else plan["head_mask"]
    hm = None if hm is None else _sdpa.sdpa_head_mask(
        to_numpy(hm, "head_mask") if isinstance(hm, torch.Tensor) else hm, q4, lead)
    out, _ = _sdpa.sdpa_forward(q4, k4, v4, masks, c, s, plan["p"], plan["seed"],
                                window=plan["window"], layout=lay, head_mask=hm)
    return (to_tensor(_sdpa.sdpa_output(out, shape)),
            (q4, k4, v4, masks, c, s, lead, lead_kv, lay, hm))


def _records(tensors) -> bool:
    """Whether a twin call goes through SDPAFunction: autograd records it
    (grad mode on and a tensor requiring grad), a tensor carries a
    forward-mode tangent (the Function then says it has no jvp), or
    torch.jit.trace is recording (its PythonOp, not a constant).  Else the
    plain forward, the same numbers without the Function's cost (~24 us of
    a small call's ~85)."""
    return bool(torch.jit.is_tracing()
                or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
                or _has_tangent(tensors))


def _unbroadcast(g, lead, shape):
    """The gradient g (B, H, n, w) of an input of `shape` that the call
    broadcast to the leading shape `lead` (then reshaped to (B, H)): summed
    back over the broadcast axes (and over enable_gqa's repeats of a head),
    as a tensor of `shape`."""
    g = g.reshape(tuple(lead) + g.shape[2:])
    extra = g.ndim - len(shape)
    if extra:
        g = g.sum(axis=tuple(range(extra)))
    axes = tuple(i for i, (a, b) in enumerate(zip(g.shape, shape)) if b == 1 and a != 1)
    if axes:
        g = g.sum(axis=axes, keepdims=True)
    for i, (a, b) in enumerate(zip(g.shape, shape)):
        if a != b:  # enable_gqa's heads repeated b -> a (repeat_interleave): summed back
            g = g.reshape(g.shape[:i] + (b, a // b) + g.shape[i + 1:]).sum(axis=i + 1)
    return torch.from_numpy(np.ascontiguousarray(g.reshape(shape)))


def _autocast(*tensors):
    """Under CPU autocast, torch's SDPA takes its floating tensors (the mask
    too; not float64) in the autocast dtype, computes there and returns it:
    so does the twin (in float32, rounded back, as for such tensors)."""
    want = torch.get_autocast_dtype("cpu")
    return [t.to(want) if isinstance(t, torch.Tensor) and t.is_floating_point()
            and t.dtype not in (torch.float64, want) and t.device.type == "cpu" else t
            for t in tensors]


def _dropout_p(value):
    """dropout_p as a probability.  A negative or NaN one, which torch's
    fused CPU kernel refuses with a RuntimeError (its math path, for 3-D or
    strided tensors, computes without dropout), is a ValueError that is also
    a RuntimeError (API.md §7).  A 0-d real tensor is its value, as torch
    reads it; one that requires grad or has dimensions is torch's
    TypeError; a bool, complex or meta one is refused (torch reads a bool
    as 0 or 1, as it does True, which is refused too).  Anything else that
    is not a real number (a NumPy array, a string, None) is torch's
    TypeError."""
    if isinstance(value, torch.Tensor):
        if value.ndim != 0 or value.requires_grad or value.dtype == torch.bool \
                or value.is_complex() or value.is_meta:
            raise TypeError(f"dropout_p must be a float or a 0-d real tensor without grad, "
                            f"got a tensor of shape {tuple(value.shape)}, {value.dtype}, "
                            f"requires_grad={value.requires_grad}")
        value = value.item()
    elif type(value) is not float and not isinstance(value, numbers.Real):
        # a NumPy array, a string, None: torch's type (a float, the usual
        # case, skips the ABC's check)
        raise TypeError(f"dropout_p must be a float or a 0-d real tensor without grad, not "
                        f"{type(value).__name__} (torch: argument 'dropout_p' must be float)")
    try:
        return probability(value, "dropout_p")
    except OverflowError:  # an int too large for a float: torch's OverflowError too
        raise
    except ValueError as exc:
        bad = isinstance(value, numbers.Real) and not float(value) >= 0.0
        if not bad:
            raise
        from ._torch_errors import ValueErrorAndRuntimeError
        raise ValueErrorAndRuntimeError(
            f"{exc} (torch's fused CPU attention refuses it too, a RuntimeError)") from None


@torch.compiler.disable(reason=COMPILE_REASON)  # called as it is under torch.compile
# (see the drop-in's forward)
def sdpa_torch(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, seed,
               window=None, layout=None, head_mask=None, pair=None):
    """scaled_dot_product_attention on tensors (see mha_ext._sdpa); pair:
    fused_causal_and_mask's answer when the caller has it (None: asked)."""
    if pair is None and torch.is_autocast_enabled("cpu"):
        query, key, value, attn_mask = _autocast(query, key, value, attn_mask)
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor like the others, not {type(t).__name__}")
        if t.dtype not in _DTYPES + HALF:
            raise TypeError(f"{name} must be float32, float64, float16 or bfloat16, "
                            f"got {t.dtype}")
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(f"query, key and value must have one dtype, got {query.dtype}, "
                        f"{key.dtype}, {value.dtype}")
    refuse_unrecordable({"attn_mask": attn_mask, "head_mask": head_mask}, (query, key, value))
    # (asked on the tensors as given: the half dtypes' float32 copies below
    # are contiguous, torch's choice reads the strides)
    both = pair if pair is not None else fused_causal_and_mask(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if query.dtype in HALF:
        # torch's CPU SDPA computes float16 and bfloat16 in float32 and rounds
        # its output back; here too, through differentiable casts (the
        # gradients arrive in the inputs' dtype).  A float mask or head mask
        # of the same dtype is exact in float32.
        def up(x):
            return x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
        return sdpa_torch(up(query), up(key), up(value), up(attn_mask), dropout_p, is_causal,
                          scale, enable_gqa, seed, window=window, layout=layout,
                          head_mask=up(head_mask), pair=both).to(query.dtype)
    hm_input = isinstance(head_mask, torch.Tensor) and head_mask.requires_grad
    refuse_traced_tensors({"attn_mask": attn_mask, "head_mask": None if hm_input else head_mask})
    if torch.jit.is_tracing() and dropout_p and seed is None:
        raise RuntimeError("torch.jit.trace would fix this call's dropout draw (made from "
                           "torch's generator outside the traced op) for every later call: "
                           "trace with dropout_p=0, or pass seed=")
    # (not where torch's SDPA returns zeros early, no query row or no value
    # element: the mask then gets no gradient, None; an empty output
    # otherwise, a batch of 0, gives it zeros)
    mask_input = (isinstance(attn_mask, torch.Tensor) and attn_mask.requires_grad
                  and torch.is_grad_enabled() and query.shape[-2] != 0
                  and value.numel() != 0)
    anchor = None
    if isinstance(attn_mask, torch.Tensor) and not mask_input:
        anchor = attn_mask if attn_mask.is_floating_point() else None  # (a bool one: copied)
        attn_mask = to_numpy(attn_mask, "attn_mask")
    p = _dropout_p(dropout_p)
    with refused_draws_nothing(p > 0 and seed is None):
        plan = dict(attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa, causal_and_mask=both, p=p,
                    seed=_sdpa._seed(seed, p, torch_stream), window=_calls.sliding_window(window),
                    layout=layout, head_mask=head_mask, mask_anchor=anchor)
        extra = []
        if mask_input:  # a learned bias (Swin, BEiT, T5): it gets its gradient
            plan["attn_mask"], plan["mask_input"] = None, True
            # through a copy, the backward's (as the torch classes take it):
            # the caller's mask may change in place before the backward, as
            # on torch's math path, which takes such a mask and keeps none
            extra.append(broadcast_copy(attn_mask))
        if hm_input:
            plan["head_mask"] = None
            extra.append(head_mask)
        if not _records((query, key, value, *extra)):
            return _forward(plan, query, key, value, extra)[0]
        mask = plan["attn_mask"]
        if isinstance(mask, np.ndarray) and mask.dtype.kind == "f" and \
                (anchor is None or anchor.is_inference()):
            # a float mask autograd cannot watch (a NumPy array, an inference
            # tensor): the backward reads a copy, the forward's values
            plan["attn_mask"] = np.array(mask, copy=True)
        return SDPAFunction.apply(plan, query, key, value, *extra)


def fused_causal_and_mask(query, key, value, attn_mask, dropout_p, is_causal, scale,
                          enable_gqa):
    """Whether torch's own SDPA computes this call with both attn_mask and
    is_causal=True: its documentation calls the pair an error and its math
    path raises, but its fused CPU kernel (taken for 4-D tensors with a unit
    last stride and no dropout, unless torch.nn.attention.sdpa_kernel rules
    it out) applies the mask and the top-left causality both, code written
    against it relies on that (ngpt-pytorch), and calls with no query or no
    key return before the check.  Asks torch: its backend choice on the
    tensors as given, then its own function on meta twins of them (no data,
    the math path: raises where torch raises).  False when there is no pair
    or torch refuses the call."""
    if attn_mask is None or not (is_causal is True or isinstance(is_causal, np.bool_)
                                 and is_causal):
        return False
    from ._torch_errors import metas
    try:
        mask = attn_mask if isinstance(attn_mask, torch.Tensor) else torch.as_tensor(
            np.asarray(attn_mask))
        if mask.is_floating_point() and query.is_floating_point():
            mask = mask.to(query.dtype)  # as the call takes it (README's differences)
        scale = None if scale is None else float(scale)
        args = (float(dropout_p), True)
        kw = dict(scale=scale, enable_gqa=bool(enable_gqa))
        try:
            fused = torch._fused_sdp_choice(query, key, value, mask, *args, **kw) \
                != torch.nn.attention.SDPBackend.MATH.value
        except RuntimeError:  # no kernel left by a sdpa_kernel context: torch's
            fused = False     # function decides (it returns early for empty calls)
        if fused:
            return True
        # torch's function itself, which F.scaled_dot_product_attention may no
        # longer be (this twin patched in its place)
        mq, mk, mv, mm = metas(query, key, value, mask)
        torch._C._nn.scaled_dot_product_attention(mq, mk, mv, mm, *args, **kw)
    except Exception:  # torch refuses the arguments: the call raises, later
        return False
    return True
