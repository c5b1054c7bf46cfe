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

import sys
import threading
from typing import TYPE_CHECKING

import numpy as np

from ._types import Flag, Int

if TYPE_CHECKING:
    from .module import MultiHeadAttention

__all__ = ["KVCache"]


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
    and feed the sequence again.
    """

    __slots__ = ("_module", "_k", "_v", "_length", "_cross", "_busy", "__weakref__")
    # _busy: a lock held by the call that extends the cache (never waited on:
    # a second call finds it held and refuses)

    def __init__(self, module: MultiHeadAttention, batch_size: Int, capacity: Int,
                 cross: Flag = False) -> None:
        """Made by MultiHeadAttention.new_cache / cache_memory, not directly."""
        for name, x in (("batch_size", batch_size), ("max_len", capacity)):
            if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
                raise TypeError(f"{name} must be an int >= 1, not {type(x).__name__}")
            if int(x) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {x!r}")
        B, cap = int(batch_size), int(capacity)
        Hkv, Dk = module.n_kv_heads, module.d_k
        nbytes = 2 * B * Hkv * Dk * cap * np.dtype(module.dtype).itemsize
        if nbytes > sys.maxsize:
            raise MemoryError(f"a cache of batch_size {B} and max_len {cap} would take "
                              f"{nbytes} bytes (2 x batch_size x n_kv_heads {Hkv} x d_k {Dk} "
                              f"x max_len scalars): too large to allocate")
        self._module = module
        self._k = np.zeros((B, Hkv, Dk, cap), dtype=module.dtype)
        self._v = np.zeros((B, Hkv, cap, Dk), dtype=module.dtype)
        self._length = 0
        self._cross = bool(cross)
        self._busy = threading.Lock()

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
        v = self._k[..., :self._length].swapaxes(2, 3)
        v.flags.writeable = False
        return v

    @property
    def values(self) -> np.ndarray:
        """The cached values V per head, (B, Hkv, length, Dk), a read-only view."""
        v = self._v[:, :, :self._length]
        v.flags.writeable = False
        return v

    def reset(self) -> "KVCache":
        """Forget every cached key (length 0); returns self.  A cross cache
        (cache_memory's) cannot be reset: make a new one."""
        if self._cross:
            raise ValueError("a cross-attention cache (cache_memory) holds its memory for "
                             "good: make a new one with cache_memory(memory)")
        self._length = 0
        return self

    # ---- for the call (mha_ext._calls and module), not public
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
