/*
 * slab.h - pinned slab allocator: page-locked host buffers in power-of-two
 * size classes, reused only once the DMA that last read them has finished.
 *
 * The transfer thread takes a slab, memcpys into it, issues an async copy
 * from it, records the slab's fence (a CUDA event) and releases it.  A
 * released slab waits on its free list until its fence completes; only then
 * may it be handed out again or freed.  A cap on pinned bytes turns memory
 * pressure into backpressure: at the cap the pool first frees idle,
 * fence-completed slabs of other classes, then (mtc_slab_alloc only) waits
 * for the oldest in-flight fence.  The pool never pins more than the cap.
 *
 * The pool knows nothing of CUDA: pinning and fences come through
 * mtc_slab_ops, so unit tests drive it with malloc and fake fences.
 *
 * The allocator is three files: slab.c (allocation paths, release, fences,
 * claims, drain, init/destroy), slablist.c (size classes and idle lists:
 * slablist.h) and slabcap.c (eviction under the cap, trim, set_cap, stats,
 * the invariant checker: slabcap.h).  This header is the whole public API.
 *
 * Conventions: public names are mtc_slab_*; helpers shared by the three
 * files are mtc_slablist_* / mtc_slabcap_* (internal to the allocator),
 * helpers internal to one file are static and start with '_'.  Errors are
 * negative errno values; no function here touches Python.
 *
 * Locking: one pthread mutex per pool guards everything; it is a leaf lock.
 * Only ops->fence_query is called with it held (so it must be cheap, must not
 * block and must not call back into the pool).  host_alloc, host_free,
 * fence_create, fence_destroy and fence_wait are always called without it,
 * so a thread stuck in a long pin or a fence wait never stalls other
 * threads' releases.
 */
#ifndef MTC_SLAB_H
#define MTC_SLAB_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#define MTC_SLAB_MIN_BYTES (64u * 1024u)
#define MTC_SLAB_NCLASSES 40

typedef struct mtc_slab_ops {
    void *ctx;
    /* pin/allocate `bytes` of page-locked host memory; 0 or a negative error code */
    int  (*host_alloc)(void *ctx, size_t bytes, void **out);
    void (*host_free)(void *ctx, void *ptr, size_t bytes);
    int  (*fence_create)(void *ctx, void **out);        /* 0 or negative */
    void (*fence_destroy)(void *ctx, void *fence);
    int  (*fence_query)(void *ctx, void *fence);        /* 1 completed, 0 pending, negative error */
    int  (*fence_wait)(void *ctx, void *fence);         /* blocks until completed; 0 or negative */
} mtc_slab_ops;

typedef struct mtc_slab {
    void   *ptr;        /* page-locked memory, `bytes` long */
    size_t  bytes;      /* the class size (a power of two >= MTC_SLAB_MIN_BYTES) */
    void   *fence;      /* created lazily by the pool on first release with a fence; the user records it (e.g. cuEventRecord) before mtc_slab_release(..., fenced=1) */
    int     cls;        /* size class index */
    int     fenced;     /* internal: fence armed at release */
    uint64_t release_seq; /* internal: order of release, oldest waited first */
    struct mtc_slab *next; /* internal list link */
} mtc_slab;

typedef struct mtc_slab_stats {
    uint64_t bytes_held;      /* pinned bytes currently allocated from host_alloc */
    uint64_t bytes_in_use;    /* bytes of slabs handed out and not yet released */
    uint64_t bytes_high_water;/* max bytes_held ever */
    uint64_t cap_bytes;
    uint64_t slabs_held, slabs_in_use;
    uint64_t allocs;          /* fresh host_alloc calls */
    uint64_t reuses;          /* requests served by a cached slab */
    uint64_t waits;           /* times a request waited on a fence because of the cap (backpressure) */
    uint64_t evictions;       /* idle slabs freed to make room under the cap */
} mtc_slab_stats;

/*
 * Every slab the pool has pinned is in exactly one state:
 *   idle     on head[cls] (oldest release first), fence maybe still pending
 *   claimed  on `claimed`: off its list while one thread waits on its fence
 *   in use   handed out (s->next is a private marker, on no list)
 *   dying    unlinked and being freed outside the lock (still pinned)
 * bytes_held counts all four; bytes_reserved counts pins in flight.
 * Invariant (outside set_cap lowering): bytes_held + bytes_reserved <= cap.
 */
typedef struct mtc_slab_pool {
    pthread_mutex_t mu;
    pthread_cond_t  cv;            /* room may have appeared, or a claim ended */
    mtc_slab_ops    ops;
    mtc_slab       *head[MTC_SLAB_NCLASSES];
    mtc_slab       *tail[MTC_SLAB_NCLASSES];
    mtc_slab       *claimed;
    uint64_t cap;
    uint64_t held_limit;           /* what bytes_held+bytes_reserved may reach after a cap cut */
    uint64_t seq;                  /* last release_seq handed out */
    uint64_t bytes_held, bytes_reserved, bytes_in_use, bytes_idle;
    uint64_t bytes_claimed, bytes_dying, bytes_high_water;
    uint64_t slabs_held, slabs_in_use, slabs_idle, slabs_claimed, slabs_dying;
    uint64_t allocs, reuses, waits, evictions;
    unsigned cond_waiters;         /* threads in pthread_cond_wait on cv */
} mtc_slab_pool;

/*
 * Sets up an empty pool that will never hold more than cap_bytes pinned.
 * The ops table is copied.  Returns 0; -EINVAL if cap_bytes is 0, ops is NULL
 * or any op is NULL; or -errno from the pthread init calls.
 */
int  mtc_slab_pool_init(mtc_slab_pool *p, const mtc_slab_ops *ops, size_t cap_bytes);

/*
 * Waits for every pending fence, then frees all slabs and fences and the
 * pool's lock.  Preconditions: no slab in use, no other call on the pool in
 * progress or to come.  Fence-wait errors are ignored: the memory is freed
 * regardless, as nothing better can be done with it at teardown.
 */
void mtc_slab_pool_destroy(mtc_slab_pool *p);

/*
 * The class size a request of `bytes` gets: the smallest power of two
 * >= max(bytes, MTC_SLAB_MIN_BYTES); 0 if that exceeds the largest class
 * (MTC_SLAB_MIN_BYTES << (MTC_SLAB_NCLASSES - 1)) or size_t.
 */
size_t mtc_slab_class_bytes(size_t bytes);

/*
 * Try-path: never waits on a fence or for another thread's release.
 * Order: an idle slab of the exact class whose fence completed (oldest
 * release first); else a fresh pin if under the cap; else evict idle
 * completed slabs of other classes (least recently released first, only if
 * that makes enough room) and pin.  Returns 0 with *out set; -EAGAIN when
 * the cap leaves no room without waiting; -E2BIG when the class size exceeds
 * the cap (or the largest class); -EINVAL on NULL arguments; other negative
 * from host_alloc or fence_query.  May block in host_alloc / host_free.
 */
int  mtc_slab_try_alloc(mtc_slab_pool *p, size_t bytes, mtc_slab **out);

/*
 * Waiting path: like try_alloc, but where that would return -EAGAIN it waits
 * (never holding the pool lock) for the oldest in-flight fence of any class,
 * or, when none is in flight, for another thread to release a slab or finish
 * a pin/free, then retries.  `waits` counts each request that had to wait at
 * least once.  Returns 0, -E2BIG, -EINVAL, or an error from the ops.
 * Blocks forever if the whole cap is held by slabs in use that are never
 * released (e.g. the caller itself holds them all).
 */
int  mtc_slab_alloc(mtc_slab_pool *p, size_t bytes, mtc_slab **out);

/*
 * Gives a slab back.  fenced=1: the caller recorded s->fence after its last
 * use (get it with mtc_slab_fence first); the slab is reused or freed only
 * after fence_query says completed.  fenced=0 (or no fence was ever
 * created): reusable at once.  Never blocks except on the pool lock, never
 * calls an op.  Releasing a slab that is not in use (double release) is
 * ignored, which keeps the lists intact but cannot catch a release of a slab
 * already re-handed to someone else.
 */
void mtc_slab_release(mtc_slab_pool *p, mtc_slab *s, int fenced);

/*
 * Puts the fence of in-use slab s in *out, creating it (fence_create,
 * without the pool lock) on first use; it stays with the slab for life.
 * Precondition: the caller holds s (in use).  Returns 0, -EINVAL, or the
 * error from fence_create.
 */
int  mtc_slab_fence(mtc_slab_pool *p, mtc_slab *s, void **out);

/*
 * Frees every idle slab whose fence has completed (queried, never waited).
 * Returns the bytes freed.  Not counted as evictions.
 */
size_t mtc_slab_trim(mtc_slab_pool *p);

/*
 * Blocks until the fence of every slab released before the call completed
 * (e.g. before process exit or a context teardown).  Returns 0 or the first
 * fence_wait error.
 */
int  mtc_slab_drain(mtc_slab_pool *p);

/* Snapshot of the pool's numbers, consistent with each other (taken under the lock). */
void mtc_slab_get_stats(mtc_slab_pool *p, mtc_slab_stats *out);

/*
 * Changes the cap.  Lowering it frees idle completed slabs (least recently
 * released first, counted as evictions) until bytes held fit, as far as
 * possible now; slabs in use or with pending fences are shed later, as
 * allocations evict or mtc_slab_trim runs.  No new pin happens while over
 * the cap.  Returns 0, or -EINVAL for a cap of 0 or a NULL pool.
 */
int  mtc_slab_set_cap(mtc_slab_pool *p, size_t cap_bytes);

/*
 * Invariant checker (tests, debug builds): 1 valid, 0 broken.  Checks that
 * byte and slab counts match the lists, bytes held + reserved stay within the
 * cap (or the post-cut limit), every listed slab's class and size agree,
 * lists are in release order with consistent tails, and no slab is on two
 * lists.  Takes the lock; O(idle slabs).
 */
int  mtc_slab_valid(mtc_slab_pool *p);

#endif /* MTC_SLAB_H */
