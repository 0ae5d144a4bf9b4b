"""Build of the C engine ``mtc_loader._engine``; metadata lives in setup.cfg.

Environment switches:
  MTC_SANITIZE=address   build the extension with -fsanitize=address,undefined
  MTC_SANITIZE=thread    build it with -fsanitize=thread
  MTC_DEBUG=1            -O0 -g and the engine's invariant checks (mtc_*_valid) on hot paths
  MTC_NVTX_INCLUDE=DIR   where the nvtx3 headers are (default: csrc/third_party, NVIDIA's NVTX v3
                         headers vendored with the source, Apache-2.0 WITH LLVM-exception)
  MTC_NO_LIBURING=1      build without liburing even where it is installed (FileTensor reads
                         then use pread on helper threads)
  MTC_REQUIRE_LIBURING=1 fail the build where liburing is not found, rather than build the
                         pread path
  MTC_LIBURING_PREFIX=D  take liburing from D/include (liburing.h, liburing/) and D/lib/liburing.a
                         (a copy of Debian's liburing-dev files, for a machine without it)

liburing (Debian: liburing-dev) is found with pkg-config, or by its header and library in the
compiler's default paths; without it the build still succeeds and file reads use pread. Where
its static library is there (Debian ships liburing.a, position-independent), it is linked in
statically with its symbols kept private, so the extension needs no liburing at run time (it
can be carried to a machine that lacks it). The build prints which reader it built in one line
that starts with "mtc_loader: FileTensor reads:" (pip shows it with `pip install -v`); at run
time, mtc_loader.file_reader() says which one a process uses, and why.
"""
import glob
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile

import numpy
from setuptools import Extension, setup

# Build switches are read whole, as the engine reads its run-time variables (csrc/engine/env.c): a value
# that is not one the switch takes stops the build with a message naming it, rather than
# building something other than what was asked for.
_YES, _NO = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _env_bool(name: str) -> bool:
    """A boolean switch: unset or empty is off; 1/0, true/false, yes/no, on/off in any case."""
    v = os.environ.get(name, "").strip()
    if not v or v.lower() in _NO:
        return False
    if v.lower() in _YES:
        return True
    raise SystemExit(f"mtc_loader: {name}={v!r} is not a boolean (1/0, true/false, yes/no, on/off)")


def _env_word(name: str, words: tuple) -> str:
    """A switch that takes one of ``words``, or is unset / empty ("")."""
    v = os.environ.get(name, "").strip()
    if v and v not in words:
        raise SystemExit(f"mtc_loader: {name}={v!r} is not one of {', '.join(map(repr, words))}")
    return v


# The C sources in two wings: csrc/engine (no Python: rings, slabs, the arena, jobs and their
# runners, host copies, file reads, plans, layouts, CUDA loading, NVTX) and csrc/binding (the
# _engine module over it, the only C that includes Python.h). Both folders are on the include path.
sources = sorted(glob.glob("csrc/engine/*.c")) + sorted(glob.glob("csrc/binding/*.c"))
extra_compile = ["-std=c11", "-O2", "-g", "-Wall", "-Wextra", "-Wno-unused-parameter",
                 "-Wno-missing-field-initializers", "-fvisibility=hidden", "-D_GNU_SOURCE"]
extra_link = ["-pthread", "-ldl"]
define_macros = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]


def nvtx_include():
    """The directory holding nvtx3/nvToolsExt.h (NVTX v3 is header-only), or None: the vendored
    copy in csrc/third_party unless MTC_NVTX_INCLUDE names another."""
    here = os.path.dirname(os.path.abspath(__file__))
    for d in (os.environ.get("MTC_NVTX_INCLUDE", ""), os.path.join(here, "csrc", "third_party")):
        if d and os.path.exists(os.path.join(d, "nvtx3", "nvToolsExt.h")):
            return d
    return None


include_dirs = ["csrc/engine", "csrc/binding", numpy.get_include()]
nvtx_dir = nvtx_include()
if nvtx_dir:
    include_dirs.append(nvtx_dir)
    define_macros.append(("MTC_HAVE_NVTX", "1"))
else:
    print("mtc_loader: no nvtx3 headers found (csrc/third_party/nvtx3 is missing, or MTC_NVTX_INCLUDE=DIR "
          "has none): building without NVTX ranges")

sanitize = _env_word("MTC_SANITIZE", ("address", "thread"))
# every boolean switch read whole now, whichever branch would read it: a bad value stops the build
# even where that switch would not matter (MTC_REQUIRE_LIBURING=maybe where liburing is found)
require_liburing = _env_bool("MTC_REQUIRE_LIBURING")
_env_bool("MTC_NO_LIBURING")
_env_bool("MTC_DEBUG")
if sanitize:
    flags = {"address": "-fsanitize=address,undefined", "thread": "-fsanitize=thread"}[sanitize]
    extra_compile += [flags, "-fno-omit-frame-pointer", "-O1"]
    extra_link += [flags]


def _static_liburing(libdirs: list) -> list:
    """Link flags for liburing.a where it is found, else []."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()
    try:
        out = subprocess.run(cc + ["-print-file-name=liburing.a"], capture_output=True, text=True).stdout.strip()
    except OSError:
        out = ""
    for d in libdirs + ([os.path.dirname(out)] if os.path.isabs(out) else []):
        if os.path.exists(os.path.join(d, "liburing.a")):
            return [os.path.join(d, "liburing.a"), "-Wl,--exclude-libs,liburing.a"]
    return []


def _liburing() -> tuple[list, list, str]:
    """(compile flags, link flags, where it came from) for liburing, or ([], [], why not) where
    it is absent."""
    if _env_bool("MTC_NO_LIBURING"):
        return [], [], "MTC_NO_LIBURING is set"
    prefix = os.environ.get("MTC_LIBURING_PREFIX")
    if prefix:
        prefix = os.path.abspath(prefix)
        static = _static_liburing([os.path.join(prefix, "lib")])
        if not static or not os.path.exists(os.path.join(prefix, "include", "liburing.h")):
            raise SystemExit(f"MTC_LIBURING_PREFIX={prefix}: no include/liburing.h and lib/liburing.a there")
        return [f"-I{os.path.join(prefix, 'include')}"], static, f"{static[0]}, linked statically"
    if shutil.which("pkg-config"):
        try:
            run = lambda *a: subprocess.run(["pkg-config", *a, "liburing"], check=True,  # noqa: E731
                                            capture_output=True, text=True).stdout.split()
            cflags, libs = run("--cflags"), run("--libs")
            static = _static_liburing(run("--variable=libdir"))
            version = " ".join(run("--modversion"))
            how = f"{static[0]}, linked statically" if static else f"{' '.join(libs)}, linked dynamically"
            return cflags, static or libs, f"liburing {version} from pkg-config: {how}"
        except (OSError, subprocess.CalledProcessError):
            pass
    # No .pc file: try the header and the library in the compiler's default paths.
    cc = (sysconfig.get_config_var("CC") or "cc").split()
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "probe.c")
        with open(src, "w") as f:
            f.write("#include <liburing.h>\nint main(void){struct io_uring r; (void)r; return 0;}\n")
        try:
            ok = subprocess.run(cc + [src, "-o", os.path.join(d, "probe"), "-luring"],
                                capture_output=True).returncode == 0
        except OSError:
            ok = False
    if not ok:
        return [], [], "liburing not found (no pkg-config entry, no liburing.h and -luring for the compiler)"
    static = _static_liburing([])
    return [], static or ["-luring"], f"{static[0]}, linked statically" if static else "-luring, linked dynamically"


uring_cflags, uring_libs, uring_how = _liburing()
if uring_libs:
    extra_compile += uring_cflags
    extra_link += uring_libs
    define_macros.append(("MTC_HAVE_LIBURING", "1"))
    print(f"mtc_loader: FileTensor reads: io_uring ({uring_how})", file=sys.stderr)
elif require_liburing:
    raise SystemExit(f"mtc_loader: MTC_REQUIRE_LIBURING is set but {uring_how}: install liburing's development "
                     "files (Debian/Ubuntu: apt-get install liburing-dev; Fedora: dnf install liburing-devel), "
                     "or point MTC_LIBURING_PREFIX at a copy of them")
else:
    print(f"mtc_loader: FileTensor reads: pread on helper threads, not io_uring ({uring_how}; for io_uring, "
          "install liburing-dev (Debian/Ubuntu) or liburing-devel (Fedora) and build again)", file=sys.stderr)

if _env_bool("MTC_DEBUG"):
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
