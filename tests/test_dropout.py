"""Dropout on the attention weights (API.md 1 `seed`, 3.2).

Training mode and p > 0 only; inverted scaling 1/(1-p); p = 1 drops
everything; the returned weights are those after dropout and the output is
computed from exactly them.  torch cannot be the oracle here (different
random streams), so the output is rebuilt in float64 NumPy from the
returned weights and the module's own parameters.

Legend: B batch, Sq/Sk query/key length, E = d_model, H = n_heads.
"""

import math

import numpy as np
import pytest

from mha_ext import MultiHeadAttention

B, Sq, Sk, E, H = 4, 32, 32, 16, 4
N_WEIGHTS = B * H * Sq * Sk  # 16384


def _inputs(dtype="float32", seed=0, b=B, sq=Sq, sk=Sk, e=E):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, sq, e)).astype(dtype)
    k = rng.standard_normal((b, sk, e)).astype(dtype)
    v = rng.standard_normal((b, sk, e)).astype(dtype)
    return q, k, v


def _binomial_ok(frac, p, n, sigmas=4.0):
    sd = math.sqrt(p * (1 - p) / n)
    return abs(frac - p) <= sigmas * sd


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5, 0.9])
def test_fraction_of_dropped_weights_near_p(p):
    m = MultiHeadAttention(E, H, dropout=p, seed=1)
    assert m.training
    q, k, v = _inputs(seed=1)
    for _ in range(2):
        _, w = m(q, k, v)
        frac = float(np.mean(w == 0))
        assert _binomial_ok(frac, p, N_WEIGHTS), (
            f"dropped fraction {frac:.4f} for p={p} is more than 4 standard "
            f"deviations ({math.sqrt(p * (1 - p) / N_WEIGHTS):.4f}) away")


@pytest.mark.parametrize("dtype, rtol", [("float32", 2e-6),
                                         ("float64", 1e-13)])
def test_kept_weights_are_softmax_scaled(dtype, rtol):
    p = 0.3
    m = MultiHeadAttention(E, H, dropout=p, dtype=dtype, seed=2)
    q, k, v = _inputs(dtype, seed=2)
    _, w_train = m(q, k, v)
    m.eval()
    _, w_eval = m(q, k, v)
    assert w_eval.dtype == np.dtype(dtype) and w_train.dtype == np.dtype(dtype)
    assert np.all(w_eval > 0), "eval softmax weights should be positive here"
    kept = w_train != 0
    assert 0.5 < kept.mean() < 0.9
    np.testing.assert_allclose(w_train[kept], w_eval[kept] / (1 - p),
                               rtol=rtol, atol=0)
    # each kept row sums (before dropout) to 1: the eval rows do
    np.testing.assert_allclose(w_eval.sum(-1), 1.0, rtol=10 * rtol)


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5),
                                        ("float64", 1e-10)])
@pytest.mark.parametrize("p", [0.1, 0.3, 0.7])
def test_output_is_computed_from_returned_weights(np_ref, dtype, tol, p):
    m = MultiHeadAttention(E, H, dropout=p, dtype=dtype, seed=3)
    q, k, v = _inputs(dtype, seed=3, b=3, sq=9, sk=13)
    sd = m.state_dict()
    for call in range(3):
        out, w = m(q, k, v)
        assert np.any(w == 0)
        expect, _ = np_ref.forward(sd, H, q, k, v, weights=w)
        np.testing.assert_allclose(out, expect, rtol=tol, atol=tol,
                                   err_msg=f"call {call}")


def test_output_from_returned_weights_with_mask(np_ref):
    p = 0.4
    m = MultiHeadAttention(E, H, dropout=p, seed=4)
    q, k, v = _inputs("float32", seed=4, b=2, sq=6, sk=11)
    mask = np.random.default_rng(4).random((2, 1, 6, 11)) < 0.4
    mask[..., 0] = False  # no fully blocked row
    out, w = m(q, k, v, mask=mask)
    assert np.all(w[np.broadcast_to(mask, w.shape)] == 0)
    expect, _ = np_ref.forward(m.state_dict(), H, q, k, v, weights=w)
    np.testing.assert_allclose(out, expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_p_equal_one_drops_everything(dtype):
    m = MultiHeadAttention(E, H, dropout=1.0, dtype=dtype, seed=5)
    q, k, v = _inputs(dtype, seed=5, b=2, sq=7, sk=5)
    out, w = m(q, k, v)
    assert w.shape == (2, H, 7, 5)
    assert np.all(w == 0), "p = 1 must drop every weight (and not give NaN)"
    expect = np.broadcast_to(m.W_o.bias, out.shape)
    np.testing.assert_array_equal(out, expect)
    out2, none = m(q, k, v, need_weights=False)
    assert none is None
    np.testing.assert_array_equal(out2, expect)


def test_eval_mode_is_deterministic_with_dropout():
    m = MultiHeadAttention(E, H, dropout=0.5, seed=6)
    q, k, v = _inputs(seed=6)
    assert m.eval() is m
    assert m.training is False
    out1, w1 = m(q, k, v)
    out2, w2 = m(q, k, v)
    np.testing.assert_array_equal(out1, out2)
    np.testing.assert_array_equal(w1, w2)
    assert np.all(w1 > 0)
    np.testing.assert_allclose(w1.sum(-1), 1.0, rtol=1e-5)
    # same as no dropout at all
    m.dropout = 0.0
    m.train()
    out3, w3 = m(q, k, v)
    np.testing.assert_allclose(out3, out1, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(w3, w1, rtol=1e-6, atol=1e-7)


def test_train_false_is_eval():
    m = MultiHeadAttention(E, H, dropout=0.5, seed=7)
    q, k, v = _inputs(seed=7, b=1)
    assert m.train(False) is m
    assert m.training is False
    _, w1 = m(q, k, v)
    _, w2 = m(q, k, v)
    np.testing.assert_array_equal(w1, w2)
    assert np.all(w1 > 0)
    assert m.train() is m and m.training is True
    _, w3 = m(q, k, v)
    assert np.any(w3 == 0)


def test_dropout_zero_in_training_mode_drops_nothing():
    m = MultiHeadAttention(E, H, dropout=0.0, seed=8)
    assert m.training
    q, k, v = _inputs(seed=8)
    _, w = m(q, k, v)
    assert np.all(w > 0)
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-5)


def test_same_seed_same_parameters_and_masks():
    a = MultiHeadAttention(E, H, dropout=0.3, seed=42)
    b = MultiHeadAttention(E, H, dropout=0.3, seed=42)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        np.testing.assert_array_equal(sa[key], sb[key], err_msg=key)
    q, k, v = _inputs(seed=9)
    for call in range(4):
        out_a, w_a = a(q, k, v)
        out_b, w_b = b(q, k, v)
        np.testing.assert_array_equal(w_a, w_b, err_msg=f"call {call}")
        np.testing.assert_array_equal(out_a, out_b, err_msg=f"call {call}")


def test_different_seeds_differ():
    a = MultiHeadAttention(E, H, dropout=0.3, seed=1)
    b = MultiHeadAttention(E, H, dropout=0.3, seed=2)
    assert not np.array_equal(a.W_q.weight, b.W_q.weight)
    assert not np.array_equal(a.W_o.bias, b.W_o.bias)
    # same parameters, different dropout streams
    b.load_state_dict(a.state_dict())
    q, k, v = _inputs(seed=10)
    _, w_a = a(q, k, v)
    _, w_b = b(q, k, v)
    assert not np.array_equal(w_a == 0, w_b == 0)


def test_successive_calls_give_different_masks():
    m = MultiHeadAttention(E, H, dropout=0.3, seed=11)
    q, k, v = _inputs(seed=11)
    zeros = [m(q, k, v)[1] == 0 for _ in range(3)]
    assert not np.array_equal(zeros[0], zeros[1])
    assert not np.array_equal(zeros[1], zeros[2])
    assert not np.array_equal(zeros[0], zeros[2])
    # the masks are (close to) independent: overlap ~ p^2
    both = float(np.mean(zeros[0] & zeros[1]))
    assert _binomial_ok(both, 0.09, N_WEIGHTS, sigmas=5)


@pytest.mark.parametrize("dtype, tol", [("float32", 2e-5),
                                        ("float64", 1e-10)])
@pytest.mark.parametrize("with_mask", [False, True], ids=["nomask", "mask"])
def test_need_weights_false_same_dropout(dtype, tol, with_mask):
    """Same seed, same call count: the need_weights=False path applies the
    same dropout mask as the weights path."""
    a = MultiHeadAttention(E, H, dropout=0.3, dtype=dtype, seed=12)
    b = MultiHeadAttention(E, H, dropout=0.3, dtype=dtype, seed=12)
    q, k, v = _inputs(dtype, seed=12, b=2, sq=17, sk=9)
    mask = None
    if with_mask:
        mask = np.random.default_rng(12).random((17, 9)) < 0.3
        mask[:, 0] = False
    for call in range(3):
        out_a, w_a = a(q, k, v, mask=mask, need_weights=True)
        out_b, w_b = b(q, k, v, mask=mask, need_weights=False)
        assert w_b is None
        assert np.any(w_a == 0)
        np.testing.assert_allclose(out_b, out_a, rtol=tol, atol=tol,
                                   err_msg=f"call {call}")


def test_dropout_attribute_is_settable():
    m = MultiHeadAttention(E, H, seed=13)
    assert m.dropout == 0.0
    m.dropout = 0.5
    assert m.dropout == 0.5
    q, k, v = _inputs(seed=13)
    _, w = m(q, k, v)
    assert _binomial_ok(float(np.mean(w == 0)), 0.5, N_WEIGHTS)
    for bad in (-0.1, 1.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="dropout"):
            m.dropout = bad
        assert m.dropout == 0.5
    m.dropout = 0
    assert m.dropout == 0.0
    m.dropout = 1
    assert m.dropout == 1.0
