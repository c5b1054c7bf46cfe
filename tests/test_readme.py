"""Every ```python block of the README runs as written, in order, in one
namespace (issue 13, point 6), in a temporary directory (the plot block
writes heads.png).  A block that imports torch or plots needs torch or
matplotlib: a skip on a developer machine without them, a failure in CI.

docs/API.md's ```python blocks: a signature (a `def` under a comment naming
its owner) is the code's, parameter for parameter; the others run."""
import inspect
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest

from _support import need

README = Path(__file__).resolve().parent.parent / "README.md"
API = README.parent / "docs" / "API.md"


def python_blocks(text):
    """(first line number, code) of each ```python block, fences indented
    or not."""
    blocks = []
    for m in re.finditer(r"^([ \t]*)```python[ \t]*\n(.*?)^\1```[ \t]*$", text, re.M | re.S):
        line = text.count("\n", 0, m.start()) + 2
        blocks.append((line, textwrap.dedent(m.group(2))))
    return blocks


def test_python_blocks_are_found():
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 5
    assert len(blocks) == README.read_text().count("```python")


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    namespace = {"__name__": "__readme__"}
    for line, code in python_blocks(README.read_text()):
        if re.search(r"^\s*(import torch|from torch|from mha_ext.torch)", code, re.M):
            need("torch")
        if re.search(r"^\s*import transformers", code, re.M):
            need("transformers")
        if "plot_heads" in code:
            need("matplotlib")
        try:
            exec(compile(code, f"README.md, block at line {line}", "exec"), namespace)
        except Exception as exc:
            pytest.fail(f"README.md block at line {line} raised {exc!r}:\n{code}")
    assert (tmp_path / "heads.png").stat().st_size > 0


def _parameters(sig):
    """(name, kind, default) of each parameter but self and a catch-all
    **keywords (which refuses every keyword it gets)."""
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()
            if p.name != "self" and p.kind is not p.VAR_KEYWORD]


def test_api_md_signatures_are_the_codes():
    import mha_ext
    signatures = 0
    namespace = {"np": np, "mha_ext": mha_ext}
    setup = ("mha = mha_ext.MultiHeadAttention(16, 2, seed=0).eval()\n"
             "batch_size, max_len = 2, 8\n"
             "prompt = np.ones((2, 3, 16), np.float32)\n"
             "next_token, query = prompt[:, :1], prompt[:, :2]\n"
             "memory = np.zeros((2, 5, 16), np.float32)\n")
    exec(setup, namespace)
    for line, code in python_blocks(API.read_text()):
        where = f"docs/API.md, block at line {line}"
        owner = re.match(r"# (mha_ext[\w.]*)", code)
        if not owner:       # an example: it runs
            exec(compile(code, where, "exec"), namespace)
            continue
        documented = {}
        exec(compile(code, where, "exec"), documented)
        (name, fn), = [(k, v) for k, v in documented.items() if inspect.isfunction(v)]
        obj = mha_ext
        for part in owner.group(1).split(".")[1:]:
            obj = getattr(obj, part)
        real = inspect.signature(obj if name == "__init__" else getattr(obj, name))
        assert _parameters(inspect.signature(fn)) == _parameters(real), where
        signatures += 1
    assert signatures == 3
