"""mha_ext.hf on decoder-only LLMs with unusual attention (helper-147's
audit: DeepSeek-V2/V3 and the other MLA models, Llama 4, GLM/GLM4/GLM4-MoE,
Granite(-MoE), Phi, Gemma3n, Qwen3-MoE/Next, Exaone4, Hunyuan, Ernie 4.5,
dots1, MiniMax, Jamba, Bamba, Zamba/Zamba2, Falcon-H1, Arcee, Apertus,
SEED-OSS, Olmo3, Helium and others: all gave "sdpa"'s numbers, gradients and
greedy tokens; GPT-OSS refuses its sinks).  Here only the paths no other test
takes, each against "sdpa":

- multi-head latent attention: query/key heads wider than value heads
  (Dk != Dv), through a DeepSeek-V3 decoder, with left padding;
- Llama 4's chunked attention (a mask that is neither causal nor a sliding
  window) and its attention temperature tuning on the layers without RoPE;
- a learned float mask that needs a gradient (Doge's dynamic mask, computed
  from the value states and added to the padding mask).
"""
import copy

import pytest

from _support import need, require_torch

torch = require_torch()
transformers = need("transformers")

import mha_ext.hf as hf  # noqa: E402

hf.register()

VOCAB = 99


def _deepseek_v3():
    """MLA: query/key heads 8 (no RoPE) + 8 (RoPE) = 16 wide, value heads 12;
    YaRN's mscale makes the layers' scaling other than 1/sqrt(16)."""
    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1, n_group=1,
        topk_group=1, n_shared_experts=1, max_position_embeddings=64, pad_token_id=0,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale_all_dim=1.0,
                             original_max_position_embeddings=16),
        bos_token_id=1, eos_token_id=2)
    return transformers.DeepseekV3ForCausalLM, cfg


def _llama4():
    """Layer 0: RoPE and chunked attention (chunks of 4 tokens); layer 1: no
    RoPE, full attention, query temperature tuned past position 4."""
    cfg = transformers.Llama4TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=37, intermediate_size_mlp=40,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        attention_chunk_size=4, no_rope_layers=[1, 0], attn_temperature_tuning=True,
        floor_scale=4, attn_scale=0.5, num_local_experts=4, num_experts_per_tok=1,
        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return transformers.Llama4ForCausalLM, cfg


def _doge():
    """Doge keeps the 4 keys of highest learned weight a query (less than the
    causal keys past position 4) and adds the weights to the mask."""
    cfg = transformers.DogeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, keep_window_size=4,
        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return transformers.DogeForCausalLM, cfg


BUILDERS = {"deepseek_v3": _deepseek_v3, "llama4": _llama4, "doge": _doge}


def _pair(kind):
    """The same weights on "sdpa" and on "mha_ext", float64, eval mode (a
    config each: from_config writes the name into the one it is given)."""
    cls, cfg = BUILDERS[kind]()
    torch.manual_seed(0)
    ref = cls._from_config(copy.deepcopy(cfg), attn_implementation="sdpa",
                           experts_implementation="eager")
    ours = cls._from_config(copy.deepcopy(cfg), attn_implementation=hf.NAME,
                            experts_implementation="eager")
    ours.load_state_dict(ref.state_dict())
    assert (ours.config._attn_implementation, ref.config._attn_implementation) == (hf.NAME, "sdpa")
    return ours.double().eval(), ref.double().eval()


def _inputs(L=11):
    ids = torch.randint(3, VOCAB, (2, L), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, L, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    return ids, mask


@pytest.fixture
def seen(monkeypatch):
    """(query, key, value, attn_mask, is_causal) of every call of the twin."""
    calls = []
    twin = hf._twin()

    def spy(q, k, v, attn_mask=None, is_causal=False, **kwargs):
        calls.append((q.shape, k.shape, v.shape, attn_mask, is_causal))
        return twin(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(hf, "_twin", lambda: spy)
    return calls


def _valid(logits, mask):
    """The rows of real tokens (a padded query's row is no token's output)."""
    return logits[mask.bool()]


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_float64_logits_with_left_padding_match_sdpa(kind, seen):
    ours, ref = _pair(kind)
    ids, mask = _inputs()
    with torch.no_grad():
        for m in (None, mask):
            a = ours(input_ids=ids, attention_mask=m).logits
            b = ref(input_ids=ids, attention_mask=m).logits
            keep = mask if m is not None else torch.ones_like(mask)
            torch.testing.assert_close(_valid(a, keep), _valid(b, keep), rtol=1e-10, atol=1e-10)
    assert seen, "no attention layer reached mha_ext"
    if kind == "deepseek_v3":
        # the twin took the latent heads as they are: keys 16 wide, values 12
        assert all(k[-1] == 16 and v[-1] == 12 for _, k, v, _, _ in seen)
        assert ours.model.layers[0].self_attn.scaling > 1.2 / 16 ** 0.5
    if kind == "llama4":
        # the chunked layer's mask: query 5 sees keys 4..5 only (not the
        # causal pattern, which the twin would take as is_causal)
        chunked = [mk for _, _, _, mk, _ in seen if mk is not None and mk.dtype == torch.bool
                   and not bool(mk[0, 0, 5, 3]) and bool(mk[0, 0, 5, 4])]
        assert chunked, "no chunked mask reached the twin"


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_float64_gradients_with_left_padding_match_sdpa(kind):
    ours, ref = _pair(kind)
    ids, mask = _inputs()
    w = torch.randn(2, ids.shape[1], VOCAB, generator=torch.Generator().manual_seed(2),
                    dtype=torch.float64) * mask[..., None]
    grads = []
    for m in (ours, ref):
        m.train()  # the configs' attention dropout is 0
        m.zero_grad()
        (m(input_ids=ids, attention_mask=mask).logits * w).sum().backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    g_ours, g_ref = grads
    assert g_ours.keys() == g_ref.keys()
    scale = max(g.abs().max().item() for g in g_ref.values())
    for name in g_ref:
        torch.testing.assert_close(g_ours[name], g_ref[name], rtol=0, atol=1e-10 * scale,
                                   msg=lambda s, n=name: f"{kind} {n}: {s}")
    if kind == "doge":
        # A reaches the output through the mask alone: its gradient came
        # from the twin's gradient of the mask
        assert all(g_ours[f"model.layers.{i}.self_attn.A"].abs().max() > 0 for i in (0, 1))


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_greedy_generate_with_left_padding_gives_sdpas_tokens(kind):
    """Float32, a padded batch of 2, 8 new tokens: past Llama 4's chunk
    boundaries and Doge's window, through the caches' decoding steps."""
    ours, ref = _pair(kind)
    ours.float(), ref.float()
    ids, mask = _inputs(6)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        a = ours.generate(input_ids=ids, attention_mask=mask, **kw)
        b = ref.generate(input_ids=ids, attention_mask=mask, **kw)
    assert a.shape == (2, 14)
    assert torch.equal(a, b)
