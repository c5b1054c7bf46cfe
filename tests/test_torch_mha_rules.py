"""mha_ext.torch.MultiheadAttention: the rules mutation testing of
mha_ext/_torch_mha.py found no test holding (a mutant of each passed the
suite before), each against torch.nn.MultiheadAttention where torch has the
rule, or against docs/API.md: a vdim alone differing from embed_dim,
from_torch's copy of dropout and its refusal of another module, the shared
C modules kept for the 64 configurations used last, the calls torch's
module keeps off its fused path (value another tensor, a float
key_padding_mask, bias=False, unbatched, add_zero_attn: a dead row's
output and the memory layout), an empty query's weights there, the
is_causal hint on the meta device, the mismatched-masks warning, and one
of in_proj_bias / out_proj.bias set to None.

Legend: B batch, L query length, S key length, E = embed_dim, H = num_heads.
"""
import pytest

from _support import require_torch

torch = require_torch()
from torch import nn  # noqa: E402

from mha_ext.torch import MultiheadAttention  # noqa: E402

from test_torch_mha_surface import (B, DTYPES, E, H, L, S, TOL, call_both,  # noqa: E402
                                    close, pair)


def x(*shape, dtype=torch.float64, seed=1):
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- construction

@pytest.mark.parametrize("kw", [dict(vdim=5), dict(kdim=3)], ids=["vdim", "kdim"])
def test_one_of_kdim_and_vdim_differing_gives_separate_projections_as_torch(kw):
    torch.manual_seed(0)
    t = nn.MultiheadAttention(E, H, **kw)
    torch.manual_seed(0)
    m = MultiheadAttention(E, H, **kw)
    assert m._qkv_same_embed_dim == t._qkv_same_embed_dim is False
    assert list(m.state_dict()) == list(t.state_dict())
    for (n, a), b in zip(t.state_dict().items(), m.state_dict().values()):
        assert a.shape == b.shape and torch.equal(a, b), n


@DTYPES
@pytest.mark.parametrize("kw", [dict(vdim=5), dict(kdim=3)], ids=["vdim", "kdim"])
def test_one_of_kdim_and_vdim_differing_computes_as_torch(dtype, kw):
    t, m = pair(dtype, **kw)
    q = x(L, B, E, dtype=dtype)
    k, v = x(S, B, t.kdim, dtype=dtype, seed=2), x(S, B, t.vdim, dtype=dtype, seed=3)
    call_both(t, m, q, k, v, dtype=dtype)
    call_both(t, m, q, k, v, dtype=dtype, need_weights=False)


# ---------------------------------------------------------------- from_torch

@pytest.mark.parametrize("training", [True, False])
def test_from_torch_copies_dropout(training):
    t = nn.MultiheadAttention(E, H, dropout=0.25).train(training)
    m = MultiheadAttention.from_torch(t)
    assert m.dropout == t.dropout == 0.25
    assert m.training == t.training


def test_from_torch_copy_in_training_drops_as_torchs_would():
    # torch's module with dropout 1 in training zeroes every weight: the
    # output is out_proj.bias (torch's weights path: dropout on the weights)
    t, _ = pair(dropout=1.0)
    t.train()
    q = x(L, B, E)
    want = t(q, q, q)[0].detach()
    got = MultiheadAttention.from_torch(t)(q, q, q)[0].detach()
    assert float((got - want).abs().max()) <= TOL[torch.float64]


@pytest.mark.parametrize("other", [nn.Linear(E, E), nn.TransformerEncoderLayer(E, H)],
                         ids=["Linear", "TransformerEncoderLayer"])
def test_from_torch_refuses_another_module_with_a_type_error(other):
    with pytest.raises(TypeError, match="from_torch expects a torch.nn.MultiheadAttention"):
        MultiheadAttention.from_torch(other)


# ---------------------------------------------------------------- shared cores

def test_the_shared_cores_keep_exactly_the_configurations_used_last():
    # docs/API.md: the C module doing a call's work is kept "for the 64
    # configurations used last": one used between the others survives more
    # than 64 other configurations, and no more than 64 are kept
    from mha_ext import _torch_mha
    q = torch.randn(1, 3, 8)
    first = MultiheadAttention(8, 2, batch_first=True)
    first(q, q, q)
    core = first._core(torch.float32)
    n = 0
    for heads in (1, 2, 4, 8):
        for kdim in range(1, 21):  # 80 other configurations
            m = MultiheadAttention(8, heads, batch_first=True, kdim=kdim)
            m(q, torch.randn(1, 3, kdim), q)
            first(q, q, q)
            n += 1
    assert n > _torch_mha._KEEP
    assert first._core(torch.float32) is core
    assert len(_torch_mha._CORES) == _torch_mha._KEEP == 64


# ---------------------------------------------------------------- torch's paths

def _dead_row_case(case):
    """(module kwargs, call args, call kwargs): batch 1 (or the unbatched
    call's every query) sees no key, need_weights=False, eval, no grad."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, S, E, dtype=torch.float64, generator=g)  # self-attention: L = S
    v = torch.randn(B, S, E, dtype=torch.float64, generator=g)
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[1] = True
    fpad = torch.zeros(B, S, dtype=torch.float64)
    fpad[1] = float("-inf")
    return {
        "value_differs": ({}, (q, q, v), dict(key_padding_mask=pad)),
        "float_key_padding_mask": ({}, (q, q, q), dict(key_padding_mask=fpad)),
        "bias_false": (dict(bias=False), (q, q, q), dict(key_padding_mask=pad)),
        "unbatched": ({}, (q[0],) * 3, dict(key_padding_mask=pad[1])),  # one tensor
        "add_zero_attn": (dict(add_zero_attn=True), (q, q, q), dict(key_padding_mask=pad)),
        "odd_heads": (dict(heads=1), (q, q, q), dict(key_padding_mask=pad)),
    }[case]


@pytest.mark.parametrize("case", ["value_differs", "float_key_padding_mask", "bias_false",
                                  "unbatched", "add_zero_attn", "odd_heads"])
def test_calls_off_torchs_fused_path_give_its_unfused_results_and_layout(case):
    # torch's module takes its fused path (NaN for a row that sees no key,
    # a contiguous (B, L, E)) only for batched self-attention with query,
    # key and value one tensor, no float mask, biases, no add_zero_attn,
    # an even num_heads;
    # elsewhere its SDPA path: out_proj.bias for the row, (L, B, E) memory
    kw, args, call = _dead_row_case(case)
    t, m = pair(batch_first=True, **kw)
    t.eval(), m.eval()
    with torch.no_grad():
        a, b = call_both(t, m, *args, need_weights=False, **call)
    assert a[0].stride() == b[0].stride()
    assert torch.isnan(b[0]).any() == torch.isnan(a[0]).any()


@pytest.mark.parametrize("kw,batch_first", [({}, False), (dict(add_zero_attn=True), True),
                                            (dict(bias=False), True)],
                         ids=["seq_first", "zero_attn", "no_bias"])
def test_an_empty_query_off_torchs_fused_path_returns_torchs_empty_weights(kw, batch_first):
    # torch's fused path returns no weights for an empty query; its unfused
    # path returns them, (B, 0, S): so does the drop-in, path by path
    t, m = pair(batch_first=batch_first, **kw)
    t.eval(), m.eval()
    q = x(B, 0, E) if batch_first else x(0, B, E)
    with torch.no_grad():
        a, b = call_both(t, m, q, q, q)
    assert a[1] is not None and b[1] is not None and a[1].shape == b[1].shape


# ---------------------------------------------------------------- the hint, warnings

def test_the_is_causal_hint_without_attn_mask_on_the_meta_device_is_torchs_error():
    q = torch.empty(L, B, E, device="meta")
    t = nn.MultiheadAttention(E, H, device="meta")
    m = MultiheadAttention(E, H, device="meta")
    with pytest.raises(RuntimeError, match="Need attn_mask"):
        t(q, q, q, is_causal=True)
    with pytest.raises(RuntimeError, match="Need attn_mask"):
        m(q, q, q, is_causal=True)
    causal = torch.ones(L, L, dtype=torch.bool, device="meta").triu(1)
    assert m(q, q, q, attn_mask=causal, is_causal=True)[0].shape == \
        t(q, q, q, attn_mask=causal, is_causal=True)[0].shape


@pytest.mark.parametrize("batch_first", [False, True])
def test_masks_of_different_dtypes_give_torchs_deprecation_warning(batch_first):
    t, m = pair(batch_first=batch_first)
    q = x(B, L, E) if batch_first else x(L, B, E)
    kpm = torch.zeros(B, L, dtype=torch.bool)
    am = torch.zeros(L, L, dtype=torch.float64)
    for mod in (t, m):
        with pytest.warns(UserWarning, match="mismatched key_padding_mask and attn_mask"):
            mod(q, q, q, key_padding_mask=kpm, attn_mask=am)


# ---------------------------------------------------------------- one bias removed

@DTYPES
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("which", ["in_proj_bias", "out_proj.bias"])
def test_one_of_the_two_biases_set_to_none_computes_as_torch(which, batch_first, dtype):
    # torch's functional takes in_proj_bias and out_proj.bias separately,
    # either may be None: the output, weights and input gradient are torch's
    t, m = pair(dtype, batch_first=batch_first)
    for mod in (t, m):
        if which == "in_proj_bias":
            mod.in_proj_bias = None
        else:
            mod.out_proj.bias = None
    q = x(B, L, E, dtype=dtype).requires_grad_()
    a, b = call_both(t, m, q, q, q, dtype=dtype)
    ga, = torch.autograd.grad(a[0].sum(), q)
    gb, = torch.autograd.grad(b[0].sum(), q)
    close(ga, gb, dtype)


# ---------------------------------------------------------------- a global swap

@pytest.fixture
def swapped_globally(monkeypatch):
    """torch.nn.MultiheadAttention replaced by the drop-in everywhere torch
    names it (the usual way to try a drop-in class on code one did not
    write): yields torch's own class."""
    import torch.nn.modules.activation as activation
    import torch.nn.modules.transformer as transformer
    stock = nn.MultiheadAttention
    for where in (nn, torch.nn.modules, activation, transformer):
        monkeypatch.setattr(where, "MultiheadAttention", MultiheadAttention)
    return stock


def test_a_global_swap_keeps_torchs_refusals_and_the_meta_device(swapped_globally):
    # mha_ext ran nn.MultiheadAttention, looked up at the call, as torch's
    # reference: after the swap that was the drop-in itself (a plain
    # ValueError without torch's message, a RecursionError on meta, a
    # message nesting "(torch: ..." a hundred times)
    m = MultiheadAttention(E, H)
    q = x(L, B, E)
    with pytest.raises(AssertionError, match="expected `key` and `value` to be 3-D"):
        m(q, x(S, E), q)
    with pytest.raises(AssertionError, match="embed_dim must be divisible by num_heads"):
        MultiheadAttention(6, 4)
    meta = MultiheadAttention(E, H, device="meta")
    qm = torch.empty(L, B, E, device="meta")
    out, w = meta(qm, qm, qm)
    assert out.shape == (L, B, E) and w.shape == (B, L, L)
    nt = torch.nested.nested_tensor([x(4, 10), x(6, 10)], layout=torch.jagged)
    with pytest.raises(AssertionError) as info:
        MultiheadAttention(10, 5, batch_first=True).eval()(nt, nt, nt)
    assert str(info.value).count("(torch:") <= 1 and len(str(info.value)) < 2000


def test_a_global_swap_leaves_from_torch_and_torchs_layers_to_torchs_class(swapped_globally):
    torch.manual_seed(0)
    stock = swapped_globally(E, H, dtype=torch.float64)  # made before the swap
    ours = MultiheadAttention.from_torch(stock)
    q = x(L, B, E)
    close(stock(q, q, q)[0], ours(q, q, q)[0], torch.float64)
    # a layer built after the swap holds the drop-in, and computes torch's numbers
    torch.manual_seed(1)
    layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=16, dropout=0.0,
                                       dtype=torch.float64)
    assert type(layer.self_attn) is MultiheadAttention
    ref = nn.TransformerEncoderLayer(E, H, dim_feedforward=16, dropout=0.0,
                                     dtype=torch.float64)
    ref.self_attn = swapped_globally(E, H, dtype=torch.float64)
    ref.load_state_dict(layer.state_dict())
    close(ref(q), layer(q), torch.float64)


@pytest.mark.parametrize("bad, torchs_words", [
    (dict(attn_mask=torch.zeros(7, 7, dtype=torch.float64)), "The shape of the 2D attn_mask is"),
    (dict(key_padding_mask=torch.zeros(B, 7, dtype=torch.bool)),
     "Expected key_padded_mask.shape[1] to be"),
])
def test_a_global_swap_of_the_functional_too_says_torchs_words_once(
        swapped_globally, monkeypatch, bad, torchs_words):
    # the probe runs torch's module in eval mode without grad, and its
    # forward calls F.multi_head_attention_forward: swapped, that was
    # mha_ext's, whose refusal already held torch's words, said twice
    import mha_ext.torch as mt
    monkeypatch.setattr(torch.nn.functional, "multi_head_attention_forward",
                        mt.multi_head_attention_forward)
    m = MultiheadAttention(E, H, dtype=torch.float64).eval()
    q = x(L, B, E)
    with torch.no_grad(), pytest.raises(ValueError) as info:
        m(q, q, q, **bad)
    said = str(info.value)
    assert said.count("(torch:") == 1 and said.count(torchs_words) == 1, said
    assert isinstance(info.value, (AssertionError, RuntimeError))
