"""KVCache: the keys and values a module has projected, kept for its next
calls (incremental decoding), made by ``MultiHeadAttention.new_cache`` (self
attention) or ``.cache_memory`` (cross-attention over a fixed memory).

The module keeps no state of its own: the cache is an explicit object the
caller passes (``m(x, cache=cache)``), which the call extends in place.  It
holds K per head transposed, (B, Hkv, Dk, capacity), and V per head,
(B, Hkv, capacity, Dk), in the module's dtype: the layouts the attention
reads, so a decode step reads each cached key and value once.

Legend: B batch, Hkv key/value heads, Dk head width.
"""
from __future__ import annotations

import os
import sys
import threading
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

import numpy as np

from . import _convert
from ._core import _Holding
from ._types import Flag, Int

if TYPE_CHECKING:
    from .module import MultiHeadAttention

__all__ = ["KVCache"]

_LIVE: "weakref.WeakSet[KVCache]" = weakref.WeakSet()   # for the fork child below


class KVCache:
    """The projected keys and values of one module's earlier calls, for one
    batch size and a maximum length (its capacity).

    length      the keys cached so far (0 .. capacity)
    capacity    the most keys it can hold
    batch_size  B; every call with it has this batch size
    cross       True for a cache of cache_memory (a fixed memory: later
                calls attend over it, never extend it)
    keys, values  read-only views (B, Hkv, length, Dk) of what is cached
    reset()     length back to 0 (self-attention caches)

    A cache belongs to the module that made it (another module refuses it)
    and is extended by one call at a time (a concurrent second call with
    the same cache is a RuntimeError).  Its contents were computed with the
    module's parameters at the time: after changing them, reset() the cache
    and feed the sequence again.  copy.copy / copy.deepcopy give a cache of
    the same module with its own keys and values (a beam's branch); pickle
    stores it with its module.
    """

    __slots__ = ("_module", "_k", "_v", "_length", "_cross", "_busy", "_epoch", "__weakref__")
    # _busy: {"by": token} while a call extends the cache, or reset() or a
    # copy reads it (never waited on: a second one finds it taken and
    # refuses); token = [the holder's thread].  Taken only by `with
    # self._held(...)`: _core._Holding's __enter__ and __exit__ take and give
    # it back, each in one C call, and a with statement runs no Python code
    # between them and its block: an exception from a signal handler (Ctrl-C)
    # cannot leave it held (a threading.Lock acquired before a try stayed
    # held for good).  In a fork child, another thread's hold is dropped.  A
    # cross cache is never extended: no hold.  _epoch: counts the cache's
    # changes (extensions, resets), under the hold (trace() checks it).

    def __init__(self, module: MultiHeadAttention, batch_size: Int, capacity: Int,
                 cross: Flag = False) -> None:
        """Made by MultiHeadAttention.new_cache / cache_memory, not directly."""
        if module.add_bias_kv or module.add_zero_attn:  # no call could use it
            raise ValueError("a cache cannot be used with add_bias_kv or add_zero_attn "
                             "(their extra keys would sit inside the cached ones)")
        B = _convert.integer(batch_size, "batch_size")
        cap = _convert.integer(capacity, "max_len")
        Hkv, Dk = module.n_kv_heads, module.d_k
        nbytes = 2 * B * Hkv * Dk * cap * np.dtype(module.dtype).itemsize
        if nbytes > sys.maxsize:
            raise MemoryError(f"a cache of batch_size {B} and max_len {cap} would take "
                              f"{nbytes} bytes (2 x batch_size x n_kv_heads {Hkv} x d_k {Dk} "
                              f"x max_len scalars): too large to allocate")
        try:
            k = np.zeros((B, Hkv, Dk, cap), dtype=module.dtype)
            v = np.zeros((B, Hkv, cap, Dk), dtype=module.dtype)
        except MemoryError:
            raise MemoryError(f"a cache of batch_size {B} and max_len {cap} needs {nbytes} "
                              f"bytes (2 x batch_size x n_kv_heads {Hkv} x d_k {Dk} x "
                              f"max_len scalars): more than can be allocated") from None
        self._adopt(module, k, v, 0, cross)

    def _adopt(self, module: MultiHeadAttention, k: np.ndarray, v: np.ndarray, length: int,
               cross: Flag) -> None:
        """The state: `module`'s cache holding k, v (taken over, not copied)
        and `length` keys (a new cache, a copy, an unpickled one)."""
        self._module = module
        self._k = k
        self._v = v
        self._length = int(length)
        self._cross = bool(cross)
        self._busy: dict[str, list[int]] = {}
        self._epoch = 0
        _LIVE.add(self)

    @property
    def length(self) -> int:
        """The keys cached so far."""
        return self._length

    @property
    def capacity(self) -> int:
        """The most keys this cache can hold (new_cache's max_len)."""
        return self._k.shape[3]

    @property
    def batch_size(self) -> int:
        """B: the batch size of every call with this cache."""
        return self._k.shape[0]

    @property
    def cross(self) -> bool:
        """True for cache_memory's cache of a fixed memory."""
        return self._cross

    @property
    def keys(self) -> np.ndarray:
        """The cached keys K per head, (B, Hkv, length, Dk), a read-only view."""
        n = self._length  # read once: a call in another thread may extend it
        v = self._k[..., :n].swapaxes(2, 3)
        v.flags.writeable = False
        return v

    @property
    def values(self) -> np.ndarray:
        """The cached values V per head, (B, Hkv, length, Dk), a read-only view."""
        n = self._length
        v = self._v[:, :, :n]
        v.flags.writeable = False
        return v

    # ---- copies: each its own keys and values (a shared buffer would let
    # one copy's call overwrite the other's keys)
    def _state(self) -> tuple[np.ndarray, np.ndarray, int]:
        """K, V (copies) and the length, taken while no call extends it (a
        cross cache is copied as it is, also during calls)."""
        with self._held("this cache is in use by a call (or another copy or reset() of it): "
                        "copy it after the call"):
            return self._k.copy(), self._v.copy(), self._length

    def __copy__(self) -> "KVCache":
        """copy.copy: a cache of the same module with its own copy of the
        keys and values (a branch of a decoding, e.g. a beam)."""
        return _rebuild(self._module, *self._state(), self._cross)

    def __deepcopy__(self, memo: dict) -> "KVCache":
        """copy.deepcopy: as copy.copy; the module stays the same one
        unless the deep copy has copied it already (then the copy's: a
        module met before its cache, as in deepcopy((module, cache)))."""
        module = memo.get(id(self._module), self._module)
        return _rebuild(module, *self._state(), self._cross)

    def __reduce__(self) -> tuple[Callable[..., KVCache], tuple[object, ...]]:
        """pickle: the module, the keys and values and the length (a
        pickle that holds the module too restores one module for both)."""
        return (_rebuild, (self._module, *self._state(), self._cross))

    def reset(self) -> "KVCache":
        """Forget every cached key (length 0); returns self.  A cross cache
        (cache_memory's) cannot be reset: make a new one."""
        if self._cross:
            raise ValueError("a cross-attention cache (cache_memory) holds its memory for "
                             "good: make a new one with cache_memory(memory)")
        with self._held("this cache is in use by a call (or a copy or another reset() of "
                        "it): reset it after the call"):
            self._length = 0
            self._epoch += 1
        return self

    # ---- for the call (mha_ext._calls and module), not public
    def _held(self, busy: str = "this cache is in use by another call, or a copy or reset() "
                                "of it in another thread: one call at a time extends a "
                                "cache") -> AbstractContextManager[None]:
        """`with cache._held(busy):` the cache for this block, or
        RuntimeError(busy) when another holds it; no hold for a cross cache
        (never extended)."""
        return nullcontext() if self._cross else _Holding(self._busy, busy)

    def _check_owner(self, module: MultiHeadAttention) -> None:
        if self._module is not module:
            raise ValueError("this cache belongs to another module: make one with this "
                             "module's new_cache(batch_size, max_len)")

    def _c_tuple(self) -> tuple[np.ndarray, np.ndarray, int]:
        return (self._k, self._v, self._length)

    def __repr__(self) -> str:
        kind = "cross, " if self._cross else ""
        return (f"KVCache({kind}batch_size={self.batch_size}, length={self._length}, "
                f"capacity={self.capacity}, n_kv_heads={self._k.shape[1]}, "
                f"d_k={self._k.shape[2]}, dtype={self._k.dtype})")


def _rebuild(module: MultiHeadAttention, k: np.ndarray, v: np.ndarray, length: int,
             cross: bool) -> KVCache:
    """copy.copy, copy.deepcopy and unpickling: a KVCache of `module`
    holding k, v and `length` keys (each call checks them, as any cache's)."""
    c = KVCache.__new__(KVCache)
    c._adopt(module, k, v, length, cross)
    return c


def _after_fork_in_child():
    # the threads of other calls do not exist in the child: their caches are free
    me = threading.get_ident()
    for c in list(_LIVE):
        by = c._busy.get("by")
        if by is not None and by[0] != me:
            c._busy = {}


os.register_at_fork(after_in_child=_after_fork_in_child)
