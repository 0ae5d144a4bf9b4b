/*
 * job.c - copy jobs, the engine's counters and clock, and what every runner
 * of a job uses: error recording, the current device, its event, an item's
 * host copy, the batched driver copy, the file reads it hands to uring.c
 * (see job.h).
 */
#include "job.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "futex.h"
#include "hostcopy.h"
#include "nvtx.h"

int64_t mtc_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

mtc_run_counters mtc_run_st;

/* ---- jobs ---- */

/* Written only by the atfork child handler (a single thread then), read by
 * any thread after it: relaxed is enough. */
static _Atomic uint32_t _fork_gen;

uint32_t mtc_engine_fork_gen(void) { return mtc_load_relaxed(&_fork_gen); }

void mtc_job_after_fork_child(void)
{
    /* jobs pending now were queued to, or run by, threads the child does not
     * have: mtc_job_orphaned() tells them apart by this generation */
    mtc_store_relaxed(&_fork_gen, mtc_load_relaxed(&_fork_gen) + 1);
}

mtc_job *mtc_job_new(uint32_t nops, uint32_t nitems)
{
    mtc_job *j = calloc(1, sizeof *j);
    if (!j) return NULL;
    j->ops = calloc(nops ? nops : 1, sizeof *j->ops);
    j->items = calloc(nitems ? nitems : 1, sizeof *j->items);
    if (!j->ops || !j->items) {
        free(j->ops);
        free(j->items);
        free(j);
        return NULL;
    }
    atomic_init(&j->state, MTC_JOB_PENDING);
    atomic_init(&j->claimed, 0);
    atomic_init(&j->refs, 1);
    j->err_leaf = -1;
    j->fork_gen = mtc_engine_fork_gen();
    return j;
}

void mtc_job_ref(mtc_job *j)
{
    /* the caller holds a reference already: no ordering needed */
    mtc_fetch_add_relaxed(&j->refs, 1);
}

void mtc_job_release(mtc_job *j)
{
    /* acq_rel: the last owner sees every write of the other before freeing */
    if (mtc_fetch_sub_acq_rel(&j->refs, 1) != 1) return;
    free(j->ops);
    free(j->items);
    free(j);
}

int mtc_job_complete(mtc_job *j)
{
    /* pairs with the release in mtc_job_publish: the job's results are visible */
    return mtc_load_acquire(&j->state) != MTC_JOB_PENDING;
}

int mtc_job_orphaned(mtc_job *j)
{
    return j->fork_gen != mtc_engine_fork_gen() && !mtc_job_complete(j);
}

int mtc_job_wait(mtc_job *j, int64_t timeout_ns)
{
    return mtc_futex_wait_while(&j->state, MTC_JOB_PENDING, 200, timeout_ns);
}

void mtc_job_publish(mtc_job *j)
{
    j->t_end = mtc_now_ns();
    MTC_COUNT(jobs_done, 1);
    if (j->err) MTC_COUNT(jobs_failed, 1);
    /* pairs with the acquire in mtc_job_complete: outputs and error fields
     * written above are visible to the waiter */
    mtc_store_release(&j->state, j->err ? MTC_JOB_FAILED : MTC_JOB_DONE);
    mtc_futex_wake_all(&j->state);
}

/* ---- the run of a job: what every runner uses ---- */

static _Thread_local CUevent _tl_ev[MTC_MAX_DEVICES];

int mtc_run_event(int dev, CUevent *out)
{
    if (!_tl_ev[dev]) {
        CUresult res = mtc_cu.cuEventCreate(&_tl_ev[dev], MTC_CU_EVENT_DISABLE_TIMING);
        if (res) return MTC_CUDA_ERR(res);
    }
    *out = _tl_ev[dev];
    return 0;
}

static _Thread_local CUstream _tl_stream[MTC_MAX_DEVICES]; /* internal streams (see mtc_run_batch_copy) */

/* One cuMemcpyBatchAsync ordered after the work of stream s. The batch API
 * refuses the legacy default stream (torch's default, handle 0): then the
 * batch runs on an internal non-blocking stream that waits for s, and s waits
 * for the batch, so for every later user of s it is as if it ran on s. */
int mtc_run_batch_copy(CUstream s, int dev, CUdeviceptr *dst, CUdeviceptr *src, size_t *sz, size_t m)
{
    mtc_cu_memcpy_attrs at;
    memset(&at, 0, sizeof at);
    at.srcAccessOrder = MTC_CU_MEMCPY_SRC_ACCESS_ORDER_STREAM; /* after the producing kernels */
    size_t idx0 = 0;
    CUstream bs = s;
    CUevent ev = NULL;
    int rc;
    if (!s) {
        if (!_tl_stream[dev] && (rc = mtc_cu_rc(mtc_cu.cuStreamCreate(&_tl_stream[dev], MTC_CU_STREAM_NON_BLOCKING))))
            return rc;
        bs = _tl_stream[dev];
        if ((rc = mtc_run_event(dev, &ev)) || (rc = mtc_cu_rc(mtc_cu.cuEventRecord(ev, s))) ||
            (rc = mtc_cu_rc(mtc_cu.cuStreamWaitEvent(bs, ev, 0))))
            return rc;
    }
    rc = mtc_cu_rc(mtc_cu.cuMemcpyBatchAsync(dst, src, sz, m, &at, &idx0, 1, bs));
    MTC_COUNT(dma_calls, 1);
    MTC_COUNT(batch_calls, 1);
    if (!rc && bs != s) {
        /* cuStreamWaitEvent took the earlier record: the event can be re-recorded */
        if (!(rc = mtc_cu_rc(mtc_cu.cuEventRecord(ev, bs)))) rc = mtc_cu_rc(mtc_cu.cuStreamWaitEvent(s, ev, 0));
    }
    return rc;
}

int mtc_run_use_dev(mtc_run *r, int dev)
{
    if (r->cur_dev == dev) return 0;
    int rc = mtc_cuda_set_device(dev);
    if (!rc) r->cur_dev = dev;
    return rc;
}

int mtc_run_fail(mtc_run *r, int err, int32_t leaf, const char *where)
{
    mtc_job *j = r->job;
    if (!j->err) {
        j->err = err;
        j->err_leaf = leaf;
        snprintf(j->err_where, sizeof j->err_where, "%s", where);
    }
    return err;
}

/* Records a failed read of a file-backed item: the part of its spec and the
 * bytes of it that arrived, for the binding layer's message. */
int mtc_run_fail_file(mtc_run *r, int err, int32_t leaf, const mtc_uring_err *fe)
{
    mtc_job *j = r->job;
    if (!j->err) {
        j->err_part = fe->index;
        j->err_got = fe->got;
    }
    return mtc_run_fail(r, err, leaf, "reading a file");
}

void mtc_run_copy_item(uintptr_t base, const mtc_item *it, int how)
{
    void *dst = (void *)(base + it->dst); /* unsigned: base 0 leaves dst the address */
    const void *src = (const void *)it->src;
    if (it->file) return;
    if (it->shape)
        mtc_copy_strided_to(dst, it->dst_strides, src, it->ndim, it->shape, it->strides, it->elsize);
    else if (!it->nbytes)
        return;
    else if (how & MTC_COPY_SPLIT)
        mtc_memcpy_parallel(dst, src, (size_t)it->nbytes, how & MTC_COPY_NT);
    else if (how & MTC_COPY_NT)
        mtc_memcpy_nt(dst, src, (size_t)it->nbytes);
    else
        memcpy(dst, src, (size_t)it->nbytes);
}

/* Reads the file-backed items among items[0..n) to address base + dst (base
 * 0: dst is the address; unsigned arithmetic, so a base below dst is fine)
 * as one batch of requests (uring.c). 0, or the failure recorded in the job. */
int mtc_run_read_files(mtc_run *r, uintptr_t base, const mtc_item *items, uint32_t n)
{
    uint32_t nfiles = 0;
    for (uint32_t i = 0; i < n; i++) nfiles += items[i].file != NULL;
    if (!nfiles) return 0;
    mtc_uring_leaf *leaves = malloc(nfiles * sizeof *leaves);
    if (!leaves) return mtc_run_fail(r, -ENOMEM, items[0].leaf, "planning the file reads");
    uint32_t q = 0;
    for (uint32_t i = 0; i < n; i++)
        if (items[i].file) leaves[q++] = (mtc_uring_leaf){items[i].file, (char *)(base + items[i].dst), items[i].leaf};
    mtc_uring_err fe = {0, 0};
    int32_t tag = -1;
    mtc_nvtx_push_name("file reads"); /* inside its op's range: how much of the op is disk */
    int rc = mtc_uring_read_leaves(leaves, nfiles, &fe, &tag);
    mtc_nvtx_pop();
    free(leaves);
    if (rc && fe.index == MTC_URING_UNPLANNED) return mtc_run_fail(r, rc, tag, "planning the file reads");
    if (rc) mtc_run_fail_file(r, rc, tag, &fe);
    return rc;
}
