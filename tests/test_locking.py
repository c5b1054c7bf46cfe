"""The module's parameter lock (issue 11, defects 1, 2, 5, 6).

Every pattern runs in a fresh interpreter under a timeout: a hang is a
failure, never a blocked test run.  Forked children are waited for with a
deadline too, and killed when they hang.
"""
import subprocess
import sys
import textwrap

import pytest

from _support import PKG_ROOT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="fork and signals as on Linux")

PRELUDE = """
import os, signal, sys, threading, time
import numpy as np
import mha_ext

def wait_child(pid, limit):
    '''0 when the child exited cleanly within `limit` s, 1 when it hung (then
    it is killed), 2 when it failed.'''
    end = time.monotonic() + limit
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return 0 if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 else 2
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return 1

def finishes(fn, limit=20):
    '''fn() run in another thread ends within `limit` s.'''
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(limit)
    return not t.is_alive()
"""


def run(code, timeout=90, extra=""):
    """Run PRELUDE + extra + code in a new interpreter; its stdout.  Fails on
    a timeout (a hang) or a nonzero exit."""
    # a hang dumps every thread's Python stack to stderr and exits 1 shortly
    # before the deadline, so that the failure shows where it waited
    dump = (f"import faulthandler\n"
            f"faulthandler.dump_traceback_later({max(timeout - 10, 5)}, exit=True)\n")
    src = dump + PRELUDE + extra + textwrap.dedent(code)
    with subprocess.Popen([sys.executable, "-c", src], cwd=PKG_ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"the pattern hung (no exit within {timeout} s); output so far:\n"
                        f"{out}\n{err}")
    assert "Timeout (" not in err, f"the pattern hung; the threads' stacks:\n{out}\n{err}"
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{err}"
    return out


# ------------------------------------------------------------- defect 1

def test_forward_train_and_backward_inside_editing_keep_the_lock():
    """The writer's own training calls inside editing() do not release its
    write lock: another thread's call waits until the block is left, and
    afterwards the lock works (no hang of calls or load_state_dict)."""
    out = run("""
        m = mha_ext.MultiHeadAttention(16, 4, seed=0)
        x = np.ones((1, 3, 16), np.float32)
        with m.editing():
            ctx = m.forward_train(x)
            m.backward(ctx, np.ones_like(ctx.output))
            m.forward_train(x, params=m.state_dict())
            m(x)
            # still held: another thread's call waits for the block's end
            t = threading.Thread(target=m, args=(x,), daemon=True)
            t.start()
            t.join(0.5)
            assert t.is_alive(), "another thread's call ran in the middle of editing()"
        t.join(20)
        assert not t.is_alive(), "the waiting call did not run after editing()"
        assert finishes(lambda: m(x)), "a call from another thread hangs"
        assert finishes(lambda: m.load_state_dict(m.state_dict())), "load_state_dict hangs"
        with m.editing():
            pass
        print("ok")
    """)
    assert out.strip() == "ok"


def test_sgd_step_inside_editing_with_threads_serving_calls():
    out = run("""
        m = mha_ext.MultiHeadAttention(32, 4, seed=0)
        x = np.random.default_rng(0).standard_normal((2, 8, 32)).astype(np.float32)
        stop = threading.Event()
        served = [0, 0]
        def serve(i):
            while not stop.is_set():
                m(x)
                served[i] += 1
        threads = [threading.Thread(target=serve, args=(i,), daemon=True) for i in range(2)]
        for t in threads:
            t.start()
        for step in range(5):
            with m.editing():
                ctx = m.forward_train(x)
                g = m.backward(ctx, np.ones_like(ctx.output))
                for name, tensor in (("W_q", m.W_q), ("W_o", m.W_o)):
                    tensor.weight[...] -= 0.01 * g[name + ".weight"]
            time.sleep(0.02)
        stop.set()
        for t in threads:
            t.join(20)
            assert not t.is_alive(), "a serving thread hangs"
        print("ok", served)
    """)
    assert out.startswith("ok")


# ------------------------------------------------------------- defect 2

def test_fork_while_another_thread_is_mid_call():
    """Children forked while a thread computes can use the module."""
    out = run("""
        m = mha_ext.MultiHeadAttention(64, 4, seed=0)
        x = np.random.default_rng(0).standard_normal((4, 128, 64)).astype(np.float32)
        stop = threading.Event()
        def compute():
            while not stop.is_set():
                m(x)
        t = threading.Thread(target=compute, daemon=True)
        t.start()
        results = []
        for i in range(10):
            time.sleep(0.013 * (i + 1))
            pid = os.fork()
            if pid == 0:
                code = 3
                try:
                    m.load_state_dict(m.state_dict())
                    m(x[:1])
                    with m.editing():
                        m.W_q.bias[...] = 0
                    code = 0
                finally:
                    os._exit(code)
            results.append(wait_child(pid, 20))
        stop.set()
        t.join(20)
        print("hung", results.count(1), "failed", results.count(2))
    """, timeout=400)
    assert out.strip() == "hung 0 failed 0"


def test_multiprocessing_fork_pool_while_a_thread_computes():
    out = run("""
        import multiprocessing as mp
        m = mha_ext.MultiHeadAttention(64, 4, seed=0)
        x = np.random.default_rng(0).standard_normal((4, 128, 64)).astype(np.float32)

        def work(i):
            m.load_state_dict(m.state_dict())
            return float(m(x[:1])[0].sum())

        stop = threading.Event()
        def compute():
            while not stop.is_set():
                m(x)
        t = threading.Thread(target=compute, daemon=True)
        t.start()
        hung = 0
        for round in range(5):
            pool = mp.get_context("fork").Pool(2)
            try:
                pool.map_async(work, range(4)).get(timeout=30)
            except mp.TimeoutError:
                hung += 1
            finally:
                pool.terminate()
                pool.join()
        stop.set()
        t.join(20)
        print("hung", hung)
    """, timeout=400)
    assert out.strip() == "hung 0"


def test_fork_while_another_thread_holds_editing():
    out = run("""
        m = mha_ext.MultiHeadAttention(16, 4, seed=0)
        x = np.ones((1, 3, 16), np.float32)
        entered, leave = threading.Event(), threading.Event()
        def edit():
            with m.editing():
                m.W_q.bias[...] = 1
                entered.set()
                leave.wait()
        t = threading.Thread(target=edit, daemon=True)
        t.start()
        entered.wait()
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                m.load_state_dict(m.state_dict())
                m(x)
                with m.editing():
                    pass
                code = 0
            finally:
                os._exit(code)
        child = wait_child(pid, 20)
        leave.set()
        t.join(20)
        assert finishes(lambda: m(x))
        print("child", child)
    """)
    assert out.strip() == "child 0"


def test_fork_inside_editing_keeps_the_forking_threads_hold():
    """The forking thread's own write hold is still its own in the child:
    the block ends normally there, and the lock is free afterwards."""
    out = run("""
        m = mha_ext.MultiHeadAttention(16, 4, seed=0)
        x = np.ones((1, 3, 16), np.float32)
        block = m.editing()
        block.__enter__()
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                with m.editing():            # nested in the inherited hold
                    m(x)
                block.__exit__(None, None, None)
                code = 0 if finishes(lambda: m(x)) else 4
            finally:
                os._exit(code)
        block.__exit__(None, None, None)
        print("child", wait_child(pid, 20), finishes(lambda: m(x)))
    """)
    assert out.strip() == "child 0 True"


# ------------------------------------------------------------- defect 5

def test_editing_left_in_another_thread_releases_the_lock():
    out = run("""
        m = mha_ext.MultiHeadAttention(16, 4, seed=0)
        x = np.ones((1, 3, 16), np.float32)
        block = m.editing()
        t = threading.Thread(target=block.__enter__)
        t.start()
        t.join()
        block.__exit__(None, None, None)   # left in the main thread: no error
        assert finishes(lambda: m(x)), "another thread's call hangs"
        assert finishes(lambda: m.load_state_dict(m.state_dict())), "load_state_dict hangs"
        m(x)
        print("ok")
    """)
    assert out.strip() == "ok"


def test_a_new_thread_with_a_dead_writers_ident_still_waits():
    """The writer is a thread, not a reusable thread ident: a later thread
    (usually given the dead writer's ident by the C library) waits for the
    block to be left like any other."""
    out = run("""
        m = mha_ext.MultiHeadAttention(16, 4, seed=0)
        x = np.ones((1, 3, 16), np.float32)
        block = m.editing()
        idents = []
        def enter():
            idents.append(threading.get_ident())
            block.__enter__()
        t = threading.Thread(target=enter)
        t.start()
        t.join()                           # the writer is gone, the block open
        # new threads until one gets the writer's ident (glibc recycles the
        # stack, and so the ident, of an exited thread); that one calls
        def call():
            idents.append(threading.get_ident())
            if idents[-1] == idents[0] or len(idents) > 40:
                m(x)
        for attempt in range(40):
            time.sleep(0.05)               # the dead thread's stack is freed
            t = threading.Thread(target=call, daemon=True)
            t.start()
            t.join(0.5)
            if idents[-1] == idents[0] or t.is_alive():
                break
        print("waited", t.is_alive(), "same ident", idents[-1] == idents[0], flush=True)
        block.__exit__(None, None, None)
        t.join(20)
        print("done", not t.is_alive())
    """)
    assert out.startswith("waited True") and out.endswith("done True\n"), out


# ------------------------------------------------------------- defect 6

INTERRUPT = """
# Python installs its Ctrl-C handler only when SIGINT is not ignored at
# start-up; a test run started in the background of a non-interactive shell
# (or under nohup) passes SIGINT on ignored, and the signal would then be
# dropped: install the handler an interactive session has
signal.signal(signal.SIGINT, signal.default_int_handler)

def interrupt_after(delay, sent):
    def fire():
        time.sleep(delay)
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)
    threading.Thread(target=fire, daemon=True).start()

def latency(fn):
    '''Seconds from SIGINT to the KeyboardInterrupt out of fn().'''
    sent = []
    interrupt_after(0.5, sent)
    start = time.monotonic()
    try:
        fn()
    except KeyboardInterrupt:
        return time.monotonic() - sent[0]
    raise SystemExit(f"fn() returned after {time.monotonic() - start:.1f} s, "
                     f"before or despite the signal")
"""


def test_ctrl_c_interrupts_a_wait_for_the_lock():
    """A call (and load_state_dict, and editing()) waiting for a lock held
    elsewhere stops at Ctrl-C within a fraction of a second."""
    out = run(extra=INTERRUPT, code="""
        m = mha_ext.MultiHeadAttention(16, 4, seed=0)
        x = np.ones((1, 3, 16), np.float32)
        entered, leave = threading.Event(), threading.Event()
        def edit():
            with m.editing():
                entered.set()
                leave.wait()
        t = threading.Thread(target=edit, daemon=True)
        t.start()
        entered.wait()
        def enter_editing():
            with m.editing():
                pass
        lat = [latency(lambda: m(x)), latency(lambda: m.forward_train(x)),
               latency(lambda: m.load_state_dict(m.state_dict())), latency(enter_editing)]
        leave.set()
        t.join(20)
        # nothing is left held or queued: calls and writes go on
        assert finishes(lambda: m(x)) and finishes(lambda: m.load_state_dict(m.state_dict()))
        m(x)
        print(max(lat))
    """)
    assert float(out) < 1.0, f"KeyboardInterrupt {float(out):.2f} s after the signal"


def test_ctrl_c_interrupts_a_long_call():
    """Multi-second calls (the call, forward_train) stop at Ctrl-C within a
    fraction of a second: the core asks mha_forward_args.poll between tasks,
    which the binding passes on the main thread."""
    out = run(extra=INTERRUPT, code="""
        mha_ext.set_num_threads(2)
        m = mha_ext.MultiHeadAttention(512, 8, seed=0)
        rng = np.random.default_rng(0)
        # a length whose call takes about 8 s here: double the length until a
        # call takes 1 s (the attention, ~ S**2, then dominates), extrapolate
        S, t = 1024, 0.0
        while t < 1.0 and S < (1 << 16):
            S *= 2
            start = time.monotonic()
            m(rng.standard_normal((1, S, 512)).astype(np.float32), need_weights=False)
            t = time.monotonic() - start
        S = min(int(S * (8.0 / t) ** 0.5), 1 << 17)
        x = rng.standard_normal((1, S, 512)).astype(np.float32)
        lat = [latency(lambda: m(x, need_weights=False)),
               latency(lambda: m.forward_train(x, need_weights=False)),
               latency(lambda: m.forward_train(x, need_weights=False,
                                               save_projections=False))]
        print(max(lat))
    """, timeout=300)
    assert float(out) < 1.0, f"KeyboardInterrupt {float(out):.2f} s after the signal"


# ------------------------------------------- audit of 2026-12-02: fork, handlers

LONG = """
m = mha_ext.MultiHeadAttention(512, 8, seed=0).eval()
x = np.random.default_rng(0).standard_normal((4, 1024, 512)).astype(np.float32)
"""


@pytest.mark.parametrize("how", ["os.fork", "multiprocessing"])
def test_fork_from_a_thread_while_the_main_thread_computes(how):
    """os.fork holds the GIL, and the main thread's call takes it to poll for
    signals: the pool's fork handler used to wait for that call's pass, and
    both threads hung for good."""
    out = run("""
        import multiprocessing as mp
        want = m(x[:1], need_weights=False)[0]
        ctx = mp.get_context("fork")
        def child():
            m(x[:1], need_weights=False)
        codes = []
        def fork_later():
            time.sleep(0.05)
            if HOW == "os.fork":
                pid = os.fork()
                if pid == 0:
                    ok = np.array_equal(m(x[:1], need_weights=False)[0], want)
                    os._exit(0 if ok else 3)
                codes.append(wait_child(pid, 30))
            else:
                p = ctx.Process(target=child)
                p.start()
                p.join(30)
                codes.append(p.exitcode)
        for _ in range(3):
            t = threading.Thread(target=fork_later)
            t.start()
            for _ in range(3):
                m(x, need_weights=False)
            t.join(60)
        print("codes", codes)
    """.replace("HOW", repr(how)), timeout=240, extra=LONG)
    assert out.strip() == "codes [0, 0, 0]"


def test_fork_in_a_signal_handler_during_a_call():
    """The handler forks inside the main thread's own call: the parent's call
    ends right; in the child that call's pass lost its workers, and it says
    so (RuntimeError) instead of returning part of a result."""
    out = run("""
        want = m(x, need_weights=False)[0]
        mha_ext.set_num_threads(2)
        pids = []
        def handler(sig, frame):
            pid = os.fork()
            if pid == 0:
                pids.append(0)
            else:
                pids.append(pid)
        signal.signal(signal.SIGALRM, handler)
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        while not pids:                           # the calls the handler forks inside
            try:
                got = m(x, need_weights=False)[0]
            except RuntimeError as exc:
                if pids == [0]:                   # the child
                    ok = "forked inside the call" in str(exc)
                    ok = ok and np.array_equal(m(x[:1], need_weights=False)[0], want[:1])
                    os._exit(0 if ok else 3)
                raise
        if pids == [0]:                           # a child whose call was not cut
            os._exit(0 if np.array_equal(got, want) else 3)
        print("parent", np.array_equal(got, want), "child", wait_child(pids[0], 60))
    """, timeout=240, extra=LONG)
    assert out.strip() == "parent True child 0"


def test_a_signal_handler_cannot_change_the_parameters_inside_a_call():
    """A write from a handler that runs inside the call would wait for the
    call, which waits for the handler: a RuntimeError at once.  A handler
    that runs between two calls may write: the timer repeats until one
    lands inside a call."""
    out = run("""
        sd = m.state_dict()
        seen = []
        def editing():
            with m.editing():
                pass
        def handler(sig, frame):
            r = []
            for write in (lambda: m.load_state_dict(sd), editing):
                try:
                    write()
                    r.append("wrote")
                except RuntimeError as exc:
                    r.append("inside one of its calls" in str(exc))
            seen.append(r)
        signal.signal(signal.SIGALRM, handler)
        signal.setitimer(signal.ITIMER_REAL, 0.05, 0.05)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 60 and all(r == ["wrote", "wrote"] for r in seen):
            m(x, need_weights=False)
        signal.setitimer(signal.ITIMER_REAL, 0)
        print([r for r in seen if r != ["wrote", "wrote"]][:1])
    """, timeout=120, extra=LONG)
    assert out.strip() == "[[True, True]]"


def test_a_signal_handlers_call_does_not_queue_behind_a_waiting_writer():
    """A thread waits in editing() for the main thread's call; the handler
    that runs inside that call calls the module again: the nested call reads
    at once (the writer waits for the outer call, not the other way)."""
    out = run("""
        small = x[:1, :8]
        want = m(small, need_weights=False)[0]
        got = []
        def handler(sig, frame):
            got.append(np.array_equal(m(small, need_weights=False)[0], want))
        def writer():
            time.sleep(0.02)
            with m.editing():
                pass
        signal.signal(signal.SIGALRM, handler)
        for _ in range(3):
            w = threading.Thread(target=writer)
            w.start()
            signal.setitimer(signal.ITIMER_REAL, 0.06)
            for _ in range(3):
                m(x, need_weights=False)
            w.join(60)
        print(got.count(True) >= 1, all(got))
    """, timeout=180, extra=LONG)
    assert out.strip() == "True True"


def test_a_cache_another_thread_was_extending_is_free_in_a_fork_child():
    out = run("""
        cache = m.new_cache(4, 2048)
        t = threading.Thread(target=lambda: m(x, cache=cache, need_weights=False))
        t.start()
        time.sleep(0.02)                          # inside that call
        pid = os.fork()
        if pid == 0:
            ok = cache.reset().length == 0
            ok = ok and m(x[:, :3], cache=cache, need_weights=False)[0].shape == (4, 3, 512)
            os._exit(0 if ok and cache.length == 3 else 3)
        t.join(60)
        print(cache.length, wait_child(pid, 60))
    """, timeout=180, extra=LONG)
    assert out.strip() == "1024 0"
