"""Build of the C engine ``mtc_loader._engine``; metadata lives in setup.cfg.

Environment switches:
  MTC_SANITIZE=address   build the extension with -fsanitize=address,undefined
  MTC_SANITIZE=thread    build it with -fsanitize=thread
  MTC_DEBUG=1            -O0 -g and the engine's invariant checks (mtc_*_valid) on hot paths
  MTC_NVTX_INCLUDE=DIR   where the nvtx3 headers are (default: the nvidia-nvtx-cu12 package, a
                         build requirement in pyproject.toml, else a CUDA toolkit's include dir)
"""
import glob
import importlib.util
import os

import numpy
from setuptools import Extension, setup

sources = sorted(glob.glob("csrc/*.c"))
extra_compile = ["-std=c11", "-O2", "-g", "-Wall", "-Wextra", "-Wno-unused-parameter",
                 "-Wno-missing-field-initializers", "-fvisibility=hidden", "-D_GNU_SOURCE"]
extra_link = ["-pthread", "-ldl"]
define_macros = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]


def nvtx_include():
    """The directory holding nvtx3/nvToolsExt.h (NVTX v3 is header-only), or None."""
    candidates = [os.environ.get("MTC_NVTX_INCLUDE", "")]
    try:
        spec = importlib.util.find_spec("nvidia.nvtx")
    except ImportError:
        spec = None
    if spec is not None:
        candidates += [os.path.join(d, "include") for d in spec.submodule_search_locations or []]
    candidates += [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "include")]
    for d in candidates:
        if d and os.path.exists(os.path.join(d, "nvtx3", "nvToolsExt.h")):
            return d
    return None


include_dirs = ["csrc", numpy.get_include()]
nvtx_dir = nvtx_include()
if nvtx_dir:
    include_dirs.append(nvtx_dir)
    define_macros.append(("MTC_HAVE_NVTX", "1"))
else:
    print("mtc_loader: no nvtx3 headers found (pip install nvidia-nvtx-cu12, or MTC_NVTX_INCLUDE=DIR): "
          "building without NVTX ranges")

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
            include_dirs=include_dirs,
            define_macros=define_macros,
            extra_compile_args=extra_compile,
            extra_link_args=extra_link,
        )
    ],
)
