"""tests/exit_trap.c, the LD_PRELOAD library that turns a silent non-zero exit of
the watched process into SIGABRT (so that faulthandler prints where it came from): built here,
preloaded into a child that exits through the C library (each exit function, a raw exit_group
through syscall(), Python's own sys.exit, a thread that blocks SIGABRT), watched and not
watched."""
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
    libc = ctypes.CDLL(None)
    how = sys.argv[2]
    if how == "sys.exit":
        sys.exit(3)
    elif how == "syscall":
        assert libc.syscall(39) == os.getpid()  # SYS_getpid (x86-64) passes through
        libc.syscall(231, 3)  # SYS_exit_group
    elif how == "blocked":  # a thread that blocks every signal, as C libraries' workers do
        import signal, threading
        def worker():
            signal.pthread_sigmask(signal.SIG_BLOCK, set(signal.Signals))
            libc.exit(3)
        threading.Thread(target=worker).start()
        threading.Event().wait(30)
    else:
        getattr(libc, how)(3)

the_caller_of_exit()
"""


@pytest.fixture(scope="module")
def trap(tmp_path_factory):
    cc = c_compiler()
    if cc is None or not sys.platform.startswith("linux"):
        pytest.skip("needs a C compiler on Linux")
    so = str(tmp_path_factory.mktemp("trap") / "exit_trap.so")
    subprocess.run([cc, "-O2", "-fPIC", "-shared", "-o", so,
                    os.path.join(_ROOT, "tests", "exit_trap.c"), "-ldl"], check=True, timeout=120)
    return so


def _run(trap, mode, how, **extra):
    env = dict(os.environ, LD_PRELOAD=trap, **extra)
    env.pop("MTC_EXIT_TRAP_PID", None)
    return subprocess.run([sys.executable, "-c", _CHILD, mode, how], env=env, capture_output=True, text=True,
                          timeout=60)


_SAYS = {"sys.exit": "exit(3)", "syscall": "syscall(SYS_exit_group)(3)", "blocked": "exit(3)"}


@pytest.mark.parametrize("how", ["exit", "_exit", "_Exit", "quick_exit", "syscall", "sys.exit", "blocked"])
def test_a_watched_exit_aborts_with_the_python_stack(trap, how, tmp_path):
    if how == "syscall" and os.uname().machine != "x86_64":
        pytest.skip("the child uses x86-64 system call numbers")
    log = tmp_path / "trap.log"
    r = _run(trap, "watched", how, MTC_EXIT_TRAP_LOG=str(log))
    assert r.returncode == -signal.SIGABRT, (r.returncode, r.stderr)
    said = f"exit_trap: {_SAYS.get(how, how + '(3)')} in the watched process"
    assert said in r.stderr
    assert said in log.read_text()  # the same line, where pytest's capture cannot swallow it
    # faulthandler's stack names the caller (the worker thread's own function where it exits);
    # sys.exit reaches exit() after the interpreter has finalized: the line alone says it
    if how != "sys.exit":
        assert ("worker" if how == "blocked" else "the_caller_of_exit") in r.stderr


@pytest.mark.parametrize("how", ["exit", "_exit", "sys.exit"])
def test_other_processes_exit_as_usual(trap, how):
    r = _run(trap, "none", how)
    assert r.returncode == 3, r.stderr
    assert "exit_trap" not in r.stderr
    r = _run(trap, "child", how)
    assert r.returncode == 3, r.stderr
    assert "child 5" in r.stdout
