/* tests/c/fake_cuda.h - the control interface of the fake CUDA driver
 * (fake_cuda.c, built by tests/c/Makefile as build/<sanitizer>/fakecuda/libcuda.so.1).
 *
 * The fake implements every driver entry point cuda.c resolves, on the host:
 * a "device pointer" is a host address, a stream is a worker thread that runs
 * its queue of copies, event records and host functions in order, each copy
 * after a delay, so that the DMA really happens after the call that issued it
 * returned. Events complete when the worker reaches their record.
 *
 * A test reaches the functions below through the exported table `fake_cuda`
 * (dlopen("libcuda.so.1") + dlsym: the engine dlopens the same library).
 */
#ifndef MTC_TESTS_FAKE_CUDA_H
#define MTC_TESTS_FAKE_CUDA_H

#include <stddef.h>
#include <stdint.h>

/* Entry points whose failure a test can inject (fake_cuda_fail). */
enum {
    FAKE_FAIL_HTOD = 0,       /* cuMemcpyHtoDAsync_v2 */
    FAKE_FAIL_EVENT_RECORD,   /* cuEventRecord */
    FAKE_FAIL_EVENT_QUERY,    /* cuEventQuery */
    FAKE_FAIL_EVENT_SYNC,     /* cuEventSynchronize */
    FAKE_FAIL_EVENT_CREATE,   /* cuEventCreate */
    FAKE_FAIL_HOST_ALLOC,     /* cuMemHostAlloc */
    FAKE_FAIL_NPOINTS
};

#define FAKE_MAX_SRCS 128

typedef struct fake_cuda_stats {
    uint64_t htod_calls, htod_bytes;   /* cuMemcpyHtoDAsync calls that were queued */
    uint64_t copies_done;              /* copies the stream workers performed */
    uint64_t event_records, event_queries, event_syncs, stream_syncs;
    uint64_t host_allocs, host_frees;  /* cuMemHostAlloc / cuMemFreeHost */
    uint64_t host_live;                /* page-locked allocations not freed */
    uint64_t events_live;              /* events created and not destroyed */
    uint64_t injected;                 /* failures returned by fake_cuda_fail */
    /* what a real driver would not survive, or what the engine must never do: */
    uint64_t src_changed;       /* a copy's source changed between the call and the DMA */
    uint64_t pageable_htod;     /* an HtoD copy whose source is not in a page-locked allocation */
    uint64_t no_context;        /* a stream call with no current context */
    uint64_t freed_in_flight;   /* cuMemFreeHost of memory a queued copy still reads */
    uint64_t destroyed_in_use;  /* a destroyed event recorded, queried or waited on */
    /* HtoD copies queued and not yet performed, at most (over all streams) */
    uint64_t max_htod_in_flight;
    /* distinct source addresses of HtoD copies (the first FAKE_MAX_SRCS) */
    uint64_t nsrcs;
    uintptr_t srcs[FAKE_MAX_SRCS];
} fake_cuda_stats;

typedef struct fake_cuda_api {
    /* Every copy waits a delay drawn uniformly from [min_us, max_us] before it runs. */
    void (*set_delay)(unsigned min_us, unsigned max_us);
    /* Entry point `point` (FAKE_FAIL_*) returns `code` on `times` calls, after
     * `after` more calls that succeed. */
    void (*fail)(int point, unsigned after, unsigned times, int code);
    void (*clear_failures)(void);
    void (*get_stats)(fake_cuda_stats *out);
    /* Zeroes the counters (the live counts are kept). */
    void (*reset_stats)(void);
} fake_cuda_api;

#endif /* MTC_TESTS_FAKE_CUDA_H */
