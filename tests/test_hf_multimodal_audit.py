"""mha_ext.hf on vision, audio and multimodal architectures (helper-148's
audit: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V, Gemma 3 multimodal, Gemma 3n,
PaliGemma, SigLIP, SigLIP2, LLaVA, Idefics2/3, SmolVLM, BLIP-2,
InstructBLIP, Mllama, Llama 4, Aria, Janus, Florence-2, Kosmos-2, Pixtral,
DINOv2, DeiT, BEiT, Swin, YOLOS, VideoMAE, OWLv2, AST, Wav2Vec2 (+Conformer,
BERT), HuBERT, Data2Vec-Audio, SEW, UniSpeech-SAT, Qwen2-Audio,
SeamlessM4T (v1, v2) speech, mBART, Pegasus, Pop2Piano, Musicgen's decoder,
VisionEncoderDecoder against "sdpa"; Speech2Text and T5Gemma against
"eager": all gave the reference's numbers, gradients and tokens).  Here the
mask paths no other test takes, each a comparison against "sdpa":

- Qwen2-VL's vision tower: images of two sizes packed into one sequence
  (``cu_seqlens``), each attended alone (block-diagonal), one call a chunk;
- Gemma 3's image tokens attend to each other both ways inside the causal
  text mask (``token_type_ids``), a sliding layer shorter than the block,
  gradients included;
- PaliGemma's prefix-LM: the prefix (image and prompt) attends both ways,
  the suffix causally; without ``token_type_ids`` "mha_ext" keeps the causal
  mask that "sdpa" leaves out (eager's numbers, as hf.py's docstring says).
"""
import pytest

from _support import need, on_name_and_sdpa, require_torch

torch = require_torch()
transformers = need("transformers")

import mha_ext.hf as hf  # noqa: E402

hf.register()

IMG, BOI, EOI = 90, 91, 92
TEXT = dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)
VISION = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
              image_size=32, patch_size=8)


def _both(model, fn):
    return on_name_and_sdpa(model, fn, hf.NAME)


def _logits_and_grads(inputs, grad_key):
    def run(model):
        model.zero_grad(set_to_none=True)
        x = dict(inputs, **{grad_key: inputs[grad_key].clone().requires_grad_(True)})
        logits = model(**x).logits
        w = torch.randn(logits.shape, dtype=logits.dtype,
                        generator=torch.Generator().manual_seed(1))
        # the real positions only: "sdpa"'s backward of a padded query row
        # (every key blocked) is not the math's (Kosmos-2's float masks)
        (logits * w * x["attention_mask"][..., None]).sum().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        return logits.detach(), grads + [x[grad_key].grad]
    return run


def _close(ours, ref, tol):
    (lo, go), (lr, gr) = ours, ref
    torch.testing.assert_close(lo, lr, rtol=tol, atol=tol * lr.abs().max().item())
    assert len(go) == len(gr) and len(go) > 10
    go, gr = torch.cat([g.flatten() for g in go]), torch.cat([g.flatten() for g in gr])
    torch.testing.assert_close(go, gr, rtol=tol, atol=tol * gr.abs().max().item())


def test_qwen2_vl_packed_images_attend_alone_and_give_sdpas_numbers(monkeypatch):
    """Two images of 16 and 8 patches, packed into one vision sequence (twice:
    a batch of two prompts), cut at cu_seqlens: each image is one twin call
    of its own length, never the packed 48 patches; logits, parameter and pixel
    gradients (float64), greedy tokens (float32) as "sdpa"'s."""
    torch.manual_seed(0)
    cfg = transformers.Qwen2VLConfig(
        text_config=dict(TEXT, rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2],
                                                "rope_theta": 10000.0}),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=32, num_heads=4, patch_size=4,
                           temporal_patch_size=2, spatial_merge_size=2),
        image_token_id=IMG, video_token_id=93, vision_start_token_id=BOI, vision_end_token_id=EOI)
    model = transformers.Qwen2VLForConditionalGeneration(cfg).eval().to(torch.float64)
    grid = torch.tensor([[1, 4, 4], [1, 2, 4]] * 2)
    pixels = torch.randn(24 * 2, 3 * 2 * 4 * 4, dtype=torch.float64)
    ids = torch.tensor([[5, BOI] + [IMG] * 4 + [EOI, 7, 8, BOI] + [IMG] * 2 + [EOI, 9, 10],
                        [0, 0, 0, BOI] + [IMG] * 4 + [EOI, 7, BOI] + [IMG] * 2 + [EOI, 11]])
    inputs = dict(input_ids=ids, attention_mask=(ids != 0).long(), pixel_values=pixels,
                  image_grid_thw=grid, mm_token_type_ids=(ids == IMG).long())

    lengths = []
    twin = hf._twin()

    def spy(q, k, v, **kw):
        lengths.append(q.shape[2])
        return twin(q, k, v, **kw)

    monkeypatch.setattr(hf, "_twin", lambda: spy)
    ours, ref = _both(model, _logits_and_grads(inputs, "pixel_values"))
    _close(ours, ref, 1e-10)
    # forward: 2 vision layers x 4 images, then 2 text layers over 15 tokens
    assert lengths == [16, 8, 16, 8] * 2 + [15, 15]

    model.float()
    kw = dict(max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        tokens, ref_tokens = _both(model, lambda m: m.generate(**dict(inputs, pixel_values=pixels.float()), **kw))
    assert torch.equal(tokens, ref_tokens)


def test_gemma3_image_block_attends_both_ways_with_sdpas_numbers_and_gradients():
    """Gemma 3 multimodal: the 4 image tokens of a prompt see each other both
    ways (token_type_ids), a sliding layer (window 3) cuts the block, a left
    padded row; logits and gradients (float64) and tokens as "sdpa"'s, and
    the block is really bidirectional (an image token's logits move when a
    later image token's do)."""
    torch.manual_seed(0)
    cfg = transformers.Gemma3Config(
        text_config=dict(TEXT, head_dim=8, sliding_window=3,
                         layer_types=["sliding_attention", "full_attention"]),
        vision_config=VISION, mm_tokens_per_image=4, image_token_index=IMG,
        boi_token_index=BOI, eoi_token_index=EOI)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval().to(torch.float64)
    ids = torch.tensor([[5, BOI] + [IMG] * 4 + [EOI, 7, 8, 9],
                        [0, 0, BOI] + [IMG] * 4 + [EOI, 7, 8]])
    inputs = dict(input_ids=ids, attention_mask=(ids != 0).long(),
                  pixel_values=torch.randn(2, 3, 32, 32, dtype=torch.float64),
                  token_type_ids=(ids == IMG).long())
    ours, ref = _both(model, _logits_and_grads(inputs, "pixel_values"))
    _close(ours, ref, 1e-10)

    model.set_attn_implementation(hf.NAME)
    with torch.no_grad():
        causal = model(**dict(inputs, token_type_ids=None)).logits
    model.set_attn_implementation("sdpa")
    first_image = ours[0][0, 2]
    assert (first_image - causal[0, 2]).abs().max() > 1e-3  # it saw later image tokens
    torch.testing.assert_close(ours[0][0, :2], causal[0, :2], rtol=1e-10, atol=1e-10)

    model.float()
    inputs["pixel_values"] = inputs["pixel_values"].float()
    with torch.no_grad():
        tokens, ref_tokens = _both(model, lambda m: m.generate(**inputs, max_new_tokens=6,
                                                               do_sample=False))
    assert torch.equal(tokens, ref_tokens)


def _paligemma():
    torch.manual_seed(0)
    cfg = transformers.PaliGemmaConfig(
        text_config=dict(TEXT, model_type="gemma", head_dim=8), vision_config=dict(VISION, projection_dim=32),
        image_token_index=IMG, projection_dim=32, hidden_size=32)
    return transformers.PaliGemmaForConditionalGeneration(cfg).eval()


def test_paligemma_prefix_attends_both_ways_with_sdpas_numbers():
    """PaliGemma's prefix (16 image tokens and the prompt) attends both ways,
    the suffix (token_type_ids 1) causally, a left-padded row: logits and
    gradients (float64) and greedy tokens as "sdpa"'s.  Without
    token_type_ids and without padding "sdpa" leaves the causal mask out and
    its layers, not flagged causal, see later tokens: "mha_ext" keeps the
    mask and gives eager's numbers."""
    model = _paligemma().to(torch.float64)
    ids = torch.tensor([[IMG] * 16 + [1, 5, 6, 7, 8, 9], [0, 0] + [IMG] * 16 + [1, 5, 6, 7]])
    suffix = torch.zeros_like(ids)
    suffix[0, -2:] = 1
    suffix[1, -1:] = 1
    inputs = dict(input_ids=ids, attention_mask=(ids != 0).long(), token_type_ids=suffix,
                  pixel_values=torch.randn(2, 3, 32, 32, dtype=torch.float64))
    ours, ref = _both(model, _logits_and_grads(inputs, "pixel_values"))
    _close(ours, ref, 1e-10)

    model.float()
    gen = dict(inputs, pixel_values=inputs["pixel_values"].float(),
               token_type_ids=torch.zeros_like(ids))
    with torch.no_grad():
        tokens, ref_tokens = _both(model, lambda m: m.generate(**gen, max_new_tokens=6,
                                                               do_sample=False))
        assert torch.equal(tokens, ref_tokens)

        plain = dict(input_ids=ids[:1], pixel_values=gen["pixel_values"][:1])
        model.set_attn_implementation("eager")
        eager = model(**plain).logits
        model.set_attn_implementation(hf.NAME)
        ours = model(**plain).logits
        model.set_attn_implementation("sdpa")
    torch.testing.assert_close(ours, eager, rtol=1e-5, atol=1e-5 * eager.abs().max().item())
