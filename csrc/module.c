/*
 * module.c - the Python binding of the engine: module state, _setup(),
 * start_copy(), the handle type, stats().
 *
 * start_copy on the calling thread (GIL held): traverse -> plan -> allocate
 * outputs (torch.empty, one uint8 buffer per chunk) -> build the job ->
 * submit it to the transfer thread -> create output views and rebuild the
 * structure while the transfer thread stages -> return the handle.
 * get() waits (GIL released) and returns the structure.
 */
#define PY_ARRAY_UNIQUE_SYMBOL mtc_ARRAY_API
#include "module.h"

#include <numpy/arrayobject.h>
#include <errno.h>
#include <sched.h>
#include <unistd.h>
#include <stdio.h>
#include <string.h>

#include "arena.h"
#include "cuda.h"
#include "hostcopy.h"
#include "layout.h"
#include "plan.h"
#include "transfer.h"
#include "traverse.h"

/* Calling-thread counters (the GIL serialises their updates). */
static struct {
    uint64_t calls, leaves, packed, reused, from_numpy, host_copies, staged, direct, d2h, d2d,
        made_contiguous, segments, chunks;
    uint64_t ns_traverse, ns_plan, ns_outputs, ns_views, ns_wait;
} _cnt;

static inline mtc_state *_state(PyObject *module) { return (mtc_state *)PyModule_GetState(module); }

/* ------------------------------------------------------------------ handle */

typedef struct {
    PyObject_HEAD
    mtc_state *st;
    mtc_job *job;        /* NULL: nothing to wait for */
    mtc_tree tree;       /* inputs and skeleton; cleared once the job completed */
    PyObject *result;    /* the rebuilt structure */
    PyObject *keep;      /* objects that must outlive the job (contiguous copies, chunks) */
    int finished;        /* completion handled (inputs released, error reported) */
    PyObject *error;     /* the exception of a failed copy, raised by every get() */
} Handle;

/* Releases inputs once the job completed; sets h->error for a failed job.
 * Precondition: the job completed (or there is none). */
static void _handle_finish(Handle *h)
{
    if (h->finished) return;
    h->finished = 1;
    if (h->job && h->job->err) {
        mtc_job *j = h->job;
        char desc[256];
        if (j->err == -E2BIG)
            snprintf(desc, sizeof desc, "a staging buffer would exceed the pinned-memory cap of %zu bytes; "
                     "raise it with mtc_loader.configure(pinned_cap_bytes=...) or lower max_packed_chunk_bytes",
                     mtc_engine_pinned_cap());
        else
            mtc_cuda_describe(j->err, desc, sizeof desc);
        PyObject *path = NULL;
        if (j->err_leaf >= 0 && (uint32_t)j->err_leaf < h->tree.nleaves)
            path = mtc_leaf_path(&h->tree, (uint32_t)j->err_leaf);
        PyErr_Clear();
        PyObject *exc_type = (j->err == -ENOMEM || (MTC_IS_CUDA_ERR(j->err) && MTC_CUDA_RES(j->err) == 2))
                                 ? PyExc_MemoryError : PyExc_RuntimeError;
        PyObject *msg = PyUnicode_FromFormat(
            "mtc_loader: the copy of %s failed while %s: %s", path ? PyUnicode_AsUTF8(path) : "the batch",
            j->err_where, desc);
        Py_XDECREF(path);
        if (msg) {
            h->error = PyObject_CallOneArg(exc_type, msg);
            Py_DECREF(msg);
        }
        if (!h->error) PyErr_Clear();
        Py_CLEAR(h->result);
    }
    if (h->job) {
        mtc_job_release(h->job);
        h->job = NULL;
    }
    mtc_tree_clear(&h->tree);
    Py_CLEAR(h->keep);
}

/* Waits for the job with the GIL released, in slices, so that a signal
 * (Ctrl-C) interrupts the wait. 0, or -1 with the signal's exception set;
 * the copy itself goes on and a later get() can still collect it. */
static int _handle_wait(Handle *h)
{
    if (!h->job || mtc_job_complete(h->job)) return 0;
    int64_t t0 = mtc_now_ns();
    for (;;) {
        int rc;
        Py_BEGIN_ALLOW_THREADS
        rc = mtc_job_wait(h->job, 100000000); /* 100 ms */
        Py_END_ALLOW_THREADS
        if (rc == 0) break;
        if (PyErr_CheckSignals()) {
            _cnt.ns_wait += (uint64_t)(mtc_now_ns() - t0);
            return -1;
        }
    }
    _cnt.ns_wait += (uint64_t)(mtc_now_ns() - t0);
    return 0;
}

static PyObject *Handle_ready(Handle *h, PyObject *unused)
{
    return PyBool_FromLong(!h->job || mtc_job_complete(h->job));
}

static PyObject *Handle_get(Handle *h, PyObject *unused)
{
    if (_handle_wait(h)) return NULL;
    _handle_finish(h);
    if (h->error) {
        PyErr_SetObject((PyObject *)Py_TYPE(h->error), h->error);
        return NULL;
    }
    if (!h->result) {
        PyErr_SetString(PyExc_RuntimeError, "mtc_loader: this handle holds no result");
        return NULL;
    }
    return Py_NewRef(h->result);
}

static void Handle_dealloc(Handle *h)
{
    PyTypeObject *tp = Py_TYPE(h);
    if (h->job && !mtc_job_complete(h->job)) {
        /* Dropped without get(): the copy may still read the inputs this
         * handle keeps alive; wait for it (uninterruptibly) before freeing. */
        Py_BEGIN_ALLOW_THREADS
        mtc_job_wait(h->job, -1);
        Py_END_ALLOW_THREADS
    }
    PyObject *exc_type, *exc, *tb;
    PyErr_Fetch(&exc_type, &exc, &tb);
    _handle_finish(h);
    PyErr_Restore(exc_type, exc, tb);
    Py_CLEAR(h->result);
    Py_CLEAR(h->error);
    tp->tp_free((PyObject *)h);
    Py_DECREF(tp);
}

static PyMethodDef Handle_methods[] = {
    {"ready", (PyCFunction)Handle_ready, METH_NOARGS, "True when get() would return without blocking."},
    {"get", (PyCFunction)Handle_get, METH_NOARGS, "Wait for the copy and return the copied structure."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot Handle_slots[] = {
    {Py_tp_dealloc, Handle_dealloc},
    {Py_tp_methods, Handle_methods},
    {Py_tp_doc, "Engine-side handle of one start_copy (wrapped by mtc_loader.AsyncCopyHandle)."},
    {0, NULL},
};

static PyType_Spec Handle_spec = {
    .name = "mtc_loader._engine.Handle",
    .basicsize = sizeof(Handle),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = Handle_slots,
};

/* -------------------------------------------------------------- helpers */

static PyObject *_shape_of(const mtc_tree *t, const mtc_leaf *l, int from)
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
static PyObject *_empty(mtc_state *st, PyObject *shape, PyObject *dtype, PyObject *device, int pin)
{
    PyObject *args[4] = {shape, dtype, device, Py_True};
    return PyObject_Vectorcall(st->torch_empty, args, 1, pin ? st->kw_dtype_device_pin : st->kw_dtype_device);
}

static int _data_ptr(mtc_state *st, PyObject *tensor, uintptr_t *out)
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

/* Creates the output views of one segment with a handful of torch calls and
 * stores them (new references) in outputs[]. region: uint8 tensor of the
 * segment's bytes. */
static int _segment_views(mtc_state *st, const mtc_tree *t, const mtc_plan *p, const mtc_seg *s,
                          PyObject *region, PyObject **outputs)
{
    const mtc_leaf *proto = &t->leaves[s->proto];
    PyObject *typed = NULL, *shaped = NULL, *parts = NULL, *tmp = NULL, *arg = NULL;
    int rc = -1;
    PyObject *dtype = st->dtypes[proto->dtype];
    if (!(typed = _call_method(region, st->s_view, &dtype, 1))) goto out;

    if (s->kind == MTC_SEG_UNIFORM && s->count == 1) {
        if (!(arg = _shape_of(t, proto, 0))) goto out;
        PyObject *v = _call_method(typed, st->s_view, &arg, 1);
        if (!v) goto out;
        outputs[p->members[s->first]] = v;
        rc = 0;
        goto out;
    }
    if (s->kind == MTC_SEG_UNIFORM) {
        /* members at a fixed slot: one as_strided view (count, *shape), unbound */
        int nd = proto->ndim;
        PyObject *size = PyTuple_New(nd + 1), *stride = PyTuple_New(nd + 1);
        if (!size || !stride) {
            Py_XDECREF(size);
            Py_XDECREF(stride);
            goto out;
        }
        PyTuple_SET_ITEM(size, 0, PyLong_FromLongLong(s->count));
        PyTuple_SET_ITEM(stride, 0, PyLong_FromLongLong(s->row_bytes / proto->elsize));
        int64_t st_el = 1;
        for (int d = nd - 1; d >= 0; d--) {
            int64_t dim = t->shape[proto->dims + d];
            PyTuple_SET_ITEM(size, d + 1, PyLong_FromLongLong(dim));
            PyTuple_SET_ITEM(stride, d + 1, PyLong_FromLongLong(st_el));
            st_el *= dim > 1 ? dim : 1;
        }
        PyObject *a2[2] = {size, stride};
        shaped = _call_method(typed, st->s_as_strided, a2, 2);
        Py_DECREF(size);
        Py_DECREF(stride);
        if (!shaped) goto out;
        PyObject *zero = PyLong_FromLong(0);
        parts = _call_method(shaped, st->s_unbind, &zero, 1);
        Py_DECREF(zero);
        if (!parts) goto out;
        if (!PyTuple_Check(parts) && !PyList_Check(parts)) goto bad;
        PyObject *fast = PySequence_Fast(parts, "unbind");
        if (!fast) goto out;
        if (PySequence_Fast_GET_SIZE(fast) != (Py_ssize_t)s->count) {
            Py_DECREF(fast);
            goto bad;
        }
        for (uint32_t k = 0; k < s->count; k++)
            outputs[p->members[s->first + k]] = Py_NewRef(PySequence_Fast_GET_ITEM(fast, k));
        Py_DECREF(fast);
        rc = 0;
        goto out;
    }
    /* SPLIT: view the segment as (rows, *trailing), cut at member starts. */
    {
        PyObject *trail = _shape_of(t, proto, 1);
        if (!trail) goto out;
        PyObject *full = PyTuple_New(proto->ndim);
        if (!full) {
            Py_DECREF(trail);
            goto out;
        }
        PyTuple_SET_ITEM(full, 0, PyLong_FromLongLong(s->rows));
        for (int d = 1; d < proto->ndim; d++) PyTuple_SET_ITEM(full, d, Py_NewRef(PyTuple_GET_ITEM(trail, d - 1)));
        Py_DECREF(trail);
        shaped = _call_method(typed, st->s_view, &full, 1);
        Py_DECREF(full);
        if (!shaped) goto out;
        if (!(tmp = PyList_New(0))) goto out;
        int64_t cursor = 0;
        for (uint32_t k = 0; k < s->count; k++) {
            const mtc_leaf *l = &t->leaves[p->members[s->first + k]];
            int64_t rows = t->shape[l->dims];
            if (l->slot > cursor) { /* padding rows before this member */
                PyObject *v = PyLong_FromLongLong(l->slot - cursor);
                if (!v || PyList_Append(tmp, v)) { Py_XDECREF(v); goto out; }
                Py_DECREF(v);
            }
            PyObject *v = PyLong_FromLongLong(rows);
            if (!v || PyList_Append(tmp, v)) { Py_XDECREF(v); goto out; }
            Py_DECREF(v);
            cursor = l->slot + rows;
        }
        if (cursor < s->rows) {
            PyObject *v = PyLong_FromLongLong(s->rows - cursor);
            if (!v || PyList_Append(tmp, v)) { Py_XDECREF(v); goto out; }
            Py_DECREF(v);
        }
        if (!(parts = _call_method(shaped, st->s_split_with_sizes, &tmp, 1))) goto out;
        PyObject *fast = PySequence_Fast(parts, "unsafe_split_with_sizes");
        if (!fast) goto out;
        Py_ssize_t j = 0;
        cursor = 0;
        for (uint32_t k = 0; k < s->count; k++) {
            const mtc_leaf *l = &t->leaves[p->members[s->first + k]];
            if (l->slot > cursor) j++; /* skip the padding piece */
            if (j >= PySequence_Fast_GET_SIZE(fast)) {
                Py_DECREF(fast);
                goto bad;
            }
            outputs[p->members[s->first + k]] = Py_NewRef(PySequence_Fast_GET_ITEM(fast, j++));
            cursor = l->slot + t->shape[l->dims];
        }
        Py_DECREF(fast);
        rc = 0;
        goto out;
    }
bad:
    PyErr_SetString(PyExc_SystemError, "mtc_loader: torch returned an unexpected number of views");
out:
    Py_XDECREF(typed);
    Py_XDECREF(shaped);
    Py_XDECREF(parts);
    Py_XDECREF(tmp);
    Py_XDECREF(arg);
    return rc;
}

/* Creates the output views of every segment of plan p over the chunk
 * tensors (uint8; the chunk's aligned base is chunk_skip[c] bytes in) and
 * stores them (new references) in outputs[]. 0 or -1 with an exception. */
static int _make_views(mtc_state *st, const mtc_tree *t, const mtc_plan *p, PyObject *const *chunk_t,
                       const Py_ssize_t *chunk_skip, PyObject **outputs)
{
    for (uint32_t s = 0; s < p->nsegs; s++) {
        const mtc_seg *sg = &p->segs[s];
        Py_ssize_t off = chunk_skip[sg->chunk] + (Py_ssize_t)sg->offset;
        PyObject *lo = PyLong_FromSsize_t(off), *hi = PyLong_FromSsize_t(off + (Py_ssize_t)sg->bytes);
        PyObject *slice = lo && hi ? PySlice_New(lo, hi, NULL) : NULL;
        Py_XDECREF(lo);
        Py_XDECREF(hi);
        if (!slice) return -1;
        PyObject *region = PyObject_GetItem(chunk_t[sg->chunk], slice);
        Py_DECREF(slice);
        if (!region) return -1;
        int rc = _segment_views(st, t, p, sg, region, outputs);
        Py_DECREF(region);
        if (rc) return -1;
    }
    return 0;
}

/* ----------------------------------------------------------- start_copy */

/* Replaces leaves that need a contiguous source by contiguous copies
 * (tensor.contiguous() / numpy ascontiguousarray); returns how many. */
static int _make_contiguous(mtc_state *st, mtc_tree *t, const mtc_plan *p)
{
    int n = 0;
    for (uint32_t i = 0; i < t->nleaves; i++) {
        if (!t->leaves[i].needs_contig) continue;
        PyObject *old = t->objs[i], *c;
        if (t->leaves[i].flags & MTC_LEAF_NUMPY)
            c = (PyObject *)PyArray_GETCONTIGUOUS((PyArrayObject *)old);
        else
            c = PyObject_VectorcallMethod(st->s_contiguous, &old, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        if (!c) return -1;
        t->objs[i] = c;
        Py_DECREF(old);
        if (mtc_tree_reread(st, t, i)) return -1;
        n++;
    }
    return n;
}

static PyObject *_device_obj(mtc_state *st, int dev)
{
    if (dev < 0) return Py_NewRef(st->device_cpu);
    PyObject *i = PyLong_FromLong(dev);
    if (!i) return NULL;
    PyObject *d = PyObject_CallOneArg(st->cuda_device, i);
    Py_DECREF(i);
    return d;
}

/* Captures the current raw stream of each involved CUDA device. */
static int _capture_streams(mtc_state *st, mtc_job *j)
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

static int _set_item(mtc_item *it, const mtc_tree *t, uint32_t i, uintptr_t dst)
{
    const mtc_leaf *l = &t->leaves[i];
    it->src = l->data;
    it->dst = dst;
    it->nbytes = l->nbytes;
    it->ndim = l->ndim;
    it->elsize = l->elsize;
    it->dev = l->dev;
    it->leaf = (int32_t)i;
    if (l->flags & MTC_LEAF_CONTIGUOUS) {
        it->shape = it->strides = NULL;
    } else {
        it->shape = &t->shape[l->dims];
        it->strides = &t->strides[l->dims];
    }
    return 0;
}

static PyObject *engine_start_copy(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    mtc_state *st = _state(module);
    if (!st->ready) {
        PyErr_SetString(PyExc_RuntimeError, "mtc_loader._engine used before _setup()");
        return NULL;
    }
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "_engine.start_copy(data, target, staging, pack, align, max_chunk, background)");
        return NULL;
    }
    PyObject *data = args[0];
    mtc_plan_opts o;
    mtc_plan_default_opts(&o, (int32_t)PyLong_AsLong(args[1]));
    o.staging = PyObject_IsTrue(args[2]);
    o.pack = PyObject_IsTrue(args[3]);
    o.align = PyLong_AsLongLong(args[4]);
    o.max_chunk = PyLong_AsLongLong(args[5]);
    int background = PyObject_IsTrue(args[6]);
    if (PyErr_Occurred()) return NULL;
    if (o.target < -1 || o.target >= MTC_MAX_DEVICES || o.align <= 0 || o.max_chunk <= 0) {
        PyErr_SetString(PyExc_ValueError, "mtc_loader: bad engine arguments");
        return NULL;
    }

    Handle *h = PyObject_New(Handle, st->handle_type);
    if (!h) return NULL;
    h->st = st;
    h->job = NULL;
    memset(&h->tree, 0, sizeof h->tree);
    h->result = NULL;
    h->error = NULL;
    h->finished = 0;
    h->keep = PyList_New(0);
    Py_INCREF(st->handle_type); /* heap type instances own their type */

    mtc_plan plan;
    memset(&plan, 0, sizeof plan);
    PyObject **outputs = NULL, **chunk_t = NULL, *dev_obj = NULL;
    uintptr_t *chunk_base = NULL;
    Py_ssize_t *chunk_skip = NULL;
    mtc_tree *t = &h->tree;
    mtc_job *job = NULL;
    if (!h->keep) goto error;

    int64_t t0 = mtc_now_ns();
    if (mtc_traverse(st, data, t)) goto error;
    int64_t t1 = mtc_now_ns();
    _cnt.ns_traverse += (uint64_t)(t1 - t0);
    _cnt.calls++;
    _cnt.leaves += t->nleaves;

    int rc = mtc_plan_build(&plan, t->leaves, t->nleaves, t->shape, &o);
    if (rc == 0 && plan.need_contig) {
        int n = _make_contiguous(st, t, &plan);
        if (n < 0) goto error;
        _cnt.made_contiguous += (uint64_t)n;
        mtc_plan_free(&plan);
        rc = mtc_plan_build(&plan, t->leaves, t->nleaves, t->shape, &o);
    }
    if (rc) {
        PyErr_Format(rc == -ENOMEM ? PyExc_MemoryError : PyExc_ValueError,
                     "mtc_loader: planning the copy failed (%s); check min_packed_alignment_bytes",
                     strerror(-rc));
        goto error;
    }
#ifdef MTC_DEBUG
    if (!mtc_plan_valid(&plan, t->leaves, t->nleaves, t->shape, &o)) {
        PyErr_SetString(PyExc_SystemError, "mtc_loader: invalid plan");
        goto error;
    }
#endif
    int64_t t2 = mtc_now_ns();
    _cnt.ns_plan += (uint64_t)(t2 - t1);
    _cnt.packed += plan.count[MTC_ACT_PACK];
    _cnt.reused += plan.count[MTC_ACT_REUSE];
    _cnt.from_numpy += plan.count[MTC_ACT_FROM_NUMPY];
    _cnt.host_copies += plan.count[MTC_ACT_HOST_COPY];
    _cnt.staged += plan.count[MTC_ACT_H2D_STAGED];
    _cnt.direct += plan.count[MTC_ACT_H2D_DIRECT];
    _cnt.d2h += plan.count[MTC_ACT_D2H];
    _cnt.d2d += plan.count[MTC_ACT_D2D];
    _cnt.segments += plan.nsegs;
    _cnt.chunks += plan.nchunks;

    /* ---- outputs that are not views ---- */
    outputs = PyMem_Calloc(t->nleaves ? t->nleaves : 1, sizeof *outputs);
    chunk_t = PyMem_Calloc(plan.nchunks ? plan.nchunks : 1, sizeof *chunk_t);
    chunk_base = PyMem_Calloc(plan.nchunks ? plan.nchunks : 1, sizeof *chunk_base);
    chunk_skip = PyMem_Calloc(plan.nchunks ? plan.nchunks : 1, sizeof *chunk_skip);
    if (!outputs || !chunk_t || !chunk_base || !chunk_skip) {
        PyErr_NoMemory();
        goto error;
    }
    uint32_t nops = plan.nchunks, nitems = plan.nmembers, host_items = 0;
    for (uint32_t i = 0; i < t->nleaves; i++) {
        uint8_t a = t->leaves[i].action;
        if (a == MTC_ACT_HOST_COPY) host_items++;
        else if (a != MTC_ACT_REUSE && a != MTC_ACT_FROM_NUMPY && a != MTC_ACT_PACK) nops++;
        if (a != MTC_ACT_REUSE && a != MTC_ACT_FROM_NUMPY && a != MTC_ACT_PACK) nitems++;
    }
    nops += host_items ? 1 : 0;
    int need_job = nitems > 0;
    uint64_t dev_mask = t->cuda_mask | (o.target >= 0 ? 1ull << o.target : 0);
    if (need_job && dev_mask) {
        if ((rc = mtc_cuda_load())) {
            char desc[256];
            mtc_cuda_describe(rc, desc, sizeof desc);
            PyErr_Format(PyExc_RuntimeError, "mtc_loader: CUDA is needed for this copy but %s", desc);
            goto error;
        }
    }
    if (need_job) {
        if (!(job = mtc_job_new(nops, nitems))) {
            PyErr_NoMemory();
            goto error;
        }
        job->target = o.target;
        job->staging = o.staging;
        job->dev_mask = dev_mask;
        if (dev_mask && _capture_streams(st, job)) goto error;
    }
    if (!(dev_obj = _device_obj(st, o.target))) goto error;
    int pin_chunks = o.target < 0; /* D2H packing writes into pinned host chunks */
    for (uint32_t c = 0; c < plan.nchunks; c++) {
        int64_t align = plan.chunks[c].align, bytes = plan.chunks[c].payload + align - 1;
        PyObject *shape = Py_BuildValue("(L)", (long long)bytes);
        if (!shape) goto error;
        chunk_t[c] = _empty(st, shape, st->uint8, pin_chunks ? st->device_cpu : dev_obj, pin_chunks);
        Py_DECREF(shape);
        if (!chunk_t[c]) goto error;
        uintptr_t ptr;
        if (_data_ptr(st, chunk_t[c], &ptr)) goto error;
        chunk_skip[c] = (Py_ssize_t)((align - (int64_t)(ptr % (uintptr_t)align)) % align);
        chunk_base[c] = ptr + (uintptr_t)chunk_skip[c];
    }
    uint32_t oi = 0, ii = 0;
    /* packed items, chunk by chunk (segments are in chunk order) */
    for (uint32_t s = 0; s < plan.nsegs;) {
        int32_t c = plan.segs[s].chunk;
        mtc_op *op = &job->ops[oi++];
        op->kind = o.target >= 0 ? MTC_OP_H2D_CHUNK : MTC_OP_D2H_CHUNK;
        op->dev = o.target;
        op->dst = chunk_base[c];
        op->nbytes = plan.chunks[c].payload;
        op->first = ii;
        for (; s < plan.nsegs && plan.segs[s].chunk == c; s++)
            for (uint32_t k = 0; k < plan.segs[s].count; k++) {
                uint32_t li = plan.members[plan.segs[s].first + k];
                _set_item(&job->items[ii++], t, li, (uintptr_t)mtc_plan_leaf_offset(&plan, &t->leaves[li]));
            }
        op->count = ii - op->first;
    }
    /* Own outputs: every leaf that is not reused or packed gets a new tensor.
     * Host copies form one op; the others one op each. Two passes keep the
     * host op's items consecutive. */
    mtc_op *host_op = NULL;
    for (int pass = 0; pass < 2; pass++) {
        for (uint32_t i = 0; i < t->nleaves; i++) {
            mtc_leaf *l = &t->leaves[i];
            if (pass == 0 && l->action == MTC_ACT_REUSE) {
                outputs[i] = Py_NewRef(t->objs[i]);
                continue;
            }
            if (pass == 0 && l->action == MTC_ACT_FROM_NUMPY) {
                if (!(outputs[i] = PyObject_CallOneArg(st->from_numpy, t->objs[i]))) goto error;
                continue;
            }
            if (l->action == MTC_ACT_REUSE || l->action == MTC_ACT_FROM_NUMPY || l->action == MTC_ACT_PACK)
                continue;
            if ((l->action == MTC_ACT_HOST_COPY) != (pass == 1)) continue;
            PyObject *shape = _shape_of(t, l, 0);
            if (!shape) goto error;
            int pin = l->action == MTC_ACT_D2H && o.staging;
            outputs[i] = _empty(st, shape, st->dtypes[l->dtype], pin ? st->device_cpu : dev_obj, pin);
            Py_DECREF(shape);
            if (!outputs[i]) goto error;
            uintptr_t dst;
            if (_data_ptr(st, outputs[i], &dst)) goto error;
            mtc_op *op;
            if (l->action == MTC_ACT_HOST_COPY) {
                if (!host_op) {
                    host_op = &job->ops[oi++];
                    host_op->kind = MTC_OP_HOST_COPY;
                    host_op->dev = -1;
                    host_op->first = ii;
                    host_op->count = 0;
                }
                op = host_op;
            } else {
                op = &job->ops[oi++];
                op->kind = l->action == MTC_ACT_D2H ? MTC_OP_D2H
                         : l->action == MTC_ACT_D2D ? MTC_OP_D2D : MTC_OP_H2D;
                op->dev = l->action == MTC_ACT_D2H ? l->dev : o.target;
                op->first = ii;
                op->count = 0;
            }
            _set_item(&job->items[ii++], t, i, dst);
            op->count++;
        }
    }
    if (job) {
        job->nops = oi;
        job->nitems = ii;
    }
    int64_t t3 = mtc_now_ns();
    _cnt.ns_outputs += (uint64_t)(t3 - t2);

    /* ---- run or submit; views are made while the transfer thread stages ---- */
    if (job) {
        if (background) {
            if ((rc = mtc_job_submit(job))) {
                PyErr_Format(PyExc_RuntimeError, "mtc_loader: cannot start the transfer thread: %s", strerror(-rc));
                goto error;
            }
        } else {
            Py_BEGIN_ALLOW_THREADS
            mtc_job_run(job);
            Py_END_ALLOW_THREADS
        }
        h->job = job;
        job = NULL;
    }
    if (_make_views(st, t, &plan, chunk_t, chunk_skip, outputs)) goto error;
    if (!(h->result = mtc_rebuild(st, t, outputs))) goto error;
    _cnt.ns_views += (uint64_t)(mtc_now_ns() - t3);

    for (uint32_t i = 0; i < t->nleaves; i++) Py_XDECREF(outputs[i]);
    for (uint32_t c = 0; c < plan.nchunks; c++) Py_XDECREF(chunk_t[c]);
    PyMem_Free(outputs);
    PyMem_Free(chunk_t);
    PyMem_Free(chunk_base);
    PyMem_Free(chunk_skip);
    Py_XDECREF(dev_obj);
    mtc_plan_free(&plan);
    if (!h->job) _handle_finish(h); /* nothing in flight: release the inputs now */
    return (PyObject *)h;

error:
    if (job) mtc_job_release(job);
    if (outputs)
        for (uint32_t i = 0; i < t->nleaves; i++) Py_XDECREF(outputs[i]);
    if (chunk_t)
        for (uint32_t c = 0; c < plan.nchunks; c++) Py_XDECREF(chunk_t[c]);
    PyMem_Free(outputs);
    PyMem_Free(chunk_t);
    PyMem_Free(chunk_base);
    PyMem_Free(chunk_skip);
    Py_XDECREF(dev_obj);
    mtc_plan_free(&plan);
    Py_DECREF(h); /* waits for a submitted job before releasing the inputs */
    return NULL;
}

/* ----------------------------------------------------------------- arena */

typedef struct {
    PyObject_HEAD
    mtc_arena *a;
    int registered_dev;  /* device it was page-locked with, -1 none */
} ArenaObject;

static mtc_arena *_arena_of(mtc_state *st, PyObject *o)
{
    if (!PyObject_TypeCheck(o, st->arena_type)) {
        PyErr_SetString(PyExc_TypeError, "mtc_loader: expected an _engine.Arena");
        return NULL;
    }
    return ((ArenaObject *)o)->a;
}

static PyObject *_arena_wrap(mtc_state *st, mtc_arena *a)
{
    ArenaObject *o = PyObject_New(ArenaObject, st->arena_type);
    if (!o) {
        mtc_arena_unref(a);
        return NULL;
    }
    Py_INCREF(st->arena_type);
    o->a = a;
    o->registered_dev = -1;
    return (PyObject *)o;
}

static void Arena_dealloc(ArenaObject *o)
{
    PyTypeObject *tp = Py_TYPE(o);
    if (o->a) {
        if (o->registered_dev >= 0) {
            /* DMAs in flight hold references (released by their completion
             * callbacks): unregister only once none reads the arena */
            Py_BEGIN_ALLOW_THREADS
            while (mtc_load_acquire(&o->a->refs) > 1) sched_yield();
            if (!mtc_cuda_set_device(o->registered_dev)) mtc_cu.cuMemHostUnregister(o->a->base);
            Py_END_ALLOW_THREADS
        }
        mtc_arena_unref(o->a);
    }
    tp->tp_free((PyObject *)o);
    Py_DECREF(tp);
}

static PyObject *Arena_fileno(ArenaObject *o, PyObject *unused) { return PyLong_FromLong(o->a->fd); }

static PyObject *Arena_stats(ArenaObject *o, PyObject *unused)
{
    mtc_arena_stats s;
    mtc_arena_get_stats(o->a, &s);
    return Py_BuildValue("{sKsKsKsKsKsKsKsKsKsKsKsi}", "bytes", s.bytes, "slot_bytes", s.slot_bytes,
                         "slots", s.nslots, "allocs", s.allocs, "frees", s.frees, "waits", s.waits,
                         "timeouts", s.timeouts, "reclaimed_slots", s.reclaims, "slots_in_use",
                         s.slots_in_use, "bytes_in_use", s.slots_in_use * s.slot_bytes,
                         "high_water_slots", s.high_water, "registered", o->registered_dev >= 0);
}

static PyObject *Arena_reclaim_dead(ArenaObject *o, PyObject *unused)
{
    uint64_t n;
    Py_BEGIN_ALLOW_THREADS
    n = mtc_arena_reclaim_dead(o->a, (uint32_t)getpid());
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLongLong(n);
}

static PyObject *Arena_release(ArenaObject *o, PyObject *args)
{
    unsigned long long off;
    unsigned int owner;
    if (!PyArg_ParseTuple(args, "KI", &off, &owner)) return NULL;
    return PyBool_FromLong(mtc_arena_free(o->a, off, owner) == 0);
}

static PyObject *Arena_adopt(ArenaObject *o, PyObject *args)
{
    unsigned long long off;
    unsigned int owner;
    if (!PyArg_ParseTuple(args, "KI", &off, &owner)) return NULL;
    uint32_t me = (uint32_t)getpid();
    if (owner != me && mtc_arena_retag(o->a, off, owner, me)) {
        PyErr_Format(PyExc_RuntimeError,
                     "mtc_loader: a packed batch names arena region %llu of process %u, which does not "
                     "hold it (a stale or forged descriptor, or the region was reclaimed)", off, owner);
        return NULL;
    }
    return PyLong_FromUnsignedLong(me);
}

static PyObject *Arena_valid(ArenaObject *o, PyObject *unused) { return PyBool_FromLong(mtc_arena_valid(o->a)); }

static PyMethodDef Arena_methods[] = {
    {"fileno", (PyCFunction)Arena_fileno, METH_NOARGS, "The arena's memfd."},
    {"stats", (PyCFunction)Arena_stats, METH_NOARGS, "Allocator counters."},
    {"reclaim_dead", (PyCFunction)Arena_reclaim_dead, METH_NOARGS, "Free regions of dead processes."},
    {"release", (PyCFunction)Arena_release, METH_VARARGS, "release(offset, owner): free a region."},
    {"adopt", (PyCFunction)Arena_adopt, METH_VARARGS, "adopt(offset, owner): take over a region."},
    {"valid", (PyCFunction)Arena_valid, METH_NOARGS, "Invariant check (quiescent arena)."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot Arena_slots[] = {
    {Py_tp_dealloc, Arena_dealloc},
    {Py_tp_methods, Arena_methods},
    {Py_tp_doc, "A shared arena mapping (wrapped by mtc_loader.collate.Arena)."},
    {0, NULL},
};

static PyType_Spec Arena_spec = {
    .name = "mtc_loader._engine.Arena",
    .basicsize = sizeof(ArenaObject),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = Arena_slots,
};

static PyObject *engine_arena_create(PyObject *module, PyObject *arg)
{
    unsigned long long n = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) return NULL;
    mtc_arena *a;
    int rc = mtc_arena_create((size_t)n, &a);
    if (rc) {
        errno = -rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return _arena_wrap(_state(module), a);
}

static PyObject *engine_arena_attach(PyObject *module, PyObject *arg)
{
    int fd = (int)PyLong_AsLong(arg);
    if (PyErr_Occurred()) return NULL;
    mtc_arena *a;
    int rc = mtc_arena_attach(fd, &a);
    if (rc == -EINVAL) {
        PyErr_SetString(PyExc_ValueError, "mtc_loader: that file descriptor is not an mtc_loader arena");
        return NULL;
    }
    if (rc) {
        errno = -rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return _arena_wrap(_state(module), a);
}

/* pack(arena, data, align, timeout_s) -> (offset, nbytes, layout, skeleton)
 * In a DataLoader worker: every tensor / numpy leaf of data is written into
 * one arena region, laid out by the planner as one chunk. */
static PyObject *engine_pack(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    mtc_state *st = _state(module);
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "pack(arena, data, align, timeout_s)");
        return NULL;
    }
    mtc_arena *a = _arena_of(st, args[0]);
    if (!a) return NULL;
    mtc_plan_opts o;
    mtc_plan_default_opts(&o, 0); /* "to a device": every host leaf is packed */
    o.align = PyLong_AsLongLong(args[2]);
    double timeout = PyFloat_AsDouble(args[3]);
    if (PyErr_Occurred()) return NULL;
    if (o.align < 1 || o.align > MTC_LAYOUT_MAX_ALIGN || (o.align & (o.align - 1))) {
        PyErr_SetString(PyExc_ValueError, "mtc_loader: the arena alignment must be a power of two <= 4096");
        return NULL;
    }
    o.max_chunk = o.pack_limit = INT64_MAX / 4; /* one chunk, whatever the sizes */
    mtc_tree t;
    memset(&t, 0, sizeof t);
    mtc_plan plan;
    memset(&plan, 0, sizeof plan);
    mtc_job *job = NULL;
    PyObject *res = NULL, *layout = NULL, *skeleton = NULL, **slots = NULL;
    uint64_t off = 0;
    int have_region = 0;
    uint32_t me = (uint32_t)getpid();
    if (mtc_traverse(st, args[1], &t)) goto out;
    if (t.any_cuda) {
        for (uint32_t i = 0; i < t.nleaves; i++)
            if (t.leaves[i].dev >= 0) {
                PyObject *path = mtc_leaf_path(&t, i);
                if (path) {
                    PyErr_Format(PyExc_TypeError, "mtc_loader: %U is a CUDA tensor; PackedCollate packs host "
                                 "tensors in DataLoader workers (move it to the GPU after loading)", path);
                    Py_DECREF(path);
                }
                goto out;
            }
    }
    int rc = mtc_plan_build(&plan, t.leaves, t.nleaves, t.shape, &o);
    if (rc) {
        PyErr_Format(PyExc_ValueError, "mtc_loader: planning the packed batch failed (%s)", strerror(-rc));
        goto out;
    }
    int64_t payload = plan.nchunks ? plan.chunks[0].payload : 0;
    Py_BEGIN_ALLOW_THREADS
    rc = mtc_arena_alloc(a, (uint64_t)(payload ? payload : 1), me,
                         timeout < 0 ? -1 : (int64_t)(timeout * 1e9), &off);
    Py_END_ALLOW_THREADS
    if (rc) {
        mtc_arena_stats as;
        mtc_arena_get_stats(a, &as);
        if (rc == -E2BIG || rc == -ETIMEDOUT)
            PyErr_Format(PyExc_RuntimeError,
                         "mtc_loader: the shared arena (%llu bytes, %llu in use) %s a packed batch of %lld "
                         "bytes. Make it larger: PackedCollate(arena_bytes=...) of at least "
                         "(num_workers * prefetch_factor + PrefetchLoader depth + 2) x %lld bytes "
                         "(this batch rounded up to the arena's 64 KiB slots)",
                         (unsigned long long)as.bytes, (unsigned long long)(as.slots_in_use * as.slot_bytes),
                         rc == -E2BIG ? "is too small for" : "stayed full too long to take",
                         (long long)payload,
                         (long long)((payload + (int64_t)as.slot_bytes - 1) / (int64_t)as.slot_bytes *
                                     (int64_t)as.slot_bytes));
        else
            PyErr_Format(PyExc_RuntimeError, "mtc_loader: arena allocation failed: %s", strerror(-rc));
        goto out;
    }
    have_region = 1;
    /* stage every leaf into the region (the GIL released; helpers for big ones) */
    if (t.nleaves) {
        if (!(job = mtc_job_new(1, t.nleaves))) {
            PyErr_NoMemory();
            goto out;
        }
        job->target = MTC_DEV_CPU;
        job->ops[0].kind = MTC_OP_HOST_COPY;
        job->ops[0].dev = -1;
        job->ops[0].first = 0;
        job->ops[0].count = t.nleaves;
        for (uint32_t i = 0; i < t.nleaves; i++)
            _set_item(&job->items[i], &t, i,
                      (uintptr_t)(a->base + off + (uint64_t)mtc_plan_leaf_offset(&plan, &t.leaves[i])));
        job->nops = 1;
        job->nitems = t.nleaves;
        Py_BEGIN_ALLOW_THREADS
        mtc_job_run(job);
        Py_END_ALLOW_THREADS
    }
    size_t lsize = mtc_layout_size(t.leaves, t.nleaves, &plan);
    if (!(layout = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)lsize))) goto out;
    if ((rc = mtc_layout_encode(t.leaves, t.nleaves, t.shape, &plan, (uint8_t *)PyBytes_AS_STRING(layout), lsize))) {
        PyErr_Format(PyExc_SystemError, "mtc_loader: layout encoding failed (%d)", rc);
        goto out;
    }
    slots = PyMem_Malloc((t.nleaves ? t.nleaves : 1) * sizeof *slots);
    if (!slots) {
        PyErr_NoMemory();
        goto out;
    }
    for (uint32_t i = 0; i < t.nleaves; i++) slots[i] = st->leaf_slot;
    if (!(skeleton = mtc_rebuild(st, &t, slots))) goto out;
    res = Py_BuildValue("(KLOO)", (unsigned long long)off, (long long)payload, layout, skeleton);
    if (res) have_region = 0; /* handed to the descriptor */
out:
    if (have_region) mtc_arena_free(a, off, me);
    if (job) mtc_job_release(job);
    PyMem_Free(slots);
    Py_XDECREF(layout);
    Py_XDECREF(skeleton);
    mtc_plan_free(&plan);
    mtc_tree_clear(&t);
    return res;
}

typedef struct _region_ref { mtc_arena *a; uint64_t off; uint32_t owner; } _region_ref;

/* Runs on a CUDA driver thread once the DMA that read the region completed. */
static void _region_done(void *arg)
{
    _region_ref *r = arg;
    mtc_arena_free(r->a, r->off, r->owner);
    mtc_arena_unref(r->a);
    free(r);
}

/* unpack(arena, offset, nbytes, owner, layout, skeleton, target, background) -> Handle
 * In the main process: the region (already adopted by this process) becomes
 * the output structure on `target`, straight from the arena. */
static PyObject *engine_unpack(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    mtc_state *st = _state(module);
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "unpack(arena, offset, nbytes, owner, layout, skeleton, target, background)");
        return NULL;
    }
    ArenaObject *ao = (ArenaObject *)args[0];
    mtc_arena *a = _arena_of(st, args[0]);
    if (!a) return NULL;
    unsigned long long off = PyLong_AsUnsignedLongLong(args[1]);
    long long nbytes = PyLong_AsLongLong(args[2]);
    unsigned long owner = PyLong_AsUnsignedLong(args[3]);
    int target = (int)PyLong_AsLong(args[6]);
    int background = PyObject_IsTrue(args[7]);
    if (PyErr_Occurred()) return NULL;
    if (!PyBytes_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "mtc_loader: a packed batch's layout must be bytes");
        return NULL;
    }
    if (nbytes < 0 || mtc_arena_check(a, off, (uint64_t)(nbytes ? nbytes : 1), (uint32_t)owner)) {
        PyErr_SetString(PyExc_ValueError, "mtc_loader: a packed batch names a region outside this process's "
                        "part of the arena (a stale or forged descriptor)");
        return NULL;
    }
    mtc_layout L;
    int rc = mtc_layout_decode((const uint8_t *)PyBytes_AS_STRING(args[4]), (size_t)PyBytes_GET_SIZE(args[4]),
                               st->elsize, st->ndtypes, (uint64_t)nbytes + MTC_LAYOUT_MAX_ALIGN, &L);
    if (rc || (L.nleaves && L.plan.chunks[0].payload != nbytes)) {
        if (!rc) mtc_layout_free(&L);
        /* the batch is consumed: its region goes back, or nobody would free it */
        mtc_arena_free(a, off, (uint32_t)owner);
        PyErr_SetString(PyExc_ValueError, "mtc_loader: a packed batch's layout is malformed or does not "
                        "match its region (a corrupt or forged descriptor)");
        return NULL;
    }
    Handle *h = PyObject_New(Handle, st->handle_type);
    if (!h) {
        mtc_layout_free(&L);
        mtc_arena_free(a, off, (uint32_t)owner);
        return NULL;
    }
    Py_INCREF(st->handle_type);
    h->st = st;
    h->job = NULL;
    memset(&h->tree, 0, sizeof h->tree);
    h->result = h->error = NULL;
    h->finished = 0;
    h->keep = NULL;
    PyObject **outputs = NULL, *chunk = NULL, *dev_obj = NULL;
    mtc_job *job = NULL;
    int region_owned = 1; /* freed here on error, unless handed to a DMA callback */
    mtc_tree *t = &h->tree;
    t->slots = 1;
    if (mtc_traverse(st, args[5], t)) goto error;
    if (t->nslots != L.nleaves || t->nleaves) {
        PyErr_SetString(PyExc_ValueError, "mtc_loader: a packed batch's skeleton does not match its layout");
        goto error;
    }
    int64_t align = L.nleaves ? L.plan.chunks[0].align : 1, payload = nbytes;
    if (target >= 0) {
        if ((rc = mtc_cuda_load()) || (rc = mtc_cuda_set_device(target))) goto cuda_error;
        if (ao->registered_dev < 0) {
            /* page-lock the whole arena once: DMAs then read it in place */
            rc = MTC_CUDA_ERR(mtc_cu.cuMemHostRegister(a->base, a->bytes, MTC_CU_MEMHOSTREGISTER_PORTABLE));
            if (rc == MTC_CUDA_ERR(0)) rc = 0;
            if (rc) goto cuda_error;
            ao->registered_dev = target;
        }
    }
    if (!(dev_obj = _device_obj(st, target))) goto error;
    PyObject *shape = Py_BuildValue("(L)", (long long)(payload + align - 1));
    if (!shape) goto error;
    chunk = _empty(st, shape, st->uint8, dev_obj, 0);
    Py_DECREF(shape);
    if (!chunk) goto error;
    uintptr_t ptr;
    if (_data_ptr(st, chunk, &ptr)) goto error;
    Py_ssize_t skip = (Py_ssize_t)((align - (int64_t)(ptr % (uintptr_t)align)) % align);
    if (target < 0) {
        /* CPU: copy out of the arena (never a view of memory that is reused) */
        Py_BEGIN_ALLOW_THREADS
        mtc_memcpy_parallel((void *)(ptr + (uintptr_t)skip), a->base + off, (size_t)payload);
        Py_END_ALLOW_THREADS
        mtc_arena_free(a, off, (uint32_t)getpid());
        region_owned = 0;
    } else {
        if (!(job = mtc_job_new(1, 1))) {
            PyErr_NoMemory();
            goto error;
        }
        _region_ref *ref = malloc(sizeof *ref);
        if (!ref) {
            PyErr_NoMemory();
            goto error;
        }
        mtc_arena_ref(a);
        ref->a = a;
        ref->off = off;
        ref->owner = (uint32_t)getpid();
        job->target = target;
        job->staging = 0;
        job->dev_mask = 1ull << target;
        job->ops[0] = (mtc_op){.kind = MTC_OP_H2D_REGION, .dev = target, .dst = 0, .nbytes = payload,
                               .first = 0, .count = 1, .after = _region_done, .after_arg = ref};
        job->items[0] = (mtc_item){.src = (uintptr_t)(a->base + off), .dst = ptr + (uintptr_t)skip,
                                   .nbytes = payload, .dev = -1, .leaf = -1};
        job->nops = job->nitems = 1;
        region_owned = 0; /* the job's op frees it, whatever happens */
        if (_capture_streams(st, job)) {
            _region_done(ref);
            goto error;
        }
        if (background && (rc = mtc_job_submit(job)) == 0) {
        } else {
            Py_BEGIN_ALLOW_THREADS
            mtc_job_run(job);
            Py_END_ALLOW_THREADS
        }
        h->job = job;
        job = NULL;
    }
    outputs = PyMem_Calloc(L.nleaves ? L.nleaves : 1, sizeof *outputs);
    if (!outputs) {
        PyErr_NoMemory();
        goto error;
    }
    mtc_tree lt;
    memset(&lt, 0, sizeof lt);
    lt.leaves = L.leaves;
    lt.shape = L.shape;
    PyObject *chunks[1] = {chunk};
    if (_make_views(st, &lt, &L.plan, chunks, &skip, outputs)) goto error;
    if (!(h->result = mtc_rebuild(st, t, outputs))) goto error;
    for (uint32_t i = 0; i < L.nleaves; i++) Py_XDECREF(outputs[i]);
    PyMem_Free(outputs);
    Py_XDECREF(chunk);
    Py_XDECREF(dev_obj);
    mtc_layout_free(&L);
    if (!h->job) _handle_finish(h);
    return (PyObject *)h;

cuda_error: {
        char desc[256];
        mtc_cuda_describe(rc, desc, sizeof desc);
        PyErr_Format(PyExc_RuntimeError, "mtc_loader: copying a packed batch to cuda:%d needs CUDA: %s", target, desc);
    }
error:
    if (region_owned) mtc_arena_free(a, off, (uint32_t)getpid());
    if (job) mtc_job_release(job);
    if (outputs)
        for (uint32_t i = 0; i < L.nleaves; i++) Py_XDECREF(outputs[i]);
    PyMem_Free(outputs);
    Py_XDECREF(chunk);
    Py_XDECREF(dev_obj);
    mtc_layout_free(&L);
    Py_DECREF(h);
    return NULL;
}

/* ---------------------------------------------------------------- _setup */

static int _take(PyObject *cfg, const char *name, PyObject **slot)
{
    PyObject *v = PyDict_GetItemString(cfg, name); /* borrowed */
    if (!v) {
        PyErr_Format(PyExc_KeyError, "_setup: missing %s", name);
        return -1;
    }
    Py_XSETREF(*slot, Py_NewRef(v));
    return 0;
}

/* _setup(cfg: dict): receives torch objects and the Python helpers. */
static PyObject *engine_setup(PyObject *module, PyObject *cfg)
{
    mtc_state *st = _state(module);
    if (!PyDict_Check(cfg)) {
        PyErr_SetString(PyExc_TypeError, "_setup(cfg: dict)");
        return NULL;
    }
    if (_take(cfg, "tensor_type", &st->tensor_type) || _take(cfg, "empty", &st->torch_empty) ||
        _take(cfg, "from_numpy", &st->from_numpy) || _take(cfg, "raw_stream", &st->raw_stream) ||
        _take(cfg, "uint8", &st->uint8) || _take(cfg, "device_cpu", &st->device_cpu) ||
        _take(cfg, "classify", &st->classify) || _take(cfg, "flatten", &st->flatten) ||
        _take(cfg, "unflatten", &st->unflatten) || _take(cfg, "diagnose", &st->diagnose) ||
        _take(cfg, "cuda_device", &st->cuda_device) || _take(cfg, "d_dtype", &st->d_dtype) ||
        _take(cfg, "d_shape", &st->d_shape) || _take(cfg, "d_is_cuda", &st->d_is_cuda) ||
        _take(cfg, "m_data_ptr", &st->m_data_ptr) || _take(cfg, "m_get_device", &st->m_get_device) ||
        _take(cfg, "m_is_contiguous", &st->m_is_contiguous) || _take(cfg, "m_stride", &st->m_stride) ||
        _take(cfg, "m_is_neg", &st->m_is_neg) || _take(cfg, "m_is_conj", &st->m_is_conj) ||
        _take(cfg, "leaf_slot", &st->leaf_slot))
        return NULL;
    if (!Py_TYPE(st->d_dtype)->tp_descr_get || !Py_TYPE(st->d_shape)->tp_descr_get ||
        !Py_TYPE(st->d_is_cuda)->tp_descr_get) {
        PyErr_SetString(PyExc_TypeError, "_setup: tensor attributes are not descriptors");
        return NULL;
    }
    /* dtypes: list of (torch.dtype, itemsize, flags); numpy: {type_num: code} */
    PyObject *dts = PyDict_GetItemString(cfg, "dtypes"), *np = PyDict_GetItemString(cfg, "numpy");
    if (!dts || !PyList_Check(dts) || PyList_GET_SIZE(dts) > MTC_MAX_DTYPES || !np || !PyDict_Check(np)) {
        PyErr_SetString(PyExc_TypeError, "_setup: bad dtypes/numpy tables");
        return NULL;
    }
    Py_XSETREF(st->dtype_codes, PyDict_New());
    if (!st->dtype_codes) return NULL;
    st->ndtypes = (int)PyList_GET_SIZE(dts);
    for (int c = 0; c < st->ndtypes; c++) {
        PyObject *dt;
        int size, flags;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(dts, c), "Oii", &dt, &size, &flags)) return NULL;
        Py_XSETREF(st->dtypes[c], Py_NewRef(dt));
        st->elsize[c] = size;
        st->dtflags[c] = flags;
        PyObject *code = PyLong_FromLong(c);
        if (!code || PyDict_SetItem(st->dtype_codes, dt, code)) {
            Py_XDECREF(code);
            return NULL;
        }
        Py_DECREF(code);
    }
    for (int i = 0; i < 32; i++) st->np_to_code[i] = -1, st->np_zerocopy[i] = 0;
    PyObject *zc = PyDict_GetItemString(cfg, "numpy_zero_copy");
    if (!zc || !PyList_Check(zc)) {
        PyErr_SetString(PyExc_TypeError, "_setup: bad numpy_zero_copy list");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(zc); i++) {
        long tn = PyLong_AsLong(PyList_GET_ITEM(zc, i));
        if (tn >= 0 && tn < 32) st->np_zerocopy[tn] = 1;
    }
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    while (PyDict_Next(np, &pos, &k, &v)) {
        long tn = PyLong_AsLong(k), code = PyLong_AsLong(v);
        if (PyErr_Occurred()) return NULL;
        if (tn >= 0 && tn < 32 && code >= 0 && code < st->ndtypes) st->np_to_code[tn] = (int)code;
    }
    Py_XSETREF(st->type_cache, PyDict_New());
    if (!st->type_cache) return NULL;
    st->ready = 1;
    Py_RETURN_NONE;
}

/* ----------------------------------------------------------------- stats */

static int _put(PyObject *d, const char *k, unsigned long long v)
{
    PyObject *o = PyLong_FromUnsignedLongLong(v);
    if (!o) return -1;
    int rc = PyDict_SetItemString(d, k, o);
    Py_DECREF(o);
    return rc;
}

static PyObject *engine_stats(PyObject *module, PyObject *unused)
{
    mtc_engine_stats e;
    mtc_engine_get_stats(&e);
    PyObject *d = PyDict_New();
    if (!d) return NULL;
#define P(name, v) if (_put(d, name, (unsigned long long)(v))) goto error
    P("calls", _cnt.calls); P("leaves", _cnt.leaves); P("tensors_packed", _cnt.packed);
    P("tensors_reused", _cnt.reused); P("numpy_zero_copy", _cnt.from_numpy);
    P("host_copies", _cnt.host_copies); P("tensors_staged", _cnt.staged);
    P("tensors_direct", _cnt.direct); P("tensors_d2h", _cnt.d2h); P("tensors_d2d", _cnt.d2d);
    P("made_contiguous", _cnt.made_contiguous); P("segments", _cnt.segments);
    P("chunks", _cnt.chunks);
    P("ns_traverse", _cnt.ns_traverse); P("ns_plan", _cnt.ns_plan);
    P("ns_outputs", _cnt.ns_outputs); P("ns_views", _cnt.ns_views); P("ns_get_wait", _cnt.ns_wait);
    P("jobs_submitted", e.jobs_submitted); P("jobs_done", e.jobs_done);
    P("jobs_failed", e.jobs_failed); P("jobs_inline", e.jobs_inline);
    P("jobs_in_flight", e.jobs_submitted + e.jobs_inline - e.jobs_done);
    P("items_copied", e.items_copied); P("bytes_h2d", e.bytes_h2d); P("bytes_d2h", e.bytes_d2h);
    P("bytes_d2d", e.bytes_d2d); P("bytes_host_copy", e.bytes_host); P("dma_calls", e.dma_calls);
    P("chunks_copied", e.chunks); P("pieces", e.pieces); P("ring_full_waits", e.ring_full_waits);
    P("worker_wakeups", e.worker_wakeups); P("ns_stage", e.ns_stage);
    P("ns_dma_issue", e.ns_dma_issue); P("ns_sync", e.ns_sync); P("ns_queue", e.ns_queue);
    P("transfer_threads", e.threads); P("batch_memcpy_calls", e.batch_calls);
    P("batch_memcpy_fallbacks", e.batch_fallbacks); P("helper_threads", mtc_pool_size());
    P("pinned_cap_bytes", mtc_engine_pinned_cap());
    mtc_slab_stats tot;
    memset(&tot, 0, sizeof tot);
    for (int dv = 0; dv < MTC_MAX_DEVICES; dv++) {
        mtc_slab_stats s;
        if (mtc_engine_slab_stats(dv, &s)) continue;
        tot.bytes_held += s.bytes_held; tot.bytes_in_use += s.bytes_in_use;
        tot.bytes_high_water += s.bytes_high_water; tot.slabs_held += s.slabs_held;
        tot.slabs_in_use += s.slabs_in_use; tot.allocs += s.allocs; tot.reuses += s.reuses;
        tot.waits += s.waits; tot.evictions += s.evictions;
    }
    P("pinned_bytes_held", tot.bytes_held); P("pinned_bytes_in_use", tot.bytes_in_use);
    P("pinned_high_water", tot.bytes_high_water); P("pinned_slabs_held", tot.slabs_held);
    P("pinned_slabs_in_use", tot.slabs_in_use); P("pinned_allocs", tot.allocs);
    P("pinned_reuses", tot.reuses); P("pinned_waits", tot.waits); P("pinned_evictions", tot.evictions);
#undef P
    return d;
error:
    Py_DECREF(d);
    return NULL;
}

static PyObject *engine_set_pinned_cap(PyObject *module, PyObject *arg)
{
    long long v = PyLong_AsLongLong(arg);
    if (v == -1 && PyErr_Occurred()) return NULL;
    if (v <= 0) {
        PyErr_SetString(PyExc_ValueError, "pinned_cap_bytes must be positive");
        return NULL;
    }
    mtc_engine_set_pinned_cap((size_t)v);
    Py_RETURN_NONE;
}

static PyObject *engine_trim(PyObject *module, PyObject *unused)
{
    size_t n;
    Py_BEGIN_ALLOW_THREADS
    n = mtc_engine_trim();
    Py_END_ALLOW_THREADS
    return PyLong_FromSize_t(n);
}

static PyObject *engine_shutdown(PyObject *module, PyObject *unused)
{
    Py_BEGIN_ALLOW_THREADS
    mtc_engine_shutdown();
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *engine_cuda_available(PyObject *module, PyObject *unused)
{
    int n = mtc_cuda_device_count();
    return PyLong_FromLong(n < 0 ? 0 : n);
}

/* ---------------------------------------------------------------- module */

static PyMethodDef engine_methods[] = {
    {"_setup", engine_setup, METH_O, "Hand the engine the torch objects and helpers it uses."},
    {"start_copy", (PyCFunction)(void (*)(void))engine_start_copy, METH_FASTCALL,
     "start_copy(data, target, staging, pack, align, max_chunk, background) -> Handle"},
    {"stats", engine_stats, METH_NOARGS, "Engine counters as a dict."},
    {"set_pinned_cap", engine_set_pinned_cap, METH_O, "Cap on pinned staging bytes per device."},
    {"trim", engine_trim, METH_NOARGS, "Free idle pinned slabs; returns bytes freed."},
    {"shutdown", engine_shutdown, METH_NOARGS, "Stop the engine's threads (interpreter exit)."},
    {"cuda_device_count", engine_cuda_available, METH_NOARGS, "Devices the CUDA driver sees (0 without one)."},
    {"arena_create", engine_arena_create, METH_O, "arena_create(nbytes) -> Arena (memfd, sealed)"},
    {"arena_attach", engine_arena_attach, METH_O, "arena_attach(fd) -> Arena"},
    {"pack", (PyCFunction)(void (*)(void))engine_pack, METH_FASTCALL,
     "pack(arena, data, align, timeout_s) -> (offset, nbytes, layout, skeleton)"},
    {"unpack", (PyCFunction)(void (*)(void))engine_unpack, METH_FASTCALL,
     "unpack(arena, offset, nbytes, owner, layout, skeleton, target, background) -> Handle"},
    {NULL, NULL, 0, NULL},
};

static int engine_exec(PyObject *module)
{
    if (_import_array() < 0) return -1;
    mtc_state *st = _state(module);
    st->handle_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &Handle_spec, NULL);
    if (!st->handle_type) return -1;
    st->arena_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &Arena_spec, NULL);
    if (!st->arena_type) return -1;
#define INTERN(field, s) if (!(st->field = PyUnicode_InternFromString(s))) return -1
    INTERN(s_data_ptr, "data_ptr"); INTERN(s_dtype, "dtype"); INTERN(s_shape, "shape");
    INTERN(s_stride, "stride"); INTERN(s_get_device, "get_device"); INTERN(s_is_cuda, "is_cuda");
    INTERN(s_is_neg, "is_neg"); INTERN(s_is_conj, "is_conj"); INTERN(s_contiguous, "contiguous"); INTERN(s_is_contiguous, "is_contiguous");
    INTERN(s_split_with_sizes, "unsafe_split_with_sizes"); INTERN(s_view, "view");
    INTERN(s_as_strided, "as_strided"); INTERN(s_unbind, "unbind"); INTERN(s_is_meta, "is_meta"); INTERN(s_device, "device");
    INTERN(s_pin_memory, "pin_memory"); INTERN(s_resolve, "resolve_conj");
#undef INTERN
    st->kw_dtype_device = Py_BuildValue("(ss)", "dtype", "device");
    st->kw_dtype_device_pin = Py_BuildValue("(sss)", "dtype", "device", "pin_memory");
    if (!st->kw_dtype_device || !st->kw_dtype_device_pin) return -1;
    mtc_engine_init_once();
    return PyModule_AddObjectRef(module, "Handle", (PyObject *)st->handle_type);
}

static int engine_traverse(PyObject *module, visitproc visit, void *arg)
{
    mtc_state *st = _state(module);
    Py_VISIT(st->handle_type);
    Py_VISIT(st->arena_type);
    Py_VISIT(st->leaf_slot);
    Py_VISIT(st->tensor_type);
    Py_VISIT(st->torch_empty);
    Py_VISIT(st->from_numpy);
    Py_VISIT(st->raw_stream);
    Py_VISIT(st->type_cache);
    Py_VISIT(st->classify);
    Py_VISIT(st->flatten);
    Py_VISIT(st->unflatten);
    Py_VISIT(st->diagnose);
    Py_VISIT(st->cuda_device);
    return 0;
}

static int engine_clear(PyObject *module)
{
    mtc_state *st = _state(module);
    Py_CLEAR(st->handle_type);
    Py_CLEAR(st->arena_type);
    Py_CLEAR(st->leaf_slot);
    Py_CLEAR(st->tensor_type);
    Py_CLEAR(st->torch_empty);
    Py_CLEAR(st->from_numpy);
    Py_CLEAR(st->raw_stream);
    Py_CLEAR(st->uint8);
    Py_CLEAR(st->device_cpu);
    Py_CLEAR(st->dtype_codes);
    for (int i = 0; i < MTC_MAX_DTYPES; i++) Py_CLEAR(st->dtypes[i]);
    Py_CLEAR(st->type_cache);
    Py_CLEAR(st->classify);
    Py_CLEAR(st->flatten);
    Py_CLEAR(st->unflatten);
    Py_CLEAR(st->diagnose);
    Py_CLEAR(st->cuda_device);
    Py_CLEAR(st->pinned_empty);
    Py_CLEAR(st->s_data_ptr); Py_CLEAR(st->s_dtype); Py_CLEAR(st->s_shape); Py_CLEAR(st->s_stride);
    Py_CLEAR(st->s_get_device); Py_CLEAR(st->s_is_cuda); Py_CLEAR(st->s_is_neg); Py_CLEAR(st->s_is_conj);
    Py_CLEAR(st->s_contiguous); Py_CLEAR(st->s_is_contiguous);
    Py_CLEAR(st->d_dtype); Py_CLEAR(st->d_shape); Py_CLEAR(st->d_is_cuda); Py_CLEAR(st->m_data_ptr);
    Py_CLEAR(st->m_get_device); Py_CLEAR(st->m_is_contiguous); Py_CLEAR(st->m_stride);
    Py_CLEAR(st->m_is_neg); Py_CLEAR(st->m_is_conj); Py_CLEAR(st->s_split_with_sizes); Py_CLEAR(st->s_view);
    Py_CLEAR(st->s_as_strided); Py_CLEAR(st->s_unbind); Py_CLEAR(st->s_is_meta); Py_CLEAR(st->s_device);
    Py_CLEAR(st->s_pin_memory); Py_CLEAR(st->s_resolve);
    Py_CLEAR(st->kw_dtype_device);
    Py_CLEAR(st->kw_dtype_device_pin);
    st->ready = 0;
    return 0;
}

static void engine_free(void *module) { engine_clear((PyObject *)module); }

static PyModuleDef_Slot engine_slots[] = {
    {Py_mod_exec, engine_exec},
    {0, NULL},
};

static struct PyModuleDef engine_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "mtc_loader._engine",
    .m_doc = "The C engine of mtc_loader.",
    .m_size = sizeof(mtc_state),
    .m_methods = engine_methods,
    .m_slots = engine_slots,
    .m_traverse = engine_traverse,
    .m_clear = engine_clear,
    .m_free = engine_free,
};

PyMODINIT_FUNC PyInit__engine(void) { return PyModuleDef_Init(&engine_def); }
