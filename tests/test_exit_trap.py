"""tools/diagnostics/exit_trap.c, the LD_PRELOAD library that turns a silent non-zero exit of
the watched process into SIGABRT (so that faulthandler prints where it came from): built here,
preloaded into a child that exits through the C library, watched and not watched."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from conftest import c_compiler

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = """
import ctypes, faulthandler, os, sys
faulthandler.enable()
if sys.argv[1] == "watched":
    os.environ["MTC_EXIT_TRAP_PID"] = str(os.getpid())
elif sys.argv[1] == "child":  # a forked child of the watched process exits as usual
    os.environ["MTC_EXIT_TRAP_PID"] = str(os.getpid())
    pid = os.fork()
    if pid == 0:
        ctypes.CDLL(None).exit(5)
    _, status = os.waitpid(pid, 0)
    print("child", os.waitstatus_to_exitcode(status), flush=True)
    os.environ.pop("MTC_EXIT_TRAP_PID")

def the_caller_of_exit():
    getattr(ctypes.CDLL(None), sys.argv[2])(3)

the_caller_of_exit()
"""


@pytest.fixture(scope="module")
def trap(tmp_path_factory):
    cc = c_compiler()
    if cc is None or not sys.platform.startswith("linux"):
        pytest.skip("needs a C compiler on Linux")
    so = str(tmp_path_factory.mktemp("trap") / "exit_trap.so")
    subprocess.run([cc, "-O2", "-fPIC", "-shared", "-o", so,
                    os.path.join(_ROOT, "tools", "diagnostics", "exit_trap.c"), "-ldl"], check=True, timeout=120)
    return so


def _run(trap, mode, how):
    env = dict(os.environ, LD_PRELOAD=trap)
    env.pop("MTC_EXIT_TRAP_PID", None)
    return subprocess.run([sys.executable, "-c", _CHILD, mode, how], env=env, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("how", ["exit", "_exit", "_Exit"])
def test_a_watched_exit_aborts_with_the_python_stack(trap, how):
    r = _run(trap, "watched", how)
    assert r.returncode == -signal.SIGABRT, (r.returncode, r.stderr)
    assert f"exit_trap: {how}(3) in the watched process" in r.stderr
    assert "the_caller_of_exit" in r.stderr  # faulthandler's stack names the caller


@pytest.mark.parametrize("how", ["exit", "_exit"])
def test_other_processes_exit_as_usual(trap, how):
    r = _run(trap, "none", how)
    assert r.returncode == 3, r.stderr
    assert "exit_trap" not in r.stderr
    r = _run(trap, "child", how)
    assert r.returncode == 3, r.stderr
    assert "child 5" in r.stdout
