"""float32 error of mha_ext and of torch against a float64 truth, on the benchmark shapes.

    python benchmarks/accuracy.py [--shapes tiny,medium,...] [--seeds 3] [--json acc.json]

For each shape and seed: torch.nn.MultiheadAttention(batch_first=True) with
its default initialisation (seed s) and an input x ~ N(0, 1) (self-attention)
give float32 weights and input; the truth is the same module and input cast
to float64 (torch, float64 arithmetic on the float32 values).  Both
libraries then run in float32 on those values: mha_ext's MultiHeadAttention
(weights loaded with from_torch) and torch's module in eval and inference
mode, need_weights=False (torch's fused path; --need-weights: the weights
path of both, and the weights' error too).  The table gives, per shape, the
largest |out - truth| over the seeds for each, and their ratio (ours /
torch's: <= 1 means ours is at most as far from the truth as torch's); then
the root mean square of out - truth over every element of every seed, and
that ratio.  The largest error is one element's: at a small shape (tiny has
10,240 outputs a seed) its ratio moves with the seeds, the RMS's far less.
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

# name: (B, S, E, H, is_causal)
SHAPES = {
    "tiny": (2, 10, 512, 8, False),
    "small E64": (2, 10, 64, 4, False),
    "medium": (8, 128, 512, 8, False),
    "causal medium": (8, 128, 512, 8, True),
    "BERT": (16, 384, 768, 12, False),
    "large": (4, 1024, 1024, 16, False),
}


def errors(shape, seed, need_weights):
    """{"out": _stats(...)} for out - truth (and "weights" when asked)."""
    import numpy as np
    import torch

    import mha_ext
    B, S, E, H, causal = SHAPES[shape]
    torch.manual_seed(seed)
    tm = torch.nn.MultiheadAttention(E, H, batch_first=True).eval()
    x = torch.randn(B, S, E)
    mask = torch.triu(torch.ones(S, S, dtype=torch.bool), 1) if causal else None
    t64 = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64).eval()
    t64.load_state_dict({k: v.double() for k, v in tm.state_dict().items()})
    kw = dict(attn_mask=mask, is_causal=causal, need_weights=need_weights,
              average_attn_weights=False)
    with torch.inference_mode():
        o64, w64 = t64(x.double(), x.double(), x.double(), **kw)
        o32, w32 = tm(x, x, x, **kw)
    ours = mha_ext.MultiHeadAttention.from_torch(tm).eval()
    xn = x.numpy()
    oo, wo = ours(xn, xn, xn, is_causal=causal, need_weights=need_weights)
    truth = o64.numpy()
    res = {"out": _stats(oo.astype(np.float64) - truth, o32.double().numpy() - truth)}
    if need_weights:
        tw = w64.numpy()
        res["weights"] = _stats(wo.astype(np.float64) - tw, w32.double().numpy() - tw)
    return res


def _stats(d_ours, d_torch):
    """(largest |d| ours, torch's, Σ d² ours, torch's, element count)"""
    import numpy as np
    return (float(np.max(np.abs(d_ours))), float(np.max(np.abs(d_torch))),
            float(np.sum(d_ours * d_ours)), float(np.sum(d_torch * d_torch)), d_ours.size)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--need-weights", action="store_true",
                    help="both on their weights path (and the weights' error)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch

    import mha_ext
    torch.set_num_threads(args.threads)
    mha_ext.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, mha_ext ISA {mha_ext._core._get_isa()}, "
          f"float32 against a float64 truth, largest |error| over {args.seeds} seeds "
          f"and RMS over all their elements, "
          f"need_weights={args.need_weights}")
    print(f"| {'shape':<14} | {'what':<7} | {'mha_ext':>9} | {'torch':>9} | {'ours/torch':>10} "
          f"| {'rms ours':>9} | {'rms torch':>9} | {'rms ratio':>9} |")
    print(f"|{'-' * 16}|{'-' * 9}|{'-' * 11}|{'-' * 11}|{'-' * 12}|{'-' * 11}|{'-' * 11}"
          f"|{'-' * 11}|")
    rows = []
    for shape in args.shapes.split(","):
        acc = {}
        for seed in range(args.seeds):
            for what, st in errors(shape, seed, args.need_weights).items():
                a = acc.get(what, (0.0, 0.0, 0.0, 0.0, 0))
                acc[what] = (max(a[0], st[0]), max(a[1], st[1]), a[2] + st[2], a[3] + st[3],
                             a[4] + st[4])
        for what, (eo, et, so, stt, n) in acc.items():
            ro, rt = (so / n) ** 0.5, (stt / n) ** 0.5
            rows.append(dict(shape=shape, what=what, ours=eo, torch=et, ratio=eo / et,
                             rms_ours=ro, rms_torch=rt, rms_ratio=ro / rt))
            print(f"| {shape:<14} | {what:<7} | {eo:9.2e} | {et:9.2e} | {eo / et:10.2f} "
                  f"| {ro:9.2e} | {rt:9.2e} | {ro / rt:9.2f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(torch=torch.__version__, seeds=args.seeds,
                           need_weights=args.need_weights, rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
