/*
 * test_transfer.c - unit tests for the job lifetime of csrc/engine/transfer.c that
 * the binding layer relies on (CPU jobs only: no GPU needed):
 *   - several waiters on one job, each with its own reference (mtc_job_ref),
 *     released in any order while the transfer thread completes and drops
 *     the engine's (get() from several threads on one handle);
 *   - jobs orphaned by fork(): a job pending when the process forked is
 *     mtc_job_orphaned() in the child and never in the parent; jobs the
 *     child makes afterwards run on the child's own, fresh transfer thread.
 *
 * Built and run by tests/c/Makefile under ASan+UBSan and under TSan.
 */
#include "transfer.h"

#include "check.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define CHILD_CHECK(cond)                                                      \
    do {                                                                       \
        if (!(cond)) {                                                         \
            fprintf(stderr, "%s:%d: child: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
            _exit(1);                                                          \
        }                                                                      \
    } while (0)

/* A CPU job of n host copies of `piece` bytes each, from src to dst. */
static mtc_job *host_job(const uint8_t *src, uint8_t *dst, uint32_t n, size_t piece)
{
    mtc_job *j = mtc_job_new(1, n);
    CHECK(j != NULL);
    j->target = -1;
    j->ops[0] = (mtc_op){.kind = MTC_OP_HOST_COPY, .dev = -1, .first = 0, .count = n};
    for (uint32_t i = 0; i < n; i++)
        j->items[i] = (mtc_item){.src = (uintptr_t)(src + i * piece), .dst = (uintptr_t)(dst + i * piece),
                                 .nbytes = (int64_t)piece, .dev = -1, .leaf = (int32_t)i};
    j->nops = 1;
    j->nitems = n;
    return j;
}

typedef struct waiter { mtc_job *job; const uint8_t *src, *dst; size_t n; int ok; } waiter;

static void *waiter_main(void *p)
{
    waiter *w = p;
    /* the reference was taken for this thread while the caller still held its own */
    int rc = mtc_job_wait(w->job, -1);
    w->ok = rc == 0 && mtc_job_complete(w->job) && !w->job->err && memcmp(w->src, w->dst, w->n) == 0;
    mtc_job_release(w->job);
    return NULL;
}

static void test_many_waiters_own_references(void)
{
    enum { NW = 8, ROUNDS = 40, PIECES = 8 };
    size_t piece = (size_t)1 << 20, n = PIECES * piece;
    uint8_t *src = malloc(n), *dst = malloc(n);
    CHECK(src && dst);
    for (size_t i = 0; i < n; i++) src[i] = (uint8_t)(i * 31 + 7);
    for (int round = 0; round < ROUNDS; round++) {
        memset(dst, 0, n);
        mtc_job *j = host_job(src, dst, PIECES, piece);
        CHECK(!mtc_job_orphaned(j));
        CHECK_EQ(mtc_transfer_submit(j), 0);
        pthread_t th[NW];
        waiter w[NW];
        for (int k = 0; k < NW; k++) {
            w[k] = (waiter){j, src, dst, n, 0};
            mtc_job_ref(j);
            CHECK_EQ(pthread_create(&th[k], NULL, waiter_main, &w[k]), 0);
        }
        /* the handle's reference goes first (the first get() to finish), any time */
        if (round % 2) mtc_job_wait(j, -1);
        mtc_job_release(j);
        for (int k = 0; k < NW; k++) {
            CHECK_EQ(pthread_join(th[k], NULL), 0);
            CHECK(w[k].ok);
        }
    }
    free(src);
    free(dst);
    printf("  many waiters: %d rounds x %d threads\n", ROUNDS, NW);
}

static void test_orphaned_by_fork(void)
{
    size_t n = 4096;
    uint8_t *src = malloc(n), *dst = malloc(n);
    CHECK(src && dst);
    for (size_t i = 0; i < n; i++) src[i] = (uint8_t)i;
    /* start the parent's transfer thread first: the child must not inherit it */
    mtc_job *warm = host_job(src, dst, 1, n);
    CHECK_EQ(mtc_transfer_submit(warm), 0);
    CHECK_EQ(mtc_job_wait(warm, -1), 0);
    mtc_job_release(warm);

    mtc_job *pending = host_job(src, dst, 1, n);   /* never submitted before the fork */
    mtc_job *done = host_job(src, dst, 1, n);
    mtc_transfer_run(done);                              /* complete before the fork */
    uint32_t gen = mtc_engine_fork_gen();
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        CHILD_CHECK(mtc_engine_fork_gen() == gen + 1);
        CHILD_CHECK(mtc_job_orphaned(pending));     /* no thread of the child will run it */
        CHILD_CHECK(!mtc_job_orphaned(done));       /* complete: nothing to wait for */
        CHILD_CHECK(mtc_job_wait(pending, 1000000) == -ETIMEDOUT);
        /* a job of the child's own runs on a fresh transfer thread (not under
         * TSan, which cannot start threads after a multi-threaded fork) */
        if (!UNDER_TSAN) {
            uint8_t *d2 = calloc(1, n);
            CHILD_CHECK(d2 != NULL);
            mtc_job *mine = host_job(src, d2, 1, n);
            CHILD_CHECK(!mtc_job_orphaned(mine));
            CHILD_CHECK(mtc_transfer_submit(mine) == 0);
            CHILD_CHECK(mtc_job_wait(mine, 20LL * 1000000000) == 0);
            CHILD_CHECK(memcmp(src, d2, n) == 0);
            mtc_job_release(mine);
        }
        _exit(0);
    }
    int status;
    CHECK_EQ(waitpid(pid, &status, 0), pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    /* in the parent nothing is orphaned, and the pending job still runs */
    CHECK_EQ(mtc_engine_fork_gen(), gen);
    CHECK(!mtc_job_orphaned(pending));
    memset(dst, 0, n);
    CHECK_EQ(mtc_transfer_submit(pending), 0);
    CHECK_EQ(mtc_job_wait(pending, -1), 0);
    CHECK(memcmp(src, dst, n) == 0);
    mtc_job_release(pending);
    mtc_job_release(done);
    free(src);
    free(dst);
    printf("  orphaned by fork: child and parent\n");
}

int main(void)
{
    mtc_transfer_init_once(); /* the atfork handler */
    test_many_waiters_own_references();
    test_orphaned_by_fork();
    mtc_transfer_shutdown();
    printf("test_transfer: all passed (%ld checks)\n", (long)atomic_load(&g_checks));
    return 0;
}
