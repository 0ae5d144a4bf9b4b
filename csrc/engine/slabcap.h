/*
 * slabcap.h - the cap of a slab pool (slab.h) and its accounting: eviction
 * of idle slabs to make room under the cap, and the public calls that act on
 * the cap and the numbers (mtc_slab_trim, mtc_slab_set_cap,
 * mtc_slab_get_stats, and the invariant checker mtc_slab_valid, all declared
 * in slab.h and defined in slabcap.c).
 *
 * The cap bounds bytes_held + bytes_reserved: a slab stays counted in
 * bytes_held while it is dying (unlinked and being freed with the lock
 * dropped), so the check made under the lock bounds the memory really pinned.
 *
 * Internal to the slab allocator: only slab.c and slabcap.c include it.
 * Contract: called with the pool's lock held; mtc_slabcap_free_dying drops
 * it while it frees and returns with it held. No Python, no CUDA.
 */
#ifndef MTC_SLABCAP_H
#define MTC_SLABCAP_H

#include <stdint.h>

#include "slab.h"

/* Moves idle completed slabs onto *dying, least recently released first,
 * until at least `need` bytes are chosen (all_or_nothing: none unless `need`
 * can be met). The bytes chosen, or a negative fence_query error. */
int64_t mtc_slabcap_pick_victims(mtc_slab_pool *p, uint64_t need, int all_or_nothing, mtc_slab **dying);
/* Frees a list of dying slabs (lock dropped meanwhile); counts them as
 * evictions if asked. The bytes freed. */
uint64_t mtc_slabcap_free_dying(mtc_slab_pool *p, mtc_slab *dying, int count_evictions);

#endif /* MTC_SLABCAP_H */
