"""mha_ext._sdpa and mha_ext._sdpa_torch, the SDPA twin: the rules mutation
testing of those files found no test holding (a mutant of each passed the
SDPA tests before).  The result's dtype from one float64 array among float32
ones and from integer arrays; a key wider than the query refused by our
rule; enable_gqa with two key/value head counts on 3-D inputs;
torch.jit.trace recording the call (not its output as a constant) and
tracing a dropout call whose seed= is given; an int dropout_p too large for
a float as torch's OverflowError too; dropout_p=0 drawing nothing from
torch's generator; np.True_ as is_causal with a mask on torch's fused path;
a mask with is_causal refused where sdpa_kernel leaves no CPU kernel; a
head_mask of one factor on a 2-D call; the backward reading the forward's
head_mask (docs/API.md §4a, §7, §8).

Each against torch.nn.functional.scaled_dot_product_attention where torch
has the call.

Legend: B batch, H heads, L query length, S key length, E width.
"""
import warnings

import numpy as np
import pytest

import mha_ext
from _support import require_torch

torch = require_torch()
F = torch.nn.functional
f = mha_ext.scaled_dot_product_attention


def _qkv(shape=(2, 3, 4, 8), dtype=np.float64, seed=0, S=None):
    r = np.random.default_rng(seed)
    kv = shape[:-2] + (S if S is not None else shape[-2], shape[-1])
    return (r.standard_normal(shape).astype(dtype), r.standard_normal(kv).astype(dtype),
            r.standard_normal(kv).astype(dtype))


def _torch(*arrays, **kw):
    """torch's SDPA on float64 copies of arrays (None stays None)."""
    t = [None if a is None else torch.from_numpy(np.asarray(a, np.float64)) for a in arrays]
    return F.scaled_dot_product_attention(*t, **kw).numpy()


# ---------------------------------------------------------------- dtypes (§4a)

@pytest.mark.parametrize("wide", ["query", "key", "value"])
def test_one_float64_array_among_float32_ones_makes_the_call_float64(wide):
    # API.md §4a: float64 when AN input is float64 (not only when all are)
    q, k, v = _qkv(S=5)
    args = [x.astype(np.float32) for x in (q, k, v)]
    args[("query", "key", "value").index(wide)] = (q, k, v)[("query", "key", "value").index(wide)]
    out = f(*args)
    assert out.dtype == np.float64
    np.testing.assert_allclose(out, _torch(*args), rtol=0, atol=1e-10)


def test_integer_arrays_compute_in_float32():
    # API.md §4a: float64 only from a float of 8 bytes or more; int64 data
    # (8 bytes, not a float) computes in float32
    r = np.random.default_rng(1)
    q, k, v = (r.integers(-2, 3, (2, 3, 4, 8)) for _ in range(3))
    out = f(q, k, v)
    assert out.dtype == np.float32
    want = F.scaled_dot_product_attention(*(torch.from_numpy(x.astype(np.float32))
                                            for x in (q, k, v)))
    np.testing.assert_allclose(out, want.numpy(), rtol=0, atol=1e-5)


# ---------------------------------------------------------------- shapes (§4a, §7)

@pytest.mark.parametrize("Ek", [7, 9])
def test_a_key_narrower_or_wider_than_the_query_is_refused_by_our_rule(Ek):
    q, _, _ = _qkv()
    k = np.ones((2, 3, 5, Ek))
    with pytest.raises(ValueError, match=r"key's last dimension must be query's \(8\)"):
        f(q, k, k)
    with pytest.raises(RuntimeError):  # torch's type too on tensors
        f(*(torch.from_numpy(x) for x in (q, k, k)))


# ---------------------------------------------------------------- recording (§8)

def test_jit_trace_records_the_call_not_its_output():
    # API.md §8: torch.jit.trace records the twin as an op (not the traced
    # inputs' output as a constant), also when no input requires grad
    q, k, v = (torch.from_numpy(x) for x in _qkv(dtype=np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(lambda a, b, c: f(a, b, c), (q, k, v), check_trace=False)
    q2, k2, v2 = (torch.from_numpy(x) for x in _qkv(dtype=np.float32, seed=5))
    torch.testing.assert_close(traced(q2, k2, v2), F.scaled_dot_product_attention(q2, k2, v2),
                               rtol=0, atol=1e-5)


def test_three_dimensional_grouped_heads_of_two_counts_match_torch():
    # API.md §4a: enable_gqa with key and value head counts that differ,
    # on 3-D tensors (heads first, no batch): both repeated to Hq
    r = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(h, 4, 8, generator=r, dtype=torch.float64) for h in (6, 2, 3))
    want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(f(q, k, v, enable_gqa=True), want, rtol=0, atol=1e-10)
    out = f(q.numpy(), k.numpy(), v.numpy(), enable_gqa=True)
    np.testing.assert_allclose(out, want.numpy(), rtol=0, atol=1e-10)


# ---------------------------------------------------------------- dropout_p and seed (§4a, §7)

@pytest.mark.parametrize("p", [10**400, -10**400])
def test_an_int_dropout_p_too_large_for_a_float_is_torchs_overflowerror_too(p):
    # API.md §7: a ValueError that is also torch's OverflowError
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(OverflowError):
        F.scaled_dot_product_attention(q, q, q, dropout_p=p)
    with pytest.raises(ValueError, match="too large for a float") as info:
        f(q, q, q, dropout_p=p)
    assert isinstance(info.value, OverflowError)


def test_no_dropout_draws_nothing_from_torchs_generator():
    # API.md §4a: seed=None draws from torch's generator only for a dropout
    # that applies; torch's SDPA with dropout_p=0 draws nothing either
    q, k, v = (torch.from_numpy(x) for x in _qkv(dtype=np.float32))
    torch.manual_seed(7)
    want = torch.rand(4)
    for call in (f, F.scaled_dot_product_attention):
        torch.manual_seed(7)
        call(q, k, v, dropout_p=0.0)
        assert torch.equal(torch.rand(4), want), call


def test_jit_trace_of_a_dropout_call_with_a_seed_traces():
    # API.md §8: tracing refuses a dropout draw from torch's generator (it
    # would be fixed in the trace), not a dropout whose seed= is given
    q, k, v = (torch.from_numpy(x) for x in _qkv(dtype=np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(lambda a, b, c: f(a, b, c, dropout_p=0.5, seed=3), (q, k, v),
                                 check_trace=False)
        with pytest.raises(RuntimeError, match="pass seed="):
            torch.jit.trace(lambda a, b, c: f(a, b, c, dropout_p=0.5), (q, k, v),
                            check_trace=False)
    q2, k2, v2 = (torch.from_numpy(x) for x in _qkv(dtype=np.float32, seed=5))
    assert torch.equal(traced(q2, k2, v2), f(q2, k2, v2, dropout_p=0.5, seed=3))


# ---------------------------------------------------------------- attn_mask with is_causal (§4a)

def _pair_call():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g) for _ in range(3))
    return q, k, v, torch.rand(5, 5, generator=g) > 0.3


def test_a_numpy_true_is_causal_with_a_mask_is_true_on_torchs_fused_path():
    # API.md §4a: 4-D tensors torch's fused CPU kernel takes apply both the
    # mask and the causality; np.True_ is True (a flag's truth value)
    q, k, v, m = _pair_call()
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=True)
    torch.testing.assert_close(f(q, k, v, attn_mask=m, is_causal=np.True_), want,
                               rtol=0, atol=1e-5)


def test_a_mask_with_is_causal_where_sdpa_kernel_leaves_no_cpu_kernel_is_refused():
    # API.md §4a: both apply only where torch's own choice takes its fused
    # kernel; a choice with no CPU kernel is torch's RuntimeError (the twin's
    # rule), while a call with no query returns before the check
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v, m = _pair_call()
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        for call in (F.scaled_dot_product_attention, f):
            with pytest.raises(RuntimeError):
                call(q, k, v, attn_mask=m, is_causal=True)
        empty = q[:, :, :0]
        want = F.scaled_dot_product_attention(empty, k, v, attn_mask=m[:0], is_causal=True)
        assert f(empty, k, v, attn_mask=m[:0], is_causal=True).shape == want.shape


# ---------------------------------------------------------------- head_mask (§4a)

@pytest.mark.parametrize("kind", ["array", "tensor"])
def test_a_head_mask_of_one_factor_scales_a_two_dimensional_call(kind):
    # API.md §4a: head_mask (Hq,); a 2-D call (L, E) has one head
    q, k, v = _qkv((4, 8), S=5)
    want = _torch(q, k, v) * 0.5
    if kind == "tensor":
        q, k, v = (torch.from_numpy(x) for x in (q, k, v))
    out = f(q, k, v, head_mask=np.array([0.5]))
    np.testing.assert_allclose(np.asarray(out), want, rtol=0, atol=1e-10)



def test_the_backward_reads_the_head_mask_the_forward_used():
    # API.md §4a: head_mask's factors are the forward's; a NumPy head mask
    # changed in place before the backward does not change the gradients
    q, k, v = (torch.from_numpy(x).requires_grad_() for x in _qkv((3, 4, 8)))
    hm = np.array([0.5, 2.0, 1.0])
    want = torch.autograd.grad(f(q, k, v, head_mask=hm.copy()).sum(), (q, k, v))
    out = f(q, k, v, head_mask=hm)
    hm[:] = 0.0
    for a, b in zip(torch.autograd.grad(out.sum(), (q, k, v)), want):
        assert torch.equal(a, b)
