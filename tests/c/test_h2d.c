/*
 * test_h2d.c - unit tests for the large host -> device copies of csrc/engine/h2d.c
 * (MTC_OP_H2D ops of a job with pinned staging, run by mtc_h2d_large): the
 * staging ring, where R pinned slabs are reused in turn (piece i is staged by
 * the helpers into slab i % R, and may be written only once the DMA of piece
 * i - R from that slab completed), and the windowed pipeline (MTC_H2D_RING=0).
 *
 * The CUDA driver is fake_cuda.c (libcuda.so.1 on LD_LIBRARY_PATH, set by
 * tests/c/Makefile): "device" buffers are host buffers, and every copy is
 * performed later by the stream's worker thread after a delay, so a slab
 * written again before its DMA ran shows up as wrong bytes on the "device",
 * as a source that changed between the copy's call and its execution
 * (fake_cuda_stats.src_changed), and under TSan as a race with the worker.
 *
 * Checked, for several sources of odd sizes at odd offsets in one job:
 *   - the bytes on the device equal the sources, over repeated jobs, run
 *     inline and on the transfer thread, on a created and the default stream:
 *     ring of 2 slabs of 64 KiB pieces (heavy reuse), of 1, 3 (pieces of odd
 *     size, split in unequal tasks), 64 (and 100, capped at 64), the default
 *     ring, streaming stores, one helper, the windowed pipeline; a slow DMA,
 *     where the helpers must wait for slabs; two rings at once; jobs queued
 *     back to back, each taking the slabs the previous one's DMAs still read;
 *     a leaf read from a file (two parts) by the helpers into the slabs, and
 *     a read that fails (the job names the leaf, the part, the bytes read);
 *   - the ring's discipline as the driver sees it: at most R copies in
 *     flight, from exactly R distinct slabs, every one from page-locked
 *     memory; and the pool holds R slabs of the piece's class afterwards;
 *   - failures injected into cuMemcpyHtoDAsync, cuEventRecord,
 *     cuEventSynchronize / cuEventQuery, cuMemHostAlloc and cuEventCreate:
 *     the job fails with the driver's code and the step, returns (no hang),
 *     the pieces issued before the failure arrived intact, every slab went
 *     back to the pool, and the next job succeeds;
 *   - the region op of an unpack (MTC_OP_H2D_REGION): one DMA per item that
 *     has bytes, its `after` once after all of them, also when one fails;
 *   - packed chunks (MTC_OP_H2D_CHUNK): a chunk's storage groups staged in
 *     one slab, fenced once, a DMA per group, also when one fails;
 *   - at the end, with the pool trimmed, no page-locked memory and no event is left.
 *   - small pinned caps (one default slab but not two; two rings at once
 *     under 5 MiB; 160 KiB): the pieces shrink so that every copy completes
 *     with its bytes; with the windowed pipeline a cap below two 64 KiB
 *     slabs is an error, not a wait.
 *
 * Built and run by tests/c/Makefile under ASan+UBSan and under TSan.
 */
#include "runner.h"

#include <dlfcn.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cuda.h"
#include "fake_cuda.h"
#include "hostcopy.h"
#include "pinned.h"
#include "slab.h"
#include "transfer.h"
#include "uring.h"

static char g_case[200] = "setup";
#define CHECK_NOTE() fprintf(stderr, "  in case: %s\n", g_case)
#include "check.h"

#define KIB ((size_t)1 << 10)
#define MIB ((size_t)1 << 20)
#define HELPERS 3
#define HELPERS_STR "3"
#define WAIT_NS (60LL * 1000000000LL) /* a job that takes longer has hung */

static const fake_cuda_api *fk;  /* the fake driver's controls */
static CUstream g_stream;        /* a created stream; NULL (the default one) in some cases */
static uint8_t *g_src;           /* random bytes the sources are cut from */
static size_t g_src_len;
static int g_reps;               /* repetitions of each case (fewer under TSan) */

/* One source: bytes [off, off + n) of g_src. */
typedef struct src_spec { size_t off, n; } src_spec;

/* Odd sizes at odd offsets, an empty one and a small one among them; 3 to 20 MiB. */
static const src_spec SRCS_BIG[] = {
    {1, 3 * MIB + 17}, {3 * MIB + 101, 5 * MIB + 4095}, {9 * MIB + 7, 12345},
    {9 * MIB + 20001, 0}, {10 * MIB + 3, 7 * MIB - 1}, {17 * MIB + 555, 20 * MIB + 333},
};
static const src_spec SRCS_MID[] = {{77, 3 * MIB + 1}, {4 * MIB + 9, 4 * MIB + 65537}};
/* Ends with whole pieces: the last DMAs of a job read whole slabs. */
static const src_spec SRCS_B2B[] = {{MIB + 11, 2 * MIB + 3}, {5, MIB}};

#define NSRC(a) (sizeof(a) / sizeof((a)[0]))

/* How a case runs: the ring (MTC_H2D_RING; NULL: unset), the staged copy's
 * piece, task and store kind (mtc_h2d_tune; NULL: the engine's), the fake
 * DMA's delay. */
typedef struct cfg {
    const char *ring, *piece, *task, *nt;
    unsigned delay_min_us, delay_max_us;
} cfg;

static void set_env(const char *name, const char *v)
{
    if (v) setenv(name, v, 1);
    else unsetenv(name);
}

static void apply(const cfg *c)
{
    set_env("MTC_H2D_RING", c->ring);
    size_t task = c->task ? (size_t)atoll(c->task) : 0;
    if (c->task && !task) task = SIZE_MAX; /* "0": one task per piece (the engine bounds it by the piece) */
    mtc_h2d_tune(c->piece ? (size_t)atoll(c->piece) : 0, task, c->nt ? atoi(c->nt) : -1);
    fk->set_delay(c->delay_min_us, c->delay_max_us);
}

static size_t total_of(const src_spec *s, int n)
{
    size_t t = 0;
    for (int k = 0; k < n; k++) t += s[k].n;
    return t;
}

/* The piece size c sets (mtc_h2d_tune, at least 64 KiB as _h2d_staged
 * bounds it), or 0 where c leaves it to the engine. */
static size_t piece_of(const cfg *c)
{
    size_t piece = c->piece ? (size_t)atoll(c->piece) : 0;
    return c->piece && piece < 65536 ? 65536 : piece;
}

/* 1 when c runs the ring (MTC_H2D_RING unset or not 0), 0 for the windows. */
static int is_ring(const cfg *c) { return !c->ring || atoll(c->ring) != 0; }

/* The ring's slabs c sets (MTC_H2D_RING of 1 to 64; pieces of at most a few
 * MiB keep the pinned cap's bound out of the way), or 0 where c leaves them
 * to the engine. */
static uint32_t ring_of(const cfg *c)
{
    long long r = c->ring ? atoll(c->ring) : 0;
    return r >= 1 && r <= 64 ? (uint32_t)r : 0;
}

static uint32_t pieces_of(const src_spec *s, int n, size_t piece)
{
    uint32_t np = 0;
    for (int k = 0; k < n; k++) np += (uint32_t)((s[k].n + piece - 1) / piece);
    return np;
}

/* The leaf (source index) of piece `p`, and where it starts in it. */
static int leaf_of_piece(const src_spec *s, int n, size_t piece, uint32_t p, size_t *off)
{
    for (int k = 0; k < n; k++) {
        uint32_t np = (uint32_t)((s[k].n + piece - 1) / piece);
        if (p < np) {
            *off = (size_t)p * piece;
            return k;
        }
        p -= np;
    }
    FAILF("piece %u out of range", p);
}

/* A job of one MTC_OP_H2D op per source, to dev[k], on stream s of device 0. */
static mtc_job *h2d_job(const src_spec *s, int n, uint8_t **dev, CUstream stream)
{
    mtc_job *j = mtc_job_new((uint32_t)n, (uint32_t)n);
    CHECK(j != NULL);
    j->target = 0;
    j->staging = 1;
    j->dev_mask = 1;
    j->streams[0] = stream;
    for (int k = 0; k < n; k++) {
        CHECK(s[k].off + s[k].n <= g_src_len);
        j->items[k] = (mtc_item){.src = (uintptr_t)(g_src + s[k].off), .dst = (uintptr_t)dev[k],
                                 .nbytes = (int64_t)s[k].n, .dev = -1, .leaf = k};
        j->ops[k] = (mtc_op){.kind = MTC_OP_H2D, .dev = 0, .first = (uint32_t)k, .count = 1};
    }
    j->nops = j->nitems = (uint32_t)n;
    return j;
}

static uint8_t **dev_alloc(const src_spec *s, int n)
{
    uint8_t **dev = calloc((size_t)n, sizeof *dev);
    CHECK(dev != NULL);
    for (int k = 0; k < n; k++) {
        dev[k] = malloc(s[k].n ? s[k].n : 1); /* exactly n: ASan catches a copy past the end */
        CHECK(dev[k] != NULL);
    }
    return dev;
}

static void dev_fill(const src_spec *s, int n, uint8_t **dev)
{
    for (int k = 0; k < n; k++) memset(dev[k], 0x5A, s[k].n);
}

static void dev_free(uint8_t **dev, int n)
{
    for (int k = 0; k < n; k++) free(dev[k]);
    free(dev);
}

/* Bytes [a, b) of source k arrived. */
static void check_bytes(const src_spec *s, int k, uint8_t **dev, size_t a, size_t b)
{
    if (b <= a || !memcmp(dev[k], g_src + s[k].off + a, b - a)) return;
    size_t i = a;
    while (dev[k][i] == g_src[s[k].off + i]) i++;
    FAILF("source %d (%zu bytes): first wrong byte at %zu (0x%02x, expected 0x%02x)", k, s[k].n, i,
          dev[k][i], g_src[s[k].off + i]);
}

static mtc_slab_pool *pool0(void)
{
    int err = 0;
    mtc_slab_pool *p = mtc_pinned_pool(0, &err);
    CHECK(p != NULL);
    return p;
}

/* No slab in use, the pool's books consistent. */
static void check_pool_idle(void)
{
    mtc_slab_stats st;
    CHECK_EQ(mtc_pinned_stats(0, &st), 0);
    CHECK_EQ(st.slabs_in_use, 0);
    CHECK_EQ(st.bytes_in_use, 0);
    CHECK(mtc_slab_valid(pool0()));
}

/* What the engine must never do, as the fake driver saw it. */
static void check_driver_clean(const fake_cuda_stats *f)
{
    CHECK_EQ(f->src_changed, 0);
    CHECK_EQ(f->pageable_htod, 0);
    CHECK_EQ(f->no_context, 0);
    CHECK_EQ(f->freed_in_flight, 0);
    CHECK_EQ(f->destroyed_in_use, 0);
}

static void sync_stream(CUstream s) { CHECK_EQ(mtc_cu.cuStreamSynchronize(s), MTC_CUDA_SUCCESS); }

/* Runs j inline or on the transfer thread; returns once it completed. */
static void run_job(mtc_job *j, int submit)
{
    if (submit) {
        CHECK_EQ(mtc_transfer_submit(j), 0);
        CHECK_EQ(mtc_job_wait(j, WAIT_NS), 0);
    } else {
        mtc_transfer_run(j);
    }
    CHECK(mtc_job_complete(j));
}

/* Copies the sources with config c g_reps times and checks every byte, and
 * the ring's discipline where c is a ring. Returns the largest number of
 * copies in flight seen. */
static uint64_t run_case(const char *name, const cfg *c, const src_spec *s, int n, CUstream stream)
{
    snprintf(g_case, sizeof g_case, "%s", name);
    apply(c);
    size_t total = total_of(s, n), piece = piece_of(c);
    uint32_t R = ring_of(c), np = piece ? pieces_of(s, n, piece) : 0; /* 0: the engine's choice */
    uint8_t **dev = dev_alloc(s, n);
    uint64_t max_in_flight = 0, pieces = 0, slabs = 0;
    double t0 = now_s();
    for (int rep = 0; rep < g_reps; rep++) {
        snprintf(g_case, sizeof g_case, "%s, rep %d", name, rep);
        dev_fill(s, n, dev);
        fk->reset_stats();
        mtc_transfer_stats e0, e1;
        mtc_transfer_get_stats(&e0);
        mtc_job *j = h2d_job(s, n, dev, stream);
        run_job(j, rep & 1);
        if (j->err) FAILF("job failed: %d at leaf %d, %s", j->err, j->err_leaf, j->err_where);
        CHECK_EQ(atomic_load(&j->state), MTC_JOB_DONE);
        mtc_job_release(j);
        sync_stream(stream); /* the job returns with its DMAs queued */
        for (int k = 0; k < n; k++) check_bytes(s, k, dev, 0, s[k].n);

        fake_cuda_stats f;
        fk->get_stats(&f);
        mtc_transfer_get_stats(&e1);
        check_driver_clean(&f);
        pieces = e1.pieces - e0.pieces;
        if (np) CHECK_EQ(pieces, np);
        CHECK(pieces >= 1);
        CHECK_EQ(f.htod_calls, pieces); /* one DMA per piece */
        CHECK_EQ(f.copies_done, pieces);
        CHECK_EQ(f.htod_bytes, total);
        CHECK_EQ(e1.bytes_h2d - e0.bytes_h2d, total);
        if (is_ring(c)) {
            /* at most one DMA in flight per slab, at most 64 slabs */
            CHECK(f.nsrcs <= 64);
            CHECK(f.max_htod_in_flight <= f.nsrcs);
        }
        if (R) {
            /* exactly R slabs, and piece i + R issued only after the DMA of piece i completed */
            CHECK_EQ(f.nsrcs, pieces < R ? pieces : R);
            CHECK(f.max_htod_in_flight <= R);
        }
        if (f.max_htod_in_flight > max_in_flight) max_in_flight = f.max_htod_in_flight;
        slabs = f.nsrcs;
        check_pool_idle();
    }
    dev_free(dev, n);
    printf("  %-44s %4llu pieces, %3llu slabs: %d reps in %.2f s, <= %llu DMAs in flight\n", name,
           (unsigned long long)pieces, (unsigned long long)slabs, g_reps, now_s() - t0,
           (unsigned long long)max_in_flight);
    return max_in_flight;
}

/* Frees every idle slab (after the stream drained, all of them): the pool holds nothing. */
static void trim_all(CUstream s)
{
    sync_stream(s);
    mtc_pinned_trim();
    mtc_slab_stats st;
    CHECK_EQ(mtc_pinned_stats(0, &st), 0);
    CHECK_EQ(st.slabs_held, 0);
}

static void test_copies(void)
{
    const int nb = (int)NSRC(SRCS_BIG), nm = (int)NSRC(SRCS_MID);
    run_case("ring 2, 64 KiB pieces", &(cfg){.ring = "2", .piece = "65536", .delay_max_us = 20}, SRCS_BIG, nb,
             g_stream);
    run_case("ring 2, 64 KiB pieces, task 0 (= piece)",
             &(cfg){.ring = "2", .piece = "65536", .task = "0", .delay_max_us = 5}, SRCS_BIG, nb, g_stream);
    run_case("ring 1, 64 KiB pieces", &(cfg){.ring = "1", .piece = "65536", .delay_max_us = 10}, SRCS_MID, nm,
             g_stream);
    run_case("ring 3, 128 KiB + 1 pieces, 64 KiB tasks",
             &(cfg){.ring = "3", .piece = "131073", .task = "65536", .delay_max_us = 30}, SRCS_BIG, nb, g_stream);
    run_case("ring 100 (64), 64 KiB pieces", &(cfg){.ring = "100", .piece = "65536", .delay_max_us = 20},
             SRCS_BIG, nb, g_stream);
    run_case("ring default", &(cfg){.delay_max_us = 50}, SRCS_BIG, nb, g_stream);
    run_case("ring default, default stream", &(cfg){.delay_max_us = 50}, SRCS_BIG, nb, NULL);
    run_case("ring 4, 1 MiB + 3 pieces, streaming stores",
             &(cfg){.ring = "4", .piece = "1048579", .task = "200000", .nt = "1", .delay_max_us = 40}, SRCS_BIG,
             nb, g_stream);
    run_case("windows, default pieces", &(cfg){.ring = "0", .delay_max_us = 50}, SRCS_BIG, nb, g_stream);
    run_case("windows, 64 KiB pieces", &(cfg){.ring = "0", .piece = "65536", .delay_max_us = 10}, SRCS_BIG, nb,
             g_stream);
}

/* The DMA much slower than the staging: the helpers wait for slabs, and the
 * ring stays full (R copies in flight). */
static void test_slow_dma(void)
{
    uint64_t m = run_case("slow DMA, ring 2, 64 KiB pieces",
                          &(cfg){.ring = "2", .piece = "65536", .delay_min_us = 300, .delay_max_us = 600}, SRCS_MID,
                          (int)NSRC(SRCS_MID), g_stream);
    CHECK_EQ(m, 2);
    m = run_case("slow DMA, ring 5, 256 KiB pieces",
                 &(cfg){.ring = "5", .piece = "262144", .delay_min_us = 500, .delay_max_us = 1500}, SRCS_MID,
                 (int)NSRC(SRCS_MID), g_stream);
    CHECK_EQ(m, 5);
}

/* One helper: it stages every piece alone, and waits for each slab. */
static void test_one_helper(void)
{
    mtc_pool_stop();
    setenv("MTC_HELPER_THREADS", "1", 1);
    CHECK_EQ(mtc_pool_start(0), 0);
    CHECK_EQ(mtc_pool_size(), 1);
    run_case("one helper, ring 2, 64 KiB pieces", &(cfg){.ring = "2", .piece = "65536", .delay_max_us = 30},
             SRCS_MID, (int)NSRC(SRCS_MID), g_stream);
    run_case("one helper, ring default", &(cfg){.delay_max_us = 30}, SRCS_MID, (int)NSRC(SRCS_MID), g_stream);
    mtc_pool_stop();
    setenv("MTC_HELPER_THREADS", HELPERS_STR, 1);
    CHECK_EQ(mtc_pool_start(0), 0);
    CHECK_EQ(mtc_pool_size(), HELPERS);
}

/* The pool holds R slabs of the piece's class after a ring ran, no more. */
static void test_pool_holds_ring(void)
{
    static const struct { const char *ring, *piece; size_t cls; uint64_t R; } rs[] = {
        {"2", "65536", 64 * KIB, 2}, {"3", "131073", 256 * KIB, 3}, {"7", "300000", 512 * KIB, 7}};
    for (size_t i = 0; i < sizeof rs / sizeof rs[0]; i++) {
        char name[64];
        snprintf(name, sizeof name, "pool holds the ring of %s", rs[i].ring);
        trim_all(g_stream);
        mtc_slab_stats a, b;
        CHECK_EQ(mtc_pinned_stats(0, &a), 0);
        run_case(name, &(cfg){.ring = rs[i].ring, .piece = rs[i].piece, .delay_max_us = 20}, SRCS_MID,
                 (int)NSRC(SRCS_MID), g_stream);
        CHECK_EQ(mtc_pinned_stats(0, &b), 0);
        CHECK_EQ(b.slabs_held, rs[i].R);
        CHECK_EQ(b.bytes_held, rs[i].R * rs[i].cls);
        CHECK_EQ(b.allocs - a.allocs, rs[i].R); /* once, then reused by every repetition */
    }
}

/* Two rings at once on one pool and one set of helpers: one job on the
 * transfer thread, one inline on this thread, each on its own stream. */
static void test_two_rings(const char *name, const cfg *c, size_t cap, int max_in_flight, int64_t wait_ns)
{
    snprintf(g_case, sizeof g_case, "%s", name);
    apply(c);
    CUstream s2;
    CHECK_EQ(mtc_cuda_set_device(0), 0);
    CHECK_EQ(mtc_cu.cuStreamCreate(&s2, MTC_CU_STREAM_NON_BLOCKING), MTC_CUDA_SUCCESS);
    const int nb = (int)NSRC(SRCS_BIG), nm = (int)NSRC(SRCS_MID);
    uint8_t **da = dev_alloc(SRCS_BIG, nb), **db = dev_alloc(SRCS_MID, nm);
    if (cap) {
        trim_all(g_stream);
        CHECK_EQ(mtc_pinned_set_cap(cap), 0);
    }
    fk->reset_stats();
    for (int rep = 0; rep < g_reps; rep++) {
        dev_fill(SRCS_BIG, nb, da);
        dev_fill(SRCS_MID, nm, db);
        mtc_job *a = h2d_job(SRCS_BIG, nb, da, g_stream), *b = h2d_job(SRCS_MID, nm, db, s2);
        CHECK_EQ(mtc_transfer_submit(a), 0);
        mtc_transfer_run(b);
        if (mtc_job_wait(a, wait_ns)) FAILF("%s: the job on the transfer thread hung", name);
        CHECK_EQ(a->err, 0);
        CHECK_EQ(b->err, 0);
        mtc_job_release(a);
        mtc_job_release(b);
        sync_stream(g_stream);
        sync_stream(s2);
        for (int k = 0; k < nb; k++) check_bytes(SRCS_BIG, k, da, 0, SRCS_BIG[k].n);
        for (int k = 0; k < nm; k++) check_bytes(SRCS_MID, k, db, 0, SRCS_MID[k].n);
        check_pool_idle();
    }
    fake_cuda_stats f;
    fk->get_stats(&f);
    check_driver_clean(&f);
    if (max_in_flight) CHECK(f.max_htod_in_flight <= (uint64_t)max_in_flight);
    if (cap) CHECK_EQ(mtc_pinned_set_cap((size_t)1 << 30), 0);
    dev_free(da, nb);
    dev_free(db, nm);
    printf("  %-60s %d reps\n", name, g_reps);
}

/* Jobs queued back to back with no wait for the stream between them: a job
 * returns with its last DMAs in flight, and the next one takes the same
 * slabs from the pool, which must wait for their fences. */
static void test_back_to_back(const char *name, const cfg *c)
{
    enum { NJOBS = 4 };
    snprintf(g_case, sizeof g_case, "%s", name);
    apply(c);
    const src_spec *s = SRCS_B2B;
    const int n = (int)NSRC(SRCS_B2B);
    uint8_t **dev[NJOBS];
    mtc_job *j[NJOBS];
    for (int rep = 0; rep < g_reps; rep++) {
        trim_all(g_stream); /* the pool's only slabs of the class are those the jobs take in turn */
        fk->reset_stats();
        for (int k = 0; k < NJOBS; k++) {
            dev[k] = dev_alloc(s, n);
            dev_fill(s, n, dev[k]);
            j[k] = h2d_job(s, n, dev[k], g_stream);
        }
        for (int k = 0; k < NJOBS; k++) {
            if (rep & 1) mtc_transfer_run(j[k]);
            else CHECK_EQ(mtc_transfer_submit(j[k]), 0);
        }
        for (int k = 0; k < NJOBS; k++) {
            CHECK_EQ(mtc_job_wait(j[k], WAIT_NS), 0);
            CHECK_EQ(j[k]->err, 0);
            mtc_job_release(j[k]);
        }
        sync_stream(g_stream);
        for (int k = 0; k < NJOBS; k++) {
            for (int i = 0; i < n; i++) check_bytes(s, i, dev[k], 0, s[i].n);
            dev_free(dev[k], n);
        }
        fake_cuda_stats f;
        fk->get_stats(&f);
        check_driver_clean(&f);
        check_pool_idle();
    }
    printf("  %-44s %d jobs, %d reps\n", name, NJOBS, g_reps);
}

/* ---- file-backed sources: the helpers read each task's bytes into the slab ---- */

/* A spec (uring.h) of nparts parts of `path`: part k is bytes [offs[k], offs[k] + lens[k]). */
static uint8_t *file_spec(const char *path, uint32_t nparts, const uint64_t *offs, const uint64_t *lens,
                          size_t *nbytes)
{
    size_t plen = strlen(path) + 1;
    uint8_t *buf = malloc(sizeof(mtc_file_spec_hdr) + sizeof(int64_t) + nparts * (sizeof(mtc_file_part) + plen));
    CHECK(buf != NULL);
    mtc_file_spec_hdr h = {MTC_FILE_SPEC_MAGIC, 3, 1, nparts, (uint32_t)(nparts * plen), 0};
    for (uint32_t k = 0; k < nparts; k++) h.nbytes += (int64_t)lens[k];
    uint8_t *p = buf;
    memcpy(p, &h, sizeof h);
    p += sizeof h;
    memcpy(p, &h.nbytes, sizeof h.nbytes); /* one dim: the bytes */
    p += sizeof h.nbytes;
    for (uint32_t k = 0; k < nparts; k++) {
        mtc_file_part part = {offs[k], lens[k], (uint32_t)(k * plen), (uint32_t)(plen - 1)};
        memcpy(p, &part, sizeof part);
        p += sizeof part;
    }
    for (uint32_t k = 0; k < nparts; k++, p += plen) memcpy(p, path, plen);
    mtc_file_spec view;
    CHECK_EQ(mtc_uring_spec_view(buf, (size_t)(p - buf), &view), 0);
    *nbytes = (size_t)h.nbytes;
    return buf;
}

/* A job of two large leaves, one read from a file (two parts of it) and one
 * from memory, through the ring; with a part that runs past the end of the
 * file, the read fails: the job reports the leaf, the part and the bytes of
 * it that arrived, and the pieces before arrived intact. */
static void test_files(void)
{
    snprintf(g_case, sizeof g_case, "file-backed sources");
    const char *tmp = getenv("TMPDIR");
    char path[512];
    snprintf(path, sizeof path, "%s/mtc_test_h2d_XXXXXX", tmp && *tmp ? tmp : "/tmp");
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    const size_t flen = 12 * MIB + 3;
    for (size_t at = 0; at < flen;) {
        ssize_t w = write(fd, g_src + at, flen - at);
        CHECK(w > 0);
        at += (size_t)w;
    }
    close(fd);
    const size_t piece = 65536;
    const uint64_t offs[2] = {12345, MIB + 1}, lens[2] = {3 * MIB + 7, 2 * MIB + 99999};
    const uint64_t bad_offs[2] = {12345, flen - MIB}, bad_lens[2] = {3 * MIB + 7, 2 * MIB};
    size_t fbytes, bad_bytes;
    uint8_t *spec = file_spec(path, 2, offs, lens, &fbytes), *bad = file_spec(path, 2, bad_offs, bad_lens, &bad_bytes);
    const src_spec mem = {5 * MIB + 3, 4 * MIB + 12345};
    uint8_t *dev_file = malloc(fbytes > bad_bytes ? fbytes : bad_bytes), *dev_mem = malloc(mem.n);
    CHECK(dev_file && dev_mem);

    for (int round = 0; round < 2 * g_reps; round++) {
        int failing = round & 1;
        const cfg c = {.ring = failing ? "2" : round & 2 ? "3" : "2", .piece = "65536",
                       .task = round & 2 ? "65536" : "200000", .delay_max_us = 20};
        snprintf(g_case, sizeof g_case, "file-backed sources, round %d%s", round, failing ? " (read fails)" : "");
        apply(&c);
        size_t n0 = failing ? bad_bytes : fbytes;
        memset(dev_file, 0x5A, n0);
        memset(dev_mem, 0x5A, mem.n);
        mtc_job *j = mtc_job_new(2, 2);
        CHECK(j != NULL);
        j->target = 0;
        j->staging = 1;
        j->dev_mask = 1;
        j->streams[0] = g_stream;
        j->items[0] = (mtc_item){.dst = (uintptr_t)dev_file, .nbytes = (int64_t)n0, .dev = -1, .leaf = 0,
                                 .file = failing ? bad : spec};
        j->items[1] = (mtc_item){.src = (uintptr_t)(g_src + mem.off), .dst = (uintptr_t)dev_mem,
                                 .nbytes = (int64_t)mem.n, .dev = -1, .leaf = 1};
        for (uint32_t k = 0; k < 2; k++) j->ops[k] = (mtc_op){.kind = MTC_OP_H2D, .dev = 0, .first = k, .count = 1};
        j->nops = j->nitems = 2;
        fk->reset_stats();
        run_job(j, !(round & 2)); /* the first failing read on the transfer thread: a hang fails the wait */
        sync_stream(g_stream);
        if (!failing) {
            if (j->err) FAILF("job failed: %d at leaf %d, %s", j->err, j->err_leaf, j->err_where);
            CHECK(!memcmp(dev_file, g_src + offs[0], lens[0]));
            CHECK(!memcmp(dev_file + lens[0], g_src + offs[1], lens[1]));
            CHECK(!memcmp(dev_mem, g_src + mem.off, mem.n));
        } else {
            /* part 1 ends 1 MiB into it: the piece holding that byte fails */
            CHECK_EQ(j->err, -ENODATA);
            if (strcmp(j->err_where, "reading a file")) FAILF("failed at \"%s\"", j->err_where);
            CHECK_EQ(j->err_leaf, 0);
            CHECK_EQ(j->err_part, 1);
            CHECK_EQ(j->err_got, MIB);
            size_t ok = (bad_lens[0] + MIB) / piece * piece; /* the pieces before it */
            CHECK(!memcmp(dev_file, g_src + bad_offs[0], bad_lens[0]));
            CHECK(!memcmp(dev_file + bad_lens[0], g_src + bad_offs[1], ok - bad_lens[0]));
        }
        mtc_job_release(j);
        fake_cuda_stats f;
        fk->get_stats(&f);
        check_driver_clean(&f);
        check_pool_idle();
    }
    unlink(path);
    free(spec);
    free(bad);
    free(dev_file);
    free(dev_mem);
    printf("  %-44s %d rounds\n", "file-backed sources", 2 * g_reps);
}

/* One injected failure: `point` fails with `code` after `after` good calls
 * (`times` times). The job fails with that code at `where` (NULL: any step),
 * returns, gives every slab back; with `issued` >= 0 the first `issued`
 * pieces (their DMAs queued before the failure) arrived intact. The next job
 * succeeds. */
static void fail_case(const char *name, const cfg *c, int point, unsigned after, unsigned times, int code,
                      const char *where, int issued, int trim_first)
{
    snprintf(g_case, sizeof g_case, "%s", name);
    const src_spec *s = SRCS_BIG;
    const int n = (int)NSRC(SRCS_BIG);
    apply(c);
    size_t piece = piece_of(c);
    CHECK(piece || issued < 0); /* which piece failed needs the piece size */
    uint8_t **dev = dev_alloc(s, n);
    if (trim_first) trim_all(g_stream);
    for (int submit = 1; submit >= 0; submit--) { /* on the transfer thread first: a hang fails the wait */
        dev_fill(s, n, dev);
        fk->reset_stats();
        fk->fail(point, after, times, code);
        mtc_job *j = h2d_job(s, n, dev, g_stream);
        run_job(j, submit); /* a hang fails the wait (submit), or the Makefile's timeout */
        fk->clear_failures();
        sync_stream(g_stream);
        fake_cuda_stats f;
        fk->get_stats(&f);
        CHECK(f.injected >= 1);
        CHECK_EQ(atomic_load(&j->state), MTC_JOB_FAILED);
        CHECK_EQ(j->err, MTC_CUDA_ERR(code));
        if (where && strcmp(j->err_where, where))
            FAILF("failed at \"%s\", expected \"%s\"", j->err_where, where);
        if (issued >= 0) {
            size_t off;
            int leaf = leaf_of_piece(s, n, piece, (uint32_t)issued, &off);
            CHECK_EQ(j->err_leaf, leaf);
            /* every piece before the failing one arrived */
            for (int k = 0; k < leaf; k++) check_bytes(s, k, dev, 0, s[k].n);
            check_bytes(s, leaf, dev, 0, off);
        }
        mtc_job_release(j);
        check_driver_clean(&f);
        check_pool_idle();
        if (trim_first) trim_all(g_stream);
    }
    /* the engine is fine afterwards */
    dev_fill(s, n, dev);
    mtc_job *j = h2d_job(s, n, dev, g_stream);
    run_job(j, 1);
    CHECK_EQ(j->err, 0);
    mtc_job_release(j);
    sync_stream(g_stream);
    for (int k = 0; k < n; k++) check_bytes(s, k, dev, 0, s[k].n);
    check_pool_idle();
    dev_free(dev, n);
    printf("  %-60s ok\n", name);
}

static void test_failures(void)
{
    const cfg r2 = {.ring = "2", .piece = "65536", .delay_max_us = 20};
    const cfg r2slow = {.ring = "2", .piece = "65536", .delay_min_us = 200, .delay_max_us = 300};
    const cfg rdef = {.piece = "2097152", .delay_max_us = 50}; /* the engine's ring of 2 MiB pieces */
    const cfg win = {.ring = "0", .piece = "65536", .delay_max_us = 20};
    const int E = 999; /* CUDA_ERROR_UNKNOWN */

    fail_case("ring 2: first DMA fails", &r2, FAKE_FAIL_HTOD, 0, 1, E, "host-to-device copy", 0, 0);
    fail_case("ring 2: DMA 1 fails", &r2, FAKE_FAIL_HTOD, 1, 1, E, "host-to-device copy", 1, 0);
    fail_case("ring 2: DMA 77 fails", &r2, FAKE_FAIL_HTOD, 77, 1, E, "host-to-device copy", 77, 0);
    fail_case("ring 2: DMA 150 fails, slow DMA", &r2slow, FAKE_FAIL_HTOD, 150, 1, E, "host-to-device copy", 150, 0);
    fail_case("ring 2: every DMA from 200 fails", &r2, FAKE_FAIL_HTOD, 200, 1000, E, "host-to-device copy", 200,
              0);
    fail_case("ring default, 2 MiB pieces: DMA 5 fails", &rdef, FAKE_FAIL_HTOD, 5, 1, E, "host-to-device copy", 5, 0);
    fail_case("windows: DMA 9 fails", &win, FAKE_FAIL_HTOD, 9, 1, E, "host-to-device copy", 9, 0);

    /* record k is the fence of piece k (its DMA queued before) */
    fail_case("ring 2: fence record 5 fails", &r2, FAKE_FAIL_EVENT_RECORD, 5, 1, E, "recording a staging fence",
              5, 0);
    fail_case("ring 2: every fence record from 40 fails", &r2, FAKE_FAIL_EVENT_RECORD, 40, 1000, E,
              "recording a staging fence", 40, 0);
    fail_case("ring default, 2 MiB pieces: fence record 0 fails", &rdef, FAKE_FAIL_EVENT_RECORD, 0, 1, E,
              "recording a staging fence", 0, 0);

    /* slow DMA: the transfer thread must wait for piece 2's slab (fence of piece 0) */
    fail_case("ring 2: first fence wait fails", &r2slow, FAKE_FAIL_EVENT_SYNC, 0, 1, E, "waiting for a staging copy",
              -1, 0);
    fail_case("ring 2: fence wait 30 fails", &r2slow, FAKE_FAIL_EVENT_SYNC, 30, 1, E, "waiting for a staging copy",
              -1, 0);
    fail_case("ring 2: fence query 20 fails", &r2slow, FAKE_FAIL_EVENT_QUERY, 20, 1, E, NULL, -1, 0);

    /* a fresh pool: the ring pins its slabs and creates their fences */
    fail_case("ring 2: first pin fails", &r2, FAKE_FAIL_HOST_ALLOC, 0, 1, E, "allocating pinned staging memory", -1,
              1);
    fail_case("ring 3: third pin fails", &(cfg){.ring = "3", .piece = "65536"}, FAKE_FAIL_HOST_ALLOC, 2, 1, E,
              "allocating pinned staging memory", -1, 1);
    fail_case("ring 2: second fence creation fails", &r2, FAKE_FAIL_EVENT_CREATE, 1, 1, E,
              "creating a staging fence", -1, 1);
    fail_case("ring 2: every fence creation fails", &r2, FAKE_FAIL_EVENT_CREATE, 0, 1000, E,
              "creating a staging fence", -1, 1);
    fail_case("windows: pin 3 fails", &win, FAKE_FAIL_HOST_ALLOC, 3, 1, E, "allocating pinned staging memory", -1, 1);
}

/* The region op of a packed batch's unpack (MTC_OP_H2D_REGION): one DMA per
 * item (a storage group of the region, each to its own device buffer), then
 * the op's `after` once, after every DMA ran; a failed DMA still calls
 * `after` once (after the stream drained), names the item's leaf, and the
 * items after it are not copied. */
static _Atomic int g_after_calls;
static uint8_t **g_after_dev;
static _Atomic int g_after_saw_bytes;

static void region_after(void *arg)
{
    const src_spec *s = arg;
    /* every DMA queued before on the stream has run: the last item's bytes are there */
    int ok = s[2].n == 0 || memcmp(g_after_dev[2], g_src + s[2].off, s[2].n) == 0;
    atomic_store(&g_after_saw_bytes, ok);
    atomic_fetch_add(&g_after_calls, 1);
}

static void test_region_items(void)
{
    static const src_spec S[] = {{3, 40000}, {40003, 0}, {40003, 123457}};
    snprintf(g_case, sizeof g_case, "region op of three items");
    apply(&(cfg){.delay_min_us = 100, .delay_max_us = 300});
    for (int fail_at = -1; fail_at < 2; fail_at++) {
        uint8_t **dev = dev_alloc(S, 3);
        dev_fill(S, 3, dev);
        g_after_dev = dev;
        atomic_store(&g_after_calls, 0);
        atomic_store(&g_after_saw_bytes, 0);
        mtc_job *j = mtc_job_new(1, 3);
        CHECK(j != NULL);
        j->target = 0;
        j->staging = 0;
        j->dev_mask = 1;
        j->streams[0] = g_stream;
        for (int k = 0; k < 3; k++)
            j->items[k] = (mtc_item){.src = (uintptr_t)(g_src + S[k].off), .dst = (uintptr_t)dev[k],
                                     .nbytes = (int64_t)S[k].n, .dev = -1, .leaf = k};
        j->ops[0] = (mtc_op){.kind = MTC_OP_H2D_REGION, .dev = 0, .first = 0, .count = 3,
                             .after = region_after, .after_arg = (void *)S};
        j->nops = 1;
        j->nitems = 3;
        fake_cuda_stats f0, f1;
        fk->get_stats(&f0);
        /* the empty item issues no DMA: DMA 1 is the third item's */
        if (fail_at >= 0) fk->fail(FAKE_FAIL_HTOD, (unsigned)fail_at, 1, 999);
        mtc_transfer_run(j);
        CHECK_EQ(mtc_job_wait(j, WAIT_NS), 0);
        sync_stream(g_stream);
        fk->clear_failures();
        fk->get_stats(&f1);
        CHECK_EQ(atomic_load(&g_after_calls), 1);
        if (fail_at < 0) {
            CHECK_EQ(j->err, 0);
            CHECK_EQ(f1.htod_calls - f0.htod_calls, 2);
            CHECK_EQ(atomic_load(&g_after_saw_bytes), 1);
            for (int k = 0; k < 3; k++) check_bytes(S, k, dev, 0, S[k].n);
        } else {
            CHECK(j->err != 0);
            CHECK_EQ(j->err_leaf, fail_at == 0 ? 0 : 2);
            if (fail_at == 1) check_bytes(S, 0, dev, 0, S[0].n);
        }
        mtc_job_release(j);
        dev_free(dev, 3);
    }
}

/* Packed chunks (MTC_OP_H2D_CHUNK): the storage groups of one chunk, each a
 * device buffer of its own, are staged into one pinned slab at their offsets
 * in the chunk and fenced once; one DMA per group. Two chunks of three groups
 * and one group: 4 DMAs, 2 slabs, 2 fences, every byte where its item
 * belongs; a DMA that fails names its group's first leaf, the groups before
 * it arrived, the slab goes back, and the next job succeeds. (Without pinned
 * staging the driver copies a pageable source out before the call returns,
 * which the fake does not model.) */
typedef struct chunk_item { int src; size_t dst; } chunk_item; /* source index, offset in its group */

static void test_chunk_groups(void)
{
    /* sources: odd sizes at odd offsets */
    static const src_spec S[] = {{5, 1000}, {2001, 24}, {3003, 300}, {4007, 41}, {5009, 7}, {6011, 70000}};
    /* chunk 0: groups at chunk offsets 0 (items 0, 1), 1024 (item 2), 1536 (items 3, 4); chunk 1: item 5 */
    static const struct { uint32_t chunk; int64_t off, nbytes; uint32_t first, count; } G[] = {
        {0, 0, 1024, 0, 2}, {0, 1024, 304, 2, 1}, {0, 1536, 56, 3, 2}, {1, 0, 70000, 5, 1}};
    static const chunk_item I[] = {{0, 0}, {1, 1000}, {2, 0}, {3, 0}, {4, 48}, {5, 0}};
    const int NG = 4, NI = 6;
    apply(&(cfg){.delay_min_us = 50, .delay_max_us = 200});
    const int staging = 1;
    {
        for (int fail_at = -1; fail_at < 4; fail_at++) {
            snprintf(g_case, sizeof g_case, "chunk groups, DMA %d fails", fail_at);
            uint8_t *dev[4];
            for (int g = 0; g < NG; g++) {
                CHECK((dev[g] = malloc((size_t)G[g].nbytes)) != NULL);
                memset(dev[g], 0x5A, (size_t)G[g].nbytes);
            }
            mtc_job *j = mtc_job_new((uint32_t)NG, (uint32_t)NI);
            CHECK(j != NULL);
            j->target = 0;
            j->staging = staging;
            j->dev_mask = 1;
            j->streams[0] = g_stream;
            for (int i = 0; i < NI; i++)
                j->items[i] = (mtc_item){.src = (uintptr_t)(g_src + S[I[i].src].off), .dst = I[i].dst,
                                         .nbytes = (int64_t)S[I[i].src].n, .dev = -1, .leaf = 10 + i};
            for (int g = 0; g < NG; g++)
                j->ops[g] = (mtc_op){.kind = MTC_OP_H2D_CHUNK, .dev = 0, .dst = (uintptr_t)dev[g],
                                     .nbytes = G[g].nbytes, .chunk = G[g].chunk, .chunk_off = G[g].off,
                                     .first = G[g].first, .count = G[g].count};
            j->nops = (uint32_t)NG;
            j->nitems = (uint32_t)NI;
            fk->reset_stats();
            mtc_transfer_stats e0, e1;
            mtc_transfer_get_stats(&e0);
            if (fail_at >= 0) fk->fail(FAKE_FAIL_HTOD, (unsigned)fail_at, 1, 999);
            run_job(j, fail_at & 1);
            sync_stream(g_stream);
            fk->clear_failures();
            fake_cuda_stats f;
            fk->get_stats(&f);
            mtc_transfer_get_stats(&e1);
            check_driver_clean(&f);
            check_pool_idle();
            /* the groups whose DMA ran: every item at its offset in its group's buffer */
            int ran = fail_at < 0 ? NG : fail_at;
            for (int g = 0; g < ran; g++)
                for (uint32_t i = G[g].first; i < G[g].first + G[g].count; i++) {
                    const src_spec *sp = &S[I[i].src];
                    if (memcmp(dev[g] + I[i].dst, g_src + sp->off, sp->n))
                        FAILF("group %d: item %u's bytes differ", g, i);
                }
            if (fail_at < 0) {
                CHECK_EQ(j->err, 0);
                CHECK_EQ(f.htod_calls, NG);
                CHECK_EQ(e1.chunks - e0.chunks, 2);
                CHECK_EQ(e1.bytes_h2d - e0.bytes_h2d, 1024 + 304 + 56 + 70000);
                CHECK_EQ(f.event_records, 2); /* one fence per chunk */
            } else {
                CHECK_EQ(j->err, MTC_CUDA_ERR(999));
                CHECK_EQ(j->err_leaf, 10 + (int)G[fail_at].first);
                CHECK(strstr(j->err_where, "host-to-device copy") != NULL);
            }
            mtc_job_release(j);
            for (int g = 0; g < NG; g++) free(dev[g]);
        }
    }
    printf("  %-60s ok\n", "chunk groups: one slab and one fence per chunk");
}

/* A small pinned cap: the pieces shrink until two fit in a quarter of it, so
 * the copy completes with its bytes (want_err 0) instead of waiting forever
 * for room that only its own slabs take; or it fails at once with want_err. */
static void test_small_cap(const char *name, const cfg *c, size_t cap, int want_err)
{
    snprintf(g_case, sizeof g_case, "%s", name);
    apply(c);
    const src_spec *s = SRCS_MID;
    const int n = (int)NSRC(SRCS_MID);
    uint8_t **dev = dev_alloc(s, n);
    dev_fill(s, n, dev);
    trim_all(g_stream);
    CHECK_EQ(mtc_pinned_set_cap(cap), 0);
    mtc_job *j = h2d_job(s, n, dev, g_stream);
    CHECK_EQ(mtc_transfer_submit(j), 0);
    if (mtc_job_wait(j, 20LL * 1000000000LL)) {
        mtc_slab_stats st;
        mtc_pinned_stats(0, &st);
        FAILF("the job hung: %llu slab(s) in use, the cap of %zu bytes leaves no room for the next",
              (unsigned long long)st.slabs_in_use, cap);
    }
    sync_stream(g_stream);
    CHECK_EQ(j->err, want_err);
    if (!j->err)
        for (int k = 0; k < n; k++) check_bytes(s, k, dev, 0, s[k].n);
    printf("  %-60s %s\n", name, j->err ? j->err_where : "copied");
    mtc_job_release(j);
    check_pool_idle();
    CHECK_EQ(mtc_pinned_set_cap((size_t)1 << 30), 0);
    dev_free(dev, n);
}

/* The fake driver's controls, from the libcuda.so.1 the engine loaded. */
static void bind_fake(void)
{
    int rc = mtc_cuda_load();
    if (rc) {
        char msg[256];
        mtc_cuda_describe(rc, msg, sizeof msg);
        FAILF("the fake libcuda.so.1 did not load (%s): run through tests/c/Makefile, which puts it on "
              "LD_LIBRARY_PATH", msg);
    }
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    CHECK(lib != NULL);
    fk = dlsym(lib, "fake_cuda");
    if (!fk) FAILF("libcuda.so.1 is not the tests' fake driver (fake_cuda.c): refusing to run on a real one");
    dlclose(lib); /* the engine holds its own reference */
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0); /* progress shows even when killed by the timeout */
    /* before the first job starts the helpers */
    setenv("MTC_HELPER_THREADS", HELPERS_STR, 1);
    unsetenv("MTC_PINNED_CAP_BYTES");
    unsetenv("MTC_SLAB_HUGEPAGES");
    mtc_transfer_init_once();
    bind_fake();
    g_reps = UNDER_TSAN ? 2 : 4;

    g_src_len = 40 * MIB;
    g_src = malloc(g_src_len);
    CHECK(g_src != NULL);
    uint64_t rng = 0x2545F4914F6CDD1Dull;
    for (size_t i = 0; i + 8 <= g_src_len; i += 8) {
        uint64_t w = xorshift64(&rng);
        memcpy(g_src + i, &w, 8);
    }
    CHECK_EQ(mtc_cuda_set_device(0), 0);
    CHECK_EQ(mtc_cu.cuStreamCreate(&g_stream, MTC_CU_STREAM_NON_BLOCKING), MTC_CUDA_SUCCESS);
    CHECK_EQ(mtc_pool_start(0), 0);
    CHECK_EQ(mtc_pool_size(), HELPERS);

    test_copies();
    test_slow_dma();
    test_one_helper();
    test_pool_holds_ring();
    /* each ring holds at most its 2 slabs: 4 copies in flight */
    test_two_rings("two rings at once", &(cfg){.ring = "2", .piece = "65536", .delay_max_us = 30}, 0, 4, WAIT_NS);
    test_files();
    /* slow DMA: the next job stages into the slabs well before their last DMAs run */
    test_back_to_back("back to back, ring 2, slow DMA",
                      &(cfg){.ring = "2", .piece = "65536", .delay_min_us = 500, .delay_max_us = 1500});
    test_back_to_back("back to back, ring default, slow DMA", &(cfg){.delay_min_us = 500, .delay_max_us = 1500});
    test_back_to_back("back to back, windows, slow DMA",
                      &(cfg){.ring = "0", .piece = "65536", .delay_min_us = 500, .delay_max_us = 1500});
    test_failures();
    test_region_items();
    test_chunk_groups();
    test_small_cap("ring default, cap of 3 MiB", &(cfg){.delay_max_us = 20}, 3 * MIB, 0);
    test_small_cap("ring default, cap of 160 KiB", &(cfg){.delay_max_us = 20}, 160 << 10, 0);
    test_small_cap("windows, cap of 1.5 MiB", &(cfg){.ring = "0", .delay_max_us = 20}, 3 * MIB / 2, 0);
    test_small_cap("windows, cap of 96 KiB", &(cfg){.ring = "0", .delay_max_us = 20}, 96 << 10, -E2BIG);
    /* each holds at most a quarter of the cap, so neither waits for the other's slabs */
    test_two_rings("two rings at once, cap of 5 MiB", &(cfg){.delay_max_us = 20}, 5 * MIB, 0, 20LL * 1000000000LL);

    snprintf(g_case, sizeof g_case, "teardown");
    mtc_transfer_shutdown();
    /* every pinned allocation and every event belongs to an idle slab: trimmed, nothing is left */
    sync_stream(g_stream);
    sync_stream(NULL);
    mtc_pinned_trim();
    mtc_slab_stats st;
    CHECK_EQ(mtc_pinned_stats(0, &st), 0);
    CHECK_EQ(st.slabs_held, 0);
    fake_cuda_stats f;
    fk->get_stats(&f);
    CHECK_EQ(f.host_live, 0);
    CHECK_EQ(f.events_live, 0);
    free(g_src);
    printf("test_h2d: all passed (%ld checks)\n", (long)atomic_load(&g_checks));
    return 0;
}
