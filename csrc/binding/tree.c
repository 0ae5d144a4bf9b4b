/*
 * tree.c - the tree of a walk (tree.h): its growable arrays, its release,
 * and the paths of its nodes and leaves for error messages.
 */
#include "tree.h"

#include <string.h>

#include "files.h"

/* ---- growable arrays ---- */

int mtc_tree_grow(void **buf, uint32_t *cap, uint32_t need, size_t elsize)
{
    if (need <= *cap) return 0;
    if (need > (uint32_t)INT32_MAX) { /* node and leaf indices are int32 */
        PyErr_SetString(PyExc_MemoryError, "mtc_loader: the batch has 2^31 or more nodes, leaves or dims");
        return -1;
    }
    uint32_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    void *p = PyMem_Realloc(*buf, (size_t)c * elsize);
    if (!p) {
        PyErr_NoMemory();
        return -1;
    }
    *buf = p;
    *cap = c;
    return 0;
}

void mtc_tree_clear(mtc_tree *t)
{
    for (uint32_t i = 0; i < t->nnodes; i++) Py_XDECREF(t->nodes[i].obj);
    for (uint32_t i = 0; i < t->nleaves; i++) Py_XDECREF(t->objs[i]);
    PyMem_Free(t->nodes);
    PyMem_Free(t->leaves);
    PyMem_Free(t->objs);
    PyMem_Free(t->leaf_node);
    PyMem_Free(t->shape);
    PyMem_Free(t->strides);
    PyMem_Free(t->ostrides);
    memset(t, 0, sizeof *t);
}

/* ---- paths ---- */

/* Appends the path segment of node `ni` within its parent to `parts`. */
static int _path_segment(const mtc_tree *t, int32_t ni, PyObject *parts)
{
    const mtc_node *n = &t->nodes[ni];
    const mtc_node *p = &t->nodes[n->parent];
    PyObject *seg = NULL;
    if (p->kind == MTC_NODE_DICT) {
        PyObject *key = PyList_GetItem(p->obj, n->pos);
        seg = key ? PyUnicode_FromFormat("[%R]", key) : NULL;
    } else if (p->kind == MTC_NODE_HOST) {
        return 0; /* the OnHost marker is not part of the path the user sees */
    } else if (p->kind == MTC_NODE_GENERIC) {
        /* context tuple: (context, [segment strings]) */
        PyObject *names = PyTuple_GetItem(p->obj, 1);
        seg = names ? PySequence_GetItem(names, n->pos) : NULL;
    } else {
        seg = PyUnicode_FromFormat("[%d]", (int)n->pos);
    }
    if (!seg) return -1;
    int rc = PyList_Append(parts, seg);
    Py_DECREF(seg);
    return rc;
}

PyObject *mtc_node_path(const mtc_tree *t, int32_t ni)
{
    PyObject *parts = PyList_New(0), *res = NULL, *empty = NULL;
    if (!parts) return NULL;
    for (; ni >= 0 && t->nodes[ni].parent >= 0; ni = t->nodes[ni].parent)
        if (_path_segment(t, ni, parts)) goto done;
    if (PyList_Reverse(parts)) goto done;
    if (!(empty = PyUnicode_FromString(""))) goto done;
    PyObject *joined = PyUnicode_Join(empty, parts);
    if (joined) {
        res = PyUnicode_FromFormat("data%U", joined);
        Py_DECREF(joined);
    }
done:
    Py_XDECREF(empty);
    Py_DECREF(parts);
    return res;
}

PyObject *mtc_leaf_path(const mtc_tree *t, uint32_t leaf)
{
    return mtc_node_path(t, (int32_t)t->leaf_node[leaf]);
}

PyObject *mtc_leaf_file_error(const mtc_tree *t, uint32_t leaf, uint32_t part, int err, uint64_t got)
{
    PyObject *where = mtc_leaf_path(t, leaf);
    if (!where) return NULL;
    PyObject *exc = mtc_files_error((const void *)t->leaves[leaf].data, where, part, err, got);
    Py_DECREF(where);
    return exc;
}

