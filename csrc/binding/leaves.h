/*
 * leaves.h - the leaf readers of the walk: a tensor's, numpy array's or
 * FileTensor's metadata (dtype, shape, strides, place, layout flags) read
 * into the next leaf slot of a tree, and the hand-off of a leaf that fails
 * the fast checks to mtc_loader._tree.diagnose. Called by the walk
 * (traverse.c) with the GIL held, and never calling back into it: what a
 * reader needs of the tree (tree.h) is below both. mtc_tree_reread, the
 * re-read of one leaf after start_copy replaced it, is here too.
 *
 * Functions return 0, or -1 with an exception set (naming the leaf's path).
 * Names starting with `_` are internal to leaves.c.
 */
#ifndef MTC_LEAVES_H
#define MTC_LEAVES_H

#include "tree.h"

/* Room for one more leaf of `ndim` dims in t (leaves, objs, leaf_node, and
 * the dims arrays). */
int mtc_leaves_reserve(mtc_tree *t, int ndim);

/* Room for `nleaves` leaves of `ndims` dims in all in t. */
int mtc_leaves_reserve_n(mtc_tree *t, uint32_t nleaves, uint32_t ndims);

/* Reads obj (a torch.Tensor, a numpy.ndarray, a FileTensor) as leaf
 * t->nleaves of node `node`, and sets the node's leaf index. */
int mtc_leaves_read_tensor(mtc_state *st, mtc_tree *t, int32_t node, PyObject *obj);
int mtc_leaves_read_ndarray(mtc_state *st, mtc_tree *t, int32_t node, PyObject *obj);
int mtc_leaves_read_file(mtc_state *st, mtc_tree *t, int32_t node, PyObject *obj);

/* Hands obj (a leaf that failed the fast checks, or a container whose
 * flatten raised: the pending exception is passed on) to
 * mtc_loader._tree.diagnose, which raises naming its path, or returns a
 * replacement tensor read in its place. */
int mtc_leaves_diagnose(mtc_state *st, mtc_tree *t, int32_t node, PyObject *obj);

/* Re-reads leaf i's metadata from t->objs[i] (after the binding layer
 * replaced it by a contiguous copy). 0 or -1 with an exception. */
int mtc_tree_reread(mtc_state *st, mtc_tree *t, uint32_t i);

#endif /* MTC_LEAVES_H */
