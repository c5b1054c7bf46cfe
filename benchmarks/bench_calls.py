"""Small calls, where a call's fixed cost (argument checks, conversions,
autograd's bookkeeping) outweighs its arithmetic: mha_ext's torch entry
points against torch's own, each library alone in its own process.

    python benchmarks/bench_calls.py [--threads 2] [--rounds 5] [--json out.json]

Cases (float32, torch tensors in, tensors out):

  sdpa decode   scaled_dot_product_attention, one query over 16 keys, B 1,
                H 8, D 64, under no_grad (a decode step of a small model):
                mha_ext.scaled_dot_product_attention vs
                torch.nn.functional.scaled_dot_product_attention
  mha eval      a MultiheadAttention call, B 2, S 10, E 64, H 8, batch_first,
                eval, no_grad, need_weights=False: mha_ext.torch's drop-in vs
                torch.nn.MultiheadAttention (its fused path)
  mha train     the same module in training (dropout 0): forward and
                backward of out.sum(), gradients to the input and the
                parameters

Each case runs `--rounds` times, the libraries' processes alternated; a
process times blocks of calls for about 0.3 s each and reports the median
block; the table gives the median of the rounds in microseconds a call and
torch's time over ours (above 1: ours faster).  Timings on a shared
machine are noisy: run it alone.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CASES = ("sdpa decode", "mha eval", "mha train")
LIBS = ("mha_ext", "torch")

CHILD = r"""
import sys, time, statistics
sys.path.insert(0, sys.argv[1])
import torch
case, lib, threads = sys.argv[2], sys.argv[3], int(sys.argv[4])
torch.set_num_threads(threads)
torch.manual_seed(0)
if lib == "mha_ext":
    import mha_ext, mha_ext.torch as mt
    mha_ext.set_num_threads(threads)
    sdpa, MHA = mha_ext.scaled_dot_product_attention, mt.MultiheadAttention
else:
    sdpa, MHA = torch.nn.functional.scaled_dot_product_attention, torch.nn.MultiheadAttention
if case == "sdpa decode":
    q, k, v = torch.randn(1, 8, 1, 64), torch.randn(1, 8, 16, 64), torch.randn(1, 8, 16, 64)
    def call():
        with torch.no_grad():
            sdpa(q, k, v)
else:
    m = MHA(64, 8, batch_first=True)
    x = torch.randn(2, 10, 64, requires_grad=case == "mha train")
    if case == "mha eval":
        m.eval()
        def call():
            with torch.no_grad():
                m(x, x, x, need_weights=False)
    else:
        def call():
            out, _ = m(x, x, x, need_weights=False)
            out.sum().backward()
n = 10
while True:
    t = time.perf_counter()
    for _ in range(n):
        call()
    if time.perf_counter() - t > 0.05:
        break
    n *= 2
n = max(1, int(n * 0.3 / (time.perf_counter() - t)))
blocks = []
for _ in range(7):
    t = time.perf_counter()
    for _ in range(n):
        call()
    blocks.append((time.perf_counter() - t) / n * 1e6)
print(statistics.median(blocks))
"""


def run(case, lib, threads):
    out = subprocess.run([sys.executable, "-c", CHILD, ROOT, case, lib, str(threads)],
                         capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    res = {c: {lib: [] for lib in LIBS} for c in CASES}
    for r in range(a.rounds):
        for c in CASES:
            for lib in (LIBS if r % 2 == 0 else LIBS[::-1]):
                res[c][lib].append(run(c, lib, a.threads))
    print(f"{a.threads} threads, {a.rounds} rounds alternated, each library in its own "
          f"process; microseconds a call, median of the rounds")
    print(f"| case        | mha_ext us | torch us | torch / ours | rounds |")
    print(f"|-------------|------------|----------|--------------|--------|")
    for c in CASES:
        ours, theirs = (statistics.median(res[c][lib]) for lib in LIBS)
        ratios = [t / o for o, t in zip(res[c]["mha_ext"], res[c]["torch"])]
        print(f"| {c:11s} | {ours:10.1f} | {theirs:8.1f} | {theirs / ours:11.2f}x | "
              f"{min(ratios):.2f}-{max(ratios):.2f}x |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"threads": a.threads, "rounds": res}, f, indent=1)


if __name__ == "__main__":
    main()
