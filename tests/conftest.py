"""Shared fixtures for the mha_ext test suite.

Shape legend (as everywhere in the project): B batch, Sq query length,
Sk key length, E = d_model, H = n_heads, Dk = E / H.

* ``isa``: runs a test once on each instruction set's kernels this CPU has
  (portable, avx2, avx512, amx), switched with ``_core._set_isa`` and restored.
* ``torch`` / ``require_torch()``: torch is the reference.  Without it the
  parity tests are skipped on a developer machine, but they *fail* when the
  ``CI`` environment variable is set, so CI can never pass by skipping them.
* ``seed_ref``: the tests' own torch module, written the way the seed
  notebook writes it (tests/torch_seed.py), paired with an mha_ext module
  holding the same weights.
* ``np_ref``: a float64 NumPy forward pass used where torch cannot be the
  oracle (dropout: the output must follow from exactly the returned weights).
* ``parity_record``: every parity comparison records its worst error; the
  terminal summary prints the worst float32 and float64 errors of the run.
"""

import math
import types

import numpy as np
import pytest

PARAM_NAMES = ("W_q", "W_k", "W_v", "W_o")
STATE_KEYS = tuple(f"{n}.{p}" for n in PARAM_NAMES for p in ("weight", "bias"))

# Tolerances of the contract (the issue): float32 vs torch float32 and
# float64 vs torch float64.
TOL = {
    "float32": dict(rtol=2e-5, atol=2e-5),
    "float64": dict(rtol=1e-10, atol=1e-10),
}


# --------------------------------------------------------------------------
# slow tests (a fresh venv and a build): in CI, or with MHA_EXT_SLOW_TESTS=1
# --------------------------------------------------------------------------

def pytest_collection_modifyitems(config, items):
    import os
    if "CI" in os.environ or os.environ.get("MHA_EXT_SLOW_TESTS"):
        return
    skip = pytest.mark.skip(reason="slow: runs in CI or with MHA_EXT_SLOW_TESTS=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


# --------------------------------------------------------------------------
# torch: skip locally, fail in CI
# --------------------------------------------------------------------------

from _support import require_torch  # noqa: E402  (skip locally, fail in CI)


@pytest.fixture(scope="session")
def torch():
    return require_torch()


# --------------------------------------------------------------------------
# isa: the test once per instruction set this CPU runs (_support.ISAS)
# --------------------------------------------------------------------------

from _support import ISAS  # noqa: E402


@pytest.fixture(params=ISAS)
def isa(request):
    from mha_ext import _core
    before = _core._get_isa()
    _core._set_isa(request.param)
    yield request.param
    _core._set_isa(before)


# --------------------------------------------------------------------------
# comparison helpers
# --------------------------------------------------------------------------

_PARITY = {}  # dtype name -> dict(abs=..., ratio=..., where=...)


def _record(dtype, where, actual, expected, rtol, atol):
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    finite = np.isfinite(expected) & np.isfinite(actual)
    if not finite.any():
        return
    diff = np.abs(actual[finite] - expected[finite])
    abs_err = float(diff.max())
    ratio = float((diff / (atol + rtol * np.abs(expected[finite]))).max())
    rec = _PARITY.setdefault(str(dtype), dict(abs=0.0, ratio=0.0, where=""))
    if abs_err > rec["abs"]:
        rec["abs"] = abs_err
        rec["where"] = where
    rec["ratio"] = max(rec["ratio"], ratio)


def assert_close(actual, expected, rtol, atol, what=""):
    """allclose with NaN positions compared exactly (np.isnan equality)."""
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    assert actual.shape == expected.shape, (
        f"{what}: shape {actual.shape} != expected {expected.shape}")
    nan_a, nan_e = np.isnan(actual), np.isnan(expected)
    assert np.array_equal(nan_a, nan_e), (
        f"{what}: NaN positions differ: {int(nan_a.sum())} NaN in ours, "
        f"{int(nan_e.sum())} in the reference; first mismatch at "
        f"{np.argwhere(nan_a != nan_e)[:1].tolist()}")
    ok = ~nan_e
    np.testing.assert_allclose(actual[ok], expected[ok], rtol=rtol, atol=atol,
                               err_msg=what)


@pytest.fixture(scope="session")
def parity_record():
    """record(dtype, where, actual, expected): note the worst error seen."""
    def record(dtype, where, actual, expected):
        tol = TOL[str(np.dtype(dtype))]
        _record(np.dtype(dtype), where, actual, expected, **tol)
    return record


def pytest_terminal_summary(terminalreporter):
    if not _PARITY:
        return
    terminalreporter.section("mha_ext parity vs torch (worst errors)")
    for name in sorted(_PARITY):
        rec = _PARITY[name]
        terminalreporter.write_line(
            f"{name}: max |ours - torch| = {rec['abs']:.3e} (at {rec['where']}); "
            f"max error / (atol + rtol*|ref|) = {rec['ratio']:.3f}")


# --------------------------------------------------------------------------
# the torch seed module paired with ours
# --------------------------------------------------------------------------

@pytest.fixture(scope="session")
def seed_ref(torch):
    """Namespace: pair(E, H, ...) -> (torch seed module, our module);
    run(ref, q, k, v, mask) -> NumPy (output, weights) from torch."""
    import torch_seed
    import mha_ext

    def pair(E, H, dtype="float32", seed=0, dropout=0.0):
        ref = torch_seed.make_seed_module(E, H, dropout=dropout, seed=seed,
                                          dtype=dtype)
        ours = mha_ext.MultiHeadAttention(E, H, dropout, dtype=dtype,
                                          seed=seed + 1000)
        ours.load_state_dict(
            {k: v.detach().numpy() for k, v in ref.state_dict().items()})
        ours.eval()
        return ref, ours

    def run(ref, q, k=None, v=None, mask=None):
        return torch_seed.run(ref, q, k, v, mask)

    return types.SimpleNamespace(pair=pair, run=run, module=torch_seed)


# --------------------------------------------------------------------------
# a float64 NumPy reference
# --------------------------------------------------------------------------

def _np_forward(state, H, query, key=None, value=None, mask=None,
                weights=None):
    """The forward pass in float64 NumPy from a state_dict-like mapping.

    Batched (B, S, E) inputs.  If ``weights`` (B, H, Sq, Sk) is given the
    softmax is skipped and exactly those weights are used (dropout check).
    Returns (output, weights) in float64.
    """
    key = query if key is None else key
    value = key if value is None else value
    p = {k: np.asarray(v, dtype=np.float64) for k, v in state.items()}

    def lin(x, name):
        y = np.asarray(x, dtype=np.float64) @ p[f"{name}.weight"].T
        b = p.get(f"{name}.bias")
        return y if b is None else y + b

    q = lin(query, "W_q")
    k = lin(key, "W_k")
    v = lin(value, "W_v")
    B, Sq, E = q.shape
    Sk = k.shape[1]
    Dk = E // H
    q_h = q.reshape(B, Sq, H, Dk).transpose(0, 2, 1, 3)   # (B, H, Sq, Dk)
    k_h = k.reshape(B, Sk, H, Dk).transpose(0, 2, 1, 3)   # (B, H, Sk, Dk)
    v_h = v.reshape(B, Sk, H, Dk).transpose(0, 2, 1, 3)   # (B, H, Sk, Dk)
    if weights is None:
        scores = q_h @ k_h.transpose(0, 1, 3, 2) / math.sqrt(Dk)
        if mask is not None:
            blocked = np.broadcast_to(np.asarray(mask) == 1, scores.shape)
            scores = np.where(blocked, -np.inf, scores)
        with np.errstate(invalid="ignore"):
            m = scores.max(axis=-1, keepdims=True)
            e = np.exp(scores - m)
            weights = e / e.sum(axis=-1, keepdims=True)
    else:
        weights = np.asarray(weights, dtype=np.float64)
    ctx = weights @ v_h                                   # (B, H, Sq, Dk)
    ctx = ctx.transpose(0, 2, 1, 3).reshape(B, Sq, E)
    return lin(ctx, "W_o"), weights


@pytest.fixture(scope="session")
def np_ref():
    return types.SimpleNamespace(forward=_np_forward)


# --------------------------------------------------------------------------
# misc
# --------------------------------------------------------------------------

@pytest.fixture(scope="session")
def helpers():
    return types.SimpleNamespace(assert_close=assert_close, TOL=TOL,
                                 STATE_KEYS=STATE_KEYS,
                                 PARAM_NAMES=PARAM_NAMES)


@pytest.fixture
def restore_threads():
    """Put the library's thread count back after the test."""
    import mha_ext
    saved = mha_ext.get_num_threads()
    yield saved
    mha_ext.set_num_threads(saved)


def random_inputs(rng, B, Sq, Sk, E, dtype="float32", kdim=None, vdim=None):
    """Standard normal query/key/value of the given dtype."""
    kdim = E if kdim is None else kdim
    vdim = E if vdim is None else vdim
    q = rng.standard_normal((B, Sq, E)).astype(dtype)
    k = rng.standard_normal((B, Sk, kdim)).astype(dtype)
    v = rng.standard_normal((B, Sk, vdim)).astype(dtype)
    return q, k, v


@pytest.fixture(scope="session")
def make_inputs():
    return random_inputs
