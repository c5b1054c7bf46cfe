"""Valgrind memcheck smoke run of the extension (not collected by pytest).

    python tests/valgrind_smoke.py            # runs valgrind on itself, checks the log

Runs a mixed workload of good and bad calls (--child) under
`valgrind --tool=memcheck` with PYTHONMALLOC=malloc (so CPython's own
allocations are visible to valgrind as plain mallocs), then reads the log.
Fails on any invalid read or write, on any other memcheck error whose stack
passes through our code (mha_ext/_core*.so: src/ and the binding), and on any
definitely-lost block allocated by our code.  CPython and NumPy keep some
memory until exit by design ("still reachable" / "possibly lost"): not ours,
not counted.
"""
import os
import re
import subprocess
import sys
import tempfile

# the binding is mha_ext/_core*.c (_core.c, _core_args.c, _core_parse.c, _core_calls.c, ...)
OURS = re.compile(r"_core\.cpython|_core\.so|\bmha_\w+|src/\w+\.[ch]|\b_core\w*\.[ch]\b")


def workload():
    import threading

    import numpy as np

    import mha_ext

    mha_ext.set_num_threads(2)
    rng = np.random.default_rng(0)
    shapes = [(2, 5, 7), (1, 33, 40), (3, 1, 130), (0, 4, 4), (2, 0, 3), (2, 3, 0)]
    for dtype in ("float32", "float64"):
        m = mha_ext.MultiHeadAttention(24, 4, dropout=0.25, dtype=dtype, seed=1)
        mk = mha_ext.MultiHeadAttention(8, 2, kdim=5, vdim=3, bias=False, dtype=dtype, seed=2)
        for B, Sq, Sk in shapes:
            x = rng.standard_normal((B, Sq, 24)).astype(dtype)
            kv = rng.standard_normal((B, Sk, 24))
            causal = np.triu(np.ones((Sq, Sk), bool), 1)
            pad = rng.random((B, Sk)) < 0.3
            for training in (True, False):
                m.train(training)
                m(x, kv, kv, attn_mask=causal, key_padding_mask=pad)
                m(x, kv, need_weights=False, is_causal=True, masked_rows="zero")
                m(x[:, ::-1], kv.astype(">f8"), mask=causal[None, None], average_weights=True)
                m(x, kv, attn_mask=np.where(causal, -np.inf, 0.0), need_weights=False)
            mk(rng.standard_normal((B, Sq, 8)), rng.standard_normal((B, Sk, 5)),
               rng.standard_normal((B, Sk, 3)), key_padding_mask=pad.astype(np.float32))
        x = rng.standard_normal((2, 6, 24)).astype(dtype)
        for bad in (dict(mask=np.full((6, 6), 2)), dict(attn_mask=np.zeros((6, 5))),
                    dict(key_padding_mask=np.zeros((2, 6), int))):
            try:
                m(x, **bad)
            except (TypeError, ValueError):
                pass
        for bad in (x.astype(complex), x[..., :3], np.broadcast_to(x[:1, :1], (1, 2 ** 36, 24))):
            try:
                m(bad)
            except (TypeError, ValueError, MemoryError):
                pass
        sd = m.state_dict()
        m.load_state_dict(sd)
        try:
            m.load_state_dict(dict(sd, **{"W_q.weight": np.zeros((3, 3))}))
        except ValueError:
            pass
        with m.editing():
            m.W_q.weight[...] *= 0.5
            m(x)  # the writer calls the module inside its block
        # training calls (saved projections, recomputation, explicit params)
        for save in (True, False):
            ctx = m.forward_train(x, attn_mask=np.triu(np.ones((6, 6), bool), 1),
                                  save_projections=save, dropout=0.3)
            m.backward(ctx, np.ones_like(ctx.output), np.ones_like(ctx.weights))
        m.backward(m.forward_train(x, params=sd), np.ones((2, 6, 24)))
        for bad in (dict(grad_output=np.ones((2, 5, 24))), dict(grad_weights=np.ones(3))):
            try:
                m.backward(ctx, **{"grad_output": np.ones((2, 6, 24)), **bad})
            except (TypeError, ValueError):
                pass
        # issue 14: block-sparse layouts (skipped runs of keys) and head masks,
        # forward (both paths), backward, the SDPA twin; a layout that does not fit
        lay = mha_ext.layout.bigbird(130, 130, (48, 20), heads=4, random_blocks=1)
        xl = rng.standard_normal((1, 130, 24)).astype(dtype)
        m(xl, layout=lay, is_causal=True)
        m(xl, layout=lay, need_weights=False, head_mask=[1.0, 0.0, 0.5, 1.0])
        ctx = m.forward_train(xl, layout=lay, head_mask=[1.0, 0.0, 0.5, 1.0], dropout=0.2)
        m.backward(ctx, np.ones_like(ctx.output), head_mask_grad=True)
        q4 = rng.standard_normal((1, 4, 130, 6)).astype(dtype)
        mha_ext.scaled_dot_product_attention(q4, q4, q4, layout=lay, head_mask=[1, 0, 1, 2])
        # decode-shaped SDPA: one query a head, keys transposed a panel at a
        # time into the thread's scratch and read there, small heads grouped
        for S in (1, 5, 17, 70):
            qd = rng.standard_normal((70, 4, 1, 6)).astype(dtype)
            kd = rng.standard_normal((70, 4, S, 6)).astype(dtype)
            mha_ext.scaled_dot_product_attention(qd, kd, kd)
            mha_ext.scaled_dot_product_attention(qd[:, :, :, :5], kd[:, :, :, :5], kd,
                                                 is_causal="lower_right")
        mha_ext._core._sdpa_backward(q4, q4, q4, q4, layout=(lay.fitted(1, 4, 130, 130), 48, 20),
                                     head_mask=np.ones((1, 4)))
        try:
            m(x, layout=lay)
        except ValueError:
            pass
        m.eval()
        # issue 15: grouped-query attention, its backward, and a key/value cache
        g = mha_ext.MultiHeadAttention(24, 4, n_kv_heads=2, dtype=dtype, seed=3).eval()
        gx = rng.standard_normal((2, 9, 24)).astype(dtype)
        g.backward(g.forward_train(gx, is_causal=True), np.ones((2, 9, 24)))
        cache = g.new_cache(2, 9)
        for n in (4, 1, 1, 3):
            L = cache.length
            g(gx[:, L:L + n], cache=cache, key_padding_mask=np.zeros((2, L + n), bool))
        try:
            g(gx[:, :1], cache=cache)  # full: refused
        except ValueError:
            pass
        g(gx[:, :2], cache=g.cache_memory(gx), need_weights=False)

        def work():
            for _ in range(3):
                m(x)
                m(x, need_weights=False)

        threads = [threading.Thread(target=work) for _ in range(3)]
        for t in threads:
            t.start()
        m.load_state_dict(sd)
        for t in threads:
            t.join()
    try:
        mha_ext.MultiHeadAttention(2 ** 24, 1)
    except MemoryError:
        pass
    print("workload done")


def parse(log):
    """{kind: count} of memcheck errors, and the definitely-lost records
    (bytes, blocks, from our code?)."""
    text = open(log).read()
    records = re.split(r"\n==\d+== \n", text)
    errors, ours, lost = {}, [], []
    for rec in records:
        lines = [re.sub(r"^==\d+== ?", "", ln) for ln in rec.strip().splitlines()]
        if not lines:
            continue
        head = lines[0]
        m = re.match(r"([\d,]+) (?:\([\d,]+ direct, [\d,]+ indirect\) )?bytes in ([\d,]+) blocks "
                     r"are definitely lost", head)
        if m:
            mine = any(OURS.search(ln) for ln in lines[1:])
            lost.append((int(m.group(1).replace(",", "")), int(m.group(2).replace(",", "")), mine))
            continue
        for kind in ("Invalid read", "Invalid write", "Invalid free", "Mismatched free",
                     "Conditional jump", "Use of uninitialised", "Syscall param",
                     "Source and destination overlap", "Argument 'size'"):
            if head.startswith(kind):
                errors[kind] = errors.get(kind, 0) + 1
                if any(OURS.search(ln) for ln in lines[1:]):
                    ours.append(rec.strip())
                break
    summary = re.findall(r"ERROR SUMMARY: (\d+) errors", text)
    return errors, ours, lost, int(summary[-1]) if summary else None


def main():
    if "--child" in sys.argv:
        workload()
        return 0
    log = os.path.join(tempfile.mkdtemp(prefix="mha-valgrind-"), "memcheck.log")
    env = dict(os.environ, PYTHONMALLOC="malloc")
    env.pop("LD_PRELOAD", None)
    supp = os.path.join(os.path.dirname(os.path.abspath(__file__)), "valgrind.supp")
    cmd = ["valgrind", "--tool=memcheck", "--leak-check=full", "--show-leak-kinds=definite",
           "--errors-for-leak-kinds=definite", f"--suppressions={supp}", "--num-callers=40", f"--log-file={log}", sys.executable, os.path.abspath(__file__),
           "--child"]
    print(" ".join(cmd), flush=True)
    run = subprocess.run(cmd, env=env, capture_output=True, text=True)
    sys.stdout.write(run.stdout)
    if run.returncode != 0 or "workload done" not in run.stdout:
        sys.stdout.write(run.stderr)
        sys.stdout.write(open(log).read()[-20000:])
        print(f"valgrind: the workload failed (exit {run.returncode})")
        return 1
    errors, ours, lost, total = parse(log)
    invalid = errors.get("Invalid read", 0) + errors.get("Invalid write", 0)
    lost_ours = [x for x in lost if x[2]]
    print(f"valgrind: memcheck errors by kind (all code, after tests/valgrind.supp): {errors or 'none'}; "
          f"ERROR SUMMARY {total}")
    print(f"valgrind: invalid reads or writes: {invalid}")
    print(f"valgrind: errors through our code: {len(ours)}")
    print(f"valgrind: definitely lost: {sum(b for _, b, _ in lost)} blocks in total, "
          f"{sum(b for _, b, m in lost if m)} blocks ({sum(n for n, _, m in lost if m)} bytes) "
          f"from our code")
    for rec in ours + [f"definitely lost record from our code: {x}" for x in lost_ours]:
        print(rec)
    if invalid or ours or lost_ours:
        print(f"valgrind: FAILED (log: {log})")
        return 1
    print("valgrind: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
