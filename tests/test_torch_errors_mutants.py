"""Rules a mutation-testing round (helper-152) found no test holding: a
mutant of each passed the test files that exercise it, and each test here
was seen to fail under its mutant.  Of the files that round was given,
mha_ext/layout.py, _params.py, _masks.py, _torch_mask_rules.py, cache.py,
explorer.py and plot.py had had a round already (tests/test_layout_rules.py,
test_functional_params_rules.py, test_masks_habits_rules.py,
test_cache_nested_rules.py, test_explorer_rules.py, test_plot_rules.py);
what is pinned here is from mha_ext/_torch_errors.py (torch's exception
types for the torch classes' refusals, never a round of its own) and fresh
mutants of mha_ext/_torch_mha.py and mha_ext/hf.py.

docs/API.md §7 (the torch classes refuse what torch refuses with torch's
type too and quote its message) and §8 (a parameter of another dtype than
the module's weights, refused where torch's module refuses it):

- the in-projection weight of another dtype than the query and the other
  weights is the parameter named (the packed and the separate layout);
- under CPU autocast no parameter of another dtype is refused;
- mha_ext.torch.MultiHeadAttention: an unbatched (2-D) input takes no
  W_k bias of another dtype, transposed view or not (nn.Linear's addmm);
- a refusal that is also torch's keeps the traceback of where mha_ext found
  the argument wrong (its innermost frame is the original error's);
- a nested query off torch's fast path (training) is torch's AssertionError
  quoting torch's words (the probe on meta twins passes it as it is);
- a probe's own trouble with meta tensors (torch reading a value there) is
  not torch's refusal: the functional's 1-D dropout_p stays a TypeError, as
  torch's, not a RuntimeError quoting the meta tensors;
- a refused call with is_causal="lower_right" (torch takes a bool) is ours
  alone, as with window=;
- the functional's 0-d bias_k / bias_v of a model wider than 1 is torch's
  RuntimeError too (the bug this round found: the probe kept the 0-d bias
  on the CPU beside its meta keys, met its own device error and left ours
  a plain ValueError; mha_ext/_torch_functional.py's _probe), and so is
  the drop-in's 0-d bias_k / bias_v parameter (its probe's module, made
  from the configuration, held torch's (1, 1, E) ones and took the call).

mha_ext.hf (its module docstring; docs/API.md §4a): T5's position bias on a
one-query step of a causal layer without a mask sees every key, as "sdpa".
(The round's two tests of a failed from_config are in
tests/test_hf_more_models.py, beside the others of that rule.)

Expected values from torch's own nn.MultiheadAttention, nn.Linear and
F.multi_head_attention_forward, and transformers' sdpa_attention_forward.

Legend: B batch, L query length, S key length, E = embed_dim, H = num_heads.
"""
import traceback
import warnings

import pytest

from _support import need, require_torch

torch = require_torch()
from torch import nn  # noqa: E402

import mha_ext.torch as mt  # noqa: E402
from mha_ext.torch import MultiheadAttention  # noqa: E402

B, L, S, E, H = 2, 5, 7, 16, 4


def _modules(**kw):
    """torch's module and ours with the same parameters."""
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, **kw)
    return ref, MultiheadAttention.from_torch(ref)


# ------------------------------------------------ parameters of another dtype

@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("kw", [{}, {"kdim": 8}], ids=["packed", "separate"])
def test_the_in_projection_weight_of_another_dtype_is_the_one_named(kw, dtype):
    """The module's dtype is read from its in-projection weight; where that
    weight alone has another dtype than the query and the other weights
    (out_proj's, the separate projections), it is the one named (torch
    refuses the call with its RuntimeError), not in_proj_bias or out_proj
    for differing from it (docs/API.md §8: "a parameter of another dtype
    than the module's weights")."""
    name = "q_proj_weight" if kw else "in_proj_weight"
    mods = _modules(**kw)
    for m in mods:
        setattr(m, name, nn.Parameter(getattr(m, name).detach().to(dtype)))
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(L, B, E, generator=gen)
    k = torch.randn(S, B, mods[0].kdim, generator=gen)
    v = torch.randn(S, B, mods[0].vdim, generator=gen)
    with pytest.raises(RuntimeError):
        mods[0](q, k, v)
    with pytest.raises(TypeError, match=f"{name} is {dtype} but the module's weights are "
                                        "torch.float32") as info:
        mods[1](q, k, v)
    assert isinstance(info.value, RuntimeError)


@pytest.mark.parametrize("name", ["in_proj_bias", "out_proj.weight"])
def test_under_cpu_autocast_a_parameter_of_another_dtype_is_taken(name):
    """Under torch.autocast("cpu") torch's module casts its linears' operands
    and refuses no parameter of another dtype; ours takes it too and
    computes in the weights' dtype (docs/API.md §8: "under CPU autocast
    none is refused"): torch's numbers for the same values in float32
    (float32: 1e-5; the float64 copies hold float32 values exactly)."""
    ref, ours = _modules()
    with torch.no_grad():
        ref.in_proj_bias.normal_(generator=torch.Generator().manual_seed(9))
        ref.out_proj.bias.normal_(generator=torch.Generator().manual_seed(10))
    ours.load_state_dict(ref.state_dict())
    owner, attr = (ours.out_proj, "weight") if name == "out_proj.weight" else (ours, name)
    setattr(owner, attr, nn.Parameter(getattr(owner, attr).detach().double()))
    x = torch.randn(L, B, E, generator=torch.Generator().manual_seed(11))
    want = ref(x, x, x)
    with torch.autocast("cpu"):
        ref(x, x, x)                    # torch's module takes it under autocast too
        got = ours(x, x, x)
    for a, b in zip(got, want):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# ------------------------------------------------ the refusal's traceback

def test_a_refusal_that_is_also_torchs_keeps_the_traceback_of_where_it_was_found():
    """The error of both types is made after the fact (torch asked on meta
    twins); its traceback is the original error's, so it still leads to
    the line of mha_ext that refused the argument, not to forward's
    re-raise alone."""
    ref, ours = _modules()
    q, k = torch.randn(L, B, E), torch.randn(S, E)     # a key of another rank
    with pytest.raises(AssertionError):
        ref(q, k, k)
    with pytest.raises(ValueError, match=r"\(torch: ") as info:
        ours(q, k, k)
    err = info.value
    assert isinstance(err, AssertionError)
    original = err.__context__
    assert isinstance(original, ValueError) and not isinstance(original, AssertionError)
    inner = traceback.extract_tb(err.__traceback__)[-1]
    assert inner == traceback.extract_tb(original.__traceback__)[-1], (inner.name, inner.line)
    assert inner.name != "forward"


# ------------------------------------------- a nested query off the fast path

@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_a_nested_query_in_training_is_torchs_assertion_with_its_words(grad):
    """Training mode: torch's module refuses a nested query (not its fast
    path) with an AssertionError; ours too, quoting it.  With grad enabled
    torch is asked on meta twins of the arguments, where the nested query
    must go as it is (it has no sizes to copy)."""
    ref, ours = _modules(batch_first=True)
    gen = torch.Generator().manual_seed(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the nested tensors' prototype warning
        q = torch.nested.nested_tensor([torch.randn(n, E, generator=gen) for n in (3, 5)])
    for m in (ref, ours):
        m.train()
    with torch.set_grad_enabled(grad):
        with pytest.raises(AssertionError, match="outside of its fast path") as want:
            ref(q, q, q)
        with pytest.raises(AssertionError) as got:
            ours(q, q, q)
    assert isinstance(got.value, ValueError)
    assert f"(torch: {want.value})" in str(got.value)


# ------------------------------------ a probe's own trouble with meta tensors

def test_a_refusal_torch_makes_a_type_error_is_not_made_a_runtime_error_by_the_probe():
    """The functional twin in training with a dropout_p of one element and
    one dimension: torch's own function refuses it with a TypeError (its
    dropout's argument), ours too.  The probe that asks torch runs on meta
    twins, where torch's `dropout_p > 0.0` meets a meta tensor ("cannot be
    called on meta tensors", a RuntimeError): that is the probe's trouble,
    not torch's refusal, and must not make ours a RuntimeError quoting it."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(L, B, E, generator=gen)
    w, b = torch.randn(3 * E, E, generator=gen) * 0.25, torch.randn(3 * E, generator=gen)
    ow, ob = torch.randn(E, E, generator=gen) * 0.25, torch.randn(E, generator=gen)
    args = (q, q, q, E, H, w, b, None, None, False, torch.tensor([0.1]), ow, ob)
    with pytest.raises(TypeError) as want:
        nn.functional.multi_head_attention_forward(*args, training=True)
    assert not isinstance(want.value, RuntimeError)
    with pytest.raises(TypeError, match="dropout_p") as got:
        mt.multi_head_attention_forward(*args, training=True)
    assert not isinstance(got.value, RuntimeError), str(got.value)
    assert "meta" not in str(got.value), str(got.value)


def test_a_zero_d_bias_k_torch_cannot_repeat_is_refused_with_torchs_runtime_error_too():
    """The functional twin with a 0-d bias_k and bias_v for a model wider
    than 1: torch's function repeats them to (1, B, 1) and its cat with the
    keys is a RuntimeError; ours refuses them (a ValueError naming the
    shape) and, as docs/API.md §7 promises, with torch's type and words
    too.  (Found by this round: the probe kept the 0-d bias on the CPU
    beside meta keys, met a device error of its own and left ours a plain
    ValueError.)"""
    gen = torch.Generator().manual_seed(12)
    q = torch.randn(L, B, E, generator=gen)
    w, b = torch.randn(3 * E, E, generator=gen) * 0.25, torch.randn(3 * E, generator=gen)
    ow, ob = torch.randn(E, E, generator=gen) * 0.25, torch.randn(E, generator=gen)
    bias = torch.tensor(0.5)
    args = (q, q, q, E, H, w, b, bias, bias, False, 0.0, ow, ob)
    with pytest.raises(RuntimeError) as want:
        nn.functional.multi_head_attention_forward(*args)
    with pytest.raises(ValueError, match="bias_k") as got:
        mt.multi_head_attention_forward(*args)
    assert isinstance(got.value, RuntimeError), str(got.value)
    # torch's words as its meta kernel says them (its CPU kernel's differ after these)
    assert "Sizes of tensors must match" in str(want.value)
    assert "(torch: Sizes of tensors must match" in str(got.value)


@pytest.mark.parametrize("training", [True, False])
def test_the_drop_ins_zero_d_bias_k_is_refused_with_torchs_runtime_error_too(training):
    """The drop-in with a 0-d bias_k and bias_v assigned (parameters that
    require grad): torch's module refuses the call (its cat of the keys, a
    RuntimeError), ours too, with torch's type and words (docs/API.md §7).
    torch is asked on a module of its own made on meta from the
    configuration, which held (1, 1, E) biases, took the call and left ours
    a plain ValueError: it now holds meta twins of the shapes its
    constructor never makes (_torch_errors.own_shapes)."""
    mods = _modules(add_bias_kv=True)
    for m in mods:
        m.bias_k, m.bias_v = nn.Parameter(torch.tensor(0.5)), nn.Parameter(torch.tensor(0.5))
        m.train(training)
    x = torch.randn(L, B, E, generator=torch.Generator().manual_seed(13))
    with pytest.raises(RuntimeError, match="Sizes of tensors must match"):
        mods[0](x, x, x)
    # the parameter named by its place in the block and its name
    with pytest.raises(ValueError, match=r"params\[8\] \(bias_k\) must have the shape") as got:
        mods[1](x, x, x)
    assert isinstance(got.value, RuntimeError), str(got.value)
    assert "(torch: Sizes of tensors must match" in str(got.value)


# ---------------------------------- the seed-style class's Linear bias rule

@pytest.mark.parametrize("layout", ["transposed view", "contiguous"])
def test_an_unbatched_input_takes_no_bias_of_another_dtype_as_nn_linear(layout):
    """mha_ext.torch.MultiHeadAttention, an unbatched (S, E) key with W_k's
    bias in float64: nn.Linear adds a bias with add_ (taking another dtype)
    only for a 3-D input that is not contiguous; a 2-D one, transposed view
    or not, goes through addmm, which refuses it (docs/API.md §8: "its
    input a 3-D tensor that is not contiguous")."""
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(E, S, generator=gen).t() if layout == "transposed view" \
        else torch.randn(S, E, generator=gen)
    q = torch.randn(L, E, generator=gen)
    m = mt.MultiHeadAttention(E, H)
    m.W_k.bias = nn.Parameter(m.W_k.bias.detach().double())
    with pytest.raises(RuntimeError, match="same dtype"):
        m.W_k(k)                                   # torch's nn.Linear on the key
    with pytest.raises(TypeError, match="W_k.bias is torch.float64 but the module's other "
                                        "parameters are torch.float32") as info:
        m(q, k, k)
    assert isinstance(info.value, RuntimeError)


# ------------------------------------------- mha_ext.hf: T5's position bias

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_position_bias_decode_step_of_a_causal_layer_sees_every_key_as_sdpa(dtype):
    """attention_forward with T5's position_bias, one query (a decoding
    step), no mask, a causal layer: "sdpa" makes the causal flag only for
    more than one query, so the bias alone is the mask and the query sees
    every cached key (folding the causal pattern in would keep key 0 alone).
    Against transformers' own sdpa_attention_forward (float32: 2e-5, the
    twin's and torch's SDPA summing in other orders; float64: 1e-10)."""
    need("transformers")
    import mha_ext.hf as hf
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class Layer(torch.nn.Module):
        is_causal = True
        num_key_value_groups = 1

    gen = torch.Generator().manual_seed(6)
    q = torch.randn(2, H, 1, 8, generator=gen, dtype=dtype)
    k, v = (torch.randn(2, H, S, 8, generator=gen, dtype=dtype) for _ in range(2))
    bias = torch.randn(1, H, 1, S, generator=gen, dtype=dtype)
    got, _ = hf.attention_forward(Layer(), q, k, v, None, position_bias=bias)
    want, _ = sdpa_attention_forward(Layer(), q, k, v, None, position_bias=bias)
    tol = {torch.float32: 2e-5, torch.float64: 1e-10}[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


# ------------------------------------ is_causal="lower_right" (ours alone)

@pytest.mark.parametrize("ours_kw", [{"is_causal": "lower_right"}, {"window": (1, 0)}],
                         ids=["lower_right", "window"])
def test_a_refusal_of_a_call_torch_has_not_is_ours_alone(ours_kw):
    """A call with a keyword torch's module does not have (window=, or
    is_causal="lower_right": torch takes a bool) that is refused (here a
    2-D key for a 3-D query) is our ValueError alone: torch is not asked
    what it would say of a call it cannot make (it read "lower_right" as
    its is_causal hint), and its words are not quoted (docs/API.md §8)."""
    _, ours = _modules()
    q, k = torch.randn(L, B, E), torch.randn(S, E)
    with pytest.raises(ValueError) as info:
        ours(q, k, k, **ours_kw)
    assert not isinstance(info.value, AssertionError)
    assert "(torch: " not in str(info.value)
