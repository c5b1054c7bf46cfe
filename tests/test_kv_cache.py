"""The key/value cache (issue 15): decoding token by token, or in chunks of
any size, through ``m(x, cache=cache)`` gives outputs bit-identical to the
full causal call over the whole sequence (same instruction set), in float32
and float64, with grouped-query attention too; masks, windows and cross
caches; and every misuse is a clear error that leaves the cache unchanged.

The oracle of the bit-exactness tests is our own full call: the property is
that two ways of computing the same rows agree to the last bit (a test that
fails on any reordering of a sum).  Their values against torch are the
parity tests' (test_gqa.py for grouped-query attention).

Legend: B batch, S sequence length, E = d_model, H = n_heads, Hkv =
n_kv_heads, Dk = E / H, L the cache's length.
"""
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mha_ext
from mha_ext import MultiHeadAttention
from mha_ext.cache import KVCache

SHAPES = [(64, 1, 1), (64, 4, 4), (64, 4, 2), (64, 4, 1), (512, 8, 8), (512, 8, 2)]


def _module(E, H, Hkv, dtype, seed=1, **kw):
    return MultiHeadAttention(E, H, n_kv_heads=Hkv, dtype=dtype, seed=seed, **kw).eval()


def _x(B, S, E, dtype, seed=0):
    return np.random.default_rng(seed).standard_normal((B, S, E)).astype(dtype)


def _decode(m, x, chunks, need_weights=False, **kw):
    """x fed through a fresh cache in pieces of the given sizes: (the
    outputs concatenated, the weights of each call, the cache)."""
    B, S, _ = x.shape
    cache = m.new_cache(B, S)
    outs, ws, L = [], [], 0
    for n in chunks:
        o, w = m(x[:, L:L + n], cache=cache, need_weights=need_weights, **kw)
        assert cache.length == L + n
        outs.append(o)
        ws.append(w)
        L += n
    return np.concatenate(outs, axis=1), ws, cache


def _sizes(S, chunk):
    return [min(chunk, S - i) for i in range(0, S, chunk)]


# ---------------------------------------------------------------- bit-exactness

@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("E,H,Hkv", SHAPES)
@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 40])
def test_decoding_is_bit_identical_to_the_full_causal_call(dtype, E, H, Hkv, chunk):
    m = _module(E, H, Hkv, dtype)
    x = _x(3, 40, E, dtype)
    full, _ = m(x, is_causal=True, need_weights=False)
    dec, _, cache = _decode(m, x, _sizes(40, chunk))
    assert dec.dtype == full.dtype
    assert np.array_equal(dec, full), np.abs(dec - full).max()
    assert cache.length == 40


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("chunk", [1, 5, 40])
def test_decoding_with_weights_is_bit_identical(dtype, chunk):
    # need_weights=True: the output and every weight row of the full call
    m = _module(64, 4, 2, dtype)
    x = _x(2, 40, 64, dtype)
    full, fw = m(x, is_causal=True, need_weights=True)
    dec, ws, _ = _decode(m, x, _sizes(40, chunk), need_weights=True)
    assert np.array_equal(dec, full)
    L = 0
    for w in ws:
        n = w.shape[2]
        assert w.shape == (2, 4, n, L + n)
        assert np.array_equal(w, fw[:, :, L:L + n, :L + n])
        L += n


def test_long_sequences_cross_every_block_boundary(isa):
    # 600 keys: more than two online-softmax key blocks (256) and many query
    # blocks (48), decoded in chunks that straddle them, on every ISA
    m = _module(64, 4, 2, "float32")
    x = _x(1, 600, 64, "float32")
    full, _ = m(x, is_causal=True, need_weights=False)
    for sizes in ([1] * 600, _sizes(600, 7), [250, 7, 1, 300, 42]):
        dec, _, _ = _decode(m, x, sizes)
        assert np.array_equal(dec, full)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=12),
       st.sampled_from(["float32", "float64"]), st.sampled_from(SHAPES[:4]))
def test_any_chunking_is_bit_identical(sizes, dtype, shape):
    E, H, Hkv = shape
    S = sum(sizes)
    m = _module(E, H, Hkv, dtype)
    x = _x(2, S, E, dtype, seed=S)
    full, _ = m(x, is_causal=True, need_weights=False)
    dec, _, _ = _decode(m, x, sizes)
    assert np.array_equal(dec, full)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_decoding_is_bit_identical_at_any_thread_count(threads):
    m = _module(512, 8, 2, "float32")
    x = _x(4, 30, 512, "float32")
    full, _ = m(x, is_causal=True, need_weights=False)  # the default thread count
    before = mha_ext.get_num_threads()
    mha_ext.set_num_threads(threads)
    try:
        dec, _, _ = _decode(m, x, _sizes(30, 4))
    finally:
        mha_ext.set_num_threads(before)
    assert np.array_equal(dec, full)


# ---------------------------------------------------------------- masks, windows

def test_left_padded_prompts_with_a_key_padding_mask():
    # batch row 0 has 3 pad tokens on the left: blocked in every call
    m = _module(64, 4, 2, "float64")
    x = _x(2, 20, 64, "float64")
    pad = np.zeros((2, 20), dtype=bool)
    pad[0, :3] = True
    full, _ = m(x, is_causal=True, key_padding_mask=pad, need_weights=False,
                masked_rows="zero")
    cache = m.new_cache(2, 20)
    outs, L = [], 0
    for n in (8, 1, 1, 5, 5):
        o, _ = m(x[:, L:L + n], cache=cache, key_padding_mask=pad[:, :L + n],
                 need_weights=False, masked_rows="zero")
        outs.append(o)
        L += n
    assert np.array_equal(np.concatenate(outs, 1), full)


def test_attn_mask_and_window_cover_the_cached_keys():
    m = _module(64, 4, 4, "float32")
    x = _x(2, 24, 64, "float32")
    add = np.random.default_rng(5).standard_normal((24, 24)).astype(np.float32)
    full, _ = m(x, is_causal=True, attn_mask=add, window=(5, None), need_weights=False)
    cache = m.new_cache(2, 24)
    outs, L = [], 0
    for n in (10, 1, 3, 10):
        o, _ = m(x[:, L:L + n], cache=cache, attn_mask=add[L:L + n, :L + n],
                 window=(5, None), need_weights=False)
        outs.append(o)
        L += n
    assert np.array_equal(np.concatenate(outs, 1), full)


def test_a_wrongly_shaped_mask_names_the_cached_length():
    m = _module(64, 4, 2, "float32")
    cache = m.new_cache(1, 8)
    m(_x(1, 3, 64, "float32"), cache=cache)
    with pytest.raises(ValueError, match="4"):
        m(_x(1, 1, 64, "float32"), cache=cache, key_padding_mask=np.zeros((1, 1), bool))
    assert cache.length == 3


# ---------------------------------------------------------------- cross-attention

@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_cross_cache_equals_the_plain_call_over_the_memory(dtype):
    m = _module(64, 4, 2, dtype, kdim=32, vdim=48)
    mem_k = _x(2, 11, 32, dtype, seed=3)
    mem_v = _x(2, 11, 48, dtype, seed=4)
    cache = m.cache_memory(mem_k, mem_v)
    assert cache.cross and cache.length == 11 and cache.capacity == 11
    q = _x(2, 6, 64, dtype, seed=5)
    plain, pw = m(q, mem_k, mem_v)
    first, fw = m(q[:, :2], cache=cache)
    again, _ = m(q[:, 2:], cache=cache)
    assert cache.length == 11  # a cross cache is never extended
    assert np.array_equal(np.concatenate([first, again], 1), plain)
    assert np.array_equal(fw, pw[:, :, :2])


@pytest.mark.parametrize("M", [3, 5])  # M == B: the memory's axes read the other way
def test_cross_cache_of_a_seq_first_module_takes_a_seq_first_memory(M):
    # a module with batch_first False (from_torch of a seq-first torch module)
    # takes (S, B, E) inputs; cache_memory read its memory as (B, M, kdim)
    # all the same: 0.6 off the plain call at M == B, a misleading batch
    # size error otherwise
    m = _module(64, 4, 2, "float64", kdim=32, vdim=48)
    m.batch_first = False
    mem_k = _x(M, 3, 32, "float64", seed=3)  # (M, B, kdim)
    mem_v = _x(M, 3, 48, "float64", seed=4)
    q = _x(2, 3, 64, "float64", seed=5)      # (L, B, E)
    plain, pw = m(q, mem_k, mem_v)
    out, w = m(q, cache=m.cache_memory(mem_k, mem_v))
    assert out.shape == (2, 3, 64)
    assert np.array_equal(out, plain) and np.array_equal(w, pw)
    if M != 3:  # a batch-first value: the shape the message asks for
        with pytest.raises(ValueError, match=r"\(length, batch, vdim\) = \(5, 3, 48\)"):
            m.cache_memory(mem_k, mem_v.swapaxes(0, 1))


def test_cached_keys_and_values_are_the_projections():
    m = _module(64, 4, 2, "float64")
    x = _x(2, 5, 64, "float64")
    cache = m.new_cache(2, 9)
    m(x, cache=cache)
    k = x @ m.W_k.weight.T + m.W_k.bias  # (B, S, Hkv*Dk)
    v = x @ m.W_v.weight.T + m.W_v.bias
    want_k = k.reshape(2, 5, 2, 16).transpose(0, 2, 1, 3)
    want_v = v.reshape(2, 5, 2, 16).transpose(0, 2, 1, 3)
    assert cache.keys.shape == cache.values.shape == (2, 2, 5, 16)
    np.testing.assert_allclose(cache.keys, want_k, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(cache.values, want_v, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError):
        cache.keys[0, 0, 0, 0] = 1.0  # read-only
    assert cache.reset() is cache and cache.length == 0 and cache.keys.shape[2] == 0


# ---------------------------------------------------------------- misuse

def test_overflow_is_a_clear_error_and_leaves_the_cache_unchanged():
    m = _module(64, 4, 2, "float32")
    cache = m.new_cache(2, 5)
    m(_x(2, 4, 64, "float32"), cache=cache)
    k, v = cache.keys.copy(), cache.values.copy()
    with pytest.raises(ValueError, match="4 of 5 keys: 2 more do not fit"):
        m(_x(2, 2, 64, "float32"), cache=cache)
    assert cache.length == 4
    assert np.array_equal(cache.keys, k) and np.array_equal(cache.values, v)


@pytest.mark.parametrize("bad,err,match", [
    (lambda m, o: m(_x(3, 1, 64, "float32"), cache=m.new_cache(2, 4)), ValueError,
     "batch_size 2, the call has batch 3"),
    (lambda m, o: m(_x(2, 1, 64, "float32"), cache=o.new_cache(2, 4)), ValueError,
     "belongs to another module"),
    (lambda m, o: m(_x(2, 1, 64, "float32"), cache=(1, 2, 3)), TypeError, "KVCache"),
    (lambda m, o: m(_x(2, 1, 64, "float32"),
                    cache=m.cache_memory(_x(2, 3, 64, "float32")), is_causal=True),
     ValueError, "not causal"),
    (lambda m, o: m(_x(2, 1, 64, "float32"), _x(2, 1, 64, "float32"),
                    cache=m.cache_memory(_x(2, 3, 64, "float32"))),
     ValueError, "query alone"),
    (lambda m, o: m.cache_memory(_x(2, 3, 64, "float32")).reset(), ValueError,
     "cache_memory"),
    (lambda m, o: m.new_cache(0, 4), ValueError, "batch_size must be an int >= 1"),
    (lambda m, o: m.new_cache(2, 2.5), TypeError, "max_len must be an int >= 1"),
    (lambda m, o: m.new_cache(True, 4), TypeError, "batch_size must be an int >= 1"),
    (lambda m, o: m.new_cache(1, 2 ** 62), MemoryError, "max_len 4611686018427387904"),
    (lambda m, o: m.new_cache(2 ** 40, 2 ** 30), MemoryError, "too large to allocate"),
    # below sys.maxsize bytes, more than can be mapped: still the sizes, not NumPy's words
    (lambda m, o: m.new_cache(2 ** 20, 2 ** 20), MemoryError,
     "batch_size 1048576 and max_len 1048576"),
    (lambda m, o: m(_x(2, 1, 64, "float32"), cache=m.new_cache(2, 4), is_causal="yes"),
     TypeError, "is_causal"),
])
def test_bad_caches_are_clear_errors(bad, err, match):
    m = _module(64, 4, 2, "float32")
    other = _module(64, 4, 2, "float32")
    with pytest.raises(err, match=match):
        bad(m, other)


@pytest.mark.parametrize("extra", ["add_bias_kv", "add_zero_attn"])
def test_extra_keys_refuse_a_cache(extra):
    # refused when the cache is made (no call could use it), by new_cache and
    # cache_memory alike
    m = MultiHeadAttention(64, 4, seed=0, **{extra: True}).eval()
    with pytest.raises(ValueError, match="add_bias_kv or add_zero_attn"):
        m.new_cache(1, 4)
    with pytest.raises(ValueError, match="add_bias_kv or add_zero_attn"):
        m.cache_memory(_x(1, 2, 64, "float32"))


def test_a_cache_in_use_refuses_a_second_call_and_a_reset():
    m = _module(64, 4, 2, "float32")
    cache = m.new_cache(1, 4)
    m(_x(1, 1, 64, "float32"), cache=cache)
    with cache._held():  # as while another thread's call runs
        with pytest.raises(RuntimeError, match="in use"):
            m(_x(1, 1, 64, "float32"), cache=cache)
        with pytest.raises(RuntimeError, match="in use"):
            cache.reset()      # the call would then add its keys to an emptied cache
        assert cache.length == 1
    assert cache.reset().length == 0
    m(_x(1, 1, 64, "float32"), cache=cache)  # free again: the next call goes through
    assert cache.length == 1 and not cache._busy


def test_two_threads_decode_with_their_own_caches():
    # one module, two caches, two threads at once: each gets the bits it gets alone
    import threading
    m = _module(64, 4, 2, "float32")
    xs = [_x(2, 30, 64, "float32", seed=s) for s in (1, 2)]
    want = [m(x, is_causal=True, need_weights=False)[0] for x in xs]
    got = [None, None]

    def run(i):
        got[i], _, _ = _decode(m, xs[i], [1] * 30)
    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(np.array_equal(g, w) for g, w in zip(got, want))


def test_the_binding_checks_the_cache_arrays():
    # the private call refuses arrays it could not write in place
    m = _module(64, 4, 2, "float32")
    x = _x(1, 2, 64, "float32")
    good_k = np.zeros((1, 2, 16, 4), np.float32)
    good_v = np.zeros((1, 2, 4, 16), np.float32)
    for cache, match in [((good_k.astype(np.float64), good_v, 0), "dtype"),
                         ((good_k[..., ::2], good_v, 0), "contiguous"),
                         ((good_k, np.zeros((1, 2, 5, 16), np.float32), 0), "same capacity"),
                         ((np.zeros((1, 4, 16, 4), np.float32), good_v, 0), "shape"),
                         ((good_k, good_v, 3), "do not fit"),
                         ((good_k, good_v, -1), "do not fit")]:
        with pytest.raises(ValueError, match=match):
            m._forward(x, x, x, cache=cache)
    with pytest.raises(ValueError, match="plain forward"):
        m._forward(x, x, x, cache=(good_k, good_v, 0), reference=True)


def test_a_cache_is_an_ordinary_object():
    m = _module(64, 4, 2, "float64")
    cache = m.new_cache(2, 6)
    assert isinstance(cache, KVCache)
    assert "batch_size=2, length=0, capacity=6, n_kv_heads=2" in repr(cache)
    m2 = pickle.loads(pickle.dumps(m))  # the module pickles with n_kv_heads
    assert m2.n_kv_heads == 2
    with pytest.raises(ValueError, match="another module"):
        m2(_x(2, 1, 64, "float64"), cache=cache)


@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle with its module"])
def test_a_copied_cache_is_its_own_and_decodes_the_same_bits(how):
    # a branch of a decoding (a beam): the copy has its own keys and values,
    # so extending one never changes the other, and each continues exactly
    # as the original would have
    import copy
    m = _module(64, 4, 2, "float32")
    x = _x(2, 7, 64, "float32")
    cache = m.new_cache(2, 8)
    m(x[:, :4], cache=cache, need_weights=False)
    if how == "copy":
        mc, c2 = m, copy.copy(cache)
    elif how == "deepcopy":
        mc, c2 = m, copy.deepcopy(cache)
        m3, c3 = copy.deepcopy((m, cache))  # with its module: the copy's module
        assert c3._module is m3 and m3 is not m
    else:
        mc, c2 = pickle.loads(pickle.dumps((m, cache)))
        assert c2._module is mc and mc is not m
    assert c2.length == 4 and c2.capacity == 8 and c2._k is not cache._k
    np.testing.assert_array_equal(c2.keys, cache.keys)
    np.testing.assert_array_equal(c2.values, cache.values)
    branch, _ = mc(x[:, 4:6] * 3, cache=c2, need_weights=False)  # other tokens
    assert cache.length == 4 and c2.length == 6
    keys = cache.keys.copy()
    main, _ = m(x[:, 4:7], cache=cache, need_weights=False)  # as if alone
    np.testing.assert_array_equal(c2.keys[:, :, :4], keys)
    full, _ = m(x, is_causal=True, need_weights=False)
    np.testing.assert_array_equal(main, full[:, 4:7])
    alt = np.concatenate([x[:, :4], x[:, 4:6] * 3], axis=1)
    np.testing.assert_array_equal(branch, m(alt, is_causal=True, need_weights=False)[0][:, 4:6])


def test_a_cache_in_use_refuses_a_copy():
    import copy
    m = _module(64, 4, 2, "float32")
    cache = m.new_cache(1, 4)
    with cache._held():  # as a call in another thread holds it
        for f in (copy.copy, copy.deepcopy, pickle.dumps):
            with pytest.raises(RuntimeError, match="in use by a call"):
                f(cache)
    assert copy.copy(cache).length == 0


def test_a_call_refused_while_another_thread_copies_the_cache_says_so():
    # a copy holds the cache as a call does (no waiting either way): the
    # refused call's message names copies and reset() too, not only calls
    m = _module(64, 4, 2, "float32")
    cache = m.new_cache(1, 4)
    with cache._held("a copy"):  # as copy.copy in another thread holds it
        with pytest.raises(RuntimeError, match=r"another call, or a copy or reset\(\) of it in "
                                               r"another thread"):
            m(_x(1, 1, 64, "float32"), cache=cache)
    assert cache.length == 0
    m(_x(1, 1, 64, "float32"), cache=cache)
    assert cache.length == 1


def test_the_binding_keeps_no_reference_to_the_cache_arrays():
    import sys
    m = _module(64, 4, 2, "float32")
    x = _x(1, 1, 64, "float32")
    k = np.zeros((1, 2, 16, 4), np.float32)
    v = np.zeros((1, 2, 4, 16), np.float32)
    before = sys.getrefcount(k), sys.getrefcount(v)
    for length in (0, 1, 2, 3, 4, -1):  # the last two are errors
        try:
            m._forward(x, x, x, cache=(k, v, length))
        except ValueError:
            pass
    assert (sys.getrefcount(k), sys.getrefcount(v)) == before


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_grouped_decoding_with_per_head_masks(dtype):
    # grouped-query decoding (one task per key/value head, its rows the
    # group's heads): a per-head additive attn_mask (B*H, n, L + n), a window
    # and a head mask reach the right rows
    m = _module(64, 8, 2, dtype)
    B, S, H = 2, 16, 8
    x = _x(B, S, 64, dtype)
    add = np.random.default_rng(8).standard_normal((B * H, S, S)).astype(dtype)
    hm = np.random.default_rng(9).uniform(0.5, 1.5, (B, H))
    kw = dict(window=(6, None), head_mask=hm, need_weights=False)
    full, _ = m(x, is_causal=True, attn_mask=add, **kw)
    cache = m.new_cache(B, S)
    outs, L = [], 0
    for n in (5, 1, 1, 3, 1, 5):
        o, _ = m(x[:, L:L + n], cache=cache, attn_mask=add[:, L:L + n, :L + n], **kw)
        outs.append(o)
        L += n
    assert np.array_equal(np.concatenate(outs, 1), full)


def test_more_new_keys_than_queries_keep_the_lower_right_alignment():
    # docs/API.md §3.3: m new keys for n queries enter the cache, query i
    # sees keys j <= i + L + m - n: the full call with is_causal="lower_right"
    rng = np.random.default_rng(0)
    m = MultiHeadAttention(8, 2, kdim=6, vdim=5, seed=0).eval()
    x, k, v = (rng.standard_normal((1, 5, w)) for w in (8, 6, 5))
    cache = m.new_cache(1, 8)
    m(x[:, :2], k[:, :2], v[:, :2], cache=cache)
    out, w = m(x[:, 2:3], k[:, 2:4], v[:, 2:4], cache=cache)      # 1 query, 2 keys
    assert cache.length == 4
    full, wf = m(x[:, :3], k[:, :4], v[:, :4], is_causal="lower_right")
    np.testing.assert_array_equal(out, full[:, 2:3])
    np.testing.assert_array_equal(w, wf[:, :, 2:3])
    assert (w[..., 3] > 0).all()                                  # j <= 0 + 2 + 2 - 1
    out, w = m(x[:, 3:5], k[:, 4:5], v[:, 4:5], cache=cache)      # 2 queries, 1 key
    qs = np.concatenate([x[:, :1], x[:, 3:5]], axis=1)            # any query before
    full, wf = m(qs, k[:, :5], v[:, :5], is_causal="lower_right")
    np.testing.assert_array_equal(out, full[:, 1:])
    assert (w[:, :, 0, 4] == 0).all() and (w[:, :, 1, 4] > 0).all()


def test_cache_memory_says_what_its_own_arguments_lack():
    # the messages name memory and value (they quoted a query (B, 0, E) the
    # caller never passed)
    m = MultiHeadAttention(8, 2, kdim=6, vdim=5, seed=0)
    mem = np.zeros((2, 4, 6), np.float32)
    with pytest.raises(ValueError, match=r"value is needed: .*vdim \(5\) is not its kdim \(6\)"):
        m.cache_memory(mem)
    with pytest.raises(ValueError, match=r"value must be \(batch, length, vdim\) = \(2, 4, 5\)"):
        m.cache_memory(mem, np.zeros((2, 3, 5)))
    with pytest.raises(ValueError, match=r"memory must be \(batch, length, kdim = 6\)"):
        m.cache_memory(np.zeros((2, 4, 8)), np.zeros((2, 4, 5)))
    assert m.cache_memory(mem, np.zeros((2, 4, 5))).length == 4
