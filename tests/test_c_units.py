"""Run the C unit tests (tests/c/test_*.c) under sanitizers via tests/c/Makefile.

Deselect with ``pytest -m "not ctests"``.  Skipped only when ``make`` or a C
compiler cannot be found.
"""

from pathlib import Path

import pytest

from conftest import c_build_skip, run_make

C_TESTS_DIR = Path(__file__).resolve().parent / "c"

# Generous: the Makefile already kills a single hung test binary after
# TEST_TIMEOUT (300 s); this bounds the whole build + run of one target.
TIMEOUT_S = 1800

pytestmark = [pytest.mark.ctests, c_build_skip("the C unit tests")]


def test_c_units_asan():
    """Every tests/c/test_*.c under AddressSanitizer + UndefinedBehaviorSanitizer."""
    run_make(C_TESTS_DIR, "asan", timeout=TIMEOUT_S)


def test_c_units_tsan():
    """The multi-threaded C tests (TSAN_TESTS in tests/c/Makefile) under ThreadSanitizer."""
    run_make(C_TESTS_DIR, "tsan", timeout=TIMEOUT_S)
