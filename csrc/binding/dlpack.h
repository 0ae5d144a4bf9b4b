/*
 * dlpack.h - the part of the DLPack ABI (major version 1) the engine uses:
 * torch's C exchange table, found on torch.Tensor as the capsule
 * __dlpack_c_exchange_api__ (torch 2.10 and later), whose
 * dltensor_from_py_object_no_sync fills a DLTensor describing a tensor
 * (data pointer, device, dtype, shape, strides) in one C call, without
 * allocating and without taking a reference. The engine reads a leaf's
 * metadata through it instead of five Python calls (leaves.c); the layouts
 * below are fixed by the DLPack specification for every 1.x version.
 * A DLTensor has no lazy bits: torch describes a negated view by the bytes
 * it holds, so the reader asks is_neg() / is_conj() besides (leaves.c).
 */
#ifndef MTC_DLPACK_H
#define MTC_DLPACK_H

#include <stdint.h>

#define MTC_DL_MAJOR 1
#define MTC_DL_CPU 1       /* kDLCPU */
#define MTC_DL_CUDA 2      /* kDLCUDA */
#define MTC_DL_CUDA_HOST 3 /* kDLCUDAHost: page-locked CPU memory */
#define MTC_DL_CODES 32    /* DLDataType codes the engine's table covers */

typedef struct {
    uint32_t major, minor;
} mtc_dl_version;

typedef struct {
    int32_t device_type;
    int32_t device_id;
} mtc_dl_device;

typedef struct {
    uint8_t code, bits;
    uint16_t lanes;
} mtc_dl_dtype;

typedef struct {
    void *data;
    mtc_dl_device device;
    int32_t ndim;
    mtc_dl_dtype dtype;
    int64_t *shape;   /* ndim sizes, owned by the tensor */
    int64_t *strides; /* ndim strides in elements (NULL: compact row-major) */
    uint64_t byte_offset;
} mtc_dl_tensor;

/* 0 with *out filled, valid while the object lives unchanged; -1 with a
 * Python exception set (the tensor cannot be described). GIL held. */
typedef int (*mtc_dl_view_fn)(void *py_object, mtc_dl_tensor *out);

typedef struct mtc_dl_api_header {
    mtc_dl_version version;
    struct mtc_dl_api_header *prev_api;
} mtc_dl_api_header;

typedef struct {
    mtc_dl_api_header header;
    void *managed_tensor_allocator;
    void *managed_tensor_from_py_object_no_sync;
    void *managed_tensor_to_py_object_no_sync;
    mtc_dl_view_fn dltensor_from_py_object_no_sync; /* may be NULL */
    void *current_work_stream;
} mtc_dl_api;

#endif /* MTC_DLPACK_H */
