"""Build the one extension, mha_ext._core, from src/*.c and mha_ext/*.c.

The flags stay portable: no tuning for the build machine and no fast-math
flags (those would break the -inf masks and NaN rows); the instruction set
is chosen at run time (src/isa.c).
MHA_EXT_CFLAGS adds flags (for example sanitizers in CI).  The AMX kernels
(src/amx_impl.h, src/amx_cut_impl.h) are built when a probe with the tile
instructions compiles (gcc 11 / clang 12 and binutils 2.36), else left out;
MHA_EXT_NO_AMX=1 leaves them out.

A C compiler is required (gcc or clang; CC selects another): build_ext
first compiles an empty C file and, if that fails, stops with a message
saying so instead of the compiler's own error.
"""
import glob
import os
import shlex
import tempfile

import numpy
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

NO_COMPILER = """\
mha_ext is a C extension: building it needs a working C compiler (gcc or
clang; the CC environment variable picks another), and {cc!r} could not
compile an empty C file ({error}).
On Debian/Ubuntu: apt-get install gcc python3-dev; on Fedora: dnf install gcc
python3-devel; on macOS: xcode-select --install.  Then run the install again."""


AMX_PROBE = """\
#include <immintrin.h>
__attribute__((target("avx512f,avx512bw,amx-tile,amx-bf16")))
void mha_ext_amx_probe(const void *cfg, float *c)
{
    _tile_loadconfig(cfg);
    _tile_zero(0);
    _tile_dpbf16ps(0, 1, 2);
    _tile_stored(0, c, 64);
    _tile_release();
}
"""


class build_ext_checked(build_ext):
    """build_ext that says so when there is no usable C compiler."""

    def build_extensions(self):
        cc = (getattr(self.compiler, "compiler_so", None) or ["cc"])[0]
        with tempfile.TemporaryDirectory() as tmp:
            probe = os.path.join(tmp, "mha_ext_probe.c")
            with open(probe, "w") as f:
                f.write("int mha_ext_probe(void) { return 0; }\n")
            try:
                self.compiler.compile([probe], output_dir=tmp)
            except Exception as exc:  # CompileError, ExecError, OSError...
                message = NO_COMPILER.format(cc=cc, error=str(exc).strip() or
                                             type(exc).__name__)
                raise SystemExit("error: " + message) from None
        # AMX (src/amx_impl.h): a compiler and assembler that know the tile
        # instructions, else the build leaves them out (MHA_EXT_NO_AMX=1 too)
        with tempfile.TemporaryDirectory() as tmp:
            probe = os.path.join(tmp, "mha_ext_amx.c")
            with open(probe, "w") as f:
                f.write(AMX_PROBE)
            try:
                if os.environ.get("MHA_EXT_NO_AMX", "0") not in ("", "0"):
                    raise RuntimeError("MHA_EXT_NO_AMX")
                self.compiler.compile([probe], output_dir=tmp)
            except Exception:
                for ext in self.extensions:
                    ext.define_macros.append(("MHA_NO_AMX", None))
        super().build_extensions()

extra_compile_args = ["-O3", "-std=c11", "-fno-strict-aliasing", "-Wall", "-Wextra",
                      "-Wno-unused-parameter", "-Wno-missing-field-initializers",
                      "-Wno-cast-function-type"]
extra_link_args = ["-lpthread", "-lm"]
extra = shlex.split(os.environ.get("MHA_EXT_CFLAGS", ""))
extra_compile_args += extra
extra_link_args += extra

sources = sorted(glob.glob("src/*.c")) + sorted(glob.glob("mha_ext/*.c"))

setup(
    cmdclass={"build_ext": build_ext_checked},
    ext_modules=[
        Extension(
            "mha_ext._core",
            sources=sources,
            include_dirs=["src", numpy.get_include()],
            define_macros=[("_GNU_SOURCE", None)],
            extra_compile_args=extra_compile_args,
            extra_link_args=extra_link_args,
            depends=sorted(glob.glob("src/*.h")) + sorted(glob.glob("mha_ext/*.h")),
        )
    ],
)
