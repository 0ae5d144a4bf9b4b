/*
 * collector.h - the interpreter's garbage collector and the outputs of a
 * batch. A call that builds a batch's outputs allocates hundreds to
 * thousands of GC-tracked objects (tensors, containers) at once, more than
 * the collector's first threshold (700): the young collection that these
 * allocations trigger runs while the new batch is alive (at the allocation
 * that crosses the threshold up to Python 3.11, when the call returns from
 * 3.12), and whatever is alive when a collection of the middle generation
 * runs is promoted to the oldest one. Batch after batch the promotions add
 * up to a full collection, over every object the program holds (tens of
 * milliseconds with torch imported), every couple of hundred calls.
 *
 * mtc_collector_before_outputs() runs, before the outputs are made, the
 * middle-generation collection those allocations would otherwise trigger
 * among them (gc.collect(1): what the collector would have collected anyway,
 * moments earlier), so that the batch is only ever promoted to the middle
 * generation, where it dies with the batch. Nothing else changes: the
 * collector's thresholds and state are the program's own, a program that
 * disabled the collector sees no collection, and the collections it sees are
 * reported to gc.callbacks as usual. Only for the collector of CPython 3.10
 * to 3.13 (with the GIL); MTC_EARLY_GC=0 turns it off.
 */
#ifndef MTC_COLLECTOR_H
#define MTC_COLLECTOR_H

#include <stdint.h>

#include "state.h"

/* Looks up the gc module's functions (engine_exec). 0 or -1. */
int mtc_collector_init(mtc_state *st);

/* Drops what init took (module clear). */
void mtc_collector_clear(mtc_state *st);

/* Before a call creates `nobjects` GC-tracked objects that stay alive until
 * it returns: when the collector is enabled, those allocations would trigger
 * a collection of the middle generation or older (gc.get_count() against
 * gc.get_threshold()), run it now. 0, or -1 with an exception (one raised
 * by gc.collect: a KeyboardInterrupt in a finalizer). */
int mtc_collector_before_outputs(mtc_state *st, int64_t nobjects);

/* _early_gc(flag) -> bool: turns the above on or off for tests and
 * benchmarks; returns the previous setting. */
PyObject *mtc_collector_set(PyObject *module, PyObject *flag);

#endif /* MTC_COLLECTOR_H */
