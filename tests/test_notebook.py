"""examples/tour.ipynb executes from top to bottom (nbclient), so it never rots."""

import json
import os
import re
from pathlib import Path

import pytest

from _support import PKG_ROOT, has, need, required

NOTEBOOK = Path(__file__).resolve().parent.parent / "examples" / "tour.ipynb"


def test_notebook_is_clean():
    nbformat = need("nbformat")
    nb = nbformat.read(str(NOTEBOOK), as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert 4 <= len(code) <= 12
    for c in code:                          # stored without outputs
        assert c.outputs == [] and c.execution_count is None
    # every cell has its own id, in the file itself: nbformat.read fills in
    # a missing one with a warning that future nbformat versions make an
    # error (nbformat 4.5 requires ids)
    raw = json.loads(NOTEBOOK.read_text())
    assert (raw["nbformat"], raw["nbformat_minor"]) >= (4, 5)
    ids = [c.get("id") for c in raw["cells"]]
    assert None not in ids, [i for i, x in enumerate(ids) if x is None]
    assert len(set(ids)) == len(ids), ids


def test_notebook_executes(tmp_path, monkeypatch):
    nbformat = need("nbformat")
    nbclient = need("nbclient")
    need("ipykernel")
    need("matplotlib")
    torch_here = has("torch")
    if not torch_here and required("torch"):
        pytest.fail("torch is required in CI: the notebook compares with it")

    # the kernel finds the package the tests import (source tree or installed)
    # and examples/heads_model.py (beside the notebook, as when opened there)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [PKG_ROOT, str(NOTEBOOK.parent), os.environ.get("PYTHONPATH", "")]))
    nb = nbformat.read(str(NOTEBOOK), as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}})
    client.execute()                        # raises CellExecutionError

    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs
                   if o.output_type == "stream")
    html = "".join(o.get("data", {}).get("text/html", "") for o in outputs)
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert "<table" in html and "masked scores" in html   # the trace's HTML
    assert "shape flow" in text                           # print(trace)
    assert images, "the head heatmaps were not displayed"
    # the trained model: the explorer, the head table, and the heads it finds
    assert 'class="mha-explorer"' in html and "mhaExplorer(root, data)" in html
    assert "loss_delta" in text and "looks at" in text
    for question in ("previous", "mirror", "first"):
        assert re.search(question + r" +error with head 0\.\.3 off: .* -> needs head \d", text)
    assert len(images) >= 2, "the head analysis plot was not displayed"
    # issue 14: switching heads off with head_mask finds a head each question needs
    for question in ("previous", "mirror", "first"):
        assert re.search(r"head_mask: " + question + r" needs head\(s\) \[\d", text), question
    assert "only one head on:" in text
    # issue 14: block-sparse layouts in the trace (its formula) and the plot
    assert "BlockLayout(shape=(5, 5)" in text and "not kept (layout 5×5" in text
    assert len(images) >= 3, "the block-sparse heatmaps were not displayed"
    if torch_here:
        # issue 14: train_copy's heads switched off, and their head-mask gradient
        assert re.search(r"train_copy: reverse needs head\(s\) \[", text)
        assert re.search(r"head 3 off: accuracy [01]\.\d+ +only head 3 on: [01]\.\d+", text)
        assert "head importance |dL/d head_mask|" in text
        assert "largest difference from torch" in text
    else:
        assert "torch is not installed" in text
    # issue 15: generation with a key/value cache, the cache growing
    assert "decode 1 token:   cache.length 11, keys (2, 2, 11, 8)" in text
    assert "generated [[2, 7, 5, 2, 7, 5, 2, 7], [1, 4, 1, 1, 4, 1, 1, 4]]" in text
    assert "K cache: [11 cached | 1 new] → length 12" in text
    assert list(tmp_path.iterdir()) == []   # the notebook writes no files


def test_plot_heads_shows_a_picture_without_the_inline_backend(tmp_path, monkeypatch):
    """A notebook that never ran %matplotlib inline nor imported pyplot:
    plot_heads' figure as the cell's last expression is a picture, not only
    its text "<Figure size ... with 3 Axes>"."""
    nbformat = need("nbformat")
    nbclient = need("nbclient")
    need("ipykernel")
    need("matplotlib")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [PKG_ROOT, os.environ.get("PYTHONPATH", "")]))
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(
        "import sys, numpy as np, mha_ext\n"
        "m = mha_ext.MultiHeadAttention(16, 2, seed=0).eval()\n"
        "print('pyplot' in str(list(sys.modules)))\n"
        "mha_ext.plot_heads(m.trace(np.ones((1, 4, 16)), is_causal=True))")]
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outs = nb.cells[0].outputs
    assert [o.get("text") for o in outs if o.output_type == "stream"] == ["False\n"]
    shown = [o for o in outs if o.output_type == "execute_result"]
    assert len(shown) == 1 and "image/png" in shown[0]["data"], shown
    import base64
    assert base64.b64decode(shown[0]["data"]["image/png"])[:8] == b"\x89PNG\r\n\x1a\n"
