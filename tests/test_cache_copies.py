"""KVCache copies and guards that tests/test_kv_cache.py leaves open: a
copy owns its values too (not only its keys), a cross cache stays a cross
cache through copy.copy, copy.deepcopy and pickle, the values view is
read-only, reset() counts as a change of the cache for trace(), the size
refusal names the bytes, and the repr names d_k and a cross cache.

Legend: B batch, E embedding, H heads, Hkv key/value heads, Dk head width.
"""
import copy
import pickle
import sys

import numpy as np
import pytest

from mha_ext import MultiHeadAttention


def _module(E=64, H=4, Hkv=2, dtype="float32", seed=1):
    return MultiHeadAttention(E, H, n_kv_heads=Hkv, dtype=dtype, seed=seed).eval()


def _x(B, S, E, dtype="float32", seed=0):
    return np.random.default_rng(seed).standard_normal((B, S, E)).astype(dtype)


# ---------------------------------------------------------------- own values

def test_a_copy_owns_its_values_and_leaves_the_original_decoding_unchanged():
    m = _module()
    x = _x(2, 7, 64)
    cache = m.new_cache(2, 8)
    m(x[:, :4], cache=cache, need_weights=False)
    c2 = copy.copy(cache)
    assert not np.shares_memory(c2.values, cache.values)
    assert not np.shares_memory(c2.keys, cache.keys)
    values = cache.values.copy()
    # the copy rewinds and is fed other tokens: it writes over positions 0..
    c2.reset()
    m(x[:, :4] * -2 + 1, cache=c2, need_weights=False)
    np.testing.assert_array_equal(cache.values, values)
    # the original's next step: the bits of a fresh cache fed the same input
    fresh = m.new_cache(2, 8)
    m(x[:, :4], cache=fresh, need_weights=False)
    want, _ = m(x[:, 4:5], cache=fresh, need_weights=False)
    got, _ = m(x[:, 4:5], cache=cache, need_weights=False)
    np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------- cross caches

def _copied(how, m, cache):
    """(module, copy of cache) by copy.copy, copy.deepcopy or a pickle of
    the (module, cache) pair."""
    if how == "copy":
        return m, copy.copy(cache)
    if how == "deepcopy":
        return m, copy.deepcopy(cache)
    return pickle.loads(pickle.dumps((m, cache)))


@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_a_copied_cross_cache_is_still_a_cross_cache(how):
    m = _module()
    memory = _x(2, 5, 64, seed=3)
    q = _x(2, 3, 64, seed=4)
    cache = m.cache_memory(memory)
    assert cache.cross
    want, _ = m(q, cache=cache, need_weights=False)
    mc, c2 = _copied(how, m, cache)
    assert c2.cross
    assert c2.length == cache.length == 5
    got, _ = mc(q, cache=c2, need_weights=False)
    np.testing.assert_array_equal(got, want)
    assert c2.length == 5                      # attended over, never extended
    with pytest.raises(ValueError, match="cross-attention cache"):
        c2.reset()


# ---------------------------------------------------------------- views

def test_the_values_view_is_read_only():
    m = _module()
    cache = m.new_cache(1, 4)
    m(_x(1, 2, 64), cache=cache, need_weights=False)
    vals = cache.values
    assert not vals.flags.writeable
    before = vals.copy()
    with pytest.raises(ValueError, match="read-only"):
        vals[0, 0, 0, 0] = 1.0
    np.testing.assert_array_equal(cache.values, before)


# ---------------------------------------------------------------- trace

def test_a_reset_between_the_traced_call_and_its_reads_is_refused(monkeypatch):
    # trace() reads the cache's change count before its call and after: a
    # reset in between (as another thread's) is a second change
    m = _module()
    x = _x(1, 3, 64)
    cache = m.new_cache(1, 8)
    m(x[:, :2], cache=cache, need_weights=False)
    mod = sys.modules["mha_ext.trace"]
    original = mod.call_and_parameters

    def reset_then_call(module, args, kwargs):
        cache.reset()
        return original(module, args, kwargs)

    monkeypatch.setattr(mod, "call_and_parameters", reset_then_call)
    with pytest.raises(RuntimeError, match="another call changed the cache"):
        m.trace(x[:, 2:3], cache=cache)


# ---------------------------------------------------------------- refusals

def test_a_cache_past_the_address_space_names_its_bytes():
    m = MultiHeadAttention(16, 2, dtype="float32", seed=0)
    B = L = 2**29
    nbytes = 2 * B * L * 16 * 4             # K and V: B x Hkv x Dk x L each (Hkv x Dk = E)
    assert nbytes > sys.maxsize
    with pytest.raises(MemoryError, match=r"would take %d bytes .*too large to allocate"
                       % nbytes):
        m.new_cache(B, L)


# ---------------------------------------------------------------- repr

def test_the_repr_names_the_head_width_and_a_cross_cache():
    m = _module(64, 4, 2)                    # d_k = 64 / 4
    r = repr(m.new_cache(1, 3))
    assert "d_k=%d" % (64 // 4) in r and "n_kv_heads=2" in r
    assert not r.startswith("KVCache(cross")
    rc = repr(m.cache_memory(_x(1, 2, 64)))
    assert rc.startswith("KVCache(cross, ") and "length=2" in rc
