/*
 * h2d.c - host -> device op runners (see runner.h): packed chunks staged
 * into one pinned slab and one DMA, large leaves cut into pieces that the
 * helpers stage while earlier pieces' DMAs run, and DMAs straight from
 * page-locked arena regions.
 */
#include "runner.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "hostcopy.h"

static void _stage_item(char *base, const mtc_item *it)
{
    if (it->file) return; /* read by mtc_run_read_files */
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
    MTC_COUNT(ns_stage, mtc_now_ns() - t0);
}

static int _dma_h2d(mtc_run *r, CUdeviceptr dst, const void *src, size_t n, CUstream s, int32_t leaf)
{
    int64_t t0 = mtc_now_ns();
    int rc = mtc_cu_rc(mtc_cu.cuMemcpyHtoDAsync(dst, src, n, s));
    MTC_COUNT(ns_dma_issue, mtc_now_ns() - t0);
    MTC_COUNT(dma_calls, 1);
    if (rc) return mtc_run_fail(r, rc, leaf, "host-to-device copy");
    MTC_COUNT(bytes_h2d, n);
    return 0;
}

/* Records the slab's fence on s and gives the slab back: it is reused once
 * the DMA that reads it has completed. */
static int _release_after(mtc_run *r, mtc_slab_pool *pool, mtc_slab *slab, CUstream s, int32_t leaf)
{
    void *fence;
    int rc = mtc_slab_fence(pool, slab, &fence);
    if (!rc) rc = mtc_cu_rc(mtc_cu.cuEventRecord((CUevent)fence, s));
    if (rc) {
        /* Without a fence the only safe reuse is after the stream drains. */
        mtc_cu.cuStreamSynchronize(s);
        mtc_slab_release(pool, slab, 0);
        return mtc_run_fail(r, rc, leaf, "recording a staging fence");
    }
    mtc_slab_release(pool, slab, 1);
    return 0;
}

int mtc_h2d_chunk(mtc_run *r, const mtc_op *op)
{
    mtc_job *j = r->job;
    const mtc_item *items = &j->items[op->first];
    CUstream s = j->streams[op->dev];
    int32_t leaf0 = op->count ? items[0].leaf : -1;
    int rc = mtc_run_use_dev(r, op->dev);
    if (rc) return mtc_run_fail(r, rc, leaf0, "selecting the device");
    MTC_COUNT(chunks, 1);
    MTC_COUNT(items_copied, op->count);
    if (!j->staging) {
        /* Pageable staging buffer: the driver copies it out before the call returns. */
        char *buf = malloc(op->nbytes ? (size_t)op->nbytes : 1);
        if (!buf) return mtc_run_fail(r, -ENOMEM, leaf0, "allocating a staging buffer");
        _stage_items(buf, items, op->count, op->nbytes);
        rc = mtc_run_read_files(r, (uintptr_t)buf, items, op->count);
        if (!rc) rc = _dma_h2d(r, op->dst, buf, (size_t)op->nbytes, s, leaf0);
        free(buf);
        return rc;
    }
    mtc_slab_pool *pool = mtc_run_pool(op->dev, &rc);
    if (!pool) return mtc_run_fail(r, rc, leaf0, "creating the pinned pool");
    mtc_slab *slab;
    if ((rc = mtc_slab_alloc(pool, (size_t)op->nbytes, &slab)))
        return mtc_run_fail(r, rc, leaf0, "allocating pinned staging memory");
    _stage_items(slab->ptr, items, op->count, op->nbytes);
    if ((rc = mtc_run_read_files(r, (uintptr_t)slab->ptr, items, op->count)) ||
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
static void _submit_window(mtc_run *r, mtc_slab_pool *pool, _piece *pc, uint32_t np, uint32_t W,
                           uint32_t w, mtc_batch *b, int *err, int32_t leaf)
{
    uint32_t a = w * W, e = a + W < np ? a + W : np;
    for (uint32_t i = a; i < e && !*err; i++)
        if ((*err = mtc_slab_alloc(pool, pc[i].n, &pc[i].slab))) {
            pc[i].slab = NULL;
            mtc_run_fail(r, *err, leaf, "allocating pinned staging memory");
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
int mtc_h2d_large(mtc_run *r, const mtc_op *ops, uint32_t nops)
{
    mtc_job *j = r->job;
    int dev = ops[0].dev;
    CUstream s = j->streams[dev];
    const mtc_item *first = &j->items[ops[0].first];
    int rc = mtc_run_use_dev(r, dev);
    if (rc) return mtc_run_fail(r, rc, first->leaf, "selecting the device");
    MTC_COUNT(items_copied, nops);
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
                if (!buf) return mtc_run_fail(r, -ENOMEM, it->leaf, "allocating a read buffer");
                rc = mtc_run_read_files(r, (uintptr_t)buf - it->dst, it, 1);
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
    mtc_slab_pool *pool = mtc_run_pool(dev, &rc);
    if (!pool) return mtc_run_fail(r, rc, first->leaf, "creating the pinned pool");

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
        return mtc_run_fail(r, -ENOMEM, first->leaf, "planning the staged copy");
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
    MTC_COUNT(pieces, np);
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
            if (!err && pc[i].err) err = mtc_run_fail_file(r, pc[i].err, leaf_of[i], &pc[i].ferr);
            if (!err && (err = _dma_h2d(r, pc[i].dst, pc[i].slab->ptr, pc[i].n, s, leaf_of[i])) == 0)
                err = _release_after(r, pool, pc[i].slab, s, leaf_of[i]);
            else
                mtc_slab_release(pool, pc[i].slab, 0);
            pc[i].slab = NULL;
        }
        if (helpers) mtc_batch_wait(&batch[w & 1]);
    }
    MTC_COUNT(ns_stage, mtc_now_ns() - t0);
    free(pc);
    free(leaf_of);
    return err;
}

/* DMA straight from page-locked memory the caller owns (an arena region);
 * op->after runs on a driver thread once the DMA completed, and frees it. */
int mtc_h2d_region(mtc_run *r, const mtc_op *op)
{
    mtc_job *j = r->job;
    const mtc_item *it = &j->items[op->first];
    CUstream s = j->streams[op->dev];
    int rc = mtc_run_use_dev(r, op->dev);
    if (!rc && it->nbytes) rc = _dma_h2d(r, it->dst, (const void *)it->src, (size_t)it->nbytes, s, it->leaf);
    else if (rc) mtc_run_fail(r, rc, it->leaf, "selecting the device");
    MTC_COUNT(items_copied, 1);
    if (!rc && op->after) rc = mtc_cu_rc(mtc_cu.cuLaunchHostFunc(s, op->after, op->after_arg));
    if (rc && op->after) {
        /* not queued: once the stream drained nothing reads the region */
        mtc_cu.cuStreamSynchronize(s);
        op->after(op->after_arg);
        mtc_run_fail(r, rc, it->leaf, "queueing the release of an arena region");
    }
    return rc;
}
