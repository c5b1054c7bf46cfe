"""Train a tiny model with mha_ext's attention: reverse a short sequence.

    python examples/train_copy.py [--task reverse|copy] [--steps 200] [--plot loss.png]

The model is token embedding + position embedding -> one mha_ext attention
layer (mha_ext.torch.MultiHeadAttention: forward and backward in mha_ext's C
core) -> a linear head over the vocabulary, trained with torch.optim.Adam on
random sequences.  To reverse, position i has to attend to position L-1-i:
the attention learns that from the position embeddings alone.  Prints the
first and the last loss (and the accuracy); --plot saves the loss curve when
matplotlib is installed.
"""
import argparse
import time

import torch
from torch import nn

import mha_ext
from mha_ext.torch import MultiHeadAttention


class TinyModel(nn.Module):
    def __init__(self, vocab, length, d_model, n_heads, dropout, seed):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(length, d_model)
        self.attn = MultiHeadAttention(d_model, n_heads, dropout=dropout, seed=seed)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens, head_mask=None):
        # tokens (B, L) -> logits (B, L, vocab); head_mask (H,): 0 switches a head off
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        y, _ = self.attn(x, need_weights=False, head_mask=head_mask)
        return self.head(y)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", choices=("reverse", "copy"), default="reverse")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--length", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=16)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="threads for torch and mha_ext (the model is tiny)")
    ap.add_argument("--plot", metavar="FILE", help="save the loss curve (needs matplotlib)")
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    mha_ext.set_num_threads(args.threads)
    model = TinyModel(args.vocab, args.length, args.d_model, args.heads, args.dropout,
                      args.seed)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(args.seed + 1)
    losses = []
    t0 = time.perf_counter()
    for step in range(args.steps):
        src = torch.randint(0, args.vocab, (args.batch, args.length), generator=gen)
        tgt = src.flip(1) if args.task == "reverse" else src
        logits = model(src)
        loss = loss_fn(logits.reshape(-1, args.vocab), tgt.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % 20 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}")
    elapsed = time.perf_counter() - t0

    model.eval()
    with torch.no_grad():
        src = torch.randint(0, args.vocab, (512, args.length), generator=gen)
        tgt = src.flip(1) if args.task == "reverse" else src
        acc = (model(src).argmax(-1) == tgt).float().mean().item()
    print(f"first loss {losses[0]:.4g}")
    print(f"last loss {losses[-1]:.4g}")
    print(f"accuracy {acc:.3f} ({args.task}, {args.steps} steps, {elapsed:.1f} s)")

    if args.plot:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib is not installed: no plot")
            return 0
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(losses)
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy")
        ax.set_title(f"{args.task}: mha_ext attention trained with Adam")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"loss curve saved to {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
