"""Block-sparse layouts (issue 14 point 2): ``layout=BlockLayout(...)`` on
every call against torch given the equivalent dense mask: the module call
and every gradient against nn.MultiheadAttention, the SDPA twin against
F.scaled_dot_product_attention, both torch classes, the float64 C
reference; odd sizes (blocks not dividing S, Sq != Sk, per-head and
per-batch layouts), empty rows -> the fully-masked-row rule, combined with
every other mask, both causal alignments, windows, head masks and dropout;
the trace and plot_heads; errors named (the type and its pattern helpers
alone: tests/test_layout.py).

Legend: B batch, Sq/Sk query/key length, E = d_model, H = n_heads,
nqb/nkb query/key blocks.
"""
import os

import numpy as np
import pytest

import mha_ext
from mha_ext import layout as L
from mha_ext.layout import BlockLayout
from _support import require_torch
from test_window import close, dense_blocked, torch_mha, DTYPES, KEYS


@pytest.fixture(scope="module")
def torch():
    return require_torch()


def random_layout(shape, block_size, seed, p=0.6, full_rows=True):
    """A random layout of `shape` (..., nqb, nkb); with full_rows each query
    block keeps at least one key block (no empty row from the layout)."""
    rng = np.random.default_rng(seed)
    keep = rng.random(shape) < p
    if full_rows:
        idx = rng.integers(0, shape[-1], size=shape[:-1])
        np.put_along_axis(keep, idx[..., None], True, axis=-1)
    return BlockLayout(keep, block_size)


def blocked4(lay, B, H, Sq, Sk):
    """The layout as a dense (B, H, Sq, Sk) bool mask, True = blocked."""
    d = ~lay.to_dense(Sq, Sk)
    return np.broadcast_to(d.reshape((1,) * (4 - d.ndim) + d.shape), (B, H, Sq, Sk))


# B, Sq, Sk, layout shape ("bc" broadcast, "h" per head, "bh" per batch and head),
# block size, window, is_causal
CASES = [
    (2, 13, 13, "bc", 4, None, False),
    (2, 13, 13, "h", (3, 5), None, True),
    (1, 7, 11, "bh", (2, 3), (None, 3), False),
    (2, 7, 11, "bc", (3, 2), (4, 1), "lower_right"),
    (1, 9, 9, "h", 100, None, False),                 # one block wider than S
    (2, 300, 300, "bc", 64, None, False),             # several key runs skipped
    (1, 270, 300, "h", (48, 37), (120, 0), "lower_right"),
    (1, 300, 257, "bh", (40, 50), None, True),
]


def _layout_for(kind, B, H, Sq, Sk, bs, seed):
    q_b, k_b = (bs, bs) if isinstance(bs, int) else bs
    nqb, nkb = -(-Sq // q_b), -(-Sk // k_b)
    shape = {"bc": (nqb, nkb), "h": (H, nqb, nkb), "bh": (B, H, nqb, nkb)}[kind]
    return random_layout(shape, bs, seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,Sq,Sk,kind,bs,window,causal", CASES)
@pytest.mark.parametrize("other", [None, "padding", "float"])
def test_module_matches_torch_mha_with_the_dense_mask(torch, dtype, B, Sq, Sk, kind, bs, window,
                                                      causal, other):
    """Output, weights and every gradient (parameters, query, key, value,
    through dL/d weights too) of the call with a layout equal
    nn.MultiheadAttention's given the layout (and window, causality) as a
    dense (B*H, Sq, Sk) mask, alone and with a key padding or float mask."""
    E, H = 16, 2
    m = mha_ext.MultiHeadAttention(E, H, dtype=dtype, seed=1).eval()
    t = torch_mha(torch, m, dtype)
    rng = np.random.default_rng(Sq * 7 + Sk)
    q = rng.standard_normal((B, Sq, E)).astype(dtype)
    k = rng.standard_normal((B, Sk, E)).astype(dtype)
    v = rng.standard_normal((B, Sk, E)).astype(dtype)
    lay = _layout_for(kind, B, H, Sq, Sk, bs, Sq + Sk)
    # no row may be empty here (torch's module makes NaN of them
    # differently): every query keeps the block of its diagonal key i + off
    keep = lay.keep.copy()
    i = np.arange(Sq)
    j = np.clip(i + (Sk - Sq if causal == "lower_right" else 0), 0, Sk - 1)
    keep[..., i // lay.q_block, j // lay.k_block] = True
    lay = BlockLayout(keep, bs)
    blocked = blocked4(lay, B, H, Sq, Sk) | dense_blocked(Sq, Sk, window or (None, None), causal)
    assert not blocked.all(axis=-1).any()
    if lay.keep.shape[-2:] != (1, 1):                    # the layout blocks something
        assert blocked4(lay, B, H, Sq, Sk).any()
    kw, tmask, tkpm = {}, blocked, None
    if other == "padding":
        kpm = np.zeros((B, Sk), dtype=bool)
        kpm[:, -2:] = True
        kw["key_padding_mask"] = kpm
        tkpm = torch.tensor(kpm)
        if (blocked | kpm[:, None, None, :]).all(axis=-1).any():
            pytest.skip("the padding empties a row")
    elif other == "float":
        add = rng.standard_normal((Sq, Sk)).astype(dtype)
        kw["attn_mask"] = add
        tmask = np.where(blocked, -np.inf, add).astype(dtype)
    if Sq >= 270:                # need_weights=False: the online path
        kw["need_weights"] = False

    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    tm = torch.tensor(np.ascontiguousarray(np.broadcast_to(tmask, (B, H, Sq, Sk)))
                      .reshape(B * H, Sq, Sk))
    out_t, w_t = t(tq, tk, tv, attn_mask=tm, key_padding_mask=tkpm, need_weights=True,
                   average_attn_weights=False)
    g = rng.standard_normal(out_t.shape).astype(dtype)
    gw = rng.standard_normal(w_t.shape).astype(dtype)
    loss = (out_t * torch.tensor(g)).sum()
    nw = kw.get("need_weights", True)
    if nw:
        loss = loss + (w_t * torch.tensor(gw)).sum()
    loss.backward()

    out, w = m(q, k, v, layout=lay, window=window, is_causal=causal, **kw)
    close(out, out_t.detach().numpy(), dtype, "output")
    if nw:
        close(w, w_t.detach().numpy(), dtype, "weights")
    else:
        assert w is None
    for save in (True, False):
        ctx = m.forward_train(q, k, v, layout=lay, window=window, is_causal=causal,
                              save_projections=save, **kw)
        np.testing.assert_array_equal(ctx.output, out)
        grads = m.backward(ctx, g, gw if nw else None)
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
@pytest.mark.parametrize("causal", [False, True, "lower_right"])
def test_empty_rows_follow_the_fully_masked_row_rule(dtype, masked_rows, causal):
    """Query blocks the layout leaves empty (and rows emptied by the layout
    with causality and padding) are the blocked rows of masked_rows, in the
    call and its gradients, as with the dense mask; the C reference agrees."""
    m = mha_ext.MultiHeadAttention(8, 2, dtype=dtype, seed=3).eval()
    rng = np.random.default_rng(5)
    Sq, Sk = 9, 7
    q = rng.standard_normal((2, Sq, 8)).astype(dtype)
    kv = rng.standard_normal((2, Sk, 8)).astype(dtype)
    kpm = np.zeros((2, Sk), dtype=bool)
    kpm[1, 0] = True
    keep = np.array([[1, 0, 1], [0, 0, 0], [0, 1, 1], [1, 0, 0], [0, 0, 1]], bool)   # (2, 3)
    lay = BlockLayout(keep, (2, 3))
    blocked = ~lay.to_dense(Sq, Sk)
    assert blocked.all(axis=1).any()          # the case has empty rows
    kw = dict(key_padding_mask=kpm, masked_rows=masked_rows, is_causal=causal)
    out, w = m(q, kv, kv, layout=lay, **kw)
    out_d, w_d = m(q, kv, kv, mask=blocked, **kw)
    close(out, out_d, dtype, "output")
    close(w, w_d, dtype, "weights")
    np.testing.assert_array_equal(np.isnan(out), np.isnan(out_d))
    out_o, _ = m(q, kv, kv, layout=lay, need_weights=False, **kw)   # the online path
    close(out_o, out_d, dtype, "output without weights")
    from mha_ext import _calls
    call = _calls.prepare(m, q, kv, kv, None, None, kpm, causal, True, False, masked_rows,
                          layout=lay)
    ref_out, ref_w = _calls.c_forward(m, call, reference=True)
    close(out, ref_out, dtype, "output vs the C reference")
    close(w, ref_w, dtype, "weights vs the C reference")
    g = rng.standard_normal(out.shape).astype(dtype)
    ga = m.backward(m.forward_train(q, kv, kv, layout=lay, **kw), g)
    gb = m.backward(m.forward_train(q, kv, kv, mask=blocked, **kw), g)
    for name in ga:
        close(ga[name], gb[name], dtype, name)
        np.testing.assert_array_equal(np.isnan(ga[name]), np.isnan(gb[name]), err_msg=name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("extra", ["bias_kv", "zero_attn", "head_mask", "dropout"])
def test_layout_with_extra_keys_head_mask_and_dropout_equals_the_dense_mask(dtype, extra):
    """With add_bias_kv / add_zero_attn (their keys never blocked, as for
    the dense mask), a head mask, or dropout (the same stream), the layout
    gives the dense mask's output, weights and gradients, and the float64
    C reference's."""
    kw = {"bias_kv": dict(add_bias_kv=True), "zero_attn": dict(add_zero_attn=True)}.get(extra, {})
    m = mha_ext.MultiHeadAttention(12, 3, dtype=dtype, seed=4, **kw).eval()
    rng = np.random.default_rng(9)
    Sq, Sk = 130, 100
    q = rng.standard_normal((2, Sq, 12)).astype(dtype)
    kv = rng.standard_normal((2, Sk, 12)).astype(dtype)
    lay = L.bigbird(Sq, Sk, (16, 20), heads=3, seed=1)
    call_kw = dict(is_causal="lower_right")
    if extra == "head_mask":
        call_kw["head_mask"] = np.array([1.0, 0.0, 0.5])
    train_kw = dict(call_kw, dropout=0.3, dropout_counter=5) if extra == "dropout" else call_kw
    dense = blocked4(lay, 2, 3, Sq, Sk)
    out, w = m(q, kv, kv, layout=lay, **call_kw)
    out_d, w_d = m(q, kv, kv, mask=dense, **call_kw)
    close(out, out_d, dtype, "output")
    close(w, w_d, dtype, "weights")
    g = rng.standard_normal(out.shape).astype(dtype)
    gw = rng.standard_normal(w.shape).astype(dtype)
    ca = m.forward_train(q, kv, kv, layout=lay, **train_kw)
    cb = m.forward_train(q, kv, kv, mask=dense, **train_kw)
    close(ca.output, cb.output, dtype, "train output")
    ga, gb = m.backward(ca, g, gw), m.backward(cb, g, gw)
    for name in ga:
        close(ga[name], gb[name], dtype, name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shapes,bs,causal,gqa,kind", [
    (((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 4)), (2, 3), False, False, "bc"),
    (((2, 4, 9, 8), (2, 2, 6, 8), (2, 2, 6, 8)), (4, 2), "lower_right", True, "h"),
    (((1, 2, 300, 16), (1, 2, 300, 16), (1, 2, 300, 16)), 64, True, False, "bh"),
    (((1, 2, 200, 16), (1, 1, 333, 16), (1, 1, 333, 8)), (48, 37), False, True, "h"),
    (((6, 8), (11, 8), (11, 3)), 1000, False, False, "bc"),                 # wider than S
])
@pytest.mark.parametrize("mask", [None, "bool", "float"])
def test_sdpa_matches_torch_with_the_dense_mask(torch, dtype, shapes, bs, causal, gqa, kind,
                                                mask):
    """mha_ext.scaled_dot_product_attention(layout=...) on tensors and
    arrays: output and d query, d key, d value equal torch's SDPA given the
    layout (and causality) folded into attn_mask, with a bool or float mask
    on top; rows the layout empties give 0 as torch's do."""
    F = torch.nn.functional
    g = torch.Generator().manual_seed(len(shapes[0]) + shapes[0][-2])
    dt = getattr(torch, dtype)
    q, k, v = (torch.randn(s, generator=g, dtype=dt).requires_grad_() for s in shapes)
    Lq, S = shapes[0][-2], shapes[1][-2]
    B = shapes[0][0] if len(shapes[0]) == 4 else 1
    Hq = shapes[0][-3] if len(shapes[0]) >= 3 else 1
    lay = _layout_for(kind, B, Hq, Lq, S, bs, Lq + S)
    allow = torch.tensor(~blocked4(lay, B, Hq, Lq, S) & ~dense_blocked(Lq, S, (None, None),
                                                                        causal))
    if len(shapes[0]) == 2:
        allow = allow[0, 0]
    kw, dense = {}, allow
    if mask == "bool":
        extra = torch.rand(Lq, S, generator=g) > 0.2
        kw["attn_mask"], dense = extra, allow & extra
    elif mask == "float":
        extra = torch.randn(Lq, S, generator=g, dtype=dt)
        kw["attn_mask"] = extra
        dense = extra.masked_fill(~allow, -float("inf"))
    if causal is True and mask is not None:
        causal = "lower_right" if Lq == S else causal   # torch refuses is_causal=True + a mask
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=gqa)
    # torch gives NaN for a row with no visible key; ours (and its C path) give 0
    empty = ~(dense if dense.dtype == torch.bool else dense > -float("inf")).any(-1)
    want = want.masked_fill(empty.expand(want.shape[:-1])[..., None], 0.0)
    got = mha_ext.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa,
                                               layout=lay, **kw)
    close(got.detach().numpy(), want.detach().numpy(), dtype, "output")
    npkw = {a: b.numpy() for a, b in kw.items()}
    arr = mha_ext.scaled_dot_product_attention(q.detach().numpy(), k.detach().numpy(),
                                               v.detach().numpy(), is_causal=causal,
                                               enable_gqa=gqa, layout=lay, **npkw)
    close(arr, want.detach().numpy(), dtype, "output on arrays")
    go = torch.randn(want.shape, generator=g, dtype=dt)
    gw = torch.autograd.grad(want, (q, k, v), go)
    gw = [x.nan_to_num(0.0) for x in gw]
    gg = torch.autograd.grad(got, (q, k, v), go)
    for name, a, b in zip(("query", "key", "value"), gg, gw):
        close(a.numpy(), b.numpy(), dtype, name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_classes_layout_equals_the_dense_mask(torch, dtype):
    """mha_ext.torch.MultiHeadAttention(layout=...) and the torch-signature
    mha_ext.torch.MultiheadAttention(layout=...) give the output and the
    gradients (inputs and parameters) of torch's nn.MultiheadAttention with
    the dense (B*H, Sq, Sk) mask."""
    from mha_ext.torch import MultiHeadAttention, MultiheadAttention
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    B, S, E, H = 2, 23, 12, 3
    lay = random_layout((H, 4, 3), (6, 8), 3)
    dense = torch.tensor(np.ascontiguousarray(blocked4(lay, B, H, S, S)).reshape(B * H, S, S))
    x = torch.randn(B, S, E, dtype=dt)
    ref = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=dt)
    ours = MultiheadAttention(E, H, batch_first=True, dtype=dt)
    ours.load_state_dict(ref.state_dict())
    seed_style = MultiHeadAttention(E, H, dtype=dt, seed=2)
    res = {}
    for name, mod, kw in (("torch", ref, dict(attn_mask=dense)),
                          ("ours", ours, dict(layout=lay)),
                          ("seed dense", seed_style, dict(mask=dense.reshape(B, H, S, S))),
                          ("seed layout", seed_style, dict(layout=lay))):
        xi = x.clone().requires_grad_()
        mod.zero_grad()
        if mod is seed_style:
            out, w = mod(xi, **kw)
        else:
            out, w = mod(xi, xi, xi, average_attn_weights=False, **kw)
        (out.square().sum() + (w * w).sum()).backward()
        res[name] = [out.detach().numpy(), w.detach().numpy(), xi.grad.numpy()] + \
            [p.grad.numpy().copy() for p in mod.parameters()]
    for a, b in zip(res["ours"], res["torch"]):
        close(a, b, dtype)
    for a, b in zip(res["seed layout"], res["seed dense"]):
        close(a, b, dtype)


@pytest.mark.parametrize("bad", ["k", "v", "grad"])
def test_nan_outside_the_layout_reaches_the_gradients_as_with_the_dense_mask(bad):
    """A NaN or inf in a key or value whose block no query keeps, or in the
    incoming gradient, reaches the outputs and gradients exactly as with the
    dense mask (0·NaN): the skipping of the layout is off then."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 100, 8))
    k = rng.standard_normal((1, 2, 300, 8))
    v = rng.standard_normal((1, 2, 300, 8))
    go = rng.standard_normal((1, 2, 100, 8))
    lay = L.local_blocks(100, 300, 50, width=0)        # keys 100..299: no query keeps them
    if bad == "k":
        k[0, 1, 250] = np.nan
    elif bad == "v":
        v[0, 0, 270] = np.inf
    else:
        go[0, 1, 2, 3] = np.nan
    from mha_ext import _core
    blocked = ~lay.to_dense(100, 300)
    c_lay = (lay.fitted(1, 2, 100, 300), 50, 50)
    got = _core._sdpa(q, k, v, layout=c_lay, zero_rows=True)[0]
    want = _core._sdpa(q, k, v, masks=[(0, blocked)], zero_rows=True)[0]
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    got = _core._sdpa_backward(q, k, v, go, layout=c_lay, zero_rows=True)
    want = _core._sdpa_backward(q, k, v, go, masks=[(0, blocked)], zero_rows=True)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
def test_full_layout_is_bit_identical_to_none(dtype):
    """A layout keeping every block changes nothing, bit for bit, on both
    attention paths and the backward."""
    m = mha_ext.MultiHeadAttention(16, 4, dtype=dtype, seed=0).eval()
    x = np.random.default_rng(1).standard_normal((2, 70, 16)).astype(dtype)
    full = BlockLayout(np.ones((3, 3), bool), 32)
    for nw in (True, False):
        base = m(x, need_weights=nw)
        got = m(x, need_weights=nw, layout=full)
        np.testing.assert_array_equal(got[0], base[0])
        if nw:
            np.testing.assert_array_equal(got[1], base[1])
    g = np.ones_like(x)
    ga = m.backward(m.forward_train(x, layout=full), g)
    gb = m.backward(m.forward_train(x), g)
    for name in ga:
        np.testing.assert_array_equal(ga[name], gb[name])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_causal", [False, True])
def test_layout_rows_do_not_depend_on_the_other_queries(dtype, is_causal):
    """A row's bits with a layout are those of the same row in a call of
    fewer queries (the key blocks computed for a block of queries that other
    rows keep change no row's sums): the prefix of 37 queries of a 600-query
    call, whose first block of tasks mixes rows of different layout rows."""
    m = mha_ext.MultiHeadAttention(64, 4, dtype=dtype, seed=0).eval()
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 600, 64)).astype(dtype)
    lay = random_layout((4, 19, 19), 32, seed=5, p=0.3)
    full = m(x, x, x, need_weights=False, is_causal=is_causal, layout=lay)[0]
    part = BlockLayout(lay.keep[:, :2], 32)  # the 2 query blocks of 37 queries
    got = m(x[:, :37], x, x, need_weights=False, is_causal=is_causal, layout=part)[0]
    np.testing.assert_array_equal(got, full[:, :37])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Sq", [1, 5, 300])
def test_layout_with_grouped_query_heads_equals_the_dense_mask(dtype, Sq):
    """n_kv_heads < n_heads with a per-head layout: the same bits as the
    equivalent dense bool mask (both paths, few queries too: the grouped
    decode tasks are off with a layout), and close to the reference."""
    m = mha_ext.MultiHeadAttention(32, 4, n_kv_heads=2, dtype=dtype, seed=1).eval()
    rng = np.random.default_rng(4)
    q = rng.standard_normal((2, Sq, 32)).astype(dtype)
    kv = rng.standard_normal((2, 700, 32)).astype(dtype)
    nqb = -(-Sq // 16)
    lay = random_layout((4, nqb, 44), 16, seed=6, p=0.2)
    dense = blocked4(lay, 2, 4, Sq, 700)
    for nw in (False, True):
        got = m(q, kv, kv, need_weights=nw, layout=lay)
        ref = m(q, kv, kv, dense, need_weights=nw)
        np.testing.assert_array_equal(got[0], ref[0])
    tol = 1e-5 if dtype == "float32" else 1e-12
    ref_out = m._forward(q, kv, kv, masks=[], reference=True, need_weights=False,
                         layout=(lay.keep[None], 16, 16))[0]
    np.testing.assert_allclose(got[0], ref_out, rtol=tol, atol=tol)


def test_layout_and_cache_do_not_combine():
    m = mha_ext.MultiHeadAttention(16, 2, seed=0).eval()
    cache = m.new_cache(1, 8)
    x = np.zeros((1, 4, 16), np.float32)
    with pytest.raises(ValueError, match="layout= and cache= do not combine"):
        m(x, cache=cache, layout=BlockLayout(np.ones((1, 1), bool), 4))
    assert cache.length == 0


def test_layouts_that_do_not_fit_the_call_are_refused():
    m = mha_ext.MultiHeadAttention(8, 2)
    x = np.zeros((2, 10, 8), np.float32)
    with pytest.raises(ValueError, match="query blocks"):
        m(x, layout=BlockLayout(np.ones((2, 3), bool), 4))            # 10 // 4 -> 3 blocks
    with pytest.raises(ValueError, match="heads axis is 3"):
        m(x, layout=BlockLayout(np.ones((3, 3, 3), bool), 4))
    with pytest.raises(ValueError, match="batch axis is 3"):
        m(x, layout=BlockLayout(np.ones((3, 2, 3, 3), bool), 4))
    with pytest.raises(TypeError, match="BlockLayout"):
        m(x, layout=np.ones((3, 3), bool))                         # a layout is never a mask
    with pytest.raises(ValueError, match="query blocks"):
        mha_ext.scaled_dot_product_attention(x[None], x[None], x[None],
                                             layout=BlockLayout(np.ones((2, 3), bool), 4))
    # the C methods check what reaches them too
    with pytest.raises(ValueError, match="does not fit"):
        m._forward(x, x, x, layout=(np.ones((1, 1, 2, 3), bool), 4, 4))
    with pytest.raises(TypeError, match="bool or uint8"):
        m._forward(x, x, x, layout=(np.ones((1, 1, 3, 3), np.float32), 4, 4))
    with pytest.raises(ValueError, match="q_block must be positive"):
        m._forward(x, x, x, layout=(np.ones((1, 1, 3, 3), bool), 0, 4))
    with pytest.raises(TypeError, match="layout must be None or a tuple"):
        m._forward(x, x, x, layout=np.ones((1, 1, 3, 3), bool))


# ---------------------------------------------------------------- display

def test_trace_shows_the_layout_in_the_masked_scores():
    """The trace's masked scores are -inf exactly where the layout blocks,
    the formula names it with its shape and density, the output is the
    call's, and plot_heads draws those cells hatched."""
    m = mha_ext.MultiHeadAttention(8, 2, seed=0).eval()
    x = np.random.default_rng(0).standard_normal((1, 11, 8)).astype(np.float32)
    lay = L.global_local(11, 11, 3, width=0)
    tr = m.trace(x, layout=lay, is_causal=True)
    step = next(s for s in tr.steps if s.name == "masked scores")
    assert "layout 4×4 blocks of 3×3" in step.formula and "density" in step.formula
    want = ~lay.to_dense(11, 11) | dense_blocked(11, 11, (None, None), True)
    np.testing.assert_array_equal(np.isneginf(step.array[0, 0]), want)
    np.testing.assert_array_equal(tr.output, m(x, layout=lay, is_causal=True)[0])
    pytest.importorskip("matplotlib")
    from matplotlib.patches import PathPatch
    for fig, cells in ((mha_ext.plot_heads(tr), want),
                       (mha_ext.plot_heads(m(x, layout=lay)[1], blocked=lay),
                        ~lay.to_dense(11, 11))):
        # the first panel's hatching: one path of rectangles (5 vertices each)
        hatched = [p for p in fig.axes[0].patches
                   if isinstance(p, PathPatch) and p.get_hatch() == "////"]
        assert len(hatched) == 1, "no hatched cells drawn"
        drawn = np.zeros((11, 11), dtype=int)
        for r in hatched[0].get_path().vertices.reshape(-1, 5, 2) + 0.5:
            (x0, y0), (x1, y1) = r[0].astype(int), r[2].astype(int)
            drawn[y0:y1, x0:x1] += 1
        np.testing.assert_array_equal(drawn, cells.astype(int))


def test_trace_lower_right_and_scale():
    """trace(is_causal="lower_right", scale=...) works (issue 14 point D):
    the masked scores block j > i + Sk - Sq, and the NumPy replay equals
    the call."""
    m = mha_ext.MultiHeadAttention(8, 2, seed=0).eval()
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 5, 8)).astype(np.float32)
    kv = rng.standard_normal((2, 9, 8)).astype(np.float32)
    tr = m.trace(q, kv, kv, is_causal="lower_right", scale=0.3, window=(3, None))
    step = next(s for s in tr.steps if s.name == "masked scores")
    want = dense_blocked(5, 9, (3, None), "lower_right")
    np.testing.assert_array_equal(np.isneginf(step.array[1, 0]), want)
    close(tr.info["numpy_output"], tr.output, "float32")
    np.testing.assert_array_equal(
        tr.output, m(q, kv, kv, is_causal="lower_right", scale=0.3, window=(3, None))[0])


MEMORY_PROBE = r"""
import resource
import numpy as np
import mha_ext
from mha_ext import layout as L
S = 4096
m = mha_ext.MultiHeadAttention(64, 2, seed=0)
x = np.random.default_rng(0).standard_normal((1, S, 64)).astype(np.float32)
lay = L.global_local(S, S, 128, width=1)
small = L.global_local(64, 64, 128, width=1)
m(x[:, :64], layout=small, need_weights=False)   # warm the pools
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
m(x, layout=lay, need_weights=False)
ctx = m.forward_train(x, layout=lay, need_weights=False)
m.backward(ctx, np.ones_like(x))
mha_ext.scaled_dot_product_attention(x[None], x[None], x[None], layout=lay)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((after - before) * 1024)
"""


def test_layout_calls_build_no_sq_by_sk_buffer(tmp_path):
    """need_weights=False with a layout, S 4096: the call, forward_train +
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
