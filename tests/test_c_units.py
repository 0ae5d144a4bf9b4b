"""Run the C unit tests (tests/c/test_*.c) under sanitizers via tests/c/Makefile.

Deselect with ``pytest -m "not ctests"``.  Skipped only when ``make`` or a C
compiler cannot be found.
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

C_TESTS_DIR = Path(__file__).resolve().parent / "c"

# Generous: the Makefile already kills a single hung test binary after
# TEST_TIMEOUT (300 s); this bounds the whole build + run of one target.
TIMEOUT_S = 1800


def _c_compiler():
    cc = os.environ.get("CC")
    if cc:
        # CC may carry arguments ("ccache gcc"); look up the program itself.
        return shutil.which(cc.split()[0])
    return shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _skip_reason():
    if shutil.which("make") is None:
        return "`make` not found on PATH; cannot build the C unit tests"
    if _c_compiler() is None:
        return "no C compiler found (tried $CC, cc, gcc, clang); cannot build the C unit tests"
    return None


_REASON = _skip_reason()

pytestmark = [
    pytest.mark.ctests,
    pytest.mark.skipif(_REASON is not None, reason=_REASON or ""),
]


def _run_make(target):
    cmd = ["make", "-C", str(C_TESTS_DIR), target]
    env = dict(os.environ)
    if "CC" not in env:
        env["CC"] = _c_compiler()
    try:
        proc = subprocess.run(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or ""
        if isinstance(out, bytes):
            out = out.decode(errors="replace")
        pytest.fail(f"{' '.join(cmd)} timed out after {TIMEOUT_S} s\n{out}")
    # Shown by pytest with -s / -rA, and in the failure report.
    print(proc.stdout)
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} exited with {proc.returncode}\n"
        f"----- output -----\n{proc.stdout}"
    )


def test_c_units_asan():
    """Every tests/c/test_*.c under AddressSanitizer + UndefinedBehaviorSanitizer."""
    _run_make("asan")


def test_c_units_tsan():
    """The multi-threaded C tests (TSAN_TESTS in tests/c/Makefile) under ThreadSanitizer."""
    _run_make("tsan")
