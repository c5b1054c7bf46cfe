"""mha.trace(...): every step of one call, its shapes, values and display.

Legend: B batch, Sq/Sk query/key length, E d_model, H heads, Dk = E / H.
"""

import html.parser

import numpy as np
import pytest

import mha_ext
from mha_ext.trace import Step, Trace, trace
from _support import need

TOL = {"float32": 2e-5, "float64": 1e-10}

STEPS = ["query", "key", "value", "Q projection", "K projection",
         "V projection", "Q heads", "K heads", "V heads", "raw scores",
         "masked scores", "softmax", "context", "concat heads",
         "output projection"]
STEPS_DROPOUT = STEPS[:12] + ["dropout"] + STEPS[12:]


def close(a, b, dtype):
    tol = TOL[np.dtype(dtype).name]
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


def reference(m, q, k, v, blocked=None, added=None):
    """The plain float64 computation, step by step, batched inputs."""
    f = lambda a: np.asarray(a, dtype=np.float64)
    lin = lambda x, l: f(x) @ f(l.weight).T + (
        f(l.bias) if l.bias is not None else 0.0)
    B, Sq, E = q.shape
    Sk, H = k.shape[1], m.n_heads
    Dk = E // H
    r = {}
    r["Q projection"] = Q = lin(q, m.W_q)
    r["K projection"] = K = lin(k, m.W_k)
    r["V projection"] = V = lin(v, m.W_v)
    r["Q heads"] = Qh = Q.reshape(B, Sq, H, Dk).transpose(0, 2, 1, 3)
    r["K heads"] = Kh = K.reshape(B, Sk, H, Dk).transpose(0, 2, 1, 3)
    r["V heads"] = Vh = V.reshape(B, Sk, H, Dk).transpose(0, 2, 1, 3)
    r["raw scores"] = S = Qh @ Kh.transpose(0, 1, 3, 2) / np.sqrt(Dk)
    if added is not None:
        S = S + added
    if blocked is not None:
        S = np.where(blocked, -np.inf, S)
    r["masked scores"] = S
    with np.errstate(invalid="ignore"):
        mx = S.max(axis=-1, keepdims=True)
        e = np.exp(S - np.where(np.isneginf(mx), 0, mx))
        A = e / e.sum(axis=-1, keepdims=True)
    A = np.where(np.isneginf(mx), np.nan, A)
    r["softmax"] = A
    r["context"] = C = A @ Vh
    r["concat heads"] = Cc = C.transpose(0, 2, 1, 3).reshape(B, Sq, E)
    r["output projection"] = lin(Cc, m.W_o)
    return r


@pytest.fixture(params=["float32", "float64"])
def dtype(request):
    return request.param


def module(dtype="float32", E=32, H=4, seed=1, **kw):
    return mha_ext.MultiHeadAttention(E, H, dtype=dtype, seed=seed, **kw)


# -- structure ---------------------------------------------------------------

def test_self_attention_steps_and_shapes(dtype):
    m = module(dtype).eval()
    x = np.random.default_rng(0).standard_normal((2, 5, 32))
    tr = m.trace(x)
    assert isinstance(tr, Trace)
    assert tr.names == STEPS
    assert len(tr) == len(STEPS)
    assert [s.name for s in tr] == STEPS
    shapes = {
        "query": (2, 5, 32), "key": (2, 5, 32), "value": (2, 5, 32),
        "Q projection": (2, 5, 32), "K projection": (2, 5, 32),
        "V projection": (2, 5, 32), "Q heads": (2, 4, 5, 8),
        "K heads": (2, 4, 5, 8), "V heads": (2, 4, 5, 8),
        "raw scores": (2, 4, 5, 5), "masked scores": (2, 4, 5, 5),
        "softmax": (2, 4, 5, 5), "context": (2, 4, 5, 8),
        "concat heads": (2, 5, 32), "output projection": (2, 5, 32)}
    for s in tr:
        assert isinstance(s, Step)
        assert s.shape == shapes[s.name], s.name
        assert s.array.shape == s.shape, s.name
        assert s.array.dtype == np.dtype(dtype), s.name
        assert len(s.dims) == len(s.shape), s.name
        assert s.formula
    assert tr["Q heads"].dims == ("B", "H", "Sq", "Dk")
    assert tr["raw scores"].dims == ("B", "H", "Sq", "Sk")
    assert tr.sizes == {"B": 2, "Sq": 5, "Sk": 5, "E": 32, "H": 4, "Dk": 8,
                        "Ek": 32, "Ev": 32}


def test_getitem_by_name_and_index():
    m = module().eval()
    tr = m.trace(np.ones((1, 3, 32)))
    assert tr["softmax"] is tr[STEPS.index("softmax")]
    assert tr[-1].name == "output projection"
    assert "softmax" in tr and "dropout" not in tr
    name, formula, shape, array, dims = tr["raw scores"]
    assert name == "raw scores" and shape == (1, 4, 3, 3)
    with pytest.raises(KeyError, match="softmax"):     # lists the names
        tr["attention"]


def test_method_matches_function_and_exports():
    m = module().eval()
    x = np.random.default_rng(1).standard_normal((2, 4, 32))
    a, b = m.trace(x), trace(m, x)
    assert a.names == b.names
    for s, t in zip(a, b):
        np.testing.assert_array_equal(s.array, t.array)
    assert mha_ext.Trace is Trace
    assert callable(mha_ext.plot_heads)


# -- values ------------------------------------------------------------------

def test_self_attention_values(dtype):
    m = module(dtype).eval()
    x = np.random.default_rng(2).standard_normal((2, 5, 32)).astype(dtype)
    x_before = x.copy()
    tr = m.trace(x)
    out, w = m(x)
    # what the call returns, bit for bit
    np.testing.assert_array_equal(tr.output, out)
    np.testing.assert_array_equal(tr.weights, w)
    # the step is a read-only copy of the call's own output
    assert not np.shares_memory(tr["output projection"].array, tr.output)
    np.testing.assert_array_equal(x, x_before)          # input untouched
    # every NumPy step agrees with the plain float64 reference
    ref = reference(m, x, x, x)
    for name, value in ref.items():
        close(tr[name].array, value, dtype)
    np.testing.assert_array_equal(tr["query"].array, x)
    # and the NumPy chain ends where the module ends
    close(tr["softmax"].array, w, dtype)
    cat = tr["concat heads"].array
    close(cat @ m.W_o.weight.T + m.W_o.bias, out, dtype)
    close(tr.info["numpy_output"], out, dtype)
    np.testing.assert_allclose(tr["softmax"].array.sum(-1), 1,
                               rtol=TOL[dtype] * 10)


def test_cross_attention_with_masks(dtype):
    rng = np.random.default_rng(3)
    B, Sq, Sk, E, H, Ek, Ev = 2, 4, 6, 24, 3, 10, 7
    m = mha_ext.MultiHeadAttention(E, H, kdim=Ek, vdim=Ev, dtype=dtype,
                                   seed=4).eval()
    q = rng.standard_normal((B, Sq, E))
    k = rng.standard_normal((B, Sk, Ek))
    v = rng.standard_normal((B, Sk, Ev))
    mask = (rng.random((B, 1, Sq, Sk)) < 0.25).astype(np.int64)  # 1 = blocked
    mask[0, 0, 1, :] = 1                       # query 1 of batch 0 sees nothing
    attn_mask = np.zeros((Sq, Sk), dtype=bool)
    attn_mask[:, 5] = True                     # nobody sees key 5
    kpm = np.zeros((B, Sk), dtype=bool)
    kpm[1, 0] = True                           # batch 1 ignores key 0
    kw = dict(attn_mask=attn_mask, key_padding_mask=kpm, is_causal=True)

    tr = m.trace(q, k, v, mask, **kw)
    out, w = m(q, k, v, mask, **kw)
    np.testing.assert_array_equal(tr.output, out)
    np.testing.assert_array_equal(tr.weights, w)

    causal = np.triu(np.ones((Sq, Sk), dtype=bool), k=1)
    blocked = ((mask != 0) | attn_mask | kpm[:, None, None, :] | causal)
    blocked = np.broadcast_to(blocked, (B, H, Sq, Sk))
    masked = tr["masked scores"].array
    # -inf exactly where blocked, the raw score everywhere else
    np.testing.assert_array_equal(np.isneginf(masked), blocked)
    np.testing.assert_array_equal(masked[~blocked],
                                  tr["raw scores"].array[~blocked])
    assert not np.isneginf(tr["raw scores"].array).any()

    assert tr["K projection"].shape == (B, Sk, E)
    assert tr["key"].shape == (B, Sk, Ek) and tr["value"].shape == (B, Sk, Ev)
    assert tr["raw scores"].shape == (B, H, Sq, Sk)
    assert tr["context"].shape == (B, H, Sq, E // H)

    ref = reference(m, q.astype(dtype), k.astype(dtype), v.astype(dtype),
                    blocked=blocked)
    for name, value in ref.items():
        np.testing.assert_allclose(tr[name].array, value, rtol=TOL[dtype],
                                   atol=TOL[dtype], equal_nan=True,
                                   err_msg=name)
    # the fully blocked row: NaN weights and output, like the call
    dead = blocked.all(-1)
    assert dead[0, :, 1].all()
    assert np.isnan(tr["softmax"].array[dead]).all()
    assert not np.isnan(tr["softmax"].array[~dead]).any()
    assert np.isnan(tr.output[0, 1]).all()
    np.testing.assert_allclose(tr["softmax"].array, w, rtol=TOL[dtype],
                               atol=TOL[dtype], equal_nan=True)
    # blocked keys get exactly zero weight in live rows
    live = blocked & ~dead[..., None]
    assert (tr["softmax"].array[live] == 0).all()
    text = str(tr)
    assert "mask" in text and "causal" in text


@pytest.mark.parametrize("shape", [(4, 6), (1, 1, 4, 6), (2, 1, 1, 6),
                                   (3, 4, 6)])
def test_mask_broadcasts(shape):
    rng = np.random.default_rng(5)
    m = module("float64", E=12, H=3).eval()
    q, kv = rng.standard_normal((2, 4, 12)), rng.standard_normal((2, 6, 12))
    mask = rng.random(shape) < 0.3
    tr = m.trace(q, kv, mask=mask)
    np.testing.assert_array_equal(
        np.isneginf(tr["masked scores"].array),
        np.broadcast_to(mask, (2, 3, 4, 6)))
    out, w = m(q, kv, mask=mask)
    np.testing.assert_array_equal(tr.output, out)
    np.testing.assert_array_equal(tr.weights, w)


def test_additive_float_masks(dtype):
    rng = np.random.default_rng(6)
    B, S, E, H = 2, 5, 16, 2
    m = module(dtype, E=E, H=H).eval()
    x = rng.standard_normal((B, S, E))
    am = rng.standard_normal((B * H, S, S))     # index b·H + h, added
    am[1, 2, 3] = -np.inf
    kpm = np.zeros((B, S))
    kpm[0, 4] = -np.inf
    kpm[1, 1] = 0.5
    tr = m.trace(x, attn_mask=am.astype(dtype), key_padding_mask=kpm.astype(dtype))
    added = am.reshape(B, H, S, S) + kpm[:, None, None, :]
    masked = tr["masked scores"].array
    np.testing.assert_array_equal(np.isneginf(masked), np.isneginf(added))
    fin = np.isfinite(added)
    close(masked[fin], (tr["raw scores"].array.astype(np.float64) + added)[fin],
          dtype)
    out, w = m(x, attn_mask=am.astype(dtype), key_padding_mask=kpm.astype(dtype))
    np.testing.assert_array_equal(tr.output, out)
    close(tr["softmax"].array, w, dtype)
    assert "attn_mask" in tr["masked scores"].formula


def test_masked_rows_zero(dtype):
    m = module(dtype, E=16, H=2).eval()
    x = np.random.default_rng(7).standard_normal((1, 3, 16))
    mask = np.zeros((3, 3))
    mask[2] = 1                                 # query 2 sees nothing
    tr = m.trace(x, mask=mask, masked_rows="zero")
    assert np.isneginf(tr["masked scores"].array[0, :, 2]).all()
    np.testing.assert_array_equal(tr["softmax"].array[0, :, 2], 0)
    np.testing.assert_array_equal(tr["context"].array[0, :, 2], 0)
    close(tr.output[0, 2], m.W_o.bias, dtype)
    out, w = m(x, mask=mask, masked_rows="zero")
    np.testing.assert_array_equal(tr.output, out)
    np.testing.assert_array_equal(tr.weights, w)


def test_need_weights_and_average_weights():
    m = module().eval()
    x = np.random.default_rng(8).standard_normal((2, 4, 32))
    tr = m.trace(x, need_weights=False)
    assert tr.weights is None
    np.testing.assert_array_equal(tr.output, m(x, need_weights=False)[0])
    assert tr["softmax"].shape == (2, 4, 4, 4)        # still traced per head
    tr = m.trace(x, average_weights=True)
    out, w = m(x, average_weights=True)
    assert tr.weights.shape == (2, 4, 4)
    np.testing.assert_array_equal(tr.weights, w)
    np.testing.assert_array_equal(tr.output, out)


def test_unbatched(dtype):
    m = module(dtype).eval()
    x = np.random.default_rng(9).standard_normal((5, 32))
    tr = m.trace(x)
    out, w = m(x)
    np.testing.assert_array_equal(tr.output, out)
    np.testing.assert_array_equal(tr.weights, w)
    assert tr["query"].shape == (5, 32)
    assert tr["Q heads"].shape == (4, 5, 8)
    assert tr["Q heads"].dims == ("H", "Sq", "Dk")
    assert tr["Q heads"].formula == "Q → [H, Sq, Dk]"
    assert tr["softmax"].shape == (4, 5, 5)
    assert "B" not in tr.sizes
    close(tr["softmax"].array, w, dtype)
    text = str(tr)
    assert "[4, 5, 8]" in text and "unbatched" in text


# -- dropout -----------------------------------------------------------------

def test_dropout_step_in_training_only():
    x = np.random.default_rng(10).standard_normal((2, 4, 32))
    m = module(dropout=0.5)
    assert m.training
    assert m.trace(x).names == STEPS_DROPOUT
    assert m.eval().trace(x).names == STEPS          # eval: no dropout
    assert module(dropout=0.0).trace(x).names == STEPS   # p = 0: none


def test_dropout_matches_call_and_consumes_one_draw(dtype):
    x = np.random.default_rng(11).standard_normal((2, 6, 32)).astype(dtype)
    m = module(dtype, dropout=0.4, seed=12)
    twin = module(dtype, dropout=0.4, seed=12)
    tr = m.trace(x)
    out1, w1 = twin(x)
    # the trace holds exactly what one call draws
    np.testing.assert_array_equal(tr.output, out1)
    np.testing.assert_array_equal(tr.weights, w1)
    np.testing.assert_array_equal(tr["dropout"].array, w1)
    # ... and consumed exactly one draw: the next calls stay in step
    for _ in range(2):
        o_m, w_m = m(x)
        o_t, w_t = twin(x)
        np.testing.assert_array_equal(o_m, o_t)
        np.testing.assert_array_equal(w_m, w_t)
    # the dropout step is softmax · keep / (1 - p)
    a, d = tr["softmax"].array, tr["dropout"].array
    kept = d != 0
    assert 0 < kept.mean() < 1
    close(d[kept], a[kept] / (1 - 0.4), dtype)
    # the context is computed from the weights after dropout
    close(tr["context"].array, d @ tr["V heads"].array, dtype)
    close(tr["concat heads"].array @ m.W_o.weight.T + m.W_o.bias, tr.output,
          dtype)


@pytest.mark.parametrize("batched", [True, False])
def test_dropout_trace_averages_the_heads_as_the_call(batched):
    # with dropout the trace reduces the call's per-head weights itself:
    # the heads summed in the call's order, so the same bits (one query and
    # one key over 8 heads: NumPy's mean would sum them pairwise)
    x = np.random.default_rng(5).standard_normal((1, 1, 32))
    if not batched:
        x = x[0]
    hits = 0
    for seed in range(8):
        m = mha_ext.MultiHeadAttention(32, 8, dropout=0.3, seed=seed, dtype="float64")
        twin = mha_ext.MultiHeadAttention(32, 8, dropout=0.3, seed=seed, dtype="float64")
        twin.load_state_dict(m.state_dict())
        tr = m.trace(x, average_weights=True)
        _, w = twin(x, average_weights=True)
        assert w.shape == ((1, 1, 1) if batched else (1, 1))
        assert np.array_equal(tr.weights, w)
        per_head = tr["dropout"].array
        hits += not np.array_equal(per_head.mean(axis=-3), w)
    assert hits  # some seed where NumPy's mean gives other bits


def test_dropout_with_need_weights_false():
    x = np.random.default_rng(13).standard_normal((1, 5, 32))
    m = module(dropout=0.3, seed=14)
    twin = module(dropout=0.3, seed=14)
    tr = m.trace(x, need_weights=False)
    assert tr.weights is None and "dropout" in tr
    out, _ = twin(x, need_weights=False)
    close(tr.output, out, "float32")
    np.testing.assert_array_equal(m(x)[1], twin(x)[1])   # still in step


# -- display -----------------------------------------------------------------

def test_str_is_a_shape_flow_table():
    m = module("float32", E=512, H=8, seed=0).eval()
    x = np.zeros((2, 10, 512), dtype=np.float32)
    tr = m.trace(x)
    text = str(tr)
    assert repr(tr) == text
    lines = text.splitlines()
    assert "B=2, Sq=10, Sk=10, E=512, H=8, Dk=64" in text
    assert "[batch=2, seq_q=10, d_model=512]" in text
    assert "[B, H, Sq, Dk]" in text and "[2, 8, 10, 64]" in text
    assert "[B, H, Sq, Sk]" in text and "[2, 8, 10, 10]" in text
    assert ("shape flow: [B, Sq, E] → [B, H, Sq, Dk] → [B, H, Sq, Sk] → "
            "[B, H, Sq, Dk] → [B, Sq, E]") in text
    # one row per step, in order, names in the first column
    rows = [ln for ln in lines if ln.split("  ")[0].strip() in STEPS]
    assert [r.split("  ")[0].strip() for r in rows] == STEPS
    assert "Q = x_q·W_qᵀ + b_q" in text and "S = Q·Kᵀ / √Dk" in text
    assert "float32" in text and "eval" in text


def test_formulas_without_bias():
    m = mha_ext.MultiHeadAttention(16, 2, bias=False, seed=0).eval()
    tr = m.trace(np.ones((1, 2, 16)))
    assert tr["Q projection"].formula == "Q = x_q·W_qᵀ"
    assert tr["output projection"].formula == "out = C·W_oᵀ"


class _Tags(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.stack, self.count, self.text = [], {}, []

    def handle_starttag(self, tag, attrs):
        self.count[tag] = self.count.get(tag, 0) + 1
        if tag not in ("br",):
            self.stack.append(tag)

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, (self.stack, tag)
        self.stack.pop()

    def handle_data(self, data):
        self.text.append(data)


def test_html_repr():
    m = module().eval()
    x = np.random.default_rng(15).standard_normal((2, 3, 32))
    tr = m.trace(x, is_causal=True)
    page = tr._repr_html_()
    assert page.lstrip().startswith("<table")
    p = _Tags()
    p.feed(page)
    p.close()
    assert p.stack == []                                # balanced tags
    assert p.count["table"] == 1
    assert p.count["tr"] == len(tr) + 1                 # header + one per step
    assert p.count["th"] == 4
    text = "".join(p.text)
    for name in STEPS:
        assert name in text
    assert "[2, 4, 3, 8]" in text and "[B, H, Sq, Dk]" in text
    assert "→" in text


# -- inputs and errors -------------------------------------------------------

def test_errors_are_the_calls_errors():
    m = module().eval()
    with pytest.raises(ValueError):
        m.trace(np.ones((2, 3, 31)))
    with pytest.raises(ValueError):
        m.trace(np.ones((2, 3, 32)), np.ones((2, 4, 32)), np.ones((2, 5, 32)))
    with pytest.raises(TypeError):
        m.trace(np.ones((2, 3, 32)), bogus=True)
    with pytest.raises((TypeError, ValueError)):
        m.trace(np.ones((2, 3, 32), dtype=complex))


def test_trace_does_not_disturb_eval_module():
    m = module().eval()
    x = np.random.default_rng(16).standard_normal((2, 3, 32))
    before = m(x)
    params = {k: v.copy() for k, v in m.state_dict().items()}
    m.trace(x)
    after = m(x)
    np.testing.assert_array_equal(before[0], after[0])
    for k, v in m.state_dict().items():
        np.testing.assert_array_equal(v, params[k])


def test_torch_tensor_inputs():
    torch = need("torch")
    m = module("float64").eval()
    x = torch.randn(2, 3, 32, dtype=torch.float64, requires_grad=True)
    tr = m.trace(x)
    out, w = m(x.detach().numpy())
    np.testing.assert_array_equal(tr.output, out)
    np.testing.assert_array_equal(tr.weights, w)


def test_html_is_styled_with_one_notation_and_values(tmp_path):
    m = module().eval()
    x = np.random.default_rng(17).standard_normal((2, 3, 32))
    tr = m.trace(x, is_causal=True)
    page = tr._repr_html_()
    assert page == tr.to_html()
    # its own CSS, scoped to the table, left-aligned (also inline, for
    # front-ends that drop <style>)
    assert "<style>" in page and ".mha-trace th,.mha-trace td{text-align:left" in page
    assert page.count('style="text-align:left;vertical-align:top"') == 4 * (len(tr) + 1) + 1
    # one shape notation: numbers in the shape column, symbols in dims
    assert "batch=" not in page and "[2, 3, 32]" in page and "[B, Sq, E]" in page
    # a values preview per step: index 0 on the leading axes, a small slice
    p = _Tags()
    p.feed(page)
    p.close()
    assert p.stack == [] and p.count["details"] == len(tr)
    soft = tr["softmax"].array[0, 0, :4, :6]
    assert "values [0, 0, :4, :6]" in page
    assert html.escape(np.array2string(soft, precision=3, suppress_small=True,
                                       max_line_width=200)) in page
    assert "−∞ where j &gt; i (causal)" in page                  # the formula
    assert "<details>" not in tr.to_html(values=False)
    path = tr.save_html(tmp_path / "trace.html")
    text = open(path, encoding="utf-8").read()
    assert text.startswith("<!DOCTYPE html>") and "default-src 'none'" in text
    assert page in text


def test_the_function_refuses_what_the_method_refuses():
    import mha_ext
    m = mha_ext.MultiHeadAttention(16, 2, seed=0).eval()
    x = np.ones((3, 4, 16))
    m.batch_first = False
    with pytest.raises(ValueError, match="batch-first"):
        mha_ext.trace(m, x)
    m.batch_first = True
    m.mask_polarity = "keep"
    with pytest.raises(ValueError, match="block polarity"):
        mha_ext.trace(m, x)
    m.mask_polarity = "block"
    with pytest.raises(TypeError, match="takes a mha_ext.MultiHeadAttention"):
        mha_ext.trace(object(), x)
    with pytest.raises(TypeError, match="KVCache"):      # the call's own error
        m.trace(x, cache=5)


def test_steps_are_read_only_and_info_holds_the_blocked_cells():
    m = mha_ext.MultiHeadAttention(16, 2, seed=0).eval()
    x = np.random.default_rng(0).standard_normal((2, 4, 16))
    tr = m.trace(x)
    assert tr.info["blocked"] is None
    # why read-only: without a mask "masked scores" is "raw scores" itself
    assert np.shares_memory(tr["raw scores"].array, tr["masked scores"].array)
    for st in tr:
        assert not st.array.flags.writeable, st.name
        with pytest.raises(ValueError, match="read-only"):
            st.array[...] = 0
    assert tr.output.flags.writeable and tr.weights.flags.writeable  # the call's, as returned
    tr.output[...] = 7.0                                  # the caller's: no step changes
    assert not (tr["output projection"].array == 7.0).any()
    md = mha_ext.MultiHeadAttention(16, 2, dropout=0.3, seed=1).train()
    td = md.trace(x)
    td.weights[...] = 9.0
    assert not (td["dropout"].array == 9.0).any()
    x_before = x.copy()
    tr["query"].array.copy()[...] = 0
    np.testing.assert_array_equal(x, x_before)
    # bool masks' True and float masks' -inf; a finite float value blocks nothing
    am = np.zeros((4, 4))
    am[0, 2], am[1, 0] = -np.inf, -1.0
    kpm = np.array([[False, False, False, True], [False] * 4])
    tr = m.trace(x, attn_mask=am, key_padding_mask=kpm)
    want = np.zeros((2, 2, 4, 4), dtype=bool)
    want[:, :, 0, 2] = True
    want[0, :, :, 3] = True
    np.testing.assert_array_equal(tr.info["blocked"], want)
    assert not tr.info["blocked"].flags.writeable
    # the caller's mask, changed afterwards, does not change the trace's cells
    only = np.zeros((4, 4), dtype=bool)
    only[0, 1] = True
    tb = m.trace(x, attn_mask=only)
    only[:] = True
    assert tb.info["blocked"].sum() == 2 * 2              # (0, 1) in each batch item and head
    np.testing.assert_array_equal(tr.info["blocked"], np.isneginf(tr["masked scores"].array))
    # unbatched, causal: the masked scores' shape; a +inf scale's -inf cells are not blocked
    u = m.trace(x[0], is_causal=True, scale=float("inf"))
    causal = np.triu(np.ones((4, 4), dtype=bool), 1)
    np.testing.assert_array_equal(u.info["blocked"], np.broadcast_to(causal, (2, 4, 4)))
    assert np.isneginf(u["masked scores"].array[:, ~causal]).any()


def test_every_symbol_in_the_dims_is_in_the_legend():
    """Each step's dims use only symbols the legend defines (trace.sizes,
    and the header of the printed and HTML table): with a cache, Sn (the
    call's own keys) and L; with grouped heads, Hkv and Ekv."""
    m = mha_ext.MultiHeadAttention(16, 4, n_kv_heads=2, kdim=6, vdim=10, seed=1).eval()
    rng = np.random.default_rng(0)
    x, kv = rng.standard_normal((2, 9, 16)), rng.standard_normal((2, 9, 6))
    cache = m.new_cache(2, 20)
    traces = [m.trace(x, kv, rng.standard_normal((2, 9, 10))),
              m.trace(x[:, :5], kv[:, :5], kv[:, :5, :1].repeat(10, -1), cache=cache),
              m.trace(x[:, 5:6], kv[:, 5:6], kv[:, 5:6, :1].repeat(10, -1), cache=cache)]
    for tr in traces:
        used = {d for s in tr.steps for d in s.dims if not d.isdigit()}
        assert used <= set(tr.sizes), (used - set(tr.sizes), tr.sizes)
        header = str(tr).splitlines()[1]
        for d in used:
            assert "%s=%d" % (d, tr.sizes[d]) in header or \
                d in ("Ek", "Ev") and tr.sizes[d] == tr.sizes["E"], (d, header)
            assert "%s=%d" % (d, tr.sizes[d]) in tr._repr_html_() or d in ("Ek", "Ev"), d
    assert traces[2].sizes["Sn"] == 1 and traces[2].sizes["L"] == 5
