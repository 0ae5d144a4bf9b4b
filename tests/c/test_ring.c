/*
 * test_ring.c - unit tests for csrc/engine/ring.c (bounded MPSC ring).
 *
 * Built and run by tests/c/Makefile under ASan+UBSan and under TSan.
 * Exit status 0 and a one-line summary on success; on the first failed check
 * it prints file:line and exits 1.
 *
 * Environment: MTC_RING_STRESS_ITEMS overrides the per-producer item count
 * of the stress test (default 200000).
 */
#include "ring.h"

#include "check.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

/* ------------------------------------------------------------------ */
/* helpers                                                             */

/* Items are small tagged integers; never NULL (values start at 1). */
static void *tag(uintptr_t v) { return (void *)v; }
static uintptr_t untag(void *p) { return (uintptr_t)p; }

/* Put a fresh ring's counters (and slot seqs) at `start`, as if `start`
 * items had already gone through it.  White-box: the ring must be empty and
 * quiescent. */
static void rebase(mtc_ring *r, uint64_t start)
{
    mtc_store_relaxed(&r->head, start);
    mtc_store_relaxed(&r->tail, start);
    for (uint64_t i = 0; i <= r->mask; i++)
        mtc_store_relaxed(&r->slots[(start + i) & r->mask].seq, start + i);
}

static int n_checks_run;

/* ------------------------------------------------------------------ */
/* single-threaded tests                                               */

static void test_init_errors(void)
{
    mtc_ring r;
    CHECK_EQ(mtc_ring_init(NULL, 8), -EINVAL);
    CHECK_EQ(mtc_ring_init(&r, 0), -EINVAL);
    CHECK(r.slots == NULL);
    mtc_ring_destroy(&r); /* destroy after failed init is safe */
    CHECK_EQ(mtc_ring_init(&r, 1), -EINVAL);
    CHECK_EQ(mtc_ring_init(&r, 3), -EINVAL);
    CHECK_EQ(mtc_ring_init(&r, 6), -EINVAL);
    CHECK_EQ(mtc_ring_init(&r, 1000), -EINVAL);
    CHECK_EQ(mtc_ring_init(&r, UINT32_MAX), -EINVAL);
    CHECK_EQ(mtc_ring_init(&r, UINT32_C(1) << 31), -EINVAL);
    CHECK_EQ(mtc_ring_init(&r, MTC_RING_MAX_CAPACITY << 1), -EINVAL);
    CHECK(r.slots == NULL);
    CHECK_EQ(mtc_ring_valid(&r), 0);
    CHECK_EQ(mtc_ring_valid(NULL), 0);
    CHECK_EQ(mtc_ring_size_approx(&r), 0);
    CHECK_EQ(mtc_ring_size_approx(NULL), 0);
    CHECK(mtc_ring_pop_sc(&r) == NULL);
    CHECK(mtc_ring_pop_sc(NULL) == NULL);

    /* smallest and a largish valid capacity */
    CHECK_EQ(mtc_ring_init(&r, 2), 0);
    CHECK_EQ(r.mask, 1);
    CHECK_EQ(mtc_ring_valid(&r), 1);
    mtc_ring_destroy(&r);
    CHECK_EQ(mtc_ring_valid(&r), 0);
    mtc_ring_destroy(&r); /* idempotent */
    mtc_ring_destroy(NULL);
    CHECK_EQ(mtc_ring_init(&r, UINT32_C(1) << 20), 0);
    CHECK_EQ(mtc_ring_valid(&r), 1);
    CHECK_EQ(mtc_ring_size_approx(&r), 0);
    mtc_ring_destroy(&r);
    n_checks_run++;
}

static void test_layout(void)
{
    /* producer and consumer indices on different cache lines */
    mtc_ring r;
    uintptr_t t = (uintptr_t)&r.tail, h = (uintptr_t)&r.head,
              m = (uintptr_t)&r.mask;
    CHECK(t / MTC_CACHELINE != h / MTC_CACHELINE);
    CHECK(h / MTC_CACHELINE != m / MTC_CACHELINE);
    CHECK(t / MTC_CACHELINE != m / MTC_CACHELINE);
    CHECK_EQ(_Alignof(mtc_ring), MTC_CACHELINE);
    n_checks_run++;
}

static void fifo_and_full(const uint32_t cap)
{
    mtc_ring r;
    CHECK_EQ(mtc_ring_init(&r, cap), 0);
    CHECK_EQ(mtc_ring_push_mp(&r, NULL), -EINVAL);
    CHECK_EQ(mtc_ring_push_mp(NULL, tag(1)), -EINVAL);
    CHECK(mtc_ring_pop_sc(&r) == NULL); /* empty */
    CHECK_EQ(mtc_ring_valid(&r), 1);

    for (uintptr_t i = 1; i <= cap; i++) {
        CHECK_EQ(mtc_ring_push_mp(&r, tag(i)), 0);
        CHECK_EQ(mtc_ring_size_approx(&r), i);
        CHECK_EQ(mtc_ring_valid(&r), 1);
    }
    CHECK_EQ(mtc_ring_push_mp(&r, tag(99)), -EAGAIN); /* full */
    CHECK_EQ(mtc_ring_push_mp(&r, tag(99)), -EAGAIN); /* still full */
    CHECK_EQ(mtc_ring_size_approx(&r), cap);
    CHECK_EQ(mtc_ring_valid(&r), 1);

    /* pop one, push one: full again */
    CHECK_EQ(untag(mtc_ring_pop_sc(&r)), 1);
    CHECK_EQ(mtc_ring_push_mp(&r, tag(cap + 1)), 0);
    CHECK_EQ(mtc_ring_push_mp(&r, tag(99)), -EAGAIN);
    CHECK_EQ(mtc_ring_valid(&r), 1);

    for (uintptr_t i = 2; i <= cap + 1; i++) {
        CHECK_EQ(untag(mtc_ring_pop_sc(&r)), i);
        CHECK_EQ(mtc_ring_size_approx(&r), cap + 1 - i);
    }
    CHECK(mtc_ring_pop_sc(&r) == NULL);
    CHECK(mtc_ring_pop_sc(&r) == NULL);
    CHECK_EQ(mtc_ring_size_approx(&r), 0);
    CHECK_EQ(mtc_ring_valid(&r), 1);
    mtc_ring_destroy(&r);
}

static void test_fifo_and_full(void)
{
    fifo_and_full(2);
    fifo_and_full(8);
    fifo_and_full(64);
    n_checks_run++;
}

/* Push/pop in varying batch sizes so head/tail run far past capacity. */
static void wrap_run(mtc_ring *r, uint64_t start, uint64_t rounds)
{
    const uint64_t cap = r->mask + 1;
    uintptr_t next_push = 1, next_pop = 1;
    uint64_t rng = 0x9e3779b97f4a7c15u;

    rebase(r, start);
    CHECK_EQ(mtc_ring_valid(r), 1);
    for (uint64_t round = 0; round < rounds; round++) {
        xorshift64(&rng);
        uint64_t npush = rng % (cap + 2);                     /* may overfill */
        uint64_t npop = (rng >> 20) % (cap + 2);              /* may overdrain */
        for (uint64_t i = 0; i < npush; i++) {
            uint64_t before = mtc_ring_size_approx(r);
            int rc = mtc_ring_push_mp(r, tag(next_push));
            if (before == cap) {
                CHECK_EQ(rc, -EAGAIN);
            } else {
                CHECK_EQ(rc, 0);
                next_push++;
            }
        }
        for (uint64_t i = 0; i < npop; i++) {
            void *it = mtc_ring_pop_sc(r);
            if (next_pop == next_push) {
                CHECK(it == NULL);
            } else {
                CHECK_EQ(untag(it), next_pop);
                next_pop++;
            }
        }
        CHECK_EQ(mtc_ring_size_approx(r), next_push - next_pop);
        if (round % 1024 == 0)
            CHECK_EQ(mtc_ring_valid(r), 1);
    }
    CHECK_EQ(mtc_ring_valid(r), 1);
    /* drain */
    while (next_pop != next_push) {
        CHECK_EQ(untag(mtc_ring_pop_sc(r)), next_pop);
        next_pop++;
    }
    CHECK(mtc_ring_pop_sc(r) == NULL);
    CHECK_EQ(mtc_ring_valid(r), 1);
    /* counters went well past capacity (and past start) */
    uint64_t moved = mtc_load_relaxed(&r->head) - start;
    CHECK_EQ(moved, next_pop - 1);
    CHECK(moved > 1000 * cap);
    CHECK_EQ(mtc_load_relaxed(&r->tail), mtc_load_relaxed(&r->head));
}

static void test_wraparound(void)
{
    mtc_ring r;
    CHECK_EQ(mtc_ring_init(&r, 4), 0);
    wrap_run(&r, 0, 200000);
    /* the 64-bit counters themselves wrapping through zero */
    wrap_run(&r, UINT64_MAX - 37, 5000);
    CHECK(mtc_load_relaxed(&r.head) < 1u << 20); /* it did wrap */
    mtc_ring_destroy(&r);

    CHECK_EQ(mtc_ring_init(&r, 64), 0);
    wrap_run(&r, UINT64_MAX - 1000, 20000);
    wrap_run(&r, (uint64_t)1 << 63, 20000); /* sign boundary of differences */
    mtc_ring_destroy(&r);
    n_checks_run++;
}

/* A producer that has claimed a position but not yet published it stops
 * the consumer there (no overtaking), and the ring then reads as invalid
 * (not quiescent).  Simulated white-box. */
static void test_claimed_unpublished(void)
{
    mtc_ring r;
    CHECK_EQ(mtc_ring_init(&r, 8), 0);
    CHECK_EQ(mtc_ring_push_mp(&r, tag(1)), 0);
    /* "producer B" claims position 1 and stalls */
    uint64_t pos = mtc_load_relaxed(&r.tail);
    CHECK_EQ(pos, 1);
    mtc_store_relaxed(&r.tail, pos + 1);
    /* "producer C" pushes position 2 */
    CHECK_EQ(mtc_ring_push_mp(&r, tag(3)), 0);
    CHECK_EQ(mtc_ring_size_approx(&r), 3);
    CHECK_EQ(mtc_ring_valid(&r), 0); /* slot 1 claimed, not published */

    CHECK_EQ(untag(mtc_ring_pop_sc(&r)), 1);
    CHECK(mtc_ring_pop_sc(&r) == NULL); /* blocked behind B, no overtaking */
    CHECK(mtc_ring_pop_sc(&r) == NULL);

    /* B publishes */
    r.slots[pos & r.mask].item = tag(2);
    mtc_store_release(&r.slots[pos & r.mask].seq, pos + 1); /* pairs with pop's acquire */
    CHECK_EQ(mtc_ring_valid(&r), 1);
    CHECK_EQ(untag(mtc_ring_pop_sc(&r)), 2);
    CHECK_EQ(untag(mtc_ring_pop_sc(&r)), 3);
    CHECK(mtc_ring_pop_sc(&r) == NULL);
    CHECK_EQ(mtc_ring_valid(&r), 1);
    mtc_ring_destroy(&r);
    n_checks_run++;
}

static void test_valid_detects_corruption(void)
{
    mtc_ring r;
    CHECK_EQ(mtc_ring_init(&r, 8), 0);
    CHECK_EQ(mtc_ring_push_mp(&r, tag(1)), 0);
    CHECK_EQ(mtc_ring_push_mp(&r, tag(2)), 0);
    CHECK_EQ(mtc_ring_valid(&r), 1);

    uint64_t s = mtc_load_relaxed(&r.slots[5].seq);
    mtc_store_relaxed(&r.slots[5].seq, s + 1);
    CHECK_EQ(mtc_ring_valid(&r), 0);
    mtc_store_relaxed(&r.slots[5].seq, s);
    CHECK_EQ(mtc_ring_valid(&r), 1);

    uint64_t h = mtc_load_relaxed(&r.head);
    mtc_store_relaxed(&r.head, h + 3); /* head past tail */
    CHECK_EQ(mtc_ring_valid(&r), 0);
    mtc_store_relaxed(&r.head, h);
    uint64_t t = mtc_load_relaxed(&r.tail);
    mtc_store_relaxed(&r.tail, t + 9); /* more than capacity in use */
    CHECK_EQ(mtc_ring_valid(&r), 0);
    mtc_store_relaxed(&r.tail, t);
    CHECK_EQ(mtc_ring_valid(&r), 1);

    uint64_t m = r.mask;
    r.mask = 5; /* capacity 6: not a power of two */
    CHECK_EQ(mtc_ring_valid(&r), 0);
    r.mask = UINT64_MAX; /* capacity wraps to 0 */
    CHECK_EQ(mtc_ring_valid(&r), 0);
    r.mask = m;
    CHECK_EQ(mtc_ring_valid(&r), 1);
    mtc_ring_destroy(&r);
    n_checks_run++;
}

/* ------------------------------------------------------------------ */
/* multi-producer stress                                               */

#define N_PRODUCERS 8
#define STRESS_CAPACITY 64
#define TAG_SHIFT 28 /* item = (producer << TAG_SHIFT) | (index + 1) */
#define WATCHDOG_S 60.0

struct stress {
    mtc_ring ring; /* first: gets the struct's 64-byte alignment */
    uint64_t per_producer;
    pthread_barrier_t start;
};

struct producer_arg {
    struct stress *st;
    uintptr_t id;
    uint64_t eagain; /* written by the producer, read after join */
};

static void *producer_main(void *argp)
{
    struct producer_arg *a = argp;
    mtc_ring *r = &a->st->ring;
    const uint64_t n = a->st->per_producer;
    uint64_t eagain = 0;

    pthread_barrier_wait(&a->st->start);
    for (uint64_t i = 0; i < n; i++) {
        void *item = tag((a->id << TAG_SHIFT) | (uintptr_t)(i + 1));
        unsigned spins = 0;
        int rc;
        while ((rc = mtc_ring_push_mp(r, item)) == -EAGAIN) {
            eagain++;
            if (++spins < 64)
                mtc_cpu_relax();
            else
                sched_yield(); /* fewer cores than threads: let the consumer run */
        }
        if (rc != 0)
            FAILF("producer %u: push returned %d", (unsigned)a->id, rc);
    }
    a->eagain = eagain;
    return NULL;
}

static void test_mpsc_stress(void)
{
    static struct stress st; /* static: honours the ring's alignment */
    pthread_t th[N_PRODUCERS];
    struct producer_arg args[N_PRODUCERS];
    uint64_t next[N_PRODUCERS] = {0}; /* next expected index per producer */

    uint64_t per = 200000;
    const char *env = getenv("MTC_RING_STRESS_ITEMS");
    if (env != NULL && *env != '\0')
        per = strtoull(env, NULL, 10);
    CHECK(per > 0 && per < ((uint64_t)1 << TAG_SHIFT));
    st.per_producer = per;

    CHECK_EQ(mtc_ring_init(&st.ring, STRESS_CAPACITY), 0);
    CHECK_EQ(pthread_barrier_init(&st.start, NULL, N_PRODUCERS + 1), 0);
    for (int p = 0; p < N_PRODUCERS; p++) {
        args[p] = (struct producer_arg){.st = &st, .id = (uintptr_t)p};
        CHECK_EQ(pthread_create(&th[p], NULL, producer_main, &args[p]), 0);
    }

    const uint64_t total = per * N_PRODUCERS;
    uint64_t got = 0, empty_pops = 0, max_size = 0;
    pthread_barrier_wait(&st.start);
    const double t0 = now_s();
    double last_progress = t0;
    unsigned spins = 0;

    while (got < total) {
        void *it = mtc_ring_pop_sc(&st.ring);
        if (it == NULL) {
            empty_pops++;
            if (++spins < 64) {
                mtc_cpu_relax();
            } else {
                sched_yield();
                spins = 0;
                double t = now_s();
                if (t - last_progress > WATCHDOG_S)
                    FAILF("stress: no item for %.0f s after %" PRIu64 "/%" PRIu64
                          " items (lost item?)", WATCHDOG_S, got, total);
            }
            continue;
        }
        spins = 0;
        if ((got & 0xfff) == 0) {
            last_progress = now_s();
            uint64_t sz = mtc_ring_size_approx(&st.ring);
            CHECK(sz <= STRESS_CAPACITY);
            if (sz > max_size)
                max_size = sz;
        }
        uintptr_t v = untag(it);
        uintptr_t p = v >> TAG_SHIFT;
        uint64_t idx = (uint64_t)(v & (((uintptr_t)1 << TAG_SHIFT) - 1));
        if (p >= N_PRODUCERS)
            FAILF("stress: bad producer tag in item %#" PRIxPTR, v);
        /* in-order per producer => each item exactly once, none skipped */
        if (idx != next[p] + 1)
            FAILF("stress: producer %u: got index %" PRIu64 ", expected %" PRIu64
                  " (duplicate, loss or reordering)",
                  (unsigned)p, idx, next[p] + 1);
        next[p] = idx;
        got++;
    }
    const double elapsed = now_s() - t0;

    uint64_t eagain = 0;
    for (int p = 0; p < N_PRODUCERS; p++) {
        CHECK_EQ(pthread_join(th[p], NULL), 0);
        eagain += args[p].eagain;
        CHECK_EQ(next[p], per);
    }
    CHECK(mtc_ring_pop_sc(&st.ring) == NULL);
    CHECK_EQ(mtc_ring_size_approx(&st.ring), 0);
    CHECK_EQ(mtc_ring_valid(&st.ring), 1);
    CHECK_EQ(mtc_load_relaxed(&st.ring.head), total);
    CHECK_EQ(pthread_barrier_destroy(&st.start), 0);
    mtc_ring_destroy(&st.ring);

    printf("test_ring: stress %d producers x %" PRIu64 " items, capacity %d: "
           "%.2f s (%.2f Mitems/s), %" PRIu64 " full retries, %" PRIu64
           " empty pops, max size seen %" PRIu64 "\n",
           N_PRODUCERS, per, STRESS_CAPACITY, elapsed,
           (double)total / elapsed / 1e6, eagain, empty_pops, max_size);
    n_checks_run++;
}

int main(void)
{
    const double t0 = now_s();
    test_init_errors();
    test_layout();
    test_fifo_and_full();
    test_wraparound();
    test_claimed_unpublished();
    test_valid_detects_corruption();
    test_mpsc_stress();
    printf("test_ring: OK: %d tests passed in %.2f s%s\n", n_checks_run,
           now_s() - t0, UNDER_TSAN ? " (under TSan)" : "");
    return 0;
}
