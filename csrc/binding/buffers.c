/*
 * buffers.c - the check of the buffers the engine writes (see buffers.h).
 */
#include "buffers.h"

#include "outputs.h"

/* 1 when a tuple filled with unchecked new references holds a NULL. */
static int _has_null(PyObject *tuple)
{
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tuple); i++)
        if (!PyTuple_GET_ITEM(tuple, i)) return 1;
    return 0;
}

/* What a buffer is, as read for the check: device -1 the CPU, k cuda:k, -2
 * another; code -1 a dtype the engine does not copy; sizes and strides
 * (elements) point at ndim values each; storage offset in elements. */
typedef struct {
    int strided, code, dev;
    int64_t ndim;
    const int64_t *sizes, *strides;
    uintptr_t data;
    int64_t storage_offset, storage_bytes;
} _buffer;

/* The buffer through the shim's getters (an exact tensor, the reader on):
 * plain C calls. 0, or 1 where a getter declined (read it from Python). */
static int _buffer_shim(const mtc_state *st, PyObject *tensor, _buffer *b)
{
    const mtc_shim_reader *r = &st->sr;
    void *h = (char *)tensor + r->cdata, *data;
    int32_t layout, devtype, dtype, index;
    int64_t *sizes, *strides;
    if (r->layout(h, &layout) || r->device_type(h, &devtype) || r->dtype(h, &dtype) || r->dim(h, &b->ndim) ||
        r->sizes(h, &sizes) || r->strides(h, &strides) || r->data_ptr(h, &data) ||
        r->storage_offset(h, &b->storage_offset) || r->storage_size(h, &b->storage_bytes))
        return 1;
    b->strided = layout == r->strided;
    b->code = dtype >= 0 && dtype < 256 ? r->to_code[dtype] : -1;
    if (devtype == r->dev_cpu) b->dev = -1;
    else if (devtype == r->dev_cuda && r->device_index(h, &index) == 0 && index >= 0) b->dev = index;
    else b->dev = -2;
    b->sizes = sizes;
    b->strides = strides;
    b->data = (uintptr_t)data;
    return 0;
}

/* A tuple of Python ints into a new PyMem array of its length. NULL with an
 * exception (TypeError for anything but a tuple of ints). */
static int64_t *_int_tuple(PyObject *v, int64_t *n)
{
    if (!v || !PyTuple_Check(v)) {
        if (v) PyErr_SetString(PyExc_TypeError, "not a tuple");
        return NULL;
    }
    *n = PyTuple_GET_SIZE(v);
    int64_t *a = PyMem_Malloc((*n ? (size_t)*n : 1) * sizeof *a);
    if (!a) return PyErr_NoMemory(), NULL;
    for (int64_t d = 0; d < *n; d++) {
        a[d] = PyLong_AsLongLong(PyTuple_GET_ITEM(v, d));
        if (a[d] == -1 && PyErr_Occurred()) {
            PyMem_Free(a);
            return NULL;
        }
    }
    return a;
}

static PyObject *_method0(PyObject *obj, PyObject *name)
{
    return PyObject_VectorcallMethod(name, &obj, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

/* The buffer through its attributes (the shim's reader off, or a subclass):
 * sizes and strides in new PyMem arrays (*own[0], *own[1]) the caller frees.
 * 0, or -1 with an exception (the buffer is then not what was asked for). */
static int _buffer_python(mtc_state *st, PyObject *tensor, _buffer *b, int64_t **own)
{
    int rc = -1;
    int64_t n1 = 0, n2 = 0;
    PyObject *dtype = PyObject_GetAttr(tensor, st->s_dtype), *v = NULL, *storage = NULL;
    PyObject *code = dtype ? PyDict_GetItemWithError(st->dtype_codes, dtype) : NULL;
    if (!code && PyErr_Occurred()) goto out;
    b->code = code ? (int)PyLong_AsLong(code) : -1;
    b->strided = 1; /* stride() of any other layout raises */
    if (!(own[0] = _int_tuple(v = PyObject_GetAttr(tensor, st->s_shape), &n1))) goto out;
    Py_CLEAR(v);
    if (!(own[1] = _int_tuple(v = _method0(tensor, st->s_stride), &n2))) goto out;
    Py_CLEAR(v);
    if (n1 != n2) {
        PyErr_SetString(PyExc_TypeError, "shape and stride() differ in length");
        goto out;
    }
    b->ndim = n1;
    b->sizes = own[0];
    b->strides = own[1];
    if (!(v = _method0(tensor, st->s_data_ptr))) goto out;
    b->data = (uintptr_t)PyLong_AsVoidPtr(v);
    Py_CLEAR(v);
    if (!(v = _method0(tensor, st->s_get_device))) goto out;
    long dev = PyLong_AsLong(v);
    Py_CLEAR(v);
    if (dev >= 0 && !(v = PyObject_GetAttr(tensor, st->s_is_cuda))) goto out;
    b->dev = dev < 0 ? -1 : v == Py_True && dev < INT32_MAX ? (int)dev : -2;
    Py_CLEAR(v);
    if (dev < 0 && !(v = PyObject_GetAttr(tensor, st->s_is_meta))) goto out;
    if (v == Py_True) b->dev = -2; /* get_device() says -1 for meta too */
    Py_CLEAR(v);
    if (!(v = _method0(tensor, st->s_storage_offset))) goto out;
    b->storage_offset = PyLong_AsLongLong(v);
    Py_CLEAR(v);
    if (!(storage = _method0(tensor, st->s_untyped_storage)) || !(v = _method0(storage, st->s_nbytes))) goto out;
    b->storage_bytes = PyLong_AsLongLong(v);
    rc = PyErr_Occurred() ? -1 : 0;
out:
    Py_XDECREF(dtype);
    Py_XDECREF(v);
    Py_XDECREF(storage);
    return rc;
}

/* 1 when buffer b is what was asked for (mtc_buffer_check): its dims and
 * the strides of its dims of more than one element (contiguous ones when
 * strides is NULL), and the span they cover, from its storage offset, within
 * its storage's bytes. */
static int _buffer_matches(const mtc_state *st, const _buffer *b, int code, int dev, int64_t ndim,
                           const int64_t *shape, const int64_t *strides)
{
    if (!b->strided || b->code != code || b->dev != dev || b->ndim != ndim) return 0;
    for (int64_t d = 0; d < ndim; d++)
        if (b->sizes[d] != shape[d]) return 0;
    for (int64_t d = 0; d < ndim; d++)
        if (shape[d] == 0) return 1; /* nothing is written */
    int64_t acc = 1, last = 0, step, end;
    for (int64_t d = ndim - 1; d >= 0; d--) {
        if (shape[d] == 1) continue;
        if (b->strides[d] != (strides ? strides[d] : acc) || b->strides[d] < 0) return 0;
        if (__builtin_mul_overflow(acc, shape[d], &acc)) return 0;
        /* the last element's index, from the first */
        if (__builtin_mul_overflow(shape[d] - 1, b->strides[d], &step) || __builtin_add_overflow(last, step, &last))
            return 0;
    }
    if (b->storage_offset < 0 || __builtin_add_overflow(last, b->storage_offset + 1, &end) ||
        __builtin_mul_overflow(end, (int64_t)st->elsize[code], &end))
        return 0;
    return end <= b->storage_bytes;
}

/* The error of a buffer that is not what was asked for: its message from
 * mtc_loader._modes.buffer_refusal (what torch gave, what was asked for, the
 * active modes), with the error that reading the buffer raised, if any, as
 * its cause. -1. */
static int _buffer_refused(mtc_state *st, PyObject *tensor, int code, int dev, int64_t ndim, const int64_t *shape,
                           const int64_t *strides)
{
    PyObject *type = NULL, *exc = NULL, *tb = NULL;
    PyErr_Fetch(&type, &exc, &tb);
    PyErr_NormalizeException(&type, &exc, &tb);
    if (exc && tb) PyException_SetTraceback(exc, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    PyObject *sh = PyTuple_New(ndim), *sd = strides ? PyTuple_New(ndim) : Py_NewRef(Py_None);
    PyObject *device = mtc_out_device(st, dev), *msg = NULL;
    for (int64_t d = 0; sh && sd && d < ndim; d++) {
        PyTuple_SET_ITEM(sh, d, PyLong_FromLongLong(shape[d]));
        if (strides) PyTuple_SET_ITEM(sd, d, PyLong_FromLongLong(strides[d]));
    }
    if (!st->buffer_refusal) {
        PyObject *m = PyImport_ImportModule("mtc_loader._modes");
        st->buffer_refusal = m ? PyObject_GetAttrString(m, "buffer_refusal") : NULL;
        Py_XDECREF(m);
    }
    if (sh && sd && device && st->buffer_refusal && !_has_null(sh) && (!strides || !_has_null(sd)))
        msg = PyObject_CallFunctionObjArgs(st->buffer_refusal, tensor, st->dtypes[code], sh, sd, device, NULL);
    if (msg) {
        PyObject *err = PyObject_CallOneArg(PyExc_RuntimeError, msg);
        if (err) {
            if (exc) PyException_SetCause(err, Py_NewRef(exc));
            PyErr_SetObject(PyExc_RuntimeError, err);
            Py_DECREF(err);
        }
    }
    Py_XDECREF(msg);
    Py_XDECREF(sh);
    Py_XDECREF(sd);
    Py_XDECREF(device);
    Py_XDECREF(exc);
    return -1;
}

int mtc_buffer_check(mtc_state *st, PyObject *tensor, int code, int dev, int64_t ndim, const int64_t *shape,
                         const int64_t *strides, uintptr_t *ptr)
{
    _buffer b;
    int64_t *own[2] = {NULL, NULL}, numel = 1;
    for (int64_t d = 0; d < ndim; d++)
        if (shape[d] == 0) numel = 0;
    /* a subclass is no plain output, and what it reports need not be its memory */
    int read = (PyObject *)Py_TYPE(tensor) == st->tensor_type &&
               ((st->sr.on && _buffer_shim(st, tensor, &b) == 0) || _buffer_python(st, tensor, &b, own) == 0);
    if (read && !b.data && numel) {
        PyMem_Free(own[0]);
        PyMem_Free(own[1]);
        PyErr_SetString(PyExc_RuntimeError, "mtc_loader: torch.empty gave the engine a tensor without memory "
                        "(data_ptr() is 0), which the copy would write through; a TorchDispatchMode such as "
                        "FakeTensorMode makes such tensors: copy outside the mode, or use .to() inside it");
        return -1;
    }
    int ok = read && _buffer_matches(st, &b, code, dev, ndim, shape, strides);
    PyMem_Free(own[0]);
    PyMem_Free(own[1]);
    if (!ok) return _buffer_refused(st, tensor, code, dev, ndim, shape, strides);
    *ptr = b.data;
    return 0;
}
