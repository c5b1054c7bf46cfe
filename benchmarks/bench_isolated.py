"""mha_ext against torch, ONNX Runtime and JAX, each library alone in its own process.

    python benchmarks/bench.py --isolated [--threads 2] [--rounds 5] [--reps 20]
                               [--cases tiny,medium,...] [--libs mha_ext,torch,ort,jax]
                               [--json results.json] [--quick]

One measurement is one fresh process running one library on one case: it
builds the module from the same weights and input (NumPy, seed 0), warms up,
times --reps calls (at least --min-time seconds) and prints their median.
Round after round every library measures every case, the order of the
libraries reversed on every other round, so that load from other processes
hits all alike; a library's time is the median of its rounds' medians.  No
process shares a core with another library's thread pool, so no OpenMP wait
policy is set: each library runs with its defaults at the same thread count
(mha_ext.set_num_threads, torch.set_num_threads, ONNX Runtime's
intra_op_num_threads, XLA's intra-op threads; below the machine's CPU count
every worker is also pinned to the first --threads CPUs).

Peers, each on its fastest path for the case:
  torch    torch.nn.MultiheadAttention(batch_first=True), eval, inference
           mode, need_weights=False (its fused SDPA path) unless the case
           returns weights (then average_attn_weights=False, as ours)
  ort      an ONNX graph: the com.microsoft Attention contrib op (ONNX
           Runtime's fused CPU attention, Q/K/V projection included) and the
           output projection (MatMul + Add); float32, no weights returned
  jax      jax.jit of the projections, jax.nn.dot_product_attention and the
           output projection; float32, no weights returned
The training rows time one step (forward + backward, need_weights=False,
the gradients of the input and of every parameter) against torch's
nn.MultiheadAttention under autograd (its fused SDPA forward and backward)
and, as "torch seed", the seed notebook's module (bench_backward.py), which
materialises every (S, S) matrix.  Every case is self-attention (query =
key = value = x).  ONNX Runtime and JAX are optional (pip install
".[bench]"): a missing one is skipped with a note.

"torch per round" is the lowest and highest of torch's time over ours
within one round: how far the machine's load moved the ratio, which the
median of the rounds does not show.  The JSON keeps every round's medians.

"diff" is the largest |peer - torch| of the output (training: of the
gradient of W_o), a sanity check that every library computes the same thing.
% peak counts the dense work (bench.flops; training 3x the forward) against
the FMA probe's peak (fma_probe.c) at the same thread count.  The probe runs
before the first case and again after every case, and a row's % peak is
against the highest probe so far: on a shared machine one probe can run
while a neighbour holds the cores (a probe at half the usual peak once gave
rows of 110% and more).  The last line gives the lowest and highest probe of
the run; the JSON keeps them all.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# name: (kind, B, S, E, H, dtype, is_causal, need_weights)
CASES = {
    "tiny": ("fwd", 2, 10, 512, 8, "float32", False, False),
    "tiny weights": ("fwd", 2, 10, 512, 8, "float32", False, True),
    "medium": ("fwd", 8, 128, 512, 8, "float32", False, False),
    "medium weights": ("fwd", 8, 128, 512, 8, "float32", False, True),
    "causal medium": ("fwd", 8, 128, 512, 8, "float32", True, False),
    "BERT": ("fwd", 16, 384, 768, 12, "float32", False, False),
    "BERT weights": ("fwd", 16, 384, 768, 12, "float32", False, True),
    "large": ("fwd", 4, 1024, 1024, 16, "float32", False, False),
    "large weights": ("fwd", 4, 1024, 1024, 16, "float32", False, True),
    "long": ("fwd", 1, 4096, 1024, 16, "float32", False, False),
    "float64 medium": ("fwd", 8, 128, 512, 8, "float64", False, False),
    "float64 medium weights": ("fwd", 8, 128, 512, 8, "float64", False, True),
    "train medium": ("train", 8, 128, 512, 8, "float32", False, False),
    "train large": ("train", 4, 1024, 1024, 16, "float32", False, False),
}
QUICK_CASES = ["tiny", "medium weights", "train medium"]
LIBS = ["mha_ext", "torch", "ort", "jax", "torch seed"]
# the issue's targets: ours at least this many times faster than the peer
TARGET = {"torch": 1.3, "ort": 1.2}


def applies(lib, case):
    """Whether `lib` runs `case` (ORT and JAX: float32 forward without
    weights; the seed module: training only)."""
    kind, *_, dtype, _causal, nw = CASES[case]
    if lib in ("mha_ext", "torch"):
        return True
    if lib == "torch seed":
        return kind == "train"
    return kind == "fwd" and dtype == "float32" and not nw


def available(lib):
    """None if `lib` can be imported, else the note printed for it."""
    mod = {"mha_ext": None, "torch": "torch", "torch seed": "torch",
           "ort": "onnxruntime", "jax": "jax"}[lib]
    if mod is None:
        return None
    code = f"import {mod}" + (", onnx" if mod == "onnxruntime" else "")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True)
    if r.returncode == 0:
        return None
    return (f"{lib}: not installed, skipped (pip install "
            f"\".[bench]\" installs onnxruntime, onnx and jax)")


# ----------------------------------------------------------------- worker side

def data(case):
    """The weights and input every library uses: torch's layout
    (in_proj_weight (3E, E), in_proj_bias, out_proj weight and bias), NumPy."""
    _kind, B, S, E, H, dtype, _c, _nw = CASES[case]
    rng = np.random.default_rng(0)
    lim = 1 / np.sqrt(E)
    w_in = rng.uniform(-lim, lim, (3 * E, E)).astype(dtype)
    b_in = rng.uniform(-lim, lim, 3 * E).astype(dtype)
    w_o = rng.uniform(-lim, lim, (E, E)).astype(dtype)
    b_o = rng.uniform(-lim, lim, E).astype(dtype)
    x = rng.standard_normal((B, S, E)).astype(dtype)
    g = rng.standard_normal((B, S, E)).astype(dtype)
    return w_in, b_in, w_o, b_o, x, g


def runner_mha_ext(case, threads):
    sys.path.insert(0, ROOT)
    import mha_ext
    kind, B, S, E, H, dtype, causal, nw = CASES[case]
    mha_ext.set_num_threads(threads)
    w_in, b_in, w_o, b_o, x, g = data(case)
    m = mha_ext.MultiHeadAttention(E, H, dtype=dtype).eval()
    m.load_state_dict({
        "W_q.weight": w_in[:E], "W_k.weight": w_in[E:2 * E], "W_v.weight": w_in[2 * E:],
        "W_q.bias": b_in[:E], "W_k.bias": b_in[E:2 * E], "W_v.bias": b_in[2 * E:],
        "W_o.weight": w_o, "W_o.bias": b_o})
    if kind == "train":
        def run():
            ctx = m.forward_train(x, x, x, need_weights=False)
            return m.backward(ctx, g)["W_o.weight"]
        return run

    def run():
        return m(x, x, x, is_causal=causal, need_weights=nw)[0]
    return run


def runner_torch(case, threads, seed_module=False):
    import torch
    kind, B, S, E, H, dtype, causal, nw = CASES[case]
    torch.set_num_threads(threads)
    w_in, b_in, w_o, b_o, x, g = (torch.from_numpy(a) for a in data(case))
    if seed_module:
        sys.path.insert(0, HERE)
        import bench_backward
        tm = bench_backward.seed_module(E, H).to(getattr(torch, dtype))
        with torch.no_grad():
            for i, lin in enumerate((tm.W_q, tm.W_k, tm.W_v)):
                lin.weight.copy_(w_in[i * E:(i + 1) * E])
                lin.bias.copy_(b_in[i * E:(i + 1) * E])
            tm.W_o.weight.copy_(w_o)
            tm.W_o.bias.copy_(b_o)
        w_out = tm.W_o.weight
    else:
        tm = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=getattr(torch, dtype))
        with torch.no_grad():
            tm.in_proj_weight.copy_(w_in)
            tm.in_proj_bias.copy_(b_in)
            tm.out_proj.weight.copy_(w_o)
            tm.out_proj.bias.copy_(b_o)
        w_out = tm.out_proj.weight
    if kind == "train":
        xr = x.clone().requires_grad_(True)

        def run():
            xr.grad = None
            tm.zero_grad(set_to_none=True)
            out = tm(xr, xr, xr) if seed_module else tm(xr, xr, xr, need_weights=False)[0]
            out.backward(g)
            return w_out.grad.numpy()
        return run
    tm.eval()
    mask = torch.triu(torch.ones(S, S, dtype=torch.bool), 1) if causal else None

    def run():
        with torch.inference_mode():
            return tm(x, x, x, attn_mask=mask, is_causal=causal, need_weights=nw,
                      average_attn_weights=False)[0].numpy()
    return run


def runner_ort(case, threads):
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper
    _kind, B, S, E, H, dtype, causal, _nw = CASES[case]
    w_in, b_in, w_o, b_o, x, _g = data(case)
    inits = [numpy_helper.from_array(np.ascontiguousarray(w_in.T), "w_in"),
             numpy_helper.from_array(b_in, "b_in"),
             numpy_helper.from_array(np.ascontiguousarray(w_o.T), "w_o"),
             numpy_helper.from_array(b_o, "b_o")]
    nodes = [helper.make_node("Attention", ["x", "w_in", "b_in"], ["ctx"],
                              domain="com.microsoft", num_heads=H,
                              unidirectional=int(causal)),
             helper.make_node("MatMul", ["ctx", "w_o"], ["proj"]),
             helper.make_node("Add", ["proj", "b_o"], ["out"])]
    graph = helper.make_graph(
        nodes, "mha", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [B, S, E])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [B, S, E])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10  # what ONNX Runtime 1.20 on reads (onnx writes newer)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])

    def run():
        return sess.run(["out"], {"x": x})[0]
    return run


def runner_jax(case, threads):
    import jax
    import jax.numpy as jnp
    _kind, B, S, E, H, dtype, causal, _nw = CASES[case]
    w_in, b_in, w_o, b_o, x, _g = (jnp.asarray(a) for a in data(case))
    Dk = E // H

    @jax.jit
    def mha(x, w_in, b_in, w_o, b_o):
        qkv = x @ w_in.T + b_in  # (B, S, 3E)
        q, k, v = (t.reshape(B, S, H, Dk) for t in jnp.split(qkv, 3, axis=-1))
        ctx = jax.nn.dot_product_attention(q, k, v, is_causal=causal)
        return ctx.reshape(B, S, E) @ w_o.T + b_o

    def run():
        return np.asarray(mha(x, w_in, b_in, w_o, b_o).block_until_ready())
    return run


def pin(threads):
    """Below the machine's CPU count, keep this process on the first `threads` CPUs."""
    if threads < (os.cpu_count() or threads):
        os.sched_setaffinity(0, range(threads))


def time_calls(run, reps, min_time):
    """Time `run` (warmed up already) at least `reps` times and for at least
    `min_time` seconds (at most 50 * reps calls); prints the worker's line,
    {"median_s": ..., "calls": ...}."""
    times = []
    t_start = time.perf_counter()
    while len(times) < reps or (time.perf_counter() - t_start < min_time
                                and len(times) < 50 * reps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    print(json.dumps({"median_s": statistics.median(times), "calls": len(times)}))


def worker(lib, case, threads, reps, min_time, save):
    """One measurement: prints {"median_s": ..., "calls": ...}; saves the
    first result to `save` (.npy) when given."""
    pin(threads)
    if lib == "mha_ext":
        run = runner_mha_ext(case, threads)
    elif lib in ("torch", "torch seed"):
        run = runner_torch(case, threads, seed_module=(lib == "torch seed"))
    elif lib == "ort":
        run = runner_ort(case, threads)
    else:
        run = runner_jax(case, threads)
    out = run()
    if save:
        np.save(save, np.asarray(out))
    run()  # warm-up: the first call above, one more
    time_calls(run, reps, min_time)


def worker_env(threads):
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    env["OMP_NUM_THREADS"] = str(threads)
    env["MHA_EXT_NUM_THREADS"] = str(threads)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=true"
                        f" intra_op_parallelism_threads={threads}").strip()
    env["JAX_PLATFORMS"] = "cpu"
    return env


# ----------------------------------------------------------------- driver side

def measure(lib, case, args, save=None):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", lib, case,
           "--threads", str(args.threads), "--reps", str(args.reps),
           "--min-time", str(args.min_time)]
    if save:
        cmd += ["--save", save]
    r = subprocess.run(cmd, capture_output=True, text=True, env=worker_env(args.threads))
    if r.returncode != 0:
        print(f"  {lib} on {case} failed:\n{r.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])["median_s"]


def cpu_model():
    """The model name, its family and model numbers and the vector
    extensions that matter here (from /proc/cpuinfo's first CPU)."""
    info = {}
    try:
        for line in open("/proc/cpuinfo"):
            if not line.strip():
                break
            k, _, v = line.partition(":")
            info[k.strip()] = v.strip()
    except OSError:
        return platform.processor() or platform.machine()
    flags = set(info.get("flags", "").split())
    ext = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    return (f"{info.get('model name', platform.machine())} (family {info.get('cpu family', '?')}, "
            f"model {info.get('model', '?')}; {' '.join(ext)})")


def mha_ext_cpu_info():
    """mha_ext.cpu_info() from a child process (this one starts no pool)."""
    r = subprocess.run([sys.executable, "-c", "import json, mha_ext; "
                        "print(json.dumps(mha_ext.cpu_info()))"],
                       capture_output=True, text=True, timeout=120)
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


def best_probe(probes):
    """The highest f32 and the highest f64 of the FMA probe's runs (pairs
    (f32, f64) GFLOP/s): the machine's peak, whatever load a run met; None
    without a run."""
    if not probes:
        return None
    return max(p[0] for p in probes), max(p[1] for p in probes)


def round_ratios(rounds, peer, ours="mha_ext"):
    """peer / ours within each round where both measured (a round runs the
    two libraries back to back, under the same load), from run_case's lists
    of round medians (None: the worker failed): their spread says how far
    the machine moved a ratio, which the median of the rounds hides."""
    return [p / o for p, o in zip(rounds.get(peer, []), rounds.get(ours, []))
            if p is not None and o]


def run_case(case, libs, args, tmp):
    """{lib: median of round medians (s)}, {lib: max |out - torch's|} and
    {lib: each round's median (s), None where the worker failed}."""
    libs = [lib for lib in libs if applies(lib, case)]
    rounds = {lib: [] for lib in libs}
    diffs = {}
    for r in range(args.rounds):
        for lib in (libs if r % 2 == 0 else libs[::-1]):
            save = os.path.join(tmp, f"{lib}.npy") if r == 0 else None
            rounds[lib].append(measure(lib, case, args, save))
    if "torch" in libs and os.path.exists(os.path.join(tmp, "torch.npy")):
        ref = np.load(os.path.join(tmp, "torch.npy"))
        for lib in libs:
            p = os.path.join(tmp, f"{lib}.npy")
            if lib != "torch" and os.path.exists(p):
                diffs[lib] = float(np.max(np.abs(np.load(p).astype(np.float64) - ref)))
            if os.path.exists(p):
                os.remove(p)
    med = {lib: statistics.median([x for x in t if x is not None])
           for lib, t in rounds.items() if any(x is not None for x in t)}
    return med, diffs, rounds


def main(argv=None):
    sys.path.insert(0, HERE)
    import bench  # flops, fma_peak
    import bench_backward
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5, help="processes per library and case")
    ap.add_argument("--reps", type=int, default=20, help="timed calls per process (at least)")
    ap.add_argument("--min-time", type=float, default=1.0,
                    help="and at least this many seconds of calls per process")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--libs", default=",".join(LIBS))
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: 2 rounds of 3 calls, cases " + ",".join(QUICK_CASES))
    ap.add_argument("--worker", nargs=2, metavar=("LIB", "CASE"), help=argparse.SUPPRESS)
    ap.add_argument("--save", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--isolated", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(*args.worker, args.threads, args.reps, args.min_time, args.save)
        return
    if args.quick:
        args.rounds, args.reps, args.min_time = 2, 3, 0.0
        if args.cases == ",".join(CASES):
            args.cases = ",".join(QUICK_CASES)
    cases = [c.strip() for c in args.cases.split(",")]
    for c in cases:
        if c not in CASES:
            ap.error(f"unknown case {c!r}; the cases are {', '.join(CASES)}")
    libs = []
    for lib in (x.strip() for x in args.libs.split(",")):
        if lib not in LIBS:
            ap.error(f"unknown library {lib!r}; the libraries are {', '.join(LIBS)}")
        note = available(lib)
        if note:
            print(note)
        else:
            libs.append(lib)
    versions = subprocess.run(
        [sys.executable, "-c", "import importlib.metadata as m\n"
         "for p in ('torch','onnxruntime','jax','numpy'):\n"
         "  try: print(p, m.version(p))\n  except Exception: pass"],
        capture_output=True, text=True).stdout.split()
    versions = dict(zip(versions[::2], versions[1::2]))
    peak = bench.fma_peak(args.threads)
    print(f"CPU: {cpu_model()}, {os.cpu_count()} CPUs; {args.threads} threads per library; "
          + ", ".join(f"{k} {v}" for k, v in versions.items()))
    if peak:
        print(f"FMA probe peak at {args.threads} threads: f32 {peak[0]:.1f} GFLOP/s, "
              f"f64 {peak[1]:.1f} GFLOP/s")
    ci = mha_ext_cpu_info()
    if ci:
        print(f"mha_ext.cpu_info(): L1d {ci['l1d_bytes'] >> 10} KiB, L2 {ci['l2_bytes'] >> 10} KiB, "
              f"L3 {ci['l3_bytes'] >> 10} KiB ({ci['cache_source']}); ISA {ci['isa']}, "
              f"{ci['fma512_per_cycle']} 512-bit FMA/cycle (fma_ratio {ci['fma_ratio']:.2f}); "
              f"GEMM KC {ci['gemm_kc']}, NC {ci['gemm_nc']['float32']} float32 / "
              f"{ci['gemm_nc']['float64']} float64; weight gradients' Aᵀ 4 KiB apart "
              + "/".join("packed" if ci.get("tn_pack", {}).get(d) else "in place"
                         for d in ("float32", "float64")))
    print(f"each library in its own process, {args.rounds} rounds alternated, "
          f"medians of {args.reps}+ calls, median of the rounds; ratio = peer / mha_ext")
    peers = [lib for lib in libs if lib != "mha_ext"]
    hdr = (f"| {'case':<22} | {'mha_ext ms':>10} | "
           + " | ".join(f"{p + ' ms':>13} | {'ratio':>6}" for p in peers)
           + f" | {'% peak':>6} | {'max diff':>8} | {'torch per round':>15} |")
    print(hdr)
    print("|" + "|".join("-" * len(c) for c in hdr.split("|")[1:-1]) + "|")
    rows = []
    probes = [peak] if peak else []
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            kind, B, S, E, H, dtype, causal, nw = CASES[case]
            med, diffs, per_round = run_case(case, libs, args, tmp)
            after = bench.fma_peak(args.threads) if peak else None
            if after:
                probes.append(after)
                peak = best_probe(probes)
            fl = (bench_backward.flops(B, S, E, H) if kind == "train"
                  else bench.flops(B, S, E, H, causal))
            ours = med.get("mha_ext")
            pk = peak[1 if dtype == "float64" else 0] if peak else None
            pct = 100 * fl / ours / 1e9 / pk if (ours and pk) else float("nan")
            ratios = {p: med[p] / ours for p in peers if p in med and ours}
            row = dict(case=case, kind=kind, B=B, S=S, E=E, H=H, dtype=dtype,
                       is_causal=causal, need_weights=nw,
                       ms={k: v * 1e3 for k, v in med.items()}, ratio=ratios,
                       met={p: ratios[p] >= TARGET[p] for p in ratios if p in TARGET},
                       pct_peak=pct, max_diff_vs_torch=diffs,
                       rounds_ms={k: [None if x is None else x * 1e3 for x in v]
                                  for k, v in per_round.items()},
                       round_ratio={p: round_ratios(per_round, p) for p in peers
                                    if p in per_round})
            rows.append(row)
            cells = []
            for p in peers:
                if p in med:
                    cells.append(f"{med[p] * 1e3:13.3f} | {ratios.get(p, float('nan')):5.2f}x")
                else:
                    cells.append(f"{'—':>13} | {'—':>6}")
            dmax = max(diffs.values()) if diffs else float("nan")
            rr = row["round_ratio"].get("torch")
            band = f"{min(rr):.2f}-{max(rr):.2f}x" if rr else "—"
            print(f"| {case:<22} | {ours * 1e3 if ours else float('nan'):10.3f} | "
                  + " | ".join(cells) + f" | {pct:5.1f}% | {dmax:8.1e} | {band:>15} |",
                  flush=True)
    if probes:
        print(f"FMA probe, {len(probes)} runs (before the first case and after each): "
              f"f32 {min(p[0] for p in probes):.1f}-{max(p[0] for p in probes):.1f} GFLOP/s, "
              f"f64 {min(p[1] for p in probes):.1f}-{max(p[1] for p in probes):.1f}; "
              "% peak is against the highest so far")
    print(f"targets: ours >= {TARGET['torch']}x torch and >= {TARGET['ort']}x ONNX Runtime "
          "on every case; GEMM-bound cases (medium, BERT, large, long) >= 75% of peak")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(mode="isolated", cpu=cpu_model(), cpus=os.cpu_count(),
                           threads=args.threads, versions=versions, rounds=args.rounds,
                           reps=args.reps,
                           peak_gflops=dict(f32=peak[0], f64=peak[1]) if peak else None,
                           probes_gflops=[dict(f32=p[0], f64=p[1]) for p in probes],
                           cpu_info=ci, cases=rows), f, indent=2)


if __name__ == "__main__":
    main()
