"""Every ```python block of the README runs as written, in order, in one
namespace (issue 13, point 6), in a temporary directory (the plot block
writes heads.png).  A block that imports torch or plots needs torch or
matplotlib: a skip on a developer machine without them, a failure in CI."""
import re
import textwrap
from pathlib import Path

import pytest

from _support import need

README = Path(__file__).resolve().parent.parent / "README.md"


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
        if "plot_heads" in code:
            need("matplotlib")
        try:
            exec(compile(code, f"README.md, block at line {line}", "exec"), namespace)
        except Exception as exc:
            pytest.fail(f"README.md block at line {line} raised {exc!r}:\n{code}")
    assert (tmp_path / "heads.png").stat().st_size > 0
