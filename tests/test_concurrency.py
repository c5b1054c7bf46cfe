"""API.md §5: one module called from many Python threads at once gives each
call the result it would get alone, and rewriting the weights while others
compute never crashes: every result is the result of either the old or the
new weights.

How (README, "Threads"): a call holds the module's read lock while it
computes (GIL released); load_state_dict() and in-place writes made inside
``with mha.editing():`` hold the write lock, so a call sees all old or all
new parameters.  In-place writes outside editing() are not synchronised with
concurrent calls (as with torch): they cannot crash, but a concurrent call
may see a mix.

Legend: B batch, Sq/Sk lengths, E = d_model, H = n_heads.
"""
import threading
import time

import numpy as np

import mha_ext

N_THREADS = 8
N_CALLS = 200
MIN_WRITES = 20
E, H = 64, 4


def same(a, b):
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and np.array_equal(a, b, equal_nan=True)


def run_threads(target, n):
    errors = []
    start = threading.Barrier(n)

    def wrap(i):
        try:
            start.wait(timeout=60)
            target(i)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=wrap, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]


def inputs(i):
    """Thread i's call: its own shapes, masks and options."""
    rng = np.random.default_rng(100 + i)
    B, Sq, Sk = 1 + i % 3, 5 + 7 * i, 3 + 11 * (i % 4)
    x = rng.standard_normal((B, Sq, E)).astype(np.float32)
    kv = rng.standard_normal((B, Sk, E)).astype(np.float32)
    kw = dict(need_weights=i % 2 == 0, is_causal=i % 3 == 0)
    if i % 4 == 1:
        kw["key_padding_mask"] = rng.random((B, Sk)) < 0.3
    return (x, kv), kw


def test_threads_get_the_serial_results():
    m = mha_ext.MultiHeadAttention(E, H, seed=11).eval()
    calls = [inputs(i) for i in range(N_THREADS)]
    serial = [m(*args, **kw) for args, kw in calls]
    bad = []

    def work(i):
        args, kw = calls[i]
        for n in range(N_CALLS):
            out, w = m(*args, **kw)
            if not (same(out, serial[i][0]) and same(w, serial[i][1])):
                bad.append((i, n))

    run_threads(work, N_THREADS)
    assert not bad, f"{len(bad)} of {N_THREADS * N_CALLS} threaded calls differ, e.g. {bad[:3]}"


def test_threads_with_changing_thread_count():
    m = mha_ext.MultiHeadAttention(E, H, seed=12).eval()
    calls = [inputs(i) for i in range(4)]
    serial = [m(*args, **kw) for args, kw in calls]
    saved = mha_ext.get_num_threads()
    stop = threading.Event()
    bad = []

    def work(i):
        if i == 4:
            n = 0
            while not stop.is_set():
                mha_ext.set_num_threads(1 + n % 3)
                n += 1
            return
        args, kw = calls[i]
        for _ in range(N_CALLS // 2):
            out, w = m(*args, **kw)
            bad.extend([i] if not (same(out, serial[i][0]) and same(w, serial[i][1])) else [])
        if i == 0:
            stop.set()

    try:
        run_threads(work, 5)
    finally:
        stop.set()
        mha_ext.set_num_threads(saved)
    assert not bad


def _two_states(m):
    rng = np.random.default_rng(3)
    old = m.state_dict()
    new = {k: (rng.standard_normal(v.shape) * 0.2).astype(v.dtype) for k, v in old.items()}
    return old, new


def _old_or_new(m, writer):
    """Readers compute while `writer(m, state, stop)` swaps between two
    states; every result must equal the old or the new weights' result."""
    old, new = _two_states(m)
    calls = [inputs(i) for i in range(N_THREADS - 1)]
    m.load_state_dict(new)
    want_new = [m(*args, **kw) for args, kw in calls]
    m.load_state_dict(old)
    want_old = [m(*args, **kw) for args, kw in calls]
    stop = threading.Event()
    bad, counts = [], {"old": 0, "new": 0, "writes": 0}
    lock = threading.Lock()

    def work(i):
        if i == N_THREADS - 1:
            n = 0
            while not stop.is_set():
                writer(m, new if n % 2 == 0 else old)
                n += 1
                counts["writes"] = n
            return
        args, kw = calls[i]
        deadline = time.monotonic() + 60
        n = 0
        # N_CALLS calls each, and on until the writer has written MIN_WRITES times
        while n < N_CALLS or (counts["writes"] < MIN_WRITES and time.monotonic() < deadline):
            n += 1
            out, w = m(*args, **kw)
            which = ("old" if same(out, want_old[i][0]) and same(w, want_old[i][1]) else
                     "new" if same(out, want_new[i][0]) and same(w, want_new[i][1]) else None)
            with lock:
                if which is None:
                    bad.append(i)
                else:
                    counts[which] += 1

    def readers_then_stop(i):
        try:
            work(i)
        finally:
            if i == 0:
                stop.set()

    try:
        run_threads(readers_then_stop, N_THREADS)
    finally:
        stop.set()
    assert not bad, f"{len(bad)} results match neither the old nor the new weights"
    assert counts["writes"] >= MIN_WRITES, counts
    assert counts["old"] > 0 and counts["new"] > 0, counts
    return counts


def test_load_state_dict_while_computing():
    m = mha_ext.MultiHeadAttention(E, H, seed=13).eval()
    counts = _old_or_new(m, lambda m, state: m.load_state_dict(state))
    print(f"\nload_state_dict while computing: {counts}")


def test_in_place_writes_under_editing_while_computing():
    m = mha_ext.MultiHeadAttention(E, H, seed=14).eval()

    def writer(m, state):
        with m.editing():
            for name in ("W_q", "W_k", "W_v", "W_o"):
                lin = getattr(m, name)
                lin.weight[...] = state[f"{name}.weight"]
                lin.bias[...] = state[f"{name}.bias"]
            # the writing thread itself may call the module meanwhile
            m(np.zeros((1, 2, E), np.float32))

    counts = _old_or_new(m, writer)
    print(f"\nin-place writes under editing(): {counts}")


def test_unsynchronised_in_place_writes_never_crash():
    """Outside editing() a concurrent call may see a mix of old and new
    values (documented), but never crashes or returns a wrong shape."""
    m = mha_ext.MultiHeadAttention(E, H, seed=15).eval()
    old, new = _two_states(m)
    stop = threading.Event()
    shapes = []

    def work(i):
        if i == 0:
            n = 0
            while not stop.is_set():
                state = new if n % 2 else old
                m.W_q.weight[...] = state["W_q.weight"]
                m.W_o.weight[...] = np.nan if n % 7 == 0 else state["W_o.weight"]
                m.dropout = 0.5 if n % 3 else 0.0
                m.train(n % 5 == 0)
                n += 1
            return
        (x, kv), kw = inputs(i)
        for _ in range(N_CALLS // 2):
            out, w = m(x, kv, **kw)
            shapes.append(out.shape == x.shape)
        if i == 1:
            stop.set()

    try:
        run_threads(work, 4)
    finally:
        stop.set()
    assert all(shapes) and len(shapes) == 3 * (N_CALLS // 2)


def test_editing_is_reentrant_and_released_on_error():
    m = mha_ext.MultiHeadAttention(8, 2, seed=0)
    try:
        with m.editing():
            with m.editing():
                m.W_q.bias[...] = 1.0
            raise KeyError("inside")
    except KeyError:
        pass
    # the lock is free again: another thread can load a state
    t = threading.Thread(target=m.load_state_dict, args=(m.state_dict(),))
    t.start()
    t.join(timeout=30)
    assert not t.is_alive()
    np.testing.assert_array_equal(m.W_q.bias, 1.0)


def test_training_calls_from_threads_use_distinct_dropout_streams():
    m = mha_ext.MultiHeadAttention(E, H, dropout=0.5, seed=16)
    x = np.random.default_rng(0).standard_normal((1, 9, E)).astype(np.float32)
    results = []

    def work(i):
        for _ in range(25):
            results.append(m(x)[1])

    run_threads(work, 4)
    assert m._counter == 100
    distinct = {r.tobytes() for r in results}
    assert len(distinct) == 100


def test_state_dict_pickle_and_deepcopy_see_all_old_or_all_new_parameters():
    # state_dict() copied tensor by tensor without the read lock: next to a
    # thread running load_state_dict or editing() blocks, about 4 snapshots
    # in 10 mixed old and new values (a checkpoint of a model that never was)
    import copy
    import pickle
    import sys
    m = mha_ext.MultiHeadAttention(E, H, seed=0)
    zeros = {k: np.zeros_like(v) for k, v in m.state_dict().items()}
    ones = {k: np.ones_like(v) for k, v in m.state_dict().items()}
    m.load_state_dict(zeros)
    stop = threading.Event()

    def writer():
        n = 0
        while not stop.is_set():
            if n % 2:
                m.load_state_dict(zeros if n % 4 == 1 else ones)
            else:
                with m.editing():
                    for name in ("W_q", "W_k", "W_v", "W_o"):
                        getattr(m, name).weight[...] = n % 4 // 2
                        getattr(m, name).bias[...] = n % 4 // 2
            n += 1
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    t = threading.Thread(target=writer)
    t.start()
    try:
        mixed = {"state_dict": 0, "pickle": 0, "deepcopy": 0}
        for _ in range(300):
            for how in mixed:
                sd = (m.state_dict() if how == "state_dict" else
                      pickle.loads(pickle.dumps(m)).state_dict() if how == "pickle" else
                      copy.deepcopy(m).state_dict())
                values = {float(v.flat[0]) for v in sd.values()} \
                    | {float(v.flat[-1]) for v in sd.values()}
                mixed[how] += len(values) > 1
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(old)
    assert mixed == {"state_dict": 0, "pickle": 0, "deepcopy": 0}, mixed


def test_trace_of_a_cache_another_thread_extends_is_whole_or_refused():
    # trace() read the cache's length, keys and values after its own call,
    # unlocked: a decode step of another thread in between gave NumPy's
    # shape errors (matmul core dimension, broadcast) or keys the traced
    # call never saw; now a RuntimeError, or a trace whose output is the call's
    import sys
    rng = np.random.default_rng(0)
    m = mha_ext.MultiHeadAttention(16, 4, seed=0, dtype="float64").eval()
    x = rng.standard_normal((1, 1, 16))
    cache = m.new_cache(1, 1 << 14)
    stop = threading.Event()

    def decode():
        while not stop.is_set():
            try:
                m(x, cache=cache, need_weights=False)
            except RuntimeError:
                pass
            time.sleep(0.0005)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    t = threading.Thread(target=decode)
    t.start()
    outcomes = {"traced": 0, "refused": 0}
    try:
        for _ in range(500):
            try:
                tr = m.trace(x, cache=cache)
            except RuntimeError as e:
                assert "cache" in str(e), e
                outcomes["refused"] += 1
                continue
            # the trace's own recomputation, from the keys it shows, is the call's output
            np.testing.assert_allclose(tr.info["numpy_output"], tr.output, rtol=1e-10,
                                       atol=1e-12)
            outcomes["traced"] += 1
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(old)
    assert outcomes["traced"] + outcomes["refused"] == 500


def test_trace_refuses_a_cache_reset_and_refilled_behind_its_call():
    # the length alone cannot tell: another thread resets the cache and
    # refills it to the same length between the traced call and trace()'s
    # read; the trace showed keys its call never saw (now: the cache's count
    # of changes must be the call's one)
    import pytest
    rng = np.random.default_rng(0)
    other = rng.standard_normal((1, 4, 16)).astype(np.float32)

    class Module(mha_ext.MultiHeadAttention):
        hook = None

        def __call__(self, *args, **kwargs):
            result = super().__call__(*args, **kwargs)
            if self.hook:  # another thread's turn, right after the call
                hook, self.hook = self.hook, None
                t = threading.Thread(target=hook)
                t.start()
                t.join()
            return result
    m = Module(16, 2, seed=0).eval()
    cache = m.new_cache(1, 8)
    m(rng.standard_normal((1, 3, 16)).astype(np.float32), cache=cache)

    def reset_and_refill():
        cache.reset()
        m(other, cache=cache)
    m.hook = reset_and_refill
    with pytest.raises(RuntimeError, match="another call changed the cache"):
        m.trace(rng.standard_normal((1, 1, 16)).astype(np.float32), cache=cache)


def test_a_cross_cache_is_copied_and_traced_while_calls_read_it():
    import copy
    rng = np.random.default_rng(1)
    m = mha_ext.MultiHeadAttention(32, 4, seed=1).eval()
    memory = rng.standard_normal((2, 64, 32)).astype(np.float32)
    cache = m.cache_memory(memory)
    x = rng.standard_normal((2, 1, 32)).astype(np.float32)
    want = m(x, memory, memory)[0]
    errors, start = [], threading.Barrier(3)

    def work(kind):
        try:
            start.wait(timeout=60)
            for _ in range(100):
                if kind == "call":
                    assert np.allclose(m(x, cache=cache)[0], want, rtol=1e-5, atol=1e-6)
                elif kind == "copy":
                    assert copy.deepcopy(cache).length == 64
                else:
                    assert np.allclose(m.trace(x, cache=cache).output, want, rtol=1e-5,
                                       atol=1e-6)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"{kind}: {e!r}")
    threads = [threading.Thread(target=work, args=(k,)) for k in ("call", "copy", "trace")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]
