"""A tiny attention model whose heads learn different jobs, in NumPy only.

    python examples/heads_model.py [--steps 300] [--seed 0]

Task: a random sequence of L tokens; at every position i the model answers
three questions at once:

    previous   the token at i-1        (nothing to answer at i = 0)
    mirror     the token at L-1-i      (what reversing the sequence needs)
    first      the token at 0

Model: token embedding + position embedding -> one mha_ext attention layer
(no mask, H heads) -> one linear read-out with 3·V logits (V per question),
trained with cross-entropy and Adam written out in NumPy.  The attention's
forward and backward are mha_ext's ``forward_train`` / ``backward`` (its C
core); everything else is a few lines of NumPy below.  One head cannot look
at i-1, L-1-i and 0 at the same time, so the heads divide the work: the
head analysis (``mha_ext.heads.analyze``) finds a previous-token head, a
mirror head and a first-token head, and switching one off costs the loss of
its question.  Trains in a few seconds on one CPU core, downloads and saves
nothing.

Legend: B batch, L sequence length, V vocabulary, E d_model, H heads.
"""
import argparse
import time

import numpy as np

import mha_ext

QUESTIONS = ("previous", "mirror", "first")


def targets(x):
    """x (B, L) tokens -> (B, L, 3) answers (-1: no answer, ignored)."""
    prev = np.concatenate([np.full_like(x[:, :1], -1), x[:, :-1]], axis=1)
    mirror = x[:, ::-1]
    first = np.repeat(x[:, :1], x.shape[1], axis=1)
    return np.stack([prev, mirror, first], axis=-1)


class HeadsModel:
    """Embeddings -> mha_ext.MultiHeadAttention -> linear read-out.

    ``model.attn`` is the attention module; ``model.embed(x)`` its input for
    tokens x (B, L); ``model.loss(x)`` the mean cross-entropy over the three
    questions (a float); ``model.accuracy(x)`` one accuracy per question.
    Each takes ``head_mask=`` (H,) as the attention call does: 0 switches a
    head off.
    """

    def __init__(self, vocab=10, length=10, d_model=48, n_heads=4, seed=0):
        rng = np.random.default_rng(seed)
        self.V, self.L = vocab, length
        f = np.float32
        self.tok = (rng.standard_normal((vocab, d_model)) * 0.5).astype(f)
        self.pos = (rng.standard_normal((length, d_model)) * 0.5).astype(f)
        bound = 1 / np.sqrt(d_model)
        self.read_w = rng.uniform(-bound, bound, (3 * vocab, d_model)).astype(f)
        self.read_b = np.zeros(3 * vocab, f)
        self.attn = mha_ext.MultiHeadAttention(d_model, n_heads, seed=seed).eval()

    def embed(self, x):
        # x (B, L) -> (B, L, E)
        return self.tok[x] + self.pos[: x.shape[1]]

    def logits(self, x, head_mask=None):
        # x (B, L) -> (B, L, 3, V)
        out, _ = self.attn(self.embed(x), need_weights=False, head_mask=head_mask)
        return self._read(out)

    def _read(self, out):
        y = out @ self.read_w.T + self.read_b
        return y.reshape(*out.shape[:2], 3, self.V)

    def loss(self, x, head_mask=None):
        return float(_cross_entropy(self.logits(x, head_mask), targets(x))[0])

    def accuracy(self, x, head_mask=None):
        t = targets(x)
        hit = (self.logits(x, head_mask).argmax(-1) == t)
        return {q: float(hit[..., k][t[..., k] >= 0].mean())
                for k, q in enumerate(QUESTIONS)}

    # -- training ------------------------------------------------------------
    def _arrays(self):
        a = self.attn
        return {"tok": self.tok, "pos": self.pos, "read_w": self.read_w,
                "read_b": self.read_b,
                "W_q.weight": a.W_q.weight, "W_q.bias": a.W_q.bias,
                "W_k.weight": a.W_k.weight, "W_k.bias": a.W_k.bias,
                "W_v.weight": a.W_v.weight, "W_v.bias": a.W_v.bias,
                "W_o.weight": a.W_o.weight, "W_o.bias": a.W_o.bias}

    def step_grads(self, x):
        """(loss, gradients by name) for one batch x (B, L)."""
        h = self.embed(x)
        ctx = self.attn.forward_train(h, need_weights=False)
        logits = self._read(ctx.output)
        loss, dlogits = _cross_entropy(logits, targets(x))
        dy = dlogits.reshape(*x.shape, -1)                 # (B, L, 3V)
        g = {"read_w": np.einsum("blo,ble->oe", dy, ctx.output),
             "read_b": dy.sum((0, 1))}
        grads = self.attn.backward(ctx, dy @ self.read_w)
        dh = grads.pop("query")                            # q = k = v: summed
        for k in ("key", "value"):
            grads.pop(k)
        g.update(grads)
        g["tok"] = np.zeros_like(self.tok)
        np.add.at(g["tok"], x, dh)
        g["pos"] = np.zeros_like(self.pos)
        g["pos"][: x.shape[1]] = dh.sum(0)
        return loss, g

    def fit(self, steps=300, batch=64, lr=1e-2, seed=1, log=None):
        """Adam on random batches; returns the list of losses."""
        rng = np.random.default_rng(seed)
        m1 = {k: np.zeros_like(v) for k, v in self._arrays().items()}
        m2 = {k: np.zeros_like(v) for k, v in self._arrays().items()}
        b1, b2, eps = 0.9, 0.999, 1e-8
        losses = []
        for t in range(1, steps + 1):
            x = rng.integers(0, self.V, (batch, self.L))
            loss, g = self.step_grads(x)
            losses.append(loss)
            with self.attn.editing():                      # writes into its memory
                for k, p in self._arrays().items():
                    m1[k] = b1 * m1[k] + (1 - b1) * g[k]
                    m2[k] = b2 * m2[k] + (1 - b2) * g[k] ** 2
                    upd = lr * (m1[k] / (1 - b1 ** t)) / (np.sqrt(m2[k] / (1 - b2 ** t)) + eps)
                    p -= upd.astype(p.dtype)
            if log is not None and (t % 50 == 0 or t == 1):
                log(f"step {t:4d}  loss {loss:.4f}")
        return losses


def _cross_entropy(logits, t):
    """Mean cross-entropy of logits (..., V) against targets t (...) where
    t >= 0, and its gradient with respect to the logits."""
    z = logits - logits.max(-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(-1, keepdims=True)
    valid = t >= 0
    n = max(int(valid.sum()), 1)
    ti = np.where(valid, t, 0)
    picked = np.take_along_axis(p, ti[..., None], -1)[..., 0]
    loss = -np.log(np.maximum(picked[valid], 1e-30)).sum() / n
    d = p.copy()
    np.put_along_axis(d, ti[..., None], np.take_along_axis(d, ti[..., None], -1) - 1, -1)
    d *= valid[..., None] / n
    return float(loss), d.astype(logits.dtype)


def train(steps=300, seed=0, log=None, **kw):
    """A trained :class:`HeadsModel` (a few seconds on one core)."""
    model = HeadsModel(seed=seed, **kw)
    model.losses = model.fit(steps=steps, seed=seed + 1, log=log)
    return model


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    mha_ext.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model = train(args.steps, args.seed, log=print)
    print(f"trained in {time.perf_counter() - t0:.1f} s")
    x = np.random.default_rng(123).integers(0, model.V, (256, model.L))
    print("accuracy:", {q: round(a, 3) for q, a in model.accuracy(x).items()})
    from mha_ext.heads import analyze
    _, w = model.attn(model.embed(x))
    report = analyze(w, module=model.attn, loss=lambda: model.loss(x))
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
