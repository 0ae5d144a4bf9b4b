/*
 * fuzz_layout.c - fuzzes mtc_layout_decode(), the decoder of what a DataLoader
 * worker sends the main process (csrc/engine/layout.h), and the planner -> encoder ->
 * decoder round trip.
 *
 * Input: byte 0 selects the mode.
 *
 *   decode (bit 7 clear): bytes 1..4 are a u32 `r`, the rest is the layout.
 *     The region size handed to the decoder is, by bits 0..1 of byte 0:
 *       0  payload field + 4096 (what module.c's unpack does)
 *       1  r
 *       2  payload field + (r & 0xfff)
 *       3  UINT64_MAX - r
 *     When it decodes, every invariant the view creation (module.c:
 *     _make_views / _segment_views) relies on is checked, and every byte of
 *     every leaf is written in a heap buffer of exactly `payload` bytes, so
 *     ASan reports a range outside the region.
 *
 *   round trip (bit 7 set): the rest generates contiguous CPU leaves (shapes
 *     torch can make, every dtype) and a power-of-two alignment; they are
 *     planned as engine_pack does (one chunk: target 0, pack_limit and
 *     max_chunk huge), encoded, decoded, and the decoded layout must equal the
 *     plan and pass the same checks.
 *     With bit 6 also set (perturbed round trip), 1 to 4 fields of the encoded
 *     layout are then changed (a count, dim, offset, size, slot... set to a
 *     neighbour of its value, 0, -1, a limit, a value of another field, or
 *     fuzz bytes): the decoder sees layouts one step from valid ones, where
 *     its checks matter most; whatever it accepts must pass the checks.
 */
#include <errno.h>

#include "fuzz.h"
#include "layout.h"

#define TOUCH_MAX ((int64_t)4 << 20) /* payloads up to this are touched byte by byte */

/*
 * The checks. `min_align` > 0: every member's offset must also be a multiple
 * of round_up(max(min_align, elsize), elsize) (the planner's promise; unknown to
 * the decoder).
 */
static void check_layout(const mtc_layout *L, uint64_t region, int64_t min_align)
{
    const mtc_plan *p = &L->plan;
    uint32_t n = L->nleaves;
    FZ_CHECK(p->count[MTC_ACT_PACK] == n);
    if (n == 0) {
        FZ_CHECK(p->nsegs == 0 && p->nmembers == 0, "nsegs %u nmembers %u", p->nsegs, p->nmembers);
        return;
    }
    FZ_CHECK(p->nchunks == 1, "nchunks %u", p->nchunks);
    const int64_t payload = p->chunks[0].payload, align = p->chunks[0].align;
    FZ_CHECK(payload >= 0 && align >= 1 && align <= MTC_LAYOUT_MAX_ALIGN && !(align & (align - 1)),
             "payload %lld align %lld", (long long)payload, (long long)align);
    /* the main process allocates payload + align - 1 bytes and skips to an aligned base */
    FZ_CHECK((uint64_t)payload + (uint64_t)align - 1 <= region, "payload %lld align %lld region %llu",
             (long long)payload, (long long)align, (unsigned long long)region);
    FZ_CHECK(p->nmembers == n, "%u members for %u leaves", p->nmembers, n);

    /* leaves: shape inside the shape table, nbytes = numel * elsize */
    for (uint32_t i = 0; i < n; i++) {
        const mtc_leaf *l = &L->leaves[i];
        FZ_CHECK(l->dtype < FZ_NDTYPES && l->elsize == fz_elsize[l->dtype], "leaf %u dtype %u", i, l->dtype);
        FZ_CHECK(l->ndim >= 0 && l->ndim <= MTC_MAX_NDIM && (uint64_t)l->dims + (uint64_t)l->ndim <= L->ndims,
                 "leaf %u ndim %d dims %u of %u", i, l->ndim, l->dims, L->ndims);
        FZ_CHECK(l->action == MTC_ACT_PACK && l->dev == MTC_DEV_CPU);
        int64_t numel = 1, nbytes;
        for (int32_t d = 0; d < l->ndim; d++) {
            int64_t v = L->shape[l->dims + d];
            FZ_CHECK(v >= 0, "leaf %u dim %d = %lld", i, d, (long long)v);
            FZ_CHECK(!__builtin_mul_overflow(numel, v, &numel), "leaf %u numel overflows", i);
        }
        FZ_CHECK(!__builtin_mul_overflow(numel, (int64_t)l->elsize, &nbytes) && nbytes == l->nbytes,
                 "leaf %u nbytes %lld", i, (long long)l->nbytes);
        FZ_CHECK(l->seg >= 0 && (uint32_t)l->seg < p->nsegs, "leaf %u seg %d of %u", i, l->seg, p->nsegs);
    }

    uint8_t *seen = calloc(n, 1);
    span *spans = malloc(n * sizeof *spans);
    FZ_CHECK(seen && spans);
    uint32_t nspans = 0, next_member = 0;
    int64_t prev_end = 0;
    for (uint32_t g = 0; g < p->nsegs; g++) {
        const mtc_seg *s = &p->segs[g];
        FZ_CHECK(s->chunk == 0 && (s->kind == MTC_SEG_SPLIT || s->kind == MTC_SEG_UNIFORM), "seg %u", g);
        FZ_CHECK(s->count >= 1 && s->first == next_member && s->count <= n - next_member,
                 "seg %u first %u count %u", g, s->first, s->count);
        next_member += s->count;
        /* inside the payload, in increasing offsets, not overlapping */
        FZ_CHECK(s->offset >= prev_end && s->bytes >= 0 && s->offset <= payload && s->bytes <= payload - s->offset,
                 "seg %u [%lld, +%lld) payload %lld prev_end %lld", g, (long long)s->offset,
                 (long long)s->bytes, (long long)payload, (long long)prev_end);
        prev_end = s->offset + s->bytes;
        FZ_CHECK(s->proto < n, "seg %u proto %u", g, s->proto);
        const mtc_leaf *pr = &L->leaves[s->proto];
        FZ_CHECK(pr->seg == (int32_t)g, "seg %u proto %u is in seg %d", g, s->proto, pr->seg);
        const int64_t es = pr->elsize;
        /* region[off:off+bytes].view(dtype): the segment's start in the (aligned)
         * chunk and its length are whole elements */
        FZ_CHECK(align % es == 0 && s->offset % es == 0 && s->bytes % es == 0,
                 "seg %u offset %lld bytes %lld elsize %lld align %lld", g, (long long)s->offset,
                 (long long)s->bytes, (long long)es, (long long)align);
        FZ_CHECK(s->rows >= 0 && s->row_bytes >= 0);
        if (s->kind == MTC_SEG_SPLIT) {
            /* typed.view(rows, *trailing): rows * row_bytes == bytes, row_bytes the row of the proto */
            FZ_CHECK(pr->ndim >= 1, "SPLIT seg %u of a 0-d leaf", g);
            int64_t rb = es, span_bytes;
            for (int32_t d = 1; d < pr->ndim; d++)
                FZ_CHECK(!__builtin_mul_overflow(rb, L->shape[pr->dims + d], &rb));
            FZ_CHECK(rb == s->row_bytes && !__builtin_mul_overflow(s->rows, s->row_bytes, &span_bytes) &&
                         span_bytes == s->bytes,
                     "SPLIT seg %u rows %lld row_bytes %lld (proto %lld) bytes %lld", g, (long long)s->rows,
                     (long long)s->row_bytes, (long long)rb, (long long)s->bytes);
        } else {
            /* as_strided((count, *shape), (row_bytes / elsize, ...)) on the typed segment;
             * a single member: typed.view(shape), so the segment is exactly the member */
            FZ_CHECK(s->row_bytes % es == 0, "UNIFORM seg %u row_bytes %lld elsize %lld", g,
                     (long long)s->row_bytes, (long long)es);
            int64_t extent;
            FZ_CHECK(!__builtin_mul_overflow((int64_t)s->count - 1, s->row_bytes, &extent) &&
                         !__builtin_add_overflow(extent, pr->nbytes, &extent) && extent <= s->bytes,
                     "UNIFORM seg %u: %u x %lld bytes at stride %lld exceed %lld", g, s->count,
                     (long long)pr->nbytes, (long long)s->row_bytes, (long long)s->bytes);
            if (s->count == 1)
                FZ_CHECK(s->bytes == pr->nbytes,
                         "UNIFORM seg %u of one member: %lld bytes, member %lld (view(shape) raises)", g,
                         (long long)s->bytes, (long long)pr->nbytes);
        }
        int64_t cursor = 0;
        for (uint32_t k = 0; k < s->count; k++) {
            uint32_t li = p->members[s->first + k];
            FZ_CHECK(li < n, "member %u", li);
            const mtc_leaf *l = &L->leaves[li];
            FZ_CHECK(!seen[li], "leaf %u in two segments", li);
            seen[li] = 1;
            FZ_CHECK(l->seg == (int32_t)g, "leaf %u listed in seg %u, says %d", li, g, l->seg);
            FZ_CHECK(l->dtype == pr->dtype && l->ndim == pr->ndim, "leaf %u dtype/ndim differ from proto", li);
            for (int32_t d = s->kind == MTC_SEG_SPLIT ? 1 : 0; d < l->ndim; d++)
                FZ_CHECK(L->shape[l->dims + d] == L->shape[pr->dims + d], "leaf %u dim %d differs from proto", li, d);
            int64_t off;
            FZ_CHECK(l->slot >= 0, "leaf %u slot %lld", li, (long long)l->slot);
            if (s->kind == MTC_SEG_UNIFORM) {
                FZ_CHECK(l->slot == (int64_t)k, "UNIFORM seg %u member %u slot %lld", g, k, (long long)l->slot);
            } else {
                /* split_with_sizes: members in row order, padding rows between them */
                FZ_CHECK(l->slot >= cursor, "SPLIT seg %u member %u slot %lld < %lld", g, k, (long long)l->slot,
                         (long long)cursor);
                FZ_CHECK(!__builtin_add_overflow(l->slot, L->shape[l->dims], &cursor) && cursor <= s->rows,
                         "SPLIT seg %u member %u rows past %lld", g, k, (long long)s->rows);
            }
            FZ_CHECK(!__builtin_mul_overflow(l->slot, s->row_bytes, &off));
            FZ_CHECK(off <= s->bytes && l->nbytes <= s->bytes - off, "leaf %u [%lld, +%lld) outside seg %u (%lld)",
                     li, (long long)off, (long long)l->nbytes, g, (long long)s->bytes);
            int64_t start = s->offset + off;
            FZ_CHECK(start % l->elsize == 0, "leaf %u at %lld, elsize %d", li, (long long)start, l->elsize);
            if (min_align > 0) {
                int64_t a = fz_ref_align(min_align, l->elsize);
                FZ_CHECK(a && start % a == 0, "leaf %u at %lld not aligned to the alignment of (%lld, %d)", li, (long long)start,
                         (long long)min_align, l->elsize);
            }
            FZ_CHECK(start >= 0 && start <= payload && l->nbytes <= payload - start);
            if (l->nbytes) spans[nspans++] = (span){start, start + l->nbytes, li};
        }
    }
    FZ_CHECK(next_member == n, "segments list %u members of %u", next_member, n);
    for (uint32_t i = 0; i < n; i++) FZ_CHECK(seen[i], "leaf %u in no segment", i);
    /* no two leaves share a byte (independently of the segment logic) */
    qsort(spans, nspans, sizeof *spans, span_cmp);
    for (uint32_t j = 1; j < nspans; j++)
        FZ_CHECK(spans[j].start >= spans[j - 1].end, "leaves %u and %u overlap", spans[j - 1].leaf, spans[j].leaf);
    /* touch every byte of every leaf in a buffer of exactly `payload` bytes */
    if (payload <= TOUCH_MAX) {
        uint8_t *buf = malloc(payload ? (size_t)payload : 1);
        FZ_CHECK(buf);
        for (uint32_t j = 0; j < nspans; j++)
            memset(buf + spans[j].start, (int)spans[j].leaf, (size_t)(spans[j].end - spans[j].start));
        free(buf);
    }
    free(seen);
    free(spans);
}

static void decode_mode(uint8_t mode, const uint8_t *data, size_t size)
{
    fz f = {data, data + size};
    uint32_t r = fz_u32(&f);
    const uint8_t *buf = f.p;
    size_t len = fz_left(&f);
    uint64_t field = 0;
    for (int i = 0; i < 8 && 16 + (size_t)i < len; i++) field |= (uint64_t)buf[16 + i] << (8 * i);
    uint64_t region;
    switch (mode & 3) {
    case 0: region = field > UINT64_MAX - 4096 ? UINT64_MAX : field + 4096; break;
    case 1: region = r; break;
    case 2: region = field > UINT64_MAX - 4096 ? UINT64_MAX : field + (r & 0xfff); break;
    default: region = UINT64_MAX - r; break;
    }
    /* an exact-size copy, so that ASan sees any read past the end */
    uint8_t *copy = malloc(len ? len : 1);
    FZ_CHECK(copy);
    memcpy(copy, buf, len);
    mtc_layout L;
    int rc = mtc_layout_decode(copy, len, fz_elsize, FZ_NDTYPES, region, &L);
    FZ_CHECK(rc == 0 || rc == -EINVAL || rc == -ENOMEM, "rc %d", rc);
    fz_stat(0, "decode: inputs");
    if (rc == 0) {
        if (L.nleaves) fz_stat(2, "decode: accepted (leaves)");
        else fz_stat(3, "decode: accepted (empty)");
        check_layout(&L, region, 0);
        mtc_layout_free(&L);
    } else {
        /* on error the layout is left empty */
        FZ_CHECK(!L.leaves && !L.shape && !L.plan.segs && L.nleaves == 0);
    }
    free(copy);
}

/* the (offset, width) of every field of an encoded layout (a valid one: lengths are trusted) */
typedef struct field {
    uint32_t off;
    uint8_t width;
} field;

static uint64_t get_le(const uint8_t *p, int w)
{
    uint64_t v = 0;
    for (int i = 0; i < w; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

static void put_le(uint8_t *p, uint64_t v, int w)
{
    for (int i = 0; i < w; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t layout_fields(const uint8_t *buf, size_t len, field *out, uint32_t cap)
{
    uint32_t nf = 0;
    size_t at = 0;
#define FIELD(w)                                                \
    do {                                                        \
        if (at + (w) > len) return nf;                          \
        if (nf < cap) out[nf++] = (field){(uint32_t)at, (w)};   \
        at += (w);                                              \
    } while (0)
    FIELD(4); FIELD(2); FIELD(2);
    uint32_t n = (uint32_t)get_le(buf + at, 4);
    FIELD(4);
    uint32_t nsegs = (uint32_t)get_le(buf + at, 4);
    FIELD(4); FIELD(8); FIELD(8);
    for (uint32_t i = 0; i < n; i++) {
        FIELD(2);
        uint32_t nd = (uint32_t)get_le(buf + at, 2);
        FIELD(2);
        for (uint32_t d = 0; d < nd; d++) FIELD(8);
    }
    for (uint32_t g = 0; g < nsegs; g++) {
        FIELD(1);
        at += 3;
        uint32_t count = (uint32_t)get_le(buf + at, 4);
        FIELD(4); FIELD(8); FIELD(8); FIELD(8); FIELD(8);
        for (uint32_t k = 0; k < count; k++) {
            FIELD(4);
            FIELD(8);
        }
    }
#undef FIELD
    return nf;
}

static void perturb(uint8_t *buf, size_t len, fz *f)
{
    enum { CAP = 4096 };
    static field fields[CAP];
    uint32_t nf = layout_fields(buf, len, fields, CAP);
    if (!nf) return;
    static const int64_t special[] = {0, 1, 2, 3, 4, 8, 16, 4096, 4097, INT32_MAX, (int64_t)1 << 32,
                                      INT64_MAX, INT64_MIN, INT64_MAX / 2, (int64_t)1 << 62, -1, -2};
    int k = 1 + (int)fz_below(f, 4);
    for (int j = 0; j < k; j++) {
        const field *fl = &fields[fz_below(f, nf)];
        uint8_t *p = buf + fl->off;
        int w = fl->width;
        uint64_t v = get_le(p, w);
        switch (fz_u8(f) % 7) {
        case 0: case 1: v += (uint64_t)(int64_t)(int8_t)fz_u8(f); break; /* a neighbour */
        case 2: v = 0; break;
        case 3: v = ~0ull; break;
        case 4: v = (uint64_t)special[fz_below(f, sizeof special / sizeof *special)]; break;
        case 5: { /* the value of another field */
            const field *o = &fields[fz_below(f, nf)];
            v = get_le(buf + o->off, o->width);
            break;
        }
        default: v = fz_bytes(f, w); break;
        }
        put_le(p, v, w);
    }
}

#define RT_MAX_LEAVES 48
#define RT_MAX_NDIM 6

static void roundtrip_mode(const uint8_t *data, size_t size, int perturbed)
{
    fz f = {data, data + size};
    mtc_plan_opts o;
    mtc_plan_default_opts(&o, 0); /* exactly engine_pack's options */
    o.align = (int64_t)1 << fz_below(&f, 13);
    o.max_chunk = o.pack_limit = INT64_MAX / 4;
    uint32_t n = (uint32_t)fz_below(&f, RT_MAX_LEAVES + 1);
    mtc_leaf leaves[RT_MAX_LEAVES];
    int64_t shape[RT_MAX_LEAVES * RT_MAX_NDIM];
    memset(leaves, 0, sizeof leaves);
    uint32_t nd = 0;
    for (uint32_t i = 0; i < n; i++) {
        mtc_leaf *l = &leaves[i];
        /* a few distinct (dtype, trailing shape) groups are the interesting case:
         * with some probability repeat an earlier leaf's dtype and shape */
        uint8_t how = fz_u8(&f);
        if (i && (how & 3) == 0) {
            *l = leaves[fz_below(&f, i)];
            memcpy(&shape[nd], &shape[l->dims], (size_t)l->ndim * sizeof *shape);
            if (l->ndim && (how & 4)) { /* same trailing dims, other rows (if torch can make it) */
                int64_t rows = (int64_t)fz_below(&f, 9), numel = rows, nb;
                for (int32_t d = 1; d < l->ndim && numel >= 0; d++)
                    if (__builtin_mul_overflow(numel, shape[nd + d], &numel)) numel = -1;
                if (numel >= 0 && !__builtin_mul_overflow(numel, (int64_t)l->elsize, &nb) && nb <= (1 << 16))
                    shape[nd] = rows;
            }
        } else {
            l->dtype = (uint16_t)fz_below(&f, FZ_NDTYPES);
            l->elsize = (uint16_t)fz_elsize[l->dtype];
            l->ndim = (int32_t)fz_below(&f, RT_MAX_NDIM + 1);
            fz_gen_shape(&f, l->ndim, l->elsize, (int64_t)1 << 16, &shape[nd]);
        }
        int64_t numel = 1;
        for (int32_t d = 0; d < l->ndim; d++) numel *= shape[nd + d]; /* legal: checked by fz_gen_shape */
        l->nbytes = numel * l->elsize;
        l->dims = nd;
        l->dev = MTC_DEV_CPU;
        l->flags = MTC_LEAF_CONTIGUOUS | ((how & 8) ? MTC_LEAF_NUMPY : 0);
        l->data = 0x1000 * (i + 1);
        nd += (uint32_t)l->ndim;
    }
    fz_dump_leaves("fuzz_layout", leaves, n, shape, &o);
    mtc_plan plan;
    int rc = mtc_plan_build(&plan, leaves, n, shape, &o);
    FZ_CHECK(rc == 0, "mtc_plan_build: %d for a batch torch can make (align %lld)", rc, (long long)o.align);
    FZ_CHECK(mtc_plan_valid(&plan, leaves, n, shape, &o) == 1, "mtc_plan_valid rejects the plan");
    FZ_CHECK(plan.count[MTC_ACT_PACK] == n && (n == 0 || plan.nchunks == 1), "packed %u of %u in %u chunks",
             plan.count[MTC_ACT_PACK], n, plan.nchunks);
    size_t len = mtc_layout_size(leaves, n, &plan);
    uint8_t *buf = malloc(len);
    FZ_CHECK(buf);
    rc = mtc_layout_encode(leaves, n, shape, NULL, &plan, buf, len);
    FZ_CHECK(rc == 0, "mtc_layout_encode: %d", rc);
    FZ_CHECK(mtc_layout_encode(leaves, n, shape, NULL, &plan, buf, len - 1) == -ENOSPC, "encode into a short buffer");
    int64_t payload = n ? plan.chunks[0].payload : 0;
    uint64_t region = (uint64_t)payload + MTC_LAYOUT_MAX_ALIGN; /* module.c's unpack */
    mtc_layout L;
    if (perturbed) {
        perturb(buf, len, &f);
        /* the region a main process would pass: the (perturbed) payload field + 4096 */
        uint64_t field_payload = get_le(buf + 16, 8);
        region = field_payload > UINT64_MAX - MTC_LAYOUT_MAX_ALIGN ? UINT64_MAX
                                                                   : field_payload + MTC_LAYOUT_MAX_ALIGN;
        rc = mtc_layout_decode(buf, len, fz_elsize, FZ_NDTYPES, region, &L);
        FZ_CHECK(rc == 0 || rc == -EINVAL || rc == -ENOMEM, "rc %d", rc);
        fz_stat(6, "perturbed: inputs");
        if (rc == 0) {
            fz_stat(7, "perturbed: accepted");
            check_layout(&L, region, 0);
            mtc_layout_free(&L);
        }
        free(buf);
        mtc_plan_free(&plan);
        return;
    }
    rc = mtc_layout_decode(buf, len, fz_elsize, FZ_NDTYPES, region, &L);
    FZ_CHECK(rc == 0, "the decoder rejects a layout the planner made (%d): n %u align %lld", rc, n,
             (long long)o.align);
    FZ_CHECK(L.nleaves == n && L.ndims == nd);
    FZ_CHECK((n ? L.plan.chunks[0].payload : 0) == payload && L.plan.nsegs == plan.nsegs &&
             L.plan.nmembers == plan.nmembers);
    if (n) FZ_CHECK(L.plan.chunks[0].align == plan.chunks[0].align);
    for (uint32_t i = 0; i < n; i++) {
        const mtc_leaf *a = &leaves[i], *b = &L.leaves[i];
        FZ_CHECK(a->dtype == b->dtype && a->elsize == b->elsize && a->ndim == b->ndim && a->nbytes == b->nbytes &&
                     a->seg == b->seg && a->slot == b->slot,
                 "leaf %u differs after the round trip", i);
        FZ_CHECK(!memcmp(&shape[a->dims], &L.shape[b->dims], (size_t)a->ndim * sizeof *shape), "leaf %u shape", i);
    }
    for (uint32_t g = 0; g < plan.nsegs; g++) {
        const mtc_seg *a = &plan.segs[g], *b = &L.plan.segs[g];
        FZ_CHECK(a->kind == b->kind && a->offset == b->offset && a->bytes == b->bytes && a->rows == b->rows &&
                     a->row_bytes == b->row_bytes && a->first == b->first && a->count == b->count &&
                     a->proto == b->proto,
                 "segment %u differs after the round trip", g);
    }
    if (plan.nmembers) FZ_CHECK(!memcmp(plan.members, L.plan.members, plan.nmembers * sizeof *plan.members));
    fz_stat(4, "roundtrip: done");
    if (n) fz_stat(5, "roundtrip: with leaves");
    check_layout(&L, region, o.align);
    mtc_layout_free(&L);
    free(buf);
    mtc_plan_free(&plan);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    if (data[0] & 0x80) roundtrip_mode(data + 1, size - 1, (data[0] & 0x40) != 0);
    else decode_mode(data[0], data + 1, size - 1);
    return 0;
}
