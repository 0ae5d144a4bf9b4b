/*
 * driver.c - a portable fuzzing driver for the harnesses (fuzz_<name>.c), for
 * machines without libFuzzer (gcc only). Linked with one harness, it calls
 * its LLVMFuzzerTestOneInput() like libFuzzer does:
 *
 *   fuzz_<name> -regress PATH...      run every input file (directories: every
 *                                     file in them, dot files skipped) once;
 *                                     exit 0 when none crashed
 *   fuzz_<name> [options] PATH...     replay the corpus in PATH..., then fuzz
 *                                     mutations of it for -seconds
 *
 * Options: -seconds=N (default 10; 0: replay only), -runs=N (mutations, default
 * unbounded), -seed=N (default 1: runs are reproducible), -max_len=N (default
 * 4096, at least the largest corpus input), -artifacts=DIR (default "."),
 * -save_corpus=DIR (write inputs that found new coverage), -timeout=S (one
 * input, default 20), -minimize_to=DIR (replay the inputs, smallest first, and
 * copy those that reach new edges to DIR: a small corpus from a large one).
 *
 * Crashes. The fuzzing runs in a child process; before every execution the
 * child copies the input into memory shared with the parent and writes it to
 * DIR/last-input-<name> (so that it survives anything, even a SIGKILL of
 * both). When the child dies (an ASan / UBSan report, an abort() from
 * FZ_CHECK, a signal) or hangs for -timeout seconds, the parent writes the
 * input it was running to DIR/crash-<name>-<n> (timeout-<name>-<n>), n the
 * execution's number, prints how to reproduce, and exits 1.
 *
 * Guidance. When the harness and csrc/engine/ are compiled with gcc's
 * -fsanitize-coverage=trace-pc,trace-cmp (the Makefile does), the callbacks
 * below keep an AFL-style edge map (hashed pc pairs, hit counts bucketed) and
 * a table of recent comparison operands: an input that reaches new edges or
 * buckets joins the corpus, and comparison operands are written into inputs.
 * Without the instrumentation the driver still runs, as a blind mutator.
 *
 * Mutations (1 to 8 stacked per input, fixed seed): bit flips, random and
 * interesting bytes / 16 / 32 / 64-bit little-endian values, small
 * arithmetic, insertion, deletion, copies inside the input, splices with
 * another corpus entry, comparison operands.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef FUZZ_NAME
#define FUZZ_NAME "harness"
#endif

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
__attribute__((weak)) int LLVMFuzzerInitialize(int *argc, char ***argv);

#define NOSAN __attribute__((no_sanitize_address, no_sanitize_undefined, noinline))

/* ------------------------------------------------------------------ coverage */

#define MAP_BITS 16
#define MAP_SIZE (1u << MAP_BITS)

static uint8_t cov_map[MAP_SIZE];      /* hits per edge, this execution */
static uint8_t cov_virgin[MAP_SIZE];   /* buckets ever seen per edge */
static uintptr_t cov_prev;
static int cov_seen_any;               /* the instrumentation called us at least once */
static volatile int cov_on;

NOSAN void __sanitizer_cov_trace_pc(void)
{
    uintptr_t pc = (uintptr_t)__builtin_return_address(0);
    uint32_t cur = (uint32_t)(((uint64_t)pc * 0x9E3779B97F4A7C15ull) >> (64 - MAP_BITS));
    cov_map[(cur ^ cov_prev) & (MAP_SIZE - 1)]++;
    cov_prev = cur >> 1;
}

#define CMP_SIZE 1024
static struct cmp_pair {
    uint64_t a, b;
    uint8_t width;
} cmp_tab[CMP_SIZE];
static uint32_t cmp_count;

NOSAN static void cmp_note(uint64_t a, uint64_t b, uint8_t width)
{
    if (!cov_on || a == b) return;
    uint64_t h = (a * 0x9E3779B97F4A7C15ull) ^ ((b + 0x632BE59BD9B4E019ull) * 0xBF58476D1CE4E5B9ull);
    uint32_t i = (uint32_t)(h >> 40) & (CMP_SIZE - 1);
    if (!cmp_tab[i].width) cmp_count++;
    cmp_tab[i] = (struct cmp_pair){a, b, width};
}

NOSAN void __sanitizer_cov_trace_cmp1(uint8_t a, uint8_t b) { cmp_note(a, b, 1); }
NOSAN void __sanitizer_cov_trace_cmp2(uint16_t a, uint16_t b) { cmp_note(a, b, 2); }
NOSAN void __sanitizer_cov_trace_cmp4(uint32_t a, uint32_t b) { cmp_note(a, b, 4); }
NOSAN void __sanitizer_cov_trace_cmp8(uint64_t a, uint64_t b) { cmp_note(a, b, 8); }
NOSAN void __sanitizer_cov_trace_const_cmp1(uint8_t a, uint8_t b) { cmp_note(a, b, 1); }
NOSAN void __sanitizer_cov_trace_const_cmp2(uint16_t a, uint16_t b) { cmp_note(a, b, 2); }
NOSAN void __sanitizer_cov_trace_const_cmp4(uint32_t a, uint32_t b) { cmp_note(a, b, 4); }
NOSAN void __sanitizer_cov_trace_const_cmp8(uint64_t a, uint64_t b) { cmp_note(a, b, 8); }
NOSAN void __sanitizer_cov_trace_cmpf(float a, float b) { (void)a, (void)b; }
NOSAN void __sanitizer_cov_trace_cmpd(double a, double b) { (void)a, (void)b; }
NOSAN void __sanitizer_cov_trace_switch(uint64_t val, uint64_t *cases)
{
    /* cases[0]: count, cases[1]: bit width, cases[2..]: values */
    for (uint64_t i = 0; i < cases[0] && i < 4; i++) cmp_note(val, cases[2 + i], (uint8_t)(cases[1] / 8));
}

static const uint8_t bucket_of[256] = {
    [0] = 0, [1] = 1, [2] = 2, [3] = 4, [4 ... 7] = 8, [8 ... 15] = 16, [16 ... 31] = 32,
    [32 ... 127] = 64, [128 ... 255] = 128,
};

/* New edges or hit-count buckets in this execution (merged into cov_virgin). */
static int cov_new(void)
{
    int found = 0;
    const uint64_t *w = (const uint64_t *)cov_map;
    for (uint32_t j = 0; j < MAP_SIZE / 8; j++) {
        if (!w[j]) continue;
        cov_seen_any = 1;
        for (uint32_t i = j * 8; i < j * 8 + 8; i++) {
            uint8_t b = bucket_of[cov_map[i]];
            if (b & ~cov_virgin[i]) {
                cov_virgin[i] |= b;
                found = 1;
            }
        }
    }
    return found;
}

/* New edges (hit counts ignored) since the last call: for -minimize_to. */
static uint8_t edge_seen[MAP_SIZE];
static int cov_new_edges(void)
{
    int found = 0;
    for (uint32_t i = 0; i < MAP_SIZE; i++)
        if (cov_map[i] && !edge_seen[i]) {
            edge_seen[i] = 1;
            found = 1;
        }
    return found;
}

static uint64_t cov_features(void)
{
    uint64_t n = 0;
    for (uint32_t i = 0; i < MAP_SIZE; i++) n += (uint64_t)__builtin_popcount(cov_virgin[i]);
    return n;
}

/* ------------------------------------------------------------------ state */

static struct {
    double seconds;
    uint64_t runs, seed;
    size_t max_len;
    const char *artifacts, *save_corpus, *minimize_to;
    double timeout;
    int regress;
} opt = {10.0, UINT64_MAX, 1, 4096, ".", NULL, NULL, 20.0, 0};

/* shared with the supervising parent */
typedef struct shared {
    volatile uint64_t execs;  /* number of the execution running now */
    volatile int phase;       /* 0 starting, 1 replay, 2 fuzzing, 3 done */
    volatile uint64_t len;
    uint8_t buf[];
} shared;
static shared *shm;
static size_t shm_cap;

typedef struct input {
    uint8_t *data;
    size_t len;
} input;

static input *corpus;
static size_t ncorpus, cap_corpus;
static int last_fd = -1;

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static uint64_t rng_state;
static uint64_t rnd(void) /* splitmix64 */
{
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static uint64_t rnd_below(uint64_t n) { return n ? rnd() % n : 0; }

static void die(const char *what)
{
    perror(what);
    exit(2);
}

static int read_file(const char *path, input *in)
{
    FILE *fp = fopen(path, "rb");
    if (!fp) return -1;
    fseek(fp, 0, SEEK_END);
    long n = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    in->len = n > 0 ? (size_t)n : 0;
    in->data = malloc(in->len ? in->len : 1);
    if (!in->data || fread(in->data, 1, in->len, fp) != in->len) {
        fclose(fp);
        return -1;
    }
    fclose(fp);
    return 0;
}

static int write_file(const char *path, const uint8_t *data, size_t len)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return -1;
    size_t done = 0;
    while (done < len) {
        ssize_t w = write(fd, data + done, len - done);
        if (w <= 0) {
            close(fd);
            return -1;
        }
        done += (size_t)w;
    }
    return close(fd);
}

static int path_cmp(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* Files named by the paths (directories: their regular files, sorted, no dot files). */
static char **collect(char **paths, int npaths, size_t *count)
{
    size_t n = 0, cap = 16;
    char **out = malloc(cap * sizeof *out);
    if (!out) die("malloc");
    for (int i = 0; i < npaths; i++) {
        struct stat sb;
        if (stat(paths[i], &sb)) {
            fprintf(stderr, "fuzz_%s: %s: %s\n", FUZZ_NAME, paths[i], strerror(errno));
            exit(2);
        }
        size_t first = n;
        if (S_ISDIR(sb.st_mode)) {
            DIR *d = opendir(paths[i]);
            if (!d) die(paths[i]);
            struct dirent *e;
            while ((e = readdir(d))) {
                if (e->d_name[0] == '.') continue;
                char *p;
                if (asprintf(&p, "%s/%s", paths[i], e->d_name) < 0) die("asprintf");
                if (stat(p, &sb) || !S_ISREG(sb.st_mode)) {
                    free(p);
                    continue;
                }
                if (n == cap && !(out = realloc(out, (cap *= 2) * sizeof *out))) die("realloc");
                out[n++] = p;
            }
            closedir(d);
            qsort(out + first, n - first, sizeof *out, path_cmp);
        } else {
            if (n == cap && !(out = realloc(out, (cap *= 2) * sizeof *out))) die("realloc");
            out[n++] = strdup(paths[i]);
        }
    }
    *count = n;
    return out;
}

/* ------------------------------------------------------------------ execution */

static uint64_t execs;

/* Runs the harness on one input; returns 1 when it found new coverage. */
static int execute(const uint8_t *data, size_t len)
{
    execs++;
    if (shm) {
        shm->len = len;
        memcpy(shm->buf, data, len);
        __atomic_store_n(&shm->execs, execs, __ATOMIC_RELEASE);
    }
    if (last_fd >= 0) {
        if (pwrite(last_fd, data, len, 0) != (ssize_t)len || ftruncate(last_fd, (off_t)len)) die("last-input");
    }
    /* an exact-size heap copy: ASan reports reads past the input's end */
    uint8_t *copy = malloc(len ? len : 1);
    if (!copy) die("malloc");
    memcpy(copy, data, len);
    memset(cov_map, 0, sizeof cov_map);
    cov_prev = 0;
    cov_on = 1;
    LLVMFuzzerTestOneInput(copy, len);
    cov_on = 0;
    free(copy);
    return cov_new();
}

static void corpus_add(const uint8_t *data, size_t len)
{
    if (ncorpus == cap_corpus) {
        cap_corpus = cap_corpus ? 2 * cap_corpus : 64;
        if (!(corpus = realloc(corpus, cap_corpus * sizeof *corpus))) die("realloc");
    }
    uint8_t *d = malloc(len ? len : 1);
    if (!d) die("malloc");
    memcpy(d, data, len);
    corpus[ncorpus++] = (input){d, len};
}

/* ------------------------------------------------------------------ mutations */

static const int64_t interesting[] = {
    0, 1, -1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 63, 64, 127, 128, 255, 256, 4095, 4096, 4097, 65535, 65536,
    0x7fff, -0x8000, 0x7fffffff, -0x7fffffff - 1, 0xffffffff, 0x100000000ll, 0x7fffffffffffffffll,
    (int64_t)0x8000000000000000ull, 0x4000000000000000ll, 0x1fffffffffffffffll, 1ll << 40, 1ll << 22,
};

static void put_le(uint8_t *p, uint64_t v, int w)
{
    for (int i = 0; i < w; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t get_le(const uint8_t *p, int w)
{
    uint64_t v = 0;
    for (int i = 0; i < w; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

static int rnd_width(void)
{
    static const int w[] = {1, 2, 4, 8};
    return w[rnd_below(4)];
}

/* One mutation of buf[0..*len) (capacity max). */
static void mutate_once(uint8_t *buf, size_t *len, size_t max)
{
    size_t n = *len;
    switch (rnd_below(13)) {
    case 0: /* bit flip */
        if (n) buf[rnd_below(n)] ^= (uint8_t)(1u << rnd_below(8));
        break;
    case 1: /* random byte */
        if (n) buf[rnd_below(n)] = (uint8_t)rnd();
        break;
    case 2: /* interesting byte */
        if (n) buf[rnd_below(n)] = (uint8_t)interesting[rnd_below(sizeof interesting / sizeof *interesting)];
        break;
    case 3: case 4: { /* interesting 1/2/4/8-byte value */
        int w = rnd_width();
        if (n < (size_t)w) break;
        uint64_t v = (uint64_t)interesting[rnd_below(sizeof interesting / sizeof *interesting)];
        put_le(buf + rnd_below(n - (size_t)w + 1), v, w);
        break;
    }
    case 5: { /* small arithmetic on a 1/2/4/8-byte value */
        int w = rnd_width();
        if (n < (size_t)w) break;
        size_t at = rnd_below(n - (size_t)w + 1);
        int64_t d = (int64_t)rnd_below(35) - 17;
        put_le(buf + at, get_le(buf + at, w) + (uint64_t)d, w);
        break;
    }
    case 6: { /* insert random bytes (or a repeated byte) */
        size_t k = 1 + rnd_below(16);
        if (n + k > max) break;
        size_t at = rnd_below(n + 1);
        memmove(buf + at + k, buf + at, n - at);
        uint8_t rep = (uint8_t)rnd();
        int same = rnd_below(2);
        for (size_t i = 0; i < k; i++) buf[at + i] = same ? rep : (uint8_t)rnd();
        *len = n + k;
        break;
    }
    case 7: { /* delete a range */
        if (!n) break;
        size_t k = 1 + rnd_below(rnd_below(2) ? 16 : n);
        if (k > n) k = n;
        size_t at = rnd_below(n - k + 1);
        memmove(buf + at, buf + at + k, n - at - k);
        *len = n - k;
        break;
    }
    case 8: { /* copy a chunk inside the input (overwrite or insert) */
        if (n < 2) break;
        size_t k = 1 + rnd_below(n / 2);
        size_t from = rnd_below(n - k + 1);
        if (rnd_below(2) && n + k <= max) {
            size_t at = rnd_below(n + 1);
            uint8_t *tmp = malloc(k);
            if (!tmp) die("malloc");
            memcpy(tmp, buf + from, k);
            memmove(buf + at + k, buf + at, n - at);
            memcpy(buf + at, tmp, k);
            free(tmp);
            *len = n + k;
        } else {
            memmove(buf + rnd_below(n - k + 1), buf + from, k);
        }
        break;
    }
    case 9: { /* splice with another corpus entry */
        const input *o = &corpus[rnd_below(ncorpus)];
        if (!o->len) break;
        if (rnd_below(2)) { /* our prefix, its suffix */
            size_t cut = rnd_below(n + 1), from = rnd_below(o->len);
            size_t k = o->len - from;
            if (cut + k > max) k = max - cut;
            memcpy(buf + cut, o->data + from, k);
            *len = cut + k;
        } else { /* insert a chunk of it */
            size_t k = 1 + rnd_below(o->len < 64 ? o->len : 64);
            size_t from = rnd_below(o->len - k + 1), at = rnd_below(n + 1);
            if (n + k > max) break;
            memmove(buf + at + k, buf + at, n - at);
            memcpy(buf + at, o->data + from, k);
            *len = n + k;
        }
        break;
    }
    default: { /* a comparison operand: replace the other operand where it occurs, or write it anywhere */
        if (!cmp_count) break;
        const struct cmp_pair *c = NULL;
        for (int tries = 0; tries < 8 && !c; tries++) {
            const struct cmp_pair *t = &cmp_tab[rnd_below(CMP_SIZE)];
            if (t->width) c = t;
        }
        if (!c) break;
        int w = c->width;
        if (n < (size_t)w) break;
        uint64_t mask = w == 8 ? ~0ull : ((1ull << (8 * w)) - 1);
        uint64_t from = c->a & mask, to = c->b & mask;
        if (rnd_below(2)) {
            uint64_t t = from;
            from = to;
            to = t;
        }
        to += (uint64_t)((int64_t)rnd_below(3) - 1); /* off by one, too */
        size_t start = rnd_below(n), at = SIZE_MAX;
        for (size_t i = 0; i + (size_t)w <= n; i++) {
            size_t j = (start + i) % (n - (size_t)w + 1);
            if (get_le(buf + j, w) == from) {
                at = j;
                break;
            }
        }
        if (at == SIZE_MAX) at = rnd_below(n - (size_t)w + 1);
        put_le(buf + at, to, w);
        break;
    }
    }
}

/* ------------------------------------------------------------------ modes */

static int size_cmp(const void *a, const void *b)
{
    struct stat x, y;
    const char *p = *(char *const *)a, *q = *(char *const *)b;
    off_t sx = stat(p, &x) ? 0 : x.st_size, sy = stat(q, &y) ? 0 : y.st_size;
    return sx < sy ? -1 : sx > sy ? 1 : strcmp(p, q);
}

/* -minimize_to=DIR: replay the inputs, smallest first, and copy to DIR those that reach new edges */
static int run_minimize(char **files, size_t nfiles)
{
    qsort(files, nfiles, sizeof *files, size_cmp);
    size_t kept = 0;
    for (size_t i = 0; i < nfiles; i++) {
        input in;
        if (read_file(files[i], &in)) die(files[i]);
        execute(in.data, in.len);
        if (cov_new_edges()) {
            const char *base = strrchr(files[i], '/');
            char *p;
            if (asprintf(&p, "%s/%s", opt.minimize_to, base ? base + 1 : files[i]) < 0) die("asprintf");
            if (write_file(p, in.data, in.len)) die(p);
            free(p);
            kept++;
        }
        free(in.data);
    }
    fprintf(stderr, "fuzz_%s: kept %zu of %zu inputs (coverage %llu features) in %s\n", FUZZ_NAME, kept, nfiles,
            (unsigned long long)cov_features(), opt.minimize_to);
    return 0;
}

static int run_regress(char **files, size_t nfiles)
{
    for (size_t i = 0; i < nfiles; i++) {
        input in;
        if (read_file(files[i], &in)) die(files[i]);
        fprintf(stderr, "fuzz_%s: running %s (%zu bytes)\n", FUZZ_NAME, files[i], in.len);
        execute(in.data, in.len);
        free(in.data);
    }
    fprintf(stderr, "fuzz_%s: %zu inputs passed\n", FUZZ_NAME, nfiles);
    return 0;
}

static void status(const char *what, double t0)
{
    double dt = now_s() - t0;
    fprintf(stderr, "#%llu\t%s cov: %llu corp: %zu cmp: %u exec/s: %.0f time: %.0fs\n",
            (unsigned long long)execs, what, (unsigned long long)cov_features(), ncorpus, cmp_count,
            dt > 0 ? (double)execs / dt : 0.0, dt);
}

/* the child: replay, then mutate until the time or run budget is spent */
static int run_fuzz(char **files, size_t nfiles)
{
    char *last;
    if (asprintf(&last, "%s/last-input-%s", opt.artifacts, FUZZ_NAME) < 0) die("asprintf");
    last_fd = open(last, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (last_fd < 0) die(last);
    double t0 = now_s();
    shm->phase = 1;
    for (size_t i = 0; i < nfiles; i++) {
        input in;
        if (read_file(files[i], &in)) die(files[i]);
        if (in.len > opt.max_len) opt.max_len = in.len;
        execute(in.data, in.len);
        corpus_add(in.data, in.len);
        free(in.data);
    }
    if (!ncorpus) { /* no seeds: start from an empty input and a few random ones */
        uint8_t r[64];
        corpus_add(r, 0);
        for (int k = 0; k < 8; k++) {
            for (size_t i = 0; i < sizeof r; i++) r[i] = (uint8_t)rnd();
            execute(r, sizeof r);
            corpus_add(r, sizeof r);
        }
    }
    size_t seeds = ncorpus;
    status("INITED", t0);
    if (!cov_seen_any)
        fprintf(stderr, "fuzz_%s: no coverage instrumentation (build with -fsanitize-coverage=trace-pc,trace-cmp); "
                        "mutating blindly\n", FUZZ_NAME);
    shm->phase = 2;
    uint8_t *buf = malloc(opt.max_len ? opt.max_len : 1);
    if (!buf) die("malloc");
    double end = t0 + opt.seconds, next_status = now_s() + 5;
    uint64_t mutations = 0;
    while (mutations < opt.runs) {
        if ((mutations & 63) == 0) {
            double t = now_s();
            if (t >= end) break;
            if (t >= next_status) {
                status("PULSE", t0);
                next_status = t + 10;
            }
        }
        /* newer entries (found by fuzzing) are picked a little more often */
        size_t pick = rnd_below(4) == 0 && ncorpus > seeds ? seeds + rnd_below(ncorpus - seeds) : rnd_below(ncorpus);
        size_t len = corpus[pick].len > opt.max_len ? opt.max_len : corpus[pick].len;
        memcpy(buf, corpus[pick].data, len);
        int k = 1 + (int)rnd_below(rnd_below(2) ? 2 : 8);
        for (int i = 0; i < k; i++) mutate_once(buf, &len, opt.max_len);
        mutations++;
        if (execute(buf, len)) {
            corpus_add(buf, len);
            if (opt.save_corpus) {
                char *p;
                if (asprintf(&p, "%s/%s-%016llx", opt.save_corpus, FUZZ_NAME, (unsigned long long)rnd()) < 0)
                    die("asprintf");
                if (write_file(p, buf, len)) perror(p);
                free(p);
            }
        }
    }
    double dt = now_s() - t0;
    fprintf(stderr,
            "fuzz_%s: done: %llu executions (%zu corpus replays, %llu mutations) in %.1f s, %.0f exec/s; "
            "corpus %zu (%zu new), coverage %llu features\n",
            FUZZ_NAME, (unsigned long long)execs, nfiles, (unsigned long long)mutations, dt,
            dt > 0 ? (double)execs / dt : 0.0, ncorpus, ncorpus - seeds, (unsigned long long)cov_features());
    shm->phase = 3;
    free(buf);
    close(last_fd);
    unlink(last); /* nothing crashed: the last input is not interesting */
    free(last);
    return 0;
}

/* the parent: runs the child, saves the input that killed or hung it */
static int supervise(char **files, size_t nfiles)
{
    size_t max_in = opt.max_len;
    for (size_t i = 0; i < nfiles; i++) {
        struct stat sb;
        if (!stat(files[i], &sb) && (size_t)sb.st_size > max_in) max_in = (size_t)sb.st_size;
    }
    opt.max_len = max_in;
    shm_cap = sizeof(shared) + max_in;
    shm = mmap(NULL, shm_cap, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (shm == MAP_FAILED) die("mmap");
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0) die("fork");
    if (pid == 0) {
        struct rlimit no_core = {0, 0};
        setrlimit(RLIMIT_CORE, &no_core);
        /* back to main, which frees everything and returns: LeakSanitizer then
         * checks the child at exit */
        return run_fuzz(files, nfiles);
    }
    uint64_t seen = UINT64_MAX;
    double since = now_s();
    int st = 0, hung = 0;
    for (;;) {
        pid_t w = waitpid(pid, &st, WNOHANG);
        if (w == pid) break;
        if (w < 0 && errno != EINTR) die("waitpid");
        uint64_t e = __atomic_load_n(&shm->execs, __ATOMIC_ACQUIRE);
        if (e != seen || shm->phase == 3) {
            seen = e;
            since = now_s();
        } else if (now_s() - since > opt.timeout) {
            hung = 1;
            kill(pid, SIGKILL);
            waitpid(pid, &st, 0);
            break;
        }
        usleep(20000);
    }
    if (!hung && WIFEXITED(st) && WEXITSTATUS(st) == 0) return 0;
    if (!hung && shm->phase == 3) {
        fprintf(stderr, "fuzz_%s: the fuzzing child failed at exit (status %d): a leak report above? "
                        "No single input to blame; rerun the corpus with -regress.\n", FUZZ_NAME, st);
        return 1;
    }
    char *p;
    if (asprintf(&p, "%s/%s-%s-%llu", opt.artifacts, hung ? "timeout" : "crash", FUZZ_NAME,
                 (unsigned long long)shm->execs) < 0) die("asprintf");
    size_t len = shm->len <= max_in ? (size_t)shm->len : max_in;
    if (write_file(p, shm->buf, len)) die(p);
    if (hung)
        fprintf(stderr, "\nfuzz_%s: execution %llu hung for %.0f s\n", FUZZ_NAME, (unsigned long long)shm->execs,
                opt.timeout);
    else if (WIFSIGNALED(st))
        fprintf(stderr, "\nfuzz_%s: execution %llu killed by signal %d\n", FUZZ_NAME, (unsigned long long)shm->execs,
                WTERMSIG(st));
    else
        fprintf(stderr, "\nfuzz_%s: execution %llu failed (exit status %d)\n", FUZZ_NAME,
                (unsigned long long)shm->execs,
                WEXITSTATUS(st));
    fprintf(stderr, "fuzz_%s: input (%zu bytes) written to %s\n  reproduce: fuzz_%s -regress %s\n", FUZZ_NAME, len, p,
            FUZZ_NAME, p);
    free(p);
    return 1;
}

static int parse_num(const char *arg, const char *name, double *out)
{
    size_t n = strlen(name);
    if (strncmp(arg, name, n) || arg[n] != '=') return 0;
    char *end;
    *out = strtod(arg + n + 1, &end);
    if (*end || end == arg + n + 1) {
        fprintf(stderr, "fuzz_%s: bad value in %s\n", FUZZ_NAME, arg);
        exit(2);
    }
    return 1;
}

int main(int argc, char **argv)
{
    if (LLVMFuzzerInitialize) LLVMFuzzerInitialize(&argc, &argv);
    char **paths = malloc((size_t)argc * sizeof *paths);
    int npaths = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        double v;
        if (!strcmp(a, "-regress")) opt.regress = 1;
        else if (parse_num(a, "-seconds", &v)) opt.seconds = v;
        else if (parse_num(a, "-runs", &v)) opt.runs = (uint64_t)v;
        else if (parse_num(a, "-seed", &v)) opt.seed = (uint64_t)v;
        else if (parse_num(a, "-max_len", &v)) opt.max_len = (size_t)v;
        else if (parse_num(a, "-timeout", &v)) opt.timeout = v;
        else if (!strncmp(a, "-artifacts=", 11)) opt.artifacts = a + 11;
        else if (!strncmp(a, "-save_corpus=", 13)) opt.save_corpus = a + 13;
        else if (!strncmp(a, "-minimize_to=", 13)) opt.minimize_to = a + 13;
        else if (a[0] == '-') {
            fprintf(stderr, "usage: fuzz_%s [-regress] [-seconds=N] [-runs=N] [-seed=N] [-max_len=N] "
                            "[-timeout=S] [-artifacts=DIR] [-save_corpus=DIR] [-minimize_to=DIR] FILE_OR_DIR...\n",
                    FUZZ_NAME);
            return 2;
        } else paths[npaths++] = argv[i];
    }
    rng_state = opt.seed;
    size_t nfiles;
    char **files = collect(paths, npaths, &nfiles);
    int rc = opt.regress       ? run_regress(files, nfiles)
             : opt.minimize_to ? run_minimize(files, nfiles)
                               : supervise(files, nfiles);
    for (size_t i = 0; i < nfiles; i++) free(files[i]);
    free(files);
    free(paths);
    for (size_t i = 0; i < ncorpus; i++) free(corpus[i].data);
    free(corpus);
    return rc;
}
