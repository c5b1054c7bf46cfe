"""What a new user notices first (issue 13, points 6 and 7): the demo's
help and torch hint, help() on the class, the dtype of the result for other
input dtypes, and dotted names in the docstrings that resolve."""
import importlib
import inspect
import os
import pydoc
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import mha_ext

PKG_DIR = Path(mha_ext.__file__).resolve().parent


# ------------------------------------------------------------------ the demo

def test_demo_help_has_no_empty_defaults():
    from mha_ext.__main__ import _parser
    text = _parser().format_help()
    assert "(default: None)" not in text and "(default: False)" not in text, text
    assert "MHA_EXT_NUM_THREADS" in text          # what --threads defaults to
    assert "(default: 512)" in text                # real defaults still shown


def test_demo_torch_hint_is_pinned_and_cpu_only(capsys, monkeypatch):
    """Without torch the demo says which torch to install: the pinned
    version the tests use, from PyTorch's CPU index (not an unpinned
    `pip install torch`, which pulls the CUDA build)."""
    from mha_ext import __main__ as demo
    monkeypatch.setitem(sys.modules, "torch", None)       # import torch fails
    assert demo.main(["--seq", "3", "--d-model", "16", "--heads", "2"]) == 0
    out = capsys.readouterr().out
    hint = [line for line in out.splitlines() if "pip install" in line]
    assert hint, out
    assert "torch==2.13.0" in hint[0] and "--index-url" in hint[0] and "/whl/cpu" in hint[0]


# ------------------------------------------------------------------ help()

def test_signature_of_the_class():
    sig = inspect.signature(mha_ext.MultiHeadAttention)
    assert list(sig.parameters) == ["d_model", "n_heads", "dropout", "bias", "kdim",
                                    "vdim", "dtype", "seed", "add_bias_kv", "add_zero_attn",
                                    "n_kv_heads"]
    kinds = {n: p.kind for n, p in sig.parameters.items()}
    assert kinds["dropout"] == inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert kinds["bias"] == inspect.Parameter.KEYWORD_ONLY


def test_help_shows_no_generic_initialize_self():
    text = pydoc.render_doc(mha_ext.MultiHeadAttention, renderer=pydoc.plaintext)
    assert "MultiHeadAttention(d_model" in text
    assert "Initialize self" not in text, text[:3000]


def test_help_of_the_c_type_shows_its_signature():
    from mha_ext import _core
    sig = inspect.signature(_core.MultiHeadAttention)
    assert list(sig.parameters)[:3] == ["d_model", "n_heads", "dropout"]
    text = pydoc.render_doc(_core.MultiHeadAttention, renderer=pydoc.plaintext)
    # Python 3.13's pydoc puts a long signature one parameter per line
    assert "MultiHeadAttention(d_model,n_heads" in "".join(text.split()) \
        .replace("|", ""), text[:800]


# ------------------------------------------------------------------ threads
# MHA_EXT_NUM_THREADS: tests/test_num_threads_env.py

# ------------------------------------------------------------------ dtypes

@pytest.mark.parametrize("module_dtype", ["float32", "float64"])
@pytest.mark.parametrize("input_dtype", ["float16", "int64", "float32", "float64"])
def test_inputs_are_converted_to_the_module_dtype(module_dtype, input_dtype):
    """README / docs/API.md: inputs of any real dtype are converted to the
    module's dtype and the results have the module's dtype (float16 in,
    float32 out for a float32 module)."""
    m = mha_ext.MultiHeadAttention(16, 2, dtype=module_dtype, seed=0)
    x = np.random.default_rng(0).integers(-3, 4, (2, 5, 16)).astype(input_dtype)
    out, w = m(x)
    assert out.dtype == np.dtype(module_dtype) and w.dtype == np.dtype(module_dtype)
    ref_out, ref_w = m(x.astype(module_dtype))
    np.testing.assert_array_equal(out, ref_out)
    np.testing.assert_array_equal(w, ref_w)


# ------------------------------------------------------------------ docstrings

def _dotted_names():
    names = set()
    for path in sorted(PKG_DIR.glob("*.py")) + sorted(PKG_DIR.glob("*.pyi")):
        for name in re.findall(r"\bmha_ext(?:\.[A-Za-z_]\w*)+", path.read_text()):
            names.add((name.rstrip("."), path.name))
    return sorted(names)


# dotted names in another helper's file, fixed at merge
PENDING: dict = {}


def _resolves(name):
    """As a reader finds it: `import a.b.c` (as far as that imports), then
    the attributes from the top."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            importlib.import_module(".".join(parts[:i]))
            break
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.split(".")[0] != "mha_ext":
                return True     # needs an optional dependency (torch) not installed here
        except ImportError:
            continue
    obj = importlib.import_module(parts[0])
    for part in parts[1:]:
        try:
            if not hasattr(obj, part):
                return False
        except ModuleNotFoundError as exc:  # a lazy attribute (mha_ext.compare) needs torch
            if exc.name and exc.name.split(".")[0] != "mha_ext":
                return True
            raise
        obj = getattr(obj, part)
    return True


def test_dotted_names_in_docstrings_resolve():
    """`mha_ext.trace` is the function, so "mha_ext.trace.Trace" in a
    docstring is an AttributeError for a reader who tries it."""
    broken = {(n, f) for n, f in _dotted_names() if not _resolves(n)}
    assert broken - set(PENDING) == set(), sorted(broken - set(PENDING))
    assert set(PENDING) <= broken, ("fixed: remove from PENDING",
                                    sorted(set(PENDING) - broken))


# ------------------------------------------------------------- without torch

@pytest.mark.parametrize("code, who", [
    ("import mha_ext.torch", "mha_ext.torch"),
    ("import mha_ext.hf", "mha_ext.hf"),
    ("import mha_ext; mha_ext.compare", "mha_ext.compare"),
])
def test_the_parts_that_need_torch_say_which_torch_to_install(code, who):
    # torch not installed (None in sys.modules: its import fails as a missing
    # module's): the CPU-only pin, not a bare "No module named 'torch'"
    r = subprocess.run([sys.executable, "-c", "import sys; sys.modules['torch'] = None\n" + code],
                       cwd=str(PKG_DIR.parent), capture_output=True, text=True, timeout=300)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: %s" % who), r.stderr
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in last


def test_python_started_in_the_package_folder_says_torch_is_hidden():
    # there, mha_ext/torch.py is found as torch itself (a notebook opened in
    # the folder): an ImportError that says why, not torch's partial import
    r = subprocess.run([sys.executable, "-c", "import torch"], cwd=str(PKG_DIR),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1
    assert "torch is hidden by mha_ext's own torch.py" in r.stderr, r.stderr
    assert str(PKG_DIR) in r.stderr
