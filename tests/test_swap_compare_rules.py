"""mha_ext.torch.swapped and mha_ext.compare (mha_ext._swap, mha_ext._compare):
the rules mutation testing of those files found no test holding (a mutant
of each passed the tests before).  swapped: mha_ext's own modules left
out with a RuntimeWarning (a nested block too), a module under two names
swapped by one module of ours, a parametrized subclass refused as a
subclass, the attention module itself refused, a block entered twice
refused while a finished one (a decorator) runs again, a failed
construction not warning "never entered", bias_k kept, the marker
pre-hook keeping nn.TransformerEncoderLayer on mha_ext and gone after the
block.  compare: a NaN only the float64 truth has left out of the errors,
an all-NaN output a tie with error 0, a shape only mha_ext's run changes
"n/a", dropout warned of in training mode only, torch's random state left
as it was, the dtype named, dict and nested outputs, an int NumPy input
kept int for the float64 copy (docs/API.md §8).

Legend: B batch, S sequence length, E width, H heads.
"""
import gc
import math
import warnings

import numpy as np
import pytest

import mha_ext
from _support import require_torch

torch = require_torch()
from torch import nn  # noqa: E402

import mha_ext.torch as mt  # noqa: E402
from mha_ext.torch import MultiheadAttention  # noqa: E402

E, H, B, S = 8, 2, 2, 5


def _x(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(dtype)


class _One(nn.Module):
    """att (torch's module made under seed 0, by default) on x as query,
    key and value; the models below change forward only."""

    def __init__(self, att=None):
        super().__init__()
        torch.manual_seed(0)
        self.att = att if att is not None else nn.MultiheadAttention(E, H, batch_first=True)

    def forward(self, x):
        return self.att(x, x, x)[0]


# ---------------------------------------------------------------- swapped

def test_a_model_of_mha_ext_modules_is_left_alone_with_a_warning():
    model = _One(MultiheadAttention(E, H, batch_first=True))
    att = model.att
    with pytest.warns(RuntimeWarning, match="mha_ext's already"):
        with mt.swapped(model):
            assert model.att is att
    assert model.att is att


def test_a_nested_block_warns_and_changes_nothing():
    model = _One()
    orig = model.att
    with mt.swapped(model):
        inner = model.att
        assert isinstance(inner, MultiheadAttention)
        with pytest.warns(RuntimeWarning, match="mha_ext's already"):
            with mt.swapped(model):
                assert model.att is inner
        assert model.att is inner
    assert model.att is orig and type(orig) is nn.MultiheadAttention


def test_a_model_without_attention_warns_holds_no():
    with pytest.warns(RuntimeWarning, match="holds no torch.nn.MultiheadAttention"):
        with mt.swapped(nn.Linear(3, 3)):
            pass


def test_one_module_under_two_names_is_one_module_of_ours():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.MultiheadAttention(E, H, batch_first=True)
            self.b = self.a

        def forward(self, x):
            return self.b(self.a(x, x, x)[0], x, x)[0]

    torch.manual_seed(0)
    model = Twice().eval()
    orig = model.a
    x = _x(B, S, E)
    with torch.no_grad():
        want = model(x)
        with mt.swapped(model):
            assert model.a is model.b and isinstance(model.a, MultiheadAttention)
            got = model(x)
    assert model.a is orig and model.b is orig
    assert list(orig._forward_pre_hooks.values()) == []
    assert (got - want).abs().max() < 1e-5


class _Scale(nn.Module):
    def forward(self, w):
        return 2 * w


def test_a_parametrized_subclass_is_refused_as_a_subclass():
    class Mine(nn.MultiheadAttention):
        pass

    torch.manual_seed(0)
    model = _One(Mine(E, H, batch_first=True))
    nn.utils.parametrize.register_parametrization(model.att, "in_proj_weight", _Scale())
    att = model.att
    with pytest.raises(TypeError, match="subclass of torch.nn.MultiheadAttention"):
        with mt.swapped(model):
            pass
    assert model.att is att


def test_a_second_parametrization_registered_inside_the_block_stays():
    torch.manual_seed(0)
    model = _One().double().eval()
    P = nn.utils.parametrize
    P.register_parametrization(model.att, "in_proj_weight", _Scale())
    x = _x(B, S, E, dtype=torch.float64)
    with mt.swapped(model):
        P.register_parametrization(model.att, "in_proj_bias", _Scale())
        with torch.no_grad():
            inside = model(x)
    att = model.att
    assert type(att) is not nn.MultiheadAttention and isinstance(att, nn.MultiheadAttention)
    assert P.is_parametrized(att, "in_proj_bias")
    assert torch.equal(att.in_proj_bias, 2 * att.parametrizations.in_proj_bias.original)
    with torch.no_grad():
        assert (model(x) - inside).abs().max() < 1e-10


def test_the_attention_module_itself_is_refused():
    with pytest.raises(TypeError, match="from_torch"):
        with mt.swapped(nn.MultiheadAttention(E, H)):
            pass


def test_a_block_entered_twice_is_refused_a_finished_one_runs_again():
    model = _One()
    orig = model.att
    block = mt.swapped(model)
    with block:
        with pytest.raises(RuntimeError, match="already entered"):
            block.__enter__()
        assert isinstance(model.att, MultiheadAttention)
    assert model.att is orig
    seen = []

    @mt.swapped(model)
    def run():
        seen.append(type(model.att))

    run()
    run()
    assert seen == [MultiheadAttention, MultiheadAttention]
    assert model.att is orig


def test_a_swapped_that_failed_to_construct_does_not_warn_never_entered():
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with pytest.raises(TypeError, match="torch.nn.Module"):
            mt.swapped(3)
        gc.collect()
    assert not [m for m in w if "never entered" in str(m.message)]
    with pytest.warns(RuntimeWarning, match="never entered"):
        mt.swapped(_One())
        gc.collect()


def test_the_marker_keeps_the_encoder_layer_on_mha_ext_and_leaves_with_the_block(
        monkeypatch):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, 16, dropout=0.0, batch_first=True).eval()
    calls = []
    orig_fwd = MultiheadAttention.forward

    def counting(self, *a, **k):
        calls.append(1)
        return orig_fwd(self, *a, **k)

    monkeypatch.setattr(MultiheadAttention, "forward", counting)
    x = _x(B, S, E)
    with torch.no_grad():
        want = layer(x)
        with mt.swapped(layer):
            got = layer(x)
    assert calls == [1]
    assert (got - want).abs().max() < 1e-5
    assert list(layer.self_attn._forward_pre_hooks.values()) == []


def test_bias_kv_attention_swapped_computes_as_torch():
    torch.manual_seed(0)
    model = _One(nn.MultiheadAttention(E, H, add_bias_kv=True, batch_first=True)).eval()
    x = _x(B, S, E, dtype=torch.float64)
    model.double()
    with torch.no_grad():
        want = model(x)
        with mt.swapped(model):
            assert model.att.bias_k is not None
            got = model(x)
    assert (got - want).abs().max() < 1e-10


# ---------------------------------------------------------------- compare

class _Float64Nan(_One):
    """NaN in the float64 copy's output only (at [0, 0, 0])."""

    def forward(self, x):
        out = self.att(x, x, x)[0].clone()
        if out.dtype == torch.float64:
            out[0, 0, 0] = math.nan
        return out


def test_a_nan_only_the_truth_has_is_left_out_of_the_errors():
    row = mha_ext.compare(_Float64Nan().eval(), _x(B, S, E))[-1]
    assert not row.nan_agree
    assert 0 < row.torch_error < 1e-5 and 0 < row.mha_ext_error < 1e-5, row


class _AllNan(_One):
    def forward(self, x):
        return self.att(x, x, x)[0] * math.nan


def test_an_all_nan_output_is_a_tie_with_error_zero():
    row = mha_ext.compare(_AllNan().eval(), _x(B, S, E))[-1]
    assert row == ("(model output)", 0.0, 0.0, True, "tie")


def test_a_shape_only_mha_ext_changes_is_not_applicable(monkeypatch):
    orig = MultiheadAttention.forward

    def short(self, *a, **k):
        out, w = orig(self, *a, **k)
        return out[:, :-1], w

    monkeypatch.setattr(MultiheadAttention, "forward", short)
    table = mha_ext.compare(_One().eval(), _x(B, S, E))
    for row in table:
        assert row.closer == "n/a" and not row.nan_agree, row
        assert math.isnan(row.torch_error) and math.isnan(row.mha_ext_error)
    lines = str(table).splitlines()[3:]
    assert lines and all(" NO " not in ln and " - " in ln for ln in lines), str(table)


def test_dropout_warns_in_training_mode_only_and_only_when_positive():
    x = _x(B, S, E)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = _One(nn.MultiheadAttention(E, H, dropout=0.3, batch_first=True)).eval()
        mha_ext.compare(model, x)
        mha_ext.compare(_One().train(), x)  # training, dropout 0.0
    with pytest.warns(UserWarning, match="att is in training mode with dropout 0.3"):
        mha_ext.compare(model.train(), x)


def test_dropout_warning_names_the_module_holding_an_nn_dropout():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, 16, dropout=0.2, batch_first=True)
    layer.self_attn.dropout = 0.0
    model = nn.Sequential(layer).train()
    with pytest.warns(UserWarning, match=r"^mha_ext.compare: 0 is in training mode "
                                         r"with dropout 0.2"):
        mha_ext.compare(model, _x(B, S, E))


class _Draws(_One):
    def forward(self, x):
        x = x + torch.randn(x.shape).to(x.dtype)
        return self.att(x, x, x)[0]


def test_torchs_random_state_is_left_as_it_was():
    model = _Draws().eval()
    torch.manual_seed(5)
    rng = torch.get_rng_state()
    table = mha_ext.compare(model, _x(B, S, E))
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(r.mha_ext_error < 1e-5 for r in table), table


def test_the_dtype_is_the_models_and_a_float64_model_compares():
    model = _One().double().eval()
    table = mha_ext.compare(model, _x(B, S, E, dtype=torch.float64))
    assert table.dtype == "float64" and "float64 runs" in str(table)
    assert all(r.mha_ext_error < 1e-10 for r in table), table
    assert mha_ext.compare(_One().eval(), _x(B, S, E)).dtype == "float32"


class _DictOut(_One):
    def forward(self, x):
        return {"hidden": self.att(x, x, x)[0], "n": 3}


def test_a_dict_output_is_compared_on_its_first_tensor():
    row = mha_ext.compare(_DictOut().eval(), _x(B, S, E))[-1]
    assert row.layer == "(model output)" and row.closer in ("torch", "mha_ext", "tie")
    assert 0 < row.torch_error < 1e-5 and 0 < row.mha_ext_error < 1e-5, row


def test_compare_refuses_mha_exts_own_module():
    with pytest.raises(TypeError, match="mha_ext's MultiheadAttention already"):
        mha_ext.compare(MultiheadAttention(E, H, batch_first=True), _x(B, S, E))


class _NestedOut(_One):
    """returns a ragged nested tensor (sequence 1 one step shorter)"""

    def forward(self, x):
        out = self.att(x, x, x)[0]
        return torch.nested.nested_tensor([out[0], out[1, :-1]])


def test_a_nested_output_is_compared_padded():
    row = mha_ext.compare(_NestedOut().eval(), _x(B, S, E))[-1]
    assert row.nan_agree and row.closer in ("torch", "mha_ext", "tie"), row
    assert 0 < row.torch_error < 1e-5 and 0 < row.mha_ext_error < 1e-5, row


class _Gather(_One):
    """takes the positions to keep as a NumPy int array"""

    def forward(self, x, keep):
        out = self.att(x, x, x)[0]
        return out[:, torch.from_numpy(keep)]


def test_an_int_array_input_stays_int_for_the_float64_copy():
    row = mha_ext.compare(_Gather().eval(), _x(B, S, E), keep=np.array([0, 2, 3]))[-1]
    assert 0 < row.torch_error < 1e-5 and 0 < row.mha_ext_error < 1e-5, row


class _NanScale(_One):
    """a parameter holding a NaN, saved for the backward of its product"""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(E))
        with torch.no_grad():
            self.scale[0] = math.nan

    def forward(self, x):
        return self.att(x, x, x)[0] * self.scale


def test_a_nan_parameter_left_alone_is_not_written_back():
    model = _NanScale().eval()
    x = _x(B, S, E)
    out = model(x)
    table = mha_ext.compare(model, x)
    assert table[-1].nan_agree
    out.sum().backward()  # the saved scale was not written
    assert model.scale.grad is not None
