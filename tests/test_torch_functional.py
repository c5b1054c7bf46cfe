"""mha_ext.torch.multi_head_attention_forward against torch's own
torch.nn.functional.multi_head_attention_forward: outputs, weights and the
gradients of every tensor passed, over its options; code that calls the
functional itself (fair-esm's and fairseq's attention do) run through the
twin by patching torch.nn.functional; its refusals.

Legend: L query length, S key length, B batch, E = embed_dim, H = num_heads.
"""
import itertools

import numpy as np

import pytest

from _support import require_torch

torch = require_torch()
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import mha_ext.torch as mt  # noqa: E402

E, H, L, S, B = 16, 4, 5, 7, 3
# float32: a few roundings of values of order 1 (ours against torch's,
# each a float32 computation); float64 likewise
TOL = {torch.float32: 2e-5, torch.float64: 1e-10}


def _module(dtype, separate, bias, bias_kv, zero_attn, seed=0):
    torch.manual_seed(seed)
    kdim, vdim = (12, 10) if separate else (None, None)
    m = nn.MultiheadAttention(E, H, bias=bias != "none", add_bias_kv=bias_kv,
                              add_zero_attn=zero_attn, kdim=kdim, vdim=vdim, dtype=dtype)
    with torch.no_grad():  # torch's zero biases would hide a bias bug
        for p in m.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return m


def _args(m, bias):
    """torch's functional's positional and keyword arguments from module m
    (as nn.MultiheadAttention.forward passes them); bias "in" keeps only
    in_proj_bias, "out" only out_proj_bias"""
    in_b = None if bias in ("none", "out") else m.in_proj_bias
    out_b = None if bias in ("none", "in") else m.out_proj.bias
    pos = (E, H, m.in_proj_weight, in_b, m.bias_k, m.bias_v, m.add_zero_attn, 0.0,
           m.out_proj.weight, out_b)
    kw = dict(use_separate_proj_weight=not m._qkv_same_embed_dim,
              q_proj_weight=m.q_proj_weight, k_proj_weight=m.k_proj_weight,
              v_proj_weight=m.v_proj_weight)
    return pos, kw


def _run(f, m, bias, q, k, v, **call):
    pos, kw = _args(m, bias)
    leaves = [t for t in (q, k, v, *m.parameters()) if t.requires_grad]
    for t in leaves:
        t.grad = None
    out, w = f(q, k, v, *pos, **kw, **call)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
    (out * g).nan_to_num().sum().backward()
    grads = [None if t.grad is None else t.grad.clone() for t in leaves]
    return out.detach(), None if w is None else w.detach(), grads


def _close(a, b, tol, what):
    if a is None or b is None:
        assert a is None and b is None, what
        return
    assert a.shape == b.shape, what
    assert torch.equal(a.isnan(), b.isnan()), f"{what}: NaN in other places"
    ok = ~a.isnan()
    scale = max(1.0, float(b[ok].abs().max())) if ok.any() else 1.0
    err = float((a[ok] - b[ok]).abs().max()) if ok.any() else 0.0
    assert err <= tol * scale, f"{what}: {err:.3g} > {tol:g} x {scale:.3g}"


def _inputs(m, dtype, batched, seed=1):
    g = torch.Generator().manual_seed(seed)
    lead = (B,) if batched else ()

    def t(n, d):
        x = torch.randn((n,) + lead + (d,), generator=g, dtype=dtype)
        return x.requires_grad_()
    return t(L, E), t(S, m.kdim), t(S, m.vdim)


def _masks(kind, dtype, batched):
    g = torch.Generator().manual_seed(3)
    am = kpm = None
    if kind in ("bool", "both"):
        am = torch.rand(L, S, generator=g) > 0.75
    if kind == "float3d" and batched:
        am = torch.randn(B * H, L, S, generator=g, dtype=dtype)
    if kind in ("padding", "both"):
        kpm = torch.rand((B, S) if batched else (S,), generator=g) > 0.7
        kpm[..., 0] = False
    return am, kpm


CASES = list(itertools.product(
    [torch.float32, torch.float64], [False, True],          # dtype, separate weights
    ["both", "none", "in", "out"], [False, True],           # biases, add_bias_kv
    ["none", "bool", "float3d", "padding", "both"]))        # masks


@pytest.mark.parametrize("dtype,separate,bias,bias_kv,masks", CASES)
def test_matches_torchs_functional(dtype, separate, bias, bias_kv, masks):
    m = _module(dtype, separate, bias, bias_kv, zero_attn=bias_kv and separate)
    for batched, need, avg in [(True, True, False), (True, False, True), (False, True, True)]:
        am, kpm = _masks(masks, dtype, batched)
        call = dict(key_padding_mask=kpm, attn_mask=am, need_weights=need,
                    average_attn_weights=avg, training=False)
        q, k, v = _inputs(m, dtype, batched)
        want = _run(F.multi_head_attention_forward, m, bias, q, k, v, **call)
        got = _run(mt.multi_head_attention_forward, m, bias, q, k, v, **call)
        what = f"batched={batched} need_weights={need}"
        _close(got[0], want[0], TOL[dtype], what + " output")
        _close(got[1], want[1], TOL[dtype], what + " weights")
        for i, (a, b) in enumerate(zip(got[2], want[2])):
            _close(a, b, TOL[dtype], f"{what} gradient {i}")


@pytest.mark.parametrize("need", [True, False])
def test_is_causal_hint_and_a_query_that_sees_no_key(need):
    """is_causal with its mask (applied as torch's functional applies it),
    and a batch whose padding hides every key: NaN with weights, the output
    bias without, as torch's functional (its unfused path) gives."""
    dtype = torch.float64
    m = _module(dtype, False, "both", False, False)
    causal = torch.triu(torch.ones(L, S, dtype=torch.bool), diagonal=1)
    q, k, v = _inputs(m, dtype, True)
    for kpm in (None, torch.zeros(B, S, dtype=torch.bool)):
        call = dict(attn_mask=causal, is_causal=True, need_weights=need, key_padding_mask=kpm,
                    training=False)
        want = _run(F.multi_head_attention_forward, m, "both", q, k, v, **call)
        got = _run(mt.multi_head_attention_forward, m, "both", q, k, v, **call)
        _close(got[0], want[0], 1e-10, "causal output")
        _close(got[1], want[1], 1e-10, "causal weights")
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[1] = True                                   # batch 1 sees no key
    call = dict(key_padding_mask=kpm, need_weights=need, training=False)
    with torch.no_grad():
        want = F.multi_head_attention_forward(q, k, v, *_args(m, "both")[0],
                                              **_args(m, "both")[1], **call)
        got = mt.multi_head_attention_forward(q, k, v, *_args(m, "both")[0],
                                              **_args(m, "both")[1], **call)
    _close(got[0], want[0], 1e-10, "blocked output")
    _close(got[1], want[1], 1e-10, "blocked weights")
    assert got[0][:, 1].isnan().all() == need


class _FairseqStyle(nn.Module):
    """Attention the way fair-esm's and fairseq's MultiheadAttention call
    torch's functional: separate projections as Linear children, an empty
    in_proj_weight, the three biases concatenated (not code of theirs)."""

    def __init__(self, dtype):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (
            nn.Linear(E, E, dtype=dtype) for _ in range(4))
        self.bias_k = nn.Parameter(torch.randn(1, 1, E, dtype=dtype))
        self.bias_v = nn.Parameter(torch.randn(1, 1, E, dtype=dtype))

    def forward(self, x, key_padding_mask=None):
        return F.multi_head_attention_forward(
            x, x, x, E, H, torch.empty([0]),
            torch.cat((self.q_proj.bias, self.k_proj.bias, self.v_proj.bias)),
            self.bias_k, self.bias_v, False, 0.0, self.out_proj.weight, self.out_proj.bias,
            self.training, key_padding_mask, False, None, use_separate_proj_weight=True,
            q_proj_weight=self.q_proj.weight, k_proj_weight=self.k_proj.weight,
            v_proj_weight=self.v_proj.weight)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_code_calling_the_functional_runs_through_the_twin(monkeypatch, dtype):
    """Patched into torch.nn.functional, the twin computes such a module and
    torch's own nn.MultiheadAttention on its unfused path (training, or
    with weights): the same numbers and gradients, and our C code ran."""
    torch.manual_seed(2)
    x = torch.randn(L, B, E, dtype=dtype)
    kpm = torch.rand(B, L) > 0.7
    kpm[:, 0] = False
    models = [_FairseqStyle(dtype), nn.MultiheadAttention(E, H, dtype=dtype)]

    def step(model):
        for p in model.parameters():
            p.grad = None
        out = model(x, key_padding_mask=kpm) if isinstance(model, _FairseqStyle) else \
            model(x, x, x, key_padding_mask=kpm)[0]
        out.square().sum().backward()
        return [out.detach()] + [p.grad.clone() for p in model.parameters()]

    want = [step(model) for model in models]
    calls = []
    twin = mt.multi_head_attention_forward

    def counted(*args, **kwargs):
        calls.append(1)
        return twin(*args, **kwargs)
    monkeypatch.setattr(F, "multi_head_attention_forward", counted)
    got = [step(model) for model in models]
    assert len(calls) == 2
    for g, w in zip(got, want):
        for i, (a, b) in enumerate(zip(g, w)):
            _close(a, b, TOL[dtype], f"tensor {i}")


def test_refusals_are_torchs_too_and_do_not_recurse_when_patched(monkeypatch):
    """Arguments torch's functional refuses are refused with its exception
    type as well as ours (and its message), also with the twin patched in
    its place (the refusals run torch's own function); what torch takes and
    we do not (static_k) is ours alone; meta tensors get torch's shapes."""
    m = _module(torch.float32, False, "both", True, False)
    pos, kw = _args(m, "both")
    x = torch.randn(L, B, E)
    monkeypatch.setattr(F, "multi_head_attention_forward", mt.multi_head_attention_forward)
    bad = [
        ((x, x, x, E + 4, H) + pos[2:], {}, "was expecting embedding dimension"),
        ((x, x[:, :2], x, E, H) + pos[2:], {}, "does not match value shape"),
        ((x, x, x, E, H) + pos[2:4] + (m.bias_k, None) + pos[6:], {},
         "bias_k is set but bias_v is None"),
    ]
    for args, extra, words in bad:
        with pytest.raises(AssertionError, match=words) as got:
            mt.multi_head_attention_forward(*args, **kw, **extra)
        assert isinstance(got.value, ValueError) and str(got.value).count("(torch:") == 1
    # torch's module, patched, on bad input: its own assertion, once
    ref = nn.MultiheadAttention(E, H)
    with pytest.raises(AssertionError, match="was expecting embedding dimension"):
        ref(torch.randn(L, B, E + 4), torch.randn(L, B, E), torch.randn(L, B, E))
    static = torch.randn(B * H, S, E // H)
    with pytest.raises(ValueError, match="static_k and static_v") as got:
        mt.multi_head_attention_forward(x, x, x, *pos, **kw, static_k=static)
    assert not isinstance(got.value, AssertionError)
    with pytest.raises(TypeError, match="must be float32 or float64"):
        mt.multi_head_attention_forward(x, x, x, E, H, m.in_proj_weight, None, None, None,
                                        False, 0.0, torch.ones(E, E, dtype=torch.int64), None)
    on_meta = [t.to("meta") if isinstance(t, torch.Tensor) else t for t in pos]
    xm = x.to("meta")
    out, w = mt.multi_head_attention_forward(xm, xm, xm, *on_meta, **kw)
    assert out.device.type == "meta" and out.shape == (L, B, E) and w.shape == (B, L, L + 1)


def test_dropout_in_training_only_from_torchs_generator():
    """dropout_p drops in training only; torch.manual_seed repeats the draw."""
    m = _module(torch.float64, False, "both", False, False)
    pos, kw = _args(m, "both")
    pos = pos[:7] + (0.5,) + pos[8:]
    x = torch.randn(L, B, E, dtype=torch.float64)

    def run(training, seed):
        torch.manual_seed(seed)
        with torch.no_grad():
            return mt.multi_head_attention_forward(x, x, x, *pos, **kw, training=training,
                                                   average_attn_weights=False)

    plain = F.multi_head_attention_forward(x, x, x, *pos, **kw, training=False,
                                           average_attn_weights=False)
    _close(run(False, 0)[0], plain[0].detach(), 1e-10, "eval")
    a, b, c = run(True, 0), run(True, 0), run(True, 1)
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])
    assert not torch.allclose(a[0], plain[0].detach())
    # the weights returned are the dropped ones: each 0 or twice torch's
    w = plain[1].detach()
    dropped = a[1] == 0
    assert 0.3 < float(dropped.double().mean()) < 0.7
    _close(torch.where(dropped, 0.0, a[1]), torch.where(dropped, 0.0, 2 * w), 1e-10, "kept")


def test_what_torchs_functional_does_unlike_its_module():
    """torch's functional drops the is_causal hint's mask unread (an int mask
    runs; torch's module refuses it first), and its shape errors are said in
    its own layout, naming the weight whose width does not fit."""
    dtype = torch.float64
    m = _module(dtype, False, "both", False, False)
    pos, kw = _args(m, "both")
    x = torch.randn(L, B, E, dtype=dtype)
    hint = torch.triu(torch.ones(L, L, dtype=torch.int32), 1)
    call = dict(attn_mask=hint, is_causal=True, need_weights=False, training=False)
    with torch.no_grad():
        want = F.multi_head_attention_forward(x, x, x, *pos, **kw, **call)[0]
        got = mt.multi_head_attention_forward(x, x, x, *pos, **kw, **call)[0]
    _close(got, want, 1e-10, "int hint mask")
    with pytest.raises(TypeError, match="attn_mask must be bool"):
        mt.MultiheadAttention(E, H, dtype=dtype)(x, x, x, attn_mask=hint, is_causal=True,
                                                 need_weights=False)
    sep = _module(torch.float32, True, "both", False, False)
    spos, skw = _args(sep, "both")
    skw["k_proj_weight"] = torch.randn(E, 11)
    q, k, v = torch.randn(L, B, E), torch.randn(S, B, 12), torch.randn(S, B, 10)
    with pytest.raises(ValueError, match=r"must be 11 and 10 wide \(k_proj_weight's") as got:
        mt.multi_head_attention_forward(q, k, v, *spos, **skw)
    assert "batch_first" not in str(got.value) and isinstance(got.value, AssertionError)


def test_arguments_torchs_functional_takes_without_reading_or_by_broadcasting():
    """What torch's functional takes that a module never passes: sizes as
    0-d integer tensors, out_proj_bias as a (1, E) row (its linear
    broadcasts it; the gradient keeps that shape), any dropout_p outside
    training (unread); in training one outside [0, 1] is refused by both."""
    dtype = torch.float64
    m = _module(dtype, False, "both", False, False)
    pos, kw = _args(m, "both")
    row = m.out_proj.bias.detach().reshape(1, E).clone().requires_grad_()
    variants = {"sizes as tensors": (torch.tensor(E), torch.tensor(H)) + pos[2:],
                "(1, E) out_proj_bias": pos[:9] + (row,),
                "dropout_p 1.5 in eval": pos[:7] + (1.5,) + pos[8:],
                "dropout_p -1 in eval": pos[:7] + (-1.0,) + pos[8:]}
    for what, args in variants.items():
        q, k, v = _inputs(m, dtype, True)
        ours = _run(lambda *a, **c: mt.multi_head_attention_forward(*a[:3], *args, **c),
                    m, "both", q, k, v, training=False)
        row.grad = None
        q, k, v = _inputs(m, dtype, True)
        want = _run(lambda *a, **c: F.multi_head_attention_forward(*a[:3], *args, **c),
                    m, "both", q, k, v, training=False)
        _close(ours[0], want[0], 1e-10, what)
        _close(ours[1], want[1], 1e-10, what)
        for i, (a, b) in enumerate(zip(ours[2], want[2])):
            _close(a, b, 1e-10, f"{what}: gradient {i}")
    # the row's own gradient, in its own shape
    x = torch.randn(L, B, E, dtype=dtype)
    grads = []
    for f in (mt.multi_head_attention_forward, F.multi_head_attention_forward):
        row.grad = None
        f(x, x, x, *variants["(1, E) out_proj_bias"], training=False)[0].sum().backward()
        grads.append(row.grad.clone())
    assert grads[0].shape == (1, E)
    _close(grads[0], grads[1], 1e-10, "out_proj_bias row")
    x = torch.randn(L, B, E)
    m32 = _module(torch.float32, False, "both", False, False)
    p32, kw32 = _args(m32, "both")
    # in training, torch's two paths: the weights path's dropout raises a
    # ValueError above 1 and drops nothing below 0; the SDPA path raises a
    # RuntimeError for both
    for f in (mt.multi_head_attention_forward, F.multi_head_attention_forward):
        with pytest.raises(ValueError, match="between 0 and 1, but got 1.5"):
            f(x, x, x, *p32[:7], 1.5, *p32[8:], **kw32, training=True)
        for p in (1.5, -0.5):
            with pytest.raises(RuntimeError):
                f(x, x, x, *p32[:7], p, *p32[8:], **kw32, training=True, need_weights=False)
    for p in (-0.5, float("nan")):
        with torch.no_grad():
            got = mt.multi_head_attention_forward(x, x, x, *p32[:7], p, *p32[8:], **kw32,
                                                  training=True)
            want = F.multi_head_attention_forward(x, x, x, *p32[:7], p, *p32[8:], **kw32,
                                                  training=True)
        _close(got[0], want[0], TOL[torch.float32], f"dropout_p {p}, training, with weights")


def test_refusals_keep_torchs_type_for_tensor_sizes_and_aliased_inputs():
    """torch's own function, run on meta twins to find its exception type,
    reads 0-d sizes' values and branches on `query is key`: the twins keep
    both.  A (1, 3E) in_proj_bias is torch's in self-attention only."""
    m = _module(torch.float64, False, "both", False, False)
    pos, kw = _args(m, "both")
    x, y = torch.randn(L, B, E, dtype=torch.float64), torch.randn(S, B, E, dtype=torch.float64)
    cases = [((x, x, x, torch.tensor(E + 2), H) + pos[2:], AssertionError),
             ((x, x, x, E, torch.tensor(True)) + pos[2:], RuntimeError),
             ((x, y, y, E, H, pos[2], pos[3].reshape(1, 3 * E)) + pos[4:], RuntimeError)]
    for args, kind in cases:
        with pytest.raises(kind) as theirs:
            F.multi_head_attention_forward(*args, **kw)
        with pytest.raises(kind) as ours:
            mt.multi_head_attention_forward(*args, **kw)
        assert isinstance(ours.value, (ValueError, TypeError))
        assert str(theirs.value) in str(ours.value)
    # unbatched, torch's functional makes query, key and value three tensors
    # and splits the row (a ValueError): refused too
    with pytest.raises(ValueError):
        F.multi_head_attention_forward(x[:, 0], x[:, 0], x[:, 0], E, H, pos[2],
                                       pos[3].reshape(1, 3 * E), *pos[4:], **kw)
    q1 = x[:, 0]
    with pytest.raises(ValueError, match=r"in_proj_bias must have shape \(48,\)"):
        mt.multi_head_attention_forward(q1, q1, q1, E, H, pos[2], pos[3].reshape(1, 3 * E),
                                        *pos[4:], **kw)
    row = pos[:3] + (pos[3].detach().reshape(1, 3 * E).clone().requires_grad_(),) + pos[4:]
    got = mt.multi_head_attention_forward(x, x, x, E, H, *row[2:], **kw, training=False)
    want = F.multi_head_attention_forward(x, x, x, E, H, *row[2:], **kw, training=False)
    _close(got[0].detach(), want[0].detach(), 1e-10, "(1, 3E) in_proj_bias, self-attention")
    grads = [torch.autograd.grad(r[0].sum(), row[3])[0] for r in (got, want)]
    assert grads[0].shape == (1, 3 * E)
    _close(grads[0], grads[1], 1e-10, "its gradient")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("out_width", [6, 24])
def test_an_output_projection_to_another_width(dtype, out_width):
    """out_proj_weight (Eo, E): OpenAI CLIP's attention pooling projects to
    its output width through the functional (torch's linear takes any Eo):
    the class token's query over every position, separate weights; also a
    query that sees no key (NaN with weights, the bias without, as torch)."""
    g = torch.Generator().manual_seed(5)

    def t(*shape):
        return (0.3 * torch.randn(*shape, generator=g, dtype=dtype)).requires_grad_()
    x = t(S, B, E)
    q_w, k_w, v_w, o_w = t(E, E), t(E, E), t(E, E), t(out_width, E)
    in_b, o_b = t(3 * E), t(out_width)
    blocked = torch.zeros(1, S, dtype=torch.bool)
    for need, bias, mask in ((True, True, None), (False, True, None), (False, False, None),
                             (False, True, ~blocked), (True, True, ~blocked)):
        leaves = [x, q_w, k_w, v_w, o_w] + ([in_b, o_b] if bias else [])
        results = []
        for f in (mt.multi_head_attention_forward, F.multi_head_attention_forward):
            for leaf in leaves:
                leaf.grad = None
            out, w = f(x[:1], x, x, E, H, None, in_b if bias else None, None, None, False,
                       0.0, o_w, o_b if bias else None, training=False, need_weights=need,
                       attn_mask=mask, use_separate_proj_weight=True, q_proj_weight=q_w,
                       k_proj_weight=k_w, v_proj_weight=v_w)
            assert out.shape == (1, B, out_width)
            out.nan_to_num().sum().backward()
            results.append((out.detach(), w, [leaf.grad.clone() for leaf in leaves]))
        (ours, w1, g1), (want, w2, g2) = results
        what = f"need_weights={need} bias={bias} mask={mask is not None}"
        _close(ours, want, TOL[dtype], what)
        _close(None if w1 is None else w1.detach(), None if w2 is None else w2.detach(),
               TOL[dtype], what)
        for i, (a, b) in enumerate(zip(g1, g2)):
            _close(a, b, TOL[dtype], f"{what}: gradient {i}")
    with pytest.raises(ValueError, match=r"out_proj_weight must have shape \(output width"):
        mt.multi_head_attention_forward(x, x, x, E, H, None, None, None, None, False, 0.0,
                                        torch.ones(6, E + 1, dtype=dtype), None,
                                        use_separate_proj_weight=True, q_proj_weight=q_w,
                                        k_proj_weight=k_w, v_proj_weight=v_w)
    with pytest.raises(ValueError, match=r"out_proj_bias must have shape \(6,\)"):
        mt.multi_head_attention_forward(x, x, x, E, H, None, None, None, None, False, 0.0,
                                        o_w[:6], torch.ones(E, dtype=dtype),
                                        use_separate_proj_weight=True, q_proj_weight=q_w,
                                        k_proj_weight=k_w, v_proj_weight=v_w)


@pytest.mark.parametrize("call", ["module", "functional"])
def test_an_input_of_another_dtype_is_refused_as_torch_refuses_it(call):
    """torch's module and functional raise a RuntimeError for a query of
    another dtype than the weights; ours computed it in the weights' dtype
    (a float64 query gave float32 numbers).  Under CPU autocast the call
    still computes in the parameters' dtype."""
    m = mt.MultiheadAttention(E, H)
    ref = nn.MultiheadAttention(E, H)
    pos, kw = _args(ref, "both")

    def run(module, functional, x):
        return module(x, x, x) if call == "module" else functional(x, x, x, *pos, **kw)

    for dtype in (torch.float64, torch.float16, torch.int64):
        x = torch.ones(L, B, E, dtype=dtype)
        with pytest.raises(RuntimeError):
            run(ref, F.multi_head_attention_forward, x)
        with pytest.raises(TypeError, match="but the parameters are torch.float32") as got:
            run(m, mt.multi_head_attention_forward, x)
        assert isinstance(got.value, RuntimeError)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(*(torch.ones(L, B, E, dtype=torch.bfloat16),) * 3)[0]
    assert out.dtype == torch.float32


COMPILE = r"""
import sys
import torch, torch.nn.functional as F
from torch import nn
import mha_ext.torch as mt
calls = []
def counted(*a, **k):
    calls.append(1)
    return mt.multi_head_attention_forward(*a, **k)
F.multi_head_attention_forward = counted   # before torch.compile's first compilation
torch.manual_seed(0)
m = nn.MultiheadAttention(16, 4)
x = torch.randn(5, 3, 16, requires_grad=True)
want = m(x, x, x)[0]
(g_want,) = torch.autograd.grad(want.square().sum(), x)
n = len(calls)
got = torch.compile(m, backend=sys.argv[1])(x, x, x)[0]
(g_got,) = torch.autograd.grad(got.square().sum(), x)
assert len(calls) > n, "the compiled module did not call mha_ext"
assert torch.allclose(got, want, atol=1e-6) and torch.allclose(g_got, g_want, atol=1e-5)
print("ok")
"""


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_after_the_patch_runs_the_twin_outside_the_graph(backend):
    """Patched in before torch.compile's first compilation (its table of
    torch functions is made then, by name), the twin was taken for torch's
    own and run on fake tensors: a TorchRuntimeError ('.numpy() is not
    supported for tensor subclasses').  Now a graph break: the call runs on
    the real tensors.  A fresh process: the table is made once per process."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-c", COMPILE, backend], capture_output=True,
                       text=True, timeout=600, env=env)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


@pytest.mark.parametrize("need_weights", [True, False])
def test_dropout_p_of_one_in_training_drops_every_weight_as_torch(need_weights):
    torch.manual_seed(0)
    L, B, E, H = 3, 2, 4, 2
    q = torch.randn(L, B, E, dtype=torch.float64)
    W, b = torch.randn(3 * E, E, dtype=torch.float64), torch.randn(3 * E, dtype=torch.float64)
    Wo, bo = torch.randn(E, E, dtype=torch.float64), torch.randn(E, dtype=torch.float64)
    args = (q, q, q, E, H, W, b, None, None, False, 1.0, Wo, bo)
    want = F.multi_head_attention_forward(*args, training=True, need_weights=need_weights)
    got = mt.multi_head_attention_forward(*args, training=True, need_weights=need_weights)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-12)  # out_proj's bias alone
    if need_weights:
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)


def test_a_bias_k_of_e_values_in_another_shape_is_refused_as_torch_refuses_it():
    torch.manual_seed(0)
    L, B, E, H = 3, 2, 4, 2
    q = torch.randn(L, B, E)
    W, b, Wo, bo = torch.randn(3 * E, E), torch.randn(3 * E), torch.randn(E, E), torch.randn(E)
    for bk, bv in ((torch.randn(E, 1, 1), torch.randn(1, 1, E)),
                   (torch.randn(1, 1, E), torch.randn(1, E, 1))):
        args = (q, q, q, E, H, W, b, bk, bv, False, 0.0, Wo, bo)
        with pytest.raises(RuntimeError):
            F.multi_head_attention_forward(*args, training=False)
        with pytest.raises(RuntimeError, match="must hold embed_dim = 4 values"):
            mt.multi_head_attention_forward(*args, training=False)


@pytest.mark.parametrize("dropout_p", [np.array(0.0), np.array(0.5), np.array([0.0]),
                                       torch.tensor([0.0]), torch.tensor([0.5]),
                                       torch.tensor(0.5), np.float64(0.5), 0,
                                       np.array(np.nan), np.array([np.nan]),
                                       torch.tensor([float("nan")]), np.array([-0.5]),
                                       np.array(["0"])])
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("training", [True, False])
def test_an_array_as_dropout_p_is_refused_where_torch_refuses_it(dropout_p, need_weights,
                                                                  training):
    """torch hands dropout_p to its SDPA (need_weights=False) or, above 0,
    to its dropout, both of which take a float: a NumPy array or a tensor
    with dimensions is its TypeError there, and computed where torch reads
    no float (outside training, or no dropout drawn with the weights)."""
    torch.manual_seed(0)
    q = torch.randn(3, 2, 4, dtype=torch.float64)
    W, b = torch.randn(12, 4, dtype=torch.float64), torch.randn(12, dtype=torch.float64)
    Wo, bo = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    args = (q, q, q, 4, 2, W, b, None, None, False, dropout_p, Wo, bo)
    kw = dict(training=training, need_weights=need_weights)
    try:
        F.multi_head_attention_forward(*args, **kw)
    except TypeError:
        with pytest.raises(TypeError, match="dropout_p must be a float.*torch: argument"):
            mt.multi_head_attention_forward(*args, **kw)
    else:
        mt.multi_head_attention_forward(*args, **kw)
