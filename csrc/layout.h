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
 *   nleaves x { u16 dtype, u16 ndim, i64 dims[ndim] }
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

typedef struct mtc_layout {
    mtc_leaf *leaves;  /* dtype, elsize, ndim, dims, nbytes, seg, slot set; dev = CPU */
    uint32_t nleaves;
    int64_t *shape;    /* dims of all leaves */
    int64_t *strides;  /* contiguous byte strides */
    uint32_t ndims;
    mtc_plan plan;     /* one chunk: payload, align; segments; members */
} mtc_layout;

/* Bytes needed to encode leaves[0..n) placed by plan p (one chunk). */
size_t mtc_layout_size(const mtc_leaf *leaves, uint32_t n, const mtc_plan *p);
/* Encodes into buf (len from mtc_layout_size). 0, -EINVAL (not one chunk,
 * or a leaf not packed), -ENOSPC. */
int mtc_layout_encode(const mtc_leaf *leaves, uint32_t n, const int64_t *shape, const mtc_plan *p,
                      uint8_t *buf, size_t len);
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
