"""mha_ext.cache (the KV cache) and mha_ext._nested (the torch drop-in's
nested queries): the rules mutation testing of those files found no test
holding (a mutant of each passed the suite before).  A nested query with
a key_padding_mask or an attn_mask refused as torch refuses it, and so
are window=, layout= and is_causal='lower_right' with one; off the fast
path torch's AssertionError also when window= is given; with
need_weights=False no weights, as torch's; weights per head or averaged,
empty sequences among them, torch's, 0 on the padding's rows (docs/API.md
§8).  A cache's capacity and batch size, its keys view read-only, a
reset() cache returned and decoding as a fresh one, a copy going on from
the original's length with keys of its own, a cross cache copied while
"held" (it has no hold) and still refusing reset(), a fork child keeping
the forking thread's own hold, and a cache one byte past sys.maxsize a
MemoryError naming its bytes (docs/API.md §3.3).

Legend: B batch, H heads, Hkv key/value heads, L query length, E width.
"""
import copy
import os
import pickle
import subprocess
import sys
import warnings

import numpy as np
import pytest

import mha_ext
from mha_ext import MultiHeadAttention, layout
from _support import require_torch

torch = require_torch()
from torch import nn  # noqa: E402
from mha_ext.torch import MultiheadAttention  # noqa: E402

E, H = 8, 2


# ---------------------------------------------------------------- nested queries

def _pair(dtype=torch.float64, seed=0):
    """torch's module and ours with its parameters, in eval mode."""
    torch.manual_seed(seed)
    ref = nn.MultiheadAttention(E, H, batch_first=True, dtype=dtype).eval()
    with torch.no_grad():
        ref.in_proj_bias.normal_()
        ref.out_proj.bias.normal_()
    ours = MultiheadAttention(E, H, batch_first=True, dtype=dtype).eval()
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def _nested(lengths=(3, 5), dtype=torch.float64, seed=5):
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(n, E, generator=g, dtype=dtype) for n in lengths]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the nested tensors' prototype warning
        return torch.nested.nested_tensor(parts)


def _close(got, want, dtype):
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got, want, rtol=0, atol=tol)


@pytest.mark.parametrize("masks", ["key_padding_mask", "attn_mask", "both"])
def test_a_nested_query_with_a_mask_is_refused_as_torch_refuses_it(masks):
    ref, ours = _pair()
    q = _nested()
    kw = {}
    if masks in ("key_padding_mask", "both"):
        kw["key_padding_mask"] = torch.zeros(2, 5, dtype=torch.bool)
    if masks in ("attn_mask", "both"):
        kw["attn_mask"] = torch.zeros(5, 5, dtype=torch.bool)
    with torch.no_grad():
        with pytest.raises(AssertionError, match="outside of its fast path"):
            ref(q, q, q, **kw)
        with pytest.raises(AssertionError, match="without masks"):
            ours(q, q, q, **kw)


@pytest.mark.parametrize("ours_kw", [{"window": (1, 0)}, {"is_causal": "lower_right"},
                                     {"layout": "bigbird"}])
def test_window_layout_and_lower_right_are_refused_with_a_nested_query(ours_kw):
    _, ours = _pair()
    q = _nested()
    if "layout" in ours_kw:
        ours_kw = {"layout": layout.bigbird(5, 5, 1, seed=0)}
    with torch.no_grad(), pytest.raises(ValueError, match="not taken with a nested query"):
        ours(q, q, q, **ours_kw)



def test_off_the_fast_path_a_nested_query_is_torchs_assertion_even_with_window():
    """Training mode: torch's AssertionError (and a ValueError), also when a
    keyword of ours (window=) is given too: the nested query is refused
    first, for the reason torch refuses it."""
    _, ours = _pair()
    q = _nested()
    ours.train()
    with pytest.raises(AssertionError, match="fast path"), torch.no_grad():
        ours(q, q, q, window=(1, 0))
    with pytest.raises(ValueError, match="fast path"), torch.no_grad():
        ours(q, q, q, window=(1, 0))

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_nested_query_without_weights_gives_none_as_torch(dtype):
    ref, ours = _pair(dtype)
    q = _nested(dtype=dtype)
    with torch.no_grad():
        want, want_w = ref(q, q, q, need_weights=False)
        got, got_w = ours(q, q, q, need_weights=False)
    assert want_w is None and got_w is None
    assert got.is_nested
    for g, w in zip(got.unbind(), want.unbind()):
        assert g.shape == w.shape
        _close(g, w, dtype)


@pytest.mark.parametrize("average", [True, False])
@pytest.mark.parametrize("lengths", [(3, 5), (5, 2, 4), (4, 0, 2)])
def test_a_nested_querys_weights_are_torchs_with_zero_padding_rows(average, lengths):
    ref, ours = _pair()
    q = _nested(lengths)
    with torch.no_grad():
        want, want_w = ref(q, q, q, average_attn_weights=average)
        got, got_w = ours(q, q, q, average_attn_weights=average)
    assert got_w.shape == want_w.shape
    _close(got_w, want_w, torch.float64)
    # the rows of the padding are 0 in each head (torch's too)
    for b, n in enumerate(lengths):
        rows = got_w[b, n:] if average else got_w[b, :, n:]
        assert rows.numel() == 0 or torch.all(rows == 0)
    for g, w in zip(got.unbind(), want.unbind()):
        assert g.shape == w.shape
        _close(g, w, torch.float64)


# ---------------------------------------------------------------- the KV cache

def _module(dtype="float64", Hkv=2):
    return MultiHeadAttention(16, 4, n_kv_heads=Hkv, dtype=dtype, seed=3).eval()


def _x(B, n, dtype="float64", seed=0):
    return np.random.default_rng(seed).standard_normal((B, n, 16)).astype(dtype)


def test_capacity_and_batch_size_are_new_caches_arguments():
    m = _module(Hkv=2)          # Hkv 2, Dk 4: neither equal to B or max_len
    cache = m.new_cache(3, 7)
    assert (cache.batch_size, cache.capacity, cache.length) == (3, 7, 0)
    assert cache.keys.shape == cache.values.shape == (3, 2, 0, 4)


def test_the_keys_view_is_read_only():
    m = _module()
    cache = m.new_cache(1, 4)
    m(_x(1, 2), cache=cache, need_weights=False)
    keys = cache.keys
    assert keys.shape == (1, 2, 2, 4) and not keys.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        keys[...] = 0


def test_reset_returns_the_cache_and_it_decodes_as_a_fresh_one():
    m = _module()
    x = _x(2, 5)
    want, _ = m(x, is_causal=True, need_weights=False)
    cache = m.new_cache(2, 5)
    m(_x(2, 4, seed=9), cache=cache, need_weights=False)
    assert cache.reset() is cache and cache.length == 0
    got = np.concatenate([m(x[:, :3], cache=cache, need_weights=False)[0],
                          m(x[:, 3:], cache=cache, need_weights=False)[0]], axis=1)
    assert cache.length == 5
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_a_copy_goes_on_from_the_originals_length(how):
    m = _module()
    x = _x(2, 6)
    want, _ = m(x, is_causal=True, need_weights=False)
    cache = m.new_cache(2, 6)
    m(x[:, :4], cache=cache, need_weights=False)
    if how == "pickle":
        m2, c2 = pickle.loads(pickle.dumps((m, cache)))
    else:
        m2, c2 = m, getattr(copy, how)(cache)
    assert c2.length == 4 and c2.capacity == 6 and not c2.cross
    assert not np.shares_memory(c2.keys, cache.keys)
    got, _ = m2(x[:, 4:], cache=c2, need_weights=False)
    np.testing.assert_allclose(got, want[:, 4:], rtol=0, atol=1e-10)
    # the copy's keys are its own: a call on it leaves the original's length
    # and keys (its next call then gives the full call's rows again)
    assert cache.length == 4
    got, _ = m(x[:, 4:], cache=cache, need_weights=False)
    np.testing.assert_allclose(got, want[:, 4:], rtol=0, atol=1e-10)


def test_a_cross_cache_copied_while_held_is_copied_and_stays_unreset():
    m = _module()
    mem = m.cache_memory(_x(2, 3, seed=4))
    q = _x(2, 2, seed=5)
    want, _ = m(q, cache=mem, need_weights=False)
    with mem._held():             # no hold for a cross cache: calls may read it
        c2 = copy.copy(mem)
        got, _ = m(q, cache=c2, need_weights=False)
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="cross-attention cache"):
        c2.reset()
    assert c2.cross and c2.length == mem.length == 3


_FORK_INSIDE_OWN_HOLD = """
import os, mha_ext
m = mha_ext.MultiHeadAttention(16, 4, seed=0)
cache = m.new_cache(1, 4)
with cache._held():               # this thread's own hold, as inside its call
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            try:
                cache.reset()     # still held by the forking thread: refused
                code = 4
            except RuntimeError:
                code = 5
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
print(os.WEXITSTATUS(status), cache.reset().length)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork as on Linux")
def test_a_fork_child_keeps_the_forking_threads_own_cache_hold():
    """A fork child drops other threads' holds of a cache (their threads are
    gone) but not the forking thread's own: its block is still running."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(mha_ext.__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    out = subprocess.run([sys.executable, "-c", _FORK_INSIDE_OWN_HOLD], env=env, cwd=root,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["5", "0"]


def test_a_cache_just_past_the_address_space_is_a_memory_error_naming_its_bytes():
    # 2 x B x Hkv 2 x Dk 4 x max_len x 8 bytes = 2**63: one past sys.maxsize
    m = _module("float64")
    with pytest.raises(MemoryError, match=f"{2 ** 63} bytes.*too large to allocate"):
        m.new_cache(2 ** 28, 2 ** 28)
