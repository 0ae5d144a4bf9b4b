/*
 * slablist.h - the size classes and idle lists of a slab pool (slab.h), and
 * the moves of a slab between the states the pool keeps it in.
 *
 * Every slab the pool has pinned is in exactly one state (see mtc_slab_pool):
 * idle on the list of its class (oldest release first), claimed, in use
 * (s->next == MTC_SLAB_IN_USE) or dying. The functions here move a slab
 * between idle, in use and off-list, keep the idle counts, and find a slab
 * to reuse or to wait for; the pool's allocation paths (slab.c) and its cap
 * accounting (slabcap.c) are built on them.
 *
 * Internal to the slab allocator: only slab.c, slablist.c and slabcap.c
 * include it. Contract: every function is called with the pool's lock held
 * and never drops it; only mtc_slablist_settled (and the two finders that
 * use it) call an op, fence_query, which must not block. No Python, no CUDA.
 */
#ifndef MTC_SLABLIST_H
#define MTC_SLABLIST_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "slab.h"

/* s->next of a slab in use: tells a double release apart from a real one. */
extern mtc_slab mtc_slablist_in_use_mark;
#define MTC_SLAB_IN_USE (&mtc_slablist_in_use_mark)

/* Class index of class size cb (a value mtc_slab_class_bytes returned):
 * 0..MTC_SLAB_NCLASSES-1, or -1 for 0. Needs no lock. */
int mtc_slablist_class_index(size_t cb);

/* 1 if idle slab s may be reused or freed, 0 if its fence is pending,
 * negative on a query error. */
int mtc_slablist_settled(mtc_slab_pool *p, mtc_slab *s);
/* Removes idle s from its list given its predecessor (NULL at the head). */
void mtc_slablist_unlink(mtc_slab_pool *p, mtc_slab *prev, mtc_slab *s);
/* Removes idle s from its list, finding its predecessor. */
void mtc_slablist_unlink_find(mtc_slab_pool *p, mtc_slab *s);
/* Puts s (on no list) back on its list at its release_seq's place. */
void mtc_slablist_insert_sorted(mtc_slab_pool *p, mtc_slab *s);
/* The oldest idle slab of class cls whose fence completed, unlinked; NULL
 * (with *rc 0 or a fence_query error) when none. */
mtc_slab *mtc_slablist_take_settled(mtc_slab_pool *p, int cls, int *rc);
/* The idle slab with the oldest armed fence released at or before max_seq, or NULL. */
mtc_slab *mtc_slablist_oldest_armed(mtc_slab_pool *p, uint64_t max_seq);

/*
 * Wakes threads parked in pthread_cond_wait.  Precondition: lock held.
 * Skipped when nobody waits, so the common release stays syscall-free.
 */
static inline void mtc_slablist_wake(mtc_slab_pool *p)
{
    if (p->cond_waiters)
        pthread_cond_broadcast(&p->cv);
}

/* Parks on the pool condvar (drops the lock while asleep). Lock held. */
static inline void mtc_slablist_cond_wait(mtc_slab_pool *p)
{
    p->cond_waiters++;
    pthread_cond_wait(&p->cv, &p->mu);
    p->cond_waiters--;
}

/*
 * Marks s handed out and counts it in use.  Precondition: lock held, s on no
 * list and not counted idle/claimed any more.
 */
static inline void mtc_slablist_hand_out(mtc_slab_pool *p, mtc_slab *s)
{
    s->next = MTC_SLAB_IN_USE;
    s->fenced = 0;
    p->bytes_in_use += s->bytes;
    p->slabs_in_use++;
}

#endif /* MTC_SLABLIST_H */
