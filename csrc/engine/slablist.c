/*
 * slablist.c - the size classes and idle lists of a slab pool (see
 * slablist.h).
 *
 * Each class keeps a singly linked FIFO of idle slabs in release order:
 * release appends at the tail and reuse scans from the head, so the slab
 * whose fence had the longest time to complete is tried first.
 */
#include "slablist.h"

/* s->next of a slab in use: tells a double release apart from a real one. */
mtc_slab mtc_slablist_in_use_mark;

/*
 * Class index of class size cb (a value mtc_slab_class_bytes returned).
 * Returns 0..MTC_SLAB_NCLASSES-1, or -1 for 0.
 */
int mtc_slablist_class_index(size_t cb)
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
 * 1 if idle slab s may be reused or freed (no fence armed, or fence_query
 * says completed), 0 if its fence is pending, negative on a query error.
 * A completion is remembered in s->fenced so each fence is queried until it
 * completes and never after.  Precondition: lock held.
 */
int mtc_slablist_settled(mtc_slab_pool *p, mtc_slab *s)
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
void mtc_slablist_unlink(mtc_slab_pool *p, mtc_slab *prev, mtc_slab *s)
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
 * Like mtc_slablist_unlink when the predecessor is not at hand: finds it by
 * walking the list.  Precondition: lock held, s on its idle list.
 */
void mtc_slablist_unlink_find(mtc_slab_pool *p, mtc_slab *s)
{
    mtc_slab *prev = NULL, *it;

    for (it = p->head[s->cls]; it && it != s; it = it->next)
        prev = it;
    mtc_slablist_unlink(p, prev, s);
}

/*
 * Puts idle slab s on its list at the place its release_seq says, so a slab
 * coming back from a claim keeps its LRU rank (usually it is the oldest and
 * goes to the head).  Precondition: lock held, s on no list.
 */
void mtc_slablist_insert_sorted(mtc_slab_pool *p, mtc_slab *s)
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
 * Takes the oldest idle slab of class cls whose fence completed.  Returns it
 * (unlinked, not yet counted in use) or NULL; *rc gets 0 or a fence_query
 * error.  Queries every pending fence of the class: fences of different
 * streams need not complete in release order.  Precondition: lock held.
 */
mtc_slab *mtc_slablist_take_settled(mtc_slab_pool *p, int cls, int *rc)
{
    mtc_slab *prev = NULL, *s;
    int q;

    *rc = 0;
    for (s = p->head[cls]; s; prev = s, s = s->next) {
        q = mtc_slablist_settled(p, s);
        if (q < 0) {
            *rc = q;
            return NULL;
        }
        if (q) {
            mtc_slablist_unlink(p, prev, s);
            return s;
        }
    }
    return NULL;
}

/*
 * The idle slab with the oldest armed fence (fenced == 1, not yet seen
 * completed) whose release_seq <= max_seq, or NULL.  Lists are in release
 * order, so only the first armed slab of each list is a candidate.
 * Precondition: lock held.
 */
mtc_slab *mtc_slablist_oldest_armed(mtc_slab_pool *p, uint64_t max_seq)
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
