"""torch's own sample inputs (the installed wheel's
torch.testing._internal.common_modules.module_db) for nn.MultiheadAttention
and the nn.Transformer* modules, run on the stock module and on a copy with
mha_ext.torch.MultiheadAttention in place of every nn.MultiheadAttention:
outputs and every gradient (inputs and parameters) equal within 2e-5
(float32) / 1e-10 (float64), relative to the value's magnitude where it
exceeds 1, in training and eval mode.  Every sample runs (add_bias_kv and
add_zero_attn included); the count of samples run is checked against the
count torch generates.  Plus gradcheck in float64 on small cases, with
and without add_bias_kv / add_zero_attn.

Run with `-s` for the counts and the worst errors.

torch's testing package is imported by _support.torch_testing (a stand-in
for ``expecttest``, a test-only dependency of torch, when it is missing).

Legend: B batch, L target length, S source length, E = embed_dim.
"""
import copy
import warnings

import pytest

from _support import require_torch, torch_testing

torch = require_torch()
from torch import nn  # noqa: E402

from mha_ext.torch import MultiheadAttention  # noqa: E402

TOL = {torch.float32: 2e-5, torch.float64: 1e-10}
MODULES = ("MultiheadAttention", "TransformerEncoderLayer", "TransformerDecoderLayer",
           "TransformerEncoder", "Transformer")
COUNTS = {}   # (module, dtype) -> [ran, of them with add_bias_kv / add_zero_attn]
WORST = {}    # (module, dtype) -> worst error
WORST_EXTRA = {}  # (module, dtype) -> worst error of the add_bias_kv / add_zero_attn samples


def _module_db():
    module_db = torch_testing("common_modules").module_db
    return {info.module_cls.__name__: info for info in module_db
            if info.module_cls.__name__ in MODULES}


DB = _module_db()


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    if COUNTS:
        print("\ntorch's sample inputs (module_db, train + eval): ran (of them with "
              "add_bias_kv / add_zero_attn) / worst error (of those)")
        for key in sorted(COUNTS):
            ran, extra = COUNTS[key]
            print(f"  {key[0]:<26} {key[1]:<8} ran {ran:3d} ({extra:3d})  "
                  f"worst {WORST.get(key, 0.0):.3g}"
                  + (f" ({WORST_EXTRA[key]:.3g})" if key in WORST_EXTRA else ""))


def _ours(stock):
    """stock with every nn.MultiheadAttention replaced by ours (from_torch)."""
    if isinstance(stock, nn.MultiheadAttention):
        return MultiheadAttention.from_torch(stock)
    ours = copy.deepcopy(stock)
    for name, m in list(ours.named_modules()):
        if isinstance(m, nn.MultiheadAttention):
            parent, _, last = name.rpartition(".")
            setattr(ours.get_submodule(parent), last, MultiheadAttention.from_torch(m))
    return ours


def _tensors(out):
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for t in out if isinstance(t, torch.Tensor)]


def _clone(x):
    if isinstance(x, torch.Tensor):
        y = x.detach().clone()
        return y.requires_grad_(x.requires_grad)
    return x


def _err(a, b, what):
    """max |a - b| over max(1, max |a|): absolute for values up to 1,
    relative beyond (the samples' inputs reach |x| = 9, so some gradients
    are in the tens, where float32's own spacing exceeds 2e-5)."""
    a, b = a.detach(), b.detach()
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    nan = torch.isnan(a)
    assert torch.equal(nan, torch.isnan(b)), f"{what}: NaN in different places"
    if not (~nan).any():
        return 0.0
    return float((a[~nan] - b[~nan]).abs().max() / max(1.0, float(a[~nan].abs().max())))


def _run(module, sample):
    fi = sample.forward_input
    args = [_clone(a) for a in fi.args]
    kwargs = {k: _clone(v) for k, v in fi.kwargs.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = _tensors(module(*args, **kwargs))
    return out, [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", MODULES)
def test_module_db_samples(name, training, dtype):
    if name not in DB:
        pytest.skip(f"this torch has no module_db entry for {name}")
    info = DB[name]
    torch.manual_seed(0)  # the samples are random
    samples = info.module_inputs_func(info, device="cpu", dtype=dtype, requires_grad=True,
                                      training=training)
    key = (name, str(dtype).replace("torch.", ""))
    counts = COUNTS.setdefault(key, [0, 0])
    samples = list(samples)
    for i, sample in enumerate(samples):
        ci = sample.constructor_input
        torch.manual_seed(i)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            stock = info.module_cls(*ci.args, **ci.kwargs).to(dtype).train(training)
        ours = _ours(stock)
        counts[0] += 1
        extra = bool(ci.kwargs.get("add_bias_kv") or ci.kwargs.get("add_zero_attn"))
        counts[1] += extra
        what = f"{name} sample {i} {sample.desc!r}"
        ya, xa = _run(stock, sample)
        yb, xb = _run(ours, sample)
        errs = [_err(a, b, f"{what} output") for a, b in zip(ya, yb)]
        g = torch.Generator().manual_seed(i)
        cot = [torch.randn(y.shape, generator=g, dtype=y.dtype) for y in ya]
        for ys, xs, mod in ((ya, xa, stock), (yb, xb, ours)):
            loss = sum((y.nan_to_num() * c).sum() for y, c in zip(ys, cot) if y.requires_grad)
            params = [p for p in mod.parameters() if p.requires_grad]
            grads = torch.autograd.grad(loss, xs + params, allow_unused=True)
            mod._grads = [torch.zeros(()) if gr is None else gr for gr in grads]
        for a, b in zip(stock._grads, ours._grads):
            errs.append(_err(a, b, f"{what} gradient"))
        if not training:  # without grad: torch's fused paths on the stock side
            with torch.no_grad():
                ya, _ = _run(stock, sample)
                yb, _ = _run(ours, sample)
            errs += [_err(a, b, f"{what} no-grad output") for a, b in zip(ya, yb)]
        err = max(errs)
        WORST[key] = max(err, WORST.get(key, 0.0))
        if extra:
            WORST_EXTRA[key] = max(err, WORST_EXTRA.get(key, 0.0))
        assert err <= TOL[dtype], f"{what}: {err:.3g} > {TOL[dtype]}"
    assert samples, f"torch gave no sample of {name}"
    assert counts[0] > 0, f"no sample of {name} ran"


@pytest.mark.parametrize("kw", [dict(), dict(kdim=3, vdim=5, bias=False),
                                dict(add_bias_kv=True, add_zero_attn=True),
                                dict(kdim=3, vdim=5, bias=False, add_bias_kv=True),
                                dict(add_zero_attn=True)],
                         ids=["packed", "separate", "bias_kv+zero_attn",
                              "separate+bias_kv", "zero_attn"])
@pytest.mark.parametrize("need_weights", [True, False])
def test_gradcheck_float64(kw, need_weights):
    torch.manual_seed(0)
    m = MultiheadAttention(4, 2, batch_first=True, dtype=torch.float64, **kw)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.rand_like(p) * 0.2)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 4, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(2, 5, m.kdim, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(2, 5, m.vdim, dtype=torch.float64, generator=g, requires_grad=True)
    kpm = torch.tensor([[False] * 5, [False, False, False, True, True]])
    # parameters enter through a functional wrapper: gradcheck perturbs them
    def functional(q, k, v, *ps):
        return torch.func.functional_call(m, dict(zip(
            [n for n, _ in m.named_parameters()], ps)), (q, k, v),
            dict(key_padding_mask=kpm, need_weights=need_weights,
                 average_attn_weights=False))

    ps = [p.detach().clone().requires_grad_() for p in m.parameters()]

    def flat(*a):
        out, w = functional(*a)
        return (out,) if w is None else (out, w)

    assert torch.autograd.gradcheck(flat, (q, k, v, *ps), eps=1e-6, atol=1e-7)
