/*
 * test_arena.c - unit tests for csrc/engine/arena.c (the shared memfd arena and its
 * lock-free slot allocator).
 *
 * Built and run by tests/c/Makefile under ASan+UBSan and under TSan. Exit
 * status 0 and a one-line summary on success; on the first failed check it
 * prints file:line and exits 1. Forked children report through their exit
 * status. alarm() turns a hang anywhere into a failure.
 *
 * Environment:
 *   MTC_ARENA_STRESS_CYCLES  cycles per process / thread of the stress tests
 *                            (default 5000 processes, 4000 threads)
 *   (the retag / reclaim_dead race test, test_retag_vs_reclaim_race, runs by
 *    default: a regression test of a bug fixed in csrc/engine/arena.c)
 */
#include "arena.h"

#include "check.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* in a forked child: report by exit status, never run the parent's atexit */
#define CHILD_CHECK(cond)                                                      \
    do {                                                                       \
        if (!(cond)) {                                                         \
            fprintf(stderr, "%s:%d: child %d: CHECK failed: %s\n", __FILE__, __LINE__, \
                    (int)getpid(), #cond);                                     \
            _exit(1);                                                          \
        }                                                                      \
    } while (0)

#define SLOT MTC_ARENA_SLOT_BYTES

/* ------------------------------------------------------------------ */
/* helpers                                                             */

static long env_long(const char *name, long dflt)
{
    const char *v = getenv(name);
    return v && *v ? strtol(v, NULL, 10) : dflt;
}

static mtc_arena_stats stats(mtc_arena *a)
{
    mtc_arena_stats s;
    mtc_arena_get_stats(a, &s);
    return s;
}

static mtc_arena *make(size_t bytes)
{
    mtc_arena *a = NULL;
    CHECK_EQ(mtc_arena_create(bytes, &a), 0);
    CHECK(a != NULL);
    return a;
}

static int wait_child(pid_t pid)
{
    int st = 0;
    while (waitpid(pid, &st, 0) < 0) {
        if (errno != EINTR) return -1;
    }
    if (WIFEXITED(st)) return WEXITSTATUS(st);
    return 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
}

/* A worker: a forked child attached to `a` by its fd, as a DataLoader worker
 * is, and two pipes for taking turns (the child writes `ready`, the parent
 * `go`). Returns the pid in the parent, 0 in the child with *c attached. */
typedef struct worker {
    int ready[2], go[2];
} worker;

static pid_t fork_worker(mtc_arena *a, worker *w, mtc_arena **c)
{
    CHECK_EQ(pipe(w->ready), 0);
    CHECK_EQ(pipe(w->go), 0);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        *c = NULL;
        CHILD_CHECK(mtc_arena_attach(a->fd, c) == 0);
    }
    return pid;
}

static void close_worker(worker *w)
{
    close(w->ready[0]), close(w->ready[1]), close(w->go[0]), close(w->go[1]);
}

/* Fills [p, p+n) with a pattern naming `tag` and the offset, and checks it. */
static void fill(uint8_t *p, uint64_t n, uint32_t tag)
{
    uint64_t w = ((uint64_t)tag << 32) | tag;
    uint64_t i = 0;
    for (; i + 8 <= n; i += 8) memcpy(p + i, &w, 8);
    for (; i < n; i++) p[i] = (uint8_t)tag;
}

static int verify(const uint8_t *p, uint64_t n, uint32_t tag)
{
    uint64_t w = ((uint64_t)tag << 32) | tag, v;
    uint64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        memcpy(&v, p + i, 8);
        if (v != w) return 0;
    }
    for (; i < n; i++)
        if (p[i] != (uint8_t)tag) return 0;
    return 1;
}

/* ------------------------------------------------------------------ */
/* create / attach / header validation                                 */

static void test_create_geometry(void)
{
    CHECK_EQ(mtc_arena_create(0, &(mtc_arena *){NULL}), -EINVAL);
    CHECK_EQ(mtc_arena_create((size_t)1 << 50, &(mtc_arena *){NULL}), -EINVAL);

    mtc_arena *a = make(3 * SLOT + 1); /* rounded up to 4 slots */
    CHECK_EQ(a->nslots, 4);
    CHECK_EQ(a->slot_bytes, SLOT);
    CHECK(a->data_offset % (uint64_t)sysconf(_SC_PAGESIZE) == 0);
    CHECK(a->data_offset >= sizeof(mtc_arena_header) + 4 * sizeof(uint64_t));
    CHECK_EQ(a->bytes, a->data_offset + 4 * SLOT);
    CHECK_EQ(a->hdr->magic, MTC_ARENA_MAGIC);
    CHECK_EQ(a->hdr->creator_pid, getpid());
    mtc_arena_stats s = stats(a);
    CHECK_EQ(s.bytes, 4 * SLOT);
    CHECK_EQ(s.nslots, 4);
    CHECK_EQ(s.slots_in_use, 0);
    CHECK(mtc_arena_valid(a));

    /* close-on-exec, sealed against growing, shrinking and re-sealing */
    CHECK(fcntl(a->fd, F_GETFD) & FD_CLOEXEC);
    int seals = fcntl(a->fd, F_GET_SEALS);
    CHECK(seals >= 0);
    CHECK((seals & (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)) == (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL));
    CHECK(ftruncate(a->fd, (off_t)a->bytes / 2) != 0);
    CHECK(ftruncate(a->fd, (off_t)a->bytes * 2) != 0);

    /* refcounting: the last unref unmaps */
    mtc_arena_ref(a);
    mtc_arena_unref(a);
    CHECK_EQ(a->hdr->magic, MTC_ARENA_MAGIC);
    mtc_arena_unref(a);
}

static void test_attach_same_process(void)
{
    mtc_arena *a = make(8 * SLOT), *b = NULL;
    CHECK_EQ(mtc_arena_attach(a->fd, &b), 0);
    CHECK(b->fd != a->fd);   /* dup'ed: the caller keeps its fd */
    CHECK(b->base != a->base); /* a second mapping of the same memory */
    CHECK_EQ(b->nslots, a->nslots);
    CHECK_EQ(b->data_offset, a->data_offset);

    uint64_t off;
    CHECK_EQ(mtc_arena_try_alloc(b, 2 * SLOT, 77, &off), 0);
    fill(b->base + off, 2 * SLOT, 0xabcd);
    CHECK(verify(a->base + off, 2 * SLOT, 0xabcd)); /* the same bytes */
    CHECK_EQ(mtc_arena_check(a, off, 2 * SLOT, 77), 0);
    CHECK_EQ(stats(a).slots_in_use, 2);
    CHECK_EQ(mtc_arena_free(a, off, 77), 0); /* freed through the other mapping */
    CHECK_EQ(stats(b).slots_in_use, 0);
    CHECK(mtc_arena_valid(a) && mtc_arena_valid(b));
    mtc_arena_unref(b);
    mtc_arena_unref(a);
}

static void test_attach_forked_child(void)
{
    mtc_arena *a = make(8 * SLOT), *c;
    worker w;
    pid_t pid = fork_worker(a, &w, &c);
    if (pid == 0) {
        uint64_t off;
        CHILD_CHECK(mtc_arena_try_alloc(c, 3 * SLOT, (uint32_t)getpid(), &off) == 0);
        fill(c->base + off, 3 * SLOT, (uint32_t)getpid());
        CHILD_CHECK(write(w.ready[1], &off, sizeof off) == (ssize_t)sizeof off);
        char x;
        CHILD_CHECK(read(w.go[0], &x, 1) == 1); /* the parent checked it and freed it */
        CHILD_CHECK(mtc_arena_check(c, off, 1, (uint32_t)getpid()) == -EINVAL);
        CHILD_CHECK(mtc_arena_free(c, off, (uint32_t)getpid()) == -EINVAL);
        _exit(0);
    }
    uint64_t off = 0;
    CHECK_EQ(read(w.ready[0], &off, sizeof off), (ssize_t)sizeof off);
    CHECK(verify(a->base + off, 3 * SLOT, (uint32_t)pid));
    CHECK_EQ(mtc_arena_check(a, off, 3 * SLOT, (uint32_t)pid), 0);
    CHECK_EQ(mtc_arena_check(a, off, 3 * SLOT, (uint32_t)getpid()), -EINVAL);
    CHECK_EQ(mtc_arena_reclaim_dead(a, (uint32_t)getpid()), 0); /* the child is alive */
    CHECK_EQ(mtc_arena_free(a, off, (uint32_t)pid), 0);
    CHECK_EQ(write(w.go[1], "x", 1), 1);
    CHECK_EQ(wait_child(pid), 0);
    CHECK_EQ(stats(a).slots_in_use, 0);
    CHECK(mtc_arena_valid(a));
    close_worker(&w);
    mtc_arena_unref(a);
}

static long minflt(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_minflt;
}

/* Writes one byte per page of slots [first, end); returns the minor faults it took. */
static long touch_faults_in(mtc_arena *a, uint32_t first, uint32_t end)
{
    long f0 = minflt();
    for (uint64_t o = a->data_offset + (uint64_t)first * a->slot_bytes;
         o < a->data_offset + (uint64_t)end * a->slot_bytes; o += 4096)
        ((volatile uint8_t *)a->base)[o] = 1;
    return minflt() - f0;
}

static long touch_faults(mtc_arena *a) { return touch_faults_in(a, 0, a->nslots); }

/* mtc_arena_populate: the region's slots mapped in this process's page
 * tables, so that writing them takes no page faults; the slots outside the
 * region are left alone; again in a forked child (which inherits the mapping
 * without its page-table entries, and a copy of the parent's bitmap). */
static void test_populate(void)
{
    mtc_arena *a = make(64 * SLOT); /* 4 MiB: 1024 pages */
    long pages = (long)(64 * SLOT / 4096);
    /* the first 32 slots, as a region of 31 slots and a bit */
    int rc = mtc_arena_populate(a, a->data_offset, 31 * SLOT + 100);
    if (rc == -EINVAL) { /* Linux < 5.14: no MADV_POPULATE_WRITE */
        printf("SKIP populate: MADV_POPULATE_WRITE unsupported\n");
        mtc_arena_unref(a);
        return;
    }
    CHECK_EQ(rc, 0);
    CHECK_EQ(mtc_load_relaxed(&a->populated_pid), (int32_t)getpid());
    for (uint32_t i = 0; i < a->nslots; i++) CHECK_EQ(mtc_load_relaxed(&a->populated[i]), i < 32);
    /* (ASan: its shadow of the area, pages / 8, faults in; TSan's shadow is
     * larger than the area: no fault counts there) */
    long fault_cap = UNDER_TSAN ? LONG_MAX : pages / 8;
    CHECK(touch_faults_in(a, 0, 32) < fault_cap);
    if (!UNDER_TSAN) CHECK(touch_faults_in(a, 32, 64) >= pages / 2 - pages / 8); /* not populated: faults */
    CHECK_EQ(mtc_arena_populate(a, a->data_offset, 64 * SLOT), 0); /* the rest: already mapped now */
    long f0 = minflt();
    CHECK_EQ(mtc_arena_populate(a, a->data_offset, 64 * SLOT), 0); /* nothing left to do */
    CHECK(UNDER_TSAN || minflt() - f0 < 4);
    CHECK_EQ(mtc_arena_populate(a, a->data_offset, 0), 0);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        /* without populate, the child faults on the inherited mapping; with it, not */
        long c0 = minflt();
        int crc = mtc_arena_populate(a, a->data_offset, 64 * SLOT);
        long c1 = minflt();
        long t = touch_faults(a);
        int ok = crc == 0 && mtc_load_relaxed(&a->populated_pid) == (int32_t)getpid() &&
                 (UNDER_TSAN || (c1 - c0 >= pages / 2 && t < 2 * fault_cap));
        for (uint32_t i = 0; i < a->nslots; i++) ok = ok && mtc_load_relaxed(&a->populated[i]) == 1;
        _exit(ok ? 0 : 3);
    }
    int status;
    CHECK(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    mtc_arena_unref(a);
}

static int memfd(size_t size)
{
    int fd = (int)syscall(SYS_memfd_create, "not_an_arena", MFD_CLOEXEC);
    CHECK(fd >= 0);
    CHECK_EQ(ftruncate(fd, (off_t)size), 0);
    return fd;
}

static void test_attach_rejects_non_arenas(void)
{
    mtc_arena *b = NULL;
    /* empty, too small for a header, zero-filled, random bytes */
    int fd = memfd(0);
    CHECK_EQ(mtc_arena_attach(fd, &b), -EINVAL);
    close(fd);
    fd = memfd(16);
    CHECK_EQ(mtc_arena_attach(fd, &b), -EINVAL);
    close(fd);
    fd = memfd(1 << 20);
    CHECK_EQ(mtc_arena_attach(fd, &b), -EINVAL);
    uint8_t junk[4096];
    uint64_t rs = 0x1234567;
    for (size_t i = 0; i < sizeof junk; i++) junk[i] = (uint8_t)xorshift64(&rs);
    CHECK_EQ(pwrite(fd, junk, sizeof junk, 0), (ssize_t)sizeof junk);
    CHECK_EQ(mtc_arena_attach(fd, &b), -EINVAL);
    close(fd);
    /* a pipe: not a mappable file */
    int p[2];
    CHECK_EQ(pipe(p), 0);
    CHECK(mtc_arena_attach(p[0], &b) < 0);
    close(p[0]), close(p[1]);
    CHECK_EQ(mtc_arena_attach(-1, &b), -EBADF);

    /* a real arena's header on a file of the wrong size */
    mtc_arena *a = make(4 * SLOT);
    fd = memfd(a->bytes + 4096);
    CHECK_EQ(pwrite(fd, a->base, a->data_offset, 0), (ssize_t)a->data_offset);
    CHECK_EQ(mtc_arena_attach(fd, &b), -EINVAL);
    close(fd);
    /* the right size, and each geometry field damaged in turn */
    struct {
        size_t at, width;
    } fields[] = {
        {offsetof(mtc_arena_header, magic), 8},       {offsetof(mtc_arena_header, version), 4},
        {offsetof(mtc_arena_header, data_offset), 8}, {offsetof(mtc_arena_header, slot_bytes), 8},
        {offsetof(mtc_arena_header, nslots), 4},
    };
    fd = memfd(a->bytes);
    CHECK_EQ(pwrite(fd, a->base, a->data_offset, 0), (ssize_t)a->data_offset);
    CHECK_EQ(mtc_arena_attach(fd, &b), 0); /* an intact copy attaches */
    mtc_arena_unref(b);
    for (size_t f = 0; f < sizeof fields / sizeof fields[0]; f++) {
        uint8_t orig[8], bad[8];
        CHECK_EQ(pread(fd, orig, fields[f].width, (off_t)fields[f].at), (ssize_t)fields[f].width);
        memcpy(bad, orig, 8);
        bad[0] ^= 0x01;
        CHECK_EQ(pwrite(fd, bad, fields[f].width, (off_t)fields[f].at), (ssize_t)fields[f].width);
        CHECK_EQ(mtc_arena_attach(fd, &b), -EINVAL);
        bad[0] = orig[0];
        bad[fields[f].width - 1] ^= 0x80; /* the high byte too */
        CHECK_EQ(pwrite(fd, bad, fields[f].width, (off_t)fields[f].at), (ssize_t)fields[f].width);
        CHECK_EQ(mtc_arena_attach(fd, &b), -EINVAL);
        CHECK_EQ(pwrite(fd, orig, fields[f].width, (off_t)fields[f].at), (ssize_t)fields[f].width);
    }
    close(fd);
    mtc_arena_unref(a);
}

/* ------------------------------------------------------------------ */
/* allocator semantics (single thread)                                 */

static void test_alloc_free_check_retag(void)
{
    mtc_arena *a = make(8 * SLOT);
    const uint32_t A = 1001, B = 1002;
    uint64_t o1, o2, o3, tmp;

    /* bad owners */
    CHECK_EQ(mtc_arena_try_alloc(a, 1, 0, &tmp), -EINVAL);
    CHECK_EQ(mtc_arena_try_alloc(a, 1, (uint32_t)INT32_MAX + 1u, &tmp), -EINVAL);
    CHECK_EQ(stats(a).allocs, 0);

    /* sizes round up to slots; 0 bytes takes one slot; offsets are slot boundaries */
    CHECK_EQ(mtc_arena_try_alloc(a, 0, A, &o1), 0);
    CHECK_EQ(mtc_arena_try_alloc(a, SLOT + 1, A, &o2), 0);
    CHECK_EQ(mtc_arena_try_alloc(a, SLOT, B, &o3), 0);
    uint64_t offs[3] = {o1, o2, o3};
    for (int k = 0; k < 3; k++) {
        CHECK(offs[k] >= a->data_offset && offs[k] < a->bytes);
        CHECK_EQ((offs[k] - a->data_offset) % SLOT, 0);
    }
    CHECK(o1 != o2 && o2 != o3 && o1 != o3);
    CHECK_EQ(stats(a).slots_in_use, 4);
    CHECK_EQ(stats(a).allocs, 3);
    CHECK_EQ(stats(a).high_water, 4);
    CHECK(mtc_arena_valid(a));
    /* the state words: head | len << 32 | owner, continuations = owner */
    uint64_t i2 = (o2 - a->data_offset) / SLOT;
    CHECK_EQ(a->hdr->slots[i2], MTC_ARENA_HEAD | (2ull << 32) | A);
    CHECK_EQ(a->hdr->slots[i2 + 1], A);

    /* check: exact head, owner, size within the run */
    CHECK_EQ(mtc_arena_check(a, o2, 2 * SLOT, A), 0);
    CHECK_EQ(mtc_arena_check(a, o2, 1, A), 0);
    CHECK_EQ(mtc_arena_check(a, o2, 2 * SLOT + 1, A), -EINVAL);
    CHECK_EQ(mtc_arena_check(a, o2, 1, B), -EINVAL);
    CHECK_EQ(mtc_arena_check(a, o2 + SLOT, 1, A), -EINVAL); /* a continuation */
    CHECK_EQ(mtc_arena_check(a, o2 + 64, 1, A), -EINVAL);   /* not a slot boundary */
    CHECK_EQ(mtc_arena_check(a, 0, 1, A), -EINVAL);         /* the header */
    CHECK_EQ(mtc_arena_check(a, a->data_offset - SLOT, 1, A), -EINVAL);
    CHECK_EQ(mtc_arena_check(a, a->bytes, 1, A), -EINVAL);  /* past the end */
    CHECK_EQ(mtc_arena_check(a, UINT64_MAX - SLOT + 1, 1, A), -EINVAL);
    uint64_t free_off = a->data_offset + 7 * SLOT;
    CHECK_EQ(mtc_arena_check(a, free_off, 1, A), -EINVAL);  /* a free slot */

    /* retag: only from the current owner, never to 0 */
    CHECK_EQ(mtc_arena_retag(a, o2, B, A), -EINVAL);
    CHECK_EQ(mtc_arena_retag(a, o2, A, 0), -EINVAL);
    CHECK_EQ(mtc_arena_retag(a, o2 + SLOT, A, B), -EINVAL);
    CHECK_EQ(mtc_arena_retag(a, free_off, A, B), -EINVAL);
    CHECK_EQ(mtc_arena_retag(a, o2, A, B), 0);
    CHECK_EQ(a->hdr->slots[i2], MTC_ARENA_HEAD | (2ull << 32) | B);
    CHECK_EQ(a->hdr->slots[i2 + 1], B);
    CHECK_EQ(mtc_arena_check(a, o2, 2 * SLOT, A), -EINVAL);
    CHECK_EQ(mtc_arena_check(a, o2, 2 * SLOT, B), 0);
    CHECK(mtc_arena_valid(a));

    /* free: only the owner, only at the head, once */
    CHECK_EQ(mtc_arena_free(a, o2, A), -EINVAL);
    CHECK_EQ(mtc_arena_free(a, o2 + SLOT, B), -EINVAL);
    CHECK_EQ(mtc_arena_free(a, free_off, B), -EINVAL);
    CHECK_EQ(mtc_arena_free(a, 0, B), -EINVAL);
    CHECK_EQ(mtc_arena_free(a, o2, B), 0);
    CHECK_EQ(mtc_arena_free(a, o2, B), -EINVAL);
    CHECK_EQ(a->hdr->slots[i2], 0);
    CHECK_EQ(a->hdr->slots[i2 + 1], 0);
    CHECK_EQ(stats(a).slots_in_use, 2);
    CHECK_EQ(stats(a).frees, 1);

    /* reclaim_owner frees every region of one owner */
    CHECK_EQ(mtc_arena_reclaim_owner(a, 0), 0);
    CHECK_EQ(mtc_arena_reclaim_owner(a, 4242), 0);
    CHECK_EQ(mtc_arena_reclaim_owner(a, A), 1);
    CHECK_EQ(mtc_arena_check(a, o1, 1, A), -EINVAL);
    CHECK_EQ(mtc_arena_check(a, o3, 1, B), 0);
    CHECK_EQ(mtc_arena_free(a, o3, B), 0);
    mtc_arena_stats s = stats(a);
    CHECK_EQ(s.slots_in_use, 0);
    CHECK_EQ(s.reclaims, 1);
    CHECK_EQ(s.high_water, 4);
    CHECK(mtc_arena_valid(a));
    mtc_arena_unref(a);
}

static void test_e2big_enospc_fragmentation(void)
{
    mtc_arena *a = make(4 * SLOT);
    const uint32_t A = 7;
    uint64_t o[4], tmp;

    CHECK_EQ(mtc_arena_try_alloc(a, 4 * SLOT + 1, A, &tmp), -E2BIG);
    CHECK_EQ(mtc_arena_try_alloc(a, UINT64_MAX, A, &tmp), -E2BIG);
    CHECK_EQ(mtc_arena_alloc(a, 5 * SLOT, A, 1000000000, &tmp), -E2BIG); /* no waiting */
    CHECK_EQ(stats(a).waits, 0);
    CHECK_EQ(mtc_arena_try_alloc(a, 4 * SLOT, A, &o[0]), 0); /* exactly the whole arena */
    CHECK_EQ(o[0], a->data_offset);
    CHECK_EQ(mtc_arena_try_alloc(a, 1, A, &tmp), -ENOSPC);
    CHECK_EQ(mtc_arena_free(a, o[0], A), 0);

    for (int i = 0; i < 4; i++) CHECK_EQ(mtc_arena_try_alloc(a, SLOT, A, &o[i]), 0);
    CHECK_EQ(mtc_arena_try_alloc(a, 1, A, &tmp), -ENOSPC);
    CHECK_EQ(mtc_arena_try_alloc(a, 4 * SLOT, A, &tmp), -ENOSPC); /* fits an empty arena: not E2BIG */
    /* free slots 0 and 2: two free slots, no run of two */
    uint64_t s0 = a->data_offset, s1 = s0 + SLOT, s2 = s0 + 2 * SLOT, s3 = s0 + 3 * SLOT;
    CHECK_EQ(mtc_arena_free(a, s0, A), 0);
    CHECK_EQ(mtc_arena_free(a, s2, A), 0);
    CHECK_EQ(mtc_arena_try_alloc(a, 2 * SLOT, A, &tmp), -ENOSPC);
    /* runs do not wrap around the end: slots 3 and 0 free */
    CHECK_EQ(mtc_arena_try_alloc(a, SLOT, A, &tmp), 0); /* takes 0 or 2 */
    uint64_t other = tmp == s0 ? s2 : s0;
    CHECK(tmp == s0 || tmp == s2);
    CHECK_EQ(mtc_arena_free(a, tmp, A), 0);
    CHECK_EQ(mtc_arena_try_alloc(a, SLOT, A, &tmp), 0);
    if (tmp == s2) {
        CHECK_EQ(mtc_arena_free(a, s3, A), 0);
        CHECK_EQ(mtc_arena_try_alloc(a, 2 * SLOT, A, &tmp), -ENOSPC); /* 3 and 0 are not a run */
        CHECK_EQ(mtc_arena_try_alloc(a, SLOT, A, &tmp), 0);
        CHECK(tmp == s0 || tmp == s3);
        CHECK_EQ(mtc_arena_free(a, tmp, A), 0);
        CHECK_EQ(mtc_arena_try_alloc(a, SLOT, A, &tmp), 0);
    }
    (void)other;
    CHECK(mtc_arena_valid(a));
    /* free everything, then one slot in the middle: a 2-slot run fits beside it */
    mtc_arena_reclaim_owner(a, A);
    CHECK_EQ(stats(a).slots_in_use, 0);
    CHECK_EQ(mtc_arena_try_alloc(a, SLOT, A, &tmp), 0);
    uint64_t mid = tmp;
    CHECK_EQ(mtc_arena_try_alloc(a, 2 * SLOT, A, &tmp), 0);
    CHECK(tmp + 2 * SLOT <= mid || tmp >= mid + SLOT); /* not overlapping */
    CHECK_EQ(mtc_arena_free(a, tmp, A), 0);
    CHECK_EQ(mtc_arena_free(a, mid, A), 0);
    (void)s1;
    CHECK(mtc_arena_valid(a));
    CHECK_EQ(stats(a).slots_in_use, 0);
    mtc_arena_unref(a);
}

static void test_alloc_timeout(void)
{
    mtc_arena *a = make(2 * SLOT);
    uint64_t o, tmp;
    CHECK_EQ(mtc_arena_try_alloc(a, 2 * SLOT, 5, &o), 0);
    double t0 = now_s();
    CHECK_EQ(mtc_arena_alloc(a, 1, 5, 0, &tmp), -ETIMEDOUT); /* 0: one try */
    CHECK(now_s() - t0 < 0.5);
    t0 = now_s();
    CHECK_EQ(mtc_arena_alloc(a, 1, 5, 150 * 1000000LL, &tmp), -ETIMEDOUT);
    double dt = now_s() - t0;
    CHECK(dt >= 0.149);
    CHECK(dt < 3.0);
    mtc_arena_stats s = stats(a);
    CHECK_EQ(s.timeouts, 2);
    CHECK_EQ(s.waits, 2);
    CHECK_EQ(s.slots_in_use, 2);
    /* with room, the waiting path returns at once */
    CHECK_EQ(mtc_arena_free(a, o, 5), 0);
    CHECK_EQ(mtc_arena_alloc(a, 1, 5, -1, &tmp), 0);
    CHECK_EQ(stats(a).waits, 2);
    CHECK_EQ(mtc_arena_free(a, tmp, 5), 0);
    CHECK(mtc_arena_valid(a));
    mtc_arena_unref(a);
}

/* The waiting path in slices (the binding layer checks for signals between
 * them): -EAGAIN at the end of each slice, one wait and one timeout counted
 * per allocation, the deadline kept across slices, a signal ends a slice at
 * once, and a free ends the wait. */
static volatile sig_atomic_t g_sigusr1;
static void on_sigusr1(int sig) { (void)sig; g_sigusr1 = 1; }

/* Signals the target every 37 ms until told to stop: one of them lands while
 * it sleeps in the futex (a signal that lands between two futex calls only
 * sets the flag, and the slice goes on, as the binding's next check sees it). */
typedef struct kicker_arg { pthread_t target; atomic_int stop; } kicker_arg;
static void *kicker_main(void *p)
{
    kicker_arg *k = p;
    while (!atomic_load(&k->stop)) {
        sleep_ms(37);
        if (!atomic_load(&k->stop)) pthread_kill(k->target, SIGUSR1);
    }
    return NULL;
}

static void test_alloc_slices(void)
{
    mtc_arena *a = make(2 * SLOT);
    uint64_t o, tmp;
    CHECK_EQ(mtc_arena_try_alloc(a, 2 * SLOT, 5, &o), 0);

    /* slices of 30 ms inside a 200 ms deadline */
    mtc_arena_wait w;
    mtc_arena_wait_init(&w, 200 * 1000000LL);
    double t0 = now_s();
    int slices = 0, rc;
    while ((rc = mtc_arena_alloc_slice(a, 1, 5, &w, 30 * 1000000LL, &tmp)) == -EAGAIN) {
        double dt = now_s() - t0;
        CHECK(dt < 3.0);
        slices++;
    }
    double dt = now_s() - t0;
    CHECK_EQ(rc, -ETIMEDOUT);
    CHECK(dt >= 0.199);
    CHECK(dt < 3.0);
    CHECK(slices >= 3);          /* 200 / 30: the caller got control back between slices */
    CHECK(slices <= 8);
    mtc_arena_stats s = stats(a);
    CHECK_EQ(s.waits, 1);        /* one allocation: one wait, one timeout */
    CHECK_EQ(s.timeouts, 1);

    /* slice 0: one try, then back to the caller */
    mtc_arena_wait_init(&w, -1);
    CHECK_EQ(mtc_arena_alloc_slice(a, 1, 5, &w, 0, &tmp), -EAGAIN);
    CHECK_EQ(stats(a).waits, 2);
    CHECK_EQ(stats(a).timeouts, 1);
    /* a timeout too long to represent is no deadline */
    mtc_arena_wait_init(&w, INT64_MAX);
    CHECK_EQ(w.deadline_ns, -1);
    CHECK_EQ(mtc_arena_alloc_slice(a, 1, 5, &w, 1000000, &tmp), -EAGAIN);
    /* bad sizes and owners fail at once, without waiting */
    mtc_arena_wait_init(&w, -1);
    CHECK_EQ(mtc_arena_alloc_slice(a, 3 * SLOT, 5, &w, -1, &tmp), -E2BIG);
    CHECK_EQ(mtc_arena_alloc_slice(a, 1, 0, &w, -1, &tmp), -EINVAL);

    /* a signal (handler without SA_RESTART, as Python installs them) ends the
     * slice at once, long before its end */
    struct sigaction sa, old;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_sigusr1;
    sigemptyset(&sa.sa_mask);
    CHECK_EQ(sigaction(SIGUSR1, &sa, &old), 0);
    kicker_arg k;
    k.target = pthread_self();
    atomic_init(&k.stop, 0);
    pthread_t th;
    g_sigusr1 = 0;
    CHECK_EQ(pthread_create(&th, NULL, kicker_main, &k), 0);
    mtc_arena_wait_init(&w, -1);
    t0 = now_s();
    rc = mtc_arena_alloc_slice(a, 1, 5, &w, 20LL * 1000000000, &tmp);
    dt = now_s() - t0;
    atomic_store(&k.stop, 1);
    CHECK_EQ(pthread_join(th, NULL), 0);
    CHECK_EQ(rc, -EAGAIN);
    CHECK(g_sigusr1);
    CHECK(dt < 10.0);            /* far from the 20 s slice */
    CHECK_EQ(sigaction(SIGUSR1, &old, NULL), 0);

    /* room: the next slice returns it */
    CHECK_EQ(mtc_arena_free(a, o, 5), 0);
    CHECK_EQ(mtc_arena_alloc_slice(a, 1, 5, &w, 0, &tmp), 0);
    CHECK_EQ(mtc_arena_free(a, tmp, 5), 0);
    CHECK(mtc_arena_valid(a));
    mtc_arena_unref(a);
}

/* Owners are pids: 1 .. INT32_MAX everywhere, so that a caller that narrows a
 * wider number cannot alias a real owner through the top bits; a forged state
 * word with a larger "pid" is reclaimed as dead (never kill() of a negative
 * pid_t, which would mean a process group). */
static void test_owner_range(void)
{
    mtc_arena *a = make(4 * SLOT);
    /* A: a live owner whatever the machine (init; reclaim_dead must keep its run) */
    const uint32_t A = 1, BIG = (uint32_t)INT32_MAX + 1u;
    uint64_t o, tmp;
    CHECK_EQ(mtc_arena_try_alloc(a, SLOT, A, &o), 0);
    CHECK_EQ(mtc_arena_try_alloc(a, SLOT, BIG, &tmp), -EINVAL);
    CHECK_EQ(mtc_arena_try_alloc(a, SLOT, UINT32_MAX, &tmp), -EINVAL);
    CHECK_EQ(mtc_arena_check(a, o, 1, 0), -EINVAL);
    CHECK_EQ(mtc_arena_check(a, o, 1, BIG | A), -EINVAL);
    CHECK_EQ(mtc_arena_retag(a, o, A, BIG), -EINVAL);
    CHECK_EQ(mtc_arena_retag(a, o, BIG, A), -EINVAL);
    CHECK_EQ(mtc_arena_free(a, o, BIG | A), -EINVAL);
    CHECK_EQ(mtc_arena_check(a, o, 1, A), 0);
    /* a forged run owned by "pid" 0xffffffff: dead */
    uint64_t i = (o - a->data_offset) / SLOT + 1;
    atomic_store(&a->hdr->slots[i], MTC_ARENA_HEAD | (1ull << 32) | UINT32_MAX);
    atomic_fetch_add(&a->hdr->slots_in_use, 1);
    CHECK_EQ(mtc_arena_reclaim_dead(a, (uint32_t)getpid()), 1);
    CHECK_EQ(atomic_load(&a->hdr->slots[i]), 0);
    CHECK_EQ(mtc_arena_free(a, o, A), 0);
    CHECK(mtc_arena_valid(a));
    mtc_arena_unref(a);
}

typedef struct waiter_arg {
    mtc_arena *a;
    int64_t timeout_ns;
    int rc;
    uint64_t off;
    double waited;
} waiter_arg;

static void *waiter_main(void *p)
{
    waiter_arg *w = p;
    double t0 = now_s();
    w->rc = mtc_arena_alloc(w->a, 2 * SLOT, 9, w->timeout_ns, &w->off);
    w->waited = now_s() - t0;
    return NULL;
}

static void test_waiter_woken_by_free_from_another_thread(void)
{
    mtc_arena *a = make(3 * SLOT);
    uint64_t o1, o2;
    CHECK_EQ(mtc_arena_try_alloc(a, SLOT, 8, &o1), 0);
    CHECK_EQ(mtc_arena_try_alloc(a, 2 * SLOT, 8, &o2), 0);
    waiter_arg w = {a, 10LL * 1000000000, 1, 0, 0};
    pthread_t th;
    CHECK_EQ(pthread_create(&th, NULL, waiter_main, &w), 0);
    sleep_ms(120);
    /* freeing one slot is not enough room for it; freeing the run is */
    CHECK_EQ(mtc_arena_free(a, o1, 8), 0);
    sleep_ms(30);
    CHECK_EQ(mtc_arena_free(a, o2, 8), 0);
    CHECK_EQ(pthread_join(th, NULL), 0);
    CHECK_EQ(w.rc, 0);
    CHECK_EQ(mtc_arena_check(a, w.off, 2 * SLOT, 9), 0);
    CHECK(w.waited >= 0.14);
    CHECK(w.waited < 5.0); /* woken by the free, long before its timeout */
    CHECK_EQ(stats(a).waits, 1);
    CHECK_EQ(stats(a).timeouts, 0);
    CHECK_EQ(mtc_arena_free(a, w.off, 9), 0);
    CHECK(mtc_arena_valid(a));
    mtc_arena_unref(a);
}

static void test_waiter_in_another_process(void)
{
    /* a worker (forked child, its own attach) waits; the main process frees */
    mtc_arena *a = make(2 * SLOT);
    uint64_t o;
    CHECK_EQ(mtc_arena_try_alloc(a, 2 * SLOT, (uint32_t)getpid(), &o), 0);
    mtc_arena *c;
    worker w;
    pid_t pid = fork_worker(a, &w, &c);
    if (pid == 0) {
        uint64_t off;
        double t0 = now_s();
        CHILD_CHECK(mtc_arena_alloc(c, SLOT, (uint32_t)getpid(), 10LL * 1000000000, &off) == 0);
        CHILD_CHECK(now_s() - t0 < 5.0);
        CHILD_CHECK(mtc_arena_free(c, off, (uint32_t)getpid()) == 0);
        _exit(0);
    }
    sleep_ms(100);
    CHECK_EQ(mtc_arena_free(a, o, (uint32_t)getpid()), 0);
    CHECK_EQ(wait_child(pid), 0);
    CHECK_EQ(stats(a).slots_in_use, 0);
    CHECK(mtc_arena_valid(a));
    close_worker(&w);
    mtc_arena_unref(a);
}

/* ------------------------------------------------------------------ */
/* reclaim_dead                                                        */

static void test_reclaim_dead_child(void)
{
    mtc_arena *a = make(16 * SLOT);
    uint32_t me = (uint32_t)getpid();
    uint64_t mine;
    CHECK_EQ(mtc_arena_try_alloc(a, 2 * SLOT, me, &mine), 0);
    mtc_arena *c;
    worker w;
    pid_t pid = fork_worker(a, &w, &c);
    if (pid == 0) {
        uint64_t off;
        /* 1 + 3 + 2 slots, then dies without freeing them */
        CHILD_CHECK(mtc_arena_try_alloc(c, 1, (uint32_t)getpid(), &off) == 0);
        CHILD_CHECK(mtc_arena_try_alloc(c, 3 * SLOT, (uint32_t)getpid(), &off) == 0);
        CHILD_CHECK(mtc_arena_try_alloc(c, 2 * SLOT, (uint32_t)getpid(), &off) == 0);
        CHILD_CHECK(write(w.ready[1], "r", 1) == 1);
        char x;
        CHILD_CHECK(read(w.go[0], &x, 1) == 1);
        _exit(0);
    }
    char x;
    CHECK_EQ(read(w.ready[0], &x, 1), 1);
    CHECK_EQ(stats(a).slots_in_use, 8);
    /* alive: nothing to reclaim */
    CHECK_EQ(mtc_arena_reclaim_dead(a, me), 0);
    CHECK_EQ(write(w.go[1], "g", 1), 1);
    CHECK_EQ(wait_child(pid), 0);
    /* dead (and reaped): its 6 slots come back, ours stay */
    CHECK_EQ(mtc_arena_reclaim_dead(a, me), 6);
    CHECK_EQ(mtc_arena_reclaim_dead(a, me), 0);
    mtc_arena_stats s = stats(a);
    CHECK_EQ(s.slots_in_use, 2);
    CHECK_EQ(s.reclaims, 6);
    CHECK_EQ(mtc_arena_check(a, mine, 2 * SLOT, me), 0);
    CHECK(mtc_arena_valid(a));
    /* the reclaimed room is usable: 14 free slots, of which a run of 14 at most */
    uint64_t big;
    CHECK_EQ(mtc_arena_try_alloc(a, 14 * SLOT, me, &big), 0);
    CHECK_EQ(mtc_arena_free(a, big, me), 0);
    CHECK_EQ(mtc_arena_free(a, mine, me), 0);
    CHECK_EQ(stats(a).slots_in_use, 0);
    CHECK(mtc_arena_valid(a));
    close_worker(&w);
    mtc_arena_unref(a);
}

/* ------------------------------------------------------------------ */
/* multi-process stress                                                */

#define NPROC 4

static void stress_child(mtc_arena *parent_map, long cycles, uint32_t max_slots)
{
    mtc_arena *c = NULL;
    CHILD_CHECK(mtc_arena_attach(parent_map->fd, &c) == 0);
    uint32_t me = (uint32_t)getpid();
    uint64_t rng = 0x9e3779b97f4a7c15ull ^ ((uint64_t)me << 17);
    for (long n = 0; n < cycles; n++) {
        uint64_t nbytes = 1 + xorshift64(&rng) % (max_slots * SLOT);
        uint64_t off;
        int rc = mtc_arena_alloc(c, nbytes, me, 20LL * 1000000000, &off);
        CHILD_CHECK(rc == 0);
        CHILD_CHECK(off >= c->data_offset && (off - c->data_offset) % SLOT == 0);
        CHILD_CHECK(off + nbytes <= c->bytes);
        CHILD_CHECK(mtc_arena_check(c, off, nbytes, me) == 0);
        /* my pid over the whole region; anyone else writing into it shows */
        fill(c->base + off, nbytes, me ^ (uint32_t)n);
        if (n % 7 == 0) sched_yield();
        CHILD_CHECK(verify(c->base + off, nbytes, me ^ (uint32_t)n));
        CHILD_CHECK(mtc_arena_free(c, off, me) == 0);
    }
    mtc_arena_unref(c);
    _exit(0);
}

static void test_multiprocess_stress(void)
{
    long cycles = env_long("MTC_ARENA_STRESS_CYCLES", 5000);
    /* 8 slots for 4 processes taking 1..3 slots: they collide and wait */
    mtc_arena *a = make(8 * SLOT);
    pid_t pids[NPROC];
    double t0 = now_s();
    for (int p = 0; p < NPROC; p++) {
        pids[p] = fork();
        CHECK(pids[p] >= 0);
        if (pids[p] == 0) stress_child(a, cycles, 3);
    }
    for (int p = 0; p < NPROC; p++) CHECK_EQ(wait_child(pids[p]), 0);
    mtc_arena_stats s = stats(a);
    CHECK(mtc_arena_valid(a));
    CHECK_EQ(s.slots_in_use, 0);
    CHECK_EQ(s.allocs, NPROC * cycles);
    CHECK_EQ(s.frees, NPROC * cycles);
    CHECK_EQ(s.reclaims, 0);
    /* high_water can overshoot the slot count: _free_run zeroes the slots before it lowers
     * slots_in_use, and another process may claim and count them in between (stats only) */
    CHECK(s.high_water <= 8 + NPROC * 3);
    for (uint32_t i = 0; i < a->nslots; i++) CHECK_EQ(a->hdr->slots[i], 0);
    printf("  multi-process stress: %d x %ld cycles in %.2f s, %" PRIu64 " waits, high water %" PRIu64 " slots\n",
           NPROC, cycles, now_s() - t0, s.waits, s.high_water);
    mtc_arena_unref(a);
}

/* ------------------------------------------------------------------ */
/* threads stress (TSan checks the memory ordering of slot hand-offs) */

#define NTHREADS 4

typedef struct stress_arg {
    mtc_arena *a;
    uint32_t owner;
    long cycles;
    int failed;
} stress_arg;

static void *stress_thread(void *p)
{
    stress_arg *s = p;
    uint64_t rng = 0xdeadbeefcafef00dull ^ ((uint64_t)s->owner << 23);
    for (long n = 0; n < s->cycles && !s->failed; n++) {
        uint64_t nbytes = 1 + xorshift64(&rng) % (3 * SLOT);
        uint64_t off;
        if (mtc_arena_alloc(s->a, nbytes, s->owner, 20LL * 1000000000, &off) != 0 ||
            mtc_arena_check(s->a, off, nbytes, s->owner) != 0) {
            s->failed = 1;
            break;
        }
        /* TSan: bytes written here were last written by the thread that freed these slots */
        fill(s->a->base + off, nbytes, s->owner ^ (uint32_t)n);
        if (n % 5 == 0) sched_yield();
        if (!verify(s->a->base + off, nbytes, s->owner ^ (uint32_t)n)) s->failed = 2;
        if (mtc_arena_free(s->a, off, s->owner) != 0) s->failed = 3;
    }
    return NULL;
}

static void test_threads_stress(void)
{
    long cycles = env_long("MTC_ARENA_STRESS_CYCLES", 4000);
    mtc_arena *a = make(8 * SLOT);
    pthread_t th[NTHREADS];
    stress_arg args[NTHREADS];
    double t0 = now_s();
    for (int t = 0; t < NTHREADS; t++) {
        args[t] = (stress_arg){a, 100 + (uint32_t)t, cycles, 0};
        CHECK_EQ(pthread_create(&th[t], NULL, stress_thread, &args[t]), 0);
    }
    for (int t = 0; t < NTHREADS; t++) CHECK_EQ(pthread_join(th[t], NULL), 0);
    for (int t = 0; t < NTHREADS; t++) CHECK_EQ(args[t].failed, 0);
    mtc_arena_stats s = stats(a);
    CHECK(mtc_arena_valid(a));
    CHECK_EQ(s.slots_in_use, 0);
    CHECK_EQ(s.allocs, NTHREADS * cycles);
    CHECK_EQ(s.frees, NTHREADS * cycles);
    printf("  threads stress: %d x %ld cycles in %.2f s, %" PRIu64 " waits\n", NTHREADS, cycles, now_s() - t0,
           s.waits);
    mtc_arena_unref(a);
}

/* ------------------------------------------------------------------ */
/* known race: retag (adopt) against reclaim_dead                      */

/*
 * A worker sent a descriptor and died. The main process adopts the region
 * (Arena.adopt -> mtc_arena_retag, e.g. on the DataLoader's pin-memory
 * thread) while another thread runs reclaim_dead (PrefetchLoader's error
 * path, with the GIL released). retag moves the head first, then the
 * continuations one by one; reclaim_dead frees any slot still naming the dead
 * pid. When the adopting thread is preempted between the two, reclaim frees
 * the continuations under a head that keeps its length: another allocation
 * can take them (overlapping regions), slots_in_use no longer matches, and
 * mtc_arena_valid() fails. (The mirror case, retag to a dead owner, leaves
 * orphan continuations.)
 *
 * The preemption is made deterministic: a helper process retags one long run
 * back and forth between a dead pid and this (live) process, and is stopped
 * with SIGSTOP at an arbitrary moment; then reclaim_dead runs. Returns the
 * round at which the arena was left invalid, 0 if never.
 */
static int test_retag_vs_reclaim_race(void)
{
    const int ROUNDS = 200;
    const uint32_t K = 64;
    uint32_t me = (uint32_t)getpid();
    /* a pid that is certainly dead: a child we reaped */
    pid_t dead = fork();
    CHECK(dead >= 0);
    if (dead == 0) _exit(0);
    CHECK_EQ(wait_child(dead), 0);
    for (int round = 1; round <= ROUNDS; round++) {
        mtc_arena *a = make((size_t)K * SLOT);
        uint64_t off;
        CHECK_EQ(mtc_arena_try_alloc(a, (uint64_t)K * SLOT, (uint32_t)dead, &off), 0);
        pid_t helper = fork();
        CHECK(helper >= 0);
        if (helper == 0) {
            for (;;) {
                if (mtc_arena_retag(a, off, (uint32_t)dead, me) == 0) (void)mtc_arena_retag(a, off, me, (uint32_t)dead);
            }
        }
        sleep_ms(1 + round % 3);
        CHECK_EQ(kill(helper, SIGSTOP), 0);
        int st;
        CHECK_EQ(waitpid(helper, &st, WUNTRACED), helper);
        CHECK(WIFSTOPPED(st));
        /* only the real case counts: stopped in the middle of an adoption (dead -> me), the
         * head already ours, some continuations still the dead worker's */
        uint64_t i0 = (off - a->data_offset) / SLOT, head = a->hdr->slots[i0];
        uint32_t still_dead = 0;
        for (uint32_t q = 1; q < K; q++) still_dead += a->hdr->slots[i0 + q] == (uint64_t)(uint32_t)dead;
        int mid_adopt = (uint32_t)head == me && still_dead > 0;
        mtc_arena_reclaim_dead(a, me);
        /* The invariant that matters while the adoption is unfinished: no slot of
         * the run was freed under its live head (a freed slot could be claimed by
         * another region: overlap). valid() is for quiescent arenas. */
        int valid = 1;
        for (uint32_t q = 0; q < K; q++)
            if (!a->hdr->slots[i0 + q]) valid = 0;
        CHECK_EQ(kill(helper, SIGKILL), 0);
        CHECK_EQ(waitpid(helper, &st, 0), helper);
        mtc_arena_unref(a);
        if (mid_adopt && !valid) return round;
    }
    return 0;
}

/* ------------------------------------------------------------------ */

int main(void)
{
    alarm(120); /* a hang anywhere fails the run instead of stalling CI */
    setvbuf(stdout, NULL, _IOLBF, 0);
    double t0 = now_s();
    test_create_geometry();
    test_attach_same_process();
    test_attach_forked_child();
    test_populate();
    test_attach_rejects_non_arenas();
    test_alloc_free_check_retag();
    test_e2big_enospc_fragmentation();
    test_alloc_timeout();
    test_alloc_slices();
    test_owner_range();
    test_waiter_woken_by_free_from_another_thread();
    test_waiter_in_another_process();
    test_reclaim_dead_child();
    test_multiprocess_stress();
    test_threads_stress();
    {
        /* regression test: reclaim_dead used to free the continuations of a run
         * whose head had just been adopted by a live process */
        int broken = test_retag_vs_reclaim_race();
        if (broken) {
            printf("  retag vs reclaim_dead: a run was freed under a live head (round %d)\n", broken);
            return 1;
        }
        printf("  retag vs reclaim_dead race: run intact in every round\n");
    }
    printf("test_arena: all passed (%ld checks, %.2f s)\n", atomic_load(&g_checks), now_s() - t0);
    return 0;
}
