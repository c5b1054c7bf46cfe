"""mha_ext.torch.multi_head_attention_forward (mha_ext/_torch_functional.py)
and the parameter keys and blocks (mha_ext/_params.py): the rules mutation
testing of those two files found no test holding (a mutant of each passed
the suite before).  For the functional twin: each argument torch's
functional refuses (a query, key or value of another rank, length, batch
or width, a weight of another shape, bias_v without bias_k, an out_proj_bias
that only holds the right number of values, a (1, 3E) in_proj_bias outside
self-attention, a 0-d size that is not a whole number, a list or None where
a tensor goes) is refused with torch's type as well as ours and in our own
words (sequence first, not the drop-in's batch-first words); a 0-d bias_k
of a width-1 model is taken; dropout_p's refusals with torch's exact types
in training; static_v alone refused (docs/API.md §7, §8:
"mha_ext.torch.multi_head_attention_forward"), and an out_proj_weight of an
integer or complex dtype torch's RuntimeError too (it was a TypeError
alone).  For the blocks: load_state_dict's
torch layouts (separate keys of a module whose kdim == vdim == d_model,
in_proj_weight refused for other widths with the reason), strict=False,
a non-mapping and a non-flag strict refused, nothing changed on an error,
a state_dict a snapshot; forward_train's params= as a state dict (no keys
asked for that the module lacks, torch's (1, 1, E) bias_k), a missing key,
a same-size other shape and a block not 1-D refused, a block copied
(docs/API.md §4, §8).

Legend: L query length, S key length, B batch, E = embed_dim, H = num_heads.
"""
import numpy as np
import pytest

from _support import require_torch

torch = require_torch()
import torch.nn.functional as F  # noqa: E402

import mha_ext  # noqa: E402
import mha_ext.torch as mt  # noqa: E402

L, B, E, H = 3, 2, 4, 2
D = torch.float64


def _r(*shape, seed=0):
    g = torch.Generator().manual_seed(seed + sum(shape) + 7 * len(shape))
    return torch.randn(shape, generator=g, dtype=D)


def _weights():
    """in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias"""
    return _r(3 * E, E), _r(3 * E), _r(E, E, seed=1), _r(E, seed=1)


def _torchs_refusal(args, kw):
    with pytest.raises(Exception) as theirs:
        F.multi_head_attention_forward(*args, **kw)
    return theirs.value


def _refused_as_torch(args, kw=None, words=None):
    """torch's functional refuses the call; ours refuses it with an error of
    torch's type that is also a ValueError or TypeError, quoting torch's
    message (from meta twins) once, and (`words`) saying what was wrong in our terms."""
    kw = kw or {}
    theirs = _torchs_refusal(args, kw)
    with pytest.raises(type(theirs)) as ours:
        mt.multi_head_attention_forward(*args, **kw)
    assert isinstance(ours.value, (ValueError, TypeError)), type(ours.value)
    if type(theirs) in (AssertionError, RuntimeError):  # (its meta twin's words)
        assert str(ours.value).count("(torch: ") == 1
    if words is not None:
        assert words in str(ours.value), str(ours.value)
    # said in the functional's sequence-first layout, not the drop-in's
    assert "batch_first" not in str(ours.value) and "(batch, seq" not in str(ours.value)
    return ours.value


# ------------------------------------------------- refusals, as torch's

def _call(query=None, key=None, value=None, **over):
    q = _r(L, B, E, seed=3)
    W, b, Wo, bo = _weights()
    a = dict(query=q, key=q, value=q, embed_dim_to_check=E, num_heads=H, in_proj_weight=W,
             in_proj_bias=b, bias_k=None, bias_v=None, add_zero_attn=False, dropout_p=0.0,
             out_proj_weight=Wo, out_proj_bias=bo)
    a.update({k: v for k, v in (("query", query), ("key", key), ("value", value))
              if v is not None})
    a.update(over)
    names = list(a)[:13]
    return tuple(a.pop(n) for n in names), a


def _separate(**weights):
    W = _weights()[0]
    kw = dict(use_separate_proj_weight=True, q_proj_weight=W[:E], k_proj_weight=W[E:2 * E],
              v_proj_weight=W[2 * E:])
    kw.update(weights)
    return kw


def test_inputs_of_another_rank_length_batch_or_width_are_refused_as_torch():
    q = _r(L, B, E, seed=3)
    cases = {
        "query must be 3-D": (q[None], q[None], q[None]),
        "key and value must be 3-D like query": (q, q, q[:, 0]),
        "must have one batch size": (q, q, q[:, :1]),
        "must have one length": (q, q, _r(L + 2, B, E)),
        "key and value must be 4 and 4 wide": (q, q, _r(L, B, E + 2)),
    }
    for words, (query, key, value) in cases.items():
        _refused_as_torch(*_call(query, key, value), words=words)


def test_a_query_of_another_width_is_refused_naming_embed_dim_to_check():
    q = _r(L, B, E + 2)
    _refused_as_torch(*_call(q, q, q, in_proj_weight=_r(3 * E, E + 2)),
                      words="query's last dimension must be embed_dim_to_check = 4")


def test_projection_weights_of_another_shape_are_refused_in_our_words():
    args, kw = _call(in_proj_weight=_r(3 * E, E + 1))
    _refused_as_torch(args, kw, words="in_proj_weight must have shape (12, 4)")
    args, _ = _call(in_proj_weight=None)
    _refused_as_torch(args, _separate(k_proj_weight=_r(E + 2, E)),
                      words="k_proj_weight must have shape (4, its input's width)")
    _refused_as_torch(args, _separate(q_proj_weight=_r(E, E + 2)),
                      words="q_proj_weight must have shape (4, 4)")


def test_an_out_proj_weight_with_three_dimensions_is_refused_as_torch():
    Wo, bo = _weights()[2:]
    for bias in (bo, None):
        _refused_as_torch(*_call(out_proj_weight=Wo[None], out_proj_bias=bias),
                          words="out_proj_weight must have shape")


@pytest.mark.parametrize("shape", [(E, 1), (2, E // 2)])
def test_an_out_proj_bias_of_e_values_in_another_shape_than_a_row_is_refused(shape):
    bo = _weights()[3]
    _refused_as_torch(*_call(out_proj_bias=bo.reshape(shape)), words="out_proj_bias must have")


def test_bias_v_without_bias_k_is_refused_as_torch():
    _refused_as_torch(*_call(bias_v=_r(1, 1, E)), words="bias_k and bias_v are given together")


def test_a_zero_d_size_that_is_not_a_whole_number_is_refused_as_torch():
    # torch compares it with the query's width (4.5 != 4): an AssertionError
    _refused_as_torch(*_call(embed_dim_to_check=torch.tensor(4.5)))


@pytest.mark.parametrize("name,value", [("out_proj_weight", None),
                                        ("in_proj_bias", [0.0] * (3 * E))])
def test_a_non_tensor_where_a_tensor_goes_is_a_type_error_as_torchs(name, value):
    args, kw = _call(**{name: value})
    theirs = _torchs_refusal(args, kw)
    assert isinstance(theirs, TypeError)
    with pytest.raises(TypeError, match=f"{name} must be a torch.Tensor"):
        mt.multi_head_attention_forward(*args, **kw)


@pytest.mark.parametrize("how", ["separate weights", "query is key", "key is value"])
def test_an_in_proj_bias_row_outside_self_attention_is_refused_as_torch(how):
    """torch's functional broadcasts a (1, 3E) in_proj_bias in its packed
    self-attention alone (query, key and value one tensor); it splits it
    otherwise, which fails."""
    q, v = _r(L, B, E, seed=3), _r(L, B, E, seed=4)
    row = _weights()[1].reshape(1, 3 * E)
    if how == "separate weights":
        args, _ = _call(q, q, q, in_proj_bias=row, in_proj_weight=None)
        kw = _separate()
    else:
        args, kw = _call(*((q, q, v) if how == "query is key" else (v, q, q)), in_proj_bias=row)
    _refused_as_torch(args, kw, words="in_proj_bias must have shape (12,)")


def test_a_zero_d_bias_k_of_a_width_one_model_is_taken_as_torch():
    # E = 1: a 0-d bias_k and bias_v hold embed_dim values; torch's repeat takes them
    q = _r(L, B, 1, seed=3)
    args = (q, q, q, 1, 1, _r(3, 1), _r(3), _r(), _r(seed=1), False, 0.0, _r(1, 1), _r(1))
    want = F.multi_head_attention_forward(*args, training=False)
    got = mt.multi_head_attention_forward(*args, training=False)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_static_v_alone_is_refused_as_static_k_is():
    static = _r(B * H, L, E // H)
    for name in ("static_k", "static_v"):
        args, kw = _call(**{name: static})
        with pytest.raises(ValueError, match="static_k and static_v") as got:
            mt.multi_head_attention_forward(*args, **kw)
        assert not isinstance(got.value, (AssertionError, RuntimeError))


def test_query_on_the_meta_device_with_real_weights_is_refused_as_torch():
    meta = torch.empty(L, B, E, dtype=D, device="meta")
    args, kw = _call(meta, meta, meta)
    theirs = _torchs_refusal(args, kw)
    with pytest.raises(type(theirs)):
        mt.multi_head_attention_forward(*args, **kw)


# ------------------------------------------------- dropout_p in training

def test_dropout_p_above_one_with_weights_is_torchs_value_error_alone():
    # torch's weights path: its dropout's ValueError, not a RuntimeError
    args, kw = _call(dropout_p=1.5, training=True, need_weights=True)
    theirs = _torchs_refusal(args, kw)
    assert type(theirs) is ValueError
    with pytest.raises(ValueError, match="between 0 and 1, but got 1.5") as ours:
        mt.multi_head_attention_forward(*args, **kw)
    assert not isinstance(ours.value, RuntimeError)


def test_a_nan_dropout_p_without_weights_is_refused_as_torchs_sdpa_refuses_it():
    args, kw = _call(dropout_p=float("nan"), training=True, need_weights=False)
    assert isinstance(_torchs_refusal(args, kw), RuntimeError)
    with pytest.raises(RuntimeError, match="between 0 and 1, but got nan") as ours:
        mt.multi_head_attention_forward(*args, **kw)
    assert isinstance(ours.value, ValueError)


def test_a_dropout_p_tensor_of_two_values_with_weights_is_refused_naming_dropout_p():
    # torch's weights path compares it with 0 first: a RuntimeError (no one value)
    args, kw = _call(dropout_p=torch.tensor([0.0, 0.0]), training=True, need_weights=True)
    assert isinstance(_torchs_refusal(args, kw), RuntimeError)
    with pytest.raises(RuntimeError, match="dropout_p must be a float") as ours:
        mt.multi_head_attention_forward(*args, **kw)
    assert isinstance(ours.value, TypeError)


# ------------------------------------------------- found differing from torch

@pytest.mark.parametrize("dtype", [torch.int64, torch.complex128])
def test_an_out_proj_weight_of_an_integer_or_complex_dtype_is_also_torchs_runtime_error(dtype):
    args, kw = _call(out_proj_weight=_weights()[2].to(dtype))
    assert isinstance(_torchs_refusal(args, kw), RuntimeError)
    with pytest.raises(TypeError, match="must be float32 or float64") as ours:
        mt.multi_head_attention_forward(*args, **kw)
    assert isinstance(ours.value, RuntimeError)


def test_an_out_proj_weight_of_an_integer_or_complex_dtype_is_a_type_error():
    for dtype in (torch.int64, torch.complex128, torch.bool):
        args, kw = _call(out_proj_weight=_weights()[2].to(dtype))
        with pytest.raises(TypeError, match="must be float32 or float64"):
            mt.multi_head_attention_forward(*args, **kw)


# ------------------------------------------------- load_state_dict (_params)

def _seeded(d_model=8, n_heads=2, seed=1, **kw):
    return mha_ext.MultiHeadAttention(d_model, n_heads, dtype="float64", seed=seed, **kw)


def _torch_mha(d_model=8, n_heads=2, **kw):
    torch.manual_seed(4)
    t = torch.nn.MultiheadAttention(d_model, n_heads, dtype=D, **kw)
    with torch.no_grad():  # torch's zero biases would hide a bias bug
        for p in t.parameters():
            p.add_(torch.randn_like(p))
    return t


def _sd(t):
    return {k: v.detach().numpy().copy() for k, v in t.state_dict().items()}


def _same_numbers(m, t, kdim=8, vdim=8):
    """our module m computes torch's module t (a cross-attention call)"""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 3, w, generator=g, dtype=D) for w in (8, kdim, vdim))
    t.batch_first = True
    want = t(q, k, v, need_weights=False)[0].detach().numpy()
    got = m(q.numpy(), k.numpy(), v.numpy(), need_weights=False)[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-10)


def test_torchs_separate_keys_load_into_a_module_of_one_width():
    # kdim == vdim == d_model: torch stores in_proj_weight, but q_proj_weight,
    # k_proj_weight and v_proj_weight (split from it) load as well
    t = _torch_mha()
    sd = _sd(t)
    W = sd.pop("in_proj_weight")
    sd.update(q_proj_weight=W[:8], k_proj_weight=W[8:16], v_proj_weight=W[16:])
    m = _seeded()
    assert m.load_state_dict(sd) == ([], [])
    _same_numbers(m, t)
    # without q_proj_weight, strict=False: that key alone is missing, the rest loads
    del sd["q_proj_weight"]
    m = _seeded()
    assert m.load_state_dict(sd, strict=False) == (["q_proj_weight"], [])
    np.testing.assert_array_equal(m.state_dict()["W_k.weight"], W[8:16])
    np.testing.assert_array_equal(m.state_dict()["W_v.weight"], W[16:])


def test_in_proj_weight_with_separate_keys_loads_packed_and_names_the_others_unexpected():
    sd = _sd(_torch_mha())
    extra = np.zeros((8, 8))
    got = _seeded().load_state_dict(dict(sd, q_proj_weight=extra), strict=False)
    assert got == ([], ["q_proj_weight"])
    with pytest.raises(KeyError, match="unexpected key 'q_proj_weight'"):
        _seeded().load_state_dict(dict(sd, q_proj_weight=extra))


@pytest.mark.parametrize("kdim,vdim", [(6, 4), (8, 4), (6, 8)])
def test_in_proj_weight_for_a_module_of_other_key_or_value_widths_says_why(kdim, vdim):
    m = _seeded(kdim=kdim, vdim=vdim)
    sd = _sd(_torch_mha())
    with pytest.raises(ValueError, match="torch's packed layout, which needs kdim == vdim"):
        m.load_state_dict(sd)
    t = _torch_mha(kdim=kdim, vdim=vdim)
    assert m.load_state_dict(_sd(t)) == ([], [])
    _same_numbers(m, t, kdim, vdim)


def test_torchs_keys_of_a_module_without_biases_load_as_torchs():
    t = _torch_mha(bias=False)
    m = _seeded(bias=False)
    assert m.load_state_dict(_sd(t)) == ([], [])
    _same_numbers(m, t)


def test_torchs_keys_with_bias_k_and_bias_v_load_as_torchs():
    t = _torch_mha(add_bias_kv=True)
    sd = _sd(t)
    assert sd["bias_k"].shape == (1, 1, 8)
    m = _seeded(add_bias_kv=True)
    assert m.load_state_dict(sd) == ([], [])
    np.testing.assert_array_equal(m.state_dict()["bias_v"], sd["bias_v"].reshape(8))
    _same_numbers(m, t)


def test_torchs_keys_for_a_grouped_query_module_are_refused_by_name():
    with pytest.raises(ValueError, match="no grouped-query attention; this module has n_kv"):
        _seeded(n_heads=4, n_kv_heads=2).load_state_dict(_sd(_torch_mha(n_heads=4)))


@pytest.mark.parametrize("layout", ["ours", "torch's"])
def test_strict_false_loads_what_is_there_and_names_missing_and_unexpected_keys(layout):
    m = _seeded()
    if layout == "ours":
        sd = {"W_k.weight": np.full((8, 8), 0.5), "extra": np.zeros(1)}
        missing = [k for k in m.state_dict() if k != "W_k.weight"]
    else:
        sd = {"in_proj_weight": np.full((24, 8), 0.5), "extra": np.zeros(1)}
        missing = ["in_proj_bias", "out_proj.weight", "out_proj.bias"]
    before = m.state_dict()
    assert m.load_state_dict(sd, strict=False) == (missing, ["extra"])
    after = m.state_dict()
    np.testing.assert_array_equal(after["W_k.weight"], np.full((8, 8), 0.5))
    np.testing.assert_array_equal(after["W_o.weight"], before["W_o.weight"])


def test_a_failed_load_changes_nothing_also_after_keys_already_read():
    m = _seeded()
    before = m.state_dict()
    sd = {k: np.zeros_like(v) for k, v in before.items()}
    sd["W_o.bias"] = np.zeros(9)                   # the last key, of a wrong shape
    with pytest.raises(ValueError, match=r"state_dict\['W_o.bias'\] must have shape"):
        m.load_state_dict(sd)
    for k, v in m.state_dict().items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)


def test_load_state_dict_takes_a_mapping_and_a_flag_for_strict():
    m = _seeded()
    pairs = list(m.state_dict().items())
    with pytest.raises(TypeError, match="state_dict must be a mapping"):
        m.load_state_dict(pairs)
    with pytest.raises(TypeError, match="strict must be True or False"):
        m.load_state_dict(dict(pairs), strict="no")


def test_a_state_dict_is_a_snapshot_unchanged_by_a_later_load():
    m = _seeded()
    sd = m.state_dict()
    kept = {k: v.copy() for k, v in sd.items()}
    m.load_state_dict({k: v + 1.0 for k, v in kept.items()})
    for k, v in sd.items():
        np.testing.assert_array_equal(v, kept[k], err_msg=k)


# ------------------------------------------------- forward_train's params= (_params)

def _x(shape=(2, 3, 8), seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


@pytest.mark.parametrize("kw", [{}, {"bias": False}, {"add_bias_kv": True}])
def test_params_as_the_state_dict_compute_as_the_modules_own(kw):
    # the keys a module lacks (biases with bias=False, bias_k and bias_v
    # without add_bias_kv) are not asked for
    m = _seeded(**kw)
    x = _x()
    want = m.forward_train(x, dropout=0.0).output
    params = m.state_dict()
    if "bias_k" in params:                        # torch's (1, 1, E) shape loads too
        params = dict(params, bias_k=params["bias_k"].reshape(1, 1, 8))
    got = m.forward_train(x, params=params, dropout=0.0).output
    np.testing.assert_array_equal(got, want)


def test_params_missing_a_key_is_a_key_error_naming_it():
    m = _seeded()
    params = m.state_dict()
    del params["W_v.bias"]
    with pytest.raises(KeyError, match="params is missing 'W_v.bias'"):
        m.forward_train(_x(), params=params)


def test_params_of_the_right_size_in_another_shape_are_refused():
    m = _seeded(kdim=6)
    params = m.state_dict()
    params["W_k.weight"] = params["W_k.weight"].T.copy()   # (6, 8): 48 values, as (8, 6)
    with pytest.raises(ValueError, match=r"params\['W_k.weight'\] must have shape \(8, 6\)"):
        m.forward_train(_x(), _x((2, 4, 6)), _x((2, 4, 8)), params=params)


def test_params_as_a_block_must_be_one_dimensional_of_the_blocks_size():
    m = _seeded()
    block = np.concatenate([v.reshape(-1) for v in m.state_dict().values()])
    for bad in (block.reshape(1, -1), 0.5, block[:-1]):
        with pytest.raises(ValueError, match="a 1-D block of"):
            m.forward_train(_x(), params=bad)


def test_params_as_a_block_are_copied_so_a_later_edit_leaves_the_backward_alone():
    m = _seeded()
    block = np.concatenate([v.reshape(-1) for v in m.state_dict().values()])
    x, g = _x(), _x(seed=1)
    want = m.backward(m.forward_train(x, params=block.copy(), dropout=0.0), g)
    ctx = m.forward_train(x, params=block, dropout=0.0)
    block *= 3.0
    got = m.backward(ctx, g)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=0, atol=1e-12, err_msg=k)
