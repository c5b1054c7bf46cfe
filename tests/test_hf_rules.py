"""mha_ext.hf, the Hugging Face attention hook (attn_implementation=
"mha_ext"): the rules mutation testing of that file found no test holding
(a mutant of each passed the hf tests before).  softcap=0.0 refused like
any other softcap; a paged cache refused with NotImplementedError; a value
of 3 dimensions refused; a layer without an is_causal attribute taken as
causal (transformers' default); a bool mask of the lower-right causal
pattern with fewer queries than keys (a chunked prefill over a cache)
computed as the causal pass, and one of a stricter pattern computed as
its mask; a mask broadcast over the queries (1 row for L queries); a float
mask of 0/1 values added, never taken for the bool pattern; a traced call
with the causal mask refused (not fixed to the causal pass); a user's
subclass whose own script has an attention class of its own refused;
MarkupLM (checked under the name) taken; the
guard passing transformers' is_init_check through (docs/API.md §4a,
mha_ext/hf.py's module docstring).

Expected values from transformers' own "sdpa" attention function
(sdpa_attention_forward), its "eager" models, or
torch.nn.functional.scaled_dot_product_attention.

Legend: B batch, H heads, L query length, S key length, D head width.
"""
import warnings

import pytest

from _support import need, require_torch

torch = require_torch()
transformers = need("transformers")

import mha_ext.hf as hf  # noqa: E402
from transformers.integrations.sdpa_attention import (  # noqa: E402
    sdpa_attention_forward)

hf.register()

F = torch.nn.functional
VOCAB = 99
TOL = 1e-10  # float64 throughout: the same computation, another summation order


def _qkv(L=5, S=6, B=2, H=4, Hkv=4, D=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, L, D, generator=gen, dtype=torch.float64),
            torch.randn(B, Hkv, S, D, generator=gen, dtype=torch.float64),
            torch.randn(B, Hkv, S, D, generator=gen, dtype=torch.float64))


class _Layer(torch.nn.Module):
    def __init__(self, is_causal=False):
        super().__init__()
        self.is_causal = is_causal


def _spy(monkeypatch):
    """Replace the twin (hf._twin: "tests replace this function to count or
    spy on calls") by one noting the is_causal and mask each call gets."""
    twin = hf._twin()
    seen = []

    def spy(q, k, v, **kw):
        seen.append((kw["is_causal"], kw["attn_mask"] is None))
        return twin(q, k, v, **kw)
    monkeypatch.setattr(hf, "_twin", lambda: spy)
    return seen


# ------------------------------------------------------------ refusals

def test_a_softcap_of_zero_is_refused_too():
    # "Refused ...: softcap": transformers' eager applies any softcap that is
    # not None (Gemma 2: scores / softcap, tanh, * softcap), 0.0 included
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="softcap"):
        hf.attention_forward(_Layer(), q, k, v, None, softcap=0.0)


def test_a_paged_cache_is_refused_with_not_implemented_error():
    # continuous batching hands the layer a PagedAttentionCache: refused
    PagedAttentionCache = type("PagedAttentionCache", (), {})
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match="paged cache"):
        hf.attention_forward(_Layer(), q, k, v, None, cache=PagedAttentionCache())
    # another cache object is no refusal: "sdpa"'s numbers
    Other = type("DynamicCache", (), {})
    ours, _ = hf.attention_forward(_Layer(), q, k, v, None, cache=Other())
    ref, _ = sdpa_attention_forward(_Layer(), q, k, v, None)
    torch.testing.assert_close(ours, ref, rtol=TOL, atol=TOL)


def test_a_value_of_three_dimensions_is_refused():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"query, key and value of 4 dimensions"):
        hf.attention_forward(_Layer(), q, k, v[0], None)


# ------------------------------------------------------------ causality

def test_a_layer_without_is_causal_is_causal_like_sdpas():
    # transformers' "sdpa": getattr(module, "is_causal", True)
    q, k, v = _qkv(L=6, S=6)
    layer = torch.nn.Module()
    ours, _ = hf.attention_forward(layer, q, k, v, None)
    ref, _ = sdpa_attention_forward(layer, q, k, v, None)
    torch.testing.assert_close(ours, ref, rtol=TOL, atol=TOL)
    causal = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    torch.testing.assert_close(ours, causal, rtol=TOL, atol=TOL)


def test_a_lower_right_mask_with_fewer_queries_than_keys_is_the_causal_pass(monkeypatch):
    # a chunk of 3 queries after 4 cached keys: query i sees keys j <= i + 4
    L, S = 3, 7
    q, k, v = _qkv(L=L, S=S)
    mask = torch.ones(L, S, dtype=torch.bool).tril(S - L).expand(2, 1, L, S)
    seen = _spy(monkeypatch)
    ours, _ = hf.attention_forward(_Layer(True), q, k, v, mask)
    assert seen == [("lower_right", True)]
    ref, _ = sdpa_attention_forward(_Layer(True), q, k, v, mask)
    torch.testing.assert_close(ours, ref, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("diagonal", [-1, 0, 1])
def test_a_causal_mask_stricter_than_lower_right_is_computed_as_its_mask(diagonal):
    # L < S and a pattern blocking more than the lower-right causal one
    # (tril(d), d < S - L): the mask's numbers, not the causal pass's
    L, S = 4, 7
    q, k, v = _qkv(L=L, S=S, seed=1)
    mask = torch.ones(L, S, dtype=torch.bool).tril(diagonal).expand(2, 1, L, S).clone()
    mask[..., 0] = True  # every row sees a key
    ours, _ = hf.attention_forward(_Layer(True), q, k, v, mask)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
    torch.testing.assert_close(ours, ref, rtol=TOL, atol=TOL)


def test_a_mask_broadcast_over_the_queries():
    # "a 4-D mask broadcastable to (B, H, L, S)": one row for all L queries
    q, k, v = _qkv(L=5, S=6, seed=2)
    mask = torch.tensor([True, True, False, True, False, True]).view(1, 1, 1, 6)
    ours, _ = hf.attention_forward(_Layer(True), q, k, v, mask)
    ref, _ = sdpa_attention_forward(_Layer(True), q, k, v, mask)
    torch.testing.assert_close(ours, ref, rtol=TOL, atol=TOL)
    # all True: a mask that blocks nothing, not the causal pattern
    ones = torch.ones(1, 1, 1, 6, dtype=torch.bool)
    ours, _ = hf.attention_forward(_Layer(True), q, k, v, ones)
    ref = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
    torch.testing.assert_close(ours, ref, rtol=TOL, atol=TOL)


def test_a_float_mask_of_the_causal_patterns_values_is_added():
    # a float mask is added to the scores: 1.0 where the causal pattern has
    # True, 0.0 elsewhere, is no causal mask
    L = S = 5
    q, k, v = _qkv(L=L, S=S, seed=3)
    mask = torch.ones(L, S, dtype=torch.float64).tril().expand(2, 1, L, S)
    ours, _ = hf.attention_forward(_Layer(True), q, k, v, mask)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
    torch.testing.assert_close(ours, ref, rtol=TOL, atol=TOL)


def test_a_traced_call_with_the_causal_mask_is_refused_not_fixed_to_the_causal_pass():
    # torch.jit.trace cannot record a mask given to mha_ext (a RuntimeError
    # saying so); the causal pattern taken for the causal pass would drop the
    # mask from the trace, and a padded mask later would compute as causal
    L = S = 5
    q, k, v = _qkv(L=L, S=S, seed=4)
    causal = torch.ones(L, S, dtype=torch.bool).tril().expand(2, 1, L, S).contiguous()
    layer = _Layer(True)

    def fn(q, k, v, m):
        return hf.attention_forward(layer, q, k, v, m)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TracerWarnings
        with pytest.raises(RuntimeError, match="torch.jit.trace cannot record .*attn_mask"):
            torch.jit.trace(fn, (q, k, v, causal), check_trace=False)


# ------------------------------------------------------------ the guard

OWN_SCRIPT = """
import torch
from torch import nn
import transformers


class MyAttention(nn.Module):  # attention code of the script's own
    def forward(self, x):
        return x


class MyOwnLlama(transformers.LlamaForCausalLM):
    _can_set_attn_implementation_cached_value = None
"""


def test_a_subclass_whose_script_has_its_own_attention_is_refused(tmp_path, monkeypatch):
    # "a user's subclass: its bases' modules too": the subclass's own module
    # (an attention class, no ALL_ATTENTION_FUNCTIONS) counts even when its
    # base (Llama) goes through the interface
    import importlib
    (tmp_path / "user_models_hf_rules.py").write_text(OWN_SCRIPT)
    monkeypatch.syspath_prepend(str(tmp_path))
    script = importlib.import_module("user_models_hf_rules")
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1)
    with pytest.raises(ValueError, match="its own code, not through transformers' "
                                         "AttentionInterface"):
        script.MyOwnLlama._from_config(cfg, attn_implementation=hf.NAME)
    # its base takes the name
    base = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation=hf.NAME)
    assert base.config._attn_implementation == hf.NAME


def test_markuplm_checked_under_the_name_takes_it_with_eagers_numbers():
    # MarkupLM refuses "sdpa" (_supports_sdpa = False) but is in the checked
    # list: it takes the name and computes eager's numbers
    cfg = transformers.MarkupLMConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, intermediate_size=37,
                                      max_position_embeddings=64, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = transformers.MarkupLMModel._from_config(cfg, attn_implementation=hf.NAME,
                                                    torch_dtype=torch.float64).eval()
    assert model.config._attn_implementation == hf.NAME
    ids = torch.randint(3, VOCAB, (2, 7))
    pad = torch.ones(2, 7, dtype=torch.long)
    pad[1, 5:] = 0
    with torch.no_grad():
        ours = model(input_ids=ids, attention_mask=pad).last_hidden_state
        model.set_attn_implementation("eager")
        eager = model(input_ids=ids, attention_mask=pad).last_hidden_state
    torch.testing.assert_close(ours, eager, rtol=1e-8, atol=1e-8)


def test_the_guard_passes_is_init_check_through_to_transformers():
    # the guard wraps PreTrainedModel.get_correct_attn_implementation for
    # every request: transformers' own checks must see the is_init_check
    # they were given (flash attention's device check runs only after init)
    from transformers import PreTrainedModel
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=1, num_attention_heads=2)
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="eager")
    original = PreTrainedModel.get_correct_attn_implementation.__wrapped__
    for fn in (PreTrainedModel.get_correct_attn_implementation, original):
        seen = []
        model._flash_attn_can_dispatch = (
            lambda flash_attn_version, is_init_check=False: seen.append(is_init_check) or True)
        model._sdpa_can_dispatch = lambda is_init_check=False: seen.append(is_init_check) or True
        for flag in (True, False):
            assert fn(model, "flash_attention_2", is_init_check=flag) == "flash_attention_2"
            assert fn(model, "sdpa", is_init_check=flag) == "sdpa"
        assert seen == [True, True, False, False], fn


CUSTOM_INTERFACE_MODEL = '''
import torch
from torch import nn
from transformers import PreTrainedModel, PretrainedConfig
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS


class LostConfig(PretrainedConfig):
    model_type = "mha_ext_lost_source_test"


class LostAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.is_causal = False

    def forward(self, q, k, v):
        f = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, None)
        return f(self, q, k, v, None, scaling=1.0, dropout=0.0)[0]


class LostModel(PreTrainedModel):
    config_class = LostConfig
    _supports_sdpa = True

    def __init__(self, cfg):
        super().__init__(cfg)
        self.attn = LostAttention(cfg)
        self.post_init()

    def forward(self, x):
        return self.attn(x, x, x)
'''


def test_a_model_whose_source_file_is_gone_is_let_through(monkeypatch):
    # "a model whose source cannot be read ... is let through": a module whose
    # file is gone (inspect's OSError) as one without a file
    import sys
    import types
    mod = types.ModuleType("mha_ext_lost_source_model")
    mod.__file__ = "/nonexistent/mha_ext_lost_source_model.py"
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    exec(compile(CUSTOM_INTERFACE_MODEL, mod.__file__, "exec"), mod.__dict__)
    x = torch.randn(1, 2, 3, 4, dtype=torch.float64)
    model = mod.LostModel._from_config(mod.LostConfig(), attn_implementation=hf.NAME)
    assert model.config._attn_implementation == hf.NAME
    ref = F.scaled_dot_product_attention(x, x, x, scale=1.0).transpose(1, 2)
    torch.testing.assert_close(model(x), ref, rtol=TOL, atol=TOL)


def test_a_users_own_model_without_sdpa_support_is_let_through(monkeypatch):
    # "a user's own model is let through": _supports_sdpa = False refuses
    # only transformers' own models that were not checked
    import sys
    import types
    mod = types.ModuleType("mha_ext_own_no_sdpa_model")
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    exec(compile(CUSTOM_INTERFACE_MODEL.replace("_supports_sdpa = True", "_supports_sdpa = False")
                 .replace("mha_ext_lost_source_test", "mha_ext_own_no_sdpa_test"),
                 "<notebook cell>", "exec"), mod.__dict__)
    x = torch.randn(1, 2, 3, 4, dtype=torch.float64)
    model = mod.LostModel._from_config(mod.LostConfig(), attn_implementation=hf.NAME)
    assert model.config._attn_implementation == hf.NAME
    ref = F.scaled_dot_product_attention(x, x, x, scale=1.0).transpose(1, 2)
    torch.testing.assert_close(model(x), ref, rtol=TOL, atol=TOL)
