/*
 * slab.c - pinned slab allocator (see slab.h for the contract).
 *
 * Design notes:
 *  - Each class keeps a singly linked FIFO of idle slabs in release order:
 *    release appends at the tail and reuse scans from the head, so the slab
 *    whose fence had the longest time to complete is tried first.
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

/* s->next of a slab in use: tells a double release apart from a real one. */
static mtc_slab _slab_in_use_mark;
#define _SLAB_IN_USE (&_slab_in_use_mark)

/*
 * Class index of class size cb (a value mtc_slab_class_bytes returned).
 * Returns 0..MTC_SLAB_NCLASSES-1, or -1 for 0.
 */
static int _slab_class_index(size_t cb)
{
    uint64_t c = MTC_SLAB_MIN_BYTES;
    int i;

    for (i = 0; i < MTC_SLAB_NCLASSES; i++, c <<= 1)
        if ((uint64_t)cb == c)
            return i;
    return -1;
}

size_t mtc_slab_class_bytes(size_t bytes)
{
    uint64_t c = MTC_SLAB_MIN_BYTES;
    int i;

    /* 64-bit arithmetic so the largest classes cannot wrap a 32-bit size_t. */
    for (i = 0; i < MTC_SLAB_NCLASSES; i++, c <<= 1)
        if ((uint64_t)bytes <= c)
            return c <= (uint64_t)SIZE_MAX ? (size_t)c : 0;
    return 0;
}

/*
 * Wakes threads parked in pthread_cond_wait.  Precondition: lock held.
 * Skipped when nobody waits, so the common release stays syscall-free.
 */
static void _slab_wake(mtc_slab_pool *p)
{
    if (p->cond_waiters)
        pthread_cond_broadcast(&p->cv);
}

/*
 * 1 if idle slab s may be reused or freed (no fence armed, or fence_query
 * says completed), 0 if its fence is pending, negative on a query error.
 * A completion is remembered in s->fenced so each fence is queried until it
 * completes and never after.  Precondition: lock held.
 */
static int _slab_settled(mtc_slab_pool *p, mtc_slab *s)
{
    int q;

    if (!s->fenced)
        return 1;
    q = p->ops.fence_query(p->ops.ctx, s->fence);
    if (q > 0) {
        s->fenced = 0;
        return 1;
    }
    return q;
}

/*
 * Removes s from its idle list given its predecessor (NULL at the head) and
 * moves it out of the idle counts.  Precondition: lock held, s idle.
 */
static void _slab_unlink(mtc_slab_pool *p, mtc_slab *prev, mtc_slab *s)
{
    int c = s->cls;

    if (prev)
        prev->next = s->next;
    else
        p->head[c] = s->next;
    if (p->tail[c] == s)
        p->tail[c] = prev;
    s->next = NULL;
    p->bytes_idle -= s->bytes;
    p->slabs_idle--;
}

/*
 * Like _slab_unlink when the predecessor is not at hand: finds it by
 * walking the list.  Precondition: lock held, s on its idle list.
 */
static void _slab_unlink_find(mtc_slab_pool *p, mtc_slab *s)
{
    mtc_slab *prev = NULL, *it;

    for (it = p->head[s->cls]; it && it != s; it = it->next)
        prev = it;
    _slab_unlink(p, prev, s);
}

/*
 * Puts idle slab s on its list at the place its release_seq says, so a slab
 * coming back from a claim keeps its LRU rank (usually it is the oldest and
 * goes to the head).  Precondition: lock held, s on no list.
 */
static void _slab_insert_sorted(mtc_slab_pool *p, mtc_slab *s)
{
    int c = s->cls;
    mtc_slab *prev = NULL, *it;

    for (it = p->head[c]; it && it->release_seq < s->release_seq; it = it->next)
        prev = it;
    s->next = it;
    if (prev)
        prev->next = s;
    else
        p->head[c] = s;
    if (!it)
        p->tail[c] = s;
    p->bytes_idle += s->bytes;
    p->slabs_idle++;
}

/*
 * Marks s handed out and counts it in use.  Precondition: lock held, s on no
 * list and not counted idle/claimed any more.
 */
static void _slab_hand_out(mtc_slab_pool *p, mtc_slab *s)
{
    s->next = _SLAB_IN_USE;
    s->fenced = 0;
    p->bytes_in_use += s->bytes;
    p->slabs_in_use++;
}

/*
 * Takes the oldest idle slab of class cls whose fence completed.  Returns it
 * (unlinked, not yet counted in use) or NULL; *rc gets 0 or a fence_query
 * error.  Queries every pending fence of the class: fences of different
 * streams need not complete in release order.  Precondition: lock held.
 */
static mtc_slab *_slab_take_settled(mtc_slab_pool *p, int cls, int *rc)
{
    mtc_slab *prev = NULL, *s;
    int q;

    *rc = 0;
    for (s = p->head[cls]; s; prev = s, s = s->next) {
        q = _slab_settled(p, s);
        if (q < 0) {
            *rc = q;
            return NULL;
        }
        if (q) {
            _slab_unlink(p, prev, s);
            return s;
        }
    }
    return NULL;
}

/*
 * Moves idle completed slabs onto *dying, least recently released first
 * (a merge of the per-class lists by release_seq), until at least `need`
 * bytes are chosen.  all_or_nothing: choose none unless `need` can be met,
 * so an allocation that must wait anyway does not throw away reusable slabs.
 * Returns the bytes chosen, or a negative fence_query error (nothing chosen).
 * Chosen slabs are counted dying (still held).  Precondition: lock held.
 */
static int64_t _slab_pick_victims(mtc_slab_pool *p, uint64_t need, int all_or_nothing,
                                  mtc_slab **dying)
{
    mtc_slab *prev[MTC_SLAB_NCLASSES], *cur[MTC_SLAB_NCLASSES];
    mtc_slab *s, *nxt;
    uint64_t avail = 0, got = 0;
    int c, best, q;

    /* Query first: after this pass s->fenced == 0 means settled. */
    for (c = 0; c < MTC_SLAB_NCLASSES; c++) {
        for (s = p->head[c]; s; s = s->next) {
            q = _slab_settled(p, s);
            if (q < 0)
                return q;
            if (q)
                avail += s->bytes;
        }
    }
    if (all_or_nothing && avail < need)
        return 0;

    for (c = 0; c < MTC_SLAB_NCLASSES; c++) {
        prev[c] = NULL;
        for (cur[c] = p->head[c]; cur[c] && cur[c]->fenced; cur[c] = cur[c]->next)
            prev[c] = cur[c];
    }
    while (got < need) {
        best = -1;
        for (c = 0; c < MTC_SLAB_NCLASSES; c++)
            if (cur[c] && (best < 0 || cur[c]->release_seq < cur[best]->release_seq))
                best = c;
        if (best < 0)
            break;
        s = cur[best];
        nxt = s->next;
        _slab_unlink(p, prev[best], s);   /* prev[best] now precedes nxt */
        for (cur[best] = nxt; cur[best] && cur[best]->fenced; cur[best] = cur[best]->next)
            prev[best] = cur[best];
        s->next = *dying;
        *dying = s;
        p->bytes_dying += s->bytes;
        p->slabs_dying++;
        got += s->bytes;
    }
    return (int64_t)got;
}

/*
 * Frees a list of dying slabs: drops the lock for fence_destroy / host_free
 * (unpinning can take milliseconds), then retakes it and only now lowers
 * bytes_held, since the memory stayed pinned until host_free returned.
 * Counts them as evictions if asked.  Returns the bytes freed.
 * Precondition: lock held; returns with it held.
 */
static uint64_t _slab_free_dying(mtc_slab_pool *p, mtc_slab *dying, int count_evictions)
{
    mtc_slab *s, *nxt;
    uint64_t bytes = 0, n = 0;

    pthread_mutex_unlock(&p->mu);
    for (s = dying; s; s = nxt) {
        nxt = s->next;
        if (s->fence)
            p->ops.fence_destroy(p->ops.ctx, s->fence);
        p->ops.host_free(p->ops.ctx, s->ptr, s->bytes);
        bytes += s->bytes;
        n++;
        free(s);
    }
    pthread_mutex_lock(&p->mu);
    p->bytes_held -= bytes;
    p->slabs_held -= n;
    p->bytes_dying -= bytes;
    p->slabs_dying -= n;
    if (count_evictions)
        p->evictions += n;
    /* Back under the cap after a cut: the strict invariant applies again. */
    if (p->bytes_held + p->bytes_reserved <= p->cap)
        p->held_limit = p->cap;
    _slab_wake(p);
    return bytes;
}

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
        _slab_wake(p);   /* the reservation may have been what a waiter lacked */
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
    _slab_hand_out(p, s);
    *out = s;
    return 0;
}

/*
 * The idle slab with the oldest armed fence (fenced == 1, not yet seen
 * completed) whose release_seq <= max_seq, or NULL.  Lists are in release
 * order, so only the first armed slab of each list is a candidate.
 * Precondition: lock held.
 */
static mtc_slab *_slab_oldest_armed(mtc_slab_pool *p, uint64_t max_seq)
{
    mtc_slab *best = NULL, *s;
    int c;

    for (c = 0; c < MTC_SLAB_NCLASSES; c++) {
        for (s = p->head[c]; s && !s->fenced; s = s->next)
            ;
        if (s && s->release_seq <= max_seq && (!best || s->release_seq < best->release_seq))
            best = s;
    }
    return best;
}

/*
 * Claims idle slab s, waits for its fence with the lock dropped, and
 * unclaims it.  On return s is on no list and counted nowhere: the caller
 * must either _slab_hand_out it or _slab_insert_sorted it back.  Returns 0
 * (fence completed; s->fenced cleared) or the fence_wait error (s stays
 * armed).  Precondition: lock held, s idle and armed; returns with it held.
 */
static int _slab_wait_claimed(mtc_slab_pool *p, mtc_slab *s)
{
    mtc_slab **pp;
    int rc;

    _slab_unlink_find(p, s);
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
    _slab_wake(p);   /* drain may be waiting for this claim to end */
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

/* Parks on the pool condvar (drops the lock while asleep). Lock held. */
static void _slab_cond_wait(mtc_slab_pool *p)
{
    p->cond_waiters++;
    pthread_cond_wait(&p->cv, &p->mu);
    p->cond_waiters--;
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
    int cls = _slab_class_index(cb);
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
        s = _slab_take_settled(p, cls, &rc);
        if (rc < 0)
            break;
        if (s) {
            _slab_hand_out(p, s);
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
        got = _slab_pick_victims(p, need, 1, &dying);
        if (got < 0) {
            rc = (int)got;
            break;
        }
        if (dying) {
            /* Room made; retry from the top rather than pin at once: while
             * the lock was dropped another thread may have taken the room,
             * or released a slab of our class. */
            _slab_free_dying(p, dying, 1);
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
        s = _slab_oldest_armed(p, UINT64_MAX);
        if (s) {
            rc = _slab_wait_claimed(p, s);
            if (rc == 0 && s->cls == cls) {
                _slab_hand_out(p, s);
                p->reuses++;
                *out = s;
                break;
            }
            _slab_insert_sorted(p, s);
            if (rc < 0)
                break;
            continue;
        }
        /* Nothing in flight to wait on: the room is held by slabs in use,
         * by other threads' pins or frees, or by fences another thread is
         * already waiting on.  Each of those ends with a wake. */
        _slab_cond_wait(p);
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
    if (s->next != _SLAB_IN_USE) {
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
    _slab_wake(p);
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

size_t mtc_slab_trim(mtc_slab_pool *p)
{
    mtc_slab *dying = NULL;
    uint64_t freed = 0;

    if (!p)
        return 0;
    pthread_mutex_lock(&p->mu);
    /* A query error leaves that slab (and the rest) in place: trim is
     * best-effort and has no error channel. */
    if (_slab_pick_victims(p, UINT64_MAX, 0, &dying) > 0 && dying)
        freed = _slab_free_dying(p, dying, 0);
    pthread_mutex_unlock(&p->mu);
    return (size_t)freed;
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
        s = _slab_oldest_armed(p, snap);
        if (s) {
            rc = _slab_wait_claimed(p, s);
            _slab_insert_sorted(p, s);
            if (rc < 0)
                break;
            continue;
        }
        if (!_slab_claim_pending(p, snap))
            break;
        _slab_cond_wait(p);   /* another thread is waiting on that fence */
    }
    pthread_mutex_unlock(&p->mu);
    return rc;
}

void mtc_slab_get_stats(mtc_slab_pool *p, mtc_slab_stats *out)
{
    if (!p || !out)
        return;
    pthread_mutex_lock(&p->mu);
    out->bytes_held = p->bytes_held;
    out->bytes_in_use = p->bytes_in_use;
    out->bytes_high_water = p->bytes_high_water;
    out->cap_bytes = p->cap;
    out->slabs_held = p->slabs_held;
    out->slabs_in_use = p->slabs_in_use;
    out->allocs = p->allocs;
    out->reuses = p->reuses;
    out->waits = p->waits;
    out->evictions = p->evictions;
    pthread_mutex_unlock(&p->mu);
}

int mtc_slab_set_cap(mtc_slab_pool *p, size_t cap_bytes)
{
    mtc_slab *dying = NULL;
    uint64_t used;

    if (!p || cap_bytes == 0)
        return -EINVAL;
    pthread_mutex_lock(&p->mu);
    p->cap = cap_bytes;
    used = p->bytes_held + p->bytes_reserved;
    /* Set before dropping the lock in the free below: a concurrent
     * mtc_slab_valid must accept the excess the cut left behind. */
    p->held_limit = used > p->cap ? used : p->cap;
    if (used > p->cap && _slab_pick_victims(p, used - p->cap, 0, &dying) > 0 && dying)
        _slab_free_dying(p, dying, 1);
    _slab_wake(p);   /* a raise may unblock waiters; a cut may make them -E2BIG */
    pthread_mutex_unlock(&p->mu);
    return 0;
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

/*
 * Walks one list (idle list of class `want_cls`, or the claimed list when
 * want_cls < 0), checking each slab and adding up bytes/slabs.  `limit`
 * bounds the walk so a cycle shows as an error instead of a hang.  *last
 * gets the final node.  Returns 1 if consistent.  Lock held.
 */
static int _slab_check_list(mtc_slab *head, int want_cls, uint64_t limit,
                            uint64_t *bytes, uint64_t *n, mtc_slab **last)
{
    mtc_slab *s;
    uint64_t prev_seq = 0;

    *last = NULL;
    for (s = head; s; s = s->next) {
        if (s == _SLAB_IN_USE || ++*n > limit)
            return 0;
        if (s->cls < 0 || s->cls >= MTC_SLAB_NCLASSES || !s->ptr)
            return 0;
        if (s->bytes != mtc_slab_class_bytes(s->bytes) || _slab_class_index(s->bytes) != s->cls)
            return 0;
        if (s->fenced != 0 && s->fenced != 1)
            return 0;
        if (s->fenced && !s->fence)
            return 0;
        if (want_cls >= 0) {
            if (s->cls != want_cls)
                return 0;
            if (*last && s->release_seq <= prev_seq)
                return 0;
        }
        prev_seq = s->release_seq;
        *bytes += s->bytes;
        *last = s;
    }
    return 1;
}

int mtc_slab_valid(mtc_slab_pool *p)
{
    mtc_slab *lasts[MTC_SLAB_NCLASSES + 1], *last;
    uint64_t ib = 0, in = 0, cb = 0, cn = 0, limit;
    int c, i, j, nl = 0, ok = 1;

    if (!p)
        return 0;
    pthread_mutex_lock(&p->mu);
    limit = p->slabs_held;
    for (c = 0; c < MTC_SLAB_NCLASSES && ok; c++) {
        ok = _slab_check_list(p->head[c], c, limit, &ib, &in, &last);
        if (ok && last != p->tail[c])
            ok = 0;
        if (ok && last)
            lasts[nl++] = last;
    }
    if (ok) {
        ok = _slab_check_list(p->claimed, -1, limit, &cb, &cn, &last);
        if (ok && last)
            lasts[nl++] = last;
    }
    /* Singly linked lists that share a node share everything after it,
     * so distinct last nodes prove no slab is on two lists. */
    for (i = 0; ok && i < nl; i++)
        for (j = i + 1; j < nl; j++)
            if (lasts[i] == lasts[j])
                ok = 0;
    if (ok) {
        ok = ib == p->bytes_idle && in == p->slabs_idle &&
             cb == p->bytes_claimed && cn == p->slabs_claimed &&
             p->bytes_held == p->bytes_idle + p->bytes_in_use + p->bytes_claimed + p->bytes_dying &&
             p->slabs_held == p->slabs_idle + p->slabs_in_use + p->slabs_claimed + p->slabs_dying &&
             p->bytes_held + p->bytes_reserved <= (p->held_limit > p->cap ? p->held_limit : p->cap) &&
             p->bytes_high_water >= p->bytes_held &&
             p->cap > 0 &&
             p->allocs >= p->slabs_held;
    }
    pthread_mutex_unlock(&p->mu);
    return ok;
}
