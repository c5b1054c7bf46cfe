"""mha_ext.heads and mha_ext._teach (the arguments the teaching tools
share): the rules mutation testing of those files found no test holding (a
mutant of each passed the heads, plot and explorer tests before).

heads: a duck-typed module refused unless its head count is a positive int
(not a bool) and its output weight a matrix, a head being its Dk columns
of a W_o with fewer outputs than inputs, mha_ext's modules ablated without
torch; weights with no heads refused; a trace whose weights went through
dropout read through its "softmax" step; a row holding an inf left out as
a NaN row is; "same", "mirror" and "previous" with more queries than keys
counting only the queries whose key exists; a loss without a module
refused; a builtin loss without a readable signature taken; a loss tensor
that requires grad read without torch's warning, complex losses (a tensor,
a clongdouble array) refused, every call's value checked, an int too
large for a float the ValueError that is also an OverflowError (docs/API.md
§7; it was a TypeError), W_o put back after it; top() ignoring NaN,
roles() taking "more than" the threshold (0.5 by default); rows() giving
the head as an int; the report's text and HTML giving the loss with every
head on, and its shape (docs/API.md §6, heads' docstrings).

_teach: an object with weights but no steps not read as a trace; complex
weights and complex blocked= refused; blocked= of numbers blocked where
nonzero (negative too); a BlockLayout's blocks not kept hatched, queries
by keys; an object like a trace without info["blocked"] blocked where its
masked scores are -inf only; labels counted exactly and shown as text;
written pages encoded before the file is made, the path returned as a str
(docs/API.md §6).

Expected statistics are computed here in NumPy from the module docstring's
definitions.

Legend: B batch, H heads, Sq query length, Sk key length, E width.
"""
import contextlib
import functools
import json
import types
import warnings

import numpy as np
import pytest

import mha_ext
from mha_ext.heads import HeadReport, ablate, analyze, head_stats

from _support import need


def _rows(B=2, H=3, Sq=4, Sk=4, seed=0):
    w = np.random.default_rng(seed).random((B, H, Sq, Sk))
    return w / w.sum(-1, keepdims=True)


def _stat(w, key_of_row, offset=0):
    """NumPy, from the docstring: per head, the mean over batch items and
    valid rows (finite, not all 0) whose key k(i) lies in 0..Sk-1 of
    w[b, h, i, k(i)]; query i at key position i + offset."""
    B, H, Sq, Sk = w.shape
    out = np.full(H, np.nan)
    for h in range(H):
        vals = []
        for b in range(B):
            for i in range(Sq):
                row = w[b, h, i]
                if not np.all(np.isfinite(row)) or not np.any(row != 0):
                    continue
                k = key_of_row(i + offset, Sk)
                if 0 <= k < Sk:
                    vals.append(row[k])
        if vals:
            out[h] = np.mean(vals)
    return out


def _entropy(w):
    B, H, Sq, Sk = w.shape
    out = np.full(H, np.nan)
    for h in range(H):
        vals = [-sum(p * np.log(p) for p in w[b, h, i] if p > 0)
                for b in range(B) for i in range(Sq)
                if np.all(np.isfinite(w[b, h, i])) and np.any(w[b, h, i] != 0)]
        if vals:
            out[h] = np.mean(vals)
    return out


# ---------------------------------------------------------------- modules ablate takes

class _Linear:
    def __init__(self, weight):
        self.weight = weight


class _Duck:
    """An object with n_heads and W_o.weight, as heads' _OurHeads."""

    def __init__(self, n_heads, weight):
        self.n_heads = n_heads
        self.W_o = _Linear(weight)


@pytest.mark.parametrize("n_heads, weight", [
    (0, np.ones((4, 4))),              # no heads
    (True, np.ones((4, 4))),           # a bool is no head count
    (2, np.ones((2, 4, 4))),           # not a matrix (E_out, E)
], ids=["zero-heads", "bool-heads", "3-D-weight"])
def test_a_module_without_positive_int_heads_and_a_matrix_w_o_is_refused(n_heads, weight):
    # API.md §6: another module is a TypeError (before loss is ever called)
    calls = []
    with pytest.raises(TypeError, match="module must be an attention module"):
        ablate(_Duck(n_heads, weight), lambda: calls.append(1) or 0.0)
    assert calls == []


class _Editable(_Duck):
    def editing(self):
        return contextlib.nullcontext(self)


def test_a_head_is_its_dk_columns_of_a_w_o_with_fewer_outputs_than_inputs():
    # W_o.weight is (E_out, E): head h reads columns h*Dk:(h+1)*Dk, Dk = E / H
    E_out, E, H = 3, 8, 2
    r = np.random.default_rng(7)
    weight = r.standard_normal((E_out, E))
    probe = r.standard_normal((E_out, E))
    m = _Editable(H, weight.copy())
    base, per_head = ablate(m, lambda: float(np.sum(m.W_o.weight * probe)))
    assert base == pytest.approx(float(np.sum(weight * probe)), rel=1e-12)
    Dk = E // H
    for h in range(H):
        off = weight.copy()
        off[:, h * Dk:(h + 1) * Dk] = 0
        assert per_head[h] == pytest.approx(float(np.sum(off * probe)), rel=1e-12)
    np.testing.assert_array_equal(m.W_o.weight, weight)


def test_ablate_of_mha_ext_modules_needs_no_torch(monkeypatch):
    # heads is plain NumPy: mha_ext's module is edited through its editing()
    # blocks, torch never imported
    import sys
    m = mha_ext.MultiHeadAttention(8, 2, seed=0).eval()
    x = np.random.default_rng(0).standard_normal((1, 3, 8)).astype(np.float32)
    monkeypatch.setitem(sys.modules, "torch", None)       # import torch fails
    base, per_head = ablate(m, lambda: float(np.sum(m(x, need_weights=False)[0])))
    assert per_head.shape == (2,) and np.all(np.isfinite(per_head))


# ---------------------------------------------------------------- weights read

def test_weights_with_no_heads_are_refused():
    with pytest.raises(ValueError, match="no heads"):
        head_stats(np.ones((1, 0, 3, 3)))
    with pytest.raises(ValueError, match="no heads"):
        analyze(np.ones((0, 3, 3)))


def test_a_dropout_trace_is_read_through_its_softmax_step():
    # API.md §6: a trace whose weights went through dropout is read through
    # its "softmax" step (the pattern, before the dropout factors)
    m = mha_ext.MultiHeadAttention(16, 2, dropout=0.5, seed=3).train()
    x = np.random.default_rng(3).standard_normal((2, 5, 16))
    t = m.trace(x)
    assert t.info.get("dropout_active")
    soft = np.asarray(t["softmax"].array, np.float64)
    assert not np.allclose(soft, np.asarray(t.weights, np.float64))   # dropout did act
    got = head_stats(t)
    np.testing.assert_allclose(got["entropy"], _entropy(soft), rtol=1e-12)
    np.testing.assert_allclose(got["same"], _stat(soft, lambda q, Sk: q), rtol=1e-12)
    np.testing.assert_allclose(got["first"], _stat(soft, lambda q, Sk: 0), rtol=1e-12)


def test_a_row_holding_an_inf_is_left_out_as_a_nan_row_is():
    # only rows that have weights count: a row with an inf value has none
    w = _rows(B=1, H=2, Sq=4, Sk=4, seed=1)
    bad = w.copy()
    bad[0, 0, 2, 1] = np.inf
    nan = w.copy()
    nan[0, 0, 2] = np.nan
    got, want = head_stats(bad), head_stats(nan)
    for c in ("entropy", "distance", "previous", "same", "first", "mirror"):
        assert np.all(np.isfinite(got[c])), c
        np.testing.assert_allclose(got[c], want[c], rtol=1e-12, err_msg=c)
    np.testing.assert_allclose(got["same"], _stat(bad, lambda q, Sk: q), rtol=1e-12)


def test_same_and_mirror_with_more_queries_than_keys_count_queries_whose_key_exists():
    # cross-attention, Sq > Sk: query i has no key i (nor Sk-1-i) past the keys
    w = _rows(B=2, H=3, Sq=6, Sk=3, seed=2)
    got = head_stats(w)
    np.testing.assert_allclose(got["same"], _stat(w, lambda q, Sk: q), rtol=1e-12)
    np.testing.assert_allclose(got["same"], w[:, :, [0, 1, 2], [0, 1, 2]].mean(axis=(0, 2)),
                               rtol=1e-12)
    np.testing.assert_allclose(got["mirror"], _stat(w, lambda q, Sk: Sk - 1 - q), rtol=1e-12)
    np.testing.assert_allclose(got["previous"], _stat(w, lambda q, Sk: q - 1), rtol=1e-12)


# ---------------------------------------------------------------- the loss

def test_a_builtin_loss_without_a_readable_signature_is_taken():
    # heads._required_arguments: a builtin whose signature cannot be read is
    # not refused up front (calling it says whether it needs arguments)
    m = mha_ext.MultiHeadAttention(8, 2, seed=0)
    loss = functools.partial(next, iter([3.0, 1.0, 2.5]))
    base, per_head = ablate(m, loss)
    assert base == 3.0
    np.testing.assert_array_equal(per_head, [1.0, 2.5])


def test_a_loss_tensor_that_requires_grad_is_read_without_torchs_warning():
    torch = need("torch")
    m = mha_ext.MultiHeadAttention(8, 2, seed=0)
    p = torch.tensor(1.5, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        base, per_head = ablate(m, lambda: p * 2)
    assert base == 3.0
    np.testing.assert_array_equal(per_head, [3.0, 3.0])


def test_a_complex_loss_tensor_is_refused_even_with_no_imaginary_part():
    # float() would read torch.tensor(1.5+0j) as 1.5; loss() must return a
    # real number
    torch = need("torch")
    m = mha_ext.MultiHeadAttention(8, 2, seed=0)
    before = m.W_o.weight.copy()
    with pytest.raises(TypeError, match=r"loss\(\) must return a real number"):
        ablate(m, lambda: torch.tensor(1.5 + 0j))
    np.testing.assert_array_equal(m.W_o.weight, before)


def test_every_call_of_loss_is_checked_not_only_the_first():
    # a loss that turns to returning text with a head off is refused then too
    m = mha_ext.MultiHeadAttention(8, 2, seed=0)
    before = m.W_o.weight.copy()
    values = iter([1.0, "2.0", 3.0])
    with pytest.raises(TypeError, match=r"loss\(\) must return a real number"):
        ablate(m, lambda: next(values))
    np.testing.assert_array_equal(m.W_o.weight, before)


def test_a_complex_long_double_array_loss_is_refused():
    # float() reads a 0-d clongdouble array as its real part (a warning, no
    # error): loss() must return a real number
    m = mha_ext.MultiHeadAttention(8, 2, seed=0)
    with pytest.raises(TypeError, match=r"loss\(\) must return a real number"):
        ablate(m, lambda: np.array(1.5 + 2j, dtype=np.clongdouble))


def test_a_loss_of_an_int_too_large_for_a_float_on_a_later_call_puts_w_o_back():
    # refused as docs/API.md §7's ValueError, not float()'s own OverflowError
    m = mha_ext.MultiHeadAttention(8, 2, seed=0)
    before = m.W_o.weight.copy()
    values = iter([1.0, 10 ** 400, 2.0])
    with pytest.raises(ValueError):
        ablate(m, lambda: next(values))
    np.testing.assert_array_equal(m.W_o.weight, before)


def test_a_loss_of_an_int_too_large_for_a_float_is_the_overflow_error_of_api_s7():
    # it was a TypeError saying loss() must return a real number
    m = mha_ext.MultiHeadAttention(8, 2, seed=0)
    with pytest.raises(OverflowError, match="loss.. returns must be a real number, got an int "
                       "of 1329 bits, too large for a float") as e:
        ablate(m, lambda: 10 ** 400)
    assert isinstance(e.value, ValueError)


def test_a_loss_without_a_module_is_refused_as_a_module_without_a_loss_is():
    # API.md §6: given a module and a loss; one without the other says so
    calls = []
    with pytest.raises(ValueError, match="give both module and loss"):
        analyze(_rows(H=2), loss=lambda: calls.append(1) or 0.0)
    assert calls == []


# ---------------------------------------------------------------- the report

def test_top_ignores_nan():
    # HeadReport.top: the head with the largest value, NaN ignored
    rep = HeadReport({"entropy": [np.nan, 0.3, 0.7, np.nan, 0.1]})
    assert rep.top("entropy") == 2
    assert HeadReport({"entropy": [np.nan, np.nan]}).top("entropy") is None


def _one_hot_rows(Sq, Sk, key_of_row, p):
    # every row: weight p on key k(i), the rest spread evenly on the others
    w = np.full((Sq, Sk), (1 - p) / (Sk - 1))
    w[np.arange(Sq), [key_of_row(i) for i in range(Sq)]] = p
    return w


def test_roles_take_more_than_the_threshold_by_default_one_half():
    # roles(): the positions that get MORE than threshold (0.5 by default)
    S = 4
    w = np.stack([_one_hot_rows(S, S, lambda i: i, 0.5),     # "same" exactly 1/2
                  _one_hot_rows(S, S, lambda i: i, 0.45),    # under 1/2
                  _one_hot_rows(S, S, lambda i: i, 0.55)])[None]
    rep = analyze(w)
    np.testing.assert_allclose(rep.values["same"], [0.5, 0.45, 0.55], rtol=1e-12)
    assert rep.roles() == ["spread", "spread", "same"]
    assert rep.roles(threshold=0.4) == ["same", "same", "same"]


def test_rows_give_the_head_index_as_an_int():
    rows = analyze(_rows(H=3)).rows()
    assert [r["head"] for r in rows] == [0, 1, 2]
    assert all(type(r["head"]) is int for r in rows)


def test_the_report_says_the_loss_with_every_head_on():
    m = mha_ext.MultiHeadAttention(8, 2, seed=0).eval()
    x = np.random.default_rng(0).standard_normal((1, 3, 8)).astype(np.float32)

    def loss():
        return float(np.sum(m(x, need_weights=False)[0] ** 2))
    want = loss()                                # every head on, computed here
    w = m(x, average_weights=False)[1]
    rep = analyze(w, module=m, loss=loss)
    assert rep.base_loss == pytest.approx(want)
    assert "%.4f" % want in str(rep)
    assert "%.4f" % want in rep._repr_html_()
    assert "%.4f" % want not in str(analyze(w))  # no loss given: none shown
    assert rep.shape == (1, 2, 3, 3)


# ---------------------------------------------------------------- _teach: shared arguments

def _data(page):
    return json.loads(page.split('class="mha-data">')[1].split("</script>")[0])


@pytest.mark.parametrize("who", ["head_stats", "explore"])
def test_complex_weights_are_refused(who):
    # weights are real numbers: a complex array is a TypeError (float64
    # would drop its imaginary part)
    w = _rows(B=1, H=2, Sq=3, Sk=3).astype(np.complex128)
    call = head_stats if who == "head_stats" else mha_ext.explore
    with pytest.raises(TypeError, match="weights must be real numbers"):
        call(w)


def test_an_object_with_weights_but_no_steps_is_not_read_as_a_trace():
    # a trace has steps and weights; forward_train's context has weights
    # only and is no trace: refused as weights, not read through .weights
    m = mha_ext.MultiHeadAttention(8, 2, seed=0)
    ctx = m.forward_train(np.ones((1, 3, 8), np.float32))
    assert ctx.weights is not None and not hasattr(ctx, "steps")
    with pytest.raises(TypeError, match="weights must be real numbers"):
        head_stats(ctx)


class _LikeATrace:
    """An object like a trace (steps, sizes, weights, its steps by name)
    without info["blocked"]."""

    def __init__(self, tr, masked):
        self.steps, self.sizes, self.weights, self.info = tr.steps, tr.sizes, tr.weights, {}
        self._arrays = {"raw scores": tr["raw scores"].array, "masked scores": masked,
                        "softmax": tr["softmax"].array}

    def __contains__(self, name):
        return name in self._arrays

    def __getitem__(self, name):
        return types.SimpleNamespace(array=self._arrays[name])


def test_without_info_blocked_the_masked_scores_minus_inf_cells_are_the_blocked_ones():
    # _teach.trace_blocked: an object like a trace without info["blocked"]:
    # the masked scores' -inf cells (a +inf score blocks nothing)
    m = mha_ext.MultiHeadAttention(16, 2, seed=3).eval()
    tr = m.trace(np.random.default_rng(4).standard_normal((1, 4, 16)), is_causal=True)
    masked = np.array(tr["masked scores"].array, np.float64)
    masked[0, 1, 2, 0] = np.inf                    # a cell the causal mask keeps
    d = _data(mha_ext.explore(_LikeATrace(tr, masked)).to_html())
    got = np.array(d["blocked"]).reshape(masked.shape).astype(bool)
    np.testing.assert_array_equal(got, np.broadcast_to(np.triu(np.ones((4, 4), bool), 1),
                                                       masked.shape))


def test_complex_blocked_is_refused():
    with pytest.raises(TypeError, match="blocked must be a BlockLayout or an array"):
        mha_ext.explore(_rows(B=1, H=1, Sq=2, Sk=2), blocked=np.eye(2, dtype=np.complex128))


def test_blocked_numbers_block_where_nonzero_negative_too():
    # API.md §6: blocked= an array of bools or numbers (nonzero: blocked)
    b = np.array([[0, -1, 2], [0, 0, -0.5], [0.0, 3, 0]])
    d = _data(mha_ext.explore(_rows(B=1, H=2, Sq=3, Sk=3), blocked=b).to_html())
    got = np.array(d["blocked"]).reshape(1, 2, 3, 3).astype(bool)
    np.testing.assert_array_equal(got, np.broadcast_to(b != 0, (1, 2, 3, 3)))


def test_a_block_layout_with_more_keys_than_queries_hatches_the_blocks_not_kept():
    # a BlockLayout's blocks not kept, rows the queries and columns the keys
    from mha_ext.layout import BlockLayout
    keep = np.array([[True, False, True], [False, True, False]])   # (nqb, nkb)
    lay = BlockLayout(keep, 2)
    want = ~np.kron(keep, np.ones((2, 2), bool))                   # (Sq 4, Sk 6)
    d = _data(mha_ext.explore(_rows(B=1, H=1, Sq=4, Sk=6), blocked=lay).to_html())
    np.testing.assert_array_equal(np.array(d["blocked"]).reshape(4, 6).astype(bool), want)


@pytest.mark.parametrize("n", [2, 4])
def test_labels_are_counted_exactly(n):
    # one label per query or key: fewer or more is a ValueError
    with pytest.raises(ValueError, match="has %d labels but the weights have 3" % n):
        mha_ext.explore(_rows(B=1, H=1, Sq=3, Sk=3), tokens=[str(i) for i in range(n)])


def test_labels_are_shown_as_text_whatever_they_are():
    # a label per query or key, shown as its str(): numbers, NumPy ints, None
    w = _rows(B=1, H=1, Sq=3, Sk=3)
    d = _data(mha_ext.explore(w, query_tokens=np.arange(3), key_tokens=[1.5, None, "x"]).to_html())
    assert d["qTokens"] == ["0", "1", "2"]
    assert d["kTokens"] == ["1.5", "None", "x"]


def test_a_saved_page_is_encoded_before_the_file_is_made(tmp_path):
    # _teach.write_page: a lone surrogate is an error and no half-written file
    page = mha_ext.explore(_rows(B=1, H=1, Sq=2, Sk=2), title="bad \ud800 title")
    path = tmp_path / "page.html"
    with pytest.raises(UnicodeEncodeError):
        page.save(path)
    assert not path.exists()
    good = mha_ext.explore(_rows(B=1, H=1, Sq=2, Sk=2), title="caf\u00e9")
    got = good.save(path)                         # a path-like: returned as a str
    assert got == str(path) and type(got) is str
    assert "caf\u00e9" in path.read_bytes().decode("utf-8")
