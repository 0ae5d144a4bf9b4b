/* tests/c/plan_rules.h - the oracle of the planner's per-leaf actions, shared
 * by the unit test (tests/c/test_plan.c) and the fuzz harness
 * (tests/fuzz/fuzz_plan.c): start_copy's rules as plan.h and docs/design.md (semantics in detail)
 * state them, written independently of csrc/engine/plan.c. */
#ifndef MTC_TESTS_PLAN_RULES_H
#define MTC_TESTS_PLAN_RULES_H

#include <stdint.h>

#include "plan.h"

/* The rules one at a time, in the order they apply (written as rules, not
 * as a copy of plan.c's branches, so that a slip in either shows):
 *  1. a numpy array for a CPU target: a zero-copy view where torch allows
 *     one, else a host copy;
 *  2. a tensor already on the target is reused;
 *  3. a leaf small enough for a pack (<= the pack limit and <= a chunk),
 *     with packing on, is packed where its route packs: CPU -> GPU always
 *     (the staging copy gathers strides), GPU -> CPU only with pinned
 *     staging and a source that is one block (contiguous or dense in
 *     another order), GPU -> GPU never;
 *  4. anything else is one copy of its own, by route, from a source that is
 *     one block (needs_contig when it is not). */
static inline uint8_t expected_action(const mtc_leaf *l, const mtc_plan_opts *o, uint8_t *nc)
{
    const int src_cpu = l->dev == MTC_DEV_CPU, dst_cpu = o->target == MTC_DEV_CPU;
    const int contig = (l->flags & (MTC_LEAF_CONTIGUOUS | MTC_LEAF_DENSE)) != 0; /* one block */
    *nc = 0;
    if (dst_cpu && (l->flags & MTC_LEAF_NUMPY))                                  /* 1 */
        return (l->flags & MTC_LEAF_ZEROCOPY) ? MTC_ACT_FROM_NUMPY : MTC_ACT_HOST_COPY;
    if (l->dev == o->target) return MTC_ACT_REUSE;                               /* 2 */
    const int fits = l->nbytes <= o->pack_limit && l->nbytes <= o->max_chunk;  /* 3 */
    const int route_packs = src_cpu || (dst_cpu && o->staging && contig);
    if (o->pack && fits && route_packs) return MTC_ACT_PACK;
    *nc = (uint8_t)!contig;                                                      /* 4 */
    if (dst_cpu) return MTC_ACT_D2H;
    if (!src_cpu) return MTC_ACT_D2D;
    return o->staging ? MTC_ACT_H2D_STAGED : MTC_ACT_H2D_DIRECT;
}

#endif /* MTC_TESTS_PLAN_RULES_H */
