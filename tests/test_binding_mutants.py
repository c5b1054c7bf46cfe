"""Pins from a mutation-testing round on the C binding (mha_ext/_core*.c):
each test fails under a plausible bug in the binding (a dropped check, a
comparison flipped, the wrong array taken) that the rest of the suite let
through, most of them in the checks of the private call protocol
(_core_calls.c, _core_parse.c, _core_sdpa.c, _core_masks.c), which the
Python layer reaches only after its own checks.  API.md §7 promises that
nothing a Python caller can pass crashes the interpreter or reads out of
bounds, the private protocol too: a wrong shape is a ValueError naming the
argument, as the public calls give.

Where torch has the call, the numbers are checked against torch in float64
(1e-10: the same sums in another order); where it has none (a tuple of
parameters, grouped-query attention with add_bias_kv, the saved tensors of
_forward_train), against the same call made another way that the suite
already checks, to the bit (API.md §3.4: one instruction set, the same
arguments give the same bits).

Legend: B batch, Sq/Sk query/key lengths, E = d_model, H = n_heads, Hkv =
n_kv_heads, Dk = E/H; L/S query/key lengths of the SDPA function, D its
head width.
"""
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import mha_ext
from mha_ext import _core
from _support import PKG_ROOT, require_torch

torch = require_torch()
M = mha_ext.MultiHeadAttention
TOL = 1e-10  # float64 against torch: the same sums in another order


def _x(*shape, seed=0, dtype=np.float64):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


# ------------------------------------------------ shapes of the call (§3, §7)

def test_inputs_of_another_rank_are_refused():
    """query, key and value must be 3-D (B, S, width): a 4-D array is not
    read as its first B·S·width scalars (_core_parse.c check_inputs)."""
    m = M(8, 2, seed=0, dtype="float64")
    x = _x(1, 3, 8)
    with pytest.raises(ValueError, match=r"query must be 3-D"):
        m._forward(x[..., None], x, x)
    with pytest.raises(ValueError, match=r"key must be 3-D"):
        m._forward(x, x[..., None], x)


def test_key_of_another_batch_is_refused():
    """key's batch must be query's: a key of batch 1 under a query of batch
    2 would be read past its end (_core_parse.c check_inputs)."""
    m = M(8, 2, seed=0, dtype="float64")
    q, k = _x(2, 3, 8), _x(1, 3, 8, seed=1)
    with pytest.raises(ValueError, match=r"key must have shape \(2, Sk, 8\)"):
        m._forward(q, k, _x(2, 3, 8, seed=2))


def test_arrays_with_extra_dimensions_are_refused():
    """Every array of a fixed shape (the parameter block, grad_output,
    head_mask) has exactly that many dimensions: a trailing axis is a
    ValueError naming the argument, not ignored (_core_parse.c
    check_shape)."""
    m = M(8, 2, seed=0, dtype="float64")
    x = _x(1, 3, 8)
    with pytest.raises(ValueError, match="params must have the parameter block's shape"):
        m._forward(x, x, x, params=np.zeros((m.num_parameters, 1)))
    out, _, _, _ = m._forward_train(x, x, x)
    with pytest.raises(ValueError, match="grad_output must have the output's shape"):
        m._backward(x, x, x, out[..., None])
    with pytest.raises(ValueError, match=r"head_mask must have the shape \(batch, heads\)"):
        m._forward(x, x, x, head_mask=np.ones((1, 2, 1)))


def _parts(m, block=None):
    """The module's parameters as the tuple the calls take (one array per
    tensor in the block's order, None where the module has none):
    weights (out, in), biases (out,), bias_k and bias_v (Ekv,)."""
    block = m._block() if block is None else block
    E, Ekv = m.d_model, m.n_kv_heads * m.d_k
    out, inp = (E, Ekv, Ekv, E), (E, m.kdim, m.vdim, E)
    parts = []
    for i, (offset, size) in enumerate(m._layout()):
        a = np.array(block[offset:offset + size])
        shape = (out[i // 2], inp[i // 2]) if i < 8 and i % 2 == 0 else (size,)
        parts.append(a.reshape(shape) if size else None)
    return tuple(parts)


def test_params_tuple_with_grouped_bias_kv():
    """params as a tuple: bias_k and bias_v are (Ekv,) = (n_kv_heads · Dk,)
    (API.md §1), as in the block; with grouped-query attention and
    add_bias_kv the tuple gives the block's bits (no torch twin: torch has
    no n_kv_heads)."""
    m = M(8, 4, n_kv_heads=2, add_bias_kv=True, seed=3, dtype="float64")
    parts = _parts(m)
    assert parts[8].shape == (4,)
    x = _x(2, 3, 8)
    want, w_want = m._forward(x, x, x)
    got, w_got = m._forward(x, x, x, params=parts)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(w_got, w_want)
    wide = parts[:8] + (np.zeros(8), np.zeros(8))
    with pytest.raises(ValueError, match=r"params\[8\] \(bias_k\) must have the shape \(4,\)"):
        m._forward(x, x, x, params=wide)


def test_params_tuple_holds_none_where_the_module_has_no_tensor():
    """A module with bias=False has no bias tensors: the tuple holds None
    there, and an array is a ValueError naming its index (not ignored)."""
    m = M(8, 2, bias=False, seed=0, dtype="float64")
    parts = _parts(m)
    assert parts[1] is None
    x = _x(1, 3, 8)
    np.testing.assert_array_equal(m._forward(x, x, x, params=parts)[0], m._forward(x, x, x)[0])
    with pytest.raises(ValueError, match=r"params\[1\] \(W_q\.bias\) must be None"):
        m._forward(x, x, x, params=(parts[0], np.zeros(8)) + parts[2:])


def test_value_that_is_the_query_against_torch():
    """mha(x, y, x): value is the query's very array, key another one; the
    binding converts an input once when it is an earlier one, and must pair
    value with query here, not with key (torch.nn.MultiheadAttention,
    float64, 1e-10; API.md §3)."""
    t = torch.nn.MultiheadAttention(8, 2, batch_first=True, dtype=torch.float64).eval()
    m = M.from_torch(t)
    x, y = _x(2, 4, 8), _x(2, 4, 8, seed=1)
    out, w = m(x, y, x)
    with torch.no_grad():
        t_out, t_w = t(*(torch.from_numpy(a) for a in (x, y, x)), average_attn_weights=False)
    np.testing.assert_allclose(out, t_out.numpy(), rtol=TOL, atol=TOL)
    np.testing.assert_allclose(w, t_w.numpy(), rtol=TOL, atol=TOL)


def test_backward_takes_saved_without_p():
    """_backward's saved: the (Q, K, V, ctx, P | None) of _forward_train, or
    its first four (no P, as _forward_train(save_p=False) keeps none): the
    same gradients as the 5-tuple with None (_core_calls.c)."""
    m = M(8, 2, seed=0, dtype="float64")
    x = _x(1, 3, 8)
    out, _, saved, _ = m._forward_train(x, x, x, save_p=False)
    g = _x(*out.shape, seed=4)
    assert saved[4] is None
    want = m._backward(x, x, x, g, saved=saved)
    got = m._backward(x, x, x, g, saved=saved[:4])
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------------ the key/value cache (§3.3)

def _cache_args(m, B, cap, dtype=np.float64):
    Hkv, Dk = m.n_kv_heads, m.d_k
    return np.zeros((B, Hkv, Dk, cap), dtype), np.zeros((B, Hkv, cap, Dk), dtype)


def test_cache_refuses_read_only_arrays():
    """The call writes its keys and values into the cache's arrays: a
    read-only one is a ValueError, never written (API.md §7: no write to
    memory the caller did not lend)."""
    m = M(8, 2, seed=0, dtype="float64").eval()
    x = _x(1, 2, 8)
    for i in range(2):
        kv = list(_cache_args(m, 1, 4))
        kv[i].setflags(write=False)
        with pytest.raises(ValueError, match="writeable"):
            m._forward(x, x, x, cache=(kv[0], kv[1], 0))
        assert not kv[i].any()


def test_cache_of_capacity_zero_is_refused():
    """A cache has a capacity > 0 (KVCache's max_len >= 1, API.md §3.3): a
    capacity-0 pair is a ValueError, even for a call of no keys."""
    m = M(8, 2, seed=0, dtype="float64").eval()
    k, v = _cache_args(m, 1, 0)
    x = _x(1, 0, 8)
    with pytest.raises(ValueError, match="capacity > 0"):
        m._forward(x, x, x, cache=(k, v, 0))


def test_cache_refuses_extra_keys():
    """add_bias_kv and add_zero_attn append keys that would sit inside the
    cached ones: a ValueError at the binding too (API.md §3.3)."""
    for kw in (dict(add_bias_kv=True), dict(add_zero_attn=True)):
        m = M(8, 2, seed=0, dtype="float64", **kw).eval()
        k, v = _cache_args(m, 1, 4)
        x = _x(1, 2, 8)
        with pytest.raises(ValueError, match="add_bias_kv or add_zero_attn"):
            m._forward(x, x, x, cache=(k, v, 0))
        assert not k.any() and not v.any()


# ------------------------------------------------------------ dropout streams (§1, §3.2)

def test_training_calls_take_streams_from_zero_only_with_dropout():
    """A training call takes the module's next dropout stream only when
    dropout > 0 (_core_calls.c: one stream per call), the first being
    stream 0: a call without dropout takes none, the first call with
    dropout draws the mask forward_train replays with dropout_counter=0,
    and forward_train's own reservation (_take_counter) is the next one."""
    m = M(8, 2, seed=5, dtype="float64")
    x = _x(1, 6, 8)
    m.dropout = 0.0
    m(x)
    assert m._counter == 0
    m.dropout = 0.5
    _, w = m(x)
    assert m._counter == 1
    replay = m.forward_train(x, dropout_counter=0).weights
    np.testing.assert_array_equal(w == 0, replay == 0)
    np.testing.assert_allclose(w, replay, rtol=TOL, atol=TOL)
    assert m.forward_train(x).counter == 1


# ------------------------------------------------------------------ masks (§3.1, §4a)

def _torch_sdpa(q, k, v, **kw):
    kw = {n: torch.from_numpy(a) if isinstance(a, np.ndarray) else a for n, a in kw.items()}
    return torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(a) for a in (q, k, v)), **kw).numpy()


def test_mask_of_five_dimensions_is_refused():
    """A mask broadcasts onto (B, H, L, S): one of 5 dimensions is a
    ValueError, not read through its last four axes (its first ignored)."""
    q, k, v = _x(1, 2, 3, 4), _x(1, 2, 5, 4, seed=1), _x(1, 2, 5, 4, seed=2)
    mask = np.zeros((2, 1, 2, 3, 5))
    with pytest.raises(ValueError, match="at most 4 dimensions"):
        _core._sdpa(q, k, v, masks=[(1, mask)])


def test_as_many_masks_as_the_core_takes():
    """Up to 8 masks (the core's MHA_MAX_MASKS) combine, blocking ones as
    -inf and additive ones added, as torch's one float mask of their sum
    (float64, 1e-10); a ninth is a ValueError."""
    q, k, v = _x(1, 2, 3, 4), _x(1, 2, 5, 4, seed=1), _x(1, 2, 5, 4, seed=2)
    rng = np.random.default_rng(7)
    adds = [rng.standard_normal((3, 5)) for _ in range(7)]
    block = np.zeros((3, 5), bool)
    block[:, 1] = True
    masks = [(1, a) for a in adds] + [(0, block)]
    got = _core._sdpa(q, k, v, masks=masks)[0]
    total = np.where(block, -np.inf, sum(adds))
    np.testing.assert_allclose(got, _torch_sdpa(q, k, v, attn_mask=total), rtol=TOL, atol=TOL)
    with pytest.raises(ValueError, match="at most 8 masks"):
        _core._sdpa(q, k, v, masks=masks + [(1, adds[0])])


def test_mask_kind_is_zero_or_one():
    """A mask's kind is 0 (blocking) or 1 (additive): any other is a
    ValueError naming both, on the module's calls and on _sdpa."""
    q, k, v = _x(1, 2, 3, 4), _x(1, 2, 5, 4, seed=1), _x(1, 2, 5, 4, seed=2)
    for kind in (2, -1):
        with pytest.raises(ValueError, match=r"kind must be 0 \(blocking\) or 1 \(additive\)"):
            _core._sdpa(q, k, v, masks=[(kind, np.zeros((3, 5)))])
    m = M(8, 2, seed=0, dtype="float64")
    x = _x(1, 3, 8)
    with pytest.raises(ValueError, match="kind must be 0"):
        m._forward(x, x, x, masks=[(2, np.zeros((3, 3)))])


def test_layout_broadcasts_batch_and_heads_only():
    """A block layout's keep is (1 or B, 1 or H, ceil(L / q_block),
    ceil(S / k_block)): only the batch and head axes broadcast; one query
    block where the call has two is a ValueError (the core would read its
    second past the array), and the kept pattern matches torch given the
    dense mask (float64, 1e-10)."""
    q, k, v = _x(2, 2, 4, 4), _x(2, 2, 6, 4, seed=1), _x(2, 2, 6, 4, seed=2)
    keep = np.array([[[[True, False, True], [False, True, True]]]])  # (1, 1, 2, 3)
    got = _core._sdpa(q, k, v, layout=(keep, 2, 2))[0]
    dense = np.repeat(np.repeat(keep[0, 0], 2, axis=0), 2, axis=1)  # (4, 6), True = kept
    np.testing.assert_allclose(got, _torch_sdpa(q, k, v, attn_mask=dense), rtol=TOL, atol=TOL)
    with pytest.raises(ValueError, match="does not fit"):
        _core._sdpa(q, k, v, layout=(keep[:, :, :1], 2, 2))


# ------------------------------------------------------------ scalar arguments (§1, §3, §7)

class _Unsure:
    """A truth value that cannot be had: its __bool__ raises."""

    def __bool__(self):
        raise RuntimeError("no truth value")


def test_flag_without_a_truth_value_is_a_type_error():
    """A flag whose bool() raises is a TypeError naming the argument, as
    mha_ext._convert.flag gives in Python, not the object's own error."""
    m = M(8, 2, seed=0, dtype="float64")
    x = _x(1, 3, 8)
    with pytest.raises(TypeError, match="need_weights must be True or False"):
        m._forward(x, x, x, need_weights=_Unsure())
    with pytest.raises(TypeError, match="zero_rows must be True or False"):
        _core._sdpa(_x(1, 1, 2, 4), _x(1, 1, 2, 4), _x(1, 1, 2, 4), zero_rows=_Unsure())


def test_scale_refuses_bools():
    """scale is None or a real number; a bool of any kind (Python's, NumPy's
    scalar or 0-d array) is a TypeError, not 1.0 (API.md §3: a real number
    where one is expected, never a bool)."""
    m = M(8, 2, seed=0, dtype="float64")
    x = _x(1, 3, 8)
    for s in (True, np.bool_(False), np.array(True)):
        with pytest.raises(TypeError, match="scale must be None or a real number, not a bool"):
            m._forward(x, x, x, scale=s)
        with pytest.raises(TypeError, match="not a bool"):
            _core._sdpa(_x(1, 1, 2, 4), _x(1, 1, 2, 4), _x(1, 1, 2, 4), scale=s)


def test_dtype_of_another_kind_is_a_value_error():
    """dtype: float32 or float64 (API.md §1); a real dtype of another kind
    (int32, float16, complex) is a ValueError (the right type of argument,
    a value not supported, as mha_ext.torch's classes give for a torch
    dtype), what is no dtype at all a TypeError."""
    for dt in ("int32", np.float16, np.complex128):
        with pytest.raises(ValueError, match='dtype must be "float32" or "float64", got'):
            M(8, 2, dtype=dt)
    with pytest.raises(TypeError, match='dtype must be "float32" or "float64", not'):
        M(8, 2, dtype="no such dtype")


# --------------------------------------------- attention on projected heads (§4a)

def test_sdpa_heads_must_be_a_multiple_of_the_key_heads():
    """q (B, H, L, D) and k, v (B, Hkv, S, ·) with H % Hkv != 0 is a
    ValueError: query head h reads key head h // (H // Hkv), past Hkv here
    (3 query heads on 2 key heads would read a third)."""
    q, k, v = _x(1, 3, 2, 4), _x(1, 2, 5, 4, seed=1), _x(1, 2, 5, 4, seed=2)
    with pytest.raises(ValueError, match="H a multiple of Hkv"):
        _core._sdpa(q, k, v)
    with pytest.raises(ValueError, match="H a multiple of Hkv"):
        _core._sdpa_backward(q, k, v, _x(1, 3, 2, 4, seed=3))


@pytest.mark.parametrize("which", ["D", "Dv"])
def test_sdpa_head_widths_are_positive(which):
    """The C call takes widths D, Dv > 0 (mha_ext.scaled_dot_product_attention
    widens a zero width before it): a zero one is a ValueError saying so."""
    D, Dv = (0, 4) if which == "D" else (4, 0)
    q, k, v = _x(1, 2, 3, D), _x(1, 2, 5, D, seed=1), _x(1, 2, 5, Dv, seed=2)
    with pytest.raises(ValueError, match="D, Dv > 0"):
        _core._sdpa(q, k, v)


def test_sdpa_head_mask_is_b_by_h_and_finite():
    """_sdpa's head_mask is exactly (B, H) of finite numbers: fewer heads
    would be read past the array, a NaN or inf would reach every row.  A
    good one scales each head's output, as torch's SDPA output times the
    factor (float64, 1e-10; API.md §3.2)."""
    q, k, v = _x(2, 2, 3, 4), _x(2, 2, 5, 4, seed=1), _x(2, 2, 5, 4, seed=2)
    hm = np.array([[0.5, 2.0], [0.0, -1.0]])
    got = _core._sdpa(q, k, v, head_mask=hm)[0]
    np.testing.assert_allclose(got, _torch_sdpa(q, k, v) * hm[:, :, None, None],
                               rtol=TOL, atol=TOL)
    for bad in (hm[:, :1], hm[:1]):
        with pytest.raises(ValueError, match=r"head_mask must have the shape \(B, H\) = \(2, 2\)"):
            _core._sdpa(q, k, v, head_mask=bad)
    for x in (np.nan, np.inf):
        with pytest.raises(ValueError, match="head_mask must hold finite numbers"):
            _core._sdpa(q, k, v, head_mask=np.where(hm == 2.0, x, hm))


def test_sdpa_backward_checks_its_gradients():
    """_sdpa_backward's grad_output is (B, H, L, Dv) and grad_weights
    (B, H, L, S), each exactly: a smaller one would be read past its end.
    Right ones give torch's gradients (float64, 1e-10)."""
    q, k, v = _x(1, 2, 3, 4), _x(1, 2, 5, 4, seed=1), _x(1, 2, 5, 4, seed=2)
    g = _x(1, 2, 3, 4, seed=3)
    got = _core._sdpa_backward(q, k, v, g)
    tq, tk, tv = (torch.from_numpy(a).requires_grad_() for a in (q, k, v))
    torch.nn.functional.scaled_dot_product_attention(tq, tk, tv).backward(torch.from_numpy(g))
    for a, t in zip(got, (tq, tk, tv)):
        np.testing.assert_allclose(a, t.grad.numpy(), rtol=TOL, atol=TOL)
    with pytest.raises(ValueError,
                       match=r"grad_output must have the output's shape \(1, 2, 3, 4\)"):
        _core._sdpa_backward(q, k, v, g[:, :, :2])
    with pytest.raises(ValueError,
                       match=r"grad_weights must have the weights' shape \(1, 2, 3, 5\)"):
        _core._sdpa_backward(q, k, v, g, grad_weights=np.zeros((1, 2, 3, 4)))


def test_sdpa_none_array_is_a_type_error():
    """q, k, v and grad_output must be arrays: None is a TypeError naming
    the argument (not read as a 0-d NaN)."""
    q = _x(1, 2, 3, 4)
    with pytest.raises(TypeError, match="k must be an array, not None"):
        _core._sdpa(q, None, q)
    with pytest.raises(TypeError, match="grad_output must be an array, not None"):
        _core._sdpa_backward(q, q, q, None)


# ------------------------------------------------------------ the module (§2, §4)

def test_empty_module_leaves_its_parameters_zero():
    """_empty=True (the torch classes' cores, whose calls pass their own
    parameters): the block stays zero, never initialised or touched (so its
    pages are never faulted in); without it the parameters are drawn."""
    assert not _core.MultiHeadAttention(8, 2, _empty=True, add_bias_kv=True)._block().any()
    assert _core.MultiHeadAttention(8, 2, seed=0, add_bias_kv=True)._block().all()


def test_load_takes_exactly_the_block():
    """_load(block) replaces every parameter with a 1-D block of exactly
    num_parameters scalars: a longer or 2-D one is a ValueError and changes
    nothing; the right one is read as given."""
    m = M(8, 2, seed=0, dtype="float64")
    before = m._snapshot()
    n = m.num_parameters
    for bad in (np.ones(n + 1), np.ones(n - 1), np.ones((n, 1))):
        with pytest.raises(ValueError, match=f"_load expects {n} scalars"):
            m._load(bad)
        np.testing.assert_array_equal(m._snapshot(), before)
    new = np.arange(n, dtype=np.float64)
    m._load(new)
    np.testing.assert_array_equal(m._block(), new)


# ------------------------------------------------------------ a bug found in this round

def test_cache_refuses_byteswapped_arrays():
    """The cache's K and V are taken as they are, never converted (the call
    writes into them), so they must be of the module's dtype exactly: a
    byte-swapped float64 ('>f8' here) has NumPy's type number of float64
    but not its byte order, and was accepted: the call wrote native-order
    keys into it (the caller read garbage back) and read a filled one's
    keys as garbage.  Now a ValueError that changes nothing."""
    m = M(8, 2, seed=0, dtype="float64").eval()
    x = _x(1, 2, 8)
    k, v = _cache_args(m, 1, 4)
    for i in range(2):
        kv = [k, v]
        kv[i] = kv[i].astype(kv[i].dtype.newbyteorder())
        with pytest.raises(ValueError, match="of the module's dtype in native byte order"):
            m._forward(x, x, x, cache=(kv[0], kv[1], 0))
        assert not kv[i].any()
    # native ones: the call with no cache, and K, V hold the projected keys
    out, _ = m._forward(x, x, x, cache=(k, v, 0), is_causal="lower_right")
    want, _ = m._forward(x, x, x, is_causal="lower_right")
    assert k.any() and v.any()
    np.testing.assert_allclose(out, want, rtol=TOL, atol=TOL)


# ------------------------------------------------------------ holds (_core_holds.c, §3.3, §5)

def test_cache_hold_gives_back_only_its_own_token():
    """_Holding(d, busy): __exit__ removes d["by"] only while it is still
    this hold's token.  A hold whose token was dropped (a fork child gives
    other threads' holds up) and taken by another must not end that other
    hold on its way out: a third is still refused with `busy`."""
    d = {}
    first, second = _core._Holding(d, "busy"), _core._Holding(d, "busy")
    first.__enter__()
    token = d["by"]
    with pytest.raises(RuntimeError, match="busy"):
        second.__enter__()
    del d["by"]  # dropped, as a fork child drops another thread's hold
    second.__enter__()
    assert d["by"] is not token
    assert first.__exit__(None, None, None) is False
    assert "by" in d
    with pytest.raises(RuntimeError, match="busy"):
        _core._Holding(d, "busy").__enter__()
    second.__exit__(None, None, None)
    assert d == {}


# the start of the scripts below: a module, calls of ~0.25 s on Zen 4 (the
# core polls for signals every 50 ms: several times a call), and a test a
# SIGALRM handler makes of where it runs
IN_A_CALL = """
import os, signal, threading, time
import numpy as np
import mha_ext
m = mha_ext.MultiHeadAttention(512, 8, seed=0).eval()
x = np.random.default_rng(0).standard_normal((4, 2048, 512)).astype(np.float32)
busy = []

def first_time_inside_a_call():
    \"\"\"True the first time a handler runs inside the main thread's call
    (which holds a read, so a write hold fails there), the timer then
    stopped; False between calls and ever after.\"\"\"
    if busy:
        return False
    busy.append(1)
    try:
        m._write_unlock(m._write_lock())
    except RuntimeError:
        signal.setitimer(signal.ITIMER_REAL, 0)
        return True
    busy.pop()
    return False
"""

WRITER_FIRST = IN_A_CALL + """
order, threads = [], []

def writer():
    with m.editing():
        order.append("writer")

def reader():
    m(x[:1, :4], need_weights=False)
    order.append("reader")

def handler(sig, frame):
    if not first_time_inside_a_call():
        return
    threads.append(threading.Thread(target=writer))
    threads[0].start()
    time.sleep(0.5)  # the writer waits for the call
    threads.append(threading.Thread(target=reader))
    threads[1].start()
    time.sleep(0.5)  # a new call waits for the writer
    order.append("handler")

signal.signal(signal.SIGALRM, handler)
signal.setitimer(signal.ITIMER_REAL, 0.02, 0.02)
t0 = time.monotonic()
while not threads and time.monotonic() - t0 < 30:
    m(x, need_weights=False)
signal.setitimer(signal.ITIMER_REAL, 0)
for t in threads:
    t.join(30)
print(order)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="signals as on Linux")
def test_new_calls_queue_behind_a_waiting_writer():
    """Writers go first (_core.h, API.md §5): while a writer waits for a
    running call, a new call from another thread waits for that writer, so
    a steady stream of calls cannot starve editing() or load_state_dict.
    The running call is held open by a signal handler inside it (the main
    thread's call polls for signals); run in a fresh interpreter under a
    timeout."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(WRITER_FIRST)], cwd=PKG_ROOT,
                          capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['handler', 'writer', 'reader']"


def test_edits_count_outer_write_holds():
    """_edits(): the write holds begun on the parameters (editing() blocks,
    load_state_dict), nested ones not counted; trace() compares it across
    its call and its copy of the parameters (API.md §6)."""
    m = M(8, 2, seed=0, dtype="float64")
    e0 = m._edits()
    with m.editing():
        with m.editing():
            pass
    assert m._edits() == e0 + 1
    m.load_state_dict(m.state_dict())
    assert m._edits() == e0 + 2
    m(_x(1, 3, 8))  # a call reads: no edit
    assert m._edits() == e0 + 2


FORK_IN_CALL = IN_A_CALL + """
pids = []

def handler(sig, frame):
    if first_time_inside_a_call():  # fork here
        pids.append(os.fork())

def edit():
    with m.editing():
        pass

signal.signal(signal.SIGALRM, handler)
signal.setitimer(signal.ITIMER_REAL, 0.02, 0.02)
t0 = time.monotonic()
while not pids and time.monotonic() - t0 < 30:
    try:
        m(x, need_weights=False)
    except RuntimeError:
        pass  # the child's call lost its workers: it says so
signal.setitimer(signal.ITIMER_REAL, 0)
if pids == [0]:  # the child: the call's read hold ended uncounted, a write goes through
    t = threading.Thread(target=edit, daemon=True)
    t.start()
    t.join(10)
    os._exit(3 if t.is_alive() else 0)
_, status = os.waitpid(pids[0], 0)
print("child", os.WEXITSTATUS(status) if os.WIFEXITED(status) else "killed")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork and signals as on Linux")
def test_fork_inside_a_call_leaves_the_childs_lock_writable():
    """A fork inside the main thread's call (from a signal handler): in the
    child the lock forgets the parent's reads (a new generation), so that
    call's read hold, ending there, is not subtracted again: a write in the
    child then goes through instead of waiting for good (API.md §5)."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(FORK_IN_CALL)], cwd=PKG_ROOT,
                          capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "child 0"


# ------------------------------------------------------------ the output cache (_core_mem.c, §5)

def _sdpa_weights(L, S, fill=1.0):
    """_sdpa's weights (1, 1, L, S) in float64: L·S·8 bytes from the output
    cache (from 1 MiB on)."""
    q = np.full((1, 1, L, 1), fill)
    return _core._sdpa(q, q[:, :, :1].repeat(S, axis=2), np.ones((1, 1, S, 1)),
                       need_weights=True)[1]


@pytest.mark.skipif(mha_ext.memory_info()["limit_bytes"] < 64 << 20,
                    reason="the output cache is off or small (MHA_EXT_CACHE_MB)")
def test_output_cache_keeps_a_large_block_from_a_small_array():
    """A freed block is reused for an array of about its size (at most
    twice), not for a much smaller one: a 16 MiB block stays cached while a
    1.2 MiB array is made (and is cached beside it when freed)."""
    mha_ext.release_memory()
    big = _sdpa_weights(1024, 2048)
    del big
    info = mha_ext.memory_info()
    assert info["cached_blocks"] == 1 and info["cached_bytes"] >= 16 << 20
    small = _sdpa_weights(128, 1200)
    assert mha_ext.memory_info()["cached_blocks"] == 1
    del small
    assert mha_ext.memory_info()["cached_blocks"] == 2
    mha_ext.release_memory()


@pytest.mark.skipif(mha_ext.memory_info()["limit_bytes"] < 64 << 20,
                    reason="the output cache is off or small (MHA_EXT_CACHE_MB)")
def test_zeroed_results_from_a_reused_block_are_zero():
    """_forward_train with no query (B·Sq = 0) leaves the saved K and V
    unwritten, so they are made zeroed: from a reused block of the output
    cache too, which holds an earlier result's numbers (never uninitialised
    memory reaches Python, API.md §7)."""
    m = M(64, 1, seed=0, dtype="float64")
    k = _x(1, 4096, 64)  # the saved K and V: 1·64·4096 float64 = 2 MiB each
    mha_ext.release_memory()
    out = m._forward(k, k, k, need_weights=False)[0]  # 2 MiB of nonzero numbers
    assert out.all()
    del out
    assert mha_ext.memory_info()["cached_blocks"] == 1
    _, _, saved, _ = m._forward_train(k[:, :0], k, k, need_weights=False)
    assert saved[1].shape == (1, 1, 64, 4096)
    assert not saved[1].any() and not saved[2].any()
    mha_ext.release_memory()
