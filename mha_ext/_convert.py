"""Argument conversion, the one home for it: torch tensors to NumPy and back
(empty results in torch's layout), array-likes to ndarrays with a message
naming the argument, the real-number check, the contiguous copy in a dtype,
and the checks of scalar arguments (flags, probabilities, stream counters)
that Python code takes.

Imports nothing of mha_ext and never imports torch: a torch tensor is
recognised by its type's module.
"""
from __future__ import annotations

import numbers
import operator
import sys

import numpy as np

__all__ = ["batched", "is_tensor", "is_causal_bias", "check_tensor", "to_numpy", "to_tensor",
           "dense", "broadcast_copy", "unmasked", "as_array", "check_real", "refuse_huge_ints",
           "as_real", "contiguous", "flag", "probability", "as_int", "seed", "counter"]


_TENSOR_TYPES: set[type] = set()  # the types is_tensor has found to be tensors


def is_tensor(x) -> bool:
    """Whether x is a torch tensor, a subclass's too (a user's own, as
    torch's functions take it; torch is never imported here: x can only be
    one once it is).  A type found once is remembered: 14 calls a small
    SDPA call on tensors."""
    t = type(x)
    if t in _TENSOR_TYPES:
        return True
    torch = sys.modules.get("torch")
    if t is np.ndarray or torch is None or not isinstance(x, torch.Tensor):
        return False
    if len(_TENSOR_TYPES) < 64:  # (types made on the fly are not all kept)
        _TENSOR_TYPES.add(t)
    return True


FX_PROXY = ("torch.fx.symbolic_trace reached mha_ext's attention with fx Proxies, which its "
            "C code cannot read (a traced call has no data): keep the module a leaf (a Tracer "
            "subclass whose is_leaf_module returns True for it) or the function wrapped "
            "(torch.fx.wrap), or record the model with torch.jit.trace or torch.compile")


def refuse_fx_proxies(*xs) -> None:
    """RuntimeError when one of xs is a torch.fx Proxy (symbolic_trace
    tracing through the call): its control flow and conversions would fail
    with fx's own obscure errors."""
    fx = sys.modules.get("torch.fx")
    if fx is not None and any(isinstance(x, fx.Proxy) for x in xs):
        raise RuntimeError(FX_PROXY)


def is_causal_bias(x) -> bool:
    """Whether x is torch's CausalBias (torch.nn.attention.bias): a tensor
    that holds no mask values, only a causal pattern."""
    return is_tensor(x) and type(x).__name__ == "CausalBias"


_BATCHED = None


def _batched_checks():
    """torch's tests for batched tensors (those it has), looked up once."""
    global _BATCHED
    if _BATCHED is None:
        ft = getattr(getattr(sys.modules.get("torch"), "_C", None), "_functorch", None)
        _BATCHED = tuple(f for f in (getattr(ft, n, None) for n in
                                     ("is_batchedtensor", "is_legacy_batchedtensor"))
                         if f is not None)
    return _BATCHED


def batched(name):
    """The refusal of a batched tensor `name`."""
    return (f"{name} is a batched tensor (torch.func.vmap, or batched gradients: "
            f"autograd.grad(is_grads_batched=True), gradcheck's check_batched_grad), which "
            f"mha_ext's C kernels cannot read; loop over the batch instead")


def check_tensor(x, name):
    """Refuse, naming `name`, the tensors NumPy cannot read: nested tensors,
    sparse or other non-strided layouts and torch's CausalBias (TypeError),
    tensors on the meta device, which have no data (ValueError), and vmap's
    batched tensors (RuntimeError; torch is imported already when x is its
    tensor)."""
    torch = sys.modules["torch"]
    if (type(x) in (torch.Tensor, torch.nn.Parameter) and not x.is_nested
            and x.layout is torch.strided and not x.is_meta):
        # a plain dense tensor (the usual case): the rules below, without the
        # lookups a subclass needs (a CausalBias is a subclass)
        for f in _batched_checks():
            if f(x):
                break
        else:
            check_storage(x, name)
            return
    if getattr(x, "is_nested", False):  # strided or jagged: no one array to read
        raise TypeError(f"{name} is a nested tensor, which mha_ext's kernels cannot read: "
                        f"pad it first (x.to_padded_tensor(0.0)) and mask the padding "
                        f"(key_padding_mask, or a mask blocking the padded keys)")
    layout = str(getattr(x, "layout", "torch.strided"))
    if layout != "torch.strided":
        raise TypeError(f"{name} must be a dense tensor, got a {layout.replace('torch.', '')} "
                        f"tensor; convert it with .to_dense() first")
    if any(f(x) for f in _batched_checks()):  # vmap's, and autograd's legacy batching
        raise RuntimeError(batched(name))
    if is_causal_bias(x):
        raise TypeError(f"{name} is a torch CausalBias, which holds no mask values: give it "
                        f"to mha_ext.scaled_dot_product_attention as attn_mask, or ask for "
                        f"is_causal=True or 'lower_right'")
    if x.device.type == "meta":
        raise ValueError(f"{name} is a tensor on the meta device, which has no data; "
                         f"materialise it on the CPU first (for a module: "
                         f"module.to_empty(device='cpu'), then initialise or load its weights)")
    check_storage(x, name)


def check_storage(x, name):
    """RuntimeError naming `name` when x's storage is smaller than its view
    needs (untyped_storage().resize_() shrank or freed it, as FSDP-style code
    does): torch's own operations refuse such a tensor, and reading it would
    go past the end of the block (or, freed, NumPy would hand back a fresh
    uninitialised array).  Tensors without a plain storage (a subclass or a
    tracing wrapper) are left to torch."""
    try:
        have = x.untyped_storage().nbytes()
        n = x.numel()
        if n == 0:
            return
        if x.is_contiguous():  # the usual case, without the loop over the dimensions
            need = (x.storage_offset() + n) * x.element_size()
        else:
            need = (x.storage_offset() + 1 + sum((d - 1) * s for d, s in
                                                 zip(x.shape, x.stride()))) * x.element_size()
        if not isinstance(need, int) or not isinstance(have, int):
            return  # symbolic sizes (make_fx's symbolic tracing): refused later, by name
    except Exception:  # noqa: BLE001 (no storage to check: torch's own checks apply)
        return
    if need > have:
        raise RuntimeError(f"{name}: its storage holds {have} bytes, but a tensor of shape "
                           f"{tuple(x.shape)}, strides {tuple(x.stride())} and storage offset "
                           f"{x.storage_offset()} needs {need} (the storage was resized or "
                           f"freed, e.g. by untyped_storage().resize_(); torch's own "
                           f"operations refuse it too)")


def _plain_tensor(x):
    import torch
    return type(x) is torch.Tensor


class NoTensorDataError(RuntimeError):
    """A tensor subclass with no data to read (to_numpy): a RuntimeError
    naming the argument wherever an array is taken, masks too (as_array
    passes it on, not as its TypeError of what cannot convert)."""


def _holds_no_data(x):
    """Whether the tensor subclass x has no data of its own to read: a fake
    tensor (torch.export, torch.compile), or a wrapper subclass whose data
    sits in the tensors it wraps (its own storage is empty, or has no data
    pointer at all)."""
    sys_torch = sys.modules["torch"]
    fake = getattr(getattr(getattr(sys_torch, "_subclasses", None), "fake_tensor", None),
                   "is_fake", None)
    if fake is not None and fake(x):
        return True
    wrapper = getattr(getattr(getattr(sys_torch, "utils", None), "_python_dispatch", None),
                      "is_traceable_wrapper_subclass", None)
    if wrapper is not None and wrapper(x):  # its data in the tensors it wraps
        return True
    try:
        if x.numel() > 0 and x.untyped_storage().nbytes() == 0:
            return True
        # a wrapper made with _make_wrapper_subclass has a storage of the
        # right size but no data (torch's LoggingTensor, MaskedTensor): its
        # data pointer raises, where as_subclass could hand back a plain
        # tensor over that storage (a wrapper whose alias runs undispatched)
        x.untyped_storage().data_ptr()
        return False
    except Exception:  # no storage to ask about, or no data in it
        return True


def to_numpy(x, name="tensor"):
    """A torch tensor (also one that requires grad, on another device, in
    bfloat16, conjugated or negated lazily) as a NumPy array; anything else
    unchanged.  A sparse or meta tensor is an error naming `name`."""
    if not is_tensor(x):
        return x
    check_tensor(x, name)
    x = x.detach()
    try:  # a dense CPU tensor NumPy can read as it is (the usual case: fast)
        return x.numpy()
    except (RuntimeError, TypeError):  # another device, bfloat16, conj or neg bit
        pass
    if not _plain_tensor(x):  # after .detach(): a Parameter is a plain tensor then
        kind = type(x).__name__
        if not _holds_no_data(x):
            import torch  # a user's subclass over its own data: read as a plain tensor
            x = x.as_subclass(torch.Tensor)
        if not _plain_tensor(x):  # no data, or a wrapper as_subclass cannot unwrap (an
            raise NoTensorDataError(  # empty LoggingTensor)
                f"{name} is a {kind}, a tensor subclass that holds no data of its "
                f"own for mha_ext's C code to read: torch.export and torch.compile's fake "
                f"tensors have no data at all. Under torch.export, export torch's own module "
                f"or keep the mha_ext call out of the exported graph; otherwise pass a plain "
                f"tensor")
    if x.device.type != "cpu":
        x = x.cpu()
    if str(x.dtype) == "torch.bfloat16":  # NumPy has no bfloat16
        x = x.float()
    return x.resolve_conj().resolve_neg().numpy()


def to_tensor(a):
    """torch.from_numpy(a), an empty array given the strides torch gives an
    empty tensor of its shape (its sizes taken as at least 1): NumPy 2 gives
    an empty array zero strides, which torch.from_numpy keeps."""
    t = sys.modules["torch"].from_numpy(a)
    return t if t.numel() else dense(t)


def dense(t):
    """t.contiguous(), an empty tensor laid out as torch lays out a fresh one
    (contiguous() keeps any strides of an empty tensor: all are contiguous)."""
    return t.contiguous() if t.numel() else t.clone(
        memory_format=sys.modules["torch"].contiguous_format)


def broadcast_copy(t):
    """A copy of tensor t that keeps t's broadcast: each dimension of stride
    0 (an expanded learned bias) is copied once and expanded again, not
    written out in full as t.clone() writes it.  Differentiable as clone."""
    once = tuple(slice(0, 1) if step == 0 and n > 1 else slice(None)
                 for n, step in zip(t.shape, t.stride()))
    return t[once].clone().expand(t.shape)


def unmasked(x, name):
    """A NumPy masked array's data, when no entry is masked; one with masked
    entries is a TypeError naming `name`: the C code reads the data alone,
    so its mask would be dropped without a word (np.asarray and
    torch.as_tensor drop it so)."""
    ma = sys.modules.get("numpy.ma")  # not imported: x cannot be a masked array
    if ma is None:
        return x
    if isinstance(x, (list, tuple)) and _holds_masked(x, ma):
        raise TypeError(f"{name} holds a NumPy masked array with masked entries: mha_ext "
                        f"reads the arrays' data, not their masks, and would use the masked "
                        f"values; fill them first (.filled(value)), or block those positions "
                        f"with a mask argument")
    if not isinstance(x, ma.MaskedArray):
        return x
    if ma.is_masked(x):
        raise TypeError(f"{name} is a NumPy masked array with masked entries: mha_ext reads "
                        f"the array's data, not its mask, and would use the masked values; "
                        f"fill them first ({name}.filled(value)), or block those positions "
                        f"with a mask argument")
    return x.data


def _holds_masked(x, ma, depth=0) -> bool:
    """Whether a list or tuple holds, at any depth, a masked array with
    masked entries (np.asarray would drop its mask, or read a masked 0-d
    one as NaN or its hidden value).  A row holding neither lists nor
    masked arrays is passed over at C speed (its items' types, as a set)."""
    if depth > 32:
        return False
    if not any(issubclass(t, (ma.MaskedArray, list, tuple)) for t in set(map(type, x))):
        return False
    for item in x:
        if isinstance(item, ma.MaskedArray):
            if ma.is_masked(item):
                return True
        elif isinstance(item, (list, tuple)):
            if _holds_masked(item, ma, depth + 1):
                return True
    return False


def as_array(x, name) -> np.ndarray:
    """x as an ndarray (no copy for an ndarray or a CPU tensor), with a
    message naming `name` when it cannot be one."""
    if type(x) is np.ndarray:  # the usual case: nothing to convert or check
        return x
    if is_tensor(x):
        check_tensor(x, name)
    else:
        refuse_fx_proxies(x)
        x = unmasked(x, name)
    try:
        x = to_numpy(x, name)
        if isinstance(x, np.ndarray):
            # a subclass (np.matrix, a memmap) as the plain array of its data:
            # indexing a matrix keeps it 2-D, which its conversion then fails on
            return x if type(x) is np.ndarray else x.view(np.ndarray)
        return np.asarray(x)
    except MemoryError as exc:
        raise MemoryError(f"{name}: {exc}") from exc
    except NoTensorDataError:
        raise
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{name} must be array-like: {exc}") from None
    except Exception as exc:  # e.g. an __array__ that raises: still bad input
        raise TypeError(f"{name} must be array-like, converting it raised "
                        f"{type(exc).__name__}: {exc}") from exc


def refuse_huge_ints(arr, name):
    """An int past int64 and uint64 in arr, which NumPy keeps as an object,
    named as such (not as "dtype object"): too large for a float, also the
    OverflowError torch raises; else a TypeError saying to pass a float."""
    big = None if arr.dtype.kind != "O" else next(
        (v for v in arr.flat if isinstance(v, int) and not -2**63 <= v < 2**64), None)
    if big is None:
        return
    try:
        float(big)
    except OverflowError:
        raise ValueErrorAndOverflowError(
            f"{name} must hold real numbers, got an int of {big.bit_length()} bits, "
            f"too large for a float") from None
    raise TypeError(f"{name} must hold real numbers NumPy can store: an int of "
                    f"{big.bit_length()} bits is past int64 and uint64 (NumPy kept "
                    f"it as an object); pass it as a float")


def check_real(arr, name):
    """TypeError naming `name` unless arr holds bool, int or float (an int
    past int64 and uint64: refuse_huge_ints)."""
    if arr.dtype.kind not in "biuf":
        refuse_huge_ints(arr, name)
        raise TypeError(f"{name} must hold real numbers (bool, int or float), "
                        f"got dtype {arr.dtype}")


def as_real(x, name) -> np.ndarray:
    """as_array, then check_real."""
    arr = as_array(x, name)
    check_real(arr, name)
    return arr


def contiguous(x, name, dtype) -> np.ndarray:
    """x as a C-contiguous array of dtype: the array itself when it already
    is one, else a converted copy (a 0-d one stays 0-d, so that a shape
    check's message gives the shape the caller passed)."""
    return np.asarray(as_real(x, name), dtype=dtype, order="C")


def _describe(value):
    shape = getattr(value, "shape", None)
    if shape is not None:
        return f"an array of shape {tuple(shape)}"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def flag(value, name) -> bool:
    """A call's on/off argument as a bool.  A bool, a NumPy bool, a 0-d array
    or any other single truth value is taken as Python's `if` would take it;
    a sequence, string or array with more than one value is a TypeError
    naming `name` (NumPy's own message does not say which argument)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    value = unmasked(value, name)  # a masked 0-d array: its hidden value
    ndim = getattr(value, "ndim", None)
    if ndim == 0 and getattr(value, "shape", None) == ():
        value = value.item() if hasattr(value, "item") else value
    elif ndim is not None or hasattr(value, "__len__"):
        raise TypeError(f"{name} must be True or False, got {_describe(value)}")
    try:
        return bool(value)
    except Exception as exc:
        raise TypeError(f"{name} must be True or False, got {_describe(value)} "
                        f"({type(exc).__name__}: {exc})") from None


class ValueErrorAndIndexError(ValueError, IndexError):
    """An index out of range (plot_heads' batch, a Trace's step number): a
    ValueError (docs/API.md §7) that is also the IndexError of indexing a
    sequence with it."""


class ValueErrorAndRuntimeError(ValueError, RuntimeError):
    """A ValueError of mha_ext's that torch raises as a RuntimeError."""


class ValueErrorAndOverflowError(ValueError, OverflowError):
    """An int too large for a float where a real number is expected: a
    ValueError (docs/API.md §7) that is also the OverflowError torch raises
    for it."""


def too_large(value, name, what="a real number") -> ValueErrorAndOverflowError:
    """The error for a `value` that float() cannot take (an int of more than
    1024 bits, a Fraction of such ints), naming `name`."""
    kind = f"an int of {value.bit_length()} bits" if isinstance(value, int) \
        else f"a {type(value).__name__}"
    return ValueErrorAndOverflowError(f"{name} must be {what}, got {kind}, too large for a "
                                      f"float")


def as_float(value, name, what="a real number") -> float:
    """float(value); a value too large for a float is too_large's error, a
    masked 0-d array (float() would read NaN) unmasked's."""
    try:
        return float(unmasked(value, name))
    except OverflowError:
        raise too_large(value, name, what) from None


def probability(value, name) -> float:
    """A real number in [0, 1] (Python's or NumPy's, a 0-d real array, not a
    bool) as a float;
    ValueError naming `name` otherwise, NaN included (an int too large for a
    float: also the OverflowError torch raises)."""
    if type(value) is float and 0.0 <= value <= 1.0:  # the usual case, checked first
        return value
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "iuf":
        # a 0-d real array: its value, as the module's dropout reads it (a
        # masked one with its value masked: refused, as wherever arrays are read)
        value = np.asarray(unmasked(value, name)).item()
    real = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
    ok = real
    if ok:
        try:
            ok = 0.0 <= float(value) <= 1.0
        except OverflowError:
            raise too_large(value, name, "a probability in [0, 1]") from None
    if not ok:
        what = ("a bool" if isinstance(value, (bool, np.bool_)) else repr(value) if real
                else f"{type(value).__name__} {value!r}"[:200] + ", not a real number")
        raise ValueError(f"{name} must be a probability in [0, 1], got {what}")
    return float(value)


def as_int(value, name) -> int | None:
    """value as an int if it is one integer, else None: a Python or NumPy
    int, a 0-d integer array or tensor, or anything else whose __index__
    gives an int (torch reads its int arguments so: torch.tensor(8) as an
    embed_dim).  A bool of any kind (Python's, NumPy's, a 0-d bool array or
    tensor, whose __index__ gives 0 or 1) is no integer here, nor a float
    or an array with dimensions.  A NumPy masked array with its value
    masked is unmasked()'s TypeError naming `name`."""
    if type(value) is int:  # the usual case, first
        return value
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, np.ndarray):
        if value.ndim != 0 or value.dtype.kind not in "iu":
            return None
        return int(unmasked(value, name))  # (masked with its value masked: refused)
    if is_tensor(value):  # torch's int dtypes; a bool tensor's __index__ would give 0 or 1
        if value.dim() != 0 or value.dtype.is_floating_point or value.dtype.is_complex \
                or str(value.dtype) == "torch.bool" or value.is_meta:
            return None
        try:
            return int(value)
        except Exception:  # a tensor without data of its own (a fake tensor)
            return None
    if not hasattr(type(value), "__index__"):
        return None
    try:
        return operator.index(value)
    except Exception:  # a __index__ refusing this value (NumPy's for a float array)
        return None


def integer(value, name, low=1) -> int:
    """An int >= low (as_int's: Python's, NumPy's, a 0-d integer array or
    tensor; not a bool) as an int, as the constructors take their sizes:
    TypeError for another type, ValueError below low."""
    i = as_int(value, name)
    if i is None:
        raise TypeError(f"{name} must be an int >= {low}, not {type(value).__name__}")
    if i < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return i


def seed(value, name="seed") -> int:
    """An int in [0, 2**64) (as_int's: Python's, NumPy's, a 0-d integer
    array or tensor; not a bool), as the module's constructor takes its
    seed: TypeError for another type, ValueError outside the range."""
    i = as_int(value, name)
    if i is None:
        raise TypeError(f"{name} must be an int in [0, 2**64), not {type(value).__name__}")
    if not 0 <= i < 2 ** 64:
        raise ValueError(f"{name} must be in [0, 2**64), got {value!r}")
    return i


def counter(value, name) -> int:
    """An integer in [0, 2**64) (as_int's, not a bool) as an int;
    ValueError naming `name` otherwise."""
    i = as_int(value, name)
    if i is None or not 0 <= i < 2 ** 64:
        raise ValueError(f"{name} must be an int in [0, 2**64), got {value!r}")
    return i
