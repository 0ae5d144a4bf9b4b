/*
 * futex.h - waits on a 32-bit word (Linux futexes), and one-shot completion
 * flags built on them: what the jobs, the helper pool and the staged copies
 * wait with. Each is a few lines over one system call, so all of them are
 * static inline here, with no source file of their own.
 *
 * No Python here; any thread may call these. Names starting with `_` are
 * internal to this header.
 */
#ifndef MTC_FUTEX_H
#define MTC_FUTEX_H

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "atomics.h"

/* Sleeps while *addr == expected, at most timeout_ns (< 0: forever). May
 * return early (a wake-up, a signal): the caller re-checks its word. */
static inline void mtc_futex_wait(_Atomic uint32_t *addr, uint32_t expected, int64_t timeout_ns)
{
    struct timespec ts, *tp = NULL;
    if (timeout_ns >= 0) {
        ts.tv_sec = timeout_ns / 1000000000;
        ts.tv_nsec = timeout_ns % 1000000000;
        tp = &ts;
    }
    /* returns at once when *addr != expected: no lost wake-up between the
     * caller's check and the sleep */
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT_PRIVATE, expected, tp, NULL, 0);
}

/* Wakes every thread asleep on addr. */
static inline void mtc_futex_wake_all(_Atomic uint32_t *addr)
{
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

static inline int64_t _mtc_futex_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Waits while *word == busy: spins `spins` times, then sleeps on the futex.
 * 0 once the word changed, -ETIMEDOUT after timeout_ns (< 0: forever). */
static inline int mtc_futex_wait_while(_Atomic uint32_t *word, uint32_t busy, int spins, int64_t timeout_ns)
{
    /* the acquire pairs with the setter's release store (mtc_flag_set, the
     * job's mtc_job_publish): what it wrote before is visible */
    int64_t deadline = timeout_ns >= 0 ? _mtc_futex_now_ns() + timeout_ns : 0;
    for (int spin = 0; spin < spins; spin++) {
        if (mtc_load_acquire(word) != busy) return 0;
        mtc_cpu_relax();
    }
    while (mtc_load_acquire(word) == busy) {
        int64_t left = -1;
        if (timeout_ns >= 0 && (left = deadline - _mtc_futex_now_ns()) <= 0) return -ETIMEDOUT;
        mtc_futex_wait(word, busy, left);
    }
    return 0;
}

/* A one-shot completion flag: set once, waited on by any number of threads. */
typedef struct mtc_flag { _Atomic uint32_t v; } mtc_flag;

static inline void mtc_flag_init(mtc_flag *f) { atomic_init(&f->v, 0); }

static inline void mtc_flag_set(mtc_flag *f)
{
    /* pairs with the acquire in mtc_flag_is_set/wait: what the setter wrote
     * before (the copied piece) is visible to whoever sees the flag */
    mtc_store_release(&f->v, 1);
    mtc_futex_wake_all(&f->v);
}

static inline int mtc_flag_is_set(mtc_flag *f)
{
    return mtc_load_acquire(&f->v) != 0; /* pairs with mtc_flag_set's release */
}

/* Waits until set or timeout_ns passes (<0: forever). 0 when set, -ETIMEDOUT. */
static inline int mtc_flag_wait(mtc_flag *f, int64_t timeout_ns) { return mtc_futex_wait_while(&f->v, 0, 64, timeout_ns); }

#endif /* MTC_FUTEX_H */
