/*
 * transfer.c - jobs, the per-device transfer threads, the pinned pools and
 * the op dispatch (see transfer.h). The runners of each direction are in
 * h2d.c, d2h.c and d2d.c; what they share with this file is in runner.h.
 */
#include "transfer.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "hostcopy.h"
#include "plan.h"
#include "ring.h"
#include "nvtx.h"
#include "runner.h"
#include "uring.h"

int64_t mtc_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* ---- counters ---- */

mtc_run_counters mtc_run_st;

void mtc_engine_get_stats(mtc_engine_stats *o)
{
#define _G(f) o->f = mtc_load_relaxed(&mtc_run_st.f)
    _G(jobs_submitted); _G(jobs_inline); _G(jobs_done); _G(jobs_failed);
    _G(items_copied); _G(bytes_h2d); _G(bytes_d2h); _G(bytes_d2d); _G(bytes_host);
    _G(dma_calls); _G(chunks); _G(pieces); _G(ring_full_waits); _G(worker_wakeups);
    _G(ns_stage); _G(ns_dma_issue); _G(ns_sync); _G(ns_queue); _G(threads);
    _G(batch_calls); _G(batch_fallbacks); _G(jobs_taken_back);
#undef _G
}

/* ---- jobs ---- */

/* Written only by the atfork child handler (a single thread then), read by
 * any thread after it: relaxed is enough. */
static _Atomic uint32_t _fork_gen;

uint32_t mtc_engine_fork_gen(void) { return mtc_load_relaxed(&_fork_gen); }

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
    /* pairs with the release in _publish: the job's results are visible */
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

static void _publish(mtc_job *j)
{
    j->t_end = mtc_now_ns();
    MTC_COUNT(jobs_done, 1);
    if (j->err) MTC_COUNT(jobs_failed, 1);
    /* pairs with the acquire in mtc_job_complete: outputs and error fields
     * written above are visible to the waiter */
    mtc_store_release(&j->state, j->err ? MTC_JOB_FAILED : MTC_JOB_DONE);
    mtc_futex_wake_all(&j->state);
}

/* ---- pinned slab pools, one per device ---- */

static pthread_mutex_t _pools_lock = PTHREAD_MUTEX_INITIALIZER;
static mtc_slab_pool *_pools[MTC_MAX_DEVICES];
static size_t _pinned_cap;

static size_t _default_cap(void)
{
    const char *e = getenv("MTC_PINNED_CAP_BYTES");
    if (e && *e) {
        long long v = atoll(e);
        if (v > 0) return (size_t)v;
    }
    return (size_t)1 << 30;
}

/* MTC_SLAB_HUGEPAGES=1: slabs mapped anonymously with MADV_HUGEPAGE (2 MiB
 * pages where the kernel's transparent huge pages allow it: fewer TLB misses
 * for the helpers' streaming stores into them) and page-locked in place with
 * cuMemHostRegister, instead of cuMemHostAlloc. MADV_DONTFORK: a forked
 * DataLoader worker never maps them, so no copy-on-write can move a page the
 * GPU reads away from the parent. Read once per process. */
static int _slab_huge = -1;

static int _huge(void)
{
    if (_slab_huge < 0) {
        const char *e = getenv("MTC_SLAB_HUGEPAGES");
        _slab_huge = e && *e == '1';
    }
    return _slab_huge;
}

static int _ops_alloc(void *ctx, size_t bytes, void **out)
{
    int rc = mtc_cuda_set_device((int)(intptr_t)ctx);
    if (rc) return rc;
    if (_huge()) {
        void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) return -ENOMEM;
        (void)madvise(p, bytes, MADV_HUGEPAGE);
        (void)madvise(p, bytes, MADV_DONTFORK);
        CUresult r = mtc_cu.cuMemHostRegister(p, bytes, MTC_CU_MEMHOSTREGISTER_PORTABLE);
        if (r) {
            munmap(p, bytes);
            return r == MTC_CUDA_ERROR_OUT_OF_MEMORY ? -ENOMEM : mtc_cu_rc(r);
        }
        *out = p;
        return 0;
    }
    CUresult r = mtc_cu.cuMemHostAlloc(out, bytes, MTC_CU_MEMHOSTALLOC_PORTABLE);
    return r == MTC_CUDA_ERROR_OUT_OF_MEMORY ? -ENOMEM : mtc_cu_rc(r);
}
static void _ops_free(void *ctx, void *ptr, size_t bytes)
{
    if (mtc_cuda_set_device((int)(intptr_t)ctx)) return;
    if (_huge()) {
        mtc_cu.cuMemHostUnregister(ptr);
        munmap(ptr, bytes);
        return;
    }
    mtc_cu.cuMemFreeHost(ptr);
}
static int _ops_fence_create(void *ctx, void **out)
{
    int rc = mtc_cuda_set_device((int)(intptr_t)ctx);
    if (rc) return rc;
    return mtc_cu_rc(mtc_cu.cuEventCreate((CUevent *)out, MTC_CU_EVENT_DISABLE_TIMING));
}
static void _ops_fence_destroy(void *ctx, void *fence)
{
    if (mtc_cuda_set_device((int)(intptr_t)ctx) == 0) mtc_cu.cuEventDestroy(fence);
}
static int _ops_fence_query(void *ctx, void *fence)
{
    (void)ctx;
    CUresult r = mtc_cu.cuEventQuery(fence);
    return r == MTC_CUDA_SUCCESS ? 1 : r == MTC_CUDA_ERROR_NOT_READY ? 0 : MTC_CUDA_ERR(r);
}
static int _ops_fence_wait(void *ctx, void *fence)
{
    (void)ctx;
    return mtc_cu_rc(mtc_cu.cuEventSynchronize(fence));
}

mtc_slab_pool *mtc_run_pool(int dev, int *err)
{
    pthread_mutex_lock(&_pools_lock);
    mtc_slab_pool *p = _pools[dev];
    if (!p) {
        if (!_pinned_cap) _pinned_cap = _default_cap();
        mtc_slab_ops ops = {(void *)(intptr_t)dev, _ops_alloc, _ops_free, _ops_fence_create,
                            _ops_fence_destroy, _ops_fence_query, _ops_fence_wait};
        p = calloc(1, sizeof *p);
        if (!p) *err = -ENOMEM;
        else if ((*err = mtc_slab_pool_init(p, &ops, _pinned_cap))) {
            free(p);
            p = NULL;
        } else {
            _pools[dev] = p;
        }
    }
    pthread_mutex_unlock(&_pools_lock);
    return p;
}

int mtc_engine_slab_stats(int dev, mtc_slab_stats *out)
{
    if (dev < 0 || dev >= MTC_MAX_DEVICES) return -EINVAL;
    pthread_mutex_lock(&_pools_lock);
    mtc_slab_pool *p = _pools[dev];
    pthread_mutex_unlock(&_pools_lock);
    if (!p) return -ENOENT;
    mtc_slab_get_stats(p, out);
    return 0;
}

int mtc_engine_set_pinned_cap(size_t bytes)
{
    if (!bytes) return -EINVAL;
    pthread_mutex_lock(&_pools_lock);
    _pinned_cap = bytes;
    for (int d = 0; d < MTC_MAX_DEVICES; d++)
        if (_pools[d]) mtc_slab_set_cap(_pools[d], bytes);
    pthread_mutex_unlock(&_pools_lock);
    return 0;
}

size_t mtc_engine_pinned_cap(void)
{
    pthread_mutex_lock(&_pools_lock);
    if (!_pinned_cap) _pinned_cap = _default_cap();
    size_t c = _pinned_cap;
    pthread_mutex_unlock(&_pools_lock);
    return c;
}

size_t mtc_engine_trim(void)
{
    size_t freed = 0;
    pthread_mutex_lock(&_pools_lock);
    for (int d = 0; d < MTC_MAX_DEVICES; d++)
        if (_pools[d]) freed += mtc_slab_trim(_pools[d]);
    pthread_mutex_unlock(&_pools_lock);
    return freed;
}

/* ---- the op runner: what the runners share (runner.h), host copies, the dispatch ---- */

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

/* Reads the file-backed items among items[0..n) to address base + dst (base
 * 0: dst is the address; unsigned arithmetic, so a base below dst is fine)
 * as one batch of requests, one per file part. 0, or the failure recorded in
 * the job. */
int mtc_run_read_files(mtc_run *r, uintptr_t base, const mtc_item *items, uint32_t n)
{
    uint32_t nreq = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (!items[i].file) continue;
        mtc_file_spec_hdr h;
        memcpy(&h, items[i].file, sizeof h);
        nreq += h.nparts;
    }
    if (!nreq) return 0;
    mtc_uring_req *reqs = malloc(nreq * sizeof *reqs);
    if (!reqs) return mtc_run_fail(r, -ENOMEM, items[0].leaf, "planning the file reads");
    uint32_t q = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (!items[i].file) continue;
        mtc_file_spec s;
        /* checked when the leaf was read (files.c); the bytes are immutable */
        mtc_uring_spec_view(items[i].file, mtc_uring_spec_size(items[i].file), &s);
        char *dst = (char *)(base + items[i].dst);
        for (uint32_t k = 0; k < s.h.nparts; k++) {
            mtc_file_part p;
            const char *path;
            mtc_uring_spec_part(&s, k, &p, &path);
            reqs[q++] = (mtc_uring_req){.path = path, .offset = p.offset, .nbytes = p.nbytes, .dst = dst,
                                        .tag = items[i].leaf, .part = k};
            dst += p.nbytes;
        }
    }
    mtc_uring_err fe = {0, 0};
    mtc_nvtx_push_name("file reads"); /* inside its op's range: how much of the op is disk */
    int rc = mtc_uring_read(reqs, nreq, &fe);
    mtc_nvtx_pop();
    if (rc) {
        mtc_uring_err pe = {reqs[fe.index].part, fe.got};
        mtc_run_fail_file(r, rc, reqs[fe.index].tag, &pe);
    }
    free(reqs);
    return rc;
}

/* Host -> host: a memcpy (split over the helpers when large) or a strided copy per item. */
static void _op_host_copy(mtc_run *r, const mtc_op *op)
{
    mtc_job *j = r->job;
    int64_t t0 = mtc_now_ns();
    for (uint32_t k = 0; k < op->count; k++) {
        const mtc_item *it = &j->items[op->first + k];
        if (it->file) continue; /* read below, all files in one batch */
        if (it->shape)
            mtc_copy_strided_to((void *)it->dst, it->dst_strides, (const void *)it->src, it->ndim, it->shape,
                                it->strides, it->elsize);
        else if (it->nbytes)
            mtc_memcpy_parallel((void *)it->dst, (const void *)it->src, (size_t)it->nbytes);
        MTC_COUNT(bytes_host, it->nbytes);
    }
    mtc_run_read_files(r, 0, &j->items[op->first], op->count);
    MTC_COUNT(items_copied, op->count);
    MTC_COUNT(ns_stage, mtc_now_ns() - t0);
}

/* Waits for the streams that carry reads of inputs or writes of CPU outputs. */
static void _sync_streams(mtc_run *r)
{
    mtc_job *j = r->job;
    int64_t t0 = mtc_now_ns();
    for (int d = 0; d < MTC_MAX_DEVICES && r->sync_mask; d++) {
        if (!(r->sync_mask & (1ull << d))) continue;
        r->sync_mask &= ~(1ull << d);
        int rc = mtc_run_use_dev(r, d);
        CUevent ev = _tl_ev[d];
        if (!rc && !ev && !(rc = mtc_cu_rc(mtc_cu.cuEventCreate(&ev, MTC_CU_EVENT_DISABLE_TIMING)))) _tl_ev[d] = ev;
        if (!rc) rc = mtc_cu_rc(mtc_cu.cuEventRecord(ev, j->streams[d]));
        if (!rc) rc = mtc_cu_rc(mtc_cu.cuEventSynchronize(ev));
        if (rc) mtc_run_fail(r, rc, -1, "waiting for the copies");
    }
    MTC_COUNT(ns_sync, mtc_now_ns() - t0);
}

int mtc_job_run(mtc_job *j)
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
        case MTC_OP_HOST_COPY: _op_host_copy(&r, op); break;
        case MTC_OP_H2D_CHUNK: mtc_h2d_chunk(&r, op); break;
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
    _publish(j);
    return 1;
}

int mtc_job_take_back(mtc_job *j)
{
    if (!j->t_submit || !mtc_job_run(j)) return 0;
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
    for (;;) {
        void *item = mtc_ring_pop_sc(&w->ring);
        if (!item) {
            uint32_t bell = mtc_load_acquire(&w->doorbell); /* pairs with the release bump in _wake */
            mtc_store_relaxed(&w->sleeping, 1);
            /* Dekker handshake with mtc_job_submit: either the producer sees
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
        mtc_job_run(j);
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

int mtc_job_submit(mtc_job *j)
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

void mtc_engine_shutdown(void)
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
    pthread_mutex_init(&_pools_lock, NULL);
    for (int i = 0; i <= MTC_MAX_DEVICES; i++) _workers[i] = NULL;
    for (int d = 0; d < MTC_MAX_DEVICES; d++) _pools[d] = NULL;
    /* jobs pending now were queued to, or run by, threads the child does not
     * have: mtc_job_orphaned() tells them apart by this generation */
    mtc_store_relaxed(&_fork_gen, mtc_load_relaxed(&_fork_gen) + 1);
    mtc_pool_after_fork_child();
    mtc_cuda_after_fork_child();
}

static pthread_once_t _init_once = PTHREAD_ONCE_INIT;
static void _init(void) { pthread_atfork(NULL, NULL, _after_fork_child); }
void mtc_engine_init_once(void) { pthread_once(&_init_once, _init); }
