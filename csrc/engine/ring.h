/*
 * ring.h - bounded lock-free ring of `void *` items.
 *
 * Concurrency contract: ANY NUMBER OF PRODUCERS, EXACTLY ONE CONSUMER (MPSC).
 *   - mtc_ring_push_mp() may be called from any thread, concurrently.
 *   - mtc_ring_pop_sc() must only ever be called by one thread at a time
 *     (the single consumer; handing the role to another thread requires a
 *     happens-before edge between the two, e.g. a mutex or a release/acquire
 *     pair).
 *   - mtc_ring_size_approx() may be called from any thread.
 *   - mtc_ring_init(), mtc_ring_destroy() and mtc_ring_valid() must not run
 *     concurrently with any other call on the same ring.
 * Neither push nor pop ever blocks, sleeps or allocates; waiting (spinning,
 * sleeping, futexes) is the caller's business.
 *
 * Names starting with `_` are internal and not part of the API.  The struct
 * fields are visible only so the ring can be embedded in other structs; do
 * not touch them directly.
 *
 * Design: Vyukov-style bounded queue.  Every slot carries a sequence number;
 * head (consumer) and tail (producers) are free-running unsigned 64-bit
 * counters, masked only when indexing a slot and compared only by
 * difference, so wrap-around of the counters themselves is harmless.  For a
 * slot at position p (index p & mask):
 *     seq == p        slot is free for the producer of position p
 *     seq == p + 1    item for position p is published, consumer may take it
 *     seq == p + cap  consumer is done with it; free for position p + cap
 * Producers claim a position with a CAS on tail; the consumer owns head.
 *
 * Embedding: struct mtc_ring is over-aligned (MTC_CACHELINE bytes) so that
 * tail, head and the read-only fields sit on separate cache lines.  A struct
 * that embeds it inherits that alignment; heap-allocate such a struct with
 * aligned_alloc()/posix_memalign(), not plain malloc().
 */
#ifndef MTC_RING_H
#define MTC_RING_H

#include <errno.h>
#include <stddef.h>
#include <stdint.h>

#include "atomics.h"

/* Largest capacity mtc_ring_init() accepts (2^26 slots = 1 GiB of slots). */
#define MTC_RING_MAX_CAPACITY (UINT32_C(1) << 26)

typedef struct mtc_ring_slot {
    _Atomic uint64_t seq;
    void *item;
} mtc_ring_slot;

typedef struct mtc_ring {
    MTC_ALIGNED_CL _Atomic uint64_t tail; /* producers: next position to claim */
    MTC_ALIGNED_CL _Atomic uint64_t head; /* consumer: next position to take */
    MTC_ALIGNED_CL uint64_t mask;         /* capacity - 1; read-only after init */
    mtc_ring_slot *slots;                 /* capacity slots; read-only pointer */
} mtc_ring;

/*
 * mtc_ring_init - initialise an empty ring of `capacity` slots.
 * Preconditions: r points to writable (suitably aligned) memory that is not
 *   in use by any thread; capacity is a power of two, 2 <= capacity <=
 *   MTC_RING_MAX_CAPACITY.
 * Returns 0 on success; -EINVAL if r is NULL or capacity is out of range or
 *   not a power of two; -ENOMEM if the slot array cannot be allocated (r is
 *   then left with slots == NULL, safe to pass to mtc_ring_destroy()).
 * Publishing the initialised ring to other threads needs a happens-before
 *   edge (pthread_create, a mutex, or a release store the others acquire).
 */
int mtc_ring_init(mtc_ring *r, uint32_t capacity);

/*
 * mtc_ring_destroy - free the slot array.  Items still in the ring are NOT
 *   freed (drain it with mtc_ring_pop_sc() first if they own resources).
 * Preconditions: no thread is using or will use the ring; r may be NULL
 *   (no-op).  Idempotent: destroying twice is harmless.
 * Returns nothing.
 */
void mtc_ring_destroy(mtc_ring *r);

/*
 * mtc_ring_push_mp - append `item`.  Any thread, any number concurrently.
 * Never blocks: on a full ring it returns at once.
 * Returns 0 on success; -EAGAIN when the ring is full (which includes the
 *   transient case where the consumer has taken the oldest item but not yet
 *   released its slot); -EINVAL if r or item is NULL (NULL is reserved as
 *   pop's "empty" answer).
 */
static inline int mtc_ring_push_mp(mtc_ring *r, void *item); /* defined below */

/*
 * mtc_ring_pop_sc - take the oldest item.  The single consumer only.
 * Returns the item; or NULL when the ring is empty, or when the producer that
 *   claimed the next position has not published it yet (retry later; items
 *   behind it are not overtaken, so FIFO order by claimed position holds).
 * Ordering: per producer, items are popped in the order that producer pushed
 *   them.  Everything the producer wrote before pushing an item is visible
 *   to the consumer after popping it.
 */
static inline void *mtc_ring_pop_sc(mtc_ring *r); /* defined below */

/*
 * mtc_ring_size_approx - number of items in the ring, as a snapshot.
 * Any thread.  The answer may be stale by the time it returns; it is clamped
 * to [0, capacity].  Returns 0 for a NULL or destroyed ring.
 */
uint64_t mtc_ring_size_approx(const mtc_ring *r);

/*
 * mtc_ring_valid - invariant checker for tests and debug builds.
 * Precondition: the ring is quiescent (no push or pop in progress); on a
 *   live ring the answer is meaningless (it may report a false 0).
 * Returns 1 if: slots != NULL; mask + 1 is a power of two in
 *   [2, MTC_RING_MAX_CAPACITY]; 0 <= tail - head <= capacity; every slot
 *   holding an item has seq == position + 1 and every free slot has
 *   seq == position.  Returns 0 otherwise (including r == NULL).  O(capacity).
 */
int mtc_ring_valid(const mtc_ring *r);

/* ---- push and pop, inline: the submission's and the transfer thread's hot
 * pair. Vyukov bounded queue, specialised for one consumer: the consumer
 * owns head outright (plain load, no CAS), producers race on tail with a
 * CAS.  All counter comparisons are done on unsigned differences, so
 * nothing breaks when the 64-bit counters wrap. */

/* Differences above this are "negative" (counter a is behind counter b). */
#define MTC_RING_HALF_RANGE (UINT64_MAX / 2)

static inline int mtc_ring_push_mp(mtc_ring *r, void *item)
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

static inline void *mtc_ring_pop_sc(mtc_ring *r)
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

#endif /* MTC_RING_H */
