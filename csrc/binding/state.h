/*
 * state.h - the state of the _engine module, shared by every file of the
 * binding wing (csrc/binding/) and below all of them, and the calling-thread
 * counters that stats() reports (state.c). module.c, which makes the module,
 * is above them all: none of them includes or calls it. Everything torch-specific arrives from
 * mtc_loader/_setup.py through _engine._setup(): the engine never imports torch
 * itself and never links against it.
 */
#ifndef MTC_STATE_H
#define MTC_STATE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "dlpack.h"

#define MTC_MAX_DTYPES 64

/* torch's AOTInductor C shim (shim.h): a tensor handle is an opaque pointer */
typedef int32_t (*mtc_shim_reinterpret_fn)(void *self, int64_t ndim, const int64_t *sizes, const int64_t *strides,
                                           int64_t offset_increment, void **ret);
typedef int32_t (*mtc_shim_delete_fn)(void *handle);
typedef int32_t (*mtc_shim_get_dtype_fn)(void *self, int32_t *dtype);
typedef int32_t (*mtc_shim_get_ptr_fn)(void *self, void **ret);
typedef int32_t (*mtc_shim_get_i64p_fn)(void *self, int64_t **ret);
typedef int32_t (*mtc_shim_get_i64_fn)(void *self, int64_t *ret);
typedef int32_t (*mtc_shim_get_i32_fn)(void *self, int32_t *ret);
typedef int32_t (*mtc_shim_code_fn)(void);
/* THPVariable_Wrap(at::TensorBase &&): a Python tensor of an at::Tensor, moved from (an rvalue
 * reference passed as a pointer) */
typedef PyObject *(*mtc_shim_wrap_fn)(void *tensor);
typedef int32_t (*mtc_shim_empty_fn)(int64_t ndim, const int64_t *sizes, const int64_t *strides, int32_t dtype,
                                     int32_t device_type, int32_t device_index, void **ret);
typedef int32_t (*mtc_shim_stream_fn)(int32_t device_index, void **ret_stream);
/* at::native::is_neg / is_conj: bool (const at::Tensor &), a reference passed as a pointer */
typedef _Bool (*mtc_native_bit_fn)(const void *tensor);

/* The leaf reader through torch's C shim (shim.h, leaves.c): a tensor's
 * metadata read from the at::Tensor inside its Python object, with the
 * shim's getters (plain C calls, no Python). */
typedef struct mtc_shim_reader {
    int on;                      /* in use now (offered and not turned off: _use_shim_reader) */
    int offered;                 /* this torch passed the checks of mtc_shim_setup */
    Py_ssize_t cdata;            /* offset of the at::Tensor in torch.Tensor's Python object */
    mtc_shim_get_i32_fn layout, device_type, device_index, dtype;
    mtc_shim_get_i64_fn dim;
    mtc_shim_get_i64p_fn sizes, strides;
    mtc_shim_get_ptr_fn data_ptr;
    mtc_shim_get_i64_fn storage_size, storage_offset; /* the storage's bytes, the tensor's offset in it */
    mtc_native_bit_fn is_neg, is_conj;
    int32_t strided, dev_cpu, dev_cuda; /* the shim's codes of the strided layout, CPU and CUDA */
    int8_t to_code[256];         /* the shim's dtype code -> the engine's, -1 not copied */
} mtc_shim_reader;

/* 1 when a storage of `storage_bytes` holds every byte a strided tensor reads: dims sh[0..ndim),
 * byte strides bs[] (those of dims of size 0 or 1 are not read: torch lets them be anything),
 * `elsize` bytes an element, its first element `offset` bytes into the storage. An empty tensor
 * reads nothing. Integer compares only: called for every leaf and every buffer. */
static inline int mtc_storage_holds(const int64_t *sh, const int64_t *bs, int64_t ndim, int64_t elsize,
                                    int64_t offset, int64_t storage_bytes)
{
    for (int64_t d = 0; d < ndim; d++)
        if (sh[d] == 0) return 1;
    int64_t end = offset, step;
    if (offset < 0 || __builtin_add_overflow(end, elsize, &end)) return 0;
    for (int64_t d = 0; d < ndim; d++) {
        if (sh[d] <= 1) continue;
        if (bs[d] < 0 || __builtin_mul_overflow(sh[d] - 1, bs[d], &step) || __builtin_add_overflow(end, step, &end))
            return 0;
    }
    return end <= storage_bytes;
}

/* dtype flags */
#define MTC_DT_FLOAT   0x1  /* floating point (every dtype may carry the negative bit) */
#define MTC_DT_COMPLEX 0x2  /* may carry the conjugate bit (is_conj) */

/* The per-type classification cache holds its types strongly (a dict keyed by the type), so it
 * is bounded: a program that makes classes per batch (namedtuples, dataclasses) would otherwise
 * keep every one alive. At the bound it starts over; real programs meet far fewer container types. */
#define MTC_TYPE_CACHE_MAX 512

typedef struct mtc_state {
    PyTypeObject *handle_type;
    int ready;                   /* _setup() ran */

    /* torch objects */
    PyObject *tensor_type;       /* torch.Tensor */
    PyObject *torch_empty;       /* torch.empty */
    PyObject *from_numpy;        /* torch.from_numpy */
    PyObject *raw_stream;        /* torch._C._cuda_getCurrentRawStream, or None */
    PyObject *uint8;             /* torch.uint8 */
    PyObject *device_cpu;        /* torch.device("cpu") */
    PyObject *dtype_codes;       /* {torch.dtype: code} */
    PyObject *dtypes[MTC_MAX_DTYPES];   /* code -> torch.dtype */
    int elsize[MTC_MAX_DTYPES];
    int dtflags[MTC_MAX_DTYPES];
    int ndtypes;
    int np_to_code[32];          /* numpy type_num (< 32) -> dtype code, -1 unsupported */
    int np_zerocopy[32];         /* torch.from_numpy accepts this type_num */

    /* Python helpers of mtc_loader._tree */
    PyObject *type_cache;        /* {type: kind} for non-exact types, at most MTC_TYPE_CACHE_MAX */
    uint64_t type_gen;           /* bumped by _forget_types: an answer computed across it is not kept */
    PyObject *classify;          /* type -> kind */
    PyObject *flatten;           /* obj -> (children list, context) */
    PyObject *unflatten;         /* (context, values list) -> obj */
    PyObject *diagnose;          /* (leaf, path, target) -> raises */
    PyObject *cuda_device;       /* index -> torch.device("cuda:index") */
    PyObject *atom_slot;         /* mtc_loader._tree.ATOM: a per-batch atom's place in a shared structure */
    PyObject *leaf_slot;         /* mtc_loader.collate.LEAF: a leaf's place in a packed skeleton */
    PyTypeObject *arena_type;
    PyTypeObject *skeleton_type; /* skeleton.c: a packed batch's structure walked once */
    PyObject *pinned_empty;      /* (nbytes) -> pinned uint8 CPU tensor */
    /* torch._C._len_torch_dispatch_stack / _len_torch_function_stack and
     * mtc_loader._modes.refusal (outputs.h: mtc_out_check_modes), on first use;
     * mode_refusal is None where this torch lacks them */
    PyObject *len_dispatch, *len_function, *mode_refusal;

    /* descriptors of torch.Tensor, called directly for exact tensors (no attribute lookup) */
    PyObject *d_dtype, *d_shape, *d_is_cuda;                     /* getset descriptors */
    PyObject *m_data_ptr, *m_get_device, *m_is_contiguous, *m_stride, *m_is_neg, *m_is_conj;
    PyObject *m_storage_offset, *m_untyped_storage;
    /* mtc_loader._modes.buffer_refusal (outputs.h: mtc_out_check_buffer), on first use */
    PyObject *buffer_refusal;

    /* torch's DLPack C exchange API (dlpack.h): a tensor's metadata in one C
     * call; NULL where this torch lacks it (the Python calls above are used) */
    mtc_dl_view_fn dl_view;
    mtc_dl_view_fn dl_offered;          /* what torch offers; _use_dlpack(False) sets dl_view NULL */
    int8_t dl_codes[MTC_DL_CODES][256]; /* (DLPack code, bits) -> dtype code; -1: not one of ours or
                                         * shared by two torch dtypes (read through dtype instead) */
    uint8_t dl_verify[MTC_DL_CODES][256]; /* 1: a torch dtype the engine does not copy has this
                                           * description too (torch's DLPack calls int1..int7
                                           * int8): the dtype attribute tells them apart */

    /* interned names; s_split_with_sizes is unsafe_split_with_sizes: outputs are not
     * tracked as autograd views of the private chunk (cheaper per view) */
    PyObject *s_data_ptr, *s_dtype, *s_shape, *s_stride, *s_get_device, *s_is_cuda,
        *s_is_neg, *s_is_conj, *s_contiguous, *s_is_contiguous, *s_split_with_sizes, *s_view,
        *s_as_strided, *s_unbind, *s_is_meta, *s_device, *s_pin_memory, *s_resolve, *s_data,
        *s_storage_offset, *s_untyped_storage, *s_nbytes;
    /* the gc module's isenabled, get_count, get_threshold and collect
     * (collector.h); NULL where the collector is not the generational one */
    PyObject *gc_isenabled, *gc_get_count, *gc_get_threshold, *gc_collect;
    int gc_early;                /* mtc_collector_before_outputs runs collections ahead */
    PyObject *kw_dtype_device;   /* ("dtype", "device") */

    /* torch's AOTInductor C shim (shim.h): output views made with one C call
     * each, turned into Python tensors with one call per batch */
    mtc_shim_reinterpret_fn shim_reinterpret; /* aoti_torch__reinterpret_tensor, or NULL */
    mtc_shim_delete_fn shim_delete;           /* aoti_torch_delete_tensor_object */
    int32_t shim_dtype[MTC_MAX_DTYPES];       /* dtype code -> the shim's code of that dtype, -1 unknown */
    PyObject *shim_handle_of;    /* torch._C._aoti.unsafe_alloc_void_ptr_from_tensor */
    PyObject *shim_steal;        /* torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs */
    int shim_offered;            /* this torch has the shim */
    int shim_on;                 /* outputs are made through it (MTC_TORCH_SHIM, _use_shim) */
    mtc_shim_reader sr;          /* leaves read through it (MTC_TORCH_SHIM too) */
    mtc_shim_wrap_fn shim_wrap;  /* torch's own wrapper of a handle, or NULL (the batch's handles go
                                  * through torch._C._aoti in one Python call) */
    int shim_wrap_on;            /* in use now (_use_shim_wrap) */
    /* a packed batch's chunks from torch's allocator through the shim, with the GIL released
     * (mtc_shim_empty): aoti_torch_empty_strided and aoti_torch_get_data_ptr, or NULL */
    mtc_shim_empty_fn shim_empty;
    mtc_shim_get_ptr_fn shim_data_ptr;
    /* and what checks each chunk before it is written: aoti_torch_get_dtype,
     * aoti_torch_get_storage_offset and aoti_torch_get_storage_size */
    mtc_shim_get_i32_fn shim_get_dtype;
    mtc_shim_get_i64_fn shim_storage_offset, shim_storage_size;
    int32_t shim_uint8, shim_dev_cpu, shim_dev_cuda; /* the shim's codes of uint8, CPU and CUDA */
    /* libtorch_cuda's aoti_torch_get_current_cuda_stream (cfg["shim_cuda"]), or NULL */
    mtc_shim_stream_fn shim_stream;
    /* the CUDA devices whose first chunk torch.empty made from Python (torch's own lazy
     * initialisation of the device): later chunks there may come through the shim */
    uint64_t shim_cuda_ready;
    int shim_env_off;            /* MTC_TORCH_SHIM=0 turned the shim off at setup */
    /* why a route is not offered (static strings for output_maker(), NULL: offered, or the
     * reason is the Python side's): the shim's output views, torch's wrapper, the leaf
     * reader through the shim, the DLPack reader */
    const char *shim_why, *wrap_why, *reader_why, *dl_why;
    PyObject *kw_dtype_device_pin; /* ("dtype", "device", "pin_memory") */
} mtc_state;

static inline mtc_state *mtc_get_state(PyObject *module) { return (mtc_state *)PyModule_GetState(module); }

/* Calling-thread counters of start_copy / get() (the GIL serialises their
 * updates); defined in state.c, reported by stats() (module.c). */
typedef struct mtc_counters {
    uint64_t calls, leaves, leaves_dlpack, leaves_shim, packed, reused, from_numpy, host_copies, staged, direct, d2h, d2d,
        made_contiguous, segments, chunks;
    uint64_t ns_traverse, ns_plan, ns_outputs, ns_views, ns_wait;
    /* unpack of a packed batch: calls, and the calling thread's time per stage
     * (layout decode, the DMA or memcpy set-up, views, skeleton and rebuild) */
    uint64_t unpacks, ns_unpack_decode, ns_unpack_copy, ns_unpack_views, ns_unpack_rebuild;
    uint64_t shim_views;         /* output views made through torch's C shim (shim.h) */
    /* the tensors a packed batch lands in, one per dtype of its chunk (unpack.c): from torch's
     * allocator through the shim with the GIL released, or with torch.empty from Python (no
     * shim, or a device's first batch) */
    uint64_t unpack_chunks_shim, unpack_chunks_python;
    /* the CUDA batches whose DMA was issued in the same GIL-free window as their tensors'
     * allocation (unpack.c's _unpack_via_shim) */
    uint64_t unpack_dma_in_alloc_window;
    /* the prefetch service's batches (CUDA targets) finished by Handle.finish (the wait, the
     * copy stream's event recorded in C) and handed out by _engine.hand_out (the current stream
     * read through the shim's getter, the wait and the event's release in C) */
    uint64_t side_finish_c, hand_out_c;
    /* the DataLoader results the prefetch service took from their pipe without giving up the GIL
     * (whole there) / after waiting for the rest GIL-free, and the indices it wrote to a worker's
     * pipe without giving it up (pipes.c) */
    uint64_t pipe_reads_quiet, pipe_reads_waited, pipe_writes_quiet;
    uint64_t gc_early;           /* middle-generation collections run before a batch's outputs (collector.h) */
} mtc_counters;
extern mtc_counters mtc_cnt;

/* Fills numpy's C API table that the binding's numpy calls go through
 * (state.c; called by the module's exec). 0, or -1 with an exception set. */
int mtc_state_import_numpy(void);

#endif /* MTC_STATE_H */
