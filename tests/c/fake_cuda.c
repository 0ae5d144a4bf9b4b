/*
 * tests/c/fake_cuda.c - a fake CUDA driver for the C unit tests: built as
 * libcuda.so.1 and found through LD_LIBRARY_PATH, it provides every entry
 * point csrc/engine/cuda.c resolves, on the host, with no GPU.
 *
 *   - A "device pointer" is a host address (a buffer the test owns).
 *   - A stream is a worker thread with a FIFO of operations: copies, event
 *     records, waits on events, host functions. The async calls only queue;
 *     the worker performs each copy later, after a delay drawn from
 *     [min_us, max_us] (fake_cuda_api.set_delay), so a staging buffer that is
 *     written again before its copy ran shows up as wrong bytes at the
 *     destination, and under TSan as a race with the worker's memcpy.
 *   - An event completes when its stream's worker reaches its record;
 *     cuEventQuery, cuEventSynchronize and cuStreamSynchronize observe the
 *     worker's progress under one mutex, which gives the caller the
 *     happens-before with the copies already performed, as a real driver does.
 *   - cuMemHostAlloc is an aligned malloc filled with 0xA5; the fake keeps the
 *     list of page-locked ranges to check where copies read from.
 *
 * It also checks what the engine must never do (fake_cuda_stats): a copy
 * source changed between the call and the copy, an HtoD copy from memory that
 * is not page-locked, a stream call without a current context, page-locked
 * memory freed while a queued copy reads it, a destroyed event used.
 * Failures of chosen entry points can be injected (fake_cuda_api.fail).
 *
 * See fake_cuda.h for the control interface.
 */
#include "fake_cuda.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_INVALID_DEVICE 101
#define CUDA_ERROR_INVALID_CONTEXT 201
#define CUDA_ERROR_INVALID_HANDLE 400
#define CUDA_ERROR_NOT_READY 600
#define CUDA_ERROR_UNKNOWN 999

#define EXPORT __attribute__((visibility("default")))
#define MAX_DEVICES 8
#define EVENT_MAGIC 0x45564e54u
#define EVENT_DEAD 0xdeadu

enum { OP_COPY, OP_RECORD, OP_WAIT, OP_HOSTFN };

struct CUevent_st;

typedef struct fake_op {
    int kind;
    int htod;
    void *dst;
    const void *src;
    size_t n;
    uint64_t hash;               /* the source's bytes when the copy was queued */
    struct CUevent_st *ev;       /* record / wait */
    uint64_t gen;                /* the record's generation, or the one waited for */
    void (*fn)(void *);
    void *arg;
    struct fake_op *next;
} fake_op;

typedef struct CUstream_st {
    pthread_t thread;
    pthread_cond_t cv;           /* work queued, or stop */
    fake_op *head, *tail;        /* head: the op being performed, dequeued when done */
    uint64_t queued, done;
    uint64_t rng;
    int stop;
    struct CUstream_st *next;
} fake_stream;

typedef struct CUevent_st {
    unsigned magic;
    uint64_t recorded;           /* generation of the last record (0: never recorded) */
    uint64_t completed;          /* highest generation the worker reached */
    struct CUevent_st *next;     /* destroyed events are kept here (a later use is counted, not a crash) */
} fake_event;

typedef struct CUctx_st { int dev; } fake_ctx;

typedef struct host_range { char *p; size_t n; int owned; struct host_range *next; } host_range;

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER; /* an op completed */
static fake_stream *g_streams;
static fake_stream *g_default;
static fake_event *g_graveyard;
static host_range *g_host;
static fake_ctx g_ctx[MAX_DEVICES];
static int g_ndev = 1;
static unsigned g_delay_min, g_delay_max = 20;
static uint64_t g_htod_in_flight;
static fake_cuda_stats g_st;
static struct { unsigned after, times; int code; } g_fail[FAKE_FAIL_NPOINTS];

static _Thread_local fake_ctx *tl_cur;
static _Thread_local fake_ctx *tl_stack[16];
static _Thread_local int tl_depth;

/* ---- helpers (g_mu held where noted) ---- */

static uint64_t _hash(const void *p, size_t n)
{
    const unsigned char *b = p;
    uint64_t h = 1469598103934665603ull;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, b + i, 8);
        h = (h ^ w) * 1099511628211ull;
        h ^= h >> 29;
    }
    for (; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

static uint64_t _rand(uint64_t *s)
{
    uint64_t x = *s;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *s = x;
}

/* g_mu held. The injected failure of point p, or 0. */
static CUresult _inject(int p)
{
    if (!g_fail[p].times) return 0;
    if (g_fail[p].after) {
        g_fail[p].after--;
        return 0;
    }
    g_fail[p].times--;
    g_st.injected++;
    return g_fail[p].code;
}

/* g_mu held. The page-locked range holding [p, p + n), or NULL. */
static host_range *_host_find(const void *p, size_t n)
{
    for (host_range *h = g_host; h; h = h->next)
        if ((const char *)p >= h->p && (const char *)p + n <= h->p + h->n) return h;
    return NULL;
}

/* g_mu held. 1 if ev is a live event, else counts the misuse. */
static int _event_ok(fake_event *ev)
{
    if (ev && ev->magic == EVENT_MAGIC) return 1;
    if (ev && ev->magic == EVENT_DEAD) g_st.destroyed_in_use++;
    return 0;
}

static void _sleep_us(unsigned us)
{
    if (!us) return;
    struct timespec ts = {us / 1000000, (long)(us % 1000000) * 1000};
    nanosleep(&ts, NULL);
}

static void *_worker(void *arg)
{
    fake_stream *s = arg;
    pthread_mutex_lock(&g_mu);
    for (;;) {
        while (!s->head && !s->stop) pthread_cond_wait(&s->cv, &g_mu);
        if (!s->head) break;
        fake_op *op = s->head; /* stays queued (stream not drained) until performed */
        unsigned delay = 0;
        if (op->kind == OP_COPY)
            delay = g_delay_min + (g_delay_max > g_delay_min
                                       ? (unsigned)(_rand(&s->rng) % (g_delay_max - g_delay_min + 1))
                                       : 0);
        pthread_mutex_unlock(&g_mu);

        int changed = 0;
        if (op->kind == OP_COPY) {
            _sleep_us(delay);
            memcpy(op->dst, op->src, op->n);
            changed = _hash(op->dst, op->n) != op->hash;
        } else if (op->kind == OP_HOSTFN) {
            op->fn(op->arg);
        }

        pthread_mutex_lock(&g_mu);
        if (op->kind == OP_WAIT)
            while (op->ev->completed < op->gen) pthread_cond_wait(&g_cv, &g_mu);
        if (op->kind == OP_RECORD && op->ev->completed < op->gen) op->ev->completed = op->gen;
        if (op->kind == OP_COPY) {
            g_st.copies_done++;
            if (changed) g_st.src_changed++;
            if (op->htod) g_htod_in_flight--;
        }
        s->head = op->next;
        if (!s->head) s->tail = NULL;
        s->done++;
        free(op);
        pthread_cond_broadcast(&g_cv);
    }
    pthread_mutex_unlock(&g_mu);
    return NULL;
}

/* g_mu held. A new stream with its worker, or NULL. */
static fake_stream *_stream_new(void)
{
    static uint64_t seed = 0x9e3779b97f4a7c15ull;
    fake_stream *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    pthread_cond_init(&s->cv, NULL);
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    s->rng = seed | 1;
    if (pthread_create(&s->thread, NULL, _worker, s)) {
        pthread_cond_destroy(&s->cv);
        free(s);
        return NULL;
    }
    s->next = g_streams;
    g_streams = s;
    return s;
}

/* g_mu held. The stream of handle h (NULL and the legacy/per-thread handles: the default one). */
static fake_stream *_stream_of(fake_stream *h)
{
    if ((uintptr_t)h <= 2) {
        if (!g_default) g_default = _stream_new();
        return g_default;
    }
    return h;
}

/* g_mu held. Queues op on stream h. */
static void _enqueue(fake_stream *h, fake_op *op)
{
    fake_stream *s = _stream_of(h);
    op->next = NULL;
    if (s->tail) s->tail->next = op;
    else s->head = op;
    s->tail = op;
    s->queued++;
    pthread_cond_signal(&s->cv);
}

static CUresult _copy(void *dst, const void *src, size_t n, fake_stream *s, int htod)
{
    fake_op *op = calloc(1, sizeof *op);
    if (!op) return CUDA_ERROR_OUT_OF_MEMORY;
    *op = (fake_op){.kind = OP_COPY, .htod = htod, .dst = dst, .src = src, .n = n};
    op->hash = _hash(src, n);
    pthread_mutex_lock(&g_mu);
    CUresult r = htod ? _inject(FAKE_FAIL_HTOD) : 0;
    if (!r && !tl_cur) {
        g_st.no_context++;
        r = CUDA_ERROR_INVALID_CONTEXT;
    }
    if (r) {
        pthread_mutex_unlock(&g_mu);
        free(op);
        return r;
    }
    if (htod) {
        g_st.htod_calls++;
        g_st.htod_bytes += n;
        if (!_host_find(src, n)) g_st.pageable_htod++;
        if (++g_htod_in_flight > g_st.max_htod_in_flight) g_st.max_htod_in_flight = g_htod_in_flight;
        uint64_t k = 0;
        while (k < g_st.nsrcs && g_st.srcs[k] != (uintptr_t)src) k++;
        if (k == g_st.nsrcs && k < FAKE_MAX_SRCS) g_st.srcs[g_st.nsrcs++] = (uintptr_t)src;
    }
    _enqueue(s, op);
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

/* ---- the driver API ---- */

EXPORT CUresult cuInit(unsigned flags)
{
    (void)flags;
    const char *e = getenv("FAKE_CUDA_DEVICES");
    pthread_mutex_lock(&g_mu);
    if (e && *e) g_ndev = atoi(e) < 0 ? 0 : atoi(e) > MAX_DEVICES ? MAX_DEVICES : atoi(e);
    for (int d = 0; d < MAX_DEVICES; d++) g_ctx[d].dev = d;
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDriverGetVersion(int *v)
{
    if (!v) return CUDA_ERROR_INVALID_VALUE;
    *v = 12040;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetCount(int *n)
{
    if (!n) return CUDA_ERROR_INVALID_VALUE;
    *n = g_ndev;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGet(CUdevice *d, int ordinal)
{
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    if (ordinal < 0 || ordinal >= g_ndev) return CUDA_ERROR_INVALID_DEVICE;
    *d = ordinal;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxRetain(fake_ctx **ctx, CUdevice d)
{
    if (!ctx) return CUDA_ERROR_INVALID_VALUE;
    if (d < 0 || d >= g_ndev) return CUDA_ERROR_INVALID_DEVICE;
    *ctx = &g_ctx[d];
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d)
{
    return d < 0 || d >= g_ndev ? CUDA_ERROR_INVALID_DEVICE : CUDA_SUCCESS;
}

EXPORT CUresult cuCtxSetCurrent(fake_ctx *ctx)
{
    tl_cur = ctx;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetCurrent(fake_ctx **ctx)
{
    if (!ctx) return CUDA_ERROR_INVALID_VALUE;
    *ctx = tl_cur;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxPushCurrent_v2(fake_ctx *ctx)
{
    if (tl_depth == (int)(sizeof tl_stack / sizeof tl_stack[0])) return CUDA_ERROR_OUT_OF_MEMORY;
    tl_stack[tl_depth++] = tl_cur;
    tl_cur = ctx;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxPopCurrent_v2(fake_ctx **ctx)
{
    if (!tl_depth) return CUDA_ERROR_INVALID_CONTEXT;
    if (ctx) *ctx = tl_cur;
    tl_cur = tl_stack[--tl_depth];
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemHostAlloc(void **out, size_t n, unsigned flags)
{
    (void)flags;
    if (!out || !n) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    CUresult r = _inject(FAKE_FAIL_HOST_ALLOC);
    if (!r && !tl_cur) {
        g_st.no_context++;
        r = CUDA_ERROR_INVALID_CONTEXT;
    }
    pthread_mutex_unlock(&g_mu);
    if (r) return r;
    size_t sz = (n + 4095) / 4096 * 4096;
    host_range *h = malloc(sizeof *h);
    char *p = aligned_alloc(4096, sz);
    if (!h || !p) {
        free(h);
        free(p);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    memset(p, 0xA5, sz);
    *h = (host_range){.p = p, .n = n, .owned = 1};
    pthread_mutex_lock(&g_mu);
    h->next = g_host;
    g_host = h;
    g_st.host_allocs++;
    g_st.host_live++;
    pthread_mutex_unlock(&g_mu);
    *out = p;
    return CUDA_SUCCESS;
}

/* g_mu held. Unlinks the range starting at p (owned or registered) and counts
 * queued copies that still touch it. NULL when p starts none. */
static host_range *_host_remove(const void *p, int owned)
{
    host_range **pp = &g_host;
    while (*pp && !((*pp)->p == p && (*pp)->owned == owned)) pp = &(*pp)->next;
    host_range *h = *pp;
    if (!h) return NULL;
    *pp = h->next;
    for (fake_stream *s = g_streams; s; s = s->next)
        for (fake_op *op = s->head; op; op = op->next)
            if (op->kind == OP_COPY && (((const char *)op->src < h->p + h->n && (const char *)op->src + op->n > h->p) ||
                                        ((char *)op->dst < h->p + h->n && (char *)op->dst + op->n > h->p)))
                g_st.freed_in_flight++;
    return h;
}

EXPORT CUresult cuMemFreeHost(void *p)
{
    pthread_mutex_lock(&g_mu);
    host_range *h = _host_remove(p, 1);
    if (h) {
        g_st.host_frees++;
        g_st.host_live--;
    }
    pthread_mutex_unlock(&g_mu);
    if (!h) return CUDA_ERROR_INVALID_VALUE;
    free(h->p);
    free(h);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned flags)
{
    (void)flags;
    host_range *h = malloc(sizeof *h);
    if (!h) return CUDA_ERROR_OUT_OF_MEMORY;
    *h = (host_range){.p = p, .n = n, .owned = 0};
    pthread_mutex_lock(&g_mu);
    h->next = g_host;
    g_host = h;
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemHostUnregister(void *p)
{
    pthread_mutex_lock(&g_mu);
    host_range *h = _host_remove(p, 0);
    pthread_mutex_unlock(&g_mu);
    free(h);
    return h ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, fake_stream *s)
{
    return _copy((void *)(uintptr_t)dst, src, n, s, 1);
}

EXPORT CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, fake_stream *s)
{
    return _copy(dst, (const void *)(uintptr_t)src, n, s, 0);
}

EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, fake_stream *s)
{
    return _copy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n, s, 0);
}

EXPORT CUresult cuMemcpyPeerAsync(CUdeviceptr dst, fake_ctx *dc, CUdeviceptr src, fake_ctx *sc, size_t n,
                                  fake_stream *s)
{
    (void)dc;
    (void)sc;
    return _copy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n, s, 0);
}

EXPORT CUresult cuEventCreate(fake_event **out, unsigned flags)
{
    (void)flags;
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    CUresult r = _inject(FAKE_FAIL_EVENT_CREATE);
    if (!r && !tl_cur) {
        g_st.no_context++;
        r = CUDA_ERROR_INVALID_CONTEXT;
    }
    pthread_mutex_unlock(&g_mu);
    if (r) return r;
    fake_event *ev = calloc(1, sizeof *ev);
    if (!ev) return CUDA_ERROR_OUT_OF_MEMORY;
    ev->magic = EVENT_MAGIC;
    pthread_mutex_lock(&g_mu);
    g_st.events_live++;
    pthread_mutex_unlock(&g_mu);
    *out = ev;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuEventDestroy_v2(fake_event *ev)
{
    pthread_mutex_lock(&g_mu);
    int ok = _event_ok(ev);
    if (ok) {
        /* kept: a queued record may still complete it, and a later misuse is counted */
        ev->magic = EVENT_DEAD;
        ev->next = g_graveyard;
        g_graveyard = ev;
        g_st.events_live--;
    }
    pthread_mutex_unlock(&g_mu);
    return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

EXPORT CUresult cuEventRecord(fake_event *ev, fake_stream *s)
{
    fake_op *op = calloc(1, sizeof *op);
    if (!op) return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&g_mu);
    CUresult r = _inject(FAKE_FAIL_EVENT_RECORD);
    if (!r && !_event_ok(ev)) r = CUDA_ERROR_INVALID_HANDLE;
    if (r) {
        pthread_mutex_unlock(&g_mu);
        free(op);
        return r;
    }
    g_st.event_records++;
    *op = (fake_op){.kind = OP_RECORD, .ev = ev, .gen = ++ev->recorded};
    _enqueue(s, op);
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuEventQuery(fake_event *ev)
{
    pthread_mutex_lock(&g_mu);
    CUresult r = _inject(FAKE_FAIL_EVENT_QUERY);
    if (!r && !_event_ok(ev)) r = CUDA_ERROR_INVALID_HANDLE;
    if (!r) {
        g_st.event_queries++;
        r = ev->completed >= ev->recorded ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
    }
    pthread_mutex_unlock(&g_mu);
    return r;
}

EXPORT CUresult cuEventSynchronize(fake_event *ev)
{
    pthread_mutex_lock(&g_mu);
    CUresult r = _inject(FAKE_FAIL_EVENT_SYNC);
    if (!r && !_event_ok(ev)) r = CUDA_ERROR_INVALID_HANDLE;
    if (!r) {
        g_st.event_syncs++;
        uint64_t gen = ev->recorded;
        while (ev->completed < gen) pthread_cond_wait(&g_cv, &g_mu);
    }
    pthread_mutex_unlock(&g_mu);
    return r;
}

EXPORT CUresult cuStreamWaitEvent(fake_stream *s, fake_event *ev, unsigned flags)
{
    (void)flags;
    fake_op *op = calloc(1, sizeof *op);
    if (!op) return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&g_mu);
    if (!_event_ok(ev)) {
        pthread_mutex_unlock(&g_mu);
        free(op);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    *op = (fake_op){.kind = OP_WAIT, .ev = ev, .gen = ev->recorded};
    _enqueue(s, op);
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamSynchronize(fake_stream *h)
{
    pthread_mutex_lock(&g_mu);
    fake_stream *s = _stream_of(h);
    g_st.stream_syncs++;
    uint64_t target = s->queued;
    while (s->done < target) pthread_cond_wait(&g_cv, &g_mu);
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamCreate(fake_stream **out, unsigned flags)
{
    (void)flags;
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    CUresult r = CUDA_SUCCESS;
    if (!tl_cur) {
        g_st.no_context++;
        r = CUDA_ERROR_INVALID_CONTEXT;
    } else if (!(*out = _stream_new())) {
        r = CUDA_ERROR_OUT_OF_MEMORY;
    }
    pthread_mutex_unlock(&g_mu);
    return r;
}

EXPORT CUresult cuLaunchHostFunc(fake_stream *s, void (*fn)(void *), void *arg)
{
    if (!fn) return CUDA_ERROR_INVALID_VALUE;
    fake_op *op = calloc(1, sizeof *op);
    if (!op) return CUDA_ERROR_OUT_OF_MEMORY;
    *op = (fake_op){.kind = OP_HOSTFN, .fn = fn, .arg = arg};
    pthread_mutex_lock(&g_mu);
    _enqueue(s, op);
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

static const char *_err_name(CUresult r)
{
    switch (r) {
    case CUDA_SUCCESS: return "CUDA_SUCCESS";
    case CUDA_ERROR_INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
    case CUDA_ERROR_OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
    case CUDA_ERROR_INVALID_DEVICE: return "CUDA_ERROR_INVALID_DEVICE";
    case CUDA_ERROR_INVALID_CONTEXT: return "CUDA_ERROR_INVALID_CONTEXT";
    case CUDA_ERROR_INVALID_HANDLE: return "CUDA_ERROR_INVALID_HANDLE";
    case CUDA_ERROR_NOT_READY: return "CUDA_ERROR_NOT_READY";
    case CUDA_ERROR_UNKNOWN: return "CUDA_ERROR_UNKNOWN";
    default: return NULL;
    }
}

EXPORT CUresult cuGetErrorName(CUresult r, const char **out)
{
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    *out = _err_name(r);
    return *out ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuGetErrorString(CUresult r, const char **out)
{
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    *out = _err_name(r) ? "fake driver error" : NULL;
    return *out ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* ---- the control interface (fake_cuda.h) ---- */

static void _set_delay(unsigned min_us, unsigned max_us)
{
    pthread_mutex_lock(&g_mu);
    g_delay_min = min_us;
    g_delay_max = max_us < min_us ? min_us : max_us;
    pthread_mutex_unlock(&g_mu);
}

static void _fail(int point, unsigned after, unsigned times, int code)
{
    if (point < 0 || point >= FAKE_FAIL_NPOINTS) return;
    pthread_mutex_lock(&g_mu);
    g_fail[point].after = after;
    g_fail[point].times = times;
    g_fail[point].code = code;
    pthread_mutex_unlock(&g_mu);
}

static void _clear_failures(void)
{
    pthread_mutex_lock(&g_mu);
    memset(g_fail, 0, sizeof g_fail);
    pthread_mutex_unlock(&g_mu);
}

static void _get_stats(fake_cuda_stats *out)
{
    pthread_mutex_lock(&g_mu);
    *out = g_st;
    pthread_mutex_unlock(&g_mu);
}

static void _reset_stats(void)
{
    pthread_mutex_lock(&g_mu);
    uint64_t host_live = g_st.host_live, events_live = g_st.events_live;
    memset(&g_st, 0, sizeof g_st);
    g_st.host_live = host_live;
    g_st.events_live = events_live;
    g_st.max_htod_in_flight = g_htod_in_flight;
    pthread_mutex_unlock(&g_mu);
}

EXPORT const fake_cuda_api fake_cuda = {_set_delay, _fail, _clear_failures, _get_stats, _reset_stats};
