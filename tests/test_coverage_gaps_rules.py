"""Behaviour of the Python layer that a user can reach and that no other
test drove (found with branch coverage of the whole suite): each test calls
the public API and checks the result against torch itself or against
docs/API.md (the error type and the message naming the argument)."""
import numpy as np
import pytest

import mha_ext
from _support import dead_row_outputs, need, require_torch

F32 = dict(rtol=2e-5, atol=2e-5)
F64 = dict(rtol=1e-10, atol=1e-10)


def _rand(*shape, dtype=np.float64, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _torch_twin(torch, m):
    """torch.nn.MultiheadAttention (batch-first) holding m's parameters."""
    E, H = m.d_model, m.n_heads
    t = torch.nn.MultiheadAttention(E, H, batch_first=True, add_bias_kv=m.add_bias_kv,
                                    dtype=getattr(torch, str(m.dtype)))
    with torch.no_grad():
        t.in_proj_weight.copy_(torch.from_numpy(np.concatenate(
            [m.W_q.weight, m.W_k.weight, m.W_v.weight])))
        t.in_proj_bias.copy_(torch.from_numpy(np.concatenate(
            [m.W_q.bias, m.W_k.bias, m.W_v.bias])))
        t.out_proj.weight.copy_(torch.from_numpy(m.W_o.weight))
        t.out_proj.bias.copy_(torch.from_numpy(m.W_o.bias))
        if m.add_bias_kv:
            t.bias_k.copy_(torch.from_numpy(m.bias_k).reshape(1, 1, E))
            t.bias_v.copy_(torch.from_numpy(m.bias_v).reshape(1, 1, E))
    return t.eval()


def _same_as_torch(torch, m):
    """m's self-attention output and per-head weights on a (2, 3, 8) input
    equal its torch twin's (float64); returns the twin."""
    t = _torch_twin(torch, m)
    x = _rand(2, 3, 8, seed=1)
    out, w = m(x)
    with torch.no_grad():
        t_out, t_w = t(*(torch.from_numpy(x),) * 3, average_attn_weights=False)
    np.testing.assert_allclose(out, t_out.numpy(), **F64)
    np.testing.assert_allclose(w, t_w.numpy(), **F64)
    return t


# -- scale that float() cannot read (_calls.py: the TypeError/ValueError of float())

@pytest.mark.parametrize("scale", [[0.5], object()])
def test_scale_that_is_no_number_is_a_typeerror_naming_scale_as_torch(scale):
    torch = require_torch()
    q = _rand(1, 2, 3, 4)
    with pytest.raises(TypeError) as theirs:
        torch.nn.functional.scaled_dot_product_attention(
            *(torch.from_numpy(q),) * 3, scale=scale)
    assert "scale" in str(theirs.value)
    with pytest.raises(TypeError, match="scale"):
        mha_ext.scaled_dot_product_attention(q, q, q, scale=scale)
    m = mha_ext.MultiHeadAttention(4, 2, seed=0)
    with pytest.raises(TypeError, match="scale"):
        m(q[0, 0], scale=scale)


# -- parameter setters (module.py)

def test_assigning_a_weight_of_another_shape_is_a_valueerror_naming_both_shapes():
    m = mha_ext.MultiHeadAttention(8, 2, seed=0)
    before = m.W_q.weight.copy()
    # (8,) would broadcast into (8, 8) without the check
    for bad in (np.ones(8), np.ones((3, 3))):
        with pytest.raises(ValueError) as exc:
            m.W_q.weight = bad
        msg = str(exc.value)
        assert "weight" in msg and "(8, 8)" in msg and str(bad.shape) in msg, msg
        np.testing.assert_array_equal(m.W_q.weight, before)


def test_assigning_weights_and_biases_changes_the_call_as_torchs_parameters():
    torch = require_torch()
    m = mha_ext.MultiHeadAttention(8, 2, dtype="float64", seed=5)
    for i, name in enumerate(("W_q", "W_k", "W_v", "W_o")):
        lin = getattr(m, name)
        w, b = _rand(8, 8, seed=10 + i), _rand(8, seed=20 + i)
        lin.weight = w.tolist()          # any array-like, converted
        lin.bias = b
        np.testing.assert_array_equal(lin.weight, w)
        np.testing.assert_array_equal(lin.bias, b)
    _same_as_torch(torch, m)


def test_setting_a_bias_the_module_does_not_have_is_an_attributeerror_that_says_why():
    m = mha_ext.MultiHeadAttention(8, 2, bias=False, seed=0)
    with pytest.raises(AttributeError, match="bias=False"):
        m.W_q.bias = np.zeros(8)
    with pytest.raises(AttributeError, match="add_bias_kv"):
        m.bias_k = np.zeros(8)
    with pytest.raises(AttributeError, match="add_bias_kv"):
        m.bias_v = np.zeros(8)
    assert m.W_q.bias is None and m.bias_k is None and m.bias_v is None


def test_assigning_bias_v_changes_the_call_as_torchs_bias_v():
    torch = require_torch()
    m = mha_ext.MultiHeadAttention(8, 2, add_bias_kv=True, dtype="float64", seed=3)
    new_v = _rand(8, seed=7)
    new_k = _rand(8, seed=8)
    m.bias_v = new_v
    m.bias_k = new_k
    np.testing.assert_array_equal(m.bias_v, new_v)
    np.testing.assert_array_equal(m.bias_k, new_k)
    t = _same_as_torch(torch, m)     # its twin copies bias_k / bias_v as they now are
    x = _rand(2, 3, 8, seed=1)
    out, _ = m(x)
    # and the value path does read it: the bias_v key gets weight > 0
    with torch.no_grad():
        t.bias_v.copy_(torch.from_numpy(new_v * 0).reshape(1, 1, 8))
        zero_out, _ = t(*(torch.from_numpy(x),) * 3)
    assert not np.allclose(out, zero_out.numpy())


# -- cache_memory's shape check (module.py)

@pytest.mark.parametrize("shape", [(3, 8), (0, 3, 8), (2, 0, 8)])
def test_cache_memory_of_a_wrong_rank_or_empty_is_a_valueerror_naming_memory(shape):
    m = mha_ext.MultiHeadAttention(8, 2, seed=0)
    with pytest.raises(ValueError) as exc:
        m.cache_memory(np.zeros(shape, np.float32))
    assert "memory" in str(exc.value) and str(shape) in str(exc.value)


# -- trace of an unbatched call with a per-head (H, Sq, Sk) attn_mask (_trace_masks.py)

def test_trace_unbatched_per_head_attn_mask_matches_torch():
    torch = require_torch()
    m = mha_ext.MultiHeadAttention(8, 2, dtype="float64", seed=4)
    m.eval()
    x = _rand(3, 8, seed=2)
    am = np.zeros((2, 3, 3), bool)
    am[0, :, 2] = True            # head 0: key 2 blocked
    am[1, 0, 1] = am[1, 2, 0] = True
    tr = mha_ext.trace(m, x, attn_mask=am)
    t = _torch_twin(torch, m)
    with torch.no_grad():
        t_out, t_w = t(*(torch.from_numpy(x),) * 3, attn_mask=torch.from_numpy(am),
                       average_attn_weights=False)
    np.testing.assert_allclose(tr.output, t_out.numpy(), **F64)
    np.testing.assert_allclose(tr.weights, t_w.numpy(), **F64)
    out, w = m(x, attn_mask=am)
    np.testing.assert_allclose(tr.output, out, **F64)
    masked = np.asarray(tr["masked scores"].array)
    assert masked.shape[-3:] == (2, 3, 3)
    np.testing.assert_array_equal(np.isneginf(masked).reshape(2, 3, 3), am)


# -- plot_heads' argument checks (plot.py)

def test_plot_heads_batch_not_an_int_and_no_heads_are_refused_by_name():
    need("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    from mha_ext.plot import plot_heads
    w = np.full((2, 2, 3, 3), 1 / 3)
    for bad in ("0", 0.0, True):
        with pytest.raises(TypeError, match="batch must be an int"):
            plot_heads(w, batch=bad)
    with pytest.raises(ValueError, match="no heads"):
        plot_heads(np.zeros((0, 3, 3)))


# -- reprs (trace.Step, Explorer, ForwardContext: docs §6, §9)

def test_reprs_of_step_explorer_and_forward_context_show_their_shapes():
    m = mha_ext.MultiHeadAttention(8, 2, seed=0)
    x = _rand(2, 3, 8, dtype=np.float32)
    tr = mha_ext.trace(m, x)
    assert repr(tr[0]) == ("Step(name='query', formula='x_q', shape=[2, 3, 8], "
                           "dims=[B, Sq, E])")
    assert repr(mha_ext.explore(tr)).startswith("Explorer(shape=[2, 2, 3, 3], layers=[")
    ctx = m.forward_train(x)
    r = repr(ctx)
    assert r.startswith("ForwardContext(output=(2, 3, 8), weights=(2, 2, 3, 3), dropout=")
    assert f"counter={ctx.counter}" in r


# -- the torch module refuses complex tensors (torch.py)

def test_torch_module_refuses_a_complex_tensor_by_name():
    torch = require_torch()
    from mha_ext.torch import MultiHeadAttention
    m = MultiHeadAttention(8, 2)
    x = torch.ones(2, 3, 8)
    for name, args in (("query", (x.to(torch.complex64),)),
                       ("key", (x, x.to(torch.complex64), x)),
                       ("value", (x, x, x.to(torch.complex64)))):
        with pytest.raises(TypeError, match=f"{name} must hold real numbers"):
            m(*args)


# -- from_torch (_interop.py)

def test_from_torch_of_a_module_with_bias_k_but_no_bias_v_is_a_valueerror():
    torch = require_torch()
    t = torch.nn.MultiheadAttention(8, 2, add_bias_kv=True)
    t.bias_v = None
    with pytest.raises(ValueError, match="bias_k and bias_v"):
        mha_ext.MultiHeadAttention.from_torch(t)


@pytest.mark.parametrize("spoil", ["last_row", "inner_row"])
def test_from_torch_buffer_almost_causal_is_not_taken_for_a_causal_mask(spoil):
    torch = require_torch()
    from torch_seed import SeedMultiHeadAttention
    t = SeedMultiHeadAttention(8, 2)
    buf = torch.tril(torch.ones(300, 300))   # more rows than one 256-row chunk
    if spoil == "last_row":
        buf[-1, 2] = 0
    else:
        buf[280, 3] = 0
    t.register_buffer("tril", buf)
    m = mha_ext.MultiHeadAttention.from_torch(t)   # no ValueError asking for causal=
    x = _rand(2, 3, 8, dtype=np.float32)
    with torch.no_grad():
        ref_out, _ = t(*(torch.from_numpy(x),) * 3)
    np.testing.assert_allclose(m(x)[0], ref_out.numpy(), **F32)
    # while the exact causal buffer is still recognised
    t.tril = torch.tril(torch.ones(300, 300))
    with pytest.raises(ValueError, match="tril"):
        mha_ext.MultiHeadAttention.from_torch(t)


# -- mask_polarity="keep" with a mask of no numeric kind (_habits.py)

@pytest.mark.parametrize("mask", [np.ones((3, 3), complex), np.array([["1"]])])
def test_keep_polarity_mask_of_another_dtype_is_a_typeerror_naming_mask(mask):
    m = mha_ext.MultiHeadAttention(8, 2, seed=0)
    m.mask_polarity = "keep"
    with pytest.raises(TypeError, match=r"mask must be bool, int or float .*mask_polarity='keep'"):
        m(_rand(2, 3, 8, dtype=np.float32), mask=mask)


# -- a long value in a flag's refusal is cut (_convert._describe)

def test_a_flag_given_a_long_sequence_names_it_and_cuts_its_repr():
    m = mha_ext.MultiHeadAttention(8, 2, seed=0)
    with pytest.raises(TypeError) as exc:
        m(_rand(2, 3, 8, dtype=np.float32), need_weights=list(range(40)))
    msg = str(exc.value)
    assert msg.startswith("need_weights must be True or False, got list [0, 1, 2")
    assert msg.endswith("...") and len(msg) < 120, msg


# -- the drop-in: window with the is_causal hint and add_bias_kv (_torch_mha.py)

def test_dropin_refuses_window_with_the_causal_hint_over_bias_kv_keys():
    torch = require_torch()
    from mha_ext.torch import MultiheadAttention
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(8, 2, add_bias_kv=True, batch_first=True).eval()
    ours = MultiheadAttention.from_torch(ref)
    x = torch.randn(2, 3, 8)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(3)
    for kw in (dict(window=(1, 0)), dict(layout=mha_ext.BlockLayout(np.ones((3, 3), bool), 1))):
        with pytest.raises(ValueError, match="window and layout"):
            ours(x, x, x, attn_mask=causal, is_causal=True, need_weights=False, **kw)
    # without them the hint is torch's
    with torch.no_grad():
        want = ref(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)[0]
        got = ours(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)[0]
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


# -- a hook on a layer's submodule keeps torch's encoder layer off its fused
#    path: a row that sees no key stays finite, as torch's (_torch_mha.py)

@pytest.mark.parametrize("hook", ["forward", "forward_pre"])
def test_encoder_layer_with_a_hook_keeps_a_dead_rows_finite_output_as_torch(hook):
    torch = require_torch()
    import copy
    from mha_ext.torch import MultiheadAttention
    torch.manual_seed(0)
    ref = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).eval()
    ours = copy.deepcopy(ref)
    ours.self_attn = MultiheadAttention.from_torch(ref.self_attn)
    for layer in (ref, ours):
        getattr(layer.linear1, f"register_{hook}_hook")(lambda *a: None)
    want, got = dead_row_outputs(ref, ours, torch.randn(2, 4, 8))
    assert not want.isnan().any()
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)



# -- mha_ext.torch.MultiHeadAttention's dtype as a NumPy spelling, and a
#    half-precision module (torch.py; docs §8: float32 and float64)

@pytest.mark.parametrize("dtype", ["float64", np.float64])
def test_torch_module_takes_a_numpy_dtype_as_the_torch_dtype(dtype):
    torch = require_torch()
    from mha_ext.torch import MultiHeadAttention
    a = MultiHeadAttention(8, 2, dtype=dtype, seed=3)
    b = MultiHeadAttention(8, 2, dtype=torch.float64, seed=3)
    assert all(p.dtype == torch.float64 for p in a.parameters())
    for (ka, pa), (kb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(pa, pb)
    x = torch.from_numpy(_rand(2, 3, 8))
    torch.testing.assert_close(a(x)[0], b(x)[0], rtol=1e-10, atol=1e-10)


def test_torch_module_cast_to_half_is_a_typeerror_naming_the_dtypes():
    torch = require_torch()
    from mha_ext.torch import MultiHeadAttention
    m = MultiHeadAttention(8, 2, seed=0).half()
    with pytest.raises(TypeError, match="float32 or float64, got torch.float16"):
        m(torch.ones(1, 2, 8, dtype=torch.float16))
