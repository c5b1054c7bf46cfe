"""add_bias_kv and add_zero_attn in mha_ext.torch.MultiheadAttention (issue
12, point 2) against torch.nn.MultiheadAttention: forward, weights over
the S + 1 or S + 2 keys, every gradient (bias_k and bias_v included) in
float32 (2e-5) and float64 (1e-10), for every mask kind, both layouts,
unbatched, need_weights and average_attn_weights on and off, training and
eval (with and without grad); torch's is_causal hint on its SDPA path
(the causal pattern top-left over the keys with the extra ones appended);
swapped() and mha_ext.compare on models holding such modules.

Legend: B batch, L query length, S key length, E = embed_dim, H = num_heads.
"""
import itertools
import warnings

import pytest

from _support import require_torch

torch = require_torch()
from torch import nn  # noqa: E402

import mha_ext  # noqa: E402
import mha_ext.torch as mt  # noqa: E402
from mha_ext.torch import MultiheadAttention  # noqa: E402

E, H, B, S = 8, 2, 3, 5
TOL = {torch.float32: 2e-5, torch.float64: 1e-10}
EXTRAS = [dict(add_bias_kv=True), dict(add_zero_attn=True),
          dict(add_bias_kv=True, add_zero_attn=True)]
EXTRA_IDS = ["bias_kv", "zero_attn", "both"]


def pair(dtype, seed=0, **kw):
    """(stock, ours) with the same random parameters and non-zero biases."""
    torch.manual_seed(seed)
    t = nn.MultiheadAttention(E, H, dtype=dtype, **kw)
    with torch.no_grad():
        for n, p in t.named_parameters():
            if "bias" in n:
                p.uniform_(-0.5, 0.5)
    return t.eval(), MultiheadAttention.from_torch(t).eval()


def x(*shape, dtype=torch.float64, seed=1):
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def masks(kind, L, batched, dtype):
    """(attn_mask, key_padding_mask) of one kind; L queries, S keys."""
    g = torch.Generator().manual_seed(7)
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[1, -2:] = True
    pad[2, :] = True  # a sequence whose every real key is padded
    if not batched:
        pad = pad[1]
    if kind == "none":
        return None, None
    if kind == "bool_2d":
        return torch.rand(L, S, generator=g) < 0.4, None
    if kind == "float_2d":
        return torch.randn(L, S, generator=g, dtype=dtype), None
    if kind == "bool_3d":
        n = B * H if batched else H
        return torch.rand(n, L, S, generator=g) < 0.4, None
    if kind == "bool_kpm":
        return None, pad
    if kind == "float_kpm":
        return None, torch.zeros(pad.shape, dtype=dtype).masked_fill(pad, float("-inf"))
    if kind == "all_blocked":  # every real key blocked for query 0
        m = torch.zeros(L, S, dtype=torch.bool)
        m[0] = True
        return m, pad
    raise AssertionError(kind)


def run(module, args, kw, grad):
    """outputs, then gradients of every input and parameter (zeros where
    torch gives none), from a fixed cotangent."""
    args = [a.detach().clone().requires_grad_(grad) for a in args]
    with warnings.catch_warnings(), torch.set_grad_enabled(grad):
        warnings.simplefilter("ignore")
        out, w = module(*args, **kw)
    res = [out] + ([] if w is None else [w])
    if not grad:
        return res
    cot = [torch.randn(r.shape, generator=torch.Generator().manual_seed(3 + i), dtype=r.dtype)
           for i, r in enumerate(res)]
    loss = sum((r.nan_to_num() * c).sum() for r, c in zip(res, cot))
    params = list(module.parameters())
    gs = torch.autograd.grad(loss, args + params, allow_unused=True)
    return res + [torch.zeros_like(p) if g is None else g for g, p in zip(gs, args + params)]


def close(a, b, dtype, what):
    a, b = a.detach(), b.detach()
    assert a.shape == b.shape and a.dtype == b.dtype, what
    assert torch.equal(torch.isnan(a), torch.isnan(b)), f"{what}: NaN in different places"
    ok = ~torch.isnan(a)
    err = float((a[ok] - b[ok]).abs().max()) if ok.any() else 0.0
    assert err <= TOL[dtype] * max(1.0, float(a[ok].abs().max()) if ok.any() else 1.0), \
        f"{what}: {err:.3g}"


def both(t, m, args, kw, dtype, grad=True, what=""):
    ra, rb = run(t, args, kw, grad), run(m, args, kw, grad)
    assert len(ra) == len(rb), what
    for i, (a, b) in enumerate(zip(ra, rb)):
        close(a, b, dtype, f"{what} result {i}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("extra", EXTRAS, ids=EXTRA_IDS)
@pytest.mark.parametrize("kind", ["none", "bool_2d", "float_2d", "bool_3d", "bool_kpm",
                                  "float_kpm", "all_blocked"])
def test_forward_and_every_gradient_match(extra, kind, dtype):
    for bf, layout, sep in itertools.product([False, True], ["batched", "unbatched"],
                                             [False, True]):
        kd = dict(kdim=3, vdim=5, bias=False) if sep else {}
        t, m = pair(dtype, **extra, batch_first=bf, **kd)
        L = 4
        batched = layout == "batched"
        if batched:
            shape = (lambda n, d: (B, n, d)) if bf else (lambda n, d: (n, B, d))
        else:
            shape = lambda n, d: (n, d)  # noqa: E731
        args = [x(*shape(L, E), dtype=dtype), x(*shape(S, t.kdim), dtype=dtype, seed=2),
                x(*shape(S, t.vdim), dtype=dtype, seed=3)]
        am, kpm = masks(kind, L, batched, dtype)
        for nw, avg in [(True, True), (True, False), (False, True)]:
            kw = dict(attn_mask=am, key_padding_mask=kpm, need_weights=nw,
                      average_attn_weights=avg)
            what = f"bf={bf} {layout} sep={sep} need_weights={nw} average={avg}"
            both(t, m, args, kw, dtype, what=what)
            both(t, m, args, kw, dtype, grad=False, what=what + " no grad")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("extra", EXTRAS, ids=EXTRA_IDS)
@pytest.mark.parametrize("L", [3, 5, 6, 7])
def test_is_causal_hint_on_every_path(extra, L, dtype):
    # need_weights=False without key_padding_mask: torch hands is_causal to
    # SDPA, which blocks key j > i counted over the keys *with* bias_k / the
    # zero key appended (so queries i < S see none of them, L > S reaches
    # them); otherwise the mask given is used, never blocking the extra keys
    for bf in (False, True):
        t, m = pair(dtype, **extra, batch_first=bf)
        shape = (lambda n: (B, n, E)) if bf else (lambda n: (n, B, E))
        args = [x(*shape(L), dtype=dtype), x(*shape(S), dtype=dtype, seed=2),
                x(*shape(S), dtype=dtype, seed=3)]
        causal = torch.ones(L, S, dtype=torch.bool).triu(1)
        pad = torch.zeros(B, S, dtype=torch.bool)
        pad[0, -1] = True
        for nw, kpm in [(False, None), (True, None), (False, pad)]:
            kw = dict(attn_mask=causal, is_causal=True, need_weights=nw, key_padding_mask=kpm)
            both(t, m, args, kw, dtype, what=f"bf={bf} need_weights={nw} kpm={kpm is not None}")
        # the SDPA path really differs from the mask path when L <= S: the
        # extra keys are out of reach there (the pinned torch quirk)
        with torch.no_grad():
            o1, _ = m(*args, attn_mask=causal, is_causal=True, need_weights=False)
            o2, _ = m(*args, attn_mask=causal, need_weights=False)
        assert float((o1 - o2).abs().max()) > 1e-3
        # unbatched too
        u = [a[0] if bf else a[:, 0] for a in args]
        both(t, m, u, dict(attn_mask=causal, is_causal=True, need_weights=False), dtype,
             what=f"bf={bf} unbatched")


@pytest.mark.parametrize("extra", EXTRAS, ids=EXTRA_IDS)
def test_training_mode_and_constructor_initialisation(extra):
    # our own constructor (no from_torch): parameters drawn as torch draws
    # them, then the same training-mode numbers (dropout 0)
    torch.manual_seed(4)
    t = nn.MultiheadAttention(E, H, dtype=torch.float64, **extra)
    torch.manual_seed(4)
    m = MultiheadAttention(E, H, dtype=torch.float64, **extra)
    for (n, a), b in zip(t.state_dict().items(), m.state_dict().values()):
        assert torch.equal(a, b), n
    if "add_bias_kv" in extra:
        assert m.bias_k.shape == (1, 1, E) and float(m.bias_k.detach().abs().max()) > 0
    args = [x(4, B, E), x(S, B, E, seed=2), x(S, B, E, seed=3)]
    both(t.train(), m.train(), args, {}, torch.float64, what="training")


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("extra", EXTRAS, ids=EXTRA_IDS)
def test_gradcheck_causal_sdpa_path_float64(extra, need_weights):
    # the row blocks of the causal SDPA path (L > S reaches the extra keys)
    # and the mask path, differentiated numerically
    torch.manual_seed(0)
    m = MultiheadAttention(4, 2, batch_first=True, dtype=torch.float64, **extra)
    names = [n for n, _ in m.named_parameters()]
    ps = [p.detach().clone().requires_grad_() for p in m.parameters()]
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 5, 4, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(2, 3, 4, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(2, 3, 4, dtype=torch.float64, generator=g, requires_grad=True)
    causal = torch.ones(5, 3, dtype=torch.bool).triu(1)

    def f(q, k, v, *ps):
        out, w = torch.func.functional_call(m, dict(zip(names, ps)), (q, k, v), dict(
            attn_mask=causal, is_causal=True, need_weights=need_weights))
        return (out,) if w is None else (out, w)

    assert torch.autograd.gradcheck(f, (q, k, v, *ps), eps=1e-6, atol=1e-7)


def model_with(extra, batch_first):
    """a small model holding two bias_kv / zero_attn attention modules"""
    torch.manual_seed(0)

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.MultiheadAttention(E, H, batch_first=batch_first, **extra)
            self.b = nn.MultiheadAttention(E, H, batch_first=batch_first, **extra)

        def forward(self, x, key_padding_mask=None):
            y, _ = self.a(x, x, x, key_padding_mask=key_padding_mask)
            z, _ = self.b(y, x, x, need_weights=False)
            return z

    return Two()


@pytest.mark.parametrize("extra", EXTRAS, ids=EXTRA_IDS)
def test_swapped_shares_bias_kv_and_matches(extra):
    model = model_with(extra, batch_first=True)
    inp = x(B, S, E, dtype=torch.float32)
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[1, -2:] = True
    ref = model(inp, key_padding_mask=pad)
    ref.sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with mt.swapped(model):
        assert isinstance(model.a, MultiheadAttention) and isinstance(model.b, MultiheadAttention)
        if "add_bias_kv" in extra:
            assert model.a.bias_k is dict(model.named_parameters())["a.bias_k"]
        assert model.a.add_zero_attn == bool(extra.get("add_zero_attn"))
        out = model(inp, key_padding_mask=pad)
        out.sum().backward()
    assert type(model.a) is nn.MultiheadAttention
    assert float((out - ref).detach().abs().max()) < 2e-5
    for n, p in model.named_parameters():  # gradients landed in the model's parameters
        assert float((p.grad - want[n]).abs().max()) < 2e-5, n


@pytest.mark.parametrize("extra", EXTRAS, ids=EXTRA_IDS)
def test_compare_handles_bias_kv_modules(extra):
    model = model_with(extra, batch_first=False).eval()
    table = mha_ext.compare(model, x(S, B, E, dtype=torch.float32))
    assert [r.layer for r in table] == ["a", "b", "(model output)"]
    assert all(r.nan_agree and r.mha_ext_error < 1e-5 for r in table)
    one = mha_ext.compare(model.a, *[x(S, B, E, dtype=torch.float32)] * 3)
    assert len(one) == 1 and one[0].mha_ext_error < 1e-5
