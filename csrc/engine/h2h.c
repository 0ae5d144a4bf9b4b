/*
 * h2h.c - the host -> host op runner (see runner.h).
 */
#include "runner.h"

#include "hostcopy.h"

/* Host -> host: a memcpy (split over the helpers when large) or a strided copy per item. */
int mtc_h2h_run(mtc_run *r, const mtc_op *op)
{
    mtc_job *j = r->job;
    int64_t t0 = mtc_now_ns();
    for (uint32_t k = 0; k < op->count; k++) {
        const mtc_item *it = &j->items[op->first + k];
        if (it->file) continue; /* read below, all files in one batch */
        if (it->shape)
            mtc_copy_strided_to((void *)it->dst, it->dst_strides, (const void *)it->src, it->ndim, it->shape,
                                it->strides, it->elsize);
        else if (it->nbytes)
            mtc_memcpy_parallel((void *)it->dst, (const void *)it->src, (size_t)it->nbytes, op->nt);
        MTC_COUNT(bytes_host, it->nbytes);
    }
    int rc = mtc_run_read_files(r, 0, &j->items[op->first], op->count);
    MTC_COUNT(items_copied, op->count);
    MTC_COUNT(ns_stage, mtc_now_ns() - t0);
    return rc;
}
