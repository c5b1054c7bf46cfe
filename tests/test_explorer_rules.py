"""mha_ext.explore rules tests/test_explorer.py leaves open: the page's
<title> is escaped, each trace layer says whether it is the masked one,
a bool head is refused, and the max_values bounds (a count equal to the
limit is taken; the default limit, MAX_VALUES, refuses one more).

Legend: B batch, H heads, Sq/Sk query/key length.
"""
import json

import numpy as np
import pytest

import mha_ext
from mha_ext.explorer import MAX_VALUES, explore


def _data(page):
    return json.loads(page.split('class="mha-data">')[1].split("</script>")[0])


def _weights(B=1, H=2, Sq=3, Sk=4, seed=0):
    w = np.random.default_rng(seed).random((B, H, Sq, Sk))
    return w / w.sum(-1, keepdims=True)


def test_the_page_title_is_escaped():
    title = "</title><script>alert(1)</script>"
    page = mha_ext.explore(_weights(), title=title).to_html(full_page=True)
    head = page.split("</head>")[0]
    assert "<script>alert(1)" not in head
    assert "<title>&lt;/title&gt;&lt;script&gt;alert(1)&lt;/script&gt;</title>" in head


def test_only_the_masked_scores_layer_is_marked_masked():
    m = mha_ext.MultiHeadAttention(16, 2, seed=3).eval()
    tr = m.trace(np.random.default_rng(4).standard_normal((1, 4, 16)), is_causal=True)
    layers = {layer["name"]: layer for layer in _data(explore(tr).to_html())["layers"]}
    assert layers["masked scores"]["masked"] is True
    assert layers["raw scores"]["masked"] is False
    assert layers["softmax"]["masked"] is False
    assert layers["softmax"]["probability"] is True
    assert layers["raw scores"]["probability"] is False


@pytest.mark.parametrize("head", [True, False, np.True_])
def test_a_bool_head_is_refused(head):
    with pytest.raises(TypeError, match='head must be "all" or an int'):
        explore(_weights(), head=head)


def test_max_values_equal_to_the_count_is_taken():
    w = _weights()
    ex = explore(w, max_values=w.size)            # one layer, no blocked cells
    assert ex.shape == w.shape
    with pytest.raises(ValueError, match="would embed %d values" % w.size):
        explore(w, max_values=w.size - 1)


def test_the_default_limit_is_max_values():
    assert MAX_VALUES == 2_000_000
    side = int(np.ceil(np.sqrt(MAX_VALUES)))     # side**2 just above the limit
    assert (side - 1) ** 2 <= MAX_VALUES < side ** 2
    with pytest.raises(ValueError, match="would embed %d values" % side ** 2):
        explore(np.zeros((1, 1, side, side), dtype=np.float32))
    assert explore(np.zeros((1, 1, side - 1, side - 1), dtype=np.float32)).shape == \
        (1, 1, side - 1, side - 1)
