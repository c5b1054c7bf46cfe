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

pip builds in the tree (its build/ folder), as `setup.py build_ext` does:
build_ext rebuilds when the compiler, its flags or the AMX choice differ
from the last build's (setuptools alone looks only at the files' times, so
MHA_EXT_NO_AMX=1, CC or MHA_EXT_CFLAGS would not reach a second `pip install
.`), and build_py first removes from build/lib the package files the tree no
longer has (a module deleted since would be installed again).
"""
import glob
import importlib.machinery
import os
import shlex
import tempfile

import setuptools

try:
    import numpy
except ModuleNotFoundError:
    numpy = None
if numpy is None or int(setuptools.__version__.split(".")[0]) < 77:
    # (pip install . fetches both into its build environment: pyproject.toml,
    # NumPy 2 there; setup.py run directly takes this Python's NumPy)
    raise SystemExit("error: building mha_ext in place needs NumPy and setuptools 77 or "
                     "newer in this Python (found NumPy %s, setuptools %s): pip install "
                     "\"numpy>=2\" \"setuptools>=77\", then run it again"
                     % (getattr(numpy, "__version__", "none"), setuptools.__version__))

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

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
        # the extension itself needs NumPy 2's headers (PyArray_ImportNumPyAPI):
        # under NumPy 1 the compiler warns of an implicit declaration and the
        # build "succeeds" with a module that cannot be imported (sdist and
        # build_py run under any NumPy: CI builds the sdist under NumPy 1.25).
        # Checked after the compiler: without one, that is the first thing to say
        if int(numpy.__version__.split(".")[0]) < 2:
            raise SystemExit("error: building mha_ext's extension needs NumPy 2 or newer "
                             "(its headers; the built module then runs on NumPy 1.25 and "
                             "newer), found NumPy %s: pip install \"numpy>=2\", then run "
                             "it again" % numpy.__version__)
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
        # what the objects depend on besides the files: another compiler,
        # flags or AMX choice than the last build's forces a rebuild
        # (NumPy by its version: pip's build environment is a new folder each time)
        # (and build_ext's own options: -D, -U, -I, -l, -L, --rpath, --debug)
        config = repr((self.compiler.compiler_so, self.compiler.linker_so, numpy.__version__,
                       [(e.define_macros, e.extra_compile_args, e.extra_link_args)
                        for e in self.extensions],
                       self.define, self.undef, self.include_dirs, self.libraries,
                       self.library_dirs, self.rpath, self.debug))
        stamp = os.path.join(self.build_temp, "mha_ext-build-config.txt")
        try:
            with open(stamp) as f:
                self.force = self.force or f.read() != config
        except OSError:
            self.force = True
        super().build_extensions()
        os.makedirs(self.build_temp, exist_ok=True)
        with open(stamp, "w") as f:
            f.write(config)


class build_py_pruned(build_py):
    """build_py that first removes from build/lib's mha_ext the files the
    tree's mha_ext no longer has (build_ext's extension stays: its own
    check decides whether to rebuild it)."""

    def run(self):
        pkg = os.path.join(self.build_lib, "mha_ext")
        built = tuple(importlib.machinery.EXTENSION_SUFFIXES)
        for root, _, files in os.walk(pkg):
            for name in files:
                rel = os.path.relpath(os.path.join(root, name), pkg)
                if not os.path.exists(os.path.join("mha_ext", rel)) and \
                        not (rel.startswith("_core") and rel.endswith(built)):
                    os.remove(os.path.join(root, name))
        super().run()

extra_compile_args = ["-O3", "-std=c11", "-fno-strict-aliasing", "-Wall", "-Wextra",
                      "-Wno-unused-parameter", "-Wno-missing-field-initializers",
                      "-Wno-cast-function-type"]
extra_link_args = ["-lpthread", "-lm"]
extra = shlex.split(os.environ.get("MHA_EXT_CFLAGS", ""))
extra_compile_args += extra
extra_link_args += extra

sources = sorted(glob.glob("src/*.c")) + sorted(glob.glob("mha_ext/*.c"))

setup(
    cmdclass={"build_ext": build_ext_checked, "build_py": build_py_pruned},
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
