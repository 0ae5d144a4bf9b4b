/*
 * h2h.c - the host -> host op runner (see runner.h).
 */
#include "runner.h"

/* Host -> host: a memcpy (split over the helpers when large) or a strided copy per item. */
int mtc_h2h_run(mtc_run *r, const mtc_op *op)
{
    mtc_job *j = r->job;
    int64_t t0 = mtc_now_ns();
    for (uint32_t k = 0; k < op->count; k++) {
        const mtc_item *it = &j->items[op->first + k];
        if (it->file) continue; /* read below, all files in one batch */
        mtc_run_copy_item(0, it, op->nt ? MTC_COPY_SPLIT_NT : MTC_COPY_SPLIT);
        MTC_COUNT(bytes_host, it->nbytes);
    }
    int rc = mtc_run_read_files(r, 0, &j->items[op->first], op->count);
    MTC_COUNT(items_copied, op->count);
    MTC_COUNT(ns_stage, mtc_now_ns() - t0);
    return rc;
}
