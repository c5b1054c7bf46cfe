"""Property tests (hypothesis): random shapes, heads, head widths, masks,
dtypes and memory layouts, every result held to the float64 NumPy reference
of tests/_reference.py (API.md §3.1 semantics: blocked rows NaN, or zero
weights and output = W_o.bias with masked_rows="zero").

Legend: B batch (0-3), Sq / Sk lengths (0-40), E = d_model, H = n_heads,
Dk = E / H.
"""
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mha_ext
from _reference import assert_close, reference

N_EXAMPLES = int(os.environ.get("MHA_HYPOTHESIS_EXAMPLES", "200"))
SEEN = {"examples": 0}


def layout(kind, a):
    """`a` (already in the module's dtype, so every layout holds the same
    values) as an array of layout `kind`."""
    if kind == "contiguous":
        return a
    if kind == "fortran":
        return np.asfortranarray(a)
    if kind == "negative-stride":
        return np.flip(np.flip(a, -2).copy(), -2) if a.ndim >= 2 else np.flip(np.flip(a).copy())
    if kind == "step-2":
        return np.repeat(a, 2, axis=-1)[..., ::2]
    if kind == "byteswapped":
        return a.astype(a.dtype.newbyteorder())
    if kind == "misaligned":
        raw = np.zeros(a.nbytes + 1, np.uint8)
        v = raw[1:].view(a.dtype).reshape(a.shape)
        v[...] = a
        return v
    if kind == "list":  # an empty nested list has lost its shape: keep the array
        return a.tolist() if a.size else a
    raise AssertionError(kind)


LAYOUTS = ["contiguous", "fortran", "negative-stride", "step-2", "byteswapped", "misaligned",
           "list"]


@st.composite
def cases(draw):
    dtype = draw(st.sampled_from(["float32", "float64"]))
    H = draw(st.integers(1, 4))
    Dk = draw(st.integers(1, 6))
    E = H * Dk
    self_attn = draw(st.booleans())
    kdim = None if self_attn else draw(st.one_of(st.none(), st.integers(1, 9)))
    vdim = None if self_attn else draw(st.one_of(st.none(), st.integers(1, 9)))
    bias = draw(st.booleans())
    batched = draw(st.booleans())
    B = draw(st.integers(0, 3)) if batched else 1
    Sq = draw(st.integers(0, 40))
    Sk = Sq if self_attn else draw(st.integers(0, 40))
    seed = draw(st.integers(0, 2 ** 32 - 1))
    rng = np.random.default_rng(seed)
    t = np.dtype(dtype)
    integer_data = draw(st.booleans())

    def data(shape, scale=1.0):
        x = rng.standard_normal(shape) * scale
        if integer_data:
            x = np.round(x * 2)
        return x.astype(t)

    q = data((B, Sq, E))
    k = q if self_attn else data((B, Sk, kdim or E))
    v = q if self_attn else data((B, Sk, vdim or E))
    zero_stride = draw(st.booleans()) and Sq > 0
    if zero_stride:  # every query row the same: a (1,)-row broadcast view
        q = np.broadcast_to(q[:, :1], q.shape)
        if self_attn:
            k = v = q

    kw = {}
    p_block = draw(st.sampled_from([0.0, 0.2, 0.7, 1.0]))
    lead = (B,) if batched else ()
    seed_mask = draw(st.sampled_from([None, "full", "per-key", "per-query-key", "heads"]))
    if seed_mask:
        shape = {"full": lead + (H, Sq, Sk), "per-key": (Sk,), "per-query-key": (Sq, Sk),
                 "heads": (H, 1, Sk)}[seed_mask]
        m = rng.random(shape) < p_block
        mdt = draw(st.sampled_from(["bool", "int8", "float32", "int64"]))
        kw["mask"] = m.astype(mdt)
    attn = draw(st.sampled_from([None, "bool", "float", "bool-3d", "float-3d"]))
    if attn:
        shape = (Sq, Sk) if not attn.endswith("3d") else ((B * H,) if batched else (H,)) + (Sq, Sk)
        blocked = rng.random(shape) < p_block
        if attn.startswith("bool"):
            kw["attn_mask"] = blocked
        else:
            kw["attn_mask"] = np.where(blocked, -np.inf, rng.uniform(-3, 3, shape)).astype(t)
    pad = draw(st.sampled_from([None, "bool", "float"]))
    if pad:
        shape = lead + (Sk,)
        blocked = rng.random(shape) < p_block / 2
        kw["key_padding_mask"] = blocked if pad == "bool" else \
            np.where(blocked, -np.inf, rng.uniform(-2, 2, shape)).astype(t)
    kw["is_causal"] = draw(st.booleans())
    kw["masked_rows"] = draw(st.sampled_from(["nan", "zero"]))
    need_weights = draw(st.booleans())
    average = draw(st.booleans())

    if not batched:
        q, k, v = q[0], k[0], v[0]
    lays = [draw(st.sampled_from(LAYOUTS)) for _ in range(3)]
    mask_lay = draw(st.sampled_from(LAYOUTS))
    return dict(dtype=dtype, E=E, H=H, kdim=kdim, vdim=vdim, bias=bias, seed=seed,
                q=q, k=k, v=v, self_attn=self_attn, kw=kw, need_weights=need_weights,
                average=average, lays=lays, mask_lay=mask_lay)


def _run(c):
    m = mha_ext.MultiHeadAttention(c["E"], c["H"], kdim=c["kdim"], vdim=c["vdim"],
                                   bias=c["bias"], dtype=c["dtype"], seed=c["seed"]).eval()
    kw = dict(c["kw"])
    if "mask" in kw:
        kw["mask"] = layout(c["mask_lay"], kw["mask"])
    for name in ("attn_mask", "key_padding_mask"):
        if name in kw and c["mask_lay"] != "list":
            kw[name] = layout(c["mask_lay"], kw[name])
    q = layout(c["lays"][0], c["q"])
    if c["self_attn"]:
        args = (q,)
    else:
        args = (q, layout(c["lays"][1], c["k"]), layout(c["lays"][2], c["v"]))
    q_before = np.array(c["q"], copy=True)
    out, w = m(*args, need_weights=c["need_weights"], average_weights=c["average"], **kw)

    want_out, want_w = reference(m.state_dict(), c["H"], c["q"],
                                 None if c["self_attn"] else c["k"],
                                 None if c["self_attn"] else c["v"], **c["kw"])
    assert out.dtype == np.dtype(c["dtype"])
    assert_close(out, want_out, c["dtype"], "output")
    if c["need_weights"]:
        if c["average"]:
            with np.errstate(all="ignore"):
                want_w = want_w.mean(axis=-3)
        assert_close(w, want_w, c["dtype"], "weights")
    else:
        assert w is None
    np.testing.assert_array_equal(c["q"], q_before)  # inputs are never modified


@settings(max_examples=N_EXAMPLES, deadline=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def _property(c):
    SEEN["examples"] += 1
    _run(c)


def test_matches_float64_reference():
    """At least N_EXAMPLES random cases, each against the reference."""
    SEEN["examples"] = 0
    _property()
    print(f"\nhypothesis examples run: {SEEN['examples']}")
    assert SEEN["examples"] >= N_EXAMPLES


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fast_path_equals_reference_core(dtype):
    """The threaded core against the plain C reference on one awkward shape."""
    m = mha_ext.MultiHeadAttention(24, 3, dtype=dtype, seed=3).eval()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 37, 24)).astype(dtype)
    kv = rng.standard_normal((3, 41, 24)).astype(dtype)
    masks = [(0, np.triu(np.ones((37, 41), np.uint8), 1))]
    for need in (True, False):
        fast = m._forward(x, kv, kv, masks=masks, need_weights=need)
        ref = m._forward(x, kv, kv, masks=masks, need_weights=need, reference=True)
        assert_close(fast[0], ref[0], dtype)
        if need:
            assert_close(fast[1], ref[1], dtype)
