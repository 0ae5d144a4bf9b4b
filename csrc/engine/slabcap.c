/*
 * slabcap.c - the cap of a slab pool and its accounting: eviction, trim, cap
 * changes, the numbers and the invariant checker (see slabcap.h).
 */
#include "slabcap.h"

#include <errno.h>
#include <stdlib.h>

#include "slablist.h"

/*
 * Moves idle completed slabs onto *dying, least recently released first
 * (a merge of the per-class lists by release_seq), until at least `need`
 * bytes are chosen.  all_or_nothing: choose none unless `need` can be met,
 * so an allocation that must wait anyway does not throw away reusable slabs.
 * Returns the bytes chosen, or a negative fence_query error (nothing chosen).
 * Chosen slabs are counted dying (still held).  Precondition: lock held.
 */
int64_t mtc_slabcap_pick_victims(mtc_slab_pool *p, uint64_t need, int all_or_nothing,
                                  mtc_slab **dying)
{
    mtc_slab *prev[MTC_SLAB_NCLASSES], *cur[MTC_SLAB_NCLASSES];
    mtc_slab *s, *nxt;
    uint64_t avail = 0, got = 0;
    int c, best, q;

    /* Query first: after this pass s->fenced == 0 means settled. */
    for (c = 0; c < MTC_SLAB_NCLASSES; c++) {
        for (s = p->head[c]; s; s = s->next) {
            q = mtc_slablist_settled(p, s);
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
        mtc_slablist_unlink(p, prev[best], s);   /* prev[best] now precedes nxt */
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
uint64_t mtc_slabcap_free_dying(mtc_slab_pool *p, mtc_slab *dying, int count_evictions)
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
    mtc_slablist_wake(p);
    return bytes;
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
    if (mtc_slabcap_pick_victims(p, UINT64_MAX, 0, &dying) > 0 && dying)
        freed = mtc_slabcap_free_dying(p, dying, 0);
    pthread_mutex_unlock(&p->mu);
    return (size_t)freed;
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
    if (used > p->cap && mtc_slabcap_pick_victims(p, used - p->cap, 0, &dying) > 0 && dying)
        mtc_slabcap_free_dying(p, dying, 1);
    mtc_slablist_wake(p);   /* a raise may unblock waiters; a cut may make them -E2BIG */
    pthread_mutex_unlock(&p->mu);
    return 0;
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
        if (s == MTC_SLAB_IN_USE || ++*n > limit)
            return 0;
        if (s->cls < 0 || s->cls >= MTC_SLAB_NCLASSES || !s->ptr)
            return 0;
        if (s->bytes != mtc_slab_class_bytes(s->bytes) || mtc_slablist_class_index(s->bytes) != s->cls)
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
