"""mha_ext.scaled_dot_product_attention: leading dimensions past two with a
mask of lower rank, torch's CausalBias in every combination, the meta
device's shapes, and the refusals' types, words and chaining, each against
torch where torch has the call (the rules mutation testing found no test
holding: a mutant of each passed the suite before).

Legend: L query length, S key length, E width, Hq/Hk query/key heads.
"""
import warnings

import numpy as np
import pytest

import mha_ext
from _support import require_torch
from mha_ext.layout import BlockLayout

torch = require_torch()
F = torch.nn.functional
f = mha_ext.scaled_dot_product_attention


@pytest.mark.parametrize("mask_shape", [(3, 2, 4, 6), (2, 4, 6), (4, 6), (1, 3, 1, 4, 6)])
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("tensors", [False, True])
def test_three_leading_dims_and_a_mask_of_lower_rank_match_torch(mask_shape, kind, tensors):
    r = np.random.default_rng(0)
    q = r.standard_normal((2, 3, 2, 4, 8))        # (batch, batch, heads, L, E)
    k, v = r.standard_normal((2, 3, 2, 6, 8)), r.standard_normal((2, 3, 2, 6, 8))
    m = r.standard_normal(mask_shape)
    m = m > -0.5 if kind == "bool" else m
    args = tuple(torch.from_numpy(x) for x in (q, k, v, np.ascontiguousarray(m)))
    want = F.scaled_dot_product_attention(*args).numpy()
    got = f(*args) if tensors else f(q, k, v, attn_mask=m)
    got = got.numpy() if tensors else got
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("is_causal", [True, "lower_right"])
def test_a_causal_bias_with_is_causal_is_refused_whichever_causality(is_causal):
    from torch.nn.attention.bias import causal_upper_left
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="CausalBias should not be used with causal=True"):
        f(q, k, k, attn_mask=causal_upper_left(3, 5), is_causal=is_causal)


@pytest.mark.parametrize("tensors", [False, True])
def test_a_causal_bias_of_other_lengths_is_refused_with_2d_inputs_too(tensors):
    from torch.nn.attention.bias import causal_upper_left
    q, k = torch.randn(3, 8), torch.randn(5, 8)
    args = (q, k, k) if tensors else (q.numpy(), k.numpy(), k.numpy())
    with pytest.raises(ValueError, match="CausalBias for 5 queries and 3 keys, the call has "
                                         "3 and 5"):
        f(*args, attn_mask=causal_upper_left(5, 3))
    right = f(*args, attn_mask=causal_upper_left(3, 5))     # the lengths of the call: taken
    assert tuple(right.shape) == (3, 8)


def test_the_meta_device_gives_torchs_shape_with_grouped_heads_and_lower_right_masks():
    L = 5
    q = torch.empty(1, 4, L, 8, device="meta")
    k, v = torch.empty(1, 2, L + 1, 8, device="meta"), torch.empty(1, 2, L + 1, 6, device="meta")
    got = f(q, k, v, enable_gqa=True)
    assert got.device.type == "meta" and tuple(got.shape) == (1, 4, L, 6)
    m = torch.empty(L, L + 1, device="meta")
    got = f(q, k[:, :1].expand(1, 4, L + 1, 8), v[:, :1].expand(1, 4, L + 1, 6), attn_mask=m,
            is_causal="lower_right")
    assert got.device.type == "meta" and tuple(got.shape) == (1, 4, L, 6)


@pytest.mark.parametrize("ours", ["window", "layout", "head_mask"])
def test_a_shape_torch_refuses_with_one_of_our_keywords_is_our_valueerror(ours):
    """With a keyword torch's function does not have there is no torch call
    to take the type from (as for the module: test_torch_refusals)."""
    q, k, v = torch.randn(2, 5, 8), torch.randn(2, 6, 7), torch.randn(2, 6, 8)  # widths differ
    with pytest.raises(ValueError, match="key's last dimension") as plain:
        f(q, k, v)
    assert isinstance(plain.value, RuntimeError)                  # torch's type too
    kw = {"window": {"window": (1, 1)}, "head_mask": {"head_mask": torch.ones(2)},
          "layout": {"layout": BlockLayout(np.ones((1, 1), bool), 8)}}[ours]
    with pytest.raises(ValueError, match="key's last dimension") as err:
        f(q, k, v, **kw)
    assert not isinstance(err.value, RuntimeError)


@pytest.mark.parametrize("case", ["3-D", "dropout", "mask requires grad"])
def test_a_mask_with_is_causal_where_torch_refuses_it_quotes_torch(case):
    q, m = torch.randn(1, 2, 5, 8), torch.zeros(5, 5)
    x, mm, kw = {"3-D": (q[0], m, {}), "dropout": (q, m, {"dropout_p": 0.1}),
                 "mask requires grad": (q, m.clone().requires_grad_(), {})}[case]
    with pytest.raises(RuntimeError) as theirs:
        F.scaled_dot_product_attention(x, x, x, attn_mask=mm, is_causal=True, **kw)
    with pytest.raises(ValueError, match="Explicit attn_mask should not be set") as err:
        f(x, x, x, attn_mask=mm, is_causal=True, **kw)
    assert isinstance(err.value, RuntimeError)
    assert "(torch: " in str(err.value) and str(theirs.value).split("\n")[0] in str(err.value)


def test_a_refusal_with_torchs_type_is_not_chained_to_our_own_error():
    with pytest.raises(ValueError) as err:
        f(torch.randn(5), torch.randn(5), torch.randn(5))
    assert isinstance(err.value, RuntimeError)
    assert err.value.__cause__ is None        # one error in the traceback, not ours twice


def test_the_drop_ins_probe_of_torch_adds_no_warning():
    import mha_ext.torch as mt
    m = mt.MultiheadAttention(8, 2)
    x = torch.randn(4, 3, 8)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with pytest.raises(ValueError):  # value of another width: torch refuses it too
            m(x, x, torch.randn(4, 3, 7), key_padding_mask=torch.zeros(3, 4, dtype=torch.bool),
              attn_mask=torch.zeros(4, 4))
    mismatched = [x for x in w if "mismatched key_padding_mask" in str(x.message)]
    assert len(mismatched) == 1, [str(x.message) for x in w]


@pytest.mark.parametrize("args,kw,words", [
    (((4,), (3, 4), (3, 4)), {}, r"query must have at least 2 dimensions \(\.\.\., length, "
                                 r"width\), got shape \(4,\)"),
    (((1, 2, 3, 8), (1, 2, 5, 8), (1, 2, 4, 8)), {}, "value must have key's length 5"),
    (((1, 6, 3, 8), (1, 4, 5, 8), (1, 4, 5, 8)), {"enable_gqa": True},
     r"enable_gqa=True: query's heads \(6"),
    (((1, 4, 3, 8), (1, 3, 5, 8), (1, 1, 5, 8)), {"enable_gqa": True},
     r"enable_gqa=True: query's heads \(4"),
    (((1, 2, 3, 8), (1, 2, 5, 8), (1, 2, 5, 8)), {"attn_mask": np.zeros((2, 2, 3, 5), bool)},
     r"attn_mask of shape \(2, 2, 3, 5\) does not broadcast to \(1, 2, 3, 5\)"),
    (((1, 2, 3, 8), (1, 2, 5, 8), (1, 2, 5, 8)), {"attn_mask": np.zeros((2, 1, 2, 3, 5))},
     r"attn_mask of shape \(2, 1, 2, 3, 5\) does not broadcast to \(1, 2, 3, 5\)"),
])
def test_shape_refusals_say_which_rule(args, kw, words):
    arrays = [np.zeros(s) for s in args]
    with pytest.raises(ValueError, match=words):
        f(*arrays, **kw)


@pytest.mark.parametrize("q_shape,k_shape,mask_shape", [
    ((2, 3, 5, 8), (2, 3, 7, 8), (1, 2, 3, 5, 7)),      # more axes than the scores
    ((2, 3, 5, 8), (2, 3, 7, 8), (1, 1, 1, 1, 7)),
    ((3, 5, 8), (3, 7, 8), (1, 3, 5, 7)),
    ((5, 8), (7, 8), (1, 5, 7)),
    ((1, 3, 5, 8), (1, 3, 7, 8), (2, 1, 5, 7)),         # a wider batch than the scores'
    ((1, 4, 5, 8), (1, 2, 7, 8), (2, 1, 5, 7)),         # ... with grouped heads
])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_a_mask_that_would_widen_the_scores_is_torchs_runtimeerror(q_shape, k_shape,
                                                                     mask_shape, kind):
    """torch broadcasts the mask into the scores in place: a mask that
    would widen them is its RuntimeError ("output with shape ... doesn't
    match the broadcast shape ..."), on every kernel, also where its meta
    functions compute; ours is that type too, quoting torch."""
    q, k = torch.randn(q_shape), torch.randn(k_shape)
    m = torch.rand(mask_shape) > 0.3 if kind == "bool" else torch.randn(mask_shape)
    gqa = q_shape[-3] != k_shape[-3] if len(q_shape) > 2 else False
    with pytest.raises(RuntimeError) as theirs:
        F.scaled_dot_product_attention(q, k, k, attn_mask=m, enable_gqa=gqa)
    with pytest.raises(RuntimeError) as ours:
        f(q, k, k, attn_mask=m, enable_gqa=gqa)
    assert isinstance(ours.value, ValueError)
    assert str(theirs.value) in str(ours.value)
    with pytest.raises(ValueError, match="does not broadcast to"):     # arrays: a ValueError
        f(q.numpy(), k.numpy(), k.numpy(), attn_mask=m.numpy(), enable_gqa=gqa)
