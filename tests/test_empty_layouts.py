"""Empty results in torch's memory layout: an output or weights tensor with
no element (an empty query, batch or head count) has the strides torch's
own call gives it, for the drop-in class, the functional twin and the SDPA
twin (docs/API.md §8), and the SDPA twin's results where torch's returns
zeros before computing (no query row or no value element: query's own
leading shape, not broadcast with key's and value's; a learned mask then
gets no gradient, and zeros where only a batch is empty; §4a).  NumPy 2 gives an empty array zero strides, which
torch.from_numpy keeps: without care an empty output came out with strides
(0, 0, 0) where torch's are (8, 16, 1), and a caller's .view or
as_strided code that reads them would see another layout than torch's.

The numbers of an empty tensor are none; its shape and strides are all
there is to compare.  The gradients of empty inputs are not compared here
(torch's own differ by path: zero strides from SDPA, its layout from the
module).

Legend: B batch, L query length, S key length, E width, H heads.
"""
import itertools

import numpy as np
import pytest

from _support import require_torch

torch = require_torch()
import mha_ext  # noqa: E402
from mha_ext.torch import MultiheadAttention, multi_head_attention_forward  # noqa: E402

F = torch.nn.functional
E, H, S = 8, 2, 5


def _same_layout(a, b):
    assert (a is None) == (b is None)
    if a is not None:
        assert (a.shape, a.stride()) == (b.shape, b.stride())


def _rand(*shape, grad=False):
    g = torch.Generator().manual_seed(sum(shape) + 1)
    return torch.randn(*shape, generator=g).requires_grad_(grad)


@pytest.mark.parametrize("batch_first,need_weights,average,grad,kind", [
    c for c in itertools.product((True, False), (True, False), (True, False), (True, False),
                                 ("self", "cross", "bias_kv"))
    if c[1] or c[2]])  # average_attn_weights changes nothing without weights
@pytest.mark.parametrize("B,L", [(2, 0), (0, 3), (0, 0)])
def test_an_empty_output_of_the_drop_in_has_torchs_strides(batch_first, need_weights, average,
                                                           grad, kind, B, L):
    # self-attention without grad takes torch's fused path (a contiguous
    # (B, L, E)); the others its SDPA path ((L, B, E) memory for batch_first)
    kw = dict(add_bias_kv=True, kdim=6, vdim=6) if kind == "bias_kv" else {}
    torch.manual_seed(0)
    t = torch.nn.MultiheadAttention(E, H, batch_first=batch_first, **kw).eval()
    m = MultiheadAttention(E, H, batch_first=batch_first, **kw).eval()
    m.load_state_dict(t.state_dict())
    q = _rand(B, L, E) if batch_first else _rand(L, B, E)
    Ek = kw.get("kdim", E)
    k = q if kind == "self" else (_rand(B, S, Ek) if batch_first else _rand(S, B, Ek))
    with torch.set_grad_enabled(grad):
        a = t(q, k, k, need_weights=need_weights, average_attn_weights=average)
        b = m(q, k, k, need_weights=need_weights, average_attn_weights=average)
    _same_layout(a[0], b[0])
    _same_layout(a[1], b[1])


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("L", [0, 3])
def test_an_empty_unbatched_query_or_batch_of_the_drop_in_has_torchs_strides(train, L):
    torch.manual_seed(0)
    t = torch.nn.MultiheadAttention(E, H, batch_first=True).train(train)
    m = MultiheadAttention(E, H, batch_first=True).train(train)
    m.load_state_dict(t.state_dict())
    q = _rand(L, E, grad=True) if L == 0 else _rand(0, L, E, grad=True)
    k = _rand(S, E) if L == 0 else _rand(0, S, E)
    a, b = t(q, k, k), m(q, k, k)
    _same_layout(a[0], b[0])
    _same_layout(a[1], b[1])


@pytest.mark.parametrize("L,B", [(0, 2), (3, 0), (0, 0)])
@pytest.mark.parametrize("need_weights", [True, False])
def test_an_empty_output_of_the_functional_twin_has_torchs_strides(L, B, need_weights):
    t = torch.nn.MultiheadAttention(E, H)
    args = (_rand(L, B, E), _rand(S, B, E), _rand(S, B, E), E, H, t.in_proj_weight,
            t.in_proj_bias, None, None, False, 0.0, t.out_proj.weight, t.out_proj.bias)
    a = F.multi_head_attention_forward(*args, need_weights=need_weights)
    b = multi_head_attention_forward(*args, need_weights=need_weights)
    _same_layout(a[0], b[0])
    _same_layout(a[1], b[1])


@pytest.mark.parametrize("shape", [(2, 3, 0, 4), (0, 3, 5, 4), (2, 0, 5, 4), (3, 0, 4),
                                   (0, 4)])
@pytest.mark.parametrize("grad", [False, True])
def test_an_empty_output_of_the_sdpa_twin_has_torchs_strides(shape, grad):
    q = _rand(*shape, grad=grad)
    k = _rand(*shape[:-2], S, shape[-1], grad=grad)
    _same_layout(F.scaled_dot_product_attention(q, k, k),
                 mha_ext.scaled_dot_product_attention(q, k, k))


_EARLY = [  # (query, key, value) shapes: torch's early zeros, or a batch of 0
    ((1, 2, 4, 8), (1, 2, 5, 8), (0, 2, 5, 8)),     # no value element, batch 0
    ((1, 2, 4, 8), (3, 2, 0, 8), (3, 2, 0, 8)),     # no key: query's batch 1, not 3
    ((1, 2, 0, 8), (3, 2, 5, 8), (3, 2, 5, 8)),     # no query row
    ((1, 2, 4, 8), (3, 2, 5, 8), (3, 2, 5, 0)),     # Ev 0
    ((0, 2, 4, 8), (1, 2, 5, 8), (1, 2, 5, 8)),     # query batch 0: computed, empty
    ((1, 2, 4, 8), (0, 2, 5, 8), (1, 2, 5, 8)),     # key batch 0
    ((0, 4, 8), (1, 5, 8), (1, 5, 8)),
]


@pytest.mark.parametrize("shapes", _EARLY)
def test_the_sdpa_twins_empty_calls_give_torchs_result_and_gradients(shapes):
    got = []
    for f in (F.scaled_dot_product_attention, mha_ext.scaled_dot_product_attention):
        q, k, v = (_rand(*s, grad=True) for s in shapes)
        mask = _rand(shapes[0][-2], shapes[1][-2], grad=True)
        out = f(q, k, v, attn_mask=mask)
        out.sum().backward()
        got.append((out, mask.grad, *(x.grad for x in (q, k, v))))
    (a, *ga), (b, *gb) = got
    _same_layout(a, b)
    assert torch.equal(a, b)  # zeros, or nothing
    for x, y in zip(ga, gb):
        assert (x is None) == (y is None)
        if x is not None:
            assert x.shape == y.shape and torch.equal(x, y)
    ours = mha_ext.scaled_dot_product_attention(*(np.zeros(s, np.float32) for s in shapes))
    assert ours.shape == tuple(a.shape)
