"""mha_ext.autograd (forward_train / backward) and mha_ext._sdpa_api (the
SDPA twin's public face): the rules mutation testing of those files found
no test holding (a mutant of each passed their tests before).  An unknown
keyword of forward_train a TypeError; a float mask edited in place after
forward_train not read by a backward that recomputes; forward_train without
dropout drawing nothing from the module's stream; a tensor on the meta
device next to tensors holding data refused by the SDPA twin (ValueError
and torch's RuntimeError); a tensor query with an array key a TypeError;
enable_gqa with one key head refused with torch's type too (docs/API.md
§3.2, §4a, §8).  Besides, the backward's own checks (context, seed, shapes,
flags), its gradients with scale= and masked_rows="zero", an unbatched
call's scores gradient, dL/d head_mask against the loss's change per unit
of mask, arrays' seed= and dropout_p range, and torch's CausalBias.

Expected values from torch (nn.MultiheadAttention, F.scaled_dot_product_
attention and autograd) or from the docs' stated rule.

Legend: B batch, H heads, L/Sq query length, S/Sk key length, E width.
"""
import math

import numpy as np
import pytest

import mha_ext
from _support import require_torch

torch = require_torch()
from torch import nn  # noqa: E402

F = torch.nn.functional
f = mha_ext.scaled_dot_product_attention
B, Sq, Sk, E, H = 2, 4, 5, 8, 2


def _x(*shape, dtype=np.float64, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _mha(dtype="float64", **kw):
    return mha_ext.MultiHeadAttention(E, H, dtype=dtype, seed=7, **kw)


def _torch_mha(mha, dtype=torch.float64):
    """torch's nn.MultiheadAttention holding mha's parameters (batch first)."""
    sd = mha.state_dict()
    t = nn.MultiheadAttention(E, H, batch_first=True, dtype=dtype)
    with torch.no_grad():
        t.in_proj_weight.copy_(torch.from_numpy(np.concatenate(
            [sd["W_q.weight"], sd["W_k.weight"], sd["W_v.weight"]])))
        t.in_proj_bias.copy_(torch.from_numpy(np.concatenate(
            [sd["W_q.bias"], sd["W_k.bias"], sd["W_v.bias"]])))
        t.out_proj.weight.copy_(torch.from_numpy(sd["W_o.weight"]))
        t.out_proj.bias.copy_(torch.from_numpy(sd["W_o.bias"]))
    return t


def _torch_grads(mha, q, k, v, g, gw=None, **kw):
    """out, weights (per head) and the gradients of <out, g> (+ <w, gw>) w.r.t.
    query, key, value by torch autograd on nn.MultiheadAttention."""
    t = _torch_mha(mha)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    out, w = t(tq, tk, tv, need_weights=True, average_attn_weights=False, **kw)
    loss = (out * torch.from_numpy(g)).sum()
    if gw is not None:
        loss = loss + (w * torch.from_numpy(gw)).sum()
    loss.backward()
    return out.detach().numpy(), w.detach().numpy(), tq.grad.numpy(), tk.grad.numpy(), \
        tv.grad.numpy()


# ---------------------------------------------------------------- forward_train's keywords (§8)

def test_forward_train_refuses_an_unknown_keyword():
    # forward_train's docstring: "another keyword is a TypeError" (as Python's own
    # call of a function without **kwargs)
    mha = _mha()
    with pytest.raises(TypeError, match="bogus"):
        mha.forward_train(_x(B, Sq, E), bogus=1)
    with pytest.raises(TypeError, match="bogus"):
        mha_ext.autograd.forward_train(mha, _x(B, Sq, E), bogus=None)


# ---------------------------------------------------------------- the SDPA twin on meta (§4a)

@pytest.mark.parametrize("on_meta", ["query", "key", "attn_mask"])
def test_a_meta_tensor_among_tensors_holding_data_is_refused(on_meta):
    # API.md §4a: meta tensors go to torch's function; one there without the
    # others is our ValueError that is also torch's RuntimeError (devices differ)
    args = dict(query=torch.randn(B, H, Sq, E), key=torch.randn(B, H, Sk, E),
                attn_mask=torch.zeros(Sq, Sk))
    args[on_meta] = args[on_meta].to("meta")
    with pytest.raises(ValueError, match="meta device") as info:
        f(args["query"], args["key"], args["key"], attn_mask=args["attn_mask"])
    assert isinstance(info.value, RuntimeError)


# ---------------------------------------------------------------- backward reads the forward's masks (§8)

@pytest.mark.parametrize("save", [True, False])
def test_a_mask_changed_after_forward_train_leaves_the_backward_alone(save):
    # §8: backward gives "the gradients of exactly the call that made ctx (its
    # parameters, masks, ...)": a float mask edited in place in between is not
    # read (save_projections=False: the backward recomputes the softmax)
    mha = _mha()
    q, k, g = _x(B, Sq, E), _x(B, Sk, E, seed=1), _x(B, Sq, E, seed=2)
    mask = _x(Sq, Sk, seed=3)
    original = mask.copy()
    ctx = mha.forward_train(q, k, k, attn_mask=mask, save_projections=save)
    mask[...] = 0.0
    mask[:, 0] = -np.inf
    grads = mha.backward(ctx, g)
    _, _, gq, gk, _ = _torch_grads(mha, q, k, k, g, attn_mask=torch.from_numpy(original))
    np.testing.assert_allclose(grads["query"], gq, rtol=0, atol=1e-10)
    np.testing.assert_allclose(grads["key"], gk, rtol=0, atol=1e-10)


# ---------------------------------------------------------------- the context's module (§8)

def test_a_context_is_refused_by_a_module_of_another_seed():
    # the ValueError names it: "another configuration, dtype or seed" (the seed
    # makes the dropout stream the backward replays)
    a, b = _mha(), mha_ext.MultiHeadAttention(E, H, dtype="float64", seed=8)
    b.load_state_dict(a.state_dict())
    ctx = a.forward_train(_x(B, Sq, E), dropout=0.5)
    with pytest.raises(ValueError, match="different module"):
        b.backward(ctx, _x(B, Sq, E))


def test_backward_refuses_what_is_not_a_forward_context():
    mha = _mha()
    ctx = mha.forward_train(_x(B, Sq, E))
    with pytest.raises(TypeError, match="ForwardContext"):
        mha.backward({"output": ctx.output}, _x(B, Sq, E))


def test_backward_checks_the_gradients_it_is_given():
    mha = _mha()
    ctx = mha.forward_train(_x(B, Sq, E))
    with pytest.raises(ValueError, match="grad_output must have the output's shape"):
        mha.backward(ctx, _x(B, Sq + 1, E))
    with pytest.raises(ValueError, match="grad_weights must have the weights' shape"):
        mha.backward(ctx, _x(B, Sq, E), _x(B, H, Sq, Sq + 1))
    ctx = mha.forward_train(_x(B, Sq, E), need_weights=False)
    with pytest.raises(ValueError, match="need_weights=False"):
        mha.backward(ctx, _x(B, Sq, E), _x(B, H, Sq, Sq))


@pytest.mark.parametrize("name", ["scores_grad", "head_mask_grad"])
def test_backward_flags_refuse_a_string(name):
    # API.md §9 / _convert.flag: a flag is one truth value; a string is a TypeError
    mha = _mha()
    ctx = mha.forward_train(_x(B, Sq, E), head_mask=np.ones(H))
    with pytest.raises(TypeError, match=name):
        mha.backward(ctx, _x(B, Sq, E), **{name: "no"})


def test_head_mask_grad_without_a_head_mask_is_refused():
    mha = _mha()
    ctx = mha.forward_train(_x(B, Sq, E))
    with pytest.raises(ValueError, match="had no head_mask"):
        mha.backward(ctx, _x(B, Sq, E), head_mask_grad=True)


# ---------------------------------------------------------------- gradients against torch (§8)

def _torch_sdpa_grads(mha, q, k, v, g, **kw):
    """the module's attention by torch autograd through F.scaled_dot_product_
    attention (for its scale=): gradients of <out, g> w.r.t. query, key, value."""
    sd = {n: torch.from_numpy(a) for n, a in mha.state_dict().items()}
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))

    def heads(x, n):
        y = F.linear(x, sd[f"{n}.weight"], sd[f"{n}.bias"])
        return y.view(y.shape[0], y.shape[1], H, E // H).transpose(1, 2)

    a = F.scaled_dot_product_attention(heads(tq, "W_q"), heads(tk, "W_k"), heads(tv, "W_v"), **kw)
    out = F.linear(a.transpose(1, 2).reshape(q.shape), sd["W_o.weight"], sd["W_o.bias"])
    (out * torch.from_numpy(g)).sum().backward()
    return out.detach().numpy(), tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy()


@pytest.mark.parametrize("save", [True, False])
def test_the_gradients_of_a_call_with_scale_are_torchs(save):
    mha = _mha()
    q, k, v, g = _x(B, Sq, E), _x(B, Sk, E, seed=1), _x(B, Sk, E, seed=5), _x(B, Sq, E, seed=2)
    ctx = mha.forward_train(q, k, v, scale=0.3, save_projections=save)
    grads = mha.backward(ctx, g)
    out, gq, gk, gv = _torch_sdpa_grads(mha, q, k, v, g, scale=0.3)
    np.testing.assert_allclose(ctx.output, out, rtol=0, atol=1e-10)
    for name, want in zip(("query", "key", "value"), (gq, gk, gv)):
        np.testing.assert_allclose(grads[name], want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("save", [True, False])
def test_masked_rows_zero_gives_zero_gradients_for_a_row_that_sees_no_key(save):
    # backward's docstring / §3.1: rows whose every key is blocked give zero
    # gradients with masked_rows="zero" (their output is W_o's bias)
    mha = _mha()
    q, k, g = _x(B, Sq, E), _x(B, Sk, E, seed=1), _x(B, Sq, E, seed=2)
    blocked = np.zeros((Sq, Sk), bool)
    blocked[1] = True
    ctx = mha.forward_train(q, k, k, attn_mask=blocked, masked_rows="zero",
                            save_projections=save)
    grads = mha.backward(ctx, g)
    assert np.all(grads["query"][:, 1] == 0)
    assert np.all(np.isfinite(grads["key"])) and np.all(np.isfinite(grads["W_q.weight"]))
    # the other rows as torch's with that row unblocked and its gradient dropped
    g0 = g.copy()
    g0[:, 1] = 0
    unblocked = blocked.copy()
    unblocked[1] = False
    _, _, gq, gk, _ = _torch_grads(mha, q, k, k, g0, attn_mask=torch.from_numpy(unblocked))
    gq[:, 1] = 0
    np.testing.assert_allclose(grads["query"], gq, rtol=0, atol=1e-10)


def test_scores_grad_of_an_unbatched_call_is_h_by_sq_by_sk():
    # §8: 'scores' is (B, H, Sq, Sk'), unbatched (H, Sq, Sk'); with no mask the
    # softmax's gradient sums to 0 along each row
    mha = _mha()
    ctx = mha.forward_train(_x(Sq, E), _x(Sk, E, seed=1))
    grads = mha.backward(ctx, _x(Sq, E, seed=2), scores_grad=True)
    assert grads["scores"].shape == (H, Sq, Sk)
    assert grads["query"].shape == (Sq, E)
    np.testing.assert_allclose(grads["scores"].sum(-1), 0, atol=1e-12)


# ---------------------------------------------------------------- dL/d head_mask (§3.2, §8)

def _loss(ctx, g, gw):
    return float(np.sum(ctx.output * g) + (0 if gw is None else np.sum(ctx.weights * gw)))


@pytest.mark.parametrize("extra", ["plain", "weights", "dropout", "scale", "window", "BH"])
def test_head_mask_gradient_is_the_change_of_the_loss_per_unit_of_mask(extra):
    # the output (ctx = concat_h m_h·A_h V_h, then W_o) and the weights (m·A) are
    # affine in the head mask: dL/dm[h] = L(m + e_h) - L(m) exactly (mathematics),
    # the second forward replaying the first's dropout stream (dropout_counter)
    mha = _mha()
    q, k, g = _x(B, Sq, E), _x(B, Sk, E, seed=1), _x(B, Sq, E, seed=2)
    gw = _x(B, H, Sq, Sk, seed=4) if extra == "weights" else None
    kw = dict(dropout=0.4) if extra == "dropout" else dict(dropout=0.0)
    kw.update(dict(scale=0.3) if extra == "scale" else {})
    kw.update(dict(window=(1, 0)) if extra == "window" else {})
    m = np.array([0.7, -1.3]) if extra != "BH" else np.array([[0.7, -1.3], [2.0, 0.5]])
    ctx = mha.forward_train(q, k, k, head_mask=m, **kw)
    got = mha.backward(ctx, g, gw, head_mask_grad=True)["head_mask"]
    assert got.shape == m.shape
    want = np.zeros(m.shape)
    base = _loss(ctx, g, gw)
    for idx in np.ndindex(m.shape):
        m1 = m.copy()
        m1[idx] += 1.0
        c1 = mha.forward_train(q, k, k, head_mask=m1, dropout_counter=ctx.counter, **kw)
        want[idx] = _loss(c1, g, gw) - base
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-10)


# ---------------------------------------------------------------- forward_train's dropout stream (§3.2, §8)

def test_forward_train_without_dropout_draws_nothing_from_the_stream():
    # dropout acts only where training and dropout > 0 (§3.2); a call without
    # it has no stream (ctx.counter 0) and leaves the module's stream where it
    # was: the next dropout call of a twin module (same seed) that made no such
    # call in between reserves the same place and drops the same weights
    x = _x(B, Sq, E)
    a, b = _mha(dropout=0.5), _mha(dropout=0.5)
    ctx0 = a.forward_train(x, dropout=0.0)
    assert ctx0.dropout == 0.0 and ctx0.counter == 0
    ca, cb = a.forward_train(x), b.forward_train(x)
    assert ca.dropout == cb.dropout == 0.5
    assert ca.counter == cb.counter
    np.testing.assert_array_equal(ca.weights, cb.weights)


# ---------------------------------------------------------------- the SDPA twin's arguments (§4a)

def test_a_tensor_query_with_an_array_key_is_refused():
    # tensors in -> a tensor out, arrays in -> an array out: a mix is a TypeError,
    # not an array result computed from the tensor's data
    q = torch.randn(B, H, Sq, E, dtype=torch.float64)
    k = _x(B, H, Sk, E)
    with pytest.raises(TypeError, match="key must be a tensor"):
        f(q, k, k)
    with pytest.raises(TypeError, match="must be a tensor"):
        f(q, torch.from_numpy(k), k)


@pytest.mark.parametrize("Hk", [1, 2])
def test_enable_gqa_refusal_torch_shares_has_its_type_too(Hk):
    # API.md §4a: arguments torch refuses too are refused with torch's exception
    # type as well as ours; also with a single key/value head
    q, k = torch.randn(B, 4, Sq, E), torch.randn(B, Hk, Sk, E - 1)
    with pytest.raises(ValueError) as info:
        f(q, k, k, enable_gqa=True)
    assert isinstance(info.value, RuntimeError)
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, k, k, enable_gqa=True)


def test_arrays_with_a_seed_repeat_their_dropout():
    # seed= (a keyword of ours) fixes the stream with arrays too; another seed
    # drops other weights
    q, k, v = _x(B, H, Sq, E), _x(B, H, Sk, E, seed=1), _x(B, H, Sk, E, seed=2)
    a = f(q, k, v, dropout_p=0.5, seed=3)
    np.testing.assert_array_equal(a, f(q, k, v, dropout_p=0.5, seed=3))
    assert not np.array_equal(a, f(q, k, v, dropout_p=0.5, seed=4))


@pytest.mark.parametrize("p", [1.5, -0.1, float("nan")])
def test_arrays_refuse_a_dropout_p_outside_0_1(p):
    q = _x(B, H, Sq, E)
    with pytest.raises(ValueError, match="dropout_p"):
        f(q, q, q, dropout_p=p)


# ---------------------------------------------------------------- torch's CausalBias (§4a)

def _bias(kind, L, S):
    from torch.nn.attention import bias
    return getattr(bias, f"causal_{kind}")(L, S)


@pytest.mark.parametrize("kind", ["upper_left", "lower_right"])
@pytest.mark.parametrize("causal", [True, "lower_right"])
def test_a_causal_bias_with_is_causal_is_torchs_value_error(kind, causal):
    q, k = torch.randn(1, H, Sq, E), torch.randn(1, H, Sk, E)
    with pytest.raises(ValueError, match="CausalBias should not be used with causal=True"):
        f(q, k, k, attn_mask=_bias(kind, Sq, Sk), is_causal=causal)


@pytest.mark.filterwarnings("ignore:Lower right causal bias")
@pytest.mark.parametrize("kind", ["upper_left", "lower_right"])
def test_a_causal_bias_is_its_pattern_as_torchs(kind):
    q, k, v = (torch.randn(1, H, n, E, dtype=torch.float64) for n in (Sq, Sk, Sk))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=_bias(kind, Sq, Sk))
    got = f(q, k, v, attn_mask=_bias(kind, Sq, Sk))
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=0, atol=1e-10)
    # its lengths the other way round are another call's: refused
    with pytest.raises(ValueError, match="CausalBias for 5 queries and 4 keys"):
        f(q, k, v, attn_mask=_bias(kind, Sk, Sq))


# ---------------------------------------------------------------- refusals that are ours alone (§4a, §7)

def test_a_nested_tensor_is_our_type_error_alone():
    # API.md §4a: "another dtype is a TypeError, and so is a nested tensor
    # (either layout)": our refusal (torch has a nested call of its own), not
    # merged with torch's complaint about this tensor
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nt = torch.nested.nested_tensor([torch.randn(3, H, E), torch.randn(4, H, E)])
    nt = nt.transpose(1, 2)
    with pytest.raises(TypeError, match="nested tensor") as info:
        f(nt, nt, nt)
    assert not isinstance(info.value, RuntimeError)
    assert "(torch:" not in str(info.value)


def test_enable_gqa_with_no_key_head_is_a_value_error_not_a_crash():
    # §7 "errors, never crashes": torch's own function dies of SIGFPE on a key
    # or value head count of 0 with enable_gqa, so it must not be asked; run
    # in a child process, whose death would be the failure
    import os
    import subprocess
    import sys
    from _support import PKG_ROOT
    code = (
        "import torch, mha_ext\n"
        "for hk, hv in [(0, 0), (0, 2), (2, 0)]:\n"
        "    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, hk, 5, 8), torch.randn(1, hv, 5, 8)\n"
        "    try:\n"
        "        mha_ext.scaled_dot_product_attention(q, k, v, enable_gqa=True)\n"
        "    except ValueError as e:\n"
        "        print('ValueError', 'multiple of' in str(e), flush=True)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": PKG_ROOT})
    assert r.returncode == 0, r.stderr[-500:]
    assert r.stdout.split("\n")[:3] == ["ValueError True"] * 3
