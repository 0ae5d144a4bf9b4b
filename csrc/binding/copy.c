/*
 * copy.c - the start_copy pipeline on the calling thread (GIL held): read the
 * leaves (traverse) -> plan -> allocate outputs (torch.empty, one buffer per
 * dtype of each chunk) -> build the job and submit it to the transfer thread -> create
 * output views and rebuild the structure while the transfer thread stages ->
 * return the handle. get() (handle.c) waits with the GIL released.
 */
#define NO_IMPORT_ARRAY
#define PY_ARRAY_UNIQUE_SYMBOL mtc_ARRAY_API
#include "copy.h"
#include "env.h"

#include <numpy/arrayobject.h>
#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "collector.h"
#include "cuda.h"
#include "handle.h"
#include "hostcopy.h"
#include "leaves.h"
#include "buffers.h"
#include "outputs.h"
#include "nvtx.h"

/* A numpy array in torch's layout for it: a new array with the output
 * strides of leaf i (MTC_LEAF_STRIDED, not a block), gathered here. New
 * reference, or NULL with an exception. */
static PyObject *_numpy_dense(const mtc_tree *t, uint32_t i)
{
    const mtc_leaf *l = &t->leaves[i];
    PyArrayObject *a = (PyArrayObject *)t->objs[i];
    npy_intp dims[NPY_MAXDIMS], strides[NPY_MAXDIMS];
    if (l->ndim > NPY_MAXDIMS) return PyErr_SetString(PyExc_SystemError, "mtc_loader: numpy ndim"), NULL;
    for (int32_t d = 0; d < l->ndim; d++) {
        dims[d] = (npy_intp)t->shape[l->dims + d];
        strides[d] = (npy_intp)(t->ostrides[l->dims + d] * l->elsize);
    }
    PyArray_Descr *descr = PyArray_DESCR(a);
    Py_INCREF(descr);
    PyObject *c = PyArray_NewFromDescr(&PyArray_Type, descr, l->ndim, dims, strides, NULL, 0, NULL);
    if (!c) return NULL;
    mtc_copy_strided_to(PyArray_DATA((PyArrayObject *)c), &t->ostrides[l->dims], (const void *)l->data, l->ndim,
                        &t->shape[l->dims], &t->strides[l->dims], l->elsize);
    return c;
}

/* Replaces leaves that need their bytes in one block (a DMA or a plain copy
 * reads them) by dense copies in the layout tensor.to() gives them:
 * tensor.clone() (preserve_format: dense strides in the order of the
 * tensor's own), for numpy the same layout (_numpy_dense) or a row-major
 * copy where torch cannot hold the array's strides. Returns how many. */
static int _make_contiguous(mtc_state *st, mtc_tree *t, const mtc_plan *p)
{
    int n = 0;
    for (uint32_t i = 0; i < t->nleaves; i++) {
        if (!t->leaves[i].needs_contig) continue;
        PyObject *old = t->objs[i], *c;
        if (!(t->leaves[i].flags & MTC_LEAF_NUMPY))
            c = PyObject_CallMethod(old, "clone", NULL);
        else if (t->leaves[i].flags & MTC_LEAF_STRIDED)
            c = _numpy_dense(t, i);
        else
            c = (PyObject *)PyArray_GETCONTIGUOUS((PyArrayObject *)old);
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
    it->file = (l->flags & MTC_LEAF_FILE) ? (const void *)l->data : NULL;
    it->dst_strides = NULL;
    if (l->flags & MTC_LEAF_BLOCK) { /* one block, laid out as the output */
        it->shape = it->strides = NULL;
    } else {
        it->shape = &t->shape[l->dims];
        it->strides = &t->strides[l->dims];
        /* gathered in the order of the output's strides */
        if (l->flags & MTC_LEAF_STRIDED) it->dst_strides = &t->ostrides[l->dims];
    }
}

/* The state of one start_copy between its stages. Owns everything it points
 * to; _copy_clear releases what is left. */
typedef struct {
    mtc_state *st;
    mtc_plan_opts o;
    int background;
    mtc_tree *t;            /* the handle's tree (owned by the handle) */
    mtc_plan plan;
    PyObject **outputs;     /* new references, one per leaf */
    mtc_group *groups;      /* the plan's storage groups (outputs.h) */
    uint32_t ngroups;
    PyObject **group_t;     /* the tensor of each group */
    PyObject *dev_obj;      /* torch.device of the target */
    PyObject *proto;        /* a tensor whose new_empty_strided makes strided outputs, or NULL */
    mtc_job *job;           /* NULL when nothing needs copying, or once submitted */
    uint32_t oi, ii;        /* ops and items filled so far */
    int keep_numpy;         /* numpy arrays pass through as the same object (the prefetch service) */
} _copy;

static void _copy_clear(_copy *c)
{
    if (c->job) mtc_job_release(c->job);
    if (c->outputs)
        for (uint32_t i = 0; i < c->t->nleaves; i++) Py_XDECREF(c->outputs[i]);
    if (c->group_t)
        for (uint32_t k = 0; k < c->ngroups; k++) Py_XDECREF(c->group_t[k]);
    PyMem_Free(c->outputs);
    PyMem_Free(c->group_t);
    PyMem_Free(c->groups);
    Py_XDECREF(c->dev_obj);
    Py_XDECREF(c->proto);
    mtc_plan_free(&c->plan);
}

/* Stage 0: the arguments. 0, or -1 with ValueError/TypeError set. */
static int _parse_args(PyObject *const *args, Py_ssize_t nargs, _copy *c)
{
    if (nargs != 7 && nargs != 8) {
        PyErr_SetString(PyExc_TypeError,
                        "_engine.start_copy(data, target, staging, pack, align, max_chunk, background[, keep_numpy])");
        return -1;
    }
    long target = PyLong_AsLong(args[1]); /* range-checked below, before any truncation */
    mtc_plan_default_opts(&c->o, target < -1 || target >= MTC_MAX_DEVICES ? -2 : (int32_t)target);
    c->o.staging = PyObject_IsTrue(args[2]);
    c->o.pack = PyObject_IsTrue(args[3]);
    c->o.align = PyLong_AsLongLong(args[4]);
    c->o.max_chunk = PyLong_AsLongLong(args[5]);
    c->background = PyObject_IsTrue(args[6]);
    c->keep_numpy = nargs == 8 ? PyObject_IsTrue(args[7]) : 0;
    if (PyErr_Occurred()) return -1;
    if (c->o.target < -1 || c->o.target >= MTC_MAX_DEVICES || c->o.align <= 0 || c->o.max_chunk <= 0) {
        PyErr_SetString(PyExc_ValueError, "mtc_loader: bad engine arguments");
        return -1;
    }
    return 0;
}

/* Stage 1: read the leaves (walk the structure into c->t). 0, or -1 with an
 * exception naming the offending leaf. */
static int _read_leaves(_copy *c, PyObject *data)
{
    int64_t t0 = mtc_now_ns();
    mtc_nvtx_push(MTC_NVTX_TRAVERSE);
    int rc = mtc_traverse(c->st, data, c->t);
    mtc_nvtx_pop();
    if (rc) return -1;
    mtc_cnt.ns_traverse += (uint64_t)(mtc_now_ns() - t0);
    mtc_cnt.calls++;
    mtc_cnt.leaves += c->t->nleaves;
    return 0;
}

/* A leaf whose bytes do not fit int64 (traverse saturates them at INT64_MAX:
 * an expanded view such as torch.zeros(1).expand(2**63)) can only be reused
 * where it is; copying it would need that many bytes. 0, or -1 with
 * ValueError naming the first such leaf the plan would copy. */
static int _refuse_huge(const mtc_tree *t)
{
    for (uint32_t i = 0; i < t->nleaves; i++) {
        const mtc_leaf *l = &t->leaves[i];
        if (l->nbytes != INT64_MAX || l->action == MTC_ACT_REUSE || l->action == MTC_ACT_FROM_NUMPY) continue;
        PyObject *path = mtc_leaf_path(t, i);
        if (path) {
            PyErr_Format(PyExc_ValueError,
                         "mtc_loader: %U spans 2^63 bytes or more (an expanded view, e.g. .expand() or "
                         "np.broadcast_to) and cannot be copied as a whole: copy the tensor it expands, "
                         "and expand it after the copy", path);
            Py_DECREF(path);
        }
        return -1;
    }
    return 0;
}

/* Stage 2: plan (an action per leaf, packed segments and chunks); leaves the
 * planner wants contiguous are replaced by contiguous copies and the plan is
 * made again. 0, or -1 with an exception. */
static int _plan(_copy *c)
{
    int64_t t0 = mtc_now_ns();
    mtc_tree *t = c->t;
    int rc = mtc_plan_build(&c->plan, t->leaves, t->nleaves, t->shape, &c->o);
    if (rc == 0 && _refuse_huge(t)) return -1;
    if (rc == 0 && c->plan.need_contig) {
        int n = _make_contiguous(c->st, t, &c->plan);
        if (n < 0) return -1;
        mtc_cnt.made_contiguous += (uint64_t)n;
        mtc_plan_free(&c->plan);
        rc = mtc_plan_build(&c->plan, t->leaves, t->nleaves, t->shape, &c->o);
    }
    if (rc) {
        PyErr_Format(rc == -ENOMEM ? PyExc_MemoryError : PyExc_ValueError,
                     "mtc_loader: planning the copy failed (%s); check min_packed_alignment_bytes",
                     strerror(-rc));
        return -1;
    }
#ifdef MTC_DEBUG
    if (!mtc_plan_valid(&c->plan, t->leaves, t->nleaves, t->shape, &c->o)) {
        PyErr_SetString(PyExc_SystemError, "mtc_loader: invalid plan");
        return -1;
    }
#endif
    const mtc_plan *p = &c->plan;
    mtc_cnt.ns_plan += (uint64_t)(mtc_now_ns() - t0);
    mtc_cnt.packed += p->count[MTC_ACT_PACK];
    /* reused: returned as is; a resolved lazy view is a new tensor, even where it is reused */
    uint32_t resolved = 0;
    for (uint32_t i = 0; t->nresolved && i < t->nleaves; i++)
        resolved += t->leaves[i].action == MTC_ACT_REUSE && (t->leaves[i].flags & MTC_LEAF_RESOLVED);
    mtc_cnt.reused += p->count[MTC_ACT_REUSE] - resolved;
    mtc_cnt.from_numpy += p->count[MTC_ACT_FROM_NUMPY];
    mtc_cnt.host_copies += p->count[MTC_ACT_HOST_COPY];
    mtc_cnt.staged += p->count[MTC_ACT_H2D_STAGED];
    mtc_cnt.direct += p->count[MTC_ACT_H2D_DIRECT];
    mtc_cnt.d2h += p->count[MTC_ACT_D2H];
    mtc_cnt.d2d += p->count[MTC_ACT_D2D];
    mtc_cnt.segments += p->nsegs;
    mtc_cnt.chunks += p->nchunks;
    return 0;
}

/* True for the actions that make an item of the job with an output of its own. */
static int _own_output(uint8_t a) { return a != MTC_ACT_REUSE && a != MTC_ACT_FROM_NUMPY && a != MTC_ACT_PACK; }

/* Stage 3a: the job (when anything needs copying), sized for every op and
 * item, with the current streams of the devices involved captured. 0, or -1
 * with an exception. */
static int _new_job(_copy *c)
{
    const mtc_tree *t = c->t;
    uint32_t nops = c->ngroups, nitems = c->plan.nmembers, host_items = 0;
    for (uint32_t i = 0; i < t->nleaves; i++) {
        uint8_t a = t->leaves[i].action;
        if (a == MTC_ACT_HOST_COPY) host_items++;
        else if (_own_output(a)) nops++;
        if (_own_output(a)) nitems++;
    }
    nops += host_items ? 1 : 0;
    if (!nitems) return 0;
    uint64_t dev_mask = t->cuda_mask | (c->o.target >= 0 ? 1ull << c->o.target : 0);
    int rc;
    if (dev_mask && (rc = mtc_cuda_load())) {
        char desc[256];
        mtc_cuda_describe(rc, desc, sizeof desc);
        PyErr_Format(PyExc_RuntimeError, "mtc_loader: CUDA is needed for this copy but %s", desc);
        return -1;
    }
    if (!(c->job = mtc_job_new(nops, nitems))) {
        PyErr_NoMemory();
        return -1;
    }
    c->job->target = c->o.target;
    c->job->staging = c->o.staging;
    c->job->dev_mask = dev_mask;
    return dev_mask ? mtc_out_capture_streams(c->st, c->job) : 0;
}

/* Stage 3b: one tensor per storage group of the packed chunks (outputs.h:
 * the bytes of one dtype in a chunk; pinned on the host for a CPU target),
 * and one op per group over its members, group by group. A group starts at
 * offset 0 of its tensor's storage, at its first segment's offset in the
 * chunk: the offset a user observes, data_ptr() -
 * untyped_storage().data_ptr(), is then the planner's offset less that one,
 * a multiple of each member's alignment. (Rounding the base up inside a
 * larger allocation would align absolute addresses to alignments the
 * allocator does not give, 6 or 4096, but put every storage offset off the
 * rule by the skip.) 0, or -1 with an exception. */
static int _alloc_chunks(_copy *c)
{
    const mtc_plan *p = &c->plan;
    int pin = c->o.target < 0; /* D2H packing writes into pinned host chunks */
    for (uint32_t g = 0; g < c->ngroups; g++) {
        const mtc_group *gr = &c->groups[g];
        uintptr_t base;
        int64_t numel = (gr->hi - gr->lo) / c->st->elsize[gr->dtype];
        c->group_t[g] = mtc_out_group_empty(c->st, gr, pin ? c->st->device_cpu : c->dev_obj, pin);
        if (!c->group_t[g] ||
            mtc_buffer_check(c->st, c->group_t[g], gr->dtype, pin ? -1 : c->o.target, 1, &numel, NULL, &base))
            return -1;
        if (gr->hi == gr->lo) continue; /* zero-size members only: nothing to copy, no DMA of 0 bytes */
        mtc_op *op = &c->job->ops[c->oi++];
        op->kind = c->o.target >= 0 ? MTC_OP_H2D_CHUNK : MTC_OP_D2H_CHUNK;
        op->dev = c->o.target;
        op->dst = base;
        op->nbytes = gr->hi - gr->lo;
        op->chunk = gr->chunk;
        op->chunk_off = gr->lo;
        op->first = c->ii;
        for (uint32_t s = gr->seg0; s < gr->seg0 + gr->nsegs; s++)
            for (uint32_t m = 0; m < p->segs[s].count; m++) {
                uint32_t li = p->members[p->segs[s].first + m];
                mtc_item_of_leaf(&c->job->items[c->ii++], c->t, li,
                                 (uintptr_t)(mtc_plan_leaf_offset(p, &c->t->leaves[li]) - gr->lo));
            }
        op->count = c->ii - op->first;
    }
    return 0;
}

/* The error of torch.from_numpy giving leaf i's array back as a tensor that
 * is not a plain torch.Tensor (a mode that passed mtc_out_check_modes made it
 * a subclass). -1. */
static int _not_plain(mtc_state *st, const mtc_tree *t, uint32_t i, PyObject *got)
{
    PyObject *path = mtc_leaf_path(t, i);
    if (path) {
        PyErr_Format(PyExc_RuntimeError,
                     "mtc_loader: torch.from_numpy gave %U (a numpy array) back as a %s, not a plain "
                     "torch.Tensor: a TorchDispatchMode or TorchFunctionMode active here changes what it "
                     "makes; copy outside the mode, or call torch.from_numpy inside it yourself",
                     path, Py_TYPE(got)->tp_name);
        Py_DECREF(path);
    }
    return -1;
}

/* Stage 3c: outputs that are not views. Reused leaves are the same objects,
 * numpy leaves for the CPU go through torch.from_numpy, every other leaf that
 * is not packed gets a new tensor and an item: host copies form one op, the
 * others one op each (two passes keep the host op's items consecutive).
 * 0, or -1 with an exception. */
static int _alloc_own_outputs(_copy *c)
{
    mtc_state *st = c->st;
    const mtc_tree *t = c->t;
    mtc_op *host_op = NULL;
    for (int pass = 0; pass < 2; pass++) {
        for (uint32_t i = 0; i < t->nleaves; i++) {
            const mtc_leaf *l = &t->leaves[i];
            if (pass == 0 && l->action == MTC_ACT_REUSE) {
                c->outputs[i] = Py_NewRef(t->objs[i]);
                continue;
            }
            if (pass == 0 && l->action == MTC_ACT_FROM_NUMPY) {
                if (!(c->outputs[i] = PyObject_CallOneArg(st->from_numpy, t->objs[i]))) return -1;
                if ((PyObject *)Py_TYPE(c->outputs[i]) != st->tensor_type && _not_plain(st, t, i, c->outputs[i]))
                    return -1;
                continue;
            }
            if (!_own_output(l->action) || (l->action == MTC_ACT_HOST_COPY) != (pass == 1)) continue;
            PyObject *shape = mtc_out_shape(t, l, 0);
            if (!shape) return -1;
            int pin = l->action == MTC_ACT_D2H && c->o.staging;
            PyObject *dev = pin ? st->device_cpu : c->dev_obj;
            if (l->flags & MTC_LEAF_STRIDED) /* the strides tensor.to() gives it */
                c->outputs[i] = mtc_out_empty_strided(st, shape, t, l, dev, pin, &c->proto);
            else
                c->outputs[i] = mtc_out_empty(st, shape, st->dtypes[l->dtype], dev, pin);
            Py_DECREF(shape);
            if (!c->outputs[i]) return -1;
            uintptr_t dst;
            if (mtc_buffer_check(st, c->outputs[i], l->dtype, pin ? -1 : c->o.target, l->ndim, &t->shape[l->dims],
                                     (l->flags & MTC_LEAF_STRIDED) ? &t->ostrides[l->dims] : NULL, &dst))
                return -1;
            mtc_op *op;
            if (l->action == MTC_ACT_HOST_COPY) {
                if (!host_op) {
                    host_op = &c->job->ops[c->oi++];
                    host_op->kind = MTC_OP_HOST_COPY;
                    host_op->dev = -1;
                    host_op->first = c->ii;
                    host_op->count = 0;
                }
                op = host_op;
            } else {
                op = &c->job->ops[c->oi++];
                op->kind = l->action == MTC_ACT_D2H ? MTC_OP_D2H : l->action == MTC_ACT_D2D ? MTC_OP_D2D : MTC_OP_H2D;
                op->dev = l->action == MTC_ACT_D2H ? l->dev : c->o.target;
                op->first = c->ii;
                op->count = 0;
            }
            mtc_item_of_leaf(&c->job->items[c->ii++], t, i, dst);
            op->count++;
        }
    }
    return 0;
}

/* Stage 3: allocate the outputs and build the job. 0, or -1 with an exception. */
static int _alloc_outputs(_copy *c)
{
    int64_t t0 = mtc_now_ns();
    if (mtc_out_groups(c->t, &c->plan, &c->groups, &c->ngroups)) return -1;
    size_t nl = c->t->nleaves ? c->t->nleaves : 1, ng = c->ngroups ? c->ngroups : 1;
    c->outputs = PyMem_Calloc(nl, sizeof *c->outputs);
    c->group_t = PyMem_Calloc(ng, sizeof *c->group_t);
    if (!c->outputs || !c->group_t) {
        PyErr_NoMemory();
        return -1;
    }
    /* a mode that fakes torch.empty's tensors (and torch.from_numpy's): refused before anything is made */
    const mtc_plan *p = &c->plan;
    if ((c->ngroups || p->count[MTC_ACT_FROM_NUMPY] || p->count[MTC_ACT_HOST_COPY] || p->count[MTC_ACT_H2D_STAGED] ||
         p->count[MTC_ACT_H2D_DIRECT] || p->count[MTC_ACT_D2H] || p->count[MTC_ACT_D2D]) &&
        mtc_out_check_modes(c->st))
        return -1;
    if (_new_job(c)) return -1;
    if (!(c->dev_obj = mtc_out_device(c->st, c->o.target))) return -1;
    if (_alloc_chunks(c) || _alloc_own_outputs(c)) return -1;
    if (c->job) {
        c->job->nops = c->oi;
        c->job->nitems = c->ii;
    }
    mtc_cnt.ns_outputs += (uint64_t)(mtc_now_ns() - t0);
    return 0;
}

/* The device tensors the outputs live in, for a consumer on another stream
 * (Handle.buffers): every chunk and every own output on the target GPU. Only
 * for a CUDA target. 0, or -1 with an exception. */
static int _collect_buffers(_copy *c, mtc_handle *h)
{
    if (c->o.target < 0) return 0;
    if (!(h->buffers = PyList_New(0))) return -1;
    for (uint32_t k = 0; k < c->ngroups; k++)
        if (PyList_Append(h->buffers, c->group_t[k])) return -1;
    for (uint32_t i = 0; i < c->t->nleaves; i++) {
        uint8_t a = c->t->leaves[i].action;
        if ((a == MTC_ACT_H2D_STAGED || a == MTC_ACT_H2D_DIRECT || a == MTC_ACT_D2D) &&
            PyList_Append(h->buffers, c->outputs[i]))
            return -1;
    }
    return 0;
}

/* Host -> device jobs of at most this many bytes to stage run on the calling
 * thread even with use_background_thread: staging a small job costs less
 * than waking the transfer thread, whose wake-up may also land on the
 * calling thread's core and slow the caller's own work. The DMAs stay
 * asynchronous. MTC_INLINE_MAX_BYTES (0: never) overrides it. */
#define MTC_INLINE_MAX_BYTES ((int64_t)1 << 20)

static int64_t _inline_max(void)
{
    static _Atomic int64_t v = -1;
    int64_t m = atomic_load_explicit(&v, memory_order_relaxed);
    if (m < 0) {
        if (mtc_env_int(MTC_ENV_INLINE_MAX_BYTES, &m) != 1) m = MTC_INLINE_MAX_BYTES;
        atomic_store_explicit(&v, m, memory_order_relaxed);
    }
    return m;
}

/* Whether a job is small host -> device work (see MTC_INLINE_MAX_BYTES):
 * packed chunks and staged tensors only, their bytes in all at most the
 * bound, no file-backed source. Copies from the device (a batched copy of hundreds of items costs
 * the driver ~1 us each) and host copies keep the transfer thread. */
static int _small_h2d(const mtc_job *j)
{
    int64_t bytes = 0, max = _inline_max();
    if (!max) return 0;
    for (uint32_t i = 0; i < j->nops; i++) {
        const mtc_op *o = &j->ops[i];
        if (o->kind == MTC_OP_H2D_CHUNK) bytes += o->nbytes;
        else if (o->kind == MTC_OP_H2D && o->count == 1) bytes += j->items[o->first].nbytes;
        else return 0;
        if (bytes > max) return 0;
    }
    for (uint32_t i = 0; i < j->nitems; i++)
        if (j->items[i].file) return 0; /* file reads wait on the disk: the transfer thread's */
    return 1;
}

/* Stage 4: hand the job to the transfer thread (or run it here, the GIL
 * released: use_background_thread=False, or small host -> device work);
 * once it runs, the handle owns it and waits for it before the inputs go.
 * 0, or -1 with an exception (the job, never started, stays in c). */
static int _submit(_copy *c, mtc_handle *h)
{
    if (!c->job) return 0;
    if (c->background && (mtc_handle_on_service() || !_small_h2d(c->job))) {
        int rc = mtc_transfer_submit(c->job);
        if (rc) {
            PyErr_Format(PyExc_RuntimeError, "mtc_loader: cannot start the transfer thread: %s", strerror(-rc));
            return -1;
        }
    } else {
        Py_BEGIN_ALLOW_THREADS
        mtc_transfer_run(c->job);
        Py_END_ALLOW_THREADS
    }
    h->job = c->job;
    c->job = NULL;
    return 0;
}

/* Stage 5: the output views over the chunks and the rebuilt structure, made
 * while the transfer thread stages. 0, or -1 with an exception. */
static int _views_and_rebuild(_copy *c, mtc_handle *h)
{
    int64_t t0 = mtc_now_ns();
    mtc_nvtx_push(MTC_NVTX_VIEWS);
    int rc = (mtc_handle_keeps() && !(h->keep = PyList_New(0))) ||
             mtc_out_views(c->st, c->t, &c->plan, c->groups, c->ngroups, c->group_t, c->outputs, h->keep) ||
             !(h->result = mtc_rebuild(c->st, c->t, c->outputs, NULL));
    mtc_nvtx_pop();
    if (rc) return -1;
    mtc_cnt.ns_views += (uint64_t)(mtc_now_ns() - t0);
    return 0;
}

/* _engine.start_copy(data, target, staging, pack, align, max_chunk, background[, keep_numpy])
 * -> Handle: the stages above in order. New reference, or NULL with an
 * exception set (a submitted job is waited for before the inputs go). */
PyObject *mtc_copy_start(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    mtc_state *st = mtc_get_state(module);
    if (!st->ready) {
        PyErr_SetString(PyExc_RuntimeError, "mtc_loader._engine used before _setup()");
        return NULL;
    }
    _copy c;
    memset(&c, 0, sizeof c);
    c.st = st;
    if (_parse_args(args, nargs, &c)) return NULL;
    mtc_handle *h = mtc_handle_new(st);
    if (!h) return NULL;
    c.t = &h->tree;
    c.t->numpy_pass = c.keep_numpy;
    /* the outputs: a tensor per leaf (and a gap's piece at most) and a container per node */
    if (_read_leaves(&c, args[0]) || _plan(&c) ||
        (!mtc_handle_on_service() && mtc_collector_before_outputs(st, (int64_t)c.t->nnodes + c.t->nleaves)) ||
        _alloc_outputs(&c) ||
        _collect_buffers(&c, h) ||
        _submit(&c, h) || _views_and_rebuild(&c, h))
        goto error;
    _copy_clear(&c);
    if (!h->job) mtc_handle_finish(h); /* nothing in flight: release the inputs now */
    return (PyObject *)h;

error:
    _copy_clear(&c);
    Py_DECREF(h); /* waits for a submitted job before releasing the inputs */
    return NULL;
}
