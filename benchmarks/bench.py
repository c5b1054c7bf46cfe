"""mha_ext against torch.nn.MultiheadAttention on the CPU, in one process.

    python benchmarks/bench.py [--threads 2] [--reps 30] [--json results.json]
                               [--cases tiny,medium,...] [--isa avx512]
    python benchmarks/bench.py --isolated [--quick] ...   (bench_isolated.py)

--isolated is the measure the README's table comes from: each library
(mha_ext, torch, ONNX Runtime, JAX) alone in its own process, processes
alternated, medians of medians (bench_isolated.py).  Without it, this file
times torch and mha_ext interleaved in one process, as below.

Both libraries run at the same thread count (torch.set_num_threads,
mha_ext.set_num_threads), torch in eval and inference mode with
batch_first=True and identical weights (MultiHeadAttention.from_torch).
Calls are interleaved (torch, ours, torch, ours, ...) so that load from other
processes hits both alike, and the medians are reported.

Two thread pools share two cores here, so torch's OpenMP workers are set to
sleep rather than spin when idle (OMP_WAIT_POLICY=PASSIVE, set before torch
is imported; --omp-wait-policy active keeps libgomp's default): spinning
after each torch call steals the core our next call needs, a cost of
interleaving in one process rather than of either library.  torch's own times
change little with it (within noise at every case here).

The fwd+bwd rows time one training step (bench_backward.py, imported): ours
is forward_train(need_weights=False) then backward, torch is the seed
notebook's module under autograd (out.backward), float32, both giving the
gradients of the inputs and every parameter; "max abs diff" is there the
largest relative error of the weight gradients, GFLOP/s counts the dense
work of forward and backward (3x the forward's).  They run at least 5
rounds and stop after --reps rounds or after 3x --min-time seconds.

The percentage of peak comes from a small C FMA probe (fma_probe.c next to
this file) compiled here with the system compiler and run at the same thread
count: independent accumulator chains of vector FMAs, best of 7 runs.  The
peak memory of the large need_weights=False case is measured in a fresh
process (ru_maxrss) next to what one (Sq, Sk) buffer per head would take.
"""
import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # bench_backward.py, for the fwd+bwd rows
# the mha_ext built in place next to benchmarks/; without a build there,
# mha_ext/__init__.py hands over to the installed mha_ext of the same version
sys.path.insert(0, os.path.dirname(HERE))

# name: (B, S, E, H, dtype, is_causal, need_weights)
CASES = {
    "tiny": (2, 10, 512, 8, "float32", False, True),
    "medium": (8, 128, 512, 8, "float32", False, True),
    "causal medium": (8, 128, 512, 8, "float32", True, True),
    "large": (4, 1024, 1024, 16, "float32", False, True),
    "large no weights": (4, 1024, 1024, 16, "float32", False, False),
    "float64 medium": (8, 128, 512, 8, "float64", False, True),
}
# forward + backward against torch autograd (bench_backward.py's functions):
# name: the shape in bench_backward.SHAPES
BWD_CASES = {"fwd+bwd medium": "medium", "fwd+bwd large": "large"}
TARGET = {"tiny": 1.5, "medium": 1.5, "causal medium": 1.5, "large": 1.5,
          "large no weights": 1.2, "float64 medium": 1.5,
          "fwd+bwd medium": 1.2, "fwd+bwd large": 1.2}


def flops(B, S, E, H, causal):
    """Multiply-adds counted as 2: four projections and the two attention
    products (half of them with causal block skipping not counted: the
    figure is the dense work, as torch does it)."""
    proj = 4 * 2 * B * S * E * E
    attn = 2 * 2 * B * S * S * E
    return proj + attn


def fma_peak(threads):
    """(f32, f64) GFLOP/s of the FMA probe at `threads` threads, or None."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None
    src = os.path.join(HERE, "fma_probe.c")
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    isa = ["-mavx512f"] if " avx512f" in flags else ["-mavx2"]
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, "fma_probe")
        r = subprocess.run([cc, "-O2", *isa, "-mfma", src, "-o", exe, "-lpthread"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            print("fma probe did not build:", r.stderr, file=sys.stderr)
            return None
        out = subprocess.run([exe, str(threads), "30000000"], capture_output=True,
                             text=True).stdout
    vals = dict(line.split() for line in out.strip().splitlines())
    return float(vals["f32"]), float(vals["f64"])


def make(case, seed=0):
    import torch
    import mha_ext
    B, S, E, H, dtype, causal, need_weights = CASES[case]
    tdtype = getattr(torch, dtype)
    torch.manual_seed(seed)
    tm = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=tdtype).eval()
    ours = mha_ext.MultiHeadAttention(E, H, dtype=dtype).eval()
    w = tm.in_proj_weight.detach().numpy()
    b = tm.in_proj_bias.detach().numpy()
    ours.load_state_dict({
        "W_q.weight": w[:E], "W_k.weight": w[E:2 * E], "W_v.weight": w[2 * E:],
        "W_q.bias": b[:E], "W_k.bias": b[E:2 * E], "W_v.bias": b[2 * E:],
        "W_o.weight": tm.out_proj.weight.detach().numpy(),
        "W_o.bias": tm.out_proj.bias.detach().numpy()})
    x = torch.randn(B, S, E, dtype=tdtype)
    xn = x.numpy()
    mask = torch.triu(torch.ones(S, S, dtype=torch.bool), 1) if causal else None

    def run_torch():
        with torch.inference_mode():
            return tm(x, x, x, attn_mask=mask, need_weights=need_weights,
                      average_attn_weights=False)

    def run_ours():
        return ours(xn, xn, xn, is_causal=causal, need_weights=need_weights)

    return run_torch, run_ours


def bench_case(case, reps, min_time):
    run_torch, run_ours = make(case)
    ot, wt = run_torch()
    oo, wo = run_ours()
    diff = float(np.nanmax(np.abs(ot.numpy() - oo)))
    if wt is not None:
        diff = max(diff, float(np.nanmax(np.abs(wt.numpy() - wo))))
    for _ in range(2):  # warm up both
        run_torch(); run_ours()
    tt, to = [], []
    t_start = time.perf_counter()
    while len(tt) < reps or (time.perf_counter() - t_start < min_time and len(tt) < 50 * reps):
        t0 = time.perf_counter(); run_torch(); t1 = time.perf_counter()
        run_ours(); t2 = time.perf_counter()
        tt.append(t1 - t0); to.append(t2 - t1)
    return float(np.median(tt)), float(np.median(to)), diff, len(tt)


def peak_memory_child():
    """Runs in a fresh process: the large need_weights=False call alone."""
    import mha_ext
    B, S, E, H = 4, 1024, 1024, 16
    mha_ext.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    mha = mha_ext.MultiHeadAttention(E, H, seed=0).eval()
    x = np.random.default_rng(0).standard_normal((B, S, E), dtype=np.float32)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out, w = mha(x, need_weights=False)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert w is None
    print(json.dumps({"before_kib": before, "after_kib": after}))


def peak_memory(threads):
    env = dict(os.environ, BENCH_THREADS=str(threads))
    # through a shell that forks: Linux carries ru_maxrss across exec, so a
    # child exec'd straight from this (large) process would report our peak
    r = subprocess.run(["/bin/sh", "-c", '"$0" "$@"; exit $?', sys.executable,
                        os.path.abspath(__file__), "--memory-child"],
                       capture_output=True, text=True, env=env)
    if r.returncode != 0:
        print(r.stderr, file=sys.stderr)
        return None
    m = json.loads(r.stdout.strip().splitlines()[-1])
    B, S, E, H = 4, 1024, 1024, 16
    m["inputs_outputs_mib"] = B * S * E * 4 * 2 / 2**20
    m["one_SqSk_buffer_per_head_mib"] = B * H * S * S * 4 / 2**20
    m["growth_mib"] = (m["after_kib"] - m["before_kib"]) / 1024
    return m


def main():
    if "--isolated" in sys.argv[1:]:
        # each library in its own process: bench_isolated.py (its own options)
        import bench_isolated
        bench_isolated.main([a for a in sys.argv[1:] if a != "--isolated"])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30, help="at least this many pairs of calls")
    ap.add_argument("--min-time", type=float, default=3.0,
                    help="and keep going for at least this many seconds per case")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--cases", default=",".join([*CASES, *BWD_CASES]))
    ap.add_argument("--isa", default=None, help="force mha_ext's ISA (portable, avx2, avx512, amx)")
    ap.add_argument("--omp-wait-policy", default="passive", choices=["passive", "active"],
                    help="OMP_WAIT_POLICY for torch's OpenMP threads (default passive)")
    ap.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--isolated", action="store_true",
                    help="each library (torch, ONNX Runtime, JAX, mha_ext) alone in its own "
                         "process: see bench_isolated.py, whose options then apply "
                         "(python benchmarks/bench.py --isolated --help)")
    args = ap.parse_args()
    os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy.upper()
    if args.memory_child:
        peak_memory_child()
        return

    import torch
    import mha_ext
    from mha_ext import _core
    torch.set_num_threads(args.threads)
    mha_ext.set_num_threads(args.threads)
    if args.isa:
        _core._set_isa(args.isa)
    isa = _core._get_isa() if hasattr(_core, "_get_isa") else "?"
    peak = fma_peak(args.threads)
    print(f"torch {torch.__version__}, mha_ext ISA {isa}, {args.threads} threads, "
          f"{platform.processor() or platform.machine()}, "
          f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}")
    if peak:
        print(f"FMA probe peak at {args.threads} threads: f32 {peak[0]:.1f} GFLOP/s, "
              f"f64 {peak[1]:.1f} GFLOP/s")
    rows = []
    hdr = (f"| {'case':<18} | {'torch ms':>9} | {'mha_ext ms':>10} | {'torch/ours':>10} | "
           f"{'target':>6} | {'GFLOP/s':>7} | {'% peak':>6} | {'max abs diff':>12} |")
    print(hdr)
    print("|" + "|".join("-" * (len(c)) for c in hdr.split("|")[1:-1]) + "|")
    for case in args.cases.split(","):
        case = case.strip()
        if case in BWD_CASES:
            import bench_backward
            sh = bench_backward.SHAPES[BWD_CASES[case]]
            B, S, E, H = sh["B"], sh["S"], sh["E"], sh["H"]
            dtype, causal, nw = "float32", False, False
            med, diff = bench_backward.bench(case, **sh, reps=args.reps,
                                             max_time=3 * args.min_time, with_nn_mha=False)
            tt, to, n = med["torch seed"], med["mha_ext"], med["rounds"]
            gf = bench_backward.flops(B, S, E, H) / to / 1e9
        else:
            B, S, E, H, dtype, causal, nw = CASES[case]
            tt, to, diff, n = bench_case(case, args.reps, args.min_time)
            gf = flops(B, S, E, H, causal) / to / 1e9
        pk = None if not peak else peak[1 if dtype == "float64" else 0]
        pct = 100 * gf / pk if pk else float("nan")
        ratio = tt / to
        row = dict(case=case, B=B, S=S, E=E, H=H, dtype=dtype, is_causal=causal,
                   need_weights=nw, torch_ms=tt * 1e3, ours_ms=to * 1e3, ratio=ratio,
                   target=TARGET[case], met=ratio >= TARGET[case], gflops=gf,
                   pct_peak=pct, max_abs_diff=diff, pairs=n)
        rows.append(row)
        print(f"| {case:<18} | {tt*1e3:9.3f} | {to*1e3:10.3f} | {ratio:9.2f}x | "
              f"{TARGET[case]:5.1f}x | {gf:7.1f} | {pct:5.1f}% | {diff:12.2e} |", flush=True)
    mem = peak_memory(args.threads)
    if mem:
        print(f"large need_weights=False, fresh process: ru_maxrss {mem['after_kib']/1024:.0f} MiB "
              f"(+{mem['growth_mib']:.0f} MiB during the call; inputs+output "
              f"{mem['inputs_outputs_mib']:.0f} MiB; one (Sq, Sk) buffer per head would be "
              f"{mem['one_SqSk_buffer_per_head_mib']:.0f} MiB)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(torch=torch.__version__, isa=isa, threads=args.threads,
                           omp_wait_policy=os.environ["OMP_WAIT_POLICY"],
                           peak_gflops=dict(f32=peak[0], f64=peak[1]) if peak else None,
                           cases=rows, memory=mem), f, indent=2)


if __name__ == "__main__":
    main()
