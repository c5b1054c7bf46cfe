"""mha_ext.hf: mha_ext's SDPA twin as a Hugging Face ``transformers``
attention implementation.

    import mha_ext.hf
    from transformers import AutoModelForCausalLM, LlamaConfig

    mha_ext.hf.register()                    # once per process: adds "mha_ext"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="mha_ext")
    model.set_attn_implementation("mha_ext") # or switch a model you already have

Every model whose attention layer calls
``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)``
(in transformers 5.23: BERT, GPT-2, BART, T5, Llama and most decoders)
then computes its attention with ``mha_ext.scaled_dot_product_attention``,
forward and backward in C.  No model needed patching: T5's relative position
bias and BART's cross-attention arrive through the same interface.  Models
with their own attention code do not, and ``register`` makes constructing
one under the name a ValueError (transformers 5.23: Bloom, MPT, CodeGen,
Falcon, GPT-J, GPT-Neo, XGLM, RoFormer, MegatronBERT, WavLM and others):
transformers would otherwise hand their eager attention the masks built for
the name, SDPA's (None for a causal one, True = attend), and compute wrong
numbers without an error.  A refused ``from_config`` leaves the config it
was given as it was (transformers writes the name into it first, and a
model already built on it would then compute so), and a refused
``set_attn_implementation`` the model's config and sub-configs.  The test is the one
transformers' ``_can_set_attn_implementation()`` makes (the model's module defines an
attention class of its own and does not call the interface), except that a
model whose source cannot be read (a notebook's class) is let through, as
is one indexing ``ALL_ATTENTION_FUNCTIONS[...]`` (transformers 4's
spelling).  One of transformers' models that refuse "sdpa" (``_supports_
sdpa = False``) is refused too unless it was checked under the name
(``_CHECKED``: some compute other numbers under what "sdpa" would do).  A
layer that picks its attention class from a table of names
of its own (GIT's text layers, SAM's vision layers:
``GIT_SELF_ATTENTION_CLASSES``) finds the name there as a refusal: the
model is a ValueError at construction (a bare KeyError before), while one
of the same module whose layers do not look there (GIT's vision model)
takes the name.

What ``attention_forward`` does is what transformers' own "sdpa" function
does, with mha_ext's twin in place of ``torch.nn.functional.
scaled_dot_product_attention``:

- query (B, H, L, D), key and value (B, Hkv, S, D) -> output (B, L, H, D),
  contiguous, and ``None`` for the attention weights (like "sdpa").
- ``attention_mask``: None, or a 4-D mask broadcastable to (B, H, L, S),
  bool (True = attend, SDPA's polarity) or float (added to the scores).  The
  masks are built by transformers' ``sdpa_mask`` (``register`` sets it for
  the name), so padding, causal and sliding-window patterns arrive inside the
  mask and need nothing here.  Unlike "sdpa"'s, a causal mask is never left
  out for the layer's is_causal flag to stand in for it: transformers keeps
  "sdpa" away from the models where the flag is wrong (decoders not flagged
  causal: NLLB-MoE, PEGASUS-X; Gemma 4's shortened
  queries), and those guards test the name "sdpa".  (PaliGemma without
  token_type_ids: "sdpa"'s text attends to later tokens there, its layers
  not flagged causal; "mha_ext" gives eager's numbers.)  A bool mask of exactly
  the lower-right causal pattern is computed as ``is_causal="lower_right"``
  (the same bits; the blocked blocks skipped).
- ``is_causal`` (top-left) only where "sdpa" uses it: more than one query,
  no mask, and the layer causal (the argument, else ``module.is_causal``).
- ``scaling`` -> ``scale`` (T5 passes 1.0); ``dropout`` -> ``dropout_p``
  (the models pass 0.0 in eval mode).
- GQA: fewer key/value heads than query heads -> ``enable_gqa=True``.
- T5's ``position_bias`` (1 or B, H, L, S) is folded into a float mask, as
  "sdpa" does: bias where the mask attends, the dtype's lowest value where it
  blocks (the causal pattern too when there is no mask).
- A float mask that needs a gradient (T5's bias while training) gets it
  from the twin (the C backward's gradient of the masked scores).

Refused with a clear error instead of computed wrongly: ``softcap``,
attention sinks (``s_aux``, or ``sinks`` as Inkling 2 names them), a
``head_mask`` (gone from transformers 5), sparse attention ``indices`` or
``block_indices`` (DeepSeek-V3.2's and MiniMax-M3's indexers), a paged
cache (continuous batching).  ``output_attentions=True`` gives ``None``
weights, as with "sdpa".

This module is imported only on request; it needs torch and transformers.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, Optional, Tuple, Union

try:
    import torch
except ModuleNotFoundError as _exc:
    from ._need_torch import needs_torch
    needs_torch(_exc, "mha_ext.hf (with transformers)")

import mha_ext

__all__ = ["NAME", "attention_forward", "register"]

NAME = "mha_ext"

_NAMES: set = set()  # the names register() gave mha_ext (the guard's)


def _twin() -> Callable[..., torch.Tensor]:
    """The SDPA function every call goes through: mha_ext's twin of
    torch.nn.functional.scaled_dot_product_attention.  The one place that
    names it (tests replace this function to count or spy on calls)."""
    fn = getattr(mha_ext, "scaled_dot_product_attention", None)
    if fn is None:
        raise ImportError(
            "mha_ext.hf needs mha_ext.scaled_dot_product_attention (the SDPA "
            "twin of issue 12, point 3), which this build of mha_ext does not "
            "have")
    return fn


def _refuse_unsupported(kwargs: Dict[str, Any]) -> None:
    if kwargs.get("softcap") is not None:
        raise ValueError(
            "attn_implementation='mha_ext' does not support softcap (logit "
            "soft-capping); use 'eager' for this model")
    for name in ("s_aux", "sinks"):  # GPT-OSS's and others'; Inkling 2's
        if kwargs.get(name) is not None:
            raise ValueError(
                "attn_implementation='mha_ext' does not support attention sinks "
                f"({name}); use 'eager' for this model")
    if kwargs.get("head_mask") is not None:
        raise ValueError(
            "attn_implementation='mha_ext' does not take a head_mask (removed "
            "in transformers 5); multiply the heads' outputs yourself or use "
            "'eager'")
    for name, what in (("indices", "a DeepSeek-V3.2-style indexer's top-k keys"),
                       ("block_indices", "MiniMax-M3's indexer's key blocks")):
        if kwargs.get(name) is not None:
            raise ValueError(
                f"attn_implementation='mha_ext' does not take sparse attention indices "
                f"({name}=: {what}, which the model folds into the mask only for 'eager' "
                f"and 'sdpa'); use 'sdpa' for this model")
    cache = kwargs.get("cache")
    if cache is not None and type(cache).__name__ == "PagedAttentionCache":
        raise NotImplementedError(
            "attn_implementation='mha_ext' does not support a paged cache "
            "(continuous batching); use 'sdpa' for it")


def _fold_position_bias(position_bias: torch.Tensor,
                        attention_mask: Optional[torch.Tensor],
                        is_causal: bool, L: int, S: int) -> torch.Tensor:
    """T5's additive relative-position bias and the mask as one float mask.

    position_bias is (1 or B, H, L, S); attention_mask None, bool (True =
    attend) or float (additive).  Blocked places get the dtype's lowest value,
    as "sdpa" gives them, so a row with every key blocked computes the same
    numbers there too."""
    lowest = torch.finfo(position_bias.dtype).min
    if attention_mask is None:
        if not is_causal:
            return position_bias
        i = torch.arange(L, device=position_bias.device)[:, None]
        j = torch.arange(S, device=position_bias.device)[None, :]
        return torch.where((j <= i).view(1, 1, L, S), position_bias, lowest)
    if attention_mask.dtype == torch.bool:
        return torch.where(attention_mask, position_bias, lowest)
    return position_bias + attention_mask


def _lower_right_causal(mask: torch.Tensor, L: int, S: int) -> bool:
    """Whether `mask` is a bool (1 or B, 1, L, S) mask (True = attend) of
    exactly the lower-right causal pattern (query i sees keys j <= i + S - L)
    in every batch row: what sdpa_mask builds for a causal layer without
    padding.  Asked anew in every layer (a comparison of B·L·S bools against
    the attention's B·H·L·S·D multiply-adds): a mask's contents can change
    without its version counter moving (through .data or NumPy), and
    inference tensors have none."""
    if (mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1
            or tuple(mask.shape[2:]) != (L, S) or S < L or mask.is_meta
            or torch.jit.is_tracing() or torch.compiler.is_compiling()):
        return False
    pattern = torch.ones(L, S, dtype=torch.bool, device=mask.device).tril(S - L)
    return bool(torch.equal(mask, pattern.expand(mask.shape)))


def attention_forward(module: torch.nn.Module, query: torch.Tensor,
                      key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor],
                      dropout: float = 0.0, scaling: Optional[float] = None,
                      is_causal: Optional[bool] = None,
                      position_bias: Optional[torch.Tensor] = None,
                      **kwargs: Any) -> Tuple[torch.Tensor, None]:
    """transformers' attention-function contract, computed by mha_ext.

    module: the calling attention layer (read: ``is_causal``).
    query (B, H, L, D); key (B, Hkv, S, D); value (B, Hkv, S, Dv), H a
    multiple of Hkv; attention_mask None or 4-D, bool (True = attend) or
    float (added).  Returns (output (B, L, H, Dv) contiguous, None).
    """
    _refuse_unsupported(kwargs)
    if kwargs.get("output_attentions", False):
        warnings.warn(
            "attn_implementation='mha_ext' returns no attention weights "
            "(output_attentions=True gives None, as with 'sdpa'); use "
            "'eager' to get them", stacklevel=2)
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(
            "attention_forward expects query, key and value of 4 dimensions "
            f"(B, H, L, D); got query {tuple(query.shape)}, key "
            f"{tuple(key.shape)}, value {tuple(value.shape)}")
    L, S = query.shape[2], key.shape[2]
    enable_gqa = key.shape[1] != query.shape[1]

    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    # "sdpa"'s rule: the flag only for a causal layer's prefill without a
    # mask; one query (a decoding step) sees every cached key.
    causal: Union[bool, str] = bool(L > 1 and attention_mask is None and is_causal)

    if position_bias is not None:
        attention_mask = _fold_position_bias(position_bias, attention_mask,
                                             bool(causal), L, S)
        causal = False
    elif attention_mask is not None and _lower_right_causal(attention_mask, L, S):
        # the causal mask _mask_builder always builds, when it blocks nothing
        # else: the twin's causal pass, which skips the blocked blocks (the
        # same bits as the mask; half the work of a long prefill)
        attention_mask, causal = None, "lower_right"

    out = _twin()(query, key, value, attn_mask=attention_mask,
                  dropout_p=dropout, is_causal=causal, scale=scaling,
                  enable_gqa=enable_gqa)
    # (B, H, L, Dv) -> (B, L, H, Dv): the layout every model reshapes to
    # (B, L, H * Dv) before its output projection.
    return out.transpose(1, 2).contiguous(), None


def register(name: str = NAME) -> str:
    """Make ``attn_implementation=name`` ("mha_ext" by default) compute
    attention with mha_ext, in every model of this process.

    Registers ``attention_forward`` in transformers' ``AttentionInterface``
    and transformers' own ``sdpa_mask`` as the mask builder for the name in
    ``AttentionMaskInterface`` (without it transformers would pass no mask at
    all to an unknown name), and makes a model whose attention does not go
    through that interface refuse the name at construction (a ValueError;
    see _guard_models).  Idempotent; returns the name.  A name taken by
    another implementation ('sdpa', 'flash_attention_2', ...) is a
    ValueError; ImportError when this mha_ext has no SDPA twin.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    taken = AttentionInterface()
    if (not isinstance(name, str) or not name or name == "eager"
            or (name in taken and taken[name] is not attention_forward)):
        raise ValueError(
            "register(name): name must be a non-empty str that names no "
            "other attention implementation (not 'eager', "
            f"{', '.join(repr(k) for k in taken if taken[k] is not attention_forward)}), "
            f"got {name!r}")
    _twin()
    # the mask builder and the guard before the name itself: transformers
    # takes the name from its AttentionInterface entry on, so an exception
    # part way (a Ctrl-C) leaves it unknown, never taken without its masks
    # or its guard
    AttentionMaskInterface.register(name, _mask_builder(sdpa_mask))
    _NAMES.add(name)
    _guard_models()
    AttentionInterface.register(name, attention_forward)
    return name


def _mask_builder(sdpa_mask: Callable[..., Any]) -> Callable[..., Any]:
    """transformers' sdpa_mask that never leaves a causal mask out.

    For "sdpa" transformers skips the causal mask (None) where the call can
    rely on SDPA's is_causal flag, and keeps "sdpa" away from the models
    where that reliance fails: those whose decoder layers are not flagged
    causal (``_supports_sdpa = False``: NLLB-MoE, PEGASUS-X
    decoders would see later tokens) and calls it cuts short itself (Gemma 4's
    KV-shared layers test ``_attn_implementation == "sdpa"`` before keeping
    fewer queries than keys without a mask).  Under another name those
    guards do not fire, so here the mask is always built: the same
    positions, nothing inferred from a flag.  A mask with nothing blocked
    besides (no padding, non-causal) may still be left out, as for "sdpa"."""
    if _BUILDERS.get(sdpa_mask) is None:
        def mask(*args: Any, **kwargs: Any) -> Any:
            kwargs["allow_is_causal_skip"] = False
            return sdpa_mask(*args, **kwargs)

        mask.__wrapped__ = sdpa_mask  # type: ignore[attr-defined]
        _BUILDERS[sdpa_mask] = mask
    return _BUILDERS[sdpa_mask]


_BUILDERS: Dict[Any, Callable[..., Any]] = {}  # one builder a sdpa_mask (register: idempotent)


_OWN: Dict[type, bool] = {}


def _own_attention(cls: type) -> bool:
    """Whether model class `cls` computes attention with its own code: its
    module defines a class ``*Attention*(nn.Module)`` and never names
    ALL_ATTENTION_FUNCTIONS (transformers' own test in
    _can_set_attn_implementation, which also calls the interface's users
    who index it rather than call get_interface "own", and a module whose
    source cannot be read; here such a model is let through: False)."""
    if cls not in _OWN:
        import inspect
        import re
        import sys
        own = False
        for module_name in _model_modules(cls):  # a user's subclass: its bases' modules too
            try:
                code = inspect.getsource(sys.modules[module_name])
            except (KeyError, OSError, TypeError):
                code = ""
            own = own or (bool(re.search(r"^class \w*Attention\w*\(nn\.Module\):", code, re.M))
                          and "ALL_ATTENTION_FUNCTIONS" not in code)
        _OWN[cls] = own
    return _OWN[cls]


# transformers' models that refuse "sdpa" (_supports_sdpa = False) and were
# checked under the name against "eager" (float64, with padding, generate,
# gradients) or refuse what they cannot take at their first call (s_aux,
# sparse indices); the others of that kind are refused (_unchecked)
_CHECKED = frozenset({
    "deepseek_v4", "flint", "gemma2", "git", "gpt_oss", "granite_swa", "granitemoe_swa",
    "hy_v4", "longt5", "markuplm", "nllb_moe", "pegasus_x", "speech_to_text",
    "switch_transformers", "t5gemma", "time_series_transformer"})


def _unchecked(cls: type) -> bool:
    """Whether `cls` is (or derives from) one of transformers' models that
    do not take "sdpa" and is not in _CHECKED.  attention_forward computes
    what "sdpa" would, and transformers never ran "sdpa" on these: some
    compute other numbers under it (Splinter's, ALIGN's and CLAP's text
    layers, without is_causal, became causal; BigBird-Pegasus's encoder and
    Informer's ProbSparse layers add the bool masks to their scores).  A
    user's own model (no transformers base) is let through."""
    if getattr(cls, "_supports_sdpa", False):
        return False
    kinds = [m.split(".")[2] for m in _model_modules(cls) if m.startswith("transformers.models.")]
    return bool(kinds) and not any(k in _CHECKED for k in kinds)


def _model_modules(cls: type) -> list:
    """The modules defining `cls` and its model bases (a user's subclass of
    GitForCausalLM in a script: the script's and modeling_git's), not
    transformers' own PreTrainedModel's."""
    from transformers import PreTrainedModel
    names = []
    for c in getattr(cls, "__mro__", (cls,)):
        if isinstance(c, type) and issubclass(c, PreTrainedModel) and c is not PreTrainedModel \
                and c.__module__ not in names and c.__module__ != PreTrainedModel.__module__:
            names.append(c.__module__)
    return names


def _same_config_modules(model: Any) -> Any:
    """model's modules, not those inside a sub-model of another config (SAM's
    vision encoder under its vision_config: a request per sub-config may keep
    it on "sdpa", and transformers asks about it apart)."""
    from transformers import PreTrainedModel
    stack = [model]
    while stack:
        m = stack.pop()
        yield m
        stack.extend(c for c in m.children()
                     if not (isinstance(c, PreTrainedModel)
                             and getattr(c, "config", None) is not getattr(model, "config", None)))


def _refuse_in_tables(cls: type, name: str) -> None:
    """Give the attention tables of `cls`'s module (``GIT_SELF_ATTENTION_
    CLASSES = {"eager": ...}``, SAM's vision layers': a class a name, looked
    up by the layers that have their own attention code) an entry for
    `name` that refuses it, by the table's name: a layer built from one then
    raises the guard's ValueError instead of a bare KeyError, and a model
    of that module whose layers never look there (GIT's vision model) still
    takes the name."""
    for table_name, table in _tables(cls):
        if name not in table:
            has = tuple(k for k, v in table.items() if not getattr(v, "_mha_ext_refusal", False))

            def refuse(*args: Any, _t: str = table_name, _has: tuple = has,
                       **kwargs: Any) -> Any:
                raise ValueError(
                    f"this layer picks its attention class from {_t}, which has "
                    f"{', '.join(repr(k) for k in _has)} only: its attention is its own "
                    f"code, not transformers' AttentionInterface, so attn_implementation="
                    f"{name!r} (mha_ext) cannot compute it; use attn_implementation="
                    f"{_has[0]!r} for this model")
            refuse._mha_ext_refusal = True  # type: ignore[attr-defined]
            table[name] = refuse


def _tables(cls: type) -> list:
    """(name, dict) of the attention tables of `cls`'s module: module-level
    dicts named ``*ATTENTION_CLASSES`` (an implementation's name -> a layer
    class with its own attention code)."""
    import sys
    modules = [sys.modules.get(n) for n in _model_modules(cls)]
    return [(k, v) for module in modules if module is not None for k, v in vars(module).items()
            if k.endswith("ATTENTION_CLASSES") and isinstance(v, dict) and v]


def _holds_own_attention(model: Any) -> bool:
    """Whether a built `model` (set_attn_implementation) holds, under its
    own config, layers with attention code of their own: built from its
    module's attention tables (GIT's text layers, switched to the name,
    lost their causal mask), or a sub-model of such a class that shares its
    config (transformers does not ask about that one apart)."""
    from transformers import PreTrainedModel
    mods = list(_same_config_modules(model))
    classes = {v for _, t in _tables(type(model)) for v in t.values() if isinstance(v, type)}
    return any(type(m) in classes for m in mods) or any(
        _own_attention(type(m)) or _unchecked(type(m))
        for m in mods[1:] if isinstance(m, PreTrainedModel))


def _guard_models() -> None:
    """Wrap transformers' PreTrainedModel.get_correct_attn_implementation
    (once): a model class that cannot take a registered implementation (its
    attention code does not use ALL_ATTENTION_FUNCTIONS: _own_attention)
    refuses a name of _NAMES with a ValueError.  transformers would accept
    the name, build that model's masks with sdpa_mask and hand them to its
    eager attention, which
    expects an additive float mask: Bloom lost its causal mask (None),
    MPT's padding was inverted, CodeGen and XGLM computed other numbers, all
    without an error and without calling mha_ext.  So does a built model
    holding such layers under its own config (_holds_own_attention).  Runs
    at construction (from_config, from_pretrained) and in
    set_attn_implementation, which skips such a model with transformers'
    own warning before asking."""
    from transformers import PreTrainedModel

    _keep_configs_on_refusal()
    original = PreTrainedModel.get_correct_attn_implementation
    if getattr(original, "_mha_ext_guard", False):
        return

    def get_correct_attn_implementation(self, requested_attention, is_init_check=False):
        if isinstance(requested_attention, str) and requested_attention in _NAMES:
            _refuse_in_tables(type(self), requested_attention)
            if _own_attention(type(self)) or _holds_own_attention(self):
                raise ValueError(
                    f"{type(self).__name__} computes attention with its own code, not through "
                    f"transformers' AttentionInterface, so attn_implementation="
                    f"{requested_attention!r} (mha_ext) cannot compute it, and the masks built "
                    f"for that name (SDPA's) would give its own attention wrong numbers: use "
                    f"attn_implementation='eager' (or 'sdpa' where the model has it) for this "
                    f"model")
            if _unchecked(type(self)):
                raise ValueError(
                    f"{type(self).__name__} is one of transformers' models that do not take "
                    f"attn_implementation='sdpa' (_supports_sdpa = False), and "
                    f"{requested_attention!r} (mha_ext) computes what 'sdpa' would: for this "
                    f"model that has not been checked (some such models compute other numbers "
                    f"under it), so it is refused; use attn_implementation='eager'")
        return original(self, requested_attention, is_init_check)

    get_correct_attn_implementation._mha_ext_guard = True  # type: ignore[attr-defined]
    get_correct_attn_implementation.__wrapped__ = original  # type: ignore[attr-defined]
    get_correct_attn_implementation.__doc__ = original.__doc__
    setattr(PreTrainedModel, "get_correct_attn_implementation", get_correct_attn_implementation)


def _config_tree(config: Any) -> list:
    """`config` and its sub-configs (text_config, vision_config, ...), nested."""
    seen: list = []
    stack = [config]
    while stack:
        c = stack.pop()
        if c is None or any(c is s for s in seen):
            continue
        seen.append(c)
        stack.extend(getattr(c, k, None) for k in (getattr(c, "sub_configs", None) or {}))
    return seen


def _keep_configs_on_refusal() -> None:
    """Wrap transformers' PreTrainedModel._from_config and
    set_attn_implementation (once each) so that a call that fails after
    taking a name of _NAMES (the guard's ValueError) leaves the config it
    was given, or the model's, as it was, nested sub-configs included.
    transformers writes the requested implementation into that config
    first: from_config copies nothing (unlike from_pretrained), so a
    refused ``from_config(model.config, attn_implementation="mha_ext")``
    left the config on "mha_ext" and the model already built on it
    (Falcon, Bloom, MPT, ...: their own attention code) then ran its eager
    attention on the SDPA masks built for the name, other numbers without
    an error; a refused ``set_attn_implementation`` of a composite model
    (SAM) left its top config on the name."""
    from transformers import PreTrainedModel

    def keeping(original: Any, config_of: Any) -> Any:
        if getattr(original, "_mha_ext_guard", False):
            return None

        def call(first: Any, *args: Any, **kwargs: Any) -> Any:
            config = config_of(first, args, kwargs)
            before = [(c, getattr(c, "_attn_implementation_internal", None))
                      for c in _config_tree(config)]
            try:
                return original(first, *args, **kwargs)
            except BaseException:
                now = [getattr(c, "_attn_implementation_internal", None) for c, _ in before]
                if any(isinstance(v, str) and v in _NAMES and v != was
                       for v, (_, was) in zip(now, before)):
                    for c, was in before:
                        c._attn_implementation_internal = was
                raise

        call._mha_ext_guard = True  # type: ignore[attr-defined]
        call.__wrapped__ = original  # type: ignore[attr-defined]
        call.__doc__ = original.__doc__
        return call

    from_config = keeping(PreTrainedModel.__dict__["_from_config"].__func__,
                          lambda cls, args, kwargs: args[0] if args else kwargs.get("config"))
    if from_config is not None:
        setattr(PreTrainedModel, "_from_config", classmethod(from_config))
    set_impl = keeping(PreTrainedModel.set_attn_implementation,
                       lambda model, args, kwargs: getattr(model, "config", None))
    if set_impl is not None:
        setattr(PreTrainedModel, "set_attn_implementation", set_impl)
