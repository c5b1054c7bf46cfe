"""mha_ext.torch.MultiheadAttention: rules a second mutation-testing round
of mha_ext/_torch_mha.py found no test holding (a mutant of each passed
every tests/test_torch_*.py), each checked against torch's own
nn.MultiheadAttention / nn.TransformerEncoderLayer: which calls from a
TransformerEncoderLayer torch's fused layer kernel would take (a query row
that sees no key is NaN there, finite elsewhere; the suite caught some of
these mutants only through side effects or its slowest file), our
is_causal="lower_right" with add_bias_kv / add_zero_attn (the appended keys
stay visible: torch's module with the pattern as a bool attn_mask), and
meta inputs with a module partly on the meta device.

Legend: B batch, L query length, S key length, E = embed_dim, H = num_heads.
"""
import copy

import pytest

from _support import dead_row_outputs, require_torch

torch = require_torch()
from torch import nn  # noqa: E402

from mha_ext.torch import MultiheadAttention  # noqa: E402

E, H, B, L = 8, 2, 2, 4


def _layer_pair(batch_first=True, **kw):
    """torch's encoder layer (dropout 0) and a copy holding our attention."""
    torch.manual_seed(0)
    ref = nn.TransformerEncoderLayer(E, H, 16, dropout=0.0, batch_first=batch_first, **kw)
    ours = copy.deepcopy(ref)
    ours.self_attn = MultiheadAttention.from_torch(ref.self_attn)
    return ref, ours


def _same(got, want):
    assert got.isnan().eq(want.isnan()).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("mode", ["train no_grad", "train", "eval grad"])
def test_a_layer_off_its_fused_kernel_for_training_or_grad_keeps_a_dead_row_finite(mode):
    # torch's layer fuses only in eval with nothing to record: in training
    # (with grad mode off too), or with gradients to record, its row that
    # sees no key is finite
    ref, ours = _layer_pair()
    x = torch.randn(B, L, E, generator=torch.Generator().manual_seed(1))
    for m in (ref, ours):
        m.train(mode.startswith("train"))
    want, got = dead_row_outputs(ref, ours, x, grad=mode != "train no_grad")
    assert not want.isnan().any()
    _same(got.detach(), want.detach())


def test_a_sequence_first_layer_keeps_a_dead_row_finite():
    # torch's layer fuses only with batch_first=True
    ref, ours = _layer_pair(batch_first=False)
    ref.eval(), ours.eval()
    x = torch.randn(L, B, E, generator=torch.Generator().manual_seed(1))
    want, got = dead_row_outputs(ref, ours, x)
    assert not want.isnan().any()
    _same(got, want)


def test_a_fusing_layer_gives_its_kernels_nan_for_a_dead_row():
    # the counterpart: eval, no grad, batch first, even heads: torch's
    # fused layer kernel gives NaN for the row, and so does ours
    ref, ours = _layer_pair()
    ref.eval(), ours.eval()
    x = torch.randn(B, L, E, generator=torch.Generator().manual_seed(1))
    want, got = dead_row_outputs(ref, ours, x)
    assert want.isnan().any()
    _same(got, want)


# ------------------------------------------- is_causal="lower_right" with extra keys

@pytest.mark.parametrize("extra", [dict(add_bias_kv=True), dict(add_zero_attn=True),
                                   dict(add_bias_kv=True, add_zero_attn=True)],
                         ids=["bias_kv", "zero_attn", "both"])
@pytest.mark.parametrize("lq, lk", [(4, 4), (3, 5), (5, 3)], ids=["L=S", "L<S", "L>S"])
@pytest.mark.parametrize("need_weights", [False, True])
def test_lower_right_causality_leaves_bias_k_and_the_zero_key_visible(extra, lq, lk,
                                                                      need_weights):
    # ours alone takes is_causal="lower_right": the pattern over the S keys
    # given, the appended bias_k / zero key seen by every query; torch's
    # module gives the same with the pattern as a bool attn_mask (it pads
    # the mask with a visible column per appended key)
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, dtype=torch.float64, **extra)
    nn.init.normal_(ref.in_proj_bias), nn.init.normal_(ref.out_proj.bias)
    ours = MultiheadAttention.from_torch(ref)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(lq, B, E, dtype=torch.float64, generator=g)
    kv = torch.randn(lk, B, E, dtype=torch.float64, generator=g)
    blocked = torch.ones(lq, lk, dtype=torch.bool).triu(lk - lq + 1)
    want = ref(q, kv, kv, attn_mask=blocked, need_weights=need_weights)
    got = ours(q, kv, kv, need_weights=need_weights, is_causal="lower_right")
    torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=1e-10)
    if need_weights:
        torch.testing.assert_close(got[1], want[1], rtol=1e-10, atol=1e-10)


# ------------------------------------------------------------- the meta device

def test_meta_inputs_and_a_module_partly_on_the_meta_device_are_refused_as_torch():
    # torch's module raises a RuntimeError (a CPU parameter with meta
    # tensors); ours too, also our ValueError, whichever parameter is meta
    for on_meta in ("out_proj", "none"):
        t, m = nn.MultiheadAttention(E, H), MultiheadAttention(E, H)
        if on_meta == "out_proj":
            t.out_proj.to("meta"), m.out_proj.to("meta")
        q = torch.empty(L, B, E, device="meta")
        with pytest.raises(RuntimeError):
            t(q, q, q)
        with pytest.raises(ValueError, match="meta device and the parameters are not"):
            m(q, q, q)
        with pytest.raises(RuntimeError):
            m(q, q, q)
