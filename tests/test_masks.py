"""The seed notebook's ``mask=`` argument (API.md 3.1): 1 / True = blocked.

Every broadcast shape and dtype is compared against the torch seed module,
which applies ``scores.masked_fill(mask == 1, float('-inf'))``.  Fully
blocked rows are NaN exactly where torch gives NaN.

Legend: B batch, Sq/Sk query/key length, E = d_model, H = n_heads.
"""

import numpy as np
import pytest

from mha_ext import MultiHeadAttention

from _support import require_torch

B, Sq, Sk, E, H = 3, 5, 7, 16, 4

# Shapes broadcastable (NumPy rules) to (B, H, Sq, Sk).
MASK_SHAPES = [
    pytest.param((Sq, Sk), id="Sq,Sk"),
    pytest.param((B, 1, Sq, Sk), id="B,1,Sq,Sk"),
    pytest.param((B, H, Sq, Sk), id="B,H,Sq,Sk"),
    pytest.param((B, 1, 1, Sk), id="B,1,1,Sk"),
    pytest.param((1, H, Sq, Sk), id="1,H,Sq,Sk"),
    pytest.param((Sk,), id="Sk"),
    pytest.param((Sq, 1), id="Sq,1"),
    pytest.param((H, 1, 1), id="H,1,1"),
    pytest.param((1, 1, 1, 1), id="1,1,1,1"),
]

MASK_DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8",
               "float32", "float64"]


def _inputs(dtype, seed=0, b=B, sq=Sq, sk=Sk):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, sq, E)).astype(dtype)
    k = rng.standard_normal((b, sk, E)).astype(dtype)
    v = rng.standard_normal((b, sk, E)).astype(dtype)
    return q, k, v


def _random_mask(shape, mask_dtype, seed=1, density=0.35):
    rng = np.random.default_rng(seed)
    blocked = rng.random(shape) < density
    return blocked.astype(mask_dtype)


def _compare(seed_ref, helpers, parity_record, ours, ref, q, k, v, mask,
             dtype, what):
    out, w = ours(q, k, v, mask=mask)
    out_ref, w_ref = seed_ref.run(ref, q, k, v, mask)
    parity_record(dtype, f"mask {what} output", out, out_ref)
    parity_record(dtype, f"mask {what} weights", w, w_ref)
    tol = helpers.TOL[dtype]
    helpers.assert_close(w, w_ref, what=f"weights {what}", **tol)
    helpers.assert_close(out, out_ref, what=f"output {what}", **tol)
    return out, w, out_ref, w_ref


@pytest.mark.parametrize("mask_dtype", MASK_DTYPES)
@pytest.mark.parametrize("shape", MASK_SHAPES)
def test_mask_shapes_and_dtypes_match_torch(seed_ref, helpers, parity_record,
                                            shape, mask_dtype):
    ref, ours = seed_ref.pair(E, H, seed=20)
    q, k, v = _inputs("float32", seed=20)
    mask = _random_mask(shape, mask_dtype, seed=21)
    out, w, _, _ = _compare(seed_ref, helpers, parity_record, ours, ref,
                            q, k, v, mask, "float32",
                            f"{shape} {mask_dtype}")
    # the blocked positions really get zero weight
    blocked = np.broadcast_to(mask == 1, w.shape)
    finite_rows = ~np.isnan(w).any(axis=-1, keepdims=True)
    assert np.all(w[blocked & finite_rows] == 0)


@pytest.mark.parametrize("shape", MASK_SHAPES[:5])
def test_mask_float64_module_matches_torch(seed_ref, helpers, parity_record,
                                           shape):
    ref, ours = seed_ref.pair(E, H, dtype="float64", seed=22)
    q, k, v = _inputs("float64", seed=22)
    mask = _random_mask(shape, "bool", seed=23)
    _compare(seed_ref, helpers, parity_record, ours, ref, q, k, v, mask,
             "float64", f"{shape} bool")


def test_mask_all_zero_is_no_mask():
    ours = MultiHeadAttention(E, H, seed=24).eval()
    q, k, v = _inputs("float32", seed=24)
    out0, w0 = ours(q, k, v)
    for mdt in ("bool", "int64", "float32"):
        out, w = ours(q, k, v, mask=np.zeros((B, H, Sq, Sk), mdt))
        np.testing.assert_allclose(out, out0, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(w, w0, rtol=1e-6, atol=1e-7)


def test_mask_large_seed_config(seed_ref, helpers, parity_record):
    """The seed configuration with a causal-looking 0/1 mask (Sq, Sk)."""
    ref, ours = seed_ref.pair(512, 8, seed=25)
    q = np.random.default_rng(25).standard_normal((2, 10, 512)).astype(
        "float32")
    mask = np.triu(np.ones((10, 10), dtype=np.int64), k=1)
    _compare(seed_ref, helpers, parity_record, ours, ref, q, q, q, mask,
             "float32", "seed triu")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fully_blocked_rows_are_nan_like_torch(seed_ref, helpers, dtype):
    ref, ours = seed_ref.pair(E, H, dtype=dtype, seed=26)
    q, k, v = _inputs(dtype, seed=26)
    mask = np.zeros((B, H, Sq, Sk), dtype=bool)
    mask[0, 1, 2, :] = True            # one head, one row of batch 0
    mask[2, :, 4, :] = True            # every head, row 4 of batch 2
    mask[1, 3, 0, :-1] = True          # almost blocked: stays finite
    out, w = ours(q, k, v, mask=mask)
    out_ref, w_ref = seed_ref.run(ref, q, k, v, mask)
    # torch's seed module gives NaN rows there; so must we
    assert np.isnan(w_ref[0, 1, 2]).all() and np.isnan(out_ref[0, 2]).all()
    np.testing.assert_array_equal(np.isnan(w), np.isnan(w_ref))
    np.testing.assert_array_equal(np.isnan(out), np.isnan(out_ref))
    assert np.isnan(w[0, 1, 2]).all()
    assert np.isnan(w[2, :, 4]).all()
    assert np.isnan(out[0, 2]).all() and np.isnan(out[2, 4]).all()
    # everything else finite and close
    assert np.isfinite(w[1, 3, 0]).all()
    np.testing.assert_allclose(w[1, 3, 0, -1], 1.0, rtol=1e-6)
    tol = helpers.TOL[dtype]
    helpers.assert_close(w, w_ref, **tol)
    helpers.assert_close(out, out_ref, **tol)


def test_whole_batch_blocked(seed_ref, helpers):
    ref, ours = seed_ref.pair(E, H, seed=27)
    q, k, v = _inputs("float32", seed=27)
    mask = np.zeros((B, 1, 1, Sk), dtype=np.uint8)
    mask[1] = 1
    out, w = ours(q, k, v, mask=mask)
    out_ref, w_ref = seed_ref.run(ref, q, k, v, mask)
    assert np.isnan(w[1]).all() and np.isnan(out[1]).all()
    assert np.isfinite(w[[0, 2]]).all() and np.isfinite(out[[0, 2]]).all()
    helpers.assert_close(w, w_ref, **helpers.TOL["float32"])
    helpers.assert_close(out, out_ref, **helpers.TOL["float32"])


@pytest.mark.parametrize("layout", ["reversed", "transposed", "strided",
                                    "fortran", "bigendian", "broadcast_view"])
def test_mask_layouts_give_identical_results(layout):
    ours = MultiHeadAttention(E, H, seed=28).eval()
    q, k, v = _inputs("float32", seed=28)
    base = _random_mask((B, H, Sq, Sk), "float32", seed=29, density=0.3)
    if layout == "reversed":
        mask = base[:, ::-1, :, ::-1].copy()[:, ::-1, :, ::-1]
    elif layout == "transposed":
        mask = np.ascontiguousarray(base.transpose(0, 1, 3, 2)).transpose(
            0, 1, 3, 2)
    elif layout == "strided":
        big = np.zeros((B, H, 2 * Sq, 3 * Sk), dtype="float32")
        big[:, :, ::2, ::3] = base
        mask = big[:, :, ::2, ::3]
    elif layout == "fortran":
        mask = np.asfortranarray(base)
    elif layout == "bigendian":
        mask = base.astype(">f4")
    else:
        base = np.broadcast_to(base[:, :1], base.shape)
        mask = base
    assert np.array_equal(mask, base)
    out_ref, w_ref = ours(q, k, v, mask=np.ascontiguousarray(base))
    out, w = ours(q, k, v, mask=mask)
    np.testing.assert_array_equal(out, out_ref)
    np.testing.assert_array_equal(w, w_ref)


def test_mask_not_modified():
    ours = MultiHeadAttention(E, H, seed=30).eval()
    q, k, v = _inputs("float32", seed=30)
    for mdt in ("bool", "int32", "float64"):
        mask = _random_mask((B, 1, Sq, Sk), mdt, seed=31)
        before = mask.copy()
        ours(q, k, v, mask=mask)
        np.testing.assert_array_equal(mask, before)
        assert mask.dtype == before.dtype


def test_unbatched_mask(seed_ref, helpers):
    """Unbatched inputs: the mask broadcasts to (H, Sq, Sk)."""
    ref, ours = seed_ref.pair(E, H, seed=32)
    q, k, v = _inputs("float32", seed=32, b=1)
    for shape in [(Sq, Sk), (H, Sq, Sk), (H, 1, Sk), (Sk,)]:
        mask = _random_mask(shape, "bool", seed=33)
        out, w = ours(q[0], k[0], v[0], mask=mask)
        assert out.shape == (Sq, E) and w.shape == (H, Sq, Sk)
        out_ref, w_ref = seed_ref.run(ref, q, k, v, mask)
        helpers.assert_close(out, out_ref[0], **helpers.TOL["float32"])
        helpers.assert_close(w, w_ref[0], **helpers.TOL["float32"])


# --------------------------------------------------------------------------
# rejected masks
# --------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [
    pytest.param(np.int64(2), id="int-2"),
    pytest.param(np.int32(-1), id="int32--1"),
    pytest.param(np.uint8(255), id="uint8-255"),
    pytest.param(np.float32(0.5), id="float-0.5"),
    pytest.param(np.float64(2.0), id="float-2.0"),
    pytest.param(np.float64(-np.inf), id="float--inf"),
    pytest.param(np.float64(np.nan), id="float-nan"),
])
def test_mask_values_other_than_0_1_point_to_attn_mask(bad):
    m = MultiHeadAttention(E, H, seed=34)
    q, k, v = _inputs("float32", seed=34)
    mask = np.zeros((B, H, Sq, Sk), dtype=np.asarray(bad).dtype)
    mask[1, 2, 3, 4] = bad
    with pytest.raises(ValueError, match="attn_mask"):
        m(q, k, v, mask=mask)


@pytest.mark.parametrize("shape", [
    pytest.param((Sq, Sk + 1), id="Sk+1"),
    pytest.param((Sq + 1, Sk), id="Sq+1"),
    pytest.param((B + 1, 1, Sq, Sk), id="B+1"),
    pytest.param((B, H + 1, Sq, Sk), id="H+1"),
    pytest.param((1, B, H, Sq, Sk), id="5d"),
    pytest.param((2, Sk), id="2,Sk"),
])
def test_mask_not_broadcastable_is_value_error(shape):
    m = MultiHeadAttention(E, H, seed=35)
    q, k, v = _inputs("float32", seed=35)
    with pytest.raises(ValueError, match="mask"):
        m(q, k, v, mask=np.zeros(shape, dtype=bool))


@pytest.mark.parametrize("sk", [Sk, 300])
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_zero_rows_are_zero_weights_times_v_as_in_torch(dtype, need_weights, sk):
    """masked_rows="zero": a row with every key blocked has zero weights and
    the context 0·V (3.1), as torch's SDPA path computes it: W_o.bias where V
    is finite, NaN where V holds NaN or inf, with or without weights.  Without
    weights the online softmax once skipped the row (W_o.bias whatever V
    held); with them the result already was 0·V."""
    torch = require_torch()
    theirs = torch.nn.MultiheadAttention(E, H, batch_first=True,
                                         dtype=getattr(torch, dtype)).eval()
    m = MultiHeadAttention.from_torch(theirs)
    bias = m.state_dict()["W_o.bias"]
    q, k, v = _inputs(dtype, seed=4, sk=sk)
    kpm = np.zeros((B, sk), bool)
    kpm[0] = True                     # batch 0: every key blocked
    kpm[2, 1] = True                  # batch 2: one
    out, w = m(q, k, v, key_padding_mask=kpm, masked_rows="zero", need_weights=need_weights)
    np.testing.assert_array_equal(out[0], np.broadcast_to(bias, out[0].shape))
    v[0, 2], v[2, 1] = np.nan, np.inf   # keys that no row sees
    out, w = m(q, k, v, key_padding_mask=kpm, masked_rows="zero", need_weights=need_weights)
    with torch.no_grad():
        want = theirs(*(torch.from_numpy(a) for a in (q, k, v)),
                      key_padding_mask=torch.from_numpy(kpm), need_weights=False)[0].numpy()
    assert np.isnan(want[0]).all() and np.isnan(out[0]).all()
    np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
    np.testing.assert_allclose(out[1:], want[1:], rtol=0,
                               atol=2e-5 if dtype == "float32" else 1e-12)
    if need_weights:
        assert (w[0] == 0).all() and np.isfinite(w).all()


def test_float_masks_are_summed_before_the_scores_as_in_torch():
    """attn_mask and key_padding_mask as floats: torch adds their sum to the
    score, s + (m1 + m2).  Two masks of 1e20 that cancel leave the scores, as
    in torch; added one after the other, (s + 1e20) - 1e20 loses s (uniform
    weights, 0.3 off)."""
    torch = require_torch()
    q, k, v = _inputs("float64", seed=5)
    theirs = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64)
    ours = MultiHeadAttention.from_torch(theirs)
    big = 1e20
    attn_mask = np.zeros((Sq, Sk))
    attn_mask[:, 1:4] = big
    kpm = np.zeros((B, Sk))
    kpm[:, 1:4] = -big
    kpm[1, 5] = -np.inf
    t = [torch.from_numpy(a) for a in (q, k, v, attn_mask, kpm)]
    with torch.no_grad():
        t_out, t_w = theirs(t[0], t[1], t[2], attn_mask=t[3], key_padding_mask=t[4],
                            average_attn_weights=False)
    out, w = ours(q, k, v, attn_mask=attn_mask, key_padding_mask=kpm)
    np.testing.assert_allclose(w, t_w.numpy(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(out, t_out.numpy(), rtol=0, atol=1e-12)
    plain, _ = ours(q, k, v, key_padding_mask=np.isinf(kpm))  # the masks cancel
    np.testing.assert_allclose(out, plain, rtol=0, atol=1e-12)
