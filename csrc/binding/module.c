/*
 * module.c - the _engine module itself, the top of the binding wing: nothing
 * calls into it. Its state (state.h), method table and multi-phase init, _setup() (the torch objects and Python helpers the engine
 * uses), stats(), configure/trim/shutdown. The work lives elsewhere, one file
 * per stage (docs/design.md, "Where to find what"): copy.c (start_copy),
 * handle.c (get/ready), outputs.c (torch outputs and views), collate.c and
 * unpack.c (the packed-batch side).
 */
#include "state.h"

#include <errno.h>
#include <string.h>

#include "collate.h"
#include "collector.h"
#include "copy.h"
#include "cuda.h"
#include "env.h"
#include "files.h"
#include "pipes.h"
#include "handle.h"
#include "hostcopy.h"
#include "skeleton.h"
#include "pinned.h"
#include "slab.h"
#include "transfer.h"
#include "nvtx.h"
#include "shim.h"
#include "uring.h"

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

/* torch's DLPack exchange table (cfg["dlpack_api"]: the capsule, or None),
 * and the DLPack dtype of each of the engine's dtypes, learnt from torch
 * itself: cfg["dlpack_samples"][code] is an empty tensor of dtype `code`. A
 * DLPack dtype two torch dtypes share, or none has, maps to -1: such leaves
 * are read through their dtype attribute. cfg["dlpack_others"] holds empty
 * tensors of the dtypes torch has and the engine does not copy: a DLPack
 * dtype one of them shares with one of ours is marked in dl_verify, and its
 * leaves' dtype attribute is checked (so that an int4 tensor is refused as
 * the attribute path refuses it, not copied as int8). No table (an older
 * torch, another major version): every leaf is read through its attributes.
 * 0 or -1. */
static int _setup_dlpack(mtc_state *st, PyObject *cfg)
{
    st->dl_view = st->dl_offered = NULL;
    memset(st->dl_codes, -1, sizeof st->dl_codes);
    memset(st->dl_verify, 0, sizeof st->dl_verify);
    PyObject *cap = PyDict_GetItemString(cfg, "dlpack_api");
    PyObject *samples = PyDict_GetItemString(cfg, "dlpack_samples");
    PyObject *others = PyDict_GetItemString(cfg, "dlpack_others");
    st->dl_why = "this torch has no DLPack C exchange table (torch.Tensor.__dlpack_c_exchange_api__, torch "
                 "2.10 and later)";
    if (!cap || cap == Py_None) return 0;
    if (!PyCapsule_IsValid(cap, "dlpack_exchange_api") || !samples || !PyList_Check(samples) ||
        PyList_GET_SIZE(samples) != st->ndtypes || !others || !PyList_Check(others)) {
        PyErr_SetString(PyExc_TypeError, "_setup: bad dlpack_api capsule or dlpack_samples");
        return -1;
    }
    const mtc_dl_api *api = PyCapsule_GetPointer(cap, "dlpack_exchange_api");
    if (!api) return -1;
    while (api && api->header.version.major != MTC_DL_MAJOR) api = (const mtc_dl_api *)api->header.prev_api;
    if (!api || !api->dltensor_from_py_object_no_sync) {
        st->dl_why = "torch's DLPack C exchange table is of another major version than the engine reads";
        return 0;
    }
    st->dl_why = NULL;
    mtc_dl_view_fn view = api->dltensor_from_py_object_no_sync;
    for (int c = 0; c < st->ndtypes; c++) {
        mtc_dl_tensor dl;
        if (view(PyList_GET_ITEM(samples, c), &dl)) {
            PyErr_Clear(); /* a dtype DLPack cannot describe: read through the attribute */
            continue;
        }
        if (dl.dtype.lanes != 1 || dl.dtype.code >= MTC_DL_CODES || dl.dtype.bits != 8 * st->elsize[c]) continue;
        int8_t *slot = &st->dl_codes[dl.dtype.code][dl.dtype.bits];
        *slot = *slot == -1 ? (int8_t)c : (int8_t)-2;
    }
    for (int k = 0; k < MTC_DL_CODES; k++)
        for (int b = 0; b < 256; b++)
            if (st->dl_codes[k][b] < 0) st->dl_codes[k][b] = -1;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(others); i++) {
        mtc_dl_tensor dl;
        if (view(PyList_GET_ITEM(others, i), &dl)) {
            PyErr_Clear();
            continue;
        }
        if (dl.dtype.lanes == 1 && dl.dtype.code < MTC_DL_CODES) st->dl_verify[dl.dtype.code][dl.dtype.bits] = 1;
    }
    st->dl_view = st->dl_offered = view;
    return 0;
}

/* _use_dlpack(flag) -> bool: whether leaves are read through torch's DLPack
 * table (when torch offers one); returns the previous setting. For tests,
 * which compare the two readers. */
static PyObject *engine_use_dlpack(PyObject *module, PyObject *flag)
{
    mtc_state *st = mtc_get_state(module);
    int on = PyObject_IsTrue(flag);
    if (on < 0) return NULL;
    PyObject *prev = PyBool_FromLong(st->dl_view != NULL);
    st->dl_view = on ? st->dl_offered : NULL;
    return prev;
}

/* _use_shim_reader(flag) -> bool: whether exact tensors' metadata is read
 * through torch's C shim (when this torch passed the reader's checks);
 * returns the previous setting. For tests and benchmarks, which compare the
 * readers; MTC_TORCH_SHIM=0 sets it off at start. */
static PyObject *engine_use_shim_reader(PyObject *module, PyObject *flag)
{
    mtc_state *st = mtc_get_state(module);
    int on = PyObject_IsTrue(flag);
    if (on < 0) return NULL;
    PyObject *prev = PyBool_FromLong(st->sr.on);
    st->sr.on = on && st->sr.offered;
    return prev;
}

/* _use_shim_wrap(flag) -> bool: whether each output handle becomes a Python
 * tensor through torch's own wrapper (where this torch passed its check at
 * setup) rather than a batch's handles through torch._C._aoti in one call;
 * returns the previous setting. For tests and benchmarks. */
static PyObject *engine_use_shim_wrap(PyObject *module, PyObject *flag)
{
    mtc_state *st = mtc_get_state(module);
    int on = PyObject_IsTrue(flag);
    if (on < 0) return NULL;
    PyObject *prev = PyBool_FromLong(st->shim_wrap_on);
    st->shim_wrap_on = on && st->shim_wrap != NULL;
    return prev;
}

/* _shim_parts() -> dict: what of torch's C shim this process uses beside
 * the output views: the leaf reader ("reader": offered, "reader_on"), the
 * lazy bits read in C ("native_bits"), torch's own wrapper of each output
 * ("wrap": offered, "wrap_on"), the DLPack reader ("dlpack": offered,
 * "dlpack_on"), whether MTC_TORCH_SHIM=0 turned the shim off ("env_off"),
 * and why a route is not offered ("shim_why", "wrap_why", "reader_why",
 * "dlpack_why": a str, or None where it is offered or the reason is the
 * Python side's). */
static PyObject *engine_shim_parts(PyObject *module, PyObject *unused)
{
    mtc_state *st = mtc_get_state(module);
    return Py_BuildValue("{sOsOsOsOsOsOsOsOszszszsz}", "reader", st->sr.offered ? Py_True : Py_False,
                         "reader_on", st->sr.on ? Py_True : Py_False,
                         "native_bits", st->sr.is_neg ? Py_True : Py_False,
                         "wrap", st->shim_wrap ? Py_True : Py_False,
                         "wrap_on", st->shim_wrap_on ? Py_True : Py_False,
                         "dlpack", st->dl_offered ? Py_True : Py_False,
                         "dlpack_on", st->dl_view ? Py_True : Py_False,
                         "env_off", st->shim_env_off ? Py_True : Py_False,
                         "shim_why", st->shim_why, "wrap_why", st->wrap_why, "reader_why", st->reader_why,
                         "dlpack_why", st->dl_why);
}

/* _use_shim(flag) -> bool: whether output views are made through torch's C
 * shim (when torch offers it); returns the previous setting. For tests and
 * benchmarks, which compare the two makers; MTC_TORCH_SHIM=0 sets it off at
 * start. */
static PyObject *engine_use_shim(PyObject *module, PyObject *flag)
{
    mtc_state *st = mtc_get_state(module);
    int on = PyObject_IsTrue(flag);
    if (on < 0) return NULL;
    PyObject *prev = PyBool_FromLong(st->shim_on);
    st->shim_on = on && st->shim_offered;
    return prev;
}

/* _shim_info() -> (offered, on): whether this torch has the C shim, and
 * whether outputs are made through it now. */
static PyObject *engine_shim_info(PyObject *module, PyObject *unused)
{
    mtc_state *st = mtc_get_state(module);
    return Py_BuildValue("(OO)", st->shim_offered ? Py_True : Py_False, st->shim_on ? Py_True : Py_False);
}

/* _setup(cfg: dict): receives torch objects and the Python helpers. */
static PyObject *engine_setup(PyObject *module, PyObject *cfg)
{
    mtc_state *st = mtc_get_state(module);
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
        _take(cfg, "m_storage_offset", &st->m_storage_offset) || _take(cfg, "m_untyped_storage", &st->m_untyped_storage) ||
        _take(cfg, "leaf_slot", &st->leaf_slot) || _take(cfg, "atom_slot", &st->atom_slot))
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
    if (_setup_dlpack(st, cfg)) return NULL;
    if (mtc_shim_setup(st, cfg)) return NULL;
    Py_XSETREF(st->type_cache, PyDict_New());
    if (!st->type_cache) return NULL;
    st->ready = 1;
    Py_RETURN_NONE;
}

/* _forget_types(): empties the per-type classification cache, so that a
 * container registered after its type was first met takes effect (the
 * traversal asks _tree.classify again). Traversals hold the GIL between a
 * cache lookup and the use of its answer, so none sees a half-cleared cache;
 * the generation tells a traversal whose classify call ran across this one
 * (other threads ran meanwhile) not to keep its answer. */
static PyObject *engine_forget_types(PyObject *module, PyObject *unused)
{
    mtc_state *st = mtc_get_state(module);
    st->type_gen++;
    if (st->type_cache) PyDict_Clear(st->type_cache);
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
    mtc_transfer_stats e;
    mtc_transfer_get_stats(&e);
    PyObject *d = PyDict_New();
    if (!d) return NULL;
#define P(name, v) if (_put(d, name, (unsigned long long)(v))) goto error
    P("calls", mtc_cnt.calls); P("leaves", mtc_cnt.leaves);
    P("leaves_read_dlpack", mtc_cnt.leaves_dlpack); P("leaves_read_shim", mtc_cnt.leaves_shim); P("tensors_packed", mtc_cnt.packed);
    P("tensors_reused", mtc_cnt.reused); P("numpy_zero_copy", mtc_cnt.from_numpy);
    P("host_copies", mtc_cnt.host_copies); P("tensors_staged", mtc_cnt.staged);
    P("tensors_direct", mtc_cnt.direct); P("tensors_d2h", mtc_cnt.d2h); P("tensors_d2d", mtc_cnt.d2d);
    P("made_contiguous", mtc_cnt.made_contiguous); P("segments", mtc_cnt.segments);
    P("chunks", mtc_cnt.chunks);
    P("ns_traverse", mtc_cnt.ns_traverse); P("ns_plan", mtc_cnt.ns_plan);
    P("ns_outputs", mtc_cnt.ns_outputs); P("ns_views", mtc_cnt.ns_views); P("ns_get_wait", mtc_cnt.ns_wait);
    P("unpacks", mtc_cnt.unpacks); P("ns_unpack_decode", mtc_cnt.ns_unpack_decode);
    P("ns_unpack_copy", mtc_cnt.ns_unpack_copy); P("ns_unpack_views", mtc_cnt.ns_unpack_views);
    P("ns_unpack_rebuild", mtc_cnt.ns_unpack_rebuild); P("gc_early_collections", mtc_cnt.gc_early);
    P("shim_views", mtc_cnt.shim_views);
    P("unpack_chunks_shim", mtc_cnt.unpack_chunks_shim); P("unpack_chunks_python", mtc_cnt.unpack_chunks_python);
    P("unpack_dma_in_alloc_window", mtc_cnt.unpack_dma_in_alloc_window);
    P("side_finish_c", mtc_cnt.side_finish_c); P("hand_out_c", mtc_cnt.hand_out_c);
    P("pipe_reads_quiet", mtc_cnt.pipe_reads_quiet); P("pipe_reads_waited", mtc_cnt.pipe_reads_waited);
    P("pipe_writes_quiet", mtc_cnt.pipe_writes_quiet);
#define _P(f, key) P(key, e.f);
    MTC_COUNTERS(_P)
#undef _P
    P("jobs_in_flight", e.jobs_submitted + e.jobs_inline - e.jobs_done);
    P("helper_threads", mtc_pool_size());
    P("pinned_cap_bytes", mtc_pinned_cap());
    mtc_slab_stats tot;
    memset(&tot, 0, sizeof tot);
    for (int dv = 0; dv < MTC_MAX_DEVICES; dv++) {
        mtc_slab_stats s;
        if (mtc_pinned_stats(dv, &s)) continue;
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
    if (mtc_files_stats(d)) goto error;
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
        PyErr_SetString(PyExc_ValueError, "mtc_loader: pinned_cap_bytes must be positive");
        return NULL;
    }
    mtc_pinned_set_cap((size_t)v);
    Py_RETURN_NONE;
}

static PyObject *engine_trim(PyObject *module, PyObject *unused)
{
    size_t n;
    Py_BEGIN_ALLOW_THREADS
    n = mtc_pinned_trim();
    Py_END_ALLOW_THREADS
    return PyLong_FromSize_t(n);
}

static PyObject *engine_shutdown(PyObject *module, PyObject *unused)
{
    Py_BEGIN_ALLOW_THREADS
    mtc_transfer_shutdown();
    mtc_uring_shutdown();
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* _memcpy_bench(dst, src, nbytes, threads, reps, nt, window=0) -> [seconds per
 * rep]: the aggregate host copy bandwidth of `threads` threads (bench/bench_copy.py's
 * ceiling; dst and src are raw addresses the caller keeps alive; with a window,
 * dst holds threads * window bytes: see mtc_memcpy_bench). Returns a
 * new reference, or NULL with an exception set. */
static PyObject *engine_memcpy_bench(PyObject *module, PyObject *args)
{
    unsigned long long dst, src, n, window = 0;
    int threads, reps, nt;
    if (!PyArg_ParseTuple(args, "KKKiii|K", &dst, &src, &n, &threads, &reps, &nt, &window)) return NULL;
    if (threads < 1 || threads > 64 || reps < 1 || reps > 10000) {
        PyErr_SetString(PyExc_ValueError, "mtc_loader: _memcpy_bench needs 1 <= threads <= 64, 1 <= reps <= 10000");
        return NULL;
    }
    double *secs = PyMem_Calloc((size_t)reps, sizeof *secs);
    if (!secs) return PyErr_NoMemory();
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = mtc_memcpy_bench((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, (size_t)n, threads, reps, nt,
                          (size_t)window, secs);
    Py_END_ALLOW_THREADS
    PyObject *out = NULL;
    if (rc) {
        errno = -rc;
        PyErr_SetFromErrno(PyExc_OSError);
    } else if ((out = PyList_New(reps))) {
        for (int r = 0; r < reps; r++) {
            PyObject *f = PyFloat_FromDouble(secs[r]);
            if (!f) {
                Py_CLEAR(out);
                break;
            }
            PyList_SET_ITEM(out, r, f);
        }
    }
    PyMem_Free(secs);
    return out;
}

static PyObject *engine_cuda_available(PyObject *module, PyObject *unused)
{
    int n = mtc_cuda_device_count();
    return PyLong_FromLong(n < 0 ? 0 : n);
}

/* stream_wait_event(device, stream, event): cuStreamWaitEvent with the GIL
 * held (the prefetch service's hand-out; torch's Stream.wait_event releases
 * the GIL, and taking it back costs the caller up to a switch interval
 * while the service thread holds it). stream and event are the raw handles
 * (torch's Stream.cuda_stream, Event.cuda_event). */
static PyObject *engine_stream_wait_event(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "mtc_loader: stream_wait_event(device, stream, event) takes 3 arguments");
        return NULL;
    }
    long dev = PyLong_AsLong(args[0]);
    if (dev == -1 && PyErr_Occurred()) return NULL;
    uintptr_t stream = (uintptr_t)PyLong_AsVoidPtr(args[1]);
    if (PyErr_Occurred()) return NULL;
    uintptr_t event = (uintptr_t)PyLong_AsVoidPtr(args[2]);
    if (PyErr_Occurred()) return NULL;
    if (dev < 0 || dev >= MTC_MAX_DEVICES || !event) {
        PyErr_Format(PyExc_ValueError, "mtc_loader: stream_wait_event needs a CUDA device index in [0, %d) "
                     "and a recorded event, got device %ld, event %zu", MTC_MAX_DEVICES, dev, (size_t)event);
        return NULL;
    }
    int rc = mtc_cuda_stream_wait_event((int)dev, stream, event);
    if (rc) {
        char desc[256];
        mtc_cuda_describe(rc, desc, sizeof desc);
        PyErr_Format(PyExc_RuntimeError, "mtc_loader: making stream %zu of cuda:%ld wait for a batch's event "
                     "failed: %s", (size_t)stream, dev, desc);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* event_record(device, stream) -> event: a pooled CUDA event recorded on the
 * raw stream, with the GIL held (torch's Event.record releases it, and the
 * prefetch service then waits up to a switch interval to take it back from
 * a launch-bound training thread). Give it back with event_release once a
 * stream waits for it. */
static PyObject *engine_event_record(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "mtc_loader: event_record(device, stream) takes 2 arguments");
        return NULL;
    }
    long dev = PyLong_AsLong(args[0]);
    if (dev == -1 && PyErr_Occurred()) return NULL;
    uintptr_t stream = (uintptr_t)PyLong_AsVoidPtr(args[1]);
    if (PyErr_Occurred()) return NULL;
    if (dev < 0 || dev >= MTC_MAX_DEVICES) {
        PyErr_Format(PyExc_ValueError, "mtc_loader: event_record needs a CUDA device index in [0, %d), got %ld",
                     MTC_MAX_DEVICES, dev);
        return NULL;
    }
    uintptr_t ev = 0;
    int rc = mtc_cuda_event_record((int)dev, stream, &ev);
    if (rc) {
        char desc[256];
        mtc_cuda_describe(rc, desc, sizeof desc);
        PyErr_Format(PyExc_RuntimeError, "mtc_loader: recording a batch's event on stream %zu of cuda:%ld "
                     "failed: %s", (size_t)stream, dev, desc);
        return NULL;
    }
    return PyLong_FromVoidPtr((void *)ev);
}

/* hand_out(device, event) -> stream | None: the prefetch service's hand-out
 * in one call, GIL held throughout (no call here blocks): the calling
 * thread's current stream on the device, read through libtorch_cuda's shim
 * getter (mtc_shim_current_stream), waits on the GPU for the batch's event
 * (cuStreamWaitEvent), and the event goes back to its pool (also when the
 * wait failed). Returns the stream's raw handle. None where the getter is
 * not in use (no shim, MTC_TORCH_SHIM=0): nothing is done then and the
 * event is still the caller's (the caller waits through stream_wait_event). */
static PyObject *engine_hand_out(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "mtc_loader: hand_out(device, event) takes 2 arguments");
        return NULL;
    }
    long dev = PyLong_AsLong(args[0]);
    if (dev == -1 && PyErr_Occurred()) return NULL;
    uintptr_t event = (uintptr_t)PyLong_AsVoidPtr(args[1]);
    if (PyErr_Occurred()) return NULL;
    if (dev < 0 || dev >= MTC_MAX_DEVICES || !event) {
        PyErr_Format(PyExc_ValueError, "mtc_loader: hand_out needs a CUDA device index in [0, %d) and a "
                     "recorded event, got device %ld, event %zu", MTC_MAX_DEVICES, dev, (size_t)event);
        return NULL;
    }
    void *raw = NULL;
    if (mtc_shim_current_stream(mtc_get_state(module), (int)dev, &raw)) Py_RETURN_NONE;
    int rc = mtc_cuda_stream_wait_event((int)dev, (uintptr_t)raw, event);
    mtc_cuda_event_release((int)dev, event); /* the wait took the record's state */
    if (rc) {
        char desc[256];
        mtc_cuda_describe(rc, desc, sizeof desc);
        PyErr_Format(PyExc_RuntimeError, "mtc_loader: making the current stream %zu of cuda:%ld wait for a "
                     "batch's event failed: %s", (size_t)(uintptr_t)raw, dev, desc);
        return NULL;
    }
    mtc_cnt.hand_out_c++;
    return PyLong_FromVoidPtr(raw);
}

/* _c_handoff() -> (on, stream_getter): MTC_C_HANDOFF (read at each call; the
 * prefetch package reads it once, at import), and whether hand_out can read
 * the current stream through the shim (else it returns None). */
static PyObject *engine_c_handoff(PyObject *module, PyObject *unused)
{
    (void)unused;
    mtc_state *st = mtc_get_state(module);
    int on = mtc_env_bool(MTC_ENV_C_HANDOFF, 1), getter = st->shim_stream != NULL && st->shim_on;
    return Py_BuildValue("(OO)", on ? Py_True : Py_False, getter ? Py_True : Py_False);
}

/* event_release(device, event): an event of event_record back to the pool. */
static PyObject *engine_event_release(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "mtc_loader: event_release(device, event) takes 2 arguments");
        return NULL;
    }
    long dev = PyLong_AsLong(args[0]);
    if (dev == -1 && PyErr_Occurred()) return NULL;
    uintptr_t ev = (uintptr_t)PyLong_AsVoidPtr(args[1]);
    if (PyErr_Occurred()) return NULL;
    mtc_cuda_event_release((int)dev, ev);
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------- NVTX */

/* The entry points that run a whole stage, each inside its NVTX range
 * (nvtx.h; nothing but a branch when no tool is attached). Same return
 * convention as the function they wrap. */
#define _NVTX_WRAPPED(name, range, fn)                                                  \
    static PyObject *name(PyObject *module, PyObject *const *args, Py_ssize_t nargs)    \
    {                                                                                  \
        mtc_nvtx_push(range);                                                          \
        PyObject *r = fn(module, args, nargs);                                         \
        mtc_nvtx_pop();                                                                \
        return r;                                                                      \
    }
_NVTX_WRAPPED(engine_start_copy, MTC_NVTX_START_COPY, mtc_copy_start)
_NVTX_WRAPPED(engine_pack, MTC_NVTX_PACK, mtc_collate_pack)
_NVTX_WRAPPED(engine_unpack, MTC_NVTX_UNPACK, mtc_collate_unpack)
#undef _NVTX_WRAPPED

/* nvtx_push(name): a range of the Python side (mtc_loader/_trace.py) in the
 * engine's domain; None. */
static PyObject *engine_nvtx_push(PyObject *module, PyObject *name)
{
    const char *s = PyUnicode_AsUTF8(name);
    if (!s) return NULL;
    mtc_nvtx_push_name(s);
    Py_RETURN_NONE;
}

static PyObject *engine_nvtx_pop(PyObject *module, PyObject *unused)
{
    mtc_nvtx_pop();
    Py_RETURN_NONE;
}

/* nvtx_info() -> {"compiled": built with the NVTX headers, "enabled": a tool
 * may be attached (NVTX_INJECTION64_PATH was set at import)} */
static PyObject *engine_nvtx_info(PyObject *module, PyObject *unused)
{
    return Py_BuildValue("{sOsO}", "compiled", mtc_nvtx_compiled() ? Py_True : Py_False, "enabled",
                         mtc_nvtx_on ? Py_True : Py_False);
}

/* _env_problems(check) -> [str]: the MTC_* variables' refused values not yet
 * reported (env.h), each once; check: parse every variable first, as the
 * readers will. The caller warns with them. */
static PyObject *engine_env_problems(PyObject *module, PyObject *check)
{
    (void)module;
    int all = PyObject_IsTrue(check);
    if (all < 0) return NULL;
    if (all) mtc_env_check_all();
    PyObject *out = PyList_New(0);
    char buf[512];
    while (out && mtc_env_take_problem(buf, sizeof buf)) {
        PyObject *m = PyUnicode_DecodeUTF8(buf, (Py_ssize_t)strlen(buf), "replace");
        if (!m || PyList_Append(out, m)) Py_CLEAR(out);
        Py_XDECREF(m);
    }
    return out;
}

/* ---------------------------------------------------------------- module */

static PyMethodDef engine_methods[] = {
    {"_setup", engine_setup, METH_O, "Hand the engine the torch objects and helpers it uses."},
    {"_use_shim", engine_use_shim, METH_O,
     "_use_shim(flag) -> previous: make output views through torch's C shim (tests compare the makers)."},
    {"_shim_info", engine_shim_info, METH_NOARGS, "_shim_info() -> (offered, on): torch's C shim for the outputs."},
    {"_use_shim_reader", engine_use_shim_reader, METH_O,
     "_use_shim_reader(flag) -> previous: read exact tensors through torch's C shim (tests compare the readers)."},
    {"_use_shim_wrap", engine_use_shim_wrap, METH_O,
     "_use_shim_wrap(flag) -> previous: wrap each output with torch's own C++ wrapper (tests compare the routes)."},
    {"_shim_parts", engine_shim_parts, METH_NOARGS,
     "_shim_parts() -> dict: the leaf reader, the lazy bits and the output wrapper through torch's C shim."},
    {"_use_dlpack", engine_use_dlpack, METH_O,
     "_use_dlpack(flag) -> previous: read tensors through torch's DLPack table (tests compare the readers)."},
    {"_early_gc", mtc_collector_set, METH_O,
     "_early_gc(flag) -> bool: run the middle-generation collection a batch's outputs would trigger "
     "before making them (collector.h); returns the previous setting."},
    {"_env_problems", engine_env_problems, METH_O,
     "_env_problems(check) -> [str]: refused MTC_* environment values not yet reported."},
    {"_forget_types", engine_forget_types, METH_NOARGS, "Classify every type anew (a container was registered)."},
    {"start_copy", (PyCFunction)(void (*)(void))engine_start_copy, METH_FASTCALL,
     "start_copy(data, target, staging, pack, align, max_chunk, background) -> mtc_handle"},
    {"stats", engine_stats, METH_NOARGS, "Engine counters as a dict."},
    {"set_pinned_cap", engine_set_pinned_cap, METH_O, "Cap on pinned staging bytes per device."},
    {"trim", engine_trim, METH_NOARGS, "Free idle pinned slabs; returns bytes freed."},
    {"shutdown", engine_shutdown, METH_NOARGS, "Stop the engine's threads (interpreter exit)."},
    {"_memcpy_bench", engine_memcpy_bench, METH_VARARGS,
     "_memcpy_bench(dst, src, nbytes, threads, reps, nt, window=0) -> [seconds]: host copy bandwidth probe."},
    {"event_record", (PyCFunction)(void (*)(void))engine_event_record, METH_FASTCALL,
     "event_record(device, stream): a pooled event recorded on a raw stream (GIL held)."},
    {"event_release", (PyCFunction)(void (*)(void))engine_event_release, METH_FASTCALL,
     "event_release(device, event): the event back to its pool."},
    {"cuda_device_count", engine_cuda_available, METH_NOARGS, "Devices the CUDA driver sees (0 without one)."},
    {"stream_wait_event", (PyCFunction)(void (*)(void))engine_stream_wait_event, METH_FASTCALL,
     "stream_wait_event(device, stream, event): the stream waits on the GPU for the event (GIL held)."},
    {"hand_out", (PyCFunction)(void (*)(void))engine_hand_out, METH_FASTCALL,
     "hand_out(device, event) -> stream | None: the current stream waits for the event, which is released."},
    {"_c_handoff", engine_c_handoff, METH_NOARGS,
     "_c_handoff() -> (on, stream_getter): MTC_C_HANDOFF, and whether hand_out reads the current stream."},
    {"keep_temporaries", mtc_handle_keep_temporaries, METH_O,
     "keep_temporaries(flag) -> previous: copies started on this thread keep their temporary views "
     "for Handle.temporaries() (the prefetch service's thread)."},
    {"service_thread", mtc_handle_service_thread, METH_O,
     "service_thread(flag) -> previous: the calling thread is a prefetch service's: its copies keep their "
     "temporaries and skip the early collection and the staging of small jobs on the calling thread."},
    {"skeleton", mtc_skeleton_make, METH_O, "skeleton(obj) -> Skeleton: a packed batch's structure walked once."},
    {"arena_create", mtc_collate_arena_create, METH_O, "arena_create(nbytes) -> Arena (memfd, sealed)"},
    {"arena_attach", mtc_collate_arena_attach, METH_O, "arena_attach(fd) -> Arena"},
    {"pack", (PyCFunction)(void (*)(void))engine_pack, METH_FASTCALL,
     "pack(arena, data, align, timeout_s) -> (offset, nbytes, layout, skeleton)"},
    {"unpack", (PyCFunction)(void (*)(void))engine_unpack, METH_FASTCALL,
     "unpack(arena, offset, nbytes, owner, layout, skeleton, target, background, atoms) -> mtc_handle"},
    {"pipe_take", mtc_pipes_take, METH_O,
     "pipe_take(fd) -> bytes or None: the pipe's next multiprocessing message when its header is there."},
    {"pipe_put", (PyCFunction)(void (*)(void))mtc_pipes_put, METH_FASTCALL,
     "pipe_put(fd, payload) -> bool: the message written at once, or False with nothing written."},
    {"_quiet_pipes", mtc_pipes_on, METH_NOARGS, "_quiet_pipes() -> bool: MTC_QUIET_PIPES (default on)."},
    {"nvtx_push", engine_nvtx_push, METH_O, "nvtx_push(name): push an NVTX range in the mtc_loader domain."},
    {"nvtx_pop", engine_nvtx_pop, METH_NOARGS, "Pop the calling thread's innermost NVTX range."},
    {"nvtx_info", engine_nvtx_info, METH_NOARGS, "{'compiled': bool, 'enabled': bool}"},
    {"file_reader", mtc_files_reader, METH_NOARGS, "file_reader() -> (mode, reason or None, forced, built with liburing)"},
    {"file_configure", mtc_files_configure, METH_VARARGS,
     "file_configure(depth, max_io, direct, mode, mincore=False): the file reader's settings (tests)"},
    {NULL, NULL, 0, NULL},
};

static int engine_exec(PyObject *module)
{
    if (mtc_state_import_numpy() < 0) return -1;
    mtc_state *st = mtc_get_state(module);
    st->handle_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &mtc_handle_spec, NULL);
    if (!st->handle_type) return -1;
    st->arena_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &mtc_arena_spec, NULL);
    if (!st->arena_type) return -1;
    st->skeleton_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &mtc_skeleton_spec, NULL);
    if (!st->skeleton_type) return -1;
#define INTERN(field, s) if (!(st->field = PyUnicode_InternFromString(s))) return -1
    INTERN(s_data_ptr, "data_ptr"); INTERN(s_dtype, "dtype"); INTERN(s_shape, "shape");
    INTERN(s_stride, "stride"); INTERN(s_get_device, "get_device"); INTERN(s_is_cuda, "is_cuda");
    INTERN(s_is_neg, "is_neg"); INTERN(s_is_conj, "is_conj"); INTERN(s_contiguous, "contiguous"); INTERN(s_is_contiguous, "is_contiguous");
    INTERN(s_split_with_sizes, "unsafe_split_with_sizes"); INTERN(s_view, "view");
    INTERN(s_as_strided, "as_strided"); INTERN(s_unbind, "unbind"); INTERN(s_is_meta, "is_meta"); INTERN(s_device, "device");
    INTERN(s_pin_memory, "pin_memory"); INTERN(s_resolve, "resolve_conj"); INTERN(s_data, "data");
    INTERN(s_storage_offset, "storage_offset"); INTERN(s_untyped_storage, "untyped_storage"); INTERN(s_nbytes, "nbytes");
#undef INTERN
    st->kw_dtype_device = Py_BuildValue("(ss)", "dtype", "device");
    st->kw_dtype_device_pin = Py_BuildValue("(sss)", "dtype", "device", "pin_memory");
    if (!st->kw_dtype_device || !st->kw_dtype_device_pin) return -1;
    if (mtc_collector_init(st)) return -1;
    mtc_transfer_init_once();
    mtc_nvtx_init();
    if (PyModule_AddObjectRef(module, "Skeleton", (PyObject *)st->skeleton_type)) return -1;
    return PyModule_AddObjectRef(module, "mtc_handle", (PyObject *)st->handle_type);
}

static int engine_traverse(PyObject *module, visitproc visit, void *arg)
{
    mtc_state *st = mtc_get_state(module);
    Py_VISIT(st->handle_type);
    Py_VISIT(st->arena_type);
    Py_VISIT(st->skeleton_type);
    Py_VISIT(st->leaf_slot);
    Py_VISIT(st->atom_slot);
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
    Py_VISIT(st->shim_handle_of);
    Py_VISIT(st->shim_steal);
    Py_VISIT(st->gc_isenabled);
    Py_VISIT(st->gc_get_count);
    Py_VISIT(st->gc_get_threshold);
    Py_VISIT(st->gc_collect);
    Py_VISIT(st->len_dispatch);
    Py_VISIT(st->len_function);
    Py_VISIT(st->mode_refusal); Py_VISIT(st->buffer_refusal);
    return 0;
}

static int engine_clear(PyObject *module)
{
    mtc_state *st = mtc_get_state(module);
    Py_CLEAR(st->handle_type);
    Py_CLEAR(st->arena_type);
    Py_CLEAR(st->skeleton_type);
    Py_CLEAR(st->leaf_slot);
    Py_CLEAR(st->atom_slot);
    Py_CLEAR(st->tensor_type);
    Py_CLEAR(st->torch_empty);
    Py_CLEAR(st->from_numpy);
    Py_CLEAR(st->raw_stream);
    Py_CLEAR(st->uint8);
    Py_CLEAR(st->device_cpu);
    Py_CLEAR(st->dtype_codes);
    for (int i = 0; i < MTC_MAX_DTYPES; i++) Py_CLEAR(st->dtypes[i]);
    Py_CLEAR(st->type_cache);
    Py_CLEAR(st->classify); Py_CLEAR(st->flatten); Py_CLEAR(st->unflatten); Py_CLEAR(st->diagnose);
    Py_CLEAR(st->cuda_device); Py_CLEAR(st->pinned_empty); Py_CLEAR(st->shim_handle_of); Py_CLEAR(st->shim_steal);
    st->shim_on = st->shim_offered = 0;
    Py_CLEAR(st->s_data_ptr); Py_CLEAR(st->s_dtype); Py_CLEAR(st->s_shape); Py_CLEAR(st->s_stride);
    Py_CLEAR(st->s_get_device); Py_CLEAR(st->s_is_cuda); Py_CLEAR(st->s_is_neg); Py_CLEAR(st->s_is_conj);
    Py_CLEAR(st->s_contiguous); Py_CLEAR(st->s_is_contiguous);
    Py_CLEAR(st->d_dtype); Py_CLEAR(st->d_shape); Py_CLEAR(st->d_is_cuda); Py_CLEAR(st->m_data_ptr);
    Py_CLEAR(st->m_get_device); Py_CLEAR(st->m_is_contiguous); Py_CLEAR(st->m_stride);
    Py_CLEAR(st->m_is_neg); Py_CLEAR(st->m_is_conj); Py_CLEAR(st->s_split_with_sizes); Py_CLEAR(st->s_view);
    Py_CLEAR(st->s_as_strided); Py_CLEAR(st->s_unbind); Py_CLEAR(st->s_is_meta); Py_CLEAR(st->s_device);
    Py_CLEAR(st->s_pin_memory); Py_CLEAR(st->s_resolve); Py_CLEAR(st->s_data);
    Py_CLEAR(st->s_storage_offset); Py_CLEAR(st->s_untyped_storage); Py_CLEAR(st->s_nbytes);
    Py_CLEAR(st->m_storage_offset); Py_CLEAR(st->m_untyped_storage); Py_CLEAR(st->buffer_refusal);
    Py_CLEAR(st->len_dispatch); Py_CLEAR(st->len_function); Py_CLEAR(st->mode_refusal);
    Py_CLEAR(st->kw_dtype_device); Py_CLEAR(st->kw_dtype_device_pin);
    mtc_collector_clear(st);
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
