/*
 * test_slab.c - unit tests for the pinned slab allocator (csrc/engine/slab.c).
 *
 * Fake ops: "pinned" memory is malloc'd, fences are structs with an atomic
 * `done` flag that the test (or a "GPU" thread) flips.  The fakes also check
 * the locking contract in single-threaded tests (fence_query with the pool
 * lock held, every other op without it) and that pinned bytes never exceed
 * the cap.  A fence_wait that waits too long, or a test that hangs anywhere,
 * aborts instead of hanging CI.
 */
#include "slab.h"

#include "check.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define K64 ((size_t)64 * 1024)

/* ------------------------------------------------------------------ fakes */

typedef struct fake_fence {
    atomic_int done;
} fake_fence;

/* One mutex/condvar for all fake fences: fence_wait sleeps on it. */
static pthread_mutex_t g_fmu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_fcv = PTHREAD_COND_INITIALIZER;

typedef struct fake_ctx {
    mtc_slab_pool *pool;
    int check_lock;            /* single-threaded tests only: trylock is unambiguous there */
    long cap_limit;            /* pinned bytes must never exceed this (0: unchecked) */
    atomic_long pinned, pinned_max, live_bufs, live_fences;
    atomic_long n_host_alloc, n_fence_wait;
    atomic_int fail_alloc;     /* next host_alloc returns this if non-zero */
    atomic_int fail_fence;     /* next fence_create returns this if non-zero */
    atomic_int fail_wait;      /* next fence_wait returns this if non-zero */
    atomic_int fail_query;     /* next fence_query returns this if non-zero */
} fake_ctx;

static void lock_must_be_free(fake_ctx *c)
{
    if (!c->check_lock)
        return;
    CHECK(pthread_mutex_trylock(&c->pool->mu) == 0);
    pthread_mutex_unlock(&c->pool->mu);
}

static void lock_must_be_held(fake_ctx *c)
{
    if (c->check_lock)
        CHECK(pthread_mutex_trylock(&c->pool->mu) == EBUSY);
}

static int fake_host_alloc(void *ctx, size_t bytes, void **out)
{
    fake_ctx *c = ctx;
    long now, max;
    int f;

    lock_must_be_free(c);
    atomic_fetch_add(&c->n_host_alloc, 1);
    f = atomic_exchange(&c->fail_alloc, 0);
    if (f)
        return f;
    *out = malloc(bytes);
    if (!*out)
        return -ENOMEM;
    now = atomic_fetch_add(&c->pinned, (long)bytes) + (long)bytes;
    max = atomic_load(&c->pinned_max);
    while (now > max && !atomic_compare_exchange_weak(&c->pinned_max, &max, now))
        ;
    if (c->cap_limit)
        CHECK(now <= c->cap_limit);
    atomic_fetch_add(&c->live_bufs, 1);
    return 0;
}

static void fake_host_free(void *ctx, void *ptr, size_t bytes)
{
    fake_ctx *c = ctx;

    lock_must_be_free(c);
    atomic_fetch_sub(&c->pinned, (long)bytes);
    atomic_fetch_sub(&c->live_bufs, 1);
    free(ptr);
}

static int fake_fence_create(void *ctx, void **out)
{
    fake_ctx *c = ctx;
    fake_fence *f;
    int e;

    lock_must_be_free(c);
    e = atomic_exchange(&c->fail_fence, 0);
    if (e)
        return e;
    f = malloc(sizeof *f);
    if (!f)
        return -ENOMEM;
    atomic_init(&f->done, 1);   /* like a never-recorded CUDA event */
    atomic_fetch_add(&c->live_fences, 1);
    *out = f;
    return 0;
}

static void fake_fence_destroy(void *ctx, void *fence)
{
    fake_ctx *c = ctx;
    fake_fence *f = fence;

    lock_must_be_free(c);
    /* The pool must never destroy a fence whose DMA is still running. */
    CHECK(atomic_load(&f->done) == 1);
    atomic_fetch_sub(&c->live_fences, 1);
    free(f);
}

static int fake_fence_query(void *ctx, void *fence)
{
    fake_ctx *c = ctx;
    int e;

    lock_must_be_held(c);
    e = atomic_exchange(&c->fail_query, 0);
    if (e)
        return e;
    return atomic_load_explicit(&((fake_fence *)fence)->done, memory_order_acquire);
}

static int fake_fence_wait(void *ctx, void *fence)
{
    fake_ctx *c = ctx;
    fake_fence *f = fence;
    struct timespec dl;
    int e;

    lock_must_be_free(c);
    atomic_fetch_add(&c->n_fence_wait, 1);
    e = atomic_exchange(&c->fail_wait, 0);
    if (e)
        return e;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += 20;
    pthread_mutex_lock(&g_fmu);
    while (!atomic_load_explicit(&f->done, memory_order_acquire)) {
        if (pthread_cond_timedwait(&g_fcv, &g_fmu, &dl) == ETIMEDOUT &&
            !atomic_load(&f->done)) {
            fprintf(stderr, "fake_fence_wait: fence never completed (pool bug?)\n");
            exit(1);
        }
    }
    pthread_mutex_unlock(&g_fmu);
    return 0;
}

/* Marks a fence pending, as cuEventRecord would. */
static void fence_record(void *fence)
{
    atomic_store(&((fake_fence *)fence)->done, 0);
}

/* The "GPU" finishing the work a fence tracks. */
static void fence_complete(void *fence)
{
    pthread_mutex_lock(&g_fmu);
    atomic_store_explicit(&((fake_fence *)fence)->done, 1, memory_order_release);
    pthread_cond_broadcast(&g_fcv);
    pthread_mutex_unlock(&g_fmu);
}

static int fence_done(void *fence)
{
    return atomic_load(&((fake_fence *)fence)->done);
}

static void setup(mtc_slab_pool *p, fake_ctx *c, size_t cap, int check_lock)
{
    mtc_slab_ops ops;

    memset(c, 0, sizeof *c);
    c->pool = p;
    c->check_lock = check_lock;
    c->cap_limit = (long)cap;
    ops.ctx = c;
    ops.host_alloc = fake_host_alloc;
    ops.host_free = fake_host_free;
    ops.fence_create = fake_fence_create;
    ops.fence_destroy = fake_fence_destroy;
    ops.fence_query = fake_fence_query;
    ops.fence_wait = fake_fence_wait;
    CHECK(mtc_slab_pool_init(p, &ops, cap) == 0);
    CHECK(mtc_slab_valid(p));
}

/* Destroys the pool and checks that every buffer and fence was freed. */
static void teardown(mtc_slab_pool *p, fake_ctx *c)
{
    CHECK(mtc_slab_valid(p));
    mtc_slab_pool_destroy(p);
    CHECK(atomic_load(&c->live_bufs) == 0);
    CHECK(atomic_load(&c->live_fences) == 0);
    CHECK(atomic_load(&c->pinned) == 0);
    if (c->cap_limit)
        CHECK(atomic_load(&c->pinned_max) <= c->cap_limit);
}

static mtc_slab_stats stats(mtc_slab_pool *p)
{
    mtc_slab_stats st;

    mtc_slab_get_stats(p, &st);
    return st;
}

/* Gets s's fence and records it: the caller then releases with fenced=1. */
static void *arm(mtc_slab_pool *p, mtc_slab *s)
{
    void *f = NULL;

    CHECK(mtc_slab_fence(p, s, &f) == 0);
    CHECK(f != NULL && f == s->fence);
    fence_record(f);
    return f;
}

/* Polls until *flag reaches want (5 s max): for "the other thread is now blocked". */
static void wait_until_long(atomic_long *v, long want)
{
    int i;

    for (i = 0; i < 5000 && atomic_load(v) < want; i++)
        sleep_ms(1);
    CHECK(atomic_load(v) >= want);
}

/* ------------------------------------------------------------------ tests */

static void test_class_sizes(void)
{
    CHECK(mtc_slab_class_bytes(0) == K64);
    CHECK(mtc_slab_class_bytes(1) == K64);
    CHECK(mtc_slab_class_bytes(K64) == K64);
    CHECK(mtc_slab_class_bytes(K64 + 1) == 2 * K64);
    CHECK(mtc_slab_class_bytes(1u << 20) == (1u << 20));
    CHECK(mtc_slab_class_bytes((1u << 20) + 1) == (2u << 20));
    CHECK(mtc_slab_class_bytes(3u << 20) == (4u << 20));
    if (sizeof(size_t) >= 8) {
        size_t top = (size_t)((uint64_t)MTC_SLAB_MIN_BYTES << (MTC_SLAB_NCLASSES - 1));
        CHECK(mtc_slab_class_bytes(top) == top);
        CHECK(mtc_slab_class_bytes(top - 1) == top);
        CHECK(mtc_slab_class_bytes(top + 1) == 0);
    }
    CHECK(mtc_slab_class_bytes(SIZE_MAX) == 0);
}

static void test_init_args(void)
{
    mtc_slab_pool p;
    fake_ctx c;
    mtc_slab_ops ops;
    mtc_slab *s = NULL;

    setup(&p, &c, 4 * K64, 1);
    ops = p.ops;
    mtc_slab_pool_destroy(&p);
    CHECK(mtc_slab_pool_init(&p, &ops, 0) == -EINVAL);
    CHECK(mtc_slab_pool_init(&p, NULL, K64) == -EINVAL);
    ops.fence_wait = NULL;
    CHECK(mtc_slab_pool_init(&p, &ops, K64) == -EINVAL);

    setup(&p, &c, 4 * K64, 1);
    CHECK(mtc_slab_try_alloc(&p, 1, NULL) == -EINVAL);
    CHECK(mtc_slab_alloc(NULL, 1, &s) == -EINVAL);
    CHECK(mtc_slab_set_cap(&p, 0) == -EINVAL);
    CHECK(mtc_slab_set_cap(NULL, K64) == -EINVAL);
    CHECK(mtc_slab_fence(NULL, NULL, NULL) == -EINVAL);
    CHECK(mtc_slab_drain(NULL) == -EINVAL);
    CHECK(mtc_slab_trim(NULL) == 0);
    CHECK(mtc_slab_valid(NULL) == 0);
    mtc_slab_release(NULL, NULL, 0);
    mtc_slab_release(&p, NULL, 1);
    mtc_slab_get_stats(NULL, NULL);
    mtc_slab_pool_destroy(NULL);
    teardown(&p, &c);
}

static void test_basic_reuse(void)
{
    mtc_slab_pool p;
    fake_ctx c;
    mtc_slab *a, *b, *x, *y;
    mtc_slab_stats st;
    void *f1, *f2;

    setup(&p, &c, 1u << 20, 1);
    CHECK(mtc_slab_alloc(&p, 100, &a) == 0);
    CHECK(a && a->ptr && a->bytes == K64 && a->cls == 0);
    memset(a->ptr, 0xab, a->bytes);   /* ASan: the whole class size is usable */
    st = stats(&p);
    CHECK(st.allocs == 1 && st.reuses == 0);
    CHECK(st.bytes_held == K64 && st.bytes_in_use == K64);
    CHECK(st.slabs_held == 1 && st.slabs_in_use == 1);
    CHECK(st.cap_bytes == (1u << 20) && st.bytes_high_water == K64);

    mtc_slab_release(&p, a, 0);
    st = stats(&p);
    CHECK(st.bytes_in_use == 0 && st.slabs_in_use == 0 && st.bytes_held == K64);

    CHECK(mtc_slab_alloc(&p, 1000, &b) == 0);
    CHECK(b == a);
    st = stats(&p);
    CHECK(st.allocs == 1 && st.reuses == 1 && st.bytes_in_use == K64);

    /* A different class is a fresh pin. */
    CHECK(mtc_slab_try_alloc(&p, K64 + 1, &x) == 0);
    CHECK(x != b && x->bytes == 2 * K64 && x->cls == 1);
    st = stats(&p);
    CHECK(st.allocs == 2 && st.bytes_held == 3 * K64 && st.bytes_high_water == 3 * K64);
    mtc_slab_release(&p, x, 0);

    /* LRU-ish: the earliest released slab is handed out first. */
    CHECK(mtc_slab_alloc(&p, 1, &y) == 0);
    CHECK(y != b);
    mtc_slab_release(&p, b, 0);
    mtc_slab_release(&p, y, 0);
    CHECK(mtc_slab_alloc(&p, 1, &x) == 0 && x == b);
    CHECK(mtc_slab_alloc(&p, 1, &x) == 0 && x == y);

    /* The fence is created once, lazily, and stays with the slab. */
    CHECK(atomic_load(&c.live_fences) == 0);
    CHECK(mtc_slab_fence(&p, y, &f1) == 0 && mtc_slab_fence(&p, y, &f2) == 0);
    CHECK(f1 == f2 && atomic_load(&c.live_fences) == 1);
    mtc_slab_release(&p, y, 0);

    /* A double release is ignored and leaves the pool intact. */
    mtc_slab_release(&p, y, 0);
    mtc_slab_release(&p, b, 0);   /* b's real release */
    mtc_slab_release(&p, b, 1);
    CHECK(mtc_slab_valid(&p));
    st = stats(&p);
    CHECK(st.slabs_in_use == 0 && st.bytes_in_use == 0 && st.slabs_held == 3);
    teardown(&p, &c);
}

static void test_pending_not_reused(void)
{
    mtc_slab_pool p;
    fake_ctx c;
    mtc_slab *a, *b, *x;
    mtc_slab_stats st;
    void *fa, *fb;

    setup(&p, &c, 1u << 20, 1);
    CHECK(mtc_slab_alloc(&p, 1, &a) == 0);
    fa = arm(&p, a);
    mtc_slab_release(&p, a, 1);

    /* a's DMA may still read it: a fresh slab under the cap instead. */
    CHECK(mtc_slab_alloc(&p, 1, &b) == 0);
    CHECK(b != a && b->ptr != a->ptr);
    st = stats(&p);
    CHECK(st.allocs == 2 && st.reuses == 0 && st.waits == 0);

    /* An older pending slab is skipped for a younger completed one. */
    mtc_slab_release(&p, b, 0);
    CHECK(mtc_slab_try_alloc(&p, 1, &x) == 0 && x == b);
    st = stats(&p);
    CHECK(st.allocs == 2 && st.reuses == 1);

    /* Once the fence completes, a is reused. */
    fence_complete(fa);
    CHECK(mtc_slab_try_alloc(&p, 1, &x) == 0 && x == a);
    st = stats(&p);
    CHECK(st.allocs == 2 && st.reuses == 2);

    /* Reused slab keeps its fence; arm it again and release both. */
    CHECK(arm(&p, a) == fa);
    fb = arm(&p, b);
    mtc_slab_release(&p, a, 1);
    mtc_slab_release(&p, b, 1);
    CHECK(atomic_load(&c.n_fence_wait) == 0);   /* nothing waited so far */
    fence_complete(fa);
    fence_complete(fb);
    teardown(&p, &c);
}

typedef struct alloc_job {
    mtc_slab_pool *p;
    size_t bytes;
    mtc_slab *out;
    int rc;
    atomic_int done;
} alloc_job;

static void *alloc_thread(void *arg)
{
    alloc_job *j = arg;

    j->rc = mtc_slab_alloc(j->p, j->bytes, &j->out);
    atomic_store(&j->done, 1);
    return NULL;
}

static void test_backpressure(void)
{
    mtc_slab_pool p;
    fake_ctx c;
    mtc_slab *s[4], *x;
    void *f[4];
    mtc_slab_stats st;
    alloc_job j;
    pthread_t t;
    int i;

    setup(&p, &c, 4 * K64, 0);   /* threads: no trylock contract checks */
    for (i = 0; i < 4; i++) {
        CHECK(mtc_slab_alloc(&p, K64, &s[i]) == 0);
        f[i] = arm(&p, s[i]);
    }
    for (i = 0; i < 4; i++)
        mtc_slab_release(&p, s[i], 1);
    st = stats(&p);
    CHECK(st.bytes_held == 4 * K64 && st.bytes_in_use == 0);

    /* At the cap with every fence pending: the try-path refuses. */
    x = (mtc_slab *)&x;
    CHECK(mtc_slab_try_alloc(&p, 1, &x) == -EAGAIN && x == NULL);
    CHECK(mtc_slab_try_alloc(&p, 2 * K64, &x) == -EAGAIN);
    st = stats(&p);
    CHECK(st.waits == 0 && st.allocs == 4 && st.evictions == 0);

    /* The waiting path blocks on the oldest fence, and only on it. */
    memset(&j, 0, sizeof j);
    j.p = &p;
    j.bytes = 1;
    CHECK(pthread_create(&t, NULL, alloc_thread, &j) == 0);
    wait_until_long(&c.n_fence_wait, 1);
    sleep_ms(20);
    CHECK(!atomic_load(&j.done));
    st = stats(&p);
    CHECK(st.waits == 1 && st.bytes_held == 4 * K64);
    fence_complete(f[1]);          /* not the oldest: the waiter sleeps on */
    sleep_ms(20);
    CHECK(!atomic_load(&j.done));
    fence_complete(f[0]);
    CHECK(pthread_join(t, NULL) == 0);
    CHECK(j.rc == 0 && j.out == s[0]);
    st = stats(&p);
    CHECK(st.waits == 1 && st.allocs == 4 && st.reuses == 1);
    CHECK(st.bytes_held == 4 * K64 && st.bytes_high_water == 4 * K64);
    CHECK(mtc_slab_valid(&p));

    /* s[1] completed meanwhile: reused without waiting. */
    CHECK(mtc_slab_alloc(&p, 1, &x) == 0 && x == s[1]);
    fence_complete(f[2]);
    fence_complete(f[3]);
    CHECK(mtc_slab_alloc(&p, 1, &x) == 0 && x == s[2]);
    CHECK(mtc_slab_alloc(&p, 1, &x) == 0 && x == s[3]);

    /* Cap held entirely by slabs in use, no fence in flight: the waiter
     * sleeps until another thread releases one. */
    memset(&j, 0, sizeof j);
    j.p = &p;
    j.bytes = K64;
    CHECK(pthread_create(&t, NULL, alloc_thread, &j) == 0);
    for (i = 0; i < 5000 && stats(&p).waits < 2; i++)
        sleep_ms(1);
    CHECK(stats(&p).waits == 2);
    sleep_ms(20);
    CHECK(!atomic_load(&j.done));
    mtc_slab_release(&p, s[3], 0);
    CHECK(pthread_join(t, NULL) == 0);
    CHECK(j.rc == 0 && j.out == s[3]);

    for (i = 0; i < 4; i++)
        mtc_slab_release(&p, s[i], 0);
    st = stats(&p);
    CHECK(st.bytes_held <= 4 * K64 && st.slabs_in_use == 0 && st.allocs == 4);
    teardown(&p, &c);
}

static void test_eviction(void)
{
    mtc_slab_pool p;
    fake_ctx c;
    mtc_slab *a, *b, *x, *y, *z;
    mtc_slab_stats st;
    void *fb, *fy;

    setup(&p, &c, 4 * K64, 1);
    CHECK(mtc_slab_alloc(&p, 2 * K64, &a) == 0);
    CHECK(mtc_slab_alloc(&p, 2 * K64, &b) == 0);
    mtc_slab_release(&p, a, 0);
    mtc_slab_release(&p, b, 0);

    /* No room for a 64K slab: the least recently released idle 128K goes. */
    CHECK(mtc_slab_try_alloc(&p, 1, &x) == 0 && x->bytes == K64);
    st = stats(&p);
    CHECK(st.evictions == 1 && st.allocs == 3 && st.bytes_held == 3 * K64);
    CHECK(mtc_slab_alloc(&p, 2 * K64, &y) == 0 && y == b);   /* b survived */
    CHECK(mtc_slab_valid(&p));

    /* Other class pending, rest in use: nothing evictable. */
    fb = arm(&p, b);
    mtc_slab_release(&p, y, 1);
    CHECK(mtc_slab_try_alloc(&p, 4 * K64, &z) == -EAGAIN);
    st = stats(&p);
    CHECK(st.evictions == 1 && st.bytes_held == 3 * K64);

    /* Completed and idle: both go to make room for a 256K slab. */
    fence_complete(fb);
    mtc_slab_release(&p, x, 0);
    CHECK(mtc_slab_try_alloc(&p, 4 * K64, &z) == 0 && z->bytes == 4 * K64);
    st = stats(&p);
    CHECK(st.evictions == 3 && st.bytes_held == 4 * K64 && st.slabs_held == 1);
    CHECK(atomic_load(&c.live_fences) == 0);   /* b's fence went with it */
    mtc_slab_release(&p, z, 0);
    teardown(&p, &c);

    /* All or nothing: evicting an idle 64K cannot make room for 128K while
     * the other 64K waits on its fence, so nothing is thrown away. */
    setup(&p, &c, 4 * K64, 1);
    CHECK(mtc_slab_alloc(&p, 1, &x) == 0);
    CHECK(mtc_slab_alloc(&p, 1, &y) == 0);
    CHECK(mtc_slab_alloc(&p, 2 * K64, &z) == 0);
    fy = arm(&p, y);
    mtc_slab_release(&p, x, 0);
    mtc_slab_release(&p, y, 1);
    CHECK(mtc_slab_try_alloc(&p, 2 * K64, &a) == -EAGAIN);
    st = stats(&p);
    CHECK(st.evictions == 0 && st.bytes_held == 4 * K64 && st.slabs_held == 3);
    /* Once y's fence completes, both 64K slabs go for the 128K request. */
    fence_complete(fy);
    CHECK(mtc_slab_try_alloc(&p, 2 * K64, &a) == 0);
    st = stats(&p);
    CHECK(st.evictions == 2 && st.bytes_held == 4 * K64 && st.slabs_held == 2);
    mtc_slab_release(&p, a, 0);
    mtc_slab_release(&p, z, 0);
    teardown(&p, &c);
}

static void test_e2big(void)
{
    mtc_slab_pool p;
    fake_ctx c;
    mtc_slab *s;

    setup(&p, &c, 2 * K64, 1);
    CHECK(mtc_slab_try_alloc(&p, 2 * K64 + 1, &s) == -E2BIG);
    CHECK(mtc_slab_alloc(&p, 2 * K64 + 1, &s) == -E2BIG);   /* no wait either */
    CHECK(mtc_slab_alloc(&p, SIZE_MAX, &s) == -E2BIG);
    CHECK(stats(&p).waits == 0 && atomic_load(&c.n_host_alloc) == 0);
    CHECK(mtc_slab_alloc(&p, 0, &s) == 0 && s->bytes == K64);   /* 0 bytes: smallest class */
    mtc_slab_release(&p, s, 0);
    CHECK(mtc_slab_alloc(&p, 2 * K64, &s) == 0 && s->bytes == 2 * K64);   /* == cap is fine */
    mtc_slab_release(&p, s, 0);
    teardown(&p, &c);
}

static void test_set_cap(void)
{
    mtc_slab_pool p;
    fake_ctx c;
    mtc_slab *s[4], *x;
    mtc_slab_stats st;
    int i;

    setup(&p, &c, 16 * K64, 1);
    for (i = 0; i < 4; i++)
        CHECK(mtc_slab_alloc(&p, 1, &s[i]) == 0);
    for (i = 0; i < 4; i++)
        mtc_slab_release(&p, s[i], 0);
    CHECK(mtc_slab_set_cap(&p, 2 * K64) == 0);
    st = stats(&p);
    CHECK(st.cap_bytes == 2 * K64 && st.bytes_held == 2 * K64 && st.evictions == 2);
    CHECK(mtc_slab_valid(&p));
    CHECK(mtc_slab_set_cap(&p, 0) == -EINVAL);
    CHECK(stats(&p).cap_bytes == 2 * K64);

    /* Cut below what is in use: nothing to free now, pool stays valid, and
     * nothing new is pinned while over the cap. */
    CHECK(mtc_slab_alloc(&p, 1, &s[0]) == 0 && mtc_slab_alloc(&p, 1, &s[1]) == 0);
    CHECK(mtc_slab_set_cap(&p, K64) == 0);
    st = stats(&p);
    CHECK(st.bytes_held == 2 * K64 && st.cap_bytes == K64);
    CHECK(mtc_slab_valid(&p));
    CHECK(mtc_slab_try_alloc(&p, 1, &x) == -EAGAIN);
    mtc_slab_release(&p, s[1], 0);
    CHECK(mtc_slab_try_alloc(&p, 1, &x) == 0 && x == s[1]);   /* reuse, no growth */
    CHECK(stats(&p).bytes_held == 2 * K64);
    mtc_slab_release(&p, s[0], 0);
    mtc_slab_release(&p, x, 0);
    /* Shed later: a trim (or an allocation that needs room) gets back under. */
    CHECK(mtc_slab_trim(&p) == 2 * K64);
    CHECK(stats(&p).bytes_held == 0);
    CHECK(mtc_slab_valid(&p));

    /* Raising it lets the pool grow again. */
    CHECK(mtc_slab_set_cap(&p, 4 * K64) == 0);
    CHECK(mtc_slab_alloc(&p, 4 * K64, &x) == 0);
    mtc_slab_release(&p, x, 0);
    CHECK(mtc_slab_set_cap(&p, 2 * K64) == 0);   /* idle 256K freed at once */
    st = stats(&p);
    CHECK(st.bytes_held == 0 && st.bytes_high_water == 4 * K64);
    c.cap_limit = 4 * K64;   /* nothing above 256K was ever pinned here */
    teardown(&p, &c);
}

static void test_failures(void)
{
    mtc_slab_pool p;
    fake_ctx c;
    mtc_slab *s[4], *x;
    mtc_slab_stats st;
    void *f;
    int i;

    setup(&p, &c, 4 * K64, 1);
    /* host_alloc failure: reported, nothing counted, reservation returned. */
    atomic_store(&c.fail_alloc, -ENOMEM);
    x = (mtc_slab *)&x;
    CHECK(mtc_slab_try_alloc(&p, 1, &x) == -ENOMEM && x == NULL);
    st = stats(&p);
    CHECK(st.allocs == 0 && st.bytes_held == 0 && st.slabs_held == 0);
    CHECK(mtc_slab_valid(&p));
    for (i = 0; i < 4; i++)   /* the full cap is still available */
        CHECK(mtc_slab_alloc(&p, 1, &s[i]) == 0);
    for (i = 0; i < 4; i++)
        mtc_slab_release(&p, s[i], 0);

    /* Failure after an eviction made room: the eviction stands, the pool
     * stays valid, and a retry succeeds. */
    atomic_store(&c.fail_alloc, -EIO);
    CHECK(mtc_slab_alloc(&p, 2 * K64, &x) == -EIO);
    st = stats(&p);
    CHECK(st.evictions == 2 && st.bytes_held == 2 * K64 && st.allocs == 4);
    CHECK(mtc_slab_valid(&p));
    CHECK(mtc_slab_alloc(&p, 2 * K64, &x) == 0);   /* held: x + two idle 64K = cap */

    /* fence_create failure; a fenced release without a fence counts as
     * unfenced (there is nothing to wait on). */
    CHECK(mtc_slab_alloc(&p, 1, &s[0]) == 0);
    atomic_store(&c.fail_fence, -EBUSY);
    CHECK(mtc_slab_fence(&p, s[0], &f) == -EBUSY && s[0]->fence == NULL);
    mtc_slab_release(&p, s[0], 1);
    CHECK(mtc_slab_valid(&p));
    st = stats(&p);
    CHECK(mtc_slab_try_alloc(&p, 1, &s[1]) == 0);
    CHECK(stats(&p).reuses == st.reuses + 1 && stats(&p).allocs == st.allocs);

    /* fence_wait failure: reported, the slab stays cached and armed. */
    CHECK(mtc_slab_alloc(&p, 1, &s[2]) == 0);     /* x, s[1], s[2] in use: full */
    f = arm(&p, s[1]);
    mtc_slab_release(&p, s[1], 1);
    atomic_store(&c.fail_wait, -EIO);
    CHECK(mtc_slab_alloc(&p, 1, &s[3]) == -EIO);
    CHECK(mtc_slab_valid(&p));
    st = stats(&p);
    CHECK(st.slabs_held == 3 && st.slabs_in_use == 2 && st.waits == 1);
    fence_complete(f);
    CHECK(mtc_slab_alloc(&p, 1, &s[3]) == 0 && s[3] == s[1]);

    /* fence_query failure, on the exact-class scan and on the eviction
     * scan: reported, nothing lost, nothing freed. */
    f = arm(&p, s[3]);
    mtc_slab_release(&p, s[3], 1);
    atomic_store(&c.fail_query, -EIO);
    CHECK(mtc_slab_try_alloc(&p, 1, &s[0]) == -EIO);
    CHECK(mtc_slab_valid(&p));
    mtc_slab_release(&p, x, 0);                  /* idle 128K + pending 64K */
    atomic_store(&c.fail_query, -EIO);
    CHECK(mtc_slab_try_alloc(&p, 4 * K64, &s[0]) == -EIO);
    st = stats(&p);
    CHECK(st.slabs_held == 3 && st.evictions == 2);
    atomic_store(&c.fail_query, -EIO);
    CHECK(mtc_slab_trim(&p) == 0);               /* best effort: nothing freed */
    CHECK(mtc_slab_valid(&p) && stats(&p).slabs_held == 3);
    fence_complete(f);
    mtc_slab_release(&p, s[2], 0);
    teardown(&p, &c);
}

/* The checker must actually notice broken invariants. */
static void test_validator(void)
{
    mtc_slab_pool p;
    fake_ctx c;
    mtc_slab *a, *b, *d;
    uint64_t seq;

    setup(&p, &c, 16 * K64, 1);
    CHECK(mtc_slab_alloc(&p, 1, &a) == 0);
    CHECK(mtc_slab_alloc(&p, 1, &b) == 0);
    CHECK(mtc_slab_alloc(&p, 2 * K64, &d) == 0);
    mtc_slab_release(&p, a, 0);
    mtc_slab_release(&p, b, 0);
    mtc_slab_release(&p, d, 0);
    CHECK(mtc_slab_valid(&p));

    p.bytes_idle += 1;                     /* counts disagree with the lists */
    CHECK(!mtc_slab_valid(&p));
    p.bytes_idle -= 1;
    p.slabs_in_use += 1;
    CHECK(!mtc_slab_valid(&p));
    p.slabs_in_use -= 1;
    p.claimed = b;                         /* b on two lists */
    CHECK(!mtc_slab_valid(&p));
    p.claimed = NULL;
    seq = a->release_seq;                  /* out of release order */
    a->release_seq = b->release_seq + 1;
    CHECK(!mtc_slab_valid(&p));
    a->release_seq = seq;
    d->cls = 0;                            /* wrong class for its size/list */
    CHECK(!mtc_slab_valid(&p));
    d->cls = 1;
    b->next = a;                           /* cycle: must not hang */
    CHECK(!mtc_slab_valid(&p));
    b->next = NULL;
    p.tail[0] = a;                         /* stale tail */
    CHECK(!mtc_slab_valid(&p));
    p.tail[0] = b;
    p.cap = p.held_limit = K64;            /* held over the cap, not after a cut */
    CHECK(!mtc_slab_valid(&p));
    p.cap = p.held_limit = 16 * K64;
    b->fenced = 1;                         /* armed with no fence */
    CHECK(!mtc_slab_valid(&p));
    b->fenced = 0;
    CHECK(mtc_slab_valid(&p));
    teardown(&p, &c);
}

static void test_trim(void)
{
    mtc_slab_pool p;
    fake_ctx c;
    mtc_slab *a, *b, *d;
    void *fb;

    setup(&p, &c, 16 * K64, 1);
    CHECK(mtc_slab_trim(&p) == 0);
    CHECK(mtc_slab_alloc(&p, 1, &a) == 0);
    CHECK(mtc_slab_alloc(&p, 2 * K64, &b) == 0);
    CHECK(mtc_slab_alloc(&p, 1, &d) == 0);
    fb = arm(&p, b);
    mtc_slab_release(&p, a, 0);
    mtc_slab_release(&p, b, 1);
    CHECK(mtc_slab_trim(&p) == K64);             /* a only: b pending, d in use */
    CHECK(stats(&p).bytes_held == 3 * K64);
    fence_complete(fb);
    CHECK(mtc_slab_trim(&p) == 2 * K64);
    mtc_slab_release(&p, d, 0);
    CHECK(mtc_slab_trim(&p) == K64);
    CHECK(stats(&p).bytes_held == 0 && stats(&p).evictions == 0);
    CHECK(atomic_load(&c.live_bufs) == 0 && atomic_load(&c.live_fences) == 0);
    CHECK(atomic_load(&c.n_fence_wait) == 0);
    teardown(&p, &c);
}

typedef struct later_job {
    void *fences[8];
    int n;
    long delay_ms;
} later_job;

/* Completes fences in order after a delay: a slow "GPU". */
static void *complete_later(void *arg)
{
    later_job *j = arg;
    int i;

    for (i = 0; i < j->n; i++) {
        sleep_ms(j->delay_ms);
        fence_complete(j->fences[i]);
    }
    return NULL;
}

static void test_drain(void)
{
    mtc_slab_pool p;
    fake_ctx c;
    mtc_slab *s[3];
    later_job j;
    pthread_t t;
    int i;

    setup(&p, &c, 16 * K64, 0);
    CHECK(mtc_slab_drain(&p) == 0);
    memset(&j, 0, sizeof j);
    for (i = 0; i < 3; i++) {
        CHECK(mtc_slab_alloc(&p, (size_t)(i + 1) * K64, &s[i]) == 0);
        j.fences[j.n++] = arm(&p, s[i]);
    }
    for (i = 0; i < 3; i++)
        mtc_slab_release(&p, s[i], 1);
    CHECK(mtc_slab_trim(&p) == 0);   /* all pending */
    j.delay_ms = 10;
    CHECK(pthread_create(&t, NULL, complete_later, &j) == 0);
    CHECK(mtc_slab_drain(&p) == 0);
    for (i = 0; i < 3; i++)
        CHECK(fence_done(j.fences[i]));
    CHECK(pthread_join(t, NULL) == 0);
    CHECK(mtc_slab_valid(&p));
    CHECK(stats(&p).waits == 0);      /* drain is not backpressure */
    CHECK(mtc_slab_trim(&p) == K64 + 2 * K64 + 4 * K64);

    /* A fence_wait error comes back from drain. */
    CHECK(mtc_slab_alloc(&p, 1, &s[0]) == 0);
    j.fences[0] = arm(&p, s[0]);
    mtc_slab_release(&p, s[0], 1);
    atomic_store(&c.fail_wait, -EIO);
    CHECK(mtc_slab_drain(&p) == -EIO);
    CHECK(mtc_slab_valid(&p));
    fence_complete(j.fences[0]);
    CHECK(mtc_slab_drain(&p) == 0);
    teardown(&p, &c);

    /* The only pending fence is being waited on by an allocator (its slab
     * is claimed, off the lists): drain must still wait for it. */
    {
        alloc_job aj;
        pthread_t at;

        setup(&p, &c, K64, 0);
        CHECK(mtc_slab_alloc(&p, 1, &s[0]) == 0);
        j.fences[0] = arm(&p, s[0]);
        mtc_slab_release(&p, s[0], 1);
        memset(&aj, 0, sizeof aj);
        aj.p = &p;
        aj.bytes = 1;
        CHECK(pthread_create(&at, NULL, alloc_thread, &aj) == 0);
        wait_until_long(&c.n_fence_wait, 1);   /* allocator holds the claim */
        j.n = 1;
        j.delay_ms = 30;
        CHECK(pthread_create(&t, NULL, complete_later, &j) == 0);
        CHECK(mtc_slab_drain(&p) == 0);
        CHECK(fence_done(j.fences[0]));
        CHECK(atomic_load(&c.n_fence_wait) == 1);   /* drain did not wait on it itself */
        CHECK(pthread_join(t, NULL) == 0);
        CHECK(pthread_join(at, NULL) == 0);
        CHECK(aj.rc == 0 && aj.out == s[0]);
        mtc_slab_release(&p, s[0], 0);
        teardown(&p, &c);
    }
}

static void test_destroy_waits(void)
{
    mtc_slab_pool p;
    fake_ctx c;
    mtc_slab *s[4];
    later_job j;
    pthread_t t;
    int i;

    setup(&p, &c, 16 * K64, 0);
    memset(&j, 0, sizeof j);
    for (i = 0; i < 4; i++)
        CHECK(mtc_slab_alloc(&p, (size_t)(i + 1) * K64, &s[i]) == 0);
    for (i = 0; i < 3; i++)
        j.fences[j.n++] = arm(&p, s[i]);
    for (i = 0; i < 4; i++)
        mtc_slab_release(&p, s[i], i < 3);
    j.delay_ms = 5;
    CHECK(pthread_create(&t, NULL, complete_later, &j) == 0);
    /* fake_fence_destroy CHECKs each fence completed: destroy must wait. */
    mtc_slab_pool_destroy(&p);
    CHECK(pthread_join(t, NULL) == 0);
    CHECK(atomic_load(&c.live_bufs) == 0 && atomic_load(&c.live_fences) == 0);
    CHECK(atomic_load(&c.pinned) == 0);
    CHECK(atomic_load(&c.n_fence_wait) == 3);
}

/* ------------------------------------------------------- threaded stress */

#define MT_THREADS 4
#define MT_ITERS 20000
#define MT_CAP (12 * K64)   /* 768K: four 256K slabs in use do not fit */
#define QCAP 4096

typedef struct gpu_job {
    void *fence;
    uint64_t *word;
    uint64_t token;
} gpu_job;

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    gpu_job q[QCAP];
    size_t head, tail;
    int stop;
} g_gpu;

static void gpu_submit(void *fence, uint64_t *word, uint64_t token)
{
    pthread_mutex_lock(&g_gpu.mu);
    CHECK(g_gpu.tail - g_gpu.head < QCAP);
    g_gpu.q[g_gpu.tail % QCAP] = (gpu_job){ fence, word, token };
    g_gpu.tail++;
    pthread_cond_signal(&g_gpu.cv);
    pthread_mutex_unlock(&g_gpu.mu);
}

/* Completes fences strictly in submission order, like one CUDA stream. */
static void *gpu_thread(void *arg)
{
    gpu_job j;
    unsigned n = 0;

    (void)arg;
    for (;;) {
        pthread_mutex_lock(&g_gpu.mu);
        while (g_gpu.head == g_gpu.tail && !g_gpu.stop)
            pthread_cond_wait(&g_gpu.cv, &g_gpu.mu);
        if (g_gpu.head == g_gpu.tail) {
            pthread_mutex_unlock(&g_gpu.mu);
            return NULL;
        }
        j = g_gpu.q[g_gpu.head % QCAP];
        g_gpu.head++;
        pthread_mutex_unlock(&g_gpu.mu);
        /* The "DMA" reads the slab: nobody may have reused it meanwhile. */
        CHECK(*j.word == j.token);
        if (++n % 16 == 0)
            sched_yield();
        if (n % 256 == 0)
            usleep(200);   /* let a backlog build so the cap bites */
        fence_complete(j.fence);
    }
}

typedef struct worker_arg {
    mtc_slab_pool *p;
    unsigned id;
    long ok_allocs;
} worker_arg;

static void *worker(void *arg)
{
    worker_arg *w = arg;
    uint64_t rng = 0x9e3779b97f4a7c15ull * (w->id + 1);
    mtc_slab_stats st;
    mtc_slab *s;
    uint64_t token, *first, *last;
    size_t bytes;
    void *f;
    int i, rc;

    for (i = 0; i < MT_ITERS; i++) {
        bytes = (K64 << (xorshift64(&rng) % 3)) - xorshift64(&rng) % K64;   /* 64K..256K classes */
        if (xorshift64(&rng) % 4 == 0) {
            rc = mtc_slab_try_alloc(w->p, bytes, &s);
            if (rc == -EAGAIN)
                rc = mtc_slab_alloc(w->p, bytes, &s);
        } else {
            rc = mtc_slab_alloc(w->p, bytes, &s);
        }
        CHECK(rc == 0);
        CHECK(s->bytes == mtc_slab_class_bytes(bytes));
        w->ok_allocs++;
        token = ((uint64_t)w->id << 32) | (uint64_t)i;
        first = s->ptr;
        last = (uint64_t *)((char *)s->ptr + s->bytes) - 1;
        *first = token;
        *last = token;
        mtc_slab_get_stats(w->p, &st);
        CHECK(st.bytes_held <= MT_CAP);
        if (xorshift64(&rng) % 8) {
            CHECK(mtc_slab_fence(w->p, s, &f) == 0);
            fence_record(f);
            gpu_submit(f, first, token);
            mtc_slab_release(w->p, s, 1);
        } else {
            CHECK(*first == token && *last == token);
            mtc_slab_release(w->p, s, 0);
        }
        if (i % 1000 == 999)
            CHECK(mtc_slab_valid(w->p));
        if (i % 2500 == 1234)
            mtc_slab_trim(w->p);
        if (i % 5000 == 4321)
            CHECK(mtc_slab_drain(w->p) == 0);
        /* Worker 0 halves and restores the cap: the others meet the
         * over-cap state a cut leaves behind (mtc_slab_valid checks no
         * growth happens in it). */
        if (w->id == 0 && i % 2000 == 1999)
            CHECK(mtc_slab_set_cap(w->p, (i / 2000) % 2 ? MT_CAP : MT_CAP / 2) == 0);
    }
    return NULL;
}

static void test_threads(void)
{
    mtc_slab_pool p;
    fake_ctx c;
    pthread_t gt, wt[MT_THREADS];
    worker_arg wa[MT_THREADS];
    mtc_slab_stats st;
    long total = 0;
    int i;

    setup(&p, &c, MT_CAP, 0);
    CHECK(pthread_mutex_init(&g_gpu.mu, NULL) == 0);
    CHECK(pthread_cond_init(&g_gpu.cv, NULL) == 0);
    CHECK(pthread_create(&gt, NULL, gpu_thread, NULL) == 0);
    for (i = 0; i < MT_THREADS; i++) {
        wa[i].p = &p;
        wa[i].id = (unsigned)i;
        wa[i].ok_allocs = 0;
        CHECK(pthread_create(&wt[i], NULL, worker, &wa[i]) == 0);
    }
    for (i = 0; i < MT_THREADS; i++) {
        CHECK(pthread_join(wt[i], NULL) == 0);
        total += wa[i].ok_allocs;
    }
    pthread_mutex_lock(&g_gpu.mu);
    g_gpu.stop = 1;
    pthread_cond_signal(&g_gpu.cv);
    pthread_mutex_unlock(&g_gpu.mu);
    CHECK(pthread_join(gt, NULL) == 0);

    CHECK(mtc_slab_drain(&p) == 0);
    CHECK(mtc_slab_valid(&p));
    st = stats(&p);
    CHECK(total == (long)MT_THREADS * MT_ITERS);
    CHECK(st.allocs + st.reuses == (uint64_t)total);
    CHECK(st.slabs_in_use == 0 && st.bytes_in_use == 0);
    CHECK(st.bytes_held <= MT_CAP && st.bytes_high_water <= MT_CAP);
    CHECK(atomic_load(&c.pinned_max) <= (long)MT_CAP);
    if (getenv("TEST_SLAB_VERBOSE"))
        printf("threads: allocs=%llu reuses=%llu waits=%llu evictions=%llu high_water=%llu\n",
               (unsigned long long)st.allocs, (unsigned long long)st.reuses,
               (unsigned long long)st.waits, (unsigned long long)st.evictions,
               (unsigned long long)st.bytes_high_water);
    teardown(&p, &c);
}

int main(void)
{
    int n = 0;

    alarm(120);   /* a deadlock anywhere fails the run instead of hanging CI */
    test_class_sizes(), n++;
    test_init_args(), n++;
    test_basic_reuse(), n++;
    test_pending_not_reused(), n++;
    test_backpressure(), n++;
    test_eviction(), n++;
    test_e2big(), n++;
    test_set_cap(), n++;
    test_failures(), n++;
    test_trim(), n++;
    test_validator(), n++;
    test_drain(), n++;
    test_destroy_waits(), n++;
    test_threads(), n++;
    printf("test_slab: %d tests, %ld checks passed\n", n, atomic_load(&g_checks));
    return 0;
}
