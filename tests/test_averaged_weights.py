"""The heads' mean of the weights formed by the C core (average_weights=True,
torch's average_attn_weights, the default of torch's nn.MultiheadAttention):
the attention runs one task per (batch, block of queries) over every head in
turn and adds each head's weights into the (B, Sq, Sk) result, so no
(B, H, Sq, Sk) array is written.  Its bits must be those of averaging the
per-head weights head by head in order (mha_ext._calls.head_mean, docs/API.md
§3.4), whatever the options, the thread count and the instruction set, and
the output must not change.

Legend: B batch, Sq queries, Sk keys, E = d_model, H = n_heads.
"""
import numpy as np
import pytest

import mha_ext
from mha_ext import MultiHeadAttention, _calls
from _support import require_torch


def _same(a, b):
    """the same shape, dtype and bits (NaN rows included)"""
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(
        a.view(np.uint8), b.view(np.uint8))


def _call_pair(m, q, kv, **kw):
    """(output, weights) of the core's averaged call, and (output, head_mean
    of the per-head weights) of the plain one, the dropout stream the same"""
    counter = m._counter
    out, w = m._forward(q, kv, kv, need_weights=True, **kw)
    m._counter = counter
    out_a, w_a = m._forward(q, kv, kv, need_weights=True, average_weights=True, **kw)
    return (out_a, w_a), (out, _calls.head_mean(w))


SHAPES = [  # B, Sq, Sk, E, H
    (2, 10, 10, 512, 8),    # tiny: one block of queries per batch, fewer rows a task
    (1, 1, 1, 16, 4),       # a decode step's first token
    (3, 100, 77, 64, 4),    # blocks of 48 queries and a part block
    (1, 200, 200, 64, 1),   # one head
    (8, 130, 130, 96, 3),   # several full blocks per batch
    (0, 4, 4, 16, 2), (2, 0, 4, 16, 2), (2, 4, 0, 16, 2),  # empty
]


def _options(rng, B, H, Sq, Sk, dtype):
    return {
        "plain": {},
        "causal": {"is_causal": True},
        "blocking": {"masks": [(0, rng.random((Sq, Sk)) < 0.3)]},  # rows with NaN weights
        "additive": {"masks": [(1, rng.standard_normal((B, H, Sq, Sk)).astype(dtype))],
                     "zero_rows": True},
        "head_mask": {"head_mask": rng.standard_normal((B, H)).astype(dtype)},
        "window": {"window": (3, 2)},
    }


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("B,Sq,Sk,E,H", SHAPES)
@pytest.mark.parametrize("layout", [{}, {"add_bias_kv": True, "add_zero_attn": True},
                                    {"n_kv_heads": 1}])
@pytest.mark.parametrize("reference", [False, True])
def test_core_mean_is_the_head_mean_of_the_weights(isa, dtype, B, Sq, Sk, E, H, layout,
                                                   reference):
    rng = np.random.default_rng(B * 1000 + Sq + 7 * Sk)
    m = MultiHeadAttention(E, H, 0.3, dtype=dtype, seed=2, **layout)  # training: dropout on
    q = rng.standard_normal((B, Sq, E)).astype(dtype)
    kv = rng.standard_normal((B, Sk, E)).astype(dtype)
    for name, kw in _options(rng, B, H, Sq, Sk, dtype).items():
        (out_a, w_a), (out, w) = _call_pair(m, q, kv, reference=reference, **kw)
        assert w_a.shape == (B, Sq, Sk + 2 * bool(layout.get("add_bias_kv"))), name
        assert _same(w_a, w), name
        assert _same(out_a, out), name


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_core_mean_at_any_thread_count(isa, threads):
    # the tasks' blocks of queries shrink when there are few of them for the
    # threads: the bits stay those of the per-head weights' mean
    rng = np.random.default_rng(3)
    m = MultiHeadAttention(128, 4, seed=5).eval()
    before = mha_ext.get_num_threads()
    try:
        mha_ext.set_num_threads(threads)
        for B, S in ((1, 5), (1, 60), (2, 49), (5, 130)):
            x = rng.standard_normal((B, S, 128)).astype(np.float32)
            (out_a, w_a), (out, w) = _call_pair(m, x, x, is_causal=True)
            assert _same(w_a, w) and _same(out_a, out), (B, S)
    finally:
        mha_ext.set_num_threads(before)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_cache_calls_average_in_the_core(isa, dtype):
    # a decode loop with a cache: each step's averaged weights are the mean
    # of its per-head ones (two caches fed the same steps)
    rng = np.random.default_rng(4)
    m = MultiHeadAttention(64, 4, dtype=dtype, seed=3).eval()
    x = rng.standard_normal((2, 9, 64)).astype(dtype)
    ca, cb = m.new_cache(2, 9), m.new_cache(2, 9)
    for t0, t1 in ((0, 4), (4, 5), (5, 6), (6, 9)):
        step = x[:, t0:t1]
        out_a, w_a = m(step, cache=ca, is_causal=True, average_weights=True)
        out, w = m(step, cache=cb, is_causal=True)
        assert w_a.shape == (2, t1 - t0, t1)
        assert _same(w_a, _calls.head_mean(w)) and _same(out_a, out), (t0, t1)


def _refuse_head_mean(monkeypatch):
    def refuse(weights):
        raise AssertionError(f"head_mean over {weights.shape} in an inference call")
    monkeypatch.setattr(_calls, "head_mean", refuse)


def test_module_call_does_not_form_the_per_head_weights(monkeypatch):
    # the module's call asks the core for the mean: Python's head_mean (over
    # a (B, H, Sq, Sk) array) is not reached
    _refuse_head_mean(monkeypatch)
    x = np.random.default_rng(5).standard_normal((2, 7, 32)).astype(np.float32)
    m = MultiHeadAttention(32, 4, seed=1).eval()
    out, w = m(x, average_weights=True)
    assert w.shape == (2, 7, 7)
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)
    out, w = m(x[0], average_weights=True)  # unbatched
    assert w.shape == (7, 7)


def test_torch_class_default_call_averages_in_the_core(monkeypatch):
    # mha_ext.torch.MultiheadAttention's default call (need_weights and
    # average_attn_weights True, as torch's) without autograd: the core's
    # mean, torch's numbers
    torch = require_torch()
    import mha_ext.torch as mt
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(32, 4, batch_first=True).eval()
    ours = mt.MultiheadAttention(32, 4, batch_first=True).eval()
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(3, 9, 32)
    kpm = torch.zeros(3, 9, dtype=torch.bool)
    kpm[1, 6:] = True
    want = ref(x, x, x, key_padding_mask=kpm)
    _refuse_head_mean(monkeypatch)
    with torch.no_grad():
        got = ours(x, x, x, key_padding_mask=kpm)
    assert got[1].shape == want[1].shape == (3, 9, 9)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b.detach(), atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("B,Sq,Sk,E,H", [(2, 10, 10, 64, 4), (3, 100, 77, 64, 4),
                                         (8, 130, 130, 96, 3), (1, 1, 1, 16, 4)])
@pytest.mark.parametrize("save,save_p", [(False, False), (True, False), (True, True)])
def test_training_forward_averages_in_the_core(isa, dtype, B, Sq, Sk, E, H, save, save_p):
    # forward_train's averaged weights: head_mean's bits of its per-head
    # ones, with P kept or not, dropout on; the saved tensors and the
    # output the same bits either way
    rng = np.random.default_rng(Sq + Sk)
    m = MultiHeadAttention(E, H, 0.25, dtype=dtype, seed=4)
    q = rng.standard_normal((B, Sq, E)).astype(dtype)
    kv = rng.standard_normal((B, Sk, E)).astype(dtype)
    for kw in ({}, {"is_causal": True} if Sq == Sk else {"window": (2, 1)},
               {"masks": [(0, rng.random((Sq, Sk)) < 0.3)]}):
        one = m._forward_train(q, kv, kv, dropout=0.25, counter=7, save=save, save_p=save_p,
                               average_weights=True, **kw)
        two = m._forward_train(q, kv, kv, dropout=0.25, counter=7, save=save, save_p=save_p,
                               **kw)
        assert _same(one[1], _calls.head_mean(two[1])) and _same(one[0], two[0]), list(kw)
        assert (one[2] is None) == (two[2] is None)
        for a, b in zip(one[2] or (), two[2] or ()):
            assert (a is None and b is None) or _same(a, b), list(kw)


def test_training_call_averages_in_the_core(monkeypatch):
    # forward_train with average_weights: the core's mean (head_mean is not
    # reached), and the backward of dL/d mean: that of dL/d weights = the
    # mean's gradient / H on every head, to the bit
    rng = np.random.default_rng(6)
    m = MultiHeadAttention(32, 4, 0.1, seed=2)
    x = rng.standard_normal((2, 7, 32)).astype(np.float32)
    g = rng.standard_normal((2, 7, 32)).astype(np.float32)
    gw = rng.standard_normal((2, 7, 7)).astype(np.float32)
    per_head = m.forward_train(x, x, x, dropout_counter=3)
    want = m.backward(per_head, g, np.repeat(gw[:, None] / np.float32(4), 4, axis=1))
    _refuse_head_mean(monkeypatch)
    ctx = m.forward_train(x, x, x, average_weights=True, dropout_counter=3)
    assert ctx.weights.shape == (2, 7, 7)
    assert _same(ctx.output, per_head.output)
    got = m.backward(ctx, g, gw)
    assert got.keys() == want.keys()
    for name in got:
        assert _same(got[name], want[name]), name
