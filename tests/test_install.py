"""The README's commands at the repository root (issue 13, point 1): after
`pip install .` in a fresh venv, `python -m mha_ext`, `import mha_ext` and
the benchmarks work from the root, where the source folder mha_ext/ (with
no extension built in it) comes first on sys.path and shadows the installed
package.  mha_ext/__init__.py then hands over to the installed package of
the same version; without one it raises an ImportError that says what to do.

Slow (a venv and a build of the extension, about a minute): runs in CI, or
with MHA_EXT_SLOW_TESTS=1 (tests/conftest.py)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow

IGNORE = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", "*.so",
                                ".pytest_cache", ".hypothesis", ".mypy_cache", "*.o")


def run(cmd, cwd, timeout=600, check=True):
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "MHA_EXT_CFLAGS",
                        "LD_PRELOAD")}
    proc = subprocess.run(cmd, cwd=str(cwd), env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)
    if check:
        assert proc.returncode == 0, (f"{cmd} failed ({proc.returncode}):\n"
                                      f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """(python of a fresh venv, a copy of the repository without builds)."""
    if not (ROOT / "setup.py").exists():
        pytest.skip("not run from a source tree")
    tmp = tmp_path_factory.mktemp("install")
    repo = tmp / "repo"
    shutil.copytree(ROOT, repo, ignore=IGNORE)
    run([sys.executable, "-m", "venv", str(tmp / "venv")], tmp)
    return tmp / "venv" / "bin" / "python", repo


def test_root_without_build_or_install_says_what_to_do(fresh):
    python, repo = fresh
    proc = run([str(python), "-c", "import mha_ext"], repo, check=False)
    assert proc.returncode == 1
    assert "ImportError" in proc.stderr
    assert "pip install ." in proc.stderr, proc.stderr
    assert "python setup.py build_ext --inplace" in proc.stderr, proc.stderr


def test_readme_commands_from_the_root(fresh):
    python, repo = fresh
    run([str(python), "-m", "pip", "install", "-q", "."], repo)
    assert not list((repo / "mha_ext").glob("_core*.so"))   # nothing built in the tree

    # the README's demo command, at the root (torch is not in this venv)
    demo = run([str(python), "-m", "mha_ext", "--no-torch"], repo)
    assert "parameters: 1,050,624" in demo.stdout, demo.stdout

    # import at the root: the installed package, whose version is the metadata's
    info = run([str(python), "-c",
                "import importlib.metadata as md, mha_ext, numpy as np\n"
                "m = mha_ext.MultiHeadAttention(16, 2, seed=0)\n"
                "out, w = m(np.ones((1, 3, 16), np.float32))\n"
                "print(mha_ext.__file__)\n"
                "print(mha_ext.__version__, md.version('mha_ext'), out.shape)\n"], repo)
    where, versions = info.stdout.splitlines()
    assert "site-packages" in where and not where.startswith(str(repo)), where
    ours, installed, shape = versions.split(" ", 2)
    assert ours == installed, versions
    assert shape == "(1, 3, 16)"

    # the benchmarks put the root first on sys.path themselves
    for script in ("benchmarks/bench.py", "benchmarks/bench_backward.py"):
        assert "usage:" in run([str(python), script, "--help"], repo).stdout
    run([str(python), "-c", "import runpy, sys; sys.argv = ['bench.py', '--help']\n"
         "try:\n    runpy.run_path('benchmarks/bench.py', run_name='x')\n"
         "except SystemExit:\n    pass\n"
         "import mha_ext; print(mha_ext.MultiHeadAttention(8, 2))"], repo)


def test_root_with_another_installed_version_says_so(fresh):
    python, repo = fresh
    run([str(python), "-m", "pip", "install", "-q", "."], repo)
    init = repo / "mha_ext" / "__init__.py"
    text = init.read_text()
    init.write_text(text.replace('__version__ = "', '__version__ = "99.', 1))
    try:
        proc = run([str(python), "-c", "import mha_ext"], repo, check=False)
    finally:
        init.write_text(text)
    assert proc.returncode == 1
    assert "not this tree's 99." in proc.stderr, proc.stderr
    assert "pip install ." in proc.stderr


def test_root_with_an_installed_copy_of_older_sources_says_so(fresh):
    """The same version installed from other sources (the tree edited or
    pulled since `pip install .`): the tree's files would pair with other
    code, so the import is refused, naming the first file that differs."""
    python, repo = fresh
    run([str(python), "-m", "pip", "install", "-q", "."], repo)
    target = repo / "mha_ext" / "trace.py"
    text = target.read_text()
    target.write_text(text + "\n# edited after the install\n")
    try:
        proc = run([str(python), "-c", "import mha_ext"], repo, check=False)
    finally:
        target.write_text(text)
    assert proc.returncode == 1
    assert "installed from other sources (its trace.py is not this tree's)" in proc.stderr, \
        proc.stderr
    assert "pip install ." in proc.stderr
    ok = run([str(python), "-c", "import mha_ext; print(mha_ext.__file__)"], repo)
    assert "site-packages" in ok.stdout, ok.stdout
    # what pip does not install is not compared: hidden files (a copier's ._
    # file, an editor's lock), other folders; nor line endings
    extra = [repo / "mha_ext" / "._trace.py", repo / "mha_ext" / ".#trace.py",
             repo / "mha_ext" / "contrib" / "__init__.py"]
    extra[2].parent.mkdir()
    for p in extra:
        p.write_bytes(b"\x00\x01 not python")
    target.write_bytes(text.replace("\n", "\r\n").encode())
    try:
        ok = run([str(python), "-c", "import mha_ext; print(mha_ext.__file__)"], repo)
    finally:
        target.write_text(text)
        for p in extra:
            p.unlink()
        extra[2].parent.rmdir()
    assert "site-packages" in ok.stdout, ok.stdout


def test_notebook_kernel_at_the_root(fresh):
    """A notebook started at the root (its kernel's cwd, first on sys.path)
    gets the installed mha_ext.  The kernel is this Python's: it needs an
    installed mha_ext (CI: the README's `pip install ".[test]"`)."""
    from _support import need
    import mha_ext
    if "site-packages" not in Path(mha_ext.__file__).parts:
        pytest.skip("mha_ext is built in place here, not installed")
    nbformat = need("nbformat")
    nbclient = need("nbclient")
    need("ipykernel")
    _, repo = fresh
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_code_cell(
        "import os, mha_ext\nprint(os.getcwd())\nprint(mha_ext.__file__)\n"
        "print(mha_ext.MultiHeadAttention(8, 2).num_parameters)"))
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(repo)}}).execute()
    cwd, where, n = nb.cells[0].outputs[0]["text"].split()
    assert Path(cwd).resolve() == repo.resolve()
    assert Path(where).resolve() == Path(mha_ext.__file__).resolve()
    assert n == "288"
