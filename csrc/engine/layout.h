/*
 * layout.h - the wire format of a packed batch's layout, and its decoder.
 *
 * A DataLoader worker packs a batch into one arena region with the planner
 * (one chunk) and sends, with the region's offset, the layout: every leaf's
 * dtype and shape, and the segments that place the leaves in the region.
 * The main process decodes it to create the output views. What crosses the
 * process boundary is untrusted: mtc_layout_decode() accepts only a layout
 * whose every leaf lies inside the region at an aligned, non-overlapping
 * place that the view creation can express; anything else is -EINVAL, never
 * a read or write outside the buffers.
 *
 * Format (little-endian, packed):
 *   u32 magic 'MTCL', u16 version, u16 reserved, u32 nleaves, u32 nsegs,
 *   i64 payload, i64 align
 *   nleaves x { u16 dtype, u16 ndim | flag, i64 dims[ndim], [i64 strides[ndim]] }
 *     flag 0x8000: the leaf's output strides (elements) follow its dims. A
 *     leaf dense in another order than row-major (channels_last, a
 *     transpose), or with a dim of size 0 or 1 whose stride is not
 *     torch.empty's, is packed as it lies and carries its strides; they
 *     must describe a dense, non-overlapping layout (strides.h), and the
 *     leaf must be alone in a UNIFORM segment. Without the flag the leaf is
 *     row-major and takes no more bytes than that.
 *     flag 0x4000: the leaf is host-placed (under an OnHost): unpacked into
 *     CPU memory of its own whatever the target. A segment's members are all
 *     host-placed or none, and host-placed segments follow all the others,
 *     so that their bytes are one span at the end of the region.

 *   nsegs   x { u8 kind, u8[3] 0, u32 count, i64 offset, i64 bytes, i64 rows,
 *               i64 row_bytes, count x { u32 leaf, i64 slot } }
 *
 * No Python; 0 or a negative errno. Names starting with `_` are internal.
 */
#ifndef MTC_LAYOUT_H
#define MTC_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#include "plan.h"

#define MTC_LAYOUT_MAGIC 0x4c43544du /* "MTCL" */
#define MTC_LAYOUT_VERSION 1u
#define MTC_LAYOUT_MAX_LEAVES (1u << 22)
#define MTC_LAYOUT_MAX_ALIGN 4096
#define MTC_LAYOUT_STRIDED 0x8000u /* in a leaf's ndim: its strides follow its dims */
#define MTC_LAYOUT_HOST 0x4000u    /* in a leaf's ndim: host-placed (MTC_LEAF_HOST) */

typedef struct mtc_layout {
    mtc_leaf *leaves;  /* dtype, elsize, ndim, dims, nbytes, seg, slot set; dev = CPU */
    uint32_t nleaves;
    int64_t *shape;    /* dims of all leaves */
    int64_t *strides;  /* byte strides: row-major, or the carried ones */
    int64_t *ostrides; /* element strides of MTC_LEAF_STRIDED leaves (carried), else unset */
    uint32_t ndims;
    mtc_plan plan;     /* one chunk: payload, align; segments; members */
    uint32_t nhost;    /* host-placed leaves (MTC_LEAF_HOST) */
    int64_t dev_end;   /* end of the last segment that is not host-placed (0: none) */
    int64_t host_start; /* offset of the first host-placed segment (payload: none); >= dev_end */
} mtc_layout;

/* Bytes needed to encode leaves[0..n) placed by plan p (one chunk). */
size_t mtc_layout_size(const mtc_leaf *leaves, uint32_t n, const mtc_plan *p);
/* Encodes into buf (len from mtc_layout_size); the strides of
 * MTC_LEAF_STRIDED leaves come from ostrides (elements, at each leaf's dims;
 * may be NULL when there is no such leaf). 0, -EINVAL (not one chunk, a
 * leaf not packed, or strided leaves and no ostrides), -ENOSPC. */
int mtc_layout_encode(const mtc_leaf *leaves, uint32_t n, const int64_t *shape, const int64_t *ostrides,
                      const mtc_plan *p, uint8_t *buf, size_t len);
/*
 * Decodes and validates an untrusted layout. elsize[code] gives the element
 * size of each of the ndtypes dtype codes. region_bytes bounds the chunk
 * (payload + align - 1 <= region_bytes). 0 and *out (free with
 * mtc_layout_free), -EINVAL, -ENOMEM.
 */
int mtc_layout_decode(const uint8_t *buf, size_t len, const int *elsize, int ndtypes,
                      uint64_t region_bytes, mtc_layout *out);
void mtc_layout_free(mtc_layout *l);

#endif /* MTC_LAYOUT_H */
