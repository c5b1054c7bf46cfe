"""A user's script type-checks under mypy --strict and pyright's strict mode
(issue 13, point 2): the scripts in tests/typing against the mha_ext these
tests import (installed or built in place), checked for Python 3.10, the
oldest supported.

  user_script.py        NumPy only: no error but on lines marked
                        "# pending[checkers]: ..." (known gaps), and one on each
  user_script_torch.py  the same with torch (skipped without torch)
  user_script_plot.py   the same with matplotlib (skipped without it)
  misuse.py             an error on each line marked "# error[checkers]: ..."
                        (misspelt keywords, ...) and nowhere else

Both user scripts also run.  mypy.stubtest checks the package's
annotations and the extension's stub against what runs.

pyright comes as basedpyright (the `typecheck` extra), which packages
pyright's engine with its own Node.js and fetches nothing at run time; its
strict mode is pyright's.  Both checkers are optional dependencies: a skip
on a developer machine, a failure in CI (tests/_support.py)."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import mha_ext
from _support import PKG_ROOT, has, need

HERE = Path(__file__).resolve().parent / "typing"
INSTALLED = "site-packages" in Path(mha_ext.__file__).parts
# script -> the optional package it needs besides mha_ext
SCRIPTS = {"user_script.py": None, "user_script_torch.py": "torch",
           "user_script_plot.py": "matplotlib", "misuse.py": None}
RUN = ["user_script.py", "user_script_torch.py", "user_script_plot.py"]
ALLOWLIST = HERE / "stubtest_allowlist.txt"


def _marked_lines(name, tool):
    """{line: marker} of the lines marked "# pending[...]:" or "# error[...]:"
    for this checker: each must have an error."""
    marked = {}
    for i, line in enumerate((HERE / name).read_text().splitlines()):
        m = re.search(r"#\s*(pending|error)\[([a-z,]+)\]:", line)
        if m and tool in m.group(2).split(","):
            marked[i + 1] = m.group(1)
    return marked


def _check(errors, name, tool):
    """Errors exactly on the marked lines of script `name` (see above)."""
    marked = _marked_lines(name, tool.split()[0])
    unexpected = {ln: msg for ln, msg in errors.items() if ln not in marked}
    assert not unexpected, f"{tool} reports errors in {name}:\n" + "\n".join(
        f"  line {ln}: {msg}" for ln, msg in sorted(unexpected.items()))
    fixed = sorted(ln for ln, kind in marked.items() if kind == "pending" and ln not in errors)
    assert not fixed, (f"{tool} reports no error on lines {fixed} marked "
                       f"'# pending[{tool.split()[0]}]' in tests/typing/{name}: "
                       "remove the marker (the annotation has landed)")
    missed = sorted(ln for ln, kind in marked.items() if kind == "error" and ln not in errors)
    assert not missed, (f"{tool} accepts the misuse on lines {missed} of "
                        f"tests/typing/{name}: an annotation lets it through")


@pytest.fixture(scope="module")
def scripts(tmp_path_factory):
    """Copies of the scripts this machine can check (torch's with torch, ...),
    outside the source tree: the checkers must not find the source folder
    by a script's location."""
    folder = tmp_path_factory.mktemp("typing")
    for name, needs in SCRIPTS.items():
        if needs is None or has(needs):
            shutil.copy(HERE / name, folder / name)
    return folder


def _env():
    env = dict(os.environ)
    if not INSTALLED:     # built in place: put its folder on the path
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [PKG_ROOT, env.get("PYTHONPATH")]))
    return env


def _mypy_env():
    env = _env()
    if not INSTALLED:
        env["MYPYPATH"] = PKG_ROOT
    return env


def _run_mypy(folder):
    """mypy --strict on every script in folder: {script: {line: message}}."""
    names = sorted(p.name for p in folder.glob("*.py"))
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent",
         "--python-version", "3.10", "--no-error-summary", "--show-error-codes",
         "--cache-dir", str(folder / ".mypy_cache")] + names,
        cwd=str(folder), env=_mypy_env(), capture_output=True, text=True, timeout=600)
    errors = {name: {} for name in names}
    for line in proc.stdout.splitlines():
        m = re.match(r"([\w.]+\.py):(\d+): error: (.*)", line)
        if m:
            errors[m.group(1)].setdefault(int(m.group(2)), m.group(3))
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    assert (proc.returncode == 1) == any(errors.values()), proc.stdout + proc.stderr
    return errors


def _run_pyright(folder):
    """basedpyright in strict mode on every script in folder: {script:
    {line: message}}."""
    names = sorted(p.name for p in folder.glob("*.py"))
    exe = shutil.which("basedpyright", path=os.path.dirname(sys.executable))
    cmd = [exe] if exe else [sys.executable, "-m", "basedpyright"]
    config = folder / "pyrightconfig.json"
    config.write_text(json.dumps({"typeCheckingMode": "strict", "pythonVersion": "3.10"}))
    proc = subprocess.run(
        cmd + ["--pythonpath", sys.executable, "-p", str(config), "--outputjson"] + names,
        cwd=str(folder), env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.stdout.strip(), proc.stderr
    report = json.loads(proc.stdout)
    errors = {name: {} for name in names}
    for d in report["generalDiagnostics"]:
        if d["severity"] == "error":
            errors[Path(d["file"]).name].setdefault(d["range"]["start"]["line"] + 1,
                                                    d["message"])
    assert report["summary"]["filesAnalyzed"] == len(names), report["summary"]
    return errors


@pytest.fixture(scope="module")
def mypy_errors(scripts):
    need("mypy")
    return _run_mypy(scripts)


@pytest.fixture(scope="module")
def pyright_errors(scripts):
    need("basedpyright")
    return _run_pyright(scripts)


def _need_for(name):
    if SCRIPTS[name] is not None:
        need(SCRIPTS[name])


@pytest.mark.parametrize("name", RUN)
def test_user_script_runs(name, tmp_path):
    _need_for(name)
    shutil.copy(HERE / name, tmp_path / name)
    subprocess.run([sys.executable, name], check=True, env=_env(), cwd=str(tmp_path),
                   timeout=300)


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_mypy_strict(name, mypy_errors):
    _need_for(name)
    _check(mypy_errors[name], name, "mypy --strict")


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_pyright_strict(name, pyright_errors):
    _need_for(name)
    _check(pyright_errors[name], name, "pyright strict")


def test_stubtest(tmp_path):
    """The package's annotations and mha_ext/_core.pyi agree with what runs
    (signatures, defaults, what exists), but for the entries of
    tests/typing/stubtest_allowlist.txt, each with its reason."""
    need("mypy")
    need("torch")        # stubtest imports every submodule: mha_ext.torch too
    proc = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "mha_ext", "--allowlist", str(ALLOWLIST),
         "--mypy-config-file", os.devnull],
        cwd=str(tmp_path), env=_mypy_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
