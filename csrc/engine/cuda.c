/*
 * cuda.c - run-time loader for the CUDA driver API (see cuda.h).
 */
#include "cuda.h"
#include "env.h"

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

mtc_cuda_api mtc_cu;

static pthread_mutex_t _cu_lock = PTHREAD_MUTEX_INITIALIZER;
static int _cu_state;          /* 0 not tried, 1 loaded, -1 failed */
static int _cu_result;
static void *_cu_lib;
static CUcontext _cu_ctx[MTC_MAX_DEVICES];

/* Versioned names first: the unversioned symbols of several entry points
 * keep their CUDA 3.x ABI for old binaries. */
#define _CU_SYM(field, name)                                             \
    do {                                                                 \
        *(void **)(&mtc_cu.field) = dlsym(_cu_lib, name);                \
        if (!mtc_cu.field) return -ENOSYS;                               \
    } while (0)

static int _cu_resolve(void)
{
    _CU_SYM(cuInit, "cuInit");
    _CU_SYM(cuDriverGetVersion, "cuDriverGetVersion");
    _CU_SYM(cuDeviceGetCount, "cuDeviceGetCount");
    _CU_SYM(cuDeviceGet, "cuDeviceGet");
    _CU_SYM(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
    _CU_SYM(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2");
    _CU_SYM(cuCtxSetCurrent, "cuCtxSetCurrent");
    _CU_SYM(cuCtxGetCurrent, "cuCtxGetCurrent");
    _CU_SYM(cuCtxPushCurrent, "cuCtxPushCurrent_v2");
    _CU_SYM(cuCtxPopCurrent, "cuCtxPopCurrent_v2");
    _CU_SYM(cuMemHostAlloc, "cuMemHostAlloc");
    _CU_SYM(cuMemFreeHost, "cuMemFreeHost");
    _CU_SYM(cuMemHostRegister, "cuMemHostRegister_v2");
    _CU_SYM(cuMemHostUnregister, "cuMemHostUnregister");
    _CU_SYM(cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2");
    _CU_SYM(cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2");
    _CU_SYM(cuMemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2");
    _CU_SYM(cuMemcpyPeerAsync, "cuMemcpyPeerAsync");
    _CU_SYM(cuEventCreate, "cuEventCreate");
    _CU_SYM(cuEventDestroy, "cuEventDestroy_v2");
    _CU_SYM(cuEventRecord, "cuEventRecord");
    _CU_SYM(cuEventQuery, "cuEventQuery");
    _CU_SYM(cuEventSynchronize, "cuEventSynchronize");
    _CU_SYM(cuStreamWaitEvent, "cuStreamWaitEvent");
    _CU_SYM(cuStreamSynchronize, "cuStreamSynchronize");
    _CU_SYM(cuStreamCreate, "cuStreamCreate");
    _CU_SYM(cuLaunchHostFunc, "cuLaunchHostFunc");
    _CU_SYM(cuGetErrorName, "cuGetErrorName");
    _CU_SYM(cuGetErrorString, "cuGetErrorString");
    /* optional: only the CUDA 13 form, whose ABI is the one declared */
    *(void **)(&mtc_cu.cuMemcpyBatchAsync) = dlsym(_cu_lib, "cuMemcpyBatchAsync_v2");
    if (mtc_env_bool(MTC_ENV_NO_BATCH_MEMCPY, 0)) mtc_cu.cuMemcpyBatchAsync = NULL;
    return 0;
}

int mtc_cuda_load(void)
{
    pthread_mutex_lock(&_cu_lock);
    if (_cu_state == 0) {
        _cu_lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        if (!_cu_lib) {
            _cu_result = -ENOENT;
        } else if ((_cu_result = _cu_resolve()) == 0) {
            CUresult r = mtc_cu.cuInit(0);
            _cu_result = r == MTC_CUDA_SUCCESS ? 0 : MTC_CUDA_ERR(r);
        }
        _cu_state = _cu_result == 0 ? 1 : -1;
    }
    int res = _cu_result;
    pthread_mutex_unlock(&_cu_lock);
    return res;
}

int mtc_cuda_device_count(void)
{
    int rc = mtc_cuda_load();
    if (rc) return rc;
    int n = 0;
    CUresult r = mtc_cu.cuDeviceGetCount(&n);
    return r ? MTC_CUDA_ERR(r) : n;
}

/* The primary context of `dev`, retained on first use: 0 or an error code. */
static int _cu_primary(int dev, CUcontext *out)
{
    if (dev < 0 || dev >= MTC_MAX_DEVICES) return -EINVAL;
    int rc = mtc_cuda_load();
    if (rc) return rc;
    pthread_mutex_lock(&_cu_lock);
    CUcontext ctx = _cu_ctx[dev];
    if (!ctx) {
        CUdevice d;
        CUresult r = mtc_cu.cuDeviceGet(&d, dev);
        if (r == MTC_CUDA_SUCCESS) r = mtc_cu.cuDevicePrimaryCtxRetain(&ctx, d);
        if (r != MTC_CUDA_SUCCESS) {
            pthread_mutex_unlock(&_cu_lock);
            return MTC_CUDA_ERR(r);
        }
        _cu_ctx[dev] = ctx;
    }
    pthread_mutex_unlock(&_cu_lock);
    *out = ctx;
    return 0;
}

int mtc_cuda_set_device(int dev)
{
    CUcontext ctx;
    int rc = _cu_primary(dev, &ctx);
    if (rc) return rc;
    CUresult r = mtc_cu.cuCtxSetCurrent(ctx);
    return r ? MTC_CUDA_ERR(r) : 0;
}

int mtc_cuda_stream_wait_event(int dev, uintptr_t stream, uintptr_t event)
{
    CUcontext ctx, cur = NULL;
    int rc = _cu_primary(dev, &ctx);
    if (rc) return rc;
    CUresult r = mtc_cu.cuCtxGetCurrent(&cur);
    if (r) return MTC_CUDA_ERR(r);
    int pushed = cur != ctx;
    if (pushed && (r = mtc_cu.cuCtxPushCurrent(ctx))) return MTC_CUDA_ERR(r);
    r = mtc_cu.cuStreamWaitEvent((CUstream)stream, (CUevent)event, 0);
    if (pushed) {
        CUcontext popped;
        CUresult r2 = mtc_cu.cuCtxPopCurrent(&popped);
        if (!r) r = r2;
    }
    return r ? MTC_CUDA_ERR(r) : 0;
}

/* Runs fn(arg) with dev's primary context current on the calling thread,
 * pushing it when another (or none) is current, and restores that one.
 * Returns 0 or an error code as above. */
static int _cu_in_context(int dev, CUresult (*fn)(void *), void *arg)
{
    CUcontext ctx, cur = NULL;
    int rc = _cu_primary(dev, &ctx);
    if (rc) return rc;
    CUresult r = mtc_cu.cuCtxGetCurrent(&cur);
    if (r) return MTC_CUDA_ERR(r);
    int pushed = cur != ctx;
    if (pushed && (r = mtc_cu.cuCtxPushCurrent(ctx))) return MTC_CUDA_ERR(r);
    r = fn(arg);
    if (pushed) {
        CUcontext popped;
        CUresult r2 = mtc_cu.cuCtxPopCurrent(&popped);
        if (!r) r = r2;
    }
    return r ? MTC_CUDA_ERR(r) : 0;
}

/* Events free for reuse, per device: a stack under _cu_lock. An event goes
 * back once a stream waits for its record (cuStreamWaitEvent takes the
 * record's state at the call), so a few per device cover every batch. */
#define _CU_POOL 64
static CUevent _cu_pool[MTC_MAX_DEVICES][_CU_POOL];
static int _cu_pool_n[MTC_MAX_DEVICES];

typedef struct { CUevent ev; CUstream stream; int create; } _cu_record_arg;

static CUresult _cu_record(void *p)
{
    _cu_record_arg *a = p;
    CUresult r = a->create ? mtc_cu.cuEventCreate(&a->ev, MTC_CU_EVENT_DISABLE_TIMING) : MTC_CUDA_SUCCESS;
    if (r == MTC_CUDA_SUCCESS) r = mtc_cu.cuEventRecord(a->ev, a->stream);
    return r;
}

int mtc_cuda_event_record(int dev, uintptr_t stream, uintptr_t *event)
{
    if (dev < 0 || dev >= MTC_MAX_DEVICES) return -EINVAL;
    _cu_record_arg a = {.ev = NULL, .stream = (CUstream)stream, .create = 1};
    pthread_mutex_lock(&_cu_lock);
    if (_cu_pool_n[dev]) {
        a.ev = _cu_pool[dev][--_cu_pool_n[dev]];
        a.create = 0;
    }
    pthread_mutex_unlock(&_cu_lock);
    int rc = _cu_in_context(dev, _cu_record, &a);
    if (rc) {
        if (a.ev) mtc_cuda_event_release(dev, (uintptr_t)a.ev);
        return rc;
    }
    *event = (uintptr_t)a.ev;
    return 0;
}

static CUresult _cu_destroy(void *p) { return mtc_cu.cuEventDestroy((CUevent)p); }

void mtc_cuda_event_release(int dev, uintptr_t event)
{
    if (!event || dev < 0 || dev >= MTC_MAX_DEVICES) return;
    pthread_mutex_lock(&_cu_lock);
    int kept = _cu_pool_n[dev] < _CU_POOL;
    if (kept) _cu_pool[dev][_cu_pool_n[dev]++] = (CUevent)event;
    pthread_mutex_unlock(&_cu_lock);
    if (!kept) (void)_cu_in_context(dev, _cu_destroy, (void *)event); /* pool full: nothing to report */
}

CUcontext mtc_cuda_context(int dev)
{
    if (dev < 0 || dev >= MTC_MAX_DEVICES) return NULL;
    pthread_mutex_lock(&_cu_lock);
    CUcontext c = _cu_ctx[dev];
    pthread_mutex_unlock(&_cu_lock);
    return c;
}

void mtc_cuda_describe(int code, char *buf, size_t len)
{
    if (!len) return;
    if (MTC_IS_CUDA_ERR(code)) {
        CUresult res = MTC_CUDA_RES(code);
        const char *name = NULL, *desc = NULL;
        if (_cu_state == 1) {
            mtc_cu.cuGetErrorName(res, &name);
            mtc_cu.cuGetErrorString(res, &desc);
        }
        snprintf(buf, len, "%s (%d): %s", name ? name : "CUDA error", res,
                 desc ? desc : "no description");
    } else if (code == -ENOENT) {
        snprintf(buf, len, "libcuda.so.1 could not be loaded (%s)", dlerror() ? "not found" : "missing");
    } else if (code == -ENOSYS) {
        snprintf(buf, len, "libcuda.so.1 lacks a driver entry point the engine needs (driver too old)");
    } else {
        snprintf(buf, len, "%s", strerror(-code));
    }
}

void mtc_cuda_after_fork_child(void)
{
    /* The child inherits the parent's memory but not its CUDA contexts:
     * forget them, and reinitialise the lock that another thread may have held. */
    pthread_mutex_init(&_cu_lock, NULL);
    memset(_cu_ctx, 0, sizeof _cu_ctx);
    memset(_cu_pool_n, 0, sizeof _cu_pool_n); /* the pooled events were the parent's */
    if (_cu_state == 1) {
        _cu_state = -1;
        _cu_result = MTC_CUDA_ERR(3); /* CUDA_ERROR_NOT_INITIALIZED: unusable after fork */
    }
}
