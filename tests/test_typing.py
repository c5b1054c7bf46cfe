"""A user's script type-checks under mypy --strict and pyright's strict mode
(issue 13, point 2): tests/typing/user_script.py against the mha_ext these
tests import (installed or built in place), checked for Python 3.10, the
oldest supported.

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
from _support import PKG_ROOT, need

SCRIPT = Path(__file__).resolve().parent / "typing" / "user_script.py"
INSTALLED = "site-packages" in Path(mha_ext.__file__).parts


def _pending_lines(tool):
    """The lines marked "# pending[...]" for this checker."""
    pending = set()
    for i, line in enumerate(SCRIPT.read_text().splitlines()):
        m = re.search(r"#\s*pending\[([a-z,]+)\]:", line)
        if m and tool in m.group(1).split(","):
            pending.add(i + 1)
    return pending


def _check(errors, tool):
    """Errors only on "pending" lines, and on each of them (see the script)."""
    pending = _pending_lines(tool.split()[0])
    unexpected = {ln: msg for ln, msg in errors.items() if ln not in pending}
    assert not unexpected, f"{tool} reports errors in the user script:\n" + "\n".join(
        f"  line {ln}: {msg}" for ln, msg in sorted(unexpected.items()))
    fixed = sorted(pending - set(errors))
    assert not fixed, (f"{tool} reports no error on lines {fixed} marked "
                       f"'# pending[{tool.split()[0]}]' in tests/typing/user_script.py: "
                       "remove the marker (the annotation has landed)")


@pytest.fixture()
def script(tmp_path):
    # a copy outside the source tree: the checkers must not find the source
    # folder by the script's location
    path = tmp_path / "user_script.py"
    shutil.copy(SCRIPT, path)
    return path


def _env():
    env = dict(os.environ)
    if not INSTALLED:     # built in place: put its folder on the path
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [PKG_ROOT, env.get("PYTHONPATH")]))
    return env


def test_user_script_runs(script):
    subprocess.run([sys.executable, str(script)], check=True, env=_env(),
                   cwd=str(script.parent), timeout=120)


def test_mypy_strict(script):
    need("mypy")
    env = _env()
    if not INSTALLED:
        env["MYPYPATH"] = PKG_ROOT
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent",
         "--python-version", "3.10", "--no-error-summary", "--show-error-codes",
         "--cache-dir", str(script.parent / ".mypy_cache"), script.name],
        cwd=str(script.parent), env=env, capture_output=True, text=True, timeout=300)
    errors = {}
    for line in proc.stdout.splitlines():
        m = re.match(r"user_script\.py:(\d+): error: (.*)", line)
        if m:
            errors.setdefault(int(m.group(1)), m.group(2))
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    assert (proc.returncode == 1) == bool(errors), proc.stdout + proc.stderr
    _check(errors, "mypy --strict")


def test_pyright_strict(script):
    need("basedpyright")
    exe = shutil.which("basedpyright", path=os.path.dirname(sys.executable))
    cmd = [exe] if exe else [sys.executable, "-m", "basedpyright"]
    config = script.parent / "pyrightconfig.json"
    config.write_text(json.dumps({"typeCheckingMode": "strict", "pythonVersion": "3.10"}))
    proc = subprocess.run(
        cmd + ["--pythonpath", sys.executable, "-p", str(config), "--outputjson", script.name],
        cwd=str(script.parent), env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.stdout.strip(), proc.stderr
    report = json.loads(proc.stdout)
    errors = {}
    for d in report["generalDiagnostics"]:
        if d["severity"] == "error":
            errors.setdefault(d["range"]["start"]["line"] + 1, d["message"])
    assert report["summary"]["filesAnalyzed"] == 1, report["summary"]
    _check(errors, "pyright strict")

