/*
 * ring.c - bounded lock-free MPSC ring (see ring.h for the contract): its
 * set-up, tear-down, size and invariant checker. Push and pop, the hot pair,
 * are static inline in ring.h.
 */
#include "ring.h"

#include <errno.h>
#include <stddef.h>
#include <stdlib.h>

int mtc_ring_init(mtc_ring *r, uint32_t capacity)
{
    if (r == NULL)
        return -EINVAL;
    /* Leave r in a destroy-safe state whatever happens below. */
    r->slots = NULL;
    r->mask = 0;
    mtc_store_relaxed(&r->tail, 0); /* not yet shared: publication is the caller's job */
    mtc_store_relaxed(&r->head, 0); /* not yet shared: publication is the caller's job */

    if (capacity < 2 || (capacity & (capacity - 1)) != 0 ||
        capacity > MTC_RING_MAX_CAPACITY)
        return -EINVAL;

    mtc_ring_slot *slots = calloc(capacity, sizeof *slots);
    if (slots == NULL)
        return -ENOMEM;
    for (uint32_t i = 0; i < capacity; i++) {
        /* Slot i is free for position i.  Relaxed: the ring is not shared
         * yet; the caller's publication edge orders these stores. */
        mtc_store_relaxed(&slots[i].seq, (uint64_t)i);
        slots[i].item = NULL;
    }
    r->slots = slots;
    r->mask = (uint64_t)capacity - 1;
    return 0;
}

void mtc_ring_destroy(mtc_ring *r)
{
    if (r == NULL)
        return;
    free(r->slots);
    r->slots = NULL;
    r->mask = 0;
    mtc_store_relaxed(&r->tail, 0); /* no other users by precondition */
    mtc_store_relaxed(&r->head, 0); /* no other users by precondition */
}

uint64_t mtc_ring_size_approx(const mtc_ring *r)
{
    if (r == NULL || r->slots == NULL)
        return 0;
    /* Acquire pairs with the consumer's store_release of head in
     * mtc_ring_pop_sc: the claims (tail CASes) of every position below the
     * head we see happen before our tail load, so tail >= head.  The
     * difference can still exceed capacity if producers and the consumer
     * move between the two loads; clamp below. */
    const uint64_t head = mtc_load_acquire(&r->head);
    /* Relaxed: tail is read for its value only (snapshot), no data rides
     * on it. */
    const uint64_t tail = mtc_load_relaxed(&r->tail);
    const uint64_t dif = tail - head;
    const uint64_t cap = r->mask + 1;
    if (dif > MTC_RING_HALF_RANGE)
        return 0; /* defensive: cannot happen with the load order above */
    return dif > cap ? cap : dif;
}

int mtc_ring_valid(const mtc_ring *r)
{
    if (r == NULL || r->slots == NULL)
        return 0;
    const uint64_t mask = r->mask;
    const uint64_t cap = mask + 1; /* 0 if mask == UINT64_MAX: rejected */
    if (cap < 2 || (cap & mask) != 0 || cap > MTC_RING_MAX_CAPACITY)
        return 0;

    /* Quiescent by precondition: acquire just makes the checker safe to
     * call after joining threads without extra fences; pairs with the
     * release stores of head (pop) and seq (push/pop). */
    const uint64_t head = mtc_load_acquire(&r->head);
    /* Relaxed: quiescent by precondition, value only. */
    const uint64_t tail = mtc_load_relaxed(&r->tail);
    const uint64_t used = tail - head;
    if (used > cap)
        return 0; /* also catches tail "behind" head (huge difference) */

    /* Positions [head, tail) hold items: seq == p + 1.
     * Positions [tail, head + cap) are free: seq == p.
     * Together they cover each slot exactly once. */
    for (uint64_t i = 0; i < cap; i++) {
        const uint64_t p = head + i;
        /* Acquire pairs with the release stores of seq in push/pop (see
         * above; quiescent, value only). */
        const uint64_t seq = mtc_load_acquire(&r->slots[p & mask].seq);
        const uint64_t want = (i < used) ? p + 1 : p;
        if (seq != want)
            return 0;
    }
    return 1;
}
