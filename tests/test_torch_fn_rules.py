"""The torch classes' autograd Function and its routing (mha_ext._torch_fn)
where mutation testing found no test holding the rule: a mutant of each
passed the torch test files before.  Each expectation is torch's own module
or function on the same parameters (float32: 1e-5; float64: 1e-10), or the
contract of docs/API.md §8 where torch has no such call.

Legend: B batch, L length, E = embed_dim, H = num_heads.
"""
import pytest

from _support import require_torch

torch = require_torch()

import mha_ext.torch as mt  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.utils import parametrize  # noqa: E402

E, H, B, L = 16, 4, 2, 5
F64 = torch.float64


class Identity(nn.Module):
    """An identity parametrization: the tensor computed, its value kept."""

    def forward(self, w):
        return w


def _pair(dtype=F64, batch_first=True, **kw):
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, batch_first=batch_first, dtype=dtype, **kw)
    ours = mt.MultiheadAttention(E, H, batch_first=batch_first, dtype=dtype, **kw)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def _x(dtype=F64, shape=(B, L, E), seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# ------------------------------------------------------------ parametrized bias_k

@pytest.mark.parametrize("training", [True, False])
def test_a_parametrized_bias_k_is_still_the_modules_bias_k(training):
    # holds(): a parametrized bias_k is no longer in _parameters; it was taken
    # for "no bias_k" (the extra key dropped: outputs 0.1 off torch's)
    ref, ours = _pair(add_bias_kv=True)
    for m in (ref, ours):
        m.train(training)
        parametrize.register_parametrization(m, "bias_k", Identity())
    x = _x()
    want, want_w = ref(x, x, x)
    got, got_w = ours(x, x, x)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got_w, want_w, rtol=1e-10, atol=1e-10)
    want.sum().backward()
    got.sum().backward()
    for (name, p), (_, q) in zip(ref.named_parameters(), ours.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-10, atol=1e-10, msg=name)


# ------------------------------------------------- no grad mode: nothing recorded

@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_a_mask_requiring_grad_under_no_grad_takes_the_plain_path(mode):
    # API.md §8: with grad mode off a call is the module's plain forward; a
    # float mask that requires grad made it the recording one (other bits)
    torch.manual_seed(0)
    x = _x(torch.float32, (B, 8, 64))       # E 64: the two paths' bits differ there
    ours = mt.MultiheadAttention(64, H, batch_first=True)
    fm = torch.randn(8, 8, generator=torch.Generator().manual_seed(2), requires_grad=True)
    ctx = torch.no_grad if mode == "no_grad" else torch.inference_mode
    with ctx():
        got = ours(x, x, x, attn_mask=fm, need_weights=False)[0]
        plain = ours(x, x, x, attn_mask=fm.detach(), need_weights=False)[0]
    assert not got.requires_grad
    assert torch.equal(got, plain), (got - plain).abs().max()


# ------------------------------------------------- mask gradients among masks

@pytest.mark.parametrize("learned", ["key_padding_mask", "attn_mask"])
def test_a_learned_mask_next_to_a_fixed_one_gets_its_own_gradient(learned):
    # the gradient of a mask requiring grad is its own part of the scores'
    # gradient, found by its place among all the call's masks (not only among
    # those requiring grad: the fixed attn_mask's shape was taken instead)
    ref, ours = _pair()
    x = _x()
    g = torch.Generator().manual_seed(3)
    fixed = {"attn_mask": torch.randn(L, L, generator=g, dtype=F64),
             "key_padding_mask": torch.randn(B, L, generator=g, dtype=F64)}
    grads = []
    for m in (ref, ours):
        masks = {n: t.clone().requires_grad_(n == learned) for n, t in fixed.items()}
        out, w = m(x, x, x, **masks)
        (out.sum() + (w * w).sum()).backward()
        grads.append(masks[learned].grad)
    assert grads[1] is not None and grads[1].shape == fixed[learned].shape
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-10, atol=1e-10)


# ------------------------------------------------------- what no trace records

@pytest.mark.parametrize("kind", ["drop-in", "MultiHeadAttention"])
@pytest.mark.parametrize("grad", [True, False])
def test_make_fx_of_a_torch_class_is_refused_not_traced_as_a_constant(kind, grad):
    # API.md §8: make_fx on real tensors held the call's result as a constant
    # (the SDPA twin's test did not reach the modules' path)
    from torch.fx.experimental.proxy_tensor import make_fx
    torch.manual_seed(0)
    m = (mt.MultiheadAttention(E, H, batch_first=True) if kind == "drop-in"
         else mt.MultiHeadAttention(E, H))
    x = _x(torch.float32)
    with torch.set_grad_enabled(grad), pytest.raises(RuntimeError, match="make_fx"):
        make_fx(lambda t: m(t, t, t)[0], tracing_mode="real")(x)


@pytest.mark.parametrize("name", ["in_proj_weight", "in_proj_bias", "out_proj.weight"])
def test_a_transform_of_one_parameter_names_a_weight_or_bias(name):
    # API.md §8: under a transform of functional_call's parameters the error
    # names "a weight or bias of the attention"; with in_proj_weight alone
    # transformed it named the query (which the transform had not taken)
    from torch.func import functional_call, grad
    _, ours = _pair(dtype=torch.float32)
    x = _x(torch.float32)
    w = dict(ours.named_parameters())[name].detach()
    with pytest.raises(RuntimeError, match="^a weight or bias of the attention is a tensor of "
                                           "a torch.func transform"):
        grad(lambda t: functional_call(ours, {name: t}, (x, x, x))[0].sum())(w)


# ------------------------------------------------ kept views: copies not kept

def test_a_negated_view_parameter_is_read_again_after_a_write_in_place():
    # a negated view is resolved into new memory: that copy must not be kept
    # as the parameter's view (a write in place to its memory went unseen:
    # 6.6 off torch's module)
    ref, ours = _pair(dtype=torch.float32)
    base = torch.randn(3 * E, E, generator=torch.Generator().manual_seed(4))
    for m in (ref, ours):
        m.in_proj_weight = nn.Parameter(torch._neg_view(base))
    assert ours.in_proj_weight.is_neg()
    x = _x(torch.float32)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(ours(x, x, x)[0], ref(x, x, x)[0], rtol=1e-5, atol=1e-5)
            base.mul_(2)        # the same memory, written in place
