/*
 * exit_trap.c - where does a process end without a word? An LD_PRELOAD library that turns an
 * exit(), _exit() or _Exit() with a non-zero status in one watched process into SIGABRT, so that
 * Python's faulthandler (on in every pytest run) prints each thread's Python stack first.
 *
 * The watched process is the one whose pid is in MTC_EXIT_TRAP_PID when it exits; the test
 * suite's conftest puts the runner's pid there for the session and takes it away when pytest
 * ends normally, so a run that ends by its own summary is left alone. Other processes (children,
 * forked tests) have other pids and exit as usual.
 *
 *     cc -O2 -fPIC -shared -o /tmp/exit_trap.so tools/diagnostics/exit_trap.c -ldl
 *     LD_PRELOAD=/tmp/exit_trap.so python3 -m pytest -q -m "not ctests" tests/test_faults.py
 *
 * The line it writes first goes to the process's stderr (under pytest's capture, into the
 * captured output); the stacks go where faulthandler writes, the terminal under pytest.
 * Not for the C unit tests: a sanitizer's runtime must come first in the library list.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void _trap(const char *how, int status)
{
    const char *e = getenv("MTC_EXIT_TRAP_PID");
    if (!status || !e || (pid_t)atol(e) != getpid()) return;
    char msg[160];
    int n = snprintf(msg, sizeof msg, "exit_trap: %s(%d) in the watched process %d; its stacks follow\n", how,
                     status, (int)getpid());
    if (n > 0) (void)!write(2, msg, (size_t)n);
    raise(SIGABRT); /* faulthandler prints the stacks, then the process ends by SIGABRT */
}

void exit(int status)
{
    _trap("exit", status);
    void (*real)(int) = (void (*)(int))dlsym(RTLD_NEXT, "exit");
    real(status);
    __builtin_unreachable();
}

void _exit(int status)
{
    _trap("_exit", status);
    void (*real)(int) = (void (*)(int))dlsym(RTLD_NEXT, "_exit");
    real(status);
    __builtin_unreachable();
}

void _Exit(int status)
{
    _trap("_Exit", status);
    void (*real)(int) = (void (*)(int))dlsym(RTLD_NEXT, "_Exit");
    real(status);
    __builtin_unreachable();
}
