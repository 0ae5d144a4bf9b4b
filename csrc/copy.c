/*
 * copy.c - the start_copy pipeline on the calling thread (GIL held): read the
 * leaves (traverse) -> plan -> allocate outputs (torch.empty, one uint8 buffer
 * per chunk) -> build the job and submit it to the transfer thread -> create
 * output views and rebuild the structure while the transfer thread stages ->
 * return the handle. get() (handle.c) waits with the GIL released.
 */
#define NO_IMPORT_ARRAY
#define PY_ARRAY_UNIQUE_SYMBOL mtc_ARRAY_API
#include "copy.h"

#include <numpy/arrayobject.h>
#include <errno.h>
#include <string.h>

#include "cuda.h"
#include "handle.h"
#include "outputs.h"

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

void mtc_item_of_leaf(mtc_item *it, const mtc_tree *t, uint32_t i, uintptr_t dst)
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
}

PyObject *mtc_copy_start(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    mtc_state *st = mtc_get_state(module);
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

    mtc_handle *h = mtc_handle_new(st);
    if (!h) return NULL;

    mtc_plan plan;
    memset(&plan, 0, sizeof plan);
    PyObject **outputs = NULL, **chunk_t = NULL, *dev_obj = NULL;
    uintptr_t *chunk_base = NULL;
    Py_ssize_t *chunk_skip = NULL;
    mtc_tree *t = &h->tree;
    mtc_job *job = NULL;

    int64_t t0 = mtc_now_ns();
    if (mtc_traverse(st, data, t)) goto error;
    int64_t t1 = mtc_now_ns();
    mtc_cnt.ns_traverse += (uint64_t)(t1 - t0);
    mtc_cnt.calls++;
    mtc_cnt.leaves += t->nleaves;

    int rc = mtc_plan_build(&plan, t->leaves, t->nleaves, t->shape, &o);
    if (rc == 0 && plan.need_contig) {
        int n = _make_contiguous(st, t, &plan);
        if (n < 0) goto error;
        mtc_cnt.made_contiguous += (uint64_t)n;
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
    mtc_cnt.ns_plan += (uint64_t)(t2 - t1);
    mtc_cnt.packed += plan.count[MTC_ACT_PACK];
    mtc_cnt.reused += plan.count[MTC_ACT_REUSE];
    mtc_cnt.from_numpy += plan.count[MTC_ACT_FROM_NUMPY];
    mtc_cnt.host_copies += plan.count[MTC_ACT_HOST_COPY];
    mtc_cnt.staged += plan.count[MTC_ACT_H2D_STAGED];
    mtc_cnt.direct += plan.count[MTC_ACT_H2D_DIRECT];
    mtc_cnt.d2h += plan.count[MTC_ACT_D2H];
    mtc_cnt.d2d += plan.count[MTC_ACT_D2D];
    mtc_cnt.segments += plan.nsegs;
    mtc_cnt.chunks += plan.nchunks;

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
        if (dev_mask && mtc_out_capture_streams(st, job)) goto error;
    }
    if (!(dev_obj = mtc_out_device(st, o.target))) goto error;
    int pin_chunks = o.target < 0; /* D2H packing writes into pinned host chunks */
    for (uint32_t c = 0; c < plan.nchunks; c++) {
        int64_t align = plan.chunks[c].align, bytes = plan.chunks[c].payload + align - 1;
        PyObject *shape = Py_BuildValue("(L)", (long long)bytes);
        if (!shape) goto error;
        chunk_t[c] = mtc_out_empty(st, shape, st->uint8, pin_chunks ? st->device_cpu : dev_obj, pin_chunks);
        Py_DECREF(shape);
        if (!chunk_t[c]) goto error;
        uintptr_t ptr;
        if (mtc_out_data_ptr(st, chunk_t[c], &ptr)) goto error;
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
                mtc_item_of_leaf(&job->items[ii++], t, li, (uintptr_t)mtc_plan_leaf_offset(&plan, &t->leaves[li]));
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
            PyObject *shape = mtc_out_shape(t, l, 0);
            if (!shape) goto error;
            int pin = l->action == MTC_ACT_D2H && o.staging;
            outputs[i] = mtc_out_empty(st, shape, st->dtypes[l->dtype], pin ? st->device_cpu : dev_obj, pin);
            Py_DECREF(shape);
            if (!outputs[i]) goto error;
            uintptr_t dst;
            if (mtc_out_data_ptr(st, outputs[i], &dst)) goto error;
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
            mtc_item_of_leaf(&job->items[ii++], t, i, dst);
            op->count++;
        }
    }
    if (job) {
        job->nops = oi;
        job->nitems = ii;
    }
    int64_t t3 = mtc_now_ns();
    mtc_cnt.ns_outputs += (uint64_t)(t3 - t2);

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
    if (mtc_out_views(st, t, &plan, chunk_t, chunk_skip, outputs)) goto error;
    if (!(h->result = mtc_rebuild(st, t, outputs))) goto error;
    mtc_cnt.ns_views += (uint64_t)(mtc_now_ns() - t3);

    for (uint32_t i = 0; i < t->nleaves; i++) Py_XDECREF(outputs[i]);
    for (uint32_t c = 0; c < plan.nchunks; c++) Py_XDECREF(chunk_t[c]);
    PyMem_Free(outputs);
    PyMem_Free(chunk_t);
    PyMem_Free(chunk_base);
    PyMem_Free(chunk_skip);
    Py_XDECREF(dev_obj);
    mtc_plan_free(&plan);
    if (!h->job) mtc_handle_finish(h); /* nothing in flight: release the inputs now */
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
