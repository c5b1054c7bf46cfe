"""mha_ext.hf beyond the architectures of test_hf.py (helper-145's audit of
GPT-NeoX, Phi-3, OPT, StableLM, Starcoder2, Qwen2, Gemma 2/3, OLMo, GPTBigCode,
DistilBERT, RoBERTa, ELECTRA, ViT, CLIP, Whisper, M2M100, Marian, Mixtral,
Cohere, SmolLM3, ModernBERT, Inkling: all gave "sdpa"'s numbers).  Here only
what the audit found and the paths no other test takes:

- a refused construction leaves the config it was given as it was (the model
  already built on that config keeps its numbers), also one failing
  otherwise than by the guard and a refused one of a composite model (SAM)
  each sub-config (helper-152's mutation round), and a refused switch of a
  built composite model its configs;
- attention sinks passed as ``sinks=`` (Inkling 2's name) are refused like
  ``s_aux``, not ignored, and GPT-OSS built on the name refuses its first call;
- a static cache (keys beyond the filled part of the cache, sliding layers
  among full ones) and packed sequences (``position_ids`` restarting, no
  attention mask) give "sdpa"'s tokens and numbers.
"""
import pytest

from _support import need, on_name_and_sdpa, require_torch

torch = require_torch()
transformers = need("transformers")

import mha_ext.hf as hf  # noqa: E402

hf.register()

VOCAB = 99


def _falcon():
    cfg = transformers.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=4)
    return transformers.FalconForCausalLM(cfg)


def _splinter():
    cfg = transformers.SplinterConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1,
                                      num_attention_heads=4, intermediate_size=37)
    return transformers.SplinterModel(cfg)


@pytest.mark.parametrize("kind, build, words", [
    ("falcon", _falcon, "its own code"),
    ("splinter", _splinter, "do not take attn_implementation='sdpa'"),
])
def test_a_refused_construction_leaves_the_shared_config_as_it_was(kind, build, words):
    """from_config copies no config (from_pretrained does): transformers
    writes the name into the one it is given, then the guard refuses the
    model.  The config was left on "mha_ext", and the model already built
    on it (Falcon: its own eager attention) ran on the SDPA masks built for
    the name: other numbers, no error."""
    torch.manual_seed(0)
    model = build().eval()
    x = dict(input_ids=torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 8, 9]]),
             attention_mask=torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]]))
    was = model.config._attn_implementation
    with torch.no_grad():
        before = model(**x)[0]
        with pytest.raises(ValueError, match=words):
            transformers.AutoModel.from_config(model.config, attn_implementation=hf.NAME)
        assert model.config._attn_implementation == was
        torch.testing.assert_close(model(**x)[0], before, rtol=0, atol=0)
    # the config still builds a model, on its own implementation
    assert type(model)._from_config(model.config).config._attn_implementation == was


def test_a_from_config_failing_otherwise_than_by_the_guard_leaves_the_config_as_it_was():
    """transformers writes the requested implementation into the config it
    is given before it builds the model; a from_config under the name that
    then fails for any reason (here a keyword the model's constructor does
    not take: its TypeError, not the guard's ValueError) leaves that config
    as it was (mha_ext/hf.py's module docstring: "A refused from_config
    leaves the config it was given as it was"), so a model already built on
    it keeps computing as before."""
    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2)
    cfg._attn_implementation = "eager"
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        transformers.LlamaForCausalLM._from_config(cfg, attn_implementation=hf.NAME,
                                                   not_a_keyword=1)
    assert cfg._attn_implementation == "eager"


def _sam_config():
    return transformers.SamConfig(
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           output_channels=16, image_size=64, patch_size=16, mlp_dim=32,
                           global_attn_indexes=[0], num_pos_feats=8),
        prompt_encoder_config=dict(hidden_size=16, image_size=64, patch_size=16),
        mask_decoder_config=dict(hidden_size=16, num_attention_heads=2, mlp_dim=16,
                                 iou_head_hidden_dim=16))


def test_a_refused_from_config_of_a_composite_model_leaves_its_sub_configs_as_they_were():
    """SAM's vision layers pick their attention from a table of their own
    (refused under the name).  transformers writes the requested name into
    every sub-config before building; the refusal puts each back (read
    here from the config's own sub_configs, not through mha_ext.hf), so the
    same config still builds a SAM model afterwards (with a sub-config left
    on the name, that construction was refused too)."""
    cfg = _sam_config()
    subs = {k: getattr(cfg, k) for k in cfg.sub_configs}
    was = {k: c._attn_implementation_internal for k, c in subs.items()}
    with pytest.raises(ValueError, match="SAM_VISION_ATTENTION_CLASSES"):
        transformers.SamModel._from_config(cfg, attn_implementation=hf.NAME)
    assert {k: c._attn_implementation_internal for k, c in subs.items()} == was
    transformers.SamModel(cfg)


def test_a_refused_switch_of_a_composite_model_leaves_its_configs_as_they_were():
    """SAM's vision encoder has its own attention code: the guard refuses
    set_attn_implementation("mha_ext"), after transformers wrote the name
    into the top config (its sub-configs kept theirs)."""
    model = transformers.SamModel(_sam_config())
    configs = hf._config_tree(model.config)
    was = [c._attn_implementation_internal for c in configs]
    with pytest.raises(ValueError, match="its own code"):
        model.set_attn_implementation(hf.NAME)
    assert [c._attn_implementation_internal for c in configs] == was


def test_attention_sinks_named_sinks_are_refused_not_ignored():
    """Inkling 2 passes its sinks as ``sinks=`` (GPT-OSS as ``s_aux=``): the
    twin has no sink column, so both are refused (the model itself is refused
    at construction, a user's own model would not be)."""
    layer = torch.nn.Module()
    layer.is_causal = False
    q = k = v = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match=r"attention sinks \(sinks\)"):
        hf.attention_forward(layer, q, k, v, None, sinks=torch.zeros(1, 2, 3, 1))


def test_gpt_oss_built_on_the_name_refuses_its_sinks_at_the_first_call():
    """GPT-OSS (attention sinks, passed as ``s_aux=``) builds on the name,
    as transformers lets it, and its first forward is refused with the
    reason, not run without its sink column."""
    cfg = transformers.GptOssConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                    num_experts_per_tok=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=hf.NAME)
    assert model.config._attn_implementation == hf.NAME
    with torch.no_grad(), pytest.raises(ValueError, match=r"attention sinks \(s_aux\)"):
        model(torch.tensor([[1, 2, 3]]))


def _qwen2_sliding(dtype=torch.float32):
    """Qwen2 with a sliding layer (window 3) after a full one, GQA 4:2."""
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        use_sliding_window=True, sliding_window=3, max_window_layers=1, initializer_range=0.2,
        bos_token_id=0, eos_token_id=1, pad_token_id=2)
    return transformers.Qwen2ForCausalLM(cfg).to(dtype).eval()


def _both(model, fn):
    return on_name_and_sdpa(model, fn, hf.NAME)


def test_static_cache_generate_with_sliding_layers_gives_sdpas_tokens():
    """A static cache: every step's keys are the cache's whole length, the
    unfilled slots masked; the sliding layer's cache holds the window only."""
    model = _qwen2_sliding()
    ids = torch.randint(3, VOCAB, (3, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[1] * 7, [0] * 2 + [1] * 5, [0] * 5 + [1] * 2])
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=2, eos_token_id=None,
              cache_implementation="static")
    with torch.no_grad():
        ours, ref = _both(model, lambda m: m.generate(input_ids=ids, attention_mask=mask, **kw))
    assert ours.shape == ref.shape == (3, 15)
    assert torch.equal(ours, ref)


def test_packed_sequences_in_position_ids_give_sdpas_numbers():
    """No attention mask, position_ids restarting at 0 (a padding-free
    collator's packed batch) and no cache (training's setting): transformers
    builds a block-causal mask from the positions, which reaches the twin."""
    model = _qwen2_sliding(torch.float64)
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 0, 1]])
    def packed(m):
        return m(input_ids=ids, position_ids=pos, use_cache=False).logits

    with torch.no_grad():
        ours, ref = _both(model, packed)
        whole = model(input_ids=ids[:1, 3:], position_ids=pos[:1, 3:]).logits
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-10)
    # the second sequence of row 0 sees nothing of the first
    torch.testing.assert_close(ours[:1, 3:], whole, rtol=1e-10, atol=1e-10)
