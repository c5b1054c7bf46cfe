"""Sliding windows (issue 14 point 1): ``window=(left, right)`` on every call
against torch given the equivalent dense mask: the module call and its
gradients against nn.MultiheadAttention, the SDPA twin against
F.scaled_dot_product_attention, the torch adapter against the same module
with the dense mask, the trace's masked scores; odd sizes (windows wider
than S, empty windows -> the fully-masked-row rule), combined with every
other mask and both causal alignments; float32 and float64; errors named.

Legend: B batch, Sq/Sk query/key length, E = d_model, H = n_heads.
"""
import os

import numpy as np
import pytest

import mha_ext
from _support import require_torch

TOL = {"float32": 2e-5, "float64": 1e-10}
DTYPES = ["float32", "float64"]
KEYS = ("W_q", "W_k", "W_v")


@pytest.fixture(scope="module")
def torch():
    return require_torch()


def dense_blocked(Sq, Sk, window, causal=False):
    """The window (and causality) as a dense (Sq, Sk) bool mask, True =
    blocked: what the kernels must never build."""
    off = Sk - Sq if causal == "lower_right" else 0
    d = np.arange(Sk)[None, :] - (np.arange(Sq)[:, None] + off)   # j - (i + off)
    blocked = np.zeros((Sq, Sk), dtype=bool)
    left, right = window
    if left is not None:
        blocked |= d < -left
    if right is not None:
        blocked |= d > right
    if causal:
        blocked |= d > 0
    return blocked


def close(got, want, dtype, what=""):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, what
    scale = max(1.0, float(np.abs(np.nan_to_num(want)).max(initial=0.0)))
    np.testing.assert_allclose(got, want, atol=TOL[dtype] * scale, rtol=TOL[dtype],
                               err_msg=what)


def torch_mha(torch, m, dtype):
    """nn.MultiheadAttention holding m's parameters (E == kdim == vdim)."""
    st = m.state_dict()
    t = torch.nn.MultiheadAttention(m.d_model, m.n_heads, batch_first=True,
                                    dtype=getattr(torch, dtype))
    with torch.no_grad():
        t.in_proj_weight.copy_(torch.tensor(np.concatenate([st[f"{k}.weight"] for k in KEYS])))
        t.in_proj_bias.copy_(torch.tensor(np.concatenate([st[f"{k}.bias"] for k in KEYS])))
        t.out_proj.weight.copy_(torch.tensor(st["W_o.weight"]))
        t.out_proj.bias.copy_(torch.tensor(st["W_o.bias"]))
    return t


CASES = [  # B, Sq, Sk, window, is_causal
    (2, 13, 13, (3, 2), False),
    (2, 13, 13, (4, 0), True),
    (2, 13, 13, (2, None), True),          # causal: right is 0 anyway
    (1, 7, 11, (None, 3), False),
    (2, 7, 11, (2, 1), "lower_right"),     # the diagonal shifted by Sk - Sq
    (1, 9, 9, (100, 100), False),          # wider than S
    (2, 300, 300, (40, 7), False),         # several key blocks skipped
    (1, 270, 300, (50, 0), "lower_right"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,Sq,Sk,window,causal", CASES)
@pytest.mark.parametrize("other", [None, "padding", "float"])
def test_module_matches_torch_mha_with_the_dense_mask(torch, dtype, B, Sq, Sk, window, causal,
                                                      other):
    """Output, weights and every gradient (parameters, query, key, value,
    through dL/d weights too) of the windowed call equal
    nn.MultiheadAttention's given the window as a dense mask, alone and with
    a key padding mask or an additive float mask."""
    E, H = 16, 2
    m = mha_ext.MultiHeadAttention(E, H, dtype=dtype, seed=1).eval()
    t = torch_mha(torch, m, dtype)
    rng = np.random.default_rng(Sq * 7 + Sk)
    q = rng.standard_normal((B, Sq, E)).astype(dtype)
    k = rng.standard_normal((B, Sk, E)).astype(dtype)
    v = rng.standard_normal((B, Sk, E)).astype(dtype)
    blocked = dense_blocked(Sq, Sk, window, causal)
    kw, tmask, tkpm = {}, blocked, None
    if other == "padding":
        kpm = np.zeros((B, Sk), dtype=bool)
        kpm[:, -2:] = True
        kw["key_padding_mask"] = kpm
        tkpm = torch.tensor(kpm)
    elif other == "float":
        add = rng.standard_normal((Sq, Sk)).astype(dtype)
        kw["attn_mask"] = add
        tmask = np.where(blocked, -np.inf, add).astype(dtype)
    if B == 1 and Sq == 300:      # with need_weights=False: the online path
        kw["need_weights"] = False
    # no row may be empty here: torch's module makes NaN of them differently
    assert not blocked.all(axis=1).any()

    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    out_t, w_t = t(tq, tk, tv, attn_mask=torch.tensor(tmask), key_padding_mask=tkpm,
                   need_weights=True, average_attn_weights=False)
    g = rng.standard_normal(out_t.shape).astype(dtype)
    gw = rng.standard_normal(w_t.shape).astype(dtype)
    loss = (out_t * torch.tensor(g)).sum()
    if kw.get("need_weights", True):
        loss = loss + (w_t * torch.tensor(gw)).sum()
    loss.backward()

    out, w = m(q, k, v, window=window, is_causal=causal, **kw)
    close(out, out_t.detach().numpy(), dtype, "output")
    if kw.get("need_weights", True):
        close(w, w_t.detach().numpy(), dtype, "weights")
    else:
        assert w is None
    ctx = m.forward_train(q, k, v, window=window, is_causal=causal, **kw)
    np.testing.assert_array_equal(ctx.output, out)
    grads = m.backward(ctx, g, gw if kw.get("need_weights", True) else None)
    dw, db = t.in_proj_weight.grad.numpy(), t.in_proj_bias.grad.numpy()
    for n, key in enumerate(KEYS):
        close(grads[f"{key}.weight"], dw[n * E:(n + 1) * E], dtype, f"{key}.weight")
        close(grads[f"{key}.bias"], db[n * E:(n + 1) * E], dtype, f"{key}.bias")
    close(grads["W_o.weight"], t.out_proj.weight.grad.numpy(), dtype, "W_o.weight")
    close(grads["W_o.bias"], t.out_proj.bias.grad.numpy(), dtype, "W_o.bias")
    for name, x in (("query", tq), ("key", tk), ("value", tv)):
        close(grads[name], x.grad.numpy(), dtype, name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("masked_rows", ["nan", "zero"])
@pytest.mark.parametrize("window,causal", [((0, 0), False), ((1, 0), "lower_right"),
                                           ((2, 1), False), ((0, None), True)])
def test_empty_windows_follow_the_fully_masked_row_rule(dtype, masked_rows, window, causal):
    """Sq > Sk: rows whose window holds no key (or all of whose keys the
    padding mask blocks) are the blocked rows of masked_rows, in the call
    and its gradients, as with the dense mask; the C reference agrees."""
    m = mha_ext.MultiHeadAttention(8, 2, dtype=dtype, seed=3).eval()
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 9, 8)).astype(dtype)
    kv = rng.standard_normal((2, 4, 8)).astype(dtype)
    kpm = np.zeros((2, 4), dtype=bool)
    kpm[1, 0] = True
    blocked = dense_blocked(9, 4, window, causal)
    assert blocked.all(axis=1).any()          # the case has empty windows
    kw = dict(key_padding_mask=kpm, masked_rows=masked_rows)
    out, w = m(q, kv, kv, window=window, is_causal=causal, **kw)
    out_d, w_d = m(q, kv, kv, attn_mask=blocked, **kw)
    close(out, out_d, dtype, "output")
    close(w, w_d, dtype, "weights")
    np.testing.assert_array_equal(np.isnan(out), np.isnan(out_d))
    from mha_ext import _calls
    call = _calls.prepare(m, q, kv, kv, None, None, kpm, causal, True, False, masked_rows,
                          window=window)
    ref_out, ref_w = _calls.c_forward(m, call, reference=True)
    close(out, ref_out, dtype, "output vs the C reference")
    close(w, ref_w, dtype, "weights vs the C reference")
    g = rng.standard_normal(out.shape).astype(dtype)
    ga = m.backward(m.forward_train(q, kv, kv, window=window, is_causal=causal, **kw), g)
    gb = m.backward(m.forward_train(q, kv, kv, attn_mask=blocked, **kw), g)
    for name in ga:
        close(ga[name], gb[name], dtype, name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shapes,window,causal,gqa", [
    (((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 4)), (1, 2), False, False),
    (((2, 4, 9, 8), (2, 2, 6, 8), (2, 2, 6, 8)), (2, 0), "lower_right", True),   # empty rows
    (((1, 2, 300, 16), (1, 2, 300, 16), (1, 2, 300, 16)), (37, None), True, False),
    (((1, 2, 200, 16), (1, 1, 333, 16), (1, 1, 333, 8)), (None, 20), False, True),
    (((6, 8), (11, 8), (11, 3)), (1000, 1000), False, False),                   # wider than S
])
@pytest.mark.parametrize("mask", [None, "bool", "float"])
def test_sdpa_matches_torch_with_the_dense_mask(torch, dtype, shapes, window, causal, gqa,
                                                mask):
    """mha_ext.scaled_dot_product_attention(window=...) on tensors and arrays:
    output and d query, d key, d value equal torch's SDPA given the window
    (and causality) folded into attn_mask, with a bool or float mask on top."""
    F = torch.nn.functional
    g = torch.Generator().manual_seed(len(shapes[0]) + shapes[0][-2])
    dt = getattr(torch, dtype)
    q, k, v = (torch.randn(s, generator=g, dtype=dt).requires_grad_() for s in shapes)
    L, S = shapes[0][-2], shapes[1][-2]
    allow = torch.tensor(~dense_blocked(L, S, window, causal))
    kw, dense = {}, allow
    if mask == "bool":
        extra = torch.rand(L, S, generator=g) > 0.2
        kw["attn_mask"], dense = extra, allow & extra
    elif mask == "float":
        extra = torch.randn(L, S, generator=g, dtype=dt)
        kw["attn_mask"] = extra
        dense = extra.masked_fill(~allow, -float("inf"))
    if causal is True and mask is not None:
        causal = "lower_right" if L == S else causal   # torch refuses is_causal=True + a mask
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=gqa)
    got = mha_ext.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa,
                                               window=window, **kw)
    close(got.detach().numpy(), want.detach().numpy(), dtype, "output")
    npkw = {a: b.numpy() for a, b in kw.items()}
    arr = mha_ext.scaled_dot_product_attention(q.detach().numpy(), k.detach().numpy(),
                                               v.detach().numpy(), is_causal=causal,
                                               enable_gqa=gqa, window=window, **npkw)
    close(arr, want.detach().numpy(), dtype, "output on arrays")
    go = torch.randn(want.shape, generator=g, dtype=dt)
    gw = torch.autograd.grad(want, (q, k, v), go)
    gg = torch.autograd.grad(got, (q, k, v), go)
    for name, a, b in zip(("query", "key", "value"), gg, gw):
        close(a.numpy(), b.numpy(), dtype, name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_adapter_window_equals_the_dense_mask(torch, dtype):
    """mha_ext.torch.MultiHeadAttention(window=...) gives the output and the
    gradients (inputs and parameters) of the same module given the dense mask."""
    from mha_ext.torch import MultiHeadAttention
    torch.manual_seed(0)
    m = MultiHeadAttention(12, 3, dtype=getattr(torch, dtype), seed=2).eval()
    x = torch.randn(2, 10, 12, dtype=getattr(torch, dtype))
    res = []
    for kw in (dict(window=(2, 1)), dict(attn_mask=torch.tensor(dense_blocked(10, 10, (2, 1))))):
        xi = x.clone().requires_grad_()
        m.zero_grad()
        out, w = m(xi, **kw)
        (out.square().sum() + w.sum()).backward()
        res.append([out.detach().numpy(), w.detach().numpy(), xi.grad.numpy()] +
                   [p.grad.numpy().copy() for p in m.parameters()])
    for a, b in zip(*res):
        close(a, b, dtype)


def test_trace_shows_the_window_in_the_masked_scores():
    """The trace's masked scores are -inf exactly where the window blocks,
    the formula names it, and its output is the windowed call's."""
    m = mha_ext.MultiHeadAttention(8, 2, seed=0).eval()
    x = np.random.default_rng(0).standard_normal((1, 7, 8)).astype(np.float32)
    tr = m.trace(x, window=(2, 0))
    step = next(s for s in tr.steps if s.name == "masked scores")
    assert "window" in step.formula
    np.testing.assert_array_equal(np.isneginf(step.array[0, 0]), dense_blocked(7, 7, (2, 0)))
    np.testing.assert_array_equal(tr.output, m(x, window=(2, 0))[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_window_is_bit_identical(dtype):
    """window=None and (None, None) change nothing, bit for bit."""
    m = mha_ext.MultiHeadAttention(16, 4, dtype=dtype, seed=0).eval()
    x = np.random.default_rng(1).standard_normal((2, 70, 16)).astype(dtype)
    for causal in (False, True):
        for nw in (True, False):
            base = m(x, is_causal=causal, need_weights=nw)
            for w in (None, (None, None)):
                got = m(x, is_causal=causal, need_weights=nw, window=w)
                np.testing.assert_array_equal(got[0], base[0])
                if nw:
                    np.testing.assert_array_equal(got[1], base[1])


@pytest.mark.parametrize("bad,err,words", [
    ("wide", TypeError, "window must be None or a pair"),
    ((3,), TypeError, "window must be None or a pair"),
    ((-1, 0), ValueError, "window's left bound"),
    ((0, True), ValueError, "window's right bound"),
    ((1.5, 0), ValueError, "window's left bound"),
])
def test_window_errors_name_the_argument(bad, err, words):
    m = mha_ext.MultiHeadAttention(8, 2)
    x = np.zeros((1, 3, 8), np.float32)
    with pytest.raises(err, match=words):
        m(x, window=bad)
    with pytest.raises(err, match=words):
        mha_ext.scaled_dot_product_attention(x[None], x[None], x[None], window=bad)
    # the C methods refuse them too, whatever the Python layer passes
    with pytest.raises((TypeError, ValueError), match="window"):
        m._forward(x, x, x, window=bad if bad != (1.5, 0) else (1.5, 0))


MEMORY_PROBE = r"""
import resource, sys
import os

import numpy as np
import mha_ext
S = 4096
m = mha_ext.MultiHeadAttention(64, 2, seed=0)
x = np.random.default_rng(0).standard_normal((1, S, 64)).astype(np.float32)
m(x[:, :64], window=(64, 0), is_causal=True, need_weights=False)   # warm the pools
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
m(x, window=(64, 0), is_causal=True, need_weights=False)
ctx = m.forward_train(x, window=(64, 0), is_causal=True, need_weights=False)
m.backward(ctx, np.ones_like(x))
mha_ext.scaled_dot_product_attention(x[None], x[None], x[None], window=(64, 0))
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((after - before) * 1024)
"""


def test_windowed_calls_build_no_sq_by_sk_buffer(tmp_path):
    """need_weights=False with a window, S 4096: the call, forward_train +
    backward and the SDPA twin raise the peak RSS by far less than one
    (S, S) float32 buffer (64 MiB): no dense mask or score matrix is made."""
    import subprocess
    import sys
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(mha_ext.__file__)), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", MEMORY_PROBE], capture_output=True, text=True,
                         timeout=120, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    grew = int(run.stdout.split()[-1])
    assert grew < 16 * 2**20, f"peak RSS grew by {grew / 2**20:.1f} MiB"


@pytest.mark.parametrize("bad", ["k", "v", "grad"])
def test_nan_outside_the_window_reaches_the_gradients_as_with_the_dense_mask(bad):
    """A NaN or inf in a key or value no query's window holds, or in the
    incoming gradient, reaches the gradients exactly as with the dense mask
    (0·NaN): the skipping of the window is off then."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 4, 8))
    k = rng.standard_normal((1, 2, 300, 8))
    v = rng.standard_normal((1, 2, 300, 8))
    go = rng.standard_normal((1, 2, 4, 8))
    if bad == "k":
        k[0, 1, 5] = np.nan            # key 5: outside every window below
    elif bad == "v":
        v[0, 0, 7] = np.inf
    else:
        go[0, 1, 2, 3] = np.nan
    from mha_ext import _core
    blocked = dense_blocked(4, 300, (10, 0), "lower_right")
    kw = dict(is_causal="lower_right", zero_rows=True)
    got = _core._sdpa_backward(q, k, v, go, window=(10, 0), **kw)
    want = _core._sdpa_backward(q, k, v, go, masks=[(0, blocked)], **kw)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
