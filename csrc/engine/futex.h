/*
 * futex.h - waits on a 32-bit word (Linux futexes), and one-shot completion
 * flags built on them: what the jobs, the helper pool and the staged copies
 * wait with.
 *
 * No Python here; any thread may call these.
 */
#ifndef MTC_FUTEX_H
#define MTC_FUTEX_H

#include <stdint.h>

#include "atomics.h"

/* A one-shot completion flag: set once, waited on by any number of threads. */
typedef struct mtc_flag { _Atomic uint32_t v; } mtc_flag;
void mtc_flag_init(mtc_flag *f);
void mtc_flag_set(mtc_flag *f);
int mtc_flag_is_set(mtc_flag *f);
/* Waits until set or timeout_ns passes (<0: forever). 0 when set, -ETIMEDOUT. */
int mtc_flag_wait(mtc_flag *f, int64_t timeout_ns);

/* futex helpers over a 32-bit word */
void mtc_futex_wait(_Atomic uint32_t *addr, uint32_t expected, int64_t timeout_ns);
void mtc_futex_wake_all(_Atomic uint32_t *addr);
/* Waits while *word == busy: spins `spins` times, then sleeps on the futex.
 * 0 once the word changed, -ETIMEDOUT after timeout_ns (< 0: forever). */
int mtc_futex_wait_while(_Atomic uint32_t *word, uint32_t busy, int spins, int64_t timeout_ns);

#endif /* MTC_FUTEX_H */
