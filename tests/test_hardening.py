"""API.md §7: bad input of any kind is a TypeError, ValueError, KeyError or
MemoryError whose message names the argument -- never a crash, never a
change to the module.  Odd but valid layouts (views, byte orders, alignment,
integer and bool data) give the result of the plain contiguous array.  NaN,
infinities and huge logits go through the softmax without overflow.

Legend: B batch, Sq/Sk lengths, E = d_model, H = n_heads.
"""
import sys
import tracemalloc

import numpy as np
import pytest

import mha_ext
from _reference import assert_close, reference

E, H, B, SQ, SK = 16, 4, 2, 5, 7
RNG = np.random.default_rng(1234)
X = RNG.standard_normal((B, SQ, E)).astype(np.float32)
KV = RNG.standard_normal((B, SK, E)).astype(np.float32)


def make(**kw):
    return mha_ext.MultiHeadAttention(E, H, seed=7, **kw).eval()


class ArrayRaises:
    """An object whose __array__ raises (a broken array-like)."""

    def __array__(self, *args, **kwargs):
        raise RuntimeError("this __array__ is broken")


class LenRaises:
    """A sequence-like whose __len__ raises."""

    def __len__(self):
        raise ZeroDivisionError("no length")

    def __getitem__(self, i):
        return 1.0


def misaligned(a):
    """A copy of `a` whose data pointer is not aligned for its dtype."""
    raw = np.zeros(a.nbytes + 1, dtype=np.uint8)
    view = raw[1:].view(a.dtype).reshape(a.shape)
    view[...] = a
    assert a.dtype.itemsize == 1 or not view.flags.aligned
    return view


def call(*args, **kw):
    return lambda m: m(*args, **kw)


def ctor(*args, **kw):
    return lambda m: mha_ext.MultiHeadAttention(*args, **kw)


def load(change):
    def f(m):
        sd = m.state_dict()
        change(sd)
        return m.load_state_dict(sd)
    return f


def sd_set(key, value):
    return load(lambda sd: sd.__setitem__(key, value))


def sd_del(key):
    return load(lambda sd: sd.__delitem__(key))


def set_attr(name, value):
    return lambda m: setattr(m, name, value)


BIG = np.broadcast_to(np.float32(0), (1, 2 ** 36, E))       # zero stride, 4 TiB as float32
OVER = np.broadcast_to(np.float32(0), (1, 2 ** 31, E))      # (B, H, Sq, Sk) overflows int64
ASK = (TypeError, ValueError)

# (id, action on a module, the exceptions allowed, words the message must contain)
BAD = [
    # non-arrays and arrays of the wrong kind
    ("query-str", call("abc"), ASK, ["query"]),
    ("query-None", call(None), ASK, ["query"]),
    ("query-object", call(np.full((B, SQ, E), object())), ASK, ["query"]),
    ("query-object-list", call([[[object()] * E] * SQ] * B), ASK, ["query"]),
    ("query-complex", call(X.astype(np.complex64)), ASK, ["query", "complex"]),
    ("key-complex", call(X, KV.astype(complex)), ASK, ["key", "complex"]),
    ("value-complex", call(X, KV, KV.astype(complex)), ASK, ["value"]),
    ("query-string-dtype", call(X.astype(str)), ASK, ["query"]),
    ("query-bytes-dtype", call(X.astype("S8")), ASK, ["query"]),
    ("query-datetime", call(np.zeros((B, SQ, E), "datetime64[s]")), ASK, ["query"]),
    ("query-structured", call(np.zeros((B, SQ, E), [("a", "f4")])), ASK, ["query"]),
    ("query-ragged", call([[[1.0] * E], [[1.0] * E, [2.0] * E]]), ASK, ["query"]),
    ("query-array-raises", call(ArrayRaises()), ASK, ["query"]),
    ("key-array-raises", call(X, ArrayRaises()), ASK, ["key"]),
    ("value-array-raises", call(X, KV, ArrayRaises()), ASK, ["value"]),
    ("query-len-raises", call(LenRaises()), ASK, ["query"]),
    # wrong ndim and shapes
    ("query-0d", call(np.float32(1)), ASK, ["query"]),
    ("query-1d", call(X[0, 0]), ASK, ["query"]),
    ("query-4d", call(X[None]), ASK, ["query"]),
    ("query-width", call(X[..., :-1]), ASK, ["query", "16"]),
    ("query-zero-width", call(np.zeros((B, SQ, 0), np.float32)), ASK, ["query"]),
    ("key-batch", call(X, KV[:1]), ASK, ["key"]),
    ("key-width", call(X, KV[..., :3]), ASK, ["key"]),
    ("key-4d", call(X, KV[None]), ASK, ["key"]),
    ("value-length", call(X, KV, KV[:, :-1]), ASK, ["value"]),
    ("value-width", call(X, KV, KV[..., :8]), ASK, ["value"]),
    ("value-batch-zero", call(X, KV, KV[:0]), ASK, ["value"]),
    ("unbatched-query-batched-key", call(X[0], KV), ASK, ["key"]),
    ("batched-query-unbatched-key", call(X, KV[0]), ASK, ["key"]),
    # masks of the wrong values, shape or dtype
    ("mask-value-2", call(X, mask=np.full((SQ, SQ), 2)), ASK, ["mask", "attn_mask"]),
    ("mask-value-half", call(X, mask=np.full((SQ, SQ), 0.5)), ASK, ["mask"]),
    ("mask-value-nan", call(X, mask=np.full((SQ, SQ), np.nan)), ASK, ["mask"]),
    ("mask-value-negative", call(X, mask=-np.ones((SQ, SQ), int)), ASK, ["mask"]),
    ("mask-shape", call(X, mask=np.zeros((3, SQ), bool)), ASK, ["mask", "(3, 5)"]),
    ("mask-heads", call(X, mask=np.zeros((B, 3, SQ, SQ), bool)), ASK, ["mask", "heads"]),
    ("mask-5d", call(X, mask=np.zeros((1, 1, 1, SQ, SQ), bool)), ASK, ["mask"]),
    ("mask-complex", call(X, mask=np.zeros((SQ, SQ), complex)), ASK, ["mask"]),
    ("mask-string", call(X, mask=np.zeros((SQ, SQ), "U1")), ASK, ["mask"]),
    ("mask-object", call(X, mask=np.full((SQ, SQ), None)), ASK, ["mask"]),
    ("mask-array-raises", call(X, mask=ArrayRaises()), ASK, ["mask"]),
    ("attn_mask-int", call(X, attn_mask=np.zeros((SQ, SQ), int)), ASK, ["attn_mask"]),
    ("attn_mask-shape", call(X, attn_mask=np.zeros((SQ, SQ + 1), bool)), ASK, ["attn_mask"]),
    ("attn_mask-3d", call(X, attn_mask=np.zeros((B * H + 1, SQ, SQ))), ASK, ["attn_mask"]),
    ("attn_mask-complex", call(X, attn_mask=np.zeros((SQ, SQ), complex)), ASK, ["attn_mask"]),
    ("attn_mask-raises", call(X, attn_mask=ArrayRaises()), ASK, ["attn_mask"]),
    ("key_padding_mask-shape", call(X, key_padding_mask=np.zeros((B, SQ + 1), bool)), ASK,
     ["key_padding_mask"]),
    ("key_padding_mask-int", call(X, key_padding_mask=np.zeros((B, SQ), int)), ASK,
     ["key_padding_mask"]),
    ("key_padding_mask-unbatched", call(X[0], key_padding_mask=np.zeros((B, SQ), bool)), ASK,
     ["key_padding_mask"]),
    ("masked_rows", call(X, masked_rows="zeros"), ASK, ["masked_rows"]),
    # misspelled keywords
    ("kw-atn_mask", call(X, atn_mask=None), ASK, ["atn_mask"]),
    ("kw-need_weight", call(X, need_weight=False), ASK, ["need_weight"]),
    ("kw-causal", call(X, causal=True), ASK, ["causal"]),
    # sizes too large to allocate: MemoryError before anything is allocated
    ("query-too-large", call(BIG, X[:1, :1], need_weights=False), (MemoryError,), ["query"]),
    ("weights-overflow", call(OVER), (MemoryError,), ["query"]),
    # bad constructor arguments
    ("ctor-d_model-float", ctor(16.0, 4), ASK, ["d_model"]),
    ("ctor-d_model-bool", ctor(True, 1), ASK, ["d_model"]),
    ("ctor-d_model-negative", ctor(-16, 4), ASK, ["d_model"]),
    ("ctor-d_model-str", ctor("16", 4), ASK, ["d_model"]),
    ("ctor-d_model-2**70", ctor(2 ** 70, 2), ASK, ["d_model"]),
    ("ctor-n_heads-zero", ctor(16, 0), ASK, ["n_heads"]),
    ("ctor-not-divisible", ctor(16, 3), ASK, ["d_model", "n_heads"]),
    ("ctor-dropout-high", ctor(16, 4, 1.5), ASK, ["dropout"]),
    ("ctor-dropout-nan", ctor(16, 4, float("nan")), ASK, ["dropout"]),
    ("ctor-dropout-str", ctor(16, 4, "0.1"), ASK, ["dropout"]),
    ("ctor-dtype-float16", ctor(16, 4, dtype="float16"), ASK, ["dtype"]),
    ("ctor-dtype-banana", ctor(16, 4, dtype="banana"), ASK, ["dtype"]),
    ("ctor-dtype-None", ctor(16, 4, dtype=None), ASK, ["dtype"]),
    ("ctor-kdim-zero", ctor(16, 4, kdim=0), ASK, ["kdim"]),
    ("ctor-vdim-float", ctor(16, 4, vdim=2.0), ASK, ["vdim"]),
    ("ctor-seed-str", ctor(16, 4, seed="x"), ASK, ["seed"]),
    ("ctor-kw-misspelled", ctor(16, n_head=4), ASK, ["n_head"]),
    ("ctor-too-large", ctor(2 ** 24, 1), (MemoryError,), ["d_model"]),
    ("ctor-overflow", ctor(2 ** 40, 1), (MemoryError,), ["d_model"]),
    ("attr-dropout", set_attr("dropout", 2.0), ASK, ["dropout"]),
    ("attr-dropout-complex", set_attr("dropout", 1j), ASK, ["dropout"]),
    ("train-str", lambda m: m.train("yes"), ASK, ["mode"]),
    # bad state dicts
    ("sd-not-mapping", lambda m: m.load_state_dict([1, 2]), ASK, ["state_dict"]),
    ("sd-missing", sd_del("W_q.bias"), (KeyError,), ["W_q.bias"]),
    ("sd-unexpected", sd_set("W_x.weight", np.zeros(3)), (KeyError,), ["W_x.weight"]),
    ("sd-shape", sd_set("W_k.weight", np.zeros((E, E + 1))), ASK, ["W_k.weight"]),
    ("sd-transposed-shape", sd_set("W_k.weight", np.zeros((E, 3))), ASK, ["W_k.weight"]),
    ("sd-scalar", sd_set("W_o.bias", 1.0), ASK, ["W_o.bias"]),
    ("sd-complex", sd_set("W_o.bias", np.zeros(E, complex)), ASK, ["W_o.bias"]),
    ("sd-string", sd_set("W_v.weight", np.full((E, E), "a")), ASK, ["W_v.weight"]),
    ("sd-object", sd_set("W_v.bias", [object()] * E), ASK, ["W_v.bias"]),
    ("sd-ragged", sd_set("W_q.weight", [[1.0], [1.0, 2.0]]), ASK, ["W_q.weight"]),
    ("sd-array-raises", sd_set("W_q.weight", ArrayRaises()), ASK, ["W_q.weight"]),
    ("sd-None", sd_set("W_q.weight", None), ASK, ["W_q.weight"]),
]


def test_the_table_is_large():
    assert len(BAD) >= 40
    assert len({case[0] for case in BAD}) == len(BAD)


@pytest.mark.parametrize("action, errors, words", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_input_raises_a_named_error(action, errors, words):
    m = make()
    before = m.state_dict()
    x_before = X.copy()
    with pytest.raises(errors) as info:
        action(m)
    assert type(info.value) in (TypeError, ValueError, KeyError, MemoryError)
    message = str(info.value)
    for w in words:
        assert w in message, f"{w!r} not in {message!r}"
    # nothing changed, and the module still works
    for k, v in m.state_dict().items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)
    np.testing.assert_array_equal(X, x_before)
    out, _ = m(X)
    assert np.isfinite(out).all()


def test_too_large_is_refused_before_allocating():
    """The MemoryError comes from the size check, not from a failed
    allocation: NumPy allocates nothing on the way (tracemalloc sees it)."""
    m = make()
    tracemalloc.start()
    try:
        for big, kw in ((BIG, dict(key=X[:1, :1], need_weights=False)), (OVER, {})):
            with pytest.raises(MemoryError, match="^(forward: )?query") as info:
                m(big, **kw)
            assert "_forward" not in str(info.value)  # the public method's name
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


def test_zero_stride_view_of_enormous_length_as_key():
    m = make()
    key = np.broadcast_to(np.float32(1), (1, 2 ** 34, E))
    with pytest.raises(MemoryError, match="key|query"):
        m(X[:1], key, need_weights=False)


# ---------------------------------------------------------------- odd but valid

def _views():
    """(id, make the odd input from a contiguous float32 array)"""
    return [
        ("fortran", np.asfortranarray),
        ("negative-stride", lambda a: a[:, ::-1].copy()[:, ::-1]),
        ("reversed-last-axis", lambda a: a[..., ::-1].copy()[..., ::-1]),
        ("every-other", lambda a: np.repeat(a, 2, axis=1)[:, ::2]),
        ("transposed-view", lambda a: np.ascontiguousarray(a.transpose(2, 1, 0)).transpose(2, 1, 0)),
        ("misaligned", misaligned),
        ("byteswapped", lambda a: a.astype(a.dtype.newbyteorder())),
        ("big-endian-f8", lambda a: a.astype(">f8")),
        ("float16", lambda a: a.astype(np.float16)),
        ("nested-list", lambda a: a.tolist()),
        ("readonly", lambda a: np.lib.stride_tricks.as_strided(a, writeable=False)),
    ]


@pytest.mark.parametrize("make_view", [v[1] for v in _views()], ids=[v[0] for v in _views()])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_odd_layouts_equal_contiguous(make_view, dtype):
    m = make(dtype=dtype)
    x = X.astype(np.float16).astype(dtype)  # exactly representable in every view's dtype
    kv = KV.astype(np.float16).astype(dtype)
    causal = np.triu(np.ones((SQ, SK), bool), 1)
    want = m(x, kv, attn_mask=causal)
    got = m(make_view(x), make_view(kv), make_view(kv), attn_mask=causal)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
        assert g.dtype == np.dtype(dtype) and g.flags.c_contiguous


def test_zero_stride_broadcast_inputs():
    m = make()
    row = X[:, :1]
    x = np.broadcast_to(row, X.shape)
    assert x.strides[1] == 0
    got = m(x)
    want = m(np.ascontiguousarray(x))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("dtype", [np.bool_, np.int8, np.int64, np.uint16, np.float16])
def test_int_and_bool_inputs_are_converted(dtype):
    m = make(dtype="float64")
    x = (RNG.standard_normal((B, SQ, E)) * 3).astype(dtype)
    out, w = m(x)
    sd = m.state_dict()
    want_out, want_w = reference(sd, H, x.astype(np.float64))
    assert_close(out, want_out, np.float64)
    assert_close(w, want_w, np.float64)


@pytest.mark.parametrize("name", ["mask", "attn_mask", "key_padding_mask"])
def test_odd_mask_layouts(name):
    m = make()
    rng = np.random.default_rng(5)
    shape = {"mask": (B, 1, SQ, SK), "attn_mask": (SQ, SK), "key_padding_mask": (B, SK)}[name]
    mk = rng.random(shape) < 0.3
    want = m(X, KV, **{name: mk})
    for odd in (mk[..., ::-1].copy()[..., ::-1], np.asfortranarray(mk), misaligned(mk),
                mk.astype(np.uint8) if name == "mask" else mk.tolist()):
        got = m(X, KV, **{name: odd})
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
    if name != "mask":
        add = np.where(mk, -np.inf, 0.0).astype(np.float32)
        for odd in (add, add.astype(">f8"), misaligned(add), add[..., ::-1].copy()[..., ::-1]):
            got = m(X, KV, **{name: odd})
            for g, w in zip(got, want):
                np.testing.assert_array_equal(g, w)


def test_broadcast_mask_with_zero_strides():
    m = make()
    causal = np.triu(np.ones((SQ, SQ), bool), 1)
    full = np.broadcast_to(causal, (B, H, SQ, SQ))
    assert full.strides[0] == 0
    for g, w in zip(m(X, mask=full), m(X, is_causal=True)):
        np.testing.assert_array_equal(g, w)


# ---------------------------------------------------------------- zero sizes

@pytest.mark.parametrize("b, sq, sk", [(0, SQ, SK), (B, 0, SK), (0, 0, 0), (B, SQ, 0), (B, 0, 0)])
@pytest.mark.parametrize("need_weights", [True, False])
def test_zero_size_dimensions(b, sq, sk, need_weights):
    m = make()
    q = np.zeros((b, sq, E), np.float32)
    kv = np.zeros((b, sk, E), np.float32)
    for rows in ("nan", "zero"):
        out, w = m(q, kv, need_weights=need_weights, masked_rows=rows)
        assert out.shape == (b, sq, E)
        assert w is None if not need_weights else w.shape == (b, H, sq, sk)
        if sk == 0 and b * sq > 0:  # no key at all: an empty sum, like torch
            np.testing.assert_array_equal(out, np.broadcast_to(m.W_o.bias, out.shape))


# ---------------------------------------------------------------- NaN, inf, huge

@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_huge_logits_do_not_overflow(dtype):
    m = make(dtype=dtype)
    big = 1e30 if dtype == "float32" else 1e300
    add = np.zeros((SQ, SK), dtype)
    add[:, 2] = big
    out, w = m(X, KV, attn_mask=add)
    assert np.isfinite(out).all() and np.isfinite(w).all()
    np.testing.assert_allclose(w[..., 2], 1.0)
    # huge scores from huge inputs: finite weights that sum to one
    scale = 1e15 if dtype == "float32" else 1e150
    out, w = m(X.astype(dtype) * np.dtype(dtype).type(scale), KV)
    assert np.isfinite(w).all()
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-5)
    # very negative (but finite) additive masks still give proper weights
    out, w = m(X, KV, attn_mask=np.full((SQ, SK), -big, dtype))
    assert np.isfinite(w).all()
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_inputs_stay_in_their_batch(bad):
    m = make()
    x = X.copy()
    x[1, 2, 3] = bad
    out, w = m(x)
    want_out, want_w = m(X[:1])
    np.testing.assert_array_equal(out[:1], want_out)
    np.testing.assert_array_equal(w[:1], want_w)
    assert not np.isfinite(out[1]).all()


def test_nan_in_additive_mask_gives_nan_rows_only_there():
    m = make(dtype="float64")
    add = np.zeros((SQ, SK))
    add[1, 3] = np.nan
    out, w = m(X, KV, attn_mask=add)
    want_out, want_w = reference(m.state_dict(), H, X, KV, attn_mask=add)
    assert_close(out, want_out, np.float64)
    assert_close(w, want_w, np.float64)
    assert np.isnan(w[:, :, 1]).all() and np.isfinite(w[:, :, 0]).all()


def test_all_minus_inf_additive_mask_is_a_blocked_row():
    m = make()
    add = np.zeros((SQ, SK), np.float32)
    add[0] = -np.inf
    out, w = m(X, KV, attn_mask=add)
    assert np.isnan(w[:, :, 0]).all() and np.isnan(out[:, 0]).all()
    out, w = m(X, KV, attn_mask=add, masked_rows="zero")
    np.testing.assert_array_equal(w[:, :, 0], 0)
    np.testing.assert_allclose(out[:, 0], np.broadcast_to(m.W_o.bias, (B, E)))


def test_nonfinite_parameters_do_not_crash():
    m = make()
    for value in (np.nan, np.inf, 1e38):
        m.W_k.weight[0, 0] = value
        out, w = m(X)
        assert out.shape == X.shape and w.shape == (B, H, SQ, SQ)


def test_error_messages_name_the_module_not_internals():
    """A too-large call says what was asked for (the shapes), not a C status."""
    m = make()
    with pytest.raises(MemoryError) as info:
        m(BIG, X[:1, :1], need_weights=False)
    assert "2" in str(info.value) and "query" in str(info.value)
    assert sys.getrefcount(BIG) < 10
