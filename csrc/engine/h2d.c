/*
 * h2d.c - host -> device op runners (see runner.h): packed chunks staged
 * into one pinned slab, one DMA per storage group of the chunk, large leaves cut into pieces that the
 * helpers stage while earlier pieces' DMAs run, and DMAs straight from
 * page-locked arena regions.
 */
#include "runner.h"
#include "atomics.h"
#include "env.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "hostcopy.h"
#include "pinned.h"
#include "slab.h"

/* Slabs of the staging ring (MTC_H2D_RING; 0: the windowed pipeline): 16 of
 * 2 MiB. A ring must hold enough slabs that the helpers and the DMA rarely
 * wait for each other, and stay small enough to live in the CPU's cache:
 * fewer slabs starve one side, more leave the cache without gaining speed. */
#define MTC_H2D_RING_SLABS 16
/* The ring's pieces: 2 MiB, so that 16 of them fit the last-level cache. */
#define MTC_H2D_RING_PIECE ((size_t)2 << 20)
/* The ring's tasks: 256 KiB, so that each piece spreads over up to 8 helpers. */
#define MTC_H2D_RING_TASK ((size_t)256 << 10)
/* The windows' tasks: 512 KiB, so that every helper works on the first pieces. */
#define MTC_H2D_WINDOW_TASK ((size_t)512 << 10)

/* The C unit tests' sizes (mtc_h2d_tune); 0: the constants above. */
static _Atomic size_t _tune_piece, _tune_task;
static _Atomic int _tune_nt = -1;

void mtc_h2d_tune(size_t piece, size_t task, int nt)
{
    mtc_store_relaxed(&_tune_piece, piece); /* read by the next staged copy; a job's submit orders it */
    mtc_store_relaxed(&_tune_task, task);
    mtc_store_relaxed(&_tune_nt, nt);
}

static size_t _or(size_t tuned, size_t dflt) { return tuned ? tuned : dflt; }

static void _stage_item(char *base, const mtc_item *it, int nt)
{
    mtc_run_copy_item((uintptr_t)base, it, nt ? MTC_COPY_NT : MTC_COPY_PLAIN);
}

/* Staging of one chunk's items, split over helpers when the chunk is large. */
typedef struct _stage_ctx { char *base; const mtc_item *items; uint32_t n, per_task; int nt; } _stage_ctx;

static void _stage_task(void *arg, uint32_t t)
{
    _stage_ctx *c = arg;
    uint32_t a = t * c->per_task, b = a + c->per_task < c->n ? a + c->per_task : c->n;
    for (uint32_t i = a; i < b; i++) _stage_item(c->base, &c->items[i], c->nt);
}

static void _stage_items(char *base, const mtc_item *items, uint32_t n, int64_t bytes)
{
    int64_t t0 = mtc_now_ns();
    if (bytes >= (int64_t)(2 * MTC_PIECE_BYTES) && n > 1 && mtc_pool_size()) {
        /* about 1 MiB of items per task */
        uint32_t tasks = (uint32_t)(bytes >> 20);
        if (tasks > n) tasks = n;
        _stage_ctx c = {base, items, n, (n + tasks - 1) / tasks, 1};
        mtc_parallel_for(_stage_task, &c, (n + c.per_task - 1) / c.per_task);
    } else if (n == 1 && !items[0].shape && !items[0].file) {
        mtc_memcpy_parallel(base + items[0].dst, (const void *)items[0].src, (size_t)items[0].nbytes, 0);
    } else {
        for (uint32_t i = 0; i < n; i++) _stage_item(base, &items[i], 0);
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

/* Stages the items of ops[0..nops) into base, each op's at its offset in
 * the chunk less off0, reads their file-backed items, and issues one DMA per
 * op from there to the op's own tensor. 0, or the failure recorded. */
static int _chunk_to(mtc_run *r, const mtc_op *ops, uint32_t nops, char *base, CUstream s)
{
    mtc_job *j = r->job;
    int64_t off0 = ops[0].chunk_off;
    for (uint32_t k = 0; k < nops; k++) {
        const mtc_op *op = &ops[k];
        char *at = base + (op->chunk_off - off0);
        const mtc_item *items = &j->items[op->first];
        _stage_items(at, items, op->count, op->nbytes);
        int rc = mtc_run_read_files(r, (uintptr_t)at, items, op->count);
        if (rc) return rc;
    }
    for (uint32_t k = 0; k < nops; k++) {
        const mtc_op *op = &ops[k];
        int rc = _dma_h2d(r, op->dst, base + (op->chunk_off - off0), (size_t)op->nbytes, s,
                          op->count ? j->items[op->first].leaf : -1);
        if (rc) return rc;
    }
    return 0;
}

int mtc_h2d_chunk(mtc_run *r, const mtc_op *ops, uint32_t nops)
{
    mtc_job *j = r->job;
    const mtc_op *last = &ops[nops - 1];
    CUstream s = j->streams[ops[0].dev];
    int32_t leaf0 = ops[0].count ? j->items[ops[0].first].leaf : -1;
    /* the chunk's bytes from its first group's start to its last group's end */
    size_t span = (size_t)(last->chunk_off + last->nbytes - ops[0].chunk_off);
    int rc = mtc_run_use_dev(r, ops[0].dev);
    if (rc) return mtc_run_fail(r, rc, leaf0, "selecting the device");
    MTC_COUNT(chunks, 1);
    for (uint32_t k = 0; k < nops; k++) MTC_COUNT(items_copied, ops[k].count);
    if (!j->staging) {
        /* Pageable staging buffer: the driver copies it out before the call returns. */
        char *buf = malloc(span ? span : 1);
        if (!buf) return mtc_run_fail(r, -ENOMEM, leaf0, "allocating a staging buffer");
        rc = _chunk_to(r, ops, nops, buf, s);
        free(buf);
        return rc;
    }
    mtc_slab_pool *pool = mtc_pinned_pool(ops[0].dev, &rc);
    if (!pool) return mtc_run_fail(r, rc, leaf0, "creating the pinned pool");
    mtc_slab *slab;
    if ((rc = mtc_slab_alloc(pool, span, &slab))) return mtc_run_fail(r, rc, leaf0, "allocating pinned staging memory");
    if ((rc = _chunk_to(r, ops, nops, slab->ptr, s))) {
        /* the groups' DMAs issued before the failure may still read the slab */
        _release_after(r, pool, slab, s, leaf0);
        return rc;
    }
    return _release_after(r, pool, slab, s, leaf0);
}

/* Large host -> device: the copy is cut into pieces (each one pinned slab and
 * one DMA), and each piece into tasks that the helpers take in order, so that
 * all of them work on the first pieces together. A piece's DMA is issued as
 * soon as its last task is done, so the DMA of piece k overlaps the copy of
 * pieces k+1...; the first DMA starts after one piece's copy by all helpers,
 * not after one helper copied a whole piece. Two windows of pieces are in
 * flight, so the helpers never wait for the transfer thread between windows. */
typedef struct _piece {
    CUdeviceptr dst;
    size_t n;
    mtc_slab *slab;          /* NULL in a cancelled ring: its tasks copy nothing */
    mtc_flag free;           /* ring: its slab may be written (the slab's previous DMA is done) */
    mtc_flag done;           /* set by the piece's last task */
    _Atomic uint32_t left;   /* tasks of the piece not finished */
    uint32_t task0;          /* its tasks: [task0, next piece's task0) */
    int32_t leaf;
} _piece;

typedef struct _task {
    _piece *piece;
    const char *src;         /* where the task's bytes are (unused for a file) */
    size_t off, n;           /* the bytes [off, off + n) of the piece */
    const void *file;        /* a file-backed item's spec: bytes [foff, foff + n) of it are read */
    uint64_t foff;
    int nt;                  /* streaming stores (mtc_memcpy_nt) */
    int err;                 /* the read's failure */
    mtc_uring_err ferr;
} _task;

static void _piece_task(void *arg, uint32_t i)
{
    _task *t = &((_task *)arg)[i];
    mtc_slab *slab = t->piece->slab;
    char *dst = slab ? (char *)slab->ptr + t->off : NULL;
    if (!dst)
        ; /* a cancelled ring */
    else if (t->file) /* pread on this helper: the parts of one file are read in parallel */
        t->err = mtc_uring_pread_range(t->file, t->foff, t->n, dst, &t->ferr);
    else if (t->nt)
        mtc_memcpy_nt(dst, t->src, t->n);
    else
        memcpy(dst, t->src, t->n);
    /* acq_rel: the last task of the piece sees the others' bytes before its
     * flag's release publishes them to the transfer thread */
    if (mtc_fetch_sub_acq_rel(&t->piece->left, 1) == 1) mtc_flag_set(&t->piece->done);
}

/* The large-copy pipeline of one run of H2D ops: pieces, tasks, windows. */
typedef struct _pipe {
    mtc_run *r;
    mtc_slab_pool *pool;
    _piece *pc;
    _task *tk;
    uint32_t np, nt, W;      /* pieces, tasks, pieces per window */
    int err;
} _pipe;

/* Allocates the slabs of window w and hands its tasks to the helpers (b), or
 * runs them here when there are none (b NULL). After an error, no piece of
 * the window gets a slab, and the batch is empty. */
static void _submit_window(_pipe *pp, uint32_t w, mtc_batch *b)
{
    _piece *pc = pp->pc;
    uint32_t a = w * pp->W, e = a + pp->W < pp->np ? a + pp->W : pp->np;
    for (uint32_t i = a; i < e && !pp->err; i++)
        if ((pp->err = mtc_slab_alloc(pp->pool, pc[i].n, &pc[i].slab))) {
            pc[i].slab = NULL;
            mtc_run_fail(pp->r, pp->err, pc[i].leaf, "allocating pinned staging memory");
        }
    if (pp->err) {
        for (uint32_t i = a; i < e; i++)
            if (pc[i].slab) {
                mtc_slab_release(pp->pool, pc[i].slab, 0);
                pc[i].slab = NULL;
            }
        e = a;
    }
    uint32_t ta = pc[a].task0, te = e < pp->np ? pc[e].task0 : pp->nt;
    if (e == a) te = ta;
    if (b) mtc_batch_submit(b, _piece_task, &pp->tk[ta], te - ta);
    else
        for (uint32_t i = ta; i < te; i++) _piece_task(pp->tk, i);
}

/* Cuts the run's items into pieces of `piece` bytes and those into tasks of
 * `task` bytes. 0, or -ENOMEM. */
static int _plan_pipe(_pipe *pp, const mtc_item *items, const mtc_op *ops, uint32_t nops, size_t piece,
                      size_t task, int nt)
{
    uint32_t np = 0, ntk = 0;
    for (uint32_t k = 0; k < nops; k++) {
        size_t n = (size_t)items[ops[k].first].nbytes;
        np += (uint32_t)((n + piece - 1) / piece);
        ntk += (uint32_t)((n / piece) * ((piece + task - 1) / task) + (n % piece + task - 1) / task);
    }
    pp->pc = calloc(np ? np : 1, sizeof *pp->pc);
    pp->tk = calloc(ntk ? ntk : 1, sizeof *pp->tk);
    if (!pp->pc || !pp->tk) return -ENOMEM;
    pp->np = np;
    pp->nt = ntk;
    uint32_t i = 0, t = 0;
    for (uint32_t k = 0; k < nops; k++) {
        const mtc_item *it = &items[ops[k].first];
        for (size_t off = 0; off < (size_t)it->nbytes; off += piece, i++) {
            _piece *p = &pp->pc[i];
            p->dst = it->dst + (CUdeviceptr)off;
            p->n = (size_t)it->nbytes - off < piece ? (size_t)it->nbytes - off : piece;
            p->leaf = it->leaf;
            p->task0 = t;
            mtc_flag_init(&p->free);
            mtc_flag_init(&p->done);
            uint32_t parts = 0;
            for (size_t o = 0; o < p->n; o += task, t++, parts++)
                pp->tk[t] = (_task){.piece = p, .src = (const char *)it->src + off + o, .off = o,
                                    .n = p->n - o < task ? p->n - o : task, .file = it->file,
                                    .foff = off + o, .nt = nt};
            atomic_init(&p->left, parts);
        }
    }
    return 0;
}

/* Waits for piece i's copy, issues its DMA and gives its slab back fenced
 * (or at once after an error). */
static void _finish_piece(_pipe *pp, uint32_t i, CUstream s)
{
    _piece *p = &pp->pc[i];
    if (!p->slab) return;
    mtc_flag_wait(&p->done, -1);
    uint32_t te = i + 1 < pp->np ? pp->pc[i + 1].task0 : pp->nt;
    for (uint32_t t = p->task0; t < te && !pp->err; t++)
        if (pp->tk[t].err) pp->err = mtc_run_fail_file(pp->r, pp->tk[t].err, p->leaf, &pp->tk[t].ferr);
    if (!pp->err && (pp->err = _dma_h2d(pp->r, p->dst, p->slab->ptr, p->n, s, p->leaf)) == 0)
        pp->err = _release_after(pp->r, pp->pool, p->slab, s, p->leaf);
    else
        mtc_slab_release(pp->pool, p->slab, 0);
    p->slab = NULL;
}

/* The windowed pipeline: every piece gets its own slab from the pool, two
 * windows of pp->W pieces in flight. */
static void _run_windows(_pipe *pp, CUstream s, uint32_t helpers)
{
    uint32_t W = pp->W, nwin = (pp->np + W - 1) / W;
    mtc_batch batch[2];
    _submit_window(pp, 0, helpers ? &batch[0] : NULL);
    for (uint32_t w = 0; w < nwin; w++) {
        if (w + 1 < nwin) _submit_window(pp, w + 1, helpers ? &batch[(w + 1) & 1] : NULL);
        uint32_t a = w * W, b = a + W < pp->np ? a + W : pp->np;
        for (uint32_t i = a; i < b; i++) _finish_piece(pp, i, s);
        if (helpers) mtc_batch_wait(&batch[w & 1]);
    }
}

/* The ring: R slabs taken once and reused in turn (piece i in slab i % R), so
 * that the staged bytes in flight stay within tens of MiB and in the cache. The
 * helpers' plain stores and the DMA's reads of them then hit the cache, and a
 * staged byte costs memory one read of its source instead of a read, a write
 * and the DMA's read. Every task is handed to the helpers at once; the tasks of
 * piece i wait for its `free` flag, which the transfer thread sets once the DMA
 * of piece i - R (the same slab) completed. */
typedef struct _ring {
    mtc_slab **slab;
    CUevent *fence;          /* slab k's fence, recorded after each DMA from it */
    uint32_t R;
    uint32_t next;           /* pieces [0, next) are free */
    uint32_t issued;         /* pieces [0, issued) had their DMA issued */
} _ring;

/* Frees the pieces whose slab's previous DMA completed: with block, waits
 * until piece `upto` is free. 0, or a driver error. */
static int _ring_free(_pipe *pp, _ring *g, uint32_t upto, int block)
{
    while (g->next < pp->np && g->next < g->issued + g->R) {
        CUevent f = g->fence[g->next % g->R];
        CUresult q = block && g->next <= upto ? mtc_cu.cuEventSynchronize(f) : mtc_cu.cuEventQuery(f);
        if (q == MTC_CUDA_ERROR_NOT_READY) return 0;
        if (q != MTC_CUDA_SUCCESS) return mtc_cu_rc(q);
        mtc_flag_set(&pp->pc[g->next++].free);
    }
    return 0;
}

static void _ring_task(void *arg, uint32_t i)
{
    /* Spin a while before sleeping: a slab usually frees within a DMA of one
     * piece, and a helper woken from the futex starts tens of microseconds late. */
    mtc_futex_wait_while(&((_task *)arg)[i].piece->free.v, 0, 2048, -1);
    _piece_task(arg, i);
}

/* Issues the ring's DMAs in piece order; after an error the pieces not yet
 * free copy nothing. Returns once every task finished. */
static void _run_ring(_pipe *pp, _ring *g, CUstream s)
{
    _piece *pc = pp->pc;
    for (uint32_t i = 0; i < pp->np; i++) pc[i].slab = g->slab[i % g->R];
    for (g->next = 0; g->next < pp->np && g->next < g->R; g->next++) mtc_flag_set(&pc[g->next].free);
    mtc_batch batch;
    mtc_batch_submit(&batch, _ring_task, pp->tk, pp->nt);
    for (uint32_t i = 0; i < pp->np && !pp->err; i++) {
        _piece *p = &pc[i];
        int rc = _ring_free(pp, g, i, 1);
        /* while the piece is copied, free the next ones as their DMAs complete */
        while (!rc && mtc_flag_wait(&p->done, 20000) != 0) rc = _ring_free(pp, g, i, 0);
        if (rc) {
            pp->err = mtc_run_fail(pp->r, rc, p->leaf, "waiting for a staging copy");
            break;
        }
        uint32_t te = i + 1 < pp->np ? pc[i + 1].task0 : pp->nt;
        for (uint32_t t = p->task0; t < te && !pp->err; t++)
            if (pp->tk[t].err) pp->err = mtc_run_fail_file(pp->r, pp->tk[t].err, p->leaf, &pp->tk[t].ferr);
        if (!pp->err && !(pp->err = _dma_h2d(pp->r, p->dst, p->slab->ptr, p->n, s, p->leaf)) &&
            (pp->err = mtc_cu_rc(mtc_cu.cuEventRecord(g->fence[i % g->R], s))))
            mtc_run_fail(pp->r, pp->err, p->leaf, "recording a staging fence");
        g->issued = i + 1;
    }
    /* cancel what did not start: no slab, free at once */
    for (uint32_t k = g->next; k < pp->np; k++) {
        pc[k].slab = NULL;
        mtc_flag_set(&pc[k].free);
    }
    mtc_batch_wait(&batch);
}

/* Takes the ring's R slabs and their fences; runs it; gives them back fenced
 * after its last DMA. */
static void _h2d_ring(_pipe *pp, CUstream s, size_t piece, uint32_t R)
{
    mtc_slab *slab[64];
    CUevent fence[64];
    _ring g = {.slab = slab, .fence = fence, .R = R};
    int32_t leaf0 = pp->pc[0].leaf;
    uint32_t got = 0;
    for (; got < R && !pp->err; got++) {
        void *f;
        if ((pp->err = mtc_slab_alloc(pp->pool, piece, &slab[got]))) {
            mtc_run_fail(pp->r, pp->err, leaf0, "allocating pinned staging memory");
            break;
        }
        if ((pp->err = mtc_slab_fence(pp->pool, slab[got], &f))) {
            mtc_run_fail(pp->r, pp->err, leaf0, "creating a staging fence");
            got++;
            break;
        }
        fence[got] = (CUevent)f;
    }
    if (!pp->err) _run_ring(pp, &g, s);
    for (uint32_t k = 0; k < got; k++) {
        int rc = _release_after(pp->r, pp->pool, slab[k], s, leaf0);
        if (rc && !pp->err) pp->err = rc;
    }
}

/* Staged large copies: pieces through pinned slabs (see _piece), by the ring
 * (MTC_H2D_RING slabs; 0: the windowed pipeline), or by windows where there
 * are no helpers. */
static int _h2d_staged(mtc_run *r, const mtc_op *ops, uint32_t nops, size_t total)
{
    mtc_job *j = r->job;
    int dev = ops[0].dev;
    CUstream s = j->streams[dev];
    int32_t leaf0 = j->items[ops[0].first].leaf;
    int rc;
    mtc_slab_pool *pool = mtc_pinned_pool(dev, &rc);
    if (!pool) return mtc_run_fail(r, rc, leaf0, "creating the pinned pool");

    uint32_t helpers = (uint32_t)mtc_pool_size();
    int64_t v;
    size_t ring = !helpers ? 0 : mtc_env_int(MTC_ENV_H2D_RING, &v) == 1 ? (size_t)v : MTC_H2D_RING_SLABS;
    if (ring > 64) ring = 64;
    size_t piece, task;
    int nt;
    if (ring) {
        /* Ring: slabs small enough that R of them stay in the cache, tasks
         * that spread a piece over several helpers, plain stores (streaming
         * ones would send the bytes to memory). */
        piece = _or(mtc_load_relaxed(&_tune_piece), MTC_H2D_RING_PIECE);
        task = _or(mtc_load_relaxed(&_tune_task), MTC_H2D_RING_TASK);
        nt = mtc_load_relaxed(&_tune_nt) == 1;
    } else {
        /* Windows: pieces large enough that the per-piece DMA and fence stay
         * cheap, small enough that the first DMA starts early and every
         * helper gets two: 1 to 4 MiB. Tasks of 512 KiB keep every helper on
         * the first pieces; streaming stores. */
        piece = _or(mtc_load_relaxed(&_tune_piece), MTC_PIECE_BYTES);
        while (piece > ((size_t)1 << 20) && total / piece < 2 * (size_t)(helpers ? helpers : 1)) piece /= 2;
        task = _or(mtc_load_relaxed(&_tune_task), MTC_H2D_WINDOW_TASK);
        nt = mtc_load_relaxed(&_tune_nt) != 0;
    }
    /* The slabs held at once stay within a quarter of the cap, or the pool's
     * backpressure would wait on slabs only this run releases (or, with two
     * runs on one device, on each other's): under a small cap the pieces
     * shrink until two of them fit in that quarter. */
    size_t cap = mtc_pinned_cap();
    while (piece > 65536 && cap / (4 * piece) < 2) piece /= 2;
    if (piece < 65536) piece = 65536;
    if (!ring && cap < 2 * piece) /* two windows of one piece could never be held */
        return mtc_run_fail(r, -E2BIG, leaf0, "allocating pinned staging memory");
    if (!task || task > piece) task = piece;
    if (task < 65536) task = 65536;
    _pipe pp = {.r = r, .pool = pool};
    if (_plan_pipe(&pp, j->items, ops, nops, piece, task, nt)) {
        free(pp.pc);
        free(pp.tk);
        return mtc_run_fail(r, -ENOMEM, leaf0, "planning the staged copy");
    }
    size_t cap_pieces = cap / (4 * piece);
    MTC_COUNT(pieces, pp.np);
    int64_t t0 = mtc_now_ns();
    if (ring) {
        /* a slab more than the pieces would never be written */
        if (ring > pp.np) ring = pp.np;
        if (ring > cap_pieces) ring = cap_pieces ? cap_pieces : 1;
        _h2d_ring(&pp, s, piece, (uint32_t)ring);
    } else {
        uint32_t W = helpers ? 2 * helpers : 1; /* pieces per window: two per helper */
        if (W > cap_pieces) W = cap_pieces ? (uint32_t)cap_pieces : 1;
        if (W > pp.np) W = pp.np;
        pp.W = W;
        _run_windows(&pp, s, helpers);
    }
    MTC_COUNT(ns_stage, mtc_now_ns() - t0);
    free(pp.pc);
    free(pp.tk);
    return pp.err;
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
    if (j->staging) return total ? _h2d_staged(r, ops, nops, total) : 0;
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

/* DMA straight from page-locked memory the caller owns (an arena region);
 * op->after runs on a driver thread once the DMA completed, and frees it. */
int mtc_h2d_region(mtc_run *r, const mtc_op *op)
{
    mtc_job *j = r->job;
    const mtc_item *items = &j->items[op->first];
    int32_t leaf0 = op->count ? items[0].leaf : -1;
    CUstream s = j->streams[op->dev];
    int rc = mtc_run_use_dev(r, op->dev);
    if (rc) mtc_run_fail(r, rc, leaf0, "selecting the device");
    for (uint32_t k = 0; !rc && k < op->count; k++)
        if (items[k].nbytes)
            rc = _dma_h2d(r, items[k].dst, (const void *)items[k].src, (size_t)items[k].nbytes, s, items[k].leaf);
    MTC_COUNT(items_copied, op->count);
    if (!rc && op->after) rc = mtc_cu_rc(mtc_cu.cuLaunchHostFunc(s, op->after, op->after_arg));
    if (rc && op->after) {
        /* not queued: once the stream drained nothing reads the region; a
         * stream that cannot be drained may still read it, so the region is
         * then kept (in use until the arena goes) rather than reused */
        if (mtc_cu_rc(mtc_cu.cuStreamSynchronize(s)) == 0) op->after(op->after_arg);
        mtc_run_fail(r, rc, leaf0, "queueing the release of an arena region");
    }
    return rc;
}
