"""Packaging (issue 13, point 5): one version, the sdist holds everything
the tests and docs need, the licence, and a clear error without a C
compiler."""
import importlib.machinery
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import mha_ext
from _support import need, required

ROOT = Path(__file__).resolve().parent.parent
SOURCE_TREE = (ROOT / "setup.py").exists()
needs_source = pytest.mark.skipif(not SOURCE_TREE, reason="not run from a source tree")
# setup.py's build_ext stops under NumPy 1 (the extension needs NumPy 2's
# headers; CI's Python 3.10 stage runs NumPy 1.25, where the module built by
# pip's build environment runs): the tests that run build_ext need NumPy 2
import numpy as np  # noqa: E402
needs_numpy_2 = pytest.mark.skipif(int(np.__version__.split(".")[0]) < 2,
                                   reason="building the extension needs NumPy 2 "
                                          "(setup.py says so under NumPy 1)")

# read by the tests or named in the README: an sdist without them fails
# its own tests (examples/tour.ipynb, tests/valgrind.supp, ...)
MUST_SHIP = ["LICENSE", "README.md", "pyproject.toml", "setup.py", "docs/API.md",
             "mha_ext/_core.pyi", "mha_ext/py.typed", "examples/tour.ipynb",
             "examples/train_copy.py", "tests/valgrind.supp", "tests/fuzz/run.sh",
             "tests/c/test_core.c", "tests/typing/user_script.py",
             "tests/typing/user_script_torch.py", "tests/typing/user_script_plot.py",
             "tests/typing/misuse.py", "tests/typing/stubtest_allowlist.txt",
             "benchmarks/fma_probe.c", "benchmarks/bench.py", "benchmarks/RESULTS.md"]


def _setuptools():
    """setup.py run directly needs the setuptools of build-system.requires
    (77: the SPDX licence); the test extras install it."""
    need("setuptools")
    import setuptools
    if int(setuptools.__version__.split(".")[0]) < 77:
        if required("setuptools"):
            pytest.fail(f"setuptools>=77 is required, got {setuptools.__version__}")
        pytest.skip(f"setuptools>=77 is needed, got {setuptools.__version__}")


def _repo_copy(tmp_path):
    """A copy of the source tree without git or build products, to build in
    (an sdist writes mha_ext.egg-info, build_ext a .so)."""
    repo = tmp_path / "repo"
    shutil.copytree(ROOT, repo, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.so", "*.egg-info", "__pycache__"))
    return repo


def _installed_dist():
    """The distribution whose files hold the imported mha_ext, or None (an
    in-place build)."""
    here = Path(mha_ext.__file__).resolve()
    for dist in importlib.metadata.distributions(name="mha_ext"):
        for f in dist.files or ():
            if f.name == "__init__.py" and Path(dist.locate_file(f)).resolve() == here:
                return dist
    return None


def test_version_is_the_installed_metadata():
    assert re.fullmatch(r"\d+\.\d+\.\d+", mha_ext.__version__)
    dist = _installed_dist()
    if dist is None:
        pytest.skip("mha_ext is built in place, not installed")
    assert dist.version == mha_ext.__version__
    assert dist.metadata["License-Expression"] == "MIT"
    assert dist.metadata["Requires-Python"] == ">=3.10"


@needs_source
def test_version_has_one_source():
    """pyproject.toml takes the version from mha_ext/__init__.py."""
    text = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in text
    assert 'version = {attr = "mha_ext.__version__"}' in text
    assert not re.search(r'^version\s*=\s*"', text, re.M)


@needs_source
def test_sdist_holds_what_the_tests_read(tmp_path):
    _setuptools()
    repo = _repo_copy(tmp_path)
    proc = subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path)],
                          cwd=str(repo), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (sdist,) = tmp_path.glob("mha_ext-*.tar.gz")
    assert sdist.name == f"mha_ext-{mha_ext.__version__}.tar.gz"
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    missing = [f for f in MUST_SHIP if f not in names]
    assert not missing, missing
    # and every tracked file but CI's own
    if shutil.which("git") and (ROOT / ".git").exists():
        tracked = subprocess.run(["git", "ls-files"], cwd=str(ROOT), capture_output=True,
                                 text=True).stdout.split()
        left_out = [f for f in tracked
                    if not f.startswith(".ci/") and not f.endswith(".gitignore")
                    and f not in names]
        assert not left_out, left_out


def test_license_file_is_mit():
    if SOURCE_TREE:
        text = (ROOT / "LICENSE").read_text()
    else:
        dist = _installed_dist()
        if dist is None:
            pytest.skip("neither a source tree nor an installed mha_ext")
        lic = [f for f in dist.files if f.name == "LICENSE"]
        assert lic, "the wheel does not ship LICENSE"
        text = Path(dist.locate_file(lic[0])).read_text()
    assert text.startswith("MIT License")
    assert "Copyright (c) 2026 the mha_ext authors" in text


@needs_source
def test_build_without_a_compiler_says_so(tmp_path):
    """No C compiler: the build stops with a message that says a C compiler
    is needed, not with the compiler's own error."""
    _setuptools()
    repo = _repo_copy(tmp_path)
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"))
    env.pop("MHA_EXT_CFLAGS", None)
    proc = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"],
                          cwd=str(repo), env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "needs a working C compiler" in proc.stderr, proc.stderr[-3000:]
    assert "no-such-cc" in proc.stderr
    assert not list((repo / "mha_ext").glob("_core*.so"))


@needs_source
def test_explorer_assets_are_package_data_without_warnings(tmp_path):
    """mha_ext/_html (the explorer's JavaScript and CSS) is declared as a
    package of data: build_py copies it into the build, and setuptools
    does not print its 'Package would be ignored' warning at every
    `pip install .` (a newcomer's first sight of the project)."""
    _setuptools()
    repo = _repo_copy(tmp_path)
    out = tmp_path / "lib"
    proc = subprocess.run([sys.executable, "setup.py", "build_py", "-d", str(out)],
                          cwd=str(repo), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout + proc.stderr
    assert "would be ignored" not in text and "absent from the `packages`" not in text, \
        text[-3000:]
    for name in ("explorer.js", "explorer.css"):
        assert (out / "mha_ext" / "_html" / name).is_file(), name
    assert (out / "mha_ext" / "_core.pyi").is_file()
    assert (out / "mha_ext" / "py.typed").is_file()


FAKE_CC = """#!/bin/sh
# a compiler that only records its calls and makes each -o file
echo "$@" >> "$(dirname "$0")/calls.log"
out=""; prev=""
for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done
[ -n "$out" ] && mkdir -p "$(dirname "$out")" && : > "$out"
exit 0
"""


@needs_source
@needs_numpy_2
def test_a_build_with_another_compiler_flags_or_amx_choice_builds_again(tmp_path):
    """pip builds in the tree's build/ (as setup.py build_ext does):
    setuptools alone rebuilds only for newer files, so a second `pip install
    .` with MHA_EXT_NO_AMX=1, another CC or MHA_EXT_CFLAGS kept the first
    build.  A compiler that records its calls shows what is compiled."""
    _setuptools()
    repo = _repo_copy(tmp_path)
    cc = tmp_path / "cc"
    cc.write_text(FAKE_CC)
    cc.chmod(0o755)
    log = tmp_path / "calls.log"

    def build(*options, **env):
        log.write_text("")
        e = {k: v for k, v in os.environ.items() if k not in ("MHA_EXT_CFLAGS", "MHA_EXT_NO_AMX")}
        proc = subprocess.run([sys.executable, "setup.py", "build_ext", *options], cwd=str(repo),
                              env=dict(e, CC=str(cc), LDSHARED="%s -shared" % cc, **env),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [line for line in log.read_text().splitlines() if "src/mha.c" in line]

    assert len(build()) == 1                        # the first build compiles
    assert build() == []                            # the same again: up to date
    again = build(MHA_EXT_NO_AMX="1")               # the AMX kernels left out
    assert len(again) == 1 and "-DMHA_NO_AMX" in again[0], again
    assert build(MHA_EXT_NO_AMX="1") == []
    flags = build(MHA_EXT_NO_AMX="1", MHA_EXT_CFLAGS="-DMHA_TIMING")
    assert len(flags) == 1 and "-DMHA_TIMING" in flags[0], flags
    # build_ext's own options (-D, --debug, ...) as well
    defined = build("-D", "MHA_SOMETHING", MHA_EXT_NO_AMX="1", MHA_EXT_CFLAGS="-DMHA_TIMING")
    assert len(defined) == 1 and "-DMHA_SOMETHING" in defined[0], defined
    assert build("-D", "MHA_SOMETHING", MHA_EXT_NO_AMX="1", MHA_EXT_CFLAGS="-DMHA_TIMING") == []


@needs_source
def test_build_py_drops_what_the_tree_no_longer_has(tmp_path):
    """A module deleted from the tree since the last build is not installed
    again from build/lib (the built extension there stays)."""
    _setuptools()
    repo = _repo_copy(tmp_path)
    out = tmp_path / "lib"
    extra = repo / "mha_ext" / "_gone_since.py"

    def build_py():
        proc = subprocess.run([sys.executable, "setup.py", "build_py", "-d", str(out)],
                              cwd=str(repo), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]

    extra.write_text("X = 1\n")
    build_py()
    assert (out / "mha_ext" / "_gone_since.py").is_file()
    built = out / "mha_ext" / ("_core" + importlib.machinery.EXTENSION_SUFFIXES[0])
    built.write_bytes(b"")                          # as build_ext leaves it
    extra.unlink()
    build_py()
    assert not (out / "mha_ext" / "_gone_since.py").exists()
    assert built.exists() and (out / "mha_ext" / "module.py").is_file()


@needs_source
def test_the_wheels_package_holds_stubs_and_assets_not_the_binding_sources(tmp_path):
    """build_py (what the wheel gets besides the extension): the stubs, the
    explorer's assets and every module; the binding's C sources stay in the
    sdist, to build from."""
    _setuptools()
    out = tmp_path / "lib"
    proc = subprocess.run([sys.executable, "setup.py", "build_py", "-d", str(out)],
                          cwd=str(_repo_copy(tmp_path)), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pkg = out / "mha_ext"
    shipped = {p.relative_to(pkg).as_posix() for p in pkg.rglob("*") if p.is_file()}
    assert {"_core.pyi", "py.typed", "_html/explorer.js", "_html/explorer.css",
            "__init__.py", "trace.py"} <= shipped, sorted(shipped)
    sources = sorted(n for n in shipped if n.endswith((".c", ".h")))
    assert not sources, sources


@needs_source
def test_setup_py_without_numpy_or_setuptools_77_says_what_to_install(tmp_path):
    # a fresh venv has neither (3.11's bundles setuptools 65: its error on
    # the SPDX licence is 70 lines of schema; NumPy: a bare import error)
    repo = _repo_copy(tmp_path)
    fake = tmp_path / "fake"
    (fake / "numpy").mkdir(parents=True)
    (fake / "numpy" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n")
    proc = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"],
                          cwd=str(repo), capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(fake)))
    assert proc.returncode != 0
    assert "needs NumPy and setuptools 77 or newer" in proc.stderr, proc.stderr[-3000:]
    assert "found NumPy none" in proc.stderr
    assert 'pip install "numpy>=2" "setuptools>=77"' in proc.stderr
    # NumPy 1: the extension needs NumPy 2's headers (a build under 1.26
    # "succeeded" with a module whose import failed on an undefined symbol)
    (fake / "numpy" / "__init__.py").write_text("__version__ = '1.26.4'\n"
                                                "def get_include():\n    return '.'\n")
    proc = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"],
                          cwd=str(repo), capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(fake)))
    assert proc.returncode != 0
    assert "needs NumPy 2 or newer" in proc.stderr and "found NumPy 1.26.4" in proc.stderr, \
        proc.stderr[-3000:]
    assert not list((repo / "mha_ext").glob("_core*.so"))


FINDER = """
import importlib.machinery, importlib.util, sys
class Editable:  # as setuptools' editable finder: it answers for mha_ext._core too
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name == "mha_ext._core":
            return importlib.util.spec_from_file_location(name, %r)
        return None
sys.meta_path.append(Editable)
try:
    import mha_ext
except ImportError as exc:
    print("ImportError:", exc)
else:
    print("imported", mha_ext.__file__, mha_ext._core.__file__)
"""


LONE_TREE = """
import os, sys
# this tree alone: no folder that holds another mha_ext (site-packages, the
# team's tree), so no installed package to hand over to
sys.path[:] = [os.getcwd()] + [p for p in sys.path
                               if p and not os.path.exists(os.path.join(p, "mha_ext"))]
try:
    import mha_ext
except ImportError as exc:
    print("ImportError:", exc)
"""


def test_a_tree_without_a_build_and_nothing_installed_says_how_to_build(tmp_path):
    # the handover's search ran into an UnboundLocalError ("importlib") once
    # its metadata import moved into the function: a newcomer's first import
    tree = tmp_path / "lone"
    shutil.copytree(Path(mha_ext.__file__).parent, tree / "mha_ext",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    proc = subprocess.run([sys.executable, "-c", LONE_TREE], cwd=str(tree),
                          capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ImportError: mha_ext's C extension (mha_ext._core) is not "
                                  "built in %s and no installed mha_ext was found"
                                  % (tree / "mha_ext")), proc.stdout
    assert "pip install ." in proc.stdout and "build_ext --inplace" in proc.stdout


def test_another_trees_extension_found_by_an_editable_install_is_refused(tmp_path):
    """A tree without a build, with another tree's editable install: its
    finder gives that tree's mha_ext._core, which would run under this
    tree's Python files unchecked (an edit or a pull apart)."""
    built = Path(mha_ext._core.__file__)
    tree = tmp_path / "other"
    shutil.copytree(Path(mha_ext.__file__).parent, tree / "mha_ext",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    proc = subprocess.run([sys.executable, "-c", FINDER % str(built)], cwd=str(tree),
                          capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ImportError: mha_ext's C extension is not built in the "
                                  "source tree %s" % (tree / "mha_ext")), proc.stdout
    assert "another tree's (an editable install" in proc.stdout
