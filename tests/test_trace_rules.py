"""mha_ext.trace: the rules mutation testing of that file found no test
holding (a mutant of each passed the trace tests before).  The header says
"dropout" only when dropout acts (training and p > 0) and gives a cache's
L; the key and value rows in the table are labelled like the query's; the
HTML preview skips empty arrays and save_html(values=False) has none; the
input steps are copies of the caller's arrays; a call with no keys (Sk = 0)
traces, its context an empty sum; a cross cache's call has no Sn and its
Sk is the memory's length; without grouped heads the K and V heads are
(B, H, Sk, Dk); the key and value formulas say which input defaulted; a
cached call's K projection has the call's own Sn keys and its cache steps
say "[L cached | n new] → length L + n"; scale= is in the raw scores'
formula and values; an unbatched trace's numpy_output is unbatched; the
formulas name masked_rows="zero" and a head_mask under dropout; a float mask
without -inf blocks no cell (info["blocked"] None), a bool one all False
gives all False
(docs/API.md §6).

Expected values come from an explicit NumPy computation from the module's
weights, or from the rule itself.

Legend: B batch, Sq/Sk query/key length, E d_model, H heads, Dk = E / H,
L keys cached before the call, Sn the call's own keys.
"""
import numpy as np
import pytest

import mha_ext

E, H = 16, 4
DK = E // H


def _module(dtype="float64", **kw):
    return mha_ext.MultiHeadAttention(E, H, dtype=dtype, seed=3, **kw).eval()


def _x(*shape, seed=0, dtype=np.float64):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _lin(x, layer):
    w = np.asarray(layer.weight, np.float64)
    b = 0.0 if layer.bias is None else np.asarray(layer.bias, np.float64)
    return np.asarray(x, np.float64) @ w.T + b


def _heads(a, B, S):
    return a.reshape(B, S, H, DK).transpose(0, 2, 1, 3)


# ---------------------------------------------------------------- the header and table

def test_the_header_says_dropout_only_when_it_acts():
    # the legend: the dropout step only in training and with p > 0
    x = _x(1, 3, E)
    none = mha_ext.MultiHeadAttention(E, H, dropout=0.0, seed=0)
    assert none.training
    title = str(none.trace(x)).splitlines()[0]
    assert "training" in title and "dropout" not in title
    some = mha_ext.MultiHeadAttention(E, H, dropout=0.25, seed=0)
    title = str(some.trace(x)).splitlines()[0]
    assert "training, dropout p=0.25" in title


def test_the_key_and_value_rows_are_labelled_like_the_query_row():
    # the input rows give each size its long name: [batch=.., seq_k=.., vdim=..]
    m = mha_ext.MultiHeadAttention(E, H, kdim=5, vdim=7, seed=0).eval()
    text = str(m.trace(_x(2, 3, E), _x(2, 6, 5, seed=1), _x(2, 6, 7, seed=2)))
    assert "[batch=2, seq_q=3, d_model=16]" in text
    assert "[batch=2, seq_k=6, kdim=5]" in text
    assert "[batch=2, seq_k=6, vdim=7]" in text


def test_the_header_gives_the_keys_cached_before_the_call():
    # API.md §6: "the header gives L"
    m = _module()
    cache = m.new_cache(1, 8)
    m(_x(1, 4, E), cache=cache)
    sizes = str(m.trace(_x(1, 2, E, seed=1), cache=cache)).splitlines()[1]
    assert "L=4" in sizes.split(", ")


# ---------------------------------------------------------------- the HTML

def test_the_html_previews_only_steps_with_values():
    # a call with no keys: the score steps are empty arrays, nothing to preview
    m = _module()
    t = m.trace(_x(1, 3, E), _x(1, 0, E, seed=1))
    page = t.to_html()
    want = sum(s.array.size > 0 for s in t)
    assert want < len(t)
    assert page.count("<details>") == want


def test_save_html_without_values_writes_no_preview(tmp_path):
    t = _module().trace(_x(1, 3, E))
    path = t.save_html(str(tmp_path / "trace.html"), values=False)
    page = open(path, encoding="utf-8").read()
    assert page.startswith("<!DOCTYPE html>")
    assert "<details>" not in page
    assert "<details>" in open(t.save_html(str(tmp_path / "v.html")), encoding="utf-8").read()


# ---------------------------------------------------------------- inputs are copies

@pytest.mark.parametrize("step", ["query", "key", "value"])
def test_the_input_steps_are_copies_of_the_callers_arrays(step):
    m = _module()
    q, k, v = _x(1, 3, E), _x(1, 4, E, seed=1), _x(1, 4, E, seed=2)
    t = m.trace(q, k, v)
    given = {"query": q, "key": k, "value": v}[step]
    before = given.copy()
    assert not np.shares_memory(t[step].array, given)
    given[...] = 7.0                                 # the caller reuses its array
    np.testing.assert_array_equal(t[step].array, before)


# ---------------------------------------------------------------- no keys

@pytest.mark.parametrize("masked_rows", ["nan", "zero"])
def test_a_call_with_no_keys_traces_an_empty_sum(masked_rows):
    # Sk = 0: the softmax has no cells, the context is an empty sum (0), the
    # output the output projection's bias
    m = _module()
    q = _x(2, 3, E)
    t = m.trace(q, _x(2, 0, E, seed=1), masked_rows=masked_rows)
    assert t.sizes["Sk"] == 0
    assert t["softmax"].shape == (2, H, 3, 0)
    np.testing.assert_array_equal(t["context"].array, np.zeros((2, H, 3, DK)))
    want = np.broadcast_to(np.asarray(m.W_o.bias, np.float64), (2, 3, E))
    np.testing.assert_allclose(t.info["numpy_output"], want, rtol=0, atol=1e-12)
    np.testing.assert_allclose(t.output, want, rtol=0, atol=1e-12)


# ---------------------------------------------------------------- caches

def test_a_cross_cache_call_has_no_own_keys_and_attends_the_memory():
    m = _module()
    memory = _x(2, 6, E, seed=4)
    cache = m.cache_memory(memory)
    q = _x(2, 3, E)
    t = m.trace(q, cache=cache)
    assert "Sn" not in t.sizes                       # the call brings no keys
    assert "Sn=" not in str(t).splitlines()[1]
    assert t.sizes["Sk"] == 6 and t.sizes["Sq"] == 3
    assert t["raw scores"].shape == (2, H, 3, 6)
    # the scores are the query's against the memory's keys
    Q, K = _heads(_lin(q, m.W_q), 2, 3), _heads(_lin(memory, m.W_k), 2, 6)
    np.testing.assert_allclose(t["raw scores"].array, Q @ K.transpose(0, 1, 3, 2) / np.sqrt(DK),
                               rtol=0, atol=1e-10)


def test_a_cached_calls_projections_and_cache_steps():
    # API.md §6: "[L cached | n new] → length L + n", (B, H, L + n, Dk)
    m = _module()
    x = _x(1, 6, E)
    cache = m.new_cache(1, 8)
    m(x[:, :4], cache=cache)
    t = m.trace(x[:, 4:], cache=cache)
    assert t.sizes["Sn"] == 2 and t.sizes["L"] == 4 and t.sizes["Sk"] == 6
    for name in ("K projection", "V projection"):
        assert t[name].dims == ("B", "Sn", "E")
        assert t[name].shape == (1, 2, E)
    for name in ("K cache", "V cache"):
        assert "[4 cached | 2 new] → length 6" in t[name].formula
        assert t[name].shape == (1, H, 6, DK)
    K = _heads(_lin(x, m.W_k), 1, 6)
    np.testing.assert_allclose(t["K cache"].array, K, rtol=0, atol=1e-10)


# ---------------------------------------------------------------- dims and formulas

def test_without_grouped_heads_the_k_and_v_heads_are_h_heads():
    t = _module().trace(_x(2, 3, E))
    for name in ("K heads", "V heads"):
        assert t[name].dims == ("B", "H", "Sk", "Dk")
        assert "[B, H, Sk, Dk]" in t[name].formula
    for name in ("K projection", "V projection"):
        assert t[name].dims == ("B", "Sk", "E")
    assert "Hkv" not in t.sizes
    for s in t:
        assert set(s.dims) <= set(t.sizes), s


@pytest.mark.parametrize("given, key_f, value_f", [
    (1, "x_k = x_q", "x_v = x_k"),
    (2, "x_k", "x_v = x_k"),
    (3, "x_k", "x_v"),
])
def test_the_input_formulas_say_which_input_defaulted(given, key_f, value_f):
    # key defaults to the query, value to the key (API.md §3)
    m = _module()
    args = [_x(1, 3, E), _x(1, 4, E, seed=1), _x(1, 4, E, seed=2)][:given]
    t = m.trace(*args)
    assert t["key"].formula == key_f
    assert t["value"].formula == value_f


def test_scale_is_in_the_raw_scores_formula_and_values():
    m = _module()
    x = _x(1, 3, E)
    t = m.trace(x, scale=0.25)
    assert t["raw scores"].formula == "S = Q·Kᵀ · 0.25"
    Q, K = _heads(_lin(x, m.W_q), 1, 3), _heads(_lin(x, m.W_k), 1, 3)
    np.testing.assert_allclose(t["raw scores"].array, Q @ K.transpose(0, 1, 3, 2) * 0.25,
                               rtol=0, atol=1e-10)
    assert m.trace(x)["raw scores"].formula == "S = Q·Kᵀ / √Dk"


def test_masked_rows_zero_is_named_in_the_softmax_formula():
    m = _module()
    x = _x(1, 3, E)
    kpm = np.array([[True, True, True]])
    zero = m.trace(x, key_padding_mask=kpm, masked_rows="zero")
    nan = m.trace(x, key_padding_mask=kpm)
    assert "→ 0" in zero["softmax"].formula
    assert "→ 0" not in nan["softmax"].formula
    assert (zero["softmax"].array == 0).all() and np.isnan(nan["softmax"].array).all()


def test_a_head_mask_under_dropout_is_named_in_the_dropout_formula():
    m = mha_ext.MultiHeadAttention(E, H, dropout=0.3, seed=0)
    x = _x(1, 3, E)
    t = m.trace(x, head_mask=np.array([1.0, 0.0, 1.0, 1.0]))
    assert "head_mask" in t["dropout"].formula
    assert (t["dropout"].array[:, 1] == 0).all()
    assert "head_mask" not in mha_ext.MultiHeadAttention(E, H, dropout=0.3, seed=0).trace(
        x)["dropout"].formula


# ---------------------------------------------------------------- unbatched

def test_an_unbatched_traces_numpy_output_is_unbatched():
    m = _module()
    x = _x(3, E)
    t = m.trace(x)
    assert t.info["numpy_output"].shape == (3, E)
    # the plain computation, one sequence
    Q, K, V = (_heads(_lin(x[None], w), 1, 3) for w in (m.W_q, m.W_k, m.W_v))
    S = Q @ K.transpose(0, 1, 3, 2) / np.sqrt(DK)
    A = np.exp(S - S.max(-1, keepdims=True))
    A /= A.sum(-1, keepdims=True)
    want = _lin((A @ V).transpose(0, 2, 1, 3).reshape(1, 3, E), m.W_o)[0]
    np.testing.assert_allclose(t.info["numpy_output"], want, rtol=0, atol=1e-10)


def test_blocked_is_none_for_a_float_mask_without_minus_inf_and_false_for_a_bool_one():
    # docs/API.md §6: a float mask blocks only where it holds -inf
    m, x = _module(), _x(2, 3, E)
    finite = _x(3, 3, seed=1)
    assert m.trace(x, attn_mask=finite).info["blocked"] is None
    blocked = m.trace(x, attn_mask=np.zeros((3, 3), dtype=bool)).info["blocked"]
    assert blocked.shape == (2, H, 3, 3) and not blocked.any()
    finite[1, 2] = -np.inf
    blocked = m.trace(x, attn_mask=finite).info["blocked"]
    assert blocked.sum() == 2 * H and blocked[:, :, 1, 2].all()
