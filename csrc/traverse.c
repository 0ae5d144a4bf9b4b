/*
 * traverse.c - the walk over a nested batch (see traverse.h; the rebuild is in
 * rebuild.c).
 */
#define NO_IMPORT_ARRAY
#define PY_ARRAY_UNIQUE_SYMBOL mtc_ARRAY_API
#include "traverse.h"

#include <numpy/arrayobject.h>

#include "files.h"
#include "strides.h"
#include <string.h>

#include "cuda.h" /* MTC_MAX_DEVICES */

/* ---- growable arrays ---- */

static int _grow(void **buf, uint32_t *cap, uint32_t need, size_t elsize)
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

static int32_t _add_node(mtc_tree *t, uint8_t kind, int32_t parent, int32_t pos)
{
    if (_grow((void **)&t->nodes, &t->cap_nodes, t->nnodes + 1, sizeof *t->nodes)) return -1;
    mtc_node *n = &t->nodes[t->nnodes];
    n->kind = kind;
    n->parent = parent;
    n->pos = pos;
    n->nchildren = 0;
    n->leaf = -1;
    n->obj = NULL;
    return (int32_t)t->nnodes++;
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

static PyObject *_node_path(const mtc_tree *t, int32_t ni)
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
    return _node_path(t, (int32_t)t->leaf_node[leaf]);
}

PyObject *mtc_leaf_file_error(const mtc_tree *t, uint32_t leaf, uint32_t part, int err, uint64_t got)
{
    PyObject *where = mtc_leaf_path(t, leaf);
    if (!where) return NULL;
    PyObject *exc = mtc_files_error((const void *)t->leaves[leaf].data, where, part, err, got);
    Py_DECREF(where);
    return exc;
}

static int _read_tensor(mtc_state *st, mtc_tree *t, int32_t node, PyObject *obj);

/* Hands a leaf that failed the fast checks to mtc_loader._tree.diagnose,
 * which raises an exception naming the path and what to do, or returns a
 * replacement tensor that is read instead. 0 or -1. */
static int _diagnose(mtc_state *st, mtc_tree *t, int32_t node, PyObject *obj)
{
    PyObject *exc = NULL;
    if (PyErr_Occurred()) {
        PyObject *type, *tb;
        PyErr_Fetch(&type, &exc, &tb);
        PyErr_NormalizeException(&type, &exc, &tb);
        Py_XDECREF(type);
        Py_XDECREF(tb);
    }
    PyObject *path = _node_path(t, node);
    if (!path) {
        Py_XDECREF(exc);
        return -1;
    }
    PyObject *res = PyObject_CallFunctionObjArgs(st->diagnose, obj, path, exc ? exc : Py_None, NULL);
    Py_DECREF(path);
    Py_XDECREF(exc);
    if (!res) return -1;
    if (res == Py_None || t->diag_depth) {
        Py_DECREF(res);
        PyErr_SetString(PyExc_RuntimeError, "mtc_loader: a leaf failed the engine's checks");
        return -1;
    }
    /* A resolved replacement (e.g. a lazily conjugated view materialised):
     * it takes the leaf's place. */
    t->diag_depth = 1;
    int rc = _read_tensor(st, t, node, res);
    t->diag_depth = 0;
    Py_DECREF(res);
    return rc;
}

/* ---- leaves ---- */

static int _reserve_leaf(mtc_tree *t, int ndim)
{
    if (_grow((void **)&t->leaves, &t->cap_leaves, t->nleaves + 1, sizeof *t->leaves)) return -1;
    /* objs and leaf_node grow with the same capacity */
    uint32_t cap = t->cap_leaves;
    PyObject **o = PyMem_Realloc(t->objs, cap * sizeof *o);
    if (!o) return PyErr_NoMemory(), -1;
    t->objs = o;
    uint32_t *ln = PyMem_Realloc(t->leaf_node, cap * sizeof *ln);
    if (!ln) return PyErr_NoMemory(), -1;
    t->leaf_node = ln;
    uint32_t cap_dims = t->cap_dims;
    if (_grow((void **)&t->shape, &cap_dims, t->ndims + (uint32_t)ndim, sizeof *t->shape)) return -1;
    cap_dims = t->cap_dims;
    if (_grow((void **)&t->strides, &cap_dims, t->ndims + (uint32_t)ndim, sizeof *t->strides)) return -1;
    cap_dims = t->cap_dims;
    if (_grow((void **)&t->ostrides, &cap_dims, t->ndims + (uint32_t)ndim, sizeof *t->ostrides)) return -1;
    t->cap_dims = cap_dims;
    return 0;
}

/* Row-major contiguity as torch defines it: dims of size 1 are ignored, an
 * empty tensor is contiguous. Strides in bytes. */
static int _is_contiguous(const int64_t *shape, const int64_t *strides, int ndim, int64_t elsize)
{
    int64_t expected = elsize;
    for (int d = ndim - 1; d >= 0; d--)
        if (shape[d] == 0) return 1;
    for (int d = ndim - 1; d >= 0; d--) {
        if (shape[d] != 1 && strides[d] != expected) return 0;
        /* a numpy as_strided view can claim any shape */
        if (__builtin_mul_overflow(expected, shape[d], &expected)) return 0;
    }
    return 1;
}

/* The element count of dims shape[0..ndim), saturated at INT64_MAX: an
 * expanded view (0 strides) can have more elements than int64 counts, e.g.
 * torch.zeros(1).expand(2**40, 2**40). Sizes are >= 0. */
static int64_t _numel(const int64_t *shape, int ndim)
{
    int64_t n = 1;
    for (int d = 0; d < ndim; d++)
        if (shape[d] == 0) return 0;
    for (int d = 0; d < ndim; d++)
        if (__builtin_mul_overflow(n, shape[d], &n)) return INT64_MAX;
    return n;
}

/* The error for a leaf of more dims than the engine takes. -1. */
static int _too_many_dims(const mtc_tree *t, int32_t node, Py_ssize_t ndim)
{
    PyObject *path = _node_path(t, node);
    if (path) {
        PyErr_Format(PyExc_ValueError,
                     "mtc_loader: %U has %zd dimensions; mtc_loader copies tensors of at most %d: "
                     "reshape it to fewer dimensions before the copy (and back after)",
                     path, ndim, MTC_MAX_NDIM);
        Py_DECREF(path);
    }
    return -1;
}

static int _finish_leaf(mtc_tree *t, mtc_leaf *l, int32_t node, PyObject *obj)
{
    /* bytes of a contiguous copy, saturated: a view of 2^63 bytes or more is
     * reused where it already is, and refused by the binding layer where it
     * would have to be copied (the planner never packs it) */
    int64_t numel = _numel(&t->shape[t->ndims], l->ndim);
    if (__builtin_mul_overflow(numel, (int64_t)l->elsize, &l->nbytes)) l->nbytes = INT64_MAX;
    if (_is_contiguous(&t->shape[t->ndims], &t->strides[t->ndims], l->ndim, l->elsize))
        l->flags |= MTC_LEAF_CONTIGUOUS;
    t->ndims += (uint32_t)l->ndim;
    Py_INCREF(obj);
    t->objs[t->nleaves] = obj;
    t->leaf_node[t->nleaves] = (uint32_t)node;
    t->nodes[node].leaf = (int32_t)t->nleaves;
    t->nleaves++;
    if (l->dev >= 0) {
        t->any_cuda = 1;
        if (l->dev < 64) t->cuda_mask |= 1ull << l->dev;
    }
    return 0;
}

static inline PyObject *_call0(PyObject *obj, PyObject *name)
{
    return PyObject_VectorcallMethod(name, &obj, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

/* Attribute / no-argument method of a tensor. For an exact torch.Tensor the
 * descriptor cached at _setup is called directly, skipping the attribute
 * lookup (a subclass may override, so it takes the generic path). */
static inline PyObject *_tattr(PyObject *obj, int exact, PyObject *descr, PyObject *name)
{
    if (exact) return Py_TYPE(descr)->tp_descr_get(descr, obj, (PyObject *)Py_TYPE(obj));
    return PyObject_GetAttr(obj, name);
}

static inline PyObject *_tcall(PyObject *obj, int exact, PyObject *descr, PyObject *name)
{
    if (exact) return PyObject_Vectorcall(descr, &obj, 1, NULL);
    return _call0(obj, name);
}

/* The dims of a tensor into the tree's next shape and stride slots (byte
 * strides: computed for a contiguous tensor, read otherwise), l->ndim and
 * l->dims set, *contiguous from is_contiguous(). The strides are read when
 * the tensor is not contiguous or has a dim of size 0 or 1 (torch lets such
 * a dim have any stride, and tensor.to() keeps it); then the output's layout
 * (strides.h) sets MTC_LEAF_DENSE / MTC_LEAF_STRIDED and the output strides.
 * 0; 1 when the tensor is to be diagnosed; -1 with an exception. */
static int _read_dims(mtc_state *st, mtc_tree *t, int32_t node, PyObject *obj, int exact, mtc_leaf *l,
                      int *contiguous)
{
    PyObject *v = NULL, *shape = NULL, *stride = NULL;
    int rc = 1;
    if (!(shape = _tattr(obj, exact, st->d_shape, st->s_shape)) || !PyTuple_Check(shape)) goto out;
    if (PyTuple_GET_SIZE(shape) > MTC_MAX_NDIM) {
        _too_many_dims(t, node, PyTuple_GET_SIZE(shape));
        rc = -1;
        goto out;
    }
    l->ndim = (int32_t)PyTuple_GET_SIZE(shape);
    if (!(v = _tcall(obj, exact, st->m_is_contiguous, st->s_is_contiguous))) goto out;
    *contiguous = v == Py_True;
    if (_reserve_leaf(t, l->ndim)) {
        rc = -1;
        goto out;
    }
    l->dims = t->ndims;
    int64_t *sh = &t->shape[t->ndims], *sd = &t->strides[t->ndims];
    int read = !*contiguous;
    for (int d = 0; d < l->ndim; d++) {
        /* symbolic sizes (jagged nested tensors) fail here and are diagnosed */
        sh[d] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, d));
        if (sh[d] == -1 && PyErr_Occurred()) goto out;
        if (sh[d] <= 1) read = 1;
    }
    if (read) {
        if (!(stride = _tcall(obj, exact, st->m_stride, st->s_stride))) goto out;
        if (!PyTuple_Check(stride) || PyTuple_GET_SIZE(stride) != l->ndim) goto out;
    }
    if (!read) {
        /* wraps only for an empty tensor (torch.empty(0, 2**62, 4)), whose
         * strides address nothing */
        int64_t acc = l->elsize;
        for (int d = l->ndim - 1; d >= 0; d--) {
            sd[d] = acc;
            (void)__builtin_mul_overflow(acc, sh[d] > 1 ? sh[d] : 1, &acc);
        }
    } else {
        int64_t *os = &t->ostrides[t->ndims];
        for (int d = 0; d < l->ndim; d++) {
            int64_t el = PyLong_AsLongLong(PyTuple_GET_ITEM(stride, d));
            if ((el == -1 && PyErr_Occurred()) || el < 0) goto out; /* torch makes no negative stride */
            os[d] = el;
            /* wraps only on a dim of size <= 1 (torch checks the storage
             * holds every element), where the stride addresses nothing */
            (void)__builtin_mul_overflow(el, (int64_t)l->elsize, &sd[d]);
        }
        l->flags |= mtc_strides_leaf(sh, os, l->ndim);
    }
    rc = 0;
out:
    Py_XDECREF(v);
    Py_XDECREF(shape);
    Py_XDECREF(stride);
    return rc;
}

/* data_ptr() and the device (get_device(), and is_cuda for an index) of a
 * tensor into l. 0; 1 when the tensor is to be diagnosed; -1 with an
 * exception (a device beyond the engine's tables). */
static int _read_place(mtc_state *st, mtc_tree *t, int32_t node, PyObject *obj, int exact, mtc_leaf *l)
{
    PyObject *v = _tcall(obj, exact, st->m_data_ptr, st->s_data_ptr);
    if (!v) return 1;
    l->data = (uintptr_t)PyLong_AsVoidPtr(v);
    Py_DECREF(v);
    if (PyErr_Occurred()) return 1;
    if (!(v = _tcall(obj, exact, st->m_get_device, st->s_get_device))) return 1;
    long dev = PyLong_AsLong(v);
    Py_DECREF(v);
    if (PyErr_Occurred()) return 1;
    if (dev >= MTC_MAX_DEVICES) { /* per-device tables (streams, pools) have this many slots */
        PyObject *path = _node_path(t, node);
        if (path) {
            PyErr_Format(PyExc_ValueError, "mtc_loader: %U lives on device %ld; mtc_loader copies from and "
                         "to CUDA devices 0 .. %d", path, dev, MTC_MAX_DEVICES - 1);
            Py_DECREF(path);
        }
        return -1;
    }
    l->dev = dev >= 0 ? (int32_t)dev : -1;
    if (l->dev >= 0) {
        /* get_device() gives an index for every accelerator: insist on CUDA */
        if (!(v = _tattr(obj, exact, st->d_is_cuda, st->s_is_cuda))) return 1;
        int cuda = v == Py_True;
        Py_DECREF(v);
        if (!cuda) return 1;
    }
    return 0;
}

/* 1 when a tensor's bytes are not its values (the lazy conjugation or
 * negation bit is set, or reading it failed), else 0. Public APIs set the
 * negative bit on real tensors only through .imag of a conjugated view,
 * which is strided unless it has at most one element: the bits are read
 * only for complex tensors and such float tensors. */
static int _lazy_bits(mtc_state *st, PyObject *obj, int exact, int fl, int contiguous, int64_t numel)
{
    if (!((fl & MTC_DT_COMPLEX) || ((fl & MTC_DT_FLOAT) && (!contiguous || numel <= 1)))) return 0;
    PyObject *v;
    if (fl & MTC_DT_COMPLEX) {
        if (!(v = _tcall(obj, exact, st->m_is_conj, st->s_is_conj))) return 1;
        int bit = v == Py_True;
        Py_DECREF(v);
        if (bit) return 1;
    }
    if (!(v = _tcall(obj, exact, st->m_is_neg, st->s_is_neg))) return 1;
    int bit = v == Py_True;
    Py_DECREF(v);
    return bit;
}

/* Reads the metadata of a tensor leaf into leaf slot t->nleaves.
 * Per tensor: dtype, shape, is_contiguous(), data_ptr(), get_device(); the
 * strides only when not contiguous; is_conj()/is_neg() only where public
 * APIs can set those bits (complex tensors; non-contiguous float views such
 * as z.conj().imag). Anything unexpected goes to _diagnose. */
static int _read_tensor(mtc_state *st, mtc_tree *t, int32_t node, PyObject *obj)
{
    int exact = (PyObject *)Py_TYPE(obj) == st->tensor_type;
    mtc_leaf l;
    memset(&l, 0, sizeof l);

    /* dtype first: quantized and unknown dtypes leave the fast path here */
    PyObject *v = _tattr(obj, exact, st->d_dtype, st->s_dtype);
    if (!v) return _diagnose(st, t, node, obj);
    PyObject *code = PyDict_GetItemWithError(st->dtype_codes, v);
    Py_DECREF(v);
    if (!code) return _diagnose(st, t, node, obj);
    long c = PyLong_AsLong(code);
    l.dtype = (uint16_t)c;
    l.elsize = (uint16_t)st->elsize[c];

    int contiguous = 0, rc = _read_dims(st, t, node, obj, exact, &l, &contiguous);
    if (!rc) rc = _read_place(st, t, node, obj, exact, &l);
    if (rc) return rc < 0 ? -1 : _diagnose(st, t, node, obj);
    int64_t numel = _numel(&t->shape[t->ndims], l.ndim);
    if (_lazy_bits(st, obj, exact, st->dtflags[c], contiguous, numel)) return _diagnose(st, t, node, obj);
    if (l.data == 0) {
        /* only an empty tensor may have no storage: a meta tensor, even an
         * empty one, is diagnosed (get_device() says -1 for meta too) */
        if (numel) return _diagnose(st, t, node, obj);
        if (!(v = PyObject_GetAttr(obj, st->s_is_meta))) return _diagnose(st, t, node, obj);
        int meta = v == Py_True;
        Py_DECREF(v);
        if (meta) return _diagnose(st, t, node, obj);
    }
    t->leaves[t->nleaves] = l;
    return _finish_leaf(t, &t->leaves[t->nleaves], node, obj);
}

static int _read_ndarray(mtc_state *st, mtc_tree *t, int32_t node, PyObject *obj)
{
    PyArrayObject *a = (PyArrayObject *)obj;
    int tn = PyArray_TYPE(a);
    if (tn < 0 || tn >= 32 || st->np_to_code[tn] < 0) return _diagnose(st, t, node, obj);
    if (!PyArray_ISNOTSWAPPED(a)) return _diagnose(st, t, node, obj);
    int ndim = PyArray_NDIM(a);
    if (ndim > MTC_MAX_NDIM) return _too_many_dims(t, node, ndim);
    if (_reserve_leaf(t, ndim)) return -1;
    mtc_leaf l;
    memset(&l, 0, sizeof l);
    l.dtype = (uint16_t)st->np_to_code[tn];
    l.elsize = (uint16_t)PyArray_ITEMSIZE(a);
    l.ndim = ndim;
    l.dims = t->ndims;
    l.dev = MTC_DEV_CPU;
    l.data = (uintptr_t)PyArray_DATA(a);
    l.flags = MTC_LEAF_NUMPY;
    int zerocopy = PyArray_ISWRITEABLE(a) && PyArray_ISALIGNED(a) && st->np_zerocopy[tn];
    int torch_strides = 1; /* torch.from_numpy would take the strides */
    int64_t *os = &t->ostrides[t->ndims];
    for (int d = 0; d < ndim; d++) {
        t->shape[t->ndims + d] = PyArray_DIM(a, d);
        npy_intp s = PyArray_STRIDE(a, d);
        t->strides[t->ndims + d] = s;
        if (s < 0 || s % l.elsize) torch_strides = 0; /* torch.from_numpy refuses these */
        else os[d] = s / l.elsize;
    }
    if (zerocopy && torch_strides) l.flags |= MTC_LEAF_ZEROCOPY;
    /* the layout torch.from_numpy(a).to(device) has; an array torch cannot
     * hold is copied row-major */
    if (torch_strides) l.flags |= mtc_strides_leaf(&t->shape[t->ndims], os, ndim);
    t->leaves[t->nleaves] = l;
    return _finish_leaf(t, &t->leaves[t->nleaves], node, obj);
}

/* A FileTensor: contiguous bytes in files, read when copied. The tree keeps
 * its spec (immutable bytes) alive, not the FileTensor. */
static int _read_file(mtc_state *st, mtc_tree *t, int32_t node, PyObject *obj)
{
    mtc_leaf l;
    int64_t dims[MTC_MAX_NDIM];
    PyObject *spec;
    if (mtc_files_leaf(st, obj, &l, dims, &spec)) return -1;
    int rc = -1;
    if (_reserve_leaf(t, l.ndim)) goto out;
    l.dims = t->ndims;
    /* wraps only for an empty leaf (dims (0, 2**62, 4)), whose strides address nothing */
    int64_t acc = l.elsize;
    for (int d = l.ndim - 1; d >= 0; d--) {
        t->shape[t->ndims + d] = dims[d];
        t->strides[t->ndims + d] = acc;
        (void)__builtin_mul_overflow(acc, dims[d] > 1 ? dims[d] : 1, &acc);
    }
    t->leaves[t->nleaves] = l;
    rc = _finish_leaf(t, &t->leaves[t->nleaves], node, spec);
out:
    Py_DECREF(spec);
    return rc;
}

int mtc_tree_reread(mtc_state *st, mtc_tree *t, uint32_t i)
{
    /* Metadata is re-read in place, over the old leaf's dims: the new object
     * must have the same dtype and shape. A tensor subclass's contiguous()
     * may return anything: a leaf of more dims would overwrite the next
     * leaves' shapes (outputs sized from one, copies from the other), so the
     * shape is checked against a copy of the old one. */
    mtc_leaf old = t->leaves[i];
    int64_t *old_shape = PyMem_Malloc((old.ndim ? (size_t)old.ndim : 1) * sizeof *old_shape);
    if (!old_shape) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(old_shape, &t->shape[old.dims], (size_t)old.ndim * sizeof *old_shape);
    uint32_t save_n = t->nleaves, save_d = t->ndims;
    PyObject *obj = t->objs[i];
    t->nleaves = i;
    t->ndims = old.dims;
    int rc = (old.flags & MTC_LEAF_NUMPY) ? _read_ndarray(st, t, (int32_t)t->leaf_node[i], obj)
                                          : _read_tensor(st, t, (int32_t)t->leaf_node[i], obj);
    if (rc == 0) Py_DECREF(obj); /* _finish_leaf took a second reference */
    t->nleaves = save_n;
    t->ndims = save_d;
    const mtc_leaf *l = &t->leaves[i];
    if (rc == 0 && (l->ndim != old.ndim || l->dtype != old.dtype || l->dev != old.dev ||
                    memcmp(&t->shape[old.dims], old_shape, (size_t)old.ndim * sizeof *old_shape))) {
        /* the dims past old.ndim (if any) were written into the next leaf's:
         * this tree is not used again (the caller's error path clears it) */
        PyObject *path = mtc_leaf_path(t, i);
        if (path) {
            PyErr_Format(PyExc_TypeError,
                         "mtc_loader: %U is a tensor whose clone() returned a tensor of another "
                         "shape, dtype or device; pass it as a plain contiguous tensor "
                         "(.as_subclass(torch.Tensor).contiguous())", path);
            Py_DECREF(path);
        }
        rc = -1;
    }
    PyMem_Free(old_shape);
    return rc;
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
} _frame;

typedef struct _stack {
    _frame *f;
    uint32_t n, cap;
    int32_t *bucket;      /* frame index heading each bucket, -1 empty */
    uint32_t nbuckets;    /* power of two >= cap */
} _stack;

static inline uint32_t _bucket_of(const _stack *s, PyObject *o)
{
    return (uint32_t)(((uint64_t)(uintptr_t)o * 0x9E3779B97F4A7C15ull) >> 32) & (s->nbuckets - 1);
}

/* Room for one more frame, buckets included. 0 or -1 with an exception. */
static int _stack_reserve(_stack *s)
{
    if (_grow((void **)&s->f, &s->cap, s->n + 1, sizeof *s->f)) return -1;
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
    PyObject *path = _node_path(t, node);
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
 * types strongly, so it is bounded (module.h's MTC_TYPE_CACHE_MAX). */
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

/* Visits one object: adds its node, a leaf, or pushes a frame. */
static int _visit(mtc_state *st, mtc_tree *t, _stack *s, PyObject *obj, int32_t parent, int32_t pos)
{
    PyTypeObject *tp = Py_TYPE(obj);
    int kind;
    uint8_t nkind;
    if (t->slots && obj == st->leaf_slot) {
        int32_t n = _add_node(t, MTC_NODE_LEAF, parent, pos);
        if (n < 0) return -1;
        t->nodes[n].leaf = (int32_t)t->nslots++;
        return 0;
    }
    if (t->slots && obj == st->atom_slot) {
        int32_t n = _add_node(t, MTC_NODE_PASS, parent, pos);
        if (n < 0) return -1;
        t->nodes[n].leaf = (int32_t)t->natoms++; /* obj stays NULL: the batch's atom */
        return 0;
    }
    if ((PyObject *)tp == st->tensor_type) kind = MTC_KIND_TENSOR;
    else if (tp == &PyArray_Type) kind = MTC_KIND_NDARRAY;
    else if (tp == &PyList_Type) { kind = MTC_KIND_GENERIC; nkind = MTC_NODE_LIST; goto container; }
    else if (tp == &PyDict_Type) { kind = MTC_KIND_GENERIC; nkind = MTC_NODE_DICT; goto container; }
    else if (tp == &PyTuple_Type) { kind = MTC_KIND_GENERIC; nkind = MTC_NODE_TUPLE; goto container; }
    else if (tp == &PyUnicode_Type || tp == &PyLong_Type || tp == &PyFloat_Type ||
             obj == Py_None || tp == &PyBool_Type || tp == &PyBytes_Type)
        kind = MTC_KIND_LEAF;
    else if ((kind = _classify(st, obj)) < 0) return -1;

    if (kind == MTC_KIND_LEAF) {
        int32_t n = _add_node(t, MTC_NODE_PASS, parent, pos);
        if (n < 0) return -1;
        Py_INCREF(obj);
        t->nodes[n].obj = obj;
        return 0;
    }
    if (kind == MTC_KIND_TENSOR || kind == MTC_KIND_NDARRAY) {
        int32_t n = _add_node(t, MTC_NODE_LEAF, parent, pos);
        if (n < 0) return -1;
        if (_reserve_leaf(t, 0)) return -1;
        return kind == MTC_KIND_TENSOR ? _read_tensor(st, t, n, obj) : _read_ndarray(st, t, n, obj);
    }
    if (kind == MTC_KIND_FILE) {
        int32_t n = _add_node(t, MTC_NODE_LEAF, parent, pos);
        if (n < 0) return -1;
        return _read_file(st, t, n, obj);
    }
    nkind = MTC_NODE_GENERIC;

container:;
    int32_t n = _add_node(t, nkind, parent, pos);
    if (n < 0) return -1;
    if (_stack_has(s, obj)) return _cycle_error(t, n);
    if (_stack_reserve(s)) return -1;
    PyObject *children = NULL;
    if (nkind == MTC_NODE_DICT) {
        if (!(t->nodes[n].obj = PyList_New(0))) return -1;
    } else if (nkind == MTC_NODE_GENERIC) {
        /* flatten(obj) -> (children list, (context, [path segments])) */
        PyObject *r = PyObject_CallOneArg(st->flatten, obj);
        if (!r) return _diagnose(st, t, n, obj); /* raises, naming the container's path */
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
    uint32_t h = _bucket_of(s, obj);
    f->hnext = s->bucket[h];
    s->bucket[h] = (int32_t)s->n;
    s->n++;
    return 0;
}

int mtc_traverse(mtc_state *st, PyObject *data, mtc_tree *t)
{
    _stack s = {0};
    int rc = -1;
    if (_visit(st, t, &s, data, -1, 0)) goto out;
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
        case MTC_NODE_DICT: {
            PyObject *key;
            if (PyDict_Next(f->container, &f->next, &key, &child))
                if (PyList_Append(t->nodes[node].obj, key)) goto out;
            break;
        }
        }
        if (!child) { /* container done */
            _stack_pop(&s);
            continue;
        }
        if (t->nodes[node].nchildren == INT32_MAX) {
            PyErr_SetString(PyExc_ValueError, "mtc_loader: a container of 2^31 or more items cannot be copied");
            goto out;
        }
        t->nodes[node].nchildren++;
        Py_INCREF(child); /* a visit may run Python code that drops the container's reference */
        int v = _visit(st, t, &s, child, node, pos);
        Py_DECREF(child);
        if (v) goto out;
    }
    rc = 0;
out:
    while (s.n) _stack_pop(&s);
    PyMem_Free(s.f);
    PyMem_Free(s.bucket);
    return rc;
}
