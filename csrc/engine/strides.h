/*
 * strides.h - the memory layout of one leaf as torch's tensor.to() treats it
 * (pure C, no Python).
 *
 * tensor.to(device) keeps a tensor's layout (memory_format=preserve_format):
 *  - a dense, non-overlapping tensor (torch's is_non_overlapping_and_dense:
 *    row-major contiguous, channels_last, a transpose, any permutation of
 *    dims; an empty tensor; dims of size 0 or 1 may have any stride) keeps
 *    its strides exactly. Its elements fill one block of numel x elsize
 *    bytes starting at its first element, so the engine copies that block
 *    as it is and gives the output the same strides;
 *  - any other tensor (gaps, overlaps, expanded dims) gets dense strides in
 *    the order of its own (ATen's infer_dense_strides, which clone() and
 *    empty_like() use too): the engine gathers it in that order.
 *
 * Strides here are in elements and non-negative (what torch can hold).
 * Names starting with `_` are internal to strides.c.
 */
#ifndef MTC_STRIDES_H
#define MTC_STRIDES_H

#include <stdint.h>

/* 1 when shape/strides describe a dense, non-overlapping tensor as torch
 * defines it (numel 0, row-major contiguous, or the dims of size >= 2 sorted
 * by stride tile the elements without gap or overlap), else 0. */
int mtc_strides_dense(const int64_t *shape, const int64_t *strides, int ndim);

/* Dense strides in the layout order of `strides` into out (ndim entries):
 * ATen's infer_dense_strides. A dim of stride 0 keeps its place in the
 * order; equal strides put the smaller dim inner. Products saturate (only an
 * expanded view of 2^63 elements or more, which is never copied, gets
 * there). */
void mtc_strides_infer(const int64_t *shape, const int64_t *strides, int ndim, int64_t *out);

/* 1 when strides are those of torch.empty(shape) (row-major, a dim of size
 * 0 or 1 counting as 1), else 0. */
int mtc_strides_default(const int64_t *shape, const int64_t *strides, int ndim);

/*
 * The output layout of a leaf whose element strides are in `strides`:
 * rewrites them in place to the output's strides (unchanged for a dense
 * leaf, infer_dense_strides otherwise) and returns the leaf flags that say
 * so: MTC_LEAF_DENSE when the leaf is dense (its bytes are one block laid
 * out as its output), MTC_LEAF_STRIDED when the output strides are not
 * torch.empty(shape)'s; 0 for neither.
 */
uint32_t mtc_strides_leaf(const int64_t *shape, int64_t *strides, int ndim);

#endif /* MTC_STRIDES_H */
