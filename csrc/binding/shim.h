/*
 * shim.h - torch's AOTInductor C shim, found at run time: the fast maker of
 * output tensors. Where the process's libtorch offers it (2.11 and 2.13
 * do: aoti_torch__reinterpret_tensor and aoti_torch_delete_tensor_object
 * in libtorch_cpu, torch._C._aoti's handle converters), an output view is one
 * C call (a new tensor over the chunk's storage with its sizes, strides and
 * offset: no operator dispatch, no autograd view record, no padding piece
 * between members) and a whole batch's views become Python tensors in one
 * Python call. The engine links no libtorch: the library is opened with
 * RTLD_NOLOAD (only the copy torch already loaded), and without the symbols
 * the outputs are made with torch's split operators (outputs.c).
 *
 * Everything here holds the GIL except mtc_shim_view (plain C, any thread).
 * Functions return 0 / a new reference, or -1 / NULL with an exception set.
 */
#ifndef MTC_SHIM_H
#define MTC_SHIM_H

#include "state.h"

/* cfg["shim"]: None, or (library path, torch._C._aoti.unsafe_alloc_void_ptr_from_tensor,
 * torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs); cfg["dlpack_samples"][code]: an
 * empty tensor of each of the engine's dtypes (their shim codes, for mtc_shim_empty). Needs
 * st->ndtypes set. Sets st->shim_offered;
 * MTC_TORCH_SHIM=0 leaves it unused. A library that is not loaded already, or
 * lacks a symbol, offers nothing (no error). 0 or -1. */
int mtc_shim_setup(mtc_state *st, PyObject *cfg);

/* 1 when outputs are made through the shim now. */
static inline int mtc_shim_on(const mtc_state *st) { return st->shim_on; }

/* A handle (torch's AtenTensorHandle: a new reference to the tensor, owned by
 * the caller, released with mtc_shim_release) of a Python tensor. NULL with an
 * exception set on failure. */
void *mtc_shim_handle(mtc_state *st, PyObject *tensor);

/* A new handle of a tensor over base's storage: base's dtype and device,
 * sizes[ndim], strides[ndim] (elements) and storage offset `offset` elements
 * from base's own. No GIL needed; nothing is checked against the storage's
 * size (the caller's layout is). 0, or -1 (torch refused; *out unset). */
int mtc_shim_view(const mtc_state *st, void *base, int64_t ndim, const int64_t *sizes,
                  const int64_t *strides, int64_t offset, void **out);

/* A new 1-D tensor of `numel` elements of the engine's dtype `code` (-1:
 * uint8) on CUDA device `target` (-1: the CPU) from torch's allocator (for a
 * CUDA device, the caching allocator, on the calling thread's current stream
 * there): its handle in *out, its data in *ptr. No GIL needed (call it with
 * the GIL released). 0, or -1 where the shim does not offer it (or does not
 * know the dtype) or torch refused (out of memory: torch.empty from Python
 * then raises torch's own error), or the tensor torch made is not of that
 * dtype or its storage does not hold `numel` elements from its data pointer
 * (torch.empty from Python then says what differs); nothing is set then. */
int mtc_shim_empty(const mtc_state *st, int target, int code, int64_t numel, void **out, uintptr_t *ptr);

/* 1 when mtc_shim_empty is offered and in use for `target` (a CUDA device
 * once its first chunk was made from Python: see state.h). */
static inline int mtc_shim_empty_on(const mtc_state *st, int target)
{
    return st->shim_on && st->shim_empty && st->shim_wrap_on &&
           (target < 0 || (target < 64 && (st->shim_cuda_ready >> target & 1)));
}

/* The calling thread's current stream on CUDA device `dev`, through
 * libtorch_cuda's shim (no Python call, no GIL needed). 0, or -1 where it is
 * not offered (the caller asks torch from Python). */
int mtc_shim_current_stream(const mtc_state *st, int dev, void **stream);

/* Releases a handle. */
void mtc_shim_release(const mtc_state *st, void *handle);

/* 1 when a handle becomes a Python tensor with torch's own C++ wrapper
 * (libtorch_python's THPVariable_Wrap, looked up and checked at setup), one
 * C call per tensor; else a batch's handles go through mtc_shim_tensors. */
static inline int mtc_shim_wrap_on(const mtc_state *st) { return st->shim_wrap_on; }

/* The Python tensor of a handle, which it takes over (the handle is released
 * whatever the outcome): a new reference, or NULL with an exception set.
 * torch's wrapper reports a failure to allocate the Python object with a C++
 * exception, which cannot cross the engine's C frames: a process out of host
 * memory at that point aborts instead of raising MemoryError
 * (MTC_TORCH_SHIM=0 avoids the wrapper). */
PyObject *mtc_shim_wrap(const mtc_state *st, void *handle);

/* Python tensors of a list of handles (PyCapsules without a destructor, one
 * handle each), which they take over, in order: a new list of len(capsules),
 * or NULL with an exception set. Either way the caller releases none of the
 * handles again: torch takes them over once it has read the list (a list it
 * cannot read, which only a capsule that is not a handle makes, leaves them
 * unreleased rather than risk releasing one twice). */
PyObject *mtc_shim_tensors(mtc_state *st, PyObject *capsules);

#endif /* MTC_SHIM_H */
