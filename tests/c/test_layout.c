/*
 * test_layout.c - the packed-batch layout codec (csrc/engine/layout.c) with leaves
 * that carry their own strides, and the layout rules it relies on
 * (csrc/engine/strides.c): torch's dense test, infer_dense_strides and the output
 * flags, checked against values torch 2.13 gives.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "layout.h"
#include "strides.h"

/* ---- strides.c against torch ---- */

typedef struct {
    int nd;
    int64_t shape[6], strides[6];
    int dense;           /* x.is_non_overlapping_and_dense() */
    int64_t out[6];      /* x.clone().stride() */
} _case;

static const _case CASES[] = {
    {2, {3, 4}, {4, 1}, 1, {4, 1}},
    {2, {3, 4}, {1, 3}, 1, {1, 3}},                          /* transposed */
    {4, {2, 3, 4, 5}, {60, 1, 15, 3}, 1, {60, 1, 15, 3}},    /* channels_last */
    {3, {4, 1, 3}, {3, 3, 1}, 1, {3, 3, 1}},
    {3, {3, 1, 4}, {4, 100, 1}, 1, {4, 100, 1}},             /* a size-1 dim, any stride */
    {1, {1}, {5}, 1, {5}},
    {2, {0, 5}, {3, 2}, 1, {3, 2}},                          /* empty: any strides */
    {3, {2, 3, 4}, {1, 8, 2}, 1, {1, 8, 2}},
    {2, {1, 5}, {1, 1}, 1, {1, 1}},
    {2, {3, 4}, {2, 6}, 0, {1, 3}},                          /* gaps */
    {4, {2, 2, 5, 3}, {60, 10, 1, 20}, 0, {30, 5, 1, 10}},
    {2, {3, 4}, {1, 0}, 0, {4, 1}},                          /* expanded */
    {5, {6, 5, 4, 3, 2}, {6, 0, 120, 0, 1}, 0, {6, 36, 180, 2, 1}},
    {2, {2, 3}, {1, 1}, 0, {1, 2}},                          /* overlapping: equal strides */
    {2, {3, 3}, {1, 1}, 0, {3, 1}},
    {4, {2, 1, 4, 5}, {40, 1, 10, 2}, 0, {20, 1, 5, 1}},
    {2, {5, 1}, {5, 1}, 0, {1, 1}},
    {3, {3, 2, 2}, {1, 1, 4}, 0, {2, 1, 6}},
    {1, {4}, {2}, 0, {1}},
};

static void test_strides_against_torch(void)
{
    for (size_t k = 0; k < sizeof CASES / sizeof CASES[0]; k++) {
        const _case *c = &CASES[k];
        CHECK_EQ(mtc_strides_dense(c->shape, c->strides, c->nd), c->dense);
        int64_t s[6];
        memcpy(s, c->strides, sizeof s);
        uint32_t fl = mtc_strides_leaf(c->shape, s, c->nd);
        for (int d = 0; d < c->nd; d++) CHECK_EQ(s[d], c->out[d]);
        CHECK_EQ((fl & MTC_LEAF_DENSE) != 0, c->dense);
        CHECK_EQ((fl & MTC_LEAF_STRIDED) != 0, !mtc_strides_default(c->shape, c->out, c->nd));
        if (!c->dense) { /* infer alone gives the same */
            int64_t o[6];
            mtc_strides_infer(c->shape, c->strides, c->nd, o);
            for (int d = 0; d < c->nd; d++) CHECK_EQ(o[d], c->out[d]);
        }
    }
    /* torch.empty's strides: a dim of 0 or 1 counts as 1 */
    int64_t sh[3] = {2, 0, 3}, st[3] = {3, 3, 1};
    CHECK(mtc_strides_default(sh, st, 3));
    int64_t sh1[2] = {1, 4}, st1[2] = {4, 1}, st1b[2] = {7, 1};
    CHECK(mtc_strides_default(sh1, st1, 2));
    CHECK(!mtc_strides_default(sh1, st1b, 2));
    CHECK(mtc_strides_default(NULL, NULL, 0));
    CHECK(mtc_strides_dense(NULL, NULL, 0));
    /* 64 dims of size 2: more elements than int64 counts, never dense */
    int64_t big[70], bst[70];
    for (int d = 0; d < 70; d++) big[d] = 2, bst[d] = d < 62 ? (int64_t)1 << d : 0;
    CHECK(!mtc_strides_dense(big, bst, 70));
}

/* ---- the codec ---- */

static const int ELSIZE[] = {1, 2, 4, 8};
#define NDT 4

/* A byte builder for hand-made (forged) layouts. */
typedef struct { uint8_t b[4096]; size_t n; } _buf;

static void put(_buf *w, uint64_t v, int n)
{
    for (int i = 0; i < n; i++) w->b[w->n++] = (uint8_t)(v >> (8 * i));
}

static void header(_buf *w, uint32_t nleaves, uint32_t nsegs, int64_t payload, int64_t align)
{
    w->n = 0;
    put(w, MTC_LAYOUT_MAGIC, 4);
    put(w, MTC_LAYOUT_VERSION, 2);
    put(w, 0, 2);
    put(w, nleaves, 4);
    put(w, nsegs, 4);
    put(w, (uint64_t)payload, 8);
    put(w, (uint64_t)align, 8);
}

/* leaf of dtype 2 (4 bytes) and ndim dims, with strides when st != NULL,
 * host-placed when host */
static void leaf_h(_buf *w, int nd, const int64_t *dims, const int64_t *st, int host)
{
    put(w, 2, 2);
    put(w, (uint64_t)nd | (st ? MTC_LAYOUT_STRIDED : 0) | (host ? MTC_LAYOUT_HOST : 0), 2);
    for (int d = 0; d < nd; d++) put(w, (uint64_t)dims[d], 8);
    if (st)
        for (int d = 0; d < nd; d++) put(w, (uint64_t)st[d], 8);
}

static void leaf(_buf *w, int nd, const int64_t *dims, const int64_t *st) { leaf_h(w, nd, dims, st, 0); }

static void seg(_buf *w, int kind, uint32_t count, int64_t off, int64_t bytes, int64_t rows, int64_t row_bytes)
{
    put(w, (uint64_t)kind, 1);
    put(w, 0, 3);
    put(w, count, 4);
    put(w, (uint64_t)off, 8);
    put(w, (uint64_t)bytes, 8);
    put(w, (uint64_t)rows, 8);
    put(w, (uint64_t)row_bytes, 8);
}

static void member(_buf *w, uint32_t li, int64_t slot)
{
    put(w, li, 4);
    put(w, (uint64_t)slot, 8);
}

static int decode(const _buf *w, mtc_layout *L)
{
    return mtc_layout_decode(w->b, w->n, ELSIZE, NDT, 1 << 20, L);
}

/* One float32 leaf (3, 4) transposed to strides (1, 3), alone in a segment. */
static void one_strided(_buf *w, const int64_t *st, int kind, uint32_t nleaves)
{
    int64_t dims[2] = {4, 3};
    header(w, nleaves, nleaves, 48 * nleaves, 16);
    for (uint32_t i = 0; i < nleaves; i++) leaf(w, 2, dims, i == 0 ? st : NULL);
    for (uint32_t i = 0; i < nleaves; i++) {
        seg(w, kind, 1, 48 * i, 48, kind == MTC_SEG_SPLIT ? 4 : 1, kind == MTC_SEG_SPLIT ? 12 : 48);
        member(w, i, 0);
    }
}

static void test_decode_strided(void)
{
    _buf w;
    mtc_layout L;
    int64_t good[2] = {1, 4};
    one_strided(&w, good, MTC_SEG_UNIFORM, 2);
    CHECK_EQ(decode(&w, &L), 0);
    CHECK_EQ(L.leaves[0].flags, MTC_LEAF_DENSE | MTC_LEAF_STRIDED);
    CHECK_EQ(L.ostrides[L.leaves[0].dims], 1);
    CHECK_EQ(L.ostrides[L.leaves[0].dims + 1], 4);
    CHECK_EQ(L.strides[L.leaves[0].dims + 1], 16); /* bytes */
    CHECK_EQ(L.leaves[1].flags, MTC_LEAF_CONTIGUOUS);
    CHECK_EQ(L.strides[L.leaves[1].dims], 12);
    mtc_layout_free(&L);

    /* forged strides: overlapping, gaps, negative, a huge one on a dim of size > 1 */
    int64_t bad[][2] = {{1, 1}, {1, 5}, {2, 8}, {-1, 4}, {1, (int64_t)1 << 62}, {0, 4}};
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        one_strided(&w, bad[k], MTC_SEG_UNIFORM, 1);
        CHECK_EQ(decode(&w, &L), -EINVAL);
    }
    /* a strided leaf in a SPLIT segment, which views row-major rows */
    one_strided(&w, good, MTC_SEG_SPLIT, 1);
    CHECK_EQ(decode(&w, &L), -EINVAL);
    /* the same leaf without strides in a SPLIT segment is fine */
    one_strided(&w, NULL, MTC_SEG_SPLIT, 1);
    CHECK_EQ(decode(&w, &L), 0);
    mtc_layout_free(&L);
    /* cut anywhere: never read past the end */
    one_strided(&w, good, MTC_SEG_UNIFORM, 2);
    for (size_t cut = 0; cut < w.n; cut++) CHECK_EQ(mtc_layout_decode(w.b, cut, ELSIZE, NDT, 1 << 20, &L), -EINVAL);

    /* a strided leaf sharing a UNIFORM segment with another */
    int64_t dims[2] = {4, 3};
    header(&w, 2, 1, 96, 16);
    leaf(&w, 2, dims, good);
    leaf(&w, 2, dims, NULL);
    seg(&w, MTC_SEG_UNIFORM, 2, 0, 96, 2, 48);
    member(&w, 0, 0);
    member(&w, 1, 1);
    CHECK_EQ(decode(&w, &L), -EINVAL);
    header(&w, 2, 1, 96, 16);
    leaf(&w, 2, dims, NULL);
    leaf(&w, 2, dims, good);
    seg(&w, MTC_SEG_UNIFORM, 2, 0, 96, 2, 48);
    member(&w, 0, 0);
    member(&w, 1, 1);
    CHECK_EQ(decode(&w, &L), -EINVAL);

    /* size-1 and empty leaves: any stride, saturated bytes where they address nothing */
    int64_t d1[3] = {3, 1, 4}, s1[3] = {4, (int64_t)1 << 62, 1};
    header(&w, 1, 1, 48, 16);
    leaf(&w, 3, d1, s1);
    seg(&w, MTC_SEG_UNIFORM, 1, 0, 48, 1, 48);
    member(&w, 0, 0);
    CHECK_EQ(decode(&w, &L), 0);
    CHECK_EQ(L.ostrides[1], (int64_t)1 << 62);
    CHECK_EQ(L.strides[1], INT64_MAX);
    mtc_layout_free(&L);
    int64_t d0[2] = {0, 5}, s0[2] = {(int64_t)1 << 62, (int64_t)1 << 61};
    header(&w, 1, 1, 0, 16);
    leaf(&w, 2, d0, s0);
    seg(&w, MTC_SEG_UNIFORM, 1, 0, 0, 1, 0);
    member(&w, 0, 0);
    CHECK_EQ(decode(&w, &L), 0);
    mtc_layout_free(&L);
}

/* Encode -> decode of a planned batch with strided leaves among row-major ones. */
static void test_round_trip(void)
{
    enum { N = 6 };
    mtc_leaf lv[N];
    int64_t shape[32], ost[32];
    uint32_t nd = 0;
    memset(lv, 0, sizeof lv);
    /* leaves: (3, 4) row-major x2, (3, 4) strided (1, 3) x2, (2, 3, 4, 5) channels_last, (5,) */
    const int64_t dims[N][4] = {{3, 4}, {3, 4}, {3, 4}, {3, 4}, {2, 3, 4, 5}, {5}};
    const int ndims[N] = {2, 2, 2, 2, 4, 1};
    const int64_t os[N][4] = {{0}, {0}, {1, 3}, {1, 3}, {60, 1, 15, 3}, {0}};
    for (int i = 0; i < N; i++) {
        lv[i].dtype = 2;
        lv[i].elsize = 4;
        lv[i].ndim = ndims[i];
        lv[i].dims = nd;
        lv[i].dev = MTC_DEV_CPU;
        int64_t numel = 1;
        for (int d = 0; d < ndims[i]; d++) {
            shape[nd + d] = dims[i][d];
            ost[nd + d] = os[i][d];
            numel *= dims[i][d];
        }
        lv[i].nbytes = numel * 4;
        lv[i].flags = os[i][0] ? MTC_LEAF_DENSE | MTC_LEAF_STRIDED : MTC_LEAF_CONTIGUOUS;
        nd += (uint32_t)ndims[i];
    }
    mtc_plan_opts o;
    mtc_plan_default_opts(&o, 0);
    mtc_plan p;
    CHECK_EQ(mtc_plan_build(&p, lv, N, shape, &o), 0);
    CHECK(mtc_plan_valid(&p, lv, N, shape, &o));
    for (int i = 0; i < N; i++)
        if (lv[i].flags & MTC_LEAF_STRIDED) CHECK_EQ(p.segs[lv[i].seg].count, 1);
    CHECK_EQ(p.segs[lv[0].seg].count, 2); /* the row-major pair still shares one */
    size_t len = mtc_layout_size(lv, N, &p);
    uint8_t *buf = malloc(len);
    CHECK(buf);
    CHECK_EQ(mtc_layout_encode(lv, N, shape, NULL, &p, buf, len), -EINVAL); /* strided leaves need ostrides */
    CHECK_EQ(mtc_layout_encode(lv, N, shape, ost, &p, buf, len), 0);
    CHECK_EQ(mtc_layout_encode(lv, N, shape, ost, &p, buf, len - 1), -ENOSPC);
    mtc_layout L;
    CHECK_EQ(mtc_layout_decode(buf, len, ELSIZE, NDT, (uint64_t)p.chunks[0].payload + 64, &L), 0);
    CHECK_EQ(L.nleaves, N);
    for (int i = 0; i < N; i++) {
        const mtc_leaf *l = &L.leaves[i];
        CHECK_EQ(l->ndim, ndims[i]);
        CHECK_EQ(l->nbytes, lv[i].nbytes);
        CHECK_EQ(l->seg >= 0, 1);
        CHECK_EQ(mtc_plan_leaf_offset(&L.plan, l), mtc_plan_leaf_offset(&p, &lv[i]));
        CHECK_EQ((l->flags & MTC_LEAF_STRIDED) != 0, (lv[i].flags & MTC_LEAF_STRIDED) != 0);
        for (int d = 0; d < ndims[i]; d++) {
            CHECK_EQ(L.shape[l->dims + d], dims[i][d]);
            if (l->flags & MTC_LEAF_STRIDED) {
                CHECK_EQ(L.ostrides[l->dims + d], os[i][d]);
                CHECK_EQ(L.strides[l->dims + d], os[i][d] * 4);
            }
        }
    }
    /* row-major leaves cost no stride bytes: 4 + 8 per dim, 8 more per dim when strided */
    lv[2].flags = lv[3].flags = lv[4].flags = MTC_LEAF_CONTIGUOUS;
    CHECK_EQ(len - mtc_layout_size(lv, N, &p), (size_t)8 * (2 + 2 + 4));
    mtc_layout_free(&L);
    mtc_plan_free(&p);
    free(buf);
}

/* Host-placed leaves (under an OnHost): planned apart from the others and
 * after all of them, the flag carried by the layout at no cost in bytes. */
static void test_host(void)
{
    enum { N = 6 };
    mtc_leaf lv[N];
    int64_t shape[32], ost[32];
    uint32_t nd = 0;
    memset(lv, 0, sizeof lv);
    /* (3, 4) float32: host, device, host, device; a strided (1, 3) host leaf; a (5,) device leaf */
    const int host[N] = {1, 0, 1, 0, 1, 0};
    const int64_t os[N][2] = {{0}, {0}, {0}, {0}, {1, 3}, {0}};
    for (int i = 0; i < N; i++) {
        lv[i].dtype = 2;
        lv[i].elsize = 4;
        lv[i].ndim = i == 5 ? 1 : 2;
        lv[i].dims = nd;
        lv[i].dev = MTC_DEV_CPU;
        shape[nd] = i == 5 ? 5 : 3;
        shape[nd + 1] = 4;
        ost[nd] = os[i][0];
        ost[nd + 1] = os[i][1];
        lv[i].nbytes = i == 5 ? 20 : 48;
        lv[i].flags = (os[i][0] ? MTC_LEAF_DENSE | MTC_LEAF_STRIDED : MTC_LEAF_CONTIGUOUS) | (host[i] ? MTC_LEAF_HOST : 0);
        nd += (uint32_t)lv[i].ndim;
    }
    mtc_plan_opts o;
    mtc_plan_default_opts(&o, 0);
    mtc_plan p;
    CHECK_EQ(mtc_plan_build(&p, lv, N, shape, &o), 0);
    CHECK(mtc_plan_valid(&p, lv, N, shape, &o));
    CHECK_EQ(p.nchunks, 1);
    /* a host leaf never shares a segment with a device leaf of its shape, and
     * every host leaf lies after every device leaf */
    CHECK(lv[0].seg != lv[1].seg);
    CHECK_EQ(lv[0].seg, lv[2].seg);
    CHECK_EQ(lv[1].seg, lv[3].seg);
    int64_t dev_end = 0, host_first = INT64_MAX;
    for (int i = 0; i < N; i++) {
        int64_t off = mtc_plan_leaf_offset(&p, &lv[i]);
        if (host[i]) host_first = off < host_first ? off : host_first;
        else dev_end = off + lv[i].nbytes > dev_end ? off + lv[i].nbytes : dev_end;
    }
    CHECK(dev_end <= host_first);
    /* the validator refuses a device segment after a host one */
    mtc_seg save = p.segs[0];
    p.segs[0] = p.segs[p.nsegs - 1];
    p.segs[p.nsegs - 1] = save;
    CHECK(!mtc_plan_valid(&p, lv, N, shape, &o));
    p.segs[p.nsegs - 1] = p.segs[0];
    p.segs[0] = save;
    CHECK(mtc_plan_valid(&p, lv, N, shape, &o));

    size_t len = mtc_layout_size(lv, N, &p);
    uint8_t *buf = malloc(len);
    CHECK(buf);
    CHECK_EQ(mtc_layout_encode(lv, N, shape, ost, &p, buf, len), 0);
    mtc_layout L;
    CHECK_EQ(mtc_layout_decode(buf, len, ELSIZE, NDT, (uint64_t)p.chunks[0].payload + 64, &L), 0);
    CHECK_EQ(L.nhost, 3);
    CHECK_EQ(L.dev_end, dev_end);
    CHECK_EQ(L.host_start, host_first);
    for (int i = 0; i < N; i++) {
        const mtc_leaf *l = &L.leaves[i];
        CHECK_EQ((l->flags & MTC_LEAF_HOST) != 0, host[i]);
        CHECK_EQ((l->flags & MTC_LEAF_STRIDED) != 0, os[i][0] != 0);
        CHECK_EQ(mtc_plan_leaf_offset(&L.plan, l), mtc_plan_leaf_offset(&p, &lv[i]));
    }
    mtc_layout_free(&L);
    /* the flag costs no bytes */
    for (int i = 0; i < N; i++) lv[i].flags &= ~(uint32_t)MTC_LEAF_HOST;
    CHECK_EQ(mtc_layout_size(lv, N, &p), len);
    mtc_plan_free(&p);
    free(buf);

    /* no host leaf: the host span is empty, at the payload's end */
    _buf w;
    int64_t dims[2] = {4, 3};
    header(&w, 1, 1, 48, 16);
    leaf(&w, 2, dims, NULL);
    seg(&w, MTC_SEG_UNIFORM, 1, 0, 48, 1, 48);
    member(&w, 0, 0);
    CHECK_EQ(decode(&w, &L), 0);
    CHECK_EQ(L.nhost, 0);
    CHECK_EQ(L.dev_end, 48);
    CHECK_EQ(L.host_start, 48);
    mtc_layout_free(&L);

    /* forged: a segment of host and device members (either order) */
    for (int first = 0; first < 2; first++) {
        header(&w, 2, 1, 96, 16);
        leaf_h(&w, 2, dims, NULL, first);
        leaf_h(&w, 2, dims, NULL, !first);
        seg(&w, MTC_SEG_UNIFORM, 2, 0, 96, 2, 48);
        member(&w, 0, 0);
        member(&w, 1, 1);
        CHECK_EQ(decode(&w, &L), -EINVAL);
    }
    /* forged: a device segment after a host one; the other order is fine */
    for (int dev_last = 0; dev_last < 2; dev_last++) {
        header(&w, 2, 2, 96, 16);
        leaf_h(&w, 2, dims, NULL, dev_last);  /* in the first segment */
        leaf_h(&w, 2, dims, NULL, !dev_last); /* in the second */
        seg(&w, MTC_SEG_UNIFORM, 1, 0, 48, 1, 48);
        member(&w, 0, 0);
        seg(&w, MTC_SEG_UNIFORM, 1, 48, 48, 1, 48);
        member(&w, 1, 0);
        CHECK_EQ(decode(&w, &L), (dev_last ? -EINVAL : 0));
        if (!dev_last) {
            CHECK_EQ(L.nhost, 1);
            CHECK_EQ(L.dev_end, 48);
            CHECK_EQ(L.host_start, 48);
            mtc_layout_free(&L);
        }
    }
    /* host and strided together (0xC000), every leaf host-placed: no device bytes */
    int64_t good[2] = {1, 4};
    header(&w, 1, 1, 48, 16);
    leaf_h(&w, 2, dims, good, 1);
    seg(&w, MTC_SEG_UNIFORM, 1, 0, 48, 1, 48);
    member(&w, 0, 0);
    CHECK_EQ(decode(&w, &L), 0);
    CHECK_EQ(L.leaves[0].flags, MTC_LEAF_DENSE | MTC_LEAF_STRIDED | MTC_LEAF_HOST);
    CHECK_EQ(L.dev_end, 0);
    CHECK_EQ(L.host_start, 0);
    mtc_layout_free(&L);
    /* an ndim with both flags and more dims than allowed is still refused */
    header(&w, 1, 1, 48, 16);
    put(&w, 2, 2);
    put(&w, (uint64_t)(MTC_MAX_NDIM + 1) | MTC_LAYOUT_HOST, 2);
    CHECK_EQ(decode(&w, &L), -EINVAL);
}

int main(void)
{
    test_strides_against_torch();
    test_decode_strided();
    test_round_trip();
    test_host();
    printf("test_layout: all passed (%ld checks)\n", (long)g_checks);
    return 0;
}
