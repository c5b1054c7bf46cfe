"""mha_ext.torch.swapped(model): the module put in place of a
torch.nn.MultiheadAttention shares its state (docs/API.md §8), so what the
block does to it the original has after the block: train()/eval(),
attributes set, load_state_dict(assign=True), hooks registered or removed,
parametrizations registered or removed; and torch's parametrize class of
nn.MultiheadAttention is swapped with its parametrizations.
"""
import copy

from _support import require_torch

torch = require_torch()
from torch import nn  # noqa: E402
from torch.nn.utils import parametrize  # noqa: E402

import mha_ext.torch as mt  # noqa: E402
from mha_ext.torch import MultiheadAttention  # noqa: E402
from test_torch_dropin import S, _build, _err, seq  # noqa: E402


def test_what_the_block_does_to_the_attention_the_original_has_after_it():
    # the swapped-in module shares the original's state: a mode switch, a
    # load with assign=True and hooks registered or removed inside the block
    # were lost (attention dropout stayed on after model.eval() inside it,
    # the attention kept its old weights)
    torch.manual_seed(4)
    x = seq(S, torch.float64, True, 1)
    enc = _build("TransformerEncoderLayer", True, False, torch.float64)
    enc.self_attn.dropout = 0.5
    enc.train()
    trained = copy.deepcopy(enc)
    for p in trained.parameters():
        p.data.add_(0.1)
    before = enc.self_attn.register_forward_hook(lambda m, a, o: fired.append("before"))
    fired = []
    with mt.swapped(enc):
        enc.eval()
        enc.load_state_dict(trained.state_dict(), assign=True)
        before.remove()
        enc.self_attn.register_forward_hook(lambda m, a, o: fired.append("inside"))
        with torch.no_grad():
            inside = enc(x)
    assert fired == ["inside"]
    assert not enc.self_attn.training and enc.self_attn.dropout == 0.5
    for n, p in trained.named_parameters():
        assert torch.equal(enc.get_parameter(n), p), n
    with torch.no_grad():
        after, again = enc(x), enc(x)
        want = trained.eval()(x)
    assert fired == ["inside"] * 3
    assert torch.equal(after, again)  # eval: no dropout
    assert _err(after, want, "output") <= 1e-10
    assert _err(inside, want, "output") <= 1e-10
    # the marker that keeps torch's layer off its fused kernel is gone again
    assert list(enc.self_attn._forward_pre_hooks.values()) == []


def test_a_parametrized_attention_is_swapped_with_its_parametrization():
    class Scale(nn.Module):
        def forward(self, w):
            return 0.5 * w

    torch.manual_seed(5)
    enc = _build("TransformerEncoderLayer", True, False, torch.float64)
    parametrize.register_parametrization(enc.self_attn, "in_proj_weight", Scale())
    ref = copy.deepcopy(enc)
    x = seq(S, torch.float64, True, 1)
    with mt.swapped(enc):
        assert isinstance(enc.self_attn, MultiheadAttention)
        assert parametrize.is_parametrized(enc.self_attn, "in_proj_weight")
        out = enc(x)
        out.sum().backward()
    want = ref(x)
    want.sum().backward()
    assert _err(out.detach(), want.detach(), "output") <= 1e-10
    original = enc.self_attn.parametrizations.in_proj_weight.original
    assert _err(original.grad, ref.self_attn.parametrizations.in_proj_weight.original.grad,
                "original") <= 1e-10
    assert type(enc.self_attn).__bases__ == (nn.MultiheadAttention,)



class Double(nn.Module):
    def forward(self, w):
        return 2 * w


def test_a_parametrization_registered_or_removed_inside_the_block_stays():
    # registered inside: the original came back with the parametrization in
    # its state but torch's plain class (AttributeError: in_proj_weight);
    # removed inside: it came back as parametrize's class with none left
    torch.manual_seed(6)
    x = seq(S, torch.float64, True, 1)
    enc = _build("TransformerEncoderLayer", True, False, torch.float64).eval()
    ref = copy.deepcopy(enc)
    with mt.swapped(enc):
        parametrize.register_parametrization(enc.self_attn, "in_proj_weight", Double())
        with torch.no_grad():
            inside = enc(x)
    parametrize.register_parametrization(ref.self_attn, "in_proj_weight", Double())
    assert parametrize.is_parametrized(enc.self_attn, "in_proj_weight")
    assert type(enc.self_attn).__bases__ == (nn.MultiheadAttention,)
    with torch.no_grad():
        want = ref(x)
        assert _err(enc(x), want, "after") <= 1e-10
    assert _err(inside, want, "inside") <= 1e-10
    with mt.swapped(enc):
        parametrize.remove_parametrizations(enc.self_attn, "in_proj_weight")
    parametrize.remove_parametrizations(ref.self_attn, "in_proj_weight")
    assert type(enc.self_attn) is nn.MultiheadAttention
    assert not parametrize.is_parametrized(enc.self_attn)
    with torch.no_grad():
        assert _err(enc(x), ref(x), "removed") <= 1e-10
    with mt.swapped(enc):  # a plain module again: swapped as any
        assert isinstance(enc.self_attn, MultiheadAttention)


# ------------------------------------------------ an exception at any step

def _encoder():
    torch.manual_seed(0)
    return nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0,
                                                            batch_first=True),
                                 num_layers=3, enable_nested_tensor=False).eval()


def _state(model):
    return [(type(m), dict(m._forward_pre_hooks)) for m in model.modules()
            if isinstance(m, nn.MultiheadAttention)]


class _Interrupt(BaseException):
    """What a signal handler raises (as KeyboardInterrupt), at a chosen step."""


def _raising_at(monkeypatch, module, name, k):
    # module.name raises _Interrupt on its k-th call (after the call ran:
    # the step done, the next not started), once
    real = getattr(module, name)
    calls = [0]

    def step(*args, **kwargs):
        out = real(*args, **kwargs)
        calls[0] += 1
        if calls[0] == k:
            raise _Interrupt(f"{name} #{k}")
        return out
    monkeypatch.setattr(module, name, step)
    return calls


def test_an_interrupt_at_any_step_of_entering_or_leaving_leaves_the_model_as_it_was(
        monkeypatch):
    # a Ctrl-C between two steps of the swap or of its undo left ours in the
    # model, or torch's modules holding our marker hook (which keeps
    # nn.TransformerEncoderLayer off its fused kernel) for good
    import mha_ext._swap as sw
    x = torch.randn(1, 3, 16)
    steps = 0
    for name in ("sharing", "_parent", "_give_back", "restore"):
        for k in range(1, 7):
            model = _encoder()
            want = _state(model)
            with torch.no_grad():
                ref = model(x)
            with monkeypatch.context() as mp:
                calls = _raising_at(mp, sw, name, k)
                try:
                    with mt.swapped(model):
                        model(x)
                except _Interrupt:
                    steps += 1
            if calls[0] < k:
                continue  # fewer calls than k: nothing raised
            assert _state(model) == want, (name, k)
            with torch.no_grad():
                torch.testing.assert_close(model(x), ref, rtol=0, atol=0)
    assert steps >= 12


def test_leaving_runs_again_when_an_exception_stops_it_then_raises_that(monkeypatch):
    # __exit__ is C (_core._Guarded): it calls _exit, and again when an
    # exception stops it part way; the first exception is raised
    model = _encoder()
    want = _state(model)
    real = mt.swapped._exit
    calls = []

    def _exit(self):
        calls.append(1)
        if len(calls) == 1:
            raise _Interrupt("as _exit starts")
        return real(self)
    monkeypatch.setattr(mt.swapped, "_exit", _exit)
    block = mt.swapped(model)
    try:
        with block:
            assert _state(model) != want
    except _Interrupt:
        pass
    else:
        raise AssertionError("the exception was lost")
    assert len(calls) == 2 and _state(model) == want
    with block:  # usable again: the record cleared
        pass
    assert _state(model) == want


def test_a_full_backward_hook_on_the_attention_still_fires_inside_swapped():
    torch.manual_seed(0)
    attn = nn.MultiheadAttention(8, 2)
    calls = []
    attn.register_full_backward_hook(lambda m, gi, go: calls.append("hook"))

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = attn

        def forward(self, x):
            return self.attn(x, x, x)[0]
    w = Wrap()
    x = torch.randn(3, 2, 8, requires_grad=True)
    w(x).sum().backward()
    assert calls == ["hook"]
    with mt.swapped(w):
        w(x).sum().backward()
    assert calls == ["hook", "hook"]
