"""The module object: constructor, attributes, parameter views, train/eval,
repr, state_dict, initialisation and threads (API.md 1, 2, 3, 5).  Input
handling (API.md 4): tests/test_module_inputs.py.

Legend: B batch, Sq/Sk query/key length, E = d_model, H = n_heads.
"""

import math
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import mha_ext
from mha_ext import MultiHeadAttention

KEYS = ["W_q.weight", "W_q.bias", "W_k.weight", "W_k.bias",
        "W_v.weight", "W_v.bias", "W_o.weight", "W_o.bias"]


def _inputs(dtype="float32", seed=0, b=2, sq=5, sk=7, e=16, kdim=None,
            vdim=None):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, sq, e)).astype(dtype)
    k = rng.standard_normal((b, sk, kdim or e)).astype(dtype)
    v = rng.standard_normal((b, sk, vdim or e)).astype(dtype)
    return q, k, v


# --------------------------------------------------------------------------
# constructor and attributes
# --------------------------------------------------------------------------

def test_default_attributes():
    m = MultiHeadAttention(512, 8)
    assert m.d_model == 512
    assert m.n_heads == 8
    assert m.d_k == 64
    assert m.kdim == 512 and m.vdim == 512
    assert isinstance(m.dtype, np.dtype) and m.dtype == np.float32
    assert m.dropout == 0.0 and isinstance(m.dropout, float)
    assert m.training is True
    assert m.num_parameters == 4 * 512 * 512 + 4 * 512
    assert type(m.num_parameters) is int


@pytest.mark.parametrize("spelling, expected", [
    ("float32", np.float32), ("float64", np.float64),
    (np.float32, np.float32), (np.float64, np.float64),
    (np.dtype("float32"), np.float32), (np.dtype("float64"), np.float64),
])
def test_dtype_spellings(spelling, expected):
    m = MultiHeadAttention(8, 2, dtype=spelling)
    assert isinstance(m.dtype, np.dtype)
    assert m.dtype == np.dtype(expected)
    for name in ("W_q", "W_k", "W_v", "W_o"):
        assert getattr(m, name).weight.dtype == np.dtype(expected)
        assert getattr(m, name).bias.dtype == np.dtype(expected)
    out, w = m(np.ones((1, 3, 8)))
    assert out.dtype == np.dtype(expected) and w.dtype == np.dtype(expected)


@pytest.mark.parametrize("kwargs, exc", [
    (dict(d_model=True, n_heads=1), TypeError),
    (dict(d_model=8.0, n_heads=2), TypeError),
    (dict(d_model=8, n_heads=True), TypeError),
    (dict(d_model=8, n_heads=2.0), TypeError),
    (dict(d_model=0, n_heads=1), ValueError),
    (dict(d_model=-8, n_heads=2), ValueError),
    (dict(d_model=8, n_heads=0), ValueError),
    (dict(d_model=8, n_heads=-2), ValueError),
    (dict(d_model=8, n_heads=2, dropout=-0.1), ValueError),
    (dict(d_model=8, n_heads=2, dropout=1.0000001), ValueError),
    (dict(d_model=8, n_heads=2, dropout=float("nan")), ValueError),
    (dict(d_model=8, n_heads=2, dropout=float("inf")), ValueError),
    (dict(d_model=8, n_heads=2, dtype="float16"), (TypeError, ValueError)),
    (dict(d_model=8, n_heads=2, dtype="int32"), (TypeError, ValueError)),
    (dict(d_model=8, n_heads=2, dtype=np.int64), (TypeError, ValueError)),
    (dict(d_model=8, n_heads=2, dtype="nonsense"), (TypeError, ValueError)),
    (dict(d_model=8, n_heads=2, dtype=np.complex64), (TypeError, ValueError)),
    (dict(d_model=8, n_heads=2, dtype=5), (TypeError, ValueError)),
])
def test_constructor_rejects(kwargs, exc):
    with pytest.raises(exc):
        MultiHeadAttention(**kwargs)


def test_d_model_not_divisible_names_both_numbers():
    with pytest.raises(ValueError) as info:
        MultiHeadAttention(10, 3)
    msg = str(info.value)
    assert re.search(r"\b10\b", msg) and re.search(r"\b3\b", msg), msg


@pytest.mark.parametrize("p", [0, 0.0, 0.25, 1, 1.0, np.float64(0.5)])
def test_dropout_accepted_values(p):
    m = MultiHeadAttention(8, 2, p)
    assert m.dropout == float(p)


def test_kdim_vdim(np_ref):
    E, H, kdim, vdim = 16, 4, 6, 10
    m = MultiHeadAttention(E, H, kdim=kdim, vdim=vdim, dtype="float64",
                           seed=1)
    assert m.kdim == kdim and m.vdim == vdim
    assert m.W_q.weight.shape == (E, E)
    assert m.W_k.weight.shape == (E, kdim)
    assert m.W_v.weight.shape == (E, vdim)
    assert m.W_o.weight.shape == (E, E)
    assert m.num_parameters == E * E + E * kdim + E * vdim + E * E + 4 * E
    q, k, v = _inputs("float64", seed=1, e=E, kdim=kdim, vdim=vdim)
    out, w = m(q, k, v)
    expect, w_expect = np_ref.forward(m.state_dict(), H, q, k, v)
    np.testing.assert_allclose(out, expect, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(w, w_expect, rtol=1e-12, atol=1e-12)


def test_train_eval_return_self():
    m = MultiHeadAttention(8, 2)
    assert m.training is True
    assert m.eval() is m
    assert m.training is False
    assert m.train() is m
    assert m.training is True
    assert m.train(False) is m
    assert m.training is False
    assert m.train(True) is m
    assert m.training is True


def test_repr_default_exact():
    assert repr(MultiHeadAttention(512, 8)) == \
        "MultiHeadAttention(d_model=512, n_heads=8, dropout=0.0)"
    assert repr(MultiHeadAttention(64, 4, 0.1)) == \
        "MultiHeadAttention(d_model=64, n_heads=4, dropout=0.1)"
    assert repr(MultiHeadAttention(64, 4, dropout=1)) == \
        "MultiHeadAttention(d_model=64, n_heads=4, dropout=1.0)"
    m = MultiHeadAttention(64, 4)
    m.dropout = 0.25
    assert repr(m) == "MultiHeadAttention(d_model=64, n_heads=4, dropout=0.25)"
    # training mode is not an option of the constructor
    assert repr(m.eval()) == \
        "MultiHeadAttention(d_model=64, n_heads=4, dropout=0.25)"


@pytest.mark.parametrize("kwargs, needle", [
    (dict(dtype="float64"), "float64"),
    (dict(bias=False), "bias=False"),
    (dict(kdim=3), "kdim=3"),
    (dict(vdim=5), "vdim=5"),
])
def test_repr_non_default_options(kwargs, needle):
    r = repr(MultiHeadAttention(8, 2, **kwargs))
    assert r.startswith("MultiHeadAttention(d_model=8, n_heads=2, dropout=0.0, ")
    assert r.endswith(")")
    assert needle in r


# --------------------------------------------------------------------------
# parameter views
# --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_parameter_views(dtype):
    E = 12
    m = MultiHeadAttention(E, 3, dtype=dtype, seed=2)
    for name in ("W_q", "W_k", "W_v", "W_o"):
        lin = getattr(m, name)
        assert isinstance(lin.weight, np.ndarray)
        assert isinstance(lin.bias, np.ndarray)
        assert lin.weight.shape == (E, E) and lin.bias.shape == (E,)
        assert lin.weight.dtype == np.dtype(dtype)
        assert lin.bias.dtype == np.dtype(dtype)
        # two accesses see the same memory: the module's
        assert np.shares_memory(getattr(m, name).weight, lin.weight)
        assert np.shares_memory(getattr(m, name).bias, lin.bias)
    # the views match state_dict
    sd = m.state_dict()
    for key in KEYS:
        name, part = key.split(".")
        np.testing.assert_array_equal(getattr(getattr(m, name), part), sd[key])


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("float64", 1e-12)])
def test_inplace_edits_change_next_result(np_ref, dtype, tol):
    E, H = 16, 4
    m = MultiHeadAttention(E, H, dtype=dtype, seed=3).eval()
    q, k, v = _inputs(dtype, seed=3, e=E)
    out0, _ = m(q, k, v)
    w_q = m.W_q.weight
    w_q[...] = np.random.default_rng(3).standard_normal((E, E)) * 0.3
    m.W_o.bias[:] = m.W_o.bias + 1
    m.W_v.weight[:, 0] = 0.25
    np.testing.assert_array_equal(m.W_q.weight, w_q)
    assert np.all(m.state_dict()["W_v.weight"][:, 0] == 0.25)
    out1, w1 = m(q, k, v)
    assert not np.allclose(out0, out1)
    expect, w_expect = np_ref.forward(m.state_dict(), H, q, k, v)
    np.testing.assert_allclose(out1, expect, rtol=tol, atol=tol)
    np.testing.assert_allclose(w1, w_expect, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_augmented_assignment_on_views(np_ref, dtype):
    """``m.W_o.bias += 1`` (Python then re-assigns the attribute) works and
    edits the module's memory, as it does on a torch Linear under no_grad."""
    E, H = 8, 2
    m = MultiHeadAttention(E, H, dtype=dtype, seed=3).eval()
    before = m.state_dict()
    m.W_o.bias += 1
    m.W_q.weight *= 2
    m.W_k.bias -= 0.5
    sd = m.state_dict()
    np.testing.assert_array_equal(sd["W_o.bias"],
                                  before["W_o.bias"] + np.asarray(1, dtype))
    np.testing.assert_array_equal(sd["W_q.weight"], before["W_q.weight"] * 2)
    np.testing.assert_array_equal(sd["W_k.bias"],
                                  before["W_k.bias"] - np.asarray(0.5, dtype))
    assert np.shares_memory(m.W_o.bias, m.W_o.bias)
    q = np.random.default_rng(3).standard_normal((1, 4, E)).astype(dtype)
    out, _ = m(q)
    expect, _ = np_ref.forward(sd, H, q)
    tol = 1e-5 if dtype == "float32" else 1e-12
    np.testing.assert_allclose(out, expect, rtol=tol, atol=tol)


def test_bias_false():
    E = 8
    m = MultiHeadAttention(E, 2, bias=False, seed=4)
    for name in ("W_q", "W_k", "W_v", "W_o"):
        assert getattr(m, name).bias is None
        assert getattr(m, name).weight.shape == (E, E)
    assert m.num_parameters == 4 * E * E
    assert sorted(m.state_dict()) == sorted(
        ["W_q.weight", "W_k.weight", "W_v.weight", "W_o.weight"])
    out, w = m(np.ones((1, 3, E)))
    assert out.shape == (1, 3, E) and w.shape == (1, 2, 3, 3)


# --------------------------------------------------------------------------
# state_dict / load_state_dict
# --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_state_dict_is_copies_with_the_eight_keys(dtype):
    E = 8
    m = MultiHeadAttention(E, 2, dtype=dtype, seed=5)
    sd = m.state_dict()
    assert isinstance(sd, dict)
    assert sorted(sd) == sorted(KEYS)
    for key, val in sd.items():
        assert isinstance(val, np.ndarray), key
        assert val.dtype == np.dtype(dtype), key
        assert val.shape == ((E, E) if key.endswith("weight") else (E,)), key
    before = {k: v.copy() for k, v in sd.items()}
    for key, val in sd.items():
        name, part = key.split(".")
        assert not np.shares_memory(val, getattr(getattr(m, name), part)), key
        val[...] = 7.0
    sd2 = m.state_dict()
    for key in KEYS:
        np.testing.assert_array_equal(sd2[key], before[key], err_msg=key)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_load_state_dict_round_trip(dtype):
    a = MultiHeadAttention(16, 4, dtype=dtype, seed=6).eval()
    b = MultiHeadAttention(16, 4, dtype=dtype, seed=7).eval()
    q, k, v = _inputs(dtype, seed=6)
    assert not np.array_equal(a(q, k, v)[0], b(q, k, v)[0])
    b.load_state_dict(a.state_dict())
    for key, val in a.state_dict().items():
        np.testing.assert_array_equal(b.state_dict()[key], val, err_msg=key)
    np.testing.assert_array_equal(a(q, k, v)[0], b(q, k, v)[0])
    np.testing.assert_array_equal(a(q, k, v)[1], b(q, k, v)[1])


def test_load_state_dict_copies_and_converts():
    E = 8
    m = MultiHeadAttention(E, 2, seed=8)
    view = m.W_q.weight
    rng = np.random.default_rng(8)
    state = {k: rng.standard_normal((E, E) if k.endswith("weight") else (E,))
             for k in KEYS}  # float64 into a float32 module
    m.load_state_dict(state)
    for key in KEYS:
        name, part = key.split(".")
        got = getattr(getattr(m, name), part)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, state[key].astype(np.float32))
    # like torch, loading copies into the existing parameters
    np.testing.assert_array_equal(view, state["W_q.weight"].astype(np.float32))
    # editing the source afterwards does not reach the module
    saved = m.state_dict()
    for val in state.values():
        val[...] = 0
    for key in KEYS:
        np.testing.assert_array_equal(m.state_dict()[key], saved[key])


def _new_state(E, seed):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal((E, E) if k.endswith("weight") else (E,))
            .astype(np.float32) for k in KEYS}


@pytest.mark.parametrize("missing", KEYS)
def test_load_state_dict_missing_key(missing):
    m = MultiHeadAttention(8, 2, seed=9)
    before = m.state_dict()
    state = _new_state(8, 9)
    del state[missing]
    with pytest.raises(KeyError, match=re.escape(missing)):
        m.load_state_dict(state)
    for key in KEYS:  # nothing applied
        np.testing.assert_array_equal(m.state_dict()[key], before[key],
                                      err_msg=key)


@pytest.mark.parametrize("bad_key", ["W_q.weight", "W_k.bias", "W_o.weight",
                                     "W_o.bias"])
@pytest.mark.parametrize("bad_shape", [(8, 9), (9,), (64,), (8, 8, 1), ()])
def test_load_state_dict_wrong_shape_is_atomic(bad_key, bad_shape):
    m = MultiHeadAttention(8, 2, seed=10)
    before = m.state_dict()
    state = _new_state(8, 10)
    # the bad entry is placed last, after every good one
    state.pop(bad_key)
    state[bad_key] = np.zeros(bad_shape, dtype=np.float32)
    with pytest.raises(ValueError, match=re.escape(bad_key)):
        m.load_state_dict(state)
    for key in KEYS:
        np.testing.assert_array_equal(m.state_dict()[key], before[key],
                                      err_msg=key)


# --------------------------------------------------------------------------
# initialisation
# --------------------------------------------------------------------------

def _check_uniform(x, bound, what, bins=8):
    x = np.asarray(x, dtype=np.float64).ravel()
    n = x.size
    assert np.all(np.abs(x) <= bound * (1 + 1e-6)), f"{what} outside bound"
    sd_mean = bound / math.sqrt(3) / math.sqrt(n)
    assert abs(x.mean()) < 5 * sd_mean, f"{what} mean {x.mean()}"
    if n >= 10000:
        assert np.abs(x).max() > 0.99 * bound, what
        var = x.var()
        assert abs(var / (bound ** 2 / 3) - 1) < 0.03, f"{what} var {var}"
        counts, _ = np.histogram(x, bins=bins, range=(-bound, bound))
        expect = n / bins
        sd = math.sqrt(expect * (1 - 1 / bins))
        assert np.all(np.abs(counts - expect) < 5 * sd), f"{what} {counts}"
    else:
        assert np.abs(x).max() > 0.8 * bound, what


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_initialisation_is_uniform_within_fan_in_bound(dtype):
    E, kdim, vdim = 256, 64, 100
    m = MultiHeadAttention(E, 8, kdim=kdim, vdim=vdim, dtype=dtype, seed=11)
    fan_in = {"W_q": E, "W_k": kdim, "W_v": vdim, "W_o": E}
    for name, fan in fan_in.items():
        bound = 1 / math.sqrt(fan)
        _check_uniform(getattr(m, name).weight, bound, f"{name}.weight")
        _check_uniform(getattr(m, name).bias, bound, f"{name}.bias")
    assert not np.array_equal(m.W_q.weight, m.W_o.weight)
    assert not np.array_equal(m.W_q.bias, m.W_k.bias)


def test_same_seed_same_parameters_different_seed_different():
    a = MultiHeadAttention(32, 4, seed=12)
    b = MultiHeadAttention(32, 4, seed=12)
    c = MultiHeadAttention(32, 4, seed=13)
    for key in KEYS:
        np.testing.assert_array_equal(a.state_dict()[key],
                                      b.state_dict()[key])
        assert not np.array_equal(a.state_dict()[key], c.state_dict()[key])


def test_seed_none_gives_different_modules():
    a = MultiHeadAttention(32, 4)
    b = MultiHeadAttention(32, 4, seed=None)
    assert not np.array_equal(a.W_q.weight, b.W_q.weight)


# --------------------------------------------------------------------------
# threads
# --------------------------------------------------------------------------

def test_num_threads_default_and_set(restore_threads):
    n0 = mha_ext.get_num_threads()
    assert isinstance(n0, int) and n0 >= 1
    for n in (1, 2, 3):
        mha_ext.set_num_threads(n)
        assert mha_ext.get_num_threads() == n


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("float64", 1e-12)])
def test_results_do_not_depend_on_thread_count(restore_threads, dtype, tol):
    m = MultiHeadAttention(128, 8, dtype=dtype, seed=22).eval()
    q, k, v = _inputs(dtype, seed=22, b=4, sq=33, sk=65, e=128)
    mask = np.random.default_rng(22).random((4, 1, 33, 65)) < 0.2
    results = {}
    for n in (1, 2, 3):
        mha_ext.set_num_threads(n)
        results[n] = (m(q, k, v, mask=mask),
                      m(q, k, v, mask=mask, need_weights=False)[0])
    (out1, w1), o1 = results[1]
    for n in (2, 3):
        (out, w), o = results[n]
        np.testing.assert_allclose(out, out1, rtol=tol, atol=tol)
        np.testing.assert_allclose(w, w1, rtol=tol, atol=tol)
        np.testing.assert_allclose(o, o1, rtol=tol, atol=tol)


def test_python_threads_share_one_module():
    m = MultiHeadAttention(64, 8, dropout=0.3, seed=23).eval()
    n_threads, reps = 8, 6
    inputs = []
    for t in range(n_threads):
        q, k, v = _inputs(seed=100 + t, b=2 + t % 3, sq=9 + t, sk=17 - t,
                          e=64)
        mask = None if t % 2 else (
            np.random.default_rng(t).random((9 + t, 17 - t)) < 0.2)
        inputs.append((q, k, v, mask))
    serial = [m(q, k, v, mask=mask) for q, k, v, mask in inputs]
    barrier = threading.Barrier(n_threads)

    def work(t):
        q, k, v, mask = inputs[t]
        barrier.wait()
        got = []
        for r in range(reps):
            got.append(m(q, k, v, mask=mask, need_weights=(r % 2 == 0)))
        return got

    with ThreadPoolExecutor(max_workers=n_threads) as pool:
        all_results = list(pool.map(work, range(n_threads)))
    for t, got in enumerate(all_results):
        out_s, w_s = serial[t]
        for r, (out, w) in enumerate(got):
            if r % 2 == 0:
                np.testing.assert_array_equal(out, out_s,
                                              err_msg=f"thread {t} rep {r}")
                np.testing.assert_array_equal(w, w_s)
            else:
                assert w is None
                np.testing.assert_allclose(out, out_s, rtol=2e-5, atol=2e-5)


def test_assigning_a_parameter_of_another_shape_is_refused_not_broadcast():
    m = MultiHeadAttention(4, 2, seed=0)
    before = m.state_dict()
    with pytest.raises(ValueError, match=r"weight must have shape \(4, 4\), got \(4,\)"):
        m.W_q.weight = np.arange(4.0)
    with pytest.raises(ValueError, match=r"bias must have shape \(4,\), got \(\)"):
        m.W_o.bias = 7.0
    for k, v in m.state_dict().items():
        assert np.array_equal(v, before[k]), k
