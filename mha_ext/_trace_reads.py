"""What trace() reads besides its call's results: the parameters and the
cache the call used, read so that another thread's change between the two
is refused (a RuntimeError saying so), never shown as steps of other
parameters or keys than the call's (API.md §6).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .cache import KVCache

__all__ = ["cache_state", "call_and_parameters"]


def cache_state(cache: KVCache, arrays: bool = True) -> tuple[int, int, np.ndarray, np.ndarray]:
    """(length, epoch, K, V) of a cache, read while no call extends it (K,
    V copies, or empty arrays without `arrays`; a cross cache, which no
    call changes, read as it is)."""
    def read() -> tuple[int, int, np.ndarray, np.ndarray]:
        if not arrays:
            return cache.length, cache._epoch, np.empty(0), np.empty(0)
        return cache.length, cache._epoch, np.array(cache.keys), np.array(cache.values)
    with cache._held("trace(): the cache is in use by another call (or a copy or reset() "
                     "of it): trace with a cache no other thread uses meanwhile"):
        return read()


def call_and_parameters(module: Any, args: tuple, kwargs: dict) -> tuple[Any, dict]:
    """(module(*args, **kwargs), a copy of its parameters as that call read
    them).  The copy is taken after the call, under the read lock, but not
    with the lock held across both (a call this one waits for in another
    thread could not end); the module's count of write holds begun
    (editing() blocks, load_state_dict) is the same before the call and
    after the copy, or no copy is returned: a RuntimeError."""
    edits = module._edits()
    result = module(*args, **kwargs)
    params = module.state_dict()
    if module._edits() != edits:
        raise RuntimeError("trace(): another thread changed the module's parameters (an "
                           "editing() block or load_state_dict) while trace() ran, so its "
                           "steps could show other parameters than the call read: trace a "
                           "module no other thread edits meanwhile")
    return result, params
