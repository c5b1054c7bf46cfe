"""What trace() reads besides its call's results (mha_ext._trace_reads),
where mutation testing found no test holding the rule: a cached call's
"K cache" and "V cache" steps are the keys and values the call saw, kept
as they were when the cache moves on, and a cache another holder has in
use at the moment trace() reads it is refused (API.md §6), never read as
it is being changed.

Legend: B batch, E embedding, H heads, Hkv key/value heads.
"""
import numpy as np
import pytest

from mha_ext import MultiHeadAttention

E, H, HKV = 32, 4, 2


def _module():
    return MultiHeadAttention(E, H, n_kv_heads=HKV, seed=1).eval()


def _x(S, seed):
    return np.random.default_rng(seed).standard_normal((1, S, E)).astype(np.float32)


@pytest.mark.parametrize("step", ["K cache", "V cache"])
def test_the_cache_steps_keep_the_keys_the_call_saw(step):
    m = _module()
    cache = m.new_cache(1, 8)
    m(_x(3, 0), cache=cache)
    t = m.trace(_x(2, 1), cache=cache)
    seen = np.array(t[step].array)                # as the trace showed it at once
    assert seen.shape == (1, HKV, 5, E // H)
    # the cache moves on: emptied and filled with other keys in the same places
    cache.reset()
    m(_x(6, 2), cache=cache)
    np.testing.assert_array_equal(t[step].array, seen)


class _HeldAfterTheCall(MultiHeadAttention):
    """A module whose cached call is followed, before trace() reads the
    cache, by another holder taking the cache (as another thread's call
    or reset() would); the hold is left to the test to give back."""
    hold = None

    def __call__(self, *args, **kwargs):
        result = super().__call__(*args, **kwargs)
        if kwargs.get("cache") is not None:
            self.hold = kwargs["cache"]._held()
            self.hold.__enter__()
        return result


def test_a_cache_held_by_another_when_trace_reads_it_is_refused():
    m = _HeldAfterTheCall(E, H, n_kv_heads=HKV, seed=1).eval()
    cache = m.new_cache(1, 8)
    try:
        with pytest.raises(RuntimeError, match="trace\\(\\): the cache is in use"):
            m.trace(_x(2, 0), cache=cache)
    finally:
        if m.hold is not None:
            m.hold.__exit__(None, None, None)
    assert not cache._busy
    # nobody holding it: the next trace reads it
    m2 = _module()
    c2 = m2.new_cache(1, 8)
    t = m2.trace(_x(2, 0), cache=c2)
    assert t["K cache"].array.shape == (1, HKV, 2, E // H)
