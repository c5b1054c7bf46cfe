"""A tiny causal language model that generates with a key/value cache, in
NumPy and mha_ext only.

    python examples/decode_model.py [--steps 250] [--seed 0]

Task: sequences that repeat a random motif of P = 3 tokens (``5 2 7 5 2 7
...``); at every position the model predicts the next token, which is the
token P positions back: the attention has to find it (causally).

Model: token + position embeddings -> one causal mha_ext attention layer
with grouped-query attention (4 query heads sharing 2 key/value heads) ->
a linear read-out to V logits, trained with cross-entropy and Adam written
out in NumPy (the attention's gradients from mha_ext's forward_train /
backward).  Generation prefills the prompt through a KVCache and then feeds
one token per step: each step projects only the new token's key and value
into the cache (``cache.length`` grows by one) and attends over all of
them.  Trains in about a second; downloads and saves nothing.

Legend: B batch, L sequence length, V vocabulary, E d_model, H heads.
"""
import argparse

import numpy as np

import mha_ext


def batch(rng, B, L, V, P=3):
    """B sequences of length L + 1 repeating a random motif of P tokens."""
    motif = rng.integers(0, V, (B, P))
    return motif[:, np.arange(L + 1) % P]


class DecodeModel:
    """Embeddings -> causal grouped-query attention -> read-out.

    ``model.logits(x)`` (B, S, V) for tokens x (B, S) in one causal call;
    ``model.generate(prompt, n)`` greedy tokens through a KVCache, with a
    log of the cache at every step."""

    def __init__(self, vocab=8, length=16, d_model=32, n_heads=4, n_kv_heads=2, seed=0):
        rng = np.random.default_rng(seed)
        f = np.float32
        self.V, self.L = vocab, length
        self.tok = (rng.standard_normal((vocab, d_model)) * 0.5).astype(f)
        self.pos = (rng.standard_normal((length, d_model)) * 0.5).astype(f)
        self.read_w = (rng.standard_normal((vocab, d_model)) / np.sqrt(d_model)).astype(f)
        self.attn = mha_ext.MultiHeadAttention(d_model, n_heads, n_kv_heads=n_kv_heads,
                                               seed=seed).eval()

    def embed(self, x, start=0):
        return self.tok[x] + self.pos[start:start + x.shape[1]]

    def logits(self, x):
        out, _ = self.attn(self.embed(x), is_causal=True, need_weights=False)
        return out @ self.read_w.T

    def _arrays(self):
        a = self.attn
        return {"tok": self.tok, "pos": self.pos, "read_w": self.read_w,
                **{f"{n}.{p}": getattr(getattr(a, n), p)
                   for n in ("W_q", "W_k", "W_v", "W_o") for p in ("weight", "bias")}}

    def step_grads(self, x, y):
        """(loss, gradients by name) for inputs x and next tokens y (B, S)."""
        ctx = self.attn.forward_train(self.embed(x), is_causal=True, need_weights=False)
        z = ctx.output @ self.read_w.T
        z = z - z.max(-1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(-1, keepdims=True)
        n = y.size
        loss = -np.log(np.take_along_axis(p, y[..., None], -1)).sum() / n
        dz = p.copy()
        np.put_along_axis(dz, y[..., None], np.take_along_axis(dz, y[..., None], -1) - 1, -1)
        dz = (dz / n).astype(np.float32)
        g = {"read_w": np.einsum("bsv,bse->ve", dz, ctx.output)}
        grads = self.attn.backward(ctx, dz @ self.read_w)
        dh = grads.pop("query") + grads.pop("key") + grads.pop("value")
        g.update(grads)
        g["tok"] = np.zeros_like(self.tok)
        np.add.at(g["tok"], x, dh)
        g["pos"] = np.zeros_like(self.pos)
        g["pos"][: x.shape[1]] = dh.sum(0)
        return float(loss), g

    def fit(self, steps=250, B=64, lr=2e-2, seed=1):
        """Adam on random motif batches; returns the losses."""
        rng = np.random.default_rng(seed)
        arrays = self._arrays()
        m1 = {k: np.zeros_like(v) for k, v in arrays.items()}
        m2 = {k: np.zeros_like(v) for k, v in arrays.items()}
        losses = []
        for t in range(1, steps + 1):
            s = batch(rng, B, self.L, self.V)
            loss, g = self.step_grads(s[:, :-1], s[:, 1:])
            losses.append(loss)
            with self.attn.editing():
                for k, p in self._arrays().items():
                    m1[k] = 0.9 * m1[k] + 0.1 * g[k]
                    m2[k] = 0.999 * m2[k] + 0.001 * g[k] ** 2
                    step = lr * (m1[k] / (1 - 0.9 ** t)) / (np.sqrt(m2[k] / (1 - 0.999 ** t)) + 1e-8)
                    p -= step.astype(p.dtype)
        return losses

    def generate(self, prompt, n, log=None):
        """Greedy: prompt (B, S0) prefilled through a new KVCache, then n
        tokens one at a time.  Returns (tokens (B, n), the cache)."""
        B, S0 = prompt.shape
        cache = self.attn.new_cache(B, S0 + n)
        out, _ = self.attn(self.embed(prompt), cache=cache, need_weights=False)
        nxt = (out[:, -1] @ self.read_w.T).argmax(-1)
        toks = [nxt]
        if log:
            log(f"prefill {S0} tokens: cache.length {cache.length}, "
                f"keys {cache.keys.shape} -> next {nxt.tolist()}")
        for _ in range(n - 1):
            start = cache.length
            out, _ = self.attn(self.embed(nxt[:, None], start), cache=cache,
                               need_weights=False)
            nxt = (out[:, -1] @ self.read_w.T).argmax(-1)
            toks.append(nxt)
            if log:
                log(f"decode 1 token:   cache.length {cache.length}, "
                    f"keys {cache.keys.shape} -> next {nxt.tolist()}")
        return np.stack(toks, 1), cache


def train(steps=250, seed=0, **kw):
    """A trained :class:`DecodeModel` (about a second on one core)."""
    model = DecodeModel(seed=seed, **kw)
    model.losses = model.fit(steps=steps, seed=seed + 1)
    return model


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    model = train(args.steps, args.seed)
    print(f"loss {model.losses[0]:.3f} -> {model.losses[-1]:.4f}")
    prompt = np.array([[5, 2, 7, 5], [1, 1, 4, 1]])
    toks, _ = model.generate(prompt, 8, log=print)
    print("prompt", prompt.tolist(), "generated", toks.tolist())


if __name__ == "__main__":
    main()
