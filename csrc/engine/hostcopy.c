/*
 * hostcopy.c - host copies and the helper-thread pool (see hostcopy.h).
 */
#include "hostcopy.h"
#include "env.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

/* ---- the helper pool ---- */

#define _MAX_HELPERS 16

static struct {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    mtc_batch *head, *tail;   /* batches with tasks left to take */
    pthread_t threads[_MAX_HELPERS];
    int nthreads;
    int stop;
} _pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, NULL, {0}, 0, 0};

/* Takes and runs tasks of b until none is left. Returns 1 if it ran any. */
static int _run_tasks(mtc_batch *b)
{
    int ran = 0;
    for (;;) {
        uint32_t i = mtc_fetch_add_relaxed(&b->next, 1);
        if (i >= b->n) break;
        b->fn(b->arg, i);
        ran = 1;
        /* acq_rel: the last finisher sees every other task's writes before
         * publishing `finished` (released to mtc_batch_wait's acquire) */
        if (mtc_fetch_add_acq_rel(&b->done, 1) + 1 == b->n) {
            mtc_store_release(&b->finished, 1);
            mtc_futex_wake_all(&b->finished);
        }
    }
    return ran;
}

static void *_helper_main(void *arg)
{
    char name[16];
    snprintf(name, sizeof name, "mtc-helper-%d", (int)(intptr_t)arg);
    pthread_setname_np(pthread_self(), name); /* for top -H and tools/diagnostics/placement.py */
    pthread_mutex_lock(&_pool.lock);
    while (!_pool.stop) {
        mtc_batch *b = _pool.head;
        if (!b) {
            pthread_cond_wait(&_pool.cond, &_pool.lock);
            continue;
        }
        /* a batch whose tasks are all taken leaves the queue */
        if (mtc_load_relaxed(&b->next) >= b->n) {
            _pool.head = b->qnext;
            if (!_pool.head) _pool.tail = NULL;
            continue;
        }
        /* Registered under the lock, while the batch is queued: its owner
         * unlinks it under the same lock and then waits for `active` to drop
         * to zero, so the batch (often on the owner's stack) outlives us. */
        mtc_fetch_add_relaxed(&b->active, 1);
        pthread_mutex_unlock(&_pool.lock);
        _run_tasks(b);
        /* pairs with the acquire in mtc_batch_wait: our last touch of b */
        mtc_fetch_sub_acq_rel(&b->active, 1);
        pthread_mutex_lock(&_pool.lock);
    }
    pthread_mutex_unlock(&_pool.lock);
    return NULL;
}

int mtc_pool_start(int nthreads)
{
    pthread_mutex_lock(&_pool.lock);
    if (_pool.nthreads) {
        pthread_mutex_unlock(&_pool.lock);
        return 0;
    }
    if (nthreads <= 0) {
        /* One thread's memcpy from pageable memory is far slower than the bus,
         * so staging takes most cores to keep the DMA fed. Leave two for the
         * Python thread and the transfer thread. */
        long cpus = sysconf(_SC_NPROCESSORS_ONLN);
        int64_t v;
        nthreads = mtc_env_int(MTC_ENV_HELPER_THREADS, &v) == 1 ? (int)v : cpus > 3 ? (int)(cpus - 2) : 1;
    }
    if (nthreads > _MAX_HELPERS) nthreads = _MAX_HELPERS;
    _pool.stop = 0;
    int rc = 0;
    for (int i = 0; i < nthreads; i++) {
        if ((rc = pthread_create(&_pool.threads[i], NULL, _helper_main, (void *)(intptr_t)i))) break;
        _pool.nthreads++;
    }
    pthread_mutex_unlock(&_pool.lock);
    return _pool.nthreads ? 0 : -rc;
}

int mtc_pool_size(void) { return _pool.nthreads; }

void mtc_batch_submit(mtc_batch *b, mtc_task_fn fn, void *arg, uint32_t n)
{
    b->fn = fn;
    b->arg = arg;
    b->n = n;
    atomic_init(&b->next, 0);
    atomic_init(&b->done, 0);
    atomic_init(&b->finished, n == 0);
    atomic_init(&b->active, 0);
    b->qnext = NULL;
    if (!n) return;
    if (!_pool.nthreads) mtc_pool_start(0);
    pthread_mutex_lock(&_pool.lock);
    if (_pool.tail) _pool.tail->qnext = b;
    else _pool.head = b;
    _pool.tail = b;
    pthread_cond_broadcast(&_pool.cond);
    pthread_mutex_unlock(&_pool.lock);
}

void mtc_batch_help(mtc_batch *b) { _run_tasks(b); }

void mtc_batch_wait(mtc_batch *b)
{
    /* pairs with the release of `finished` in _run_tasks */
    while (!mtc_load_acquire(&b->finished)) mtc_futex_wait(&b->finished, 0, -1);
    /* The batch may still sit in the queue (all tasks taken, not yet popped):
     * unlink it before the caller frees it. */
    pthread_mutex_lock(&_pool.lock);
    mtc_batch **pp = &_pool.head, *prev = NULL;
    while (*pp && *pp != b) {
        prev = *pp;
        pp = &(*pp)->qnext;
    }
    if (*pp) {
        *pp = b->qnext;
        if (_pool.tail == b) _pool.tail = prev;
    }
    pthread_mutex_unlock(&_pool.lock);
    /* Unlinked: no helper can pick b up any more. Wait for those that did to
     * leave it (they only have the failed fetch_add and the wake-up left). */
    while (mtc_load_acquire(&b->active)) mtc_cpu_relax(); /* pairs with the release in _helper_main */
}

void mtc_parallel_for(mtc_task_fn fn, void *arg, uint32_t n)
{
    mtc_batch b;
    mtc_batch_submit(&b, fn, arg, n);
    mtc_batch_help(&b);
    mtc_batch_wait(&b);
}

void mtc_pool_stop(void)
{
    pthread_mutex_lock(&_pool.lock);
    _pool.stop = 1;
    pthread_cond_broadcast(&_pool.cond);
    int n = _pool.nthreads;
    pthread_mutex_unlock(&_pool.lock);
    for (int i = 0; i < n; i++) pthread_join(_pool.threads[i], NULL);
    pthread_mutex_lock(&_pool.lock);
    _pool.nthreads = 0;
    pthread_mutex_unlock(&_pool.lock);
}

void mtc_pool_after_fork_child(void)
{
    pthread_mutex_init(&_pool.lock, NULL);
    pthread_cond_init(&_pool.cond, NULL);
    _pool.head = _pool.tail = NULL;
    _pool.nthreads = 0;
    _pool.stop = 0;
}

/* ---- copies ---- */

void mtc_copy_strided_range(void *dst, const void *src, int ndim, const int64_t *shape,
                            const int64_t *strides, int64_t elsize, int64_t begin, int64_t end)
{
    if (begin >= end) return;
    /* Merge the innermost dims while they are contiguous: the run length. */
    int inner = ndim;
    int64_t run = elsize;
    while (inner > 0 && (shape[inner - 1] == 1 || strides[inner - 1] == run)) {
        run *= shape[inner - 1];
        inner--;
    }
    if (inner == 0) {
        memcpy(dst, (const char *)src + begin, (size_t)(end - begin));
        return;
    }
    /* The outer dims [0, inner) without those of size 1 (their index is
     * always 0). Every one left has size >= 2 (a dim of size 0 leaves no
     * bytes: begin >= end above), and the copy spans fewer than 2^63 bytes,
     * so at most 62 are left, whatever ndim is (torch allows any). */
    int64_t sh[64], sd[64], idx[64];
    int m = 0;
    for (int d = 0; d < inner && m < 64; d++)
        if (shape[d] != 1) {
            sh[m] = shape[d];
            sd[m] = strides[d];
            m++;
        }
    /* Walk runs: index over the m dims, each run is `run` contiguous bytes. */
    int64_t r = begin / run, within = begin % run;
    for (int d = m - 1; d >= 0; d--) {
        idx[d] = r % sh[d];
        r /= sh[d];
    }
    char *out = dst;
    int64_t left = end - begin;
    while (left > 0) {
        const char *p = src;
        for (int d = 0; d < m; d++) p += idx[d] * sd[d];
        int64_t n = run - within;
        if (n > left) n = left;
        memcpy(out, p + within, (size_t)n);
        out += n;
        left -= n;
        within = 0;
        for (int d = m - 1; d >= 0; d--) {
            if (++idx[d] < sh[d]) break;
            idx[d] = 0;
        }
    }
}

void mtc_copy_strided(void *dst, const void *src, int ndim, const int64_t *shape,
                      const int64_t *strides, int64_t elsize)
{
    int64_t total = elsize;
    for (int d = 0; d < ndim; d++) total *= shape[d];
    mtc_copy_strided_range(dst, src, ndim, shape, strides, elsize, 0, total);
}

void mtc_copy_strided_to(void *dst, const int64_t *dst_strides, const void *src, int ndim,
                         const int64_t *shape, const int64_t *strides, int64_t elsize)
{
    if (!dst_strides) {
        mtc_copy_strided(dst, src, ndim, shape, strides, elsize);
        return;
    }
    /* The dims of size >= 2 (at most 62 when there are elements: see
     * mtc_copy_strided_range), outermost in the destination first. */
    int64_t sh[64], sd[64], key[64], total = elsize;
    int m = 0;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] == 0) return;
        if (shape[d] == 1) continue;
        /* 2^63 bytes or more: cannot be a copy's (refused before) */
        if (m == 64 || __builtin_mul_overflow(total, shape[d], &total)) return;
        int j = m++;
        for (; j > 0 && key[j - 1] < dst_strides[d]; j--) {
            sh[j] = sh[j - 1];
            sd[j] = sd[j - 1];
            key[j] = key[j - 1];
        }
        sh[j] = shape[d];
        sd[j] = strides[d];
        key[j] = dst_strides[d];
    }
    mtc_copy_strided_range(dst, src, m, sh, sd, elsize, 0, total);
}

typedef struct _pcopy { char *dst; const char *src; size_t n, piece; int nt; } _pcopy;

static void _pcopy_task(void *arg, uint32_t i)
{
    _pcopy *c = arg;
    size_t off = (size_t)i * c->piece;
    size_t len = c->n - off < c->piece ? c->n - off : c->piece;
    if (c->nt)
        mtc_memcpy_nt(c->dst + off, c->src + off, len);
    else
        memcpy(c->dst + off, c->src + off, len);
}

void mtc_memcpy_parallel(void *dst, const void *src, size_t nbytes, int nt)
{
    if (nbytes < 2 * MTC_PIECE_BYTES || !mtc_pool_size()) {
        if (nt)
            mtc_memcpy_nt(dst, src, nbytes);
        else
            memcpy(dst, src, nbytes);
        return;
    }
    _pcopy c = {dst, src, nbytes, MTC_PIECE_BYTES, nt};
    mtc_parallel_for(_pcopy_task, &c, (uint32_t)((nbytes + c.piece - 1) / c.piece));
}

/* ---- streaming copies and the copy-bandwidth probe ---- */

#if defined(__x86_64__)
/* 64 bytes per step, unaligned loads, aligned streaming stores (SSE2 is part
 * of x86-64): memory-bound, so wider vectors would not copy faster. */
static void _copy_nt_sse2(char *d, const char *s, size_t n)
{
    for (; n >= 64; n -= 64, d += 64, s += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)s), b = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + 32)), e = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_stream_si128((__m128i *)d, a);
        _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), c);
        _mm_stream_si128((__m128i *)(d + 48), e);
    }
    if (n) memcpy(d, s, n);
}
#endif

void mtc_memcpy_nt(void *dst, const void *src, size_t nbytes)
{
#if defined(__x86_64__)
    char *d = dst;
    const char *s = src;
    size_t head = (size_t)(-(uintptr_t)d & 15); /* to the destination's 16-byte alignment */
    if (nbytes < 256 || head >= nbytes) {
        memcpy(dst, src, nbytes);
        return;
    }
    memcpy(d, s, head);
    _copy_nt_sse2(d + head, s + head, nbytes - head);
    /* streaming stores are weakly ordered: fence them before the caller publishes the bytes */
    _mm_sfence();
#else
    memcpy(dst, src, nbytes);
#endif
}

static int64_t _now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

typedef struct _bench {
    char *dst;
    const char *src;
    size_t n, window;
    int threads, reps, nt;
    int abort;              /* written before `go` is set: the threads exit at once */
    mtc_flag go;            /* set once every thread was started (or one failed to) */
    pthread_barrier_t start, end;
} _bench;

typedef struct _bench_thread { _bench *b; int index; } _bench_thread;

static void _bench_share(_bench *b, int i)
{
    /* 4 KiB-aligned shares, the last one takes the rest */
    size_t per = (b->n / (size_t)b->threads) & ~(size_t)4095;
    size_t off = per * (size_t)i, len = i == b->threads - 1 ? b->n - off : per;
    if (b->window) {
        char *d = b->dst + (size_t)i * b->window;
        for (size_t o = 0; o < len; o += b->window) {
            size_t k = len - o < b->window ? len - o : b->window;
            if (b->nt) mtc_memcpy_nt(d, b->src + off + o, k);
            else memcpy(d, b->src + off + o, k);
        }
        return;
    }
    if (b->nt) mtc_memcpy_nt(b->dst + off, b->src + off, len);
    else memcpy(b->dst + off, b->src + off, len);
}

static void *_bench_main(void *arg)
{
    _bench_thread *t = arg;
    mtc_flag_wait(&t->b->go, -1);
    if (t->b->abort) return NULL;
    for (int r = 0; r < t->b->reps; r++) {
        pthread_barrier_wait(&t->b->start);
        _bench_share(t->b, t->index);
        pthread_barrier_wait(&t->b->end);
    }
    return NULL;
}

int mtc_memcpy_bench(void *dst, const void *src, size_t nbytes, int threads, int reps, int nt,
                     size_t window, double *secs)
{
    if (threads < 1 || threads > 64 || reps < 1) return -EINVAL;
    _bench b = {.dst = dst, .src = src, .n = nbytes, .window = window, .threads = threads, .reps = reps,
                .nt = nt};
    mtc_flag_init(&b.go);
    pthread_t th[64];
    _bench_thread ts[64];
    int started = 0, rc = 0;
    if (pthread_barrier_init(&b.start, NULL, (unsigned)threads)) return -ENOMEM;
    if (pthread_barrier_init(&b.end, NULL, (unsigned)threads)) {
        pthread_barrier_destroy(&b.start);
        return -ENOMEM;
    }
    /* the caller is thread 0; the others are started once and meet it at the barriers */
    for (int i = 1; i < threads && !rc; i++) {
        ts[i] = (_bench_thread){&b, i};
        if ((rc = -pthread_create(&th[i], NULL, _bench_main, &ts[i])) == 0) started++;
    }
    b.abort = rc != 0;
    mtc_flag_set(&b.go); /* its release publishes `abort` */
    if (rc) {
        /* a barrier of `threads` would never open without the missing ones */
        for (int i = 1; i <= started; i++) pthread_join(th[i], NULL);
    } else {
        for (int r = 0; r < reps; r++) {
            pthread_barrier_wait(&b.start);
            int64_t t0 = _now_ns();
            _bench_share(&b, 0);
            pthread_barrier_wait(&b.end);
            secs[r] = (double)(_now_ns() - t0) * 1e-9;
        }
        for (int i = 1; i < threads; i++) pthread_join(th[i], NULL);
    }
    pthread_barrier_destroy(&b.start);
    pthread_barrier_destroy(&b.end);
    return rc;
}
