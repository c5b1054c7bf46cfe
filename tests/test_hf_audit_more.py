"""mha_ext.hf on the architectures the earlier audits left out (helper-150's
audit: LLaVA-Next, LLaVA-OneVision (images and video), LLaVA-Next-Video,
SAM2 (image model, the video model's memory attention), EdgeTAM-Video's
perceiver and memory attention, UDOP, Voxtral, Mimi, Moshi (text, audio and
depth decoder), CSM, Emu3 (text and VQ-VAE), Qwen2.5-Omni's thinker (image
windows, audio chunks), Janus, Idefics (v1, with and without its
perceiver), Fuyu, BLT, Cohere-Compass (text and vision): float64 outputs and
gradients and float32 outputs and greedy tokens as "sdpa"'s; DeepSeek-V4
and HY-V4 (attention sinks) and Mistral-Large4 (sparse indices) refuse their
first call).  Here the paths no other test takes, each against "sdpa":

- LLaVA-Next's anyres tiles: two images of other aspect ratios give 3 and 5
  crops, their unpadded features 56 and 88 tokens, in a left-padded batch;
  the CLIP tower's calls have no mask and must not be causal;
- SAM2's two-way attention (9 prompt tokens against 64 image tokens and
  back, no mask, not causal, queries and keys of other lengths) and the
  video model's memory attention (RoPE on the spatial memory, none on the
  object-pointer tokens);
- UDOP's relative bias: one (B, H, L, S) float bias a batch row (from the
  token boxes), folded with the padding, T5's scale 1.0, the bias tables'
  gradients through the folded mask;
- Idefics' gated cross-attention (a float mask whose rows before the first
  image block every key) and Fuyu: a generate loop over a left-padded batch;
- Moshi's and CSM's depth decoders: no mask at all, the layers' own
  ``is_causal`` (Moshi passes none) the only causal signal;
- DeepSeek-V4, HY-V4 (``s_aux``) and Mistral-Large4 (``indices``) built on
  the name refuse their first call with the reason.

Tolerances: float64 1e-10 relative to the largest reference value (the twin
and torch's math sum in other orders; the differences seen were ~1e-16);
float32 1e-5 likewise (~5e-7 seen).
"""
import pytest

from _support import need, on_name_and_sdpa, require_torch

torch = require_torch()
transformers = need("transformers")

import mha_ext.hf as hf  # noqa: E402

hf.register()

IMG, VID = 90, 91
TEXT = dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)


def _both(model, fn):
    return on_name_and_sdpa(model, fn, hf.NAME)


def _close(ours, ref, tol):
    torch.testing.assert_close(ours, ref, rtol=tol, atol=tol * ref.abs().max().item())


def _flat(grads):
    return torch.cat([g.flatten() for g in grads])


def _backward(y, weight=1):
    """Backward of a fixed random weighting of `y` (times `weight`)."""
    w = torch.randn(y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(1))
    (y * w * weight).sum().backward()


def _outputs_and_grads(inputs, leaves, out=lambda o: o.logits, weight=None):
    """fn(model): the output out(model(**inputs)) and the gradients of every
    parameter and of the inputs named in `leaves` of a fixed random weighting
    of it (times `weight`, broadcast: the real tokens only)."""
    def run(model):
        model.zero_grad(set_to_none=True)
        x = dict(inputs, **{k: inputs[k].clone().requires_grad_(True) for k in leaves})
        y = out(model(**x))
        _backward(y, 1 if weight is None else weight)
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        return y.detach(), grads + [x[k].grad for k in leaves]
    return run


def _check(ours, ref, n_grads):
    (yo, go), (yr, gr) = ours, ref
    _close(yo, yr, 1e-10)
    assert len(go) == len(gr) >= n_grads
    _close(_flat(go), _flat(gr), 1e-10)


def _spy(monkeypatch):
    """The twin's calls: (query shape, key shape, mask or None, is_causal)."""
    calls = []
    twin = hf._twin()

    def spy(q, k, v, **kw):
        calls.append((tuple(q.shape), tuple(k.shape), kw.get("attn_mask"), kw.get("is_causal")))
        return twin(q, k, v, **kw)

    monkeypatch.setattr(hf, "_twin", lambda: spy)
    return calls


def test_llava_next_anyres_tiles_with_unpadded_features_give_sdpas_numbers(monkeypatch):
    """Images of 30x14 and 20x20 pixels pick the 32x16 and 32x32 grids: 1 + 2
    and 1 + 4 crops of 16x16, unpadded to 56 and 88 image tokens, in a batch
    left-padded to 93.  The CLIP tower (8 crops, 17 tokens) is called without
    a mask and must not be causal; logits and gradients (float64) and greedy
    tokens (float32) as "sdpa"'s."""
    torch.manual_seed(0)
    cfg = transformers.LlavaNextConfig(
        text_config=dict(TEXT, model_type="llama"),
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=37,
                           num_hidden_layers=2, num_attention_heads=4, image_size=16,
                           patch_size=4, projection_dim=32),
        image_token_index=IMG, image_grid_pinpoints=[[16, 32], [32, 16], [32, 32]],
        vision_feature_layer=-1)
    model = transformers.LlavaNextForConditionalGeneration(cfg).eval().to(torch.float64)
    n0, n1 = 56, 88
    ids = torch.zeros(2, n1 + 5, dtype=torch.long)
    ids[0, -(n0 + 5):] = torch.tensor([1, 5] + [IMG] * n0 + [6, 7, 8])
    ids[1] = torch.tensor([1, 5] + [IMG] * n1 + [6, 7, 8])
    inputs = dict(input_ids=ids, attention_mask=(ids != 0).long(),
                  pixel_values=torch.randn(2, 5, 3, 16, 16, dtype=torch.float64),
                  image_sizes=torch.tensor([[30, 14], [20, 20]]))
    calls = _spy(monkeypatch)
    run = _outputs_and_grads(inputs, ["pixel_values"],
                             weight=inputs["attention_mask"][..., None])
    _check(*_both(model, run), 40)
    vision = [c for c in calls if c[0][2] == 17]
    assert [c[0] for c in vision] == [(8, 4, 17, 8)] * 2
    assert all(c[2] is None and c[3] is False for c in vision)

    model.float()
    gen = dict(inputs, pixel_values=inputs["pixel_values"].float())
    with torch.no_grad():
        tokens, ref = _both(model, lambda m: m.generate(**gen, max_new_tokens=6, do_sample=False))
    assert tokens.shape == (2, 99) and torch.equal(tokens, ref)


def _sam2_config(video=False):
    backbone = dict(model_type="sam2_hiera_det_model", hidden_size=12,
                    embed_dim_per_stage=[12, 24, 48, 96],
                    num_attention_heads_per_stage=[1, 2, 4, 8], image_size=[128, 128])
    parts = dict(
        vision_config=dict(model_type="sam2_vision_model", backbone_config=backbone,
                           backbone_channel_list=[96, 48, 24, 12],
                           backbone_feature_sizes=[[32, 32], [16, 16], [8, 8]], fpn_hidden_size=32),
        prompt_encoder_config=dict(hidden_size=32, image_size=128, patch_size=16,
                                   mask_input_channels=8),
        mask_decoder_config=dict(hidden_size=32, mlp_dim=64, num_attention_heads=4,
                                 iou_head_hidden_dim=32))
    if not video:
        return transformers.Sam2Config(**parts)
    return transformers.Sam2VideoConfig(
        **parts, image_size=128, memory_attention_hidden_size=32, memory_attention_num_layers=2,
        memory_attention_num_attention_heads=2, memory_attention_feed_forward_hidden_size=64,
        memory_attention_rope_feat_sizes=[8, 8], memory_encoder_hidden_size=32,
        memory_encoder_output_channels=64, mask_downsampler_embed_dim=32,
        memory_fuser_embed_dim=32, memory_fuser_intermediate_dim=64)


def test_sam2_two_way_and_memory_attention_without_masks_give_sdpas_numbers(monkeypatch):
    """SAM2's mask decoder from given image embeddings (the three FPN levels,
    leaves of the graph): its 9 tokens (7 output tokens, 2 points)
    attend to the 64 image tokens and back, no mask, not causal.  The video
    model's memory attention: 64 frame tokens against 2 memory frames of 64
    tokens (RoPE'd) and 4 object pointers (not).  Outputs and the gradients
    of the parameters and of the embeddings and memories, float64."""
    torch.manual_seed(0)
    model = transformers.Sam2Model(_sam2_config()).eval().to(torch.float64)
    g = torch.Generator().manual_seed(2)
    emb = [torch.randn(2, c, s, s, dtype=torch.float64, generator=g)
           for c, s in ((4, 32), (8, 16), (32, 8))]
    points = torch.tensor([[[[10., 20.], [60., 70.]]], [[[100., 30.], [5., 5.]]]],
                          dtype=torch.float64)

    def decode(m):
        m.zero_grad(set_to_none=True)
        leaves = [e.clone().requires_grad_(True) for e in emb]
        out = m(image_embeddings=leaves, input_points=points,
                input_labels=torch.tensor([[[1, 0]], [[1, -1]]]), multimask_output=True)
        y = torch.cat([out.pred_masks.flatten(), out.iou_scores.flatten()])
        _backward(y)
        grads = [p.grad for p in m.parameters() if p.grad is not None]
        return y.detach(), grads + [e.grad for e in leaves]

    calls = _spy(monkeypatch)
    _check(*_both(model, decode), 20)
    two_way = {c[:2] for c in calls}
    assert ((2, 4, 9, 4), (2, 4, 64, 4)) in two_way and ((2, 4, 64, 4), (2, 4, 9, 4)) in two_way
    assert all(c[2] is None and c[3] is False for c in calls)

    torch.manual_seed(0)
    video = transformers.Sam2VideoModel(_sam2_config(video=True)).eval().to(torch.float64)
    # 64 frame tokens; 2 memory frames of 64 tokens and 4 object pointers
    x = {k: torch.randn(*shape, dtype=torch.float64, generator=g) for k, shape in (
        ("current_vision_features", (64, 2, 32)),
        ("current_vision_position_embeddings", (64, 2, 32)),
        ("memory", (132, 2, 64)), ("memory_posision_embeddings", (132, 2, 64)))}

    def attend(m):
        m.zero_grad(set_to_none=True)
        leaves = {k: v.clone().requires_grad_(True) for k, v in x.items()}
        y = m.memory_attention(**leaves, num_object_pointer_tokens=4)
        _backward(y)
        grads = [p.grad for p in m.memory_attention.parameters() if p.grad is not None]
        return y.detach(), grads + [leaves["memory"].grad, leaves["current_vision_features"].grad]

    calls.clear()
    _check(*_both(video, attend), 20)
    assert {c[:2] for c in calls} == {((2, 2, 64, 16), (2, 2, 64, 16)),
                                     ((2, 2, 64, 16), (2, 2, 132, 16))}


def test_udop_relative_bias_of_the_boxes_with_padding_and_its_gradient():
    """UDOP adds to T5's 1-D bucket bias a horizontal and a vertical one from
    each token's box: a (B, H, L, S) float bias of its own a batch row,
    folded with the padding mask; scale 1.0 (T5's).  Logits and every
    gradient (the three bias tables' too, through the folded float mask;
    pixels) as "sdpa"'s, float64."""
    torch.manual_seed(0)
    cfg = transformers.UdopConfig(vocab_size=99, d_model=32, d_kv=8, d_ff=37, num_layers=2,
                                  num_heads=4, image_size=32, patch_size=8, dropout_rate=0.0,
                                  decoder_start_token_id=0)
    model = transformers.UdopForConditionalGeneration(cfg).eval().to(torch.float64)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 1], [5, 6, 7, 1, 0, 0, 0]])
    g = torch.Generator().manual_seed(3)
    bbox = torch.rand(2, 7, 4, dtype=torch.float64, generator=g)
    bbox[..., 2:] = bbox[..., :2] + 0.1
    inputs = dict(input_ids=ids, attention_mask=(ids != 0).long(), bbox=bbox,
                  pixel_values=torch.randn(2, 3, 32, 32, dtype=torch.float64, generator=g),
                  decoder_input_ids=torch.tensor([[0, 11, 12, 13], [0, 14, 15, 16]]))
    ours, ref = _both(model, _outputs_and_grads(inputs, ["pixel_values"]))
    _check(ours, ref, 40)
    # the model is left with "sdpa"'s gradients: the same parameters have one
    names = [n for n, p in model.named_parameters() if p.grad is not None]
    tables = [i for i, n in enumerate(names) if n.startswith("encoder.relative_bias.biases")]
    # the horizontal and vertical tables (the 1-D one is layer 0's T5 table),
    # reached only through the folded mask
    assert len(tables) == 2
    for i in tables:
        assert ours[1][i].abs().max() > 0
        _close(ours[1][i], ref[1][i], 1e-10)


def _idefics():
    cfg = transformers.IdeficsConfig(
        vocab_size=99, additional_vocab_size=2, hidden_size=32, intermediate_size=37,
        num_hidden_layers=2, num_attention_heads=4, cross_layer_interval=1, alpha_initializer="ones",
        vision_config=dict(embed_dim=32, image_size=16, intermediate_size=37, patch_size=4,
                           num_hidden_layers=2, num_attention_heads=4),
        freeze_text_layers=False, freeze_vision_layers=False)
    model = transformers.IdeficsForVisionText2Text(cfg)
    ids = torch.tensor([[1, IMG, 5, 6, 7, IMG, 8, 9], [0, 0, 1, IMG, 5, 6, 7, 8]])
    seen = torch.zeros(2, 8, 2, dtype=torch.long)  # token i sees image k from its place on
    seen[0, 1:, 0] = 1
    seen[0, 5:, 1] = 1
    seen[1, 3:, 0] = 1
    return model, dict(input_ids=ids, attention_mask=(ids != 0).long(), image_attention_mask=seen,
                       pixel_values=torch.randn(2, 2, 3, 16, 16)), "pixel_values"


def _fuyu():
    cfg = transformers.FuyuConfig(
        image_size=16, patch_size=4, image_token_id=IMG,
        text_config=dict(model_type="persimmon", vocab_size=99, hidden_size=32, intermediate_size=37,
                         num_hidden_layers=2, num_attention_heads=4, pad_token_id=0,
                         bos_token_id=1, eos_token_id=2, qk_layernorm=True))
    model = transformers.FuyuForCausalLM(cfg)
    ids = torch.tensor([[1] + [IMG] * 4 + [5, 6, 7], [0, 0, 1] + [IMG] * 4 + [5]])
    return model, dict(input_ids=ids, attention_mask=(ids != 0).long(),
                       pixel_values=torch.randn(2, 4, 4 * 4 * 3)), "pixel_values"


@pytest.mark.parametrize("build", [_idefics, _fuyu], ids=["idefics", "fuyu"])
def test_idefics_and_fuyu_generate_over_a_left_padded_batch(build):
    """Idefics' gated cross-attention takes a float mask whose rows before
    the first image block every key (their output gated to 0), extended a
    step at a time by generate; Fuyu (Persimmon with qk-layernorm, partial
    RoPE) takes image patches in place of tokens.  Logits and gradients
    (float64) and 8 greedy tokens (float32) as "sdpa"'s."""
    torch.manual_seed(0)
    model, inputs, leaf = build()
    model = model.eval().to(torch.float64)
    x = dict(inputs, **{leaf: inputs[leaf].double()})
    run = _outputs_and_grads(x, [leaf], weight=inputs["attention_mask"][..., None])
    _check(*_both(model, run), 30)

    model.float()
    with torch.no_grad():
        tokens, ref = _both(model, lambda m: m.generate(**inputs, max_new_tokens=8, do_sample=False))
    assert tokens.shape == (2, 16) and torch.equal(tokens, ref)


def test_moshi_and_csm_depth_decoders_causal_without_a_mask(monkeypatch):
    """Moshi's depth decoder gives its layers no mask and no is_causal (the
    layers' own ``is_causal = True`` is the only causal signal); CSM's
    decoder a lower-right causal mask (computed as is_causal="lower_right").
    Outputs and gradients as "sdpa"'s, float64, and the causal pattern is
    there: the first position's logits do not move with a later code."""
    from transformers.models.moshi.modeling_moshi import MoshiDepthDecoder
    torch.manual_seed(0)
    moshi = MoshiDepthDecoder(transformers.MoshiDepthConfig(
        vocab_size=99, hidden_size=32, input_size=32, num_hidden_layers=2, num_attention_heads=4,
        audio_vocab_size=32, ffn_dim=74, num_codebooks=3, sliding_window=3,
        max_position_embeddings=3)).eval().to(torch.float64)
    hidden = torch.randn(2, 3, 32, dtype=torch.float64)
    codes = torch.tensor([[5, 3, 4], [6, 7, 8]])
    calls = _spy(monkeypatch)
    _check(*_both(moshi, _outputs_and_grads(dict(input_ids=codes, last_hidden_state=hidden),
                                            ["last_hidden_state"])), 15)
    assert calls and all(c[2] is None and c[3] is True for c in calls)
    moshi.set_attn_implementation(hf.NAME)
    with torch.no_grad():
        a = moshi(input_ids=codes, last_hidden_state=hidden).logits
        later = torch.cat([codes[:, :1], codes[:, 1:].flip(0)], 1)  # the first code kept
        b = moshi(input_ids=later, last_hidden_state=hidden).logits
    moshi.set_attn_implementation("sdpa")
    _close(a[:, 0], b[:, 0], 1e-12)
    assert (a[:, 1:] - b[:, 1:]).abs().max() > 1e-3

    csm = transformers.CsmDepthDecoderForCausalLM(transformers.CsmDepthDecoderConfig(
        num_codebooks=3, backbone_hidden_size=32, vocab_size=40, hidden_size=32,
        intermediate_size=37, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=4)).eval().to(torch.float64)
    calls.clear()
    inputs = dict(input_ids=torch.tensor([[0, 5, 6], [0, 7, 8]]),
                  backbone_last_hidden_state=torch.randn(2, 32, dtype=torch.float64))
    _check(*_both(csm, _outputs_and_grads(inputs, ["backbone_last_hidden_state"])), 15)
    assert calls and all(c[2] is None and c[3] == "lower_right" for c in calls)


def _deepseek_v4():
    return transformers.AutoModelForCausalLM.from_config(transformers.DeepseekV4Config(
        vocab_size=99, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, q_lora_rank=16,
        n_routed_experts=4, num_experts_per_tok=2, sliding_window=4, o_groups=2, o_lora_rank=16,
        index_n_heads=2, index_head_dim=8, index_topk=4, max_position_embeddings=64,
        hc_sinkhorn_iters=3, pad_token_id=0), attn_implementation=hf.NAME)


def _hy_v4():
    return transformers.AutoModelForCausalLM.from_config(transformers.HYV4Config(
        vocab_size=99, hidden_size=32, intermediate_size=37, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
        n_routed_experts=4, num_experts_per_tok=2, q_lora_rank=16, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, index_topk=4, index_head_dim=8,
        index_n_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
        eos_token_id=2), attn_implementation=hf.NAME)


def _mistral_large4():
    return transformers.MistralLarge4TextModel._from_config(transformers.MistralLarge4TextConfig(
        vocab_size=99, hidden_size=32, intermediate_size=37, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, kv_lora_rank=16, qk_rope_head_dim=4, v_head_dim=8,
        qk_nope_head_dim=4, head_dim=8, index_topk=4, index_head_dim=8, index_n_heads=2,
        max_position_embeddings=64, pad_token_id=0), attn_implementation=hf.NAME)


@pytest.mark.parametrize("build, words", [
    (_deepseek_v4, r"attention sinks \(s_aux\)"),
    (_hy_v4, r"attention sinks \(s_aux\)"),
    (_mistral_large4, r"sparse attention indices \(indices=: a DeepSeek-V3.2-style"),
], ids=["deepseek_v4", "hy_v4", "mistral_large4"])
def test_sinks_and_sparse_indices_of_the_newest_decoders_are_refused_at_the_first_call(build, words):
    """DeepSeek-V4 and HY-V4 (no "sdpa"; checked under the name) pass
    attention sinks, Mistral-Large4's indexed layers their top-k keys as
    ``indices=`` (folded into the mask for "eager"/"sdpa" only): built on the
    name, each refuses its first call with the reason, not dense numbers."""
    torch.manual_seed(0)
    model = build().eval()
    assert model.config._attn_implementation == hf.NAME
    with torch.no_grad(), pytest.raises(ValueError, match=words):
        model(input_ids=torch.tensor([[1, 5, 6, 7], [0, 1, 5, 6]]),
              attention_mask=torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]]))
