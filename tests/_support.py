"""Helpers shared by the test files: optional dependencies, which skip a
test on a developer machine but fail it in CI (the ``CI`` environment
variable set, whatever its value) unless MHA_EXT_TEST_WITHOUT names them
(a comma-separated list: CI's runs on the Pythons other than torch's set
MHA_EXT_TEST_WITHOUT=torch,nbformat,nbclient,ipykernel), and where the imported mha_ext lives (for
subprocesses and notebook kernels, installed or built in place)."""
import importlib
import os
from pathlib import Path

import pytest

import mha_ext
from mha_ext import _core

# the folder holding the mha_ext package the tests imported
PKG_ROOT = str(Path(mha_ext.__file__).resolve().parent.parent)

# the instruction sets whose kernels this CPU can run (conftest.py's `isa`
# fixture runs a test on each)
ISAS = [name for name in ("portable", "avx2", "avx512", "amx") if _core._isa_available(name)]


def required(name):
    """True when a missing `name` must fail the test rather than skip it:
    CI is set and MHA_EXT_TEST_WITHOUT does not name it."""
    without = os.environ.get("MHA_EXT_TEST_WITHOUT", "").replace(" ", "").split(",")
    return "CI" in os.environ and name not in without


def need(name):
    """Import and return an optional test dependency: a skip when it is
    missing on a developer machine, a failure when CI is set (see
    required())."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:  # pragma: no cover - depends on the machine
        if required(name):
            pytest.fail(f"{name} is required when CI is set, but: {exc}", pytrace=False)
        # module level too (a file that needs torch throughout skips whole)
        pytest.skip(f"{name} is not installed ({exc})", allow_module_level=True)


def has(name):
    """True when `name` imports."""
    try:
        importlib.import_module(name)
        return True
    except ImportError:
        return False


def require_torch():
    """torch (the reference of every parity test), as need() gives it."""
    return need("torch")


def torch_testing(module):
    """torch.testing._internal.<module> (torch's own test inputs: module_db,
    op_db).  torch's testing package imports ``expecttest``, a test-only
    dependency of torch that its wheel does not install; when it is missing
    a stand-in with its one used name (``TestCase``) is registered for that
    import only."""
    import sys
    import types
    import unittest
    try:
        importlib.import_module("expecttest")
        stub = None
    except ImportError:
        stub = types.ModuleType("expecttest")
        stub.TestCase = unittest.TestCase
        sys.modules["expecttest"] = stub
    try:
        return importlib.import_module("torch.testing._internal." + module)
    finally:
        if stub is not None and sys.modules.get("expecttest") is stub:
            del sys.modules["expecttest"]


def dead_row_outputs(ref, ours, x, *, grad=False, value=None, **kw):
    """torch's module or nn.TransformerEncoderLayer `ref` and its copy with
    our drop-in `ours` on `x` ((B, S, E), or (S, B, E) when not batch
    first), under a boolean mask whose query row 1 sees no key: (torch's
    output, ours), computed with grad mode `grad`."""
    torch = require_torch()
    layer = isinstance(ref, torch.nn.TransformerEncoderLayer)
    first = (ref.self_attn if layer else ref).batch_first
    n = x.shape[1] if first else x.shape[0]
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[1] = True                                  # row 1 sees no key
    with torch.set_grad_enabled(grad):
        if layer:
            return ref(x, src_mask=mask), ours(x, src_mask=mask)
        v = x if value is None else value
        return ref(x, x, v, attn_mask=mask, **kw)[0], ours(x, x, v, attn_mask=mask, **kw)[0]


def on_name_and_sdpa(model, fn, name):
    """(fn(model) with attention implementation `name`, fn(model) with
    "sdpa"): a Hugging Face model's one set of weights run both ways; the
    model is left on "sdpa"."""
    model.set_attn_implementation(name)
    try:
        ours = fn(model)
    finally:
        model.set_attn_implementation("sdpa")
    return ours, fn(model)
