"""How close ONNX Runtime runs to the FMA peak: the arithmetic behind the
"1.2x ONNX Runtime" target.

    python benchmarks/ort_bound.py [--threads 2] [--rounds 3] [--cases tiny,medium,...]
                                   [--json results.json]

For each forward case that bench_isolated.py runs ONNX Runtime on (float32,
no weights), one fresh process per measurement times, with ONNX Runtime at
--threads intra-op threads:

  call   bench_isolated.py's whole ONNX graph (com.microsoft Attention with
         its Q/K/V projection, then the output projection)
  qkv    ONNX Runtime's own MatMul at the Q/K/V projection's shape,
         (B*S, E) x (E, 3E), the weight a constant (prepacked at load)
  out    the same at the output projection's shape, (B*S, E) x (E, E)

and prints each as GFLOP/s and % of the FMA probe's peak (fma_probe.c, the
highest of the probes run before and after every case).  The work counted
is the dense work (bench.flops), as bench_isolated.py counts it.  A library
1.2x faster than ONNX Runtime's whole call runs at 1.2 x its % of the peak
("1.2x needs"): past 100% no library doing the dense work can (a causal
case's skipped blocks are work not done, so there it can).  The GEMM rows
show how fast the same library's prepacked GEMM runs on that machine at
those shapes.  The parts run in turn, their order reversed every other
round; times are medians over rounds of each process's median.  Needs
onnxruntime and onnx (pip install ".[bench]").
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench  # noqa: E402  (flops, fma_peak)
import bench_isolated  # noqa: E402  (CASES, runner_ort, worker_env)

PARTS = ["call", "qkv", "out"]


def cases():
    return [c for c in bench_isolated.CASES if bench_isolated.applies("ort", c)]


def part_flops(case, part):
    _kind, B, S, E, H, _dtype, causal, _nw = bench_isolated.CASES[case]
    if part == "call":
        return bench.flops(B, S, E, H, causal)
    return 2 * B * S * E * (3 * E if part == "qkv" else E)


def runner_matmul(case, part, threads):
    """ONNX Runtime's MatMul of x (B*S, E) by a constant weight."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper
    _kind, B, S, E, _H, _dtype, _c, _nw = bench_isolated.CASES[case]
    N = 3 * E if part == "qkv" else E
    rng = np.random.default_rng(0)
    w = (rng.uniform(-1, 1, (E, N)) / np.sqrt(E)).astype(np.float32)
    x = rng.standard_normal((B * S, E)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [B * S, E])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [B * S, N])],
        [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10  # what ONNX Runtime 1.20 on reads (onnx writes newer)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])
    return lambda: sess.run(["y"], {"x": x})[0]


def worker(case, part, threads, reps, min_time):
    """One measurement, as bench_isolated.py's workers take theirs."""
    bench_isolated.pin(threads)
    run = (bench_isolated.runner_ort(case, threads) if part == "call"
           else runner_matmul(case, part, threads))
    run()
    run()
    bench_isolated.time_calls(run, reps, min_time)


def measure(case, part, args):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", case, part,
           "--threads", str(args.threads), "--reps", str(args.reps),
           "--min-time", str(args.min_time)]
    r = subprocess.run(cmd, capture_output=True, text=True,
                       env=bench_isolated.worker_env(args.threads))
    if r.returncode != 0:
        sys.exit(f"ONNX Runtime on {case} ({part}) failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])["median_s"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--min-time", type=float, default=1.0,
                    help="seconds each process times at least (default 1)")
    ap.add_argument("--cases", default=",".join(cases()),
                    help="comma-separated (default: every case ONNX Runtime runs)")
    ap.add_argument("--json", help="write the measurements here")
    ap.add_argument("--worker", nargs=2, metavar=("CASE", "PART"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(*args.worker, args.threads, args.reps, args.min_time)
        return 0
    todo = [c.strip() for c in args.cases.split(",") if c.strip()]
    for c in todo:
        if c not in cases():
            ap.error(f"unknown case {c!r}: expected some of {', '.join(cases())}")
    missing = bench_isolated.available("ort")
    if missing:
        sys.exit(missing)
    probes = [bench.fma_peak(args.threads)]
    if probes[0] is None:
        sys.exit("the FMA probe did not build (it needs cc or gcc): no peak to compare with")
    print(f"CPU: {bench_isolated.cpu_model()}; ONNX Runtime at {args.threads} threads")
    print(f"{'case':<16}{'part':<6}{'ms':>10}{'GFLOP/s':>10}{'% peak':>8}{'1.2x needs':>12}")
    results = []
    for case in todo:
        times = {p: [] for p in PARTS}
        for rnd in range(args.rounds):
            for p in (PARTS if rnd % 2 == 0 else PARTS[::-1]):
                times[p].append(measure(case, p, args))
        probes.append(bench.fma_peak(args.threads))
        peak = max(p[0] for p in probes if p)
        for p in PARTS:
            t = statistics.median(times[p])
            rate = part_flops(case, p) / t / 1e9
            need = f"{120 * rate / peak:.0f}%" if p == "call" else ""
            print(f"{case:<16}{p:<6}{1e3 * t:>10.3f}{rate:>10.0f}{100 * rate / peak:>7.1f}%"
                  f"{need:>12}")
            results.append({"case": case, "part": p, "times_s": times[p], "median_s": t,
                            "gflops": rate, "peak_f32": peak})
    f32 = [p[0] for p in probes if p]
    print(f"FMA probe f32: {min(f32):.1f}-{max(f32):.1f} GFLOP/s over {len(f32)} probes")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"cpu": bench_isolated.cpu_model(), "threads": args.threads,
                       "probes": probes, "results": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
