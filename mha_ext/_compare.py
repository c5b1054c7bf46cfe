"""mha_ext.compare(model, *inputs, **kwargs): a one-call numeric check of
every attention layer of a torch model.

Three runs of the model on the same inputs, all without grad and in the
model's current mode (use eval(), or dropout 0, for comparable numbers),
each from the model's state as it was (its parameters' and buffers' values
and torch's random state, restored after each run: a layer that changes
them in training mode, BatchNorm's running statistics or spectral_norm's
power iteration, would otherwise give the second run other numbers):

  torch    the model as it is (float32, or whatever its dtype is)
  mha_ext  the same model with every nn.MultiheadAttention computed by
           mha_ext (mha_ext.torch.swapped: the same parameters)
  truth    a float64 copy of the model, stock torch

Each attention layer's output is captured by a forward hook (which, on the
stock side, makes nn.TransformerEncoderLayer skip its fused whole-layer
kernel; nn.MultiheadAttention's own fused path still runs where torch
takes it).  The result is a :class:`Comparison`: one row per layer plus
the model's output, with the largest |torch - truth| and |mha_ext - truth|,
whether NaN sit in the same places, and which is closer.

A seed-style attention module (W_q/W_k/W_v/W_o, q_linear/..., q_proj/...,
per-head lists: whatever MultiHeadAttention.from_torch converts) given as
`model` is compared directly: torch is the module, mha_ext the NumPy module
from_torch builds (options in ``from_torch_options``, e.g.
``{"mask_polarity": "keep"}``), called with the same arguments.
"""
from __future__ import annotations

import copy
import html
import math
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple, SupportsIndex, overload

import numpy as np

try:
    import torch
except ModuleNotFoundError as _exc:
    from ._need_torch import needs_torch
    needs_torch(_exc, "mha_ext.compare")
from torch import nn

from ._swap import attention_modules, finish, swapped
from ._torch_errors import TORCH_MHA
from ._torch_fn import drop_hooks
from ._torch_mha import MultiheadAttention
from .module import MultiHeadAttention as _NumpyMHA

__all__ = ["compare", "Comparison", "Row"]


class Row(NamedTuple):
    """One line of a :class:`Comparison`."""
    layer: str            # the module's qualified name, or "(model output)"
    torch_error: float    # max |torch - truth| over the non-NaN entries
    mha_ext_error: float  # max |mha_ext - truth| over the non-NaN entries
    nan_agree: bool       # NaN in the same places in all three runs
    closer: str           # "mha_ext", "torch" or "tie"; "not called by ..." when
                          # a run never called the layer (its errors NaN),
                          # "n/a" when the runs' outputs differ in shape


class Comparison:
    """The per-layer table compare() returns: rows (:class:`Row`), also
    through len(), iteration and indexing; print() it for a text table; in
    a notebook it renders as an HTML table."""

    HEAD = ("layer", "max |torch - truth|", "max |mha_ext - truth|", "NaN agree", "closer")

    rows: list[Row]
    dtype: str        # the model's parameters' dtype, e.g. "float32"

    def __init__(self, rows: Iterable[Row], dtype: str) -> None:
        self.rows = list(rows)
        self.dtype = dtype

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[Row]:
        return iter(self.rows)

    @overload
    def __getitem__(self, i: SupportsIndex) -> Row: ...
    @overload
    def __getitem__(self, i: slice) -> list[Row]: ...

    def __getitem__(self, i: SupportsIndex | slice) -> Row | list[Row]:
        return self.rows[i]

    def _cells(self) -> list[tuple[str, str, str, str, str]]:
        return [(r.layer, f"{r.torch_error:.3g}", f"{r.mha_ext_error:.3g}",
                 "yes" if r.nan_agree else ("-" if r.closer.startswith(("not called", "n/a"))
                                            else "NO"), r.closer) for r in self.rows]

    def __str__(self) -> str:
        cells = [self.HEAD] + self._cells()
        widths = [max(len(c[i]) for c in cells) for i in range(len(self.HEAD))]
        lines = [f"mha_ext.compare: {self.dtype} runs against a float64 copy (truth)"]
        for j, c in enumerate(cells):
            lines.append("  ".join(s.ljust(w) for s, w in zip(c, widths)).rstrip())
            if j == 0:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in self.HEAD)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(s)}</td>" for s in c) + "</tr>"
                       for c in self._cells())
        return (f"<table><caption>mha_ext.compare: {html.escape(self.dtype)} runs against "
                f"a float64 copy (truth)</caption><thead><tr>{head}</tr></thead>"
                f"<tbody>{body}</tbody></table>")


def _to64(x):
    # inputs for the float64 copy: floating tensors and arrays to float64
    if isinstance(x, torch.Tensor):
        return x.double() if x.is_floating_point() else x
    if isinstance(x, np.ndarray):
        return x.astype(np.float64) if x.dtype.kind == "f" else x
    if isinstance(x, (list, tuple)):
        return type(x)(_to64(v) for v in x)
    if isinstance(x, dict):
        return {k: _to64(v) for k, v in x.items()}
    return x


def _tensors(out):
    # the tensors of a result, in order (nested ones padded)
    if isinstance(out, torch.Tensor):
        return [out.to_padded_tensor(0.0) if out.is_nested else out]
    if isinstance(out, np.ndarray):
        return [torch.from_numpy(out)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in _tensors(v)]
    if isinstance(out, dict):
        return [t for v in out.values() for t in _tensors(v)]
    return []


def _first(out):
    ts = _tensors(out)
    return None if not ts else ts[0].detach().double()


def _capture(model, names):
    """Forward hooks on the modules `names`, recording each one's output
    (the first tensor it returns) in the dict returned; _uncapture takes
    them off."""
    seen = {}
    modules = dict(model.named_modules())
    for name in names:
        def hook(module, args, out, name=name):
            seen[name] = _first(out)
        hook._mha_ext_capture = True  # type: ignore[attr-defined]
        modules[name].register_forward_hook(hook)
    return seen


def _uncapture(model, names):
    """_capture's hooks off the modules `names`, found by their mark (no
    handle to lose between a hook's registration and its keeping: a Ctrl-C
    there left the hook on the model for good, and with it torch's
    TransformerEncoderLayer off its fused kernel); idempotent."""
    modules = dict(model.named_modules())
    for name in names:
        drop_hooks(modules.get(name), "forward",
                   lambda fn: getattr(fn, "_mha_ext_capture", False))


def _row(name, a, b, truth):
    # a layer a run never called (a model branching around it, say): said so
    missing = [who for who, x in (("torch", a), ("mha_ext", b), ("the float64 copy", truth))
               if x is None]
    if missing:
        return Row(name, math.nan, math.nan, False, "not called by " + ", ".join(missing))
    if a.shape != truth.shape or b.shape != truth.shape:
        return Row(name, math.nan, math.nan, False, "n/a")
    nan_a, nan_b, nan_t = torch.isnan(a), torch.isnan(b), torch.isnan(truth)
    agree = bool(torch.equal(nan_a, nan_t) and torch.equal(nan_b, nan_t))

    def err(x, nan_x):
        ok = ~(nan_x | nan_t)
        return float((x[ok] - truth[ok]).abs().max()) if ok.any() else 0.0

    ea, eb = err(a, nan_a), err(b, nan_b)
    closer = "tie" if ea == eb else ("mha_ext" if eb < ea else "torch")
    return Row(name, ea, eb, agree, closer)


def _warn_dropout(model):
    # dropout in training mode draws different masks in each run
    for name, m in model.named_modules():
        p = getattr(m, "dropout", getattr(m, "p", 0.0))
        p = getattr(p, "p", p)
        if m.training and isinstance(p, float) and p > 0.0:
            warnings.warn(f"mha_ext.compare: {name or type(m).__name__} is in training mode "
                          f"with dropout {p}: the three runs draw different dropout masks, "
                          f"so the table compares noise; call model.eval() first",
                          stacklevel=3)
            return


def _snapshot(model):
    """What a run may change: each parameter's and buffer's value (by
    name) and torch's random state; _restore puts them back."""
    for n, t in list(model.named_parameters()) + list(model.named_buffers()):
        if isinstance(t, nn.parameter.UninitializedTensorMixin):
            raise ValueError(f"compare: {n!r} is not initialised yet (a lazy module's, "
                             f"made by its first call): call the model once first, so that "
                             f"the three runs compute with the same parameters")
    with torch.inference_mode(False), torch.no_grad():
        values = {("p", n): t.detach().clone() for n, t in model.named_parameters()}
        values.update({("b", n): t.detach().clone() for n, t in model.named_buffers()})
    return values, torch.get_rng_state()


def _same(t, v):
    # the same values (NaN where NaN: a value a run left alone)
    return t.shape == v.shape and t.dtype == v.dtype and bool(
        ((t == v) | (t != t) & (v != v)).all())


def _restore(model, snapshot):
    """The snapshot's values back where a run changed them (in place: a
    tensor a run left alone is not written, so a graph that saved it still
    backpropagates; a buffer a run replaced by one of another shape or dtype
    is put back as it was)."""
    values, rng = snapshot
    owners = dict(model.named_modules())
    with torch.no_grad():
        for (kind, name), v in values.items():
            owner_name, _, attr = name.rpartition(".")
            owner = owners.get(owner_name)
            store = None if owner is None else (owner._parameters if kind == "p"
                                                else owner._buffers)
            t = None if store is None else store.get(attr)
            if t is None or _same(t, v):
                continue
            if t.shape == v.shape and t.dtype == v.dtype:
                with torch.inference_mode(t.is_inference()):
                    t.copy_(v)
            elif kind == "b":
                store[attr] = v.clone()
            else:
                t.data = v.clone()
    torch.set_rng_state(rng)


def _dtype_name(model):
    for p in model.parameters():
        return str(p.dtype).replace("torch.", "")
    return "float32"


def compare(model: nn.Module, *inputs: Any, from_torch_options: Mapping[str, Any] | None = None,
            **kwargs: Any) -> Comparison:
    """Run `model(*inputs, **kwargs)` three ways (stock torch, mha_ext
    swapped in, a float64 stock copy as the truth) and return the
    :class:`Comparison` of every nn.MultiheadAttention layer's output and
    of the model's output.  `model` may also be one seed-style attention
    module (see the module docstring; ``from_torch_options`` go to
    mha_ext.MultiHeadAttention.from_torch).  Each run starts from the model's
    state as it was (parameters, buffers, torch's random state), and the
    model is left as it was."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"compare expects a torch.nn.Module, not {type(model).__name__}")
    if isinstance(model, MultiheadAttention):
        raise TypeError("compare takes the torch model or module: this is mha_ext's "
                        "MultiheadAttention already (compare computes it with mha_ext itself)")
    _warn_dropout(model)
    state = _snapshot(model)
    try:
        return _compare(model, inputs, from_torch_options, kwargs, state)
    finally:
        # done again if an exception (a Ctrl-C) stops it: a BatchNorm's
        # statistics moved by the runs stayed, and the model's later numbers
        finish(_restore, model, state)


def _compare(model, inputs, from_torch_options, kwargs, state):
    # compare's runs, each from `state` (a parametrized weight read by
    # from_torch, say, advances it in training mode)
    if isinstance(model, TORCH_MHA):
        ours = MultiheadAttention.from_torch(model)
        _restore(model, state)
        return _compare_module(model, ours, inputs, kwargs, state)
    names = [n for n, _ in attention_modules(model)]
    if not names:
        try:
            ours = _NumpyMHA.from_torch(model, **(from_torch_options or {}))
        except TypeError as exc:
            raise TypeError(f"compare found no torch.nn.MultiheadAttention in this "
                            f"{type(model).__name__}, and it is not an attention module "
                            f"from_torch converts: {exc}") from None
        _restore(model, state)
        return _compare_module(model, ours, inputs, kwargs, state)
    truth_model = copy.deepcopy(model).double()
    with torch.no_grad():
        try:
            seen_t = _capture(model, names)
            out_t = model(*inputs, **kwargs)
        finally:
            finish(_uncapture, model, names)
        _restore(model, state)
        with swapped(model):
            try:  # (the hooks land in the dicts ours share with the originals)
                seen_m = _capture(model, names)
                out_m = model(*inputs, **kwargs)
            finally:
                finish(_uncapture, model, names)
        torch.set_rng_state(state[1])
        seen_x = _capture(truth_model, names)  # a copy: dropped with its hooks
        out_x = truth_model(*_to64(inputs), **_to64(kwargs))
    rows = [_row(n, seen_t.get(n), seen_m.get(n), seen_x.get(n)) for n in names]
    rows.append(_row("(model output)", _first(out_t), _first(out_m), _first(out_x)))
    return Comparison(rows, _dtype_name(model))


def _compare_module(module, ours, inputs, kwargs, state):
    # one attention module against ours (a torch module, or the NumPy
    # module, which is given the arguments as arrays)
    truth_module = copy.deepcopy(module).double()
    if isinstance(ours, _NumpyMHA):
        def plain(x):
            return x.detach().numpy() if isinstance(x, torch.Tensor) else x
        ours_args = [plain(x) for x in inputs]
        ours_kwargs = {k: plain(v) for k, v in kwargs.items()}
    else:
        ours_args, ours_kwargs = inputs, kwargs
    with torch.no_grad():
        out_t = module(*inputs, **kwargs)
        _restore(module, state)
        out_m = ours(*ours_args, **ours_kwargs)
        torch.set_rng_state(state[1])
        out_x = truth_module(*_to64(inputs), **_to64(kwargs))
    name = type(module).__name__
    return Comparison([_row(name, _first(out_t), _first(out_m), _first(out_x))],
                      _dtype_name(module))
