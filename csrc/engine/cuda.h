/*
 * cuda.h - the CUDA driver API, loaded at run time.
 *
 * Nothing CUDA is needed to build or import the engine: libcuda.so.1 is
 * dlopen()ed on first use and the few driver entry points the engine needs are
 * resolved into a table. The types below mirror the driver's ABI (handles are
 * pointers, device pointers are 64-bit integers, results are ints).
 *
 * Code here returns codes, never touches Python: 0 on success, a negative
 * errno for loader problems, or MTC_CUDA_ERR(res) for a driver error `res`.
 * Names starting with `_` are internal to cuda.c.
 */
#ifndef MTC_CUDA_H
#define MTC_CUDA_H

#include <stddef.h>
#include <stdint.h>

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef unsigned long long CUdeviceptr;

#define MTC_CUDA_SUCCESS 0
#define MTC_CUDA_ERROR_NOT_READY 600
#define MTC_CUDA_ERROR_OUT_OF_MEMORY 2
#define MTC_CU_EVENT_DISABLE_TIMING 0x2
#define MTC_CU_STREAM_NON_BLOCKING 0x1
#define MTC_CU_MEMHOSTALLOC_PORTABLE 0x1
#define MTC_CU_MEMHOSTREGISTER_PORTABLE 0x1

/* Driver errors are reported as -(100000 + res) so that they never collide with -errno. */
#define MTC_CUDA_ERR(res) (-(100000 + (int)(res)))
/* A driver result as the engine's code: 0 or MTC_CUDA_ERR(r). */
static inline int mtc_cu_rc(CUresult r) { return r == MTC_CUDA_SUCCESS ? 0 : MTC_CUDA_ERR(r); }
#define MTC_IS_CUDA_ERR(code) ((code) <= -100000)
#define MTC_CUDA_RES(code) (-(code) - 100000)

#define MTC_MAX_DEVICES 64

/* CUmemcpyAttributes of cuMemcpyBatchAsync (CUDA 12.8+) */
typedef struct mtc_cu_memloc { int type; int id; } mtc_cu_memloc;
typedef struct mtc_cu_memcpy_attrs {
    int srcAccessOrder;          /* 1: CU_MEMCPY_SRC_ACCESS_ORDER_STREAM */
    mtc_cu_memloc srcLocHint, dstLocHint;
    unsigned int flags;
} mtc_cu_memcpy_attrs;
#define MTC_CU_MEMCPY_SRC_ACCESS_ORDER_STREAM 1

typedef struct mtc_cuda_api {
    CUresult (*cuInit)(unsigned int);
    CUresult (*cuDriverGetVersion)(int *);
    CUresult (*cuDeviceGetCount)(int *);
    CUresult (*cuDeviceGet)(CUdevice *, int);
    CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*cuDevicePrimaryCtxRelease)(CUdevice);
    CUresult (*cuCtxSetCurrent)(CUcontext);
    CUresult (*cuCtxGetCurrent)(CUcontext *);
    CUresult (*cuCtxPushCurrent)(CUcontext);
    CUresult (*cuCtxPopCurrent)(CUcontext *);
    CUresult (*cuMemHostAlloc)(void **, size_t, unsigned int);
    CUresult (*cuMemFreeHost)(void *);
    CUresult (*cuMemHostRegister)(void *, size_t, unsigned int);
    CUresult (*cuMemHostUnregister)(void *);
    CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, CUstream);
    CUresult (*cuMemcpyDtoHAsync)(void *, CUdeviceptr, size_t, CUstream);
    CUresult (*cuMemcpyDtoDAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
    CUresult (*cuMemcpyPeerAsync)(CUdeviceptr, CUcontext, CUdeviceptr, CUcontext, size_t, CUstream);
    CUresult (*cuEventCreate)(CUevent *, unsigned int);
    CUresult (*cuEventDestroy)(CUevent);
    CUresult (*cuEventRecord)(CUevent, CUstream);
    CUresult (*cuEventQuery)(CUevent);
    CUresult (*cuEventSynchronize)(CUevent);
    CUresult (*cuStreamWaitEvent)(CUstream, CUevent, unsigned int);
    CUresult (*cuStreamSynchronize)(CUstream);
    CUresult (*cuStreamCreate)(CUstream *, unsigned int);
    CUresult (*cuLaunchHostFunc)(CUstream, void (*)(void *), void *);
    CUresult (*cuGetErrorName)(CUresult, const char **);
    CUresult (*cuGetErrorString)(CUresult, const char **);
    /* optional (NULL when the driver lacks it): one call for many copies.
     * CUDA 13 ABI (cuMemcpyBatchAsync_v2): no failIdx argument. */
    CUresult (*cuMemcpyBatchAsync)(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
                                   mtc_cu_memcpy_attrs *attrs, size_t *attrsIdxs, size_t numAttrs,
                                   CUstream stream);
} mtc_cuda_api;

/* The loaded table; valid only after mtc_cuda_load() returned 0. */
extern mtc_cuda_api mtc_cu;

/*
 * Loads libcuda.so.1 and calls cuInit(0), once per process (thread-safe).
 * Returns 0, -ENOENT when the library is missing, -ENOSYS when a symbol is
 * missing, or MTC_CUDA_ERR(res) when cuInit fails. Later calls return the
 * first call's result.
 */
int mtc_cuda_load(void);

/*
 * Makes the primary context of `dev` current on the calling thread,
 * retaining it on first use. Returns 0 or an error code as above.
 */
int mtc_cuda_set_device(int dev);

/* Returns the primary context of `dev` (retained by mtc_cuda_set_device), or NULL. */
CUcontext mtc_cuda_context(int dev);

/*
 * Makes `stream` (a stream of device `dev`'s primary context; 0 is its
 * legacy default stream) wait on the GPU for `event`'s last record
 * (cuStreamWaitEvent). The calling thread's current context is left as it
 * was: when it is not `dev`'s primary context (a thread that never used
 * CUDA, or one current on another device) that context is pushed for the
 * call and popped. Never blocks on the GPU, so a caller may hold the GIL.
 * Returns 0 or an error code as above.
 */
int mtc_cuda_stream_wait_event(int dev, uintptr_t stream, uintptr_t event);

/*
 * Records an event (timing disabled, from a per-device pool) on `stream` of
 * device `dev` into *event, with dev's primary context current for the call
 * (pushed and popped as in mtc_cuda_stream_wait_event). Never blocks, so a
 * caller may hold the GIL. Give the event back with mtc_cuda_event_release
 * once a stream waits for it (or it is not needed). 0 or an error code.
 */
int mtc_cuda_event_record(int dev, uintptr_t stream, uintptr_t *event);

/* Returns an event of mtc_cuda_event_record to dev's pool (destroyed when
 * the pool is full). Any thread; 0 is ignored. */
void mtc_cuda_event_release(int dev, uintptr_t event);

/* Number of devices the driver sees, or a negative error code. */
int mtc_cuda_device_count(void);

/*
 * Writes "CUDA_ERROR_NAME: description" for `code` into buf (always
 * NUL-terminated). Works for loader errors (-errno) too.
 */
void mtc_cuda_describe(int code, char *buf, size_t len);

/* Forget everything after fork(): the child must not use the parent's contexts. */
void mtc_cuda_after_fork_child(void);

#endif /* MTC_CUDA_H */
