/*
 * exit_trap.c - where does a process end without a word? An LD_PRELOAD library that turns an
 * exit(), _exit(), _Exit() or quick_exit() with a non-zero status in one watched process, and a
 * raw exit_group through syscall(), into SIGABRT, so that Python's faulthandler (on in every
 * pytest run) prints each thread's Python stack first. A Python program's own end by sys.exit()
 * or an uncaught exception goes through exit() too, once the interpreter has finalized: trapped,
 * with the line below and no Python stack.
 *
 * The watched process is the one whose pid is in MTC_EXIT_TRAP_PID when it exits; the test
 * suite's conftest puts the runner's pid there for the session and takes it away when pytest
 * ends normally, so a run that ends by its own summary is left alone. Other processes (children,
 * forked tests) have other pids and exit as usual.
 *
 *     cc -O2 -fPIC -shared -o /tmp/exit_trap.so tests/exit_trap.c -ldl
 *     LD_PRELOAD=/tmp/exit_trap.so python3 -m pytest -q -m "not ctests" tests/test_faults.py
 *
 * The line it writes first goes to the process's stderr (under pytest's capture, into the
 * captured output) and, where MTC_EXIT_TRAP_LOG names a file, is appended there too; the stacks
 * go where faulthandler writes, the terminal under pytest. SIGABRT is unblocked in the exiting
 * thread first (a thread that blocks every signal would otherwise exit quietly after all).
 * Not for the C unit tests: a sanitizer's runtime must come first in the library list.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

static void _say(const char *msg, size_t n)
{
    (void)!write(2, msg, n);
    const char *log = getenv("MTC_EXIT_TRAP_LOG");
    if (!log) return;
    int fd = open(log, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) return;
    (void)!write(fd, msg, n);
    close(fd);
}

static void _trap(const char *how, long status)
{
    const char *e = getenv("MTC_EXIT_TRAP_PID");
    if (!status || !e || (pid_t)atol(e) != getpid()) return;
    char msg[200];
    int n = snprintf(msg, sizeof msg, "exit_trap: %s(%ld) in the watched process %d, thread %ld; its stacks follow\n",
                     how, status, (int)getpid(), (long)gettid());
    if (n > 0) _say(msg, (size_t)n < sizeof msg ? (size_t)n : sizeof msg - 1);
    sigset_t abrt;
    sigemptyset(&abrt);
    sigaddset(&abrt, SIGABRT);
    pthread_sigmask(SIG_UNBLOCK, &abrt, NULL);
    raise(SIGABRT); /* faulthandler prints the stacks, then the process ends by SIGABRT */
}

#define _TRAPPED_EXIT(name)                                                      \
    void name(int status)                                                        \
    {                                                                            \
        _trap(#name, status);                                                    \
        void (*real)(int) = (void (*)(int))dlsym(RTLD_NEXT, #name);              \
        real(status);                                                            \
        __builtin_unreachable();                                                 \
    }

_TRAPPED_EXIT(exit)
_TRAPPED_EXIT(_exit)
_TRAPPED_EXIT(_Exit)
_TRAPPED_EXIT(quick_exit)

/* syscall(SYS_exit_group, status): what a library that bypasses the C library's exit calls.
 * Every other call passes through with its six argument registers (the x86-64 and AArch64 calling
 * conventions pass them the same way whether the caller gave fewer or not). */
long syscall(long nr, ...)
{
    static long (*real)(long, ...);
    va_list ap;
    long a[6];
    va_start(ap, nr);
    for (int i = 0; i < 6; i++) a[i] = va_arg(ap, long);
    va_end(ap);
    if (nr == SYS_exit_group) _trap("syscall(SYS_exit_group)", a[0]);
    long (*f)(long, ...) = __atomic_load_n(&real, __ATOMIC_ACQUIRE);
    if (!f) {
        f = (long (*)(long, ...))dlsym(RTLD_NEXT, "syscall");
        __atomic_store_n(&real, f, __ATOMIC_RELEASE);
    }
    return f(nr, a[0], a[1], a[2], a[3], a[4], a[5]);
}
