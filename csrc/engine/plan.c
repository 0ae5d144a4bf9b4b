/*
 * plan.c - per-leaf actions and the packed layout (see plan.h).
 */
#include "plan.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

void mtc_plan_default_opts(mtc_plan_opts *o, int32_t target)
{
    o->target = target;
    o->pack = 1;
    o->staging = 1;
    o->align = 16;
    o->max_chunk = 33554432;
    o->pack_limit = 256 * 1024;
    o->max_pad = 4096;
}

static int64_t _gcd(int64_t a, int64_t b)
{
    while (b) {
        int64_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

/* lcm, or 0 when it would exceed 2^40 (no sane alignment is that large). */
static int64_t _lcm(int64_t a, int64_t b)
{
    int64_t g = _gcd(a, b);
    int64_t q = a / g;
    if (q > ((int64_t)1 << 40) / b) return 0;
    return q * b;
}

static int64_t _round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

int64_t mtc_plan_leaf_align(const mtc_plan_opts *o, uint32_t elsize)
{
    /* the reference implementation's rule: round_up(max(min, elsize), elsize),
     * e.g. 8 for 6 and float32 (not the lcm, 12) */
    int64_t e = elsize ? elsize : 1, a = o->align > e ? o->align : e;
    if (a > ((int64_t)1 << 40)) return 0;
    return _round_up(a, e);
}

/* Decides the action of one leaf. Packing is only considered here; whether a
 * packed leaf fits a chunk is the layout's business. */
/* The chunk size the planner works with: max_chunk, capped so that no sum
 * of the layout (offsets, a segment's bytes plus a member, padding: each at
 * most a chunk) can overflow int64, whatever the options say. */
static inline int64_t _max_chunk(const mtc_plan_opts *o)
{
    return o->max_chunk < MTC_PLAN_MAX_CHUNK ? o->max_chunk : MTC_PLAN_MAX_CHUNK;
}

static uint8_t _action(const mtc_leaf *l, const mtc_plan_opts *o, uint8_t *needs_contig)
{
    /* a DMA or a plain memcpy reads one block: a contiguous or dense source */
    int contiguous = (l->flags & MTC_LEAF_BLOCK) != 0;
    int small = l->nbytes <= o->pack_limit && l->nbytes <= _max_chunk(o);
    *needs_contig = 0;
    if (o->target == MTC_DEV_CPU) {
        if (l->dev == MTC_DEV_CPU) {
            if (l->flags & MTC_LEAF_FILE) return MTC_ACT_HOST_COPY; /* read into a new tensor */
            if (!(l->flags & MTC_LEAF_NUMPY)) return MTC_ACT_REUSE;
            return (l->flags & MTC_LEAF_ZEROCOPY) ? MTC_ACT_FROM_NUMPY : MTC_ACT_HOST_COPY;
        }
        /* GPU -> CPU: the mirror of packing gathers small tensors into one
         * pinned chunk, which needs pinned staging and packing both on. */
        if (o->pack && o->staging && small && contiguous) return MTC_ACT_PACK;
        *needs_contig = !contiguous;
        return MTC_ACT_D2H;
    }
    if (l->dev == o->target) return MTC_ACT_REUSE;
    if (l->dev != MTC_DEV_CPU) {
        *needs_contig = !contiguous;
        return MTC_ACT_D2D;
    }
    /* CPU -> GPU: small tensors are packed whatever their strides (the
     * staging copy gathers strided ones); others need a contiguous source. */
    if (o->pack && small) return MTC_ACT_PACK;
    *needs_contig = !contiguous;
    return o->staging ? MTC_ACT_H2D_STAGED : MTC_ACT_H2D_DIRECT;
}

static int _u64_cmp(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* ---- grouping: open-addressing hash of (dtype, ndim, trailing dims) ---- */

typedef struct _group {
    uint32_t proto;   /* first member */
    uint32_t count;
    uint32_t fill;    /* members placed so far into the group's member list */
    uint32_t start;   /* offset of its members in the scratch member list */
    int uniform;
} _group;

static uint64_t _key_hash(const mtc_leaf *l, const int64_t *shape)
{
    uint64_t h = 1469598103934665603ull ^ ((uint64_t)l->dtype << 8) ^ (uint64_t)l->ndim ^
                 ((uint64_t)(l->flags & (MTC_LEAF_STRIDED | MTC_LEAF_HOST)) << 40);
    for (int32_t d = 1; d < l->ndim; d++) {
        h ^= (uint64_t)shape[l->dims + d];
        h *= 1099511628211ull;
    }
    return h * 0x9E3779B97F4A7C15ull;
}

static int _key_eq(const mtc_leaf *a, const mtc_leaf *b, const int64_t *shape)
{
    if (a->dtype != b->dtype || a->ndim != b->ndim || a->elsize != b->elsize ||
        (a->flags & (MTC_LEAF_STRIDED | MTC_LEAF_HOST)) != (b->flags & (MTC_LEAF_STRIDED | MTC_LEAF_HOST)))
        return 0;
    for (int32_t d = 1; d < a->ndim; d++)
        if (shape[a->dims + d] != shape[b->dims + d]) return 0;
    return 1;
}

/* Bytes per row (element size x trailing dims), or -1 when that overflows:
 * only a zero-size leaf can have such dims, e.g. torch.empty(0, 2**60, 4). */
static int64_t _row_bytes(const mtc_leaf *l, const int64_t *shape)
{
    int64_t rb = l->elsize;
    for (int32_t d = 1; d < l->ndim; d++)
        if (__builtin_mul_overflow(rb, shape[l->dims + d], &rb)) return -1;
    return rb;
}

typedef struct _layout {
    mtc_plan *p;
    mtc_leaf *leaves;
    const int64_t *shape;
    const mtc_plan_opts *o;
    uint32_t cap_segs, cap_chunks;
    int64_t cursor;     /* end of the open chunk's payload */
} _layout;

static int _new_chunk(_layout *L)
{
    mtc_plan *p = L->p;
    if (p->nchunks == L->cap_chunks) {
        uint32_t cap = L->cap_chunks ? 2 * L->cap_chunks : 4;
        mtc_chunk *c = realloc(p->chunks, cap * sizeof *c);
        if (!c) return -ENOMEM;
        p->chunks = c;
        L->cap_chunks = cap;
    }
    p->chunks[p->nchunks].payload = 0;
    p->chunks[p->nchunks].align = 1;
    p->nchunks++;
    L->cursor = 0;
    return 0;
}

/* Opens a segment at the next offset of the open chunk aligned to `align`. */
static int _open_seg(_layout *L, int kind, uint32_t proto, int64_t align, int64_t row_bytes)
{
    mtc_plan *p = L->p;
    if (p->nsegs == L->cap_segs) {
        uint32_t cap = L->cap_segs ? 2 * L->cap_segs : 16;
        mtc_seg *s = realloc(p->segs, cap * sizeof *s);
        if (!s) return -ENOMEM;
        p->segs = s;
        L->cap_segs = cap;
    }
    mtc_seg *s = &p->segs[p->nsegs++];
    s->chunk = (int32_t)p->nchunks - 1;
    s->kind = kind;
    s->offset = _round_up(L->cursor, align);
    s->bytes = 0;
    s->rows = 0;
    s->row_bytes = row_bytes;
    s->first = p->nmembers;
    s->count = 0;
    s->proto = proto;
    mtc_chunk *c = &p->chunks[s->chunk];
    int64_t a = _lcm(c->align, align);
    if (!a) return -EOVERFLOW;
    c->align = a;
    return 0;
}

static void _close_seg(_layout *L)
{
    mtc_plan *p = L->p;
    mtc_seg *s = &p->segs[p->nsegs - 1];
    int64_t end = s->offset + s->bytes;
    if (end > L->cursor) L->cursor = end;
    mtc_chunk *c = &p->chunks[s->chunk];
    if (L->cursor > c->payload) c->payload = L->cursor;
}

/*
 * Places the members of one group (leaf indices in `idx`, input order).
 * Starts a new chunk whenever the next member would push the open chunk past
 * max_chunk; every member fits an empty chunk (the planner packs only leaves
 * of at most max_chunk bytes).
 */
static int _place_group(_layout *L, const uint32_t *idx, uint32_t count, int uniform)
{
    mtc_leaf *lv = L->leaves;
    const mtc_plan_opts *o = L->o;
    const mtc_leaf *proto = &lv[idx[0]];
    int64_t align = mtc_plan_leaf_align(o, proto->elsize);
    if (!align) return -EOVERFLOW;
    int64_t row_bytes = _row_bytes(proto, L->shape);
    int single = 0;
    /* Rows of no bytes (a trailing dim is 0) or too many bytes to count (a
     * zero-size leaf with huge trailing dims): the members are all zero-size,
     * and a SPLIT's row count (the sum of their leading dims, any int64) could
     * overflow: one segment per member. */
    if (row_bytes <= 0) {
        row_bytes = 0;
        single = 1;
    }
    /* Leaves with strides of their own: one segment each, viewed with those
     * strides (a segment's shared views are row-major) */
    if (proto->flags & MTC_LEAF_STRIDED) single = 1;
    /* SPLIT: member start rows are multiples of m, so that their byte offset
     * (row * row_bytes) is a multiple of align. */
    int64_t m = row_bytes ? align / _gcd(align, row_bytes) : 1;
    int64_t pad;
    /* Identical shapes whose size is a multiple of the alignment tile without
     * padding: a SPLIT cuts them with the cheaper split (0-d members need unbind). */
    if (uniform && proto->ndim > 0 && proto->nbytes % align == 0) uniform = 0;
    if (!uniform && (__builtin_mul_overflow(m - 1, row_bytes, &pad) || pad > o->max_pad))
        single = 1; /* padding would waste too much */

    int rc;
    int open = 0;
    for (uint32_t k = 0; k < count; k++) {
        mtc_leaf *l = &lv[idx[k]];
        for (int attempt = 0;; attempt++) {
            if (!open) {
                if (single) rc = _open_seg(L, MTC_SEG_UNIFORM, idx[k], align, _round_up(l->nbytes, align));
                else if (uniform) rc = _open_seg(L, MTC_SEG_UNIFORM, idx[k], align, _round_up(l->nbytes, align));
                else rc = _open_seg(L, MTC_SEG_SPLIT, idx[k], align, row_bytes);
                if (rc) return rc;
                open = 1;
            }
            mtc_seg *s = &L->p->segs[L->p->nsegs - 1];
            int64_t pos, new_bytes, new_rows;
            if (s->kind == MTC_SEG_UNIFORM) {
                pos = s->rows;
                new_rows = s->rows + 1;
                new_bytes = pos * s->row_bytes + l->nbytes;
            } else {
                pos = _round_up(s->rows, m);
                int64_t nrows = proto->ndim ? L->shape[l->dims] : 1;
                new_rows = pos + nrows;
                new_bytes = new_rows * row_bytes;
            }
            if (s->offset + new_bytes <= _max_chunk(o) || (s->count == 0 && s->offset == 0)) {
                s->rows = new_rows;
                s->bytes = new_bytes;
                s->count++;
                L->p->members[L->p->nmembers++] = idx[k];
                l->seg = (int32_t)(L->p->nsegs - 1);
                l->slot = pos;
                if (single) {
                    _close_seg(L);
                    open = 0;
                }
                break;
            }
            /* Does not fit: close this segment (dropping it if empty) and
             * continue in a fresh chunk. */
            if (s->count == 0) L->p->nsegs--;
            else _close_seg(L);
            open = 0;
            if ((rc = _new_chunk(L))) return rc;
            if (attempt > 1) return -EINVAL; /* cannot happen: a member fits an empty chunk */
        }
    }
    if (open) _close_seg(L);
    return 0;
}

int mtc_plan_build(mtc_plan *p, mtc_leaf *leaves, uint32_t n, const int64_t *shape,
                   const mtc_plan_opts *o)
{
    memset(p, 0, sizeof *p);
    if (o->align <= 0 || o->max_chunk <= 0 || o->pack_limit < 0) return -EINVAL;
    uint32_t npack = 0;
    for (uint32_t i = 0; i < n; i++) {
        mtc_leaf *l = &leaves[i];
        if (l->elsize == 0 || l->nbytes < 0 || l->ndim < 0 || l->ndim > MTC_MAX_NDIM) return -EINVAL;
        l->action = _action(l, o, &l->needs_contig);
        l->seg = -1;
        l->slot = 0;
        p->count[l->action]++;
        p->need_contig += l->needs_contig;
        if (l->action == MTC_ACT_PACK) {
            npack++;
            /* saturated: expanded views can sum past int64 */
            if (__builtin_add_overflow(p->packed_bytes, l->nbytes, &p->packed_bytes))
                p->packed_bytes = INT64_MAX;
        }
    }
    if (!npack) return 0;

    int rc = -ENOMEM;
    /* Hash groups; the table is twice the packed count, rounded to a power of two. */
    uint32_t hcap = 16;
    while (hcap < 2 * npack) hcap <<= 1;
    int32_t *table = malloc(hcap * sizeof *table);
    _group *groups = malloc(npack * sizeof *groups);
    uint32_t *gof = malloc(npack * sizeof *gof);        /* group of each packed leaf, in order */
    uint32_t *order = malloc(npack * sizeof *order);    /* packed leaf indices, by group */
    p->members = malloc(npack * sizeof *p->members);
    uint64_t *sortkey = malloc(npack * sizeof *sortkey); /* groups in placement order */
    if (!table || !groups || !gof || !order || !p->members || !sortkey) goto out;
    memset(table, 0xff, hcap * sizeof *table);

    uint32_t ngroups = 0, k = 0;
    for (uint32_t i = 0; i < n; i++) {
        mtc_leaf *l = &leaves[i];
        if (l->action != MTC_ACT_PACK) continue;
        uint32_t h = (uint32_t)(_key_hash(l, shape) >> 32) & (hcap - 1);
        while (table[h] >= 0 && !_key_eq(&leaves[groups[table[h]].proto], l, shape))
            h = (h + 1) & (hcap - 1);
        if (table[h] < 0) {
            table[h] = (int32_t)ngroups;
            groups[ngroups] = (_group){.proto = i, .count = 0, .fill = 0, .uniform = 1};
            ngroups++;
        }
        _group *g = &groups[table[h]];
        g->count++;
        const mtc_leaf *pr = &leaves[g->proto];
        if (l->ndim > 0 && shape[l->dims] != shape[pr->dims]) g->uniform = 0;
        gof[k++] = (uint32_t)table[h];
    }
    uint32_t start = 0;
    for (uint32_t g = 0; g < ngroups; g++) {
        groups[g].start = start;
        start += groups[g].count;
    }
    k = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (leaves[i].action != MTC_ACT_PACK) continue;
        _group *g = &groups[gof[k++]];
        order[g->start + g->fill++] = i;
    }

    /* Groups by dtype (in order of first appearance within one), so that a
     * chunk's bytes of one dtype are one span: the binding layer gives each
     * span a storage of its own (torch.save refuses a storage viewed as two
     * dtypes). The key sorts host-placed groups after all the others: their
     * bytes end the chunk. */
    for (uint32_t g = 0; g < ngroups; g++) {
        const mtc_leaf *pr = &leaves[groups[g].proto];
        sortkey[g] = ((uint64_t)((pr->flags & MTC_LEAF_HOST) != 0) << 48) | ((uint64_t)pr->dtype << 32) | g;
    }
    qsort(sortkey, ngroups, sizeof *sortkey, _u64_cmp);
    _layout L = {.p = p, .leaves = leaves, .shape = shape, .o = o};
    if ((rc = _new_chunk(&L))) goto out;
    for (uint32_t k2 = 0; k2 < ngroups; k2++) {
        const _group *g = &groups[(uint32_t)sortkey[k2]];
        if ((rc = _place_group(&L, &order[g->start], g->count, g->uniform))) goto out;
    }
    rc = 0;
out:
    free(table);
    free(groups);
    free(gof);
    free(order);
    free(sortkey);
    if (rc) mtc_plan_free(p);
    return rc;
}

void mtc_plan_free(mtc_plan *p)
{
    free(p->segs);
    free(p->members);
    free(p->chunks);
    memset(p, 0, sizeof *p);
}

int64_t mtc_plan_leaf_offset(const mtc_plan *p, const mtc_leaf *l)
{
    const mtc_seg *s = &p->segs[l->seg];
    return s->offset + l->slot * s->row_bytes;
}

typedef struct _span { int64_t start, end; } _span;

static int _span_cmp(const void *a, const void *b)
{
    const _span *x = a, *y = b;
    return x->start < y->start ? -1 : x->start > y->start;
}

int mtc_plan_valid(const mtc_plan *p, const mtc_leaf *leaves, uint32_t n, const int64_t *shape,
                   const mtc_plan_opts *o)
{
    uint32_t packed = 0;
    for (uint32_t i = 0; i < n; i++) {
        const mtc_leaf *l = &leaves[i];
        uint8_t nc;
        if (l->action != _action(l, o, &nc) || nc != l->needs_contig) return 0;
        if (l->action != MTC_ACT_PACK) {
            if (l->seg != -1) return 0;
            continue;
        }
        packed++;
        if (l->seg < 0 || (uint32_t)l->seg >= p->nsegs) return 0;
        const mtc_seg *s = &p->segs[l->seg];
        const mtc_leaf *pr = &leaves[s->proto];
        if (pr->dtype != l->dtype || pr->ndim != l->ndim) return 0;
        if ((l->flags & MTC_LEAF_STRIDED) && (s->kind != MTC_SEG_UNIFORM || s->count != 1)) return 0;
        if ((l->flags ^ pr->flags) & MTC_LEAF_HOST) return 0;
        if (s->kind == MTC_SEG_UNIFORM && s->count > 1)
            for (int32_t d = 0; d < l->ndim; d++)
                if (shape[l->dims + d] != shape[pr->dims + d]) return 0;
        int64_t off = mtc_plan_leaf_offset(p, l);
        int64_t a = mtc_plan_leaf_align(o, l->elsize);
        const mtc_chunk *c = &p->chunks[s->chunk];
        if (off % a || c->align % a) return 0;
        if (off < s->offset || off + l->nbytes > s->offset + s->bytes) return 0;
        if (off + l->nbytes > c->payload) return 0;
        if (c->payload > _max_chunk(o) && !(s->count == 1 && s->offset == 0)) return 0;
    }
    if (packed != p->nmembers) return 0;
    /* no two packed leaves of one chunk overlap */
    for (uint32_t c = 0; c < p->nchunks; c++) {
        _span *sp = malloc((packed ? packed : 1) * sizeof *sp);
        if (!sp) return 0;
        uint32_t m = 0;
        for (uint32_t j = 0; j < p->nmembers; j++) {
            const mtc_leaf *l = &leaves[p->members[j]];
            if (p->segs[l->seg].chunk != (int32_t)c || l->nbytes == 0) continue;
            int64_t off = mtc_plan_leaf_offset(p, l);
            sp[m++] = (_span){off, off + l->nbytes};
        }
        qsort(sp, m, sizeof *sp, _span_cmp);
        for (uint32_t j = 1; j < m; j++)
            if (sp[j].start < sp[j - 1].end) {
                free(sp);
                return 0;
            }
        free(sp);
    }
    /* segments list their members in order; in a chunk, host-placed segments
     * come after all the others (segments are laid out chunk by chunk, each
     * after the last) */
    int host_seen = 0;
    for (uint32_t si = 0; si < p->nsegs; si++) {
        const mtc_seg *s = &p->segs[si];
        if (s->first + s->count > p->nmembers || s->count == 0) return 0;
        int host = (leaves[p->members[s->first]].flags & MTC_LEAF_HOST) != 0;
        if (si && s->chunk != p->segs[si - 1].chunk) host_seen = 0;
        if (host_seen && !host) return 0;
        host_seen |= host;
        int64_t prev = -1;
        for (uint32_t j = s->first; j < s->first + s->count; j++) {
            const mtc_leaf *l = &leaves[p->members[j]];
            if (l->seg != (int32_t)si || l->slot < prev) return 0;
            prev = l->slot;
        }
    }
    return 1;
}
