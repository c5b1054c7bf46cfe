"""The rest of test_torch_surface.py (API.md §3): where torch disagrees with
itself (its fused fast path against its SDPA path, is_causal as a hint, the
SDPA twin's bool polarity), pinned against torch's own results; and the
errors for wrong mask shapes, dtypes and values.  The helpers, tolerances and
fixtures are test_torch_surface.py's.

Legend: B batch, Sq/Sk query/key length, E = d_model, H = n_heads.
"""
import numpy as np
import pytest

import mha_ext
from mha_ext import MultiHeadAttention
from test_torch_surface import (B, E, H, SK, SQ, assert_close, fully_masked_kpm,  # noqa: F401
                                inputs, out_projection, projected_heads, tensor, torch_ref,
                                torch, dtype, pair)


# ------------------------------------------------------------------ torch disagrees with itself

def test_pinned_fast_path_vs_sdpa_path(torch, dtype, pair):
    """A query that sees no key: torch's fused fast path (eval, self-attention,
    batch_first) gives NaN even with need_weights=False, its SDPA path gives
    W_o.bias.  We give NaN by default and W_o.bias with masked_rows="zero",
    whatever need_weights is."""
    t, m = pair
    q, _, _ = inputs(dtype, B, SK, SK, E)
    kpm = fully_masked_kpm()
    tq = tensor(torch, q)
    with torch.no_grad():
        fast, _ = t(tq, tq, tq, key_padding_mask=tensor(torch, kpm), need_weights=False)
        sdpa, _ = t(tq, tq.clone(), tq.clone(), key_padding_mask=tensor(torch, kpm),
                    need_weights=False)
    assert np.isnan(fast[1].numpy()).all()  # torch's fast path: NaN
    assert np.allclose(sdpa[1].numpy(), t.out_proj.bias.detach().numpy())  # SDPA path: bias
    for need in (True, False):
        out, _ = m(q, q, q, key_padding_mask=kpm, need_weights=need)
        assert_close("pinned: fast path NaN rows", dtype, out, fast)
        out, _ = m(q, q, q, key_padding_mask=kpm, need_weights=need, masked_rows="zero")
        assert_close("pinned: SDPA path zero rows", dtype, out, sdpa)


def test_pinned_is_causal_with_attn_mask(torch, dtype, pair):
    """torch treats is_causal=True as a hint about attn_mask: given a mask
    that is not causal, its weights path uses only attn_mask and its SDPA path
    only causality.  We apply both."""
    t, m = pair
    S = 6
    q, k, v = inputs(dtype, B, S, S, E)
    am = np.random.default_rng(12).random((S, S)) < 0.3
    np.fill_diagonal(am, False)
    causal = np.triu(np.ones((S, S), dtype=bool), k=1)
    out, w = m(q, k, v, attn_mask=am, is_causal=True)
    t_both, t_w = torch_ref(torch, t, q, k, v, attn_mask=am | causal)
    assert_close("pinned: is_causal + attn_mask = both", dtype, out, t_both)
    assert_close("pinned: is_causal + attn_mask = both", dtype, w, t_w)
    with pytest.raises(RuntimeError, match="attn_mask"):  # torch: is_causal is a hint
        torch_ref(torch, t, q, k, v, is_causal=True)
    t_weights_path, _ = torch_ref(torch, t, q, k, v, attn_mask=am, is_causal=True)
    t_sdpa_path, _ = torch_ref(torch, t, q, k, v, attn_mask=am, is_causal=True,
                               need_weights=False)
    assert np.allclose(t_weights_path.numpy(), torch_ref(torch, t, q, k, v, attn_mask=am)[0])
    assert np.allclose(t_sdpa_path.numpy(), torch_ref(torch, t, q, k, v, attn_mask=causal)[0])
    assert not np.allclose(out, t_weights_path.numpy())
    assert not np.allclose(out, t_sdpa_path.numpy())


def test_pinned_sdpa_bool_polarity(torch, dtype, pair):
    """F.scaled_dot_product_attention's bool mask means True = attend, the
    inverse of nn.MultiheadAttention's.  attn_mask follows the module: True =
    blocked; an SDPA-style mask must be inverted (~mask) first."""
    t, m = pair
    q, k, v = inputs(dtype, B, SQ, SK, E)
    allowed = np.random.default_rng(13).random((SQ, SK)) < 0.6
    allowed[:, 0] = True
    with torch.no_grad():
        ctx = torch.nn.functional.scaled_dot_product_attention(
            *projected_heads(torch, t, q, k, v), attn_mask=tensor(torch, allowed))
    want = out_projection(torch, t, ctx)
    out, _ = m(q, k, v, attn_mask=~allowed, need_weights=False)
    assert_close("pinned: SDPA bool polarity inverted", dtype, out, want)
    assert not np.allclose(m(q, k, v, attn_mask=allowed)[0], want.numpy())


# ------------------------------------------------------------------ errors

@pytest.fixture
def m32():
    return MultiHeadAttention(E, H, seed=0)


def x3(S, D=E, b=B):
    return np.zeros((b, S, D), dtype=np.float32)


@pytest.mark.parametrize("shape", [(SK, SQ), (SQ,), (B, SQ, SK), (H, SQ, SK), (B, H, SQ, SK),
                                   (H * B, SK, SQ), (1, SQ, SK), (SQ, SK + 1)])
def test_attn_mask_wrong_shape(m32, shape):
    with pytest.raises(ValueError) as e:
        m32(x3(SQ), x3(SK), x3(SK), attn_mask=np.zeros(shape, dtype=bool))
    msg = str(e.value)
    assert "attn_mask" in msg and f"({SQ}, {SK})" in msg and f"({B * H}, {SQ}, {SK})" in msg
    assert str(shape) in msg


def test_attn_mask_wrong_shape_unbatched(m32):
    with pytest.raises(ValueError) as e:
        m32(x3(SQ)[0], x3(SK)[0], x3(SK)[0], attn_mask=np.zeros((B * H, SQ, SK), dtype=bool))
    assert "attn_mask" in str(e.value) and f"({H}, {SQ}, {SK})" in str(e.value)


@pytest.mark.parametrize("shape", [(SK, B), (B,), (B, 1, SK), (1, SK), (B, SK + 1)])
def test_key_padding_mask_wrong_shape(m32, shape):
    with pytest.raises(ValueError) as e:
        m32(x3(SQ), x3(SK), x3(SK), key_padding_mask=np.zeros(shape, dtype=bool))
    msg = str(e.value)
    assert "key_padding_mask" in msg and f"({B}, {SK})" in msg and str(shape) in msg


def test_key_padding_mask_wrong_shape_unbatched(m32):
    with pytest.raises(ValueError) as e:
        m32(x3(SQ)[0], x3(SK)[0], x3(SK)[0], key_padding_mask=np.zeros((1, SK), dtype=bool))
    assert "key_padding_mask" in str(e.value) and f"({SK},)" in str(e.value)


@pytest.mark.parametrize("name", ["attn_mask", "key_padding_mask"])
@pytest.mark.parametrize("dt", [np.int64, np.uint8, np.complex64, object, "U1"])
def test_mask_wrong_dtype(m32, name, dt):
    shape = (SQ, SK) if name == "attn_mask" else (B, SK)
    bad = np.zeros(shape, dtype=dt)
    with pytest.raises(TypeError) as e:
        m32(x3(SQ), x3(SK), x3(SK), **{name: bad})
    assert name in str(e.value) and "bool" in str(e.value) and "float" in str(e.value)


def test_torch_mask_wrong_dtype(torch, m32):
    with pytest.raises(TypeError, match="attn_mask"):
        m32(x3(SQ), x3(SK), x3(SK), attn_mask=torch.zeros(SQ, SK, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"key_padding_mask.*\(3, 7\)"):
        m32(x3(SQ), x3(SK), x3(SK), key_padding_mask=torch.zeros(SK, B, dtype=torch.bool))


def test_seed_mask_additive_values_point_to_attn_mask(m32):
    with pytest.raises(ValueError, match="attn_mask"):
        m32(x3(SQ), x3(SK), x3(SK), mask=np.full((SQ, SK), -np.inf, dtype=np.float32))


def test_masked_rows_bad_value(m32):
    for bad in ("NaN", "zeros", None, 0):
        with pytest.raises(ValueError, match="masked_rows"):
            m32(x3(SQ), x3(SK), x3(SK), masked_rows=bad)


def test_unbatched_mixed_with_batched(m32):
    with pytest.raises(ValueError, match="key"):
        m32(x3(SQ)[0], x3(SK), x3(SK))


def test_version_exposed():
    assert isinstance(mha_ext.__version__, str)
