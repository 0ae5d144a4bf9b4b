/*
 * transfer.h - the dispatch of copy jobs (job.h): the transfer threads that
 * run them and the op runner that hands each op to its direction's runner.
 *
 * A built job is either submitted to the transfer thread of its target (one
 * long-lived thread per CUDA device, one for CPU targets, created on first
 * use, fed through a lock-free MPSC ring), or run on the calling thread with
 * the GIL released. Exactly one thread runs a job (mtc_transfer_run claims it).
 * Nothing on a transfer thread touches a Python object.
 *
 * Layering: transfer.c calls the runners (runner.h: h2d.c, d2h.c, d2d.c,
 * h2h.c);
 * they and transfer.c share only what is below both (job.h, pinned.h), and
 * no runner calls back into transfer.c.
 *
 * No Python here; functions return 0 or a negative code (errno, or a CUDA
 * error as in cuda.h). Every public name here starts with `mtc_transfer_`;
 * names starting with `_` are internal to transfer.c.
 */
#ifndef MTC_TRANSFER_H
#define MTC_TRANSFER_H

#include <stdint.h>

#include "job.h"

/* Runs every op of the job on the calling thread and publishes completion,
 * unless another thread took it first (then nothing). Never fails: errors
 * are recorded in the job. 1 when it ran the job here, 0 when it was taken. */
int mtc_transfer_run(mtc_job *job);

/* A submitted job that no thread has taken yet, run here (the caller of
 * get(), GIL released) rather than waited for: 1 when it ran it, 0 when the
 * transfer thread has it (or it was never submitted). */
int mtc_transfer_take_back(mtc_job *job);

/* Queues the job on its target's transfer thread (started on first use);
 * takes a reference for the engine. 0, or -errno when the thread cannot start. */
int mtc_transfer_submit(mtc_job *job);

/* The engine's counters (job.h's MTC_COUNTERS), read at one instant each. */
#define _MTC_STATS_FIELD(f, key) uint64_t f;
typedef struct mtc_transfer_stats {
    MTC_COUNTERS(_MTC_STATS_FIELD)
} mtc_transfer_stats;
#undef _MTC_STATS_FIELD

void mtc_transfer_get_stats(mtc_transfer_stats *out);
/* Stops the transfer threads (interpreter exit): waits for queued jobs. */
void mtc_transfer_shutdown(void);
/* Registers the fork handlers (once). */
void mtc_transfer_init_once(void);

#endif /* MTC_TRANSFER_H */
