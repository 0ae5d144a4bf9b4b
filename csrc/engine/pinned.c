/*
 * pinned.c - the per-device pinned staging pools: slab pools (slab.h) whose
 * memory and fences come from the CUDA driver (see pinned.h).
 */
#include "pinned.h"
#include "env.h"

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>

#include "cuda.h"

static pthread_mutex_t _pools_lock = PTHREAD_MUTEX_INITIALIZER;
static mtc_slab_pool *_pools[MTC_MAX_DEVICES];
static size_t _pinned_cap;

static size_t _default_cap(void)
{
    int64_t v;
    return mtc_env_int(MTC_ENV_PINNED_CAP_BYTES, &v) == 1 ? (size_t)v : (size_t)1 << 30;
}

/* MTC_SLAB_HUGEPAGES=1: slabs mapped anonymously with MADV_HUGEPAGE (2 MiB
 * pages where the kernel's transparent huge pages allow it: fewer TLB misses
 * for the helpers' streaming stores into them) and page-locked in place with
 * cuMemHostRegister, instead of cuMemHostAlloc. MADV_DONTFORK: a forked
 * DataLoader worker never maps them, so no copy-on-write can move a page the
 * GPU reads away from the parent. Read once per process. */
static int _slab_huge = -1;

static int _huge(void)
{
    if (_slab_huge < 0) {
        _slab_huge = mtc_env_bool(MTC_ENV_SLAB_HUGEPAGES, 0);
    }
    return _slab_huge;
}

/* ---- the slab pool's ops (mtc_slab_ops) over the driver; ctx is the device ---- */

static int _ops_alloc(void *ctx, size_t bytes, void **out)
{
    int rc = mtc_cuda_set_device((int)(intptr_t)ctx);
    if (rc) return rc;
    if (_huge()) {
        void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) return -ENOMEM;
        (void)madvise(p, bytes, MADV_HUGEPAGE);
        (void)madvise(p, bytes, MADV_DONTFORK);
        CUresult r = mtc_cu.cuMemHostRegister(p, bytes, MTC_CU_MEMHOSTREGISTER_PORTABLE);
        if (r) {
            munmap(p, bytes);
            return r == MTC_CUDA_ERROR_OUT_OF_MEMORY ? -ENOMEM : mtc_cu_rc(r);
        }
        *out = p;
        return 0;
    }
    CUresult r = mtc_cu.cuMemHostAlloc(out, bytes, MTC_CU_MEMHOSTALLOC_PORTABLE);
    return r == MTC_CUDA_ERROR_OUT_OF_MEMORY ? -ENOMEM : mtc_cu_rc(r);
}
static void _ops_free(void *ctx, void *ptr, size_t bytes)
{
    if (mtc_cuda_set_device((int)(intptr_t)ctx)) return;
    if (_huge()) {
        mtc_cu.cuMemHostUnregister(ptr);
        munmap(ptr, bytes);
        return;
    }
    mtc_cu.cuMemFreeHost(ptr);
}
static int _ops_fence_create(void *ctx, void **out)
{
    int rc = mtc_cuda_set_device((int)(intptr_t)ctx);
    if (rc) return rc;
    return mtc_cu_rc(mtc_cu.cuEventCreate((CUevent *)out, MTC_CU_EVENT_DISABLE_TIMING));
}
static void _ops_fence_destroy(void *ctx, void *fence)
{
    if (mtc_cuda_set_device((int)(intptr_t)ctx) == 0) mtc_cu.cuEventDestroy(fence);
}
static int _ops_fence_query(void *ctx, void *fence)
{
    (void)ctx;
    CUresult r = mtc_cu.cuEventQuery(fence);
    return r == MTC_CUDA_SUCCESS ? 1 : r == MTC_CUDA_ERROR_NOT_READY ? 0 : MTC_CUDA_ERR(r);
}
static int _ops_fence_wait(void *ctx, void *fence)
{
    (void)ctx;
    return mtc_cu_rc(mtc_cu.cuEventSynchronize(fence));
}

/* ---- the pools, one per device ---- */

mtc_slab_pool *mtc_pinned_pool(int dev, int *err)
{
    pthread_mutex_lock(&_pools_lock);
    mtc_slab_pool *p = _pools[dev];
    if (!p) {
        if (!_pinned_cap) _pinned_cap = _default_cap();
        mtc_slab_ops ops = {(void *)(intptr_t)dev, _ops_alloc, _ops_free, _ops_fence_create,
                            _ops_fence_destroy, _ops_fence_query, _ops_fence_wait};
        p = calloc(1, sizeof *p);
        if (!p) *err = -ENOMEM;
        else if ((*err = mtc_slab_pool_init(p, &ops, _pinned_cap))) {
            free(p);
            p = NULL;
        } else {
            _pools[dev] = p;
        }
    }
    pthread_mutex_unlock(&_pools_lock);
    return p;
}

int mtc_pinned_stats(int dev, mtc_slab_stats *out)
{
    if (dev < 0 || dev >= MTC_MAX_DEVICES) return -EINVAL;
    pthread_mutex_lock(&_pools_lock);
    mtc_slab_pool *p = _pools[dev];
    pthread_mutex_unlock(&_pools_lock);
    if (!p) return -ENOENT;
    mtc_slab_get_stats(p, out);
    return 0;
}

int mtc_pinned_set_cap(size_t bytes)
{
    if (!bytes) return -EINVAL;
    pthread_mutex_lock(&_pools_lock);
    _pinned_cap = bytes;
    for (int d = 0; d < MTC_MAX_DEVICES; d++)
        if (_pools[d]) mtc_slab_set_cap(_pools[d], bytes);
    pthread_mutex_unlock(&_pools_lock);
    return 0;
}

size_t mtc_pinned_cap(void)
{
    pthread_mutex_lock(&_pools_lock);
    if (!_pinned_cap) _pinned_cap = _default_cap();
    size_t c = _pinned_cap;
    pthread_mutex_unlock(&_pools_lock);
    return c;
}

size_t mtc_pinned_trim(void)
{
    size_t freed = 0;
    pthread_mutex_lock(&_pools_lock);
    for (int d = 0; d < MTC_MAX_DEVICES; d++)
        if (_pools[d]) freed += mtc_slab_trim(_pools[d]);
    pthread_mutex_unlock(&_pools_lock);
    return freed;
}

void mtc_pinned_after_fork_child(void)
{
    /* only the forking thread survives: the lock may have been held by a
     * thread that no longer exists */
    pthread_mutex_init(&_pools_lock, NULL);
    for (int d = 0; d < MTC_MAX_DEVICES; d++) _pools[d] = NULL;
}
