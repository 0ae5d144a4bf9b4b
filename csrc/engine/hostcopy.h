/*
 * hostcopy.h - host memory copies: contiguous and strided copies, and a small
 * pool of helper threads that splits large copies.
 *
 * The pool: any thread may submit a batch of `n` independent tasks; helpers
 * take task indices from an atomic counter; the submitter can help, and waits
 * for the batch with mtc_batch_wait(). Per-task completion can be observed
 * with mtc_flag (futex.h), which is what lets the transfer thread issue the
 * DMA of piece k while helpers still copy piece k+1.
 *
 * No Python here; functions return 0 or a negative errno. Names starting with
 * `_` are internal to hostcopy.c.
 */
#ifndef MTC_HOSTCOPY_H
#define MTC_HOSTCOPY_H

#include <stddef.h>
#include <stdint.h>

#include "atomics.h"
#include "futex.h" /* the flags a batch's tasks are observed with */

typedef void (*mtc_task_fn)(void *arg, uint32_t index);

typedef struct mtc_batch {
    mtc_task_fn fn;
    void *arg;
    uint32_t n;
    _Atomic uint32_t next;      /* next task index to take */
    _Atomic uint32_t done;      /* tasks finished */
    _Atomic uint32_t finished;  /* futex word: 1 once done == n */
    _Atomic uint32_t active;    /* helpers that picked the batch and may still touch it */
    struct mtc_batch *qnext;    /* internal: pool queue link */
} mtc_batch;

/* Starts the helpers (idempotent; at most `nthreads`, 0 = automatic). 0 or -errno. */
int mtc_pool_start(int nthreads);
/* Number of helper threads running. */
int mtc_pool_size(void);
/* Queues a batch for the helpers. The batch must outlive its completion. */
void mtc_batch_submit(mtc_batch *b, mtc_task_fn fn, void *arg, uint32_t n);
/* The caller takes tasks of b too, until none is left. */
void mtc_batch_help(mtc_batch *b);
/* Waits for every task of b to finish. */
void mtc_batch_wait(mtc_batch *b);
/* Runs fn over [0, n) on the helpers and the caller; returns when all finished. */
void mtc_parallel_for(mtc_task_fn fn, void *arg, uint32_t n);

/* Stops the helpers (tests; interpreter exit). */
void mtc_pool_stop(void);
/* After fork() in the child: the helpers did not survive the fork. */
void mtc_pool_after_fork_child(void);

/*
 * Copies a strided host array into a contiguous destination. shape/strides
 * (bytes) describe the source; elsize is the element size. The innermost
 * contiguous run is copied with memcpy. Any ndim; the contiguous image must
 * be smaller than 2^63 bytes.
 */
void mtc_copy_strided(void *dst, const void *src, int ndim, const int64_t *shape,
                      const int64_t *strides, int64_t elsize);

/*
 * Copies a byte range [begin, end) of the contiguous image of a strided
 * source (begin/end multiples of elsize) into dst. Lets a large strided copy
 * be split into pieces.
 */
void mtc_copy_strided_range(void *dst, const void *src, int ndim, const int64_t *shape,
                            const int64_t *strides, int64_t elsize, int64_t begin, int64_t end);

/*
 * Copies a strided host array into a dense destination whose element
 * strides are dst_strides (a permutation of a dense layout, strides.h): the
 * source is walked in the destination's order, so the destination is
 * written front to back. dst_strides NULL: row-major, as mtc_copy_strided.
 */
void mtc_copy_strided_to(void *dst, const int64_t *dst_strides, const void *src, int ndim,
                         const int64_t *shape, const int64_t *strides, int64_t elsize);

/* Copies nbytes, split over the helpers when large; nt: with streaming
 * stores (mtc_memcpy_nt), for a destination that no CPU reads next. */
void mtc_memcpy_parallel(void *dst, const void *src, size_t nbytes, int nt);

/*
 * Copies nbytes with non-temporal (streaming) stores where the CPU has them
 * (x86-64), else memcpy. The destination's lines are not read first (no
 * read-for-ownership) and not left in the cache: for staging that a DMA reads
 * next, a third less memory traffic than memcpy. Ends with a store fence, so
 * a release that follows publishes the bytes like any other store.
 */
void mtc_memcpy_nt(void *dst, const void *src, size_t nbytes);

/*
 * Measures the aggregate host copy bandwidth: `threads` threads (1..64, their
 * own, not the helpers) each copy their contiguous share of nbytes from src to
 * dst, `reps` times, with memcpy (nt 0) or mtc_memcpy_nt (nt 1). secs[r] is
 * rep r's time from the common start to the last thread's end. 0 or -errno.
 *
 * window > 0: thread i copies its share window bytes at a time, every time
 * into the same dst + i * window (dst holds threads * window bytes), so that
 * the destination stays in the cache: the copy rate without the write to
 * memory. 0: dst is nbytes long, as src.
 */
int mtc_memcpy_bench(void *dst, const void *src, size_t nbytes, int threads, int reps, int nt,
                     size_t window, double *secs);

/* Piece size for splitting large copies, bytes. */
#define MTC_PIECE_BYTES ((size_t)4 << 20)

#endif /* MTC_HOSTCOPY_H */
