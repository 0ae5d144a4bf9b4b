/*
 * d2h.c - device -> host op runner (see runner.h).
 */
#include "runner.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

static _Atomic int _batch_broken;     /* the driver refused a batched D2H copy: per-item copies from then on */

/* Device -> host: one batched driver call per source device when the driver
 * has cuMemcpyBatchAsync (hundreds of small copies in one call), else one
 * cuMemcpyDtoHAsync per item. */
int mtc_d2h_run(mtc_run *r, const mtc_op *op)
{
    mtc_job *j = r->job;
    const mtc_item *items = &j->items[op->first];
    uint32_t n = op->count;
    if (op->kind == MTC_OP_D2H_CHUNK) MTC_COUNT(chunks, 1);
    MTC_COUNT(items_copied, n);
    int64_t t0 = mtc_now_ns();
    int rc = 0;
    if (mtc_cu.cuMemcpyBatchAsync && n > 1 && !mtc_load_relaxed(&_batch_broken)) {
        CUdeviceptr *dst = malloc(n * sizeof *dst), *src = malloc(n * sizeof *src);
        size_t *sz = malloc(n * sizeof *sz);
        if (!dst || !src || !sz) rc = mtc_run_fail(r, -ENOMEM, items[0].leaf, "planning the device-to-host copies");
        /* one batch per source device, in item order */
        for (uint32_t a = 0; a < n && !rc;) {
            int dev = items[a].dev;
            uint32_t m = 0, b = a;
            for (; b < n && items[b].dev == dev; b++) {
                if (!items[b].nbytes) continue;
                dst[m] = op->kind == MTC_OP_D2H_CHUNK ? op->dst + items[b].dst : items[b].dst;
                src[m] = items[b].src;
                sz[m] = (size_t)items[b].nbytes;
                m++;
                MTC_COUNT(bytes_d2h, items[b].nbytes);
            }
            if (m && !(rc = mtc_run_use_dev(r, dev))) {
                rc = mtc_run_batch_copy(j->streams[dev], dev, dst, src, sz, m);
                if (rc == MTC_CUDA_ERR(1) && !mtc_load_relaxed(&_batch_broken)) {
                    /* CUDA_ERROR_INVALID_VALUE from a driver that takes the
                     * symbol but not this use: per-item copies from now on,
                     * counted in stats()["batch_fallbacks"] */
                    mtc_store_relaxed(&_batch_broken, 1);
                    MTC_COUNT(batch_fallbacks, 1);
                    rc = 0;
                    for (uint32_t q = 0; q < m && !rc; q++)
                        rc = mtc_cu_rc(mtc_cu.cuMemcpyDtoHAsync((void *)dst[q], src[q], sz[q], j->streams[dev]));
                }
                r->sync_mask |= 1ull << dev;
            }
            if (rc) mtc_run_fail(r, rc, items[a].leaf, "device-to-host copy");
            a = b;
        }
        free(dst);
        free(src);
        free(sz);
        MTC_COUNT(ns_dma_issue, mtc_now_ns() - t0);
        return rc;
    }
    for (uint32_t k = 0; k < n; k++) {
        const mtc_item *it = &items[k];
        if ((rc = mtc_run_use_dev(r, it->dev))) return mtc_run_fail(r, rc, it->leaf, "selecting the device");
        if (!it->nbytes) continue;
        uintptr_t dst = op->kind == MTC_OP_D2H_CHUNK ? op->dst + it->dst : it->dst;
        rc = mtc_cu_rc(mtc_cu.cuMemcpyDtoHAsync((void *)dst, it->src, (size_t)it->nbytes, j->streams[it->dev]));
        MTC_COUNT(dma_calls, 1);
        if (rc) return mtc_run_fail(r, rc, it->leaf, "device-to-host copy");
        r->sync_mask |= 1ull << it->dev;
        MTC_COUNT(bytes_d2h, it->nbytes);
    }
    MTC_COUNT(ns_dma_issue, mtc_now_ns() - t0);
    return 0;
}
