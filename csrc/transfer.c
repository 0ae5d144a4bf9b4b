/*
 * transfer.c - jobs, the per-device transfer threads and the op runner
 * (see transfer.h).
 */
#include "transfer.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "hostcopy.h"
#include "plan.h"
#include "ring.h"
#include "nvtx.h"
#include "uring.h"

int64_t mtc_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* ---- counters ---- */

static struct {
    _Atomic uint64_t jobs_submitted, jobs_inline, jobs_done, jobs_failed;
    _Atomic uint64_t items_copied, bytes_h2d, bytes_d2h, bytes_d2d, bytes_host;
    _Atomic uint64_t dma_calls, chunks, pieces, ring_full_waits, worker_wakeups;
    _Atomic uint64_t ns_stage, ns_dma_issue, ns_sync, ns_queue;
    _Atomic uint64_t threads, batch_calls, batch_fallbacks;
} _st;

#define _COUNT(field, v) mtc_fetch_add_relaxed(&_st.field, (uint64_t)(v))

void mtc_engine_get_stats(mtc_engine_stats *o)
{
#define _G(f) o->f = mtc_load_relaxed(&_st.f)
    _G(jobs_submitted); _G(jobs_inline); _G(jobs_done); _G(jobs_failed);
    _G(items_copied); _G(bytes_h2d); _G(bytes_d2h); _G(bytes_d2d); _G(bytes_host);
    _G(dma_calls); _G(chunks); _G(pieces); _G(ring_full_waits); _G(worker_wakeups);
    _G(ns_stage); _G(ns_dma_issue); _G(ns_sync); _G(ns_queue); _G(threads);
    _G(batch_calls); _G(batch_fallbacks);
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
    _COUNT(jobs_done, 1);
    if (j->err) _COUNT(jobs_failed, 1);
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

static int _cu(CUresult r) { return r == MTC_CUDA_SUCCESS ? 0 : MTC_CUDA_ERR(r); }

static int _ops_alloc(void *ctx, size_t bytes, void **out)
{
    int rc = mtc_cuda_set_device((int)(intptr_t)ctx);
    if (rc) return rc;
    CUresult r = mtc_cu.cuMemHostAlloc(out, bytes, MTC_CU_MEMHOSTALLOC_PORTABLE);
    return r == MTC_CUDA_ERROR_OUT_OF_MEMORY ? -ENOMEM : _cu(r);
}
static void _ops_free(void *ctx, void *ptr, size_t bytes)
{
    (void)bytes;
    if (mtc_cuda_set_device((int)(intptr_t)ctx) == 0) mtc_cu.cuMemFreeHost(ptr);
}
static int _ops_fence_create(void *ctx, void **out)
{
    int rc = mtc_cuda_set_device((int)(intptr_t)ctx);
    if (rc) return rc;
    return _cu(mtc_cu.cuEventCreate((CUevent *)out, MTC_CU_EVENT_DISABLE_TIMING));
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
    return _cu(mtc_cu.cuEventSynchronize(fence));
}

static mtc_slab_pool *_pool_of(int dev, int *err)
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

/* ---- the op runner ---- */

typedef struct _run {
    mtc_job *job;
    int cur_dev;              /* device whose context is current, -2 none */
    uint64_t sync_mask;       /* streams to wait for before completion */
} _run;

static _Thread_local CUevent _tl_ev[MTC_MAX_DEVICES];
static _Thread_local CUstream _tl_stream[MTC_MAX_DEVICES]; /* internal streams (see _batch_stream) */
static _Atomic int _batch_broken;     /* the driver refused a batched D2H copy: per-item copies from then on */
static _Atomic int _batch_broken_d2d; /* the same for device-to-device batches (peer paths may differ) */

static int _event_of(int dev, CUevent *out)
{
    if (!_tl_ev[dev]) {
        CUresult res = mtc_cu.cuEventCreate(&_tl_ev[dev], MTC_CU_EVENT_DISABLE_TIMING);
        if (res) return MTC_CUDA_ERR(res);
    }
    *out = _tl_ev[dev];
    return 0;
}

static int _use_dev(_run *r, int dev)
{
    if (r->cur_dev == dev) return 0;
    int rc = mtc_cuda_set_device(dev);
    if (!rc) r->cur_dev = dev;
    return rc;
}

static int _fail(_run *r, int err, int32_t leaf, const char *where)
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
static int _fail_file(_run *r, int err, int32_t leaf, const mtc_uring_err *fe)
{
    mtc_job *j = r->job;
    if (!j->err) {
        j->err_part = fe->index;
        j->err_got = fe->got;
    }
    return _fail(r, err, leaf, "reading a file");
}

/* Reads the file-backed items among items[0..n) to address base + dst (base
 * 0: dst is the address; unsigned arithmetic, so a base below dst is fine)
 * as one batch of requests, one per file part. 0, or the failure recorded in
 * the job. */
static int _read_files(_run *r, uintptr_t base, const mtc_item *items, uint32_t n)
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
    if (!reqs) return _fail(r, -ENOMEM, items[0].leaf, "planning the file reads");
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
        _fail_file(r, rc, reqs[fe.index].tag, &pe);
    }
    free(reqs);
    return rc;
}

static void _stage_item(char *base, const mtc_item *it)
{
    if (it->file) return; /* read by _read_files */
    if (it->shape)
        mtc_copy_strided(base + it->dst, (const void *)it->src, it->ndim, it->shape, it->strides,
                         it->elsize);
    else if (it->nbytes)
        memcpy(base + it->dst, (const void *)it->src, (size_t)it->nbytes);
}

/* Staging of one chunk's items, split over helpers when the chunk is large. */
typedef struct _stage_ctx { char *base; const mtc_item *items; uint32_t n, per_task; } _stage_ctx;

static void _stage_task(void *arg, uint32_t t)
{
    _stage_ctx *c = arg;
    uint32_t a = t * c->per_task, b = a + c->per_task < c->n ? a + c->per_task : c->n;
    for (uint32_t i = a; i < b; i++) _stage_item(c->base, &c->items[i]);
}

static void _stage_items(char *base, const mtc_item *items, uint32_t n, int64_t bytes)
{
    int64_t t0 = mtc_now_ns();
    if (bytes >= (int64_t)(2 * MTC_PIECE_BYTES) && n > 1 && mtc_pool_size()) {
        /* about 1 MiB of items per task */
        uint32_t tasks = (uint32_t)(bytes >> 20);
        if (tasks > n) tasks = n;
        _stage_ctx c = {base, items, n, (n + tasks - 1) / tasks};
        mtc_parallel_for(_stage_task, &c, (n + c.per_task - 1) / c.per_task);
    } else if (n == 1 && !items[0].shape && !items[0].file) {
        mtc_memcpy_parallel(base + items[0].dst, (const void *)items[0].src, (size_t)items[0].nbytes);
    } else {
        for (uint32_t i = 0; i < n; i++) _stage_item(base, &items[i]);
    }
    _COUNT(ns_stage, mtc_now_ns() - t0);
}

static int _dma_h2d(_run *r, CUdeviceptr dst, const void *src, size_t n, CUstream s, int32_t leaf)
{
    int64_t t0 = mtc_now_ns();
    int rc = _cu(mtc_cu.cuMemcpyHtoDAsync(dst, src, n, s));
    _COUNT(ns_dma_issue, mtc_now_ns() - t0);
    _COUNT(dma_calls, 1);
    if (rc) return _fail(r, rc, leaf, "host-to-device copy");
    _COUNT(bytes_h2d, n);
    return 0;
}

/* Records the slab's fence on s and gives the slab back: it is reused once
 * the DMA that reads it has completed. */
static int _release_after(_run *r, mtc_slab_pool *pool, mtc_slab *slab, CUstream s, int32_t leaf)
{
    void *fence;
    int rc = mtc_slab_fence(pool, slab, &fence);
    if (!rc) rc = _cu(mtc_cu.cuEventRecord((CUevent)fence, s));
    if (rc) {
        /* Without a fence the only safe reuse is after the stream drains. */
        mtc_cu.cuStreamSynchronize(s);
        mtc_slab_release(pool, slab, 0);
        return _fail(r, rc, leaf, "recording a staging fence");
    }
    mtc_slab_release(pool, slab, 1);
    return 0;
}

static int _op_h2d_chunk(_run *r, const mtc_op *op)
{
    mtc_job *j = r->job;
    const mtc_item *items = &j->items[op->first];
    CUstream s = j->streams[op->dev];
    int32_t leaf0 = op->count ? items[0].leaf : -1;
    int rc = _use_dev(r, op->dev);
    if (rc) return _fail(r, rc, leaf0, "selecting the device");
    _COUNT(chunks, 1);
    _COUNT(items_copied, op->count);
    if (!j->staging) {
        /* Pageable staging buffer: the driver copies it out before the call returns. */
        char *buf = malloc(op->nbytes ? (size_t)op->nbytes : 1);
        if (!buf) return _fail(r, -ENOMEM, leaf0, "allocating a staging buffer");
        _stage_items(buf, items, op->count, op->nbytes);
        rc = _read_files(r, (uintptr_t)buf, items, op->count);
        if (!rc) rc = _dma_h2d(r, op->dst, buf, (size_t)op->nbytes, s, leaf0);
        free(buf);
        return rc;
    }
    mtc_slab_pool *pool = _pool_of(op->dev, &rc);
    if (!pool) return _fail(r, rc, leaf0, "creating the pinned pool");
    mtc_slab *slab;
    if ((rc = mtc_slab_alloc(pool, (size_t)op->nbytes, &slab)))
        return _fail(r, rc, leaf0, "allocating pinned staging memory");
    _stage_items(slab->ptr, items, op->count, op->nbytes);
    if ((rc = _read_files(r, (uintptr_t)slab->ptr, items, op->count)) ||
        (rc = _dma_h2d(r, op->dst, slab->ptr, (size_t)op->nbytes, s, leaf0))) {
        mtc_slab_release(pool, slab, 0);
        return rc;
    }
    return _release_after(r, pool, slab, s, leaf0);
}

/* Large host -> device: pieces are copied into pinned slabs by the helpers,
 * and each piece's DMA is issued as soon as its copy is done, so the copy of
 * piece k+1 overlaps the DMA of piece k. Two windows of pieces are in flight,
 * so the helpers never wait for the transfer thread between windows. */
typedef struct _piece {
    const char *src;
    CUdeviceptr dst;
    size_t n;
    mtc_slab *slab;
    mtc_flag done;
    const void *file;   /* a file-backed item's spec: bytes [foff, foff + n) of it are read */
    uint64_t foff;
    int err;            /* the read's failure */
    mtc_uring_err ferr;
} _piece;

static void _piece_task(void *arg, uint32_t i)
{
    _piece *p = &((_piece *)arg)[i];
    if (p->file) /* pread on this helper: the pieces of one file are read in parallel */
        p->err = mtc_uring_pread_range(p->file, p->foff, p->n, p->slab->ptr, &p->ferr);
    else
        memcpy(p->slab->ptr, p->src, p->n);
    mtc_flag_set(&p->done);
}

/* Allocates the slabs of window w and hands its copies to the helpers (b),
 * or does them here when there are none (b NULL). After an error, no piece
 * of the window gets a slab, and the batch is empty. */
static void _submit_window(_run *r, mtc_slab_pool *pool, _piece *pc, uint32_t np, uint32_t W,
                           uint32_t w, mtc_batch *b, int *err, int32_t leaf)
{
    uint32_t a = w * W, e = a + W < np ? a + W : np;
    for (uint32_t i = a; i < e && !*err; i++)
        if ((*err = mtc_slab_alloc(pool, pc[i].n, &pc[i].slab))) {
            pc[i].slab = NULL;
            _fail(r, *err, leaf, "allocating pinned staging memory");
        }
    if (*err) {
        for (uint32_t i = a; i < e; i++)
            if (pc[i].slab) {
                mtc_slab_release(pool, pc[i].slab, 0);
                pc[i].slab = NULL;
            }
        e = a;
    }
    if (b) mtc_batch_submit(b, _piece_task, &pc[a], e - a);
    else
        for (uint32_t i = a; i < e; i++) _piece_task(pc, i);
}

/* Large host -> device copies of consecutive ops (one tensor each) on one
 * device. With staging, every op is cut into pieces and all pieces of the run
 * go through one pipeline, so that the helpers stay busy across tensors. */
static int _ops_h2d(_run *r, const mtc_op *ops, uint32_t nops)
{
    mtc_job *j = r->job;
    int dev = ops[0].dev;
    CUstream s = j->streams[dev];
    const mtc_item *first = &j->items[ops[0].first];
    int rc = _use_dev(r, dev);
    if (rc) return _fail(r, rc, first->leaf, "selecting the device");
    _COUNT(items_copied, nops);
    size_t total = 0;
    for (uint32_t k = 0; k < nops; k++) total += (size_t)j->items[ops[k].first].nbytes;
    if (!j->staging) {
        for (uint32_t k = 0; k < nops; k++) {
            const mtc_item *it = &j->items[ops[k].first];
            if (!it->nbytes) continue;
            /* The DMA reads the input itself; if the input happens to be
             * pinned it runs asynchronously, so get() must wait for it
             * (DESIGN: "no input will be read any more"). */
            r->sync_mask |= 1ull << dev;
            if (it->file) {
                /* read into pageable memory: the driver copies it out before the call returns */
                char *buf = malloc((size_t)it->nbytes);
                if (!buf) return _fail(r, -ENOMEM, it->leaf, "allocating a read buffer");
                rc = _read_files(r, (uintptr_t)buf - it->dst, it, 1);
                if (!rc) rc = _dma_h2d(r, it->dst, buf, (size_t)it->nbytes, s, it->leaf);
                free(buf);
                if (rc) return rc;
                continue;
            }
            if ((rc = _dma_h2d(r, it->dst, (const void *)it->src, (size_t)it->nbytes, s, it->leaf))) return rc;
        }
        return 0;
    }
    if (!total) return 0;
    mtc_slab_pool *pool = _pool_of(dev, &rc);
    if (!pool) return _fail(r, rc, first->leaf, "creating the pinned pool");

    uint32_t helpers = (uint32_t)mtc_pool_size();
    /* Pieces small enough that every helper gets two, large enough that the
     * per-piece DMA and fence stay cheap: 1 to 4 MiB. */
    size_t piece = MTC_PIECE_BYTES;
    while (piece > ((size_t)1 << 20) && total / piece < 2 * (size_t)(helpers ? helpers : 1)) piece /= 2;
    uint32_t np = 0;
    for (uint32_t k = 0; k < nops; k++) {
        size_t n = (size_t)j->items[ops[k].first].nbytes;
        np += (uint32_t)((n + piece - 1) / piece);
    }
    uint32_t W = helpers ? 2 * helpers : 1;
    /* Two windows of slabs are held at once: keep them within half the cap,
     * or the pool's backpressure would wait on slabs only this run releases. */
    size_t cap_pieces = mtc_engine_pinned_cap() / (4 * piece);
    if (W > cap_pieces) W = cap_pieces ? (uint32_t)cap_pieces : 1;
    if (W > np) W = np;
    _piece *pc = calloc(np, sizeof *pc);
    int32_t *leaf_of = calloc(np, sizeof *leaf_of);
    if (!pc || !leaf_of) {
        free(pc);
        free(leaf_of);
        return _fail(r, -ENOMEM, first->leaf, "planning the staged copy");
    }
    uint32_t i = 0;
    for (uint32_t k = 0; k < nops; k++) {
        const mtc_item *it = &j->items[ops[k].first];
        for (size_t off = 0; off < (size_t)it->nbytes; off += piece, i++) {
            pc[i].src = (const char *)it->src + off;
            pc[i].dst = it->dst + (CUdeviceptr)off;
            pc[i].n = (size_t)it->nbytes - off < piece ? (size_t)it->nbytes - off : piece;
            pc[i].file = it->file;
            pc[i].foff = off;
            mtc_flag_init(&pc[i].done);
            leaf_of[i] = it->leaf;
        }
    }
    _COUNT(pieces, np);
    uint32_t nwin = (np + W - 1) / W;
    mtc_batch batch[2];
    int err = 0;
    int64_t t0 = mtc_now_ns();
    _submit_window(r, pool, pc, np, W, 0, helpers ? &batch[0] : NULL, &err, first->leaf);
    for (uint32_t w = 0; w < nwin; w++) {
        if (w + 1 < nwin)
            _submit_window(r, pool, pc, np, W, w + 1, helpers ? &batch[(w + 1) & 1] : NULL, &err, first->leaf);
        uint32_t a = w * W, b = a + W < np ? a + W : np;
        for (i = a; i < b; i++) {
            if (!pc[i].slab) continue;
            mtc_flag_wait(&pc[i].done, -1);
            if (!err && pc[i].err) err = _fail_file(r, pc[i].err, leaf_of[i], &pc[i].ferr);
            if (!err && (err = _dma_h2d(r, pc[i].dst, pc[i].slab->ptr, pc[i].n, s, leaf_of[i])) == 0)
                err = _release_after(r, pool, pc[i].slab, s, leaf_of[i]);
            else
                mtc_slab_release(pool, pc[i].slab, 0);
            pc[i].slab = NULL;
        }
        if (helpers) mtc_batch_wait(&batch[w & 1]);
    }
    _COUNT(ns_stage, mtc_now_ns() - t0);
    free(pc);
    free(leaf_of);
    return err;
}

/* One cuMemcpyBatchAsync ordered after the work of stream s. The batch API
 * refuses the legacy default stream (torch's default, handle 0): then the
 * batch runs on an internal non-blocking stream that waits for s, and s waits
 * for the batch, so for every later user of s it is as if it ran on s. */
static int _batch_copy(CUstream s, int dev, CUdeviceptr *dst, CUdeviceptr *src, size_t *sz, size_t m)
{
    mtc_cu_memcpy_attrs at;
    memset(&at, 0, sizeof at);
    at.srcAccessOrder = MTC_CU_MEMCPY_SRC_ACCESS_ORDER_STREAM; /* after the producing kernels */
    size_t idx0 = 0;
    CUstream bs = s;
    CUevent ev = NULL;
    int rc;
    if (!s) {
        if (!_tl_stream[dev] && (rc = _cu(mtc_cu.cuStreamCreate(&_tl_stream[dev], MTC_CU_STREAM_NON_BLOCKING))))
            return rc;
        bs = _tl_stream[dev];
        if ((rc = _event_of(dev, &ev)) || (rc = _cu(mtc_cu.cuEventRecord(ev, s))) ||
            (rc = _cu(mtc_cu.cuStreamWaitEvent(bs, ev, 0))))
            return rc;
    }
    rc = _cu(mtc_cu.cuMemcpyBatchAsync(dst, src, sz, m, &at, &idx0, 1, bs));
    _COUNT(dma_calls, 1);
    _COUNT(batch_calls, 1);
    if (!rc && bs != s) {
        /* cuStreamWaitEvent took the earlier record: the event can be re-recorded */
        if (!(rc = _cu(mtc_cu.cuEventRecord(ev, bs)))) rc = _cu(mtc_cu.cuStreamWaitEvent(s, ev, 0));
    }
    return rc;
}

/* Device -> host: one batched driver call per source device when the driver
 * has cuMemcpyBatchAsync (hundreds of small copies in one call), else one
 * cuMemcpyDtoHAsync per item. */
static int _op_d2h(_run *r, const mtc_op *op)
{
    mtc_job *j = r->job;
    const mtc_item *items = &j->items[op->first];
    uint32_t n = op->count;
    if (op->kind == MTC_OP_D2H_CHUNK) _COUNT(chunks, 1);
    _COUNT(items_copied, n);
    int64_t t0 = mtc_now_ns();
    int rc = 0;
    if (mtc_cu.cuMemcpyBatchAsync && n > 1 && !mtc_load_relaxed(&_batch_broken)) {
        CUdeviceptr *dst = malloc(n * sizeof *dst), *src = malloc(n * sizeof *src);
        size_t *sz = malloc(n * sizeof *sz);
        if (!dst || !src || !sz) rc = _fail(r, -ENOMEM, items[0].leaf, "planning the device-to-host copies");
        /* one batch per source device, in item order */
        for (uint32_t a = 0; a < n && !rc;) {
            int dev = items[a].dev;
            uint32_t m = 0, b = a;
            for (; b < n && items[b].dev == dev; b++) {
                if (!items[b].nbytes) continue;
                dst[m] = op->kind == MTC_OP_D2H_CHUNK ? op->dst + items[b].dst : items[b].dst;
                src[m] = items[b].src;
                sz[m] = (size_t)items[b].nbytes;
                m++;
                _COUNT(bytes_d2h, items[b].nbytes);
            }
            if (m && !(rc = _use_dev(r, dev))) {
                rc = _batch_copy(j->streams[dev], dev, dst, src, sz, m);
                if (rc == MTC_CUDA_ERR(1) && !mtc_load_relaxed(&_batch_broken)) {
                    /* CUDA_ERROR_INVALID_VALUE from a driver that takes the
                     * symbol but not this use: per-item copies from now on,
                     * counted in stats()["batch_fallbacks"] */
                    mtc_store_relaxed(&_batch_broken, 1);
                    _COUNT(batch_fallbacks, 1);
                    rc = 0;
                    for (uint32_t q = 0; q < m && !rc; q++)
                        rc = _cu(mtc_cu.cuMemcpyDtoHAsync((void *)dst[q], src[q], sz[q], j->streams[dev]));
                }
                r->sync_mask |= 1ull << dev;
            }
            if (rc) _fail(r, rc, items[a].leaf, "device-to-host copy");
            a = b;
        }
        free(dst);
        free(src);
        free(sz);
        _COUNT(ns_dma_issue, mtc_now_ns() - t0);
        return rc;
    }
    for (uint32_t k = 0; k < n; k++) {
        const mtc_item *it = &items[k];
        if ((rc = _use_dev(r, it->dev))) return _fail(r, rc, it->leaf, "selecting the device");
        if (!it->nbytes) continue;
        uintptr_t dst = op->kind == MTC_OP_D2H_CHUNK ? op->dst + it->dst : it->dst;
        rc = _cu(mtc_cu.cuMemcpyDtoHAsync((void *)dst, it->src, (size_t)it->nbytes, j->streams[it->dev]));
        _COUNT(dma_calls, 1);
        if (rc) return _fail(r, rc, it->leaf, "device-to-host copy");
        r->sync_mask |= 1ull << it->dev;
        _COUNT(bytes_d2h, it->nbytes);
    }
    _COUNT(ns_dma_issue, mtc_now_ns() - t0);
    return 0;
}

/* Device -> another device, for a run of consecutive D2D ops with one source
 * and one target device: the target's captured stream waits once for the
 * source's captured stream, then one batched copy (or one peer copy per
 * tensor) runs on the target stream. */
static int _ops_d2d(_run *r, const mtc_op *ops, uint32_t nops)
{
    mtc_job *j = r->job;
    const mtc_item *first = &j->items[ops[0].first];
    int src = first->dev, dst = ops[0].dev;
    int rc;
    CUevent ev = NULL;
    /* Order the copies after the work queued on the source's captured stream. */
    if ((rc = _use_dev(r, src))) return _fail(r, rc, first->leaf, "selecting the source device");
    if ((rc = _event_of(src, &ev))) return _fail(r, rc, first->leaf, "creating an event");
    if ((rc = _cu(mtc_cu.cuEventRecord(ev, j->streams[src])))) return _fail(r, rc, first->leaf, "recording an event");
    if ((rc = _use_dev(r, dst))) return _fail(r, rc, first->leaf, "selecting the target device");
    if ((rc = _cu(mtc_cu.cuStreamWaitEvent(j->streams[dst], ev, 0))))
        return _fail(r, rc, first->leaf, "ordering the copy after the source stream");
    _COUNT(items_copied, nops);
    /* get() returns once the sources have been read (the inputs may be freed then) */
    r->sync_mask |= 1ull << dst;
    int64_t t0 = mtc_now_ns();
    if (mtc_cu.cuMemcpyBatchAsync && nops > 1 && !mtc_load_relaxed(&_batch_broken_d2d)) {
        CUdeviceptr *d = malloc(nops * sizeof *d), *sp = malloc(nops * sizeof *sp);
        size_t *sz = malloc(nops * sizeof *sz);
        size_t m = 0;
        if (d && sp && sz) {
            for (uint32_t k = 0; k < nops; k++) {
                const mtc_item *it = &j->items[ops[k].first];
                if (!it->nbytes) continue;
                d[m] = it->dst;
                sp[m] = it->src;
                sz[m++] = (size_t)it->nbytes;
            }
            rc = m ? _batch_copy(j->streams[dst], dst, d, sp, sz, m) : 0;
        } else {
            rc = -ENOMEM;
        }
        free(d);
        free(sp);
        free(sz);
        if (!rc) {
            for (uint32_t k = 0; k < nops; k++) _COUNT(bytes_d2d, j->items[ops[k].first].nbytes);
            _COUNT(ns_dma_issue, mtc_now_ns() - t0);
            return 0;
        }
        /* refused (e.g. no peer path for a batch): per-tensor peer copies, counted */
        mtc_store_relaxed(&_batch_broken_d2d, 1);
        _COUNT(batch_fallbacks, 1);
    }
    for (uint32_t k = 0; k < nops; k++) {
        const mtc_item *it = &j->items[ops[k].first];
        if (!it->nbytes) continue;
        rc = _cu(mtc_cu.cuMemcpyPeerAsync(it->dst, mtc_cuda_context(dst), it->src, mtc_cuda_context(src),
                                          (size_t)it->nbytes, j->streams[dst]));
        _COUNT(dma_calls, 1);
        if (rc) return _fail(r, rc, it->leaf, "device-to-device copy");
        _COUNT(bytes_d2d, it->nbytes);
    }
    _COUNT(ns_dma_issue, mtc_now_ns() - t0);
    return 0;
}

static void _op_host_copy(_run *r, const mtc_op *op)
{
    mtc_job *j = r->job;
    int64_t t0 = mtc_now_ns();
    for (uint32_t k = 0; k < op->count; k++) {
        const mtc_item *it = &j->items[op->first + k];
        if (it->file) continue; /* read below, all files in one batch */
        if (it->shape)
            mtc_copy_strided((void *)it->dst, (const void *)it->src, it->ndim, it->shape, it->strides, it->elsize);
        else if (it->nbytes)
            mtc_memcpy_parallel((void *)it->dst, (const void *)it->src, (size_t)it->nbytes);
        _COUNT(bytes_host, it->nbytes);
    }
    _read_files(r, 0, &j->items[op->first], op->count);
    _COUNT(items_copied, op->count);
    _COUNT(ns_stage, mtc_now_ns() - t0);
}

/* DMA straight from page-locked memory the caller owns (an arena region);
 * op->after runs on a driver thread once the DMA completed, and frees it. */
static int _op_h2d_region(_run *r, const mtc_op *op)
{
    mtc_job *j = r->job;
    const mtc_item *it = &j->items[op->first];
    CUstream s = j->streams[op->dev];
    int rc = _use_dev(r, op->dev);
    if (!rc && it->nbytes) rc = _dma_h2d(r, it->dst, (const void *)it->src, (size_t)it->nbytes, s, it->leaf);
    else if (rc) _fail(r, rc, it->leaf, "selecting the device");
    _COUNT(items_copied, 1);
    if (!rc && op->after) rc = _cu(mtc_cu.cuLaunchHostFunc(s, op->after, op->after_arg));
    if (rc && op->after) {
        /* not queued: once the stream drained nothing reads the region */
        mtc_cu.cuStreamSynchronize(s);
        op->after(op->after_arg);
        _fail(r, rc, it->leaf, "queueing the release of an arena region");
    }
    return rc;
}

/* Waits for the streams that carry reads of inputs or writes of CPU outputs. */
static void _sync_streams(_run *r)
{
    mtc_job *j = r->job;
    int64_t t0 = mtc_now_ns();
    for (int d = 0; d < MTC_MAX_DEVICES && r->sync_mask; d++) {
        if (!(r->sync_mask & (1ull << d))) continue;
        r->sync_mask &= ~(1ull << d);
        int rc = _use_dev(r, d);
        CUevent ev = _tl_ev[d];
        if (!rc && !ev && !(rc = _cu(mtc_cu.cuEventCreate(&ev, MTC_CU_EVENT_DISABLE_TIMING)))) _tl_ev[d] = ev;
        if (!rc) rc = _cu(mtc_cu.cuEventRecord(ev, j->streams[d]));
        if (!rc) rc = _cu(mtc_cu.cuEventSynchronize(ev));
        if (rc) _fail(r, rc, -1, "waiting for the copies");
    }
    _COUNT(ns_sync, mtc_now_ns() - t0);
}

void mtc_job_run(mtc_job *j)
{
    _run r = {.job = j, .cur_dev = -2, .sync_mask = 0};
    if (!mtc_pool_size()) mtc_pool_start(0);
    CUcontext saved = NULL;
    int cuda = j->dev_mask != 0;
    j->t_start = mtc_now_ns();
    mtc_nvtx_push(MTC_NVTX_JOB);
    if (j->t_submit) _COUNT(ns_queue, j->t_start - j->t_submit);
    else _COUNT(jobs_inline, 1);
    if (cuda) {
        int rc = mtc_cuda_load();
        if (rc) _fail(&r, rc, -1, "loading the CUDA driver");
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
        case MTC_OP_H2D_CHUNK: _op_h2d_chunk(&r, op); break;
        case MTC_OP_H2D: {
            /* a run of large copies to one device shares one staging pipeline */
            uint32_t e = i + 1;
            while (e < j->nops && j->ops[e].kind == MTC_OP_H2D && j->ops[e].dev == op->dev) e++;
            _ops_h2d(&r, op, e - i);
            i = e - 1;
            break;
        }
        case MTC_OP_D2H_CHUNK:
        case MTC_OP_D2H: _op_d2h(&r, op); break;
        case MTC_OP_D2D: {
            /* a run of copies from one device to another shares one wait and one batch */
            uint32_t e = i + 1;
            while (e < j->nops && j->ops[e].kind == MTC_OP_D2D && j->ops[e].dev == op->dev &&
                   j->items[j->ops[e].first].dev == j->items[op->first].dev)
                e++;
            _ops_d2d(&r, op, e - i);
            i = e - 1;
            break;
        }
        case MTC_OP_H2D_REGION: _op_h2d_region(&r, op); break;
        default: _fail(&r, -EINVAL, -1, "running an unknown operation");
        }
        mtc_nvtx_pop();
    }
    /* Even after an error: copies already queued may read inputs or write
     * outputs, and the handle must not release them before they finish. */
    if (r.sync_mask) _sync_streams(&r);
    if (cuda && !mtc_cuda_load()) mtc_cu.cuCtxSetCurrent(saved);
    mtc_nvtx_pop();
    _publish(j);
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
                _COUNT(worker_wakeups, 1);
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
                _COUNT(threads, 1);
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
        _COUNT(ring_full_waits, 1);
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
    _COUNT(jobs_submitted, 1);
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
