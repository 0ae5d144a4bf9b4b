/*
 * skeleton.c - a packed batch's structure, walked once and rebuilt from for
 * every batch of the same structure. See skeleton.h.
 */
#define NO_IMPORT_ARRAY
#define PY_ARRAY_UNIQUE_SYMBOL mtc_ARRAY_API
#include "skeleton.h"

#include <numpy/arrayobject.h>
#include <string.h>

static int _atom(PyObject *o)
{
    PyTypeObject *tp = Py_TYPE(o);
    return o == Py_None || tp == &PyUnicode_Type || tp == &PyLong_Type || tp == &PyFloat_Type ||
           tp == &PyBool_Type || tp == &PyBytes_Type;
}

/* A passthrough a shared structure may hold in an atom's place: an atom, or
 * a numpy array (a batch keeps its collate's arrays; each travels pickled
 * in the batch's atoms, never shared with another batch). Not a dict key. */
static int _passthrough_atom(PyObject *o)
{
    return _atom(o) || PyArray_CheckExact(o);
}

int mtc_skeleton_atoms_only(const mtc_tree *t)
{
    for (uint32_t i = 0; i < t->nnodes; i++) {
        const mtc_node *n = &t->nodes[i];
        switch (n->kind) {
        case MTC_NODE_LEAF:
        case MTC_NODE_LIST:
        case MTC_NODE_TUPLE:
        case MTC_NODE_HOST: /* an OnHost: not in the output, which holds its value */
            break;
        case MTC_NODE_PASS: /* no obj: a per-batch atom's place */
            if (n->obj && !_passthrough_atom(n->obj)) return 0;
            break;
        case MTC_NODE_DICT: /* obj: the keys, a list */
            for (Py_ssize_t k = 0; k < PyList_GET_SIZE(n->obj); k++)
                if (!_atom(PyList_GET_ITEM(n->obj, k))) return 0;
            break;
        default: /* a container flattened by Python: its context is the batch's */
            return 0;
        }
    }
    return 1;
}

PyObject *mtc_skeleton_make(PyObject *module, PyObject *obj)
{
    mtc_state *st = mtc_get_state(module);
    mtc_skeleton *s = PyObject_New(mtc_skeleton, st->skeleton_type);
    if (!s) return NULL;
    Py_INCREF(st->skeleton_type); /* heap type instances own their type */
    memset(&s->tree, 0, sizeof s->tree);
    s->tree.slots = 1;
    if (mtc_traverse(st, obj, &s->tree)) goto error;
    if (s->tree.nleaves || !mtc_skeleton_atoms_only(&s->tree)) {
        PyErr_SetString(PyExc_ValueError, "mtc_loader: a packed batch's shared skeleton holds more than plain "
                        "containers and atoms (a corrupt or forged descriptor)");
        goto error;
    }
    return (PyObject *)s;
error:
    Py_DECREF(s);
    return NULL;
}

/* ---- the structures this process shared, with their walks ----
 *
 * Packing the batches of a dataset in one process (the main process with
 * num_workers=0, or a worker) would otherwise build the same placeholder
 * structure for every batch: a new list or dict per container, hundreds of
 * objects for the garbage collector to count, and in the main process a walk
 * of it again at unpack. Instead the structures are kept (a few, GIL held),
 * each with its walk: a batch whose walk matches one of them node for node
 * gets that same structure object, and unpack (mtc_skeleton_tree) rebuilds
 * from the kept walk. A kept structure is dropped only when nothing else
 * holds it (no batch, so no unpack in progress, still refers to it): the walk
 * unpack reads stays alive while it reads it. The structure object is shared
 * by the batches and never mutated by the engine. */

#define _SHARED_MAX 16

static struct {
    PyObject *structure;   /* the placeholder structure handed to the batches */
    mtc_skeleton *walk;    /* its walk (slots mode) */
} _shared[_SHARED_MAX];
static unsigned _shared_next;

/* 1 when two dict keys (atoms) are the same key for the output: the same
 * type and value (a float bit for bit: 0.0 and -0.0 are distinct keys of
 * the output, though equal). */
static int _same_key(PyObject *a, PyObject *b)
{
    if (a == b) return 1;
    if (Py_TYPE(a) != Py_TYPE(b)) return 0;
    if (PyFloat_CheckExact(a)) {
        double x = PyFloat_AS_DOUBLE(a), y = PyFloat_AS_DOUBLE(b);
        return memcmp(&x, &y, sizeof x) == 0;
    }
    int eq = PyObject_RichCompareBool(a, b, Py_EQ); /* atoms: str, int, bool, bytes, None */
    if (eq < 0) PyErr_Clear();
    return eq == 1;
}

/* 1 when the walk w of a kept structure is what the receiver's walk of the
 * structure built from pack walk t would be: the same nodes in the same
 * order, the same dict keys, leaves numbered alike (atoms may differ: they
 * travel beside the structure). */
static int _same_walk(const mtc_tree *t, const mtc_tree *w)
{
    if (t->nnodes != w->nnodes || t->nleaves != w->nslots || w->nleaves || t->nhost != w->nhost) return 0;
    for (uint32_t i = 0; i < t->nnodes; i++) {
        const mtc_node *a = &t->nodes[i], *b = &w->nodes[i];
        if (a->kind != b->kind || a->nchildren != b->nchildren || a->host != b->host) return 0;
        switch (a->kind) {
        case MTC_NODE_LEAF:
            if (a->leaf != b->leaf) return 0;
            break;
        case MTC_NODE_DICT: {
            Py_ssize_t n = PyList_GET_SIZE(a->obj);
            if (PyList_GET_SIZE(b->obj) != n) return 0;
            for (Py_ssize_t k = 0; k < n; k++)
                if (!_same_key(PyList_GET_ITEM(a->obj, k), PyList_GET_ITEM(b->obj, k))) return 0;
            break;
        }
        case MTC_NODE_HOST:
            if (a->obj != b->obj) return 0;
            break;
        default: /* list, tuple, an atom's place */
            break;
        }
    }
    return 1;
}

/* The kept structure whose walk matches t (new reference), or NULL. */
static PyObject *_shared_find(mtc_state *st, const mtc_tree *t)
{
    (void)st;
    for (unsigned i = 0; i < _SHARED_MAX; i++)
        if (_shared[i].structure && _same_walk(t, &_shared[i].walk->tree)) return Py_NewRef(_shared[i].structure);
    return NULL;
}

/* Keeps `structure` (just built from a pack walk) with its walk, in a free
 * place or one whose structure nothing else holds; not kept when every place
 * is in use, or when its walk fails (no exception is left set). */
static void _shared_add(mtc_state *st, PyObject *structure)
{
    unsigned place = _SHARED_MAX;
    for (unsigned k = 0; k < _SHARED_MAX && place == _SHARED_MAX; k++) {
        unsigned i = (_shared_next + k) % _SHARED_MAX;
        if (!_shared[i].structure || Py_REFCNT(_shared[i].structure) == 1) place = i;
    }
    if (place == _SHARED_MAX) return;
    mtc_skeleton *s = PyObject_New(mtc_skeleton, st->skeleton_type);
    if (!s) {
        PyErr_Clear();
        return;
    }
    Py_INCREF(st->skeleton_type); /* heap type instances own their type */
    memset(&s->tree, 0, sizeof s->tree);
    s->tree.slots = 1;
    if (mtc_traverse(st, structure, &s->tree)) {
        PyErr_Clear();
        Py_DECREF(s);
        return;
    }
    Py_CLEAR(_shared[place].structure);
    Py_CLEAR(_shared[place].walk);
    _shared[place].structure = Py_NewRef(structure);
    _shared[place].walk = s;
    _shared_next = (place + 1) % _SHARED_MAX;
}

/* The kept walk of a kept structure (borrowed), or NULL. */
static const mtc_tree *_shared_walk(PyObject *obj)
{
    for (unsigned i = 0; i < _SHARED_MAX; i++)
        if (_shared[i].structure == obj) return &_shared[i].walk->tree;
    return NULL;
}

int mtc_skeleton_share(mtc_state *st, const mtc_tree *t, PyObject *const *slots, PyObject **structure,
                       PyObject **atoms)
{
    uint32_t count = 0;
    for (uint32_t i = 0; i < t->nnodes; i++) count += t->nodes[i].kind == MTC_NODE_PASS;
    mtc_tree shape = *t; /* shallow: the rebuild only reads it, and takes its own references */
    shape.nodes = PyMem_Malloc((t->nnodes ? t->nnodes : 1) * sizeof *shape.nodes);
    *atoms = PyTuple_New(count);
    if (!shape.nodes || !*atoms) {
        PyMem_Free(shape.nodes);
        Py_CLEAR(*atoms);
        PyErr_NoMemory();
        return -1;
    }
    memcpy(shape.nodes, t->nodes, t->nnodes * sizeof *shape.nodes);
    /* atoms in preorder, the order in which the receiver's walk numbers the ATOM places */
    for (uint32_t i = 0, k = 0; i < t->nnodes; i++) {
        if (shape.nodes[i].kind != MTC_NODE_PASS) continue;
        PyTuple_SET_ITEM(*atoms, k++, Py_NewRef(t->nodes[i].obj));
        shape.nodes[i].obj = st->atom_slot;
    }
    /* a structure this process shared before is handed out again (no containers per batch) */
    if ((*structure = _shared_find(st, t))) {
        PyMem_Free(shape.nodes);
        return 0;
    }
    *structure = mtc_rebuild(st, &shape, slots, NULL);
    PyMem_Free(shape.nodes);
    if (!*structure) {
        Py_CLEAR(*atoms);
        return -1;
    }
    _shared_add(st, *structure);
    return 0;
}

const mtc_tree *mtc_skeleton_tree(mtc_state *st, PyObject *obj)
{
    if (Py_IS_TYPE(obj, st->skeleton_type)) return &((mtc_skeleton *)obj)->tree;
    return _shared_walk(obj);
}

static void _skeleton_dealloc(mtc_skeleton *s)
{
    PyTypeObject *tp = Py_TYPE(s);
    mtc_tree_clear(&s->tree);
    tp->tp_free((PyObject *)s);
    Py_DECREF(tp);
}

static PyObject *_skeleton_leaves(mtc_skeleton *s, void *unused)
{
    return PyLong_FromUnsignedLong(s->tree.nslots);
}

static PyGetSetDef _skeleton_getset[] = {
    {"leaves", (getter)_skeleton_leaves, NULL, "The tensors a batch of this structure holds.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot _skeleton_slots[] = {
    {Py_tp_dealloc, _skeleton_dealloc},
    {Py_tp_getset, _skeleton_getset},
    {Py_tp_doc, "A packed batch's structure walked once (mtc_loader._engine.skeleton)."},
    {0, NULL},
};

PyType_Spec mtc_skeleton_spec = {
    .name = "mtc_loader._engine.Skeleton",
    .basicsize = sizeof(mtc_skeleton),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = _skeleton_slots,
};
