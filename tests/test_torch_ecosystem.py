"""What users do to models around the torch classes (docs/API.md §8):
torch.save with weights_only, torch.fx, torch.compile(fullgraph=True), an
input of another dtype, an int too large for a float as dropout.  Each case
once gave another behaviour than torch's module or the documents say.
"""
import io

import pytest

from _support import require_torch

torch = require_torch()
import mha_ext  # noqa: E402
import mha_ext.torch as mt  # noqa: E402
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear  # noqa: E402


def test_a_saved_drop_in_loads_with_weights_only_and_torchs_allowlist():
    """torch's module needs its class and NonDynamicallyQuantizableLinear
    allowlisted; ours needed a private hook function too."""
    torch.manual_seed(0)
    m = mt.MultiheadAttention(16, 4, batch_first=True).eval()
    buf = io.BytesIO()
    torch.save(m, buf)
    names = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(buf.getvalue()))
    assert sorted(names) == sorted(["mha_ext._torch_mha.MultiheadAttention",
                                    "torch.nn.modules.linear.NonDynamicallyQuantizableLinear"])
    buf.seek(0)
    with torch.serialization.safe_globals([mt.MultiheadAttention,
                                           NonDynamicallyQuantizableLinear]):
        loaded = torch.load(buf, weights_only=True)
    x = torch.randn(2, 5, 16)
    assert torch.equal(loaded(x, x, x)[0], m(x, x, x)[0])
    # the loaded module still keeps nn.TransformerEncoderLayer off torch's
    # fused kernel (its pre-hook, put back on load), and a copy keeps the
    # user's hooks
    assert len(loaded._forward_pre_hooks) == 1
    seen = []
    m.register_forward_pre_hook(lambda mod, args: seen.append(1))
    import copy
    twin = copy.deepcopy(m)
    twin(x, x, x)
    assert seen == [1] and len(twin._forward_pre_hooks) == 2


def test_an_input_tensor_of_another_dtype_is_refused_as_torchs_module_refuses_it():
    m = mt.MultiHeadAttention(16, 4)                    # float32 parameters
    ref = torch.nn.MultiheadAttention(16, 4, batch_first=True)
    for x in (torch.randn(2, 5, 16, dtype=torch.float64), torch.randint(0, 3, (2, 5, 16))):
        with pytest.raises(RuntimeError):
            ref(x, x, x)
        with pytest.raises(TypeError, match=f"query is {x.dtype} but the parameters are "
                                            f"torch.float32") as info:
            m(x)
        assert isinstance(info.value, RuntimeError)
    # arrays are converted, as the NumPy class converts them; under CPU
    # autocast the call computes in the parameters' dtype
    assert m(torch.randn(2, 5, 16).numpy().astype("float64"))[0].dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert m(torch.randn(2, 5, 16, dtype=torch.float64))[0].dtype == torch.float32


class _Wrap(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x):
        return self.m(x, x, x)[0]


class _Twin(torch.nn.Module):
    def forward(self, x):
        return mha_ext.scaled_dot_product_attention(x, x, x)


@pytest.mark.parametrize("kind", ["drop-in", "torch class", "twin"])
def test_fx_symbolic_trace_through_a_call_is_refused_by_name(kind):
    """fx's Proxies reached our control flow: a TraceError, a co_varnames
    ValueError or "parameters must be float32 or float64, got Proxy"."""
    model = {"drop-in": lambda: _Wrap(mt.MultiheadAttention(16, 4, batch_first=True)),
             "torch class": lambda: _Wrap(mt.MultiHeadAttention(16, 4)),
             "twin": _Twin}[kind]()
    with pytest.raises(RuntimeError, match="torch.fx.symbolic_trace reached mha_ext"):
        torch.fx.symbolic_trace(model)


def test_fx_with_the_module_a_leaf_traces_and_runs():
    class Leaf(torch.fx.Tracer):
        def is_leaf_module(self, m, name):
            return isinstance(m, mt.MultiheadAttention) or super().is_leaf_module(m, name)

    model = _Wrap(mt.MultiheadAttention(16, 4, batch_first=True)).eval()
    gm = torch.fx.GraphModule(model, Leaf().trace(model))
    x = torch.randn(2, 5, 16)
    assert torch.equal(gm(x), model(x))


@pytest.mark.parametrize("kind", ["drop-in", "torch class", "twin"])
def test_compile_fullgraph_names_mha_ext(kind):
    model = {"drop-in": lambda: _Wrap(mt.MultiheadAttention(16, 4, batch_first=True)),
             "torch class": lambda: _Wrap(mt.MultiHeadAttention(16, 4)),
             "twin": _Twin}[kind]()
    x = torch.randn(1, 2, 5, 16) if kind == "twin" else torch.randn(2, 5, 16)
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="mha_ext computes attention in C, outside the graph"):
        torch.compile(model, fullgraph=True)(x)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(model)(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("need_weights", [False, True])
def test_an_int_too_large_for_a_float_as_dropout_raises_what_torch_raises(need_weights):
    """torch: its SDPA path an OverflowError, its weights path a ValueError;
    ours is both (a ValueError that is also an OverflowError)."""
    x = torch.randn(2, 3, 8)
    huge = 10 ** 400
    theirs = torch.nn.MultiheadAttention(8, 2, dropout=huge, batch_first=True).train()
    ours = mt.MultiheadAttention(8, 2, dropout=huge, batch_first=True).train()
    want = OverflowError if not need_weights else ValueError
    with pytest.raises(want):
        theirs(x, x, x, need_weights=need_weights)
    with pytest.raises(want, match="dropout must be a probability in"):
        ours(x, x, x, need_weights=need_weights)
    w = torch.randn(24, 8)
    wo = torch.randn(8, 8)
    args = (x, x, x, 8, 2, w, None, None, None, False, huge, wo, None)
    q = x.transpose(0, 1)
    args = (q, q, q) + args[3:]
    with pytest.raises(want):
        torch.nn.functional.multi_head_attention_forward(*args, training=True,
                                                         need_weights=need_weights)
    with pytest.raises(want, match="dropout_p must be a probability in"):
        mt.multi_head_attention_forward(*args, training=True, need_weights=need_weights)


def _halve(module, args):  # a user's pre-hook that changes the inputs
    return tuple(a * 0.5 for a in args)


def _keep(module, args, kwargs):  # a user's pre-hook with kwargs, changing nothing
    return None


def test_a_loaded_drop_in_keeps_the_users_hooks_whatever_the_hook_counter(monkeypatch):
    """A module unpickled in another process holds hook ids of that
    process's counter; the pre-hook put back on load took a fresh id that
    could equal the user's and replace it (0.36 off, no error)."""
    from torch.utils.hooks import RemovableHandle
    torch.manual_seed(0)
    m = mt.MultiheadAttention(8, 2, batch_first=True).eval()
    m.register_forward_pre_hook(_halve)
    m.register_forward_pre_hook(_keep, with_kwargs=True)
    x = torch.randn(1, 3, 8)
    want = m(x, x, x)[0]
    buf = io.BytesIO()
    torch.save(m, buf)
    for start in range(0, max(m._forward_pre_hooks) + 2):  # a fresh process's counter
        monkeypatch.setattr(RemovableHandle, "next_id", start)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        assert _halve in loaded._forward_pre_hooks.values()
        assert len(loaded._forward_pre_hooks) == 3
        assert torch.equal(loaded(x, x, x)[0], want), start


def test_swapped_keeps_a_loaded_torch_modules_hooks_whatever_the_hook_counter(monkeypatch):
    """swapped()'s marker took a fresh hook id that could equal a loaded
    user hook's: the hook was replaced inside the block and deleted after."""
    from torch.utils.hooks import RemovableHandle
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.MultiheadAttention(8, 2, batch_first=True)).eval()
    monkeypatch.setattr(RemovableHandle, "next_id", 3)
    model[0].register_forward_pre_hook(_halve)  # id 3
    x = torch.randn(1, 3, 8)
    want = model[0](x, x, x)[0]
    for start in range(5):  # the counter of the process that loaded the model
        monkeypatch.setattr(RemovableHandle, "next_id", start)
        with mt.swapped(model):
            assert _halve in model[0]._forward_pre_hooks.values(), start
            torch.testing.assert_close(model[0](x, x, x)[0], want, rtol=0, atol=1e-6)
        assert list(model[0]._forward_pre_hooks.values()) == [_halve], start
        assert torch.equal(model[0](x, x, x)[0], want)
