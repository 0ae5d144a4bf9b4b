/*
 * outputs.c - the torch side of the outputs: new tensors from torch.empty, their
 * data pointers, output views over packed chunks, device objects and the capture
 * of current streams. The only file that calls torch's tensor API (see outputs.h).
 */
#include "outputs.h"

#include <string.h>

PyObject *mtc_out_shape(const mtc_tree *t, const mtc_leaf *l, int from)
{
    PyObject *s = PyTuple_New(l->ndim - from);
    if (!s) return NULL;
    for (int d = from; d < l->ndim; d++) {
        PyObject *v = PyLong_FromLongLong(t->shape[l->dims + d]);
        if (!v) {
            Py_DECREF(s);
            return NULL;
        }
        PyTuple_SET_ITEM(s, d - from, v);
    }
    return s;
}

/* torch.empty(shape, dtype=dtype, device=device[, pin_memory=True]). New reference. */
PyObject *mtc_out_empty(mtc_state *st, PyObject *shape, PyObject *dtype, PyObject *device, int pin)
{
    PyObject *args[4] = {shape, dtype, device, Py_True};
    return PyObject_Vectorcall(st->torch_empty, args, 1, pin ? st->kw_dtype_device_pin : st->kw_dtype_device);
}

int mtc_out_data_ptr(mtc_state *st, PyObject *tensor, uintptr_t *out)
{
    PyObject *v = PyObject_VectorcallMethod(st->s_data_ptr, &tensor, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (!v) return -1;
    *out = (uintptr_t)PyLong_AsVoidPtr(v);
    Py_DECREF(v);
    return PyErr_Occurred() ? -1 : 0;
}

static PyObject *_call_method(PyObject *obj, PyObject *name, PyObject *const *args, size_t nargs)
{
    PyObject *stack[8];
    stack[0] = obj;
    for (size_t i = 0; i < nargs; i++) stack[i + 1] = args[i];
    return PyObject_VectorcallMethod(name, stack, (nargs + 1) | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

/* 1 when a tuple filled with unchecked new references holds a NULL (the
 * allocation failed; MemoryError is set). */
static int _tuple_has_null(PyObject *tuple)
{
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tuple); i++)
        if (!PyTuple_GET_ITEM(tuple, i)) return 1;
    return 0;
}

/* Appends a temporary tensor (a view made on the way to the outputs) to
 * `keep` when there is one. Dropping a tensor's Python object releases the
 * GIL (torch frees it without), and in a thread that shares the GIL with a
 * launch-bound one every release costs a forced switch to take it back: the
 * temporaries go with the outputs' buffers instead, and are dropped when the
 * batch is handed out. 0 or -1. */
static int _keep(PyObject *keep, PyObject *tmp)
{
    return keep ? PyList_Append(keep, tmp) : 0;
}

/* Stores the first `count` items of the sequence `parts` (torch's list or
 * tuple of views), skipping the items at the indices skip() names, as new
 * references in outputs[members[k]]. 0, or -1 with SystemError when torch
 * returned fewer views than asked for. */
static int _store_views(PyObject *parts, const mtc_tree *t, const mtc_plan *p, const mtc_seg *s,
                        int skip_padding, PyObject **outputs)
{
    if (!PyTuple_Check(parts) && !PyList_Check(parts)) goto bad;
    PyObject *fast = PySequence_Fast(parts, "views");
    if (!fast) return -1;
    Py_ssize_t j = 0, n = PySequence_Fast_GET_SIZE(fast);
    int64_t cursor = 0;
    for (uint32_t k = 0; k < s->count; k++) {
        const mtc_leaf *l = &t->leaves[p->members[s->first + k]];
        if (skip_padding) {
            if (l->slot > cursor) j++; /* the padding piece before this member */
            cursor = l->slot + t->shape[l->dims];
        }
        if (j >= n) {
            Py_DECREF(fast);
            goto bad;
        }
        outputs[p->members[s->first + k]] = Py_NewRef(PySequence_Fast_GET_ITEM(fast, j++));
    }
    if (!skip_padding && n != (Py_ssize_t)s->count) {
        Py_DECREF(fast);
        goto bad;
    }
    Py_DECREF(fast);
    return 0;
bad:
    PyErr_SetString(PyExc_SystemError, "mtc_loader: torch returned an unexpected number of views");
    return -1;
}

/* A UNIFORM segment of several members at a fixed row: one as_strided view
 * (count, *shape) of the typed region, unbound. 0 or -1. */
static int _uniform_views(mtc_state *st, const mtc_tree *t, const mtc_plan *p, const mtc_seg *s,
                          PyObject *typed, PyObject **outputs, PyObject *keep)
{
    const mtc_leaf *proto = &t->leaves[s->proto];
    int nd = proto->ndim, rc = -1;
    PyObject *size = PyTuple_New(nd + 1), *stride = PyTuple_New(nd + 1), *shaped = NULL, *parts = NULL;
    if (!size || !stride) goto out;
    PyTuple_SET_ITEM(size, 0, PyLong_FromLongLong(s->count));
    PyTuple_SET_ITEM(stride, 0, PyLong_FromLongLong(s->row_bytes / proto->elsize));
    int64_t st_el = 1;
    for (int d = nd - 1; d >= 0; d--) {
        int64_t dim = t->shape[proto->dims + d];
        PyTuple_SET_ITEM(size, d + 1, PyLong_FromLongLong(dim));
        PyTuple_SET_ITEM(stride, d + 1, PyLong_FromLongLong(st_el));
        if (d) st_el *= dim > 1 ? dim : 1; /* members have bytes: the product fits */
    }
    /* an item that failed to allocate is NULL: never hand torch such a tuple */
    if (_tuple_has_null(size) || _tuple_has_null(stride)) goto out;
    PyObject *a2[2] = {size, stride};
    if (!(shaped = _call_method(typed, st->s_as_strided, a2, 2)) || _keep(keep, shaped)) goto out;
    PyObject *zero = PyLong_FromLong(0);
    if (!zero) goto out;
    parts = _call_method(shaped, st->s_unbind, &zero, 1);
    Py_DECREF(zero);
    if (parts && !_keep(keep, parts)) rc = _store_views(parts, t, p, s, 0, outputs);
out:
    Py_XDECREF(size);
    Py_XDECREF(stride);
    Py_XDECREF(shaped);
    Py_XDECREF(parts);
    return rc;
}

/* The row counts split_with_sizes cuts a SPLIT segment at: each member's
 * rows, with a padding piece before a member that does not start where the
 * last one ended, and one after the last. New list, or NULL. */
static PyObject *_split_sizes(const mtc_tree *t, const mtc_plan *p, const mtc_seg *s)
{
    PyObject *sizes = PyList_New(0);
    if (!sizes) return NULL;
    int64_t cursor = 0;
    for (uint32_t k = 0; k <= s->count; k++) {
        const mtc_leaf *l = k < s->count ? &t->leaves[p->members[s->first + k]] : NULL;
        int64_t start = l ? l->slot : s->rows;
        int64_t piece[2] = {start - cursor, l ? t->shape[l->dims] : 0};
        for (int i = 0; i < 2; i++) {
            if (i == 0 && piece[0] <= 0) continue; /* no padding here */
            if (i == 1 && !l) break;
            PyObject *v = PyLong_FromLongLong(piece[i]);
            if (!v || PyList_Append(sizes, v)) {
                Py_XDECREF(v);
                Py_DECREF(sizes);
                return NULL;
            }
            Py_DECREF(v);
        }
        if (l) cursor = l->slot + t->shape[l->dims];
    }
    return sizes;
}

/* A SPLIT segment: the typed region viewed as (rows, *trailing), cut at the
 * member starts with one split_with_sizes. 0 or -1. */
static int _split_views(mtc_state *st, const mtc_tree *t, const mtc_plan *p, const mtc_seg *s,
                        PyObject *typed, PyObject **outputs, PyObject *keep)
{
    const mtc_leaf *proto = &t->leaves[s->proto];
    int rc = -1;
    PyObject *full = PyTuple_New(proto->ndim), *shaped = NULL, *sizes = NULL, *parts = NULL;
    if (!full) return -1;
    PyTuple_SET_ITEM(full, 0, PyLong_FromLongLong(s->rows));
    for (int d = 1; d < proto->ndim; d++) PyTuple_SET_ITEM(full, d, PyLong_FromLongLong(t->shape[proto->dims + d]));
    if (_tuple_has_null(full)) goto out;
    if (!(shaped = _call_method(typed, st->s_view, &full, 1)) || _keep(keep, shaped)) goto out;
    if (!(sizes = _split_sizes(t, p, s))) goto out;
    /* the pieces, padding pieces included, stay alive in keep */
    if ((parts = _call_method(shaped, st->s_split_with_sizes, &sizes, 1)) && !_keep(keep, parts))
        rc = _store_views(parts, t, p, s, 1, outputs);
out:
    Py_DECREF(full);
    Py_XDECREF(shaped);
    Py_XDECREF(sizes);
    Py_XDECREF(parts);
    return rc;
}

/* Creates the output views of one segment with a handful of torch calls and
 * stores them (new references) in outputs[]. region: uint8 tensor of the
 * segment's bytes. 0 or -1. */
static int _segment_views(mtc_state *st, const mtc_tree *t, const mtc_plan *p, const mtc_seg *s,
                          PyObject *region, PyObject **outputs, PyObject *keep)
{
    const mtc_leaf *proto = &t->leaves[s->proto];
    PyObject *dtype = st->dtypes[proto->dtype];
    PyObject *typed = _call_method(region, st->s_view, &dtype, 1);
    if (!typed) return -1;
    int rc = -1;
    if (_keep(keep, typed)) goto out;
    if (s->kind == MTC_SEG_UNIFORM && s->count == 1) {
        PyObject *shape = mtc_out_shape(t, proto, 0);
        PyObject *v = shape ? _call_method(typed, st->s_view, &shape, 1) : NULL;
        Py_XDECREF(shape);
        if (v) {
            outputs[p->members[s->first]] = v;
            rc = 0;
        }
    } else if (s->kind == MTC_SEG_UNIFORM) {
        rc = _uniform_views(st, t, p, s, typed, outputs, keep);
    } else {
        rc = _split_views(st, t, p, s, typed, outputs, keep);
    }
out:
    Py_DECREF(typed);
    return rc;
}

/* Creates the output views of every segment of plan p over the chunk
 * tensors (uint8; chunk c starts chunk_skip[c] bytes in, or at 0 when
 * chunk_skip is NULL) and stores them (new references) in outputs[]. 0 or -1
 * with an exception. */
int mtc_out_views(mtc_state *st, const mtc_tree *t, const mtc_plan *p, PyObject *const *chunk_t,
                  const Py_ssize_t *chunk_skip, PyObject **outputs, PyObject *keep)
{
    for (uint32_t s = 0; s < p->nsegs; s++) {
        const mtc_seg *sg = &p->segs[s];
        Py_ssize_t off = (chunk_skip ? chunk_skip[sg->chunk] : 0) + (Py_ssize_t)sg->offset;
        PyObject *lo = PyLong_FromSsize_t(off), *hi = PyLong_FromSsize_t(off + (Py_ssize_t)sg->bytes);
        PyObject *slice = lo && hi ? PySlice_New(lo, hi, NULL) : NULL;
        Py_XDECREF(lo);
        Py_XDECREF(hi);
        if (!slice) return -1;
        PyObject *region = PyObject_GetItem(chunk_t[sg->chunk], slice);
        Py_DECREF(slice);
        if (!region) return -1;
        int rc = _keep(keep, region) ? -1 : _segment_views(st, t, p, sg, region, outputs, keep);
        Py_DECREF(region);
        if (rc) return -1;
    }
    return 0;
}

PyObject *mtc_out_device(mtc_state *st, int dev)
{
    if (dev < 0) return Py_NewRef(st->device_cpu);
    PyObject *i = PyLong_FromLong(dev);
    if (!i) return NULL;
    PyObject *d = PyObject_CallOneArg(st->cuda_device, i);
    Py_DECREF(i);
    return d;
}

/* Captures the current raw stream of each involved CUDA device. */

int mtc_out_capture_streams(mtc_state *st, mtc_job *j)
{
    for (int d = 0; d < MTC_MAX_DEVICES; d++) {
        if (!(j->dev_mask & (1ull << d))) continue;
        PyObject *i = PyLong_FromLong(d);
        if (!i) return -1;
        PyObject *s = PyObject_CallOneArg(st->raw_stream, i);
        Py_DECREF(i);
        if (!s) return -1;
        j->streams[d] = (CUstream)PyLong_AsVoidPtr(s);
        Py_DECREF(s);
        if (PyErr_Occurred()) return -1;
    }
    return 0;
}
