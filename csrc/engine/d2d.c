/*
 * d2d.c - device -> another device op runner (see runner.h).
 */
#include "runner.h"

#include <errno.h>
#include <stdlib.h>

static _Atomic int _batch_broken_d2d; /* a batched device-to-device copy was refused (peer paths
                                         may differ from D2H): per-tensor peer copies from then on */

/* Device -> another device, for a run of consecutive D2D ops with one source
 * and one target device: the target's captured stream waits once for the
 * source's captured stream, then one batched copy (or one peer copy per
 * tensor) runs on the target stream. */
int mtc_d2d_run(mtc_run *r, const mtc_op *ops, uint32_t nops)
{
    mtc_job *j = r->job;
    const mtc_item *first = &j->items[ops[0].first];
    int src = first->dev, dst = ops[0].dev;
    int rc;
    CUevent ev = NULL;
    /* Order the copies after the work queued on the source's captured stream. */
    if ((rc = mtc_run_use_dev(r, src))) return mtc_run_fail(r, rc, first->leaf, "selecting the source device");
    if ((rc = mtc_run_event(src, &ev))) return mtc_run_fail(r, rc, first->leaf, "creating an event");
    if ((rc = mtc_cu_rc(mtc_cu.cuEventRecord(ev, j->streams[src])))) return mtc_run_fail(r, rc, first->leaf, "recording an event");
    if ((rc = mtc_run_use_dev(r, dst))) return mtc_run_fail(r, rc, first->leaf, "selecting the target device");
    if ((rc = mtc_cu_rc(mtc_cu.cuStreamWaitEvent(j->streams[dst], ev, 0))))
        return mtc_run_fail(r, rc, first->leaf, "ordering the copy after the source stream");
    MTC_COUNT(items_copied, nops);
    /* get() returns once the sources have been read (the inputs may be freed then) */
    r->sync_mask |= 1ull << dst;
    int64_t t0 = mtc_now_ns();
    if (mtc_cu.cuMemcpyBatchAsync && nops > 1 && !mtc_load_relaxed(&_batch_broken_d2d)) {
        CUdeviceptr *d = malloc(nops * sizeof *d), *sp = malloc(nops * sizeof *sp);
        size_t *sz = malloc(nops * sizeof *sz);
        size_t m = 0;
        if (d && sp && sz) {
            for (uint32_t k = 0; k < nops; k++) {
                const mtc_item *it = &j->items[ops[k].first];
                if (!it->nbytes) continue;
                d[m] = it->dst;
                sp[m] = it->src;
                sz[m++] = (size_t)it->nbytes;
            }
            rc = m ? mtc_run_batch_copy(j->streams[dst], dst, d, sp, sz, m) : 0;
        } else {
            rc = -ENOMEM;
        }
        free(d);
        free(sp);
        free(sz);
        if (!rc) {
            for (uint32_t k = 0; k < nops; k++) MTC_COUNT(bytes_d2d, j->items[ops[k].first].nbytes);
            MTC_COUNT(ns_dma_issue, mtc_now_ns() - t0);
            return 0;
        }
        /* refused (e.g. no peer path for a batch): per-tensor peer copies, counted */
        mtc_store_relaxed(&_batch_broken_d2d, 1);
        MTC_COUNT(batch_fallbacks, 1);
    }
    for (uint32_t k = 0; k < nops; k++) {
        const mtc_item *it = &j->items[ops[k].first];
        if (!it->nbytes) continue;
        rc = mtc_cu_rc(mtc_cu.cuMemcpyPeerAsync(it->dst, mtc_cuda_context(dst), it->src, mtc_cuda_context(src),
                                          (size_t)it->nbytes, j->streams[dst]));
        MTC_COUNT(dma_calls, 1);
        if (rc) return mtc_run_fail(r, rc, it->leaf, "device-to-device copy");
        MTC_COUNT(bytes_d2d, it->nbytes);
    }
    MTC_COUNT(ns_dma_issue, mtc_now_ns() - t0);
    return 0;
}
