"""Run the C fuzz harnesses (tests/fuzz/) under ASan + UBSan via tests/fuzz/Makefile.

- ``make -C tests/fuzz regress``: every harness on every input of ``regressions/<h>/`` (inputs
  that once crashed) and ``corpus/<h>/`` (the seed corpus);
- ``make -C tests/fuzz run SECONDS=20``: each harness replays its corpus, then fuzzes random
  mutations of it for 20 s with a fixed seed (reproducible). A crash leaves the input in
  ``tests/fuzz/artifacts/crash-<h>-<n>``; the failure message says how to reproduce it.

Deselect with ``pytest -m "not ctests"``. Skipped only when ``make`` or a C compiler cannot be
found.
"""

from pathlib import Path

import pytest

from conftest import c_build_skip, run_make

FUZZ_DIR = Path(__file__).resolve().parent / "fuzz"
SECONDS = 20
# build + 3 harnesses x SECONDS, with a wide margin for a slow machine
TIMEOUT_S = 900

pytestmark = [pytest.mark.ctests, c_build_skip("the fuzz harnesses")]


def _run_make(*args) -> str:
    return run_make(FUZZ_DIR, *args, timeout=TIMEOUT_S)


def test_fuzz_regressions_and_corpus():
    """Every saved crash input and every seed passes (no sanitizer report, no broken invariant)."""
    out = _run_make("regress")
    assert "regress: all passed" in out


def test_fuzz_bounded_run():
    """Each harness fuzzes for SECONDS seconds (fixed seed) without a crash."""
    out = _run_make("run", f"SECONDS={SECONDS}")
    for h in ("layout", "plan", "arena"):
        assert f"fuzz_{h}: done:" in out, f"fuzz_{h} did not finish its run"
