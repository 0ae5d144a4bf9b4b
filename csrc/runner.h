/*
 * runner.h - what the op runner of transfer.c shares with the per-direction
 * runners: h2d.c (host -> device: chunks, large staged copies, arena
 * regions), d2h.c (device -> host, and the batched driver copy) and d2d.c
 * (device -> another device).
 *
 * Internal to the engine: only transfer.c, h2d.c, d2h.c and d2d.c include it.
 * Every function runs on the thread that runs the job (a transfer thread, or
 * the caller of an inline job), never touches Python, and returns 0 or a
 * negative code (errno, or a CUDA error as in cuda.h). A runner that fails
 * records the error in its job (mtc_run_fail) and returns it; the dispatch in
 * mtc_job_run stops issuing ops after the first one.
 */
#ifndef MTC_RUNNER_H
#define MTC_RUNNER_H

#include <stdint.h>

#include "atomics.h"
#include "cuda.h"
#include "slab.h"
#include "transfer.h"
#include "uring.h"

/* The engine's counters (mtc_engine_get_stats), bumped by every runner. */
typedef struct mtc_run_counters {
    _Atomic uint64_t jobs_submitted, jobs_inline, jobs_done, jobs_failed;
    _Atomic uint64_t items_copied, bytes_h2d, bytes_d2h, bytes_d2d, bytes_host;
    _Atomic uint64_t dma_calls, chunks, pieces, ring_full_waits, worker_wakeups;
    _Atomic uint64_t ns_stage, ns_dma_issue, ns_sync, ns_queue;
    _Atomic uint64_t threads, batch_calls, batch_fallbacks, jobs_taken_back;
} mtc_run_counters;

extern mtc_run_counters mtc_run_st;

#define MTC_COUNT(field, v) mtc_fetch_add_relaxed(&mtc_run_st.field, (uint64_t)(v))

/* The state of one job's run. */
typedef struct mtc_run {
    mtc_job *job;
    int cur_dev;              /* device whose context is current, -2 none */
    uint64_t sync_mask;       /* streams to wait for before completion */
} mtc_run;

/* A driver result as the engine's code: 0 or MTC_CUDA_ERR(r). */
static inline int mtc_cu_rc(CUresult r) { return r == MTC_CUDA_SUCCESS ? 0 : MTC_CUDA_ERR(r); }

/* Records err for leaf (-1: none) and the step `where` in the job, unless an
 * earlier error is recorded; returns err. */
int mtc_run_fail(mtc_run *r, int err, int32_t leaf, const char *where);
/* The same for a failed file read: also records the part and the bytes of it that arrived. */
int mtc_run_fail_file(mtc_run *r, int err, int32_t leaf, const mtc_uring_err *fe);
/* Makes dev's primary context current (once per run and device). */
int mtc_run_use_dev(mtc_run *r, int dev);
/* This thread's event of device dev (created on first use, kept). */
int mtc_run_event(int dev, CUevent *out);
/* The pinned slab pool of device dev, created on first use; NULL with *err set. */
mtc_slab_pool *mtc_run_pool(int dev, int *err);
/* Reads the file-backed items among items[0..n) to base + dst, as one batch. 0, or the failure
 * recorded in the job. */
int mtc_run_read_files(mtc_run *r, uintptr_t base, const mtc_item *items, uint32_t n);

/* h2d.c: H2D_CHUNK; a run of nops consecutive H2D ops to one device; H2D_REGION. */
int mtc_h2d_chunk(mtc_run *r, const mtc_op *op);
int mtc_h2d_large(mtc_run *r, const mtc_op *ops, uint32_t nops);
int mtc_h2d_region(mtc_run *r, const mtc_op *op);

/* d2h.c: D2H and D2H_CHUNK. */
int mtc_d2h_run(mtc_run *r, const mtc_op *op);
/* d2h.c: one cuMemcpyBatchAsync of m copies ordered after stream s of device dev (current). */
int mtc_run_batch_copy(CUstream s, int dev, CUdeviceptr *dst, CUdeviceptr *src, size_t *sz, size_t m);

/* d2d.c: a run of nops consecutive D2D ops with one source and one target device. */
int mtc_d2d_run(mtc_run *r, const mtc_op *ops, uint32_t nops);

#endif /* MTC_RUNNER_H */
