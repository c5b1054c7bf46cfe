"""mha_ext.compare (issue 12, point 5): the per-layer table of a small
nn.TransformerEncoder (and of single attention modules), its text and HTML
forms, and that the model is left as it was.

Legend: B batch, S sequence length, E = d_model, H = n_heads.
"""
import numpy as np
import pytest

from _support import require_torch

torch = require_torch()
from torch import nn  # noqa: E402

import mha_ext  # noqa: E402
from mha_ext.torch import MultiheadAttention  # noqa: E402

E, H, B, S = 16, 4, 2, 6


class _Stateful(nn.Module):
    # training mode, no dropout: spectral_norm's power iteration and
    # BatchNorm's running statistics move at every call
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.utils.parametrizations.spectral_norm(nn.Linear(E, E))
        with torch.no_grad():
            self.proj.parametrizations.weight.original.mul_(torch.logspace(0, 1, E)[:, None])
        self.bn = nn.BatchNorm1d(E)
        self.att = nn.MultiheadAttention(E, H, batch_first=True)

    def forward(self, x):
        x = self.bn(self.proj(x).transpose(1, 2)).transpose(1, 2)
        return self.att(x, x, x)[0]


def test_each_run_starts_from_the_models_state_and_leaves_it_so():
    """A model whose training-mode calls change its state (buffers,
    parametrizations): every run starts where the model was, so mha_ext's
    column is mha_ext's error (against the float64 copy, as torch's), and
    the model's parameters and buffers are left as they were."""
    model = _Stateful()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    table = mha_ext.compare(model, x(B, S, E))
    for row in table:
        assert row.mha_ext_error < 1e-5 and row.torch_error < 1e-5, table
    after = model.state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    assert int(model.bn.num_batches_tracked) == 0


def test_state_that_is_untouched_written_replaced_or_lazy():
    """compare writes back only what a run changed: a backward still
    pending on an earlier output works after it, a model made under
    inference_mode compares, a buffer a run replaces by a longer one is put
    back; a lazy module not yet called is a ValueError saying so."""
    model = encoder(layers=1)
    inp = x(B, S, E)
    out = model(inp)
    mha_ext.compare(model, inp)
    out.sum().backward()                      # its saved tensors were not written
    with torch.inference_mode():
        frozen = encoder(layers=1)
    assert mha_ext.compare(frozen, inp)[-1].mha_ext_error < 1e-5

    class Grow(nn.Module):
        def __init__(self):
            super().__init__()
            self.att = nn.MultiheadAttention(E, H, batch_first=True)
            self.register_buffer("seen", torch.zeros(0, E))

        def forward(self, t):
            self.seen = torch.cat([self.seen, t.mean((0, 1))[None]])
            return self.att(t, t, t)[0] + self.seen.shape[0]
    grow = Grow().eval()
    assert mha_ext.compare(grow, inp)[-1].mha_ext_error < 1e-5
    assert grow.seen.shape == (0, E)

    class Lazy(nn.Module):
        def __init__(self):
            super().__init__()
            self.att = nn.MultiheadAttention(E, H, batch_first=True)
            self.head = nn.LazyLinear(3)

        def forward(self, t):
            return self.head(self.att(t, t, t)[0])
    with pytest.raises(ValueError, match="'head.weight' is not initialised yet.*call the model once"):
        mha_ext.compare(Lazy(), inp)


def encoder(batch_first=True, layers=2):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, batch_first=batch_first)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).eval()


def x(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1))


def test_table_of_a_transformer_encoder():
    model = encoder()
    before = [(n, id(m)) for n, m in model.named_modules()]
    table = mha_ext.compare(model, x(B, S, E))
    assert [r.layer for r in table] == ["layers.0.self_attn", "layers.1.self_attn",
                                        "(model output)"]
    for r in table:
        assert r.nan_agree
        assert 0 < r.torch_error < 1e-5 and 0 < r.mha_ext_error < 1e-5
        assert r.closer in ("torch", "mha_ext", "tie")
    assert [(n, id(m)) for n, m in model.named_modules()] == before
    text = str(table)
    assert repr(table) == text
    assert "layers.1.self_attn" in text and "max |mha_ext - truth|" in text
    htm = table._repr_html_()
    assert htm.startswith("<table>") and htm.count("<tr>") == 4


def test_masks_and_seq_first_reach_the_model():
    model = encoder(batch_first=False)
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[1, -2:] = True
    table = mha_ext.compare(model, x(S, B, E), src_key_padding_mask=kpm,
                            mask=nn.Transformer.generate_square_subsequent_mask(S) < 0)
    assert len(table) == 3 and all(r.nan_agree and r.mha_ext_error < 1e-5 for r in table)


def test_a_wrong_mha_ext_is_seen(monkeypatch):
    # the table measures our side: an error of 1e-3 in our forward shows
    orig = MultiheadAttention.forward

    def off(self, *a, **k):
        out, w = orig(self, *a, **k)
        return out + 1e-3, w

    monkeypatch.setattr(MultiheadAttention, "forward", off)
    table = mha_ext.compare(encoder(layers=1), x(B, S, E))
    assert table[0].mha_ext_error > 5e-4 and table[0].closer == "torch"


def test_nan_disagreement_is_reported(monkeypatch):
    orig = MultiheadAttention.forward

    def nan(self, *a, **k):
        out, w = orig(self, *a, **k)
        out = out.clone()
        out[0, 0, 0] = float("nan")
        return out, w

    monkeypatch.setattr(MultiheadAttention, "forward", nan)
    table = mha_ext.compare(encoder(layers=1), x(B, S, E))
    assert not table[0].nan_agree and "NO" in str(table)


def test_one_multihead_attention_module():
    torch.manual_seed(0)
    m = nn.MultiheadAttention(E, H, batch_first=True).eval()
    q, k = x(B, S, E), x(B, S + 1, E)
    table = mha_ext.compare(m, q, k, k)
    assert len(table) == 1 and table[0].layer == "MultiheadAttention"
    assert table[0].mha_ext_error < 1e-5


def test_refuses_what_it_cannot_compare():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        mha_ext.compare(np.zeros(3), 1)
    with pytest.raises(TypeError, match="no torch.nn.MultiheadAttention"):
        mha_ext.compare(nn.Linear(3, 3), x(2, 3))


def test_dropout_in_training_mode_warns():
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, 32, dropout=0.1,
                                                             batch_first=True), 1,
                                  enable_nested_tensor=False)
    with pytest.warns(UserWarning, match="model.eval()"):
        mha_ext.compare(model, x(B, S, E))


def test_import_mha_ext_does_not_import_torch():
    # compare is reached through mha_ext.compare, importing torch on first use only
    import os
    import subprocess
    import sys

    from _support import PKG_ROOT
    code = ("import sys; import mha_ext; assert 'torch' not in sys.modules; "
            "f = mha_ext.compare; assert 'torch' in sys.modules and callable(f)")
    env = dict(os.environ, PYTHONPATH=PKG_ROOT)  # keeps CI's preloads (ASan)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env=env)


def test_a_layer_a_run_never_called_is_said_so():
    """A model that branches around its attention in one run (here on the
    exact type, so not with ours) gets a row saying which run never called
    the layer, not NaN errors with "NaN agree NO"; and compare refuses ours
    itself, which it would compare with itself."""
    class Exact(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(E, H, batch_first=True)

        def forward(self, x):
            if type(self.attn) is nn.MultiheadAttention:
                return self.attn(x, x, x, need_weights=False)[0]
            return x

    torch.manual_seed(6)
    table = mha_ext.compare(Exact().eval(), x(B, S, E))
    row = table[0]
    assert row.layer == "attn" and row.closer == "not called by mha_ext"
    assert np.isnan(row.torch_error) and np.isnan(row.mha_ext_error)
    assert "not called by mha_ext" in str(table) and " NO " not in str(table)
    with pytest.raises(TypeError, match="mha_ext's MultiheadAttention already"):
        mha_ext.compare(MultiheadAttention(E, H), x(B, S, E), x(B, S, E), x(B, S, E))


class _Interrupt(BaseException):
    """What a signal handler raises (as KeyboardInterrupt), at a chosen step."""


def test_an_interrupt_at_any_step_leaves_the_model_as_it_was(monkeypatch):
    # compare's promise, "the model is left as it was", under a Ctrl-C:
    # one stopping its last restore left a BatchNorm's statistics moved by
    # the runs (later eval outputs 0.03 off), one right after a capture
    # hook's registration left the hook on the attention (torch's encoder
    # layer then off its fused kernel)
    import mha_ext._compare as C
    from torch import nn

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.MultiheadAttention(8, 2, batch_first=True)
            self.bn = nn.BatchNorm1d(8)

        def forward(self, x):
            y = self.a(x, x, x)[0]
            return self.bn(y.transpose(1, 2)).transpose(1, 2)
    x = torch.randn(2, 5, 8)
    stopped = 0
    for step, before in (("_restore", True), ("_capture", False), ("_uncapture", False),
                         ("_first", False)):
        for k in range(1, 5):
            torch.manual_seed(0)
            m = Model()  # training mode: the runs move bn's statistics
            want = {n: t.clone() for n, t in m.state_dict().items()}
            rng = torch.get_rng_state()
            real, calls = getattr(C, step), [0]

            def patched(*args, real=real, calls=calls, k=k, before=before):
                calls[0] += 1
                if before and calls[0] == k:
                    raise _Interrupt(step)
                out = real(*args)
                if not before and calls[0] == k:
                    raise _Interrupt(step)
                return out
            with monkeypatch.context() as mp:
                mp.setattr(C, step, patched)
                try:
                    mha_ext.compare(m, x)
                except _Interrupt:
                    stopped += 1
            for n, t in m.state_dict().items():
                assert torch.equal(t, want[n]), (step, k, n)
            assert not m.a._forward_hooks, (step, k)
            assert torch.equal(torch.get_rng_state(), rng), (step, k)
    assert stopped >= 8


class _Noisy(nn.Module):
    """draws from torch's generator in eval mode (in float32, cast: the
    float64 copy then draws the same numbers)"""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2)

    def forward(self, x):
        x = x + 0.5 * torch.randn(x.shape).to(x.dtype)
        return self.attn(x, x, x)[0]


class _TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2)

    def forward(self, x, memory=None):
        return self.attn(x, memory, memory)[0]


def test_the_float64_truth_draws_what_the_runs_draw_and_takes_keyword_tensors():
    # the truth run starts from the same generator state as the others (a
    # model drawing in eval mode showed a 0.35 error for both columns), and
    # a floating tensor passed by keyword is made float64 for it too (was
    # "mat1 and mat2 must have the same dtype")
    torch.manual_seed(0)
    x = torch.randn(4, 2, 8)
    for row in mha_ext.compare(_Noisy().eval(), x):
        assert row.mha_ext_error < 1e-5 and row.torch_error < 1e-5, row
    for row in mha_ext.compare(_TwoInputs().eval(), x, memory=torch.randn(5, 2, 8)):
        assert row.mha_ext_error < 1e-5 and row.torch_error < 1e-5, row
