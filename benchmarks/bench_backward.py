"""Forward + backward of mha_ext against torch autograd, same run, same threads.

    python benchmarks/bench_backward.py [--threads 2] [--reps 7] [--shapes medium,large]

Each row times one training step of the attention alone: the forward and the
backward giving the gradients of query, key, value and every parameter from
a given dL/d output, float32, no dropout, no weights returned.

  mha_ext         ctx = mha.forward_train(q, k, v, need_weights=False);
                  mha.backward(ctx, grad_out)
  torch seed      the seed notebook's module (nn.Linear, matmul, softmax,
                  matmul, nn.Linear) under autograd: out.backward(grad_out)
  torch nn.MHA    torch.nn.MultiheadAttention(batch_first=True) with
                  need_weights=False (its fused SDPA kernel) under autograd

The runs are interleaved (ours, seed, nn.MHA, ours, ...) so that load from
other processes hits all alike; the table gives medians and the ratio
torch time / mha_ext time (> 1: mha_ext is faster).

Two thread pools share two cores here, so torch's OpenMP workers are set to
sleep rather than spin when idle (OMP_WAIT_POLICY=PASSIVE, set before torch
is imported; --omp-wait-policy active keeps libgomp's default): spinning
after each torch call steals the core our next call needs, a cost of
interleaving in one process rather than of either library.  So torch is
imported in main() and in the functions, never at the top: benchmarks/bench.py
imports this file for its fwd+bwd rows after setting the policy the same way.
"""
import argparse
import math
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
# the mha_ext built in place next to benchmarks/; without a build there,
# mha_ext/__init__.py hands over to the installed mha_ext of the same version
sys.path.insert(0, os.path.dirname(HERE))

SHAPES = {
    "small": dict(B=2, S=10, E=512, H=8),
    "medium": dict(B=8, S=128, E=512, H=8),
    "large": dict(B=4, S=1024, E=1024, H=16),
}


def seed_module(E, H):
    """The seed notebook's module (torch imported here, not at the top: the
    caller sets OMP_WAIT_POLICY first)."""
    import torch
    from torch import nn

    class Seed(nn.Module):
        def __init__(self, E, H):
            super().__init__()
            self.H, self.Dk = H, E // H
            self.W_q, self.W_k, self.W_v, self.W_o = (nn.Linear(E, E) for _ in range(4))

        def forward(self, q, k, v):
            B, Sq, E = q.shape
            Sk = k.shape[1]
            Q = self.W_q(q).view(B, Sq, self.H, self.Dk).transpose(1, 2)
            K = self.W_k(k).view(B, Sk, self.H, self.Dk).transpose(1, 2)
            V = self.W_v(v).view(B, Sk, self.H, self.Dk).transpose(1, 2)
            w = torch.softmax(Q @ K.transpose(-2, -1) / math.sqrt(self.Dk), dim=-1)
            ctx = (w @ V).transpose(1, 2).reshape(B, Sq, E)
            return self.W_o(ctx)

    return Seed(E, H)


def flops(B, S, E, H):
    """The dense work of one step, multiply-adds counted as 2: the forward's
    four projections and two attention products, and two products in the
    backward for each of them (the gradients of both operands)."""
    return 3 * (4 * 2 * B * S * E * E + 2 * 2 * B * S * S * E)


def bench(name, B, S, E, H, reps, max_time=float("inf"), with_nn_mha=True):
    """Medians (s) of interleaved runs {'mha_ext', 'torch seed'[, 'torch
    nn.MHA']} and the largest relative error of ours against the seed's
    weight gradients.  Stops after `reps` rounds, or after max_time seconds
    once 5 rounds are done; times['rounds'] is how many ran."""
    import torch
    from torch import nn

    import mha_ext

    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal((B, S, E)).astype(np.float32) for _ in range(4))
    ours = mha_ext.MultiHeadAttention(E, H, seed=0).eval()
    seed = seed_module(E, H)
    ours.load_state_dict({kk: vv.detach().numpy() for kk, vv in seed.state_dict().items()})
    tmha = nn.MultiheadAttention(E, H, batch_first=True)
    tq, tk, tv = (torch.from_numpy(x).requires_grad_(True) for x in (q, k, v))
    tg = torch.from_numpy(g)

    def run_ours():
        ctx = ours.forward_train(q, k, v, need_weights=False)
        return ours.backward(ctx, g)

    def run_seed():
        for t in (tq, tk, tv):
            t.grad = None
        seed.zero_grad(set_to_none=True)
        seed(tq, tk, tv).backward(tg)

    def run_tmha():
        for t in (tq, tk, tv):
            t.grad = None
        tmha.zero_grad(set_to_none=True)
        out, _ = tmha(tq, tk, tv, need_weights=False)
        out.backward(tg)

    # the numbers agree (a sanity check, not a test)
    grads = run_ours()
    run_seed()
    err = max(float(np.abs(grads[n] - p.grad.numpy()).max() / np.abs(p.grad.numpy()).max())
              for n, p in seed.named_parameters() if n.endswith("weight"))
    runs = {"mha_ext": run_ours, "torch seed": run_seed}
    if with_nn_mha:
        runs["torch nn.MHA"] = run_tmha
    times = {kk: [] for kk in runs}
    for fn in runs.values():  # warm-up
        fn()
    t_start = time.perf_counter()
    rounds = 0
    while rounds < reps and not (rounds >= 5 and time.perf_counter() - t_start > max_time):
        for kk, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            times[kk].append(time.perf_counter() - t0)
        rounds += 1
    med = {kk: statistics.median(tt) for kk, tt in times.items()}
    med["rounds"] = rounds
    return med, err


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--shapes", default="medium,large")
    ap.add_argument("--omp-wait-policy", default="passive", choices=["passive", "active"],
                    help="OMP_WAIT_POLICY for torch's OpenMP threads (default passive)")
    args = ap.parse_args()
    os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy.upper()
    import torch

    import mha_ext

    torch.set_num_threads(args.threads)
    mha_ext.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads {args.threads} each, float32, "
          f"median of {args.reps} interleaved runs; ratio = torch / mha_ext; "
          f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}")
    print(f"{'shape':<28} {'mha_ext ms':>11} {'seed ms':>9} {'ratio':>6} "
          f"{'nn.MHA ms':>10} {'ratio':>6}  {'max rel err dW':>14}")
    for name in args.shapes.split(","):
        sh = SHAPES[name]
        med, err = bench(name, **sh, reps=args.reps)
        o, s, m = med["mha_ext"], med["torch seed"], med["torch nn.MHA"]
        label = f"{name} B{sh['B']} S{sh['S']} E{sh['E']} H{sh['H']}"
        print(f"{label:<28} {o * 1e3:11.1f} {s * 1e3:9.1f} {s / o:6.2f} "
              f"{m * 1e3:10.1f} {m / o:6.2f}  {err:14.2e}", flush=True)


if __name__ == "__main__":
    main()
