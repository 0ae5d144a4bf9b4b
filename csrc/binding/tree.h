/*
 * tree.h - the tree a walk fills (traverse.h) and its leaf readers write
 * into (leaves.h): nodes, leaves and their dims, below both. Growing its
 * arrays, clearing it, and the path of a node as the user wrote it
 * ("data[3]['cams_gt'][2]"), for error messages.
 *
 * Functions that touch Python return -1 (or NULL) with an exception set,
 * or 0 (or a new reference). Names starting with `_` are internal to tree.c.
 */
#ifndef MTC_TREE_H
#define MTC_TREE_H

#include "state.h"
#include "plan.h"

enum {
    MTC_NODE_LEAF = 1,   /* tensor / ndarray: leaf index in `leaf` */
    MTC_NODE_PASS,       /* passthrough object: `obj` */
    MTC_NODE_LIST,
    MTC_NODE_TUPLE,
    MTC_NODE_DICT,       /* exact dict: keys tuple in `obj` */
    MTC_NODE_GENERIC,    /* flattened by Python: context in `obj` */
    MTC_NODE_HOST,       /* an OnHost in a pack or slots walk: one child (its value); `obj` its type */
};

/*
 * Host-placed leaves (mtc_loader._tree.OnHost). In a walk for start_copy an
 * OnHost is a passthrough of its value (a PASS node holding the value, the
 * same object; nothing under it is walked). In a pack walk (t->pack) and a
 * slots walk (a packed batch's skeleton) it is a MTC_NODE_HOST container of
 * one child: every tensor and FileTensor leaf (slots: LEAF placeholder)
 * under it, through any containers, is host-placed (MTC_LEAF_HOST, node
 * `host`), and a numpy array under it is a passthrough, not a leaf. The
 * rebuild of a pack walk (the skeleton) wraps the child's value in OnHost
 * again; any other rebuild returns the child's value (the marker is gone).
 */

/* The binding's own leaf flag, beside plan.h's MTC_LEAF_* (the engine masks
 * the bits it reads, and never reads this one): the leaf is the resolved copy
 * that mtc_loader._tree.diagnose returned for a lazily conjugated or negated
 * view, not the user's object, so a reuse of it returns a new tensor. */
#define MTC_LEAF_RESOLVED 0x80000000u

typedef struct mtc_node {
    uint8_t kind;
    uint8_t host;        /* MTC_NODE_LEAF under an OnHost (pack and slots walks) */
    int32_t parent;      /* node index, -1 for the root */
    int32_t pos;         /* position among the parent's children */
    int32_t nchildren;
    int32_t leaf;        /* MTC_NODE_LEAF */
    PyObject *obj;       /* owned: PASS object, DICT keys tuple, GENERIC context */
} mtc_node;

typedef struct mtc_tree {
    mtc_node *nodes;
    uint32_t nnodes, cap_nodes;
    mtc_leaf *leaves;
    PyObject **objs;     /* owned: the tensor / ndarray of each leaf (a FileTensor's spec bytes) */
    uint32_t *leaf_node; /* node of each leaf, for error paths */
    uint32_t nleaves, cap_leaves;
    int64_t *shape;      /* dims of all leaves */
    int64_t *strides;    /* byte strides of all leaves */
    int64_t *ostrides;   /* element strides of the outputs of MTC_LEAF_STRIDED leaves (strides.h);
                            unset for the others */
    uint32_t ndims, cap_dims;
    int any_cuda;        /* a leaf lives on a CUDA device */
    int slots;           /* skeleton mode: the placeholder st->leaf_slot marks leaves (numbered
                            in order in nslots), tensors are not expected */
    int pack;            /* a walk for pack (PackedCollate): OnHost is walked into (see above) */
    int numpy_pass;      /* numeric numpy arrays pass through as the same object, as under an
                            OnHost (a pack walk that keeps them numpy, a slots walk, the prefetch
                            service's copies): the structure keeps what the collate made */
    uint32_t nslots;
    uint32_t nhost;      /* host-placed leaves (slots mode: placeholders) */
    uint32_t natoms;     /* skeleton mode: the placeholder st->atom_slot marks a per-batch atom
                            (a PASS node with no obj, numbered in order in natoms) */
    uint64_t cuda_mask;  /* bit d: a leaf lives on cuda:d (d < 64) */
    int diag_depth;      /* reading a replacement that diagnose returned: no second one. Per
                            tree, not global: the replacement's Python code can switch threads
                            to another walk */
    int rereading;       /* mtc_tree_reread: the leaf was counted in stats() when first read */
    uint32_t nresolved;  /* leaves with MTC_LEAF_RESOLVED */
} mtc_tree;

/* Releases everything t owns and zeroes it. */
void mtc_tree_clear(mtc_tree *t);

/* Grows a growable array of `elsize` items to at least `need` (capacity
 * in *cap). 0, or -1 with an exception (MemoryError; 2^31 items or more). */
int mtc_tree_grow(void **buf, uint32_t *cap, uint32_t need, size_t elsize);

/* The path of node `ni` ("data[3]['cams']"). New reference, or NULL with an
 * exception set. */
PyObject *mtc_node_path(const mtc_tree *t, int32_t ni);

/* The path of leaf i in the structure, e.g. "data[3]['cams_gt'][2]". New
 * reference, or NULL with an exception set. */
PyObject *mtc_leaf_path(const mtc_tree *t, uint32_t leaf);

/* The exception for a failed read of file leaf `leaf` (mtc_files_error with
 * the leaf's path). New reference, or NULL with an exception set. */
PyObject *mtc_leaf_file_error(const mtc_tree *t, uint32_t leaf, uint32_t part, int err, uint64_t got);

#endif /* MTC_TREE_H */
