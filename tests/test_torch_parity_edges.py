"""Edges where mha_ext differed from torch 2.13, each compared with torch
itself (docs/API.md §1, §3.1, §4a, §8):

- an int argument (a window bound, a seed, the drop-in's sizes, the
  functional's embed_dim_to_check and num_heads) given as a 0-d integer
  NumPy array or tensor: torch reads one as its int (its __index__), so do
  we; a bool of any kind stays refused;
- kdim=0 / vdim=0 in the drop-in: torch builds the module and computes
  (an empty key projects to its bias alone): the same numbers and
  gradients;
- the SDPA twin with an empty value, and the drop-in's gradients of empty
  inputs: torch's shapes, strides and values."""
import operator

import numpy as np
import pytest

from _support import require_torch

torch = require_torch()
import torch.nn.functional as F  # noqa: E402

import mha_ext  # noqa: E402
import mha_ext.torch as mt  # noqa: E402

# 0-d integers of every kind torch reads as an int (operator.index gives it)
INTS = [np.int64(3), np.array(3), np.array(3, np.uint8), torch.tensor(3),
        torch.tensor(3, dtype=torch.int32)]
INT_IDS = ["np.int64", "np.array", "np.array_uint8", "torch.tensor", "torch.tensor_int32"]
# bools whose __index__ gives 0 or 1 (a Python bool too): refused, as elsewhere
BOOLS = [True, np.True_, np.array(True), torch.tensor(True)]
BOOL_IDS = ["bool", "np.bool_", "np.array_bool", "torch.tensor_bool"]


def _t(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("n", INTS, ids=INT_IDS)
def test_torch_reads_these_as_ints(n):
    # the premise: torch takes them where it takes an int
    assert operator.index(n) == 3
    assert torch.zeros(n).shape == (3,)


# ------------------------------------------------------------ 1. window bounds
@pytest.mark.parametrize("n", INTS, ids=INT_IDS)
def test_window_bound_takes_a_0d_integer(n):
    q, k, v = _t(2, 2, 6, 4, seed=1), _t(2, 2, 6, 4, seed=2), _t(2, 2, 6, 4, seed=3)
    i, j = torch.arange(6)[:, None], torch.arange(6)[None, :]
    keep = (j >= i - 3) & (j <= i + 1)  # the window (3, 1) as torch's boolean mask
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    got = mha_ext.scaled_dot_product_attention(q, k, v, window=(n, 1))
    torch.testing.assert_close(got, want)
    got = mha_ext.scaled_dot_product_attention(q, k, v, window=(3, torch.tensor(1)))
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("bad", BOOLS + [torch.tensor(3.0), np.array([3]), torch.tensor([3]),
                                         torch.tensor(-1), np.array(-1)],
                         ids=BOOL_IDS + ["float_tensor", "1d_array", "1d_tensor", "neg_tensor",
                                         "neg_array"])
def test_window_bound_refuses_bools_floats_arrays_negatives(bad):
    q = _t(1, 1, 4, 4)
    with pytest.raises(ValueError, match="window's left bound must be None"):
        mha_ext.scaled_dot_product_attention(q, q, q, window=(bad, 1))


# ------------------------------------------------------------ 2. seeds
@pytest.mark.parametrize("n", INTS, ids=INT_IDS)
def test_seed_takes_a_0d_integer(n):
    # torch's own seed reads one so
    assert torch.manual_seed(n).initial_seed() == 3
    q = _t(2, 2, 5, 4)
    want = mha_ext.scaled_dot_product_attention(q, q, q, dropout_p=0.5, seed=3)
    got = mha_ext.scaled_dot_product_attention(q, q, q, dropout_p=0.5, seed=n)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    x = q[0].numpy().astype(np.float32)
    assert mha_ext.MultiHeadAttention(8, 2, seed=n).seed == 3
    a = mha_ext.MultiHeadAttention(4, 2, dropout=0.5, seed=n)
    b = mha_ext.MultiHeadAttention(4, 2, dropout=0.5, seed=3)
    np.testing.assert_array_equal(a.forward_train(x).output, b.forward_train(x).output)


@pytest.mark.parametrize("bad", BOOLS + [torch.tensor([3]), np.array([3])],
                         ids=BOOL_IDS + ["1d_tensor", "1d_array"])
def test_seed_refuses_bools_and_arrays(bad):
    q = _t(1, 1, 4, 4)
    with pytest.raises(TypeError, match="seed must be an int"):
        mha_ext.scaled_dot_product_attention(q, q, q, dropout_p=0.5, seed=bad)
    with pytest.raises(TypeError, match="seed must be an int"):
        mha_ext.MultiHeadAttention(8, 2, seed=bad)


# ------------------------------------------------------------ 4. the drop-in's sizes
def _same_module(sizes):
    """torch's module and ours built from `sizes`, ours with torch's
    parameters: their outputs and weights."""
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(*sizes["args"], **sizes["kw"]).double()
    ours = mt.MultiheadAttention(*sizes["args"], **sizes["kw"]).double()
    assert list(ours.state_dict()) == list(ref.state_dict())
    ours.load_state_dict(ref.state_dict())
    E = 8
    kdim = int(sizes["kw"].get("kdim", E))
    q, k, v = _t(5, 2, E, seed=4), _t(3, 2, kdim, seed=5), _t(3, 2, E, seed=6)
    for m in (ref, ours):
        assert m.embed_dim == 8 and m.num_heads == 2 and m.head_dim == 4
    a, b = ref(q, k, v), ours(q, k, v)
    torch.testing.assert_close(b[0], a[0])
    torch.testing.assert_close(b[1], a[1])


@pytest.mark.parametrize("sizes", [
    dict(args=(torch.tensor(8), 2), kw={}),
    dict(args=(np.array(8), 2), kw={}),
    dict(args=(8, torch.tensor(2)), kw={}),
    # (not a tensor divided by an array: torch's own module warns then)
    dict(args=(torch.tensor(8), torch.tensor(2)), kw=dict(kdim=np.array(6))),
], ids=["embed_tensor", "embed_array", "heads_tensor", "all_0d"])
def test_dropin_takes_0d_integer_sizes_as_torch(sizes):
    _same_module(sizes)


@pytest.mark.parametrize("bad", [torch.tensor(True), torch.tensor(8.0), 8.0, torch.tensor([8])],
                         ids=["bool_tensor", "float_tensor", "float", "1d_tensor"])
def test_dropin_refuses_other_sizes(bad):
    with pytest.raises(TypeError, match="embed_dim must be an int"):
        mt.MultiheadAttention(bad, 2)


# ------------------------------------------------------------ 5. the functional's sizes
def _functional(fn, e, h):
    torch.manual_seed(0)
    m = torch.nn.MultiheadAttention(8, 2).double()
    q = _t(5, 2, 8, seed=6)
    return fn(q, q, q, e, h, m.in_proj_weight, m.in_proj_bias, None, None, False, 0.0,
              m.out_proj.weight, m.out_proj.bias, training=False)


@pytest.mark.parametrize("e, h", [(torch.tensor(8), 2), (np.array(8), 2), (8, np.array(2)),
                                  (np.array(8), torch.tensor(2))],
                         ids=["embed_tensor", "embed_array", "heads_array", "both"])
def test_functional_takes_0d_integer_sizes_as_torch(e, h):
    want = _functional(F.multi_head_attention_forward, e, h)
    got = _functional(mt.multi_head_attention_forward, e, h)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


# ------------------------------------------------------------ 3. kdim=0, vdim=0
@pytest.mark.parametrize("kdim, vdim", [(0, 0), (0, 6), (6, 0)])
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("need_weights", [True, False])
def test_dropin_zero_kdim_vdim_as_torch(kdim, vdim, batch_first, need_weights):
    # torch builds the module (k_proj_weight (E, 0)) and computes: an empty
    # key projects to its bias alone, so every key scores alike
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(8, 2, kdim=kdim, vdim=vdim, add_bias_kv=kdim == vdim,
                                      batch_first=batch_first).double()
    with torch.no_grad():  # nonzero biases (torch starts them at 0): nonzero results
        for p in ref.parameters():
            p.uniform_(-1, 1)
    ours = mt.MultiheadAttention(8, 2, kdim=kdim, vdim=vdim, add_bias_kv=kdim == vdim,
                                 batch_first=batch_first).double()
    ours.load_state_dict(ref.state_dict())
    assert ours.k_proj_weight.shape == (8, kdim) and ours.v_proj_weight.shape == (8, vdim)
    q, k, v = _t(5, 2, 8, seed=7), _t(3, 2, kdim, seed=8), _t(3, 2, vdim, seed=9)
    if batch_first:
        q, k, v = (x.transpose(0, 1).contiguous() for x in (q, k, v))
    results = []
    for m in (ref, ours):
        ins = [x.clone().requires_grad_() for x in (q, k, v)]
        out, weights = m(*ins, need_weights=need_weights)
        (out * _t(*out.shape, seed=10)).sum().backward()
        grads = [x.grad for x in ins] + [p.grad for p in m.parameters()]
        results.append((out, weights, grads))
    (a, aw, ag), (b, bw, bg) = results
    torch.testing.assert_close(b, a)
    torch.testing.assert_close(bw, aw)
    for x, y in zip(ag, bg):
        torch.testing.assert_close(y, x)
        assert y.stride() == x.stride()


def test_dropin_zero_kdim_refuses_a_wider_key_as_torch():
    ref = torch.nn.MultiheadAttention(8, 2, kdim=0, vdim=0)
    ours = mt.MultiheadAttention(8, 2, kdim=0, vdim=0)
    q, k = torch.randn(5, 2, 8), torch.randn(3, 2, 3)
    with pytest.raises(AssertionError):  # torch's
        ref(q, k, k)
    with pytest.raises(ValueError, match=r"key must be 0 wide \(kdim = 0\), got 3 wide") as e:
        ours(q, k, k)
    assert isinstance(e.value, AssertionError)  # torch's type too


def test_functional_zero_kdim_as_torch():
    torch.manual_seed(0)
    m = torch.nn.MultiheadAttention(8, 2, kdim=0, vdim=0).double()
    with torch.no_grad():
        for p in m.parameters():
            p.uniform_(-1, 1)
    q, k = _t(5, 2, 8), _t(3, 2, 0)
    args = (q, k, k, 8, 2, None, m.in_proj_bias, None, None, False, 0.0, m.out_proj.weight,
            m.out_proj.bias)
    kw = dict(use_separate_proj_weight=True, q_proj_weight=m.q_proj_weight,
              k_proj_weight=m.k_proj_weight, v_proj_weight=m.v_proj_weight, training=False)
    want = F.multi_head_attention_forward(*args, **kw)
    got = mt.multi_head_attention_forward(*args, **kw)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


# ------------------------------------------------------------ 6. SDPA, empty value
def _sdpa_run(fn, shapes, mask, **kw):
    ins = [_t(*s, seed=i).requires_grad_() for i, s in enumerate(shapes)]
    m = None
    if mask:
        m = _t(shapes[0][-2], shapes[1][-2], seed=11).requires_grad_()
    out = fn(*ins, attn_mask=m, **kw)
    (out * _t(*out.shape, seed=12)).sum().backward()
    return out, [x.grad for x in ins] + [None if m is None else m.grad]


@pytest.mark.parametrize("shapes", [
    ((2, 2, 5, 4), (2, 2, 3, 4), (2, 2, 3, 0)),   # value width 0
    ((2, 2, 5, 4), (2, 2, 0, 4), (2, 2, 0, 6)),   # no key (S = 0)
    ((2, 2, 0, 4), (2, 2, 3, 4), (2, 2, 3, 6)),   # no query (L = 0)
    ((2, 2, 5, 0), (2, 2, 3, 0), (2, 2, 3, 6)),   # E = 0: every score 0
    ((0, 2, 5, 4), (0, 2, 3, 4), (0, 2, 3, 6)),   # no batch
    ((5, 4), (3, 4), (3, 0)),                     # 2-D, value width 0
], ids=["Ev0", "S0", "L0", "E0", "B0", "2d_Ev0"])
# (not a mask with is_causal: torch refuses the two together)
@pytest.mark.parametrize("mask, is_causal", [(False, False), (False, True), (True, False)],
                         ids=["plain", "causal", "float_mask"])
def test_sdpa_empty_inputs_as_torch(shapes, mask, is_causal):
    want, want_g = _sdpa_run(F.scaled_dot_product_attention, shapes, mask, is_causal=is_causal)
    got, got_g = _sdpa_run(mha_ext.scaled_dot_product_attention, shapes, mask,
                           is_causal=is_causal)
    torch.testing.assert_close(got, want)
    assert got.stride() == want.stride()
    for x, y in zip(want_g, got_g):  # query, key, value, then the mask's (None or not)
        assert (x is None) == (y is None)
        if x is not None:
            torch.testing.assert_close(y, x)
            assert y.stride() == x.stride()


# ------------------------------------------------------------ 7. the drop-in, empty inputs
@pytest.mark.parametrize("shapes", [
    ((0, 2, 8), (3, 2, 4), (3, 2, 6)),   # L = 0
    ((5, 2, 8), (0, 2, 4), (0, 2, 6)),   # S = 0
    ((5, 0, 8), (3, 0, 4), (3, 0, 6)),   # B = 0
    ((0, 8), (3, 4), (3, 6)),            # unbatched, L = 0
    ((5, 8), (0, 4), (0, 6)),            # unbatched, S = 0
], ids=["L0", "S0", "B0", "2d_L0", "2d_S0"])
@pytest.mark.parametrize("same_dims", [True, False], ids=["packed", "kdim_vdim"])
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("need_weights", [True, False])
def test_dropin_grads_of_empty_inputs_as_torch(shapes, same_dims, batch_first, need_weights):
    if same_dims:
        shapes = tuple(s[:-1] + (8,) for s in shapes)
    kdim, vdim = shapes[1][-1], shapes[2][-1]
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(8, 2, kdim=kdim, vdim=vdim,
                                      batch_first=batch_first).double()
    with torch.no_grad():
        for p in ref.parameters():
            p.uniform_(-1, 1)
    ours = mt.MultiheadAttention(8, 2, kdim=kdim, vdim=vdim, batch_first=batch_first).double()
    ours.load_state_dict(ref.state_dict())
    if batch_first and len(shapes[0]) == 3:
        shapes = tuple((s[1], s[0], s[2]) for s in shapes)
    results = []
    for m in (ref, ours):
        ins = [_t(*s, seed=i).requires_grad_() for i, s in enumerate(shapes)]
        out, weights = m(*ins, need_weights=need_weights)
        loss = out.sum() + (0 if weights is None else weights.sum())
        loss.backward()
        results.append((out, weights, [x.grad for x in ins],
                        {n: p.grad for n, p in m.named_parameters()}))
    (a, aw, ag, ap), (b, bw, bg, bp) = results
    torch.testing.assert_close(b, a)
    assert b.stride() == a.stride()
    torch.testing.assert_close(bw, aw)
    for x, y in zip(ag, bg):  # query, key, value: torch's shapes, strides and values
        torch.testing.assert_close(y, x)
        assert y.stride() == x.stride()
    assert list(bp) == list(ap)
    for n in ap:
        assert (ap[n] is None) == (bp[n] is None), n
        if ap[n] is not None:
            torch.testing.assert_close(bp[n], ap[n])
