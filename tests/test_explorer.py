"""mha_ext.explorer: what the page embeds and what it refuses (the page itself
runs in tests/test_browser.py)."""
import json
import re

import numpy as np
import pytest

import mha_ext
from mha_ext.explorer import MAX_VALUES, Explorer, explore

from _support import need


def _data(page):
    m = re.search(r'<script type="application/json" class="mha-data">(.*?)</script>', page, re.S)
    assert m, "no embedded data"
    return json.loads(m.group(1))


def _values(layer, shape):
    return np.array([np.nan if v is None else v for v in layer["values"]]).reshape(shape)


def _trace(training=False, **kw):
    m = mha_ext.MultiHeadAttention(16, 2, dropout=0.5 if training else 0.0, seed=3)
    m.train(training)
    x = np.random.default_rng(4).standard_normal((2, 5, 16))
    return m.trace(x, **kw)


def test_trace_layers_values_and_blocked_cells():
    tr = _trace(is_causal=True)
    tokens = ["a", "b", "c", "d", "e"]
    ex = explore(tr, tokens=tokens)
    assert isinstance(ex, Explorer)
    assert ex.layers == ["raw scores", "masked scores", "softmax"]
    assert ex.shape == (2, 2, 5, 5)
    d = _data(ex._repr_html_())
    assert (d["B"], d["H"], d["Sq"], d["Sk"]) == (2, 2, 5, 5)
    assert d["qTokens"] == tokens and d["kTokens"] == tokens and d["layer"] == "softmax"
    blocked = np.array(d["blocked"]).reshape(2, 2, 5, 5).astype(bool)
    np.testing.assert_array_equal(blocked, np.isneginf(tr["masked scores"].array))
    assert blocked[0, 0, 0, 1] and not blocked[0, 0, 1, 0]
    for layer in d["layers"]:
        v = _values(layer, (2, 2, 5, 5))
        want = tr[layer["name"]].array
        fin = np.isfinite(want)
        np.testing.assert_allclose(v[fin], want[fin], rtol=1e-3, atol=1e-6)
        # -inf (blocked) travels as -1e999, which JSON parsers read as -inf
        np.testing.assert_array_equal(v[~fin], want[~fin])
    soft = _values(d["layers"][2], (2, 2, 5, 5))
    np.testing.assert_allclose(np.nansum(soft, -1), 1, atol=2e-3)


def test_dropout_layer_and_unbatched():
    ex = explore(_trace(training=True))
    assert ex.layers[-1] == "dropout"
    m = mha_ext.MultiHeadAttention(16, 4, seed=0).eval()
    tr = m.trace(np.ones((3, 16)))
    ex = explore(tr, layer="raw scores", head=3)
    d = _data(ex.to_html())
    assert ex.shape == (1, 4, 3, 3) and d["layer"] == "raw scores"
    assert d["head"] == 3 and d["allHeads"] is False


def test_weights_array_torch_and_blocked():
    w = np.random.default_rng(0).random((3, 4, 4))
    d = _data(explore(w).to_html())
    assert d["blocked"] is None and [l["name"] for l in d["layers"]] == ["weights"]
    assert d["qTokens"] == ["0", "1", "2", "3"]
    causal = np.triu(np.ones((4, 4)), 1)
    d = _data(explore(w, blocked=causal, query_tokens=list("wxyz"), key_tokens=list("WXYZ")).to_html())
    assert np.array(d["blocked"]).reshape(1, 3, 4, 4)[0, 2].tolist() == causal.tolist()
    assert d["qTokens"] == list("wxyz") and d["kTokens"] == list("WXYZ")
    torch = need("torch")
    d2 = _data(explore(torch.tensor(w)).to_html())
    assert d2["layers"][0]["values"][:3] == [float("%.4g" % v) for v in w.ravel()[:3]]


def test_tokens_cannot_break_out_of_the_page():
    evil = ["</script><script>alert(1)</script>", "<!--", "&amp;", "\"'", "é", "x"]
    page = explore(np.full((1, 6, 6), 1 / 6), tokens=evil).to_html(full_page=True)
    assert page.count("</script>") == 2 and "<!--" not in page     # data + code only
    assert _data(page)["qTokens"] == evil


def test_offline_page():
    page = explore(np.full((1, 2, 3, 3), 1 / 3)).to_html(full_page=True)
    assert "Content-Security-Policy" in page and "default-src 'none'" in page
    # nothing that could load anything
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", page, re.I)
    assert "@import" not in page and "url(http" not in page
    assert page.startswith("<!DOCTYPE html>")
    fragment = explore(np.full((1, 2, 3, 3), 1 / 3))._repr_html_()
    assert fragment.startswith('<div class="mha-explorer"') and "mha-nojs" in fragment


def test_save(tmp_path):
    ex = explore(_trace(), tokens=list("abcde"))
    path = ex.save(tmp_path / "attention.html")
    text = open(path, encoding="utf-8").read()
    assert text.startswith("<!DOCTYPE html>") and "mhaExplorer" in text
    assert _data(text)["kTokens"] == list("abcde")


def test_each_output_has_its_own_id():
    ex = explore(np.ones((1, 1, 1)))
    ids = re.findall(r'id="(mha-explorer-[^"]+)"', ex._repr_html_() + ex._repr_html_())
    assert len(ids) == 2 and ids[0] != ids[1]


@pytest.mark.parametrize("args, kwargs, exc, words", [
    ((np.ones((2, 2)),), {}, ValueError, "(B, H, Sq, Sk) or (H, Sq, Sk)"),
    ((np.array([["a"]]),), {}, TypeError, "real numbers"),
    ((np.ones((1, 2, 3)),), {"tokens": ["a"]}, ValueError, "tokens has 1 labels"),
    ((np.ones((1, 2, 3)),), {"tokens": "ab"}, TypeError, "split"),
    ((np.ones((1, 2, 3)),), {"key_tokens": list("ab")}, ValueError, "key_tokens has 2"),
    ((np.ones((1, 2, 3)),), {"head": 1}, ValueError, "head 1 is out of range for 1"),
    ((np.ones((1, 2, 3)),), {"head": "1"}, TypeError, "head must be"),
    ((np.ones((1, 2, 3)),), {"layer": "softmax"}, ValueError, "layer must be one of"),
    ((np.ones((1, 2, 3)),), {"blocked": np.ones(4)}, ValueError, "blocked must broadcast"),
    ((np.ones((1, 2, 3)),), {"blocked": "abc"}, TypeError, "blocked must be a BlockLayout"),
    ((np.ones((1, 2, 3)),), {"blocked": [[None]]}, TypeError, "blocked must be a BlockLayout"),
    ((np.ones((1, 2, 3)),), {"tokens": list("abc")}, ValueError, "labels but the weights "
                                                                 "have 2 queries"),
    ((np.ones((0, 2, 3)),), {}, ValueError, "no heads"),
    ((np.ones((2, 8, 100, 100)),), {"max_values": 10_000}, ValueError, "max_values=10000"),
    ((np.ones((2, 8, 100, 100)),), {"max_values": 10_000}, ValueError, "max_values=None"),
    ((np.ones((1, 2, 3)),), {"max_values": 1.5}, TypeError, "max_values must be an int or None"),
])
def test_errors(args, kwargs, exc, words):
    with pytest.raises(exc) as e:
        explore(*args, **kwargs)
    assert words in str(e.value)


def test_no_limit_and_generator_tokens():
    # max_values=None embeds everything; tokens from a generator label both
    # axes (it was used up by the query labels: "tokens has 0 labels")
    page = explore(np.full((1, 1, 120, 120), 1 / 120), max_values=None,
                   tokens=("w%d" % i for i in range(120))).to_html()
    assert "w119" in page
    with pytest.raises(ValueError, match="would embed 14400 values .* each of 1 layer\\)"):
        explore(np.full((1, 1, 120, 120), 1 / 120), max_values=14_399)


def test_the_limits_message_counts_what_it_embeds():
    # a trace: 3 layers (raw, masked scores, softmax) and its blocked
    # cells, 4 arrays of B*H*Sq*Sk (it said "x 4 layers": the page has 3)
    tr = _trace()
    n = int(np.prod(tr["softmax"].shape))
    with pytest.raises(ValueError, match="would embed %d values .* each of 3 layers and the "
                                         "blocked cells\\)" % (4 * n)):
        explore(tr, max_values=10)


def test_blocked_is_for_weights_only():
    with pytest.raises(ValueError, match="a trace knows its masks"):
        explore(_trace(), blocked=np.zeros((5, 5)))
    assert MAX_VALUES >= 1_000_000


def test_missing_assets_are_a_clear_error(monkeypatch, tmp_path):
    import mha_ext.explorer as ex_mod
    monkeypatch.setattr(ex_mod, "_HERE", tmp_path)
    with pytest.raises(RuntimeError, match="explorer.css is missing from this installation"):
        explore(np.ones((1, 1, 1)))._repr_html_()


def test_blocked_may_be_a_block_layout():
    from mha_ext.layout import local_blocks
    w = np.random.default_rng(0).random((2, 8, 8))
    lay = local_blocks(8, 8, 4, width=0)            # 2 of 4 blocks kept
    d = _data(explore(w, blocked=lay).to_html())
    blocked = np.array(d["blocked"]).reshape(1, 2, 8, 8)
    assert blocked.sum() == 2 * 32
    assert (blocked[0, 0] == ~lay.to_dense(8, 8)).all()


def test_blocked_cells_come_from_the_masks_and_infinities_travel():
    """A scale of +inf makes finite cells -inf: the page still hatches only
    what the masks blocked, and carries ±inf (JSON has none) as ±1e999."""
    tr = _trace(is_causal=True, scale=float("inf"))
    causal = np.triu(np.ones((5, 5), dtype=bool), 1)
    masked = tr["masked scores"].array
    assert np.isneginf(masked[..., ~causal]).any()      # -inf the scale made
    d = _data(explore(tr).to_html())
    blocked = np.array(d["blocked"]).reshape(2, 2, 5, 5).astype(bool)
    np.testing.assert_array_equal(blocked, np.broadcast_to(causal, (2, 2, 5, 5)))
    for layer in d["layers"][:2]:
        np.testing.assert_array_equal(_values(layer, (2, 2, 5, 5)),
                                      tr[layer["name"]].array)
    assert "1e999" in explore(tr).to_html()
    # the largest finite doubles stay finite (4 digits would round them past it)
    from mha_ext.explorer import _encode
    big = np.array([1.7976931348623157e308, -1.79e308, 1.5e308])
    np.testing.assert_array_equal(json.loads(_encode(big)), big[:2].tolist() + [1.5e308])


@pytest.mark.parametrize("shape, words", [
    ((0, 5, 16), "no batch items"), ((2, 0, 16), "no queries")])
def test_nothing_to_explore_is_a_clear_error(shape, words):
    m = mha_ext.MultiHeadAttention(16, 2, seed=0).eval()
    tr = m.trace(np.zeros(shape))
    with pytest.raises(ValueError, match="nothing to explore: " + words):
        explore(tr)
    with pytest.raises(ValueError, match="nothing to explore: no keys"):
        explore(np.zeros((1, 2, 3, 0)))
