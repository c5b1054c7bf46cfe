"""Masks that require grad get their gradients, as torch gives them.

A float attn_mask or key_padding_mask is added to the scores before the
softmax, so its gradient is the masked scores' gradient dL/dS' (the C
backward's grad_scores) summed over the axes along which it was broadcast.
torch's modules and functionals differentiate them (a learned
relative-position bias: Graphormer, Swin, T5; torch's own OpInfo samples of
multi_head_attention_forward make attn_mask require grad); so do mha_ext's
twins, checked here against torch itself.

Legend: B batch, L query length, S key length, E = embed_dim, H = num_heads.
"""
import itertools

import numpy as np
import pytest

from _support import require_torch

torch = require_torch()
import mha_ext  # noqa: E402
import mha_ext.torch as mt  # noqa: E402

E, H, B, L, S = 8, 2, 3, 5, 6
TOL = {torch.float32: 2e-6, torch.float64: 1e-12}  # relative to 1 + max |torch's|


def _close(got, want, dtype, what):
    assert got is not None and want is not None, what
    got, want = got.detach(), want.detach()
    assert got.shape == want.shape and got.dtype == want.dtype, what
    assert torch.equal(torch.isnan(got), torch.isnan(want)), f"{what}: NaN elsewhere"
    ok = ~torch.isnan(want)
    err = float((got[ok] - want[ok]).abs().max()) if ok.any() else 0.0
    assert err <= TOL[dtype] * (1 + float(want[ok].abs().max() if ok.any() else 0)), \
        f"{what}: {err}"


def _loss(out, w):
    # a loss that weighs every output (and weight) element differently
    loss = (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)).sum()
    if w is not None:
        loss = loss + (w * torch.linspace(0, 2, w.numel(), dtype=w.dtype).reshape(w.shape)).sum()
    return loss


CONFIGS = list(itertools.product(
    (torch.float64, torch.float32),
    ("attn (L, S)", "attn (B*H, L, S)", "key padding", "both"),
    ("batch first", "seq first", "unbatched"),
    ("plain", "add_bias_kv + add_zero_attn"),
    (True, False)))


@pytest.mark.parametrize("dtype,masks,layout,extra,need_weights", CONFIGS,
                         ids=[f"{d}-{m}-{la}-{e}-w{w}".replace("torch.", "").replace(" ", "")
                              for d, m, la, e, w in CONFIGS])
def test_the_drop_in_gives_learned_masks_torchs_gradients(dtype, masks, layout, extra,
                                                          need_weights):
    g = torch.Generator().manual_seed(1)
    kw = dict(batch_first=layout == "batch first", dtype=dtype)
    if extra != "plain":
        kw.update(add_bias_kv=True, add_zero_attn=True)
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(E, H, **kw)
    ours = mt.MultiheadAttention.from_torch(ref)
    if layout == "unbatched":
        shape = lambda n: (n, E)  # noqa: E731
    else:
        shape = (lambda n: (B, n, E)) if layout == "batch first" else (lambda n: (n, B, E))
    q, k, v = (torch.randn(shape(n), generator=g, dtype=dtype) for n in (L, S, S))
    attn = pad = None
    if masks in ("attn (L, S)", "both"):
        attn = torch.randn(L, S, generator=g, dtype=dtype)
        attn[1, 2] = float("-inf")  # a blocked key: gradient 0 there
    if masks == "attn (B*H, L, S)":
        attn = torch.randn((H if layout == "unbatched" else B * H), L, S, generator=g,
                           dtype=dtype)
    if masks in ("key padding", "both"):
        pad = torch.randn((S,) if layout == "unbatched" else (B, S), generator=g, dtype=dtype)
    results = []
    for module in (ours, ref):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        learned = [None if t is None else t.clone().requires_grad_() for t in (attn, pad)]
        out, w = module(*leaves, attn_mask=learned[0], key_padding_mask=learned[1],
                        need_weights=need_weights)
        _loss(out, w).backward()
        results.append([out, *(t.grad for t in leaves),
                        *(t.grad for t in learned if t is not None)])
    for i, (got, want) in enumerate(zip(*results)):
        _close(got, want, dtype, f"result {i}")


def test_the_functional_twin_gives_a_learned_mask_its_gradient():
    # as torch's OpInfo sample of multi_head_attention_forward: every tensor
    # requires grad, the float attn_mask too (sequence first, bias_k, bias_v)
    g = torch.Generator().manual_seed(2)
    dt = torch.float64
    r = lambda *s: torch.randn(*s, generator=g, dtype=dt) * 3  # noqa: E731
    args = [r(L, B, E), r(S, B, E), r(S, B, E), E, H, r(3 * E, E), r(3 * E), r(1, 1, E),
            r(1, 1, E), False, 0.0, r(E, E), r(E)]
    kw = dict(training=False, attn_mask=r(L, S))
    results = []
    for f in (mt.multi_head_attention_forward, torch.nn.functional.multi_head_attention_forward):
        leaves, a2, k2 = [], [], {}
        for a in args:
            if isinstance(a, torch.Tensor):
                a = a.clone().requires_grad_()
                leaves.append(a)
            a2.append(a)
        k2 = dict(kw, attn_mask=kw["attn_mask"].clone().requires_grad_())
        leaves.append(k2["attn_mask"])
        out, w = f(*a2, **k2)
        results.append([out, w, *torch.autograd.grad(_loss(out, w), leaves)])
    for i, (got, want) in enumerate(zip(*results)):
        _close(got, want, dt, f"result {i}")


def test_dropout_and_gradcheck_through_a_learned_mask():
    # the drop-in in training draws its dropout stream from torch's
    # generator: re-seeded before each call, a function of its inputs
    torch.manual_seed(0)
    m = mt.MultiheadAttention(E, H, dropout=0.3, batch_first=True, dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, L, E, generator=g, dtype=torch.float64, requires_grad=True)
    attn = torch.randn(L, L, generator=g, dtype=torch.float64, requires_grad=True)
    pad = torch.randn(2, L, generator=g, dtype=torch.float64, requires_grad=True)

    def f(q, attn, pad):
        torch.manual_seed(7)
        return m(q, q, q, attn_mask=attn, key_padding_mask=pad)[0]
    assert torch.autograd.gradcheck(f, (q, attn, pad), check_batched_grad=False)


def test_mha_ext_torch_module_learns_additive_masks_not_its_blocking_mask():
    torch.manual_seed(0)
    a = mt.MultiHeadAttention(E, H, dtype=torch.float64, seed=0)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(B, L, E, generator=g, dtype=torch.float64, requires_grad=True)
    attn = torch.randn(B, H, L, L, generator=g, dtype=torch.float64, requires_grad=True)
    pad = torch.randn(B, L, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, attn, pad: a(q, attn_mask=attn.reshape(B * H, L, L), key_padding_mask=pad)[0],
        (q, attn, pad), check_batched_grad=False)
    # only the mask requires grad: the call still records it
    out = a(q.detach(), attn_mask=attn.reshape(B * H, L, L))[0]
    assert out.requires_grad
    with pytest.raises(ValueError, match="0/1 blocking mask"):
        a(q, mask=torch.zeros(L, L, dtype=torch.float64, requires_grad=True))
    with torch.no_grad():  # no gradient asked for: taken as any mask
        a(q, mask=torch.zeros(L, L, dtype=torch.float64, requires_grad=True))


def test_backward_returns_the_masked_scores_gradient():
    # the NumPy API: scores_grad=True adds dL/dS'; summed as an (Sq, Sk)
    # attn_mask broadcasts, it is that mask's gradient (against torch's)
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64)
    mha = mha_ext.MultiHeadAttention(E, H, dtype="float64", seed=0)
    mha.load_state_dict({k: v.numpy() for k, v in ref.state_dict().items()})  # torch's keys
    rng = np.random.default_rng(5)
    x = rng.standard_normal((B, L, E))
    mask = rng.standard_normal((L, L))
    ctx = mha.forward_train(x, attn_mask=mask, need_weights=False)
    go = rng.standard_normal(ctx.output.shape)
    grads = mha.backward(ctx, go, scores_grad=True)
    assert grads["scores"].shape == (B, H, L, L)
    tm = torch.tensor(mask, requires_grad=True)
    xt = torch.tensor(x)
    out = ref(xt, xt, xt, attn_mask=tm, need_weights=False)[0]
    (out * torch.tensor(go)).sum().backward()
    np.testing.assert_allclose(out.detach().numpy(), ctx.output, rtol=0, atol=1e-12)
    np.testing.assert_allclose(grads["scores"].sum(axis=(0, 1)), tm.grad.numpy(), rtol=0,
                               atol=1e-12)
    assert "scores" not in mha.backward(ctx, go)


@pytest.mark.parametrize("kw", [{}, {"add_bias_kv": True}, {"kdim": 6, "vdim": 5}],
                         ids=["packed", "add_bias_kv", "separate"])
def test_a_loss_on_the_weights_alone_leaves_the_values_path_none_as_torch(kw):
    # an attention-map loss (distillation): the values, W_v and out_proj do
    # not reach it; torch leaves their .grad None, which AdamW's weight decay
    # and momentum skip; zeros were acted on
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64, **kw)
    ours = mt.MultiheadAttention.from_torch(ref)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(B, L, E, generator=g, dtype=torch.float64)
    k = torch.randn(B, S, kw.get("kdim", E), generator=g, dtype=torch.float64)
    v = torch.randn(B, S, kw.get("vdim", E), generator=g, dtype=torch.float64)
    results = []
    for m in (ours, ref):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        w = m(*leaves, average_attn_weights=False)[1]
        _loss(w, None).backward()
        results.append({**{n: p.grad for n, p in m.named_parameters()},
                        **dict(zip("qkv", (t.grad for t in leaves)))})
    got, want = results
    assert set(got) == set(want)
    for name in want:
        if want[name] is None:
            assert got[name] is None, name
        else:
            _close(got[name], want[name], torch.float64, name)
