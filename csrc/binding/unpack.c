/*
 * unpack.c - the main process's side of a packed batch (mtc_loader/collate.py):
 * unpack() turns the batch's arena region into the output structure on the
 * target, straight from the arena: the descriptor decoded, one tensor per
 * storage group (outputs.h) from torch's allocator, one DMA job for a CUDA
 * target (a memcpy per group on the host), the views and the structure made
 * around them. See collate.h; pack() is in collate.c.
 */
#include "collate.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "arena.h"
#include "collector.h"
#include "cuda.h"
#include "handle.h"
#include "hostcopy.h"
#include "layout.h"
#include "buffers.h"
#include "outputs.h"
#include "shim.h"
#include "skeleton.h"
#include "traverse.h"

typedef struct _region_ref { mtc_arena *a; uint64_t off; uint32_t owner; } _region_ref;

/* Runs on a CUDA driver thread once the DMA that read the region completed. */
static void _region_done(void *arg)
{
    _region_ref *r = arg;
    mtc_arena_free(r->a, r->off, r->owner);
    mtc_arena_unref(r->a);
    free(r);
}

/* Checks a descriptor's byte count against its region (already found to be
 * this process's) and decodes its layout (untrusted input). 0 with the layout
 * in *L (free with mtc_layout_free), or -1 with ValueError/TypeError set; the
 * caller frees the region (the batch is consumed: nobody else would). */
static int _unpack_decode(mtc_state *st, mtc_arena *a, uint64_t off, int64_t nbytes, uint32_t owner,
                          PyObject *layout, mtc_layout *L)
{
    if (!PyBytes_Check(layout)) {
        PyErr_SetString(PyExc_TypeError, "mtc_loader: a packed batch's layout must be bytes");
        return -1;
    }
    if (nbytes < 0 || mtc_arena_check(a, off, (uint64_t)(nbytes ? nbytes : 1), owner)) {
        PyErr_SetString(PyExc_ValueError, "mtc_loader: a packed batch's byte count does not fit its arena "
                        "region (a corrupt or forged descriptor)");
        return -1;
    }
    int rc = mtc_layout_decode((const uint8_t *)PyBytes_AS_STRING(layout), (size_t)PyBytes_GET_SIZE(layout),
                               st->elsize, st->ndtypes, (uint64_t)nbytes + MTC_LAYOUT_MAX_ALIGN, L);
    if (rc || (L->nleaves && L->plan.chunks[0].payload != nbytes)) {
        if (!rc) mtc_layout_free(L);
        PyErr_SetString(PyExc_ValueError, "mtc_loader: a packed batch's layout is malformed or does not "
                        "match its region (a corrupt or forged descriptor)");
        return -1;
    }
    return 0;
}

/* Page-locks the whole arena once, for `target`: DMAs then read it in place.
 * 0, or a CUDA error code (mtc_cuda_describe). */
static int _unpack_register(mtc_arena_object *ao, int target)
{
    int rc;
    if ((rc = mtc_cuda_load()) || (rc = mtc_cuda_set_device(target))) return rc;
    if (ao->registered_dev >= 0) return 0;
    rc = MTC_CUDA_ERR(mtc_cu.cuMemHostRegister(ao->a->base, ao->a->bytes, MTC_CU_MEMHOSTREGISTER_PORTABLE));
    if (rc == MTC_CUDA_ERR(0)) rc = 0;
    if (!rc) ao->registered_dev = target;
    return rc;
}

/* The job that DMAs the region's device groups into their tensors on
 * `target`: one MTC_OP_H2D_REGION op of n items (from the region to each
 * group's tensor; the items' dst is set when the tensors exist), the region
 * freed by its completion callback, and the streams captured (the calling
 * thread's current ones). The job or NULL with an exception; on NULL the
 * region was freed. */
static mtc_job *_unpack_job(mtc_state *st, mtc_arena *a, uint64_t off, uint32_t n, int target)
{
    _region_ref *ref = malloc(sizeof *ref);
    mtc_job *job = ref ? mtc_job_new(1, n) : NULL;
    if (!job) {
        free(ref);
        mtc_arena_free(a, off, (uint32_t)getpid());
        PyErr_NoMemory();
        return NULL;
    }
    mtc_arena_ref(a);
    *ref = (_region_ref){.a = a, .off = off, .owner = (uint32_t)getpid()};
    job->target = target;
    job->staging = 0;
    job->dev_mask = 1ull << target;
    job->ops[0] = (mtc_op){.kind = MTC_OP_H2D_REGION, .dev = target, .dst = 0, .nbytes = 0,
                           .first = 0, .count = n, .after = _region_done, .after_arg = ref};
    job->nops = 1;
    job->nitems = n;
    if (mtc_out_capture_streams(st, job)) {
        _region_done(ref);
        mtc_job_release(job);
        return NULL;
    }
    return job;
}

/* Fills the job's items (one per device group, in order) from the groups'
 * data pointers ptr[], then runs it here, or queues it on the transfer thread
 * (background). Call with or without the GIL: no Python is touched. */
static void _unpack_issue(mtc_job *job, const uint8_t *region, const mtc_group *groups, uint32_t ngroups,
                          const uintptr_t *ptr, int background)
{
    for (uint32_t g = 0, k = 0; g < ngroups; g++)
        if (!groups[g].host)
            job->items[k++] = (mtc_item){.src = (uintptr_t)(region + groups[g].lo), .dst = ptr[g],
                                         .nbytes = groups[g].hi - groups[g].lo, .dev = -1, .leaf = -1};
    if (!background || mtc_transfer_submit(job)) mtc_transfer_run(job);
}

/* The memcpy of the host groups (every group for a CPU target, the
 * host-placed ones for a CUDA target) into their tensors. No GIL needed. */
static void _unpack_host_copies(const uint8_t *region, const mtc_group *groups, uint32_t ngroups,
                                const uintptr_t *ptr, int target)
{
    for (uint32_t g = 0; g < ngroups; g++)
        if ((target < 0 || groups[g].host) && groups[g].hi > groups[g].lo)
            mtc_memcpy_parallel((void *)ptr[g], region + groups[g].lo, (size_t)(groups[g].hi - groups[g].lo), 0);
}

/* 1 when every group's tensor can come from torch's allocator through the C
 * shim (mtc_shim_empty): the shim is in use for the CPU and, where there are
 * device groups, for `target`, and it knows each group's dtype. */
static int _unpack_shim_ok(const mtc_state *st, const mtc_group *groups, uint32_t ngroups, int target, uint32_t ndev)
{
    if (!ngroups || !mtc_shim_empty_on(st, -1) || (ndev && !mtc_shim_empty_on(st, target))) return 0;
    for (uint32_t g = 0; g < ngroups; g++)
        if (groups[g].dtype >= MTC_MAX_DTYPES || st->shim_dtype[groups[g].dtype] < 0) return 0;
    return 1;
}

/* The groups' tensors through the shim, their copies and the DMA issued, in
 * one window with the GIL released; the GIL is taken back once, to make the
 * groups' Python tensors (counted in stats: unpack_dma_in_alloc_window for a
 * batch with a DMA). 1 when torch refused an allocation (out of memory):
 * nothing was issued, nothing is held, and the caller makes the tensors from
 * Python, which raises torch's own error. 0 with group_t[] set and h->job the
 * job (if any), or -1 with an exception (the job, issued, is the handle's). */
static int _unpack_via_shim(mtc_state *st, mtc_handle *h, mtc_job *job, const uint8_t *region,
                            const mtc_group *groups, uint32_t ngroups, int target, int background,
                            uintptr_t *ptr, void **th, PyObject **group_t)
{
    uint32_t made = 0;
    Py_BEGIN_ALLOW_THREADS
    for (; made < ngroups; made++) {
        const mtc_group *g = &groups[made];
        int dev = target < 0 || g->host ? -1 : target;
        if (mtc_shim_empty(st, dev, g->dtype, (g->hi - g->lo) / st->elsize[g->dtype], &th[made], &ptr[made]))
            break;
    }
    if (made == ngroups) {
        _unpack_host_copies(region, groups, ngroups, ptr, target);
        if (job) _unpack_issue(job, region, groups, ngroups, ptr, background);
    }
    Py_END_ALLOW_THREADS
    if (made < ngroups) { /* torch refused: give back what was made; nothing was issued */
        for (uint32_t g = 0; g < made; g++) mtc_shim_release(st, th[g]);
        return 1;
    }
    mtc_cnt.unpack_chunks_shim += ngroups;
    if (job) {
        h->job = job;
        mtc_cnt.unpack_dma_in_alloc_window++;
    }
    uint32_t g = 0;
    for (; g < ngroups; g++) {
        /* torch's wrapper moves from the handle; it is released only after
         * that (mtc_shim_wrap's order), here after the wait below where the
         * wrapper failed */
        if (!(group_t[g] = st->shim_wrap(th[g]))) break;
        mtc_shim_release(st, th[g]);
    }
    if (g == ngroups) return 0;
    if (job) {
        /* the handles left go back to the caching allocator's pool of the
         * stream the DMA is issued on: first wait (GIL released) until the
         * DMA is issued, so that whoever reuses that memory there is
         * ordered after it */
        Py_BEGIN_ALLOW_THREADS
        mtc_job_wait(job, -1);
        Py_END_ALLOW_THREADS
    }
    for (; g < ngroups; g++) mtc_shim_release(st, th[g]);
    return -1;
}

/* The tensors that receive the region (outputs.h's storage groups: one per
 * dtype, from torch's allocator) and the copies into them: memcpy on the
 * host (never a view of arena memory, which is reused) for a CPU target and
 * for the host-placed leaves (layout.h) of any target, one DMA per group for
 * the others on a CUDA target, all in one job. Each group lands at offset 0
 * of its tensor's storage, so that every output's storage offset is its
 * offset from its group's first segment, a multiple of its alignment (see
 * copy.c's _alloc_chunks).
 *
 * Where the shim's allocator is in use, the tensors are allocated, filled
 * and the DMA issued with the GIL released (_unpack_via_shim); otherwise, or
 * where torch refused an allocation there, each tensor is torch.empty from
 * Python (counted in stats: unpack_chunks_python; a CUDA device's first
 * batch takes this way, so that torch initialises the device on its own
 * path), then the copies. A mode that fakes torch.empty's tensors is
 * refused before anything is made (mtc_out_check_modes). The region is
 * freed by then or by the DMAs' callback: *region_owned becomes 0. 0 with
 * new references in group_t[0..ngroups), or -1 with an exception (those
 * made so far are the caller's to release). */
static int _unpack_copy(mtc_state *st, mtc_handle *h, mtc_arena_object *ao, uint64_t off, const mtc_group *groups,
                        uint32_t ngroups, int target, int background, PyObject **group_t, int *region_owned)
{
    mtc_arena *a = ao->a;
    const uint8_t *region = a->base + off;
    if (ngroups && mtc_out_check_modes(st)) return -1;
    uint32_t ndev = 0;
    for (uint32_t g = 0; g < ngroups; g++) ndev += target >= 0 && !groups[g].host;
    if (ndev) {
        int rc = _unpack_register(ao, target);
        if (rc) {
            char desc[256];
            mtc_cuda_describe(rc, desc, sizeof desc);
            PyErr_Format(PyExc_RuntimeError, "mtc_loader: copying a packed batch to cuda:%d needs CUDA: %s",
                         target, desc);
            return -1;
        }
    }
    PyObject *dev_obj = NULL;
    uintptr_t *ptr = PyMem_Calloc(ngroups ? ngroups : 1, sizeof *ptr);
    void **th = PyMem_Calloc(ngroups ? ngroups : 1, sizeof *th);
    mtc_job *job = NULL;
    if (!ptr || !th) {
        PyErr_NoMemory();
        goto error;
    }
    if (ndev) {
        *region_owned = 0; /* from here the job's callback frees it */
        if (!(job = _unpack_job(st, a, off, ndev, target))) goto error;
    }
    if (_unpack_shim_ok(st, groups, ngroups, target, ndev)) {
        int rc = _unpack_via_shim(st, h, job, region, groups, ngroups, target, background, ptr, th, group_t);
        if (rc <= 0) {
            job = NULL; /* the handle's, issued */
            if (rc < 0) goto error;
            goto done;
        }
        /* torch refused (out of memory): torch.empty below raises its own error */
    }
    if (!(dev_obj = mtc_out_device(st, target))) goto error;
    for (uint32_t g = 0; g < ngroups; g++) {
        int host = target < 0 || groups[g].host;
        int64_t numel = (groups[g].hi - groups[g].lo) / st->elsize[groups[g].dtype];
        if (!(group_t[g] = mtc_out_group_empty(st, &groups[g], host ? st->device_cpu : dev_obj, 0)) ||
            mtc_buffer_check(st, group_t[g], groups[g].dtype, host ? -1 : target, 1, &numel, NULL, &ptr[g]))
            goto error;
    }
    mtc_cnt.unpack_chunks_python += ngroups;
    if (ndev && target < 64) st->shim_cuda_ready |= 1ull << target;
    Py_BEGIN_ALLOW_THREADS
    _unpack_host_copies(region, groups, ngroups, ptr, target);
    if (job) _unpack_issue(job, region, groups, ngroups, ptr, background);
    Py_END_ALLOW_THREADS
    if (job) {
        h->job = job;
        job = NULL;
    }
done:
    if (!ndev && *region_owned) {
        *region_owned = 0;
        mtc_arena_free(a, off, (uint32_t)getpid());
    }
    Py_XDECREF(dev_obj);
    PyMem_Free(ptr);
    PyMem_Free(th);
    return 0;
error:
    /* a job never issued: its release does not run the callback, so the
     * region is freed here through it */
    if (job) {
        _region_done(job->ops[0].after_arg);
        mtc_job_release(job);
    }
    Py_XDECREF(dev_obj);
    PyMem_Free(ptr);
    PyMem_Free(th);
    return -1;
}

/* Releases the groups and their tensors (NULL entries skipped). */
static void _unpack_release(mtc_group *groups, uint32_t ngroups, PyObject **group_t)
{
    for (uint32_t g = 0; group_t && g < ngroups; g++) Py_XDECREF(group_t[g]);
    PyMem_Free(group_t);
    PyMem_Free(groups);
}

/* The outputs over the group tensors (_unpack_copy), and the skeleton's walk
 * `sk` rebuilt around them and the batch's atoms (a tuple of sk->natoms, or
 * None) into h->result. 0, or -1 with an exception. */
static int _unpack_views(mtc_state *st, mtc_handle *h, const mtc_layout *L, const mtc_tree *lt, const mtc_tree *sk,
                         PyObject *atoms, const mtc_group *groups, uint32_t ngroups, PyObject *const *group_t)
{
    PyObject **outputs = PyMem_Calloc(L->nleaves ? L->nleaves : 1, sizeof *outputs);
    if (!outputs) {
        PyErr_NoMemory();
        return -1;
    }
    int rc = -1;
    int64_t t0 = mtc_now_ns();
    if ((!mtc_handle_keeps() || (h->keep = PyList_New(0))) &&
        !mtc_out_views(st, lt, &L->plan, groups, ngroups, group_t, outputs, h->keep)) {
        int64_t t1 = mtc_now_ns();
        mtc_cnt.ns_unpack_views += (uint64_t)(t1 - t0);
        PyObject *const *av = PyTuple_Check(atoms) ? &PyTuple_GET_ITEM(atoms, 0) : NULL;
        if ((h->result = mtc_rebuild(st, sk, outputs, av))) rc = 0;
        mtc_cnt.ns_unpack_rebuild += (uint64_t)(mtc_now_ns() - t1);
    }
    for (uint32_t i = 0; i < L->nleaves; i++) Py_XDECREF(outputs[i]);
    PyMem_Free(outputs);
    return rc;
}

/* 1 when the host-placed leaves of the skeleton's walk (under an OnHost) are
 * not those of the layout (a corrupt or forged descriptor). sk->nslots is
 * L->nleaves. */
static int _host_mismatch(const mtc_tree *sk, const mtc_layout *L)
{
    if (sk->nhost != L->nhost) return 1;
    for (uint32_t i = 0; L->nhost && i < sk->nnodes; i++) {
        const mtc_node *n = &sk->nodes[i];
        if (n->kind == MTC_NODE_LEAF && !n->host != !(L->leaves[n->leaf].flags & MTC_LEAF_HOST)) return 1;
    }
    return 0;
}

/* unpack(arena, offset, nbytes, owner, layout, skeleton, target, background, atoms) -> Handle
 * In the main process: the region (already adopted by this process) becomes
 * the output structure on `target`, straight from the arena: decode the
 * descriptor, walk the skeleton, copy, make views and rebuild. New reference,
 * or NULL with an exception set; the region is freed on every error after it
 * was found to be this process's. */
PyObject *mtc_collate_unpack(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    mtc_state *st = mtc_get_state(module);
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError,
                        "unpack(arena, offset, nbytes, owner, layout, skeleton, target, background, atoms)");
        return NULL;
    }
    mtc_arena_object *ao = (mtc_arena_object *)args[0];
    mtc_arena *a = mtc_arenaobj_of(st, args[0]);
    if (!a) return NULL;
    uint64_t off;
    uint32_t owner, me = (uint32_t)getpid();
    if (mtc_arenaobj_parse_offset(args[1], &off) || mtc_arenaobj_parse_owner(args[3], &owner)) return NULL;
    if (owner != me || mtc_arena_check(a, off, 1, owner)) {
        PyErr_SetString(PyExc_ValueError, "mtc_loader: a packed batch names a region outside this process's "
                        "part of the arena (a stale or forged descriptor)");
        return NULL;
    }
    /* From here the region is this batch's, and the batch is consumed: every
     * error frees it (nobody else would), unless the copy took it over. */
    int region_owned = 1;
    mtc_layout L;
    memset(&L, 0, sizeof L);
    mtc_handle *h = NULL;
    mtc_group *groups = NULL;
    uint32_t ngroups = 0;
    PyObject **group_t = NULL;
    mtc_tree lt; /* the layout's leaves, as the output makers read them */
    memset(&lt, 0, sizeof lt);
    long long nbytes = PyLong_Check(args[2]) ? PyLong_AsLongLong(args[2]) : -1;
    if (nbytes < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "mtc_loader: a packed batch's byte count %R is not a byte count "
                     "(a corrupt or forged descriptor)", args[2]);
        goto error;
    }
    long target = PyLong_AsLong(args[6]);
    if (target == -1 && PyErr_Occurred()) goto error;
    if (target < -1 || target >= MTC_MAX_DEVICES) {
        PyErr_Format(PyExc_ValueError, "mtc_loader: bad target device index %ld", target);
        goto error;
    }
    int background = PyObject_IsTrue(args[7]);
    int64_t t0 = mtc_now_ns();
    if (background < 0 || _unpack_decode(st, a, off, nbytes, owner, args[4], &L)) goto error;
    int64_t t1 = mtc_now_ns();
    mtc_cnt.ns_unpack_decode += (uint64_t)(t1 - t0);
    if (!(h = mtc_handle_new(st))) goto error;
    /* a Skeleton (a structure shared by many batches) was walked once; any
     * other skeleton is walked here */
    const mtc_tree *sk = mtc_skeleton_tree(st, args[5]);
    if (!sk) {
        h->tree.slots = 1;
        if (mtc_traverse(st, args[5], &h->tree)) goto error;
        sk = &h->tree;
    }
    t0 = mtc_now_ns();
    mtc_cnt.ns_unpack_rebuild += (uint64_t)(t0 - t1);
    Py_ssize_t natoms = PyTuple_Check(args[8]) ? PyTuple_GET_SIZE(args[8]) : args[8] == Py_None ? 0 : -1;
    if (sk->nslots != L.nleaves || sk->nleaves || natoms != (Py_ssize_t)sk->natoms || _host_mismatch(sk, &L)) {
        PyErr_SetString(PyExc_ValueError, "mtc_loader: a packed batch's skeleton does not match its layout");
        goto error;
    }
    lt.leaves = L.leaves;
    lt.shape = L.shape;
    lt.ostrides = L.ostrides;
    if (mtc_out_groups(&lt, &L.plan, &groups, &ngroups)) goto error;
    if (!(group_t = PyMem_Calloc(ngroups ? ngroups : 1, sizeof *group_t))) {
        PyErr_NoMemory();
        goto error;
    }
    if ((!mtc_handle_on_service() && mtc_collector_before_outputs(st, (int64_t)sk->nnodes + L.nleaves)) ||
        _unpack_copy(st, h, ao, off, groups, ngroups, (int)target, background, group_t, &region_owned))
        goto error;
    mtc_cnt.ns_unpack_copy += (uint64_t)(mtc_now_ns() - t0);
    mtc_cnt.unpacks++;
    if (target >= 0 && !(h->buffers = PyList_New(0))) goto error; /* Handle.buffers: the device groups */
    for (uint32_t g = 0; h->buffers && g < ngroups; g++)
        if (!groups[g].host && PyList_Append(h->buffers, group_t[g])) goto error;
    if (_unpack_views(st, h, &L, &lt, sk, args[8], groups, ngroups, group_t)) goto error;
    _unpack_release(groups, ngroups, group_t);
    mtc_layout_free(&L);
    if (!h->job) mtc_handle_finish(h);
    return (PyObject *)h;

error:
    if (region_owned) mtc_arena_free(a, off, owner);
    /* the handle first: its dealloc waits (GIL released) for a job already
     * issued, before the groups' tensors can go back to torch's pool */
    Py_XDECREF(h);
    _unpack_release(groups, ngroups, group_t);
    mtc_layout_free(&L);
    return NULL;
}
