"""The NumPy MultiHeadAttention's call rules that mutation testing of
mha_ext/module.py and mha_ext/_calls.py found no test holding (a mutant of
each passed the module's tests before): the scale a call is given reaches
the scores, as torch's SDPA ``scale`` does; the scale refusals (NaN, more
than one number, a tensor that requires grad, NumPy and torch bools, a
NumPy complex); train() with a NumPy bool (docs/API.md §9); the
projections' repr, which reads like torch.nn.Linear's; a window of more
than two bounds, a one-row head_mask for a larger batch and a call of a
smaller batch than its cache's, each refused (docs/API.md §3.1-§3.3).

Legend: B batch, S length, E width, H heads, Dk = E / H.
"""
import numpy as np
import pytest

from _support import require_torch
from mha_ext import MultiHeadAttention

torch = require_torch()
F = torch.nn.functional


def _module(E=16, H=4, dtype="float64", seed=3, **kw):
    return MultiHeadAttention(E, H, dtype=dtype, seed=seed, **kw).eval()


def _x(B, S, E, dtype="float64", seed=0):
    return np.random.default_rng(seed).standard_normal((B, S, E)).astype(dtype)


def _torch_attention(m, x, scale):
    """torch's computation of m's self-attention call with this scale:
    its Linear projections, F.scaled_dot_product_attention(scale=) for the
    output, the softmax of the scaled scores for the weights."""
    t = {k: torch.from_numpy(v) for k, v in m.state_dict().items()}
    xt = torch.from_numpy(x)
    B, S, E = x.shape
    H = m.n_heads

    def heads(name):
        y = F.linear(xt, t[f"{name}.weight"], t[f"{name}.bias"])
        return y.reshape(B, S, H, E // H).transpose(1, 2)

    q, k, v = heads("W_q"), heads("W_k"), heads("W_v")
    ctx = F.scaled_dot_product_attention(q, k, v, scale=scale)
    out = F.linear(ctx.transpose(1, 2).reshape(B, S, E), t["W_o.weight"], t["W_o.bias"])
    weights = torch.softmax(q @ k.transpose(-2, -1) * scale, dim=-1)
    return out.numpy(), weights.numpy()


# ---------------------------------------------------------------- scale

@pytest.mark.parametrize("scale", [0.0, 0.07, 2.5, -1.0])
@pytest.mark.parametrize("need_weights", [True, False])
def test_the_scale_given_multiplies_the_scores_as_torchs_sdpa_scale(scale, need_weights):
    m = _module()
    x = _x(2, 5, 16)
    want_out, want_w = _torch_attention(m, x, scale)
    out, w = m(x, scale=scale, need_weights=need_weights)
    np.testing.assert_allclose(out, want_out, rtol=0, atol=1e-10)
    if need_weights:
        np.testing.assert_allclose(w, want_w, rtol=0, atol=1e-10)


def test_a_nan_scale_is_a_value_error():
    m = _module()
    with pytest.raises(ValueError, match="NaN"):
        m(_x(1, 3, 16), scale=float("nan"))


@pytest.mark.parametrize("make", [lambda: np.array([0.5]), lambda: torch.tensor([0.5])],
                         ids=["ndarray", "tensor"])
def test_a_scale_of_more_than_a_0d_number_is_a_type_error_as_torchs(make):
    q = torch.zeros(1, 1, 2, 4)
    with pytest.raises(TypeError, match="scale"):
        F.scaled_dot_product_attention(q, q, q, scale=make())
    with pytest.raises(TypeError, match="scale"):
        _module()(_x(1, 3, 16), scale=make())


def test_a_scale_tensor_that_requires_grad_is_a_type_error_as_torchs():
    q = torch.zeros(1, 1, 2, 4)
    s = torch.tensor(0.5, requires_grad=True)
    with pytest.raises(TypeError, match="scale"):
        F.scaled_dot_product_attention(q, q, q, scale=s)
    with pytest.raises(TypeError, match="grad"):
        _module()(_x(1, 3, 16), scale=s)


@pytest.mark.parametrize("make", [lambda: True, lambda: np.bool_(True),
                                  lambda: np.array(True), lambda: torch.tensor(True)],
                         ids=["bool", "numpy-bool", "0d-array", "torch-bool"])
def test_a_bool_scale_of_any_kind_is_a_type_error(make):
    # docs/API.md §3.1: "a bool is a TypeError" (torch reads True as 1.0)
    with pytest.raises(TypeError, match="scale.*bool"):
        _module()(_x(1, 3, 16), scale=make())


@pytest.mark.parametrize("kind", [np.complex64, np.complex128, complex])
def test_a_complex_scale_is_a_type_error_not_its_real_part(kind):
    # float() of a NumPy complex drops the imaginary part with a warning only
    with pytest.raises(TypeError, match="scale.*complex"):
        _module()(_x(1, 3, 16), scale=kind(0.5 + 1j))


# ---------------------------------------------------------------- train()

@pytest.mark.parametrize("mode", [False, True])
def test_train_takes_a_numpy_bool_as_its_mode(mode):
    # docs/API.md §9 names train(np.bool_(False))
    m = _module(dropout=0.5)
    m.train(not mode)
    assert m.train(np.bool_(mode)) is m
    assert m.training is mode


# ---------------------------------------------------------------- repr

@pytest.mark.parametrize("bias", [True, False])
def test_a_projections_repr_reads_like_torch_linears(bias):
    m = _module(E=16, H=4, kdim=6, bias=bias)
    want = repr(torch.nn.Linear(6, 16, bias=bias))  # Linear(in_features=6, ..., bias=...)
    got = repr(m.W_k)
    assert got.startswith(want[:-1] + ",") and "float64" in got


# ---------------------------------------------------------------- window, head_mask

@pytest.mark.parametrize("window", [(1, 2, 3), [0, None, None]])
def test_a_window_of_more_than_two_bounds_is_a_type_error(window):
    with pytest.raises(TypeError, match="window must be None or a pair"):
        _module()(_x(1, 4, 16), window=window)


def test_a_head_mask_of_one_row_is_refused_for_a_larger_batch():
    # docs/API.md §3.2: exactly (H,) or (B, H); (1, H) with B > 1 is a ValueError
    m = _module()
    with pytest.raises(ValueError, match="head_mask must have shape"):
        m(_x(2, 3, 16), head_mask=np.ones((1, 4)))
    out, _ = m(_x(1, 3, 16), head_mask=np.ones((1, 4)))  # (B, H) with B = 1
    np.testing.assert_array_equal(out, m(_x(1, 3, 16))[0])


# ---------------------------------------------------------------- the cache's batch

@pytest.mark.parametrize("B", [1, 3])
def test_a_call_of_another_batch_than_its_cache_is_refused_naming_both(B):
    # docs/API.md §3.3: a batch size other than the cache's, smaller too, is
    # a ValueError leaving the cache unchanged
    m = _module()
    cache = m.new_cache(2, 8)
    m(_x(2, 3, 16), cache=cache, need_weights=False)
    with pytest.raises(ValueError, match=f"batch_size 2, the call has batch {B}"):
        m(_x(B, 1, 16), cache=cache)
    assert cache.length == 3
