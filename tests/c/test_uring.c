/* Unit tests of csrc/engine/uring.c: the ring's submission and completion logic
 * (windows of requests, a queue shallower than the batch, reads cut short and
 * completed, O_DIRECT middles with buffered heads and tails), errors (missing,
 * short, directory) with the failing request and the bytes that arrived, no
 * descriptor left open, the pread fallback doing the same, the spec parser,
 * several threads reading at once, and a forked child building its own ring.
 * Built with liburing where the Makefile finds it; the io_uring cases skip
 * (saying so) where the ring cannot be set up. */
#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "uring.h"

static unsigned long long g_seed;
#define CHECK_NOTE() fprintf(stderr, "(seed %llu)\n", g_seed)
#include "check.h"

#define NFILES 24
#define A 4096

static char g_dir[64];
static char g_path[NFILES][96];
static uint8_t *g_data[NFILES];
static size_t g_size[NFILES];

static int open_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    int n = 0;
    if (!d) return -1;
    while (readdir(d)) n++;
    closedir(d);
    return n;
}

static void make_files(void)
{
    strcpy(g_dir, "/tmp/mtc_test_uring_XXXXXX");
    CHECK(mkdtemp(g_dir) != NULL);
    uint64_t s = 12345;
    for (int i = 0; i < NFILES; i++) {
        /* sizes from empty to a few MiB, aligned and not */
        size_t sizes[] = {0, 1, 100, A - 1, A, A + 1, 3 * A, 65536 + 7, (1 << 20) + 123, (3 << 20) + A};
        g_size[i] = sizes[i % 10] + (size_t)(i / 10) * 513;
        g_data[i] = malloc(g_size[i] ? g_size[i] : 1);
        for (size_t k = 0; k < g_size[i]; k++) g_data[i][k] = (uint8_t)(xorshift64(&s) >> 24);
        snprintf(g_path[i], sizeof g_path[i], "%s/f%d.bin", g_dir, i);
        FILE *f = fopen(g_path[i], "wb");
        CHECK(f != NULL);
        CHECK_EQ(fwrite(g_data[i], 1, g_size[i], f), g_size[i]);
        CHECK(fflush(f) == 0 && fsync(fileno(f)) == 0); /* clean pages: drop_cache can drop them */
        fclose(f);
    }
}

static void remove_files(void)
{
    for (int i = 0; i < NFILES; i++) {
        unlink(g_path[i]);
        free(g_data[i]);
    }
    char p[128];
    snprintf(p, sizeof p, "%s/sub", g_dir);
    rmdir(p);
    snprintf(p, sizeof p, "%s/short.bin", g_dir);
    unlink(p);
    snprintf(p, sizeof p, "%s/fifo", g_dir);
    unlink(p);
    rmdir(g_dir);
}

/* Random requests over the files, each to its own place in one destination
 * buffer: sometimes congruent with the file offset modulo 4 KiB (O_DIRECT
 * middles), sometimes not. Returns the count; dst is 4 KiB aligned. */
static uint32_t make_requests(uint64_t *rng, mtc_uring_req *reqs, uint32_t max, uint8_t *dst, size_t cap)
{
    uint32_t n = 1 + (uint32_t)(xorshift64(rng) % max);
    size_t at = 0;
    uint32_t k = 0;
    for (; k < n; k++) {
        int f = (int)(xorshift64(rng) % NFILES);
        uint64_t off = g_size[f] ? xorshift64(rng) % (g_size[f] + 1) : 0;
        if (xorshift64(rng) % 3 == 0) off = off / A * A;
        uint64_t len = g_size[f] - off;
        if (len && xorshift64(rng) % 2) len = xorshift64(rng) % (len + 1);
        /* congruent placement: dst + at == off (mod A) */
        if (xorshift64(rng) % 2) at = (at + A - 1) / A * A + off % A;
        if (at + len > cap) break;
        reqs[k] = (mtc_uring_req){.path = g_path[f], .offset = off, .nbytes = len, .dst = dst + at, .tag = (int32_t)k};
        at += len + xorshift64(rng) % 64;
    }
    return k;
}

static void check_requests(const mtc_uring_req *reqs, uint32_t n)
{
    for (uint32_t k = 0; k < n; k++) {
        int f = -1;
        for (int i = 0; i < NFILES; i++)
            if (reqs[k].path == g_path[i]) f = i;
        CHECK(f >= 0);
        if (memcmp(reqs[k].dst, g_data[f] + reqs[k].offset, reqs[k].nbytes))
            FAILF("request %u (file %d, offset %llu, %llu bytes) read wrong bytes", k, f,
                  (unsigned long long)reqs[k].offset, (unsigned long long)reqs[k].nbytes);
    }
}

static int g_have_uring;

/* Drops the files' pages from the page cache (a cold read). */
static void drop_cache(void)
{
    for (int i = 0; i < NFILES; i++) {
        int fd = open(g_path[i], O_RDONLY);
        CHECK(fd >= 0);
        CHECK_EQ(posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), 0);
        close(fd);
    }
}

/* Reads every file through the page cache (a warm read: an earlier cold
 * batch, or O_DIRECT reads, may have left parts of them uncached). */
static void warm_cache(void)
{
    static char buf[1 << 16];
    for (int i = 0; i < NFILES; i++) {
        int fd = open(g_path[i], O_RDONLY);
        CHECK(fd >= 0);
        while (read(fd, buf, sizeof buf) > 0) {
        }
        close(fd);
    }
}

/* Whether this kernel has cachestat(2) (Linux 6.5), which the reader asks
 * before an O_DIRECT read whether the page cache holds the bytes. */
static long cached_pages(int f)
{
#if defined(__x86_64__) || defined(__aarch64__)
    int fd = open(g_path[f], O_RDONLY);
    CHECK(fd >= 0);
    uint64_t range[2] = {0, 0}, cs[5];
    long rc = syscall(451, fd, range, cs, 0);
    close(fd);
    return rc == 0 ? (long)cs[0] : -1;
#else
    return -1;
#endif
}
static int have_cachestat(void) { return cached_pages(9) >= 0; }

/* Whether every page of every file is in the page cache now. */
static int all_cached(void)
{
    for (int i = 0; i < NFILES; i++)
        if (cached_pages(i) < (long)((g_size[i] + A - 1) / A)) return 0;
    return 1;
}

/* Whether dropping the cache works here (not on tmpfs, whose pages are the
 * files): cold batches then must read their middles O_DIRECT. */
static int cache_droppable(void)
{
    drop_cache();
    return cached_pages(9) <= 0;
}

/* Many random batches under one setting; the mode must be what was asked.
 * cold: the files' pages are dropped before every batch (O_DIRECT reads go
 * to the device); else they are in the page cache, and the default direct
 * setting (UNCACHED) reads them buffered where cachestat says so. */
static void run_random(int mode, unsigned depth, uint64_t max_io, int direct, int rounds, int cold)
{
    mtc_uring_configure(depth, max_io, direct, mode);
    const char *why;
    int forced;
    CHECK_EQ(mtc_uring_mode(&why, &forced), mode);
    size_t cap = 24 << 20;
    uint8_t *dst = aligned_alloc(A, cap);
    mtc_uring_req *reqs = malloc(400 * sizeof *reqs);
    CHECK(dst && reqs);
    uint64_t rng = g_seed ^ (depth * 7919u + max_io * 31u + (uint64_t)direct + (uint64_t)mode * 1000003u);
    int fds = open_fds();
    mtc_uring_stats before, after;
    mtc_uring_get_stats(&before);
    uint64_t total = 0;
    /* warm, UNCACHED: a round whose files were all cached before and after its
     * read (the kernel may evict pages under memory pressure at any time, and
     * then an O_DIRECT read of them is right) must read nothing O_DIRECT. A page
     * evicted after the check before the read and brought back by a
     * neighbouring buffered read's readahead within it passes both checks: one
     * such round, and one more per ten, is let through (seen once on a loaded 2-core machine:
     * 1 O_DIRECT read in one round), a reader that goes O_DIRECT on cached
     * pages fails every round */
    int warm_uncached = mode == MTC_URING_MODE_URING && direct == MTC_URING_DIRECT_UNCACHED && !cold &&
                        have_cachestat();
    int steady = 0, evicted = 0, steady_direct = 0;
    for (int r = 0; r < rounds; r++) {
        uint32_t n = make_requests(&rng, reqs, r % 4 == 0 ? 400 : 40, dst, cap);
        memset(dst, 0xAB, cap);
        if (cold) drop_cache();
        else warm_cache();
        int cached_before = warm_uncached && all_cached();
        mtc_uring_stats rb, ra;
        mtc_uring_get_stats(&rb);
        mtc_uring_err e = {0, 0};
        int rc = mtc_uring_read(reqs, n, &e);
        if (rc) FAILF("mode %d depth %u max_io %llu direct %d: read failed %d at %u", mode, depth,
                      (unsigned long long)max_io, direct, rc, e.index);
        mtc_uring_get_stats(&ra);
        if (warm_uncached) {
            if (cached_before && all_cached()) {
                steady++;
                if (ra.direct_reads != rb.direct_reads) {
                    steady_direct++;
                    printf("  warm, depth %u: round %d read %llu pieces O_DIRECT with every page cached "
                           "before and after\n", depth, r, (unsigned long long)(ra.direct_reads - rb.direct_reads));
                }
            } else {
                evicted++;
            }
        }
        check_requests(reqs, n);
        total += n;
    }
    if (warm_uncached) CHECK(steady_direct <= 1 + steady / 10);
    if (warm_uncached && evicted)
        printf("  warm, depth %u: %d of %d rounds lost cached pages around the read%s\n", depth, evicted,
               rounds, steady ? "" : " (SKIP: no round to check for O_DIRECT reads)");
    mtc_uring_get_stats(&after);
    /* every byte read took one route */
    CHECK_EQ(after.bytes_cached + after.bytes_direct + after.bytes_buffered + after.bytes_pread -
                 (before.bytes_cached + before.bytes_direct + before.bytes_buffered + before.bytes_pread),
             after.bytes - before.bytes);
    if (mode == MTC_URING_MODE_URING) {
        CHECK_EQ(after.reads_uring - before.reads_uring, total);
        CHECK_EQ(after.bytes_pread, before.bytes_pread);
        /* the ring reads what the page cache does not hold, and everything with ALWAYS */
        if (direct == MTC_URING_DIRECT_ALWAYS || (cold && cache_droppable())) CHECK(after.submits > before.submits);
    } else {
        CHECK_EQ(after.reads_pread - before.reads_pread, total);
        CHECK_EQ(after.bytes_pread - before.bytes_pread, after.bytes - before.bytes);
    }
    if (max_io && max_io < 4096) CHECK(after.short_reads > before.short_reads);
    if (mode == MTC_URING_MODE_URING) {
        int dropped = cold && cache_droppable();
        if (direct == MTC_URING_DIRECT_ALWAYS || (direct == MTC_URING_DIRECT_UNCACHED && (dropped || !have_cachestat())))
            CHECK(after.direct_reads > before.direct_reads);
        /* (cold: a later window may find pages that an earlier one's buffered
         * heads and tails, with their readahead, brought in: cached is right) */
        if (direct == MTC_URING_DIRECT_ALWAYS) CHECK_EQ(after.bytes_cached, before.bytes_cached);
        if (warm_uncached && steady) /* warm: the helpers copy from the page cache (per round above) */
            CHECK(after.bytes_cached > before.bytes_cached);
        if (direct == MTC_URING_DIRECT_OFF) CHECK_EQ(after.direct_reads, before.direct_reads);
    }
    CHECK_EQ(open_fds(), fds);
    free(dst);
    free(reqs);
}

/* One batch of whole files, half of them in the page cache and half evicted:
 * the cached ones are copied by the helpers, the others read by the ring, in
 * the io_uring mode; everything with pread in the pread mode. Skipped (said)
 * where the cache cannot be dropped or the kernel evicts a warm file. */
static void test_routes(int mode, int probe)
{
    mtc_uring_configure(16, 0, MTC_URING_DIRECT_UNCACHED, mode);
    size_t cap = 24 << 20, at = 0;
    uint8_t *dst = aligned_alloc(A, cap);
    CHECK(dst != NULL);
    mtc_uring_req reqs[NFILES];
    uint64_t warm = 0, cold = 0;
    uint32_t n = 0;
    warm_cache();
    for (int i = 0; i < NFILES; i++) {
        if (i % 2 == 0) { /* evicted */
            int fd = open(g_path[i], O_RDONLY);
            CHECK(fd >= 0);
            CHECK_EQ(posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), 0);
            close(fd);
            cold += g_size[i];
        } else {
            warm += g_size[i];
        }
        reqs[n] = (mtc_uring_req){.path = g_path[i], .offset = 0, .nbytes = g_size[i], .dst = dst + at, .tag = i};
        at = (at + g_size[i] + A - 1) / A * A;
        n++;
    }
    int known = have_cachestat();
    int state_ok = known;
    for (int i = 0; known && i < NFILES; i++)
        if (g_size[i] && cached_pages(i) != (i % 2 ? (long)((g_size[i] + A - 1) / A) : 0)) state_ok = 0;
    memset(dst, 0xAB, cap);
    mtc_uring_stats b, a;
    mtc_uring_get_stats(&b);
    mtc_uring_err e = {0, 0};
    CHECK_EQ(mtc_uring_read(reqs, n, &e), 0);
    mtc_uring_get_stats(&a);
    check_requests(reqs, n);
    CHECK_EQ(a.bytes - b.bytes, warm + cold);
    if (mode == MTC_URING_MODE_PREAD) {
        CHECK_EQ(a.bytes_pread - b.bytes_pread, warm + cold);
    } else if (!state_ok) {
        printf("SKIP routes (probe %d): the page cache could not be set up (tmpfs, or pages evicted)\n", probe);
    } else {
        CHECK_EQ(a.bytes_cached - b.bytes_cached, warm);
        CHECK_EQ(a.bytes_direct - b.bytes_direct + a.bytes_buffered - b.bytes_buffered, cold);
        CHECK(a.direct_reads > b.direct_reads);
        CHECK(a.bytes_direct - b.bytes_direct > cold / 2);
    }
    free(dst);
}

static void test_errors(int mode)
{
    mtc_uring_configure(3, 0, 1, mode);
    CHECK_EQ(mtc_uring_mode(NULL, NULL), mode); /* the ring's descriptor exists before we count */
    uint8_t *dst = aligned_alloc(A, 16 << 20);
    CHECK(dst != NULL);
    char missing[128], sub[128], shortp[128], fifo[128];
    snprintf(missing, sizeof missing, "%s/none.bin", g_dir);
    snprintf(fifo, sizeof fifo, "%s/fifo", g_dir);
    if (access(fifo, F_OK)) CHECK(mkfifo(fifo, 0600) == 0);
    snprintf(sub, sizeof sub, "%s/sub", g_dir);
    snprintf(shortp, sizeof shortp, "%s/short.bin", g_dir);
    mkdir(sub, 0700);
    int fds = open_fds();
    mtc_uring_req reqs[12];
    /* 10 good requests, then the bad one at index 10, then a good one; a depth
     * of 3 puts the failure in a later window */
    for (int kind = 0; kind < 6; kind++) {
        for (int k = 0; k < 12; k++)
            reqs[k] = (mtc_uring_req){.path = g_path[8], .offset = 0, .nbytes = g_size[8],
                                      .dst = dst + (size_t)k * (g_size[8] + A), .tag = k};
        uint64_t want_got = 0;
        int want = 0;
        if (kind == 0) {
            reqs[10].path = missing;
            want = -ENOENT;
        } else if (kind == 1) {
            reqs[10].path = sub;
            want = -EISDIR;
        } else if (kind == 2) { /* the file ends 5000 bytes into the request */
            reqs[10].path = g_path[9];
            reqs[10].offset = g_size[9] - 5000;
            reqs[10].nbytes = 5000 + 3 * A + 17;
            want = -ENODATA;
            want_got = 5000;
        } else if (kind == 4) { /* a FIFO: refused without waiting for a writer */
            reqs[10].path = fifo;
            want = -ESPIPE;
        } else if (kind == 5) { /* a character device has no offsets either */
            reqs[10].path = "/dev/zero";
            want = -ESPIPE;
        } else if (kind == 3) { /* a file that is truncated below its offset: nothing arrives */
            FILE *f = fopen(shortp, "wb");
            CHECK(f != NULL);
            fwrite(g_data[9], 1, 100, f);
            fclose(f);
            reqs[10].path = shortp;
            reqs[10].offset = 4096;
            reqs[10].nbytes = 8192;
            want = -ENODATA;
        }
        mtc_uring_err e = {99, 99};
        int rc = mtc_uring_read(reqs, 12, &e);
        CHECK_EQ(rc, want);
        CHECK_EQ(e.index, 10);
        CHECK_EQ(e.got, want_got);
        CHECK_EQ(open_fds(), fds);
    }
    /* the ring is still good after errors */
    for (int k = 0; k < 12; k++)
        reqs[k] = (mtc_uring_req){.path = g_path[k], .offset = 0, .nbytes = g_size[k],
                                  .dst = dst + (size_t)k * (600 << 10), .tag = k};
    reqs[8].nbytes = reqs[9].nbytes = 0; /* too large for this layout; still opened */
    mtc_uring_err e;
    CHECK_EQ(mtc_uring_read(reqs, 12, &e), 0);
    check_requests(reqs, 12);
    free(dst);
}

/* A file that ends inside a request's O_DIRECT middle, whose buffered tail is
 * read in parallel: the tail finds the end first, at its own start, yet the
 * bytes reported are those the file has. */
static void test_short_direct(int mode)
{
    mtc_uring_configure(3, 0, MTC_URING_DIRECT_ALWAYS, mode);
    char path[128];
    snprintf(path, sizeof path, "%s/short.bin", g_dir);
    FILE *f = fopen(path, "wb");
    CHECK(f != NULL);
    CHECK_EQ(fwrite(g_data[9], 1, 5 * A + 100, f), (size_t)(5 * A + 100));
    fclose(f);
    uint8_t *dst = aligned_alloc(A, 16 * A);
    CHECK(dst != NULL);
    for (int round = 0; round < 20; round++) {
        mtc_uring_req r = {.path = path, .offset = 0, .nbytes = 8 * A + 17, .dst = dst, .tag = 0};
        mtc_uring_err e = {99, 99};
        CHECK_EQ(mtc_uring_read(&r, 1, &e), -ENODATA);
        CHECK_EQ(e.index, 0);
        CHECK_EQ(e.got, (uint64_t)(5 * A + 100));
    }
    unlink(path);
    free(dst);
}

/* ---- the spec ---- */

static size_t build_spec(uint8_t *buf, uint32_t nparts, const char *const *paths, const uint64_t *offs,
                         const uint64_t *lens)
{
    mtc_file_spec_hdr h = {MTC_FILE_SPEC_MAGIC, 3, 1, nparts, 0, 0};
    size_t pool = 0;
    for (uint32_t k = 0; k < nparts; k++) {
        pool += strlen(paths[k]) + 1;
        h.nbytes += (int64_t)lens[k];
    }
    h.paths_bytes = (uint32_t)pool;
    uint8_t *p = buf;
    memcpy(p, &h, sizeof h);
    p += sizeof h;
    int64_t dim = h.nbytes;
    memcpy(p, &dim, sizeof dim);
    p += sizeof dim;
    uint32_t at = 0;
    for (uint32_t k = 0; k < nparts; k++) {
        mtc_file_part part = {offs[k], lens[k], at, (uint32_t)strlen(paths[k])};
        memcpy(p, &part, sizeof part);
        p += sizeof part;
        at += part.path_len + 1;
    }
    for (uint32_t k = 0; k < nparts; k++) {
        memcpy(p, paths[k], strlen(paths[k]) + 1);
        p += strlen(paths[k]) + 1;
    }
    CHECK_EQ((size_t)(p - buf), mtc_uring_spec_size(buf));
    return (size_t)(p - buf);
}

static void test_spec(void)
{
    uint8_t buf[2048], bad[2048];
    const char *paths[3] = {g_path[7], g_path[8], g_path[6]};
    uint64_t offs[3] = {5, 100, 0}, lens[3] = {60000, (1 << 20) + 23, 1000};
    size_t n = build_spec(buf, 3, paths, offs, lens);
    mtc_file_spec s;
    CHECK_EQ(mtc_uring_spec_view(buf, n, &s), 0);
    CHECK_EQ(s.h.nparts, 3);
    for (uint32_t k = 0; k < 3; k++) {
        mtc_file_part p;
        const char *path;
        mtc_uring_spec_part(&s, k, &p, &path);
        CHECK(strcmp(path, paths[k]) == 0);
        CHECK_EQ(p.offset, offs[k]);
        CHECK_EQ(p.nbytes, lens[k]);
    }
    /* every truncation, a bad magic, a path without its NUL, a part that does not add up */
    for (size_t cut = 0; cut < n; cut++) CHECK_EQ(mtc_uring_spec_view(buf, cut, &s), -EINVAL);
    memcpy(bad, buf, n);
    bad[0] ^= 1;
    CHECK_EQ(mtc_uring_spec_view(bad, n, &s), -EINVAL);
    memcpy(bad, buf, n);
    bad[n - 1] = 'x';
    CHECK_EQ(mtc_uring_spec_view(bad, n, &s), -EINVAL);
    memcpy(bad, buf, n);
    mtc_file_part p;
    size_t p0 = sizeof(mtc_file_spec_hdr) + sizeof(int64_t);
    memcpy(&p, bad + p0, sizeof p);
    p.nbytes++;
    memcpy(bad + p0, &p, sizeof p);
    CHECK_EQ(mtc_uring_spec_view(bad, n, &s), -EINVAL);
    /* a range across the parts, read with pread on this thread */
    size_t total = (size_t)(lens[0] + lens[1] + lens[2]);
    uint8_t *ref = malloc(total), *out = malloc(total);
    CHECK(ref && out);
    memcpy(ref, g_data[7] + offs[0], lens[0]);
    memcpy(ref + lens[0], g_data[8] + offs[1], lens[1]);
    memcpy(ref + lens[0] + lens[1], g_data[6] + offs[2], lens[2]);
    uint64_t rng = g_seed + 5;
    for (int r = 0; r < 50; r++) {
        uint64_t b = xorshift64(&rng) % total, len = xorshift64(&rng) % (total - b + 1);
        mtc_uring_err e;
        memset(out, 0, total);
        CHECK_EQ(mtc_uring_pread_range(buf, b, len, out, &e), 0);
        CHECK(memcmp(out, ref + b, len) == 0);
    }
    /* a short part names itself */
    lens[2] = g_size[6] + 10;
    n = build_spec(buf, 3, paths, offs, lens);
    uint8_t *big = malloc((size_t)(lens[0] + lens[1] + lens[2]));
    CHECK(big != NULL);
    mtc_uring_err e;
    CHECK_EQ(mtc_uring_pread_range(buf, 0, lens[0] + lens[1] + lens[2], big, &e), -ENODATA);
    CHECK_EQ(e.index, 2);
    CHECK_EQ(e.got, g_size[6]);
    free(big);
    free(ref);
    free(out);
}

/* ---- threads, fork ---- */

typedef struct { int mode; uint64_t seed; } thr_arg;

static void *reader_thread(void *arg)
{
    thr_arg *t = arg;
    size_t cap = 4 << 20;
    uint8_t *dst = aligned_alloc(A, cap);
    mtc_uring_req reqs[40];
    uint64_t rng = t->seed;
    for (int r = 0; r < (UNDER_TSAN ? 15 : 60); r++) {
        uint32_t n = make_requests(&rng, reqs, 40, dst, cap);
        mtc_uring_err e;
        CHECK_EQ(mtc_uring_read(reqs, n, &e), 0);
        check_requests(reqs, n);
    }
    free(dst);
    return NULL;
}

static void test_threads(int mode)
{
    mtc_uring_configure(16, 0, 1, mode);
    pthread_t th[4];
    thr_arg args[4];
    for (int i = 0; i < 4; i++) {
        args[i] = (thr_arg){mode, g_seed * 31 + (uint64_t)i};
        CHECK(pthread_create(&th[i], NULL, reader_thread, &args[i]) == 0);
    }
    for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
}

static void test_fork(void)
{
    mtc_uring_configure(8, 0, 1, MTC_URING_MODE_URING);
    thr_arg a = {MTC_URING_MODE_URING, g_seed + 99};
    reader_thread(&a); /* the parent's ring exists */
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        /* the child builds its own ring; reads must not go through the parent's */
        mtc_uring_stats s0, s1;
        mtc_uring_get_stats(&s0);
        reader_thread(&a);
        mtc_uring_get_stats(&s1);
        _exit(s1.reads_uring > s0.reads_uring ? 0 : 3);
    }
    int status;
    CHECK(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    reader_thread(&a); /* and the parent's still works */
}

int main(void)
{
    const char *e = getenv("MTC_TEST_SEED");
    g_seed = e ? strtoull(e, NULL, 10) : (unsigned long long)time(NULL);
    alarm(600); /* a read that blocks (an open of a FIFO waits for a writer) fails the test */
    make_files();
    mtc_uring_configure(64, 0, 1, 0);
    const char *why;
    int forced;
    g_have_uring = mtc_uring_mode(&why, &forced) == MTC_URING_MODE_URING;
    if (!g_have_uring) printf("SKIP io_uring cases: %s\n", why ? why : "?");
    int modes[2] = {MTC_URING_MODE_URING, MTC_URING_MODE_PREAD};
    for (int m = g_have_uring ? 0 : 1; m < 2; m++) {
        int mode = modes[m];
        int rounds = UNDER_TSAN ? 8 : 30;
        const int U = MTC_URING_DIRECT_UNCACHED, AL = MTC_URING_DIRECT_ALWAYS;
        run_random(mode, 128, 0, U, rounds, 0);
        run_random(mode, 128, 0, U, rounds / 2, 1); /* cold: O_DIRECT middles */
        run_random(mode, 128, 0, AL, rounds, 0);    /* O_DIRECT even with the pages cached */
        run_random(mode, 1, 0, AL, rounds, 0);      /* one read in flight at a time */
        run_random(mode, 4, 1000, AL, rounds, 0);   /* every read cut short and completed */
        run_random(mode, 4, 1000, U, rounds / 2, 1);
        run_random(mode, 7, 3 * A + 5, AL, rounds, 0);
        run_random(mode, 32, 0, MTC_URING_DIRECT_OFF, rounds, 0); /* buffered only */
        run_random(mode, 32, 0, MTC_URING_DIRECT_OFF, rounds / 2, 1);
        for (int probe = 0; probe < 2; probe++) {
            mtc_uring_probe_mincore(probe); /* the page cache asked with cachestat(2), then mincore(2) */
            test_routes(mode, probe);
            if (probe) {
                run_random(mode, 16, 0, U, rounds, 0);
                run_random(mode, 16, 5000, U, rounds / 2, 1);
            }
        }
        mtc_uring_probe_mincore(0);
        test_errors(mode);
        test_short_direct(mode);
        test_threads(mode);
    }
    if (g_have_uring) test_fork();
    test_spec();
    mtc_uring_shutdown();
    remove_files();
    printf("test_uring: %ld checks passed (seed %llu)\n", (long)atomic_load(&g_checks), g_seed);
    return 0;
}
