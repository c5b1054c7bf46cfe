"""torch's exception types for the torch classes' argument errors.

mha_ext refuses bad arguments with a ValueError or TypeError saying what
was expected (docs/API.md §7).  torch refuses many of the same arguments
with an AssertionError or a RuntimeError (torch.nn.functional's shape
checks are asserts), and code written against torch, its own tests among
it, catches those.  So where the torch classes (mha_ext.torch's modules and
the SDPA twin on tensors) refuse arguments, torch's own code is run on the
same arguments as meta tensors (shapes and dtypes, no data, nothing
computed); if torch refuses them too, the error raised is of both types
(ValueErrorAndAssertionError is a ValueError and an AssertionError) and
carries both messages.  Where torch takes what we refuse (a float16 module,
say: README's differences), ours is raised as it was.

Imported by the torch classes only (needs torch).
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from ._convert import ValueErrorAndRuntimeError  # noqa: F401 (here too, as ever)

__all__ = ["TORCH_MHA", "torchs", "metas", "own_shapes", "refuse_mixed_dtypes",
           "linear_adds_bias"]

# torch's own module class, as torch defined it: the probes run it, and the
# swaps and checks look for it, also after a caller's global
# `nn.MultiheadAttention = mha_ext.torch.MultiheadAttention` (which made the
# probes run the drop-in itself: plain ValueErrors, a RecursionError on meta)
TORCH_MHA = torch.nn.MultiheadAttention


class ValueErrorAndAssertionError(ValueError, AssertionError):
    """A ValueError of mha_ext's that torch raises as an AssertionError."""


class TypeErrorAndAssertionError(TypeError, AssertionError):
    """A TypeError of mha_ext's that torch raises as an AssertionError."""


class TypeErrorAndRuntimeError(TypeError, RuntimeError):
    """A TypeError of mha_ext's that torch raises as a RuntimeError."""


_BOTH = {(ValueError, AssertionError): ValueErrorAndAssertionError,
         (ValueError, RuntimeError): ValueErrorAndRuntimeError,
         (TypeError, AssertionError): TypeErrorAndAssertionError,
         (TypeError, RuntimeError): TypeErrorAndRuntimeError}


def metas(*xs: Any) -> list[Any]:
    """The meta twins of xs (their shapes and dtypes, no data), one per
    distinct tensor; anything else as is: arguments
    that are one tensor stay one (torch's code branches on `query is key`);
    0-d tensors stay as they are (torch reads their values: a size, a
    count)."""
    twins: dict[int, Any] = {}
    out = []
    for x in xs:
        if isinstance(x, torch.Tensor) and not x.is_nested and x.dim() > 0:
            if id(x) not in twins:
                twins[id(x)] = torch.empty(x.shape, dtype=x.dtype, device="meta")
            x = twins[id(x)]
        out.append(x)
    return out


def torchs(ours: BaseException, probe: Callable[[], object]) -> BaseException:
    """ours, or, where probe() (torch's code on meta tensors) raises an
    AssertionError or RuntimeError, an error of both types with both
    messages.  Errors the probe meets because its tensors are meta (no data
    to read) are not torch's refusal and leave ours alone."""
    if not isinstance(ours, (ValueError, TypeError)):
        return ours
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            probe()
    except (AssertionError, RuntimeError) as theirs:
        if isinstance(theirs, (NotImplementedError, RecursionError)) \
                or "meta" in str(theirs).lower():
            return ours
        mine = ValueError if isinstance(ours, ValueError) else TypeError
        kind = AssertionError if isinstance(theirs, AssertionError) else RuntimeError
        # theirs may be one of these, torch's words already in it: torch's
        # module ran mha_ext's functional (a caller's global swap of
        # F.multi_head_attention_forward); torch's words are said once
        said = getattr(theirs, "torch_said", str(theirs))
        both: Any = _BOTH[(mine, kind)](f"{ours} (torch: {said})")
        both.torch_said = said
        both.__traceback__ = ours.__traceback__
        return both
    except Exception:                  # another refusal, or the probe's own trouble
        return ours
    return ours


PARAMETERS = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight",
              "in_proj_bias", "out_proj.weight", "out_proj.bias", "bias_k", "bias_v")


def own_shapes(ref: Any, sources: tuple[Any, ...]) -> Any:
    """ref, torch's module made on meta from a module's configuration, given
    meta twins of the shapes among sources (PARAMETERS' order) that its
    constructor never makes (a 0-d bias_k, say; in ref's dtype): torch's
    forward then refuses them as torch's module holding them would."""
    for name, p in zip(PARAMETERS, sources):
        owner, attr = (ref.out_proj, name[9:]) if name.startswith("out_proj.") else (ref, name)
        theirs = getattr(owner, attr, None)
        if isinstance(p, torch.Tensor) and theirs is not None and p.shape != theirs.shape:
            setattr(owner, attr, torch.nn.Parameter(
                torch.empty(p.shape, dtype=theirs.dtype, device="meta")))
    return ref


def linear_adds_bias(x: Any) -> bool:
    """Whether torch's linear (nn.Linear, F.linear) adds its bias to x's
    product with add_, which takes a bias of another dtype, rather than
    with addmm, which refuses it: x a 3-D tensor that is not contiguous."""
    return isinstance(x, torch.Tensor) and x.dim() == 3 and not x.is_contiguous()


def _adds_bias(x: Any, batch_first: bool) -> bool:
    """linear_adds_bias of x as torch's module hands it on to its in-projection
    (seq-first; (L, 1, E) when unbatched)"""
    if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3):
        return True  # refused after, as ever
    return linear_adds_bias(x.unsqueeze(1) if x.dim() == 2 else
                            x.transpose(1, 0) if batch_first else x)


def refuse_mixed_dtypes(sources: tuple[Any, ...], dtype: torch.dtype,
                        inputs: tuple[Any, Any, Any], batch_first: bool) -> None:
    """torch's module computes in its weights' dtype: another weight's, out_proj's
    bias's, or a bias_k / bias_v that would widen the keys is its RuntimeError
    (not converted here: other numbers than torch, which has none).  Taken
    as torch takes them: a narrower bias_k / bias_v (its keys keep their
    dtype) and in_proj_bias where torch adds it in the weights' dtype (every
    input as torch projects it not contiguous: batch-first inputs of B and L
    over 1, transposed by torch; _adds_bias).  Not under CPU autocast,
    where the torch classes compute in the parameters' dtype (docs/API.md
    §8).  sources: the module's tensors in PARAMETERS' order (None where
    absent; what is no tensor, a quantized out_proj's weight method, is
    refused after); dtype: the in-projection weight's; inputs: query, key,
    value (the odd weight out is named: dtype is the query's when another
    weight has it)."""
    if torch.is_autocast_enabled("cpu"):
        return
    tensors = [(n, p) for n, p in zip(PARAMETERS, sources) if isinstance(p, torch.Tensor)]
    query = getattr(inputs[0], "dtype", dtype)
    if query != dtype and any(n in ("out_proj.weight", "q_proj_weight", "k_proj_weight",
                                    "v_proj_weight") and p.dtype == query for n, p in tensors):
        dtype = query
    for name, p in tensors:
        if p.dtype == dtype or \
                (name == "in_proj_bias" and all(_adds_bias(x, batch_first) for x in inputs)) \
                or (name in ("bias_k", "bias_v") and torch.promote_types(dtype, p.dtype) == dtype):
            continue
        raise TypeErrorAndRuntimeError(
            f"{name} is {p.dtype} but the module's weights are {dtype}: torch's module "
            f"computes in one dtype and raises a RuntimeError here; cast the parameter or the "
            f"module (module.to({dtype}))")
