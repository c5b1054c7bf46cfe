"""The torch autograd Function both torch classes run on (mha_ext.torch's
MultiHeadAttention and MultiheadAttention): forward is mha_ext's
forward_train, backward is mha_ext's backward, both in C.

The backward is not itself differentiable.  Under ``create_graph=True`` the
gradients it returns are routed through :class:`_NoDoubleBackward`, so that
differentiating them (double backward, gradgradcheck) raises a clear
RuntimeError instead of silently treating them as constants.

Legend: B batch, Sq query length, Sk key length, E = d_model, H = n_heads.
"""
from __future__ import annotations

import contextlib
import sys
import weakref
from typing import Any, NoReturn

import numpy as np
import torch
from torch.autograd import forward_ad as _forward_ad
from torch.nn.utils import parametrize

from . import _calls, _params, autograd as _ag
from ._convert import batched, broadcast_copy, to_numpy, to_tensor
from ._params import seed_keys

__all__ = ["AttentionFunction", "DOUBLE_BACKWARD", "HALF", "attention", "attention_kept", "holds",
           "records", "refuse_mask_grads", "refuse_script", "refuse_transformed",
           "refused_draws_nothing",
           "torch_stream"]

# float16 and bfloat16: computed in float32 and rounded back, as torch's CPU
# SDPA does (the SDPA twin and the drop-in module alike)
HALF = (torch.float16, torch.bfloat16)

DOUBLE_BACKWARD = ("mha_ext.torch: double backward is not supported: the gradient computed by "
                   "mha_ext's C backward is not itself differentiable (create_graph=True "
                   "followed by differentiating that gradient, gradgradcheck, gradient "
                   "penalties); use torch.nn.MultiheadAttention for higher-order gradients")


def torch_stream() -> int:
    """A dropout stream (a counter, or the SDPA's seed) drawn from torch's
    default CPU generator, as torch's own dropout draws its mask: a run
    repeats under torch.manual_seed, copies of a module draw different
    masks, and torch.utils.checkpoint, which restores that generator before
    it recomputes a forward, recomputes the same mask."""
    return int(torch.randint(0, 2 ** 63 - 1, (), dtype=torch.int64))


def holds(m, name):
    """Whether module m has the tensor `name`, found without reading it where
    it is a parameter (a read computes a parametrized one: spectral_norm's
    power iteration moves, once more than in torch's module)."""
    if parametrize.is_parametrized(m, name):
        return True
    if name in m._parameters:
        return m._parameters[name] is not None
    return getattr(m, name, None) is not None


def refuse_script(name: str) -> NoReturn:
    """torch.jit.script of mha_ext.torch.<name> (its __prepare_scriptable__,
    torch's first step on each module): a RuntimeError saying what to use
    instead (TorchScript's own error named a type annotation)."""
    raise RuntimeError(
        f"torch.jit.script cannot compile mha_ext.torch.{name}: its forward calls "
        f"mha_ext's C code, which TorchScript cannot see into. Use torch.jit.trace (the call "
        f"is recorded as a Python op), torch.compile (a graph break) or eager mode; or "
        f"script a model holding torch's own attention module")


def register_our_pre_hook(module, hook):
    """module.register_forward_pre_hook(hook) under an id none of its
    pre-hook dicts holds: torch numbers hooks from a counter of this
    process, and a module unpickled from another one holds ids of that
    process's counter, which a fresh one can meet (the new entry would
    replace the user's hook under the same key, or find its with_kwargs
    flag).  The counter is moved past them first."""
    from torch.utils.hooks import RemovableHandle
    held = [k for name in ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs",
                           "_forward_pre_hooks_always_called")
            for k in getattr(module, name, {})]
    if held and RemovableHandle.next_id <= max(held):
        RemovableHandle.next_id = max(held) + 1
    return module.register_forward_pre_hook(hook)


COMPILE_REASON = (
    "mha_ext computes attention in C, outside the graph: torch.compile(fullgraph=True) "
    "cannot take it; compile without fullgraph (a graph break at each call), or keep "
    "torch's own attention in a fullgraph model")


def drop_hooks(module, kind, match) -> None:
    """Take off `module` every `kind` ("forward" or "forward_pre") hook
    whose function `match` accepts, from each of torch's dicts that hold
    its id (as RemovableHandle.remove does); idempotent, and needs no
    handle: one lost between a hook's registration and its keeping (a
    Ctrl-C there) is found all the same."""
    hooks = getattr(module, f"_{kind}_hooks", None) or {}
    for key in [k for k, fn in hooks.items() if match(fn)]:
        hooks.pop(key, None)
        for attr in (f"_{kind}_hooks_with_kwargs", f"_{kind}_hooks_always_called"):
            getattr(module, attr, {}).pop(key, None)


class _PutsBackTheGenerator:
    """refused_draws_nothing's context when the call draws: torch's
    generator state before it, put back if the call raises."""

    def __init__(self) -> None:
        self.drawn = torch.get_rng_state()

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> None:  # (the exception goes on)
        if kind is not None:
            torch.set_rng_state(self.drawn)


_DRAWS_NOTHING = contextlib.nullcontext()


def refused_draws_nothing(draws: bool) -> contextlib.AbstractContextManager[None]:
    """Around a call that draws its dropout stream (torch_stream) before
    the C side checks its arguments: when draws, a call refused inside puts
    torch's generator back, as torch's module and SDPA check before they
    draw.  (A class, not a generator: a call without dropout, the usual
    one, then costs no generator frame.)"""
    return _PutsBackTheGenerator() if draws else _DRAWS_NOTHING


def refuse_mask_grads(**masks) -> None:
    """A 0/1 blocking mask (MultiHeadAttention's `mask`) that requires grad:
    a ValueError under grad mode (it blocks keys, it is not added to the
    scores: it has no gradient to give), not a .grad silently left None."""
    if not torch.is_grad_enabled():
        return
    for name, mask in masks.items():
        if isinstance(mask, torch.Tensor) and mask.requires_grad:
            raise ValueError(f"{name} requires grad, but it is a 0/1 blocking mask (not added "
                             f"to the scores): it has no gradient; detach it, or pass an "
                             f"additive float mask as attn_mask to learn it")


MASKS = ("mask", "attn_mask", "key_padding_mask")  # the order of _masks.masks


def mask_inputs(opts) -> tuple[str, ...]:
    """The masks of a call that get a gradient: float tensors in opts
    requiring grad under grad mode (added to the scores, as torch's
    modules add them: their gradient is the masked scores' gradient)."""
    if not torch.is_grad_enabled():
        return ()
    return tuple(n for n in MASKS if isinstance(opts.get(n), torch.Tensor)
                 and opts[n].requires_grad)


def _apply(core, opts, query, key, value, *params):
    """AttentionFunction.apply, the masks that get a gradient (mask_inputs)
    passed as its last tensors."""
    names = mask_inputs(opts)
    if names:
        # copies (as torch's modules add one): saved as anchors of create_graph's
        # guard, they leave the caller's masks free to change in place before
        # the backward (saved themselves, that was autograd's in-place error)
        return AttentionFunction.apply(core, dict(opts, mask_inputs=names), query, key, value,
                                       *params, *(broadcast_copy(opts[n]) for n in names))
    return AttentionFunction.apply(core, opts, query, key, value, *params)


class _NoDoubleBackward(torch.autograd.Function):
    """forward(n, *tensors): the first n tensors (gradients) unchanged; the
    rest (the forward's inputs that require grad) only connect the result to
    the graph.  Its backward is the error of a double backward."""

    @staticmethod
    def forward(ctx, n, *tensors):
        return tuple(t.clone() for t in tensors[:n])

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(DOUBLE_BACKWARD)


def save_arrays(ctx, anchors, arrays) -> None:
    """ctx.save_for_backward(*anchors, *arrays): the NumPy arrays a backward
    needs go through autograd's saved tensors (tensors sharing their
    memory), so that torch.utils.checkpoint (non-reentrant: transformers'
    gradient_checkpointing_enable) frees them after the forward and
    recomputes them, and saved_tensors_hooks (save_on_cpu) see them (kept
    on ctx, they were held for good).  None, a read-only array (a broadcast
    view) or one torch cannot take stays on ctx; the same array object
    twice is saved once.  saved_arrays() gives back (anchors, arrays)."""
    slots: list[tuple[str, Any]] = []
    tensors: list[torch.Tensor] = []
    seen: dict[int, int] = {}
    for a in arrays:
        if isinstance(a, np.ndarray) and id(a) in seen:
            slots.append(("same", seen[id(a)]))
            continue
        if isinstance(a, np.ndarray) and a.flags.writeable:
            try:
                t = torch.from_numpy(a)
            except (TypeError, ValueError):  # negative strides, a dtype torch lacks
                t = None
            if t is not None:
                seen[id(a)] = len(slots)
                slots.append(("saved", (len(tensors), t.dtype)))
                tensors.append(t)
                continue
        slots.append(("kept", a))
    ctx.array_slots = slots
    ctx.n_anchors = len(anchors)
    ctx.save_for_backward(*anchors, *tensors)


def saved_arrays(ctx: Any, saved_tensors: tuple[Any, ...]) -> tuple[tuple[Any, ...], list[Any]]:
    """(anchors, arrays) of save_arrays, from ctx.saved_tensors (unpacked
    once by the caller; a saved-tensor hook that gave back another dtype or
    device is undone: the arrays are as the forward made them)."""
    anchors, tensors = saved_tensors[:ctx.n_anchors], saved_tensors[ctx.n_anchors:]
    arrays: list[Any] = []
    for how, x in ctx.array_slots:
        if how == "saved":
            t = tensors[x[0]]
            if t.dtype != x[1] or t.device.type != "cpu":
                t = t.to("cpu", x[1])
            arrays.append(t.detach().numpy())
        else:
            arrays.append(arrays[x] if how == "same" else x)
    return anchors, arrays


class AttentionFunction(torch.autograd.Function):
    """forward(core, opts, query, key, value, *params) -> (output, weights);
    core a mha_ext.MultiHeadAttention of the computation's dtype (its own
    parameters unused), opts the keywords of its forward_train; params are
    W_q.weight, W_q.bias, ... W_o.bias (biases omitted when the module has
    none), then bias_k, bias_v when the core has add_bias_kv, in the order
    of the C parameter block.  params beyond the core's block (bias_k,
    bias_v given to a core without add_bias_kv) are unused: their gradient
    is zero.  With opts["head_mask_input"] True the next tensor is the head
    mask (opts["head_mask"] its detached copy), which gets dL/d head_mask;
    with opts["mask_inputs"] (names of MASKS) the last tensors are those
    masks (taken detached), which get dL/d mask (their part of the masked
    scores' gradient).  With opts["packed"] params are packed instead:
    in_proj_weight (3E, E) and in_proj_bias (3E,) whole, then W_o's weight
    and bias (mha_ext._params.groups), each in_proj tensor split here as
    NumPy views and its gradient the three parts' concatenated.  weights is
    an empty tensor with need_weights=False."""

    @staticmethod
    def forward(ctx, core, opts, query, key, value, *params):
        ctx.hm_input = bool(opts.get("head_mask_input", False))
        ctx.packed = bool(opts.get("packed", False))
        names = opts.get("mask_inputs", ())
        opts = {k: v for k, v in opts.items()
                if k not in ("head_mask_input", "mask_inputs", "packed")}
        masks = ()
        if names:
            params, masks = params[:-len(names)], params[-len(names):]
            opts.update((n, t.detach()) for n, t in zip(names, masks))
        head_mask = ()
        if ctx.hm_input:
            params, head_mask = params[:-1], params[-1:]
        draws = opts.get("dropout", 0.0) > 0 and opts.get("dropout_counter") is None
        with refused_draws_nothing(draws):
            if draws:
                opts["dropout_counter"] = torch_stream()
            # forward_train on the tensors' memory: each parameter read in
            # place by the C call (views of the tensors): no block joined
            # per call, which cost more than the attention at small sizes
            # (B1 S1 E768: 3.8 ms a call against torch's 0.16)
            groups = _params.groups(core, ctx.packed)
            arrays = [to_numpy(p, "parameters") for p in params[:len(groups)]]
            parts = _params.parts(core, _params.unpacked(core, groups, arrays))
            q, k, v = (to_numpy(x, n) for x, n in ((query, "query"), (key, "key"),
                                                    (value, "value")))
            if not any(ctx.needs_input_grad):  # no backward will come: keep nothing for it
                opts.setdefault("save_projections", False)
            saved = _ag.forward_train(core, q, k, v, params=parts, **opts)
        ctx.core = core
        ctx.saved, arrays = _ag.hollow(saved)  # the arrays: saved tensors (save_arrays)
        # each mask's place among the call's masks (_masks.masks's order),
        # its shape and dtype
        present = [n for n in MASKS if opts.get(n) is not None]
        ctx.masks = [(present.index(n), tuple(t.shape), t.dtype) for n, t in zip(names, masks)]
        ctx.set_materialize_grads(False)
        # only what requires grad (a tensor made under inference_mode may not
        # be saved, and the gradients come from `saved`): the anchors of
        # create_graph's guard (the head mask too: alone, it is the only
        # one; the masks: _apply's copies), and the unused parameters' shapes
        save_arrays(ctx, [t if t.requires_grad else None
                          for t in (query, key, value, *params, *head_mask, *masks)], arrays)
        out = to_tensor(saved.output)
        if saved.weights is None:
            weights = torch.empty(0, dtype=out.dtype)
            ctx.mark_non_differentiable(weights)
        else:
            weights = to_tensor(saved.weights)
        return out, weights

    @staticmethod
    def backward(ctx, grad_out, grad_weights):
        # once: checkpoint's unpack runs once per backward
        saved_tensors, arrays = saved_arrays(ctx, ctx.saved_tensors)
        with torch.no_grad():
            grads = _gradients(ctx, _ag.filled(ctx.saved, arrays), saved_tensors, grad_out,
                               grad_weights)
        if torch.is_grad_enabled():
            # create_graph=True: make a later differentiation of these fail
            # loudly, also one through the incoming gradients (a loss on the
            # layers after this one, torch.autograd.functional.jvp)
            anchors = [t for t in saved_tensors if t is not None] + \
                [g for g in (grad_out, grad_weights) if g is not None and g.requires_grad]
            have = [i for i, g in enumerate(grads) if g is not None]
            if anchors and have:
                guarded = _NoDoubleBackward.apply(len(have), *[grads[i] for i in have],
                                                  *anchors)
                for i, g in zip(have, guarded):
                    grads[i] = g
        return (None, None, *grads)


ONNX_EXPORT = ("torch.onnx.export cannot record mha_ext's C computation (its TorchScript "
               "exporter, dynamo=False, would store the result as a constant, the same for "
               "every input); export a model that uses torch's own attention "
               "(torch.nn.MultiheadAttention, F.scaled_dot_product_attention, "
               "attn_implementation='sdpa'), or compare mha_ext with the exported model "
               "outside the export")
MAKE_FX = ("torch.fx's make_fx (a proxy tensor mode) cannot record mha_ext's C computation: "
           "the graph would hold this call's result as a constant, the same for every input; "
           "trace a model that uses torch's own attention (torch.nn.MultiheadAttention, "
           "F.scaled_dot_product_attention), or call mha_ext outside the trace")
FUNC_TRANSFORMS = ("is a tensor of a torch.func transform (grad, jacrev, jacfwd, jvp, "
                   "hessian, functionalize), which mha_ext's C kernels cannot read and its "
                   "autograd function cannot take; use torch.autograd.grad or "
                   "torch.autograd.functional (their first derivatives run through mha_ext's "
                   "C backward), or torch's own attention under torch.func")


_MASKS_AND_HEAD = (*MASKS, "head_mask")


# make_fx's mode (None where this torch has no such key)
_PROXY = getattr(getattr(torch._C, "_TorchDispatchModeKey", None), "PROXY", None)


def refuse_unrecordable(masks, tensors) -> None:
    """Refuse, naming mha_ext, the calls whose derivatives or export would
    be silently wrong, before anything runs (`masks`: name -> the mask or
    head mask or None; `tensors`: query, key, value, then the parameters;
    named only in a message, as this runs on every call): torch.onnx's
    TorchScript export and make_fx's real-tensor tracing (both would store
    the C call's result as a constant), tensors of torch.func's
    transforms (torch's own message named no one; vmap's batched tensors
    get check_tensor's), and a forward-mode tangent on a mask or
    head mask (not an input of the autograd function: the tangent was
    dropped where torch's math path carries it)."""
    onnx = sys.modules.get("torch.onnx")
    if onnx is not None and onnx.is_in_onnx_export():
        raise RuntimeError(ONNX_EXPORT)
    if _PROXY is not None and torch._C._get_dispatch_mode(_PROXY) is not None:
        raise RuntimeError(MAKE_FX)  # (make_fx's real, fake and symbolic tracing alike)
    if _transformed(masks, tensors):
        ft = torch._C._functorch
        # the masks named first, then the parameters: under a transform of the
        # parameters alone (functional_call) the inputs' conversions (x.to(dtype))
        # are the transform's tensors too, and the parameters are what it took
        named = [*masks.items(),
                 *(("a weight or bias of the attention", t) for t in tensors[3:]),
                 *zip(("query", "key", "value"), tensors[:3])]
        for name, t in named:
            if isinstance(t, torch.Tensor) and ft.is_functorch_wrapped_tensor(t):
                raise RuntimeError(batched(name) if ft.is_batchedtensor(t)
                                   else f"{name} {FUNC_TRANSFORMS}")
    for name, t in masks.items():
        if isinstance(t, torch.Tensor) and _has_tangent((t,)):
            raise NotImplementedError(
                f"{name} carries a forward-mode tangent (a dual tensor): mha_ext has no "
                f"forward-mode AD (jvp) for its masks; use torch's own attention for it")


def refuse_transformed(masks, tensors) -> None:
    """refuse_unrecordable at a call's entry, on its arguments as given, when
    one is a tensor of a torch.func transform: what the call derives from
    them is the transform's too, and the call's own work (a module made,
    drawing its initialisation) would meet the transform first."""
    if _transformed(masks, tensors):
        refuse_unrecordable(masks, tensors)


def _transformed(masks, tensors) -> bool:
    """Whether a mask or tensor is a tensor of a torch.func transform."""
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    return any(isinstance(t, torch.Tensor) and wrapped(t) for t in (*masks.values(), *tensors))


def records(core, opts, tensors) -> bool:
    """Whether a call must go through AttentionFunction: autograd records it
    (grad mode on and a tensor requiring grad), it has dropout or a head mask
    to differentiate, a tensor carries a forward-mode tangent, or torch.jit.trace
    is recording (the plain path's result would be traced as a constant;
    refuse_traced_tensors refuses what the traced op cannot take).  What no
    path can record is refused first (refuse_unrecordable)."""
    refuse_unrecordable({n: opts.get(n) for n in _MASKS_AND_HEAD}, tensors)
    if torch.jit.is_tracing():  # the trace's PythonOp, not a constant; and what
        refuse_traced_tensors(opts)  # that op cannot take as an input, refused
        return True
    return bool((torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
                or mask_inputs(opts) or opts.get("dropout") or opts.get("head_mask_input")
                or (core.training and core.dropout > 0) or _has_tangent(tensors))


def refuse_traced_tensors(opts) -> None:
    """Under torch.jit.trace a call is one PythonOp whose tensor inputs are
    query, key, value and the parameters: a mask (or a head mask) rides in
    opts, which the trace cannot record (torch's tracer fails with its own
    "unordered_map::at", or, off grad, fixed the trace-time values).  Say so."""
    if torch.jit.is_tracing():
        named = [k for k, v in opts.items() if isinstance(v, torch.Tensor)]
        if named:
            raise RuntimeError(
                f"torch.jit.trace cannot record mha_ext's {', '.join(named)} (they are not "
                f"inputs of its autograd function): trace the call without them "
                f"(is_causal=..., window=... are recorded as constants), or run the model "
                f"eagerly or under torch.compile")


def attention(core, opts, query, key, value, *params):
    """AttentionFunction.apply(core, opts, query, key, value, *params); or,
    when autograd will record nothing (grad mode off, as under no_grad and
    inference_mode, or no tensor requiring grad) and there is no dropout,
    the core's plain forward: nothing copied or kept for a backward."""
    if records(core, opts, (query, key, value, *params)):
        return _apply(core, opts, query, key, value, *params)
    return _plain(core, opts, query, key, value, _parts(core, params))


# module -> (core, key, Parts): the plain path's parameter views, kept
# between calls (outside the module's __dict__: a deepcopy or pickle of the
# module must not carry views of another module's memory)
_KEPT: weakref.WeakKeyDictionary[Any, tuple] = weakref.WeakKeyDictionary()


def attention_kept(module, core, opts, query, key, value, sources, get_params,
                   get_packed=None):
    """attention(core, opts, query, key, value, *get_params()) for a torch
    module whose parameter tensors are `sources` (None where absent), with
    get_params() (the parameters made from those very tensors) called only
    when the views are not kept already; a call autograd records takes
    get_packed()'s tensors instead where it gives them (not None: the
    Function's opts["packed"]).  The plain path reuses
    the Parts (NumPy views) of the module's last plain call while every
    source still is the same memory read the same way: the same address,
    dtype, shape, strides, type and negation/conjugation flags (a hit reads
    exactly what new views would).  Writes in place (an optimizer step,
    load_state_dict, .data.copy_) are read through the views; a new tensor
    (.data = ..., .double(), a new Parameter) makes new views.  Only
    registered Parameters are kept: a parametrization (or functional_call's
    plain tensors) gives new tensors each call, which would only be held.
    This spares the parameters' conversions of a call (B 1, S 1, E 768:
    about a sixth of the drop-in's call)."""
    present = tuple(t for t in sources if t is not None)
    if records(core, opts, (query, key, value, *present)):
        packed = get_packed() if get_packed is not None else None
        if packed is not None:
            return _apply(core, dict(opts, packed=True), query, key, value, *packed)
        return _apply(core, opts, query, key, value, *get_params())
    memory = None  # kept only for registered parameters (not a parametrization's
    if all(t is None or isinstance(t, torch.nn.Parameter) for t in sources):  # new tensors)
        try:
            memory = tuple(None if t is None else (t.data_ptr(), t.dtype, t.shape, t.stride(),
                                                   type(t), t.is_neg(), t.is_conj())
                           for t in sources)
        except (RuntimeError, TypeError, ValueError):  # no storage (vmap's, fake): not
            memory = None                              # kept; _parts says what is wrong
    try:
        kept = _KEPT.get(module) if memory is not None else None
    except TypeError:  # a module class that cannot be a weak key: nothing kept
        memory = kept = None
    if kept is not None and kept[0] is core and kept[1] == memory:
        parts = kept[2]
    else:
        params = get_params()
        parts, arrays = _parts_arrays(core, params)
        # kept only when every array is a view of its tensor (not a copy:
        # a conjugated or negated view is resolved into new memory)
        if memory is not None and all(a.__array_interface__["data"][0] == p.data_ptr()
                                      for a, p in zip(arrays, params)):
            _KEPT[module] = (core, memory, parts)
    return _plain(core, opts, query, key, value, parts)


def _parts_arrays(core, params):
    """(Parts of the C call, their arrays) from the parameter tensors (those
    the core's block has, the first len(seed_keys(core)); views, no copy for
    float CPU tensors)."""
    arrays = [to_numpy(p, "parameters") for p in params[:len(seed_keys(core))]]
    return _params.parts(core, arrays), arrays


def _parts(core, params):
    """The Parts of the C call from the parameter tensors."""
    return _parts_arrays(core, params)[0]


def _plain(core, opts, query, key, value, parts):
    """The core's plain forward on tensors: (output, weights), weights an
    empty tensor when not asked for."""
    q = to_numpy(query, "query")
    k = q if key is query else to_numpy(key, "key")
    v = k if value is key else (q if value is query else to_numpy(value, "value"))
    out, weights = _forward_plain(core, q, k, v, parts, opts)
    out = to_tensor(out)
    return out, torch.empty(0, dtype=out.dtype) if weights is None else to_tensor(weights)


def _has_tangent(tensors):
    """Whether a tensor carries a forward-mode tangent (a dual tensor, which
    no_grad does not stop): the Function path then says it has no jvp,
    where the plain path would drop the tangent without a word."""
    if getattr(_forward_ad, "_current_level", 0) < 0:  # no dual level open
        return False
    return any(_forward_ad.unpack_dual(t).tangent is not None for t in tensors)


def _forward_plain(core, q, k, v, parts, opts):
    """core's plain forward (the module's call) with the parameters `parts`
    and forward_train's keywords `opts` (no dropout): (output, weights)."""
    call = _calls.prepare(core, q, k, v, opts.get("mask"), opts.get("attn_mask"),
                          opts.get("key_padding_mask"), opts.get("is_causal", False),
                          opts.get("need_weights", True), opts.get("average_weights", False),
                          opts.get("masked_rows", "nan"), dtype=core.dtype,
                          scale=opts.get("scale"), window=opts.get("window"),
                          head_mask=opts.get("head_mask"), layout=opts.get("layout"))
    out, weights = _calls.c_forward(core, call, params=parts)
    return _calls.shape_output(call, out, weights)


# what the attention weights do not depend on: the values' path and W_o
_WEIGHTS_ONLY = ("value",) + _ag.VALUE_PATH

def _gradients(ctx, saved, saved_tensors, grad_out, grad_weights):
    # [d query, d key, d value, d params...] as tensors, None where not needed
    # (saved: the forward's context, filled again)
    core = ctx.core
    if grad_out is None:  # a loss on the weights alone: no 0·NaN from the value path
        saved = _ag.without_value_path(core, saved)
    go = np.zeros_like(saved.output) if grad_out is None else to_numpy(grad_out, "grad_out")
    gw = None
    if grad_weights is not None and saved.weights is not None:
        gw = to_numpy(grad_weights, "grad_weights")
    n_masks = len(ctx.masks)
    need = ctx.needs_input_grad
    want_masks = n_masks and any(need[-n_masks:])
    grads = _ag.backward(core, saved, go, gw, head_mask_grad=ctx.hm_input,
                         scores_grad=want_masks)
    # only the weights reached the loss (an attention-map loss): what they do
    # not depend on gets None, as from torch (not zeros, which an optimiser's
    # weight decay and momentum would act on)
    off = _WEIGHTS_ONLY if grad_out is None else ()
    inputs = [torch.from_numpy(grads[k]) if need[2 + i] and k not in off else None
              for i, k in enumerate(("query", "key", "value"))]
    groups = _params.groups(core, ctx.packed)  # block order: bias_k, bias_v last
    params = [None if not need[5 + i] or all(k in off for k in group) else
              torch.from_numpy(np.ascontiguousarray(grads[group[0]])) if len(group) == 1 else
              torch.from_numpy(np.concatenate([np.zeros_like(grads[k]) if k in off else grads[k]
                                               for k in group]))
              for i, group in enumerate(groups)]
    # parameters outside the core's block (the head mask and the masks,
    # saved last, are not)
    unused = saved_tensors[3 + len(groups):len(saved_tensors) - ctx.hm_input - n_masks]
    # (one that needs a gradient requires grad, so forward saved it)
    params += [torch.zeros_like(p) if need[5 + len(groups) + i] else None
               for i, p in enumerate(unused)]
    if ctx.hm_input:
        params.append(torch.from_numpy(grads["head_mask"]) if need[-1 - n_masks] else None)
    if n_masks:
        # dL/d mask: the masked scores' gradient over the given keys (not
        # add_bias_kv's and add_zero_attn's), summed over the axes along
        # which the mask (as the C call took it) was broadcast
        g = grads["scores"][..., :saved._key.shape[1]] if want_masks else None
        for i, (at, shape, dtype) in enumerate(ctx.masks):
            if not need[len(need) - n_masks + i]:
                params.append(None)
                continue
            taken = saved._masks[at][1].shape
            gm = torch.from_numpy(np.ascontiguousarray(g)).sum_to_size(taken)
            params.append(gm.reshape(shape).to(dtype))
    return inputs + params
