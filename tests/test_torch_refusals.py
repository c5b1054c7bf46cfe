"""mha_ext.torch's refusals against torch's own: where torch refuses the
same arguments, ours is also of torch's exception type and quotes its
message (docs/API.md §7), on each of torch's paths (its slow path's
assertions, its fused fast path's RuntimeErrors, the is_causal hint's
rank check), and stays ours alone where torch has no such call.

Legend: B batch, L query length, S key length, E = embed_dim, H = num_heads.
"""
import pytest

from _support import require_torch

torch = require_torch()
from torch import nn  # noqa: E402

import mha_ext  # noqa: E402
import mha_ext.torch as mt  # noqa: E402
from mha_ext.torch import MultiheadAttention  # noqa: E402
from test_torch_mha_surface import B, E, H, L, S, pair  # noqa: E402


def _torch_refusal(fn):
    try:
        fn()
    except (AssertionError, RuntimeError) as exc:
        return exc
    raise AssertionError("torch took these arguments")


BAD_CALLS = {
    "3-D query, 2-D key": lambda q: (q, q[0], q),
    "3-D query, 2-D value": lambda q: (q, q, q[0]),
    "1-D key_padding_mask": lambda q: (q, q, q, torch.zeros(S, dtype=torch.bool)),
    "1-D attn_mask": lambda q: (q, q, q, None, True, torch.zeros(S, dtype=torch.bool)),
    "2-D attn_mask of another shape": lambda q: (q, q, q, None, True,
                                                  torch.zeros(3, 3, dtype=torch.bool)),
    "3-D attn_mask of another shape": lambda q: (q, q, q, None, True,
                                                  torch.zeros(2, L, L, dtype=torch.bool)),
    "int attn_mask": lambda q: (q, q, q, None, True, torch.zeros(L, L, dtype=torch.int64)),
    "2-D query, 3-D key": lambda q: (q[:, 0], q, q),
    # torch checks the padding mask's dtype before the hint's missing mask
    "uint8 key_padding_mask, is_causal without attn_mask": lambda q: (
        q, q, q, torch.zeros(B, L, dtype=torch.uint8), True, None, True, True),
}


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_what_torch_refuses_is_refused_with_torchs_type_and_message_too(case, batch_first):
    """torch's own tests catch AssertionError / RuntimeError with its
    messages: ours is also of that type and quotes torch's message, and
    still the ValueError or TypeError of API.md §7."""
    t, m = pair(batch_first=batch_first)
    q = torch.randn((B, L, E) if batch_first else (L, B, E), dtype=torch.float64)
    args = BAD_CALLS[case](q)
    theirs = _torch_refusal(lambda: t(*args))
    with pytest.raises(type(theirs)) as got:
        m(*args)
    assert isinstance(got.value, (ValueError, TypeError))
    assert str(theirs) in str(got.value)


FAST_PATH_BAD = {
    "key_padding_mask of another length": lambda q: (q, q, q, torch.zeros(B, L + 1,
                                                                          dtype=torch.bool)),
    "1-D key_padding_mask, batched": lambda q: (q, q, q, torch.zeros(L, dtype=torch.bool)),
    "key_padding_mask of another length, with attn_mask": lambda q: (
        q, q, q, torch.zeros(B, L + 1, dtype=torch.bool), True,
        torch.zeros(L, L, dtype=torch.bool)),
}


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("case", list(FAST_PATH_BAD))
def test_refusals_on_torchs_fast_path_have_its_type(case, bias):
    """eval, no grad, batch-first self-attention: torch's fused fast path,
    which no meta tensor takes, refuses with a RuntimeError (its slow
    path's is an AssertionError): ours is of the fast path's type.  Without
    biases torch still merges the masks (a RuntimeError) before it leaves
    the fast path."""
    t, m = pair(dtype=torch.float32, batch_first=True, bias=bias)
    t.eval(), m.eval()
    q = torch.randn(B, L, E)
    args = FAST_PATH_BAD[case](q)
    with torch.no_grad():
        theirs = _torch_refusal(lambda: t(*args))
        # (without biases torch leaves the fast path after merging the masks)
        assert isinstance(theirs, RuntimeError) or not bias
        with pytest.raises(type(theirs)) as got:
            m(*args)
    assert isinstance(got.value, ValueError) and str(theirs) in str(got.value)
    # with grad the fast path is not taken: torch's assertion, ours too
    theirs = _torch_refusal(lambda: t(*args))
    with pytest.raises(type(theirs)):
        m(*args)


def test_a_4d_attn_mask_is_refused_on_every_path():
    # README's differences: torch's fast path takes a (1, 1, L, L) mask as
    # (L, L), its other paths refuse it; ours refuses it everywhere
    t, m = pair(dtype=torch.float32, batch_first=True)
    t.eval(), m.eval()
    q = torch.randn(B, L, E)
    mask = torch.zeros(1, 1, L, L, dtype=torch.bool)
    with torch.no_grad():
        assert t(q, q, q, attn_mask=mask)[0].shape == (B, L, E)
        with pytest.raises(ValueError, match="attn_mask must have shape") as got:
            m(q, q, q, attn_mask=mask)
    assert not isinstance(got.value, (RuntimeError, AssertionError))
    theirs = _torch_refusal(lambda: t(q, q, q, attn_mask=mask))  # with grad: its slow path
    with pytest.raises(type(theirs), match="4-D"):
        m(q, q, q, attn_mask=mask)


@pytest.mark.parametrize("shape", [(L,), (1, 1, L, L), (1, 1, 1, L, L)])
def test_the_causal_hint_checks_the_masks_rank_before_replacing_it(shape):
    # torch's module and functional check attn_mask's rank (an assertion)
    # before the is_causal hint replaces the mask by the pattern; ours
    # dropped a mask of any rank unread
    t, m = pair(batch_first=True)
    q = torch.randn(B, L, E, dtype=torch.float64)
    mask = torch.zeros(shape, dtype=torch.bool)
    call = dict(attn_mask=mask, is_causal=True, need_weights=False)
    theirs = _torch_refusal(lambda: t(q, q, q, **call))
    with pytest.raises(type(theirs)) as got:
        m(q, q, q, **call)
    assert isinstance(got.value, ValueError) and "2-D (L, S) or 3-D" in str(got.value)
    x = q.transpose(0, 1)
    pos = (E, H, t.in_proj_weight, t.in_proj_bias, None, None, False, 0.0, t.out_proj.weight,
           t.out_proj.bias)
    F = torch.nn.functional
    theirs = _torch_refusal(lambda: F.multi_head_attention_forward(x, x, x, *pos, **call))
    with pytest.raises(type(theirs)):
        mt.multi_head_attention_forward(x, x, x, *pos, **call)
    # unbatched: a 3-D mask must be (num_heads, L, S)
    u = q[0]
    bad = dict(call, attn_mask=torch.zeros(H + 1, L, L, dtype=torch.bool))
    theirs = _torch_refusal(lambda: t(u, u, u, **bad))
    with pytest.raises(type(theirs), match=r"\(num_heads, L, S\)"):
        m(u, u, u, **bad)


def test_the_constructor_refuses_with_torchs_type_too():
    theirs = _torch_refusal(lambda: nn.MultiheadAttention(6, 4))
    with pytest.raises(AssertionError) as got:
        MultiheadAttention(6, 4)
    assert isinstance(got.value, ValueError) and str(theirs) in str(got.value)


def test_refusals_torch_does_not_share_stay_ours():
    # our own keywords: no torch call to compare with
    m = MultiheadAttention(E, H)
    q = torch.randn(L, B, E)
    with pytest.raises(ValueError) as got:
        m(q, q[0], q, window=(1, 1))
    assert type(got.value) is ValueError


@pytest.mark.parametrize("kind", ["drop-in", "MultiHeadAttention", "sdpa"])
def test_script_and_export_say_what_to_do_instead(kind):
    # torch's own errors here named a type annotation ('Parameter | None')
    # or .numpy() of a tensor subclass, not mha_ext nor another way
    import warnings
    torch.manual_seed(0)
    x = torch.randn(B, L, E)
    if kind == "drop-in":
        layer = nn.TransformerEncoderLayer(E, H, 2 * E, 0.0, batch_first=True)
        layer.self_attn = MultiheadAttention(E, H, batch_first=True)
    elif kind == "MultiHeadAttention":
        layer = mt.MultiHeadAttention(E, H)
    else:
        class Layer(nn.Module):
            def forward(self, x):
                return mha_ext.scaled_dot_product_attention(x, x, x)
        layer = Layer()
    if kind != "sdpa":
        with pytest.raises(RuntimeError, match="torch.jit.script cannot compile mha_ext"):
            torch.jit.script(layer)
    with warnings.catch_warnings(), \
            pytest.raises(RuntimeError, match="a tensor subclass that holds no data of its "
                                              "own for mha_ext's C code.*torch.export"):
        warnings.simplefilter("ignore")
        torch.export.export(layer, (x,), strict=False)


@pytest.mark.parametrize("name", ["in_proj_weight", "in_proj_bias", "out_proj.weight",
                                  "out_proj.bias", "bias_k", "bias_v"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.int32])
@pytest.mark.parametrize("need_weights", [True, False])
def test_a_parameter_of_another_dtype_is_refused_where_torch_refuses_it(name, dtype,
                                                                        need_weights):
    """One parameter of another dtype than the module's weights: converted
    without a word before (an int32 out_proj.weight computed), where torch
    raises its RuntimeError.  Now torch's outcome: refused where torch
    refuses (a TypeError that is also a RuntimeError), and torch's numbers
    where torch computes (in_proj_bias; a narrower bias_k / bias_v)."""
    x = torch.randn(2, 5, 16)
    mods = []
    for cls in (nn.MultiheadAttention, MultiheadAttention):
        torch.manual_seed(0)
        m = cls(16, 4, batch_first=True, add_bias_kv=True)
        owner, attr = (m.out_proj, name[9:]) if name.startswith("out_proj.") else (m, name)
        setattr(owner, attr, nn.Parameter(getattr(owner, attr).detach().to(dtype),
                                          requires_grad=dtype.is_floating_point))
        mods.append(m)
    try:
        want = mods[0](x, x, x, need_weights=need_weights)
    except RuntimeError:
        with pytest.raises(TypeError, match="torch's module computes in one dtype") as info:
            mods[1](x, x, x, need_weights=need_weights)
        assert isinstance(info.value, RuntimeError)
        if name != "in_proj_weight":        # (that one sets the module's dtype: the others differ)
            assert f"{name} is {dtype} but the module's weights are torch.float32" in \
                str(info.value)
        return
    got = mods[1](x, x, x, need_weights=need_weights)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["W_q.weight", "W_k.bias", "W_v.weight", "W_o.weight",
                                  "W_o.bias"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.int32])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_the_seed_style_class_refuses_a_parameter_of_another_dtype_as_nn_linear_does(
        name, dtype, layout):
    """mha_ext.torch.MultiHeadAttention with one Linear's parameter in another
    dtype: converted without a word before (an int32 W_o.weight computed;
    a float64 W_q.weight was blamed on the query), where the seed module's
    nn.Linear raises its RuntimeError.  Now refused, naming the parameter;
    taken where nn.Linear takes it (a W_k bias on a transposed view: add_,
    not addmm), with torch's numbers."""
    from torch_seed import SeedMultiHeadAttention
    x = torch.randn(2, 5, 16) if layout == "contiguous" else torch.randn(5, 2, 16).transpose(0, 1)
    mods = [SeedMultiHeadAttention(16, 4), mt.MultiHeadAttention(16, 4)]
    mods[0].load_state_dict(mods[1].state_dict())
    for m in mods:
        lin, attr = getattr(m, name[:3]), name[4:]
        setattr(lin, attr, nn.Parameter(getattr(lin, attr).detach().to(dtype),
                                        requires_grad=dtype.is_floating_point))
    try:
        want = mods[0].eval()(x, x, x)
    except RuntimeError:
        with pytest.raises(TypeError, match=f"{name} is {dtype} but the module's other "
                                            "parameters are torch.float32") as info:
            mods[1](x, x, x)
        assert isinstance(info.value, RuntimeError)
    else:
        assert name == "W_k.bias" and layout == "transposed"   # the one nn.Linear takes
        got = mods[1](x, x, x)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with torch.autocast("cpu"):  # autocast: computed in W_q.weight's dtype, as documented
        if dtype == torch.float64 or name != "W_q.weight":
            assert mods[1](x, x, x)[0].dtype == mods[1].W_q.weight.dtype


def _inputs(kind, layout, batch_first, B, L):
    def make(S):
        if layout == "unbatched":
            return torch.randn(S, 16)
        if layout == "transposed":  # the other layout's memory, as a transposed view
            x = torch.randn(S, B, 16) if batch_first else torch.randn(B, S, 16)
            return x.transpose(0, 1)
        return torch.randn(B, S, 16) if batch_first else torch.randn(S, B, 16)
    x, y = make(L), make(7)
    return {"self": (x, x, x), "key is value": (x, y, y), "cross": (x, y, make(7))}[kind]


@pytest.mark.parametrize("kind", ["self", "key is value", "cross"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "unbatched"])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("B, L", [(2, 5), (1, 5), (2, 1)])
def test_an_in_proj_bias_of_another_dtype_is_taken_where_torch_takes_it(kind, layout,
                                                                       batch_first, B, L):
    """torch adds in_proj_bias with addmm (which refuses another dtype) where
    the input it projects is contiguous, else with add_ (which takes it):
    batch-first inputs it transposes, of B and L over 1, or a transposed
    view.  Before, ours took it everywhere; now torch's outcome, case by case"""
    torch.manual_seed(0)
    q, k, v = _inputs(kind, layout, batch_first, B, L)
    mods = []
    for cls in (nn.MultiheadAttention, MultiheadAttention):
        torch.manual_seed(1)
        m = cls(16, 4, batch_first=batch_first)
        m.in_proj_bias = nn.Parameter(m.in_proj_bias.detach().double())
        mods.append(m)
    try:
        want = mods[0](q, k, v)
    except RuntimeError:
        with pytest.raises(TypeError, match="in_proj_bias is torch.float64 but the module's "
                                            "weights are torch.float32") as info:
            mods[1](q, k, v)
        assert isinstance(info.value, RuntimeError)
        return
    got = mods[1](q, k, v)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "unbatched"])
def test_the_functional_takes_an_in_proj_bias_of_another_dtype_where_torch_does(layout):
    """multi_head_attention_forward (sequence-first): refused for a
    contiguous input, as torch's addmm refuses it; taken for a transposed
    view, as torch's add_ takes it"""
    torch.manual_seed(0)
    q, k, v = _inputs("cross", layout, False, 2, 5)
    w, b = torch.randn(48, 16) * 0.25, torch.randn(48, dtype=torch.float64)
    ow, ob = torch.randn(16, 16) * 0.25, torch.randn(16)
    args = (q, k, v, 16, 4, w, b, None, None, False, 0.0, ow, ob)
    try:
        want = torch.nn.functional.multi_head_attention_forward(*args)
    except RuntimeError:
        with pytest.raises(RuntimeError, match="in_proj_bias is torch.float64"):
            mt.multi_head_attention_forward(*args)
        return
    got = mt.multi_head_attention_forward(*args)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
