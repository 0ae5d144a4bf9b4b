/*
 * arena.h - the shared pinned arena of the DataLoader path.
 *
 * One memfd mapping, created by the main process (anonymous: no name in
 * /dev/shm, close-on-exec, sealed against growing and shrinking), mapped by
 * DataLoader workers that were handed its descriptor. Workers allocate
 * regions from a lock-free allocator in the arena's header, write a packed
 * batch into one, and send a small descriptor; the main process DMAs the
 * region to the GPU and frees it once the DMA that read it has completed.
 *
 * Allocator: the data area is cut into fixed slots; a region is a run of
 * consecutive slots. Each slot has a 64-bit state word in the header:
 *   0                      free
 *   HEAD | len<<32 | pid   first slot of a run of `len` slots owned by `pid`
 *   pid                    a continuation slot owned by `pid`
 * A run is claimed by CAS from its last slot to its head (a scanner that sees
 * any claimed slot skips it), freed by storing 0 from head to tail. Any
 * number of processes may allocate and free at once. A waiter for space
 * sleeps on a process-shared futex word that every free bumps.
 *
 * The header lives in memory every process of the arena can write: the main
 * process treats everything in it (and every descriptor) as untrusted, and
 * checks before it uses an offset. No Python here; functions return 0 or a
 * negative errno. Names starting with `_` are internal to arena.c.
 */
#ifndef MTC_ARENA_H
#define MTC_ARENA_H

#include <stddef.h>
#include <stdint.h>

#include "atomics.h"

#define MTC_ARENA_MAGIC 0x616e657241637466ull /* "ftcArena" little-endian */
#define MTC_ARENA_VERSION 1u
#define MTC_ARENA_SLOT_BYTES ((uint64_t)64 * 1024)
#define MTC_ARENA_HEAD (1ull << 63)

typedef struct mtc_arena_header {
    uint64_t magic;
    uint32_t version;
    uint32_t creator_pid;
    uint64_t arena_bytes;   /* the whole mapping */
    uint64_t data_offset;   /* first slot; a multiple of the page size */
    uint64_t slot_bytes;
    uint32_t nslots;
    uint32_t pad0;
    MTC_ALIGNED_CL _Atomic uint32_t free_seq; /* futex word: bumped by every free */
    _Atomic uint32_t hint;                    /* where the next scan starts */
    MTC_ALIGNED_CL _Atomic uint64_t allocs, frees, waits, timeouts, reclaims, slots_in_use, high_water;
    MTC_ALIGNED_CL _Atomic uint64_t slots[];  /* nslots state words */
} mtc_arena_header;

typedef struct mtc_arena {
    int fd;
    uint8_t *base;
    size_t bytes;
    mtc_arena_header *hdr;
    uint32_t nslots;        /* private copies of the header's geometry, checked at attach */
    uint64_t data_offset;
    uint64_t slot_bytes;
    int registered;         /* page-locked with CUDA in this process */
    _Atomic int32_t refs;
    _Atomic int32_t populated_pid; /* the process `populated` describes (0: none yet) */
    _Atomic uint8_t *populated;    /* per slot: mapped in populated_pid's page tables (NULL: unknown, never populate) */
} mtc_arena;

typedef struct mtc_arena_stats {
    uint64_t bytes, slot_bytes, nslots, allocs, frees, waits, timeouts, reclaims, slots_in_use,
        high_water;
} mtc_arena_stats;

/* Creates an arena of at least `bytes` of data (rounded up to slots).
 * 0 and *out (refs = 1), or -errno. */
int mtc_arena_create(size_t bytes, mtc_arena **out);
/* Maps the arena behind fd (dup'ed: the caller keeps its fd). Checks the
 * header against the file's size. 0, -EINVAL (not an arena), -errno. */
int mtc_arena_attach(int fd, mtc_arena **out);
void mtc_arena_ref(mtc_arena *a);
/* Drops a reference; unmaps and closes at zero. Unregistering from CUDA is
 * the caller's business (before the last unref). */
void mtc_arena_unref(mtc_arena *a);

/* Maps the pages of the region [off, off + nbytes) (offsets from the
 * arena's base, slot-aligned start) into this process's page tables before
 * it is written: one madvise(MADV_POPULATE_WRITE) per run of slots this
 * process has not populated yet, instead of a page fault per 4 KiB (a forked
 * DataLoader worker inherits the mapping but not its page table entries, and
 * regions cycle through the whole arena, so every worker would fault on all
 * of it, ~1 us per page). A per-process bitmap of slots (reset when the pid
 * changes, i.e. after fork) makes later calls over the same slots a scan of
 * a few bytes. Memory the main process has not page-locked yet is allocated
 * then. 0, or -errno of madvise (EINVAL before Linux 5.14: the pages are
 * then faulted in as they are written, as without it).
 * MTC_ARENA_POPULATE=0 in the environment turns it off. */
int mtc_arena_populate(mtc_arena *a, uint64_t off, uint64_t nbytes);

/* Owners are pids, 1 .. INT32_MAX; every function below returns -EINVAL for
 * any other owner (a caller that narrows a wider pid must check first). */

/* Try-path: claims a region of at least nbytes for `owner`. 0 and *off (from
 * the arena's base), -ENOSPC when no run is free now, -E2BIG when nbytes can
 * never fit, -EINVAL. */
int mtc_arena_try_alloc(mtc_arena *a, uint64_t nbytes, uint32_t owner, uint64_t *off);
/* Waiting path: waits up to timeout_ns (<0 forever) for frees. -ETIMEDOUT.
 * Uninterruptible: a caller that must react to signals uses the slices below. */
int mtc_arena_alloc(mtc_arena *a, uint64_t nbytes, uint32_t owner, int64_t timeout_ns, uint64_t *off);

/* One allocation's wait, across slices. */
typedef struct mtc_arena_wait {
    int64_t deadline_ns; /* CLOCK_MONOTONIC; -1: none */
    int waited;          /* the header's `waits` counted already */
} mtc_arena_wait;
/* Starts a wait of at most timeout_ns (<0, or too long to represent: forever). */
void mtc_arena_wait_init(mtc_arena_wait *w, int64_t timeout_ns);
/* The waiting path in slices, for a caller that checks for signals between
 * them: tries, and waits for frees for at most slice_ns (<0: no slice limit).
 * 0 and *off; -ETIMEDOUT once the deadline passed (counted once); -EAGAIN
 * when the slice ended, or a signal interrupted the wait, with no room yet
 * (call again with the same w); -E2BIG, -EINVAL as mtc_arena_try_alloc. */
int mtc_arena_alloc_slice(mtc_arena *a, uint64_t nbytes, uint32_t owner, mtc_arena_wait *w, int64_t slice_ns,
                          uint64_t *off);
/* Checks that [off, off+nbytes) is exactly inside one region headed at off
 * and owned by `owner`: 0, or -EINVAL. */
int mtc_arena_check(mtc_arena *a, uint64_t off, uint64_t nbytes, uint32_t owner);
/* Moves a region from owner `from` to `to` (the main process takes over a
 * region a worker handed it). 0, or -EINVAL when it is not from's region. */
int mtc_arena_retag(mtc_arena *a, uint64_t off, uint32_t from, uint32_t to);
/* Frees the region headed at off if `owner` owns it. 0 or -EINVAL. */
int mtc_arena_free(mtc_arena *a, uint64_t off, uint32_t owner);
/* Frees every slot owned by a process that exited (gone, or a zombie not yet
 * reaped: a worker that died); returns the number of slots freed. `keep` is
 * never reclaimed. */
uint64_t mtc_arena_reclaim_dead(mtc_arena *a, uint32_t keep);
/* 1 when the process that created the arena (the one that consumes its
 * regions: the training process) has exited or is a zombie, else 0. A worker
 * that waits for room calls it between slices: room would never come. */
int mtc_arena_creator_gone(const mtc_arena *a);

/* 1 when process `pid` has exited (gone, or a zombie not yet reaped), else 0. */
int mtc_arena_pid_gone(uint32_t pid);
/* Frees every slot owned by `owner`; returns slots freed. */
uint64_t mtc_arena_reclaim_owner(mtc_arena *a, uint32_t owner);
void mtc_arena_get_stats(mtc_arena *a, mtc_arena_stats *out);
/* Who holds the arena's slots now, for an error message (a racy snapshot of
 * untrusted words, for messages only): the regions and slots
 * owned by `owner`, and by every other process. */
typedef struct mtc_arena_usage_t {
    uint64_t owner_regions, owner_slots, other_regions, other_slots;
} mtc_arena_usage_t;
void mtc_arena_usage(mtc_arena *a, uint32_t owner, mtc_arena_usage_t *u);
/* Invariant checker (tests; quiescent arena): 1 valid, 0 broken. */
int mtc_arena_valid(mtc_arena *a);

#endif /* MTC_ARENA_H */
