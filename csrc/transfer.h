/*
 * transfer.h - copy jobs and the transfer threads that run them.
 *
 * A job is the whole copy of one start_copy call: a list of operations over
 * items. The binding layer builds it (GIL held), then either submits it to
 * the transfer thread of its target (one long-lived thread per CUDA device,
 * one for CPU targets, created on first use, fed through a lock-free MPSC
 * ring), or runs it on the calling thread with the GIL released. Nothing on
 * a transfer thread touches a Python object.
 *
 * Lifetime: a job is reference-counted (the handle, and the engine while it
 * runs the job). The engine's last touch of a job is mtc_job_release() after
 * publishing completion, so a handle may free its side at any time after
 * seeing the job completed.
 *
 * No Python here; functions return 0 or a negative code (errno, or a CUDA
 * error as in cuda.h). Names starting with `_` are internal to their file;
 * runner.h holds what transfer.c shares with the per-direction runners
 * (h2d.c, d2h.c, d2d.c).
 */
#ifndef MTC_TRANSFER_H
#define MTC_TRANSFER_H

#include <stdint.h>

#include "atomics.h"
#include "cuda.h"
#include "slab.h"

enum {
    MTC_OP_HOST_COPY = 1, /* host -> host, each item to its own dst */
    MTC_OP_H2D_CHUNK,     /* items packed at their dst offsets, one DMA of the chunk */
    MTC_OP_H2D,           /* one item, contiguous host source -> device */
    MTC_OP_D2H_CHUNK,     /* items (device) -> host chunk at their dst offsets */
    MTC_OP_D2H,           /* one item, device -> host */
    MTC_OP_D2D,           /* one item, device -> another device */
    MTC_OP_H2D_REGION,    /* one item from page-locked (registered) memory, DMA'd as is;
                             `after(after_arg)` runs once the DMA completed */
};

typedef struct mtc_item {
    uintptr_t src;          /* host address or device pointer of the first element */
    uintptr_t dst;          /* absolute address, or the offset in the op's chunk */
    int64_t nbytes;
    const int64_t *shape;   /* strided host source: shape and byte strides; NULL when contiguous */
    const int64_t *strides;
    int32_t ndim;
    int32_t elsize;
    int32_t dev;            /* device of a device source, else -1 */
    int32_t leaf;           /* for error messages */
    const void *file;       /* a file-backed source: its spec (uring.h), read instead of src; else NULL */
    const int64_t *dst_strides; /* strided source: the destination's element strides (dense, in
                                   another order: strides.h); NULL when row-major */
} mtc_item;

typedef struct mtc_op {
    int32_t kind;
    int32_t dev;            /* device the op's copies run on (target, or the source for D2H) */
    uintptr_t dst;          /* chunk ops: base of the chunk (device or host) */
    int64_t nbytes;         /* chunk ops: payload bytes */
    uint32_t first, count;  /* items[first .. first+count) */
    void (*after)(void *);  /* MTC_OP_H2D_REGION: called once the DMA completed (any thread) */
    void *after_arg;
} mtc_op;

enum { MTC_JOB_PENDING = 0, MTC_JOB_DONE = 1, MTC_JOB_FAILED = 2 };

typedef struct mtc_job {
    _Atomic uint32_t state;     /* futex word: MTC_JOB_* */
    _Atomic uint32_t claimed;   /* 1 once a thread took the job to run it (mtc_job_run) */
    _Atomic int32_t refs;
    int32_t target;             /* MTC_DEV_CPU (-1) or a CUDA device */
    int staging;                /* use_pinned_staging */
    uint64_t dev_mask;          /* CUDA devices involved (bit d) */
    CUstream streams[MTC_MAX_DEVICES]; /* captured at start_copy, per device */
    mtc_op *ops;
    uint32_t nops;
    mtc_item *items;
    uint32_t nitems;
    /* error, set by the runner before completion */
    int err;
    int32_t err_leaf;
    char err_where[64];
    uint32_t err_part;          /* a failed file read: the part of the leaf's spec, */
    uint64_t err_got;           /* and the bytes of it that arrived */
    /* timing (ns, CLOCK_MONOTONIC) */
    int64_t t_submit, t_start, t_end;
    uint32_t fork_gen;          /* mtc_engine_fork_gen() when created: a job of an older
                                   generation that is still pending was left by fork() */
} mtc_job;

/* Allocates a job with room for nops ops and nitems items; refs = 1. NULL on ENOMEM. */
mtc_job *mtc_job_new(uint32_t nops, uint32_t nitems);
/* Takes one more reference (a waiter that must keep the job while the
 * handle's may go: several threads in get() at once). */
void mtc_job_ref(mtc_job *job);
/* Drops one reference; frees at zero. */
void mtc_job_release(mtc_job *job);

/* Runs every op of the job on the calling thread and publishes completion,
 * unless another thread took it first (then nothing). Never fails: errors
 * are recorded in the job. 1 when it ran the job here, 0 when it was taken. */
int mtc_job_run(mtc_job *job);

/* A submitted job that no thread has taken yet, run here (the caller of
 * get(), GIL released) rather than waited for: 1 when it ran it, 0 when the
 * transfer thread has it (or it was never submitted). */
int mtc_job_take_back(mtc_job *job);

/* Queues the job on its target's transfer thread (started on first use);
 * takes a reference for the engine. 0, or -errno when the thread cannot start. */
int mtc_job_submit(mtc_job *job);

/* Waits for completion up to timeout_ns (<0: forever). 0 when complete, -ETIMEDOUT. */
int mtc_job_wait(mtc_job *job, int64_t timeout_ns);
/* 1 once the job completed (done or failed). */
int mtc_job_complete(mtc_job *job);
/* 1 when the job can never complete in this process: it was pending when the
 * process was forked from the one that created it (no thread of the child
 * runs it). Waiting for it would hang. */
int mtc_job_orphaned(mtc_job *job);
/* Bumped in the child of every fork(). */
uint32_t mtc_engine_fork_gen(void);

/* Configuration and counters */
typedef struct mtc_engine_stats {
    uint64_t jobs_submitted, jobs_inline, jobs_done, jobs_failed;
    uint64_t items_copied, bytes_h2d, bytes_d2h, bytes_d2d, bytes_host;
    uint64_t dma_calls, chunks, pieces, ring_full_waits, worker_wakeups;
    uint64_t ns_stage, ns_dma_issue, ns_sync, ns_queue;
    uint64_t threads, batch_calls, batch_fallbacks, jobs_taken_back;
} mtc_engine_stats;

void mtc_engine_get_stats(mtc_engine_stats *out);
/* Pinned-slab statistics of device dev; -ENOENT when it has no pool. */
int mtc_engine_slab_stats(int dev, mtc_slab_stats *out);
/* Cap on pinned staging bytes per device (applies to pools created later and to existing ones). */
int mtc_engine_set_pinned_cap(size_t bytes);
size_t mtc_engine_pinned_cap(void);
/* Frees idle slabs of every device; returns bytes freed. */
size_t mtc_engine_trim(void);
/* Stops the transfer threads (interpreter exit): waits for queued jobs. */
void mtc_engine_shutdown(void);
/* Registers the fork handlers (once). */
void mtc_engine_init_once(void);

int64_t mtc_now_ns(void);

#endif /* MTC_TRANSFER_H */
