"""How the torch classes hand their parameters to the C core: each tensor read
in place (no block joined per call), and no copy at all when autograd will
record nothing (no_grad, inference_mode, or nothing requires grad).

Before, every call joined the parameters into one block (np.concatenate) and
copied that block once more: at B1 S1 E768 a call took 3.8 ms against
torch's 0.16.  The tests measure NumPy's allocations (tracemalloc sees
them), not time.

Legend: B batch, S length, E = embed_dim, H = num_heads.
"""
import tracemalloc

import numpy as np
import pytest

from _support import require_torch

torch = require_torch()

import mha_ext  # noqa: E402
import mha_ext.torch as mt  # noqa: E402
from mha_ext import _params  # noqa: E402

E, H = 512, 8  # the parameters: 4·E² + 4·E float32 scalars, about 4 MiB


def _peak(fn):
    """NumPy's (and Python's) peak allocation in bytes while fn() runs."""
    fn()  # warm: first-call caches
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _param_bytes(m):
    return sum(p.numel() * p.element_size() for p in m.parameters())


@pytest.fixture
def pair():
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(E, H, batch_first=True).eval()
    ours = mt.MultiheadAttention(E, H, batch_first=True).eval()
    ours.load_state_dict(ref.state_dict())
    return ref, ours


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_no_grad_call_copies_no_parameters(pair, mode):
    ref, ours = pair
    x = torch.randn(1, 1, E)
    ctx = torch.no_grad if mode == "no_grad" else torch.inference_mode
    with ctx():
        peak = _peak(lambda: ours(x, x, x, need_weights=False))
        out = ours(x, x, x, need_weights=False)[0]
        want = ref(x, x, x, need_weights=False)[0]
    assert peak < _param_bytes(ours) / 8, (peak, _param_bytes(ours))
    torch.testing.assert_close(out, want, rtol=0, atol=2e-5)


def test_grad_call_copies_the_parameters_once(pair):
    # the backward needs the forward's values (an optimiser step may come in
    # between): one copy, made by the C forward, not three
    _, ours = pair
    x = torch.randn(1, 1, E)
    peak = _peak(lambda: ours(x, x, x, need_weights=False))
    assert peak < 1.5 * _param_bytes(ours), (peak, _param_bytes(ours))


def test_the_plain_path_agrees_with_the_recording_one(pair):
    # the recording path keeps P for the backward (the weights pass), the
    # plain one runs the online softmax: the same numbers to rounding
    _, ours = pair
    torch.manual_seed(1)
    x = torch.randn(3, 7, E)
    kpm = torch.rand(3, 7) < 0.3
    kpm[:, 0] = False
    for need_weights in (False, True):
        with torch.no_grad():
            a = ours(x, x, x, key_padding_mask=kpm, need_weights=need_weights)
        b = ours(x, x, x, key_padding_mask=kpm, need_weights=need_weights)  # records a graph
        assert b[0].grad_fn is not None and a[0].grad_fn is None
        torch.testing.assert_close(a[0], b[0].detach(), rtol=0, atol=1e-6)
        if need_weights:
            torch.testing.assert_close(a[1], b[1].detach(), rtol=0, atol=1e-6)


def test_parameters_changed_in_place_are_read_at_once(pair):
    # nothing cached between calls: a write through .data (which torch's
    # version counter does not see) reaches the next call
    ref, ours = pair
    x = torch.randn(2, 3, E)
    with torch.no_grad():
        before = ours(x, x, x, need_weights=False)[0]
        ours.in_proj_weight.data[:E].mul_(0.5)
        ref.in_proj_weight.data[:E].mul_(0.5)
        after = ours(x, x, x, need_weights=False)[0]
        want = ref(x, x, x, need_weights=False)[0]
    assert not torch.equal(before, after)
    torch.testing.assert_close(after, want, rtol=0, atol=2e-5)


def test_the_generic_class_under_no_grad_is_the_modules_call():
    torch.manual_seed(2)
    m = mt.MultiHeadAttention(E, H).eval()
    plain = mha_ext.MultiHeadAttention(E, H)
    plain.load_state_dict({k: v.detach().numpy() for k, v in m.state_dict().items()})
    x = torch.randn(2, 5, E)
    with torch.inference_mode():
        peak = _peak(lambda: m(x, need_weights=False))
        a = m(x, need_weights=False)[0]
    assert peak < _param_bytes(m) / 8, (peak, _param_bytes(m))
    assert np.array_equal(a.numpy(), plain(x.numpy(), need_weights=False)[0])


@pytest.mark.parametrize("mode", ["no_grad", "enable_grad"])
def test_a_dual_tensor_is_refused_not_dropped(pair, mode):
    # forward-mode AD runs under no_grad too: the plain path must not take a
    # dual tensor (it would drop the tangent); the Function says it has no jvp
    import torch.autograd.forward_ad as fwAD
    _, ours = pair
    x = torch.randn(1, 3, E)
    ctx = torch.no_grad if mode == "no_grad" else torch.enable_grad
    with fwAD.dual_level(), ctx():
        d = fwAD.make_dual(x, torch.ones_like(x))
        with pytest.raises(NotImplementedError, match="jvp"):
            ours(d, d, d, need_weights=False)


def test_a_transposed_weight_is_refused():
    # W_k (E, kdim) given as (kdim, E): as many scalars, the wrong shape
    m = mha_ext.MultiHeadAttention(16, 4, kdim=8)
    parts = list(_module_parts(m))
    parts[2] = np.ascontiguousarray(parts[2].T)
    q, k = np.zeros((1, 2, 16), np.float32), np.zeros((1, 3, 8), np.float32)
    with pytest.raises(ValueError, match=r"params\[2\] \(W_k\.weight\) must have the shape \(16, 8\), "
                                         r"got \(8, 16\)"):
        m._forward(q, k, k, params=tuple(parts))


def test_the_generic_class_with_dropout_in_eval_takes_the_plain_path():
    # its C core stays in eval mode: the torch module's flag decides the dropout
    m = mt.MultiHeadAttention(E, H, dropout=0.5).eval()
    x = torch.randn(2, 5, E)
    with torch.inference_mode():
        peak = _peak(lambda: m(x, need_weights=False))
        a = m(x, need_weights=False)[0]
        b = m(x, need_weights=False)[0]
    assert peak < _param_bytes(m) / 8, (peak, _param_bytes(m))
    assert torch.equal(a, b)  # no dropout in eval
    m.train()
    with torch.no_grad():
        c, d = m(x, need_weights=False)[0], m(x, need_weights=False)[0]
    assert not torch.equal(c, d)  # dropout in training, a new mask each call


# ---- the binding's protocol: params as one array per tensor


def _module_parts(m):
    layout = m._layout()
    block = m._block()
    return _params.Parts(_params.tensor(m, i, block) if n else None
                         for i, (o, n) in enumerate(layout))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_parts_give_the_blocks_bits(dtype):
    m = mha_ext.MultiHeadAttention(16, 4, dtype=dtype, seed=3)
    x = np.random.default_rng(0).standard_normal((2, 5, 16)).astype(dtype)
    out, w = m._forward(x, x, x)
    out2, w2 = m._forward(x, x, x, params=_module_parts(m))
    assert np.array_equal(out, out2) and np.array_equal(w, w2)
    # a float64 copy of each tensor for a float32 module is converted
    other = _params.Parts(None if p is None else p.astype("float64") for p in _module_parts(m))
    assert np.array_equal(out, m._forward(x, x, x, params=other)[0])


def test_parts_errors():
    m = mha_ext.MultiHeadAttention(16, 4, bias=False)
    x = np.zeros((1, 2, 16), np.float32)
    parts = list(_module_parts(m))
    with pytest.raises(ValueError, match="must hold 10 arrays"):
        m._forward(x, x, x, params=tuple(parts[:9]))
    bad = list(parts)
    bad[2] = bad[2][:-1]
    with pytest.raises(ValueError, match=r"params\[2\] \(W_k\.weight\) must have the shape \(16, 16\), "
                                         r"got \(15, 16\)"):
        m._forward(x, x, x, params=tuple(bad))
    bad[2] = parts[2].reshape(-1)  # the right number of scalars, not the shape
    with pytest.raises(ValueError, match=r"params\[2\] \(W_k\.weight\) must have the shape \(16, 16\)"):
        m._forward(x, x, x, params=tuple(bad))
    bad[2] = None  # a tensor the module has
    with pytest.raises(TypeError, match=r"params\[2\] \(W_k\.weight\)"):
        m._forward(x, x, x, params=tuple(bad))
    bad = list(parts)
    bad[1] = np.zeros(16, np.float32)  # W_q.bias: this module has none
    with pytest.raises(ValueError, match=r"params\[1\] \(W_q\.bias\) must be None"):
        m._forward(x, x, x, params=tuple(bad))
    bad = list(parts)
    bad[0] = "weights"
    with pytest.raises((TypeError, ValueError)):
        m._forward(x, x, x, params=tuple(bad))
