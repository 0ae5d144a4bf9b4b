/*
 * ring.c - bounded lock-free MPSC ring (see ring.h for the contract).
 *
 * Vyukov bounded queue, specialised for one consumer: the consumer owns head
 * outright (plain load, no CAS), producers race on tail with a CAS.  All
 * counter comparisons are done on unsigned differences, so nothing breaks
 * when the 64-bit counters wrap.
 */
#include "ring.h"

#include <errno.h>
#include <stddef.h>
#include <stdlib.h>

/* Differences above this are "negative" (counter a is behind counter b). */
#define MTC_RING_HALF_RANGE (UINT64_MAX / 2)

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

int mtc_ring_push_mp(mtc_ring *r, void *item)
{
    if (r == NULL || item == NULL)
        return -EINVAL;

    mtc_ring_slot *const slots = r->slots;
    const uint64_t mask = r->mask;
    /* Relaxed: tail is only a hint of which position to try; the slot's seq
     * (acquired below) decides whether the position is really ours. */
    uint64_t pos = mtc_load_relaxed(&r->tail);

    for (;;) {
        mtc_ring_slot *slot = &slots[pos & mask];
        /* Acquire pairs with the consumer's store_release of seq = pos in
         * mtc_ring_pop_sc: its read of the previous lap's item happens
         * before our overwrite of slot->item below. */
        uint64_t seq = mtc_load_acquire(&slot->seq);
        uint64_t dif = seq - pos;

        if (dif == 0) {
            /* Slot is free for position pos: try to claim pos.  Relaxed CAS
             * is enough: it only arbitrates between producers; the item is
             * published by the release store of seq below, and the acquire
             * above already ordered us after the consumer.  On failure pos
             * is reloaded with the current tail. */
            if (mtc_cas_weak_relaxed(&r->tail, &pos, pos + 1)) {
                slot->item = item;
                /* Release pairs with the consumer's load_acquire of seq in
                 * mtc_ring_pop_sc: publishes slot->item (and everything this
                 * producer wrote before the push) before seq says "full". */
                mtc_store_release(&slot->seq, pos + 1);
                return 0;
            }
        } else if (dif > MTC_RING_HALF_RANGE) {
            /* seq < pos: the slot still holds (or is still being released
             * from) the item of position pos - capacity.  Since seq only
             * grows and tail >= pos, the ring was full at the seq load. */
            return -EAGAIN;
        } else {
            /* seq > pos: another producer claimed pos after we read tail;
             * our pos is stale.  Relaxed: hint only, as above. */
            pos = mtc_load_relaxed(&r->tail);
        }
    }
}

void *mtc_ring_pop_sc(mtc_ring *r)
{
    if (r == NULL || r->slots == NULL)
        return NULL;

    /* Relaxed: the consumer is the only writer of head. */
    const uint64_t pos = mtc_load_relaxed(&r->head);
    mtc_ring_slot *slot = &r->slots[pos & r->mask];
    /* Acquire pairs with the producer's store_release of seq = pos + 1 in
     * mtc_ring_push_mp: makes slot->item (and the producer's earlier
     * writes) visible before we read it. */
    const uint64_t seq = mtc_load_acquire(&slot->seq);
    if (seq != pos + 1)
        return NULL; /* empty (seq == pos, unclaimed) or claimed, unpublished */

    void *item = slot->item;
    /* Release pairs with the load_acquire of head in mtc_ring_size_approx:
     * a reader that sees head == pos + 1 then reads tail >= pos + 1 (the
     * producer's tail CAS happens before its seq release, which we
     * acquired), so its snapshot tail - head is never negative. */
    mtc_store_release(&r->head, pos + 1);
    /* Release pairs with the producers' load_acquire of seq in
     * mtc_ring_push_mp: our read of slot->item (and the head store above)
     * happen before the producer of position pos + capacity reuses it. */
    mtc_store_release(&slot->seq, pos + r->mask + 1);
    return item;
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
