/*
 * fuzz_plan.c - fuzzes the planner (csrc/engine/plan.h): input bytes -> options and
 * leaves (any device, dtype, shape torch can make, contiguity, numpy) ->
 * mtc_plan_build(), whose result must pass mtc_plan_valid() and, checked here
 * independently of plan.c, everything the copy and the output views rely on:
 * actions by the rules of start_copy's docstring, every packed leaf exactly
 * once in one segment, inside its chunk, aligned to round_up(max(align, elsize), elsize), no
 * two packed leaves overlapping, chunks within max_packed_chunk_bytes,
 * segments that view creation can express. Every packed leaf's bytes are
 * then written in a heap buffer of exactly the chunk's payload (ASan).
 *
 * Input layout (all fields read with fz_*, missing bytes are zeros):
 *   options: target, pack/staging bits, align, max_chunk, pack_limit, max_pad
 *   n, then per leaf: device, dtype or raw element size, flags, ndim, dims
 */
#include <errno.h>

#include "fuzz.h"
#include "../c/plan_rules.h"

#define MAX_LEAVES 96
#define MAX_ND 8
#define TOUCH_MAX ((int64_t)4 << 20)

static const int64_t ALIGNS[] = {1, 2, 4, 8, 16, 32, 64, 128, 4096};
static const int64_t CHUNKS[] = {1, 7, 64, 4096, 65536, (int64_t)1 << 25};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fz f = {data, data + size};
    mtc_plan_opts o;
    mtc_plan_default_opts(&o, 0);
    uint8_t b = fz_u8(&f);
    o.target = (b & 3) == 0 ? MTC_DEV_CPU : (b & 3) - 1; /* cpu, cuda:0, cuda:1, cuda:2 */
    o.pack = !(b & 4);
    o.staging = !(b & 8);
    uint8_t a = fz_u8(&f);
    if (a < 200) o.align = ALIGNS[a % 9];
    else if (a < 250) o.align = 1 + fz_below(&f, 300);              /* any positive int is accepted */
    else o.align = (int64_t)1 << (20 + fz_below(&f, 40));           /* lcm past 2^40: -EOVERFLOW */
    uint8_t c = fz_u8(&f);
    if (c < 200) o.max_chunk = CHUNKS[c % 6];
    else o.max_chunk = 1 + (int64_t)fz_u32(&f);
    uint8_t pl = fz_u8(&f);
    if (pl >= 224) o.pack_limit = (int64_t)fz_u32(&f);
    uint8_t mp = fz_u8(&f);
    if (mp >= 224) o.max_pad = (int64_t)fz_u16(&f);

    uint32_t n = (uint32_t)fz_below(&f, MAX_LEAVES + 1);
    mtc_leaf leaves[MAX_LEAVES];
    int64_t shape[MAX_LEAVES * MAX_ND];
    memset(leaves, 0, sizeof leaves);
    uint32_t nd = 0;
    int64_t all_align = 1; /* lcm of every leaf's alignment: a chunk's alignment divides it */
    for (uint32_t i = 0; i < n; i++) {
        mtc_leaf *l = &leaves[i];
        uint8_t h = fz_u8(&f);
        if (i && (h & 7) == 0) { /* same dtype and trailing dims as an earlier leaf: one group */
            const mtc_leaf *src = &leaves[fz_below(&f, i)];
            l->dtype = src->dtype;
            l->elsize = src->elsize;
            l->ndim = src->ndim;
            memcpy(&shape[nd], &shape[src->dims], (size_t)src->ndim * sizeof *shape);
            if (l->ndim && (h & 8)) {
                int64_t rows = (int64_t)fz_below(&f, 17), numel = rows, nb;
                for (int32_t d = 1; d < l->ndim && numel >= 0; d++)
                    if (__builtin_mul_overflow(numel, shape[nd + d], &numel)) numel = -1;
                if (numel >= 0 && !__builtin_mul_overflow(numel, (int64_t)l->elsize, &nb)) shape[nd] = rows;
            }
        } else {
            uint8_t t = fz_u8(&f);
            if (t < 240) {
                l->dtype = (uint16_t)(t % FZ_NDTYPES);
                l->elsize = (uint16_t)fz_elsize[l->dtype];
            } else { /* element sizes no dtype has: the planner takes any >= 1 */
                l->elsize = (uint16_t)(1 + fz_below(&f, 40));
                l->dtype = (uint16_t)(FZ_NDTYPES + l->elsize);
            }
            l->ndim = (int32_t)fz_below(&f, MAX_ND + 1);
            fz_gen_shape(&f, l->ndim, l->elsize, 0, &shape[nd]);
        }
        int64_t numel = 1;
        for (int32_t d = 0; d < l->ndim; d++) numel *= shape[nd + d];
        l->nbytes = numel * l->elsize; /* fits: fz_gen_shape / the check above */
        l->dims = nd;
        nd += (uint32_t)l->ndim;
        uint8_t dv = (h >> 4) & 3;
        l->dev = dv <= 1 ? MTC_DEV_CPU : dv - 2;
        l->flags = ((h & 0x40) ? 0 : MTC_LEAF_CONTIGUOUS);
        if (l->dev == MTC_DEV_CPU && (h & 0x80)) l->flags |= MTC_LEAF_NUMPY | ((h & 8) ? MTC_LEAF_ZEROCOPY : 0);
        l->data = (uintptr_t)0x10000 * (i + 1);
        l->action = 0xee; /* overwritten by the planner */
        l->seg = 12345;
        int64_t la = fz_ref_align(o.align, l->elsize);
        if (all_align) all_align = la ? fz_lcm(all_align, la) : 0; /* 0: past int64 */
    }

    fz_dump_leaves("fuzz_plan", leaves, n, shape, &o);
    mtc_plan p;
    int rc = mtc_plan_build(&p, leaves, n, shape, &o);
    fz_stat(0, "plans");
    if (rc) {
        fz_stat(1, "plan: -EOVERFLOW");
        /* valid options and leaves: only a chunk alignment past 2^40 may fail */
        FZ_CHECK(rc == -EOVERFLOW && (!all_align || all_align > ((int64_t)1 << 40)),
                 "mtc_plan_build: %d (align %lld, lcm of all alignments %lld)", rc, (long long)o.align,
                 (long long)all_align);
        FZ_CHECK(!p.segs && !p.members && !p.chunks && p.nsegs == 0, "failed plan not left empty");
        return 0;
    }
    FZ_CHECK(mtc_plan_valid(&p, leaves, n, shape, &o) == 1, "mtc_plan_valid rejects the plan");

    /* actions and counters */
    uint32_t count[MTC_ACT_COUNT] = {0}, need_contig = 0, npacked = 0;
    int64_t packed_bytes = 0;
    for (uint32_t i = 0; i < n; i++) {
        const mtc_leaf *l = &leaves[i];
        uint8_t nc;
        int want = expected_action(l, &o, &nc);
        FZ_CHECK(l->action == want, "leaf %u: action %d, expected %d", i, l->action, want);
        FZ_CHECK(l->needs_contig == nc, "leaf %u: needs_contig %d, expected %d", i, l->needs_contig, nc);
        count[l->action]++;
        need_contig += l->needs_contig;
        if (l->action == MTC_ACT_PACK) {
            npacked++;
            packed_bytes += l->nbytes;
            FZ_CHECK(l->seg >= 0 && (uint32_t)l->seg < p.nsegs, "packed leaf %u seg %d", i, l->seg);
        } else {
            FZ_CHECK(l->seg == -1, "leaf %u not packed, seg %d", i, l->seg);
        }
    }
    for (int k = 0; k < MTC_ACT_COUNT; k++)
        FZ_CHECK(count[k] == p.count[k], "count[%d] %u != %u", k, p.count[k], count[k]);
    FZ_CHECK(need_contig == p.need_contig && packed_bytes == p.packed_bytes && npacked == p.nmembers);
    FZ_CHECK(npacked == 0 || p.nchunks >= 1);
    if (npacked) fz_stat(2, "plan: with packed leaves");
    if (p.nchunks > 1) fz_stat(3, "plan: several chunks");
    for (uint32_t g = 0; g < p.nsegs; g++) {
        if (p.segs[g].kind == MTC_SEG_SPLIT && p.segs[g].count > 1) fz_stat(4, "plan: SPLIT segs of >1");
        if (p.segs[g].kind == MTC_SEG_UNIFORM && p.segs[g].count > 1) fz_stat(5, "plan: UNIFORM segs of >1");
    }

    /* chunks */
    for (uint32_t ci = 0; ci < p.nchunks; ci++) {
        const mtc_chunk *ch = &p.chunks[ci];
        FZ_CHECK(ch->payload >= 0 && ch->payload <= o.max_chunk, "chunk %u payload %lld > max_chunk %lld", ci,
                 (long long)ch->payload, (long long)o.max_chunk);
        FZ_CHECK(ch->align >= 1);
    }

    /* segments: in chunk order, partitioning the member list, inside their chunk, not
     * overlapping, expressible as views */
    uint8_t *seen = calloc(n ? n : 1, 1);
    span *spans = malloc((n ? n : 1) * sizeof *spans);
    FZ_CHECK(seen && spans);
    uint32_t nspans = 0, next_member = 0;
    int32_t prev_chunk = 0;
    int64_t prev_end = 0;
    for (uint32_t g = 0; g < p.nsegs; g++) {
        const mtc_seg *s = &p.segs[g];
        FZ_CHECK(s->chunk >= prev_chunk && (uint32_t)s->chunk < p.nchunks, "seg %u chunk %d", g, s->chunk);
        if (s->chunk != prev_chunk) prev_end = 0;
        prev_chunk = s->chunk;
        const mtc_chunk *ch = &p.chunks[s->chunk];
        FZ_CHECK(s->count >= 1 && s->first == next_member && s->count <= p.nmembers - next_member,
                 "seg %u first %u count %u", g, s->first, s->count);
        next_member += s->count;
        FZ_CHECK(s->offset >= prev_end && s->bytes >= 0 && s->offset <= ch->payload &&
                     s->bytes <= ch->payload - s->offset,
                 "seg %u [%lld, +%lld) in chunk %d of %lld after %lld", g, (long long)s->offset,
                 (long long)s->bytes, s->chunk, (long long)ch->payload, (long long)prev_end);
        prev_end = s->offset + s->bytes;
        FZ_CHECK(s->proto < n && leaves[s->proto].seg == (int32_t)g, "seg %u proto %u", g, s->proto);
        const mtc_leaf *pr = &leaves[s->proto];
        const int64_t es = pr->elsize;
        FZ_CHECK(s->offset % es == 0 && s->bytes % es == 0, "seg %u not whole elements", g);
        if (s->kind == MTC_SEG_SPLIT) {
            FZ_CHECK(pr->ndim >= 1, "SPLIT seg %u of a 0-d leaf", g);
            int64_t rb = es, span_bytes;
            for (int32_t d = 1; d < pr->ndim; d++)
                FZ_CHECK(!__builtin_mul_overflow(rb, shape[pr->dims + d], &rb), "seg %u row bytes overflow", g);
            FZ_CHECK(rb == s->row_bytes && !__builtin_mul_overflow(s->rows, s->row_bytes, &span_bytes) &&
                         span_bytes == s->bytes,
                     "SPLIT seg %u: rows %lld x row_bytes %lld (proto %lld) != bytes %lld", g, (long long)s->rows,
                     (long long)s->row_bytes, (long long)rb, (long long)s->bytes);
        } else {
            FZ_CHECK(s->kind == MTC_SEG_UNIFORM, "seg %u kind %d", g, s->kind);
            FZ_CHECK(s->row_bytes >= 0 && s->row_bytes % es == 0, "UNIFORM seg %u row_bytes %lld", g,
                     (long long)s->row_bytes);
            int64_t extent;
            FZ_CHECK(!__builtin_mul_overflow((int64_t)s->count - 1, s->row_bytes, &extent) &&
                         !__builtin_add_overflow(extent, pr->nbytes, &extent) && extent <= s->bytes,
                     "UNIFORM seg %u extent", g);
            if (s->count == 1)
                FZ_CHECK(s->bytes == pr->nbytes, "UNIFORM seg %u of one: bytes %lld", g, (long long)s->bytes);
        }
        int64_t cursor = 0;
        for (uint32_t k = 0; k < s->count; k++) {
            uint32_t li = p.members[s->first + k];
            FZ_CHECK(li < n && !seen[li], "member %u of seg %u", li, g);
            seen[li] = 1;
            const mtc_leaf *l = &leaves[li];
            FZ_CHECK(l->action == MTC_ACT_PACK && l->seg == (int32_t)g, "member %u of seg %u", li, g);
            FZ_CHECK(l->dtype == pr->dtype && l->elsize == pr->elsize && l->ndim == pr->ndim, "leaf %u vs proto", li);
            for (int32_t d = s->kind == MTC_SEG_SPLIT ? 1 : 0; d < l->ndim; d++)
                FZ_CHECK(shape[l->dims + d] == shape[pr->dims + d], "leaf %u dim %d vs proto", li, d);
            if (s->kind == MTC_SEG_UNIFORM) {
                FZ_CHECK(l->slot == (int64_t)k, "UNIFORM member %u slot %lld", k, (long long)l->slot);
            } else {
                FZ_CHECK(l->slot >= cursor, "SPLIT member %u slot %lld < %lld", k, (long long)l->slot,
                         (long long)cursor);
                FZ_CHECK(!__builtin_add_overflow(l->slot, shape[l->dims], &cursor) && cursor <= s->rows);
            }
            int64_t off;
            FZ_CHECK(!__builtin_mul_overflow(l->slot, s->row_bytes, &off) && off >= 0 && off <= s->bytes &&
                         l->nbytes <= s->bytes - off,
                     "leaf %u outside seg %u", li, g);
            int64_t start = s->offset + off;
            FZ_CHECK(start == mtc_plan_leaf_offset(&p, l));
            int64_t la = fz_ref_align(o.align, l->elsize);
            FZ_CHECK(la && start % la == 0 && ch->align % la == 0, "leaf %u at %lld, align %lld, chunk align %lld",
                     li, (long long)start, (long long)la, (long long)ch->align);
            if (l->nbytes) spans[nspans++] = (span){start, start + l->nbytes, li};
        }
    }
    FZ_CHECK(next_member == p.nmembers);
    for (uint32_t i = 0; i < n; i++) FZ_CHECK(seen[i] == (leaves[i].action == MTC_ACT_PACK), "leaf %u", i);

    /* per chunk: no overlap, and every byte of every member written in a buffer of
     * exactly the payload */
    for (uint32_t ci = 0; ci < p.nchunks; ci++) {
        uint32_t m = 0;
        span *cs = malloc((nspans ? nspans : 1) * sizeof *cs);
        FZ_CHECK(cs);
        for (uint32_t j = 0; j < nspans; j++)
            if (p.segs[leaves[spans[j].leaf].seg].chunk == (int32_t)ci) cs[m++] = spans[j];
        qsort(cs, m, sizeof *cs, span_cmp);
        for (uint32_t j = 1; j < m; j++)
            FZ_CHECK(cs[j].start >= cs[j - 1].end, "leaves %u and %u overlap in chunk %u", cs[j - 1].leaf,
                     cs[j].leaf, ci);
        int64_t payload = p.chunks[ci].payload;
        if (payload <= TOUCH_MAX) {
            uint8_t *buf = malloc(payload ? (size_t)payload : 1);
            FZ_CHECK(buf);
            for (uint32_t j = 0; j < m; j++) memset(buf + cs[j].start, 0x5a, (size_t)(cs[j].end - cs[j].start));
            free(buf);
        }
        free(cs);
    }
    free(seen);
    free(spans);
    mtc_plan_free(&p);
    return 0;
}
