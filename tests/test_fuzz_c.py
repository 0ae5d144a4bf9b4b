"""Run the C fuzz harnesses (tests/fuzz/) under ASan + UBSan via tests/fuzz/Makefile.

- ``make -C tests/fuzz regress``: every harness on every input of ``regressions/<h>/`` (inputs
  that once crashed) and ``corpus/<h>/`` (the seed corpus);
- ``make -C tests/fuzz run SECONDS=20``: each harness replays its corpus, then fuzzes random
  mutations of it for 20 s with a fixed seed (reproducible). A crash leaves the input in
  ``tests/fuzz/artifacts/crash-<h>-<n>``; the failure message says how to reproduce it.

Deselect with ``pytest -m "not ctests"``. Skipped only when ``make`` or a C compiler cannot be
found.
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

FUZZ_DIR = Path(__file__).resolve().parent / "fuzz"
SECONDS = 20
# build + 3 harnesses x SECONDS, with a wide margin for a slow machine
TIMEOUT_S = 900


def _c_compiler():
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc.split()[0])
    return shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _skip_reason():
    if shutil.which("make") is None:
        return "`make` not found on PATH; cannot build the fuzz harnesses"
    if _c_compiler() is None:
        return "no C compiler found (tried $CC, cc, gcc, clang); cannot build the fuzz harnesses"
    return None


_REASON = _skip_reason()

pytestmark = [
    pytest.mark.ctests,
    pytest.mark.skipif(_REASON is not None, reason=_REASON or ""),
]


def _run_make(*args):
    cmd = ["make", "-C", str(FUZZ_DIR), *args]
    env = dict(os.environ)
    if "CC" not in env:
        env["CC"] = _c_compiler()
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                              timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or ""
        if isinstance(out, bytes):
            out = out.decode(errors="replace")
        pytest.fail(f"{' '.join(cmd)} timed out after {TIMEOUT_S} s\n{out[-20000:]}")
    print(proc.stdout)
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} exited with {proc.returncode}\n----- output (tail) -----\n{proc.stdout[-20000:]}")
    return proc.stdout


def test_fuzz_regressions_and_corpus():
    """Every saved crash input and every seed passes (no sanitizer report, no broken invariant)."""
    out = _run_make("regress")
    assert "regress: all passed" in out


def test_fuzz_bounded_run():
    """Each harness fuzzes for SECONDS seconds (fixed seed) without a crash."""
    out = _run_make("run", f"SECONDS={SECONDS}")
    for h in ("layout", "plan", "arena"):
        assert f"fuzz_{h}: done:" in out, f"fuzz_{h} did not finish its run"
