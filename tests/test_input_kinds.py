"""Inputs of unusual kinds (API.md §3, §4a, §7): NumPy arrays in another
byte order or of a wider float, masked arrays, ints too large for a float,
0-d arrays where arrays are expected.  Each case is one a caller can pass and
that once gave other numbers or another error than the documents say.
"""
import re

import numpy as np
import pytest

import mha_ext
from mha_ext import MultiHeadAttention
from _support import require_torch

RNG = np.random.default_rng(56)
Q4, K4, V4 = (RNG.standard_normal((2, 3, 5, 8)) for _ in range(3))  # float64


# ---------------------------------------------------------------- dtypes

@pytest.mark.parametrize("kind", [">f8", "<f8", "longdouble"])
def test_sdpa_of_float64_in_any_byte_order_or_wider_is_float64(kind):
    """float64 data in big-endian order ('>f8' != np.float64) or a wider
    float computes in float64, as native float64 does: the same bits."""
    dt = np.longdouble if kind == "longdouble" else np.dtype(kind)
    native = mha_ext.scaled_dot_product_attention(Q4, K4, V4)
    other = mha_ext.scaled_dot_product_attention(Q4.astype(dt), K4.astype(dt), V4.astype(dt))
    assert other.dtype == np.float64
    np.testing.assert_array_equal(other, native)
    # one such input with float32 others is enough for float64, as for native float64
    mixed = mha_ext.scaled_dot_product_attention(Q4.astype(dt), K4.astype(np.float32),
                                                 V4.astype(np.float32))
    assert mixed.dtype == np.float64


def test_sdpa_of_big_endian_float64_matches_torch_in_float64():
    torch = require_torch()
    got = mha_ext.scaled_dot_product_attention(Q4.astype(">f8"), K4.astype(">f8"),
                                               V4.astype(">f8"), is_causal=True)
    want = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(x) for x in (Q4, K4, V4)), is_causal=True).numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_big_endian_float32_stays_float32():
    x = Q4.astype(">f4")
    out = mha_ext.scaled_dot_product_attention(x, x, x)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, mha_ext.scaled_dot_product_attention(
        *(Q4.astype(np.float32),) * 3))


# ---------------------------------------------------------------- masked arrays

def _masked(a, where):
    return np.ma.masked_array(a, mask=where)


def test_a_masked_seed_mask_is_refused_not_read_by_its_hidden_values():
    """mask= takes 0/1 values only; a masked array hid 0.5 and 7.0 from that
    check and its raw data then blocked keys."""
    m = MultiHeadAttention(16, 4, seed=0).eval()
    q = RNG.standard_normal((1, 4, 16)).astype(np.float32)
    x = np.zeros((4, 4))
    x[0, 1], x[0, 2] = 0.5, 7.0
    with pytest.raises(ValueError, match="only 0 and 1"):
        m(q, mask=x)
    with pytest.raises(TypeError, match="mask is a NumPy masked array with masked entries"):
        m(q, mask=_masked(x, x != 0))


@pytest.mark.parametrize("arg", ["query", "attn_mask", "key_padding_mask", "head_mask"])
def test_masked_arrays_with_masked_entries_are_refused_by_name(arg):
    m = MultiHeadAttention(16, 4, seed=0).eval()
    q = RNG.standard_normal((2, 4, 16)).astype(np.float32)
    kw = {"query": q}
    shapes = {"query": q, "attn_mask": np.zeros((4, 4)),
              "key_padding_mask": np.zeros((2, 4), bool), "head_mask": np.ones(4)}
    a = shapes[arg]
    where = np.zeros(a.shape, bool)
    where.flat[0] = True
    kw[arg] = _masked(a, where)
    with pytest.raises(TypeError, match=f"{arg} is a NumPy masked array"):
        m(**kw)


def test_masked_arrays_with_nothing_masked_are_their_data():
    m = MultiHeadAttention(16, 4, seed=0).eval()
    q = RNG.standard_normal((2, 4, 16)).astype(np.float32)
    am = np.triu(np.full((4, 4), -np.inf), 1)
    want = m(q, attn_mask=am)
    got = m(np.ma.masked_invalid(q), attn_mask=np.ma.masked_array(am))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    out = mha_ext.scaled_dot_product_attention(np.ma.masked_array(Q4), K4, V4)
    assert type(out) is np.ndarray
    np.testing.assert_array_equal(out, mha_ext.scaled_dot_product_attention(Q4, K4, V4))


def test_a_list_holding_masked_arrays_with_masked_entries_is_refused():
    require_torch()
    """np.asarray of a list drops its masked arrays' masks: the masked (huge)
    value was used without a word."""
    m = MultiHeadAttention(16, 4, seed=0).eval()
    q = RNG.standard_normal((2, 4, 16)).astype(np.float32)
    row = np.ma.masked_array(q[0].copy())
    row.data[0, 0] = 1e6
    row[0, 0] = np.ma.masked
    import torch
    for given in ([row, q[1]], (q[0], row), [[row[0], q[0, 1]], list(q[1])],
                  [torch.from_numpy(q[0]), row]):
        with pytest.raises(TypeError, match="query holds a NumPy masked array"):
            m(given)
    with pytest.raises(TypeError, match="key holds a NumPy masked array"):
        mha_ext.scaled_dot_product_attention(Q4, [K4[0], _masked(K4[1], K4[1] > 1)], V4)
    # nothing masked: the data, as the arrays themselves give
    unmasked = [np.ma.masked_array(q[0]), q[1]]
    for a, b in zip(m(unmasked), m(q)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.int64])
@pytest.mark.parametrize("module_dtype", ["float32", "float64"])
def test_np_matrix_inputs_are_their_data_in_any_dtype(dtype, module_dtype):
    """A np.matrix (2-D: one unbatched sequence) in another dtype than the
    module's failed inside NumPy's matrix class ("could not broadcast ...")."""
    import warnings
    m = MultiHeadAttention(16, 4, seed=0, dtype=module_dtype).eval()
    x = (RNG.standard_normal((5, 16)) * 4).astype(dtype)
    kv = (RNG.standard_normal((7, 16)) * 4).astype(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PendingDeprecationWarning)  # np.matrix's own
        xm, kvm = np.asmatrix(x), np.asmatrix(kv)
    for got, want in ((m(xm), m(x)), (m(x, kvm, kvm), m(x, kv, kv))):
        assert type(got[0]) is np.ndarray and got[0].shape == (5, 16)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(m.trace(xm).output, m(x)[0])


def test_a_masked_parameter_is_refused_by_its_key():
    m = MultiHeadAttention(16, 4, seed=0)
    w = np.array(m.W_q.weight)
    where = np.zeros(w.shape, bool)
    where[0, 0] = True
    sd = dict(m.state_dict())
    sd["W_q.weight"] = _masked(w, where)
    with pytest.raises(TypeError, match="masked array"):
        m.load_state_dict(sd)


def test_a_masked_sdpa_key_is_refused():
    where = np.zeros(K4.shape, bool)
    where[0, 0, 0, 0] = True
    with pytest.raises(TypeError, match="key is a NumPy masked array"):
        mha_ext.scaled_dot_product_attention(Q4, _masked(K4, where), V4)


# ---------------------------------------------------------------- ints too large

HUGE = 10 ** 400


@pytest.mark.parametrize("sign", [1, -1])
def test_an_int_too_large_for_a_float_as_scale_is_a_valueerror_and_torchs_overflowerror(sign):
    m = MultiHeadAttention(16, 4, seed=0).eval()
    x = np.ones((1, 2, 16), np.float32)
    for call in (lambda: m(x, scale=sign * HUGE),
                 lambda: mha_ext.scaled_dot_product_attention(Q4, K4, V4, scale=sign * HUGE)):
        with pytest.raises(ValueError, match="scale must be a real number, got an int of "
                                             "1329 bits, too large for a float") as info:
            call()
        assert isinstance(info.value, OverflowError)


def test_an_array_of_ints_too_large_is_named_not_called_dtype_object():
    """NumPy keeps an int past int64 and uint64 as an object: an input or a
    state_dict value holding one said "got dtype object" of the user's
    ints.  Too large for a float: the ValueError that is also torch's
    OverflowError (torch.tensor raises an overflow there); within a float's
    range: a TypeError saying to pass a float."""
    m = MultiHeadAttention(8, 2, seed=0).eval()
    state = m.state_dict()
    state["W_q.bias"] = [HUGE] * 8
    for call, name in ((lambda: m([[[HUGE] * 8] * 2]), "query"),
                       (lambda: m.load_state_dict(state), "state_dict['W_q.bias']"),
                       (lambda: mha_ext.scaled_dot_product_attention([[-HUGE] * 4] * 2, K4[0, 0],
                                                                     V4[0, 0]), "query")):
        with pytest.raises(ValueError, match=re.escape(name) + " must hold real numbers, got "
                                             "an int of 1329 bits, too large for a float") as info:
            call()
        assert isinstance(info.value, OverflowError)
    with pytest.raises(TypeError, match="an int of 71 bits is past int64 and uint64"):
        m([[[2 ** 70] * 8] * 2])
    with pytest.raises(ValueError, match="Overflow"):        # torch: a ValueError too
        require_torch().tensor([HUGE])
    with pytest.raises(TypeError, match="got dtype object"):     # other objects: as before
        m(np.array([[["a"] * 8] * 2], dtype=object))


@pytest.mark.parametrize("name", ["mask", "attn_mask", "key_padding_mask", "keep mask"])
def test_a_mask_of_ints_too_large_is_named_not_called_dtype_object(name):
    """The NumPy module's masks as its inputs above: "got dtype object" of
    the user's ints before"""
    m = MultiHeadAttention(8, 2, seed=0)
    m.mask_polarity = "keep" if name == "keep mask" else "block"
    x = np.ones((1, 2, 8), np.float32)
    kw = "mask" if name == "keep mask" else name
    for big, err, words in ((HUGE, OverflowError, "an int of 1329 bits, too large for a float"),
                            (2 ** 70, TypeError, "an int of 71 bits is past int64 and uint64")):
        mask = [[0, big]] if name == "key_padding_mask" else [[0, big], [0, 0]]
        with pytest.raises(err, match=re.escape(f"{kw} must hold real numbers") + ".*" + words):
            m(x, x, x, **{kw: mask})


@pytest.mark.parametrize("sign", [1, -1])
def test_an_int_too_large_for_a_float_as_dropout_p(sign):
    with pytest.raises(ValueError, match="dropout_p must be a probability") as info:
        mha_ext.scaled_dot_product_attention(Q4, K4, V4, dropout_p=sign * HUGE)
    assert isinstance(info.value, OverflowError)


def test_a_0d_array_as_dropout_p_is_its_value_as_the_modules_dropout_reads_it():
    """The module's dropout takes a 0-d array; the NumPy SDPA's dropout_p
    said "must be a probability in [0, 1], got array(0.)" of 0."""
    want = mha_ext.scaled_dot_product_attention(Q4, K4, V4, dropout_p=0.25, seed=3)
    got = mha_ext.scaled_dot_product_attention(Q4, K4, V4, dropout_p=np.array(0.25), seed=3)
    np.testing.assert_array_equal(got, want)
    assert MultiHeadAttention(16, 4, dropout=np.array(0.25)).dropout == 0.25
    # a masked one whose value is masked: refused, not read as its hidden value
    hidden = np.ma.masked_array(0.9, mask=True)
    with pytest.raises(TypeError, match="dropout_p is a NumPy masked array"):
        mha_ext.scaled_dot_product_attention(Q4, K4, V4, dropout_p=hidden, seed=3)
    with pytest.raises(TypeError, match="dropout is a NumPy masked array"):
        MultiHeadAttention(8, 2, seed=0).forward_train(np.ones((1, 4, 8), np.float32),
                                                       dropout=hidden)
    for bad, says in ((np.array(1.5), "got 1.5"), (np.array([0.1]), "not a real number"),
                      ("0.1", "got str '0.1', not a real number"),
                      (np.array(True), "not a real number")):
        with pytest.raises(ValueError, match="dropout_p must be a probability in") as info:
            mha_ext.scaled_dot_product_attention(Q4, K4, V4, dropout_p=bad)
        assert says in str(info.value)


@pytest.mark.parametrize("sign", [1, -1])
def test_an_int_too_large_for_a_float_as_the_modules_dropout(sign):
    # the constructor, the setter and forward_train: the same error as
    # scale's (docs/API.md §7), not "not int" (ints 0 and 1 are taken)
    m = MultiHeadAttention(16, 4, seed=0)
    x = np.ones((1, 2, 16), np.float32)
    for call in (lambda: MultiHeadAttention(16, 4, dropout=sign * HUGE),
                 lambda: setattr(m, "dropout", sign * HUGE),
                 lambda: m.forward_train(x, dropout=sign * HUGE)):
        with pytest.raises(ValueError, match="dropout must be a probability in \\[0, 1\\], got "
                                             "an int of 1329 bits, too large") as info:
            call()
        assert isinstance(info.value, OverflowError)
    assert m.dropout == 0.0


def test_ints_too_large_on_tensors_raise_what_torch_raises_too():
    torch = require_torch()
    q = torch.from_numpy(Q4)
    for kw in ({"scale": HUGE}, {"dropout_p": HUGE}, {"dropout_p": -HUGE}):
        with pytest.raises(OverflowError):
            torch.nn.functional.scaled_dot_product_attention(q, q, q, **kw)
        with pytest.raises(ValueError) as info:
            mha_ext.scaled_dot_product_attention(q, q, q, **kw)
        assert isinstance(info.value, OverflowError), kw
    # the drop-in in training: torch's module says ValueError (its dropout's check)
    import mha_ext.torch as mt
    x = torch.randn(2, 3, 4)
    theirs = torch.nn.MultiheadAttention(4, 2, dropout=HUGE, batch_first=True)
    ours = mt.MultiheadAttention(4, 2, dropout=HUGE, batch_first=True)
    with pytest.raises(ValueError):
        theirs(x, x, x)
    with pytest.raises(ValueError, match="dropout"):
        ours(x, x, x)
    ours.eval()  # unread outside training, as torch's
    ours(x, x, x)


# ---------------------------------------------------------------- messages

def test_cache_memory_names_memory_in_its_errors():
    m = MultiHeadAttention(16, 4, seed=0)
    with pytest.raises(TypeError, match="^memory must hold real numbers"):
        m.cache_memory(np.zeros((1, 3, 16), complex))
    with pytest.raises(TypeError, match="^value must hold real numbers"):
        m.cache_memory(np.zeros((1, 3, 16)), np.zeros((1, 3, 16), complex))


def test_0d_arrays_are_reported_with_their_own_shape():
    m = MultiHeadAttention(16, 4, seed=0)
    ctx = m.forward_train(np.ones((1, 2, 16)))
    with pytest.raises(ValueError, match=r"got \(\)$"):
        m.backward(ctx, np.float32(1))
    with pytest.raises(ValueError, match=r"got shape \(\)$"):
        m.forward_train(np.float32(1))


def test_a_head_mask_too_large_for_float32_is_refused_without_a_warning():
    x = Q4.astype(np.float32)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="head_mask must hold finite numbers"):
            mha_ext.scaled_dot_product_attention(x, x, x, head_mask=np.array([1e300, 1, 1]))


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_a_bool_scale_is_refused_by_the_module_and_the_twin(kind):
    # torch's SDPA reads scale=True as 1.0; ours refuses a bool (docs/API.md
    # §3.1: a flag passed where a number goes is a slip, write 1.0)
    x = np.ones((1, 2, 16), np.float32)
    if kind == "torch":
        x = require_torch().from_numpy(x)
    calls = [lambda: mha_ext.scaled_dot_product_attention(x, x, x, scale=True)]
    if kind == "numpy":
        calls.append(lambda: MultiHeadAttention(16, 4, seed=0)(x, scale=True))
    for call in calls:
        with pytest.raises(TypeError, match="scale must be None or a real number, not a bool"):
            call()


class _AliasUndispatched:
    """A wrapper subclass (made with _make_wrapper_subclass, no
    __tensor_flatten__) whose alias runs with dispatch off, on the wrapper
    itself: as_subclass then gives a plain tensor over the wrapper's
    storage, which has the right size and no data."""

    @staticmethod
    def make(elem):
        torch = require_torch()
        from torch.utils._mode_utils import no_dispatch
        from torch.utils._pytree import tree_map

        class W(torch.Tensor):
            @staticmethod
            def __new__(cls, elem):
                r = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype,
                                                        strides=elem.stride())
                r.elem = elem
                return r

            __torch_function__ = torch._C._disabled_torch_function_impl

            @classmethod
            def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
                if func is torch.ops.aten.alias.default:
                    with no_dispatch():
                        return func(*args)

                def un(x):
                    return x.elem if isinstance(x, W) else x
                out = func(*tree_map(un, args), **tree_map(un, kwargs or {}))
                return tree_map(lambda x: W(x) if isinstance(x, torch.Tensor) else x, out)
        return W(elem)


@pytest.mark.parametrize("kind", ["alias undispatched", "MaskedTensor"])
def test_a_wrapper_subclass_without_data_is_refused_by_name_never_read(kind):
    """Its storage has the right size but its data pointer raises: no array
    is made over it (that read uninitialised memory), wherever a tensor is
    taken, as the mask of a NumPy call too."""
    torch = require_torch()
    import warnings
    from mha_ext._convert import NoTensorDataError, to_numpy

    def wrapped(t):
        if kind == "MaskedTensor":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return torch.masked.masked_tensor(t, torch.ones_like(t, dtype=torch.bool))
        return _AliasUndispatched.make(t)
    q = torch.arange(24.).reshape(1, 2, 3, 4) / 10
    with pytest.raises(NoTensorDataError, match="m is a .*holds no data of its own"):
        to_numpy(wrapped(torch.zeros(3, 3)), "m")
    with pytest.raises(NoTensorDataError, match="attn_mask is a .*holds no data of its own"):
        mha_ext.scaled_dot_product_attention(q.numpy(), q.numpy(), q.numpy(),
                                             attn_mask=wrapped(torch.zeros(3, 3)))
    with pytest.raises(NoTensorDataError, match="query is a .*holds no data of its own"):
        mha_ext.scaled_dot_product_attention(wrapped(q.clone()), q, q)
