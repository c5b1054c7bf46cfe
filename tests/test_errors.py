"""Bad input of every kind: the right exception, a message naming the
argument, never a crash (API.md 1, 3, 3.1, 4, 7).

Legend: B batch, Sq/Sk query/key length, E = d_model, H = n_heads.
Good inputs throughout: E = 16, H = 4, query (2, 5, 16), key and value
(2, 7, 16).
"""


import numpy as np
import pytest

import mha_ext
from mha_ext import MultiHeadAttention

E, H, B, Sq, Sk = 16, 4, 2, 5, 7
KEYS = ["W_q.weight", "W_q.bias", "W_k.weight", "W_k.bias",
        "W_v.weight", "W_v.bias", "W_o.weight", "W_o.bias"]
ALLOWED = (TypeError, ValueError, KeyError, MemoryError)


def f32(*shape):
    return np.random.default_rng(sum(shape) + len(shape)).standard_normal(
        shape).astype(np.float32)


Q, K, V = f32(B, Sq, E), f32(B, Sk, E), f32(B, Sk, E)


@pytest.fixture(scope="module")
def m():
    return MultiHeadAttention(E, H, seed=0).eval()


def _mask(shape, dtype=bool, fill=0):
    a = np.zeros(shape, dtype=dtype)
    if fill:
        a.flat[a.size // 2] = fill
    return a


# (id, args, kwargs, exception(s), regex on the message)
CALL_CASES = [
    # wrong number of dimensions
    ("query-0d", (np.float32(1.0), K, V), {}, ValueError, r"query"),
    ("query-1d", (f32(E), K, V), {}, ValueError, r"query"),
    ("query-4d", (f32(1, B, Sq, E), K, V), {}, ValueError, r"query"),
    ("key-4d", (Q, f32(1, B, Sk, E), V), {}, ValueError, r"key"),
    ("value-4d", (Q, K, f32(1, B, Sk, E)), {}, ValueError, r"value"),
    ("key-2d-batched-query", (Q, f32(Sk, E), V), {}, ValueError, r"key"),
    ("value-2d-batched-query", (Q, K, f32(Sk, E)), {}, ValueError, r"value"),
    ("value-1d", (Q, K, f32(E)), {}, ValueError, r"value"),
    # embedding width mismatch
    ("query-E", (f32(B, Sq, E - 1), K, V), {}, ValueError, r"query"),
    ("query-E-shape", (f32(B, Sq, E + 3), K, V), {}, ValueError, r"19"),
    ("key-E", (Q, f32(B, Sk, E + 1), V), {}, ValueError, r"key"),
    ("key-E-shape", (Q, f32(B, Sk, E + 1), V), {}, ValueError, r"17"),
    ("value-E", (Q, K, f32(B, Sk, E - 2)), {}, ValueError, r"value"),
    ("value-E-shape", (Q, K, f32(B, Sk, E - 2)), {}, ValueError, r"14"),
    ("query-E-unbatched", (f32(Sq, E + 1),), {}, ValueError, r"query"),
    # batch mismatch
    ("key-batch", (Q, f32(B + 1, Sk, E), f32(B + 1, Sk, E)), {}, ValueError,
     r"key"),
    ("value-batch", (Q, K, f32(B + 1, Sk, E)), {}, ValueError, r"value"),
    # key / value length mismatch
    ("value-length", (Q, K, f32(B, Sk - 1, E)), {}, ValueError, r"value"),
    ("value-length-unbatched", (Q[0], K[0], f32(Sk + 2, E)), {}, ValueError,
     r"value"),
    # unsupported dtypes
    ("query-complex", (Q.astype(np.complex64), K, V), {}, TypeError,
     r"query"),
    ("key-complex", (Q, K.astype(np.complex128), V), {}, TypeError, r"key"),
    ("value-complex", (Q, K, V.astype(np.complex64)), {}, TypeError,
     r"value"),
    ("query-object", (Q.astype(object), K, V), {}, TypeError, r"query"),
    ("key-object", (Q, K.astype(object), V), {}, TypeError, r"key"),
    ("value-object", (Q, K, V.astype(object)), {}, TypeError, r"value"),
    ("query-str", (np.full((B, Sq, E), "a"), K, V), {}, TypeError, r"query"),
    ("key-bytes", (Q, np.full((B, Sk, E), b"a"), V), {}, TypeError, r"key"),
    ("value-str-list", (Q, K, [[["x"] * E] * Sk] * B), {}, TypeError,
     r"value"),
    ("query-complex-list", ([[[1j] * E] * Sq] * B, K, V), {}, TypeError,
     r"query"),
    # not arrays at all: object or string data (API.md: a TypeError, before
    # any shape is looked at)
    ("query-None", (None, K, V), {}, TypeError, r"query"),
    ("query-object()", (object(), K, V), {}, TypeError, r"query"),
    ("query-dict", ({"a": 1}, K, V), {}, TypeError, r"query"),
    ("query-string", ("hello", K, V), {}, TypeError, r"query"),
    ("query-0d-complex", (np.array(1 + 2j), K, V), {}, TypeError, r"query"),
    ("key-set", (Q, {1, 2}, V), {}, TypeError, r"key"),
    ("value-ragged", (Q, K, [[1.0, 2.0], [3.0]]), {}, (TypeError, ValueError),
     r"value"),
    # masks
    ("mask-shape-Sk", (Q, K, V), dict(mask=_mask((Sq, Sk + 1))), ValueError,
     r"mask"),
    ("mask-shape-Sq", (Q, K, V), dict(mask=_mask((Sq + 2, Sk))), ValueError,
     r"mask"),
    ("mask-shape-B", (Q, K, V), dict(mask=_mask((B + 1, 1, Sq, Sk))),
     ValueError, r"mask"),
    ("mask-shape-H", (Q, K, V), dict(mask=_mask((B, H - 1, Sq, Sk))),
     ValueError, r"mask"),
    ("mask-5d", (Q, K, V), dict(mask=_mask((1, B, H, Sq, Sk))), ValueError,
     r"mask"),
    ("mask-value-2", (Q, K, V), dict(mask=_mask((Sq, Sk), np.int64, 2)),
     ValueError, r"attn_mask"),
    ("mask-value-0.5", (Q, K, V), dict(mask=_mask((Sq, Sk), np.float32, 0.5)),
     ValueError, r"attn_mask"),
    ("mask-value--1", (Q, K, V), dict(mask=_mask((Sq, Sk), np.int8, -1)),
     ValueError, r"attn_mask"),
    ("mask-value-nan", (Q, K, V),
     dict(mask=_mask((Sq, Sk), np.float64, np.nan)), ValueError,
     r"attn_mask"),
    ("mask-complex", (Q, K, V), dict(mask=_mask((Sq, Sk), np.complex64)),
     (TypeError, ValueError), r"mask"),
    ("mask-str", (Q, K, V), dict(mask=np.full((Sq, Sk), "0")),
     (TypeError, ValueError), r"mask"),
    ("mask-object", (Q, K, V), dict(mask=object()), (TypeError, ValueError),
     r"mask"),
    # keywords and arity
    ("unknown-keyword", (Q, K, V), dict(foo=1), TypeError, r"foo"),
    ("misspelt-keyword", (Q, K, V), dict(need_weight=False), TypeError,
     r"need_weight"),
    ("need_weights-positional", (Q, K, V, None, False), {}, TypeError, None),
    ("no-query", (), {}, TypeError, r"query"),
    ("query-twice", (Q,), dict(query=Q), TypeError, r"query"),
]


@pytest.mark.parametrize("args, kwargs, exc, pattern",
                         [pytest.param(*c[1:], id=c[0]) for c in CALL_CASES])
def test_call_rejects_bad_input(m, args, kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        m(*args, **kwargs)


@pytest.mark.parametrize("args, kwargs, exc, pattern",
                         [pytest.param(*c[1:], id=c[0]) for c in CALL_CASES
                          if c[0] in ("query-E", "value-length",
                                      "mask-value-2", "unknown-keyword")])
def test_forward_rejects_bad_input_too(m, args, kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        m.forward(*args, **kwargs)


def test_bad_call_leaves_module_usable(m):
    good = m(Q, K, V)
    for c in CALL_CASES:
        with pytest.raises(c[3]):
            m(*c[1], **c[2])
    again = m(Q, K, V)
    np.testing.assert_array_equal(good[0], again[0])
    np.testing.assert_array_equal(good[1], again[1])


# --------------------------------------------------------------------------
# constructor
# --------------------------------------------------------------------------

CTOR_CASES = [
    ("d_model-bool", (True, 1), {}, TypeError, r"d_model"),
    ("d_model-float", (16.0, 4), {}, TypeError, r"d_model"),
    ("d_model-str", ("16", 4), {}, TypeError, r"d_model"),
    ("d_model-None", (None, 4), {}, TypeError, r"d_model"),
    ("d_model-zero", (0, 1), {}, ValueError, r"d_model"),
    ("d_model-negative", (-16, 4), {}, ValueError, r"d_model"),
    ("n_heads-bool", (16, True), {}, TypeError, r"n_heads"),
    ("n_heads-float", (16, 4.0), {}, TypeError, r"n_heads"),
    ("n_heads-zero", (16, 0), {}, ValueError, r"n_heads"),
    ("n_heads-negative", (16, -4), {}, ValueError, r"n_heads"),
    ("not-divisible", (10, 3), {}, ValueError, r"(10.*\b3\b)|(\b3\b.*10)"),
    ("not-divisible-2", (16, 5), {}, ValueError, r"(16.*\b5\b)|(\b5\b.*16)"),
    ("dropout-negative", (16, 4, -0.1), {}, ValueError, r"dropout"),
    ("dropout-above-one", (16, 4, 1.5), {}, ValueError, r"dropout"),
    ("dropout-nan", (16, 4, float("nan")), {}, ValueError, r"dropout"),
    ("dropout-inf", (16, 4, float("inf")), {}, ValueError, r"dropout"),
    ("dropout-str", (16, 4, "0.1"), {}, ValueError, r"dropout"),   # API.md: "ValueError
    ("dropout-None", (16, 4, None), {}, ValueError, r"dropout"),   # otherwise"
    ("dropout-bool", (16, 4, True), {}, ValueError, r"dropout"),
    # NumPy's bools as Python's (API.md §9: NumPy scalars where Python's are)
    ("dropout-numpy-bool", (16, 4, np.bool_(True)), {}, ValueError, r"dropout"),
    ("dropout-0d-bool-array", (16, 4, np.array(False)), {}, ValueError, r"not a bool"),
    ("dtype-float16", (16, 4), dict(dtype="float16"), (TypeError, ValueError),
     r"dtype"),
    ("dtype-int", (16, 4), dict(dtype=np.int32), (TypeError, ValueError),
     r"dtype"),
    ("dtype-complex", (16, 4), dict(dtype="complex128"),
     (TypeError, ValueError), r"dtype"),
    ("dtype-junk", (16, 4), dict(dtype="fp32x"), (TypeError, ValueError),
     r"dtype"),
    ("dtype-number", (16, 4), dict(dtype=32), (TypeError, ValueError),
     r"dtype"),
    ("kdim-bool", (16, 4), dict(kdim=True), TypeError, r"kdim"),
    ("kdim-float", (16, 4), dict(kdim=8.0), TypeError, r"kdim"),
    ("kdim-zero", (16, 4), dict(kdim=0), ValueError, r"kdim"),
    ("vdim-negative", (16, 4), dict(vdim=-3), ValueError, r"vdim"),
    ("vdim-float", (16, 4), dict(vdim=2.5), TypeError, r"vdim"),
    ("seed-str", (16, 4), dict(seed="abc"), TypeError, r"seed"),
    ("seed-float", (16, 4), dict(seed=1.5), TypeError, r"seed"),
    ("unknown-keyword", (16, 4), dict(heads=2), TypeError, r"heads"),
    ("missing-n_heads", (16,), {}, TypeError, r"n_heads"),
]


@pytest.mark.parametrize("args, kwargs, exc, pattern",
                         [pytest.param(*c[1:], id=c[0]) for c in CTOR_CASES])
def test_constructor_rejects_bad_arguments(args, kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        MultiHeadAttention(*args, **kwargs)


@pytest.mark.parametrize("value, exc", [
    (-0.5, ValueError), (1.01, ValueError), (float("nan"), ValueError),
    (float("-inf"), ValueError), ("0.5", ValueError), (None, ValueError), (True, ValueError),
    (np.bool_(True), ValueError), (np.array(True), ValueError),
])
def test_dropout_attribute_rejects(value, exc):
    mod = MultiHeadAttention(E, H, 0.2)
    with pytest.raises(exc, match="dropout"):
        mod.dropout = value
    assert mod.dropout == 0.2


# --------------------------------------------------------------------------
# load_state_dict
# --------------------------------------------------------------------------

def _good_state():
    rng = np.random.default_rng(3)
    return {k: rng.standard_normal((E, E) if k.endswith("weight") else (E,))
            .astype(np.float32) for k in KEYS}


def _without(key):
    s = _good_state()
    del s[key]
    return s


def _with(key, value):
    s = _good_state()
    s[key] = value
    return s


LOAD_CASES = [
    ("not-a-dict-list", [1, 2, 3], TypeError, None),
    ("not-a-dict-None", None, TypeError, None),
    ("not-a-dict-array", np.zeros(3), TypeError, None),
    ("missing-W_q.weight", _without("W_q.weight"), KeyError, r"W_q\.weight"),
    ("missing-W_v.bias", _without("W_v.bias"), KeyError, r"W_v\.bias"),
    ("missing-W_o.bias", _without("W_o.bias"), KeyError, r"W_o\.bias"),
    ("empty", {}, KeyError, r"W_[qkvo]\.(weight|bias)"),
    ("shape-W_k.weight-transposed-ish", _with("W_k.weight", np.zeros((E, E + 1))),
     ValueError, r"W_k\.weight"),
    ("shape-W_q.bias", _with("W_q.bias", np.zeros(E + 1)), ValueError,
     r"W_q\.bias"),
    ("shape-W_o.weight-flat", _with("W_o.weight", np.zeros(E * E)),
     ValueError, r"W_o\.weight"),
    ("shape-W_v.bias-2d", _with("W_v.bias", np.zeros((1, E))), ValueError,
     r"W_v\.bias"),
    ("shape-scalar", _with("W_k.bias", 0.0), ValueError, r"W_k\.bias"),
    ("value-str", _with("W_q.bias", np.full(E, "x")),
     (TypeError, ValueError), r"W_q\.bias"),
    ("value-None", _with("W_o.weight", None), (TypeError, ValueError),
     r"W_o\.weight"),
    ("value-complex", _with("W_v.weight", np.zeros((E, E), np.complex64)),
     (TypeError, ValueError), r"W_v\.weight"),
    ("value-object", _with("W_k.weight", object()), (TypeError, ValueError),
     r"W_k\.weight"),
    ("unexpected-key", _with("foo.weight", np.zeros((E, E))),
     (KeyError, ValueError), r"foo\.weight"),
]


@pytest.mark.parametrize("state, exc, pattern",
                         [pytest.param(*c[1:], id=c[0]) for c in LOAD_CASES])
def test_load_state_dict_rejects(state, exc, pattern):
    mod = MultiHeadAttention(E, H, seed=4)
    before = mod.state_dict()
    with pytest.raises(exc, match=pattern):
        mod.load_state_dict(state)
    after = mod.state_dict()
    for key in KEYS:  # nothing changed
        np.testing.assert_array_equal(after[key], before[key], err_msg=key)


# --------------------------------------------------------------------------
# never a crash: many odd shapes, each either works or raises cleanly
# --------------------------------------------------------------------------

def test_odd_shapes_never_crash():
    rng = np.random.default_rng(5)
    mod = MultiHeadAttention(8, 2, seed=5)
    ok = 0
    for _ in range(300):
        def arr():
            nd = int(rng.integers(0, 5))
            shape = tuple(int(rng.choice([0, 1, 2, 3, 8, 9]))
                          for _ in range(nd))
            return rng.standard_normal(shape).astype(np.float32)
        q, k, v = arr(), arr(), arr()
        mask = None
        if rng.random() < 0.3:
            nd = int(rng.integers(0, 5))
            mask = rng.integers(0, 2, tuple(
                int(rng.choice([1, 2, 3, 8])) for _ in range(nd))).astype(bool)
        try:
            out, w = mod(q, k, v, mask=mask)
        except ALLOWED as exc:
            assert str(exc), f"empty message for {type(exc).__name__}"
            continue
        ok += 1
        assert out.shape == q.shape
        assert w.shape[-3:-2] == (2,) and w.shape[-2] == q.shape[-2]
    # most combinations are invalid; what matters is that none crashed


# --------------------------------------------------------------------------
# no leaked references, on success or on error
# --------------------------------------------------------------------------

def test_calls_do_not_leak_references(m):
    import sys
    q, k, v = f32(B, Sq, E), f32(B, Sk, E), f32(B, Sk, E)
    mask = _mask((Sq, Sk))
    bad_v = f32(B, Sk + 1, E)
    bad_mask = _mask((Sq, Sk), np.int64, 2)
    objs = (q, k, v, mask, bad_v, bad_mask)
    for _ in range(3):  # warm up any caches
        m(q, k, v, mask=mask)
    before = [sys.getrefcount(x) for x in objs]
    for _ in range(200):
        m(q, k, v, mask=mask)
        m(q, k, v, mask=mask, need_weights=False)
        with pytest.raises(ValueError):
            m(q, k, bad_v)
        with pytest.raises(ValueError):
            m(q, k, v, mask=bad_mask)
    after = [sys.getrefcount(x) for x in objs]
    assert after == before


@pytest.mark.parametrize("value", [True, np.bool_(True), np.array(True), np.array(False)])
def test_a_bool_scale_is_refused_whatever_its_kind(value):
    """scale is a real number: a Python bool, a NumPy bool and a 0-d bool
    array alike are a TypeError saying so (the 0-d array read as 1.0 before)."""
    mod = MultiHeadAttention(E, H)
    x = np.ones((1, 3, E), np.float32)
    with pytest.raises(TypeError, match="scale must be None or a real number, not a bool"):
        mod(x, scale=value)
    with pytest.raises(TypeError, match="scale must be None or a real number, not a bool"):
        mha_ext.scaled_dot_product_attention(x, x, x, scale=value)


def test_a_torch_bool_as_dropout_is_refused_as_a_bool():
    """A torch bool tensor as dropout (constructor and setter) was read as
    1.0 where a Python or NumPy bool is refused."""
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="dropout must be a real number in \\[0, 1\\], not a bool"):
        MultiHeadAttention(E, H, torch.tensor(True))
    mod = MultiHeadAttention(E, H, torch.tensor(0.25))
    assert mod.dropout == 0.25
    with pytest.raises(ValueError, match="not a bool"):
        mod.dropout = torch.tensor(False)
    assert mod.dropout == 0.25
