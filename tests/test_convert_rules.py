"""mha_ext._convert, the conversions every call goes through: the rules
mutation testing of that file found no test holding (a mutant of each
passed the suite before).  torch.fx Proxies refused by name wherever one
arrives (not only as the query), a tensor's storage bound exact for strided
and subclass tensors and skipped for empty ones, as torch's own operations
check it, a fake tensor's data pointer left untouched, complex data refused
as complex (a conjugated tensor too, and in forward_train and backward),
ints just past int64 and uint64 named, a failing conversion's error naming
the argument, a flag's truth value, a 0-d int array as dropout_p, and the
bounds of a layout's seed (docs/API.md §3, §4a, §7, §8).

Legend: B batch, H heads, L query length, S key length, E width.
"""
import warnings

import numpy as np
import pytest

import mha_ext
from mha_ext import MultiHeadAttention, layout
from _support import require_torch

torch = require_torch()
import mha_ext.torch as mt  # noqa: E402
F = torch.nn.functional
f = mha_ext.scaled_dot_product_attention
FX = "torch.fx.symbolic_trace reached mha_ext"


def _qkv(shape=(2, 3, 4, 8), dtype=np.float64, seed=0):
    r = np.random.default_rng(seed)
    return tuple(r.standard_normal(shape).astype(dtype) for _ in range(3))


# ---------------------------------------------------------------- torch.fx

class _CrossAttention(torch.nn.Module):
    """Queries from the traced input, keys and values from a plain tensor
    attribute (a real tensor under symbolic_trace, not a Proxy)."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.attn = {"drop-in": lambda: mt.MultiheadAttention(16, 4, batch_first=True),
                     "torch class": lambda: mt.MultiHeadAttention(16, 4),
                     "twin": lambda: None}[kind]()
        self.memory = torch.randn(2, 4, 5, 4) if kind == "twin" else torch.randn(2, 5, 16)

    def forward(self, x):
        m = self.memory.detach()
        if self.kind == "twin":
            return f(x, m, m)
        return self.attn(x, m, m)[0]


@pytest.mark.parametrize("kind", ["drop-in", "torch class", "twin"])
def test_fx_trace_of_a_query_against_constant_keys_is_refused_by_name(kind):
    # API.md §8: tracing through a call is a RuntimeError naming mha_ext,
    # also when only the query is a Proxy (not fx's TraceError from our code)
    with pytest.raises(RuntimeError, match=FX):
        torch.fx.symbolic_trace(_CrossAttention(kind))


class _NumPyClass(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = MultiHeadAttention(16, 4)

    def forward(self, x):
        return self.attn(x)[0]


class _TwinHeadMask(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q = torch.randn(2, 4, 5, 4)

    def forward(self, head_mask):
        q = self.q.detach()
        return f(q, q, q, head_mask=head_mask)


@pytest.mark.parametrize("model", [_NumPyClass, _TwinHeadMask])
def test_fx_proxy_converted_as_an_array_is_refused_by_name(model):
    # a Proxy reaching as_array (the NumPy class's query, the twin's head
    # mask): not "must be array-like: invalid __array_struct__"
    with pytest.raises(RuntimeError, match=FX):
        torch.fx.symbolic_trace(model())


# ---------------------------------------------------------------- storage bounds

def test_a_strided_tensor_one_element_past_its_storage_is_refused_as_torch_refuses_it():
    q = torch.randn(2, 3, 4, 8).transpose(1, 2)  # not contiguous: the strided bound
    assert not q.is_contiguous()
    q.untyped_storage().resize_(q.untyped_storage().nbytes() - q.element_size())
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, q, q)
    with pytest.raises(RuntimeError, match="query: its storage holds 764 bytes.*needs 768"):
        f(q, q, q)


class _MyTensor(torch.Tensor):
    """A user's own subclass over its own data."""


def test_a_subclass_tensor_with_a_shrunk_storage_is_refused_as_torch_refuses_it():
    q = torch.randn(2, 3, 4, 8).as_subclass(_MyTensor)
    q.untyped_storage().resize_(16)
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, q, q)
    with pytest.raises(RuntimeError, match="query: its storage holds 16 bytes"):
        f(q, q, q)


def test_an_empty_view_of_a_freed_storage_gives_torchs_empty_result():
    # numel 0 reads nothing: its storage offset past a freed storage is fine
    q = torch.randn(4, 2, 3, 8)[4:]
    assert q.numel() == 0 and q.storage_offset() > 0
    q.untyped_storage().resize_(0)
    want = F.scaled_dot_product_attention(q, q, q)
    got = f(q, q, q)
    assert got.shape == want.shape and got.dtype == want.dtype


# ---------------------------------------------------------------- data kinds

@pytest.mark.parametrize("conj", [False, True])
def test_a_complex_tensor_is_refused_as_complex_data_conjugated_or_not(conj):
    # API.md §3: complex data are a TypeError; a lazily conjugated tensor is
    # complex data too (not "must be array-like, converting it raised")
    z = torch.randn(2, 3, 8, dtype=torch.cfloat)
    z = z.conj() if conj else z
    assert z.is_conj() == conj
    with pytest.raises(TypeError, match="query must hold real numbers.*complex64"):
        MultiHeadAttention(8, 2, seed=0)(z)


@pytest.mark.parametrize("bad", [np.ones((1, 4, 8), np.complex64), np.full((1, 4, 8), "a")],
                         ids=["complex", "str"])
def test_forward_train_and_backward_refuse_complex_or_text_data(bad):
    # the dtype-converting path (contiguous()) checks the data as every call
    # does: not the real part kept with a ComplexWarning, nor a ValueError
    m = MultiHeadAttention(8, 2, seed=0)
    with pytest.raises(TypeError, match="query must hold real numbers"):
        m.forward_train(bad)
    ctx = m.forward_train(np.ones((1, 4, 8), np.float32))
    with pytest.raises(TypeError, match="grad_output must hold real numbers"):
        m.backward(ctx, bad)


def test_a_fake_tensor_is_refused_by_name_without_reading_its_data_pointer():
    # torch warns that a FakeTensor's data pointer "will error": the fake
    # is told apart before that, so the caller sees our error alone
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        fake = torch.randn(1, 2, 3, 4)
    q = torch.randn(1, 2, 3, 4)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="query is a FakeTensor"):
            f(fake, q, q)
    assert not [w for w in seen if "data pointer" in str(w.message)]


@pytest.mark.parametrize("value", [2 ** 64, -2 ** 63 - 1], ids=["2**64", "-2**63-1"])
def test_an_int_just_past_int64_and_uint64_says_to_pass_it_as_a_float(value):
    # API.md §7: NumPy keeps it as an object; a TypeError saying so (torch
    # cannot take it either), not "got dtype object"
    with pytest.raises((ValueError, RuntimeError, OverflowError)):
        torch.tensor([[[value, 1]]])
    one = np.ones((1, 1, 2))
    with pytest.raises(TypeError, match="past int64 and uint64.*pass it as a float"):
        f([[[value, 1]]], one, one)


class _ArrayRaising:
    def __init__(self, exc):
        self.exc = exc

    def __array__(self, dtype=None, copy=None):
        raise self.exc


def test_a_conversion_running_out_of_memory_names_the_argument():
    with pytest.raises(MemoryError, match="^key: no room"):
        MultiHeadAttention(8, 2, seed=0)(np.ones((1, 4, 8)), _ArrayRaising(MemoryError("no room")))


def test_a_conversion_raising_another_error_is_a_typeerror_naming_the_argument():
    # as for anything else that is not array-like (API.md §7: what was wrong)
    with pytest.raises(TypeError, match="key must be array-like, converting it raised "
                                        "ZeroDivisionError"):
        MultiHeadAttention(8, 2, seed=0)(np.ones((1, 4, 8)), _ArrayRaising(ZeroDivisionError()))


# ---------------------------------------------------------------- scalars

class _NA:
    """A truth value that cannot be read (pandas.NA's: a TypeError)."""

    def __bool__(self):
        raise TypeError("boolean value of NA is ambiguous")


@pytest.mark.parametrize("name", ["need_weights", "average_weights", "is_causal"])
def test_a_flag_whose_truth_value_raises_is_a_typeerror_naming_it(name):
    # Python's `if` raises the TypeError: so does the call, naming the flag
    x = np.ones((1, 4, 8), np.float32)
    with pytest.raises(TypeError, match=f"{name} must be True or False"):
        MultiHeadAttention(8, 2, seed=0)(x, **{name: _NA()})


@pytest.mark.parametrize("p", [np.array(0), np.array(1, dtype=np.uint8), np.array(1)],
                         ids=["int 0", "uint8 1", "int 1"])
def test_a_0d_int_array_as_dropout_p_is_its_value_as_torch_reads_the_number(p):
    # API.md §4a: on arrays a 0-d real array is read as its value; p = 0
    # drops nothing and p = 1 everything, as torch's dropout_p of that value
    q, k, v = _qkv()
    want = F.scaled_dot_product_attention(*(torch.from_numpy(x) for x in (q, k, v)),
                                          dropout_p=float(p.item())).numpy()
    got = f(q, k, v, dropout_p=p, seed=0)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("seed", [2 ** 64, -1])
def test_a_bigbird_seed_outside_0_to_2_64_is_a_valueerror_naming_seed(seed):
    # API.md §3.1: seed an int in [0, 2**64), or None (numpy's default_rng
    # takes 2**64, and says "expected non-negative integer" of -1)
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*64\)"):
        layout.bigbird(64, 64, 8, seed=seed)
    assert layout.bigbird(64, 64, 8, seed=2 ** 64 - 1).keep.shape == (8, 8)


# ---------------------------------------------------------------- masked arrays in lists

@pytest.mark.parametrize("at", [0, 3])
@pytest.mark.parametrize("name", ["query", "key_padding_mask"])
def test_a_masked_entry_anywhere_in_a_row_of_a_list_is_refused(at, name):
    # API.md §3: a masked array with masked entries is a TypeError, "also
    # inside a list or tuple given as an array".  Past a row's first number
    # it was read before: NaN in a query, its hidden value in a bool mask
    import numpy.ma as ma
    m = MultiHeadAttention(4, 2, seed=0)
    if name == "query":
        row = [1.0, 2.0, 3.0, 4.0]
        row[at] = ma.masked_array(5.0, mask=True)
        args, kw = ([[1.0, 2.0, 3.0, 4.0], row],), {}
    else:
        row = [False, False, False, False]
        row[at] = ma.masked_array(True, mask=True)
        args, kw = (np.ones((1, 4, 4)),), {"key_padding_mask": [row]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy.ma's "converting a masked element to nan"
        with pytest.raises(TypeError, match=f"{name} holds a NumPy masked array with masked "
                                            "entries"):
            m(*args, **kw)


class _MaskFromInput(torch.nn.Module):
    """Query, key and value plain tensors; only the mask from the traced input."""

    def __init__(self, attn, kw):
        super().__init__()
        self.attn, self.kw = attn, kw
        self.memory = torch.randn(2, 5, 16)

    def forward(self, mask):
        m = self.memory.detach()
        return self.attn(m, m, m, **{self.kw: mask})[0]


@pytest.mark.parametrize("kw", ["attn_mask", "key_padding_mask"])
@pytest.mark.parametrize("cls", ["drop-in", "torch class"])
def test_fx_trace_of_a_mask_alone_is_refused_by_name(cls, kw):
    # API.md §8: a RuntimeError naming mha_ext, not fx's TraceError (the
    # drop-in) nor "parameters must be float32 or float64, got Proxy"
    attn = (mt.MultiheadAttention(16, 4, batch_first=True) if cls == "drop-in"
            else mt.MultiHeadAttention(16, 4))
    with pytest.raises(RuntimeError, match=FX):
        torch.fx.symbolic_trace(_MaskFromInput(attn, kw))
