"""Greedy decoding with the key/value cache against Hugging Face's
``generate()`` (issue 15's proof): a tiny random-init GPT-2 (float64, eval)
whose attention we run with mha_ext modules and one KVCache per layer
(prefill the prompt, then one token per step); everything else of GPT-2
(embeddings, layer norms, MLP, tied head) is written out in NumPy below.
The tokens must equal generate(do_sample=False)'s, which runs GPT-2 with its
own DynamicCache.  GPT-2 has no rotary embedding, so the swap is exact up to
float rounding (the logits agree to ~1e-12; a greedy choice could only
differ at a near-tie, which the test rules out by checking the margin).

Legend: B batch, S length, E = n_embd, H = n_head.
"""
import numpy as np
import pytest

from _support import need, require_torch
from mha_ext import MultiHeadAttention

torch = require_torch()
transformers = need("transformers")


def _tiny_gpt2(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=61, n_positions=64, n_embd=64, n_layer=2,
                                  n_head=4, initializer_range=0.3, bos_token_id=0,
                                  eos_token_id=None, attn_implementation="sdpa")
    return transformers.GPT2LMHeadModel(cfg).double().eval()


def _np(t):
    return t.detach().numpy()


def _layer_norm(x, ln):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + ln.eps) * _np(ln.weight) + _np(ln.bias)


def _gelu_new(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def _attention_modules(model):
    """One mha_ext module per GPT-2 block, with its c_attn / c_proj weights
    (GPT-2's Conv1D keeps them as (in, out): transposed into ours)."""
    E = model.config.n_embd
    mods = []
    for block in model.transformer.h:
        w, b = _np(block.attn.c_attn.weight), _np(block.attn.c_attn.bias)
        m = MultiHeadAttention(E, model.config.n_head, dtype="float64").eval()
        m.load_state_dict({"W_q.weight": w[:, :E].T, "W_q.bias": b[:E],
                           "W_k.weight": w[:, E:2 * E].T, "W_k.bias": b[E:2 * E],
                           "W_v.weight": w[:, 2 * E:].T, "W_v.bias": b[2 * E:],
                           "W_o.weight": _np(block.attn.c_proj.weight).T,
                           "W_o.bias": _np(block.attn.c_proj.bias)})
        mods.append(m)
    return mods


def _greedy(model, prompt, n_new, chunk=None):
    """Greedy tokens from our cached decoding: the prompt prefilled (in
    pieces of `chunk` tokens, default all at once), then one token a step.
    Returns (tokens (B, n_new), the smallest top-1 margin of the logits)."""
    tr = model.transformer
    mods = _attention_modules(model)
    B, S0 = prompt.shape
    caches = [m.new_cache(B, S0 + n_new) for m in mods]
    wte, wpe = _np(tr.wte.weight), _np(tr.wpe.weight)

    def step(ids, pos0):
        h = wte[ids] + wpe[pos0:pos0 + ids.shape[1]]
        for block, m, cache in zip(tr.h, mods, caches):
            a, _ = m(_layer_norm(h, block.ln_1), cache=cache, need_weights=False)
            h = h + a
            x = _layer_norm(h, block.ln_2)
            x = _gelu_new(x @ _np(block.mlp.c_fc.weight) + _np(block.mlp.c_fc.bias))
            h = h + x @ _np(block.mlp.c_proj.weight) + _np(block.mlp.c_proj.bias)
        return _layer_norm(h, tr.ln_f)[:, -1] @ wte.T  # tied head: (B, vocab)

    out, margin, pos = [], np.inf, 0
    for piece in np.split(prompt, range(chunk or S0, S0, chunk or S0), axis=1):
        logits = step(piece, pos)
        pos += piece.shape[1]
    for t in range(n_new):
        top2 = np.sort(logits, axis=-1)[:, -2:]
        margin = min(margin, float((top2[:, 1] - top2[:, 0]).min()))
        nxt = logits.argmax(-1)
        out.append(nxt)
        if t + 1 < n_new:
            logits = step(nxt[:, None], pos)
            pos += 1
    assert all(c.length == S0 + n_new - 1 for c in caches)
    return np.stack(out, 1), margin


@pytest.mark.parametrize("chunk", [None, 1, 3])
def test_greedy_tokens_equal_hugging_face_generate(chunk):
    model = _tiny_gpt2()
    prompt = np.random.default_rng(0).integers(0, 61, size=(2, 6))
    n_new = 12
    ours, margin = _greedy(model, prompt, n_new, chunk)
    assert margin > 1e-8  # no near-tie: the greedy choice is well defined
    with torch.no_grad():
        ref = model.generate(torch.tensor(prompt), attention_mask=torch.ones(2, 6, dtype=torch.long),
                             do_sample=False, max_new_tokens=n_new, pad_token_id=0)
    assert ref.shape == (2, 6 + n_new)
    assert np.array_equal(ours, ref[:, 6:].numpy()), (ours, ref[:, 6:])
