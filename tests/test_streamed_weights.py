"""Weights and the saved softmax P past 32 MiB (src/attend_impl.h,
attend_weights_task with at->stream): there each block of queries forms S,
P, the dropout and the head mask's scale in a scratch block that stays in
the cache, and copies P and the weights out with stores that bypass the
caches.  Below 32 MiB they
are formed in the arrays themselves, except the weights alone (P not kept),
which are streamed at every size (att_streams): where a case keeps no P,
both of its calls stream and the comparison below checks the rows' bits
across query counts; where it keeps P, it compares the two ways.

The two ways do the same arithmetic in the same order, so a row must come
out with the same bits either way: each case runs a call past 32 MiB and the
same call on its first queries only (below 32 MiB; a query's row does not
depend on the other queries), and compares the rows they share bit for bit:
output, weights, the saved P.  The gradients of the large call are checked
against torch autograd (tests/test_backward.py's reference).

Legend: B batch, Sq/Sk query/key length, E = d_model, H = n_heads.
"""

import numpy as np
import pytest

import mha_ext
from test_backward import TOL, assert_grads, need_torch, torch_reference

LIMIT = 32 << 20  # bytes of P or the weights past which they are streamed


def _bytes(H, Sq, Sk, dtype):
    return H * Sq * Sk * np.dtype(dtype).itemsize  # B = 1


def _keeps_p(H, Sq, Sk, E, dtype):
    """whether forward_train keeps P (B = 1; mha_ext/_calls.py's rule): when
    it is no larger than Q, K, V and the context, or at most four times as
    large and within a quarter of the output cache's limit (MHA_EXT_CACHE_MB;
    a sanitizer build has no cache, limit 0).  Without P the backward
    recomputes it, and with no weights asked for the forward takes the
    online softmax instead of the streamed path"""
    p, four = H * Sq * Sk, 2 * E * (Sq + Sk)
    limit = mha_ext.memory_info()["limit_bytes"]
    return p <= four or (p <= 4 * four and 4 * _bytes(H, Sq, Sk, dtype) <= limit)


def _case(dtype, H, Sq, Sk, E, n, p=0.0, seed=0, **kw):
    """(large, small): forward_train on Sq queries and on the first n"""
    assert _bytes(H, Sq, Sk, dtype) > LIMIT >= _bytes(H, n, Sk, dtype)
    m = mha_ext.MultiHeadAttention(E, H, dropout=p, dtype=dtype, seed=seed)
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, Sq, E)).astype(dtype)
    k = rng.standard_normal((1, Sk, E)).astype(dtype)
    v = rng.standard_normal((1, Sk, E)).astype(dtype)
    big = m.forward_train(q, k, v, dropout_counter=7, **kw)
    small_kw = dict(kw)
    if "attn_mask" in kw:  # (Sq, Sk): its first n rows
        small_kw["attn_mask"] = kw["attn_mask"][:n]
    small = m.forward_train(q[:, :n], k, v, dropout_counter=7, **small_kw)
    return m, (q, k, v), big, small


def _same_rows(big, small, n, need_weights, same_path=True):
    """the rows both calls computed: the same bits when both took the same
    path (the weights asked for, or P kept by both or by neither); else one
    ran the online softmax and the other the full rows, whose sums differ in
    the last bits (a non-default MHA_EXT_CACHE_MB can split them so)"""
    if same_path or need_weights:
        np.testing.assert_array_equal(big.output[:, :n], small.output)
    else:
        rtol = 1e-5 if big.output.dtype == np.float32 else 1e-12
        np.testing.assert_allclose(big.output[:, :n], small.output, rtol=rtol,
                                   atol=rtol * float(np.abs(small.output).max()))
    if need_weights:
        assert big.weights.shape[-2] > n
        np.testing.assert_array_equal(big.weights[..., :n, :], small.weights)
    else:
        assert big.weights is None
    P_big, P_small = big._saved[4], small._saved[4]
    if P_big is not None and P_small is not None:
        np.testing.assert_array_equal(P_big[..., :n, :], P_small)
    return P_big is not None


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("what", ["plain", "mask", "window", "head_mask"])
def test_float32_rows_same_bits_as_below_the_limit(what, need_weights):
    H, Sq, Sk, E, n = 4, 1024, 2100, 512, 300
    kw = {"need_weights": need_weights}
    rng = np.random.default_rng(1)
    if what == "mask":  # torch's bool polarity: True = blocked; rows 5, 17 fully
        mask = rng.random((Sq, Sk)) < 0.3
        mask[[5, 17]] = True
        kw.update(attn_mask=mask, masked_rows="zero")
    elif what == "window":  # 200 keys back, 40 ahead: blocks of keys skipped
        kw.update(window=(200, 40))
    elif what == "head_mask":
        kw.update(head_mask=np.array([1.0, 0.0, 0.5, 2.0], np.float32))
    m, _, big, small = _case("float32", H, Sq, Sk, E, n, **kw)
    kept = _same_rows(big, small, n, need_weights,
                      _keeps_p(H, Sq, Sk, E, "float32") == _keeps_p(H, n, Sk, E, "float32"))
    if not need_weights:  # P (34 MB here, < 4x Q, K, V and the context) kept
        assert kept == _keeps_p(H, Sq, Sk, E, "float32")
    assert np.isfinite(big.output).all()


@pytest.mark.parametrize("need_weights", [True, False])
def test_float64_dropout_rows_same_bits_as_below_the_limit(need_weights):
    """one head, so that a row's dropout stream (at (b·H + h)·Sq + i) does
    not depend on Sq; the weights (need_weights) are those after dropout, P
    the softmax before it"""
    m, _, big, small = _case("float64", 1, 2100, 2048, 256, 700, p=0.25,
                             need_weights=need_weights, is_causal=True)
    kept = _same_rows(big, small, 700, need_weights,
                      _keeps_p(1, 2100, 2048, 256, "float64") ==
                      _keeps_p(1, 700, 2048, 256, "float64"))
    assert kept == _keeps_p(1, 2100, 2048, 256, "float64")
    if need_weights:
        w = big.weights[0, 0]
        assert 0.2 < float((w[np.tril_indices_from(w)] == 0).mean()) < 0.3
    if need_weights and kept:  # a weight is 0 where dropped or where P is
        P = big._saved[4][0, 0]
        np.testing.assert_array_equal(w != 0, (P != 0) & (w != 0))


@pytest.mark.parametrize("need_weights", [True, False])
def test_gradients_past_the_limit_match_torch(need_weights):
    """the saved P past 32 MiB feeds the backward: gradients against torch
    autograd in float64 on the same float32 inputs (test_backward's TOL)"""
    torch = need_torch()
    H, Sq, Sk, E = 4, 1024, 2100, 512
    rng = np.random.default_rng(3)
    block = rng.random((Sq, Sk)) < 0.2
    m, (q, k, v), big, _ = _case("float32", H, Sq, Sk, E, 300, need_weights=need_weights,
                                 attn_mask=block)
    assert (big._saved[4] is not None) == _keeps_p(H, Sq, Sk, E, "float32")
    g_out = rng.standard_normal(q.shape).astype(np.float32)
    g_w = rng.standard_normal((1, H, Sq, Sk)).astype(np.float32) if need_weights else None
    grads = m.backward(big, g_out, g_w)
    state = {kk: vv.astype(np.float64) for kk, vv in m.state_dict().items()}
    out, want = torch_reference(torch, state, H, q.astype(np.float64), k.astype(np.float64),
                                v.astype(np.float64), block=block, grad_out=g_out,
                                grad_weights=g_w)
    scale = np.abs(out).max()
    assert np.abs(big.output - out).max() <= TOL["float32"] * scale
    assert_grads(grads, want, "float32", "past 32 MiB")
