"""The torch classes keep their parameters' NumPy views between plain calls
(no_grad, inference_mode, or nothing requiring grad): a call converts only
its inputs while every parameter is still the same memory.  These tests
check that the views are reused, and that every way of changing the
parameters reaches the next call all the same: writes in place, a new
tensor under .data, a new Parameter, .double(), a parametrization,
torch.func.functional_call, and a deepcopy.  A call autograd records reads
in_proj_weight and in_proj_bias whole (no autograd slices of them).

Each expectation is torch.nn.MultiheadAttention's output with the same
parameters (float32: 1e-5; float64: 1e-10).

Legend: B batch, S length, E = embed_dim, H = num_heads.
"""
import copy

import pytest

from _support import require_torch

torch = require_torch()

import mha_ext.torch as mt  # noqa: E402
from mha_ext import _torch_fn  # noqa: E402

E, H = 64, 4


def _pair(**kw):
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(E, H, batch_first=True, **kw).eval()
    ours = mt.MultiheadAttention(E, H, batch_first=True, **kw).eval()
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def _x(dtype=torch.float32):
    return torch.randn(2, 5, E, generator=torch.Generator().manual_seed(1), dtype=dtype)


def _check(ref, ours, x, tol=1e-5):
    with torch.inference_mode():
        got = ours(x, x, x, need_weights=False)[0]
        want = ref(x, x, x, need_weights=False)[0]
    assert torch.allclose(got, want, atol=tol, rtol=tol), (got - want).abs().max()


def _conversions(monkeypatch):
    """A list that grows by one name per to_numpy of the torch classes' calls."""
    seen = []
    real = _torch_fn.to_numpy

    def counting(x, name="tensor"):
        seen.append(name)
        return real(x, name)

    monkeypatch.setattr(_torch_fn, "to_numpy", counting)
    return seen


@pytest.mark.parametrize("kw", [{}, {"kdim": 32, "vdim": 48}, {"add_bias_kv": True},
                                {"bias": False}])
def test_plain_calls_convert_the_parameters_once(monkeypatch, kw):
    ref, ours = _pair(**kw)
    seen = _conversions(monkeypatch)
    x = _x()
    k = torch.randn(2, 7, kw.get("kdim", E))
    v = torch.randn(2, 7, kw.get("vdim", E))
    with torch.inference_mode():
        first = ours(x, k, v, need_weights=False)[0]
        n_first = seen.count("parameters")
        assert n_first >= 4
        del seen[:]
        again = ours(x, k, v, need_weights=False)[0]
        want = ref(x, k, v, need_weights=False)[0]
    assert seen.count("parameters") == 0, seen
    assert torch.equal(first, again)
    assert torch.allclose(again, want, atol=1e-5, rtol=1e-5)


def test_generic_class_converts_the_parameters_once(monkeypatch):
    torch.manual_seed(0)
    m = mt.MultiHeadAttention(E, H).eval()
    seen = _conversions(monkeypatch)
    x = _x()
    with torch.no_grad():
        first = m(x, need_weights=False)[0]
        del seen[:]
        again = m(x, need_weights=False)[0]
        with torch.no_grad():
            m.W_o.weight.mul_(2.0)
        changed = m(x, need_weights=False)[0]
    assert seen.count("parameters") == 0, seen
    assert torch.equal(first, again)
    assert not torch.allclose(changed, first)


def test_writes_in_place_reach_the_next_call():
    ref, ours = _pair()
    x = _x()
    _check(ref, ours, x)
    with torch.no_grad():
        for m in (ref, ours):
            m.in_proj_weight.mul_(1.5)
            m.out_proj.bias.add_(0.25)
            m.in_proj_bias.data.copy_(torch.linspace(-1, 1, 3 * E))
    _check(ref, ours, x)


def test_new_tensor_under_data_reaches_the_next_call():
    ref, ours = _pair()
    x = _x()
    _check(ref, ours, x)
    w = torch.randn(3 * E, E) * 0.1
    ref.in_proj_weight.data = w.clone()
    ours.in_proj_weight.data = w.clone()
    _check(ref, ours, x)


def test_same_address_other_strides():
    ref, ours = _pair()
    x = _x()
    t = torch.randn(E, E) * 0.1
    ref.out_proj.weight.data = t.clone()
    ours.out_proj.weight.data = t
    _check(ref, ours, x)
    # the same storage, transposed: the same address, other strides
    ref.out_proj.weight.data = t.t().contiguous()
    ours.out_proj.weight.data = t.t()
    _check(ref, ours, x)


def test_same_address_negated():
    # z.conj().imag: the same memory as z.imag, read negated (torch's neg bit)
    ref, ours = _pair()
    x = _x()
    z = torch.randn(E, E, dtype=torch.complex64) * 0.1
    for m in (ref, ours):
        m.out_proj.weight.data = z.imag
    _check(ref, ours, x)
    for m in (ref, ours):
        m.out_proj.weight.data = z.conj().imag
    assert ours.out_proj.weight.is_neg()
    _check(ref, ours, x)


def test_new_parameter_reaches_the_next_call():
    ref, ours = _pair()
    x = _x()
    _check(ref, ours, x)
    b = torch.randn(E)
    ref.out_proj.bias = torch.nn.Parameter(b.clone())
    ours.out_proj.bias = torch.nn.Parameter(b.clone())
    _check(ref, ours, x)


def test_double_then_float_again():
    ref, ours = _pair()
    x = _x()
    _check(ref, ours, x)
    ref.double()
    ours.double()
    _check(ref, ours, _x(torch.float64), tol=1e-10)
    ref.float()
    ours.float()
    _check(ref, ours, x)


def test_parametrization_is_read_at_each_call():
    from torch.nn.utils import parametrize

    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.s = 1.0

        def forward(self, w):
            return w * self.s

    ref, ours = _pair()
    sr, so = Scale(), Scale()
    parametrize.register_parametrization(ref, "in_proj_weight", sr)
    parametrize.register_parametrization(ours, "in_proj_weight", so)
    x = _x()
    _check(ref, ours, x)
    sr.s = so.s = 0.5
    _check(ref, ours, x)
    # a parametrization makes new tensors each call: none kept (only held)
    assert _torch_fn._KEPT.get(ours) is None


def test_functional_call_uses_the_given_parameters():
    from torch.func import functional_call

    ref, ours = _pair()
    x = _x()
    _check(ref, ours, x)
    new = {k: torch.randn_like(v) * 0.1 for k, v in ref.state_dict().items()}
    with torch.inference_mode():
        got = functional_call(ours, new, (x, x, x), {"need_weights": False})[0]
        want = functional_call(ref, new, (x, x, x), {"need_weights": False})[0]
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    _check(ref, ours, x)  # its own parameters again


def test_deepcopy_computes_with_its_own_parameters():
    ref, ours = _pair()
    x = _x()
    _check(ref, ours, x)
    ref2, ours2 = copy.deepcopy(ref), copy.deepcopy(ours)
    with torch.no_grad():
        ref2.in_proj_weight.mul_(-1.0)
        ours2.in_proj_weight.mul_(-1.0)
    _check(ref2, ours2, x)
    _check(ref, ours, x)
    del ours
    _check(ref2, ours2, x)


def test_scores_overflowing_to_minus_inf_give_torchs_nan():
    # every score of a row -inf without any mask: on torch's fast path
    # (eval, no grad, batch-first self-attention, need_weights=False) the
    # row is NaN; ours says the same
    e, h = 8, 2
    ref = torch.nn.MultiheadAttention(e, h, batch_first=True).eval()
    ours = mt.MultiheadAttention(e, h, batch_first=True).eval()
    eye = torch.eye(e)
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([eye, -eye, eye]))
        ref.in_proj_bias.zero_()
        ref.out_proj.weight.copy_(1e-20 * eye)
        ref.out_proj.bias.fill_(0.5)
    ours.load_state_dict(ref.state_dict())
    x = torch.full((1, 3, e), 1e20)
    with torch.inference_mode():
        want = ref(x, x, x, need_weights=False)[0]
        got = ours(x, x, x, need_weights=False)[0]
    assert torch.isnan(want).all()
    assert torch.isnan(got).all()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("bias_kv", [False, True])
def test_a_recorded_call_reads_in_proj_whole_and_its_gradients_are_torchs(bias, bias_kv):
    """Under autograd the packed in_proj_weight and in_proj_bias reach the
    Function whole (no slice of them in the graph: each slice's backward
    allocated a zeroed (3E, E) tensor), and their gradients are torch's."""
    torch.manual_seed(1)
    ref = torch.nn.MultiheadAttention(E, H, batch_first=True, bias=bias, add_bias_kv=bias_kv,
                                      dtype=torch.float64)
    ours = mt.MultiheadAttention(E, H, batch_first=True, bias=bias, add_bias_kv=bias_kv,
                                 dtype=torch.float64)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(2, 5, E, dtype=torch.float64)
    out, _ = ours(x, x, x, need_weights=False)
    seen, todo = {}, [out.grad_fn]
    while todo:  # every node of the graph
        f = todo.pop()
        if f is not None and id(f) not in seen:
            seen[id(f)] = f
            todo += [g for g, _ in f.next_functions]
    nodes = {type(f).__name__ for f in seen.values()}
    assert "AttentionFunctionBackward" in nodes
    assert not any("Slice" in n for n in nodes), nodes
    want, _ = ref(x, x, x, need_weights=False)
    want.square().sum().backward()
    out.square().sum().backward()
    for (name, a), (_, b) in zip(ours.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-10, msg=name)
