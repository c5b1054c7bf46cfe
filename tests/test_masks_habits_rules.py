"""mha_ext._masks, mha_ext._habits and mha_ext._torch_mask_rules: the rules
mutation testing of those files found no test holding (a mutant of each
passed the tests that exercise them).  The seed mask's shape errors name
the axes that do not fit (right-aligned, size 1 allowed) and the unbatched
(H, Sq, Sk) form, also for a mask of too many dimensions; torch's keyword
`nhead` named as ours; the module's mask_polarity a string, its causal
attribute a single truth value, a causal module's call still refusing an
is_causal of many values or an empty string; a seq-first module's shape
error quoting only the arguments passed; and torch's rules for the
is_causal hint's attn_mask (its rank, an unbatched call's (num_heads, L, S))
and for the mismatched-masks warning, and masks that are not tensors refused
with torch's TypeError (a NumPy key_padding_mask next to a float attn_mask
too: it was taken), each checked against torch's own nn.MultiheadAttention
(docs/API.md §2, §3.1, §4, §7, §8).

Legend: B batch, H heads, L query length, S key length, E width.
"""
import warnings

import numpy as np
import pytest

from mha_ext import MultiHeadAttention
from _support import require_torch

torch = require_torch()
import mha_ext.torch as mt  # noqa: E402
nn = torch.nn

B, H, L, S, E = 2, 2, 4, 6, 8


def _x(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


def _module(**attrs):
    m = MultiHeadAttention(E, H, dtype="float64", seed=0)
    for name, value in attrs.items():
        setattr(m, name, value)
    return m


# ---------------------------------------------------------------- the seed mask's shapes

def test_a_mask_of_too_many_dimensions_for_an_unbatched_call_says_so():
    # API.md §3.1: unbatched, the mask broadcasts to (H, Sq, Sk); a 4-D one
    # is refused as too many dimensions, not as axes of the wrong sizes
    m = _module()
    with pytest.raises(ValueError, match=r"must broadcast to .*\(unbatched: \(H, Sq, Sk\)\), "
                                         r"got shape \(1, 2, 4, 6\)"):
        m(_x(L, E), _x(S, E, seed=1), mask=np.zeros((1, H, L, S)))


def test_an_unbatched_mask_that_does_not_broadcast_names_the_unbatched_form():
    m = _module()
    with pytest.raises(ValueError) as err:
        m(_x(L, E), _x(S, E, seed=1), mask=np.zeros((H, L, S + 3)))
    assert str(err.value) == ("mask of shape (2, 4, 9) does not broadcast to (H, Sq, Sk) = "
                              "(2, 4, 6): its key length axis is 9, not 6")


def test_a_mask_shape_error_names_only_the_axes_that_do_not_fit():
    # axes of size 1 broadcast: they are not named; a lower-rank mask's axes
    # are named from the right (its first axis here is the query length)
    m = _module()
    q, k = _x(B, L, E), _x(B, S, E, seed=1)
    with pytest.raises(ValueError) as err:
        m(q, k, mask=np.zeros((1, 1, L + 1, S)))
    assert str(err.value).endswith(": its query length axis is 5, not 4")
    with pytest.raises(ValueError) as err:
        m(q, k, mask=np.zeros((L + 1, S + 1)))
    assert str(err.value).endswith(
        ": its query length axis is 5, not 4, its key length axis is 7, not 6")
    with pytest.raises(ValueError) as err:
        m(q, k, mask=np.zeros((3, 1, L, S)))
    assert str(err.value).endswith(": its batch axis is 3, not 2")


# ---------------------------------------------------------------- torch's keyword names

def test_torchs_nhead_keyword_names_n_heads():
    # API.md §4: torch's keyword names (nn.TransformerEncoderLayer's nhead
    # too) are a TypeError naming ours
    with pytest.raises(TypeError, match="got torch's keyword 'nhead'; mha_ext spells it "
                                        "'n_heads'"):
        MultiHeadAttention(E, nhead=H)
    with pytest.raises(TypeError, match="'nhead'; mha_ext spells it 'n_heads'"):
        _module()(_x(B, L, E), nhead=H)


# ---------------------------------------------------------------- the module's attributes

@pytest.mark.parametrize("value", [np.array("keep"), ["keep"], None, 1])
def test_mask_polarity_takes_only_the_two_strings(value):
    m = _module()
    with pytest.raises(ValueError, match="mask_polarity must be 'block'"):
        m.mask_polarity = value
    assert m.mask_polarity == "block" and type(m.mask_polarity) is str


@pytest.mark.parametrize("value", [[True], np.array([True, False]), (1, 0)])
def test_the_causal_attribute_takes_a_single_truth_value(value):
    m = _module()
    with pytest.raises(TypeError, match="causal"):
        m.causal = value
    assert m.causal is False
    m.causal = np.bool_(True)
    assert m.causal is True


@pytest.mark.parametrize("is_causal", [[True, True], (1,), np.array([True, False]),
                                       "", "upper"])
def test_a_causal_modules_call_refuses_an_is_causal_a_plain_one_refuses(is_causal):
    # API.md §4: a causal module reads a *false* is_causal as True; anything
    # else is checked by the call, as on a module that is not causal
    plain, causal = _module(), _module(causal=True)
    x = _x(B, L, E)
    for m in (plain, causal):
        with pytest.raises(TypeError, match="is_causal must be True or False"):
            m(x, is_causal=is_causal)


# ---------------------------------------------------------------- seq-first errors

def test_a_seq_first_shape_error_quotes_only_the_arguments_passed():
    # API.md §4: the message gives the shapes the caller passed; a key and a
    # value left to default are not listed
    m = _module(batch_first=False)
    with pytest.raises(ValueError) as err:
        m(_x(L, B, E), attn_mask=np.zeros((3, 3), bool))
    assert str(err.value).endswith("; you passed query (4, 2, 8))")
    with pytest.raises(ValueError) as err:
        m(_x(L, B, E), _x(S, B, E, seed=1), attn_mask=np.zeros((3, 3), bool))
    assert str(err.value).endswith("; you passed query (4, 2, 8), key (6, 2, 8))")


# ---------------------------------------------------------------- torch's mask rules

def _pair(dtype=torch.float64, **kw):
    torch.manual_seed(0)
    t = nn.MultiheadAttention(E, H, dtype=dtype, **kw)
    m = mt.MultiheadAttention(E, H, dtype=dtype, **kw)
    m.load_state_dict(t.state_dict())
    return t, m


def _both(t, m, *args, **kw):
    """torch's outcome and ours: ("ok", output) or ("raises", exception)."""
    out = []
    for mod in (t, m):
        try:
            out.append(("ok", mod(*args, **kw)[0]))
        except Exception as exc:  # noqa: BLE001 - compared below
            out.append(("raises", exc))
    return out


def _assert_as_torch(t, m, *args, **kw):
    (tk, tv), (ok, ov) = _both(t, m, *args, **kw)
    assert ok == tk, (tv, ov)
    if tk == "ok":
        torch.testing.assert_close(ov, tv, atol=1e-10, rtol=1e-10)
    else:
        assert isinstance(ov, type(tv)), (type(ov), tv)
    return tk


def _qk(batched, dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    shape = (lambda n: (n, B, E)) if batched else (lambda n: (n, E))
    return (torch.randn(shape(L), generator=g, dtype=dtype),
            torch.randn(shape(S), generator=g, dtype=dtype))


def _float_causal(*lead):
    blocked = torch.ones(L, S, dtype=torch.bool).triu(1).expand(*lead, L, S)
    return torch.zeros(*lead, L, S, dtype=torch.float64).masked_fill(blocked, float("-inf"))


@pytest.mark.parametrize("training", [True, False])
def test_a_float_attn_mask_with_the_is_causal_hint_computes_as_torch(training):
    # API.md §8: the hint's attn_mask is checked as torch checks it (bool or
    # float), then replaced by the pattern: a float one is taken
    t, m = _pair()
    t.train(training), m.train(training)
    q, k = _qk(True)
    with torch.no_grad():
        assert _assert_as_torch(t, m, q, k, k, attn_mask=_float_causal(), is_causal=True,
                                need_weights=False) == "ok"


def test_a_float_key_padding_mask_with_the_hint_and_no_attn_mask_is_torchs_error():
    t, m = _pair()
    q, k = _qk(True)
    kpm = torch.zeros(B, S, dtype=torch.float64)
    for mod in (t, m):
        with pytest.raises(RuntimeError, match="Need attn_mask"):
            mod(q, k, k, key_padding_mask=kpm, is_causal=True, need_weights=False)


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("lead", [(), (1,), (1, 1), (1, 1, 1)], ids=["2d", "3d", "4d", "5d"])
def test_the_hints_attn_mask_rank_is_checked_as_torch(batched, lead):
    # torch's _mha_shape_check: 2-D or 3-D, before the hint replaces it
    t, m = _pair()
    q, k = _qk(batched)
    mask = torch.ones(L, S, dtype=torch.bool).triu(1).expand(*lead, L, S)
    if len(lead) == 1:
        mask = mask.expand((B if batched else 1) * H, L, S)
    want = "ok" if len(lead) < 2 else "raises"
    assert _assert_as_torch(t, m, q, k, k, attn_mask=mask, is_causal=True,
                            need_weights=False) == want


@pytest.mark.parametrize("shape,want", [((H, L, S), "ok"), ((1, L, S), "raises"),
                                        ((H, L, L), "raises"), ((H, S, S), "raises"),
                                        ((H, L, S + 1), "raises"), ((H + 1, L, S), "raises")])
def test_an_unbatched_hints_3d_attn_mask_must_be_num_heads_l_s_as_torch(shape, want):
    # L != S: the mask's last axis counts the keys, not the queries
    t, m = _pair()
    q, k = _qk(False)
    mask = torch.zeros(shape, dtype=torch.bool)
    assert _assert_as_torch(t, m, q, k, k, attn_mask=mask, is_causal=True,
                            need_weights=False) == want


def _warned(mod, *args, **kw):
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        try:
            mod(*args, **kw)
        except Exception:  # noqa: BLE001 - the warning alone is compared
            pass
    return [str(w.message) for w in got if "mismatched key_padding_mask" in str(w.message)]


@pytest.mark.parametrize("kpm,am", [(torch.int64, torch.float64), (torch.int64, torch.bool),
                                    (torch.bool, torch.float64), (torch.float32, torch.float64),
                                    (torch.float64, torch.float64), (torch.bool, torch.bool)])
def test_the_mismatched_masks_warning_comes_where_torchs_does(kpm, am):
    t, m = _pair()
    q, k = _qk(True)
    args = dict(key_padding_mask=torch.zeros(B, S, dtype=kpm),
                attn_mask=torch.zeros(L, S, dtype=am))
    assert bool(_warned(m, q, k, k, **args)) == bool(_warned(t, q, k, k, **args))



_NP_BOOL = np.zeros((L, S), bool)


@pytest.mark.parametrize("kw", [
    dict(attn_mask=_NP_BOOL, is_causal=True),
    dict(attn_mask=_NP_BOOL.tolist(), is_causal=True),
    dict(key_padding_mask=np.zeros((B, S), np.int64), is_causal=True),
    dict(key_padding_mask=np.zeros((B, S), bool), attn_mask=torch.zeros(L, S, dtype=torch.bool)),
    dict(key_padding_mask=torch.zeros(B, S, dtype=torch.bool), attn_mask=_NP_BOOL),
], ids=["np attn_mask, hint", "list attn_mask, hint", "np key_padding_mask, hint",
        "np key_padding_mask", "np attn_mask"])
def test_masks_that_are_not_tensors_are_refused_with_torchs_type_error(kw):
    # API.md §7: torch's own TypeError (its is_floating_point of the mask),
    # not an AttributeError from a rule that reads a tensor's methods
    t, m = _pair()
    q, k = _qk(True)
    assert _assert_as_torch(t, m, q, k, k, need_weights=False, **kw) == "raises"
    with pytest.raises(TypeError):
        m(q, k, k, need_weights=False, **kw)


@pytest.mark.parametrize("kpm_dtype", [np.bool_, np.float32])
def test_a_numpy_key_padding_mask_next_to_a_float_attn_mask_is_refused_as_torch(kpm_dtype):
    # API.md §7: the torch classes refuse what torch refuses, with its type
    # (torch: a TypeError from is_floating_point); with a bool attn_mask we do
    t, m = _pair(torch.float32)
    q, k = _qk(True, torch.float32)
    kpm = np.zeros((B, S), kpm_dtype)
    assert _assert_as_torch(t, m, q, k, k, key_padding_mask=kpm,
                            attn_mask=torch.zeros(L, S)) == "raises"
