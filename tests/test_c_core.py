"""Build and run the C core's own tests (tests/c/test_*.c, one program each)
against src/.

They need no Python or NumPy: a hand-computed case, masks, float32 against
float64, the fast forward against the reference on every instruction set,
the vector exp over its whole negative range (defect 4), the poll hook (stop
-> MHA_ERR_INTERRUPTED, then a normal call), size overflow as a status
(test_core.c); the fast backward against mha_backward_ref on every
instruction set and the reference backward against finite differences
(test_backward.c); the saved path (mha_forward_save's
kept projections, P and copies, mha_backward_saved, the masked scores'
gradient of every backward: test_saved.c); the options of issue 12 on the
module path: lower-right causal alignment, the scale override, add_bias_kv
and add_zero_attn, fast against reference and the reference against finite
differences (test_options.c); the attention entry point on projected heads,
mha_sdpa_forward / mha_sdpa_backward with GQA, Dv != D, both alignments,
masks, dropout, S = 0, L = 0 (test_sdpa.c); grouped-query attention on the
module path against the reference, forward and backward, and the key/value
cache: chunked decoding bit-identical to the full causal call, bad caches
as statuses (test_cache.c).  With MHA_EXT_CFLAGS (the CI's sanitizer stage)
they are built with those flags too.
"""
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SRC = ROOT / "src"


PROGRAMS = ["test_core", "test_backward", "test_saved", "test_options", "test_sdpa", "test_cache"]


@pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")
@pytest.mark.parametrize("program", PROGRAMS)
def test_c_core(tmp_path, program):
    if not SRC.is_dir():
        pytest.skip("src/ is not next to the tests (installed without sources)")
    cc = os.environ.get("CC", "cc")
    exe = tmp_path / program
    sources = sorted(str(p) for p in SRC.glob("*.c")) + [str(ROOT / "tests" / "c" / f"{program}.c")]
    flags = os.environ.get("MHA_EXT_CFLAGS", "").split()
    cmd = [cc, "-O2", "-std=c11", "-D_GNU_SOURCE", "-Wall", "-Wextra", "-Werror",
           "-Wno-unused-parameter", "-Wno-missing-field-initializers",
           f"-I{SRC}", *flags, *sources, "-o", str(exe), "-lm", "-lpthread"]
    build = subprocess.run(cmd, capture_output=True, text=True)
    assert build.returncode == 0, build.stdout + build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    sys.stdout.write(run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr
    assert " 0 failed" in run.stdout


def test_every_c_program_runs():
    """A new tests/c/test_*.c is run too: it must be listed in PROGRAMS."""
    found = sorted(p.stem for p in (ROOT / "tests" / "c").glob("test_*.c"))
    assert found == sorted(PROGRAMS)
