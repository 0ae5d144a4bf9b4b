/*
 * fuzz.h - helpers shared by the fuzz harnesses (fuzz_<name>.c).
 *
 * Every harness defines LLVMFuzzerTestOneInput(data, size), the libFuzzer
 * entry point: it builds with clang -fsanitize=fuzzer (Makefile target
 * `libfuzzer`) or with gcc and the portable driver (driver.c). A harness
 * turns its input into structured values with the fz_* readers (an input
 * that runs out reads as zeros, so every input is meaningful) and reports a
 * broken invariant with FZ_CHECK, which prints and abort()s: the driver (or
 * libFuzzer) then saves the input that did it.
 */
#ifndef MTC_FUZZ_H
#define MTC_FUZZ_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "plan.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define FZ_CHECK(cond, ...)                                                             \
    do {                                                                                \
        if (!(cond)) {                                                                  \
            fprintf(stderr, "\n%s:%d: fuzz invariant failed: %s\n  ", __FILE__, __LINE__, \
                    #cond);                                                             \
            fprintf(stderr, " " __VA_ARGS__);                                           \
            fprintf(stderr, "\n");                                                      \
            abort();                                                                    \
        }                                                                               \
    } while (0)

/* ---------------------------------------------------------------- input reader */

typedef struct fz {
    const uint8_t *p, *end;
} fz;

static inline size_t fz_left(const fz *f) { return (size_t)(f->end - f->p); }

/* n little-endian bytes (n <= 8); missing bytes read as 0 */
static inline uint64_t fz_bytes(fz *f, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n && f->p < f->end; i++) v |= (uint64_t)*f->p++ << (8 * i);
    return v;
}

static inline uint8_t fz_u8(fz *f) { return (uint8_t)fz_bytes(f, 1); }
static inline uint16_t fz_u16(fz *f) { return (uint16_t)fz_bytes(f, 2); }
static inline uint32_t fz_u32(fz *f) { return (uint32_t)fz_bytes(f, 4); }
static inline uint64_t fz_u64(fz *f) { return fz_bytes(f, 8); }

/* a value in [0, n), n >= 1, from as few bytes as n needs */
static inline uint64_t fz_below(fz *f, uint64_t n)
{
    if (n <= 1) return 0;
    int bytes = n <= 0x100 ? 1 : n <= 0x10000 ? 2 : n <= 0x100000000ull ? 4 : 8;
    return fz_bytes(f, bytes) % n;
}

/* ---------------------------------------------------------------- byte spans */

/* [start, end) of a leaf's bytes: sorted by start to find overlaps */
typedef struct span {
    int64_t start, end;
    uint32_t leaf;
} span;

static inline int span_cmp(const void *a, const void *b)
{
    const span *x = a, *y = b;
    return x->start < y->start ? -1 : x->start > y->start;
}

/* ---------------------------------------------------------------- dtypes */

/* Element sizes of the engine's dtype codes: mtc_loader._setup.DTYPES (torch 2.13, sorted by
 * name): bfloat16 bits16 bits1x8 bits2x4 bits4x2 bits8 bool complex128 complex32 complex64
 * float16 float32 float4_e2m1fn_x2 float64 float8_e4m3fn float8_e4m3fnuz float8_e5m2
 * float8_e5m2fnuz float8_e8m0fnu int16 int32 int64 int8 uint16 uint32 uint64 uint8. */
#define FZ_NDTYPES 27
static const int fz_elsize[FZ_NDTYPES] = {2, 2, 1, 1, 1, 1, 1, 16, 4, 8, 2, 4, 1, 8,
                                          1, 1, 1, 1, 1, 2, 4, 8, 1, 2, 4, 8, 1};

/* ---------------------------------------------------------------- arithmetic */

static inline int64_t fz_gcd(int64_t a, int64_t b)
{
    while (b) {
        int64_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

/* lcm of two positive values, or 0 when it does not fit int64 */
static inline int64_t fz_lcm(int64_t a, int64_t b)
{
    int64_t r;
    if (__builtin_mul_overflow(a / fz_gcd(a, b), b, &r)) return 0;
    return r;
}

/* The alignment of a packed leaf, the reference implementation's rule:
 * round_up(max(min, elsize), elsize); 0 past 2^40, as the planner refuses it. */
static inline int64_t fz_ref_align(int64_t min, int64_t elsize)
{
    int64_t a = min > elsize ? min : elsize;
    if (a > ((int64_t)1 << 40)) return 0;
    return (a + elsize - 1) / elsize * elsize;
}

/* ---------------------------------------------------------------- leaves */

/*
 * A shape torch can create for a contiguous tensor of element size `elsize`:
 * the element strides (products of max(dim, 1) over the trailing dims) and
 * numel * elsize fit int64 and, when max_nbytes > 0, numel * elsize <=
 * max_nbytes. Zero-size shapes may have huge other dims (torch allows
 * torch.empty(0, 2**60, 4)). Returns nbytes.
 */
static inline int64_t fz_gen_shape(fz *f, int ndim, int elsize, int64_t max_nbytes, int64_t *dims)
{
    for (int d = 0; d < ndim; d++) {
        uint8_t k = fz_u8(f);
        switch (k >> 5) {
        case 0: case 1: case 2: case 3: dims[d] = k & 7; break;
        case 4: dims[d] = k & 31; break;
        case 5: dims[d] = fz_u16(f); break;
        case 6: dims[d] = 0; break;
        default: dims[d] = (k & 1) ? (int64_t)1 << (fz_u8(f) % 63) : (int64_t)(fz_u64(f) >> 1); break;
        }
    }
    for (int attempt = 0;; attempt++) {
        int ok = 1;
        int64_t st = 1, numel = 1, nbytes = 0;
        for (int d = ndim - 1; d >= 1 && ok; d--)
            if (__builtin_mul_overflow(st, dims[d] > 1 ? dims[d] : 1, &st)) ok = 0;
        for (int d = 0; d < ndim && ok; d++)
            if (__builtin_mul_overflow(numel, dims[d], &numel)) ok = 0;
        if (ok && (__builtin_mul_overflow(numel, (int64_t)elsize, &nbytes) ||
                   (max_nbytes > 0 && nbytes > max_nbytes)))
            ok = 0;
        if (ok) return nbytes;
        /* not a tensor torch would make: shrink (attempt 0 keeps zeros, so that
         * zero-size shapes with huge dims survive when they are legal) */
        for (int d = 0; d < ndim; d++) dims[d] %= attempt == 0 ? 65536 : attempt == 1 ? 4 : 2;
    }
}

/* Outcome counters: FUZZ_STATS=1 in the environment prints them at exit (how often did
 * inputs decode, attach, allocate...: is the fuzzer getting anywhere?). */
#define FZ_NSTATS 16
static const char *fz_stat_names[FZ_NSTATS];
static unsigned long long fz_stat_counts[FZ_NSTATS];

static inline void fz_stat(int i, const char *name)
{
    fz_stat_names[i] = name;
    fz_stat_counts[i]++;
}

__attribute__((destructor, used)) static void fz_stat_print(void)
{
    if (!getenv("FUZZ_STATS")) return;
    for (int i = 0; i < FZ_NSTATS; i++)
        if (fz_stat_names[i]) fprintf(stderr, "  stat %-28s %llu\n", fz_stat_names[i], fz_stat_counts[i]);
}

/* FUZZ_VERBOSE=1 in the environment: print the generated leaves (reproducing a crash) */
static inline void fz_dump_leaves(const char *what, const mtc_leaf *leaves, uint32_t n, const int64_t *shape,
                                  const mtc_plan_opts *o)
{
    static int verbose = -1;
    if (verbose < 0) verbose = getenv("FUZZ_VERBOSE") && *getenv("FUZZ_VERBOSE") != '0';
    if (!verbose) return;
    fprintf(stderr,
            "%s: target %d pack %d staging %d align %lld max_chunk %lld pack_limit %lld max_pad %lld, %u leaves\n",
            what, o->target, o->pack, o->staging, (long long)o->align, (long long)o->max_chunk,
            (long long)o->pack_limit, (long long)o->max_pad, n);
    for (uint32_t i = 0; i < n; i++) {
        const mtc_leaf *l = &leaves[i];
        fprintf(stderr, "  [%u] dev %d dtype %u elsize %u flags %#x nbytes %lld shape (", i, l->dev, l->dtype,
                l->elsize,
                l->flags, (long long)l->nbytes);
        for (int32_t d = 0; d < l->ndim; d++) fprintf(stderr, "%s%lld", d ? ", " : "", (long long)shape[l->dims + d]);
        fprintf(stderr, ")\n");
    }
}

#endif /* MTC_FUZZ_H */
