/*
 * runner.h - the per-direction op runners that the dispatch (transfer.c)
 * calls: h2d.c (host -> device: chunks, large staged copies, arena regions),
 * h2h.c (host -> host), d2h.c (device -> host) and d2d.c (device -> another
 * device).
 *
 * Internal to the engine: only transfer.c and the runners include it. The
 * runners build on job.h (the job, the run state, counters, error recording,
 * file reads) and pinned.h (the staging pools), never on transfer.h: calls
 * go from the dispatch down to the runners, never back.
 *
 * Every function runs on the thread that runs the job (a transfer thread, or
 * the caller of an inline job), never touches Python, and returns 0 or a
 * negative code (errno, or a CUDA error as in cuda.h). A runner that fails
 * records the error in its job (mtc_run_fail) and returns it; the dispatch in
 * mtc_transfer_run stops issuing ops after the first one.
 */
#ifndef MTC_RUNNER_H
#define MTC_RUNNER_H

#include <stddef.h>
#include <stdint.h>

#include "cuda.h"
#include "job.h"

/* h2d.c: a run of nops consecutive H2D_CHUNK ops of one chunk (its storage
 * groups, in chunk order); a run of nops consecutive H2D ops to one device;
 * H2D_REGION. */
int mtc_h2d_chunk(mtc_run *r, const mtc_op *ops, uint32_t nops);
int mtc_h2d_large(mtc_run *r, const mtc_op *ops, uint32_t nops);
int mtc_h2d_region(mtc_run *r, const mtc_op *op);
/* h2d.c: the staged copies' piece and task sizes and store kind (nt: 1
 * streaming stores, 0 memcpy) in place of the engine's; 0, 0, -1 give them
 * back. For the C unit tests, whose rings of small pieces reuse every slab
 * many times. */
void mtc_h2d_tune(size_t piece, size_t task, int nt);

/* h2h.c: HOST_COPY (a memcpy split over the helpers when large, or a strided
 * copy, per item; file-backed items read in one batch). */
int mtc_h2h_run(mtc_run *r, const mtc_op *op);

/* d2h.c: D2H and D2H_CHUNK. */
int mtc_d2h_run(mtc_run *r, const mtc_op *op);

/* d2d.c: a run of nops consecutive D2D ops with one source and one target device. */
int mtc_d2d_run(mtc_run *r, const mtc_op *ops, uint32_t nops);

#endif /* MTC_RUNNER_H */
