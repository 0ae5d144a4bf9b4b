/*
 * traverse.h - walks a nested batch (GIL held), collects its tensor and
 * numpy leaves with their metadata for the planner, records a compact
 * skeleton, and rebuilds the same structure around new leaves.
 *
 * Containers: exact list / tuple / dict are walked in C; every other type is
 * classified once (mtc_loader._tree.classify, cached per type): subclasses of
 * list/tuple/dict, namedtuples and dataclass instances are flattened and
 * rebuilt by mtc_loader._tree; any other object is a passthrough leaf,
 * returned as the same object. The walk is iterative, so depth is bounded by
 * memory, not by the C stack; a container that contains itself is an error.
 *
 * The tree it fills is in tree.h; the leaf readers it hands each leaf to
 * are in leaves.c, and never call back into the walk.
 *
 * Functions that touch Python return -1 with an exception set, or 0.
 * Names starting with `_` are internal to traverse.c.
 */
#ifndef MTC_TRAVERSE_H
#define MTC_TRAVERSE_H

#include "tree.h"

/* kinds returned by the Python classifier */
enum {
    MTC_KIND_LEAF = 0, MTC_KIND_TENSOR = 1, MTC_KIND_NDARRAY = 2, MTC_KIND_GENERIC = 3, MTC_KIND_FILE = 4,
    MTC_KIND_HOST = 5,   /* mtc_loader._tree.OnHost */
};

/* Walks `data` into t (zeroed by the caller). 0, or -1 with an exception
 * naming the offending leaf. On error t holds what was collected; clear it. */
int mtc_traverse(mtc_state *st, PyObject *data, mtc_tree *t);

/* rebuild.c: builds the output structure; outputs[i] (borrowed) replaces leaf i, and
 * atoms[i] (borrowed; t->natoms of them, NULL when there are none) the
 * per-batch atom i. Returns a new reference, or NULL with an exception set. */
PyObject *mtc_rebuild(mtc_state *st, const mtc_tree *t, PyObject *const *outputs, PyObject *const *atoms);

#endif /* MTC_TRAVERSE_H */
