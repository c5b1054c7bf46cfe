"""The output cache (docs/API.md §5): result arrays of 1 MiB or more reuse the
memory of freed ones, which must never show through (stale values), bound
its size as documented, and stay ordinary NumPy arrays."""
import os
import pickle
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import mha_ext
from _support import PKG_ROOT

MIB = 1 << 20

needs_cache = pytest.mark.skipif(
    mha_ext.memory_info()["limit_bytes"] == 0,
    reason="the output cache is off (MHA_EXT_CACHE_MB=0 or a sanitizer build, by design)")


def spoil(*arrays):
    """Write garbage into arrays about to be freed: a reuse that leaked it
    into a result would show as NaN or 1e30."""
    for i, a in enumerate(arrays):
        if a is not None:
            a[...] = np.nan if i % 2 == 0 else 1e30


def same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert np.array_equal(a, b, equal_nan=True), float(np.nanmax(np.abs(a - b)))


@needs_cache
def test_a_freed_result_is_reused_and_its_old_values_never_show():
    m = mha_ext.MultiHeadAttention(512, 8, seed=0)
    x = np.random.default_rng(0).standard_normal((8, 128, 512)).astype(np.float32)
    mha_ext.release_memory()
    o, w = m(x, x, x, is_causal=True)  # weights (8, 8, 128, 128): 4 MiB, zeros past the diagonal
    assert w.nbytes >= MIB and o.nbytes >= MIB
    want_o, want_w = o.copy(), w.copy()
    addresses = {o.ctypes.data, w.ctypes.data}
    spoil(o, w)
    del o, w
    info = mha_ext.memory_info()
    assert info["cached_blocks"] >= 2 and info["cached_bytes"] >= 6 * MIB
    o, w = m(x, x, x, is_causal=True)
    assert {o.ctypes.data, w.ctypes.data} == addresses  # the same memory again
    assert mha_ext.memory_info()["cached_bytes"] < info["cached_bytes"]
    same(o, want_o)
    same(w, want_w)
    assert o.flags.owndata and w.flags.owndata and o.flags.writeable


@needs_cache
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_training_results_from_reused_memory(dtype):
    """forward_train's saved tensors and backward's gradients, made from
    spoiled freed blocks, hold the bits of fresh memory."""
    m = mha_ext.MultiHeadAttention(256, 4, dtype=dtype, seed=1)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 160, 256)).astype(dtype)
    g = rng.standard_normal((4, 160, 256)).astype(dtype)
    mask = np.zeros((160, 160), bool)
    mask[:, 150:] = True  # key padding-like: blocked keys read as zeros in the weights

    def step():
        ctx = m.forward_train(x, x, x, attn_mask=mask, need_weights=True)
        grads = m.backward(ctx, g, np.ones_like(ctx.weights))
        return ctx, grads

    mha_ext.release_memory()
    ctx, grads = step()
    want = [ctx.output.copy(), ctx.weights.copy()] + [grads[k].copy() for k in sorted(grads)]
    spoil(ctx.output, ctx.weights, *grads.values())
    del ctx, grads
    assert mha_ext.memory_info()["cached_blocks"] > 0
    for _ in range(2):
        ctx, grads = step()
        got = [ctx.output, ctx.weights] + [grads[k] for k in sorted(grads)]
        for a, b in zip(got, want):
            same(a, b)
        spoil(ctx.output, ctx.weights, *grads.values())
        del ctx, grads, got


@needs_cache
def test_sdpa_results_from_reused_memory():
    """The functional twin's output, and its core's weights and gradients."""
    from mha_ext import _core
    rng = np.random.default_rng(2)
    q, k, v, go = (rng.standard_normal((2, 4, 256, 64)).astype(np.float32) for _ in range(4))

    def call():
        out = mha_ext.scaled_dot_product_attention(q, k, v, is_causal=True)
        o2, w = _core._sdpa(q, k, v, is_causal=True, need_weights=True)
        grads = _core._sdpa_backward(q, k, v, go, is_causal=True)
        return [out, o2, w, *grads]

    mha_ext.release_memory()
    first = call()
    want = [a.copy() for a in first]
    spoil(*first)
    del first
    assert mha_ext.memory_info()["cached_blocks"] > 0
    for a, b in zip(call(), want):
        same(a, b)


@needs_cache
def test_release_memory_returns_what_was_cached():
    m = mha_ext.MultiHeadAttention(512, 8, seed=0)
    x = np.ones((8, 128, 512), np.float32)
    mha_ext.release_memory()
    o, w = m(x, x, x)
    del o, w
    cached = mha_ext.memory_info()["cached_bytes"]
    assert cached >= 6 * MIB
    assert mha_ext.release_memory() == cached
    assert mha_ext.memory_info() == {"cached_bytes": 0, "cached_blocks": 0,
                                     "limit_bytes": mha_ext.memory_info()["limit_bytes"]}
    assert mha_ext.release_memory() == 0


def test_small_results_use_numpy_memory():
    """Below 1 MiB nothing is cached (NumPy's allocator reuses those)."""
    m = mha_ext.MultiHeadAttention(64, 4, seed=0)
    x = np.ones((2, 10, 64), np.float32)
    mha_ext.release_memory()
    for _ in range(3):
        o, w = m(x, x, x)
        del o, w
    assert mha_ext.memory_info()["cached_blocks"] == 0


@needs_cache
def test_cached_arrays_are_ordinary_arrays():
    """They outlive the module, pickle, and resize in place (through the
    handler's realloc) keeping their values."""
    m = mha_ext.MultiHeadAttention(512, 8, seed=0)
    x = np.random.default_rng(3).standard_normal((8, 128, 512)).astype(np.float32)
    o, _ = m(x, x, x, need_weights=False)
    del m
    want = o.copy()
    same(pickle.loads(pickle.dumps(o)), want)
    flat = o.reshape(-1).copy()  # a cached-size array of its own to resize
    o.resize((o.size * 3,), refcheck=False)
    same(o[:flat.size], flat)
    assert not o[flat.size:].any()  # resize fills the new part with zeros
    o.resize((flat.size // 4,), refcheck=False)
    same(o, flat[:flat.size // 4])
    del o


def test_threads_sharing_the_cache_get_their_own_results():
    m = mha_ext.MultiHeadAttention(256, 4, seed=0)
    rng = np.random.default_rng(4)
    xs = [rng.standard_normal((b, 128, 256)).astype(np.float32) for b in (2, 3, 5, 8)]
    want = [m(x, x, x) for x in xs]
    errors = []

    def worker(i):
        try:
            for n in range(12):
                x = xs[(i + n) % len(xs)]
                o, w = m(x, x, x)
                same(o, want[(i + n) % len(xs)][0])
                same(w, want[(i + n) % len(xs)][1])
                spoil(o, w)
                del o, w
        except AssertionError as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors[0]


def run(code, env_mb, timeout=120):
    env = dict(os.environ)
    if env_mb is None:
        env.pop("MHA_EXT_CACHE_MB", None)
    else:
        env["MHA_EXT_CACHE_MB"] = env_mb
    src = ("import faulthandler\n"
           f"faulthandler.dump_traceback_later({timeout - 10}, exit=True)\n"
           "import os, sys, threading, time\nimport numpy as np\nimport mha_ext\n"
           + textwrap.dedent(code))
    r = subprocess.run([sys.executable, "-c", src], cwd=PKG_ROOT, env=env, capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


LIMIT_PROBE = """
    m = mha_ext.MultiHeadAttention(512, 8, seed=0)
    x = np.ones((8, 128, 512), np.float32)
    for _ in range(3):
        o, w = m(x, x, x)   # 2 MiB and 4 MiB
        del o, w
    i = mha_ext.memory_info()
    print(i["limit_bytes"], i["cached_bytes"], i["cached_blocks"])
"""


@needs_cache
@pytest.mark.parametrize("env_mb, limit", [("0", 0), ("3", 3 * MIB), ("64", 64 * MIB)])
def test_the_limit_follows_mha_ext_cache_mb(env_mb, limit):
    got_limit, cached, blocks = map(int, run(LIMIT_PROBE, env_mb).split())
    assert got_limit == limit
    assert cached <= limit
    if limit == 0:
        assert cached == 0 and blocks == 0
    elif limit == 3 * MIB:  # the 4 MiB weights do not fit; the 2 MiB output does
        assert blocks == 1 and 2 * MIB <= cached <= 3 * MIB
    else:
        assert blocks == 2


@needs_cache
@pytest.mark.parametrize("env_mb", ["64 ", " 64\n", "+64", "\t064", "\f64\r", "\v64"])
def test_mha_ext_cache_mb_is_read_with_blanks_around_it(env_mb):
    """as MHA_EXT_NUM_THREADS is: a blank a shell script leaves is no reason
    to fall back on the default silently"""
    assert int(run(LIMIT_PROBE, env_mb).split()[0]) == 64 * MIB


@needs_cache
@pytest.mark.parametrize("env_mb", [str(2**44), str(2**64), "9" * 40])
def test_an_mha_ext_cache_mb_past_what_memory_can_count_means_no_limit(env_mb):
    """a limit too large to count in bytes is no limit, not the default's
    1 GiB (as MHA_EXT_NUM_THREADS past its range counts as its cap)"""
    assert int(run(LIMIT_PROBE, env_mb).split()[0]) == 2**64 - 1


@needs_cache
@pytest.mark.parametrize("env_mb", ["junk", "-5", " -5", "-0", "1.5", "", " ", "+-5", "64 MB",
                                    "\r-5", "\v-5", "\f-5", " \r-5"])
def test_an_invalid_mha_ext_cache_mb_is_ignored(env_mb):
    default = int(run(LIMIT_PROBE, None).split()[0])
    assert default > 0
    assert int(run(LIMIT_PROBE, env_mb).split()[0]) == default


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork as on Linux")
def test_fork_while_another_thread_allocates():
    """The cache's lock is held for a moment at a time by a thread that calls
    and frees in a loop; forked children still call and exit (no hang)."""
    out = run("""
        m = mha_ext.MultiHeadAttention(512, 8, seed=0)
        x = np.ones((8, 128, 512), np.float32)
        want = m(x, x, x)[0].copy()
        stop = False
        def loop():
            while not stop:
                o, w = m(x, x, x)
                del o, w
        t = threading.Thread(target=loop, daemon=True)
        t.start()
        bad = 0
        for _ in range(8):
            time.sleep(0.02)
            pid = os.fork()
            if pid == 0:
                o, w = m(x, x, x)
                os._exit(0 if np.array_equal(o, want) else 3)
            end = time.monotonic() + 60
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    bad += not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0)
                    break
                if time.monotonic() > end:
                    os.kill(pid, 9)
                    os.waitpid(pid, 0)
                    bad += 1
                    break
                time.sleep(0.01)
        stop = True
        t.join(30)
        print(bad)
    """, None)
    assert out.split() == ["0"]


@needs_cache
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise as on Linux")
def test_a_reclaimed_header_page_neither_leaks_nor_misleads_realloc():
    # A cached block of 32 MiB or more is MADV_FREE: the kernel may take its
    # pages back, its header's too, which then reads zeros.  The length was
    # read back from that header: 0, so the block leaked (a 0-byte slot
    # release_memory could not unmap) and ndarray.resize copied the new
    # size out of the old mapping (SIGSEGV).  The reclaim is simulated with
    # MADV_DONTNEED on the header's page (what reclaim gives: zeros).
    script = textwrap.dedent("""
        import ctypes, os
        import numpy as np
        import mha_ext
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        PAGE = os.sysconf("SC_PAGE_SIZE")
        m = mha_ext.MultiHeadAttention(64, 4, seed=0).eval()
        x = np.random.default_rng(0).standard_normal((1, 2048, 64)).astype(np.float32)
        mha_ext.release_memory()
        for i in range(3):
            _, w = m(x)                                # weights: 64 MiB
            raw = w.ctypes.data - 64                   # the block's header
            del w                                      # cached, MADV_FREE
            assert libc.madvise(ctypes.c_void_p(raw & ~(PAGE - 1)), PAGE, 4) == 0
            _, w = m(x)                                # the same block again
            assert w.ctypes.data - 64 == raw
            del w
            info = mha_ext.memory_info()
            assert info["cached_blocks"] == 1 and info["cached_bytes"] >= 64 << 20, info
            assert mha_ext.release_memory() == info["cached_bytes"]
        _, w = m(x)
        raw = w.ctypes.data - 64
        del w
        assert libc.madvise(ctypes.c_void_p(raw & ~(PAGE - 1)), PAGE, 4) == 0
        _, w = m(x)
        w[...] = 1.5
        w.resize((2, 4, 2048, 2048), refcheck=False)   # realloc: 64 -> 128 MiB
        assert float(w[0].min()) == float(w[0].max()) == 1.5
        print("ok")
    """)
    env = dict(os.environ, PYTHONPATH=PKG_ROOT, MHA_EXT_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=240, env=env)
    assert run.returncode == 0 and run.stdout.strip() == "ok", (run.returncode, run.stderr)


@needs_cache
@pytest.mark.parametrize("env_mb", ["8796093022208", "17592186044415"])
def test_a_limit_past_2_63_bytes_is_reported_as_it_is_and_keeps_p(env_mb):
    # 2**43 MiB and just under 2**44: the limit (2**63 bytes and more) came
    # back as a negative int, which also made forward_train stop keeping P
    # (keep_level compares against it)
    code = """
        from types import SimpleNamespace
        from mha_ext import _calls
        m = mha_ext.MultiHeadAttention(16, 8, seed=0)
        x = np.ones((2, 16, 16), np.float32)   # P: 2x the projections, a few KiB
        print(mha_ext.memory_info()["limit_bytes"],
              _calls.keep_level(m, SimpleNamespace(query=x, key=x), True))
    """
    limit, level = map(int, run(code, env_mb).split())
    assert limit == int(env_mb) * MIB
    assert level == 2                           # P kept, as under any limit that holds it
