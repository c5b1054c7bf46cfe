"""Dropout in the torch-facing APIs draws from torch's default generator, as
torch's own dropout does: torch.manual_seed repeats a run, deep copies of a
module draw different masks, and torch.utils.checkpoint (which restores that
generator before it recomputes a forward, reentrant or not) gets the
gradients of the forward that made the loss.  Before, the stream was
mha_ext's own (a counter in the module, or a fresh seed per SDPA call): a
reentrant checkpoint of the drop-in class differentiated another mask than
the forward's (gradients 0.68 off), and the SDPA's under either checkpoint.

Also: inputs made under torch.inference_mode() train, as torch's do (they
were saved for backward, which torch refuses for inference tensors).

Legend: B batch, L query length, S key length, E = embed_dim, H heads.
"""
import copy

import pytest

from _support import require_torch

torch = require_torch()
from torch.utils.checkpoint import checkpoint  # noqa: E402

import mha_ext  # noqa: E402
import mha_ext.torch as mt  # noqa: E402

B, L, E, H, P = 2, 7, 8, 2, 0.5


def _dropin():
    torch.manual_seed(3)
    return mt.MultiheadAttention(E, H, dropout=P, batch_first=True, dtype=torch.float64)


def _ours():
    return mt.MultiHeadAttention(E, H, dropout=P, dtype=torch.float64, seed=4)


def _sdpa_module():
    # the SDPA twin behind a projection, as a Hugging Face layer calls it
    torch.manual_seed(5)
    lin = torch.nn.Linear(E, 3 * E, dtype=torch.float64)

    def run(x):
        q, k, v = (t.unflatten(-1, (H, E // H)).transpose(1, 2) for t in lin(x).chunk(3, -1))
        return mha_ext.scaled_dot_product_attention(q, k, v, dropout_p=P), None
    run.parameters = lin.parameters
    return run


MAKERS = {"drop-in MultiheadAttention": _dropin, "MultiHeadAttention": _ours,
          "scaled_dot_product_attention": _sdpa_module}


def _call(m, x):
    if isinstance(m, mt.MultiheadAttention):
        return m(x, x, x, need_weights=False)[0]
    if isinstance(m, mt.MultiHeadAttention):
        return m(x, need_weights=False)[0]
    return m(x)[0]


def _x():
    return torch.randn(B, L, E, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(9))


@pytest.mark.parametrize("kind", MAKERS)
def test_manual_seed_repeats_the_dropout_mask(kind):
    m, x = MAKERS[kind](), _x()
    torch.manual_seed(11)
    a = _call(m, x)
    torch.manual_seed(11)
    b = _call(m, x)
    c = _call(m, x)  # the generator moved on: another mask
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert (a - c).abs().max() > 1e-3


@pytest.mark.parametrize("kind", ["drop-in MultiheadAttention", "MultiHeadAttention"])
def test_deep_copies_draw_different_masks(kind):
    m, x = MAKERS[kind](), _x()
    _call(m, x)  # the C core exists before the copies (nn.TransformerEncoder's case)
    a, b = copy.deepcopy(m), copy.deepcopy(m)
    torch.manual_seed(12)
    assert (_call(a, x) - _call(b, x)).abs().max() > 1e-3


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("kind", MAKERS)
def test_checkpoint_recomputes_the_same_mask(kind, reentrant):
    m = MAKERS[kind]()
    grads = []
    for ckpt in (False, True):
        x = _x().requires_grad_()
        for p in m.parameters():
            p.grad = None
        torch.manual_seed(13)
        if ckpt:
            out = checkpoint(lambda t: _call(m, t), x, use_reentrant=reentrant)
        else:
            out = _call(m, x)
        out.square().sum().backward()
        grads.append([x.grad] + [p.grad for p in m.parameters()])
    for plain, ck in zip(*grads):
        torch.testing.assert_close(ck, plain, rtol=1e-12, atol=1e-12)


def test_inference_mode_inputs_train():
    torch.manual_seed(14)
    ours = mt.MultiheadAttention(E, H, batch_first=True)
    ref = torch.nn.MultiheadAttention(E, H, batch_first=True)
    ref.load_state_dict(ours.state_dict())
    with torch.inference_mode():
        x = torch.randn(B, L, E)
    for m in (ours, ref):
        m(x, x, x)[0].square().sum().backward()
    torch.testing.assert_close(ours.in_proj_weight.grad, ref.in_proj_weight.grad,
                               rtol=2e-5, atol=2e-5)
    q = torch.randn(B, H, L, E // H, requires_grad=True)
    with torch.inference_mode():
        kv = torch.randn(B, H, L, E // H)
    want_q = q.detach().clone().requires_grad_()
    mha_ext.scaled_dot_product_attention(q, kv, kv).sum().backward()
    # torch's SDPA refuses them here (it saves K and V): its numbers on clones
    F = torch.nn.functional
    F.scaled_dot_product_attention(want_q, kv.clone(), kv.clone()).sum().backward()
    torch.testing.assert_close(q.grad, want_q.grad, rtol=2e-5, atol=2e-5)


def test_a_refused_call_draws_nothing():
    # torch's module and SDPA check their arguments before drawing a mask;
    # ours drew first: a refused call moved torch's generator
    x = _x()
    bad_pad = torch.zeros(B, L + 1, dtype=torch.bool)
    dropin, ours = _dropin().train(), _ours().train()
    calls = {
        "drop-in MultiheadAttention": lambda: dropin(x, x, x, key_padding_mask=bad_pad),
        "MultiHeadAttention": lambda: ours(x, key_padding_mask=bad_pad),
        "scaled_dot_product_attention": lambda: mha_ext.scaled_dot_product_attention(
            x[:, None], x[:, None], x[:, None], dropout_p=P,
            attn_mask=torch.ones(L + 1, L + 1, dtype=torch.bool)),
        # a window refused after the SDPA twin drew its seed
        "scaled_dot_product_attention, window": lambda: mha_ext.scaled_dot_product_attention(
            x[:, None], x[:, None], x[:, None], dropout_p=P, window=(-5, 0)),
        "scaled_dot_product_attention, window type": lambda: mha_ext.scaled_dot_product_attention(
            x[:, None], x[:, None], x[:, None], dropout_p=P, window="x"),
    }
    for name, call in calls.items():
        torch.manual_seed(0)
        before = torch.get_rng_state()
        with pytest.raises((ValueError, TypeError)):
            call()
        assert torch.equal(before, torch.get_rng_state()), name
