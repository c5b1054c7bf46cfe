"""mha_ext.hf.register()'s guard (docs/API.md §4): a model whose attention
does not go through transformers' AttentionInterface refuses the name at
construction (transformers would hand its own attention SDPA's masks and
compute wrong numbers without an error); models that do, transformers' own
and custom ones (transformers 4's spelling, a class without readable
source), take it.
"""
import pytest

from _support import need, require_torch

torch = require_torch()
transformers = need("transformers")

import mha_ext.hf as hf  # noqa: E402

hf.register()

VOCAB = 99


# models with their own attention code: transformers would accept the name,
# hand their eager attention SDPA's masks and compute wrong numbers
OWN_ATTENTION = {
    "bloom": lambda: transformers.BloomConfig(vocab_size=VOCAB, hidden_size=16, n_layer=1,
                                              n_head=2),
    "mpt": lambda: transformers.MptConfig(vocab_size=VOCAB, d_model=16, n_layers=1,
                                          n_heads=2),
    "codegen": lambda: transformers.CodeGenConfig(vocab_size=VOCAB, n_embd=32, n_layer=1,
                                                  n_head=4, rotary_dim=4, bos_token_id=0,
                                                  eos_token_id=1),
    "xglm": lambda: transformers.XGLMConfig(vocab_size=VOCAB, d_model=16, num_layers=1,
                                            attention_heads=2, ffn_dim=32),
    "gpt_neo": lambda: transformers.GPTNeoConfig(vocab_size=VOCAB, hidden_size=16,
                                                 num_layers=1, num_heads=2,
                                                 attention_types=[[["global"], 1]]),
}


@pytest.mark.parametrize("kind", sorted(OWN_ATTENTION))
def test_models_with_their_own_attention_refuse_the_name(kind):
    cfg = OWN_ATTENTION[kind]()
    with pytest.raises(ValueError, match="its own code, not through transformers' "
                                         "AttentionInterface"):
        transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=hf.NAME)
    # the name is refused for that model only: eager builds and runs it
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    assert model.config._attn_implementation == "eager"
    # set_attn_implementation keeps the implementation it has (transformers'
    # warning), so the model's numbers stay its own
    x = torch.tensor([[1, 5, 7, 2, 9]])
    with torch.no_grad():
        before = model.eval()(x).logits
        model.set_attn_implementation(hf.NAME)
        assert model.config._attn_implementation == "eager"
        torch.testing.assert_close(model(x).logits, before, rtol=0, atol=0)


def test_the_guard_leaves_interface_models_and_other_names_alone():
    from transformers import PreTrainedModel
    hf.register()
    hf.register()
    guard = PreTrainedModel.get_correct_attn_implementation
    assert guard._mha_ext_guard and not getattr(guard.__wrapped__, "_mha_ext_guard", False)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1)
    for name in (hf.NAME, "sdpa", "eager"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=name)
        assert model.config._attn_implementation == name
    bloom = OWN_ATTENTION["bloom"]()
    model = transformers.AutoModelForCausalLM.from_config(bloom)  # transformers' default
    assert model.config._attn_implementation in ("sdpa", "eager")


_CUSTOM = '''
import torch
from torch import nn
from transformers import PreTrainedModel, PretrainedConfig
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS


class CustomConfig(PretrainedConfig):
    model_type = "mha_ext_custom_test"


class CustomAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg

    def forward(self, q, k, v):
        f = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]  # transformers 4
        return f(self, q, k, v, None, scaling=1.0, dropout=0.0)[0]


class CustomModel(PreTrainedModel):
    config_class = CustomConfig
    _supports_sdpa = True

    def __init__(self, cfg):
        super().__init__(cfg)
        self.attn = CustomAttention(cfg)
        self.post_init()

    def forward(self, x):
        return self.attn(x, x, x)
'''


@pytest.mark.parametrize("where", ["file", "no source"])
def test_custom_models_using_the_interface_take_the_name(where, tmp_path, monkeypatch):
    # transformers' own test (_can_set_attn_implementation) calls a module
    # that indexes ALL_ATTENTION_FUNCTIONS[...] (transformers 4's spelling,
    # common in remote code), or whose source it cannot read (a notebook's
    # class), "own attention": the guard refused both, which compute through
    # the interface
    import importlib
    import sys
    import types
    name = "mha_ext_custom_model_" + where.replace(" ", "_")
    if where == "file":
        (tmp_path / f"{name}.py").write_text(_CUSTOM)
        monkeypatch.syspath_prepend(str(tmp_path))
        mod = importlib.import_module(name)
    else:
        mod = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, mod)
        exec(compile(_CUSTOM, "<notebook cell>", "exec"), mod.__dict__)
    calls = []
    twin = hf._twin()
    monkeypatch.setattr(hf, "_twin", lambda: (lambda *a, **k: calls.append(1) or twin(*a, **k)))
    x = torch.randn(1, 2, 3, 4, dtype=torch.float64)
    outs = {}
    for impl in ("sdpa", hf.NAME):
        model = mod.CustomModel._from_config(mod.CustomConfig(), attn_implementation=impl)
        outs[impl] = model(x)
    assert calls == [1]
    torch.testing.assert_close(outs[hf.NAME], outs["sdpa"], rtol=1e-12, atol=1e-12)
