"""Build of the C engine ``mtc_loader._engine``; metadata lives in setup.cfg.

Environment switches:
  MTC_SANITIZE=address   build the extension with -fsanitize=address,undefined
  MTC_SANITIZE=thread    build it with -fsanitize=thread
  MTC_DEBUG=1            -O0 -g and the engine's invariant checks (mtc_*_valid) on hot paths
"""
import glob
import os

import numpy
from setuptools import Extension, setup

sources = sorted(glob.glob("csrc/*.c"))
extra_compile = ["-std=c11", "-O2", "-g", "-Wall", "-Wextra", "-Wno-unused-parameter",
                 "-Wno-missing-field-initializers", "-fvisibility=hidden", "-D_GNU_SOURCE"]
extra_link = ["-pthread", "-ldl"]
define_macros = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]

sanitize = os.environ.get("MTC_SANITIZE", "").strip()
if sanitize:
    flags = {"address": "-fsanitize=address,undefined", "thread": "-fsanitize=thread"}[sanitize]
    extra_compile += [flags, "-fno-omit-frame-pointer", "-O1"]
    extra_link += [flags]
if os.environ.get("MTC_DEBUG"):
    extra_compile += ["-O0", "-UNDEBUG"]
    define_macros.append(("MTC_DEBUG", "1"))

setup(
    ext_modules=[
        Extension(
            "mtc_loader._engine",
            sources=sources,
            include_dirs=["csrc", numpy.get_include()],
            define_macros=define_macros,
            extra_compile_args=extra_compile,
            extra_link_args=extra_link,
        )
    ],
)
