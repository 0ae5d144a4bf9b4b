/*
 * pinned.h - the pinned staging pools: one slab pool (slab.h) per CUDA
 * device, whose page-locked memory and fences come from the CUDA driver.
 *
 * A pool is created on the first use of its device (mtc_pinned_pool) and
 * lives until the process ends. Its slabs are allocated with cuMemHostAlloc,
 * or, with MTC_SLAB_HUGEPAGES=1, mapped anonymously with MADV_HUGEPAGE and
 * page-locked in place with cuMemHostRegister; its fences are CUDA events.
 * One cap on pinned bytes applies to every device's pool
 * (MTC_PINNED_CAP_BYTES, default 1 GiB; mtc_pinned_set_cap).
 *
 * Concurrency: every function may be called from any thread; one mutex
 * guards the table of pools (a slab pool has its own lock for the rest).
 * No Python here; functions return 0 or a negative code (errno, or a CUDA
 * error as in cuda.h). Names starting with `_` are internal to pinned.c.
 */
#ifndef MTC_PINNED_H
#define MTC_PINNED_H

#include <stddef.h>

#include "slab.h"

/* The pinned slab pool of device dev, created on first use; NULL with *err set. */
mtc_slab_pool *mtc_pinned_pool(int dev, int *err);
/* Slab statistics of device dev's pool; -EINVAL for a bad device, -ENOENT when it has no pool. */
int mtc_pinned_stats(int dev, mtc_slab_stats *out);
/* Cap on pinned bytes per device (applies to pools created later and to existing ones).
 * 0, or -EINVAL for 0. */
int mtc_pinned_set_cap(size_t bytes);
/* The cap now. */
size_t mtc_pinned_cap(void);
/* Frees idle slabs of every device; returns bytes freed. */
size_t mtc_pinned_trim(void);
/* In the child of fork(): forgets the parent's pools (their memory is the
 * parent's copy, left alone) and reinitialises the lock. */
void mtc_pinned_after_fork_child(void);

#endif /* MTC_PINNED_H */
