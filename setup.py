"""Build the one extension, mha_ext._core, from src/*.c and mha_ext/*.c.

The flags stay portable: no tuning for the build machine and no fast-math
flags (those would break the -inf masks and NaN rows); the instruction set
is chosen at run time (src/isa.c).
MHA_EXT_CFLAGS adds flags (for example sanitizers in CI).
"""
import glob
import os
import shlex

import numpy
from setuptools import Extension, setup

extra_compile_args = ["-O3", "-std=c11", "-fno-strict-aliasing", "-Wall", "-Wextra",
                      "-Wno-unused-parameter", "-Wno-missing-field-initializers",
                      "-Wno-cast-function-type"]
extra_link_args = ["-lpthread", "-lm"]
extra = shlex.split(os.environ.get("MHA_EXT_CFLAGS", ""))
extra_compile_args += extra
extra_link_args += extra

sources = sorted(glob.glob("src/*.c")) + sorted(glob.glob("mha_ext/*.c"))

setup(
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
