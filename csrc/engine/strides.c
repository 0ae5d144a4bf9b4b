/*
 * strides.c - dense layouts and torch's output strides (see strides.h).
 */
#include "strides.h"

#include "plan.h"

int mtc_strides_dense(const int64_t *shape, const int64_t *strides, int ndim)
{
    /* The dims that address anything: size >= 2. An empty tensor is dense
     * (torch calls it contiguous). More than 63 such dims hold 2^63
     * elements or more: never dense. */
    int idx[64], m = 0;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] == 0) return 1;
        if (shape[d] == 1) continue;
        if (m == 64) return 0;
        idx[m++] = d;
    }
    /* sorted by stride, innermost first (insertion sort: m <= 64) */
    for (int i = 1; i < m; i++)
        for (int j = i; j > 0 && strides[idx[j - 1]] > strides[idx[j]]; j--) {
            int t = idx[j];
            idx[j] = idx[j - 1];
            idx[j - 1] = t;
        }
    int64_t want = 1;
    for (int i = 0; i < m; i++) {
        if (strides[idx[i]] != want) return 0;
        if (__builtin_mul_overflow(want, shape[idx[i]], &want)) return 0; /* 2^63 elements: not a block */
    }
    return 1;
}

/* -1: dim a goes inside dim b; 1: outside; 0: no order (a stride of 0, or
 * equal strides with a not the larger dim). */
static int _order(const int64_t *shape, const int64_t *strides, int a, int b)
{
    int64_t sa = strides[a], sb = strides[b];
    if (sa == 0 || sb == 0) return 0;
    if (sa != sb) return sa < sb ? -1 : 1;
    return shape[a] > shape[b] ? 1 : 0;
}

void mtc_strides_infer(const int64_t *shape, const int64_t *strides, int ndim, int64_t *out)
{
    if (ndim <= 0) return;
    if (ndim == 1) {
        out[0] = 1;
        return;
    }
    /* perm[0] is the innermost dim; it starts as the row-major order, and an
     * insertion sort that steps over unordered pairs (ATen's, which
     * TensorIterator shares) moves dims by stride */
    int perm[MTC_MAX_NDIM];
    if (ndim > MTC_MAX_NDIM) ndim = MTC_MAX_NDIM;
    for (int i = 0; i < ndim; i++) perm[i] = ndim - 1 - i;
    for (int i = 1; i < ndim; i++) {
        int cur = i;
        for (int j = i - 1; j >= 0; j--) {
            int c = _order(shape, strides, perm[j], perm[cur]);
            if (c > 0) {
                int t = perm[j];
                perm[j] = perm[cur];
                perm[cur] = t;
                cur = j;
            } else if (c < 0) {
                break;
            }
        }
    }
    int64_t run = 1;
    for (int i = 0; i < ndim; i++) {
        out[perm[i]] = run;
        if (shape[perm[i]] > 1 && __builtin_mul_overflow(run, shape[perm[i]], &run)) run = INT64_MAX;
    }
}

int mtc_strides_default(const int64_t *shape, const int64_t *strides, int ndim)
{
    int64_t want = 1;
    for (int d = ndim - 1; d >= 0; d--) {
        if (strides[d] != want) return 0;
        if (shape[d] > 1 && __builtin_mul_overflow(want, shape[d], &want)) want = INT64_MAX;
    }
    return 1;
}

uint32_t mtc_strides_leaf(const int64_t *shape, int64_t *strides, int ndim)
{
    uint32_t flags = 0;
    if (mtc_strides_dense(shape, strides, ndim)) {
        flags = MTC_LEAF_DENSE;
    } else {
        int64_t out[MTC_MAX_NDIM];
        if (ndim > MTC_MAX_NDIM) return 0;
        mtc_strides_infer(shape, strides, ndim, out);
        for (int d = 0; d < ndim; d++) strides[d] = out[d];
    }
    if (!mtc_strides_default(shape, strides, ndim)) flags |= MTC_LEAF_STRIDED;
    return flags;
}
