/*
 * layout.c - encode and (defensively) decode packed-batch layouts (layout.h).
 */
#include "layout.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "strides.h"

typedef struct _rd { const uint8_t *p, *end; int bad; } _rd;

static uint64_t _get(_rd *r, int n)
{
    if (r->bad || (size_t)(r->end - r->p) < (size_t)n) {
        r->bad = 1;
        return 0;
    }
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v |= (uint64_t)r->p[i] << (8 * i);
    r->p += n;
    return v;
}

typedef struct _wr { uint8_t *p, *end; int bad; } _wr;

static void _put(_wr *w, uint64_t v, int n)
{
    if (w->bad || (size_t)(w->end - w->p) < (size_t)n) {
        w->bad = 1;
        return;
    }
    for (int i = 0; i < n; i++) w->p[i] = (uint8_t)(v >> (8 * i));
    w->p += n;
}

size_t mtc_layout_size(const mtc_leaf *leaves, uint32_t n, const mtc_plan *p)
{
    size_t s = 4 + 2 + 2 + 4 + 4 + 8 + 8;
    for (uint32_t i = 0; i < n; i++)
        s += 4 + 8 * (size_t)leaves[i].ndim * ((leaves[i].flags & MTC_LEAF_STRIDED) ? 2 : 1);
    for (uint32_t g = 0; g < p->nsegs; g++) s += 1 + 3 + 4 + 4 * 8 + (size_t)p->segs[g].count * 12;
    return s;
}

int mtc_layout_encode(const mtc_leaf *leaves, uint32_t n, const int64_t *shape, const int64_t *ostrides,
                      const mtc_plan *p, uint8_t *buf, size_t len)
{
    if (n && p->nchunks != 1) return -EINVAL;
    for (uint32_t i = 0; i < n; i++)
        if (leaves[i].action != MTC_ACT_PACK || ((leaves[i].flags & MTC_LEAF_STRIDED) && !ostrides))
            return -EINVAL;
    _wr w = {buf, buf + len, 0};
    _put(&w, MTC_LAYOUT_MAGIC, 4);
    _put(&w, MTC_LAYOUT_VERSION, 2);
    _put(&w, 0, 2);
    _put(&w, n, 4);
    _put(&w, p->nsegs, 4);
    _put(&w, n ? (uint64_t)p->chunks[0].payload : 0, 8);
    _put(&w, n ? (uint64_t)p->chunks[0].align : 1, 8);
    for (uint32_t i = 0; i < n; i++) {
        const mtc_leaf *l = &leaves[i];
        int strided = (l->flags & MTC_LEAF_STRIDED) != 0;
        _put(&w, l->dtype, 2);
        _put(&w, (uint64_t)l->ndim | (strided ? MTC_LAYOUT_STRIDED : 0) | ((l->flags & MTC_LEAF_HOST) ? MTC_LAYOUT_HOST : 0),
             2);
        for (int32_t d = 0; d < l->ndim; d++) _put(&w, (uint64_t)shape[l->dims + d], 8);
        if (strided)
            for (int32_t d = 0; d < l->ndim; d++) _put(&w, (uint64_t)ostrides[l->dims + d], 8);
    }
    for (uint32_t g = 0; g < p->nsegs; g++) {
        const mtc_seg *s = &p->segs[g];
        _put(&w, (uint64_t)s->kind, 1);
        _put(&w, 0, 3);
        _put(&w, s->count, 4);
        _put(&w, (uint64_t)s->offset, 8);
        _put(&w, (uint64_t)s->bytes, 8);
        _put(&w, (uint64_t)s->rows, 8);
        _put(&w, (uint64_t)s->row_bytes, 8);
        for (uint32_t k = 0; k < s->count; k++) {
            uint32_t li = p->members[s->first + k];
            _put(&w, li, 4);
            _put(&w, (uint64_t)leaves[li].slot, 8);
        }
    }
    return w.bad ? -ENOSPC : 0;
}

void mtc_layout_free(mtc_layout *l)
{
    free(l->leaves);
    free(l->shape);
    free(l->strides);
    free(l->ostrides);
    mtc_plan_free(&l->plan);
    memset(l, 0, sizeof *l);
}

/* a * b into *out unless it overflows int64 (both non-negative) */
static int _mul(int64_t a, int64_t b, int64_t *out)
{
    if (a && b > INT64_MAX / a) return -1;
    *out = a * b;
    return 0;
}

/* The header: leaf and segment counts, the chunk's payload and alignment,
 * bounded by the buffer and the region before anything is allocated.
 * 0 or -EINVAL. */
static int _decode_header(_rd *r, size_t len, uint64_t region_bytes, uint32_t *n, uint32_t *nsegs,
                          int64_t *payload, int64_t *align)
{
    if (_get(r, 4) != MTC_LAYOUT_MAGIC || _get(r, 2) != MTC_LAYOUT_VERSION) return -EINVAL;
    _get(r, 2);
    *n = (uint32_t)_get(r, 4);
    *nsegs = (uint32_t)_get(r, 4);
    *payload = (int64_t)_get(r, 8);
    *align = (int64_t)_get(r, 8);
    /* every leaf takes >= 4 bytes and every segment >= 40: bound the counts by
     * the buffer before allocating anything */
    if (r->bad || *n > MTC_LAYOUT_MAX_LEAVES || (size_t)*n * 4 > len || (size_t)*nsegs * 40 > len ||
        *nsegs > *n || *payload < 0 || *align < 1 || *align > MTC_LAYOUT_MAX_ALIGN || (*align & (*align - 1)) ||
        (uint64_t)*payload > region_bytes || (uint64_t)*payload + (uint64_t)*align - 1 > region_bytes)
        return -EINVAL;
    return 0;
}

/* Carried strides of leaf l (MTC_LAYOUT_STRIDED): non-negative, a dense,
 * non-overlapping layout of its dims, so that its bytes are one block of
 * nbytes at its offset. Into L->ostrides, and as byte strides into
 * L->strides (saturated on a dim of size <= 1, or of an empty leaf, where
 * they address nothing).
 * 0 or -EINVAL. */
static int _decode_strides(_rd *r, mtc_layout *L, mtc_leaf *l, int64_t numel)
{
    int64_t *os = &L->ostrides[L->ndims], *bs = &L->strides[L->ndims];
    const int64_t *sh = &L->shape[L->ndims];
    for (int32_t d = 0; d < l->ndim; d++) {
        os[d] = (int64_t)_get(r, 8);
        if (r->bad || os[d] < 0) return -EINVAL;
        if (_mul(os[d], l->elsize, &bs[d])) {
            if (sh[d] > 1 && numel) return -EINVAL;
            bs[d] = INT64_MAX;
        }
    }
    if (!mtc_strides_dense(sh, os, l->ndim)) return -EINVAL;
    l->flags = (l->flags & MTC_LEAF_HOST) | MTC_LEAF_DENSE | MTC_LEAF_STRIDED;
    return 0;
}

/* Leaf i: dtype and shape, row-major byte strides or carried ones (the
 * output's), at most `payload` bytes. Grows L's dims arrays (capacity
 * *cap_dims). 0, -EINVAL or -ENOMEM. */
static int _decode_leaf(_rd *r, mtc_layout *L, uint32_t i, const int *elsize, int ndtypes, int64_t payload,
                        uint32_t *cap_dims)
{
    mtc_leaf *l = &L->leaves[i];
    uint64_t dt = _get(r, 2), nd = _get(r, 2), strided = nd & MTC_LAYOUT_STRIDED, host = nd & MTC_LAYOUT_HOST;
    nd &= ~(uint64_t)(MTC_LAYOUT_STRIDED | MTC_LAYOUT_HOST);
    if (r->bad || dt >= (uint64_t)ndtypes || nd > MTC_MAX_NDIM || elsize[dt] < 1) return -EINVAL;
    if (L->ndims + nd > *cap_dims) {
        while (L->ndims + nd > *cap_dims) *cap_dims *= 2;
        int64_t *s = realloc(L->shape, *cap_dims * sizeof *s);
        if (!s) return -ENOMEM;
        L->shape = s;
        int64_t *t = realloc(L->strides, *cap_dims * sizeof *t);
        if (!t) return -ENOMEM;
        L->strides = t;
        int64_t *o = realloc(L->ostrides, *cap_dims * sizeof *o);
        if (!o) return -ENOMEM;
        L->ostrides = o;
    }
    l->dtype = (uint16_t)dt;
    l->elsize = (uint16_t)elsize[dt];
    l->ndim = (int32_t)nd;
    l->dims = L->ndims;
    l->dev = MTC_DEV_CPU;
    l->flags = MTC_LEAF_CONTIGUOUS;
    l->action = MTC_ACT_PACK;
    l->seg = -1;
    int64_t numel = 1;
    for (uint64_t d = 0; d < nd; d++) {
        int64_t v = (int64_t)_get(r, 8);
        if (r->bad || v < 0 || _mul(numel, v, &numel)) return -EINVAL;
        L->shape[L->ndims + d] = v;
    }
    if (_mul(numel, l->elsize, &l->nbytes) || l->nbytes > payload) return -EINVAL;
    if (host) {
        l->flags |= MTC_LEAF_HOST;
        L->nhost++;
    }
    if (strided) {
        if (_decode_strides(r, L, l, numel)) return -EINVAL;
        L->ndims += (uint32_t)nd;
        return 0;
    }
    /* Byte strides fit when the leaf has bytes (they are at most nbytes);
     * a zero-size leaf may have dims whose strides do not (torch.empty(0,
     * 2**60, 4) is a tensor): saturated, they address nothing. */
    int64_t acc = l->elsize;
    for (uint64_t d = nd; d-- > 0;) {
        L->strides[L->ndims + d] = acc;
        int64_t v = L->shape[L->ndims + d];
        if (d && _mul(acc, v > 1 ? v : 1, &acc)) {
            if (numel) return -EINVAL;
            acc = INT64_MAX;
        }
    }
    L->ndims += (uint32_t)nd;
    return 0;
}

/* Member li of segment s at `slot`: same dtype, ndim and trailing shape as
 * the segment's first member, aligned for a view of its dtype, inside the
 * segment; *cursor is the next free row (SPLIT) or member index (UNIFORM).
 * Sets *off to its byte offset in the segment. 0 or -EINVAL. */
static int _check_member(const mtc_layout *L, const mtc_seg *s, const mtc_leaf *l, int64_t slot, int64_t align,
                         int64_t *cursor, int64_t *off)
{
    const mtc_leaf *pr = &L->leaves[s->proto];
    if (l->dtype != pr->dtype || l->ndim != pr->ndim || ((l->flags ^ pr->flags) & MTC_LEAF_HOST)) return -EINVAL;
    /* a leaf with strides of its own is viewed alone, with them */
    if ((l->flags & MTC_LEAF_STRIDED) && (s->kind != MTC_SEG_UNIFORM || s->count != 1)) return -EINVAL;
    for (int32_t d = 1; d < l->ndim; d++)
        if (L->shape[l->dims + d] != L->shape[pr->dims + d]) return -EINVAL;
    /* The chunk base is aligned to `align`; a view of the dtype needs its
     * element size to divide that and the member's offset. (The planner
     * aligns members to lcm(min alignment, elsize) only, not to the chunk's
     * `align`, the lcm over all members.) */
    int64_t a = l->elsize;
    if (align % a || s->offset % a) return -EINVAL;
    if (s->kind == MTC_SEG_UNIFORM) {
        if (slot != *cursor) return -EINVAL;
        for (int32_t d = 0; d < l->ndim; d++)
            if (L->shape[l->dims + d] != L->shape[pr->dims + d]) return -EINVAL;
        if (s->row_bytes % l->elsize || (s->count > 1 && s->row_bytes < l->nbytes)) return -EINVAL;
        /* one member is viewed as the whole segment: typed.view(shape) */
        if (s->count == 1 && s->bytes != l->nbytes) return -EINVAL;
        if (_mul(slot, s->row_bytes, off)) return -EINVAL;
        *cursor = slot + 1;
    } else {
        if (l->ndim < 1) return -EINVAL;
        int64_t rb = l->elsize;
        for (int32_t d = 1; d < l->ndim; d++)
            if (_mul(rb, L->shape[l->dims + d], &rb)) return -EINVAL;
        if (rb != s->row_bytes || slot < *cursor || slot > s->rows ||
            L->shape[l->dims] > s->rows - slot) /* its rows end past the segment's */
            return -EINVAL;
        if (_mul(slot, rb, off)) return -EINVAL;
        *cursor = slot + L->shape[l->dims];
    }
    if (*off > s->bytes || l->nbytes > s->bytes - *off || (s->offset + *off) % a) return -EINVAL;
    return 0;
}

/* Segment g and its members: after the previous segment (*prev_end), inside
 * the payload, every member placed once. 0 or -EINVAL. */
static int _decode_segment(_rd *r, mtc_layout *L, uint32_t g, int64_t payload, int64_t align, int64_t *prev_end)
{
    mtc_plan *p = &L->plan;
    uint32_t n = L->nleaves;
    mtc_seg *s = &p->segs[g];
    uint64_t kind = _get(r, 1);
    _get(r, 3);
    uint64_t count = _get(r, 4);
    s->offset = (int64_t)_get(r, 8);
    s->bytes = (int64_t)_get(r, 8);
    s->rows = (int64_t)_get(r, 8);
    s->row_bytes = (int64_t)_get(r, 8);
    if (r->bad || (kind != MTC_SEG_SPLIT && kind != MTC_SEG_UNIFORM) || count == 0 ||
        count > (uint64_t)(n - p->nmembers) || s->offset < *prev_end || s->bytes < 0 ||
        s->offset > payload || s->bytes > payload - s->offset || s->rows < 0 || s->row_bytes < 0)
        return -EINVAL;
    /* segments in increasing offsets: they cannot overlap */
    *prev_end = s->offset + s->bytes;
    s->kind = (int32_t)kind;
    s->chunk = 0;
    s->first = p->nmembers;
    s->count = (uint32_t)count;
    int64_t cursor = 0; /* SPLIT: next free row; UNIFORM: next member index */
    for (uint64_t k = 0; k < count; k++) {
        uint64_t li = _get(r, 4);
        int64_t slot = (int64_t)_get(r, 8), off;
        if (r->bad || li >= n || L->leaves[li].seg != -1 || slot < 0) return -EINVAL;
        mtc_leaf *l = &L->leaves[li];
        if (k == 0) s->proto = (uint32_t)li;
        if (_check_member(L, s, l, slot, align, &cursor, &off)) return -EINVAL;
        l->seg = (int32_t)g;
        l->slot = slot;
        p->members[p->nmembers++] = (uint32_t)li;
    }
    if (s->bytes % L->leaves[s->proto].elsize) return -EINVAL; /* viewed as the dtype */
    int64_t span;
    if (s->kind == MTC_SEG_UNIFORM) {
        if (cursor != s->count) return -EINVAL;
        if (_mul(s->count - 1, s->row_bytes, &span) || span > s->bytes) return -EINVAL;
    } else {
        if (_mul(s->rows, s->row_bytes, &span) || span != s->bytes) return -EINVAL;
    }
    p->nsegs++;
    return 0;
}

int mtc_layout_decode(const uint8_t *buf, size_t len, const int *elsize, int ndtypes,
                      uint64_t region_bytes, mtc_layout *out)
{
    memset(out, 0, sizeof *out);
    _rd r = {buf, buf + len, 0};
    uint32_t n, nsegs;
    int64_t payload, align;
    if (_decode_header(&r, len, region_bytes, &n, &nsegs, &payload, &align)) return -EINVAL;
    int rc = -ENOMEM;
    mtc_layout *L = out;
    L->nleaves = n;
    L->leaves = calloc(n ? n : 1, sizeof *L->leaves);
    uint32_t cap_dims = 16;
    L->shape = malloc(cap_dims * sizeof *L->shape);
    L->strides = malloc(cap_dims * sizeof *L->strides);
    L->ostrides = malloc(cap_dims * sizeof *L->ostrides);
    mtc_plan *p = &L->plan;
    p->segs = calloc(nsegs ? nsegs : 1, sizeof *p->segs);
    p->members = calloc(n ? n : 1, sizeof *p->members);
    p->chunks = calloc(1, sizeof *p->chunks);
    if (!L->leaves || !L->shape || !L->strides || !L->ostrides || !p->segs || !p->members || !p->chunks) goto error;
    p->nchunks = n ? 1 : 0;
    p->chunks[0].payload = payload;
    p->chunks[0].align = align;
    for (uint32_t i = 0; i < n; i++)
        if ((rc = _decode_leaf(&r, L, i, elsize, ndtypes, payload, &cap_dims))) goto error;
    rc = -EINVAL;
    int64_t prev_end = 0;
    for (uint32_t g = 0; g < nsegs; g++)
        if (_decode_segment(&r, L, g, payload, align, &prev_end)) goto error;
    if (p->nmembers != n || r.p != r.end) goto error; /* every leaf placed, nothing trailing */
    /* host-placed segments (all members alike, _check_member) after all the others */
    int host_seen = 0;
    L->host_start = payload;
    for (uint32_t g = 0; g < nsegs; g++) {
        const mtc_seg *s = &p->segs[g];
        if (L->leaves[s->proto].flags & MTC_LEAF_HOST) {
            if (!host_seen) L->host_start = s->offset;
            host_seen = 1;
        } else {
            if (host_seen) goto error;
            L->dev_end = s->offset + s->bytes;
        }
    }
    p->count[MTC_ACT_PACK] = n;
    return 0;
error:
    mtc_layout_free(L);
    return rc;
}
