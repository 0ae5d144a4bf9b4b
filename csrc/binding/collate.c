/*
 * collate.c - the packed-batch side (mtc_loader/collate.py): pack() in a
 * DataLoader worker (every leaf of a batch written into one arena region,
 * described by a layout and a skeleton); unpack() in the main process is in
 * unpack.c. See collate.h; the Arena type is in arenaobj.c.
 */
#include "collate.h"

#include <errno.h>
#include <limits.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "arena.h"
#include "copy.h"
#include "env.h"
#include "files.h"
#include "layout.h"
#include "skeleton.h"
#include "traverse.h"

/* ------------------------------------------------------------------ pack */

/* Refuses CUDA leaves: a worker packs host memory. 0, or -1 with TypeError
 * naming the first CUDA leaf. */
static int _pack_refuse_cuda(const mtc_tree *t)
{
    if (!t->any_cuda) return 0;
    for (uint32_t i = 0; i < t->nleaves; i++)
        if (t->leaves[i].dev >= 0) {
            PyObject *path = mtc_leaf_path(t, i);
            if (path) {
                PyErr_Format(PyExc_TypeError, "mtc_loader: %U is a CUDA tensor; PackedCollate packs host "
                             "tensors in DataLoader workers (move it to the GPU after loading)", path);
                Py_DECREF(path);
            }
            return -1;
        }
    return 0;
}

/* What the process that unpacks the arena's batches keeps in flight
 * (PackedCollate passes it, see mtc_loader/collate.py): how many batches may
 * hold regions at once, which the messages turn into a size to configure. */
typedef struct _in_flight {
    uint64_t batches;    /* 0: unknown (a caller that passed none) */
    PyObject *why;       /* borrowed str: what they are (NULL when batches is 0) */
    uint64_t least;      /* batches the arena must hold for the loader to go on at
                          * all; 0: no check (not the process's first pack) */
    PyObject *least_why; /* borrowed str: what they are */
    int loaders;         /* the training process's regions are its loaders' own (a
                          * PrefetchLoader consumes: no loop of the user holds one) */
} _in_flight;

/* Bytes that hold the batches in flight at `unit` bytes each; 0 when their
 * number is unknown. */
static unsigned long long _pack_need(const _in_flight *f, int64_t unit)
{
    unsigned long long need;
    if (__builtin_mul_overflow((unsigned long long)f->batches, (unsigned long long)unit, &need)) need = ULLONG_MAX;
    return need;
}

/* The advice that ends every "arena too small" error: the arena_bytes to
 * configure, as a number of bytes: `f` batches of `unit` bytes (`what`, in
 * whole slots). Where the arena has that much already (it filled up with
 * batches held beyond those in flight), it says so instead. New reference,
 * or NULL with an exception set. */
static PyObject *_pack_advice(const _in_flight *f, int64_t unit, const char *what, uint64_t arena_bytes)
{
    if (!f->batches)
        return PyUnicode_FromFormat("Make it larger: PackedCollate(arena_bytes=...) of at least the batches in "
                                    "flight x %lld bytes (%s rounded up to the arena's 64 KiB slots)",
                                    (long long)unit, what);
    unsigned long long need = _pack_need(f, unit);
    const char *batches = f->batches == 1 ? "batch" : "batches";
    if (need <= arena_bytes)
        return PyUnicode_FromFormat("Its size is not what is short: PackedCollate(arena_bytes=...) of %llu bytes "
                                    "holds the %llu %s in flight (%U) at %lld bytes each (%s rounded up to the "
                                    "arena's 64 KiB slots: a batch takes whole slots), and this arena has %llu, so "
                                    "what fills it is held beyond those",
                                    need, (unsigned long long)f->batches, batches, f->why, (long long)unit, what,
                                    (unsigned long long)arena_bytes);
    return PyUnicode_FromFormat("Make it larger: PackedCollate(arena_bytes=...) of at least %llu bytes: %llu %s in "
                                "flight (%U) x %lld bytes (%s rounded up to the arena's 64 KiB slots: a batch takes "
                                "whole slots)",
                                need, (unsigned long long)f->batches, batches, f->why, (long long)unit, what);
}

/* `payload` rounded up to the arena's whole slots (a region of 0 bytes takes
 * one), without overflowing. */
static int64_t _pack_rounded(int64_t slot, int64_t payload)
{
    if (payload <= 0) return slot;
    return payload > INT64_MAX - slot ? payload : (payload + slot - 1) / slot * slot;
}

/* The error for a packed batch of `payload` bytes that the arena is too
 * small for (rc -E2BIG) or stayed too full to take (-ETIMEDOUT): the size to
 * configure. -1. */
static int _pack_too_big(mtc_arena *a, int64_t payload, int rc, const _in_flight *f)
{
    mtc_arena_stats as;
    mtc_arena_get_stats(a, &as);
    int64_t rounded = _pack_rounded((int64_t)as.slot_bytes, payload);
    PyObject *advice = _pack_advice(f, rounded, "this batch", as.bytes);
    if (!advice) return -1;
    if (rc == -E2BIG) {
        PyErr_Format(PyExc_RuntimeError, "mtc_loader: the shared arena (%llu bytes) is too small for a packed "
                     "batch of %lld bytes. %U", (unsigned long long)as.bytes, (long long)payload, advice);
        Py_DECREF(advice);
        return -1;
    }
    /* full for too long: say who holds the room. The training process (the
     * arena's creator) holds the batches it received and has not unpacked or
     * dropped: its DataLoader holds those that arrived ahead of the one it
     * hands out next, a PrefetchLoader the ones it copies, and a loop that
     * keeps PackedBatch objects fills an arena of any size. */
    uint32_t creator = a->hdr->creator_pid;
    mtc_arena_usage_t u;
    mtc_arena_usage(a, creator, &u);
    const char *holders =
        f->loaders ? "all of them its loaders' own: the DataLoader keeps the batches that arrive ahead of the one "
                     "it hands out next (it hands them out in order), the PrefetchLoader the ones it copies"
                   : "received, and not yet unpacked or dropped: by the DataLoader, which keeps the batches that "
                     "arrive ahead of the one it hands out next (it hands them out in order), or by the loop";
    int small = !f->batches || _pack_need(f, rounded) > as.bytes;
    const char *keep = "";
    if (!f->loaders && u.owner_regions)
        keep = small ? "A loop that keeps the PackedBatch objects it receives (in a list, or referenced beyond its "
                       "step) fills an arena of any size: unpack each one (batch.to(device), or iterate a "
                       "PrefetchLoader) and keep what it unpacks to, or drop it. Otherwise: "
                     : "A loop that keeps the PackedBatch objects it receives (in a list, or referenced beyond its "
                       "step) fills an arena of any size: unpack each one (batch.to(device), or iterate a "
                       "PrefetchLoader) and keep what it unpacks to, or drop it. ";
    PyErr_Format(PyExc_RuntimeError,
                 "mtc_loader: the shared arena (%llu bytes, %llu in use) stayed full too long to take a packed "
                 "batch of %lld bytes: %llu batches (%llu bytes) are held by the training process (pid %u, %s), "
                 "%llu (%llu bytes) by other processes (DataLoader workers: packed, not yet received). %s%U",
                 (unsigned long long)as.bytes, (unsigned long long)(as.slots_in_use * as.slot_bytes),
                 (long long)payload, (unsigned long long)u.owner_regions,
                 (unsigned long long)(u.owner_slots * as.slot_bytes), (unsigned)creator, holders,
                 (unsigned long long)u.other_regions, (unsigned long long)(u.other_slots * as.slot_bytes), keep,
                 advice);
    Py_DECREF(advice);
    return -1;
}

/* The check of a process's first pack, where the consumer said what its
 * loader needs: an arena that cannot hold `least` batches of this one's size
 * can leave every worker waiting for room that only the batch the DataLoader
 * hands out next would free (it hands batches out in order, and keeps those
 * packed ahead of that one): a stall until the timeout. Refused at once, with
 * the size to configure for the whole flight. 0, or -1 with RuntimeError. */
static int _pack_check_in_flight(mtc_arena *a, int64_t payload, const _in_flight *f)
{
    if (!f->least || !f->batches) return 0;
    int64_t slot = (int64_t)a->slot_bytes, rounded = _pack_rounded(slot, payload);
    uint64_t per = (uint64_t)(rounded / slot), holds = a->nslots / per;
    if (holds >= f->least) return 0;
    uint64_t arena_bytes = (uint64_t)a->nslots * a->slot_bytes;
    PyObject *advice = _pack_advice(f, rounded, "this batch", arena_bytes);
    if (!advice) return -1;
    PyErr_Format(PyExc_RuntimeError,
                 "mtc_loader: the shared arena (%llu bytes) holds %llu packed batch%s of this one's %lld bytes, "
                 "and the DataLoader needs room for %llu at once to go on (%U): with less, every worker can end "
                 "up waiting for room that only the batch the DataLoader hands out next would free. %U; more "
                 "where later batches are larger",
                 (unsigned long long)arena_bytes, (unsigned long long)holds, holds == 1 ? "" : "es",
                 (long long)payload, (unsigned long long)f->least, f->least_why, advice);
    Py_DECREF(advice);
    return -1;
}

/* Takes a region of `payload` bytes for this process, waiting up to timeout_ns
 * (< 0: forever) with the GIL released, in slices: a signal (Ctrl-C) ends the
 * wait with its exception, as in get(), and so does the exit of the process
 * that created the arena or of `consumer` (0: none), the process this one
 * packs for: a DataLoader worker's parent, which is not the arena's creator
 * where a launcher made the PackedCollate and handed it to a rank process.
 * Only the consumer frees room, and torch's own watchdog cannot run while
 * the worker waits here. 0 and *off, or -1 with an error that says which
 * arena size to configure. */
static int _pack_alloc_region(mtc_arena *a, int64_t payload, int64_t timeout_ns, uint32_t me, uint32_t consumer,
                              const _in_flight *f, uint64_t *off)
{
    mtc_arena_wait w;
    mtc_arena_wait_init(&w, timeout_ns);
    int rc;
    for (;;) {
        Py_BEGIN_ALLOW_THREADS
        rc = mtc_arena_alloc_slice(a, (uint64_t)(payload ? payload : 1), me, &w, 100000000, off); /* 100 ms */
        Py_END_ALLOW_THREADS
        if (rc != -EAGAIN) break;
        if (PyErr_CheckSignals()) return -1;
        if (me != a->hdr->creator_pid && mtc_arena_creator_gone(a)) {
            PyErr_Format(PyExc_RuntimeError,
                         "mtc_loader: the process that created this PackedCollate's arena (pid %u, "
                         "the training process) has exited while process %u waited for room in it; "
                         "no room will come, so this process stops packing",
                         (unsigned)a->hdr->creator_pid, (unsigned)me);
            return -1;
        }
        /* the parent's exit reparents this process: getppid() tells at once,
         * the pid check covers a consumer that is not the parent */
        if (consumer && consumer != me && ((uint32_t)getppid() != consumer || mtc_arena_pid_gone(consumer))) {
            PyErr_Format(PyExc_RuntimeError,
                         "mtc_loader: the process this DataLoader worker packs batches for (pid %u, its "
                         "parent) has exited while process %u waited for room in the shared arena; no room "
                         "will come, so this process stops packing", (unsigned)consumer, (unsigned)me);
            return -1;
        }
    }
    if (!rc) return 0;
    if (rc == -E2BIG || rc == -ETIMEDOUT) return _pack_too_big(a, payload, rc, f);
    PyErr_Format(PyExc_RuntimeError, "mtc_loader: arena allocation failed: %s", strerror(-rc));
    return -1;
}

/* Checks that the plan put every leaf into one chunk that fits the arena (the
 * planner was asked for chunks of at most the arena's size): a leaf that is
 * not packed is larger than the whole arena (an expanded view is packed with
 * every element), and a second chunk means the batch is. 0, or -1 with an
 * error naming the leaf or the size to configure. */
static int _pack_check_plan(mtc_arena *a, const mtc_tree *t, const mtc_plan *p, int64_t arena_bytes,
                            const _in_flight *f)
{
    for (uint32_t i = 0; i < t->nleaves; i++) {
        const mtc_leaf *l = &t->leaves[i];
        if (l->action == MTC_ACT_PACK) continue;
        PyObject *path = mtc_leaf_path(t, i);
        if (!path) return -1;
        /* an expanded view (a 0 stride on a dim of more than one element) is
         * packed with every element it shows */
        int expanded = 0;
        for (int32_t d = 0; d < l->ndim; d++)
            if (t->shape[l->dims + d] > 1 && t->strides[l->dims + d] == 0) expanded = 1;
        if (l->nbytes == INT64_MAX)
            PyErr_Format(PyExc_RuntimeError,
                         "mtc_loader: %U spans 2^63 bytes or more (an expanded view, e.g. .expand() or "
                         "np.broadcast_to), more than any arena_bytes: pack the tensor it expands, and "
                         "expand it after loading", path);
        else {
            PyObject *advice = _pack_advice(f, _pack_rounded((int64_t)a->slot_bytes, l->nbytes), "this tensor alone",
                                            (uint64_t)arena_bytes);
            if (advice)
                PyErr_Format(PyExc_RuntimeError,
                             "mtc_loader: %U takes %lld bytes packed%s, more than the whole shared arena "
                             "(%lld bytes). %U; the whole batch takes more than this tensor%s",
                             path, (long long)l->nbytes,
                             expanded ? " (an expanded view is packed with every element it shows)" : "",
                             (long long)arena_bytes, advice, expanded ? ". Or expand the tensor after loading" : "");
            Py_XDECREF(advice);
        }
        Py_DECREF(path);
        return -1;
    }
    if (p->nchunks > 1) {
        int64_t total = 0;
        for (uint32_t k = 0; k < p->nchunks; k++)
            if (__builtin_add_overflow(total, p->chunks[k].payload, &total)) total = INT64_MAX;
        return _pack_too_big(a, total, -E2BIG, f);
    }
    return 0;
}

/* Writes every leaf of t into the region at `dst` as plan p places them: one
 * host-copy job run here with the GIL released (helpers for big leaves; the
 * FileTensor leaves read straight into the region, one batch of reads). The
 * contiguous leaves are written with streaming stores (MTC_PACK_NT=0: with
 * memcpy): what the region holds is read next by a DMA or by another
 * process, so its lines are neither read before they are written nor left to
 * push the rest of the machine's work out of the shared cache.
 * 0, or -1 with MemoryError or the exception of a failed file read. */
static int _pack_write(const mtc_tree *t, const mtc_plan *p, uint8_t *dst)
{
    if (!t->nleaves) return 0;
    mtc_job *job = mtc_job_new(1, t->nleaves);
    if (!job) {
        PyErr_NoMemory();
        return -1;
    }
    job->target = MTC_DEV_CPU;
    job->ops[0] = (mtc_op){.kind = MTC_OP_HOST_COPY, .dev = -1, .first = 0, .count = t->nleaves,
                           .nt = mtc_env_bool(MTC_ENV_PACK_NT, 1)};
    for (uint32_t i = 0; i < t->nleaves; i++)
        mtc_item_of_leaf(&job->items[i], t, i, (uintptr_t)(dst + mtc_plan_leaf_offset(p, &t->leaves[i])));
    job->nops = 1;
    job->nitems = t->nleaves;
    Py_BEGIN_ALLOW_THREADS
    mtc_transfer_run(job);
    Py_END_ALLOW_THREADS
    int rc = 0;
    if (job->err) { /* only file reads fail here */
        rc = -1;
        PyObject *exc = job->err_leaf >= 0 && (t->leaves[job->err_leaf].flags & MTC_LEAF_FILE)
                            ? mtc_leaf_file_error(t, (uint32_t)job->err_leaf, job->err_part, job->err, job->err_got)
                            : (PyErr_Format(PyExc_RuntimeError, "mtc_loader: packing the batch failed while %s: %s",
                                            job->err_where, strerror(-job->err)), NULL);
        if (exc) {
            PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
            Py_DECREF(exc);
        }
    }
    mtc_job_release(job);
    return rc;
}

/* The descriptor's layout (bytes), skeleton (the structure with LEAF in
 * each tensor's place) and atoms: for a structure that batches may share
 * (skeleton.h), the skeleton has ATOM in each passthrough atom's place and
 * atoms is the tuple of those atoms; else atoms is None. 0 with three new
 * references, or -1 with an exception. */
static int _pack_describe(mtc_state *st, const mtc_tree *t, const mtc_plan *p, PyObject **layout,
                          PyObject **skeleton, PyObject **atoms)
{
    PyObject **slots = NULL;
    size_t lsize = mtc_layout_size(t->leaves, t->nleaves, p);
    if (!(*layout = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)lsize))) goto error;
    int rc = mtc_layout_encode(t->leaves, t->nleaves, t->shape, t->ostrides, p,
                               (uint8_t *)PyBytes_AS_STRING(*layout), lsize);
    if (rc) {
        PyErr_Format(PyExc_SystemError, "mtc_loader: layout encoding failed (%d)", rc);
        goto error;
    }
    if (!(slots = PyMem_Malloc((t->nleaves ? t->nleaves : 1) * sizeof *slots))) {
        PyErr_NoMemory();
        goto error;
    }
    for (uint32_t i = 0; i < t->nleaves; i++) slots[i] = st->leaf_slot;
    if (mtc_skeleton_atoms_only(t)) {
        if (mtc_skeleton_share(st, t, slots, skeleton, atoms)) goto error;
    } else {
        if (!(*skeleton = mtc_rebuild(st, t, slots, NULL))) goto error;
        *atoms = Py_NewRef(Py_None);
    }
    PyMem_Free(slots);
    return 0;
error:
    PyMem_Free(slots);
    Py_CLEAR(*layout);
    return -1;
}

/* Parses pack()'s in_flight argument: None, or (batches, why, least,
 * least_why, loaders) as PackedCollate passes it (least 0: no check). 0, or
 * -1 with an exception. */
static int _pack_parse_in_flight(PyObject *o, _in_flight *f)
{
    memset(f, 0, sizeof *f);
    if (o == Py_None) return 0;
    unsigned long long batches, least;
    if (!PyTuple_Check(o) ||
        !PyArg_ParseTuple(o, "KUKUp", &batches, &f->why, &least, &f->least_why, &f->loaders)) {
        if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_SetString(PyExc_TypeError,
                            "pack: in_flight must be None or (batches, why, least, least_why, loaders)");
        }
        return -1;
    }
    if (!batches || least > batches) {
        PyErr_SetString(PyExc_ValueError, "pack: in_flight needs 1 <= batches and least <= batches");
        return -1;
    }
    f->batches = batches;
    f->least = least;
    return 0;
}

/* pack(arena, data, align, timeout_s[, consumer_pid[, in_flight[, numpy_tensors]]])
 *   -> (offset, nbytes, layout, skeleton, atoms)
 * In a DataLoader worker: every tensor / numpy leaf of data is written into
 * one arena region, laid out by the planner as one chunk: read the leaves,
 * plan, take a region, write, describe (_pack_describe: atoms is None or the
 * per-batch atoms of a structure batches may share). in_flight (see
 * _in_flight) sizes the advice of an "arena too small" error and, with its
 * `least` set, refuses at once a batch the arena cannot hold enough of. New
 * reference, or NULL with an exception set (the region, if taken, is freed). */
PyObject *mtc_collate_pack(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    mtc_state *st = mtc_get_state(module);
    if (nargs < 4 || nargs > 7) {
        PyErr_SetString(PyExc_TypeError,
                        "pack(arena, data, align, timeout_s[, consumer_pid[, in_flight[, numpy_tensors]]])");
        return NULL;
    }
    mtc_arena *a = mtc_arenaobj_of(st, args[0]);
    if (!a) return NULL;
    mtc_plan_opts o;
    mtc_plan_default_opts(&o, 0); /* "to a device": every host leaf is packed */
    o.align = PyLong_AsLongLong(args[2]);
    double timeout = PyFloat_AsDouble(args[3]);
    unsigned long consumer = nargs >= 5 ? PyLong_AsUnsignedLong(args[4]) : 0;
    if (PyErr_Occurred()) return NULL;
    _in_flight f;
    if (_pack_parse_in_flight(nargs >= 6 ? args[5] : Py_None, &f)) return NULL;
    if (consumer > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "pack: consumer_pid must be a pid or 0");
        return NULL;
    }
    if (o.align < 1 || o.align > MTC_LAYOUT_MAX_ALIGN || (o.align & (o.align - 1))) {
        PyErr_SetString(PyExc_ValueError, "mtc_loader: the arena alignment must be a power of two <= 4096");
        return NULL;
    }
    if (timeout != timeout) {
        PyErr_SetString(PyExc_ValueError, "mtc_loader: PackedCollate's timeout must be a number of seconds "
                        "(negative: wait forever), got nan");
        return NULL;
    }
    /* negative, infinite or past int64 nanoseconds: forever */
    int64_t timeout_ns = timeout < 0 || timeout >= 9.2e9 ? -1 : (int64_t)(timeout * 1e9);
    /* one chunk of at most the arena: a leaf or batch past it is refused by name */
    int64_t arena_bytes = (int64_t)a->nslots * (int64_t)a->slot_bytes;
    o.max_chunk = o.pack_limit = arena_bytes;
    mtc_tree t;
    memset(&t, 0, sizeof t);
    mtc_plan plan;
    memset(&plan, 0, sizeof plan);
    PyObject *res = NULL, *layout = NULL, *skeleton = NULL, *atoms = NULL;
    uint64_t off = 0;
    int have_region = 0;
    uint32_t me = (uint32_t)getpid();
    t.pack = 1; /* OnHost is walked into: its leaves are host-placed */
    /* numpy arrays stay numpy (pickled in the skeleton), unless the consumer asked for tensors */
    int numpy_tensors = nargs == 7 ? PyObject_IsTrue(args[6]) : 0;
    if (numpy_tensors < 0) return NULL;
    t.numpy_pass = !numpy_tensors;
    if (mtc_traverse(st, args[1], &t) || _pack_refuse_cuda(&t)) goto error;
    if (t.nleaves > MTC_LAYOUT_MAX_LEAVES) { /* the main process's decoder takes no more */
        PyErr_Format(PyExc_ValueError, "mtc_loader: the batch holds %u tensors and arrays; a packed batch "
                     "holds at most %u (2^22): split it into smaller batches", t.nleaves,
                     (unsigned)MTC_LAYOUT_MAX_LEAVES);
        goto error;
    }
    int rc = mtc_plan_build(&plan, t.leaves, t.nleaves, t.shape, &o);
    if (rc) {
        PyErr_Format(PyExc_ValueError, "mtc_loader: planning the packed batch failed (%s)", strerror(-rc));
        goto error;
    }
    if (_pack_check_plan(a, &t, &plan, arena_bytes, &f)) goto error;
    int64_t payload = plan.nchunks ? plan.chunks[0].payload : 0;
    if (_pack_check_in_flight(a, payload, &f)) goto error;
    if (_pack_alloc_region(a, payload, timeout_ns, me, (uint32_t)consumer, &f, &off)) goto error;
    have_region = 1;
    /* the region's pages into this process's page tables in one call, the
     * first time this process writes its slots (see mtc_arena_populate) */
    Py_BEGIN_ALLOW_THREADS
    mtc_arena_populate(a, off, (uint64_t)payload);
    Py_END_ALLOW_THREADS
    if (_pack_write(&t, &plan, a->base + off) || _pack_describe(st, &t, &plan, &layout, &skeleton, &atoms))
        goto error;
    if (!(res = Py_BuildValue("(KLOOO)", (unsigned long long)off, (long long)payload, layout, skeleton, atoms)))
        goto error;
    have_region = 0; /* handed to the descriptor */
error:
    if (have_region) mtc_arena_free(a, off, me);
    Py_XDECREF(layout);
    Py_XDECREF(skeleton);
    Py_XDECREF(atoms);
    mtc_plan_free(&plan);
    mtc_tree_clear(&t);
    return res;
}
