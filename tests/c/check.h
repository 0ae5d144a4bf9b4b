/* tests/c/check.h - the checks and small helpers the C unit tests share.
 *
 *   CHECK(cond), CHECK_EQ(a, b)  on failure: print where and what (both
 *                                values for CHECK_EQ), then the test's own
 *                                context, and exit(1). A test that has more
 *                                to say (a seed that reproduces the run)
 *                                defines CHECK_NOTE() before including this.
 *   FAILF(fmt, ...)              fail with a message.
 *   g_checks                     checks made so far (atomic: tests check
 *                                from several threads).
 *   UNDER_TSAN                   1 when built with ThreadSanitizer.
 *   now_s(), sleep_ms(ms), xorshift64(&state)
 */
#ifndef MTC_TESTS_CHECK_H
#define MTC_TESTS_CHECK_H

#include <errno.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#ifndef CHECK_NOTE
#define CHECK_NOTE() ((void)0)
#endif

static atomic_long g_checks;

#define CHECK(cond)                                                            \
    do {                                                                       \
        atomic_fetch_add_explicit(&g_checks, 1, memory_order_relaxed);         \
        if (!(cond)) {                                                         \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
            CHECK_NOTE();                                                      \
            exit(1);                                                           \
        }                                                                      \
    } while (0)

#define CHECK_EQ(a, b)                                                         \
    do {                                                                       \
        long long _a = (long long)(a), _b = (long long)(b);                    \
        atomic_fetch_add_explicit(&g_checks, 1, memory_order_relaxed);         \
        if (_a != _b) {                                                        \
            fprintf(stderr, "%s:%d: CHECK_EQ failed: %s == %s (%lld vs %lld)\n", \
                    __FILE__, __LINE__, #a, #b, _a, _b);                       \
            CHECK_NOTE();                                                      \
            exit(1);                                                           \
        }                                                                      \
    } while (0)

#define FAILF(...)                                                             \
    do {                                                                       \
        fprintf(stderr, "%s:%d: ", __FILE__, __LINE__);                        \
        fprintf(stderr, __VA_ARGS__);                                          \
        fputc('\n', stderr);                                                   \
        CHECK_NOTE();                                                          \
        exit(1);                                                               \
    } while (0)

#if defined(__SANITIZE_THREAD__)
#define UNDER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define UNDER_TSAN 1
#endif
#endif
#ifndef UNDER_TSAN
#define UNDER_TSAN 0
#endif

static inline double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static inline void sleep_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) && errno == EINTR) {
    }
}

/* xorshift64 (13, 7, 17); the state must not be 0 */
static inline uint64_t xorshift64(uint64_t *s)
{
    uint64_t x = *s;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *s = x;
}

#endif /* MTC_TESTS_CHECK_H */
