/*
 * handle.c - the engine side of AsyncCopyHandle (mtc_loader/handle.py): one
 * copy in flight, its inputs and skeleton kept alive until the job completes,
 * and its result or error. See handle.h.
 */
#include "handle.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "cuda.h"
#include "files.h"
#include "hostcopy.h"

/* Releases inputs once the job completed; sets h->error for a failed job.
 * Precondition: the job completed (or there is none). */
void mtc_handle_finish(mtc_handle *h)
{
    if (h->finished) return;
    h->finished = 1;
    if (h->job && h->job->err && h->job->err_leaf >= 0 && (uint32_t)h->job->err_leaf < h->tree.nleaves &&
        (h->tree.leaves[h->job->err_leaf].flags & MTC_LEAF_FILE)) {
        /* a failed file read: the exception names the file and the leaf */
        mtc_job *j = h->job;
        if (!(h->error = mtc_files_error(&h->tree, (uint32_t)j->err_leaf, j->err_part, j->err, j->err_got)))
            PyErr_Clear();
        Py_CLEAR(h->result);
    } else if (h->job && h->job->err) {
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
}

/* Waits for the job with the GIL released, in slices, so that a signal
 * (Ctrl-C) interrupts the wait. 0, or -1 with the signal's exception set;
 * the copy itself goes on and a later get() can still collect it. */
static int _handle_wait(mtc_handle *h)
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
            mtc_cnt.ns_wait += (uint64_t)(mtc_now_ns() - t0);
            return -1;
        }
    }
    mtc_cnt.ns_wait += (uint64_t)(mtc_now_ns() - t0);
    return 0;
}

static PyObject *Handle_ready(mtc_handle *h, PyObject *unused)
{
    return PyBool_FromLong(!h->job || mtc_job_complete(h->job));
}

static PyObject *Handle_get(mtc_handle *h, PyObject *unused)
{
    if (_handle_wait(h)) return NULL;
    mtc_handle_finish(h);
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

/* The device tensors that hold the outputs (one per packed chunk, one per
 * own output on the target GPU): what a consumer on another stream records
 * with Tensor.record_stream. A new list (empty for a CPU target). */
static PyObject *Handle_buffers(mtc_handle *h, PyObject *unused)
{
    return h->buffers ? PyList_GetSlice(h->buffers, 0, PyList_GET_SIZE(h->buffers)) : PyList_New(0);
}

static void Handle_dealloc(mtc_handle *h)
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
    mtc_handle_finish(h);
    PyErr_Restore(exc_type, exc, tb);
    Py_CLEAR(h->result);
    Py_CLEAR(h->error);
    Py_CLEAR(h->buffers);
    tp->tp_free((PyObject *)h);
    Py_DECREF(tp);
}

static PyMethodDef Handle_methods[] = {
    {"ready", (PyCFunction)Handle_ready, METH_NOARGS, "True when get() would return without blocking."},
    {"get", (PyCFunction)Handle_get, METH_NOARGS, "Wait for the copy and return the copied structure."},
    {"buffers", (PyCFunction)Handle_buffers, METH_NOARGS, "The device tensors the outputs live in."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot Handle_slots[] = {
    {Py_tp_dealloc, Handle_dealloc},
    {Py_tp_methods, Handle_methods},
    {Py_tp_doc, "Engine-side handle of one start_copy (wrapped by mtc_loader.AsyncCopyHandle)."},
    {0, NULL},
};

PyType_Spec mtc_handle_spec = {
    .name = "mtc_loader._engine.mtc_handle",
    .basicsize = sizeof(mtc_handle),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = Handle_slots,
};

mtc_handle *mtc_handle_new(mtc_state *st)
{
    mtc_handle *h = PyObject_New(mtc_handle, st->handle_type);
    if (!h) return NULL;
    Py_INCREF(st->handle_type); /* heap type instances own their type */
    h->st = st;
    h->job = NULL;
    memset(&h->tree, 0, sizeof h->tree);
    h->result = NULL;
    h->error = NULL;
    h->finished = 0;
    h->buffers = NULL;
    return h;
}
