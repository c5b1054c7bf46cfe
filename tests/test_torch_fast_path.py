"""torch's own choice between its fused kernel and its slow path, followed
by the drop-in: where torch's nn.MultiheadAttention or
nn.TransformerEncoderLayer stays on its slow path (an odd head count, norms
of different eps, a value other than query and key), a query row that sees
no key gives torch's finite slow-path numbers, not the fused kernel's NaN;
on the fast path the is_causal hint leaves attn_mask as given.
"""
import copy

import pytest

from _support import dead_row_outputs, require_torch

torch = require_torch()
from torch import nn  # noqa: E402

from mha_ext.torch import MultiheadAttention  # noqa: E402


@pytest.mark.parametrize("nhead", [1, 3])
def test_an_encoder_layer_with_an_odd_head_count_keeps_a_dead_rows_finite_output(nhead):
    # torch's layer takes its fused path only with an even head count: with
    # an odd one its row that sees no key is finite, not the fused NaN
    torch.manual_seed(0)
    E = 6
    ref = nn.TransformerEncoderLayer(E, nhead, dim_feedforward=8, dropout=0.0,
                                     batch_first=True).eval()
    ours = copy.deepcopy(ref)
    ours.self_attn = MultiheadAttention.from_torch(ref.self_attn)
    want, got = dead_row_outputs(ref, ours, torch.randn(2, 4, E))
    assert not want.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _dead_row_case(ref, ours, **kw):
    """torch's module (or layer) and ours on a batch whose query row 1 sees
    no key: the same numbers, NaN where torch's fused kernel gives NaN"""
    torch.manual_seed(1)
    return dead_row_outputs(ref, ours, torch.randn(2, 4, 8), **kw)


def test_a_layer_whose_norms_differ_in_eps_keeps_a_dead_rows_finite_output():
    # torch's layer takes its fused path only with equal norm eps
    torch.manual_seed(0)
    ref = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).eval()
    ref.norm2.eps = 1e-3
    ours = copy.deepcopy(ref)
    ours.self_attn = MultiheadAttention.from_torch(ref.self_attn)
    want, got = _dead_row_case(ref, ours)
    assert not want.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_value_other_than_query_and_key_keeps_torchs_slow_path_result():
    # query is key but value another tensor: torch's module is off its fast
    # path, and a row that sees no key gives out_proj's bias, not NaN
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    nn.init.normal_(ref.out_proj.bias)
    ours = MultiheadAttention.from_torch(ref)
    want, got = _dead_row_case(ref, ours, value=torch.randn(2, 4, 8), need_weights=False)
    assert not want.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_is_causal_on_torchs_fast_path_leaves_the_mask_as_given():
    # torch's fast path ignores the is_causal hint and applies attn_mask
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    ours = MultiheadAttention.from_torch(ref)
    x = torch.randn(2, 4, 8)
    mask = torch.zeros(4, 4, dtype=torch.bool)
    mask[:, 0] = True                                 # not causal
    with torch.no_grad():
        want = ref(x, x, x, attn_mask=mask, need_weights=False, is_causal=True)[0]
        got = ours(x, x, x, attn_mask=mask, need_weights=False, is_causal=True)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
