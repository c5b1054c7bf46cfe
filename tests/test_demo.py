"""python -m mha_ext: the demo, run as a user would, from another directory."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from _support import PKG_ROOT, has, need



def run_demo(cwd, *args, hide=(), broken=(), env=None, encoding=None):
    """Run the demo in cwd (not the source tree) with the package the tests
    import; `hide` lists top-level modules made unimportable, `broken` ones
    whose import fails otherwise (an OSError, as a missing shared library);
    `env`: variables set for it; `encoding`: its output's (UTF-8)."""
    path = [PKG_ROOT]
    fake = Path(cwd) / "_hidden"
    for names, error in ((hide, "ModuleNotFoundError(\"No module named '%s'\")"),
                         (broken, "OSError('%s: libmissing.so: cannot open shared object')")):
        for name in names:
            (fake / name).mkdir(parents=True, exist_ok=True)
            (fake / name / "__init__.py").write_text("raise %s\n" % (error % name))
    if hide or broken:
        path.insert(0, str(fake))
    env = dict(os.environ, **(env or {}))
    env["PYTHONPATH"] = os.pathsep.join(path + [env.get("PYTHONPATH", "")])
    env["MPLBACKEND"] = "Agg"
    return subprocess.run([sys.executable, "-m", "mha_ext", *args], cwd=cwd,
                          env=env, capture_output=True, text=True,
                          encoding=encoding, timeout=600)


def test_seed_configuration(tmp_path):
    r = run_demo(tmp_path)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "B=2, Sq=10, Sk=10, E=512, H=8, Dk=64" in out
    assert "[batch=2, seq_q=10, d_model=512]" in out
    for shape in ("[2, 10, 512]", "[2, 8, 10, 64]", "[2, 8, 10, 10]"):
        assert shape in out
    for step in ("Q projection", "Q heads", "raw scores", "masked scores",
                 "softmax", "context", "concat heads", "output projection"):
        assert step in out
    assert "shape flow: [B, Sq, E] → [B, H, Sq, Dk]" in out
    assert "parameters: 1,050,624" in out
    if has("torch"):
        assert "largest difference from torch" in out
        assert "time per call" in out
    else:
        assert "torch is not installed" in out


def test_compares_with_torch(tmp_path):
    need("torch")
    for dtype, tol in (("float32", 1e-4), ("float64", 1e-10)):
        r = run_demo(tmp_path, "--dtype", dtype, "--repeat", "3", "--causal")
        assert r.returncode == 0, r.stderr
        found = re.search(r"largest difference from torch: output (\S+), "
                          r"weights (\S+)", r.stdout)
        assert found, r.stdout
        d_out, d_w = float(found.group(1)), float(found.group(2))
        assert d_out < tol and d_w < tol, (dtype, d_out, d_w)
        t = re.search(r"mha_ext ([\d.]+) ms, torch ([\d.]+) ms", r.stdout)
        assert t and float(t.group(1)) > 0 and float(t.group(2)) > 0
        assert "speed-up over torch" in r.stdout


def test_options(tmp_path):
    r = run_demo(tmp_path, "--batch", "3", "--seq-len", "4", "--d-model",
                 "48", "--heads", "6", "--dtype", "float64", "--no-torch",
                 "--causal")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "[batch=3, seq_q=4, d_model=48]" in out
    assert "[3, 6, 4, 8]" in out and "[3, 6, 4, 4]" in out
    assert "parameters: 9,408" in out                 # 4·48² + 4·48
    assert "float64" in out and "causal" in out
    assert "comparison with torch skipped" in out


def test_help_lists_the_options(tmp_path):
    r = run_demo(tmp_path, "--help")
    assert r.returncode == 0
    for opt in ("--batch", "--seq", "--d-model", "--heads", "--dtype",
                "--plot", "--seed"):
        assert opt in r.stdout


def test_bad_configuration_is_a_clear_error(tmp_path):
    r = run_demo(tmp_path, "--d-model", "10", "--heads", "3")
    assert r.returncode == 2
    assert "10" in r.stderr and "3" in r.stderr
    assert "Traceback" not in r.stderr
    r = run_demo(tmp_path, "--heads", "0")
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_without_torch(tmp_path):
    r = run_demo(tmp_path, "--seq", "3", "--d-model", "16", "--heads", "2",
                 hide=("torch",))
    assert r.returncode == 0, r.stderr
    assert "torch is not installed" in r.stdout
    assert "[2, 2, 3, 8]" in r.stdout


def test_plot_option(tmp_path):
    need("matplotlib")
    png = tmp_path / "out" / "heads.png"
    png.parent.mkdir()
    r = run_demo(tmp_path, "--no-torch", "--plot", str(png))
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert str(png) in r.stdout


def test_plot_without_matplotlib(tmp_path):
    r = run_demo(tmp_path, "--no-torch", "--seq", "3", "--d-model", "16",
                 "--heads", "2", "--plot", str(tmp_path / "x.png"),
                 hide=("matplotlib",))
    assert r.returncode == 1
    assert 'pip install "mha_ext[plot]"' in r.stderr
    assert "[2, 2, 3, 8]" in r.stdout              # the rest still ran
    assert not (tmp_path / "x.png").exists()


SMALL = ("--no-torch", "--seq", "3", "--d-model", "16", "--heads", "2")


def test_bad_values_are_short_errors_before_the_run(tmp_path):
    for args, words in [(("--threads", "257"), "at most 256"),
                        (("--plot", ""), "needs a file name"),
                        (("--plot", str(tmp_path / "nowhere" / "x.png")), "does not exist"),
                        # matplotlib would write heads.png, or a hidden .png in the folder
                        (("--plot", "heads"), "has no extension: name the format"),
                        (("--plot", str(tmp_path) + os.sep), "is a folder: give a file name"),
                        (("--plot", str(tmp_path)), "is a folder: give a file name"),
                        (("--d-model", "1000000000", "--heads", "1"), "more memory"),
                        (("--batch", "100000", "--seq", "100000"), "more memory"),
                        # past what an address counts: NumPy's "array is too big" before
                        (("--batch", "1000000000000000"), "more memory"),
                        # the configuration's own error first, however large the sizes
                        (("--d-model", "8", "--heads", "16", "--seq", "1000000000"),
                         "divisible")]:
        r = run_demo(tmp_path, *SMALL[:1], *args)
        assert r.returncode == 2, (args, r.stderr)
        assert words in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
        assert "shape flow" not in r.stdout, args


def test_threads_apply_without_torch(tmp_path):
    r = run_demo(tmp_path, *SMALL, "--threads", "1")
    assert r.returncode == 0, r.stderr
    code = ("import mha_ext.__main__ as d, mha_ext; d.main(%r); print('threads', "
            "mha_ext.get_num_threads())" % (list(SMALL) + ["--threads", "3"],))
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=PKG_ROOT, MPLBACKEND="Agg"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("threads 3"), r.stdout


def test_plot_to_an_unknown_format_is_a_message_before_the_run(tmp_path):
    # (it used to run the whole demo, torch's comparison included, first)
    need("matplotlib")
    r = run_demo(tmp_path, *SMALL, "--plot", str(tmp_path / "x.xyz"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "cannot write .xyz files; use one of:" in r.stderr and "png" in r.stderr
    assert "shape flow" not in r.stdout


def test_causal_plot_hatches_the_blocked_cells(tmp_path, monkeypatch):
    # the demo hands plot_heads the trace (its masks), not the bare weights
    need("matplotlib")
    import mha_ext
    import mha_ext.__main__ as demo
    seen = []
    monkeypatch.setattr(demo, "plot_heads", lambda w, **kw: seen.append(w) or _Fig())
    assert demo.main([*SMALL, "--causal", "--plot", str(tmp_path / "x.png")]) == 0
    assert isinstance(seen[0], mha_ext.Trace)


class _Fig:
    def savefig(self, path, **kw):
        Path(path).write_bytes(b"")


def test_a_broken_torch_skips_the_comparison(tmp_path):
    r = run_demo(tmp_path, *SMALL[1:], broken=("torch",))
    assert r.returncode == 0, r.stderr
    assert "torch could not be imported (OSError" in r.stdout


def test_a_terminal_that_cannot_write_the_shape_flows_characters(tmp_path):
    # an ASCII or latin-1 stream (PYTHONIOENCODING, a non-UTF-8 locale): the
    # table's ᵀ, √, → and · as "?", not a UnicodeEncodeError half way
    for encoding, shown in (("ascii", "Q?K?"), ("latin-1", "Q·K?")):
        r = run_demo(tmp_path, "--no-torch", env={"PYTHONIOENCODING": encoding},
                     encoding=encoding)
        assert r.returncode == 0, r.stderr
        assert "UnicodeEncodeError" not in r.stderr
        assert "parameters: 1,050,624" in r.stdout
        assert "Q·Kᵀ" not in r.stdout and shown in r.stdout, r.stdout


def test_a_plot_file_under_a_quoted_tilde_is_the_home_folders(tmp_path, monkeypatch):
    # "~/x.png" quoted reached the check as it is: "folder '~' does not exist"
    from mha_ext.__main__ import _plot_file
    monkeypatch.setenv("HOME", str(tmp_path))
    assert _plot_file("~/heads.png") == str(tmp_path / "heads.png")
    with pytest.raises(Exception, match="such as heads.png or heads.svg"):
        _plot_file("heads.")                    # not "heads..png"

