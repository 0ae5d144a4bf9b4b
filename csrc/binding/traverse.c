/*
 * traverse.c - the walk over a nested batch (see traverse.h; the tree it
 * fills is in tree.c, the leaf readers in leaves.c, the rebuild in rebuild.c).
 */
#define NO_IMPORT_ARRAY
#define PY_ARRAY_UNIQUE_SYMBOL mtc_ARRAY_API
#include "traverse.h"

#include <numpy/arrayobject.h>
#include <string.h>

#include "leaves.h"

/* ---- nodes ---- */

static int32_t _add_node(mtc_tree *t, uint8_t kind, int32_t parent, int32_t pos)
{
    if (mtc_tree_grow((void **)&t->nodes, &t->cap_nodes, t->nnodes + 1, sizeof *t->nodes)) return -1;
    mtc_node *n = &t->nodes[t->nnodes];
    n->kind = kind;
    n->parent = parent;
    n->pos = pos;
    n->nchildren = 0;
    n->host = 0;
    n->leaf = -1;
    n->obj = NULL;
    return (int32_t)t->nnodes++;
}

/* ---- the walk ---- */

/*
 * The walk keeps its own stack of open containers. Every frame owns a
 * reference to its container: a visit runs user code (a subclass's keys() or
 * __iter__, a dataclass's __getattribute__, a tensor subclass's property)
 * that may drop every other reference to a container higher up.
 *
 * The cycle check asks whether a container is already open on the stack. The
 * frames are also chained in a hash table by container address; as the stack
 * is LIFO, the frame popped is always the head of its bucket, so a pop unlinks
 * it in O(1) and the check costs O(1) per container whatever the depth.
 */
typedef struct _frame {
    PyObject *container;  /* owned */
    PyObject *children;   /* GENERIC: owned list of children */
    int32_t node;
    int32_t hnext;        /* next frame of the same bucket, -1 ends the chain */
    Py_ssize_t next;      /* next child index, or PyDict_Next position */
    uint8_t kind;
    uint8_t host;         /* inside an OnHost (pack and slots walks): its children are host-placed */
} _frame;

typedef struct _stack {
    _frame *f;
    uint32_t n, cap;
    int32_t *bucket;      /* frame index heading each bucket, -1 empty */
    uint32_t nbuckets;    /* power of two >= cap */
    PyObject *keys[4];    /* borrowed: keys lists of dicts walked to the end (_share_keys) */
    uint32_t nkeys;
} _stack;

/* A dict walked to the end: when its keys (the same objects, in the same
 * order) are those of a recent dict of this walk, the node takes that list
 * and drops its own, so that a batch of many dicts of one schema holds a few
 * keys lists, not one per dict (each a list for the garbage collector to
 * count). A shared list is complete: nothing appends to it any more. */
static void _share_keys(_stack *s, mtc_node *n)
{
    PyObject *mine = n->obj;
    Py_ssize_t len = PyList_GET_SIZE(mine);
    for (uint32_t k = 0; k < s->nkeys && k < 4; k++) {
        PyObject *other = s->keys[k];
        if (PyList_GET_SIZE(other) != len) continue;
        Py_ssize_t i = 0;
        while (i < len && PyList_GET_ITEM(other, i) == PyList_GET_ITEM(mine, i)) i++;
        if (i < len) continue;
        n->obj = Py_NewRef(other);
        Py_DECREF(mine);
        return;
    }
    s->keys[s->nkeys++ % 4] = mine;
}

static inline uint32_t _bucket_of(const _stack *s, PyObject *o)
{
    return (uint32_t)(((uint64_t)(uintptr_t)o * 0x9E3779B97F4A7C15ull) >> 32) & (s->nbuckets - 1);
}

/* Room for one more frame, buckets included. 0 or -1 with an exception. */
static int _stack_reserve(_stack *s)
{
    if (mtc_tree_grow((void **)&s->f, &s->cap, s->n + 1, sizeof *s->f)) return -1;
    if (s->nbuckets >= s->cap) return 0;
    uint32_t nb = s->nbuckets ? s->nbuckets : 64;
    while (nb < s->cap) nb *= 2;
    int32_t *b = PyMem_Realloc(s->bucket, (size_t)nb * sizeof *b);
    if (!b) {
        PyErr_NoMemory();
        return -1;
    }
    memset(b, 0xff, (size_t)nb * sizeof *b);
    s->bucket = b;
    s->nbuckets = nb;
    /* re-chain bottom to top: a later frame heads its bucket, as on push */
    for (uint32_t i = 0; i < s->n; i++) {
        uint32_t h = _bucket_of(s, s->f[i].container);
        s->f[i].hnext = s->bucket[h];
        s->bucket[h] = (int32_t)i;
    }
    return 0;
}

/* 1 when obj is a container open on the stack (the walk is inside it). */
static int _stack_has(const _stack *s, PyObject *obj)
{
    if (!s->nbuckets) return 0;
    for (int32_t i = s->bucket[_bucket_of(s, obj)]; i >= 0; i = s->f[i].hnext)
        if (s->f[i].container == obj) return 1;
    return 0;
}

/* Pops the top frame, releasing what it owns. */
static void _stack_pop(_stack *s)
{
    _frame *f = &s->f[--s->n];
    s->bucket[_bucket_of(s, f->container)] = f->hnext; /* LIFO: f heads its bucket */
    Py_XDECREF(f->children);
    Py_DECREF(f->container);
}

static int _cycle_error(const mtc_tree *t, int32_t node)
{
    PyObject *path = mtc_node_path(t, node);
    if (path) {
        PyErr_Format(PyExc_ValueError,
                     "mtc_loader: %U contains itself (a reference cycle); start_copy copies "
                     "trees of containers, not graphs: pass a structure without cycles",
                     path);
        Py_DECREF(path);
    }
    return -1;
}

/* Classifies a non-exact type through the per-type cache. Returns a kind or -1.
 * classify runs Python code, during which another thread may change the
 * registrations (and bump type_gen): its answer is then used for this object
 * but not kept. Nothing between the generation check and the insert can run
 * another thread (a type hashes and compares by identity). The cache holds its
 * types strongly, so it is bounded (state.h's MTC_TYPE_CACHE_MAX). */
static int _classify(mtc_state *st, PyObject *obj)
{
    PyObject *tp = (PyObject *)Py_TYPE(obj);
    PyObject *k = PyDict_GetItemWithError(st->type_cache, tp);
    if (k) return (int)PyLong_AsLong(k);
    if (PyErr_Occurred()) return -1;
    uint64_t gen = st->type_gen;
    k = PyObject_CallOneArg(st->classify, tp);
    if (!k) return -1;
    int kind = (int)PyLong_AsLong(k);
    int rc = 0;
    /* (clearing may free types, whose weak references' callbacks may run other threads: the
     * generation is read after it) */
    if (PyDict_GET_SIZE(st->type_cache) >= MTC_TYPE_CACHE_MAX) PyDict_Clear(st->type_cache);
    if (gen == st->type_gen) rc = PyDict_SetItem(st->type_cache, tp, k);
    Py_DECREF(k);
    return rc ? -1 : kind;
}

/* 1 when numpy array obj is one no tensor can hold, whatever its layout:
 * strings, bytes, objects, records, dates and durations (dtype kinds U, T, S,
 * O, V, M, m; nuScenes' and mmdet3d's info dicts carry names and tokens so).
 * Such an array is a leaf like a str: passed through as the same object by
 * start_copy, pickled into a packed batch's skeleton by PackedCollate. Numeric
 * and bool arrays (kinds b, i, u, f, c) are read as tensors, and those torch
 * has no dtype for (float128) are diagnosed there. */
static int _array_passes(PyObject *obj)
{
    char k = PyArray_DESCR((PyArrayObject *)obj)->kind;
    return k == 'U' || k == 'T' || k == 'S' || k == 'O' || k == 'V' || k == 'M' || k == 'm';
}

/* Marks leaf node n (the last leaf read, or a slot) host-placed. 0. */
static int _host_leaf(mtc_tree *t, int32_t n)
{
    t->nodes[n].host = 1;
    t->nhost++;
    if (!t->slots) t->leaves[t->nodes[n].leaf].flags |= MTC_LEAF_HOST;
    return 0;
}

static int _open(mtc_state *st, mtc_tree *t, _stack *s, PyObject *obj, uint8_t nkind, int32_t parent, int32_t pos,
                 int host);

/* Visits one object: adds its node, a leaf, or pushes a frame. host: the
 * object is under an OnHost (pack and slots walks). */
static int _visit(mtc_state *st, mtc_tree *t, _stack *s, PyObject *obj, int32_t parent, int32_t pos, int host)
{
    PyTypeObject *tp = Py_TYPE(obj);
    int kind;
    uint8_t nkind;
    if (t->slots && obj == st->leaf_slot) {
        int32_t n = _add_node(t, MTC_NODE_LEAF, parent, pos);
        if (n < 0) return -1;
        t->nodes[n].leaf = (int32_t)t->nslots++;
        return host ? _host_leaf(t, n) : 0;
    }
    if (t->slots && obj == st->atom_slot) {
        int32_t n = _add_node(t, MTC_NODE_PASS, parent, pos);
        if (n < 0) return -1;
        t->nodes[n].leaf = (int32_t)t->natoms++; /* obj stays NULL: the batch's atom */
        return 0;
    }
    if ((PyObject *)tp == st->tensor_type) kind = MTC_KIND_TENSOR;
    else if (tp == &PyArray_Type) kind = MTC_KIND_NDARRAY;
    else if (tp == &PyList_Type) return _open(st, t, s, obj, MTC_NODE_LIST, parent, pos, host);
    else if (tp == &PyDict_Type) return _open(st, t, s, obj, MTC_NODE_DICT, parent, pos, host);
    else if (tp == &PyTuple_Type) return _open(st, t, s, obj, MTC_NODE_TUPLE, parent, pos, host);
    else if (tp == &PyUnicode_Type || tp == &PyLong_Type || tp == &PyFloat_Type ||
             obj == Py_None || tp == &PyBool_Type || tp == &PyBytes_Type)
        kind = MTC_KIND_LEAF;
    else if ((kind = _classify(st, obj)) < 0) return -1;
    if (kind == MTC_KIND_NDARRAY && _array_passes(obj)) kind = MTC_KIND_LEAF;

    if (kind == MTC_KIND_LEAF || ((host || t->numpy_pass || t->slots) && kind == MTC_KIND_NDARRAY)) {
        /* (a numpy array under an OnHost, or in a walk that keeps numpy arrays, passes
         * through: pickled in the skeleton, as a DataLoader worker pickles it) */
        int32_t n = _add_node(t, MTC_NODE_PASS, parent, pos);
        if (n < 0) return -1;
        Py_INCREF(obj);
        t->nodes[n].obj = obj;
        return 0;
    }
    if (kind == MTC_KIND_TENSOR || kind == MTC_KIND_NDARRAY) {
        int32_t n = _add_node(t, MTC_NODE_LEAF, parent, pos);
        if (n < 0) return -1;
        if (mtc_leaves_reserve(t, 0)) return -1;
        int rc = kind == MTC_KIND_TENSOR ? mtc_leaves_read_tensor(st, t, n, obj) : mtc_leaves_read_ndarray(st, t, n, obj);
        return rc || !host ? rc : _host_leaf(t, n);
    }
    if (kind == MTC_KIND_FILE) {
        int32_t n = _add_node(t, MTC_NODE_LEAF, parent, pos);
        if (n < 0) return -1;
        int rc = mtc_leaves_read_file(st, t, n, obj);
        return rc || !host ? rc : _host_leaf(t, n);
    }
    nkind = MTC_NODE_GENERIC;
    if (kind == MTC_KIND_HOST) {
        if (!t->pack && !t->slots) { /* start_copy: its value passes through, the same object */
            PyObject *value = PyObject_GetAttrString(obj, "value");
            int32_t n = value ? _add_node(t, MTC_NODE_PASS, parent, pos) : -1;
            if (n < 0) {
                Py_XDECREF(value);
                return -1;
            }
            t->nodes[n].obj = value;
            return 0;
        }
        nkind = MTC_NODE_HOST;
    }
    return _open(st, t, s, obj, nkind, parent, pos, host);
}

/* Opens container obj as a node of kind nkind (list, tuple, dict, a
 * flattened type, an OnHost marker): adds the node, checks for a cycle and
 * pushes its frame, whose children the walk visits next. host: as _visit's. */
static int _open(mtc_state *st, mtc_tree *t, _stack *s, PyObject *obj, uint8_t nkind, int32_t parent, int32_t pos,
                 int host)
{
    PyTypeObject *tp = Py_TYPE(obj);
    int32_t n = _add_node(t, nkind, parent, pos);
    if (n < 0) return -1;
    if (_stack_has(s, obj)) return _cycle_error(t, n);
    if (_stack_reserve(s)) return -1;
    PyObject *children = NULL;
    if (nkind == MTC_NODE_DICT) {
        if (!(t->nodes[n].obj = PyList_New(0))) return -1;
    } else if (nkind == MTC_NODE_HOST) {
        /* its one child; its type rebuilds the marker around it in the skeleton */
        if (!(children = PyObject_GetAttrString(obj, "value"))) return -1;
        t->nodes[n].obj = Py_NewRef((PyObject *)tp);
        host = 1;
    } else if (nkind == MTC_NODE_GENERIC) {
        /* flatten(obj) -> (children list, (context, [path segments])) */
        PyObject *r = PyObject_CallOneArg(st->flatten, obj);
        if (!r) return mtc_leaves_diagnose(st, t, n, obj); /* raises, naming the container's path */
        if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 2 || !PyList_Check(PyTuple_GET_ITEM(r, 0)) ||
            !PyTuple_Check(PyTuple_GET_ITEM(r, 1)) || PyTuple_GET_SIZE(PyTuple_GET_ITEM(r, 1)) != 2) {
            Py_DECREF(r);
            PyErr_SetString(PyExc_SystemError, "mtc_loader._tree.flatten returned a bad value");
            return -1;
        }
        children = Py_NewRef(PyTuple_GET_ITEM(r, 0));
        t->nodes[n].obj = Py_NewRef(PyTuple_GET_ITEM(r, 1));
        Py_DECREF(r);
    }
    /* flatten ran Python code, but nothing else touches the stack: the room
     * reserved above is still there */
    _frame *f = &s->f[s->n];
    f->container = Py_NewRef(obj);
    f->children = children;
    f->node = n;
    f->next = 0;
    f->kind = nkind;
    f->host = (uint8_t)host;
    uint32_t h = _bucket_of(s, obj);
    f->hnext = s->bucket[h];
    s->bucket[h] = (int32_t)s->n;
    s->n++;
    return 0;
}

/* The sizes of the last walk (GIL held): a loop walks batches of one shape,
 * so a walk starts with room for as many nodes, leaves and dims as the last
 * one had, rather than growing its arrays from empty every time. Skeleton
 * walks (slots), whose trees are kept, neither use nor set the hint. */
#define _HINT_MAX (1u << 16)
static uint32_t _hint_nodes, _hint_leaves, _hint_dims;

int mtc_traverse(mtc_state *st, PyObject *data, mtc_tree *t)
{
    _stack s = {0};
    int rc = -1;
    if (!t->slots) {
        if (_hint_nodes && mtc_tree_grow((void **)&t->nodes, &t->cap_nodes, _hint_nodes, sizeof *t->nodes)) goto out;
        if (_hint_leaves && mtc_leaves_reserve_n(t, _hint_leaves, _hint_dims)) goto out;
    }
    if (_visit(st, t, &s, data, -1, 0, 0)) goto out;
    while (s.n) {
        _frame *f = &s.f[s.n - 1];
        PyObject *child = NULL;
        int32_t node = f->node, pos = (int32_t)t->nodes[node].nchildren;
        switch (f->kind) {
        case MTC_NODE_LIST:
            /* re-read the size: a passthrough's Python code may have run meanwhile */
            if (f->next < PyList_GET_SIZE(f->container)) child = PyList_GET_ITEM(f->container, f->next++);
            break;
        case MTC_NODE_TUPLE:
            if (f->next < PyTuple_GET_SIZE(f->container)) child = PyTuple_GET_ITEM(f->container, f->next++);
            break;
        case MTC_NODE_GENERIC:
            if (f->next < PyList_GET_SIZE(f->children)) child = PyList_GET_ITEM(f->children, f->next++);
            break;
        case MTC_NODE_HOST: /* children: the value itself */
            if (f->next++ == 0) child = f->children;
            break;
        case MTC_NODE_DICT: {
            PyObject *key;
            if (PyDict_Next(f->container, &f->next, &key, &child))
                if (PyList_Append(t->nodes[node].obj, key)) goto out;
            break;
        }
        }
        if (!child) { /* container done */
            if (f->kind == MTC_NODE_DICT) _share_keys(&s, &t->nodes[node]);
            _stack_pop(&s);
            continue;
        }
        if (t->nodes[node].nchildren == INT32_MAX) {
            PyErr_SetString(PyExc_ValueError, "mtc_loader: a container of 2^31 or more items cannot be copied");
            goto out;
        }
        t->nodes[node].nchildren++;
        Py_INCREF(child); /* a visit may run Python code that drops the container's reference */
        int v = _visit(st, t, &s, child, node, pos, f->host);
        Py_DECREF(child);
        if (v) goto out;
    }
    rc = 0;
    if (!t->slots) {
        _hint_nodes = t->nnodes < _HINT_MAX ? t->nnodes : _HINT_MAX;
        _hint_leaves = t->nleaves < _HINT_MAX ? t->nleaves : _HINT_MAX;
        _hint_dims = t->ndims < 4 * _HINT_MAX ? t->ndims : 4 * _HINT_MAX;
    }
out:
    while (s.n) _stack_pop(&s);
    PyMem_Free(s.f);
    PyMem_Free(s.bucket);
    return rc;
}
