"""mha_ext.heads: per-head statistics, switching heads off, the report, and
the example model whose heads specialise (examples/heads_model.py)."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

import mha_ext
from mha_ext.heads import HeadReport, ablate, analyze, head_stats

from _support import need

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "heads_model.py"


def _shift(S, k):
    # each query i puts all its weight on key i+k (clipped into the sequence)
    w = np.zeros((S, S))
    w[np.arange(S), np.clip(np.arange(S) + k, 0, S - 1)] = 1
    return w


def test_stats_of_known_patterns():
    S = 6
    uniform = np.full((S, S), 1 / S)
    first = np.zeros((S, S))
    first[:, 0] = 1
    mirror = _shift(S, 0)[:, ::-1]
    w = np.stack([_shift(S, 0), _shift(S, -1), first, mirror, uniform])[None]  # (1, 5, S, S)
    st = head_stats(w)
    # the shift head puts row 0 on key 0 (same, and first with row 1)
    np.testing.assert_allclose(st["same"], [1, 1 / S, 1 / S, 0, 1 / S])
    # previous: queries i >= 1 only
    np.testing.assert_allclose(st["previous"], [0, 1, 1 / (S - 1), 1 / (S - 1), 1 / S])
    np.testing.assert_allclose(st["first"], [1 / S, 2 / S, 1, 1 / S, 1 / S])
    np.testing.assert_allclose(st["mirror"], [0, 1 / S, 1 / S, 1, 1 / S])
    np.testing.assert_allclose(st["entropy"], [0, 0, 0, 0, np.log(S)], atol=1e-12)
    i = np.arange(S)
    np.testing.assert_allclose(st["distance"], [
        0, (S - 1) / S, i.mean(), np.abs(i - (S - 1 - i)).mean(),
        np.abs(i[:, None] - i[None]).mean()])


def test_nan_rows_are_left_out_and_batches_averaged():
    S = 4
    a = _shift(S, 0)[None]                             # (1, S, S): one head
    b = _shift(S, -1)[None].copy()
    b[0, 2] = np.nan                                   # a query with every key blocked
    st = head_stats(np.stack([a, b]))                  # (2, 1, S, S)
    # same: batch 0 gives 1 on 4 rows, batch 1 gives 1 (row 0) + 0 (rows 1, 3)
    np.testing.assert_allclose(st["same"], [(4 + 1) / 7])
    all_nan = np.full((1, 2, S, S), np.nan)
    assert np.all(np.isnan(head_stats(all_nan)["entropy"]))


def test_stats_of_a_trace_and_unbatched_weights():
    m = mha_ext.MultiHeadAttention(16, 4, seed=0).eval()
    x = np.random.default_rng(0).standard_normal((2, 5, 16))
    tr = m.trace(x, is_causal=True)
    st = head_stats(tr)
    assert st["entropy"].shape == (4,)
    # causal: no weight on later keys, so none on the mirror of early queries
    np.testing.assert_allclose(head_stats(tr.weights[0])["same"], head_stats(tr.weights[:1])["same"])
    assert np.all((st["first"] > 0) & (st["first"] <= 1))


def test_ablate_zeroes_exactly_one_heads_context():
    m = mha_ext.MultiHeadAttention(16, 4, seed=1).eval()
    x = np.random.default_rng(1).standard_normal((2, 5, 16)).astype(np.float32)
    before = m.state_dict()
    seen = []

    def loss():
        out, _ = m(x)
        seen.append(out)
        return float(np.sum(out ** 2))

    base, per_head = ablate(m, loss)
    assert per_head.shape == (4,)
    tr = m.trace(x)
    for h in range(4):                                  # redo it by hand from the trace
        ctx = tr["context"].array.copy()
        ctx[:, h] = 0
        cat = ctx.transpose(0, 2, 1, 3).reshape(2, 5, 16)
        out = cat @ m.W_o.weight.T + m.W_o.bias
        np.testing.assert_allclose(seen[1 + h], out, rtol=1e-5, atol=1e-5)
        assert per_head[h] == pytest.approx(float(np.sum(out ** 2)), rel=1e-4)
    assert base == pytest.approx(float(np.sum(tr.output ** 2)))
    for k, v in m.state_dict().items():                 # restored
        np.testing.assert_array_equal(v, before[k])


def test_ablate_restores_when_loss_raises():
    m = mha_ext.MultiHeadAttention(8, 2, seed=2)
    before = m.W_o.weight.copy()
    calls = []

    def loss():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return 0.0

    with pytest.raises(RuntimeError, match="boom"):
        ablate(m, loss)
    np.testing.assert_array_equal(m.W_o.weight, before)


def test_ablate_torch_module():
    torch = need("torch")
    from mha_ext.torch import MultiHeadAttention
    m = MultiHeadAttention(8, 2, seed=0)
    x = torch.randn(1, 3, 8)
    before = m.W_o.weight.detach().clone()
    base, per_head = ablate(m, lambda: float(m(x)[0].detach().pow(2).sum()))
    assert per_head.shape == (2,) and not np.allclose(per_head, base)
    assert torch.equal(m.W_o.weight.detach(), before)


@pytest.mark.parametrize("kind", ["nn.MultiheadAttention", "drop-in"])
def test_ablate_and_analyze_take_torchs_attention_modules(kind):
    """torch's nn.MultiheadAttention and the drop-in (num_heads, out_proj):
    switching head h off is the call with a head mask of 0 at h (the NumPy
    copy's head_mask, an independent path), the module restored after."""
    torch = need("torch")
    import mha_ext.torch as mt
    cls = torch.nn.MultiheadAttention if kind == "nn.MultiheadAttention" else mt.MultiheadAttention
    torch.manual_seed(0)
    m = cls(16, 4, batch_first=True, dtype=torch.float64).eval()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    before = m.out_proj.weight.detach().clone()

    def loss():
        with torch.no_grad():
            return float(m(x, x, x, need_weights=False)[0].pow(2).sum())
    base, per_head = ablate(m, loss)
    copy = mha_ext.MultiHeadAttention.from_torch(m)
    want = [float((copy(x.numpy(), head_mask=np.where(np.arange(4) == h, 0.0, 1.0))[0] ** 2)
                  .sum()) for h in range(4)]
    np.testing.assert_allclose(per_head, want, rtol=1e-12)
    assert base == pytest.approx(float((copy(x.numpy())[0] ** 2).sum()), rel=1e-12)
    assert torch.equal(m.out_proj.weight.detach(), before)
    with torch.no_grad():
        w = m(x, x, x, average_attn_weights=False)[1].numpy()
    report = analyze(w, module=m, loss=loss)
    np.testing.assert_allclose(report.values["loss_delta"], np.array(want) - base, rtol=1e-9)
    with pytest.raises(ValueError, match="the weights have 2 heads but the module has 4"):
        analyze(w[:, :2], module=m, loss=loss)
    # a parametrized out_proj.weight is computed at each call: zeroing the
    # computed one would switch nothing off
    torch.nn.utils.parametrizations.weight_norm(m.out_proj)
    with pytest.raises(TypeError, match="out_proj.weight is parametrized"):
        ablate(m, loss)


def test_report_text_html_plot():
    S = 5
    w = np.stack([_shift(S, -1), _shift(S, 0)[:, ::-1]])[None]
    rep = analyze(w)
    assert isinstance(rep, HeadReport) and rep.n_heads == 2
    assert rep.roles() == ["previous", "mirror"]
    assert rep.top("mirror") == 1 and rep.top("previous") == 0
    text = str(rep)
    assert "head" in text and "entropy" in text and "looks at" in text
    assert text.splitlines()[3].split()[0] == "0" and "previous" in text.splitlines()[3]
    page = rep._repr_html_()
    assert page.count("<tr>") == 3 and "mirror" in page
    assert [r["head"] for r in rep.rows()] == [0, 1]
    need("matplotlib")
    fig = rep.plot()
    assert len([a for a in fig.axes if a.get_visible()]) == len(rep.columns)


def test_trace_positions_rows_and_factors():
    # a cached call's query i sits at key position L + i; rows that are all 0
    # (masked_rows="zero") are left out as the NaN rows are; dropout and a
    # head mask are factors on the weights, not the pattern: a trace's
    # statistics read its softmax step then
    rng = np.random.default_rng(5)
    m = mha_ext.MultiHeadAttention(16, 2, seed=0).eval()
    x = rng.standard_normal((1, 6, 16)).astype(np.float32)
    q = rng.standard_normal((1, 2, 16)).astype(np.float32)
    cache = m.new_cache(1, 8)
    m(x, cache=cache)
    t = m.trace(q, cache=cache)
    assert t.info["query_position"] == 6
    w = np.asarray(t.weights, np.float64)[0]           # (H, 2, 8)
    got = head_stats(t)
    np.testing.assert_allclose(got["same"], w[:, [0, 1], [6, 7]].mean(-1), rtol=1e-12)
    np.testing.assert_allclose(got["previous"], w[:, [0, 1], [5, 6]].mean(-1), rtol=1e-12)
    np.testing.assert_allclose(got["mirror"], w[:, [0, 1], [1, 0]].mean(-1), rtol=1e-12)
    lr = m.trace(x[:, :4], x, x, is_causal="lower_right")
    assert lr.info["query_position"] == 2
    assert m.trace(x).info["query_position"] == 0
    blocked = np.zeros((6, 6), bool)
    blocked[1:] = True
    for stat in ("same", "entropy", "first"):
        np.testing.assert_allclose(head_stats(m.trace(x, mask=blocked, masked_rows="zero"))[stat],
                                   head_stats(m.trace(x, mask=blocked))[stat], rtol=1e-12)
    plain = head_stats(m.trace(x))
    for t2 in (m.trace(x, head_mask=[0.0, 3.0]),
               mha_ext.MultiHeadAttention(16, 2, dropout=0.8, seed=0).train().trace(x)):
        got = head_stats(t2)
        assert (got["entropy"] > 0).all() and (got["same"] <= 1).all()
        if "head mask" in t2:
            np.testing.assert_allclose(got["entropy"], plain["entropy"], rtol=1e-6)


def test_errors():
    m = mha_ext.MultiHeadAttention(8, 2, seed=0)
    w = np.full((1, 2, 3, 3), 1 / 3)
    with pytest.raises(ValueError, match="give both module and loss"):
        analyze(w, module=m)
    with pytest.raises(ValueError, match="the weights have 3 heads but the module has 2"):
        analyze(np.full((3, 3, 3), 1 / 3), module=m, loss=lambda: 0.0)
    with pytest.raises(TypeError, match="loss must be a callable"):
        ablate(m, 3.0)
    # a loss returning no number: said so (was float()'s own words), W_o as it was
    w_o = m.W_o.weight.copy()
    x = np.ones((1, 3, 8), np.float32)
    for bad in (lambda: None, lambda: "high", lambda: m(x)[0], lambda: "1.5",
                lambda: np.complex128(1 + 2j)):
        with pytest.raises(TypeError, match="loss\\(\\) must return a real number"):
            ablate(m, bad)
    assert np.array_equal(m.W_o.weight, w_o)
    assert ablate(m, lambda: np.array(2.5))[0] == 2.5
    # a loss written to take the output is refused before any head is switched
    # off (API.md §6: loss takes no arguments, it runs the model itself)
    before = m.W_o.weight.copy()
    for bad in (lambda out: 0.0, lambda *, out: 0.0):
        with pytest.raises(TypeError, match="no arguments.*runs the model itself"):
            analyze(w, module=m, loss=bad)
    assert np.array_equal(m.W_o.weight, before)
    analyze(w, module=m, loss=lambda out=None: 0.0)  # optional arguments are fine
    with pytest.raises(TypeError, match="module must be an attention module"):
        ablate(object(), lambda: 0.0)
    with pytest.raises(ValueError, match=r"\(B, H, Sq, Sk\) or \(H, Sq, Sk\)"):
        head_stats(np.ones((3, 3)))
    with pytest.raises(KeyError, match="no column 'nope'"):
        analyze(w).top("nope")


def test_trained_example_heads_specialise():
    """examples/heads_model.py: trained, a previous-token head, a mirror head
    and a first-token head appear, and switching each off breaks its question."""
    spec = importlib.util.spec_from_file_location("heads_model", EXAMPLE)
    hm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hm)
    model = hm.train(steps=300, seed=0)
    x = np.random.default_rng(123).integers(0, model.V, (256, model.L))
    assert model.losses[-1] < 0.05 < 2.0 < model.losses[0]
    assert min(model.accuracy(x).values()) > 0.95
    _, w = model.attn(model.embed(x))
    rep = analyze(w, module=model.attn, loss=lambda: model.loss(x))
    heads = {q: rep.top(q) for q in ("previous", "mirror", "first")}
    assert len(set(heads.values())) == 3, (heads, str(rep))
    for q, h in heads.items():
        assert rep.values[q][h] > 0.8, (q, str(rep))
    # the previous-token and first-token questions each rest on one head
    for k, q in enumerate(hm.QUESTIONS):
        _, off = ablate(model.attn, lambda: 1 - model.accuracy(x)[q])
        assert int(off.argmax()) == heads[q], (q, off, str(rep))
        assert off.max() > 0.1
    assert rep.values["loss_delta"][heads["first"]] > 0.5
    assert rep.values["loss_delta"][heads["previous"]] > 0.5


def test_example_script_runs():
    import os
    import subprocess
    import sys
    from _support import PKG_ROOT
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([PKG_ROOT, os.environ.get("PYTHONPATH", "")]))
    try:
        r = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "150"], capture_output=True,
                           text=True, timeout=120, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("examples/heads_model.py did not finish within 120 s")
    assert r.returncode == 0, r.stderr
    assert "accuracy:" in r.stdout and "loss_delta" in r.stdout and "looks at" in r.stdout
    for role in ("previous", "mirror", "first"):
        assert role in r.stdout.split("looks at", 1)[1]


def test_a_trace_of_averaged_weights_is_refused():
    m = mha_ext.MultiHeadAttention(16, 4, seed=0).eval()
    t = m.trace(np.ones((3, 5, 16)), average_weights=True)     # weights (3, 5, 5)
    with pytest.raises(ValueError, match="averaged over heads"):
        analyze(t)


class _Interrupt(BaseException):
    """What a signal handler raises (as KeyboardInterrupt), at a chosen step."""


def test_ablate_restores_w_o_whichever_step_an_interrupt_stops(monkeypatch):
    # a Ctrl-C as the block that zeroed a head's columns ended (before the
    # try that puts them back) left the head off for good: every later call
    # silently wrong.  Each editing block's exit raises once, in turn
    import mha_ext.heads as heads_mod
    m = mha_ext.MultiHeadAttention(16, 4, seed=0).eval()
    x = np.random.default_rng(0).standard_normal((1, 3, 16)).astype(np.float32)
    w0 = np.array(m.W_o.weight)
    real = heads_mod._editing
    raised = 0
    for k in range(1, 13):
        exits = [0]

        class Editing:
            def __init__(self, module):
                self.cm = real(module)

            def __enter__(self):
                return self.cm.__enter__()

            def __exit__(self, *exc):
                out = self.cm.__exit__(*exc)
                exits[0] += 1
                if exits[0] == k:
                    raise _Interrupt(f"exit #{k}")
                return out
        monkeypatch.setattr(heads_mod, "_editing", Editing)
        try:
            ablate(m, lambda: float(m(x, need_weights=False)[0].sum()))
        except _Interrupt:
            raised += 1
        np.testing.assert_array_equal(np.array(m.W_o.weight), w0, err_msg=f"exit #{k}")
    assert raised >= 8


@pytest.mark.parametrize("raises", [RuntimeError, TypeError])
def test_a_loss_value_that_cannot_say_what_it_is_is_refused_as_not_a_number(raises):
    """What asks about the loss's value (a tensor's is_complex) raising is
    the refusal's TypeError too, W_o put back."""
    class Odd:
        def is_complex(self):
            raise raises("is_complex failed")

        def __float__(self):
            return 1.0
    m = mha_ext.MultiHeadAttention(8, 2, seed=0)
    before = m.state_dict()["W_o.weight"].copy()
    with pytest.raises(TypeError, match="loss\\(\\) must return a real number"):
        ablate(m, lambda: Odd())
    np.testing.assert_array_equal(m.state_dict()["W_o.weight"], before)
