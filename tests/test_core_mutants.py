"""Pins from a mutation-testing round on the C core (src/): each test fails
under a plausible bug in src/ (an off-by-one, a dropped condition, a wrong
index) that the rest of the suite let through.  Each compares against torch
in float64 (1e-10), or, where torch has no twin (mha_ext's dropout stream,
a window), against the core's plain reference (reference=True), or checks
the same-bits promises of API.md §3.3/§3.4."""
import numpy as np
import pytest

import mha_ext
from mha_ext import _core
from _support import require_torch

torch = require_torch()
F = torch.nn.functional
TOL = 1e-10


def _qkv(seed, B, H, L, S, D, Dv=None, Hkv=None):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, H, L, D)), rng.standard_normal((B, Hkv or H, S, D)),
            rng.standard_normal((B, Hkv or H, S, Dv or D)))


def _torch_sdpa(q, k, v, **kw):
    def t(a):
        return torch.from_numpy(np.ascontiguousarray(a)) if isinstance(a, np.ndarray) else a
    kw = {n: t(a) for n, a in kw.items()}
    return F.scaled_dot_product_attention(t(q), t(k), t(v), **kw).numpy()


@pytest.mark.parametrize("need_weights", [False, True])
def test_dropout_stream_past_the_first_block_of_keys(need_weights):
    """Dropout on 60 queries, 1100 keys (two blocks of queries with weights,
    three online blocks of 512 keys without) matches the core's
    plain reference, which draws key j of row (b, h, i) at index
    ((b*H + h)*L + i)*S + j."""
    q, k, v = _qkv(3, 1, 2, 60, 1100, 8)  # 60 queries: two blocks of 48 with weights
    got = _core._sdpa(q, k, v, dropout=0.3, seed=5, need_weights=need_weights)[0]
    want = _core._sdpa(q, k, v, dropout=0.3, seed=5, reference=True)[0]
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("S", [5, 700])
def test_fully_masked_row_with_nan_value_online(S):
    """A query with no visible key gives a zero row, but 0·NaN where V holds
    a NaN, as torch's SDPA gives (no weights: the online path)."""
    q, k, v = _qkv(4, 1, 1, 3, S, 4)
    v[0, 0, 2, 1] = np.nan
    m = np.ones((3, S), bool)
    m[1] = False
    want = _torch_sdpa(q, k, v, attn_mask=m)
    got = mha_ext.scaled_dot_product_attention(q, k, v, attn_mask=m)
    assert np.isnan(want[0, 0, 1, 1]) and want[0, 0, 1, 0] == 0
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)


def test_block_layout_past_the_first_block_of_keys():
    """A block layout over 1100 keys (key blocks of 100, so online blocks of
    512 start inside a layout block) against torch's bool mask; and a row's
    bits do not depend on the layout of the other rows of its block of
    queries (batch 1 keeps the first key blocks for the other rows, batch 0
    does not: the online blocks stay anchored at key 0, API.md §3.4)."""
    from mha_ext.layout import BlockLayout
    L, S, kb = 6, 1100, 100
    rng = np.random.default_rng(5)
    q1, k1, v1 = _qkv(6, 1, 2, L, S, 8)
    q, k, v = (np.concatenate([a, a]) for a in (q1, k1, v1))
    keep = rng.random((2, 2, L, 11)) < 0.4
    keep[..., 7] = True        # every row sees a block past key 512
    keep[:, :, 2, :7] = False  # row 2: its first visible keys at 700 in both batches
    keep[:, :, 2, 7:] = True   # ... and keys on both sides of key 1024
    keep[0, :, [0, 1, 3, 4, 5], :6] = False
    keep[1, :, [0, 1, 3, 4, 5], 0] = True
    lay = BlockLayout(keep, (1, kb))
    got = mha_ext.scaled_dot_product_attention(q, k, v, layout=lay)
    want = _torch_sdpa(q, k, v, attn_mask=lay.to_dense(L, S))
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)
    np.testing.assert_array_equal(got[0, :, 2], got[1, :, 2])


def _grads(fn, q, k, v, seed=8, **kw):
    """(out, d q, d k, d v) of fn on float64 tensors, the output's gradient seeded"""
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    out = fn(tq, tk, tv, **kw)
    g = torch.from_numpy(np.random.default_rng(seed).standard_normal(tuple(out.shape)))
    return [out.detach().numpy()] + [x.numpy() for x in torch.autograd.grad(out, (tq, tk, tv), g)]


def test_nan_query_row_reaches_every_key_in_the_window_backward():
    """A NaN in one query row under a sliding window: torch's softmax row is
    NaN on every key, so d key and d value are NaN for every key of that
    head, not only for the keys of the row's block of queries (the C
    backward redoes such a block on every key: bwd_range's skipping)."""
    L = S = 200  # two of the backward's blocks of 128 queries
    q, k, v = _qkv(7, 1, 2, L, S, 8)
    q[0, 1, 150, 3] = np.nan
    d = np.arange(L)[:, None] - np.arange(S)[None]
    mask = (d <= 2) & (d >= -1)  # window (2, 1): i - 2 <= j <= i + 1
    want = _grads(F.scaled_dot_product_attention, q, k, v, attn_mask=torch.from_numpy(mask))
    got = _grads(mha_ext.scaled_dot_product_attention, q, k, v, window=(2, 1))
    assert np.isnan(want[2][0, 1]).all()
    for name, a, b in zip(("out", "query", "key", "value"), got, want):
        np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL, err_msg=name)


@pytest.mark.parametrize("where", ["key", "value", "grad_output", "grad_weights"])
def test_window_backward_with_an_infinity_matches_the_reference(where):
    """An infinity in k, v, the output's gradient or the weights' gradient
    under a window, over two of the backward's blocks of 128 queries: it
    reaches every gradient as 0·inf does in the core's plain reference (a
    window replaces the scores it blocks, API.md §3.1: not torch's -inf
    sum), so the C backward must then skip no key."""
    L = S = 200
    q, k, v = _qkv(9, 1, 2, L, S, 8)
    rng = np.random.default_rng(10)
    go = rng.standard_normal((1, 2, L, 8))
    gw = rng.standard_normal((1, 2, L, S))
    arr = {"key": k, "value": v, "grad_output": go, "grad_weights": gw}[where]
    arr[(0, 0, 150, 10) if where == "grad_weights" else (0, 0, 10, 2)] = np.inf
    kw = dict(window=(2, 1), grad_weights=gw if where == "grad_weights" else None)
    got = _core._sdpa_backward(q, k, v, go, **kw)
    want = _core._sdpa_backward(q, k, v, go, reference=True, **kw)
    assert any(np.isnan(w).any() for w in want)
    for name, a, b in zip(("query", "key", "value"), got, want):
        np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL, err_msg=name)


def test_backward_dropout_past_the_first_block_of_queries():
    """The C backward replays dropout for query i of every block of 128 at
    stream index ((b*H + h)*L + i)*S + j, as the reference (300 queries)."""
    q, k, v = _qkv(18, 1, 2, 300, 20, 8)
    go = np.random.default_rng(19).standard_normal((1, 2, 300, 8))
    got = _core._sdpa_backward(q, k, v, go, dropout=0.4, seed=3)
    want = _core._sdpa_backward(q, k, v, go, dropout=0.4, seed=3, reference=True)
    for name, a, b in zip(("query", "key", "value"), got, want):
        np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL, err_msg=name)


@pytest.mark.parametrize("L", [1, 4])
def test_grouped_query_decode_with_a_per_head_layout(L):
    """Grouped-query attention with few queries (the decode step's shape,
    one task per key/value head elsewhere) and a layout that differs between
    the query heads of a group: head 1 keeps a block of keys past 512 that
    head 0 does not; against torch's bool mask with enable_gqa."""
    from mha_ext.layout import BlockLayout
    S, kb = 1100, 100
    q, k, v = _qkv(11, 4, 4, L, S, 8, Hkv=2)
    keep = np.zeros((4, 1, 11), bool)
    keep[:, :, :2] = True
    keep[1, :, 8] = keep[3, :, 9] = True
    lay = BlockLayout(keep, (L, kb))
    got = mha_ext.scaled_dot_product_attention(q, k, v, enable_gqa=True, layout=lay)
    want = _torch_sdpa(q, k, v, attn_mask=lay.to_dense(L, S), enable_gqa=True)
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("need_weights", [True, False])
def test_cached_call_with_a_long_window_gives_the_full_calls_bits(need_weights):
    """API.md §3.3/§3.4: a cached call's rows are the bits of the same rows of
    one causal call over every token.  A left window of 500 keys over 1000
    tokens: the rows' first visible keys differ between the cached call's
    blocks of queries and the full call's, so the products over the keys
    must start at a multiple of the GEMM's depth block (512) in both."""
    E, H, S, n = 16, 2, 1000, 900
    m = mha_ext.MultiHeadAttention(E, H, dtype="float64", seed=1)
    x = np.random.default_rng(13).standard_normal((1, S, E))
    kw = dict(window=(500, None), need_weights=need_weights)
    full = m(x, is_causal=True, **kw)
    cache = m.new_cache(1, S)
    m(x[:, :n], cache=cache, **kw)
    part = m(x[:, n:], cache=cache, **kw)
    np.testing.assert_array_equal(part[0], full[0][:, n:])
    if need_weights:
        np.testing.assert_array_equal(part[1], full[1][..., n:, :])


def _torch_pair(E, H, seed=0):
    """torch.nn.MultiheadAttention (float64, batch_first) and its copy"""
    torch.manual_seed(seed)
    t = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64).eval()
    return t, mha_ext.MultiHeadAttention.from_torch(t)


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("nan_key", [1, 2])
def test_one_causal_query_with_a_nan_value_past_the_diagonal(nan_key, need_weights):
    """One query, top-left causal, three keys: it sees key 0 only, but a NaN
    in a later value row still reaches it as 0·NaN, as in torch's module
    (the C forward checks V from key coff + 1 on before skipping keys)."""
    E, H, S = 8, 2, 3
    t, m = _torch_pair(E, H)
    rng = np.random.default_rng(14)
    q = rng.standard_normal((2, 1, E))
    k, v = rng.standard_normal((2, S, E)), rng.standard_normal((2, S, E))
    v[0, nan_key, 3] = np.nan
    T = torch.from_numpy
    want = t(T(q), T(k), T(v), attn_mask=torch.ones(1, S, dtype=torch.bool).triu(1),
             need_weights=need_weights)[0].detach().numpy()
    got = m(q, k, v, is_causal=True, need_weights=need_weights)[0]
    assert np.isnan(want[0]).all() and not np.isnan(want[1]).any()
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("S", [6, 61])
def test_sdpa_causal_with_an_infinite_value_reaches_earlier_rows(S):
    """is_causal with an infinity in the last value row (S = 61, Dv = 3: in
    the tail past the last 8 scalars all_finite sums together): the rows
    before it are 0·inf = NaN in that column, as torch's SDPA gives (the C
    forward skips keys past the diagonal only when V is finite)."""
    q, k, v = _qkv(15, 1, 1, S, S, 4, Dv=3)
    v[0, 0, S - 1, 1] = np.inf
    want = _torch_sdpa(q, k, v, is_causal=True)
    got = mha_ext.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert np.isnan(want[0, 0, 0, 1])
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)


def test_causal_weights_of_a_nan_query_row_are_nan_past_the_diagonal():
    """A NaN query under is_causal: the row's weights are NaN on every key,
    those past the diagonal too, as torch's (NaN + -inf) gives."""
    E, H, L = 8, 2, 5
    t, m = _torch_pair(E, H)
    x = np.random.default_rng(16).standard_normal((2, L, E))
    q = x.copy()
    q[0, 2, 1] = np.nan
    T = torch.from_numpy
    out, w = t(T(q), T(x), T(x), attn_mask=torch.ones(L, L, dtype=torch.bool).triu(1),
               average_attn_weights=False)
    got, gw = m(q, x, x, is_causal=True)
    assert np.isnan(w[0, :, 2].detach().numpy()).all()
    np.testing.assert_allclose(gw, w.detach().numpy(), rtol=TOL, atol=TOL)
    np.testing.assert_allclose(got, out.detach().numpy(), rtol=TOL, atol=TOL)


def test_lower_right_rows_with_no_key_are_nan_with_weights():
    """Lower-right causal with 30 queries over 5 keys: the first 25 rows see
    no key and are NaN, outputs and weights, as torch's module gives for a
    fully blocked row, whole runs of rows included (attend_impl.h av_runs)."""
    E, H, L, S = 8, 2, 30, 5
    t, m = _torch_pair(E, H)
    rng = np.random.default_rng(17)
    q, kv = rng.standard_normal((2, L, E)), rng.standard_normal((2, S, E))
    T = torch.from_numpy
    out, w = t(T(q), T(kv), T(kv), attn_mask=~torch.ones(L, S, dtype=torch.bool).tril(S - L),
               average_attn_weights=False)
    got, gw = m(q, kv, kv, is_causal="lower_right")
    assert np.isnan(out[:, :L - S].detach().numpy()).all()
    np.testing.assert_allclose(got, out.detach().numpy(), rtol=TOL, atol=TOL)
    np.testing.assert_allclose(gw, w.detach().numpy(), rtol=TOL, atol=TOL)


def test_learned_bias_gradient_is_zero_on_keys_the_window_skips():
    """A float mask that requires grad under a window, over two of the
    backward's blocks of 128 queries: its gradient is 0 on the keys outside
    the window (the C backward skips them, so they must be zeroed first),
    as torch's gradient of the same mask with -inf outside the window."""
    L = S = 200
    q, k, v = _qkv(21, 1, 1, L, S, 4)
    bias = np.random.default_rng(22).standard_normal((L, S))
    d = np.arange(L)[:, None] - np.arange(S)[None]
    outside = torch.from_numpy(np.where((d <= 2) & (d >= -1), 0.0, -np.inf))
    for _ in range(3):  # freed memory of the gradient's size, not zeros
        junk = np.full((1, 1, L, S), 7.0)
        del junk
        bw, bt = (torch.tensor(bias, requires_grad=True) for _ in range(2))
        T = torch.from_numpy
        got = mha_ext.scaled_dot_product_attention(T(q), T(k), T(v), attn_mask=bw, window=(2, 1))
        want = F.scaled_dot_product_attention(T(q), T(k), T(v), attn_mask=bt + outside)
        got.sum().backward()
        want.sum().backward()
        np.testing.assert_allclose(bw.grad.numpy(), bt.grad.numpy(), rtol=TOL, atol=TOL)
