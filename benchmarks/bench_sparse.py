"""Sliding-window and block-sparse attention (issue 14): the work outside
the window or the layout skipped.

    python benchmarks/bench_sparse.py [--S 8192] [--E 512] [--H 8] [--window 256]
                                      [--block 128] [--rounds 5] [--threads 0]
                                      [--rows window|layout|all]

One forward call, B 1, float32, need_weights=False, self-attention, rows:

  mha_ext causal           m(x, is_causal=True, need_weights=False)
  mha_ext causal+window    m(x, is_causal=True, window=(w, 0), need_weights=False)
  torch nn.MHA dense mask  torch.nn.MultiheadAttention(batch_first=True), eval,
                           need_weights=False, attn_mask = the same window as a
                           dense (S, S) bool mask (what one must build without
                           window=)
  mha_ext dense            m(x, need_weights=False): no mask at all
  mha_ext layout           m(x, layout=lay, need_weights=False), lay =
                           mha_ext.layout.global_local(S, S, block,
                           global_blocks=1, width=2): Longformer's pattern, a
                           band of 5 blocks plus the first block row and
                           column (density about 10% at S 8192, block 128)

Each measurement runs in its own process (one library per process, no thread
pool of one disturbing the other), the rows alternate round by round, and
the table gives each row's median over the rounds (each round: the median of
3 calls after one warm-up).  The goals of the issue: causal+window at least
3.5x faster than causal (the projections are not reduced; the attention part
scales with S·w) and faster than torch given the dense mask; the layout at
about 10% density at least 4x faster than the dense call.

Memory: each child reports its peak RSS (ru_maxrss); the windowed call's
must stay far below one S x S float32 buffer (S² · 4 bytes) above the
inputs, as no (Sq, Sk) buffer exists with need_weights=False.

The machine may be shared: read the numbers with that caveat.
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WINDOW_ROWS = ("mha_ext causal", "mha_ext causal+window", "torch nn.MHA dense mask")
LAYOUT_ROWS = ("mha_ext dense", "mha_ext layout")
ROWS = WINDOW_ROWS + LAYOUT_ROWS


def bench_layout(S, block):
    """The benchmark's layout (see the module docstring)."""
    from mha_ext import layout
    return layout.global_local(S, S, block, global_blocks=1, width=2)


def child(row, S, E, H, w, threads, block=128):
    """One row in this process: prints {"time": median seconds, "rss": bytes}."""
    sys.path.insert(0, os.path.dirname(HERE))
    import numpy as np
    x = np.random.default_rng(0).standard_normal((1, S, E)).astype(np.float32)
    if row.startswith("mha_ext"):
        import mha_ext
        if threads:
            mha_ext.set_num_threads(threads)
        m = mha_ext.MultiHeadAttention(E, H, seed=0).eval()
        kw = dict(is_causal=row in WINDOW_ROWS, need_weights=False)
        if row.endswith("window"):
            kw["window"] = (w, 0)
        if row.endswith("layout"):
            kw["layout"] = bench_layout(S, block)

        def call():
            m(x, **kw)
    else:
        import torch
        if threads:
            torch.set_num_threads(threads)
        t = torch.nn.MultiheadAttention(E, H, batch_first=True).eval()
        i = torch.arange(S)
        blocked = (i[None, :] > i[:, None]) | (i[None, :] < i[:, None] - w)
        xt = torch.from_numpy(x)

        def call():
            with torch.no_grad():
                t(xt, xt, xt, attn_mask=blocked, need_weights=False)
    call()                                           # warm-up
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"time": statistics.median(times), "rss": rss}))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--S", type=int, default=8192)
    ap.add_argument("--E", type=int, default=512)
    ap.add_argument("--H", type=int, default=8)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--block", type=int, default=128, help="the layout's block size")
    ap.add_argument("--threads", type=int, default=0, help="0: each library's default")
    ap.add_argument("--rows", choices=("all", "window", "layout"), default="all")
    ap.add_argument("--child", choices=ROWS, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        child(a.child, a.S, a.E, a.H, a.window, a.threads, a.block)
        return
    rows = {"all": ROWS, "window": WINDOW_ROWS, "layout": LAYOUT_ROWS}[a.rows]
    res = {r: [] for r in rows}
    for _ in range(a.rounds):
        for r in rows:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", r, "--S", str(a.S),
                   "--E", str(a.E), "--H", str(a.H), "--window", str(a.window),
                   "--threads", str(a.threads), "--block", str(a.block)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            res[r].append(json.loads(out.strip().splitlines()[-1]))
    print(f"B 1, S {a.S}, E {a.E}, H {a.H}, float32, need_weights=False, {a.rounds} rounds "
          f"(medians; shared machine: indicative)")
    sq = a.S * a.S * 4
    for group, base_row, what in ((WINDOW_ROWS, "mha_ext causal", "causal"),
                                  (LAYOUT_ROWS, "mha_ext dense", "dense")):
        if group[0] not in res:
            continue
        if what == "causal":
            print(f"window ({a.window}, 0), causal:")
        else:
            sys.path.insert(0, os.path.dirname(HERE))
            lay = bench_layout(a.S, a.block)
            print(f"layout global_local(block {a.block}, global_blocks=1, width=2), "
                  f"density {lay.density:.3f}:")
        base = statistics.median(x["time"] for x in res[base_row])
        for r in group:
            t = statistics.median(x["time"] for x in res[r])
            rss = max(x["rss"] for x in res[r])
            print(f"  {r:26s} {t * 1e3:10.1f} ms   x{base / t:5.2f} vs {what:6s}   "
                  f"peak RSS {rss / 2**20:8.1f} MiB (S·S·4 = {sq / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
