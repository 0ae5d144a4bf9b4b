/* Unit tests of csrc/engine/hostcopy.c: the helper pool (batches on the submitter's
 * stack, several submitters at once), completion flags, strided copies. */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hostcopy.h"

#include "check.h"

typedef struct { _Atomic uint32_t *hits; uint32_t n; } count_ctx;

static void count_task(void *arg, uint32_t i)
{
    count_ctx *c = arg;
    CHECK(i < c->n);
    atomic_fetch_add(&c->hits[i], 1);
}

/* Many short batches on the stack: a helper that touched a batch after its
 * owner returned would scribble on a later frame (ASan: stack-use-after-return). */
static void *submitter(void *arg)
{
    unsigned seed = (unsigned)(uintptr_t)arg;
    for (int round = 0; round < 3000; round++) {
        uint32_t n = 1 + (uint32_t)(rand_r(&seed) % 40);
        _Atomic uint32_t hits[40];
        for (uint32_t i = 0; i < n; i++) atomic_init(&hits[i], 0);
        count_ctx c = {hits, n};
        mtc_parallel_for(count_task, &c, n);
        for (uint32_t i = 0; i < n; i++) CHECK(atomic_load(&hits[i]) == 1);
    }
    return NULL;
}

typedef struct { mtc_flag *flags; int *data; } flag_ctx;

static void flag_task(void *arg, uint32_t i)
{
    flag_ctx *c = arg;
    c->data[i] = (int)i * 3; /* published by the flag's release */
    mtc_flag_set(&c->flags[i]);
}

static void test_flags_in_order(void)
{
    enum { N = 64 };
    for (int round = 0; round < 200; round++) {
        mtc_flag flags[N];
        int data[N];
        for (int i = 0; i < N; i++) mtc_flag_init(&flags[i]);
        flag_ctx c = {flags, data};
        mtc_batch b;
        mtc_batch_submit(&b, flag_task, &c, N);
        for (int i = 0; i < N; i++) {
            CHECK(mtc_flag_wait(&flags[i], -1) == 0);
            CHECK(data[i] == i * 3);
        }
        mtc_batch_wait(&b);
    }
}

static void test_strided(void)
{
    /* a (5, 6, 7) int32 array viewed with strides permuted and a step */
    int32_t src[2 * 5 * 6 * 7];
    for (int i = 0; i < 2 * 5 * 6 * 7; i++) src[i] = i;
    int64_t shape[3] = {5, 6, 4};
    int64_t strides[3] = {6 * 7 * 4, 7 * 4, 2 * 4}; /* last dim: every other element */
    int32_t dst[5 * 6 * 4], ref[5 * 6 * 4];
    int k = 0;
    for (int a = 0; a < 5; a++)
        for (int b = 0; b < 6; b++)
            for (int c = 0; c < 4; c++) ref[k++] = src[a * 42 + b * 7 + c * 2];
    mtc_copy_strided(dst, src, 3, shape, strides, 4);
    CHECK(memcmp(dst, ref, sizeof ref) == 0);
    /* any element range of it, as the piecewise copy uses */
    for (int64_t begin = 0; begin < 120; begin += 7)
        for (int64_t end = begin; end <= 120; end += 13) {
            memset(dst, 0, sizeof dst);
            mtc_copy_strided_range(dst, src, 3, shape, strides, 4, begin * 4, end * 4);
            CHECK(memcmp(dst, ref + begin, (size_t)(end - begin) * 4) == 0);
        }
    /* contiguous inner run + zero-size dim */
    int64_t shape0[2] = {3, 0}, strides0[2] = {4, 4};
    mtc_copy_strided(dst, src, 2, shape0, strides0, 4);
    /* broadcast (stride 0) */
    int64_t shapeb[2] = {4, 3}, stridesb[2] = {0, 4};
    mtc_copy_strided(dst, src, 2, shapeb, stridesb, 4);
    for (int i = 0; i < 12; i++) CHECK(dst[i] == i % 3);
}

/* A gather into a destination dense in another order (mtc_copy_strided_to):
 * every element lands at its destination strides, the destination is filled
 * exactly, size-1 dims (any stride on either side) are ignored. */
static void test_strided_to(void)
{
    /* source: a (4, 1, 3, 5) int32 view with a step on its last dim and
     * garbage on its size-1 dim, of a (4, 3, 10) array */
    int32_t src[4 * 3 * 10];
    for (int i = 0; i < 4 * 3 * 10; i++) src[i] = i;
    int64_t shape[4] = {4, 1, 3, 5};
    int64_t sstr[4] = {30 * 4, -77, 10 * 4, 2 * 4};
    /* destination strides (elements): dims ordered (1, 3, 0) outermost to
     * innermost, i.e. dim 0 innermost, dim 2 outermost; size-1 dim: 1000 */
    int64_t dstr[4] = {1, 1000, 5 * 4, 4};
    int32_t dst[60 + 4], ref[60];
    memset(dst, 0xab, sizeof dst);
    for (int a = 0; a < 4; a++)
        for (int c = 0; c < 3; c++)
            for (int e = 0; e < 5; e++) ref[a * dstr[0] + c * dstr[2] + e * dstr[3]] = src[a * 30 + c * 10 + e * 2];
    mtc_copy_strided_to(dst, dstr, src, 4, shape, sstr, 4);
    CHECK(memcmp(dst, ref, sizeof ref) == 0);
    for (int i = 60; i < 64; i++) CHECK_EQ((uint32_t)dst[i], 0xababababu); /* nothing past the end */
    /* NULL destination strides: row-major, as mtc_copy_strided */
    int32_t rm[60], rm_ref[60];
    mtc_copy_strided(rm_ref, src, 4, shape, sstr, 4);
    mtc_copy_strided_to(rm, NULL, src, 4, shape, sstr, 4);
    CHECK(memcmp(rm, rm_ref, sizeof rm) == 0);
    /* a zero-size dim copies nothing */
    int64_t shape0[2] = {3, 0}, s0[2] = {4, 4}, d0[2] = {1, 3};
    memset(dst, 0xab, sizeof dst);
    mtc_copy_strided_to(dst, d0, src, 2, shape0, s0, 4);
    CHECK_EQ((uint32_t)dst[0], 0xababababu);
    /* an expanded source (stride 0) into a transposed destination */
    int64_t shapeb[2] = {4, 3}, sb[2] = {0, 4}, db[2] = {1, 4};
    mtc_copy_strided_to(dst, db, src, 2, shapeb, sb, 4);
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 3; j++) CHECK_EQ(dst[i + 4 * j], j);
}

/* Any ndim (torch allows more than 64): size-1 dims address nothing and are
 * dropped, so a copy of fewer than 2^63 bytes has at most 62 dims left. Here
 * 100 dims, 6 of them of size 2 with permuted strides, the others of size 1
 * with garbage strides (huge, negative). */
static void test_strided_many_dims(void)
{
    enum { ND = 100 };
    int16_t src[64], dst[64], ref[64];
    for (int i = 0; i < 64; i++) src[i] = (int16_t)(i * 3 + 1);
    int64_t shape[ND], strides[ND];
    int big[6] = {3, 17, 40, 41, 77, 99}; /* the dims of size 2 */
    int64_t perm[6] = {4, 32, 1, 16, 8, 2}; /* their element strides: a permutation */
    for (int d = 0; d < ND; d++) {
        shape[d] = 1;
        strides[d] = (d % 3 ? INT64_MAX / 2 : -123456) * 2;
    }
    for (int k = 0; k < 6; k++) {
        shape[big[k]] = 2;
        strides[big[k]] = perm[k] * 2;
    }
    /* the reference: row-major over the 6 dims of size 2 */
    for (int i = 0; i < 64; i++) {
        int64_t off = 0;
        for (int k = 0; k < 6; k++) off += ((i >> (5 - k)) & 1) * perm[k];
        ref[i] = src[off];
    }
    memset(dst, 0, sizeof dst);
    mtc_copy_strided(dst, src, ND, shape, strides, 2);
    CHECK(memcmp(dst, ref, sizeof ref) == 0);
    for (int64_t begin = 0; begin < 64; begin += 5)
        for (int64_t end = begin; end <= 64; end += 9) {
            memset(dst, 0, sizeof dst);
            mtc_copy_strided_range(dst, src, ND, shape, strides, 2, begin * 2, end * 2);
            CHECK(memcmp(dst, ref + begin, (size_t)(end - begin) * 2) == 0);
        }
}

static void test_memcpy_parallel(void)
{
    size_t n = 3 * MTC_PIECE_BYTES + 12345;
    unsigned char *a = malloc(n), *b = malloc(n);
    CHECK(a && b);
    for (size_t i = 0; i < n; i++) a[i] = (unsigned char)(i * 7 + 3);
    /* below and above the helpers' split (2 pieces), misaligned on both sides */
    size_t lens[] = {0, 300, MTC_PIECE_BYTES + 5, n - 3};
    for (int nt = 0; nt < 2; nt++)
        for (size_t l = 0; l < sizeof lens / sizeof *lens; l++) {
            memset(b, 0, n);
            mtc_memcpy_parallel(b + 1, a + 3, lens[l], nt);
            CHECK(memcmp(b + 1, a + 3, lens[l]) == 0);
            CHECK(b[0] == 0);
            if (lens[l] + 1 < n) CHECK(b[lens[l] + 1] == 0);
        }
    free(a);
    free(b);
}

/* Streaming-store copies: every length around the 64-byte steps and the
 * 256-byte threshold, at every source and destination misalignment, leave
 * the bytes around the destination untouched. */
static void test_memcpy_nt(void)
{
    enum { MAX = 1200, PAD = 32 };
    static unsigned char src[MAX + 64], dst[MAX + 64 + 2 * PAD], ref[MAX + 64 + 2 * PAD];
    for (size_t i = 0; i < sizeof src; i++) src[i] = (unsigned char)(i * 13 + 5);
    size_t lens[] = {0, 1, 15, 16, 63, 64, 65, 255, 256, 257, 300, 511, 1000, MAX};
    for (size_t l = 0; l < sizeof lens / sizeof *lens; l++)
        for (size_t so = 0; so < 16; so += 3)
            for (size_t d0 = 0; d0 < 16; d0++) {
                memset(dst, 0xAB, sizeof dst);
                memset(ref, 0xAB, sizeof ref);
                memcpy(ref + PAD + d0, src + so, lens[l]);
                mtc_memcpy_nt(dst + PAD + d0, src + so, lens[l]);
                CHECK(memcmp(dst, ref, sizeof dst) == 0);
            }
    /* and a large one through the probe: 3 threads, both kinds */
    size_t n = (size_t)5 << 20;
    unsigned char *a = malloc(n), *b = malloc(n + 1);
    double secs[2];
    CHECK(a && b);
    for (size_t i = 0; i < n; i++) a[i] = (unsigned char)(i * 7 + 3);
    for (int nt = 0; nt < 2; nt++) {
        memset(b, 0, n + 1);
        CHECK(mtc_memcpy_bench(b + 1, a, n - 1, 3, 2, nt, 0, secs) == 0);
        CHECK(memcmp(a, b + 1, n - 1) == 0 && b[0] == 0 && b[n] == 0);
        CHECK(secs[0] > 0 && secs[1] > 0);
    }
    /* a window: each thread's last window of its share ends up at dst + i * window */
    size_t win = (size_t)64 << 10, per = ((n / 3) & ~(size_t)4095);
    for (int nt = 0; nt < 2; nt++) {
        memset(b, 0, n + 1);
        CHECK(mtc_memcpy_bench(b, a, n, 3, 1, nt, win, secs) == 0);
        for (int i = 0; i < 3; i++) {
            size_t len = i == 2 ? n - 2 * per : per, last = (len - 1) / win * win;
            CHECK(memcmp(b + (size_t)i * win, a + (size_t)i * per + last, len - last) == 0);
        }
        CHECK(b[3 * win] == 0);
    }
    CHECK(mtc_memcpy_bench(b, a, n, 0, 1, 0, 0, secs) == -EINVAL);
    free(a);
    free(b);
}

int main(void)
{
    CHECK(mtc_pool_start(3) == 0);
    CHECK(mtc_pool_size() == 3);
    test_strided();
    test_strided_many_dims();
    test_strided_to();
    test_memcpy_parallel();
    test_memcpy_nt();
    test_flags_in_order();
    pthread_t t[4];
    for (int i = 0; i < 4; i++) CHECK(pthread_create(&t[i], NULL, submitter, (void *)(uintptr_t)(i + 1)) == 0);
    for (int i = 0; i < 4; i++) pthread_join(t[i], NULL);
    mtc_pool_stop();
    CHECK(mtc_pool_size() == 0);
    printf("test_hostcopy: all passed\n");
    return 0;
}
