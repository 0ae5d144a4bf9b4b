/*
 * handle.c - the engine side of AsyncCopyHandle (mtc_loader/handle.py): one
 * copy in flight, its inputs and skeleton kept alive until the job completes,
 * and its result or error. See handle.h.
 */
#include "handle.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "cuda.h"
#include "files.h"
#include "hostcopy.h"
#include "pinned.h"

/* Releases inputs once the job completed; sets h->error for a failed job.
 * Precondition: the job completed (or there is none), or it is orphaned by a
 * fork (no thread of this process runs it: nothing reads the inputs).
 *
 * Building the error runs Python code (a dict key's repr, any allocation's
 * GC), which may let another thread into get() on this handle: `finishing`
 * tells it that the result and error are not settled yet (it waits for
 * `finished`, see _handle_settle), and nothing the other thread could free
 * is read after the Python code ran. */
void mtc_handle_finish(mtc_handle *h)
{
    if (h->finished || h->finishing) return;
    h->finishing = 1;
    h->finishing_thread = PyThread_get_thread_ident();
    PyObject *error = NULL;
    mtc_job *j = h->job;
    if (j && mtc_job_orphaned(j)) {
        PyObject *msg = PyUnicode_FromString(
            "mtc_loader: this copy was started before the process was forked, and no thread of this "
            "(child) process runs it: it never completes here. Start the copy again in the child");
        if (msg) {
            error = PyObject_CallOneArg(PyExc_RuntimeError, msg);
            Py_DECREF(msg);
        }
        if (!error) PyErr_Clear();
    } else if (j && j->err && j->err_leaf >= 0 && (uint32_t)j->err_leaf < h->tree.nleaves &&
               (h->tree.leaves[j->err_leaf].flags & MTC_LEAF_FILE)) {
        /* a failed file read: the exception names the file and the leaf */
        if (!(error = mtc_leaf_file_error(&h->tree, (uint32_t)j->err_leaf, j->err_part, j->err, j->err_got)))
            PyErr_Clear();
    } else if (j && j->err) {
        char desc[256];
        if (j->err == -E2BIG)
            snprintf(desc, sizeof desc, "a staging buffer would exceed the pinned-memory cap of %zu bytes; "
                     "raise it with mtc_loader.configure(pinned_cap_bytes=...) or lower max_packed_chunk_bytes",
                     mtc_pinned_cap());
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
            error = PyObject_CallOneArg(exc_type, msg);
            Py_DECREF(msg);
        }
        if (!error) PyErr_Clear();
    }
    /* settle first (no Python code runs from here to `finished`), then drop
     * what may run __del__ code */
    PyObject *result = NULL;
    if (j && (j->err || mtc_job_orphaned(j))) {
        result = h->result;
        h->result = NULL;
    }
    h->error = error;
    h->job = NULL;
    h->finished = 1;
    h->finishing = 0;
    if (j) {
        /* an orphaned job is the parent's: its engine reference is never
         * dropped here, so this only forgets it */
        mtc_job_release(j);
    }
    Py_XDECREF(result);
    mtc_tree_clear(&h->tree);
}

/* After the wait: makes sure the handle's outcome is settled, finishing it
 * here or waiting (GIL released) for the thread that is finishing it. 0, or
 * -1 with an exception (get() re-entered from the finishing code). */
static int _handle_settle(mtc_handle *h)
{
    while (!h->finished) {
        if (!h->finishing) {
            mtc_handle_finish(h);
            continue;
        }
        if (h->finishing_thread == PyThread_get_thread_ident()) {
            PyErr_SetString(PyExc_RuntimeError, "mtc_loader: get() was called on a handle from code that "
                            "runs while that handle is being finished (a __repr__ or __del__)");
            return -1;
        }
        Py_BEGIN_ALLOW_THREADS
        struct timespec ts = {0, 100000}; /* the finishing thread holds the GIL in bursts */
        nanosleep(&ts, NULL);
        Py_END_ALLOW_THREADS
    }
    return 0;
}

/* Waits for the job with the GIL released, in slices, so that a signal
 * (Ctrl-C) interrupts the wait. 0, or -1 with the signal's exception set;
 * the copy itself goes on and a later get() can still collect it.
 * Several threads may wait on one handle: each holds its own reference to the
 * job, as the first to finish drops the handle's (h->job becomes NULL). */
static int _handle_wait(mtc_handle *h)
{
    mtc_job *j = h->job;
    if (!j || mtc_job_complete(j) || mtc_job_orphaned(j)) return 0;
    mtc_job_ref(j);
    int64_t t0 = mtc_now_ns();
    int rc, ran;
    /* still queued (the transfer thread has not woken up yet): run it here */
    Py_BEGIN_ALLOW_THREADS
    ran = mtc_transfer_take_back(j);
    Py_END_ALLOW_THREADS
    (void)ran;
    for (;;) {
        Py_BEGIN_ALLOW_THREADS
        rc = mtc_job_wait(j, 100000000); /* 100 ms */
        Py_END_ALLOW_THREADS
        if (rc == 0) break;
        if (PyErr_CheckSignals()) {
            rc = -1;
            break;
        }
    }
    mtc_cnt.ns_wait += (uint64_t)(mtc_now_ns() - t0);
    mtc_job_release(j);
    return rc ? -1 : 0;
}

static PyObject *Handle_ready(mtc_handle *h, PyObject *unused)
{
    /* an orphaned job: get() raises at once */
    return PyBool_FromLong(!h->job || mtc_job_complete(h->job) || mtc_job_orphaned(h->job));
}

static PyObject *Handle_get(mtc_handle *h, PyObject *unused)
{
    if (_handle_wait(h) || _handle_settle(h)) return NULL;
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
    if (h->job && !mtc_job_complete(h->job) && !mtc_job_orphaned(h->job)) {
        /* Dropped without get(): the copy may still read the inputs this
         * handle keeps alive; wait for it (uninterruptibly) before freeing.
         * (An orphaned job never completes, and nothing runs it.) */
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
    Py_CLEAR(h->keep);
    tp->tp_free((PyObject *)h);
    Py_DECREF(tp);
}

/* temporaries() -> list: the temporary views made on the way to the outputs,
 * taken out of the handle (a second call returns an empty list; so does a
 * handle made on a thread that does not keep them, mtc_handle_keeps). Dropping a
 * tensor releases the GIL: the prefetch service hands them to the caller's
 * thread with the batch instead of dropping them itself. New reference. */
static PyObject *Handle_temporaries(mtc_handle *h, PyObject *unused)
{
    PyObject *k = h->keep;
    h->keep = NULL;
    return k ? k : PyList_New(0);
}

/* finish(device, stream) -> (result, temporaries, buffers, event): what the
 * prefetch service needs of a finished copy, in one call. Waits as get()
 * does (GIL released; raises the copy's error), then, for a CUDA device
 * (`device` >= 0), records a pooled driver event (mtc_cuda_event_record,
 * GIL held: it never blocks) on `stream`, the raw handle of the stream the
 * copy was started on; the caller gives the event back with
 * _engine.hand_out or _engine.event_release. temporaries: as
 * temporaries(); buffers: the device tensors the outputs live in, taken out
 * of the handle (empty for a CPU target); event: its raw handle, 0 for the
 * CPU. New reference, or NULL with an exception (no event is left
 * recorded then). */
static PyObject *Handle_finish(mtc_handle *h, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "mtc_loader: finish(device, stream) takes 2 arguments");
        return NULL;
    }
    long dev = PyLong_AsLong(args[0]);
    if (dev == -1 && PyErr_Occurred()) return NULL;
    uintptr_t stream = (uintptr_t)PyLong_AsVoidPtr(args[1]);
    if (PyErr_Occurred()) return NULL;
    if (dev < -1 || dev >= MTC_MAX_DEVICES) {
        PyErr_Format(PyExc_ValueError, "mtc_loader: finish needs a CUDA device index in [0, %d), or -1 for the "
                     "CPU, got %ld", MTC_MAX_DEVICES, dev);
        return NULL;
    }
    PyObject *result = Handle_get(h, NULL);
    if (!result) return NULL;
    PyObject *out = PyTuple_New(4);
    if (!out) {
        Py_DECREF(result);
        return NULL;
    }
    PyTuple_SET_ITEM(out, 0, result);
    PyObject *keep = Handle_temporaries(h, NULL), *buffers = NULL, *event = NULL;
    if (keep) PyTuple_SET_ITEM(out, 1, keep);
    if (dev >= 0 && h->buffers) {
        buffers = h->buffers;
        h->buffers = NULL;
    } else {
        buffers = PyList_New(0);
    }
    if (buffers) PyTuple_SET_ITEM(out, 2, buffers);
    if (!keep || !buffers) {
        Py_DECREF(out);
        return NULL;
    }
    uintptr_t ev = 0;
    if (dev >= 0) {
        int rc = mtc_cuda_event_record((int)dev, stream, &ev);
        if (rc) {
            char desc[256];
            mtc_cuda_describe(rc, desc, sizeof desc);
            PyErr_Format(PyExc_RuntimeError, "mtc_loader: recording a batch's event on its copy stream %zu of "
                         "cuda:%ld failed: %s", (size_t)stream, dev, desc);
            Py_DECREF(out);
            return NULL;
        }
    }
    if (!(event = PyLong_FromVoidPtr((void *)ev))) {
        mtc_cuda_event_release((int)dev, ev);
        Py_DECREF(out);
        return NULL;
    }
    PyTuple_SET_ITEM(out, 3, event);
    if (dev >= 0) mtc_cnt.side_finish_c++;
    return out;
}

static PyMethodDef Handle_methods[] = {
    {"ready", (PyCFunction)Handle_ready, METH_NOARGS, "True when get() would return without blocking."},
    {"get", (PyCFunction)Handle_get, METH_NOARGS, "Wait for the copy and return the copied structure."},
    {"buffers", (PyCFunction)Handle_buffers, METH_NOARGS, "The device tensors the outputs live in."},
    {"temporaries", (PyCFunction)Handle_temporaries, METH_NOARGS,
     "The temporary views made on the way to the outputs, taken out of the handle."},
    {"finish", (PyCFunction)(void (*)(void))Handle_finish, METH_FASTCALL,
     "finish(device, stream) -> (result, temporaries, buffers, event): get(), the outputs' buffers and "
     "temporaries taken out, and a pooled event recorded on the copy stream (device >= 0)."},
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

/* Per thread: the prefetch service's thread keeps its temporaries (dropping a
 * tensor releases the GIL, see Handle_temporaries); every other caller drops
 * them where they are made. */
static _Thread_local int _keeps;
static _Thread_local int _service;

int mtc_handle_keeps(void) { return _keeps; }

int mtc_handle_on_service(void) { return _service; }

PyObject *mtc_handle_service_thread(PyObject *module, PyObject *flag)
{
    (void)module;
    int v = PyObject_IsTrue(flag);
    if (v < 0) return NULL;
    int was = _service;
    _service = v;
    _keeps = v;
    return PyBool_FromLong(was);
}

PyObject *mtc_handle_keep_temporaries(PyObject *module, PyObject *flag)
{
    (void)module;
    int v = PyObject_IsTrue(flag);
    if (v < 0) return NULL;
    int was = _keeps;
    _keeps = v;
    return PyBool_FromLong(was);
}

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
    h->finishing = 0;
    h->finishing_thread = 0;
    h->buffers = NULL;
    h->keep = NULL;
    return h;
}
