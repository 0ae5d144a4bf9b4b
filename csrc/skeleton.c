/*
 * skeleton.c - a packed batch's structure, walked once and rebuilt from for
 * every batch of the same structure. See skeleton.h.
 */
#include "skeleton.h"

#include <string.h>

static int _atom(PyObject *o)
{
    PyTypeObject *tp = Py_TYPE(o);
    return o == Py_None || tp == &PyUnicode_Type || tp == &PyLong_Type || tp == &PyFloat_Type ||
           tp == &PyBool_Type || tp == &PyBytes_Type;
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
            if (n->obj && !_atom(n->obj)) return 0;
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
    *structure = mtc_rebuild(st, &shape, slots, NULL);
    PyMem_Free(shape.nodes);
    if (!*structure) {
        Py_CLEAR(*atoms);
        return -1;
    }
    return 0;
}

const mtc_tree *mtc_skeleton_tree(mtc_state *st, PyObject *obj)
{
    return Py_IS_TYPE(obj, st->skeleton_type) ? &((mtc_skeleton *)obj)->tree : NULL;
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
