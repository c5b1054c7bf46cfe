"""mha_ext.__main__ (the demo), mha_ext._trace_masks (the trace's masked
scores) and mha_ext/__init__.py (the hand-over to an installed package):
the rules mutation testing of those files found no test holding (a mutant
of each passed the demo, trace and usability tests before).

The demo: a size of 0 refused and --threads 256 (the limit) taken; its
defaults the documented seed configuration; --repeat N timed runs per
library; --threads setting both libraries for the timing and torch's own
count given back afterwards; the speed-up as torch's time over ours; "1
thread" in the singular; the mask in the first line and the plot's title;
a plot that cannot be saved exit 1, not a traceback; an upper-case
extension matplotlib writes; torch's idle threads set to sleep
(OMP_WAIT_POLICY=PASSIVE, README "Benchmarks"); no "(default: False)" for
flags.  The trace: the lower-right diagonal and a window under it, cells
and words, with Sq > Sk too; a layout's block grid and density (docs/API.md
§3.1, §6).  The package: which files the hand-over compares, its refusals
(another version, no extension, an exec that fails) and ImportError.name,
an unset MHA_EXT_ISA quiet and one this CPU lacks named so, and a missing
attribute an AttributeError.

Legend: B batch, H heads, Sq query length, Sk key length, E width.
"""
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import mha_ext
import mha_ext.__main__ as demo
from mha_ext import _core
from _support import PKG_ROOT, has, need

SMALL = ["--no-torch", "--seq", "3", "--d-model", "16", "--heads", "2"]


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=PKG_ROOT, MPLBACKEND="Agg")
    env.update(extra)
    return env


# ---------------------------------------------------------------- demo: arguments

@pytest.mark.parametrize("option", ["--batch", "--seq", "--d-model", "--heads", "--repeat",
                                    "--threads"])
def test_a_size_of_zero_is_refused_by_argparse(option, capsys):
    with pytest.raises(SystemExit) as exc:
        demo._parser().parse_args([option, "0"])
    assert exc.value.code == 2
    assert "must be at least 1, got 0" in capsys.readouterr().err


def test_threads_up_to_the_limit_of_set_num_threads():
    # "at most 256": 256 itself is taken, as set_num_threads takes it
    assert demo._parser().parse_args(["--threads", "256"]).threads == 256
    mha_ext.set_num_threads(256)
    mha_ext.set_num_threads(mha_ext.get_num_threads())     # no error: the limit is valid


def test_the_defaults_are_the_seed_configuration():
    # README / API.md §6: B=2, S=10, E=512, H=8; the docstring's usage:
    # --seed 0, --repeat 20, float32, no mask
    a = demo._parser().parse_args([])
    assert (a.batch, a.seq, a.d_model, a.heads) == (2, 10, 512, 8)
    assert (a.dtype, a.seed, a.repeat, a.causal, a.threads) == ("float32", 0, 20, False, None)


def test_flags_show_no_default_in_the_help():
    # a flag is off unless given: "(default: False)" says nothing
    text = demo._parser().format_help()
    assert "(default: False)" not in text
    assert "(default: 20)" in text and "(default: 0)" in text


def test_an_upper_case_extension_matplotlib_writes_is_taken(tmp_path):
    if not has("matplotlib"):
        pytest.skip("matplotlib is not installed")
    from matplotlib.backend_bases import FigureCanvasBase
    assert "png" in FigureCanvasBase.get_supported_filetypes()
    path = str(tmp_path / "heads.PNG")
    assert demo._plot_file(path) == path


# ---------------------------------------------------------------- demo: timing

@pytest.mark.parametrize("repeat", [1, 2, 3, 20])
def test_median_times_takes_repeat_timed_runs_of_each(repeat, monkeypatch):
    # "median of N runs": N timed calls per library (each timed call reads
    # the clock twice; the warm-up calls are not timed)
    clock = {"reads": 0, "t": 0.0}

    def counter():
        clock["reads"] += 1
        clock["t"] += 1.0
        return clock["t"]
    monkeypatch.setattr(demo.time, "perf_counter", counter)
    calls = [0, 0]
    fns = [lambda: calls.__setitem__(0, calls[0] + 1), lambda: calls.__setitem__(1, calls[1] + 1)]
    demo._median_times(fns, repeat)
    assert clock["reads"] == 2 * 2 * repeat
    assert calls[0] == calls[1] and calls[0] >= repeat


def _run_compare(monkeypatch, capsys, argv, times=(0.002, 0.006)):
    """main(argv) with torch, the timing replaced by one that records the
    thread counts it runs under and returns `times` (ours, torch's)."""
    torch = need("torch")
    seen = []

    def fake(fns, repeat):
        seen.append((torch.get_num_threads(), mha_ext.get_num_threads(), repeat))
        return list(times)
    monkeypatch.setattr(demo, "_median_times", fake)
    assert demo.main(argv) == 0
    return seen, capsys.readouterr().out


@pytest.mark.parametrize("threads", [1, 2])
def test_threads_set_both_libraries_and_torchs_count_is_given_back(threads, monkeypatch, capsys):
    torch = need("torch")
    old_torch, old_ours = torch.get_num_threads(), mha_ext.get_num_threads()
    other = 3 if threads != 3 else 4
    torch.set_num_threads(other)
    try:
        seen, out = _run_compare(monkeypatch, capsys, [*SMALL[1:], "--threads", str(threads)])
        assert seen == [(threads, threads, 20)]
        assert torch.get_num_threads() == other                    # given back
        word = "thread" if threads == 1 else "threads"
        assert "median of 20 runs, %d %s)" % (threads, word) in out, out
    finally:
        torch.set_num_threads(old_torch)
        mha_ext.set_num_threads(old_ours)


def test_the_speed_up_is_torchs_time_over_ours(monkeypatch, capsys):
    _, out = _run_compare(monkeypatch, capsys, [*SMALL[1:], "--threads", "1"],
                          times=(0.002, 0.006))
    assert "mha_ext 2.000 ms, torch 6.000 ms" in out, out
    found = re.search(r"speed-up over torch \(torch time / mha_ext time\): ([\d.]+)x", out)
    assert found and float(found.group(1)) == pytest.approx(0.006 / 0.002), out


class _NoTorch:
    """A meta path finder: `import torch` fails as a missing module's."""

    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError("No module named %r" % name, name=name)


@pytest.mark.parametrize("given", [None, "ACTIVE"])
def test_torchs_idle_threads_sleep_unless_the_user_set_the_policy(given, monkeypatch, capsys):
    # README "Benchmarks": OMP_WAIT_POLICY=PASSIVE set before torch is
    # imported (a value the user set stays); torch not imported yet here
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_NoTorch()] + sys.meta_path)
    if given is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", given)
    assert demo.main(SMALL[1:]) == 0
    assert "torch is not installed" in capsys.readouterr().out
    assert os.environ.get("OMP_WAIT_POLICY") == (given or "PASSIVE")


# ---------------------------------------------------------------- demo: output and plot

@pytest.mark.parametrize("causal", [False, True])
def test_the_first_line_names_the_mask(causal, capsys):
    assert demo.main(SMALL + (["--causal"] if causal else [])) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.endswith(", float32, causal" if causal else ", float32, no mask"), first


class _Fig:
    def __init__(self, error=None):
        self.error = error

    def savefig(self, path, **kw):
        if self.error:
            raise self.error
        with open(path, "wb"):
            pass


@pytest.mark.parametrize("causal", [False, True])
def test_the_plots_title_says_causal_only_for_a_causal_call(causal, tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(demo, "plot_heads", lambda tr, **kw: seen.append(kw) or _Fig())
    argv = SMALL + ["--seed", "4", "--plot", str(tmp_path / "x.png")]
    assert demo.main(argv + (["--causal"] if causal else [])) == 0
    title = seen[0]["title"]
    assert "2 heads" in title and "seed 4" in title
    assert ("causal" in title) == causal, title
    # one label per position, numbered as the trace numbers queries and keys:
    # from 0 (API.md §6: query_position is query 0's key position)
    assert [int(re.sub(r"\D", "", t)) for t in seen[0]["tokens"]] == [0, 1, 2]


@pytest.mark.parametrize("error", [PermissionError(13, "Permission denied"),
                                   OSError(28, "No space left on device")])
def test_a_plot_that_cannot_be_written_is_exit_1_not_a_traceback(error, tmp_path, monkeypatch,
                                                                 capsys):
    monkeypatch.setattr(demo, "plot_heads", lambda tr, **kw: _Fig(error))
    path = str(tmp_path / "x.png")
    assert demo.main(SMALL + ["--plot", path]) == 1
    err = capsys.readouterr().err
    assert "cannot save the plot to %s" % path in err and str(error.strerror) in err, err


# ---------------------------------------------------------------- trace: masked scores

def _masked(t):
    step = t["masked scores"]
    return np.isneginf(step.array), step.formula


@pytest.mark.parametrize("Sq, Sk", [(3, 5), (5, 3), (4, 4)])
def test_lower_right_causality_blocks_past_the_shifted_diagonal(Sq, Sk):
    # API.md §3.1: query i does not see key j > i + Sk − Sq
    m = mha_ext.MultiHeadAttention(8, 2, seed=0).eval()
    r = np.random.default_rng(0)
    q, kv = r.standard_normal((1, Sq, 8)), r.standard_normal((1, Sk, 8))
    t = m.trace(q, kv, is_causal="lower_right")
    cells, formula = _masked(t)
    i, j = np.arange(Sq)[:, None], np.arange(Sk)[None, :]
    want = j > i + (Sk - Sq)
    assert np.array_equal(cells, np.broadcast_to(want, (1, 2, Sq, Sk)))
    off = Sk - Sq
    where = "i" if off == 0 else "i + %d" % off if off > 0 else "i − %d" % -off
    tail = " (causal, lower right)" if off else " (causal)"
    assert "j > " + where + tail in formula, formula


@pytest.mark.parametrize("Sq, Sk, window", [(3, 6, (1, 0)), (3, 6, (0, 1)), (6, 3, (1, 1)),
                                            (4, 4, (2, None)), (4, 7, (None, 1))])
def test_a_window_under_lower_right_causality_shifts_with_the_diagonal(Sq, Sk, window):
    # API.md §3.1: query i sees keys i + d − left <= j <= i + d + right, d = Sk − Sq
    m = mha_ext.MultiHeadAttention(8, 2, seed=0).eval()
    r = np.random.default_rng(1)
    q, kv = r.standard_normal((1, Sq, 8)), r.standard_normal((1, Sk, 8))
    t = m.trace(q, kv, is_causal="lower_right", window=window)
    cells, formula = _masked(t)
    d = Sk - Sq
    i, j = np.arange(Sq)[:, None], np.arange(Sk)[None, :]
    left, right = window
    want = j > i + d
    words = []

    def at(k):
        return "i" if k == 0 else "i + %d" % k if k > 0 else "i − %d" % -k
    if left is not None:
        want = want | (j < i + d - left)
        words.append("j < " + at(d - left))
    if right is not None:
        want = want | (j > i + d + right)
        words.append("j > " + at(d + right))
    assert np.array_equal(cells[0, 0], want)
    assert " or ".join(words) + " (window)" in formula, formula
    np.testing.assert_array_equal(t.info["blocked"][0, 0], want)


def test_a_window_on_a_top_left_call_is_its_band():
    m = mha_ext.MultiHeadAttention(8, 2, seed=0).eval()
    x = np.random.default_rng(2).standard_normal((1, 6, 8))
    t = m.trace(x, window=(1, 2))
    cells, formula = _masked(t)
    i, j = np.arange(6)[:, None], np.arange(6)[None, :]
    assert np.array_equal(cells[0, 1], (j < i - 1) | (j > i + 2))
    assert "j < i − 1 or j > i + 2 (window)" in formula, formula


def test_a_layouts_words_give_its_block_grid_and_density():
    # 6 queries in blocks of 2 (3 rows), 6 keys in blocks of 3 (2 columns)
    keep = np.array([[True, False], [True, True], [False, True]])
    lay = mha_ext.BlockLayout(keep, (2, 3))
    m = mha_ext.MultiHeadAttention(8, 2, seed=0).eval()
    x = np.random.default_rng(3).standard_normal((1, 6, 8))
    t = m.trace(x, layout=lay)
    cells, formula = _masked(t)
    assert "layout 3×2 blocks of 2×3, density %.2f" % (4 / 6) in formula, formula
    want = ~np.repeat(np.repeat(keep, 2, axis=0), 3, axis=1)
    assert np.array_equal(cells[0, 0], want)


def test_an_unbatched_call_with_the_seed_mask_blocks_its_cells():
    # API.md §3.1: the seed's 0/1 mask, 1 = blocked, broadcast to (H, Sq, Sk)
    # for one unbatched sequence
    m = mha_ext.MultiHeadAttention(8, 2, seed=0).eval()
    x = np.random.default_rng(4).standard_normal((4, 8))
    mask = np.triu(np.ones((4, 4), int), 1)
    t = m.trace(x, mask=mask)
    cells, formula = _masked(t)
    assert np.array_equal(cells, np.broadcast_to(mask == 1, (2, 4, 4)))
    w = np.exp(t["raw scores"].array) * (mask == 0)
    np.testing.assert_allclose(t.weights, w / w.sum(-1, keepdims=True), rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- the package

def _tree(root, files):
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return str(root)


def test_the_handover_compares_what_pip_installs_and_nothing_else(tmp_path):
    # __init__._first_differing's rule: the package's .py, .pyi, py.typed,
    # _html's .js and .css; not hidden files, other kinds; line endings aside
    same = {"a.py": b"x = 1\n", "a.pyi": b"x: int\n", "py.typed": b"",
            "_html/e.js": b"f()\n", "_html/e.css": b"p {}\n"}
    inst = _tree(tmp_path / "inst", same)
    first = mha_ext._first_differing
    assert first(_tree(tmp_path / "t0", same), inst) is None
    extra = dict(same, **{".#a.py": b"lock", "._a.py": b"\x00", "notes.txt": b"n",
                          "_html/e.map": b"m"})
    assert first(_tree(tmp_path / "t1", extra), inst) is None          # not compared
    assert first(_tree(tmp_path / "t2", dict(same, **{"a.py": b"x = 1\r\n"})), inst) is None
    crlf = _tree(tmp_path / "i2", dict(same, **{"a.py": b"x = 1\r\n"}))
    assert first(_tree(tmp_path / "t3", same), crlf) is None           # either side
    for rel in ("a.py", "py.typed", "_html/e.js", "_html/e.css"):
        changed = dict(same, **{rel: same[rel] + b"# edited\n"})
        assert first(_tree(tmp_path / ("c" + rel.replace("/", "_")), changed), inst) \
            == os.path.join(*rel.split("/"))
    new = dict(same, **{"b.py": b"y = 2\n"})                           # not installed
    assert first(_tree(tmp_path / "t4", new), inst) == "b.py"


HANDOVER = """
import sys, mha_ext
src, site = sys.argv[1], sys.argv[2]
sys.path[:] = [src, site] + [p for p in sys.path if 'site-packages' in p or 'lib/python' in p]
orig = sys.modules["mha_ext"]
try:
    got = mha_ext._installed_package(src + "/mha_ext")
except Exception as exc:
    print(type(exc).__name__, getattr(exc, "name", None), "|", exc)
    print("restored", sys.modules["mha_ext"] is orig)
else:
    print("got", got.X, got.__file__.startswith(site), sys.modules["mha_ext"] is got)
"""


def _handover(tmp_path, version="0.1.0", core=True, init=b"X = 7\n"):
    src = tmp_path / "src"
    site = tmp_path / "site"
    _tree(src, {"mha_ext/__init__.py": init})
    files = {"mha_ext/__init__.py": init,
             "mha_ext-%s.dist-info/METADATA" % version:
                 b"Metadata-Version: 2.1\nName: mha_ext\nVersion: %s\n" % version.encode()}
    if core:
        files["mha_ext/_core.py"] = b""
    _tree(site, files)
    r = subprocess.run([sys.executable, "-c", HANDOVER, str(src), str(site)], cwd=tmp_path,
                       env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_the_handover_takes_the_installed_package_of_this_version(tmp_path):
    out = _handover(tmp_path)
    assert out.split() == ["got", "7", "True", "True"], out


def test_the_handover_refuses_another_version(tmp_path):
    out = _handover(tmp_path, version="9.9")
    assert out.startswith("ImportError mha_ext._core |"), out
    assert "is version 9.9, not this tree's %s" % mha_ext.__version__ in out, out
    assert "restored True" in out


def test_an_installed_package_that_fails_to_import_leaves_the_entry_as_it_was(tmp_path):
    # the failed module was put back as sys.modules["mha_ext"] (harmless in a
    # real import, whose machinery then drops the entry; not in a direct call)
    out = _handover(tmp_path, init=b"raise RuntimeError('broken install')\n")
    assert out.startswith("RuntimeError None | broken install"), out
    assert "restored True" in out, out


def test_the_handover_refuses_a_package_without_its_extension(tmp_path):
    out = _handover(tmp_path, core=False)
    assert out.startswith("ImportError mha_ext._core |"), out
    assert "no installed mha_ext was found on sys.path" in out, out


def test_another_missing_module_under_the_extension_is_not_a_missing_build(tmp_path):
    # a module the extension needs, missing: its own ModuleNotFoundError, not
    # "not built in ..." (which only a missing mha_ext._core itself means)
    code = textwrap.dedent("""
        import sys
        class Finder:
            def find_spec(self, name, path=None, target=None):
                if name == "mha_ext._core":
                    raise ModuleNotFoundError("No module named 'libfoo'", name="libfoo")
        sys.meta_path.insert(0, Finder())
        try:
            import mha_ext
        except ImportError as exc:
            print(type(exc).__name__, exc.name)
        """)
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["ModuleNotFoundError", "libfoo"], (r.stdout, r.stderr)


def _import_with_isa(value):
    env = {k: v for k, v in _env().items() if k != "MHA_EXT_ISA"}
    if value is not None:
        env["MHA_EXT_ISA"] = value
    return subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c", "import mha_ext"],
                          env=env, capture_output=True, text=True, timeout=120)


def test_no_isa_asked_imports_quietly():
    r = _import_with_isa(None)
    assert r.returncode == 0 and "MHA_EXT_ISA" not in r.stderr, r.stderr


def test_a_known_isa_this_cpu_lacks_is_named_so():
    lacking = [i for i in ("amx", "avx512", "avx2") if not _core._isa_available(i)]
    if not lacking:
        pytest.skip("this CPU and build run every ISA")
    for isa in lacking:
        r = _import_with_isa(isa)
        assert r.returncode != 0
        assert "MHA_EXT_ISA=%r is ignored (this CPU or this build lacks it)" % isa in r.stderr, \
            r.stderr


def test_a_missing_attribute_is_an_attribute_error():
    assert not hasattr(mha_ext, "no_such_name")
    with pytest.raises(AttributeError, match="module 'mha_ext' has no attribute 'no_such_name'"):
        mha_ext.no_such_name


def test_star_import_gives_the_documented_names():
    # API.md: mha_ext.layout (the module), mha_ext.BlockLayout, mha_ext.heads
    ns = {}
    exec("from mha_ext import *", ns)
    for name in ("MultiHeadAttention", "layout", "BlockLayout", "heads", "trace", "KVCache",
                 "scaled_dot_product_attention", "__version__"):
        assert name in ns, name
