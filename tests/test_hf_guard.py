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


def test_models_picking_their_attention_from_a_table_of_names_refuse_the_name():
    """GIT's text layers take GIT_SELF_ATTENTION_CLASSES[name] ("eager"
    only): a bare KeyError at construction before; now the guard's
    ValueError, as for the models above."""
    cfg = transformers.GitConfig(
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                           intermediate_size=37, image_size=32, patch_size=8),
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=37)
    with pytest.raises(ValueError, match="picks its attention class from "
                                         "GIT_SELF_ATTENTION_CLASSES, which has 'eager' only"):
        transformers.GitForCausalLM._from_config(cfg, attn_implementation=hf.NAME)
    # a model of the same module whose layers never look there takes the name
    # (the vision tower goes through the interface): eager's numbers
    from transformers.models.git.modeling_git import GitVisionModel
    torch.manual_seed(1)
    vision = GitVisionModel._from_config(
        transformers.GitVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, image_size=32, patch_size=8),
        attn_implementation=hf.NAME, torch_dtype=torch.float64).eval()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        ours = vision(pixel_values=x).last_hidden_state
        vision.set_attn_implementation("eager")
        eager = vision(pixel_values=x).last_hidden_state
    torch.testing.assert_close(ours, eager, rtol=0, atol=1e-8)  # (eager: a float32 softmax)
    # a GIT built under eager refuses a switch to the name: its text layers
    # keep their own attention, which the name's bool masks left without
    # causality (0.16 off, no error)
    model = transformers.GitForCausalLM._from_config(cfg, attn_implementation="eager").eval()
    ids = torch.randint(3, VOCAB, (1, 7))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        with pytest.raises(ValueError, match="GitForCausalLM computes attention with its own"):
            model.set_attn_implementation(hf.NAME)
        assert model.config._attn_implementation == "eager"
        torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=0, atol=0)
    # a second registered name's message lists the table's own entries only
    second = hf.register("mha_ext_second")
    with pytest.raises(ValueError, match="which has 'eager' only"):
        transformers.GitForCausalLM._from_config(cfg, attn_implementation=second)


def _sized(model, std=0.2):
    # weights large enough that a leak of later tokens moves the logits visibly
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, std)
    return model.eval()


SEQ2SEQ_NOT_FLAGGED_CAUSAL = {
    # decoders whose self-attention layers say is_causal=False (transformers
    # keeps "sdpa" away from them: _supports_sdpa = False)
    "nllb_moe": lambda: transformers.NllbMoeForConditionalGeneration._from_config(
        transformers.NllbMoeConfig(
            vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=37,
            decoder_ffn_dim=37, num_experts=2, expert_capacity=8, dropout=0.0,
            attention_dropout=0.0, activation_dropout=0.0),
        attn_implementation=hf.NAME, torch_dtype=torch.float64),
    "pegasus_x": lambda: transformers.PegasusXForConditionalGeneration._from_config(
        transformers.PegasusXConfig(
            vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=37,
            decoder_ffn_dim=37, block_size=4, num_global_tokens=2, dropout=0.0,
            attention_dropout=0.0, activation_dropout=0.0),
        attn_implementation=hf.NAME, torch_dtype=torch.float64),
}


@pytest.mark.parametrize("kind", sorted(SEQ2SEQ_NOT_FLAGGED_CAUSAL))
def test_a_decoder_not_flagged_causal_still_sees_no_later_token(kind):
    """The causal mask is always built for the name (never left to a flag
    the layer does not carry): position 0's logits do not move when the
    last decoder token changes, and match eager's."""
    torch.manual_seed(0)
    model = _sized(SEQ2SEQ_NOT_FLAGGED_CAUSAL[kind]())
    ids = torch.randint(3, VOCAB, (2, 8))
    dec = torch.randint(3, VOCAB, (2, 5))
    dec2 = dec.clone()
    dec2[:, -1] = (dec2[:, -1] + 1 - 3) % (VOCAB - 3) + 3
    with torch.no_grad():
        ours = model(input_ids=ids, decoder_input_ids=dec).logits
        ours2 = model(input_ids=ids, decoder_input_ids=dec2).logits
        model.set_attn_implementation("eager")
        eager = model(input_ids=ids, decoder_input_ids=dec).logits
    torch.testing.assert_close(ours2[:, :-1], ours[:, :-1], rtol=0, atol=1e-12)
    torch.testing.assert_close(ours, eager, rtol=0, atol=1e-10)


def test_fewer_queries_than_keys_without_sdpas_guard_see_the_right_keys():
    """Gemma 4's KV-shared layers keep only the last logits_to_keep queries
    unless the implementation is named "sdpa"; the mask, always built,
    places them (before: top-left causality, 1.77 off)."""
    torch.manual_seed(0)
    cfg = transformers.Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=8,
        sliding_window=4, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8,
        num_kv_shared_layers=2,
        layer_types=["sliding_attention", "full_attention"] * 2)
    model = _sized(transformers.Gemma4ForCausalLM._from_config(
        cfg, attn_implementation=hf.NAME, torch_dtype=torch.float64))
    ids = torch.randint(3, VOCAB, (2, 10))
    with torch.no_grad():
        full = model(input_ids=ids, use_cache=False).logits
        kept = model(input_ids=ids, logits_to_keep=3).logits
        model.set_attn_implementation("sdpa")
        sdpa = model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(full, sdpa, rtol=0, atol=1e-10)
    torch.testing.assert_close(kept, full[:, -3:], rtol=0, atol=1e-10)


def test_sparse_attention_indices_are_refused_not_ignored():
    """DeepSeek-V3.2 hands its indexer's top-k keys to a name other than
    eager/sdpa as indices=; computing dense attention gave logits 0.125 off."""
    torch.manual_seed(0)
    cfg = transformers.DeepseekV32Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=40, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        n_group=1, topk_group=1, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=16,
        qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8, head_dim=8, index_topk=3,
        index_head_dim=16, index_n_heads=2, first_k_dense_replace=2,
        max_position_embeddings=64)
    model = transformers.DeepseekV32ForCausalLM._from_config(
        cfg, attn_implementation=hf.NAME).eval()
    with torch.no_grad(), pytest.raises(ValueError, match="sparse attention indices"):
        model(input_ids=torch.randint(3, VOCAB, (2, 10)))


def _tiny_llama():
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).double().eval()


def test_inference_mode_forward_and_generate():
    """Inference tensors have no version counter: nothing may read one."""
    model = _tiny_llama()
    ids = torch.randint(1, VOCAB, (2, 6))
    pad = torch.ones(2, 6, dtype=torch.long)
    pad[0, :2] = 0
    out = {}
    for impl in ("sdpa", hf.NAME):
        model.set_attn_implementation(impl)
        with torch.inference_mode():
            out[impl] = (model(ids).logits, model(ids, attention_mask=pad).logits,
                         model.generate(ids, max_new_tokens=3, do_sample=False))
    for a, b in zip(out["sdpa"], out[hf.NAME]):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-12)


def test_a_mask_changed_in_place_by_any_route_is_read_anew():
    """A user's 4-D bool mask, changed in place between calls through NumPy
    or .data (its version counter unmoved): the second call sees the change."""
    import numpy as np
    model = _tiny_llama()
    ids = torch.randint(1, VOCAB, (1, 6))
    arr = np.tril(np.ones((6, 6), dtype=bool))[None, None]
    mask = torch.from_numpy(arr)

    def run(impl):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            return model(ids, attention_mask=mask).logits

    run(hf.NAME)
    arr[0, 0, 5, 0] = False
    torch.testing.assert_close(run(hf.NAME), run("sdpa"), rtol=0, atol=1e-12)
    mask.data[0, 0, 4, 1] = False
    torch.testing.assert_close(run(hf.NAME), run("sdpa"), rtol=0, atol=1e-12)


def test_block_sparse_indices_are_refused_not_ignored():
    """MiniMax-M3's sparse layers hand their key blocks to a name other than
    eager/sdpa as block_indices=; dense attention gave logits 0.63 off."""
    cfg = transformers.MiniMaxM3VLTextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rotary_dim=8,
        dense_intermediate_size=64, shared_intermediate_size=64, num_local_experts=2,
        num_experts_per_tok=1, mlp_layer_types=["dense", "dense"],
        layer_types=["minimax_m3_sparse", "full_attention"], index_n_heads=2,
        index_head_dim=16, index_block_size=4, index_topk_blocks=1, index_local_blocks=1,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.MiniMaxM3VLForCausalLM._from_config(
        cfg, attn_implementation=hf.NAME).eval()
    with torch.no_grad(), pytest.raises(ValueError, match=r"block_indices=: MiniMax-M3"):
        model(input_ids=torch.randint(3, VOCAB, (1, 32)), use_cache=False)


USER_SCRIPT = """
import transformers


class MyGit(transformers.GitForCausalLM):
    _can_set_attn_implementation_cached_value = None  # (not the base's, cached by other tests)


class MyBloom(transformers.BloomForCausalLM):
    _can_set_attn_implementation_cached_value = None
"""


def _user_script(tmp_path, monkeypatch):
    """A user's subclasses in a script of their own: no attention class in its
    source, so transformers' _can_set_attn_implementation lets the switch
    through and asks the guard."""
    import importlib
    (tmp_path / "user_models_56.py").write_text(USER_SCRIPT)
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module("user_models_56")


def _git_config():
    return transformers.GitConfig(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, image_size=32, patch_size=16),
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        vocab_size=VOCAB, max_position_embeddings=64)


@pytest.mark.parametrize("kind", ["MyGit", "MyBloom"])
def test_a_users_subclass_of_a_refused_model_is_refused_too(kind, tmp_path, monkeypatch):
    """The guard read the subclass's own module only (none here): a subclass
    of GIT or Bloom switched to the name and lost its causal mask."""
    script = _user_script(tmp_path, monkeypatch)
    torch.manual_seed(0)
    model = (script.MyGit(_git_config()) if kind == "MyGit" else script.MyBloom(
        transformers.BloomConfig(hidden_size=32, n_layer=2, n_head=2, vocab_size=VOCAB))).eval()
    ids = torch.randint(3, VOCAB, (1, 8))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        with pytest.raises(ValueError, match="computes attention with its own code"):
            model.set_attn_implementation(hf.NAME)
        torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=0, atol=0)


def test_a_request_per_sub_config_keeping_sams_vision_on_sdpa_is_taken():
    """SAM's vision layers come from an attention table; a request that keeps
    them on "sdpa" (its vision_config) and gives the mask decoder the name is
    taken by set_attn_implementation as by from_config."""
    import copy
    cfg = transformers.SamConfig(
        vision_config=dict(hidden_size=32, output_channels=256, num_hidden_layers=2,
                           num_attention_heads=2, image_size=64, patch_size=16, mlp_dim=64,
                           global_attn_indexes=[1], window_size=2),
        prompt_encoder_config=dict(image_size=64, patch_size=16),
        mask_decoder_config=dict(num_hidden_layers=2))
    want = {"": hf.NAME, "vision_config": "sdpa", "mask_decoder_config": hf.NAME}
    torch.manual_seed(0)
    model = transformers.SamModel(copy.deepcopy(cfg)).eval()
    x = torch.randn(1, 3, 64, 64)
    points = torch.tensor([[[[10.0, 20.0]]]])
    with torch.no_grad():
        ref = model(pixel_values=x, input_points=points).pred_masks
        model.set_attn_implementation(want)
        assert model.config.mask_decoder_config._attn_implementation == hf.NAME
        assert model.config.vision_config._attn_implementation == "sdpa"
        torch.testing.assert_close(model(pixel_values=x, input_points=points).pred_masks, ref,
                                   rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="computes attention with its own code"):
        transformers.SamModel(copy.deepcopy(cfg)).set_attn_implementation(hf.NAME)


UNCHECKED = {
    # transformers' models that refuse "sdpa": under what "sdpa" would do they
    # computed other numbers (text layers without is_causal became causal)
    "splinter": lambda: transformers.SplinterModel(transformers.SplinterConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=37, attn_implementation=hf.NAME)),
    "align_text": lambda: transformers.AlignTextModel(transformers.AlignTextConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=37, attn_implementation=hf.NAME)),
}


@pytest.mark.parametrize("kind", sorted(UNCHECKED))
def test_models_that_refuse_sdpa_and_were_not_checked_refuse_the_name(kind):
    with pytest.raises(ValueError, match="do not take attn_implementation='sdpa'"):
        UNCHECKED[kind]()
    # and a switch of a built one
    model = transformers.SplinterModel(transformers.SplinterConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=37))
    with pytest.raises(ValueError, match="do not take attn_implementation='sdpa'"):
        model.set_attn_implementation(hf.NAME)
