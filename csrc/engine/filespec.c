/*
 * filespec.c - the spec of a file-backed leaf: checked, measured, and its
 * parts read out (see uring.h, which declares these).
 */
#include "uring.h"

#include <errno.h>
#include <string.h>

#include "plan.h" /* MTC_MAX_NDIM */

int mtc_uring_spec_view(const void *buf, size_t len, mtc_file_spec *out)
{
    const uint8_t *b = buf;
    if (len < sizeof out->h) return -EINVAL;
    memcpy(&out->h, b, sizeof out->h);
    const mtc_file_spec_hdr *h = &out->h;
    if (h->magic != MTC_FILE_SPEC_MAGIC || h->ndim > MTC_MAX_NDIM || h->nparts == 0 || h->nbytes < 0)
        return -EINVAL;
    size_t need = sizeof *h + (size_t)h->ndim * sizeof(int64_t) + (size_t)h->nparts * sizeof(mtc_file_part);
    if ((uint64_t)h->nparts > len / sizeof(mtc_file_part) || need > len || len - need != h->paths_bytes)
        return -EINVAL;
    out->dims = (const int64_t *)(b + sizeof *h);
    out->parts = b + sizeof *h + (size_t)h->ndim * sizeof(int64_t);
    out->paths = (const char *)(b + need);
    uint64_t sum = 0;
    for (uint32_t k = 0; k < h->nparts; k++) {
        mtc_file_part p;
        memcpy(&p, out->parts + (size_t)k * sizeof p, sizeof p);
        if ((uint64_t)p.path + p.path_len >= h->paths_bytes || out->paths[p.path + p.path_len] != '\0' ||
            memchr(out->paths + p.path, '\0', p.path_len) || p.nbytes > (uint64_t)INT64_MAX - sum ||
            p.offset > (uint64_t)INT64_MAX - p.nbytes)
            return -EINVAL;
        sum += p.nbytes;
    }
    return sum == (uint64_t)h->nbytes ? 0 : -EINVAL;
}

size_t mtc_uring_spec_size(const void *buf)
{
    mtc_file_spec_hdr h;
    memcpy(&h, buf, sizeof h);
    return sizeof h + (size_t)h.ndim * sizeof(int64_t) + (size_t)h.nparts * sizeof(mtc_file_part) + h.paths_bytes;
}

void mtc_uring_spec_part(const mtc_file_spec *s, uint32_t k, mtc_file_part *part, const char **path)
{
    memcpy(part, s->parts + (size_t)k * sizeof *part, sizeof *part);
    *path = s->paths + part->path;
}
