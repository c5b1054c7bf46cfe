"""The C binding's boundary (issue 11): the private keyword protocol and its
fixed result shapes, parameter memory that makes no reference cycle
(defect 3), NumPy integers and clear errors for ints, seeds and flags
(defect 7), the type's text signature."""
import gc
import inspect
import weakref

import numpy as np
import pytest

import mha_ext
from mha_ext import _core

M = mha_ext.MultiHeadAttention


# ------------------------------------------------------------- defect 3

class Projected(M):
    """A subclass keeping parameter objects as attributes, as users do."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.q_proj = self.W_q


def test_modules_holding_their_own_views_are_collected():
    """module -> view -> base must not lead back to the module: NumPy arrays
    are not tracked by gc, so such a cycle would never be freed (20 modules
    of this size leaked 320 MiB)."""
    refs = []
    for i in range(20):
        m = M(64, 4, seed=i) if i % 2 else Projected(64, 4, seed=i)
        m.wq = m.W_q.weight
        m.block = m._block()
        refs.append(weakref.ref(m))
        del m
    gc.collect()
    assert [r() for r in refs] == [None] * 20


def test_views_never_reference_the_module():
    m = M(8, 2, seed=0)
    for v in (m.W_q.weight, m.W_o.bias, m._block()):
        base = v
        while isinstance(base, np.ndarray):
            base = base.base
        assert base is not m
    # the parameter memory stays 64-byte aligned and live
    assert m._block().ctypes.data % 64 == 0
    m.W_q.bias[...] = 3.0
    np.testing.assert_array_equal(m.state_dict()["W_q.bias"], 3.0)


# ------------------------------------------------------------- defect 7

@pytest.mark.parametrize("kind", [np.int64, np.int32, np.uint8])
def test_numpy_integers_are_ints(kind):
    m = M(kind(8), kind(2), kdim=kind(6), vdim=kind(4), seed=kind(7))
    assert (m.d_model, m.n_heads, m.kdim, m.vdim, m.seed) == (8, 2, 6, 4, 7)
    assert type(m.d_model) is int and type(m.seed) is int
    ref = M(8, 2, kdim=6, vdim=4, seed=7)
    np.testing.assert_array_equal(m._block(), ref._block())
    before = mha_ext.get_num_threads()
    try:
        mha_ext.set_num_threads(kind(1))
        assert mha_ext.get_num_threads() == 1
    finally:
        mha_ext.set_num_threads(before)


@pytest.mark.parametrize("name", ["d_model", "n_heads", "kdim", "vdim"])
# (a 0-d integer array is an int, as torch reads one: tests/test_torch_parity_edges.py)
@pytest.mark.parametrize("bad", [True, np.True_, np.array(True), 8.0, np.float64(8),
                                 np.array([8]), np.array(8.0), "8"])
def test_sizes_refuse_bools_floats_and_arrays(name, bad):
    args = dict(d_model=8, n_heads=2)
    args[name] = bad
    with pytest.raises(TypeError, match=f"{name} must be an int"):
        M(**args)


@pytest.mark.parametrize("seed", [-1, 2 ** 64, 2 ** 200 + 7, np.int64(-5)])
def test_seeds_outside_64_bits_are_refused(seed):
    """No silent reduction mod 2**64 (seed=-1 used to be 2**64 - 1)."""
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*64\)"):
        M(8, 2, seed=seed)


def test_seed_range_ends():
    assert M(8, 2, seed=0).seed == 0
    assert M(8, 2, seed=2 ** 64 - 1).seed == 2 ** 64 - 1
    assert M(8, 2, seed=np.uint64(2 ** 64 - 1)).seed == 2 ** 64 - 1
    for bad in (True, 1.0, "1"):
        with pytest.raises(TypeError, match="seed must be an int"):
            M(8, 2, seed=bad)


@pytest.mark.parametrize("n", [2 ** 70, -(2 ** 70), 0, 257, -1])
def test_set_num_threads_out_of_range_says_the_range(n):
    before = mha_ext.get_num_threads()
    with pytest.raises(ValueError, match="1 to 256"):
        mha_ext.set_num_threads(n)
    assert mha_ext.get_num_threads() == before


@pytest.mark.parametrize("bad", [True, 2.0, np.array([2]), None])
def test_set_num_threads_refuses_non_ints(bad):
    with pytest.raises(TypeError, match="must be an int"):
        mha_ext.set_num_threads(bad)


X = np.ones((1, 3, 8), np.float32)


def _calls(m):
    ctx = m._forward_train(X, X, X)
    return {
        "_forward": lambda **kw: m._forward(X, X, X, **kw),
        "_forward_train": lambda **kw: m._forward_train(X, X, X, **kw),
        "_backward": lambda **kw: m._backward(X, X, X, ctx[0], saved=ctx[2], **kw),
    }


FLAGS = {"_forward": ["is_causal", "need_weights", "zero_rows", "reference"],
         "_forward_train": ["is_causal", "need_weights", "zero_rows", "save", "save_p"],
         "_backward": ["is_causal", "zero_rows"]}


@pytest.mark.parametrize("method", sorted(FLAGS))
@pytest.mark.parametrize("bad", [np.array([True, False]), np.zeros((1, 1)), "yes", [True],
                                 (1,), {1}])
def test_ambiguous_flags_name_the_argument(method, bad):
    """Not NumPy's bare "truth value of an array ... is ambiguous"."""
    m = M(8, 2, seed=0)
    call = _calls(m)[method]
    for flag in FLAGS[method]:
        with pytest.raises(TypeError, match=f"{flag} must be True or False"):
            call(**{flag: bad})


@pytest.mark.parametrize("true, false", [(True, False), (np.True_, np.False_), (1, 0),
                                         (np.array(True), np.array(False)), (2.0, None)])
def test_flags_are_single_truth_values(true, false):
    m = M(8, 2, seed=0)
    a = m._forward(X, X, X, is_causal=true, need_weights=false)
    b = m._forward(X, X, X, is_causal=True, need_weights=False)
    np.testing.assert_array_equal(a[0], b[0])
    assert a[1] is None
    assert not np.array_equal(a[0], m._forward(X, X, X)[0])


def test_training_calls_take_numpy_scalars_and_check_ranges():
    m = M(8, 2, seed=0)
    a = m._forward_train(X, X, X, dropout=np.float32(0.5), counter=np.int64(3))
    b = m._forward_train(X, X, X, dropout=0.5, counter=3)
    np.testing.assert_array_equal(a[0], b[0])
    with pytest.raises(ValueError, match=r"counter must be in \[0, 2\*\*64\)"):
        m._forward_train(X, X, X, counter=-1)
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\]"):
        m._forward_train(X, X, X, dropout=1.5)
    with pytest.raises(ValueError, match="dropout must be a real number"):
        m._forward_train(X, X, X, dropout=np.array([0.5]))
    # a 0-d array is one number (the constructor took one before, too)
    np.testing.assert_array_equal(
        m._forward_train(X, X, X, dropout=np.array(0.5), counter=3)[0], b[0])
    assert M(8, 2, np.array(0.25)).dropout == 0.25


# ------------------------------------------------------------- the protocol

def test_forward_train_result_has_one_shape():
    m = M(8, 2, seed=0)
    B, H, S, E, Dk = 1, 2, 3, 8, 4
    for kw, n_saved, has_p in [({}, 5, False), ({"save_p": True}, 5, True),
                               ({"save": False}, None, False)]:
        for params in (None, m._block().copy()):
            out, w, saved, copies = m._forward_train(X, X, X, params=params, **kw)
            assert out.shape == (B, S, E) and w.shape == (B, H, S, S)
            if n_saved is None:
                assert saved is None
            else:
                assert len(saved) == 5
                assert [a.shape for a in saved[:4]] == [(B, H, S, Dk), (B, H, Dk, S),
                                                        (B, H, S, Dk), (B, S, E)]
                assert (saved[4] is not None) == has_p
            assert len(copies) == 4
            if params is None:
                np.testing.assert_array_equal(copies[0], m._block())
                assert not np.shares_memory(copies[0], m._block())
            else:
                assert copies[0] is None
            for c in copies[1:]:
                np.testing.assert_array_equal(c, X)
                assert not np.shares_memory(c, X)
    out, w, saved, copies = m._forward_train(X, X, X, need_weights=False)
    assert w is None


def test_forward_train_then_backward_equals_the_public_api():
    m = M(8, 2, seed=0)
    x = np.random.default_rng(1).standard_normal((2, 5, 8))
    masks = [(0, np.triu(np.ones((5, 5), bool), 1))]
    out, w, saved, copies = m._forward_train(x, x, x, masks=masks, dropout=0.25, counter=9)
    g = np.ones_like(out)
    kw = dict(masks=masks, dropout=0.25, counter=9)
    with_saved = m._backward(x, x, x, g, saved=saved, **kw)
    recomputed = m._backward(x, x, x, g, **kw)
    assert [a.shape for a in with_saved] == [(m.num_parameters,), x.shape, x.shape, x.shape]
    for a, b in zip(with_saved, recomputed):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    ctx = m.forward_train(x, mask=np.triu(np.ones((5, 5)), 1), dropout=0.25,
                          dropout_counter=9)
    np.testing.assert_array_equal(ctx.output, out)


def test_protocol_is_keyword_only():
    m = M(8, 2, seed=0)
    with pytest.raises(TypeError):
        m._forward(X, X, X, [], False)
    with pytest.raises(TypeError):
        m._forward_train(X, X, X, None)
    with pytest.raises(TypeError):
        m._backward(X, X, X, X, None)
    with pytest.raises(TypeError, match="keep"):
        m._forward_train(X, X, X, keep=1)
    assert not hasattr(m, "_forward_with")


def test_bad_saved_and_grads_name_the_argument():
    m = M(8, 2, seed=0)
    out, w, saved, _ = m._forward_train(X, X, X)
    with pytest.raises(ValueError, match=r"saved K must have shape \(1, 2, 4, 3\)"):
        m._backward(X, X, X, out, saved=(saved[0], saved[0], saved[2], saved[3], None))
    with pytest.raises(TypeError, match="saved must be None or"):
        m._backward(X, X, X, out, saved=saved[:3])
    with pytest.raises(ValueError, match="grad_output must have the output's shape"):
        m._backward(X, X, X, out[:, :2])
    with pytest.raises(ValueError, match="grad_weights must have the weights' shape"):
        m._backward(X, X, X, out, grad_weights=w[:, :1])
    with pytest.raises(ValueError, match="params must have the parameter block's shape"):
        m._forward_train(X, X, X, params=np.zeros(3))
    with pytest.raises(TypeError, match="query must hold real numbers"):
        m._forward_train(X.astype(complex), X, X)


def test_write_lock_token():
    m = M(8, 2, seed=0)
    token = m._write_lock()
    assert isinstance(token, int) and m._write_lock() == token  # nested: same holder
    m._write_unlock(token)
    m._write_unlock()                    # the calling thread's own hold
    with pytest.raises(RuntimeError, match="not held"):
        m._write_unlock(token)
    with pytest.raises(RuntimeError, match="not held"):
        m._write_unlock()


def test_type_has_a_text_signature():
    sig = inspect.signature(_core.MultiHeadAttention)
    assert str(sig) == ("(d_model, n_heads, dropout=0.0, *, bias=True, kdim=None, "
                        "vdim=None, dtype='float32', seed=None, add_bias_kv=False, "
                        "add_zero_attn=False, n_kv_heads=None, _empty=False)")
    assert str(inspect.signature(M(8, 2)._forward)).startswith(
        "(query, key, value, *, params=None, masks=()")
    assert str(inspect.signature(M(8, 2)._forward)).endswith(
        "layout=None, cache=None, average_weights=False)")
    assert str(inspect.signature(M(8, 2)._backward)).startswith(
        "(query, key, value, grad_output, *, params=None")


@pytest.mark.parametrize("bad", [np.array([True, False]), [1, 0], "yes"])
def test_bias_flag_names_the_argument(bad):
    """bias= follows the flags' rule: one truth value, or a TypeError naming
    it (not NumPy's bare "truth value of an array is ambiguous")."""
    with pytest.raises(TypeError, match="bias"):
        mha_ext.MultiHeadAttention(8, 2, bias=bad)
    assert mha_ext.MultiHeadAttention(8, 2, bias=np.bool_(False), seed=0).bias is False
