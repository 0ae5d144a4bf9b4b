/*
 * slab.c - pinned slab allocator: the pool's allocation paths, release,
 * fences, claims and drain (see slab.h for the contract). The size classes
 * and idle lists are in slablist.c, the cap and the numbers in slabcap.c.
 *
 * Design notes:
 *  - Anything slow (pinning, unpinning, fence create/destroy/wait) runs with
 *    the lock dropped.  The state a slab is in while the lock is dropped is
 *    explicit (claimed / dying) and counted in bytes_held, and pins in flight
 *    are counted in bytes_reserved, so the cap check "held + reserved + cb
 *    <= cap" made under the lock bounds the memory really pinned at any
 *    instant, whatever the other threads do meanwhile.
 *  - A thread waiting for a fence first takes the slab off its list
 *    (claims it).  Nobody else can then reuse, evict or destroy the fence it
 *    sleeps on, and two waiters never pick the same fence.
 */
#include "slab.h"

#include <errno.h>
#include <stdlib.h>

#include "slabcap.h"
#include "slablist.h"

/*
 * Pins a fresh slab of class cls (size cb) and hands it out in *out.  The
 * bytes are reserved before the lock is dropped so that concurrent
 * allocators see them as taken.  Returns 0, or -ENOMEM / the host_alloc
 * error (reservation returned, pool unchanged).
 * Precondition: lock held and held + reserved + cb <= cap; returns with it held.
 */
static int _slab_grow(mtc_slab_pool *p, int cls, size_t cb, mtc_slab **out)
{
    mtc_slab *s;
    void *ptr = NULL;
    int rc;

    p->bytes_reserved += cb;
    pthread_mutex_unlock(&p->mu);
    s = calloc(1, sizeof *s);
    rc = s ? p->ops.host_alloc(p->ops.ctx, cb, &ptr) : -ENOMEM;
    if (rc >= 0 && !ptr)
        rc = -ENOMEM;
    if (rc < 0)
        free(s);
    pthread_mutex_lock(&p->mu);
    p->bytes_reserved -= cb;
    if (rc < 0) {
        mtc_slablist_wake(p);   /* the reservation may have been what a waiter lacked */
        return rc;
    }
    s->ptr = ptr;
    s->bytes = cb;
    s->cls = cls;
    p->bytes_held += cb;
    p->slabs_held++;
    if (p->bytes_held > p->bytes_high_water)
        p->bytes_high_water = p->bytes_held;
    p->allocs++;
    mtc_slablist_hand_out(p, s);
    *out = s;
    return 0;
}

/*
 * Claims idle slab s, waits for its fence with the lock dropped, and
 * unclaims it.  On return s is on no list and counted nowhere: the caller
 * must either mtc_slablist_hand_out it or mtc_slablist_insert_sorted it back.  Returns 0
 * (fence completed; s->fenced cleared) or the fence_wait error (s stays
 * armed).  Precondition: lock held, s idle and armed; returns with it held.
 */
static int _slab_wait_claimed(mtc_slab_pool *p, mtc_slab *s)
{
    mtc_slab **pp;
    int rc;

    mtc_slablist_unlink_find(p, s);
    s->next = p->claimed;
    p->claimed = s;
    p->bytes_claimed += s->bytes;
    p->slabs_claimed++;

    pthread_mutex_unlock(&p->mu);
    rc = p->ops.fence_wait(p->ops.ctx, s->fence);
    pthread_mutex_lock(&p->mu);

    for (pp = &p->claimed; *pp != s; pp = &(*pp)->next)
        ;
    *pp = s->next;
    s->next = NULL;
    p->bytes_claimed -= s->bytes;
    p->slabs_claimed--;
    if (rc == 0)
        s->fenced = 0;
    mtc_slablist_wake(p);   /* drain may be waiting for this claim to end */
    return rc;
}

/* 1 if a claimed slab with release_seq <= max_seq still has its fence armed. Lock held. */
static int _slab_claim_pending(mtc_slab_pool *p, uint64_t max_seq)
{
    mtc_slab *s;

    for (s = p->claimed; s; s = s->next)
        if (s->fenced && s->release_seq <= max_seq)
            return 1;
    return 0;
}

/*
 * Shared body of try_alloc and alloc; may_wait selects the waiting path.
 * Each loop turn re-reads the pool state, since every path that drops the
 * lock (pin, free, wait) lets other threads change it.
 * Returns as mtc_slab_try_alloc / mtc_slab_alloc.
 */
static int _slab_alloc(mtc_slab_pool *p, size_t bytes, mtc_slab **out, int may_wait)
{
    size_t cb = mtc_slab_class_bytes(bytes);
    int cls = mtc_slablist_class_index(cb);
    int rc = 0, waited = 0;
    mtc_slab *s, *dying;
    uint64_t need;
    int64_t got;

    if (!p || !out)
        return -EINVAL;
    *out = NULL;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        if (cls < 0 || cb > p->cap) {
            rc = -E2BIG;
            break;
        }
        s = mtc_slablist_take_settled(p, cls, &rc);
        if (rc < 0)
            break;
        if (s) {
            mtc_slablist_hand_out(p, s);
            p->reuses++;
            *out = s;
            break;
        }
        if (p->bytes_held + p->bytes_reserved + cb <= p->cap) {
            rc = _slab_grow(p, cls, cb, out);
            break;
        }

        need = p->bytes_held + p->bytes_reserved + cb - p->cap;
        dying = NULL;
        got = mtc_slabcap_pick_victims(p, need, 1, &dying);
        if (got < 0) {
            rc = (int)got;
            break;
        }
        if (dying) {
            /* Room made; retry from the top rather than pin at once: while
             * the lock was dropped another thread may have taken the room,
             * or released a slab of our class. */
            mtc_slabcap_free_dying(p, dying, 1);
            continue;
        }

        if (!may_wait) {
            rc = -EAGAIN;
            break;
        }
        if (!waited) {
            p->waits++;
            waited = 1;
        }
        s = mtc_slablist_oldest_armed(p, UINT64_MAX);
        if (s) {
            rc = _slab_wait_claimed(p, s);
            if (rc == 0 && s->cls == cls) {
                mtc_slablist_hand_out(p, s);
                p->reuses++;
                *out = s;
                break;
            }
            mtc_slablist_insert_sorted(p, s);
            if (rc < 0)
                break;
            continue;
        }
        /* Nothing in flight to wait on: the room is held by slabs in use,
         * by other threads' pins or frees, or by fences another thread is
         * already waiting on.  Each of those ends with a wake. */
        mtc_slablist_cond_wait(p);
    }
    pthread_mutex_unlock(&p->mu);
    return rc;
}

int mtc_slab_try_alloc(mtc_slab_pool *p, size_t bytes, mtc_slab **out)
{
    return _slab_alloc(p, bytes, out, 0);
}

int mtc_slab_alloc(mtc_slab_pool *p, size_t bytes, mtc_slab **out)
{
    return _slab_alloc(p, bytes, out, 1);
}

void mtc_slab_release(mtc_slab_pool *p, mtc_slab *s, int fenced)
{
    int c;

    if (!p || !s)
        return;
    pthread_mutex_lock(&p->mu);
    if (s->next != MTC_SLAB_IN_USE) {
        pthread_mutex_unlock(&p->mu);
        return;
    }
    c = s->cls;
    p->bytes_in_use -= s->bytes;
    p->slabs_in_use--;
    /* A fenced release without a fence has nothing to wait on: the caller
     * broke the protocol, and treating it as unfenced is all we can do. */
    s->fenced = (fenced && s->fence) ? 1 : 0;
    s->release_seq = ++p->seq;
    s->next = NULL;
    if (p->tail[c])
        p->tail[c]->next = s;
    else
        p->head[c] = s;
    p->tail[c] = s;
    p->bytes_idle += s->bytes;
    p->slabs_idle++;
    mtc_slablist_wake(p);
    pthread_mutex_unlock(&p->mu);
}

int mtc_slab_fence(mtc_slab_pool *p, mtc_slab *s, void **out)
{
    void *f = NULL;
    int rc;

    if (!p || !s || !out)
        return -EINVAL;
    /* No lock: an in-use slab belongs to its holder, and the pool reads
     * s->fence only after mtc_slab_release, whose lock orders this write. */
    if (!s->fence) {
        rc = p->ops.fence_create(p->ops.ctx, &f);
        if (rc < 0)
            return rc;
        if (!f)
            return -ENOMEM;
        s->fence = f;
    }
    *out = s->fence;
    return 0;
}

int mtc_slab_drain(mtc_slab_pool *p)
{
    uint64_t snap;
    mtc_slab *s;
    int rc = 0;

    if (!p)
        return -EINVAL;
    pthread_mutex_lock(&p->mu);
    /* Only slabs released before the call: a stream of later releases
     * must not keep drain from returning. */
    snap = p->seq;
    for (;;) {
        s = mtc_slablist_oldest_armed(p, snap);
        if (s) {
            rc = _slab_wait_claimed(p, s);
            mtc_slablist_insert_sorted(p, s);
            if (rc < 0)
                break;
            continue;
        }
        if (!_slab_claim_pending(p, snap))
            break;
        mtc_slablist_cond_wait(p);   /* another thread is waiting on that fence */
    }
    pthread_mutex_unlock(&p->mu);
    return rc;
}

int mtc_slab_pool_init(mtc_slab_pool *p, const mtc_slab_ops *ops, size_t cap_bytes)
{
    int rc, c;

    if (!p || !ops || cap_bytes == 0 || !ops->host_alloc || !ops->host_free ||
        !ops->fence_create || !ops->fence_destroy || !ops->fence_query || !ops->fence_wait)
        return -EINVAL;
    rc = pthread_mutex_init(&p->mu, NULL);
    if (rc)
        return -rc;
    rc = pthread_cond_init(&p->cv, NULL);
    if (rc) {
        pthread_mutex_destroy(&p->mu);
        return -rc;
    }
    p->ops = *ops;
    for (c = 0; c < MTC_SLAB_NCLASSES; c++) {
        p->head[c] = NULL;
        p->tail[c] = NULL;
    }
    p->claimed = NULL;
    p->cap = cap_bytes;
    p->held_limit = cap_bytes;
    p->seq = 0;
    p->bytes_held = p->bytes_reserved = p->bytes_in_use = p->bytes_idle = 0;
    p->bytes_claimed = p->bytes_dying = p->bytes_high_water = 0;
    p->slabs_held = p->slabs_in_use = p->slabs_idle = p->slabs_claimed = p->slabs_dying = 0;
    p->allocs = p->reuses = p->waits = p->evictions = 0;
    p->cond_waiters = 0;
    return 0;
}

void mtc_slab_pool_destroy(mtc_slab_pool *p)
{
    mtc_slab *s, *nxt;
    int c;

    if (!p)
        return;
    /* No lock: the precondition rules out any concurrent call, and
     * fence_wait must not run under it anyway. */
    for (c = 0; c < MTC_SLAB_NCLASSES; c++) {
        for (s = p->head[c]; s; s = nxt) {
            nxt = s->next;
            /* The DMA may still read this memory: unpinning it first would
             * be a use-after-free on the device side. */
            if (s->fenced)
                (void)p->ops.fence_wait(p->ops.ctx, s->fence);
            if (s->fence)
                p->ops.fence_destroy(p->ops.ctx, s->fence);
            p->ops.host_free(p->ops.ctx, s->ptr, s->bytes);
            free(s);
        }
        p->head[c] = p->tail[c] = NULL;
    }
    p->bytes_held = p->bytes_idle = 0;
    p->slabs_held = p->slabs_idle = 0;
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->mu);
}
