/*
 * test_plan.c - unit tests for csrc/engine/plan.c (the planner: per-leaf actions and
 * the packed layout).
 *
 * Built and run by tests/c/Makefile under ASan+UBSan (pure C, single-threaded).
 * Exit status 0 and a one-line summary on success; on the first failed check
 * it prints file:line, the random seed and case, and exits 1.
 *
 * Environment:
 *   MTC_PLAN_SEED   seed of the random layout cases (default 0x5eed1234)
 *   MTC_PLAN_CASES  number of random layout cases (default 2000)
 *
 * Reproduce a failure with the printed seed:  MTC_PLAN_SEED=<seed> ./test_plan
 */
#include "plan.h"

#include <errno.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ------------------------------------------------------------------ */
/* context printed with every failure                                  */

static uint64_t g_seed = 0x5eed1234ull;
static char g_case[256] = "(setup)"; /* the test / random case */
static char g_ctx[128] = "";         /* where in it */

#define CASE(...) (snprintf(g_case, sizeof g_case, __VA_ARGS__), g_ctx[0] = 0)
#define CTX(...) snprintf(g_ctx, sizeof g_ctx, __VA_ARGS__)

/* the seed and case of a failure, and how to rerun exactly that */
#define CHECK_NOTE()                                                         \
    fprintf(stderr, "  [seed 0x%" PRIx64 ", %s; %s]\n  reproduce: MTC_PLAN_SEED=0x%" PRIx64 \
            " ./test_plan\n", g_seed, g_case, g_ctx, g_seed)
#include "check.h"
#include "plan_rules.h"

static int n_tests_run;

/* ------------------------------------------------------------------ */
/* xorshift64*                                                         */

static uint64_t g_rng;

static uint64_t rnd(void)
{
    uint64_t x = g_rng;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    g_rng = x;
    return x * 0x2545F4914F6CDD1Dull;
}

/* uniform in [0, n) (n > 0) */
static uint64_t rnd_below(uint64_t n) { return rnd() % n; }

/* ------------------------------------------------------------------ */
/* independent arithmetic (the oracle does not call plan.c internals)  */

static int64_t gcd64(int64_t a, int64_t b)
{
    while (b) {
        int64_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

static int64_t lcm64(int64_t a, int64_t b) { return a / gcd64(a, b) * b; }
/* the reference implementation's alignment of a packed leaf */
static int64_t ref_align(int64_t min, int64_t e) { int64_t a = min > e ? min : e; return (a + e - 1) / e * e; }

/* ------------------------------------------------------------------ */
/* a leaf set under construction                                       */

#define MAX_LEAVES 20000
#define MAX_DIMS (MAX_LEAVES * 4)

typedef struct {
    mtc_leaf leaves[MAX_LEAVES];
    int64_t shape[MAX_DIMS];
    uint32_t n, ndims;
} leafset;

static leafset g_ls; /* big: static, not on the stack */

static void ls_reset(leafset *s)
{
    s->n = 0;
    s->ndims = 0;
}

/* dtype codes of a fake dtype table: code -> element size */
static const uint16_t DT_ELSIZE[] = {1, 1, 2, 2, 4, 4, 8, 8, 16, 16};
#define N_DTYPES ((int)(sizeof DT_ELSIZE / sizeof DT_ELSIZE[0]))

/* Adds a leaf; returns its index. shape: ndim dims. */
static uint32_t ls_add(leafset *s, uint16_t dtype, int32_t ndim, const int64_t *dims, int32_t dev,
                       uint32_t flags)
{
    CHECK(s->n < MAX_LEAVES);
    CHECK(s->ndims + (uint32_t)ndim <= MAX_DIMS);
    mtc_leaf *l = &s->leaves[s->n];
    memset(l, 0, sizeof *l);
    l->dtype = dtype;
    l->elsize = DT_ELSIZE[dtype];
    l->ndim = ndim;
    l->dims = s->ndims;
    int64_t numel = 1;
    for (int32_t d = 0; d < ndim; d++) {
        s->shape[s->ndims + (uint32_t)d] = dims[d];
        numel *= dims[d];
    }
    s->ndims += (uint32_t)ndim;
    l->nbytes = numel * l->elsize;
    l->dev = dev;
    l->flags = flags;
    l->data = 0x10000u + (uintptr_t)s->n * 64u;
    /* poison the outputs: mtc_plan_build must set them */
    l->action = 0xEE;
    l->needs_contig = 0xEE;
    l->seg = 12345;
    l->slot = -777;
    return s->n++;
}

/* 1-d leaf of `nbytes` bytes of a 1-byte dtype */
static uint32_t ls_add_bytes(leafset *s, int64_t nbytes, int32_t dev, uint32_t flags)
{
    return ls_add(s, 0, 1, &nbytes, dev, flags);
}

/* ------------------------------------------------------------------ */
/* full independent check of a built plan                              */

static int same_shape(const leafset *s, const mtc_leaf *a, const mtc_leaf *b, int from)
{
    if (a->ndim != b->ndim) return 0;
    for (int32_t d = from; d < a->ndim; d++)
        if (s->shape[a->dims + (uint32_t)d] != s->shape[b->dims + (uint32_t)d]) return 0;
    return 1;
}

static void check_plan(const mtc_plan *p, const leafset *s, const mtc_plan_opts *o)
{
    CHECK_EQ(mtc_plan_valid(p, s->leaves, s->n, s->shape, o), 1);

    /* actions, needs_contig, counters */
    uint32_t count[MTC_ACT_COUNT] = {0}, need_contig = 0, npacked = 0;
    int64_t packed_bytes = 0;
    for (uint32_t i = 0; i < s->n; i++) {
        const mtc_leaf *l = &s->leaves[i];
        uint8_t nc;
        uint8_t a = expected_action(l, o, &nc);
        CTX("leaf %u", i);
        CHECK_EQ(l->action, a);
        CHECK_EQ(l->needs_contig, nc);
        count[a]++;
        need_contig += nc;
        if (a == MTC_ACT_PACK) {
            npacked++;
            packed_bytes += l->nbytes;
            /* too large for a pack: never packed */
            CHECK(l->nbytes <= o->pack_limit);
            CHECK(l->nbytes <= o->max_chunk);
            CHECK(l->seg >= 0 && (uint32_t)l->seg < p->nsegs);
        } else {
            CHECK_EQ(l->seg, -1);
        }
        /* needs_contig only for actions that read a contiguous source */
        if (nc) CHECK(a == MTC_ACT_D2H || a == MTC_ACT_D2D || a == MTC_ACT_H2D_STAGED ||
                      a == MTC_ACT_H2D_DIRECT);
        if (l->flags & MTC_LEAF_CONTIGUOUS) CHECK_EQ(nc, 0);
    }
    for (int a = 0; a < MTC_ACT_COUNT; a++) CHECK_EQ(p->count[a], count[a]);
    CHECK_EQ(p->need_contig, need_contig);
    CHECK_EQ(p->packed_bytes, packed_bytes);
    CHECK_EQ(p->nmembers, npacked);
    if (!npacked) {
        CHECK_EQ(p->nsegs, 0);
        CHECK_EQ(p->nchunks, 0);
        return;
    }
    CHECK(p->nchunks >= 1);
    CHECK(p->nsegs >= 1);

    /* every packed leaf is a member exactly once */
    unsigned char *seen = calloc(s->n ? s->n : 1, 1);
    CHECK(seen != NULL);
    for (uint32_t j = 0; j < p->nmembers; j++) {
        uint32_t li = p->members[j];
        CHECK(li < s->n);
        CHECK_EQ(s->leaves[li].action, MTC_ACT_PACK);
        CHECK_EQ(seen[li], 0);
        seen[li] = 1;
    }
    free(seen);

    /* per chunk: number of members, members in segments, end of segments */
    uint32_t *chunk_members = calloc(p->nchunks, sizeof *chunk_members);
    uint32_t *chunk_segs = calloc(p->nchunks, sizeof *chunk_segs);
    int64_t *chunk_end = calloc(p->nchunks, sizeof *chunk_end);
    CHECK(chunk_members && chunk_segs && chunk_end);

    int32_t prev_chunk = 0;
    int64_t prev_seg_end = 0;
    uint32_t next_first = 0;
    for (uint32_t si = 0; si < p->nsegs; si++) {
        const mtc_seg *sg = &p->segs[si];
        CTX("segment %u", si);
        CHECK(sg->chunk >= 0 && (uint32_t)sg->chunk < p->nchunks);
        /* segments are in chunk order (the binding issues one op per chunk run) */
        CHECK(sg->chunk >= prev_chunk);
        if (sg->chunk != prev_chunk) prev_seg_end = 0;
        /* segments of a chunk do not overlap and follow each other */
        CHECK(sg->offset >= prev_seg_end);
        prev_seg_end = sg->offset + sg->bytes;
        prev_chunk = sg->chunk;
        /* members are listed segment after segment */
        CHECK_EQ(sg->first, next_first);
        CHECK(sg->count >= 1);
        next_first = sg->first + sg->count;
        CHECK(next_first <= p->nmembers);
        CHECK(sg->kind == MTC_SEG_SPLIT || sg->kind == MTC_SEG_UNIFORM);
        CHECK(sg->proto < s->n);

        const mtc_leaf *pr = &s->leaves[sg->proto];
        CHECK_EQ(pr->action, MTC_ACT_PACK);
        CHECK_EQ(pr->seg, (int32_t)si);
        int64_t align = ref_align(o->align, pr->elsize);
        CHECK_EQ(mtc_plan_leaf_align(o, pr->elsize), align);
        CHECK_EQ(sg->offset % align, 0);
        CHECK(sg->offset >= 0);
        const mtc_chunk *c = &p->chunks[sg->chunk];
        CHECK(sg->offset + sg->bytes <= c->payload);
        if (sg->offset + sg->bytes > chunk_end[sg->chunk]) chunk_end[sg->chunk] = sg->offset + sg->bytes;
        chunk_members[sg->chunk] += sg->count;
        chunk_segs[sg->chunk]++;

        int64_t prev_slot = -1, prev_end_row = 0;
        for (uint32_t j = sg->first; j < sg->first + sg->count; j++) {
            const mtc_leaf *l = &s->leaves[p->members[j]];
            CTX("segment %u member %u (leaf %u)", si, j - sg->first, p->members[j]);
            CHECK_EQ(l->seg, (int32_t)si);
            /* one group: dtype, ndim and trailing dims of the prototype */
            CHECK_EQ(l->dtype, pr->dtype);
            CHECK_EQ(l->elsize, pr->elsize);
            CHECK(same_shape(s, l, pr, 1));
            int64_t off = mtc_plan_leaf_offset(p, l);
            /* every packed leaf: offset a multiple of round_up(max(align, elsize), elsize) */
            CHECK_EQ(off % ref_align(o->align, l->elsize), 0);
            CHECK_EQ(c->align % ref_align(o->align, l->elsize), 0);
            CHECK(off >= sg->offset);
            CHECK(off + l->nbytes <= sg->offset + sg->bytes);
            CHECK(l->slot >= prev_slot);
            if (sg->kind == MTC_SEG_UNIFORM) {
                /* UNIFORM segments hold equal shapes only, at a fixed slot */
                CHECK(same_shape(s, l, pr, 0));
                CHECK_EQ(l->slot, (int64_t)(j - sg->first));
                CHECK(sg->row_bytes >= l->nbytes);
                CHECK_EQ(sg->row_bytes % align, 0);
                CHECK_EQ(off, sg->offset + l->slot * sg->row_bytes);
            } else {
                /* SPLIT: rows of the trailing dims */
                CHECK(l->ndim >= 1);
                int64_t rb = l->elsize;
                for (int32_t d = 1; d < l->ndim; d++) rb *= s->shape[l->dims + (uint32_t)d];
                CHECK_EQ(sg->row_bytes, rb);
                int64_t rows = s->shape[l->dims];
                CHECK(l->slot >= prev_end_row);
                /* padding between members stays within max_pad */
                CHECK((l->slot - prev_end_row) * rb <= o->max_pad || rb == 0);
                CHECK_EQ(off, sg->offset + l->slot * rb);
                CHECK(l->slot + rows <= sg->rows);
                prev_end_row = l->slot + rows;
            }
            prev_slot = l->slot;
        }
        if (sg->kind == MTC_SEG_UNIFORM) {
            CHECK_EQ(sg->rows, (int64_t)sg->count);
            const mtc_leaf *last = &s->leaves[p->members[sg->first + sg->count - 1]];
            CHECK_EQ(sg->bytes, (int64_t)(sg->count - 1) * sg->row_bytes + last->nbytes);
        } else {
            /* rows consistent: the segment ends with its last member */
            CHECK_EQ(sg->rows, prev_end_row);
            CHECK_EQ(sg->bytes, sg->rows * sg->row_bytes);
        }
    }
    CHECK_EQ(next_first, p->nmembers);

    for (uint32_t c = 0; c < p->nchunks; c++) {
        const mtc_chunk *ch = &p->chunks[c];
        CTX("chunk %u of %u", c, p->nchunks);
        /* no empty chunk; payload ends at its last segment */
        CHECK(chunk_segs[c] >= 1);
        CHECK_EQ(ch->payload, chunk_end[c]);
        CHECK(ch->align >= 1);
        /* payload <= max_chunk unless the chunk holds a single leaf */
        CHECK(ch->payload <= o->max_chunk || chunk_members[c] == 1);
    }
    free(chunk_members);
    free(chunk_segs);
    free(chunk_end);
}

/* builds, checks, frees; returns 0 */
static void build_and_check(leafset *s, const mtc_plan_opts *o, mtc_plan *out_or_null)
{
    mtc_plan p;
    int rc = mtc_plan_build(&p, s->leaves, s->n, s->shape, o);
    CHECK_EQ(rc, 0);
    check_plan(&p, s, o);
    if (out_or_null) *out_or_null = p;
    else mtc_plan_free(&p);
}

/* ------------------------------------------------------------------ */
/* tests                                                               */

static void test_default_opts(void)
{
    CASE("default opts");
    mtc_plan_opts o;
    memset(&o, 0xAB, sizeof o);
    mtc_plan_default_opts(&o, MTC_DEV_CPU);
    CHECK_EQ(o.target, MTC_DEV_CPU);
    CHECK_EQ(o.pack, 1);
    CHECK_EQ(o.staging, 1);
    CHECK_EQ(o.align, 16);
    CHECK_EQ(o.max_chunk, 33554432);
    CHECK_EQ(o.pack_limit, 256 * 1024);
    CHECK(o.max_pad >= 0);
    mtc_plan_default_opts(&o, 3);
    CHECK_EQ(o.target, 3);
    CHECK_EQ(o.pack, 1);
    CHECK_EQ(o.staging, 1);
    n_tests_run++;
}

static void test_leaf_align(void)
{
    CASE("leaf align");
    mtc_plan_opts o;
    mtc_plan_default_opts(&o, 0);
    static const struct { int64_t align; uint32_t elsize; int64_t want; } T[] = {
        {16, 1, 16}, {16, 8, 16}, {16, 16, 16}, {1, 1, 1}, {1, 2, 2}, {1, 16, 16},
        {2, 8, 8}, {4, 8, 8}, {3, 4, 4}, {3, 16, 16}, {24, 16, 32}, {24, 8, 24},
        {4096, 16, 4096}, {6, 4, 8}, {6, 16, 16}, {6, 1, 6}, {6, 2, 6}, {6, 8, 8}, {1, 3, 3},
        {100, 1, 100}, {100, 2, 100}, {100, 4, 100}, {100, 8, 104}, {100, 16, 112},
        {24, 1, 24}, {24, 2, 24}, {24, 4, 24}, {16, 2, 16}, {16, 4, 16},
    };
    for (size_t i = 0; i < sizeof T / sizeof T[0]; i++) {
        o.align = T[i].align;
        CASE("leaf align row %zu", i);
        CHECK_EQ(mtc_plan_leaf_align(&o, T[i].elsize), T[i].want);
    }
    /* overflow: an alignment that cannot be represented gives 0 */
    o.align = (int64_t)1 << 45;
    CHECK_EQ(mtc_plan_leaf_align(&o, 1), 0);
    n_tests_run++;
}

/* Table-driven: the action of one leaf for each target / source / option. */
static void test_actions_table(void)
{
    enum { C = MTC_LEAF_CONTIGUOUS, N = MTC_LEAF_NUMPY, Z = MTC_LEAF_ZEROCOPY };
    const int64_t SMALL = 1024, BIG = 300 * 1024; /* pack_limit 256 KiB */
    static const struct {
        int32_t target, dev;
        uint32_t flags;
        int big, pack, staging;
        uint8_t action, needs_contig;
    } T[] = {
        /* CPU target, CPU sources */
        {-1, -1, C, 0, 1, 1, MTC_ACT_REUSE, 0},
        {-1, -1, 0, 0, 1, 1, MTC_ACT_REUSE, 0},       /* strided CPU tensor: reused as is */
        {-1, -1, C, 1, 0, 0, MTC_ACT_REUSE, 0},
        {-1, -1, C | N | Z, 0, 1, 1, MTC_ACT_FROM_NUMPY, 0},
        {-1, -1, N | Z, 1, 1, 1, MTC_ACT_FROM_NUMPY, 0}, /* strided zero-copy numpy */
        {-1, -1, C | N, 0, 1, 1, MTC_ACT_HOST_COPY, 0},  /* read-only numpy */
        {-1, -1, N, 1, 0, 0, MTC_ACT_HOST_COPY, 0},      /* negative strides */
        /* CPU target, GPU sources: D2H, packed when pack && staging && small && contiguous */
        {-1, 0, C, 0, 1, 1, MTC_ACT_PACK, 0},
        {-1, 1, C, 0, 1, 1, MTC_ACT_PACK, 0},
        {-1, 0, 0, 0, 1, 1, MTC_ACT_D2H, 1},
        {-1, 0, C, 1, 1, 1, MTC_ACT_D2H, 0},
        {-1, 0, 0, 1, 1, 1, MTC_ACT_D2H, 1},
        {-1, 0, C, 0, 0, 1, MTC_ACT_D2H, 0},
        {-1, 0, C, 0, 1, 0, MTC_ACT_D2H, 0},
        {-1, 0, 0, 0, 1, 0, MTC_ACT_D2H, 1},
        /* GPU target, same device: reuse */
        {0, 0, C, 0, 1, 1, MTC_ACT_REUSE, 0},
        {0, 0, 0, 1, 0, 0, MTC_ACT_REUSE, 0},
        {2, 2, 0, 0, 1, 1, MTC_ACT_REUSE, 0},
        /* GPU target, other device: D2D */
        {0, 1, C, 0, 1, 1, MTC_ACT_D2D, 0},
        {1, 0, 0, 0, 1, 1, MTC_ACT_D2D, 1},
        {1, 0, 0, 1, 0, 0, MTC_ACT_D2D, 1},
        /* GPU target, CPU source: small ones packed whatever their strides */
        {0, -1, C, 0, 1, 1, MTC_ACT_PACK, 0},
        {0, -1, 0, 0, 1, 1, MTC_ACT_PACK, 0},
        {0, -1, 0, 0, 1, 0, MTC_ACT_PACK, 0},
        {0, -1, C | N | Z, 0, 1, 1, MTC_ACT_PACK, 0},
        {0, -1, N, 0, 1, 1, MTC_ACT_PACK, 0},
        {0, -1, C, 1, 1, 1, MTC_ACT_H2D_STAGED, 0},
        {0, -1, 0, 1, 1, 1, MTC_ACT_H2D_STAGED, 1},
        {0, -1, C, 0, 0, 1, MTC_ACT_H2D_STAGED, 0},
        {0, -1, 0, 0, 0, 1, MTC_ACT_H2D_STAGED, 1},
        {0, -1, C, 1, 1, 0, MTC_ACT_H2D_DIRECT, 0},
        {0, -1, 0, 1, 1, 0, MTC_ACT_H2D_DIRECT, 1},
        {0, -1, C, 0, 0, 0, MTC_ACT_H2D_DIRECT, 0},
        {0, -1, N, 1, 0, 0, MTC_ACT_H2D_DIRECT, 1},
        {3, -1, C, 0, 1, 1, MTC_ACT_PACK, 0},
    };
    for (size_t i = 0; i < sizeof T / sizeof T[0]; i++) {
        CASE("actions table row %zu", i);
        mtc_plan_opts o;
        mtc_plan_default_opts(&o, T[i].target);
        o.pack = T[i].pack;
        o.staging = T[i].staging;
        leafset *s = &g_ls;
        ls_reset(s);
        ls_add_bytes(s, T[i].big ? BIG : SMALL, T[i].dev, T[i].flags);
        mtc_plan p;
        CHECK_EQ(mtc_plan_build(&p, s->leaves, s->n, s->shape, &o), 0);
        CTX("after build");
        CHECK_EQ(s->leaves[0].action, T[i].action);
        CHECK_EQ(s->leaves[0].needs_contig, T[i].needs_contig);
        CHECK_EQ(p.count[T[i].action], 1);
        CHECK_EQ(p.need_contig, T[i].needs_contig);
        if (T[i].action == MTC_ACT_PACK) {
            CHECK_EQ(p.nchunks, 1);
            CHECK_EQ(p.nsegs, 1);
            CHECK_EQ(p.nmembers, 1);
            CHECK_EQ(p.packed_bytes, SMALL);
            CHECK_EQ(mtc_plan_leaf_offset(&p, &s->leaves[0]), 0);
            CHECK_EQ(p.chunks[0].payload, SMALL);
        } else {
            CHECK_EQ(s->leaves[0].seg, -1);
            CHECK_EQ(p.nchunks, 0);
            CHECK_EQ(p.nsegs, 0);
            CHECK_EQ(p.packed_bytes, 0);
        }
        CHECK_EQ(mtc_plan_valid(&p, s->leaves, s->n, s->shape, &o), 1);
        check_plan(&p, s, &o);
        mtc_plan_free(&p);
    }
    n_tests_run++;
}

/* Exhaustive cross-product of the action inputs against the oracle. */
static void test_actions_exhaustive(void)
{
    static const int32_t targets[] = {-1, 0, 1};
    static const int32_t devs[] = {-1, 0, 1};
    /* sizes around the limits: pack_limit 256 KiB, max_chunk varied */
    static const int64_t sizes[] = {0, 1, 100, 4096, 256 * 1024 - 1, 256 * 1024, 256 * 1024 + 1, 1 << 22};
    static const int64_t chunks[] = {1, 100, 4096, 256 * 1024, 1 << 25};
    int rows = 0;
    for (size_t ti = 0; ti < 3; ti++)
        for (size_t di = 0; di < 3; di++)
            for (uint32_t flags = 0; flags < 8; flags++)
                for (int pack = 0; pack < 2; pack++)
                    for (int staging = 0; staging < 2; staging++)
                        for (size_t ci = 0; ci < sizeof chunks / sizeof chunks[0]; ci++) {
                            if ((flags & MTC_LEAF_NUMPY) && devs[di] != -1) continue; /* numpy is host memory */
                            if ((flags & MTC_LEAF_ZEROCOPY) && !(flags & MTC_LEAF_NUMPY)) continue;
                            mtc_plan_opts o;
                            mtc_plan_default_opts(&o, targets[ti]);
                            o.pack = pack;
                            o.staging = staging;
                            o.max_chunk = chunks[ci];
                            leafset *s = &g_ls;
                            ls_reset(s);
                            for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++)
                                ls_add_bytes(s, sizes[si], devs[di], flags);
                            CASE("actions exhaustive target %d dev %d flags %u pack %d staging %d max_chunk %lld",
                                targets[ti], devs[di], flags, pack, staging, (long long)chunks[ci]);
                            build_and_check(s, &o, NULL);
                            rows++;
                        }
    CHECK(rows > 500);
    n_tests_run++;
}

static void test_empty_and_unpacked(void)
{
    CASE("empty");
    mtc_plan_opts o;
    mtc_plan_default_opts(&o, 0);
    mtc_plan p;
    memset(&p, 0x5A, sizeof p);
    CHECK_EQ(mtc_plan_build(&p, g_ls.leaves, 0, g_ls.shape, &o), 0);
    CHECK_EQ(p.nsegs, 0);
    CHECK_EQ(p.nchunks, 0);
    CHECK_EQ(p.nmembers, 0);
    CHECK_EQ(p.packed_bytes, 0);
    CHECK_EQ(p.need_contig, 0);
    for (int a = 0; a < MTC_ACT_COUNT; a++) CHECK_EQ(p.count[a], 0);
    CHECK_EQ(mtc_plan_valid(&p, g_ls.leaves, 0, g_ls.shape, &o), 1);
    mtc_plan_free(&p);
    mtc_plan_free(&p); /* freeing an emptied plan again is harmless */
    n_tests_run++;
}

static void test_bad_opts(void)
{
    leafset *s = &g_ls;
    ls_reset(s);
    int64_t d = 64;
    ls_add(s, 4, 1, &d, -1, MTC_LEAF_CONTIGUOUS);
    static const struct { int64_t align, max_chunk, pack_limit; } T[] = {
        {0, 1024, 1024}, {-1, 1024, 1024}, {-16, 1024, 1024}, {INT64_MIN, 1024, 1024},
        {16, 0, 1024}, {16, -1, 1024}, {16, INT64_MIN, 1024}, {16, 1024, -1},
    };
    for (size_t i = 0; i < sizeof T / sizeof T[0]; i++) {
        CASE("bad opts row %zu", i);
        mtc_plan_opts o;
        mtc_plan_default_opts(&o, 0);
        o.align = T[i].align;
        o.max_chunk = T[i].max_chunk;
        o.pack_limit = T[i].pack_limit;
        mtc_plan p;
        memset(&p, 0x5A, sizeof p);
        CHECK_EQ(mtc_plan_build(&p, s->leaves, s->n, s->shape, &o), -EINVAL);
        /* on error the plan is left empty */
        CHECK(p.segs == NULL && p.members == NULL && p.chunks == NULL);
        CHECK_EQ(p.nsegs, 0);
        CHECK_EQ(p.nchunks, 0);
        CHECK_EQ(p.nmembers, 0);
        mtc_plan_free(&p);
        /* also with no leaves at all */
        CHECK_EQ(mtc_plan_build(&p, s->leaves, 0, s->shape, &o), -EINVAL);
        mtc_plan_free(&p);
    }
    n_tests_run++;
}

static void test_bad_leaves(void)
{
    mtc_plan_opts o;
    mtc_plan_default_opts(&o, 0);
    for (int kind = 0; kind < 4; kind++) {
        CASE("bad leaf kind %d", kind);
        leafset *s = &g_ls;
        ls_reset(s);
        int64_t d = 8;
        ls_add(s, 2, 1, &d, -1, MTC_LEAF_CONTIGUOUS); /* a good leaf first: packed */
        uint32_t i = ls_add(s, 2, 1, &d, -1, MTC_LEAF_CONTIGUOUS);
        mtc_leaf *l = &s->leaves[i];
        if (kind == 0) l->elsize = 0;
        if (kind == 1) l->nbytes = -1;
        if (kind == 2) l->ndim = -1;
        if (kind == 3) l->ndim = MTC_MAX_NDIM + 1;
        mtc_plan p;
        CHECK_EQ(mtc_plan_build(&p, s->leaves, s->n, s->shape, &o), -EINVAL);
        CHECK(p.segs == NULL && p.members == NULL && p.chunks == NULL);
        CHECK_EQ(p.nsegs + p.nchunks + p.nmembers, 0);
        mtc_plan_free(&p);
    }
    /* ndim == MTC_MAX_NDIM is allowed */
    {
        CASE("max ndim leaf");
        leafset *s = &g_ls;
        ls_reset(s);
        int64_t dims[MTC_MAX_NDIM];
        for (int k = 0; k < MTC_MAX_NDIM; k++) dims[k] = 1;
        dims[0] = 3;
        ls_add(s, 4, MTC_MAX_NDIM, dims, -1, MTC_LEAF_CONTIGUOUS);
        ls_add(s, 4, MTC_MAX_NDIM, dims, -1, MTC_LEAF_CONTIGUOUS);
        build_and_check(s, &o, NULL);
    }
    n_tests_run++;
}

/* Options past any real chunk (max_chunk / pack_limit up to INT64_MAX, as
 * start_copy and pack may pass) and leaves of up to 2^61 bytes (expanded
 * views: the planner never touches memory): no sum may overflow (UBSan), the
 * plan is valid, and a chunk never exceeds MTC_PLAN_MAX_CHUNK unless it holds
 * one leaf. */
static void test_huge_options_and_leaves(void)
{
    CASE("huge max_chunk and leaves");
    leafset *s = &g_ls;
    ls_reset(s);
    int64_t big = (int64_t)1 << 60, small = 12, odd = ((int64_t)1 << 60) + 3;
    for (int k = 0; k < 6; k++) {
        ls_add(s, 0, 1, &big, -1, MTC_LEAF_CONTIGUOUS);   /* uint8, 2^60 bytes */
        ls_add(s, 2, 1, &small, -1, MTC_LEAF_CONTIGUOUS);
        ls_add(s, 0, 1, &odd, -1, 0);
    }
    mtc_plan_opts o;
    mtc_plan_default_opts(&o, 0);
    o.max_chunk = INT64_MAX;
    o.pack_limit = INT64_MAX;
    mtc_plan p;
    CHECK_EQ(mtc_plan_build(&p, s->leaves, s->n, s->shape, &o), 0);
    CHECK(mtc_plan_valid(&p, s->leaves, s->n, s->shape, &o));
    CHECK_EQ(p.count[MTC_ACT_PACK], s->n);
    CHECK(p.nchunks > 1); /* 12 x 2^60 bytes do not fit one capped chunk */
    for (uint32_t c = 0; c < p.nchunks; c++) CHECK(p.chunks[c].payload <= MTC_PLAN_MAX_CHUNK);
    CHECK_EQ(p.packed_bytes, INT64_MAX); /* saturated */
    mtc_plan_free(&p);
    n_tests_run++;
}

static void test_overflow_alignment(void)
{
    CASE("overflowing alignment");
    leafset *s = &g_ls;
    ls_reset(s);
    int64_t d = 4;
    ls_add(s, 4, 1, &d, -1, MTC_LEAF_CONTIGUOUS);
    mtc_plan_opts o;
    mtc_plan_default_opts(&o, 0);
    o.align = (int64_t)1 << 45;
    mtc_plan p;
    CHECK_EQ(mtc_plan_build(&p, s->leaves, s->n, s->shape, &o), -EOVERFLOW);
    CHECK(p.segs == NULL && p.members == NULL && p.chunks == NULL);
    mtc_plan_free(&p);
    /* the same alignment is fine when nothing is packed */
    o.pack = 0;
    build_and_check(s, &o, NULL);
    /* a large but representable alignment packs, one leaf per chunk when
     * the alignment exceeds max_chunk */
    o.pack = 1;
    o.align = (int64_t)1 << 30;
    ls_add(s, 4, 1, &d, -1, MTC_LEAF_CONTIGUOUS);
    mtc_plan p2;
    build_and_check(s, &o, &p2);
    CHECK_EQ(p2.count[MTC_ACT_PACK], 2);
    mtc_plan_free(&p2);
    o.max_chunk = 1 << 20;
    build_and_check(s, &o, &p2);
    CHECK_EQ(p2.nchunks, 2);
    mtc_plan_free(&p2);
    n_tests_run++;
}

/* Hand-computed layouts. */
static void test_known_layouts(void)
{
    mtc_plan_opts o;
    mtc_plan_default_opts(&o, 0);
    leafset *s = &g_ls;
    mtc_plan p;

    /* three equal float32 (dtype 4, elsize 4) shapes (3,): one UNIFORM segment,
     * slot 16 bytes, 12-byte members */
    CASE("known: uniform");
    ls_reset(s);
    int64_t d3 = 3;
    for (int k = 0; k < 3; k++) ls_add(s, 4, 1, &d3, -1, MTC_LEAF_CONTIGUOUS);
    build_and_check(s, &o, &p);
    CHECK_EQ(p.nchunks, 1);
    CHECK_EQ(p.nsegs, 1);
    CHECK_EQ(p.segs[0].kind, MTC_SEG_UNIFORM);
    CHECK_EQ(p.segs[0].count, 3);
    CHECK_EQ(p.segs[0].row_bytes, 16);
    CHECK_EQ(p.segs[0].bytes, 2 * 16 + 12);
    CHECK_EQ(p.chunks[0].payload, 44);
    CHECK_EQ(p.chunks[0].align % 16, 0);
    for (uint32_t k = 0; k < 3; k++) CHECK_EQ(mtc_plan_leaf_offset(&p, &s->leaves[k]), 16 * k);
    mtc_plan_free(&p);

    /* float32 (n, 4) with n = 1, 2, 3: SPLIT, row 16 bytes, no padding with align 16 */
    CASE("known: split");
    ls_reset(s);
    for (int64_t n = 1; n <= 3; n++) {
        int64_t d2[2] = {n, 4};
        ls_add(s, 4, 2, d2, -1, MTC_LEAF_CONTIGUOUS);
    }
    build_and_check(s, &o, &p);
    CHECK_EQ(p.nsegs, 1);
    CHECK_EQ(p.segs[0].kind, MTC_SEG_SPLIT);
    CHECK_EQ(p.segs[0].row_bytes, 16);
    CHECK_EQ(p.segs[0].rows, 6);
    CHECK_EQ(p.segs[0].bytes, 96);
    CHECK_EQ(s->leaves[0].slot, 0);
    CHECK_EQ(s->leaves[1].slot, 1);
    CHECK_EQ(s->leaves[2].slot, 3);
    mtc_plan_free(&p);

    /* float32 (n, 3), row 12 bytes, align 16: member starts on multiples of 4 rows */
    CASE("known: split padded");
    ls_reset(s);
    for (int64_t n = 1; n <= 3; n++) {
        int64_t d2[2] = {n, 3};
        ls_add(s, 4, 2, d2, -1, MTC_LEAF_CONTIGUOUS);
    }
    build_and_check(s, &o, &p);
    CHECK_EQ(p.nsegs, 1);
    CHECK_EQ(p.segs[0].kind, MTC_SEG_SPLIT);
    CHECK_EQ(s->leaves[0].slot, 0);
    CHECK_EQ(s->leaves[1].slot, 4);
    CHECK_EQ(s->leaves[2].slot, 8);
    CHECK_EQ(p.segs[0].rows, 11);
    mtc_plan_free(&p);

    /* two dtypes: two segments in one chunk, second starts aligned */
    CASE("known: two groups");
    ls_reset(s);
    int64_t d5 = 5;
    ls_add(s, 0, 1, &d5, -1, MTC_LEAF_CONTIGUOUS);  /* 5 bytes, uint8-like */
    ls_add(s, 6, 1, &d5, -1, MTC_LEAF_CONTIGUOUS);  /* 40 bytes, 8-byte elements */
    build_and_check(s, &o, &p);
    CHECK_EQ(p.nchunks, 1);
    CHECK_EQ(p.nsegs, 2);
    CHECK_EQ(mtc_plan_leaf_offset(&p, &s->leaves[0]), 0);
    CHECK_EQ(mtc_plan_leaf_offset(&p, &s->leaves[1]), 16);
    CHECK_EQ(p.chunks[0].payload, 56);
    mtc_plan_free(&p);

    /* chunk split: 4 x 100 bytes, max_chunk 250, align 16 -> slots 112: 2 per chunk */
    CASE("known: chunk split");
    ls_reset(s);
    for (int k = 0; k < 4; k++) ls_add_bytes(s, 100, -1, MTC_LEAF_CONTIGUOUS);
    o.max_chunk = 250;
    build_and_check(s, &o, &p);
    CHECK_EQ(p.nchunks, 2);
    CHECK_EQ(p.chunks[0].payload, 212);
    CHECK_EQ(p.chunks[1].payload, 212);
    mtc_plan_free(&p);

    /* leaves larger than max_chunk are not packed (staged) */
    CASE("known: bigger than max_chunk");
    ls_reset(s);
    ls_add_bytes(s, 251, -1, MTC_LEAF_CONTIGUOUS);
    ls_add_bytes(s, 250, -1, MTC_LEAF_CONTIGUOUS);
    build_and_check(s, &o, &p);
    CHECK_EQ(s->leaves[0].action, MTC_ACT_H2D_STAGED);
    CHECK_EQ(s->leaves[1].action, MTC_ACT_PACK);
    CHECK_EQ(p.nchunks, 1);
    mtc_plan_free(&p);

    /* deterministic: the same input gives the same plan */
    CASE("known: deterministic");
    o.max_chunk = 1 << 12;
    ls_reset(s);
    for (int k = 0; k < 50; k++) {
        int64_t dd[2] = {k % 7, 1 + k % 3};
        ls_add(s, (uint16_t)(k % N_DTYPES), 2, dd, -1, (k & 1) ? MTC_LEAF_CONTIGUOUS : 0);
    }
    mtc_plan a, b;
    build_and_check(s, &o, &a);
    int64_t offs[50];
    for (int k = 0; k < 50; k++) offs[k] = s->leaves[k].seg >= 0 ? mtc_plan_leaf_offset(&a, &s->leaves[k]) : -1;
    build_and_check(s, &o, &b);
    CHECK_EQ(a.nsegs, b.nsegs);
    CHECK_EQ(a.nchunks, b.nchunks);
    CHECK(memcmp(a.segs, b.segs, a.nsegs * sizeof *a.segs) == 0);
    CHECK(memcmp(a.chunks, b.chunks, a.nchunks * sizeof *a.chunks) == 0);
    CHECK(memcmp(a.members, b.members, a.nmembers * sizeof *a.members) == 0);
    for (int k = 0; k < 50; k++)
        CHECK_EQ(offs[k], s->leaves[k].seg >= 0 ? mtc_plan_leaf_offset(&b, &s->leaves[k]) : -1);
    mtc_plan_free(&a);
    mtc_plan_free(&b);
    n_tests_run++;
}

/* mtc_plan_valid detects corruption of a good plan. */
static void test_valid_detects_corruption(void)
{
    CASE("valid detects corruption");
    mtc_plan_opts o;
    mtc_plan_default_opts(&o, 0);
    leafset *s = &g_ls;
    ls_reset(s);
    int64_t d3 = 3;
    for (int k = 0; k < 4; k++) ls_add(s, 4, 1, &d3, -1, MTC_LEAF_CONTIGUOUS);
    mtc_plan p;
    build_and_check(s, &o, &p);
    CHECK_EQ(mtc_plan_valid(&p, s->leaves, s->n, s->shape, &o), 1);
    /* misaligned member */
    p.segs[0].offset += 4;
    CHECK_EQ(mtc_plan_valid(&p, s->leaves, s->n, s->shape, &o), 0);
    p.segs[0].offset -= 4;
    /* overlapping members */
    int64_t rb = p.segs[0].row_bytes;
    p.segs[0].row_bytes = 0;
    CHECK_EQ(mtc_plan_valid(&p, s->leaves, s->n, s->shape, &o), 0);
    p.segs[0].row_bytes = rb;
    /* wrong action */
    s->leaves[1].action = MTC_ACT_H2D_STAGED;
    CHECK_EQ(mtc_plan_valid(&p, s->leaves, s->n, s->shape, &o), 0);
    s->leaves[1].action = MTC_ACT_PACK;
    /* payload too small */
    int64_t pl = p.chunks[0].payload;
    p.chunks[0].payload = pl - 1;
    CHECK_EQ(mtc_plan_valid(&p, s->leaves, s->n, s->shape, &o), 0);
    p.chunks[0].payload = pl;
    CHECK_EQ(mtc_plan_valid(&p, s->leaves, s->n, s->shape, &o), 1);
    mtc_plan_free(&p);
    n_tests_run++;
}

/* Many members: chunk and segment arrays grow; one UNIFORM group spans chunks. */
static void test_many_leaves(void)
{
    CASE("many leaves");
    mtc_plan_opts o;
    mtc_plan_default_opts(&o, 0);
    o.max_chunk = 4096;
    leafset *s = &g_ls;
    ls_reset(s);
    for (uint32_t k = 0; k < MAX_LEAVES; k++) {
        int64_t d[2] = {(k % 3 == 0) ? 2 : 1 + (int64_t)(k % 5), 3};
        ls_add(s, (uint16_t)(k % N_DTYPES), (k % 4 == 0) ? 1 : 2, d, -1, MTC_LEAF_CONTIGUOUS);
    }
    mtc_plan p;
    build_and_check(s, &o, &p);
    CHECK(p.nchunks > 10);
    CHECK_EQ(p.nmembers, MAX_LEAVES);
    mtc_plan_free(&p);
    n_tests_run++;
}

/* ---- random layouts ---- */

static const int64_t ALIGNS[] = {1, 2, 3, 4, 8, 16, 24, 64, 256, 4096};
static const uint16_t ELSIZES[] = {1, 2, 4, 8, 16};

static int64_t rnd_dim(void)
{
    uint64_t r = rnd_below(100);
    if (r < 10) return 0;          /* zeros */
    if (r < 30) return 1;
    if (r < 85) return 1 + (int64_t)rnd_below(8);
    if (r < 97) return 1 + (int64_t)rnd_below(200);
    return 1 + (int64_t)rnd_below(5000); /* occasionally beyond pack_limit */
}

/* what the random cases exercised (checked, so that the generator stays useful) */
static struct {
    uint64_t plans, packed, uniform_multi, split, split_padded, multi_chunk, not_packed_big,
        zero_bytes, needs_contig;
} cov;

static void random_case(int ci)
{
    leafset *s = &g_ls;
    ls_reset(s);
    mtc_plan_opts o;
    /* targets: mostly CPU -> GPU (packing); also GPU -> CPU (D2H packing) */
    uint64_t tsel = rnd_below(10);
    int32_t target = tsel < 7 ? 0 : (tsel < 9 ? MTC_DEV_CPU : 1);
    mtc_plan_default_opts(&o, target);
    o.align = ALIGNS[rnd_below(sizeof ALIGNS / sizeof ALIGNS[0])];
    /* max_chunk from 1 to 1<<20, log-uniform */
    int sh = (int)rnd_below(21);
    o.max_chunk = (int64_t)1 + (int64_t)rnd_below((uint64_t)1 << sh);
    if (rnd_below(8) == 0) o.pack_limit = (int64_t)rnd_below(1 << 16);
    if (rnd_below(8) == 0) o.max_pad = (int64_t)rnd_below(512);
    if (rnd_below(16) == 0) o.pack = 0;
    if (rnd_below(16) == 0) o.staging = 0;

    /* a handful of prototype shapes, so that groups have several members */
    uint32_t nleaves = (uint32_t)rnd_below(rnd_below(4) == 0 ? 200 : 40);
    int64_t protos[6][3];
    int32_t pnd[6];
    uint16_t pdt[6];
    for (int k = 0; k < 6; k++) {
        pnd[k] = (int32_t)rnd_below(4);
        for (int d = 0; d < 3; d++) protos[k][d] = rnd_dim();
        uint16_t es = ELSIZES[rnd_below(5)];
        /* dtype codes of that element size (two per size in DT_ELSIZE) */
        uint16_t code = 0;
        for (uint16_t c = 0; c < N_DTYPES; c++)
            if (DT_ELSIZE[c] == es) { code = (uint16_t)(c + rnd_below(2)); break; }
        pdt[k] = code;
    }
    for (uint32_t i = 0; i < nleaves; i++) {
        int64_t dims[3];
        int32_t ndim;
        uint16_t dt;
        uint64_t mode = rnd_below(10);
        if (mode < 6) { /* a prototype: equal shapes (UNIFORM) */
            int k = (int)rnd_below(6);
            ndim = pnd[k];
            dt = pdt[k];
            memcpy(dims, protos[k], sizeof dims);
            if (mode >= 3 && ndim >= 1) dims[0] = rnd_dim(); /* same trailing dims (SPLIT) */
        } else { /* anything */
            ndim = (int32_t)rnd_below(4);
            uint16_t es = ELSIZES[rnd_below(5)];
            dt = 0;
            for (uint16_t c = 0; c < N_DTYPES; c++)
                if (DT_ELSIZE[c] == es) { dt = c; break; }
            for (int d = 0; d < 3; d++) dims[d] = rnd_dim();
        }
        int32_t dev;
        if (target == MTC_DEV_CPU) dev = rnd_below(8) == 0 ? MTC_DEV_CPU : (int32_t)rnd_below(2);
        else dev = rnd_below(10) == 0 ? (int32_t)rnd_below(2) : MTC_DEV_CPU;
        uint32_t flags = rnd_below(3) ? MTC_LEAF_CONTIGUOUS : 0;
        if (dev == MTC_DEV_CPU && rnd_below(4) == 0) {
            flags |= MTC_LEAF_NUMPY;
            if (rnd_below(2)) flags |= MTC_LEAF_ZEROCOPY;
        }
        ls_add(s, dt, ndim, dims, dev, flags);
    }
    CASE("random case %d: target %d align %lld max_chunk %lld pack_limit %lld max_pad %lld "
        "pack %d staging %d leaves %u",
        ci, target, (long long)o.align, (long long)o.max_chunk, (long long)o.pack_limit,
        (long long)o.max_pad, o.pack, o.staging, nleaves);
    mtc_plan p;
    int rc = mtc_plan_build(&p, s->leaves, s->n, s->shape, &o);
    CHECK_EQ(rc, 0);
    check_plan(&p, s, &o);
    CTX("rebuild after free");
    cov.plans++;
    cov.packed += p.nmembers;
    cov.multi_chunk += p.nchunks > 1;
    cov.needs_contig += p.need_contig;
    for (uint32_t si = 0; si < p.nsegs; si++) {
        const mtc_seg *sg = &p.segs[si];
        if (sg->kind == MTC_SEG_UNIFORM && sg->count > 1) cov.uniform_multi++;
        if (sg->kind == MTC_SEG_SPLIT) {
            cov.split++;
            int64_t end = 0;
            for (uint32_t j = sg->first; j < sg->first + sg->count; j++) {
                const mtc_leaf *l = &s->leaves[p.members[j]];
                if (l->slot > end) { cov.split_padded++; break; }
                end = l->slot + s->shape[l->dims];
            }
        }
    }
    for (uint32_t i = 0; i < s->n; i++) {
        const mtc_leaf *l = &s->leaves[i];
        if (l->action != MTC_ACT_PACK && l->dev != o.target &&
            (l->nbytes > o.pack_limit || l->nbytes > o.max_chunk)) cov.not_packed_big++;
        if (l->action == MTC_ACT_PACK && l->nbytes == 0) cov.zero_bytes++;
    }
    /* the plan struct may be reused after mtc_plan_free */
    mtc_plan_free(&p);
    CHECK_EQ(mtc_plan_build(&p, s->leaves, s->n, s->shape, &o), 0);
    CHECK_EQ(mtc_plan_valid(&p, s->leaves, s->n, s->shape, &o), 1);
    mtc_plan_free(&p);
}

static void test_random_layouts(int ncases)
{
    g_rng = g_seed ? g_seed : 1;
    for (int ci = 0; ci < ncases; ci++) random_case(ci);
    printf("test_plan: random coverage: %" PRIu64 " plans, %" PRIu64 " packed leaves, %" PRIu64
           " uniform segments of >1 member, %" PRIu64 " split segments (%" PRIu64
           " with padding), %" PRIu64 " multi-chunk plans, %" PRIu64 " leaves too big to pack, %"
           PRIu64 " zero-byte packed, %" PRIu64 " needs_contig\n",
           cov.plans, cov.packed, cov.uniform_multi, cov.split, cov.split_padded, cov.multi_chunk,
           cov.not_packed_big, cov.zero_bytes, cov.needs_contig);
    if (ncases >= 1000) {
        CASE("random coverage");
        CHECK(cov.uniform_multi > 100);
        CHECK(cov.split > 100);
        CHECK(cov.split_padded > 10);
        CHECK(cov.multi_chunk > 100);
        CHECK(cov.not_packed_big > 100);
        CHECK(cov.zero_bytes > 10);
        CHECK(cov.needs_contig > 10);
    }
    n_tests_run++;
}

int main(void)
{
    const double t0 = now_s();
    const char *e = getenv("MTC_PLAN_SEED");
    if (e && *e) g_seed = strtoull(e, NULL, 0);
    int ncases = 2000;
    e = getenv("MTC_PLAN_CASES");
    if (e && *e) ncases = atoi(e);
    printf("test_plan: seed 0x%" PRIx64 " (set MTC_PLAN_SEED to change), %d random cases\n", g_seed,
           ncases);
    test_default_opts();
    test_leaf_align();
    test_actions_table();
    test_actions_exhaustive();
    test_empty_and_unpacked();
    test_bad_opts();
    test_bad_leaves();
    test_overflow_alignment();
    test_huge_options_and_leaves();
    test_known_layouts();
    test_valid_detects_corruption();
    test_many_leaves();
    test_random_layouts(ncases);
    printf("test_plan: OK: %d tests passed in %.2f s (seed 0x%" PRIx64 ")\n", n_tests_run,
           now_s() - t0, g_seed);
    return 0;
}
