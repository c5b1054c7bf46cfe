"""torch's own sample inputs for the functionals we twin: the installed
wheel's torch.testing._internal.common_methods_invocations.op_db entries
``nn.functional.scaled_dot_product_attention`` and
``nn.functional.multi_head_attention_forward``, each sample run through
torch's function and through ours (mha_ext.scaled_dot_product_attention,
mha_ext.torch.multi_head_attention_forward), float32 and float64.

- The outputs and the gradients of every input that requires grad (for the
  functional: in_proj_weight, its bias, out_proj's weight and bias too)
  agree within 2e-5 (float32) / 1e-10 (float64), relative to the value's
  magnitude where it exceeds 1 (the samples' inputs reach |x| = 9).
- A sample with dropout (dropout_p 0.5, training=True) is compared with its
  dropout off (torch's random stream is not ours), and run as given too:
  then the output has torch's shape, dtype and strides, differs from the
  output without dropout (it dropped something), repeats for the same
  seed, and its gradients have the inputs' shapes and are finite.
- Every sample torch generates runs: the counts are checked.

Run with `-s` for the counts and the worst errors.
"""
import warnings

import pytest

from _support import require_torch, torch_testing

torch = require_torch()
import torch.nn.functional as F  # noqa: E402

import mha_ext  # noqa: E402
from mha_ext.torch import multi_head_attention_forward  # noqa: E402

TOL = {torch.float32: 2e-5, torch.float64: 1e-10}
SDPA = "nn.functional.scaled_dot_product_attention"
MHAF = "nn.functional.multi_head_attention_forward"
OURS = {SDPA: mha_ext.scaled_dot_product_attention, MHAF: multi_head_attention_forward}
TORCHS = {SDPA: F.scaled_dot_product_attention, MHAF: F.multi_head_attention_forward}
OPS = {op.name: op for op in torch_testing("common_methods_invocations").op_db
       if op.name in (SDPA, MHAF)}
WORST = {}   # (op, dtype) -> (samples, worst error)


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    if WORST:
        print("\ntorch's sample inputs (op_db): samples / worst error")
        for (name, dtype), (n, err) in sorted(WORST.items()):
            print(f"  {name:<46} {dtype:<8} {n:3d}  {err:.3g}")


def _err(a, b, what):
    """max |a - b| over max(1, max |a|) (as test_torch_module_db.py)."""
    a, b = a.detach(), b.detach()
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert torch.isfinite(a).all() and torch.isfinite(b).all(), f"{what}: not finite"
    return float((a - b).abs().max() / max(1.0, float(a.abs().max())))


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone().requires_grad_(x.requires_grad)
    return x


def _call(name, fn, sample, **change):
    """fn on fresh copies of the sample's tensors (keywords changed by
    `change`), torch's generator seeded (dropout draws from it): (outputs
    as a list, the inputs that require grad)."""
    args = [_clone(sample.input)] + [_clone(a) for a in sample.args]
    kwargs = {k: _clone(v) for k, v in sample.kwargs.items()}
    kwargs.update(change)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = fn(*args, **kwargs)
    outs = [out] if isinstance(out, torch.Tensor) else [o for o in out if o is not None]
    leaves = [a for a in [*args, *kwargs.values()]
              if isinstance(a, torch.Tensor) and a.requires_grad]
    return outs, leaves


def _grads(outs, leaves, seed):
    g = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() for o in outs)
    return torch.autograd.grad(loss, leaves)


def _dropout(name, sample):
    """the sample's dropout probability, and the keywords that turn it off"""
    if name == SDPA:
        return sample.kwargs.get("dropout_p", 0.0), dict(dropout_p=0.0)
    training = sample.kwargs.get("training", True)
    return (sample.args[9] if training else 0.0), dict(training=False)  # args[9]: dropout_p


def _samples(name, dtype):
    torch.manual_seed(0)  # the samples are random
    return list(OPS[name].sample_inputs("cpu", dtype, requires_grad=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("name", [SDPA, MHAF])
def test_op_db_samples(name, dtype):
    assert name in OPS, f"torch's op_db has no entry {name}"
    samples = _samples(name, dtype)
    assert samples, f"torch gave no sample of {name}"
    worst, ran, dropped = 0.0, 0, 0
    for i, s in enumerate(samples):
        what = f"{name} sample {i} ({tuple(s.input.shape)}, {s.kwargs})"
        p, off = _dropout(name, s)
        # the numbers: without dropout
        ya, xa = _call(name, TORCHS[name], s, **off)
        yb, xb = _call(name, OURS[name], s, **off)
        assert len(ya) == len(yb) and len(xa) == len(xb), what
        errs = [_err(a, b, what + " output") for a, b in zip(ya, yb)]
        errs += [_err(a, b, what + " gradient")
                 for a, b in zip(_grads(ya, xa, i), _grads(yb, xb, i))]
        err = max(errs)
        assert err <= TOL[dtype], f"{what}: {err:.3g} > {TOL[dtype]}"
        worst = max(worst, err)
        ran += 1
        if p:  # as given: dropout on
            torch_out, _ = _call(name, TORCHS[name], s)
            ours, leaves = _call(name, OURS[name], s)
            again, _ = _call(name, OURS[name], s)
            for t, o, a, base in zip(torch_out, ours, again, yb):
                assert (o.shape, o.dtype, o.stride()) == (t.shape, t.dtype, t.stride()), what
                assert torch.equal(o, a), what + ": dropout did not repeat for the same seed"
                assert not torch.equal(o, base.detach()), what + ": nothing was dropped"
            for x, gx in zip(leaves, _grads(ours, leaves, i)):
                assert gx.shape == x.shape and torch.isfinite(gx).all(), what
            dropped += 1
    WORST[(name, str(dtype).replace("torch.", ""))] = (ran, worst)
    assert ran == len(samples)
    assert dropped > 0, f"no sample of {name} had dropout: the test of it ran nothing"


def test_sdpa_samples_cover_the_cases():
    """what the SDPA samples hold, so a torch whose samples lost a case is
    noticed: causal and not, a float mask, a 3-D query against 4-D keys"""
    samples = _samples(SDPA, torch.float64)
    assert any(s.kwargs.get("is_causal") for s in samples)
    assert any(not s.kwargs.get("is_causal") for s in samples)
    assert any(s.kwargs.get("attn_mask") is not None for s in samples)
    assert any(s.input.dim() < s.args[0].dim() for s in samples)
