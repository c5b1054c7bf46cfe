"""API.md §5: after Ctrl-C (KeyboardInterrupt, or any signal handler that
raises) the module and its caches stay usable.  An exception from a signal
handler may land between any two bytecodes; a lock taken in Python before
the `try:` that releases it (a KV cache's hold, editing()'s write lock)
stayed held for good when one landed in that gap: the cache refused every
later call and reset(), and other threads' calls waited forever.

Each storm runs in a child process under a timeout: SIGALRM every 0.3 ms,
its handler raising once per armed call.
"""
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import mha_ext
from _support import PKG_ROOT

STORM = textwrap.dedent("""
    import signal, sys, threading, time
    import numpy as np
    import mha_ext

    class Boom(Exception):
        pass

    armed = False
    def handler(sig, frame):
        global armed
        if armed:
            armed = False
            raise Boom()

    what = sys.argv[1]
    m = mha_ext.MultiHeadAttention(16, 4, seed=0).eval()
    x = np.ones((1, 1, 16), np.float32)
    cache = m.new_cache(1, 10 ** 6)
    signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, 0.0005, 0.0003)
    hits, t0 = 0, time.time()
    while time.time() - t0 < float(sys.argv[2]):
        try:
            armed = True
            if what == "cache":
                m(x, cache=cache, need_weights=False)
                if cache.length > 900000:
                    cache.reset()
            else:
                with m.editing():
                    pass
            armed = False
        except Boom:
            hits += 1
        except RuntimeError as e:   # the cache refuses: stuck
            print("stuck:", e)
            break
        except Exception:           # Boom inside NumPy's conversion of x
            hits += 1
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    assert hits > 100, hits
    if what == "cache":
        cache.reset()               # RuntimeError if the hold was left taken
        m(x, cache=cache)
    else:                           # another thread's call must not wait
        t = threading.Thread(target=lambda: m(x), daemon=True)
        t.start()
        t.join(10)
        assert not t.is_alive(), "another thread's call waits: the write lock is held"
    print("ok", hits)
""")


@pytest.mark.skipif(not hasattr(__import__("signal"), "setitimer"), reason="setitimer")
@pytest.mark.parametrize("what", ["cache", "editing"])
def test_an_exception_from_a_signal_handler_leaves_no_lock_held(what):
    run = subprocess.run([sys.executable, "-c", STORM, what, "4"], cwd=PKG_ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith("ok"), (run.stdout, run.stderr)


def test_threads_share_a_cross_attention_cache():
    # a cross cache is never extended: calls from many threads read it at
    # once (each got "one call at a time extends a cache", which it never is)
    import threading
    rng = np.random.default_rng(0)
    m = mha_ext.MultiHeadAttention(32, 4, seed=1).eval()
    memory = rng.standard_normal((2, 9, 32)).astype(np.float32)
    cache = m.cache_memory(memory)
    xs = [rng.standard_normal((2, 1, 32)).astype(np.float32) for _ in range(8)]
    want = [m(x, memory, memory)[0] for x in xs]
    errors, start = [], threading.Barrier(8)

    def work(i):
        try:
            start.wait(timeout=60)
            for _ in range(200):
                out = m(xs[i], cache=cache)[0]
                assert np.allclose(out, want[i], rtol=1e-5, atol=1e-6)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))
    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]
    assert cache.length == 9


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="signals as on Linux")
def test_ctrl_c_interrupts_a_long_backward():
    # the backward's attention runs one task per (batch, key head): with B
    # 1 and 4 heads each lasted seconds, and Ctrl-C was heard only between
    # them (2.8-5.3 s after the signal); now between blocks of queries
    from test_locking import INTERRUPT, run
    out = run(extra=INTERRUPT, code="""
        mha_ext.set_num_threads(2)
        m = mha_ext.MultiHeadAttention(256, 4, seed=0)
        rng = np.random.default_rng(0)
        def step(S):
            x = rng.standard_normal((1, S, 256)).astype(np.float32)
            ctx = m.forward_train(x, need_weights=False)
            return ctx, np.ones_like(ctx.output)
        # a length whose backward takes about 6 s here (~ S**2 at these lengths)
        S, t = 1024, 0.0
        while t < 1.0 and S < 16384:
            S *= 2
            ctx, g = step(S)
            start = time.monotonic()
            m.backward(ctx, g)
            t = time.monotonic() - start
        S = min(int(S * (6.0 / t) ** 0.5), 20000)
        ctx, g = step(S)
        lat = [latency(lambda: m.backward(ctx, g))]
        m.backward(*step(64))  # usable after it
        print(max(lat))
    """, timeout=300)
    assert float(out) < 1.0, f"KeyboardInterrupt {float(out):.2f} s after the signal"


def test_an_editing_block_dropped_without_leaving_releases_its_lock():
    # editing()'s manager is a C object (the lock taken and released in C);
    # entered and then dropped unexited (a generator abandoned, a frame
    # gone), the collector releases the hold: another thread's call runs
    import gc
    import threading
    m = mha_ext.MultiHeadAttention(16, 4, seed=0)
    x = np.ones((1, 2, 16), np.float32)
    block = m.editing()
    assert block.__enter__() is m
    with pytest.raises(RuntimeError, match="entered already"):
        block.__enter__()
    del block
    gc.collect()
    t = threading.Thread(target=m, args=(x,), daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive(), "the dropped block kept the write lock"
    with m.editing() as same:  # and the usual way still nests and leaves
        with m.editing():
            same.W_q.bias[...] = 0.0
    t = threading.Thread(target=m, args=(x,), daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive()


def test_a_cache_hold_dropped_without_leaving_is_given_back():
    # a KVCache's hold is a C context manager (_core._Holding); entered and
    # dropped unexited, it gives the cache back; entered twice it refuses;
    # it leaves alone a hold it no longer has (a fork child's new _busy)
    import gc
    m = mha_ext.MultiHeadAttention(16, 4, seed=0)
    cache = m.new_cache(1, 4)
    x = np.ones((1, 1, 16), np.float32)
    hold = cache._held()
    hold.__enter__()
    with pytest.raises(RuntimeError, match="entered already"):
        hold.__enter__()
    with pytest.raises(RuntimeError, match="one call at a time"):
        m(x, cache=cache)
    del hold
    gc.collect()
    m(x, cache=cache)
    assert cache.length == 1 and not cache._busy
    hold = cache._held()
    hold.__enter__()
    cache._busy = {}            # as _after_fork_in_child drops another thread's hold
    with cache._held():         # a new holder; the old hold's exit leaves it be
        assert hold.__exit__(None, None, None) is False
        with pytest.raises(RuntimeError, match="one call at a time"):
            m(x, cache=cache)
    m(x, cache=cache)
    assert cache.length == 2 and not cache._busy
