/*
 * job.h - copy jobs and the run of one: what the dispatch (transfer.c) and
 * the per-direction runners (h2d.c, d2h.c, d2d.c) both use.
 *
 * A job is the whole copy of one start_copy call: a list of operations over
 * items. The binding layer builds it (GIL held); the dispatch runs it (see
 * transfer.h). While it runs, an mtc_run holds the run's state, and every
 * runner reports into the same places: the engine's counters (MTC_COUNT),
 * the job's error and the step it failed at (mtc_run_fail), the clock
 * (mtc_now_ns).
 *
 * Lifetime: a job is reference-counted (the handle, and the engine while it
 * runs the job). The engine's last touch of a job is mtc_job_release() after
 * publishing completion (mtc_job_publish), so a handle may free its side at
 * any time after seeing the job completed.
 *
 * Concurrency: a job's ops, items and error fields are written by one thread
 * at a time (the builder, then the one thread that runs it) and read by
 * waiters only after mtc_job_complete() returned 1. The counters are relaxed
 * atomics, bumped from any thread. The mtc_run_* functions run on the thread
 * that runs the job and never touch Python.
 *
 * Functions return 0 or a negative code (errno, or a CUDA error as in
 * cuda.h). Names starting with `_` are internal to job.c.
 */
#ifndef MTC_JOB_H
#define MTC_JOB_H

#include <stdint.h>

#include "atomics.h"
#include "cuda.h"
#include "uring.h"

enum {
    MTC_OP_HOST_COPY = 1, /* host -> host, each item to its own dst */
    MTC_OP_H2D_CHUNK,     /* items packed at their dst offsets, one DMA of the chunk; consecutive
                             ops of one `chunk` share one staging slab and its fence */
    MTC_OP_H2D,           /* one item, contiguous host source -> device */
    MTC_OP_D2H_CHUNK,     /* items (device) -> host chunk at their dst offsets */
    MTC_OP_D2H,           /* one item, device -> host */
    MTC_OP_D2D,           /* one item, device -> another device */
    MTC_OP_H2D_REGION,    /* items from page-locked (registered) memory, each DMA'd as is to
                             its dst; `after(after_arg)` runs once the DMAs completed */
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
    uint32_t chunk;         /* H2D_CHUNK: the planned chunk this op is a storage group of */
    int64_t chunk_off;      /* H2D_CHUNK: where its bytes start in that chunk (staged there) */
    uint32_t first, count;  /* items[first .. first+count) */
    void (*after)(void *);  /* MTC_OP_H2D_REGION: called once the DMA completed (any thread) */
    void *after_arg;
    int32_t nt;             /* HOST_COPY: contiguous items written with streaming stores (a
                               destination no CPU reads next: mtc_memcpy_nt) */
} mtc_op;

enum { MTC_JOB_PENDING = 0, MTC_JOB_DONE = 1, MTC_JOB_FAILED = 2 };

typedef struct mtc_job {
    _Atomic uint32_t state;     /* futex word: MTC_JOB_* */
    _Atomic uint32_t claimed;   /* 1 once a thread took the job to run it (mtc_transfer_run) */
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

/* Publishes the job's completion (done, or failed when job->err is set) and
 * wakes its waiters. Called once, by the thread that ran the job, after its
 * last write to the job's outputs and error fields. */
void mtc_job_publish(mtc_job *job);
/* Waits for completion up to timeout_ns (<0: forever). 0 when complete, -ETIMEDOUT. */
int mtc_job_wait(mtc_job *job, int64_t timeout_ns);
/* 1 once the job completed (done or failed). */
int mtc_job_complete(mtc_job *job);
/* 1 when the job can never complete in this process: it was pending when the
 * process was forked from the one that created it (no thread of the child
 * runs it). Waiting for it would hang. */
int mtc_job_orphaned(mtc_job *job);
/* The process's fork generation: bumped in the child of every fork(). */
uint32_t mtc_engine_fork_gen(void);
/* Bumps the fork generation: called by the engine's atfork child handler only. */
void mtc_job_after_fork_child(void);

/* CLOCK_MONOTONIC in nanoseconds. */
int64_t mtc_now_ns(void);

/* The engine's counters (mtc_transfer_get_stats), bumped by the dispatch and
 * every runner, listed once: X(field, the key mtc_loader.stats() gives it).
 * jobs_* count jobs; items_copied, bytes_* what they moved; dma_calls the
 * driver's copy calls (batch_calls of them batched, batch_fallbacks the times
 * the driver refused a batch); ns_* time on the transfer thread; threads the
 * transfer threads started. */
#define MTC_COUNTERS(X) \
    X(jobs_submitted, "jobs_submitted") X(jobs_done, "jobs_done") X(jobs_failed, "jobs_failed") \
    X(jobs_inline, "jobs_inline") X(jobs_taken_back, "jobs_taken_back") \
    X(items_copied, "items_copied") X(bytes_h2d, "bytes_h2d") X(bytes_d2h, "bytes_d2h") \
    X(bytes_d2d, "bytes_d2d") X(bytes_host, "bytes_host_copy") X(dma_calls, "dma_calls") \
    X(chunks, "chunks_copied") X(pieces, "pieces") X(ring_full_waits, "ring_full_waits") \
    X(worker_wakeups, "worker_wakeups") X(ns_stage, "ns_stage") X(ns_dma_issue, "ns_dma_issue") \
    X(ns_sync, "ns_sync") X(ns_queue, "ns_queue") X(threads, "transfer_threads") \
    X(batch_calls, "batch_memcpy_calls") X(batch_fallbacks, "batch_memcpy_fallbacks")

#define _MTC_COUNTER_FIELD(f, key) _Atomic uint64_t f;
typedef struct mtc_run_counters {
    MTC_COUNTERS(_MTC_COUNTER_FIELD)
} mtc_run_counters;
#undef _MTC_COUNTER_FIELD

extern mtc_run_counters mtc_run_st;

#define MTC_COUNT(field, v) mtc_fetch_add_relaxed(&mtc_run_st.field, (uint64_t)(v))

/* The state of one job's run. */
typedef struct mtc_run {
    mtc_job *job;
    int cur_dev;              /* device whose context is current, -2 none */
    uint64_t sync_mask;       /* streams to wait for before completion */
} mtc_run;

/* Records err for leaf (-1: none) and the step `where` in the job, unless an
 * earlier error is recorded; returns err. */
int mtc_run_fail(mtc_run *r, int err, int32_t leaf, const char *where);
/* The same for a failed file read: also records the part and the bytes of it that arrived. */
int mtc_run_fail_file(mtc_run *r, int err, int32_t leaf, const mtc_uring_err *fe);
/* Makes dev's primary context current (once per run and device). */
int mtc_run_use_dev(mtc_run *r, int dev);
/* This thread's event of device dev (created on first use, kept). */
int mtc_run_event(int dev, CUevent *out);
/* One cuMemcpyBatchAsync of m copies ordered after stream s of device dev
 * (current): the D2H and D2D runners' batched copy. */
int mtc_run_batch_copy(CUstream s, int dev, CUdeviceptr *dst, CUdeviceptr *src, size_t *sz, size_t m);
/* How mtc_run_copy_item writes: memcpy, streaming stores, or either split
 * over the helpers when large. */
enum { MTC_COPY_PLAIN = 0, MTC_COPY_NT = 1, MTC_COPY_SPLIT = 2, MTC_COPY_SPLIT_NT = 3 };
/* Copies an item's bytes from its source to base + dst (strided where it has
 * a shape). File-backed items are left to mtc_run_read_files. */
void mtc_run_copy_item(uintptr_t base, const mtc_item *it, int how);
/* Reads the file-backed items among items[0..n) to base + dst, as one batch. 0, or the failure
 * recorded in the job. */
int mtc_run_read_files(mtc_run *r, uintptr_t base, const mtc_item *items, uint32_t n);

#endif /* MTC_JOB_H */
