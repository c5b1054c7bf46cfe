"""mha_ext inside Hugging Face transformers models (issue 12 point 3):
mha_ext.hf.register() and attn_implementation="mha_ext" against
attn_implementation="sdpa" on random-init models built from small configs
(nothing downloaded): BERT, GPT-2, BART, T5 and a Llama-style model with
grouped-query attention; logits within 2e-5 (float32) / 1e-10 (float64),
padding masks included, greedy generate() giving the same tokens, and the
attention really computed by mha_ext (counted).  transformers is pinned in
pyproject's test extra: missing, these tests skip on a developer machine and
fail in CI.
"""
import copy

import numpy as np
import pytest

from _support import need, require_torch

TOL = {"float32": 2e-5, "float64": 1e-10}


@pytest.fixture(scope="module")
def torch():
    return require_torch()


@pytest.fixture(scope="module")
def tf():
    t = need("transformers")
    import mha_ext.hf
    assert mha_ext.hf.register() == "mha_ext"
    return t


def _configs(tf):
    return {
        "bert": (tf.BertModel, tf.BertConfig(vocab_size=100, hidden_size=32,
                                             num_hidden_layers=2, num_attention_heads=4,
                                             intermediate_size=64)),
        "gpt2": (tf.GPT2LMHeadModel, tf.GPT2Config(vocab_size=100, n_embd=32, n_layer=2,
                                                   n_head=4, n_positions=64, bos_token_id=1,
                                                   eos_token_id=2, pad_token_id=0)),
        "bart": (tf.BartForConditionalGeneration,
                 tf.BartConfig(vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2,
                               encoder_attention_heads=4, decoder_attention_heads=4,
                               encoder_ffn_dim=64, decoder_ffn_dim=64,
                               max_position_embeddings=64)),
        "t5": (tf.T5ForConditionalGeneration,
               tf.T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                           num_heads=4, decoder_start_token_id=0)),
        "llama-gqa": (tf.LlamaForCausalLM,
                      tf.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, max_position_embeddings=64,
                                     pad_token_id=0)),
    }


def _pair(torch, cls, cfg, dtype):
    """the stock model (sdpa) and an identical one on mha_ext; each its own
    config (transformers stores the implementation in it)"""
    torch.manual_seed(0)
    a = cls._from_config(copy.deepcopy(cfg), attn_implementation="sdpa").eval()
    torch.manual_seed(0)
    b = cls._from_config(copy.deepcopy(cfg), attn_implementation="mha_ext").eval()
    a, b = a.to(getattr(torch, dtype)), b.to(getattr(torch, dtype))
    b.load_state_dict(a.state_dict())
    assert a.config._attn_implementation == "sdpa"
    assert b.config._attn_implementation == "mha_ext"
    return a, b


def _out(model, name, ids, am):
    kw = dict(attention_mask=am)
    if name in ("bart", "t5"):
        kw["decoder_input_ids"] = ids
    out = model(ids, **kw)
    return out.last_hidden_state if name == "bert" else out.logits


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", ["bert", "gpt2", "bart", "t5", "llama-gqa"])
def test_models_match_sdpa(torch, tf, monkeypatch, dtype, name):
    import mha_ext._sdpa_api as api

    calls = []
    real = api.scaled_dot_product_attention

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(api, "scaled_dot_product_attention", counting)
    cls, cfg = _configs(tf)[name]
    a, b = _pair(torch, cls, cfg, dtype)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 100, (2, 9), generator=g)
    am = torch.ones(2, 9, dtype=torch.long)
    am[1, :3] = 0  # left padding in the second row
    with torch.no_grad():  # T5's learned position bias: no gradient into a mask
        for mask in (None, am):
            want = _out(a, name, ids, mask)
            n = len(calls)
            got = _out(b, name, ids, mask)
            assert len(calls) > n, "the model did not call mha_ext"
            w, o = want.numpy(), got.numpy()
            if mask is not None:  # the real tokens (a padded position's row is arbitrary)
                rows = (am > 0).numpy()
                w, o = w[rows], o[rows]
            np.testing.assert_allclose(o, w, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("name", ["gpt2", "bart", "t5", "llama-gqa"])
def test_greedy_generate_same_tokens(torch, tf, name):
    cls, cfg = _configs(tf)[name]
    a, b = _pair(torch, cls, cfg, "float64")
    ids = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(2))
    am = torch.ones_like(ids)
    am[1, :2] = 0
    with torch.no_grad():
        ta = a.generate(ids, attention_mask=am, max_new_tokens=8, do_sample=False)
        tb = b.generate(ids, attention_mask=am, max_new_tokens=8, do_sample=False)
    assert torch.equal(ta, tb)


def test_training_gradients_match(torch, tf):
    # GQA model, float64: every parameter's gradient through the C backward
    cls, cfg = _configs(tf)["llama-gqa"]
    a, b = _pair(torch, cls, cfg, "float64")
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(3))
    for m in (a, b):
        m.train()
        m(ids, labels=ids).loss.backward()
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        np.testing.assert_allclose(pb.grad.numpy(), pa.grad.numpy(), atol=1e-10, rtol=1e-10,
                                   err_msg=n)
