"""Decoding with a key/value cache: one decode step (one new token per
sequence) against a cache of 2048 keys, mha_ext vs torch and Hugging Face.

    python benchmarks/bench_decode.py [--threads 2] [--min-time 3] [--rounds 3] [--json out.json]

Shape (issue 15): B 8, 2048 cached keys, E 1024, H 16, float32, with
n_kv_heads 16 (plain multi-head) and 4 (grouped-query).  For each:

  ours   MultiHeadAttention(E, H, n_kv_heads=Hkv) and m(x, cache=cache): the
         four projections of the new token, its K and V written into the
         cache, attention over the 2049 keys.
  torch  four nn.Linear projections, the new K and V written into
         preallocated cache tensors (B, Hkv, cap, Dk), then
         F.scaled_dot_product_attention over the cached K and V
         (enable_gqa when Hkv < H): the usual hand-written torch cache.
  hf     transformers' LlamaAttention (random init from a config, attention
         "sdpa") with a DynamicCache of 2048 keys: its path, rotary
         embeddings included (cos/sin given).

Every step starts from the same 2048 keys (our cache's length is set back,
torch's index is fixed, HF's DynamicCache is cropped back to 2048 after
each step, which is how its cache stays at that length).  The cache is
filled with random keys and values (the projections that would have made
them are not what is timed).

Reported: ms per step (median), the cache's bytes read per step (K and V of
2049 keys: 2 · B · Hkv · 2049 · Dk · 4 bytes) over the step's time in GB/s
(also the cache and the four weight matrices together, all a step must read)
(and, for ours, over the attention's share alone: the step minus the same
step with an empty cache, which is the projections' and the call's fixed
cost), and that as a % of the machine's memory read bandwidth measured by a small
C probe (read_probe.c next to this file, compiled at run time: each of
--threads threads sums its slice of a 512 MiB buffer; run once per round,
the median taken, as this machine's bandwidth varies); also a prefill
(B 8, 256 tokens) through the cache against the plain causal call.
Each implementation runs in its own process.  Timings on a shared machine
are noisy: run it alone.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # an in-place build at the root, as the other benches
B, L, E, H = 8, 2048, 1024, 16
KV_HEADS = (16, 4)
IMPLS = ("ours", "torch", "hf")


def read_bandwidth(threads):
    """GB/s of the read probe at `threads` threads, or None."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    isa = ["-mavx512f"] if " avx512f" in flags else ["-mavx2"]
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, "read_probe")
        r = subprocess.run([cc, "-O2", *isa, os.path.join(HERE, "read_probe.c"), "-o", exe,
                            "-lpthread"], capture_output=True, text=True)
        if r.returncode != 0:
            print("read probe did not build:", r.stderr, file=sys.stderr)
            return None
        out = subprocess.run([exe, str(threads), "512"], capture_output=True, text=True).stdout
    return float(out.split()[1])


def timed(fn, min_time, reps=10):
    """Median seconds of fn() over at least `reps` calls and `min_time` s."""
    for _ in range(3):
        fn()
    ts, t_end = [], time.perf_counter() + min_time
    while len(ts) < reps or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2]


def child_ours(Hkv, min_time):
    import numpy as np
    import mha_ext
    rng = np.random.default_rng(0)
    m = mha_ext.MultiHeadAttention(E, H, n_kv_heads=Hkv, seed=0).eval()
    cache = m.new_cache(B, L + 1)
    cache._k[...] = rng.standard_normal(cache._k.shape, dtype=np.float32)  # 2048 "past" keys
    cache._v[...] = rng.standard_normal(cache._v.shape, dtype=np.float32)
    x = rng.standard_normal((B, 1, E), dtype=np.float32)

    def step(length=L):
        cache._length = length
        m(x, cache=cache, need_weights=False)
    res = {"step_s": timed(step, min_time)}
    # the same step over an empty cache: the projections and the call's fixed
    # costs, so that step_s - empty_s is the attention's share (the cache read)
    res["empty_s"] = timed(lambda: step(0), min_time / 2)
    # prefill: 256 tokens through a cache vs the plain causal call
    xp = rng.standard_normal((B, 256, E), dtype=np.float32)
    pc = m.new_cache(B, 256)

    def prefill():
        pc.reset()
        m(xp, cache=pc, need_weights=False)
    res["prefill_s"] = timed(prefill, min_time / 2)
    res["plain_s"] = timed(lambda: m(xp, is_causal=True, need_weights=False), min_time / 2)
    return res


def child_torch(Hkv, min_time):
    import torch
    F = torch.nn.functional
    torch.manual_seed(0)
    Dk = E // H
    q, k, v, o = (torch.nn.Linear(E, n) for n in (E, Hkv * Dk, Hkv * Dk, E))
    kc = torch.randn(B, Hkv, L + 1, Dk)
    vc = torch.randn(B, Hkv, L + 1, Dk)
    x = torch.randn(B, 1, E)

    @torch.inference_mode()
    def step():
        qh = q(x).view(B, 1, H, Dk).transpose(1, 2)
        kc[:, :, L:L + 1] = k(x).view(B, 1, Hkv, Dk).transpose(1, 2)
        vc[:, :, L:L + 1] = v(x).view(B, 1, Hkv, Dk).transpose(1, 2)
        c = F.scaled_dot_product_attention(qh, kc, vc, enable_gqa=Hkv < H)
        return o(c.transpose(1, 2).reshape(B, 1, E))
    return {"step_s": timed(step, min_time)}


def child_hf(Hkv, min_time):
    import torch
    import transformers
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=E, num_attention_heads=H,
                                   num_key_value_heads=Hkv, attn_implementation="sdpa")
    att = LlamaAttention(cfg, layer_idx=0).eval()
    rope = LlamaRotaryEmbedding(cfg)
    Dk = E // H
    cache = transformers.DynamicCache()
    cache.update(torch.randn(B, Hkv, L, Dk), torch.randn(B, Hkv, L, Dk), 0)
    x = torch.randn(B, 1, E)
    pos = torch.full((B, 1), L)
    cos_sin = rope(x, pos)

    @torch.inference_mode()
    def step():
        out = att(x, position_embeddings=cos_sin, attention_mask=None, past_key_values=cache)
        cache.crop(-1)  # back to the 2048 keys
        return out
    return {"step_s": timed(step, min_time)}


def run_child(impl, Hkv, args):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", impl, "--kv", str(Hkv),
           "--threads", str(args.threads), "--min-time", str(args.min_time)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        print(f"{impl} (n_kv_heads {Hkv}) failed:\n{r.stderr}", file=sys.stderr)
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--min-time", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of probe + every process")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--kv-heads", default=",".join(map(str, KV_HEADS)))
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", choices=IMPLS, help=argparse.SUPPRESS)
    ap.add_argument("--kv", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        import mha_ext  # noqa: F401 -- the path of the package under test
        import torch
        torch.set_num_threads(args.threads)
        mha_ext.set_num_threads(args.threads)
        res = globals()[f"child_{args.child}"](args.kv, args.min_time)
        print(json.dumps(res))
        return
    # rounds: the read probe, then each implementation in its own process,
    # alternated; medians over the rounds (the probe's too: a shared
    # machine's memory bandwidth varies from minute to minute)
    kvs = list(map(int, args.kv_heads.split(",")))
    impls = args.impls.split(",")
    bws, runs = [], {(Hkv, impl): [] for Hkv in kvs for impl in impls}
    for rnd in range(args.rounds):
        b = read_bandwidth(args.threads)
        if b:
            bws.append(b)
        for Hkv in kvs:
            for impl in (impls if rnd % 2 == 0 else impls[::-1]):
                r = run_child(impl, Hkv, args)
                if r is not None:
                    runs[(Hkv, impl)].append(r)
    bw = statistics.median(bws) if bws else None
    print(f"memory read bandwidth ({args.threads} threads, read_probe.c, median of "
          f"{len(bws)}: {', '.join(f'{x:.1f}' for x in bws)}): {bw:.1f} GB/s" if bw else
          "memory read bandwidth: (probe unavailable)")
    results = {"read_GBps": bw, "read_GBps_rounds": bws, "threads": args.threads,
               "rounds": args.rounds, "cases": {}}
    for Hkv in kvs:
        cache_bytes = 2 * B * Hkv * (L + 1) * (E // H) * 4
        weight_bytes = (2 * E * E + 2 * E * Hkv * (E // H)) * 4  # W_q, W_o; W_k, W_v
        print(f"\ndecode step: B {B}, {L} cached keys, E {E}, H {H}, n_kv_heads {Hkv} "
              f"(cache read per step {cache_bytes / 1e6:.1f} MB)")
        row = {}
        for impl in impls:
            rs = runs[(Hkv, impl)]
            if not rs:
                continue
            r = {k: statistics.median(x[k] for x in rs) for k in rs[0]}
            ms = 1e3 * r["step_s"]
            gbps = cache_bytes / r["step_s"] / 1e9
            pct = f"{100 * gbps / bw:5.1f}% of read bandwidth" if bw else ""
            print(f"  {impl:6s} {ms:8.3f} ms/step  {gbps:7.1f} GB/s  {pct}   (rounds: "
                  f"{', '.join('%.2f' % (1e3 * x['step_s']) for x in rs)} ms)")
            # what the step must read in all: the cache and the four weight matrices
            allb = cache_bytes + weight_bytes
            pall = f" = {100 * allb / r['step_s'] / 1e9 / bw:.1f}% of read bandwidth" if bw else ""
            print(f"  {'':6s} cache + weights ({allb / 1e6:.1f} MB) per step: "
                  f"{allb / r['step_s'] / 1e9:.1f} GB/s{pall}")
            if "empty_s" in r and r["step_s"] > r["empty_s"]:
                att = r["step_s"] - r["empty_s"]
                r["attention_GBps"] = cache_bytes / att / 1e9
                pa = f"{100 * r['attention_GBps'] / bw:5.1f}% of read bandwidth" if bw else ""
                print(f"  {'':6s} the attention alone (the step minus the same step with an empty "
                      f"cache, {1e3 * r['empty_s']:.3f} ms): {1e3 * att:.3f} ms, "
                      f"{r['attention_GBps']:.1f} GB/s {pa}")
            row[impl] = dict(r, ms=ms, GBps=gbps, pct_bw=100 * gbps / bw if bw else None)
            if "prefill_s" in r:
                print(f"  {'':6s} prefill 256 tokens through the cache {1e3 * r['prefill_s']:.2f} ms"
                      f" vs the plain causal call {1e3 * r['plain_s']:.2f} ms "
                      f"(ratio {r['prefill_s'] / r['plain_s']:.2f})")
        for impl in ("torch", "hf"):
            if "ours" in row and impl in row:
                print(f"  ours vs {impl}: {row[impl]['ms'] / row['ours']['ms']:.2f}x faster")
        results["cases"][f"n_kv_heads={Hkv}"] = row
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
