/*
 * leaves.c - the leaf readers of the walk (see leaves.h): metadata of a
 * tensor, numpy array or FileTensor into a tree's leaf slot.
 */
#define NO_IMPORT_ARRAY
#define PY_ARRAY_UNIQUE_SYMBOL mtc_ARRAY_API
#include "leaves.h"

#include <numpy/arrayobject.h>
#include <string.h>

#include "cuda.h" /* MTC_MAX_DEVICES */
#include "files.h"
#include "strides.h"

/* Hands a leaf that failed the fast checks to mtc_loader._tree.diagnose,
 * which raises an exception naming the path and what to do, or returns a
 * replacement tensor that is read instead. 0 or -1. */
int mtc_leaves_diagnose(mtc_state *st, mtc_tree *t, int32_t node, PyObject *obj)
{
    PyObject *exc = NULL;
    if (PyErr_Occurred()) {
        PyObject *type, *tb;
        PyErr_Fetch(&type, &exc, &tb);
        PyErr_NormalizeException(&type, &exc, &tb);
        Py_XDECREF(type);
        Py_XDECREF(tb);
    }
    PyObject *path = mtc_node_path(t, node);
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
    int rc = mtc_leaves_read_tensor(st, t, node, res);
    t->diag_depth = 0;
    if (rc == 0) {
        t->leaves[t->nleaves - 1].flags |= MTC_LEAF_RESOLVED;
        if (!t->rereading) t->nresolved++;
    }
    Py_DECREF(res);
    return rc;
}

/* ---- leaves ---- */

int mtc_leaves_reserve_n(mtc_tree *t, uint32_t nleaves, uint32_t ndims)
{
    uint32_t cap = t->cap_leaves;
    if (mtc_tree_grow((void **)&t->leaves, &t->cap_leaves, nleaves, sizeof *t->leaves)) return -1;
    if (t->cap_leaves != cap) {
        /* objs and leaf_node grow with leaves: until both have, the
         * capacity stays what all three hold */
        uint32_t grown = t->cap_leaves;
        t->cap_leaves = cap;
        PyObject **o = PyMem_Realloc(t->objs, grown * sizeof *o);
        if (!o) return PyErr_NoMemory(), -1;
        t->objs = o;
        uint32_t *ln = PyMem_Realloc(t->leaf_node, grown * sizeof *ln);
        if (!ln) return PyErr_NoMemory(), -1;
        t->leaf_node = ln;
        t->cap_leaves = grown;
    }
    if (ndims > t->cap_dims) {
        /* shape, strides and ostrides share cap_dims, set once all three grew */
        uint32_t cap_dims = t->cap_dims;
        if (mtc_tree_grow((void **)&t->shape, &cap_dims, ndims, sizeof *t->shape)) return -1;
        cap_dims = t->cap_dims;
        if (mtc_tree_grow((void **)&t->strides, &cap_dims, ndims, sizeof *t->strides)) return -1;
        cap_dims = t->cap_dims;
        if (mtc_tree_grow((void **)&t->ostrides, &cap_dims, ndims, sizeof *t->ostrides)) return -1;
        t->cap_dims = cap_dims;
    }
    return 0;
}

int mtc_leaves_reserve(mtc_tree *t, int ndim)
{
    return mtc_leaves_reserve_n(t, t->nleaves + 1, t->ndims + (uint32_t)ndim);
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
    PyObject *path = mtc_node_path(t, node);
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
    if (mtc_leaves_reserve(t, l->ndim)) {
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
        PyObject *path = mtc_node_path(t, node);
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
 * negation bit is set, or reading it failed), else 0. Read for every leaf,
 * whatever its dtype and layout: the negative bit can sit on a tensor of any
 * dtype and any layout (torch._neg_view(x), x.conj().imag, views of those),
 * and neither the DLPack description nor the dims say so. torch keeps the
 * conjugate bit on complex tensors only (TensorImpl asserts it). */
static int _lazy_bits(mtc_state *st, PyObject *obj, int exact, int fl)
{
    if (exact && st->sr.on && st->sr.is_neg) {
        const void *h = (char *)obj + st->sr.cdata;
        return ((fl & MTC_DT_COMPLEX) && st->sr.is_conj(h)) || st->sr.is_neg(h);
    }
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

/* The end of a one-call read (_read_dlpack, _read_shim): from the element
 * strides os[] of the leaf's dims sh[], its byte strides sd[] and layout
 * flags as the attribute path leaves them. small: a dim has 0 or 1 elements
 * (its stride is free in torch, and kept). Returns whether it is contiguous. */
static int _finish_strides(mtc_leaf *l, int64_t *sh, int64_t *sd, int64_t *os, int small)
{
    /* byte strides; wraps only on a dim of size <= 1 (torch checks the
     * storage holds every element), where the stride addresses nothing */
    for (int d = 0; d < l->ndim; d++) (void)__builtin_mul_overflow(os[d], (int64_t)l->elsize, &sd[d]);
    int contiguous = _is_contiguous(sh, sd, l->ndim, l->elsize);
    if (!contiguous || small) {
        l->flags |= mtc_strides_leaf(sh, os, l->ndim);
    } else {
        /* what the attribute path stores for a contiguous tensor of dims > 1 */
        int64_t acc = l->elsize;
        for (int d = l->ndim - 1; d >= 0; d--) {
            sd[d] = acc;
            (void)__builtin_mul_overflow(acc, sh[d], &acc);
        }
    }
    return contiguous;
}

/* The dims, data pointer and device of an exact torch.Tensor read from the
 * DLTensor torch fills for it (dlpack.h), with *code its dtype code: one C
 * call where the attribute path makes five Python calls. Strides are taken
 * as torch reports them only where every dim has more than one element; a
 * dim of size 0 or 1 may carry any stride (tensor.to() keeps it), so those
 * are read through stride() as the attribute path reads them. 0; 1 when the
 * tensor is to be read the attribute way (a dtype or device the table does
 * not describe, a dtype torch describes as one of ours, such as int4 as
 * int8, or torch declined: sparse, meta, ...); -1 with an exception. */
static int _read_dlpack(mtc_state *st, mtc_tree *t, int32_t node, PyObject *obj, mtc_leaf *l, int *code,
                        int *contiguous)
{
    mtc_dl_tensor dl;
    if (st->dl_view(obj, &dl)) {
        PyErr_Clear();
        return 1;
    }
    if (dl.dtype.lanes != 1 || dl.dtype.code >= MTC_DL_CODES) return 1;
    int c = st->dl_codes[dl.dtype.code][dl.dtype.bits];
    if (c < 0) return 1;
    if (st->dl_verify[dl.dtype.code][dl.dtype.bits]) {
        /* the description is also a dtype the engine does not copy: one of ours only by name */
        PyObject *v = _tattr(obj, 1, st->d_dtype, st->s_dtype);
        if (!v) {
            PyErr_Clear();
            return 1;
        }
        int ours = v == st->dtypes[c];
        Py_DECREF(v);
        if (!ours) return 1;
    }
    int32_t dev;
    if (dl.device.device_type == MTC_DL_CUDA && dl.device.device_id >= 0 && dl.device.device_id < MTC_MAX_DEVICES)
        dev = dl.device.device_id;
    else if (dl.device.device_type == MTC_DL_CPU || dl.device.device_type == MTC_DL_CUDA_HOST)
        dev = -1;
    else
        return 1; /* the attribute path names the device in its error */
    if (dl.ndim < 0) return 1;
    if (dl.ndim > MTC_MAX_NDIM) return _too_many_dims(t, node, dl.ndim);
    if (mtc_leaves_reserve(t, dl.ndim)) return -1;
    l->dtype = (uint16_t)c;
    l->elsize = (uint16_t)st->elsize[c];
    l->ndim = dl.ndim;
    l->dims = t->ndims;
    l->data = (uintptr_t)dl.data + (uintptr_t)dl.byte_offset;
    l->dev = dev;
    int64_t *sh = &t->shape[t->ndims], *sd = &t->strides[t->ndims], *os = &t->ostrides[t->ndims];
    int small = 0;
    for (int d = 0; d < l->ndim; d++) {
        sh[d] = dl.shape[d];
        if (sh[d] <= 1) small = 1;
    }
    if (small) {
        /* the strides torch keeps for dims of size 0 and 1 */
        PyObject *stride = _tcall(obj, 1, st->m_stride, st->s_stride);
        if (!stride) return 1;
        int bad = !PyTuple_Check(stride) || PyTuple_GET_SIZE(stride) != l->ndim;
        for (int d = 0; !bad && d < l->ndim; d++) {
            os[d] = PyLong_AsLongLong(PyTuple_GET_ITEM(stride, d));
            bad = (os[d] == -1 && PyErr_Occurred()) || os[d] < 0;
        }
        Py_DECREF(stride);
        if (bad) return 1;
    } else if (dl.strides) {
        for (int d = 0; d < l->ndim; d++) {
            if (dl.strides[d] < 0) return 1; /* torch makes none; let the attribute path judge */
            os[d] = dl.strides[d];
        }
    } else {
        int64_t acc = 1;
        for (int d = l->ndim - 1; d >= 0; d--) {
            os[d] = acc;
            (void)__builtin_mul_overflow(acc, sh[d], &acc);
        }
    }
    *contiguous = _finish_strides(l, sh, sd, os, small);
    *code = c;
    return 0;
}

/* The dims, data pointer and device of an exact torch.Tensor read through
 * torch's C shim (state.h's mtc_shim_reader) from the at::Tensor inside its
 * Python object, and its storage's bytes and its offset there (storage[0]:
 * elements, storage[1]: bytes): a few plain C calls, no Python. The layout
 * and device are checked before anything that could fail on a tensor
 * without storage. 0; 1 when the tensor is to be read another way (not
 * strided, a device other than the CPU or CUDA, a dtype the engine does not
 * copy, or torch declined); -1 with an exception. */
static int _read_shim(mtc_state *st, mtc_tree *t, int32_t node, PyObject *obj, mtc_leaf *l, int *code,
                      int *contiguous, int64_t *storage)
{
    const mtc_shim_reader *r = &st->sr;
    void *h = (char *)obj + r->cdata;
    int32_t layout, devtype, dtype, index = -1;
    int64_t ndim, *sizes, *strides;
    void *data;
    if (r->layout(h, &layout) || layout != r->strided || r->device_type(h, &devtype)) return 1;
    if (devtype == r->dev_cuda) {
        if (r->device_index(h, &index) || index < 0) return 1;
        if (index >= MTC_MAX_DEVICES) return 1; /* the attribute path names the device in its error */
    } else if (devtype != r->dev_cpu) {
        return 1;
    }
    if (r->dtype(h, &dtype) || dtype < 0 || dtype > 255 || r->to_code[dtype] < 0) return 1;
    if (r->dim(h, &ndim) || ndim < 0) return 1;
    if (ndim > MTC_MAX_NDIM) return _too_many_dims(t, node, ndim);
    if (r->sizes(h, &sizes) || r->strides(h, &strides) || r->data_ptr(h, &data) ||
        r->storage_offset(h, &storage[0]) || r->storage_size(h, &storage[1]))
        return 1;
    if (mtc_leaves_reserve(t, (int)ndim)) return -1;
    int c = r->to_code[dtype];
    l->dtype = (uint16_t)c;
    l->elsize = (uint16_t)st->elsize[c];
    l->ndim = (int32_t)ndim;
    l->dims = t->ndims;
    l->data = (uintptr_t)data;
    l->dev = index;
    int64_t *sh = &t->shape[t->ndims], *sd = &t->strides[t->ndims], *os = &t->ostrides[t->ndims];
    int small = 0;
    for (int d = 0; d < l->ndim; d++) {
        if (strides[d] < 0) return 1; /* torch makes none; let the attribute path judge */
        sh[d] = sizes[d];
        os[d] = strides[d];
        if (sh[d] <= 1) small = 1;
    }
    *contiguous = _finish_strides(l, sh, sd, os, small);
    *code = c;
    return 0;
}

/* The storage offset (elements) and storage bytes of a tensor read the
 * DLPack or attribute way, into storage[0] and storage[1]: three Python
 * calls (storage_offset(), untyped_storage(), nbytes()). 0; 1 when reading
 * them failed (the tensor is diagnosed). */
static int _storage_python(mtc_state *st, PyObject *obj, int exact, int64_t *storage)
{
    PyObject *v = _tcall(obj, exact, st->m_storage_offset, st->s_storage_offset);
    if (!v) return 1;
    storage[0] = PyLong_AsLongLong(v);
    Py_DECREF(v);
    PyObject *s = _tcall(obj, exact, st->m_untyped_storage, st->s_untyped_storage);
    if (!s) return 1;
    v = _call0(s, st->s_nbytes);
    Py_DECREF(s);
    if (!v) return 1;
    storage[1] = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return PyErr_Occurred() ? 1 : 0;
}

/* Reads the metadata of a tensor leaf into leaf slot t->nleaves.
 * Per tensor: dtype, shape, is_contiguous(), data_ptr(), get_device(); the
 * strides only when not contiguous; is_neg() always, is_conj() of complex
 * tensors (_lazy_bits). A tensor that reads past its storage's end (one
 * whose storage was freed or shrunk: untyped_storage().resize_()) is
 * diagnosed, on every route: the shim's getters tell the storage's bytes
 * (two C calls), the others ask Python (_storage_python). Anything
 * unexpected goes to _diagnose. */
int mtc_leaves_read_tensor(mtc_state *st, mtc_tree *t, int32_t node, PyObject *obj)
{
    int exact = (PyObject *)Py_TYPE(obj) == st->tensor_type;
    mtc_leaf l;
    memset(&l, 0, sizeof l);
    int contiguous = 0, c = -1, rc = 1;
    int64_t storage[2] = {-1, -1}; /* offset (elements) and bytes; offset -1: not read yet */
    uint64_t *read_by = NULL; /* the counter of the reader that read it, bumped once the leaf is kept */
    if (exact && st->sr.on) {
        rc = _read_shim(st, t, node, obj, &l, &c, &contiguous, storage);
        if (rc < 0) return -1;
        if (rc) {
            memset(&l, 0, sizeof l);
            storage[0] = -1;
        } else {
            read_by = &mtc_cnt.leaves_shim;
        }
    }
    if (rc && exact && st->dl_view) {
        rc = _read_dlpack(st, t, node, obj, &l, &c, &contiguous);
        if (rc < 0) return -1;
        if (rc) memset(&l, 0, sizeof l);
        else read_by = &mtc_cnt.leaves_dlpack;
    }
    if (rc) {
        /* dtype first: quantized and unknown dtypes leave the fast path here */
        PyObject *v = _tattr(obj, exact, st->d_dtype, st->s_dtype);
        if (!v) return mtc_leaves_diagnose(st, t, node, obj);
        PyObject *code = PyDict_GetItemWithError(st->dtype_codes, v);
        Py_DECREF(v);
        if (!code) return mtc_leaves_diagnose(st, t, node, obj);
        c = (int)PyLong_AsLong(code);
        l.dtype = (uint16_t)c;
        l.elsize = (uint16_t)st->elsize[c];
        rc = _read_dims(st, t, node, obj, exact, &l, &contiguous);
        if (!rc) rc = _read_place(st, t, node, obj, exact, &l);
        if (rc) return rc < 0 ? -1 : mtc_leaves_diagnose(st, t, node, obj);
    }
    int64_t numel = _numel(&t->shape[t->ndims], l.ndim);
    if (_lazy_bits(st, obj, exact, st->dtflags[c])) return mtc_leaves_diagnose(st, t, node, obj);
    if (numel && l.data) {
        /* every byte it reads within its storage: a storage shrunk under it
         * (untyped_storage().resize_(n)) would be read past its end */
        if (storage[0] < 0 && _storage_python(st, obj, exact, storage))
            return mtc_leaves_diagnose(st, t, node, obj); /* with the error, for its message */
        if (storage[0] > INT64_MAX / l.elsize ||
            !mtc_storage_holds(&t->shape[t->ndims], &t->strides[t->ndims], l.ndim, l.elsize,
                               storage[0] * l.elsize, storage[1]))
            return mtc_leaves_diagnose(st, t, node, obj);
    }
    if (l.data == 0) {
        /* only an empty tensor may have no storage: a meta tensor, even an
         * empty one, is diagnosed (get_device() says -1 for meta too) */
        if (numel) return mtc_leaves_diagnose(st, t, node, obj);
        PyObject *v;
        if (!(v = PyObject_GetAttr(obj, st->s_is_meta))) return mtc_leaves_diagnose(st, t, node, obj);
        int meta = v == Py_True;
        Py_DECREF(v);
        if (meta) return mtc_leaves_diagnose(st, t, node, obj);
    }
    t->leaves[t->nleaves] = l;
    /* A leaf handed to _diagnose returned above: its resolved replacement (a
     * lazy conj/neg view materialised) is read and counted there, once. */
    rc = _finish_leaf(t, &t->leaves[t->nleaves], node, obj);
    if (!rc && read_by && !t->rereading) (*read_by)++;
    return rc;
}

int mtc_leaves_read_ndarray(mtc_state *st, mtc_tree *t, int32_t node, PyObject *obj)
{
    PyArrayObject *a = (PyArrayObject *)obj;
    int tn = PyArray_TYPE(a);
    if (tn < 0 || tn >= 32 || st->np_to_code[tn] < 0) return mtc_leaves_diagnose(st, t, node, obj);
    if (!PyArray_ISNOTSWAPPED(a)) return mtc_leaves_diagnose(st, t, node, obj);
    int ndim = PyArray_NDIM(a);
    if (ndim > MTC_MAX_NDIM) return _too_many_dims(t, node, ndim);
    if (mtc_leaves_reserve(t, ndim)) return -1;
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
int mtc_leaves_read_file(mtc_state *st, mtc_tree *t, int32_t node, PyObject *obj)
{
    mtc_leaf l;
    int64_t dims[MTC_MAX_NDIM];
    PyObject *spec;
    if (mtc_files_leaf(st, obj, &l, dims, &spec)) return -1;
    int rc = -1;
    if (mtc_leaves_reserve(t, l.ndim)) goto out;
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
    t->rereading = 1; /* counted as read when it was first read */
    int rc = (old.flags & MTC_LEAF_NUMPY) ? mtc_leaves_read_ndarray(st, t, (int32_t)t->leaf_node[i], obj)
                                          : mtc_leaves_read_tensor(st, t, (int32_t)t->leaf_node[i], obj);
    t->rereading = 0;
    if (rc == 0) Py_DECREF(obj); /* _finish_leaf took a second reference */
    t->leaves[i].flags |= old.flags & (MTC_LEAF_HOST | MTC_LEAF_RESOLVED); /* the walk's, not the object's */
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