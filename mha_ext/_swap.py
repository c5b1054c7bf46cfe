"""Swapping mha_ext into a torch model: every torch.nn.MultiheadAttention
submodule replaced by an mha_ext.torch.MultiheadAttention that shares its
state (the same parameters, out_proj and hooks; what the block changes in
it, from train()/eval() to load_state_dict(assign=True), the original has
after), and put back after.

Because the parameters are shared, gradients computed inside the swap land
in the model's own parameters and an optimiser built on
``model.parameters()`` keeps working.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import TYPE_CHECKING, Generic, TypeVar

from torch import nn
from torch.nn.utils import parametrize

from ._core import _Guarded
from ._torch_fn import drop_hooks, holds, register_our_pre_hook
from ._torch_errors import TORCH_MHA
from ._torch_mha import MultiheadAttention, _use_our_forward

__all__ = ["attention_modules", "swap_in", "restore", "swapped", "sharing", "finish"]


def attention_modules(model):
    """[(qualified name, module)] of every torch.nn.MultiheadAttention in
    model (the model itself included), in named_modules() order, under each
    name it has (one module reachable by two names is listed twice); ours
    (mha_ext.torch.MultiheadAttention, a subclass) are mha_ext's already and
    left out.  Another subclass is a TypeError: its own forward or methods
    would not run."""
    found = []
    for name, m in model.named_modules(remove_duplicate=False):
        if isinstance(m, TORCH_MHA) and not isinstance(m, MultiheadAttention):
            if type(m) is not TORCH_MHA and not _parametrized(m):
                raise TypeError(
                    f"{name or 'the model'} is a {type(m).__qualname__}, a subclass of "
                    f"torch.nn.MultiheadAttention: mha_ext computes torch's class only, and "
                    f"a subclass's own forward or methods would not run (convert it "
                    f"yourself, or leave it out)")
            found.append((name, m))
    return found


def _parametrized(m):
    """Whether m is torch's own class under torch.nn.utils.parametrize (the
    class parametrize made for it: properties, no forward of its own)."""
    return parametrize.is_parametrized(m) and type(m).__bases__ == (TORCH_MHA,)


def _body(cls):
    """What parametrize put into its class `cls` (the properties of the
    parametrized tensors, its pickling refusal), to make the same class on
    another base."""
    return {k: v for k, v in vars(cls).items()
            if k not in ("__module__", "__qualname__", "__doc__", "__dict__", "__weakref__")}


def _properties(cls):
    return {k for k, v in vars(cls).items() if isinstance(v, property)}


def _plain(key):
    """An attribute the swapped-in module copies in and restore() copies
    back (training, dropout, batch_first, a backward hook's kind), not one
    of the shared dicts and sets of its state."""
    return not key.startswith("_") or key == "_is_full_backward_hook"


def sharing(module):
    """An mha_ext.torch.MultiheadAttention computing with `module`'s own
    state: the same dict objects for its parameters, buffers, submodules
    (out_proj) and hooks, so what the block does to the swapped-in module
    (load_state_dict(assign=True), a hook registered or removed) is done to
    `module`; its plain attributes (training, dropout, ...) are copied, and
    put back by restore()."""
    # made on the meta device, its own parameters never used (the shared
    # dicts replace them): no parameter of `module` is read here (a read
    # would run a parametrization, spectral_norm's power iteration, once
    # more than torch does); add_bias_kv decides its plain attributes
    new = MultiheadAttention(module.embed_dim, module.num_heads, module.dropout,
                             add_bias_kv=holds(module, "bias_k"),
                             add_zero_attn=module.add_zero_attn, kdim=module.kdim,
                             vdim=module.vdim, batch_first=module.batch_first,
                             device="meta")
    for key, value in module.__dict__.items():
        if key.startswith("_") and isinstance(value, (dict, set)) and key in new.__dict__:
            new.__dict__[key] = value  # shared, not copied
        elif _plain(key):
            new.__dict__[key] = value
    if _parametrized(module):
        # parametrize's class for torch's module (a property per parametrized
        # tensor, reading the shared `parametrizations`), made for ours
        new.__class__ = type(type(module).__name__, (MultiheadAttention,), _body(type(module)))
    # the marker that keeps nn.TransformerEncoderLayer off torch's fused
    # kernel, in the shared hooks for the block only (restore() removes it)
    new.__dict__["_mha_ext_marker"] = register_our_pre_hook(new, _use_our_forward)
    return new


def _give_back(old, ours):
    """restore()'s half of sharing(): the marker out of the shared hooks,
    the plain attributes the block may have changed (training, dropout,
    batch_first, a backward hook's kind) back on `old`."""
    marker = ours.__dict__.get("_mha_ext_marker")  # None: given back already
    if marker is not None:
        marker.remove()  # idempotent, and the handle kept until it has run
        ours.__dict__.pop("_mha_ext_marker", None)
    # a parametrization registered or removed inside the block: torch's
    # class for `old` as parametrize leaves it (the shared `parametrizations`
    # holds the tensors; the class, its properties)
    if type(ours) is MultiheadAttention:
        if type(old) is not TORCH_MHA:
            old.__class__ = TORCH_MHA
    elif type(old) is TORCH_MHA or _properties(type(old)) != _properties(type(ours)):
        old.__class__ = type(type(ours).__name__, (TORCH_MHA,), _body(type(ours)))
    for key in old.__dict__:
        if _plain(key) and key in ours.__dict__:
            old.__dict__[key] = ours.__dict__[key]


def _parent(model, name):
    parent = model
    *path, last = name.split(".")
    for part in path:
        parent = getattr(parent, part)
    return parent, last


def swap_in(model, record=None):
    """Replace every stock nn.MultiheadAttention below `model` by one of ours
    sharing its state (sharing()); returns what restore() needs, also put
    into the list `record` (when given) before the first module is
    replaced.  Raises (and changes nothing) if one of them cannot be
    swapped, or if an exception (a Ctrl-C) stops it part way."""
    found = attention_modules(model)
    if any(name == "" for name, _ in found):
        raise TypeError("swap the attention module itself by "
                        "mha_ext.torch.MultiheadAttention.from_torch(module); swapped() "
                        "replaces attention modules inside a model")
    made = {}  # one of ours per module, whatever its number of names
    try:
        for _, old in found:
            if id(old) not in made:
                made[id(old)] = sharing(old)
        new = [(name, old, made[id(old)]) for name, old in found]
        if record is not None:
            record[:] = new
        for name, old, ours in new:
            parent, last = _parent(model, name)
            setattr(parent, last, ours)
    except BaseException:
        # an exception part way (a Ctrl-C between two steps): every step
        # undone, the model as it was
        finish(restore, model, [(name, old, made.get(id(old))) for name, old in found])
        raise
    return new


def restore(model, record):
    """Put back the modules swap_in replaced, with what the block changed
    in the ones that stood in for them.  Idempotent: a second run (after an
    interrupt stopped the first part way) finishes the work; an entry whose
    module of ours is None (swap_in stopped before making it) puts back the
    original and takes our marker out of the hooks it shares."""
    given = set()
    for name, old, ours in record:
        parent, last = _parent(model, name)
        if getattr(parent, last, None) is not old:
            setattr(parent, last, old)
        if ours is None:
            _drop_markers(old)
        elif id(ours) not in given:
            given.add(id(ours))
            _give_back(old, ours)


def _drop_markers(module):
    """Our marker hooks out of `module`'s pre-hook dicts (which a module of
    ours shared with it): sharing() was stopped after registering one and
    before keeping its handle."""
    drop_hooks(module, "forward_pre", lambda fn: fn is _use_our_forward)


def finish(step, *args):
    """step(*args), run once more if an exception (a Ctrl-C landing inside
    it) stops it part way, then that exception raised: for an idempotent
    step that must end done (restore(), compare's own restore)."""
    try:
        step(*args)
    except BaseException:
        step(*args)
        raise


_Model = TypeVar("_Model", bound=nn.Module)


class swapped(_Guarded, contextlib.ContextDecorator, Generic[_Model]):
    """``with mha_ext.torch.swapped(model): model(x)`` -- inside the block
    every torch.nn.MultiheadAttention of model is computed by mha_ext (the
    same parameters, shared); after it the original modules are back, also
    when the block raised.  Entering yields the model.

    A context manager, not a function: ``swapped(model)`` alone changes
    nothing (a RuntimeWarning says so when such an object is dropped
    unused).  `model` must be a torch.nn.Module (a TypeError otherwise);
    the swap itself happens on entering the block, and a model holding no
    torch.nn.MultiheadAttention (ours are left as they are) gives a
    RuntimeWarning there: nothing is swapped.  As a decorator
    (``@swapped(model)``), each call of the function runs inside it."""

    def __init__(self, model: _Model) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"swapped() takes a torch.nn.Module (a model holding "
                            f"torch.nn.MultiheadAttention layers), got {type(model).__name__}")
        self._model = model
        self._record: list | None = None
        self._used = False

    if TYPE_CHECKING:  # _Guarded's (C), calling _enter and _exit from C
        def __enter__(self) -> _Model: ...
        def __exit__(self, *exc: object) -> None: ...

    def _enter(self) -> _Model:
        if self._record is not None:
            raise RuntimeError("this swapped() block is already entered: use a new "
                               "swapped(model) for a nested block")
        self._used = True
        try:
            self._record = []  # filled before the first change
            swap_in(self._model, self._record)
            if not self._record:
                self._nothing_swapped()
        except BaseException:
            # (a Ctrl-C, or a warning made an error): the model as it was
            record, self._record = self._record, None
            if record:
                finish(restore, self._model, record)
            raise
        return self._model

    def _nothing_swapped(self) -> None:
        if any(isinstance(m, MultiheadAttention) for m in self._model.modules()):
            # a block inside another swapped block, or a model of drop-ins
            warnings.warn(f"mha_ext.torch.swapped: this {type(self._model).__name__}'s "
                          f"attention modules are mha_ext's already (an outer swapped block, "
                          f"or mha_ext.torch.MultiheadAttention), so the block changes nothing",
                          RuntimeWarning, stacklevel=3)
        else:  # nothing to compute: say so rather than compare torch with itself
            warnings.warn(f"mha_ext.torch.swapped: this {type(self._model).__name__} holds no "
                          f"torch.nn.MultiheadAttention, so the block runs it unchanged (for "
                          f"models calling torch.nn.functional.scaled_dot_product_attention, "
                          f"use mha_ext.scaled_dot_product_attention)", RuntimeWarning,
                          stacklevel=3)

    def _exit(self) -> None:
        # idempotent (restore is): _core._Guarded calls it again if an
        # exception (a Ctrl-C) stopped it, before raising that exception
        record = self._record
        if record is not None:
            restore(self._model, record)
            self._record = None

    def __del__(self) -> None:
        if not getattr(self, "_used", True):
            warnings.warn("mha_ext.torch.swapped(model) was never entered, so it changed "
                          "nothing: use it as `with mha_ext.torch.swapped(model): ...`",
                          RuntimeWarning, stacklevel=2)
