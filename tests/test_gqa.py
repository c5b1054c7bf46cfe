"""Grouped-query and multi-query attention in the module (issue 15):
``MultiHeadAttention(..., n_kv_heads=Hkv)``, against torch's
``F.scaled_dot_product_attention(..., enable_gqa=True)`` with torch
projections and against Hugging Face's LlamaAttention (random init from a
config), forward and gradients, float32 and float64; the parameter shapes,
state dicts, from_torch, trace and the errors.

Hugging Face's LlamaAttention always applies rotary embeddings, which our
module does not: it takes them as an argument (position_embeddings=(cos,
sin)), so passing cos = 1, sin = 0 (the identity rotation) leaves exactly
the projections + grouped attention part, which is what we compare.  Its
"sdpa" implementation keeps the softmax in the input dtype (the "eager" one
upcasts it to float32, which would spoil a float64 comparison).

Tolerances (conftest.TOL): float32 2e-5, float64 1e-10, relative and
absolute: the sums of a few hundred products in each dtype.

Legend: B batch, S length, E = d_model, H = n_heads, Hkv = n_kv_heads,
Dk = E / H.
"""
import numpy as np
import pytest

from _support import require_torch
from conftest import TOL
from mha_ext import MultiHeadAttention

torch = require_torch()
F = torch.nn.functional
TDT = {"float32": torch.float32, "float64": torch.float64}


def _module(E, H, Hkv, dtype, **kw):
    return MultiHeadAttention(E, H, n_kv_heads=Hkv, dtype=dtype, seed=7, **kw).eval()


def _torch_gqa(sd, x, H, Hkv, dtype, is_causal=False, pad=None):
    """torch's forward of the same parameters: projections, SDPA with
    enable_gqa, output projection; returns (output, {name: leaf tensor})."""
    leaves = {k: torch.tensor(v, dtype=TDT[dtype], requires_grad=True) for k, v in sd.items()}
    xt = torch.tensor(x, dtype=TDT[dtype], requires_grad=True)
    leaves["query"] = xt
    B, S, E = x.shape
    Dk = E // H

    def lin(name, n_heads):
        y = xt @ leaves[f"{name}.weight"].T + leaves[f"{name}.bias"]
        return y.view(B, S, n_heads, Dk).transpose(1, 2)

    mask = None
    if pad is not None:  # key padding: True = blocked -> False in torch's bool mask
        mask = ~torch.tensor(pad)[:, None, None, :]
        if is_causal:
            mask = mask & torch.ones(S, S, dtype=torch.bool).tril()
    c = F.scaled_dot_product_attention(lin("W_q", H), lin("W_k", Hkv), lin("W_v", Hkv),
                                       attn_mask=mask, is_causal=is_causal and pad is None,
                                       enable_gqa=True)
    out = c.transpose(1, 2).reshape(B, S, E) @ leaves["W_o.weight"].T + leaves["W_o.bias"]
    return out, leaves


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("E,H,Hkv", [(64, 8, 2), (64, 8, 1), (96, 6, 3), (64, 4, 4)])
@pytest.mark.parametrize("case", ["plain", "causal", "padded causal"])
def test_gqa_matches_torch_sdpa_forward_and_gradients(dtype, E, H, Hkv, case, parity_record):
    m = _module(E, H, Hkv, dtype)
    B, S = 2, 9
    x = np.random.default_rng(1).standard_normal((B, S, E)).astype(dtype)
    causal = case != "plain"
    pad = None
    if case == "padded causal":
        pad = np.zeros((B, S), bool)
        pad[0, :2] = True  # a left-padded prompt; rows 0, 1 of batch 0 see nothing
    kw = dict(is_causal=causal, key_padding_mask=pad, masked_rows="zero")
    out, _ = m(x, need_weights=False, **kw)
    ref, leaves = _torch_gqa(m.state_dict(), x, H, Hkv, dtype, causal, pad)
    want = ref.detach().numpy()
    if pad is not None:  # torch gives NaN rows where we give 0-context rows (masked_rows)
        want = np.where(np.isnan(want), out, want)
    np.testing.assert_allclose(out, want, **TOL[dtype])
    parity_record(dtype, f"GQA E={E} H={H} Hkv={Hkv} {case} output", out, want)

    g = np.random.default_rng(2).standard_normal(out.shape).astype(dtype)
    if pad is not None:
        g[0, :2] = 0  # the rows torch makes NaN: no gradient from them
    torch.nan_to_num(ref).backward(torch.tensor(g))
    ctx = m.forward_train(x, need_weights=False, **kw)
    grads = m.backward(ctx, g)
    assert grads["W_k.weight"].shape == (Hkv * (E // H), E)
    # self-attention: x's gradient is the sum of its three roles'
    grads["query"] = grads["query"] + grads["key"] + grads["value"]
    for name, leaf in leaves.items():
        np.testing.assert_allclose(grads[name], leaf.grad.numpy(), **TOL[dtype],
                                   err_msg=name)
        parity_record(dtype, f"GQA E={E} H={H} Hkv={Hkv} {case} d{name}", grads[name],
                      leaf.grad.numpy())


def _llama(E, H, Hkv, dtype, bias):
    tr = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaAttention
    torch.manual_seed(0)
    cfg = tr.LlamaConfig(hidden_size=E, num_attention_heads=H, num_key_value_heads=Hkv,
                         attention_bias=bias, attn_implementation="sdpa")
    return LlamaAttention(cfg, layer_idx=0).to(TDT[dtype]).eval()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("Hkv,bias", [(2, False), (1, True), (8, False)])
def test_gqa_matches_hugging_face_llama_attention(dtype, Hkv, bias, parity_record):
    E, H, B, S = 64, 8, 2, 7
    att = _llama(E, H, Hkv, dtype, bias)
    m = MultiHeadAttention.from_torch(att)  # q_proj, k_proj, v_proj, o_proj
    assert (m.n_heads, m.n_kv_heads, m.bias, m.dtype) == (H, Hkv, bias, np.dtype(dtype))
    x = np.random.default_rng(3).standard_normal((B, S, E)).astype(dtype)
    xt = torch.tensor(x, requires_grad=True)
    ones = torch.ones(B, S, E // H, dtype=TDT[dtype])  # the identity rotation
    causal = torch.full((S, S), -torch.inf, dtype=TDT[dtype]).triu(1)[None, None]
    ref, _ = att(xt, position_embeddings=(ones, 0 * ones), attention_mask=causal)
    out, _ = m(x, is_causal=True, need_weights=False)
    np.testing.assert_allclose(out, ref.detach().numpy(), **TOL[dtype])
    parity_record(dtype, f"HF Llama GQA Hkv={Hkv} output", out, ref.detach().numpy())
    g = np.random.default_rng(4).standard_normal(out.shape).astype(dtype)
    ref.backward(torch.tensor(g))
    grads = m.backward(m.forward_train(x, is_causal=True, need_weights=False), g)
    grads["query"] = grads["query"] + grads["key"] + grads["value"]
    pairs = {"query": xt, "W_q.weight": att.q_proj.weight, "W_k.weight": att.k_proj.weight,
             "W_v.weight": att.v_proj.weight, "W_o.weight": att.o_proj.weight}
    for name, t in pairs.items():
        np.testing.assert_allclose(grads[name], t.grad.numpy(), **TOL[dtype], err_msg=name)
        parity_record(dtype, f"HF Llama GQA Hkv={Hkv} d{name}", grads[name], t.grad.numpy())


def test_gqa_reference_core_agrees():
    # the plain C reference (the tests' oracle for the fast core) with Hkv < H
    m = _module(48, 6, 2, "float64")
    x = np.random.default_rng(5).standard_normal((2, 5, 48))
    fast, fw = m._forward(x, x, x, is_causal=True)
    ref, rw = m._forward(x, x, x, is_causal=True, reference=True)
    np.testing.assert_allclose(fast, ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(fw, rw, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- the module's surface

def test_parameter_shapes_state_dict_and_repr():
    m = _module(64, 8, 2, "float32", kdim=40, vdim=24, add_bias_kv=True)
    assert m.n_kv_heads == 2
    shapes = {k: v.shape for k, v in m.state_dict().items()}
    assert shapes == {"W_q.weight": (64, 64), "W_q.bias": (64,), "W_k.weight": (16, 40),
                      "W_k.bias": (16,), "W_v.weight": (16, 24), "W_v.bias": (16,),
                      "W_o.weight": (64, 64), "W_o.bias": (64,), "bias_k": (16,),
                      "bias_v": (16,)}
    assert m.num_parameters == sum(int(np.prod(s)) for s in shapes.values())
    assert "n_kv_heads=2" in repr(m)
    m2 = _module(64, 8, 2, "float32", kdim=40, vdim=24, add_bias_kv=True)
    m2.load_state_dict(m.state_dict())
    x = np.ones((1, 3, 64), np.float32)
    k, v = np.ones((1, 3, 40), np.float32), np.ones((1, 3, 24), np.float32)
    assert np.array_equal(m(x, k, v)[0], m2(x, k, v)[0])
    with pytest.raises(ValueError, match=r"W_k.weight'\] must have shape \(16, 40\)"):
        m2.load_state_dict({**m.state_dict(), "W_k.weight": np.zeros((64, 40))})


def test_torch_keys_are_refused_for_a_grouped_module():
    m = _module(64, 8, 2, "float32")
    with pytest.raises(ValueError, match="no grouped-query attention"):
        m.load_state_dict({"in_proj_weight": np.zeros((192, 64)),
                           "in_proj_bias": np.zeros(192),
                           "out_proj.weight": np.zeros((64, 64)), "out_proj.bias": np.zeros(64)})


@pytest.mark.parametrize("bad,err", [(3, ValueError), (0, ValueError), (-2, ValueError),
                                     (16, ValueError), (2.0, TypeError), (True, TypeError)])
def test_bad_n_kv_heads(bad, err):
    with pytest.raises(err, match="n_kv_heads") as info:
        MultiHeadAttention(64, 8, n_kv_heads=bad)
    if err is ValueError:  # API.md §1: the message names both numbers
        assert f"({bad})" in str(info.value) or f"got {bad}" in str(info.value)
        assert "(8)" in str(info.value)


def test_from_torch_refuses_kv_widths_that_are_not_whole_heads():
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = torch.nn.Linear(64, 64)
            self.k_proj = torch.nn.Linear(64, 12)  # heads of 8: not a whole number
            self.v_proj = torch.nn.Linear(64, 12)
            self.o_proj = torch.nn.Linear(64, 64)
            self.num_heads = 8
    with pytest.raises(ValueError, match="n_kv_heads"):
        MultiHeadAttention.from_torch(Odd())


def test_trace_shows_the_groups():
    m = _module(32, 4, 2, "float64")
    x = np.random.default_rng(6).standard_normal((1, 3, 32))
    t = m.trace(x, is_causal=True)
    text = str(t)
    assert "[B, Hkv, Sk, Dk]" in text and "query head h reads K head h // 2" in text \
        and "query head h reads V head h // 2" in text
    np.testing.assert_allclose(t.info["numpy_output"], t.output, rtol=1e-12, atol=1e-12)


def test_the_torch_module_takes_n_kv_heads():
    # mha_ext.torch.MultiHeadAttention: nn.Linear W_k, W_v of Hkv * Dk features,
    # forward and autograd gradients against torch's SDPA with enable_gqa
    from mha_ext.torch import MultiHeadAttention as TorchMHA
    t = TorchMHA(64, 8, n_kv_heads=2, dtype=torch.float64, seed=3).eval()
    assert t.n_kv_heads == 2 and t.W_k.weight.shape == (16, 64) and "n_kv_heads=2" in repr(t)
    x = torch.randn(2, 5, 64, dtype=torch.float64, requires_grad=True)
    out, _ = t(x, is_causal=True, need_weights=False)
    sd = {k: v.detach().numpy() for k, v in t.state_dict().items()}
    ref, leaves = _torch_gqa(sd, x.detach().numpy(), 8, 2, "float64", is_causal=True)
    np.testing.assert_allclose(out.detach().numpy(), ref.detach().numpy(), **TOL["float64"])
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    np.testing.assert_allclose(x.grad.numpy(), leaves["query"].grad.numpy(), **TOL["float64"])
    np.testing.assert_allclose(t.W_k.weight.grad.numpy(), leaves["W_k.weight"].grad.numpy(),
                               **TOL["float64"])


@pytest.mark.parametrize("heads", [(6, 0, 3), (6, 0, 0), (6, 3, 0)])
def test_no_key_heads_under_enable_gqa_is_a_valueerror_not_a_crash(heads):
    # torch's own function dies of SIGFPE on (6, 0, 3); the twin's refusal
    # asked it for its exception type on meta tensors and died with it
    import subprocess
    import sys
    from _support import PKG_ROOT
    Hq, Hk, Hv = heads
    script = (
        "import torch, mha_ext\n"
        f"q, k, v = torch.randn(3, {Hq}, 5, 4), torch.randn(3, {Hk}, 2, 4), "
        f"torch.randn(3, {Hv}, 2, 4)\n"
        "try:\n"
        "    mha_ext.scaled_dot_product_attention(q, k, v, enable_gqa=True)\n"
        "except ValueError as e:\n"
        "    print('ValueError', e)\n")
    run = subprocess.run([sys.executable, "-c", script], cwd=PKG_ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    assert run.stdout.startswith("ValueError enable_gqa=True"), run.stdout


def test_a_grouped_query_module_survives_pickle_and_deepcopy():
    import copy
    import pickle
    m = MultiHeadAttention(16, 4, n_kv_heads=2, seed=0).eval()
    x = np.random.default_rng(0).standard_normal((1, 3, 16)).astype(np.float32)
    for c in (pickle.loads(pickle.dumps(m)), copy.deepcopy(m)):
        assert c.n_kv_heads == 2
        assert np.array_equal(c(x)[0], m(x)[0])
