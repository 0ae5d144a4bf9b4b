/*
 * transfer.c - the dispatch of copy jobs (see transfer.h): the op runner,
 * the per-device transfer threads and their submission rings, the fork
 * handler. The runners of each direction are in h2d.c, h2h.c, d2h.c and
 * d2d.c (runner.h); jobs and what every runner uses are in job.c, the
 * pinned pools in pinned.c.
 */
#include "transfer.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hostcopy.h"
#include "nvtx.h"
#include "pinned.h"
#include "ring.h"
#include "runner.h"

/* ---- counters ---- */

void mtc_transfer_get_stats(mtc_transfer_stats *o)
{
#define _G(f, key) o->f = mtc_load_relaxed(&mtc_run_st.f);
    MTC_COUNTERS(_G)
#undef _G
}

/* ---- the dispatch to the runners (runner.h) ---- */

/* Waits for the streams that carry reads of inputs or writes of CPU outputs. */
static void _sync_streams(mtc_run *r)
{
    mtc_job *j = r->job;
    int64_t t0 = mtc_now_ns();
    for (int d = 0; d < MTC_MAX_DEVICES && r->sync_mask; d++) {
        if (!(r->sync_mask & (1ull << d))) continue;
        r->sync_mask &= ~(1ull << d);
        int rc = mtc_run_use_dev(r, d);
        CUevent ev = NULL;
        if (!rc) rc = mtc_run_event(d, &ev);
        if (!rc) rc = mtc_cu_rc(mtc_cu.cuEventRecord(ev, j->streams[d]));
        if (!rc) rc = mtc_cu_rc(mtc_cu.cuEventSynchronize(ev));
        if (rc) mtc_run_fail(r, rc, -1, "waiting for the copies");
    }
    MTC_COUNT(ns_sync, mtc_now_ns() - t0);
}

int mtc_transfer_run(mtc_job *j)
{
    /* one thread runs a job: the transfer thread that pops it, or a caller of
     * get() that finds it still queued (it would otherwise wait for the
     * transfer thread to wake up and do what it can do sooner itself) */
    if (mtc_exchange_acq_rel(&j->claimed, 1)) return 0;
    mtc_run r = {.job = j, .cur_dev = -2, .sync_mask = 0};
    if (!mtc_pool_size()) mtc_pool_start(0);
    CUcontext saved = NULL;
    int cuda = j->dev_mask != 0;
    j->t_start = mtc_now_ns();
    mtc_nvtx_push(MTC_NVTX_JOB);
    if (j->t_submit) MTC_COUNT(ns_queue, j->t_start - j->t_submit);
    else MTC_COUNT(jobs_inline, 1);
    if (cuda) {
        int rc = mtc_cuda_load();
        if (rc) mtc_run_fail(&r, rc, -1, "loading the CUDA driver");
        else mtc_cu.cuCtxGetCurrent(&saved);
    }
    for (uint32_t i = 0; i < j->nops; i++) {
        if (j->err) { /* skipped after an error: still release what an op owns */
            if (j->ops[i].kind == MTC_OP_H2D_REGION && j->ops[i].after) {
                if (r.sync_mask) _sync_streams(&r);
                j->ops[i].after(j->ops[i].after_arg);
            }
            continue;
        }
        const mtc_op *op = &j->ops[i];
        mtc_nvtx_push(MTC_NVTX_OP);
        switch (op->kind) {
        case MTC_OP_HOST_COPY: mtc_h2h_run(&r, op); break;
        case MTC_OP_H2D_CHUNK: {
            /* the storage groups of one chunk share its staging slab */
            uint32_t e = i + 1;
            while (e < j->nops && j->ops[e].kind == MTC_OP_H2D_CHUNK && j->ops[e].dev == op->dev &&
                   j->ops[e].chunk == op->chunk && j->ops[e].chunk_off >= j->ops[e - 1].chunk_off + j->ops[e - 1].nbytes)
                e++;
            mtc_h2d_chunk(&r, op, e - i);
            i = e - 1;
            break;
        }
        case MTC_OP_H2D: {
            /* a run of large copies to one device shares one staging pipeline */
            uint32_t e = i + 1;
            while (e < j->nops && j->ops[e].kind == MTC_OP_H2D && j->ops[e].dev == op->dev) e++;
            mtc_h2d_large(&r, op, e - i);
            i = e - 1;
            break;
        }
        case MTC_OP_D2H_CHUNK:
        case MTC_OP_D2H: mtc_d2h_run(&r, op); break;
        case MTC_OP_D2D: {
            /* a run of copies from one device to another shares one wait and one batch */
            uint32_t e = i + 1;
            while (e < j->nops && j->ops[e].kind == MTC_OP_D2D && j->ops[e].dev == op->dev &&
                   j->items[j->ops[e].first].dev == j->items[op->first].dev)
                e++;
            mtc_d2d_run(&r, op, e - i);
            i = e - 1;
            break;
        }
        case MTC_OP_H2D_REGION: mtc_h2d_region(&r, op); break;
        default: mtc_run_fail(&r, -EINVAL, -1, "running an unknown operation");
        }
        mtc_nvtx_pop();
    }
    /* Even after an error: copies already queued may read inputs or write
     * outputs, and the handle must not release them before they finish. */
    if (r.sync_mask) _sync_streams(&r);
    if (cuda && !mtc_cuda_load()) mtc_cu.cuCtxSetCurrent(saved);
    mtc_nvtx_pop();
    mtc_job_publish(j);
    return 1;
}

int mtc_transfer_take_back(mtc_job *j)
{
    if (!j->t_submit || !mtc_transfer_run(j)) return 0;
    MTC_COUNT(jobs_taken_back, 1);
    return 1;
}

/* ---- transfer threads ---- */

#define _RING_CAP 1024
#define _STOP ((void *)1)

typedef struct _worker {
    mtc_ring ring;
    MTC_ALIGNED_CL _Atomic uint32_t doorbell; /* futex word, bumped to wake the thread */
    _Atomic uint32_t sleeping;                /* the thread is (about to be) asleep */
    pthread_t thread;
    int dev;
    int started;
} _worker;

static pthread_mutex_t _workers_lock = PTHREAD_MUTEX_INITIALIZER;
static _worker *_workers[MTC_MAX_DEVICES + 1]; /* [0]: CPU targets, [d+1]: cuda:d */

static void *_worker_main(void *arg)
{
    _worker *w = arg;
    /* named for top -H, profilers and tools/diagnostics/placement.py */
    char name[16];
    if (w->dev < 0) snprintf(name, sizeof name, "mtc-xfer-cpu");
    else snprintf(name, sizeof name, "mtc-xfer-cuda%u", (unsigned)w->dev % 100u); /* devices < 64 */
    pthread_setname_np(pthread_self(), name);
    for (;;) {
        void *item = mtc_ring_pop_sc(&w->ring);
        if (!item) {
            uint32_t bell = mtc_load_acquire(&w->doorbell); /* pairs with the release bump in _wake */
            mtc_store_relaxed(&w->sleeping, 1);
            /* Dekker handshake with mtc_transfer_submit: either the producer sees
             * sleeping=1 and rings, or this re-check sees its item. */
            mtc_fence_seq_cst();
            item = mtc_ring_pop_sc(&w->ring);
            if (!item) {
                mtc_futex_wait(&w->doorbell, bell, -1);
                mtc_store_relaxed(&w->sleeping, 0);
                MTC_COUNT(worker_wakeups, 1);
                continue;
            }
            mtc_store_relaxed(&w->sleeping, 0);
        }
        if (item == _STOP) break;
        mtc_job *j = item;
        mtc_transfer_run(j);
        mtc_job_release(j); /* the engine's reference: its last touch of the job */
    }
    return NULL;
}

static void _wake(_worker *w)
{
    mtc_fence_seq_cst(); /* the other half of the handshake in _worker_main */
    if (mtc_load_relaxed(&w->sleeping)) {
        mtc_fetch_add_acq_rel(&w->doorbell, 1);
        mtc_futex_wake_all(&w->doorbell);
    }
}

static _worker *_worker_of(int target, int *err)
{
    int idx = target + 1;
    pthread_mutex_lock(&_workers_lock);
    _worker *w = _workers[idx];
    if (!w) {
        /* the ring inside is cache-line aligned: so must the worker be */
        size_t size = (sizeof *w + MTC_CACHELINE - 1) / MTC_CACHELINE * MTC_CACHELINE;
        w = aligned_alloc(MTC_CACHELINE, size);
        if (w) memset(w, 0, size);
        if (!w) *err = -ENOMEM;
        else if ((*err = mtc_ring_init(&w->ring, _RING_CAP))) {
            free(w);
            w = NULL;
        } else {
            w->dev = target;
            mtc_pool_start(0); /* helpers for large copies: before the first job needs them */
            atomic_init(&w->doorbell, 0);
            atomic_init(&w->sleeping, 0);
            int rc = pthread_create(&w->thread, NULL, _worker_main, w);
            if (rc) {
                *err = -rc;
                mtc_ring_destroy(&w->ring);
                free(w);
                w = NULL;
            } else {
                w->started = 1;
                _workers[idx] = w;
                MTC_COUNT(threads, 1);
            }
        }
    }
    pthread_mutex_unlock(&_workers_lock);
    return w;
}

static void _push(_worker *w, void *item)
{
    while (mtc_ring_push_mp(&w->ring, item) == -EAGAIN) {
        /* full: 1024 jobs queued; let the thread drain */
        MTC_COUNT(ring_full_waits, 1);
        _wake(w);
        sched_yield();
    }
    _wake(w);
}

int mtc_transfer_submit(mtc_job *j)
{
    int err = 0;
    if (j->target < -1 || j->target >= MTC_MAX_DEVICES) return -EINVAL;
    _worker *w = _worker_of(j->target, &err);
    if (!w) return err;
    j->t_submit = mtc_now_ns();
    mtc_fetch_add_relaxed(&j->refs, 1); /* the engine's reference, dropped by the worker; the caller holds one, so no ordering is needed */
    MTC_COUNT(jobs_submitted, 1);
    _push(w, j);
    return 0;
}

void mtc_transfer_shutdown(void)
{
    pthread_mutex_lock(&_workers_lock);
    for (int i = 0; i <= MTC_MAX_DEVICES; i++) {
        _worker *w = _workers[i];
        if (!w) continue;
        _push(w, _STOP);
        pthread_join(w->thread, NULL);
        mtc_ring_destroy(&w->ring);
        free(w);
        _workers[i] = NULL;
    }
    pthread_mutex_unlock(&_workers_lock);
    mtc_pool_stop();
}

static void _after_fork_child(void)
{
    /* Only the forking thread survives: the transfer threads, the helpers and
     * the CUDA contexts are gone. Forget them (their memory is the parent's
     * copy, left alone); the child starts fresh threads on first use. CPU
     * paths work in the child; CUDA does not survive a fork. */
    pthread_mutex_init(&_workers_lock, NULL);
    for (int i = 0; i <= MTC_MAX_DEVICES; i++) _workers[i] = NULL;
    mtc_pinned_after_fork_child();
    mtc_job_after_fork_child();
    mtc_pool_after_fork_child();
    mtc_cuda_after_fork_child();
}

static pthread_once_t _init_once = PTHREAD_ONCE_INIT;
static void _init(void) { pthread_atfork(NULL, NULL, _after_fork_child); }
void mtc_transfer_init_once(void) { pthread_once(&_init_once, _init); }
