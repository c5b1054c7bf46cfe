"""The module's input handling (API.md 4): memory layouts and dtypes the
call takes, unbatched inputs, what it refuses.

Legend: B batch, Sq/Sk query/key length, E = d_model, H = n_heads.
"""
import numpy as np
import pytest

from mha_ext import MultiHeadAttention
from test_module import _inputs


def _unaligned(a):
    buf = np.zeros(a.nbytes + 1, dtype=np.uint8)
    u = np.frombuffer(buf, dtype=a.dtype, count=a.size, offset=1)
    u = u.reshape(a.shape)
    u[...] = a
    return u


def _layout(a, layout):
    if layout == "contiguous":
        return a.copy()
    if layout == "strided":
        big = np.zeros((a.shape[0], 2 * a.shape[1], 3 * a.shape[2]), a.dtype)
        big[:, ::2, ::3] = a
        return big[:, ::2, ::3]
    if layout == "fortran":
        return np.asfortranarray(a)
    if layout == "negative":
        return a[::-1, ::-1, ::-1].copy()[::-1, ::-1, ::-1]
    if layout == "transposed":
        return a.transpose(2, 0, 1).copy().transpose(1, 2, 0)
    if layout == "bigendian":
        return a.astype(a.dtype.newbyteorder(">"))
    if layout == "unaligned":
        return _unaligned(a)
    if layout == "readonly":
        r = a.copy()
        r.flags.writeable = False
        return r
    if layout == "list":
        return a.tolist()
    if layout == "other_float":
        # a wider float that converts back exactly
        return a.astype(np.float64 if a.dtype == np.float32
                        else np.longdouble)
    raise AssertionError(layout)


LAYOUTS = ["contiguous", "strided", "fortran", "negative", "transposed",
           "bigendian", "unaligned", "readonly", "list", "other_float"]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_input_layouts_give_identical_results(dtype, layout):
    m = MultiHeadAttention(16, 4, dtype=dtype, seed=14).eval()
    q, k, v = _inputs(dtype, seed=14)
    out_ref, w_ref = m(q, k, v)
    lq, lk, lv = (_layout(x, layout) for x in (q, k, v))
    if layout == "unaligned":
        assert not lq.flags.aligned
    if layout in ("strided", "negative", "transposed"):
        assert not lq.flags.c_contiguous
    out, w = m(lq, lk, lv)
    np.testing.assert_array_equal(out, out_ref)
    np.testing.assert_array_equal(w, w_ref)
    # only one of the three in an odd layout
    out, w = m(q, lk, v)
    np.testing.assert_array_equal(out, out_ref)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("int_dtype", ["int8", "int32", "int64", "uint8",
                                       "uint16"])
def test_integer_inputs_and_lists_are_converted(dtype, int_dtype):
    m = MultiHeadAttention(8, 2, dtype=dtype, seed=15).eval()
    rng = np.random.default_rng(15)
    lo = 0 if int_dtype.startswith("u") else -3
    q = rng.integers(lo, 4, (2, 3, 8)).astype(int_dtype)
    k = rng.integers(lo, 4, (2, 5, 8)).astype(int_dtype)
    out_ref, w_ref = m(q.astype(dtype), k.astype(dtype))
    out, w = m(q, k)
    assert out.dtype == np.dtype(dtype) and w.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(out, out_ref)
    np.testing.assert_array_equal(w, w_ref)
    out, w = m(q.tolist(), k.tolist())
    np.testing.assert_array_equal(out, out_ref)
    np.testing.assert_array_equal(w, w_ref)


def test_float16_input_converted():
    m = MultiHeadAttention(8, 2, seed=16).eval()
    q = np.random.default_rng(16).standard_normal((2, 3, 8)).astype(np.float16)
    np.testing.assert_array_equal(m(q)[0], m(q.astype(np.float32))[0])


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_callers_arrays_never_modified(dtype, train):
    m = MultiHeadAttention(16, 4, dropout=0.3, dtype=dtype, seed=17)
    m.train(train)
    for in_dtype in ("float32", "float64", "int64"):
        q, k, v = _inputs("float64", seed=17)
        q, k, v = (x.astype(in_dtype) for x in (q, k, v))
        for layout in ("contiguous", "strided", "negative"):
            lq, lk, lv = (_layout(x, layout) for x in (q, k, v))
            mask = np.zeros((2, 1, 5, 7), dtype=bool)
            mask[:, :, :, 3] = True
            saved = [x.copy() for x in (lq, lk, lv, mask)]
            m(lq, lk, lv, mask=mask)
            m(lq, lk, lv, mask=mask, need_weights=False)
            m(lq)
            for x, s in zip((lq, lk, lv, mask), saved):
                np.testing.assert_array_equal(x, s)
                assert x.dtype == s.dtype


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_results_are_new_arrays_of_module_dtype(dtype):
    m = MultiHeadAttention(16, 4, dtype=dtype, seed=18).eval()
    q, k, v = _inputs(dtype, seed=18)
    out1, w1 = m(q, k, v)
    out2, w2 = m(q, k, v)
    for r in (out1, w1, out2, w2):
        assert type(r) is np.ndarray
        assert r.dtype == np.dtype(dtype)
        for x in (q, k, v, m.W_q.weight, m.W_o.weight, m.W_o.bias):
            assert not np.shares_memory(r, x)
    assert not np.shares_memory(out1, out2)
    assert not np.shares_memory(w1, w2)
    keep = out2.copy()
    out1[...] = 0
    w1[...] = 0
    np.testing.assert_array_equal(out2, keep)
    np.testing.assert_array_equal(m(q, k, v)[0], keep)


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-6), ("float64", 1e-13)])
def test_key_defaults_to_query_value_to_key(dtype, tol):
    m = MultiHeadAttention(16, 4, dtype=dtype, seed=19).eval()
    q, k, _ = _inputs(dtype, seed=19)
    for got, expect in [
        (m(q), m(q, q, q)),
        (m(q, k), m(q, k, k)),
        (m(q, key=k), m(q, k, k)),
        (m(query=q), m(q, q, q)),
        (m(q, None, None), m(q, q, q)),
        (m(q, k, None), m(q, k, k)),
    ]:
        np.testing.assert_allclose(got[0], expect[0], rtol=tol, atol=tol)
        np.testing.assert_allclose(got[1], expect[1], rtol=tol, atol=tol)


def test_forward_is_call():
    m = MultiHeadAttention(16, 4, seed=20).eval()
    q, k, v = _inputs(seed=20)
    mask = np.zeros((5, 7), dtype=bool)
    mask[:, -1] = True
    a = m(q, k, v, mask=mask)
    b = m.forward(q, k, v, mask=mask)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    c = m.forward(q, key=k, value=v, mask=mask, need_weights=False)
    assert c[1] is None
    np.testing.assert_allclose(c[0], a[0], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("train", [False, True])
def test_zero_size_batch_and_query(dtype, train):
    m = MultiHeadAttention(16, 4, dropout=0.2, dtype=dtype, seed=21)
    m.train(train)
    cases = [
        ((0, 5, 16), (0, 7, 16), (0, 5, 16), (0, 4, 5, 7)),
        ((2, 0, 16), (2, 7, 16), (2, 0, 16), (2, 4, 0, 7)),
        ((0, 0, 16), (0, 7, 16), (0, 0, 16), (0, 4, 0, 7)),
        ((0, 16), (7, 16), (0, 16), (4, 0, 7)),
    ]
    for qs, ks, out_shape, w_shape in cases:
        q = np.zeros(qs, dtype=dtype)
        k = np.ones(ks, dtype=dtype)
        out, w = m(q, k, k)
        assert out.shape == out_shape and out.dtype == np.dtype(dtype)
        assert w.shape == w_shape and w.dtype == np.dtype(dtype)
        out, none = m(q, k, k, need_weights=False)
        assert out.shape == out_shape and none is None
