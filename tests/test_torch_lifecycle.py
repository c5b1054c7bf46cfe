"""The drop-in's life next to torch's tooling, against torch itself:
parametrizations computed as often as torch's module computes them (a
spectral_norm'd weight moves its power iteration at every read in training),
no hidden second copy of the parameters (memory, torch.save, pickle,
deepcopy), the meta device, and a quantized out_proj.  Each case was found
by an audit against torch (the numbers differed, or a copy was 2.5 times
torch's size) and fails on the code before it.

Legend: L query length, B batch, E = embed_dim, H = num_heads.
"""
import copy
import io
import pickle

import pytest

from _support import require_torch

torch = require_torch()
import mha_ext.torch as mt  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.utils import parametrize  # noqa: E402

E, H, L, B = 16, 4, 5, 2
F64 = torch.float64


class Counted(nn.Module):
    """An identity parametrization counting its computations."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def forward(self, w):
        self.n += 1
        return w


def _pair(batch_first=True, **kw):
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, batch_first=batch_first, dtype=F64, **kw)
    ours = mt.MultiheadAttention(E, H, batch_first=batch_first, dtype=F64, **kw)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def _calls():
    """(name, module kwargs, call(module) -> outputs): batched self-attention
    with and without weights, a float mask, cross-attention, unbatched,
    eval without grad (torch's fast-path checks read every tensor)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, L, E, generator=g, dtype=F64)
    y = torch.randn(B, L + 2, E, generator=g, dtype=F64)
    fm = torch.randn(L, L, generator=g, dtype=F64)
    return [
        ("self, weights", lambda m: m(x, x, x)),
        ("self, no weights", lambda m: m(x, x, x, need_weights=False)),
        ("float mask", lambda m: m(x, x, x, attn_mask=fm, need_weights=False)),
        ("cross", lambda m: m(x, y, y)),
        ("unbatched", lambda m: m(x[0], x[0], x[0])),
    ]


@pytest.mark.parametrize("bias_kv", [False, True])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("case", range(5))
def test_a_parametrized_weight_is_computed_as_often_as_torch_computes_it(case, training,
                                                                         bias_kv):
    name, call = _calls()[case]
    names = ["in_proj_weight", "in_proj_bias"] + ["bias_k", "bias_v"] * bias_kv
    counts = []
    for m in _pair(add_bias_kv=bias_kv):
        m.train(training)
        for tensor in names:
            parametrize.register_parametrization(m, tensor, Counted())
        parametrize.register_parametrization(m.out_proj, "weight", Counted())
        call(m)
        with torch.no_grad():
            call(m)
        counts.append([m.parametrizations[t][0].n for t in names]
                      + [m.out_proj.parametrizations.weight[0].n])
    assert counts[1] == counts[0], name


@pytest.mark.parametrize("need_weights", [True, False])
def test_spectral_norm_on_in_proj_weight_trains_as_torchs(need_weights):
    # training mode: one power iteration per read; ours read the weight once
    # with weights where torch reads it three times (1.7e-5 off, u 6.9e-3)
    x = torch.randn(B, L, E, generator=torch.Generator().manual_seed(2), dtype=F64)
    outs, states = [], []
    for m in _pair():
        torch.manual_seed(3)
        nn.utils.parametrizations.spectral_norm(m, "in_proj_weight")
        outs.append([m(x, x, x, need_weights=need_weights)[0] for _ in range(3)])
        states.append(m.state_dict())
    for a, b in zip(*outs):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    for key, value in states[0].items():
        torch.testing.assert_close(states[1][key], value, rtol=1e-12, atol=1e-12, msg=key)


def test_entering_swapped_computes_no_parameter():
    # swapped() read out_proj.weight for its dtype: a spectral_norm'd out_proj
    # moved its power iteration on entering an empty block (u 4.7e-3 off)
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, batch_first=True, dtype=F64)
    parametrize.register_parametrization(layer.self_attn.out_proj, "weight", Counted())
    count = layer.self_attn.out_proj.parametrizations.weight[0]
    count.n = 0  # (registering computes it once)
    x = torch.randn(B, L, E, generator=torch.Generator().manual_seed(4), dtype=F64)
    layer(x)
    per_call = count.n
    count.n = 0
    with mt.swapped(layer):
        assert count.n == 0
        layer(x)
    assert count.n == per_call


def _saved_size(m):
    buf = io.BytesIO()
    torch.save(m, buf)
    return len(buf.getvalue())


@pytest.mark.parametrize("kind", ["drop-in", "MultiHeadAttention"])
def test_a_module_holds_its_parameters_once(kind):
    # each drop-in kept, per dtype it was called in, a C module with its own
    # (never read) parameters: torch.save of a module 16.0 MiB before a call,
    # 40.7 after, 105.8 after .double(); the own class carried one always
    torch.manual_seed(0)
    m = (mt.MultiheadAttention(256, 8, batch_first=True) if kind == "drop-in"
         else mt.MultiHeadAttention(256, 8, dropout=0.5, seed=3))
    params = sum(p.numel() * p.element_size() for p in m.parameters())
    x = torch.randn(B, L, 256, generator=torch.Generator().manual_seed(5))
    m.eval()
    want = m(x, x, x)[0]
    for module in (m, m.double()):
        xx = x.to(next(module.parameters()).dtype)
        module(xx, xx, xx)
        assert _saved_size(module) < 1.1 * sum(p.numel() * p.element_size()
                                               for p in module.parameters())
    m.float()
    assert sum(p.numel() * p.element_size() for p in m.parameters()) == params
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    for copied in (pickle.loads(pickle.dumps(m)), copy.deepcopy(m),
                   torch.load(buf, weights_only=False)):
        torch.testing.assert_close(copied(x, x, x)[0], want, rtol=0, atol=0)
    if kind == "MultiHeadAttention":  # the seed of the dropout stream travels
        twin = copy.deepcopy(m.train())
        assert twin.dropout == 0.5
        torch.manual_seed(6)
        a = m(x)[0]
        torch.manual_seed(6)
        assert torch.equal(twin(x)[0], a)


def test_a_checkpoint_holding_cores_loads_without_them():
    # torch.save of a called drop-in carried its cores until now: such a
    # file loads, and the loaded module carries none
    _, ours = _pair()
    x = torch.randn(B, L, E, dtype=F64)
    want = ours(x, x, x)[0]
    ours.__dict__["_cores"] = {"old": mt.MultiHeadAttention(E, H)._core}
    loaded = pickle.loads(pickle.dumps(ours))
    assert "_cores" not in loaded.__dict__
    torch.testing.assert_close(loaded(x, x, x)[0], want, rtol=0, atol=0)


@pytest.mark.parametrize("need_weights", [True, False])
def test_a_call_on_the_meta_device_gives_torchs_shapes(need_weights):
    # the drop-in refused meta tensors (its functional twin took them)
    outs = []
    for cls in (nn.MultiheadAttention, mt.MultiheadAttention):
        m = cls(E, H, device="meta")
        x = torch.empty(L, B, E, device="meta")
        out, w = m(x, x, x, need_weights=need_weights)
        outs.append((out.device, out.shape, None if w is None else (w.device, w.shape)))
    assert outs[1] == outs[0]
    assert outs[0][0].type == "meta"


def test_meta_parameters_with_cpu_inputs_are_torchs_runtimeerror_too():
    # torch raises a RuntimeError; ours was a ValueError alone (docs/API.md
    # §7: a refusal torch makes too is also of torch's type)
    x = torch.randn(L, B, E)
    with pytest.raises(RuntimeError, match="meta"):
        nn.MultiheadAttention(E, H, device="meta")(x, x, x)
    m = mt.MultiheadAttention(E, H, device="meta")
    for kind in (RuntimeError, ValueError):
        with pytest.raises(kind, match="parameters must be on the CPU, got device meta"):
            m(x, x, x)
    xm = x.to("meta")
    with pytest.raises(RuntimeError, match="meta"):
        nn.MultiheadAttention(E, H)(xm, xm, xm)
    for kind in (RuntimeError, ValueError):
        with pytest.raises(kind, match="on the meta device and the parameters are not"):
            mt.MultiheadAttention(E, H)(xm, xm, xm)


def test_the_sdpa_twin_on_the_meta_device_gives_torchs_shape():
    from mha_ext import scaled_dot_product_attention as f
    q = torch.empty(2, 4, L, 8, device="meta")
    k = torch.empty(2, 4, L + 1, 8, device="meta")
    v = torch.empty(2, 4, L + 1, 6, device="meta")
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    for kw in ({}, {"is_causal": "lower_right"}, {"window": (2, 0)}):
        got = f(q, k, v, **kw)
        assert got.device == want.device and got.shape == want.shape
    with pytest.raises(RuntimeError, match="device"):
        f(torch.randn(2, 4, L, 8), k, v)


def test_a_quantized_out_proj_is_a_typeerror_that_says_so():
    # torch.ao.quantization.convert makes out_proj a quantized Linear whose
    # .weight is a method: an AttributeError about 'function' .device before
    import torch.ao.quantization as tq
    _, ours = _pair(batch_first=False)
    ours.float().eval()

    class Model(nn.Module):
        def __init__(self, attn):
            super().__init__()
            self.quant, self.attn, self.dequant = tq.QuantStub(), attn, tq.DeQuantStub()

        def forward(self, x):
            x = self.dequant(self.quant(x))
            return self.attn(x, x, x)[0]

    model = Model(ours).eval()
    model.qconfig = tq.default_qconfig
    x = torch.randn(L, B, E)
    prepared = tq.prepare(model)
    prepared(x)
    converted = tq.convert(prepared)
    with pytest.raises(TypeError, match="quantized out_proj"):
        converted(x)


def test_the_shared_cores_are_kept_for_the_configurations_used_last():
    # the drop-ins share one C module per configuration: a model with more
    # configurations than the 16 the functional twin kept (dropped oldest
    # first, even when just used) would rebuild one (its parameters'
    # initialisation: 15 ms at E 1024) at every call
    from mha_ext import _torch_mha
    x = torch.randn(1, 3, 8)
    first = mt.MultiheadAttention(8, 2, batch_first=True)
    first(x, x, x)
    core = first._core(torch.float32)
    for heads in (1, 2, 4, 8):  # 4 ...
        for kdim in range(1, 9):  # ... x 8 other configurations, the first used between
            m = mt.MultiheadAttention(8, heads, batch_first=True, kdim=kdim)
            m(x, torch.randn(1, 3, kdim), x)
            first(x, x, x)
    assert first._core(torch.float32) is core
    assert len(_torch_mha._CORES) <= _torch_mha._KEEP


def test_the_cores_hold_no_parameters_of_their_own():
    # every call hands the C module the torch parameters: its own block is
    # never initialised nor touched (zeros, next to no memory); each core
    # initialised its own before (a model's parameters twice in memory)
    x = torch.randn(1, 3, 16)
    drop_in = mt.MultiheadAttention(16, 4, batch_first=True)
    drop_in(x, x, x)
    own = mt.MultiHeadAttention(16, 4, seed=1)
    assert own.W_q.weight.abs().sum() > 0  # the seed's initialisation, in torch's Linears
    for core in (drop_in._core(torch.float32), own._core, copy.deepcopy(own)._core,
                 own.double()._core_for(torch.float64)):
        assert not core._block().any()


_RSS = """
import torch, mha_ext.torch as mt
def rss():
    return int(open('/proc/self/statm').read().split()[1]) * 4096
x = torch.randn(2, 5, 1024)
ms = [mt.MultiheadAttention(1024, 16, batch_first=True) for _ in range(4)]
with torch.no_grad():
    ms[0](x, x, x)   # the output cache, thread pool, first-call state
    before = rss()
    for m in ms:
        m(x, x, x)
print((rss() - before) / 2 ** 20)
"""


def test_calling_drop_ins_adds_no_copy_of_their_parameters():
    # four drop-ins at E 1024 (16 MiB of parameters each): 101 MiB more for
    # eight after one call each before (a core per module, initialised)
    import subprocess
    import sys
    run = subprocess.run([sys.executable, "-c", _RSS], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert float(run.stdout) < 8, run.stdout


def test_torch_compile_calls_the_entry_points_as_they_are():
    # Dynamo traced into the drop-in's forward and compiled each Python
    # function it called on its own, recompiling for each kind of tensor
    # met until its limit (warnings; a DETR-like model 31 s for its first
    # call and 29 ms a step, against 4 s and 8.5 ms): now each entry point
    # is one call Dynamo does not enter (the SDPA twin's first lines, which
    # NumPy calls share without torch, before its torch part)
    import os

    import mha_ext
    root = os.path.dirname(mha_ext.__file__)
    torch.manual_seed(0)
    drop_in = mt.MultiheadAttention(8, 2, batch_first=True)
    own = mt.MultiHeadAttention(8, 2, seed=0)
    lin = nn.Linear(8, 8)
    models = {
        "drop-in": lambda x: lin(drop_in(x, x, x, need_weights=False)[0]).relu(),
        "MultiHeadAttention": lambda x: lin(own(x)[0]).relu(),
        "SDPA twin": lambda x: lin(mha_ext.scaled_dot_product_attention(
            x[:, None], x[:, None], x[:, None])[:, 0]).relu(),
    }
    x = torch.randn(2, 4, 8)
    for name, f in models.items():
        torch._dynamo.reset()
        explained = torch._dynamo.explain(f)(x)
        inside = [fr.filename for r in explained.break_reasons for fr in r.user_stack
                  if fr.filename.startswith(root) and not (
                      name == "SDPA twin" and fr.filename.endswith("_sdpa_api.py"))]
        assert not inside, (name, inside)
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(f)(x), f(x), rtol=0, atol=0)


def test_a_wrapped_forward_inside_an_encoder_layer_keeps_torchs_nan_rows():
    # torch's fused encoder layer (eval, no grad) gives NaN for a fully padded
    # sequence; the drop-in finds the calling layer on the stack, within a
    # few frames: torch.compiler.disable's wrapper took one of them, and a
    # forward wrapped three times more (instrumentation) came out finite
    import functools
    torch.manual_seed(0)
    x = torch.randn(3, 4, 8)
    pad = torch.zeros(3, 4, dtype=torch.bool)
    pad[1] = True
    base = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).eval()
    outs = []
    for ours in (False, True):
        m = copy.deepcopy(base)
        if ours:
            m.self_attn = mt.MultiheadAttention.from_torch(m.self_attn).eval()
        for _ in range(3):
            old = m.self_attn.forward

            @functools.wraps(old)
            def forward(*a, _old=old, **k):
                return _old(*a, **k)
            m.self_attn.forward = forward
        with torch.no_grad():
            outs.append(m(x, src_key_padding_mask=pad))
    assert outs[0][1].isnan().all()
    assert torch.equal(outs[0].isnan(), outs[1].isnan())
    torch.testing.assert_close(outs[1].nan_to_num(), outs[0].nan_to_num(), rtol=1e-5,
                               atol=1e-6)
