"""The backward with dropout (the forward's mask replayed: finite
differences, torch autograd on the same mask), the torch adapter
(gradcheck, the NumPy API's numbers, training) and the training example;
tests/test_backward.py's helpers and tolerances.

Legend: B batch, Sq/Sk query/key length, E = d_model, H = n_heads.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

from test_backward import (KEYS, PKG_PARENT, ROOT, assert_grads, inputs, make, need_torch,
                           torch_reference)


# ---------------------------------------------------------------- dropout

def test_dropout_replayed_mask_matches_finite_differences():
    """With dropout in training, backward replays the forward's mask: its
    gradients equal central differences of the loss computed with the same
    (seed, counter), for inputs and parameters."""
    E, H = 12, 3
    ours = make(E, H, "float64", dropout=0.4, seed=5)  # training mode
    rng = np.random.default_rng(5)
    q, k, v = inputs(rng, 2, 6, 7, E, "float64")
    mask = rng.random((2, 1, 6, 7)) < 0.2
    g_out = rng.standard_normal((2, 6, E))
    ctx = ours.forward_train(q, k, v, mask=mask)
    assert ctx.dropout == 0.4
    dropped = (ctx.weights == 0) & ~np.broadcast_to(mask, ctx.weights.shape)
    assert dropped.any() and (ctx.weights > 0).any()
    grads = ours.backward(ctx, g_out)
    params = ours.state_dict()

    def loss(q_=q, k_=k, v_=v, p_=params):
        c = ours.forward_train(q_, k_, v_, mask=mask, params=p_,
                               dropout_counter=ctx.counter)
        return float((c.output * g_out).sum())

    h = 1e-6
    checked = 0
    for name, arr in (("query", q), ("key", k), ("value", v)):
        for idx in [tuple(rng.integers(0, s) for s in arr.shape) for _ in range(4)]:
            plus, minus = arr.copy(), arr.copy()
            plus[idx] += h
            minus[idx] -= h
            kw = {name[0] + "_": plus}
            fd = (loss(**kw) - loss(**{name[0] + "_": minus})) / (2 * h)
            assert abs(fd - grads[name][idx]) <= 1e-6 * max(1.0, abs(fd)), (name, idx)
            checked += 1
    for name in KEYS:
        arr = params[name]
        for idx in [tuple(rng.integers(0, s) for s in arr.shape) for _ in range(3)]:
            plus = {kk: vv.copy() for kk, vv in params.items()}
            minus = {kk: vv.copy() for kk, vv in params.items()}
            plus[name][idx] += h
            minus[name][idx] -= h
            fd = (loss(p_=plus) - loss(p_=minus)) / (2 * h)
            assert abs(fd - grads[name][idx]) <= 1e-6 * max(1.0, abs(fd)), (name, idx)
            checked += 1
    assert checked == 12 + 24
    # a new training call draws a new mask
    assert ours.forward_train(q, k, v, mask=mask).counter != ctx.counter


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_dropout_grads_match_torch_with_the_same_mask(dtype):
    torch = need_torch()
    p = 0.3
    ours = make(16, 4, dtype, dropout=p, seed=6)
    rng = np.random.default_rng(6)
    q, k, v = inputs(rng, 2, 11, 13, 16, dtype)
    g_out = rng.standard_normal(q.shape).astype(dtype)
    g_w = rng.standard_normal((2, 4, 11, 13)).astype(dtype)
    ctx = ours.forward_train(q, k, v)
    keep = (ctx.weights != 0).astype(dtype)  # every softmax entry is > 0 here
    grads = ours.backward(ctx, g_out, g_w)
    _, want = torch_reference(torch, ours.state_dict(), 4, q, k, v, keep=keep, p=p,
                              grad_out=g_out, grad_weights=g_w)
    assert_grads(grads, want, dtype, "dropout")


def test_dropout_one_drops_every_gradient_through_attention():
    ours = make(8, 2, "float64", dropout=1.0)
    rng = np.random.default_rng(7)
    q, k, v = inputs(rng, 1, 4, 5, 8, "float64")
    ctx = ours.forward_train(q, k, v)
    assert not ctx.weights.any()
    g = ours.backward(ctx, np.ones_like(ctx.output))
    for name in ("query", "key", "value", "W_q.weight", "W_k.weight", "W_v.weight",
                 "W_o.weight"):
        assert not g[name].any(), name
    np.testing.assert_array_equal(g["W_o.bias"], np.full(8, 4.0))


def test_eval_mode_and_explicit_dropout():
    ours = make(8, 2, "float64", dropout=0.5).eval()
    x = np.random.default_rng(8).standard_normal((1, 3, 8))
    assert ours.forward_train(x).dropout == 0.0
    ctx = ours.forward_train(x, dropout=0.25)
    assert ctx.dropout == 0.25
    with pytest.raises(ValueError):
        ours.forward_train(x, dropout=1.5)


# ---------------------------------------------------------------- torch adapter

def test_adapter_gradcheck_float64():
    torch = need_torch()
    from torch.func import functional_call
    import mha_ext.torch as mt

    m = mt.MultiHeadAttention(8, 2, kdim=6, vdim=5, dtype=torch.float64, seed=0)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(2, 4, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(2, 4, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    names = [n for n, _ in m.named_parameters()]
    params = [p.detach().clone().requires_grad_(True) for _, p in m.named_parameters()]
    mask = torch.tensor([[0, 0, 1, 1], [0, 0, 0, 1], [0, 0, 0, 0]])

    def f(q, k, v, *ps):
        return functional_call(m, dict(zip(names, ps)), (q, k, v), dict(mask=mask))

    assert torch.autograd.gradcheck(f, (q, k, v, *params))


def test_adapter_matches_numpy_api_and_trains():
    torch = need_torch()
    import mha_ext.torch as mt

    m = mt.MultiHeadAttention(16, 4, seed=3)
    core = make(16, 4, "float32", seed=3).eval()
    for k, v in m.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), core.state_dict()[k])
    x = torch.randn(2, 5, 16, requires_grad=True)
    out, w = m(x)
    ctx = core.forward_train(x.detach().numpy())
    np.testing.assert_array_equal(out.detach().numpy(), ctx.output)
    out.sum().backward()
    g = core.backward(ctx, np.ones_like(ctx.output))
    np.testing.assert_allclose(x.grad.numpy(), g["query"] + g["key"] + g["value"],
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(m.W_o.weight.grad.numpy(), g["W_o.weight"])
    # torch's optimiser updates the parameters our next call uses
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    opt.step()
    out2, _ = m(x)
    assert not torch.equal(out, out2)
    assert m(x, need_weights=False)[1] is None
    m.double()
    out3, _ = m(x.double())
    assert out3.dtype == torch.float64


def test_train_copy_example_loss_falls():
    need_torch()
    if not (ROOT / "examples" / "train_copy.py").is_file():
        pytest.skip("examples/ is not next to the tests (installed without sources)")
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "train_copy.py"),
                          "--steps", "60"], capture_output=True, text=True, timeout=300,
                         cwd=str(ROOT), env={**os.environ, "PYTHONPATH": PKG_PARENT})
    assert run.returncode == 0, run.stdout + run.stderr
    first = last = None
    for line in run.stdout.splitlines():
        if line.startswith("first loss"):
            first = float(line.split()[-1])
        if line.startswith("last loss"):
            last = float(line.split()[-1])
    assert first is not None and last is not None, run.stdout
    assert last < 0.8 * first, run.stdout
