/*
 * rebuild.c - the output structure rebuilt around new leaves from the
 * skeleton that traverse.c recorded (mtc_rebuild, declared in traverse.h).
 */
#include "traverse.h"

PyObject *mtc_rebuild(mtc_state *st, const mtc_tree *t, PyObject *const *outputs, PyObject *const *atoms)
{
    /* Nodes are in preorder; walking them backwards, a container's children
     * are the top of the value stack, its first child topmost. */
    PyObject **vals = PyMem_Malloc((t->nnodes + 1) * sizeof *vals);
    if (!vals) return PyErr_NoMemory();
    uint32_t top = 0;
    for (uint32_t i = t->nnodes; i-- > 0;) {
        const mtc_node *n = &t->nodes[i];
        PyObject *v = NULL;
        Py_ssize_t k = n->nchildren;
        switch (n->kind) {
        case MTC_NODE_LEAF:
            v = Py_NewRef(outputs[n->leaf]);
            break;
        case MTC_NODE_PASS:
            v = Py_NewRef(n->obj ? n->obj : atoms[n->leaf]);
            break;
        case MTC_NODE_LIST:
            if (!(v = PyList_New(k))) goto error;
            for (Py_ssize_t j = 0; j < k; j++) PyList_SET_ITEM(v, j, vals[--top]);
            break;
        case MTC_NODE_TUPLE:
            if (!(v = PyTuple_New(k))) goto error;
            for (Py_ssize_t j = 0; j < k; j++) PyTuple_SET_ITEM(v, j, vals[--top]);
            break;
        case MTC_NODE_DICT:
            if (!(v = PyDict_New())) goto error;
            for (Py_ssize_t j = 0; j < k; j++) {
                PyObject *x = vals[--top];
                int rc = PyDict_SetItem(v, PyList_GET_ITEM(n->obj, j), x);
                Py_DECREF(x);
                if (rc) {
                    for (Py_ssize_t r = j + 1; r < k; r++) Py_DECREF(vals[--top]);
                    Py_DECREF(v);
                    goto error;
                }
            }
            break;
        case MTC_NODE_HOST: /* its value: wrapped again only in a pack walk's skeleton */
            v = vals[--top];
            if (t->pack) {
                PyObject *w = PyObject_CallOneArg(n->obj, v);
                Py_DECREF(v);
                if (!(v = w)) goto error;
            }
            break;
        case MTC_NODE_GENERIC: {
            PyObject *lst = PyList_New(k);
            if (!lst) goto error;
            for (Py_ssize_t j = 0; j < k; j++) PyList_SET_ITEM(lst, j, vals[--top]);
            v = PyObject_CallFunctionObjArgs(st->unflatten, PyTuple_GET_ITEM(n->obj, 0), lst, NULL);
            Py_DECREF(lst);
            if (!v) goto error;
            break;
        }
        }
        vals[top++] = v;
    }
    PyObject *res = top == 1 ? vals[0] : NULL;
    PyMem_Free(vals);
    if (!res) PyErr_SetString(PyExc_SystemError, "mtc_loader: skeleton rebuild mismatch");
    return res;
error:
    while (top) Py_DECREF(vals[--top]);
    PyMem_Free(vals);
    return NULL;
}
