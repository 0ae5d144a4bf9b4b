/*
 * uring.h - reads of file-backed leaves (mtc_loader.FileTensor) into host
 * memory. Each piece of a read (4 MiB at most) takes its route: the pieces
 * the page cache holds are copied with pread by the helper threads, in
 * parallel; the others go through one io_uring per process, O_DIRECT for
 * their aligned middle, while the helpers copy. Where io_uring is
 * unavailable or liburing was absent at build time, every piece is read
 * with pread on the helper threads.
 *
 * Concurrency: any number of threads may call mtc_uring_read at once; the
 * ring is taken by one caller at a time (a mutex), the copies run on the
 * shared helper pool. After fork() the child builds its own ring.
 *
 * No Python here; functions return 0 or a negative errno. Names starting
 * with `_` are internal to uring.c.
 *
 * The spec: a FileTensor carries its file parts as one immutable bytes
 * object (`FileTensor._spec`, built by mtc_loader/files.py), laid out as
 *
 *   mtc_file_spec_hdr | int64 dims[ndim] | mtc_file_part[nparts] | paths
 *
 * every path NUL-terminated; part k fills bytes [sum of earlier parts'
 * nbytes, + nbytes) of the leaf. A stacked FileTensor (default_collate of
 * several) has one part per file.
 */
#ifndef MTC_URING_H
#define MTC_URING_H

#include <stddef.h>
#include <stdint.h>

#define MTC_FILE_SPEC_MAGIC 0x4654434du /* "MCTF" little-endian: version 1 */

typedef struct mtc_file_spec_hdr {
    uint32_t magic;
    uint16_t dtype;     /* dtype code (index in mtc_loader._dtypes.DTYPES) */
    uint16_t ndim;
    uint32_t nparts;
    uint32_t paths_bytes; /* size of the path pool after the parts */
    int64_t nbytes;     /* sum of the parts' nbytes = numel * elsize */
} mtc_file_spec_hdr;

typedef struct mtc_file_part {
    uint64_t offset;    /* in the file */
    uint64_t nbytes;
    uint32_t path;      /* offset of the NUL-terminated path in the pool */
    uint32_t path_len;  /* without the NUL */
} mtc_file_part;

/* A view of a spec (borrowed from the bytes; valid while they live). */
typedef struct mtc_file_spec {
    mtc_file_spec_hdr h;
    const int64_t *dims;        /* may be unaligned: read with memcpy */
    const uint8_t *parts;       /* mtc_file_part[nparts], may be unaligned */
    const char *paths;
} mtc_file_spec;

/* Checks and views a spec of `len` bytes: sizes add up, every path is inside
 * the pool and NUL-terminated, the parts' bytes sum to h.nbytes. 0 or -EINVAL. */
int mtc_uring_spec_view(const void *buf, size_t len, mtc_file_spec *out);

/* The size of the spec that starts at buf, from its header (which the
 * caller has checked with mtc_uring_spec_view before). */
size_t mtc_uring_spec_size(const void *buf);

/* Part k of a viewed spec (k < nparts); its path into *path. */
void mtc_uring_spec_part(const mtc_file_spec *s, uint32_t k, mtc_file_part *part, const char **path);

/* One read: nbytes of `path` at `offset` into dst. `tag` is the caller's (a
 * leaf index), `part` the part of that leaf, both only for error reports. */
typedef struct mtc_uring_req {
    const char *path;
    uint64_t offset;
    uint64_t nbytes;
    void *dst;
    int32_t tag;
    uint32_t part;
} mtc_uring_req;

/* On failure: which request failed and how many of its bytes arrived. */
typedef struct mtc_uring_err {
    uint32_t index;
    uint64_t got;       /* -ENODATA: the file ended after `got` bytes of the request */
} mtc_uring_err;

/* How reads are done in this process. */
enum { MTC_URING_MODE_URING = 1, MTC_URING_MODE_PREAD = 2 };

/*
 * Reads every request (any order, any number; the bytes of distinct requests
 * must not overlap). Returns 0 once all arrived, or the first failure's code
 * with *err filled: -ENOENT, -EACCES, -EISDIR, -EIO, ..., or -ENODATA when a
 * file is shorter than offset + nbytes. After a failure no read is in flight
 * any more and every descriptor it opened is closed; the destination bytes
 * are unspecified.
 */
int mtc_uring_read(const mtc_uring_req *reqs, uint32_t n, mtc_uring_err *err);

/* One file-backed leaf to read: its spec (checked with mtc_uring_spec_view
 * when the leaf was read), where its bytes go, and the caller's tag (a leaf
 * index) for the error. */
typedef struct mtc_uring_leaf {
    const void *spec;
    void *dst;
    int32_t tag;
} mtc_uring_leaf;

/* The index an error carries when the requests could not be planned. */
#define MTC_URING_UNPLANNED UINT32_MAX

/*
 * Reads every part of every leaf as one batch of requests (mtc_uring_read).
 * 0, or the first failure's code with *err (index: the failed part of its
 * leaf, got: the bytes of that part that arrived) and *tag (that leaf's
 * tag); -ENOMEM with err->index MTC_URING_UNPLANNED and *tag the first
 * leaf's when the requests cannot be allocated.
 */
int mtc_uring_read_leaves(const mtc_uring_leaf *leaves, uint32_t n, mtc_uring_err *err, int32_t *tag);

/*
 * Reads bytes [begin, begin + len) of the leaf a spec describes into dst
 * with pread on the calling thread (a helper's piece of a large leaf).
 * 0, or a code as above with err->index = the part and err->got = the
 * bytes of that part that arrived.
 */
int mtc_uring_pread_range(const void *spec, uint64_t begin, uint64_t len, void *dst, mtc_uring_err *err);

/*
 * The mode reads take in this process, setting the ring up on first use:
 * MTC_URING_MODE_URING, or MTC_URING_MODE_PREAD with *why (static text) and
 * *forced (1 when MTC_FILE_READER=pread asked for it, 0 when io_uring is
 * unavailable or liburing was absent at build time).
 */
int mtc_uring_mode(const char **why, int *forced);

typedef struct mtc_uring_stats {
    uint64_t reads_uring, reads_pread; /* requests completed by each mode (pread: also mtc_uring_pread_range's) */
    uint64_t bytes;                    /* bytes read (every route) */
    /* bytes by route: copied from the page cache by the helpers; read
     * O_DIRECT by the ring; read buffered by the ring (heads and tails,
     * O_DIRECT off or refused); read with pread (the pread mode, and
     * mtc_uring_pread_range). Their sum is `bytes`. */
    uint64_t bytes_cached, bytes_direct, bytes_buffered, bytes_pread;
    uint64_t direct_reads;             /* O_DIRECT segments */
    uint64_t direct_refused;           /* requests whose O_DIRECT open the filesystem refused (EINVAL) */
    uint64_t submits;                  /* io_uring_enter calls that submitted */
    uint64_t short_reads;              /* reads resubmitted for their remainder */
    uint64_t errors;
} mtc_uring_stats;

void mtc_uring_get_stats(mtc_uring_stats *out);

/* The io_uring mode's pieces: the page cache's to the helpers, the others'
 * aligned middles O_DIRECT (UNCACHED, the default); the same with the
 * others read buffered (OFF); every piece through the ring, its aligned
 * middle O_DIRECT, cached or not (ALWAYS). cachestat(2), Linux 6.5, tells
 * what the page cache holds, and mincore(2) before it. */
enum { MTC_URING_DIRECT_OFF = 0, MTC_URING_DIRECT_UNCACHED = 1, MTC_URING_DIRECT_ALWAYS = 2 };

/* Tests: set the queue depth, the largest single read (0: unlimited; forces
 * short reads to be completed in several steps), O_DIRECT (MTC_URING_DIRECT_*),
 * and the mode (MTC_URING_MODE_*, 0: automatic). Tears the ring down; the
 * next read sets it up again. Environment equivalents, read once per process:
 * MTC_URING_DEPTH, MTC_URING_MAX_IO, MTC_FILE_DIRECT=0|1|always,
 * MTC_FILE_READER=pread. */
void mtc_uring_configure(unsigned depth, uint64_t max_io, int direct, int mode);

/* Tests: ask the page cache with mincore(2) (on) rather than cachestat(2)
 * (off, the default where the kernel has it). */
void mtc_uring_probe_mincore(int on);

/* Tears the ring down (interpreter exit, tests). */
void mtc_uring_shutdown(void);

#endif /* MTC_URING_H */
