/*
 * skeleton.h - the structure of a packed batch prepared once and reused.
 *
 * A worker sends each batch's skeleton (its structure, LEAF in every tensor's
 * place) across the process boundary. Most batches of a dataset share one
 * structure: the same containers and keys, only the tensors' shapes differ
 * (and those travel in the layout). When a skeleton holds nothing that a
 * batch could change after the fact (plain lists, tuples and dicts, with
 * only immutable atoms as keys and passthrough leaves: str, int, float,
 * bool, None, bytes; OnHost markers around such parts), the receiving process walks it once into a Skeleton
 * object and rebuilds every later batch of that structure from the same walk:
 * no unpickling of the structure's containers and no walk per batch. Other
 * skeletons are walked per batch (mtc_traverse), since their objects are the
 * batch's own (a container registered from Python, a mutable object that the
 * output must not share with the next batch).
 *
 * GIL held in every function here.
 */
#ifndef MTC_SKELETON_H
#define MTC_SKELETON_H

#include "state.h"
#include "traverse.h"

typedef struct mtc_skeleton {
    PyObject_HEAD
    mtc_tree tree;       /* the skeleton walked in slots mode; read-only once made */
} mtc_skeleton;

/* The heap type's spec (module.c creates the type in its exec slot). */
extern PyType_Spec mtc_skeleton_spec;

/* 1 when every node of t is a leaf, a plain list, tuple or dict, or a
 * passthrough atom, and every dict key is an atom: a structure whose rebuilt
 * output shares nothing mutable with the tree. 0 otherwise. */
int mtc_skeleton_atoms_only(const mtc_tree *t);

/* The worker's side: t (a batch's walk, atoms only) as the structure to
 * share (slots[i] in leaf i's place, ATOM in each passthrough atom's) and
 * the tuple of its atoms in preorder. 0 with two new references, or -1 with
 * an exception set. */
int mtc_skeleton_share(mtc_state *st, const mtc_tree *t, PyObject *const *slots, PyObject **structure,
                       PyObject **atoms);

/* skeleton(obj) -> Skeleton: obj (a packed batch's skeleton) walked once, for
 * unpack to rebuild from. ValueError when obj holds anything but plain
 * containers and atoms (see mtc_skeleton_atoms_only). New reference, or NULL
 * with an exception set. */
PyObject *mtc_skeleton_make(PyObject *module, PyObject *obj);

/* The walk of a Skeleton object, or NULL when obj is not one (borrowed). */
const mtc_tree *mtc_skeleton_tree(mtc_state *st, PyObject *obj);

#endif /* MTC_SKELETON_H */
