"""Parity with torch.nn.MultiheadAttention for every argument a torch user
passes (API.md §3): attn_mask, key_padding_mask, is_causal, masked_rows,
kdim/vdim, bias=False, unbatched inputs, average_weights, torch tensors as
inputs; and the errors for wrong mask shapes, dtypes and orders.

The oracle is torch itself, in eval mode, with random non-zero biases.  Unless
a test is about torch's own paths, torch runs its "slow" path with weights
(key and value are copies of the query, so the fused fast path is not taken),
and average_attn_weights=False.  Tolerances (the issue): float32 2e-5,
float64 1e-10, as the largest absolute difference.  NaN must sit in the same
places on both sides.

Run with `-s` to see the worst error of each item at the end of the module.

Legend: B batch, Sq/Sk query/key length, E = d_model, H = n_heads, Dk = E/H.
"""
import warnings

import numpy as np
import pytest

import mha_ext
from mha_ext import MultiHeadAttention
from _support import require_torch

DTYPES = ("float32", "float64")
TOL = {"float32": 2e-5, "float64": 1e-10}
WORST = {}  # (item, dtype) -> the largest error seen against torch


@pytest.fixture(scope="module")
def torch():
    return require_torch()


@pytest.fixture(scope="module", autouse=True)
def worst_error_report():
    yield
    if WORST:
        print("\nworst error against torch, per item:")
        for (item, dtype), err in sorted(WORST.items()):
            print(f"  {item:<40} {dtype}  {err:.3g}")


def to_np(x):
    if x is None:
        return None
    if hasattr(x, "detach"):
        return x.detach().numpy()
    return np.asarray(x)


def assert_close(item, dtype, got, want):
    """got (ours) equals want (torch) within the dtype's tolerance; NaN in the
    same places.  Records the error under `item`."""
    got, want = to_np(got), to_np(want)
    assert got.shape == want.shape, f"{item}: shape {got.shape} != torch's {want.shape}"
    assert got.dtype == np.dtype(dtype)
    nan_got, nan_want = np.isnan(got), np.isnan(want)
    assert np.array_equal(nan_got, nan_want), f"{item}: NaN in different places"
    err = float(np.abs(got[~nan_got] - want[~nan_want]).max()) if (~nan_got).any() else 0.0
    WORST[(item, dtype)] = max(err, WORST.get((item, dtype), 0.0))
    assert err <= TOL[dtype], f"{item}: error {err:.3g} > {TOL[dtype]} ({dtype})"


def make_torch_mha(torch, E, H, dtype, seed=0, **kw):
    """An nn.MultiheadAttention in eval mode with random non-zero biases
    (|b| in [0.05, 0.5], random signs)."""
    torch.manual_seed(seed)
    kw.setdefault("batch_first", True)
    t = torch.nn.MultiheadAttention(E, H, **kw)
    t = t.to(getattr(torch, dtype)).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in t.named_parameters():
            if name.endswith("bias"):
                mag = torch.rand(p.shape, generator=gen, dtype=p.dtype) * 0.45 + 0.05
                sign = torch.randint(0, 2, p.shape, generator=gen).to(p.dtype) * 2 - 1
                p.copy_(mag * sign)
    return t


def inputs(dtype, B, Sq, Sk, E, kdim=None, vdim=None, seed=0):
    rng = np.random.default_rng(seed)
    shape = lambda S, D: (S, D) if B is None else (B, S, D)  # noqa: E731
    q = rng.standard_normal(shape(Sq, E)).astype(dtype)
    k = rng.standard_normal(shape(Sk, kdim or E)).astype(dtype)
    v = rng.standard_normal(shape(Sk, vdim or E)).astype(dtype)
    return q, k, v


def tensor(torch, x):
    return None if x is None else torch.from_numpy(np.ascontiguousarray(x))


def torch_ref(torch, t, q, k, v, need_weights=True, average=False, **masks):
    """torch's answer on its slow path: key and value are distinct tensors
    from the query, so nn.MultiheadAttention does not take the fused path."""
    masks = {n: tensor(torch, m) if isinstance(m, np.ndarray) else m for n, m in masks.items()}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "mismatched mask types" deprecation
        return t(tensor(torch, q), tensor(torch, k).clone(), tensor(torch, v).clone(),
                 need_weights=need_weights, average_attn_weights=average, **masks)


def check(torch, item, dtype, t, m, q, k, v, ours=None, theirs=None, average=False):
    """Run ours and torch's with the given masks and compare both results."""
    ours, theirs = ours or {}, theirs or {}
    out, w = m(q, k, v, average_weights=average, **ours)
    t_out, t_w = torch_ref(torch, t, q, k, v, average=average, **theirs)
    assert_close(item, dtype, out, t_out)
    assert_close(item, dtype, w, t_w)
    return out, w


def no_full_rows(blocked):
    """Unblock the first key of any query row that a bool mask blocks fully."""
    blocked = blocked.copy()
    full = blocked.all(axis=-1)
    blocked[..., 0] = np.where(full, False, blocked[..., 0])
    return blocked


def additive(rng, shape, dtype):
    """A float mask: random values, about a quarter -inf, no row all -inf."""
    add = rng.standard_normal(shape).astype(dtype)
    blocked = no_full_rows(rng.random(shape) < 0.25)
    return np.where(blocked, -np.inf, add).astype(dtype)


E, H = 16, 4
B, SQ, SK = 3, 5, 7


@pytest.fixture(params=DTYPES)
def dtype(request):
    return request.param


@pytest.fixture
def pair(torch, dtype):
    t = make_torch_mha(torch, E, H, dtype)
    return t, MultiHeadAttention.from_torch(t)


# ------------------------------------------------------------------ plain

@pytest.mark.parametrize("Sq,Sk", [(SQ, SK), (SK, SK), (1, 1)])
def test_plain_parity(torch, dtype, pair, Sq, Sk):
    t, m = pair
    q, k, v = inputs(dtype, B, Sq, Sk, E)
    check(torch, "plain (cross and self attention)", dtype, t, m, q, k, v)
    check(torch, "plain (cross and self attention)", dtype, t, m, q, q, q)


def test_seed_configuration_with_every_torch_mask(torch, dtype):
    """The seed size (B=2, S=10, E=512, H=8) with attn_mask, key_padding_mask
    and is_causal, on both torch paths (weights and SDPA)."""
    E_, H_, B_, S = 512, 8, 2, 10
    t = make_torch_mha(torch, E_, H_, dtype)
    m = MultiHeadAttention.from_torch(t)
    q, k, v = inputs(dtype, B_, S, S, E_)
    rng = np.random.default_rng(14)
    am = additive(rng, (B_ * H_, S, S), dtype)
    am[..., 0] = 0.0
    kpm = rng.random((B_, S)) < 0.3
    kpm[:, 0] = False
    causal = np.triu(np.ones((S, S), dtype=bool), k=1)
    merged = torch_merged(torch, dtype, (B_, H_, S, S), am.reshape(B_, H_, S, S),
                          kpm[:, None, None, :], causal)
    item = "seed size E=512 H=8, every torch mask"
    check(torch, item, dtype, t, m, q, k, v, dict(attn_mask=am, key_padding_mask=kpm,
                                                  is_causal=True), dict(attn_mask=merged))
    out, _ = m(q, k, v, attn_mask=am, key_padding_mask=kpm, is_causal=True, need_weights=False)
    t_out, _ = torch_ref(torch, t, q, k, v, need_weights=False, attn_mask=merged)
    assert_close(item, dtype, out, t_out)


def test_batch_first_false(torch, dtype):
    """A seq-first torch module: its copy takes (S, B, E) as torch does
    (issue 12); with batch_first = True our call is batch-first."""
    t = make_torch_mha(torch, E, H, dtype, batch_first=False)
    m = MultiHeadAttention.from_torch(t)
    assert m.batch_first is False
    q, k, v = inputs(dtype, B, SQ, SK, E)
    with torch.no_grad():
        t_out, t_w = t(*(tensor(torch, x.transpose(1, 0, 2)) for x in (q, k, v)),
                       average_attn_weights=False)
    out, w = m(*(x.transpose(1, 0, 2) for x in (q, k, v)))
    assert_close("batch_first=False module", dtype, out, t_out)
    assert_close("batch_first=False module", dtype, w, t_w)
    m.batch_first = True
    out, w = m(q, k, v)
    assert_close("batch_first=False module", dtype, out, t_out.transpose(0, 1))
    assert_close("batch_first=False module", dtype, w, t_w)


# ------------------------------------------------------------------ attn_mask

def test_attn_mask_2d_bool(torch, dtype, pair):
    t, m = pair
    q, k, v = inputs(dtype, B, SQ, SK, E)
    am = no_full_rows(np.random.default_rng(1).random((SQ, SK)) < 0.4)
    out, w = check(torch, "attn_mask (Sq,Sk) bool", dtype, t, m, q, k, v,
                   dict(attn_mask=am), dict(attn_mask=am))
    assert np.all(w[:, :, am] == 0)  # True = blocked


def test_attn_mask_2d_float(torch, dtype, pair):
    t, m = pair
    q, k, v = inputs(dtype, B, SQ, SK, E)
    am = additive(np.random.default_rng(2), (SQ, SK), dtype)
    assert np.isinf(am).any()
    check(torch, "attn_mask (Sq,Sk) float, -inf", dtype, t, m, q, k, v,
          dict(attn_mask=am), dict(attn_mask=am))


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_attn_mask_3d_order(torch, dtype, pair, kind):
    """(B*H, Sq, Sk) with index b*H + h: every (b, h) gets its own mask."""
    t, m = pair
    q, k, v = inputs(dtype, B, SQ, SK, E)
    rng = np.random.default_rng(3)
    if kind == "bool":
        am = no_full_rows(rng.random((B * H, SQ, SK)) < 0.4)
    else:
        am = additive(rng, (B * H, SQ, SK), dtype)
    out, w = check(torch, f"attn_mask (B*H,Sq,Sk) {kind}", dtype, t, m, q, k, v,
                   dict(attn_mask=am), dict(attn_mask=am))
    if kind == "bool":
        assert np.all(w[am.reshape(B, H, SQ, SK)] == 0)
    # the same mask in the other order (h*B + b) gives other numbers
    swapped = am.reshape(B, H, SQ, SK).transpose(1, 0, 2, 3).reshape(B * H, SQ, SK)
    assert not np.allclose(m(q, k, v, attn_mask=swapped)[1], w, equal_nan=True)


# ------------------------------------------------------------------ key_padding_mask

@pytest.mark.parametrize("kind", ["bool", "float"])
def test_key_padding_mask(torch, dtype, pair, kind):
    t, m = pair
    q, k, v = inputs(dtype, B, SQ, SK, E)
    rng = np.random.default_rng(4)
    if kind == "bool":
        kpm = rng.random((B, SK)) < 0.4
        kpm[:, 0] = False
    else:
        kpm = additive(rng, (B, SK), dtype)
    out, w = check(torch, f"key_padding_mask (B,Sk) {kind}", dtype, t, m, q, k, v,
                   dict(key_padding_mask=kpm), dict(key_padding_mask=kpm))
    if kind == "bool":
        assert np.all(w.transpose(0, 2, 1, 3)[kpm[:, None, None, :].repeat(SQ, 1).repeat(H, 2)] == 0)


# ------------------------------------------------------------------ is_causal

@pytest.mark.parametrize("Sq,Sk", [(SK, SK), (SQ, SK), (SK, SQ)])
def test_is_causal_without_mask(torch, dtype, pair, Sq, Sk):
    """is_causal=True needs no mask (torch's MHA insists on one: we give it
    the top-left aligned causal mask)."""
    t, m = pair
    q, k, v = inputs(dtype, B, Sq, Sk, E)
    causal = np.triu(np.ones((Sq, Sk), dtype=bool), k=1)
    out, w = check(torch, "is_causal=True, no mask", dtype, t, m, q, k, v,
                   dict(is_causal=True), dict(attn_mask=causal, is_causal=True))
    assert np.all(w[..., causal] == 0) and np.all(w[..., ~causal] > 0)
    # the same alignment as SDPA's is_causal (top-left when Sq != Sk)
    out_s, _ = m(q, k, v, is_causal=True, need_weights=False, masked_rows="zero")
    heads = projected_heads(torch, t, q, k, v)
    ctx = torch.nn.functional.scaled_dot_product_attention(*heads, is_causal=True)
    assert_close("is_causal=True, no mask", dtype, out_s, out_projection(torch, t, ctx))


# ------------------------------------------------------------------ combinations

def torch_merged(torch, dtype, shape4, *blocked_or_added):
    """One float (B*H, Sq, Sk) attn_mask for torch: the sum of every mask,
    bool ones as -inf.  Each item broadcasts to (B, H, Sq, Sk)."""
    total = np.zeros(shape4, dtype=dtype)
    for x in blocked_or_added:
        total = total + (np.where(x, -np.inf, 0.0) if x.dtype == bool else x).astype(dtype)
    return total.reshape(-1, *shape4[2:])


def test_every_mask_together(torch, dtype, pair):
    """mask + attn_mask + key_padding_mask + is_causal all apply at once."""
    t, m = pair
    Sq = Sk = 6
    q, k, v = inputs(dtype, B, Sq, Sk, E)
    rng = np.random.default_rng(5)
    seed_mask = (rng.random((1, H, 1, Sk)) < 0.3).astype(np.int64)  # broadcasts
    seed_mask[..., 0] = 0
    am = additive(rng, (B * H, Sq, Sk), dtype)
    am[..., 0] = 0.5  # key 0 stays visible for everyone
    kpm = rng.random((B, Sk)) < 0.3
    kpm[:, 0] = False
    causal = np.triu(np.ones((Sq, Sk), dtype=bool), k=1)
    merged = torch_merged(torch, dtype, (B, H, Sq, Sk), seed_mask.astype(bool),
                          am.reshape(B, H, Sq, Sk), kpm[:, None, None, :], causal)
    out, w = check(torch, "mask+attn_mask+key_padding_mask+is_causal", dtype, t, m, q, k, v,
                   dict(mask=seed_mask, attn_mask=am, key_padding_mask=kpm, is_causal=True),
                   dict(attn_mask=merged))
    # need_weights=False: the same output
    out2, none = m(q, k, v, seed_mask, attn_mask=am, key_padding_mask=kpm, is_causal=True,
                   need_weights=False)
    assert none is None
    assert_close("mask+attn_mask+key_padding_mask+is_causal", dtype, out2, out)


@pytest.mark.parametrize("am_kind,kpm_kind", [("bool", "float"), ("float", "bool")])
def test_mixed_mask_dtypes(torch, dtype, pair, am_kind, kpm_kind):
    """A bool attn_mask with a float key_padding_mask (and the reverse): both
    apply, as torch does (it converts both to float, with a deprecation
    warning we do not repeat)."""
    t, m = pair
    q, k, v = inputs(dtype, B, SQ, SK, E)
    rng = np.random.default_rng(6)
    am = no_full_rows(rng.random((SQ, SK)) < 0.3)
    am[:, 0] = False
    kpm = rng.random((B, SK)) < 0.3
    kpm[:, 0] = False
    if am_kind == "float":
        am = np.where(am, -np.inf, rng.standard_normal((SQ, SK))).astype(dtype)
    if kpm_kind == "float":
        kpm = np.where(kpm, -np.inf, rng.standard_normal((B, SK))).astype(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # we warn about nothing
        out, w = m(q, k, v, attn_mask=am, key_padding_mask=kpm)
    t_out, t_w = torch_ref(torch, t, q, k, v, attn_mask=am, key_padding_mask=kpm)
    item = "bool attn_mask + float key_padding_mask (mixed)"
    assert_close(item, dtype, out, t_out)
    assert_close(item, dtype, w, t_w)


def test_seed_mask_with_torch_masks(torch, dtype, pair):
    """The seed `mask` (0/1, 1 = blocked, (B, H, Sq, Sk)) next to attn_mask."""
    t, m = pair
    q, k, v = inputs(dtype, B, SQ, SK, E)
    rng = np.random.default_rng(7)
    seed_mask = (rng.random((B, H, SQ, SK)) < 0.3).astype(np.float32)
    seed_mask[..., 1] = 0
    am = additive(rng, (SQ, SK), dtype)
    am[:, 1] = -0.25
    merged = torch_merged(torch, dtype, (B, H, SQ, SK), seed_mask.astype(bool), am)
    check(torch, "seed mask + attn_mask", dtype, t, m, q, k, v,
          dict(mask=seed_mask, attn_mask=am), dict(attn_mask=merged))


# ------------------------------------------------------------------ masked rows

def fully_masked_kpm():
    kpm = np.zeros((B, SK), dtype=bool)
    kpm[1, :] = True  # batch 1 sees no key at all
    return kpm


def test_masked_rows_nan(torch, dtype, pair):
    """Default: NaN weights and output rows, like torch's weights path."""
    t, m = pair
    q, k, v = inputs(dtype, B, SQ, SK, E)
    am = np.zeros((SQ, SK), dtype=bool)
    am[2, :] = True  # query 2 sees no key either
    kpm = fully_masked_kpm()
    out, w = check(torch, "masked_rows='nan' (weights path)", dtype, t, m, q, k, v,
                   dict(attn_mask=am, key_padding_mask=kpm),
                   dict(attn_mask=am, key_padding_mask=kpm))
    assert np.isnan(out[1]).all() and np.isnan(w[1]).all()
    assert np.isnan(out[:, 2]).all() and not np.isnan(out[0, [0, 1, 3, 4]]).any()
    out2, _ = m(q, k, v, attn_mask=am, key_padding_mask=kpm, need_weights=False)
    assert np.array_equal(np.isnan(out2), np.isnan(out))


def test_masked_rows_zero(torch, dtype, pair):
    """"zero": zero weights and an output row equal to W_o.bias, like torch's
    SDPA path (need_weights=False, no fused fast path)."""
    t, m = pair
    q, k, v = inputs(dtype, B, SQ, SK, E)
    am = np.zeros((SQ, SK), dtype=bool)
    am[2, :] = True
    kpm = fully_masked_kpm()
    out, w = m(q, k, v, attn_mask=am, key_padding_mask=kpm, masked_rows="zero")
    assert np.all(w[1] == 0) and np.all(w[:, :, 2] == 0)
    assert np.all(out[1] == m.W_o.bias) and np.all(out[:, 2] == m.W_o.bias)
    t_out, _ = torch_ref(torch, t, q, k, v, need_weights=False,
                         attn_mask=am, key_padding_mask=kpm)
    assert_close("masked_rows='zero' vs torch SDPA path", dtype, out, t_out)
    out2, none = m(q, k, v, attn_mask=am, key_padding_mask=kpm, masked_rows="zero",
                   need_weights=False)
    assert none is None
    assert_close("masked_rows='zero' vs torch SDPA path", dtype, out2, t_out)


def projected_heads(torch, t, q, k, v):
    """q, k, v projected with torch's weights and split into (B, H, S, Dk)."""
    E = t.embed_dim
    if t.in_proj_weight is not None:
        wq, wk, wv = t.in_proj_weight.split(E)
    else:
        wq, wk, wv = t.q_proj_weight, t.k_proj_weight, t.v_proj_weight
    bq = bk = bv = None
    if t.in_proj_bias is not None:
        bq, bk, bv = t.in_proj_bias.split(E)
    F = torch.nn.functional
    heads = []
    with torch.no_grad():
        for x, w, b in ((q, wq, bq), (k, wk, bk), (v, wv, bv)):
            y = F.linear(tensor(torch, x), w, b)
            heads.append(y.unflatten(-1, (t.num_heads, E // t.num_heads)).transpose(-3, -2))
    return heads


def out_projection(torch, t, ctx):
    with torch.no_grad():
        return t.out_proj(ctx.transpose(-3, -2).flatten(-2))


@pytest.mark.parametrize("need_weights", [True, False])
def test_no_keys_at_all(torch, dtype, pair, need_weights):
    """Sk = 0: every torch path gives an output of W_o.bias (an empty sum,
    not a masked row), so we do too, whatever masked_rows says."""
    t, m = pair
    q, k, v = inputs(dtype, B, SQ, 0, E)
    t_out, t_w = torch_ref(torch, t, q, k, v, need_weights=need_weights)
    for rows in ("nan", "zero"):
        out, w = m(q, k, v, need_weights=need_weights, masked_rows=rows,
                   key_padding_mask=np.zeros((B, 0), dtype=bool))
        assert_close("Sk = 0 (no keys)", dtype, out, t_out)
        assert np.all(out == m.W_o.bias)
        if need_weights:
            assert w.shape == t_w.shape == (B, H, SQ, 0)


def test_need_weights_false_vs_sdpa(torch, dtype, pair):
    """need_weights=False, masked_rows="zero" against
    F.scaled_dot_product_attention on the projected heads, with an additive
    float mask made of every mask (fully masked rows included)."""
    t, m = pair
    q, k, v = inputs(dtype, B, SQ, SK, E)
    rng = np.random.default_rng(8)
    am = additive(rng, (B * H, SQ, SK), dtype)
    am[0, 3, :] = -np.inf  # one fully masked row in (b=0, h=0)
    kpm = fully_masked_kpm()
    out, none = m(q, k, v, attn_mask=am, key_padding_mask=kpm, need_weights=False,
                  masked_rows="zero")
    assert none is None
    float_mask = torch_merged(torch, dtype, (B, H, SQ, SK), am.reshape(B, H, SQ, SK),
                              kpm[:, None, None, :]).reshape(B, H, SQ, SK)
    with torch.no_grad():
        ctx = torch.nn.functional.scaled_dot_product_attention(
            *projected_heads(torch, t, q, k, v), attn_mask=tensor(torch, float_mask))
    assert_close("need_weights=False, 'zero' vs F.sdpa", dtype, out, out_projection(torch, t, ctx))
    assert np.all(out[1] == m.W_o.bias)


# ------------------------------------------------------------------ shapes and options

def test_unbatched(torch, dtype, pair):
    """2-D inputs: output (Sq, E), weights (H, Sq, Sk) or (Sq, Sk) averaged;
    attn_mask (Sq, Sk) or (H, Sq, Sk); key_padding_mask (Sk,)."""
    t, m = pair
    q, k, v = inputs(dtype, None, SQ, SK, E)
    out, w = check(torch, "unbatched", dtype, t, m, q, k, v)
    assert out.shape == (SQ, E) and w.shape == (H, SQ, SK)
    out, w = check(torch, "unbatched", dtype, t, m, q, k, v, average=True)
    assert w.shape == (SQ, SK)
    rng = np.random.default_rng(9)
    am3 = additive(rng, (H, SQ, SK), dtype)
    am2 = no_full_rows(rng.random((SQ, SK)) < 0.3)
    kpm = rng.random(SK) < 0.3
    kpm[0] = False
    for am in (am3, am2):
        check(torch, "unbatched", dtype, t, m, q, k, v,
              dict(attn_mask=am, key_padding_mask=kpm), dict(attn_mask=am, key_padding_mask=kpm))
    out, w = check(torch, "unbatched", dtype, t, m, q, q, q,
                   dict(is_causal=True), dict(attn_mask=np.triu(np.ones((SQ, SQ), bool), 1)))
    # key and value default to the query
    assert np.array_equal(m(q)[0], m(q, q, q)[0])


def test_average_weights(torch, dtype, pair):
    t, m = pair
    q, k, v = inputs(dtype, B, SQ, SK, E)
    kpm = np.zeros((B, SK), dtype=bool)
    kpm[:, -2:] = True
    out, w = check(torch, "average_weights=True", dtype, t, m, q, k, v,
                   dict(key_padding_mask=kpm), dict(key_padding_mask=kpm), average=True)
    assert w.shape == (B, SQ, SK)
    assert_close("average_weights=True", dtype, w, m(q, k, v, key_padding_mask=kpm)[1].mean(1))
    # pinned: torch averages by default, we do not
    _, t_default = t(*(tensor(torch, x) for x in (q, k, v)))
    assert t_default.shape == (B, SQ, SK) and m(q, k, v)[1].shape == (B, H, SQ, SK)


@pytest.mark.parametrize("kdim,vdim,bias", [(8, 12, True), (24, 24, True), (16, 16, False),
                                            (8, 12, False), (16, 20, True)])
def test_kdim_vdim_bias(torch, dtype, kdim, vdim, bias):
    t = make_torch_mha(torch, E, H, dtype, kdim=kdim, vdim=vdim, bias=bias)
    m = MultiHeadAttention.from_torch(t)
    assert (m.kdim, m.vdim, m.bias) == (kdim, vdim, bias)
    q, k, v = inputs(dtype, B, SQ, SK, E, kdim, vdim)
    item = "kdim/vdim" if bias else "kdim/vdim, bias=False"
    check(torch, item, dtype, t, m, q, k, v)
    kpm = np.zeros((B, SK), dtype=bool)
    kpm[0, 1:] = True
    am = additive(np.random.default_rng(10), (SQ, SK), dtype)
    am[:, 0] = 0.3  # key 0 is the one batch 0 may see
    check(torch, item, dtype, t, m, q, k, v, dict(attn_mask=am, key_padding_mask=kpm),
          dict(attn_mask=am, key_padding_mask=kpm))
    check(torch, item, dtype, t, m, q[0], k[0], v[0])  # unbatched
    # need_weights=False against torch's SDPA path
    out, _ = m(q, k, v, attn_mask=am, key_padding_mask=kpm, need_weights=False)
    t_out, _ = torch_ref(torch, t, q, k, v, need_weights=False, attn_mask=am,
                         key_padding_mask=kpm)
    assert_close(item, dtype, out, t_out)


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")  # torch's
def test_torch_tensor_inputs(torch, dtype, pair):
    """Torch tensors as query/key/value and masks, also ones that require
    grad and non-contiguous ones; nothing is modified."""
    t, m = pair
    q, k, v = inputs(dtype, B, SQ, SK, E)
    tq = tensor(torch, q).requires_grad_()
    tk = tensor(torch, k.transpose(1, 0, 2).copy()).transpose(0, 1).requires_grad_()
    assert not tk.is_contiguous()
    tv = tensor(torch, v)
    am = torch.from_numpy(additive(np.random.default_rng(11), (B * H, SQ, SK), dtype))
    am.requires_grad_()
    kpm = torch.zeros(B, SK, dtype=torch.bool)
    kpm[:, -1] = True
    before = [x.detach().clone() for x in (tq, tk, tv)]
    out, w = m(tq, tk, tv, attn_mask=am, key_padding_mask=kpm)
    assert isinstance(out, np.ndarray) and isinstance(w, np.ndarray)
    for x, b in zip((tq, tk, tv), before):
        assert torch.equal(x.detach(), b)
    assert tq.requires_grad and tq.grad is None
    with torch.no_grad():
        t_out, t_w = t(tq, tk, tv, attn_mask=am, key_padding_mask=kpm, average_attn_weights=False)
    assert_close("torch tensors as inputs (requires grad)", dtype, out, t_out)
    assert_close("torch tensors as inputs (requires grad)", dtype, w, t_w)
    # grad enabled: torch keeps the autograd graph, we just read the numbers
    t_out2, _ = t(tq, tk, tv, attn_mask=am, key_padding_mask=kpm)
    assert t_out2.requires_grad
    assert_close("torch tensors as inputs (requires grad)", dtype, out, t_out2)
    # other dtypes are converted to the module's
    out3, _ = m(tq.to(torch.float16 if dtype == "float32" else torch.float32),
                tk.double(), tv.float(), attn_mask=am, key_padding_mask=kpm)
    assert out3.dtype == np.dtype(dtype)

