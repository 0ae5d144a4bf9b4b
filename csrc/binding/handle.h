/*
 * handle.h - the engine side of one copy in flight, wrapped in Python by
 * mtc_loader.handle.AsyncCopyHandle: the job, the inputs and skeleton it must
 * keep alive until the job completes, and the result (or the error every
 * get() raises).
 *
 * Created by the start_copy pipeline (copy.c) and by unpack (unpack.c);
 * get() waits for the job with the GIL released, in slices so that Ctrl-C
 * interrupts the wait. GIL held in every function here.
 */
#ifndef MTC_HANDLE_H
#define MTC_HANDLE_H

#include "state.h"
#include "transfer.h"
#include "traverse.h"

typedef struct mtc_handle {
    PyObject_HEAD
    mtc_state *st;
    mtc_job *job;        /* NULL: nothing to wait for */
    mtc_tree tree;       /* inputs and skeleton; cleared once the job completed */
    PyObject *result;    /* the rebuilt structure */
    int finished;        /* completion handled (inputs released, error reported) */
    int finishing;       /* mtc_handle_finish is running (it may run Python code) */
    unsigned long finishing_thread; /* ... on this thread (PyThread_get_thread_ident) */
    PyObject *error;     /* the exception of a failed copy, raised by every get() */
    PyObject *buffers;   /* list of the device tensors the outputs live in (chunks, own
                            outputs) for Tensor.record_stream, or NULL (CPU target) */
    PyObject *keep;      /* list of the temporary views made on the way to the outputs, or
                            NULL: handed to whoever drops them (Handle.temporaries) */
} mtc_handle;

/* The heap type's spec (module.c creates the type in its exec slot). */
extern PyType_Spec mtc_handle_spec;

/* A new, empty handle (no job, empty tree). New reference, or NULL with an
 * exception set. */
mtc_handle *mtc_handle_new(mtc_state *st);

/* 1 when copies started on the calling thread keep their temporary views in
 * h->keep (for Handle.temporaries); off unless the thread asked for it with
 * _engine.keep_temporaries(True). Off, a temporary is dropped as soon as it
 * has served, so that a copy keeps no more objects alive than its result. */
int mtc_handle_keeps(void);
/* _engine.keep_temporaries(flag) -> the previous setting, for the calling thread. */
PyObject *mtc_handle_keep_temporaries(PyObject *module, PyObject *flag);

/* Whether the calling thread is a prefetch service's (_engine.service_thread):
 * its copies skip the two rules that serve a caller waiting on its own call,
 * the early collection (collector.h) and staging small host -> device jobs on
 * the calling thread (copy.c), since on the service thread both run under the
 * GIL in the training thread's time, and its batches are handed over to die
 * young. */
int mtc_handle_on_service(void);

/* _engine.service_thread(flag) -> the previous setting: marks the calling
 * thread as a prefetch service's (the above, and it keeps its temporaries). */
PyObject *mtc_handle_service_thread(PyObject *module, PyObject *flag);

/* Releases the inputs once the job completed and turns a failed job into
 * h->error (naming the leaf), and a job orphaned by fork() into an error
 * saying so. Idempotent. Precondition: the job completed, or is orphaned,
 * or there is none. */
void mtc_handle_finish(mtc_handle *h);

#endif /* MTC_HANDLE_H */
