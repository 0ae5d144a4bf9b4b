/*
 * uring.c - reads of file-backed leaves: the page cache's bytes copied by the
 * helper threads, the rest by io_uring (O_DIRECT where aligned), or pread on
 * the helper threads for everything (see uring.h).
 */
#include "uring.h"
#include "env.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#ifdef MTC_HAVE_LIBURING
#include <liburing.h>
#endif

#include "atomics.h"
#include "hostcopy.h"

/* O_DIRECT needs the file offset, the length and the memory address aligned
 * to the device's logical block; 4 KiB covers every block size in use. */
#define _DIRECT_ALIGN ((uint64_t)4096)
/* A single read's length is a u32 in the SQE, and Linux caps one read at
 * just under 2 GiB: larger reads are completed in steps like short ones. */
#define _MAX_ONE_READ ((uint64_t)1 << 30)
/* Pieces one helper reads, so one large file keeps several busy; also the
 * unit of the route choice (each piece of a read is cached or not). */
#define _PREAD_PIECE ((uint64_t)4 << 20)

/* ---- configuration, state, counters ---- */

static struct {
    pthread_mutex_t lock;     /* the ring and the mode: one caller at a time */
    int state;                /* 0 not set up, else MTC_URING_MODE_* */
    int forced;
    const char *why;
    char why_buf[160];
    unsigned depth;
    uint64_t max_io;          /* 0: unlimited (tests lower it to force short reads) */
    int direct;               /* MTC_URING_DIRECT_* */
    int want_mode;            /* 0 automatic, else forced MTC_URING_MODE_* */
    int env_read;
#ifdef MTC_HAVE_LIBURING
    struct io_uring ring;
#endif
} _u = {.lock = PTHREAD_MUTEX_INITIALIZER, .depth = 128, .direct = MTC_URING_DIRECT_UNCACHED};

static struct {
    _Atomic uint64_t reads_uring, reads_pread, bytes, bytes_cached, bytes_direct, bytes_buffered, bytes_pread;
    _Atomic uint64_t direct_reads, direct_refused, submits, short_reads, errors;
} _st;

#define _COUNT(field, v) mtc_fetch_add_relaxed(&_st.field, (uint64_t)(v))

void mtc_uring_get_stats(mtc_uring_stats *o)
{
    o->reads_uring = mtc_load_relaxed(&_st.reads_uring);
    o->reads_pread = mtc_load_relaxed(&_st.reads_pread);
    o->bytes = mtc_load_relaxed(&_st.bytes);
    o->bytes_cached = mtc_load_relaxed(&_st.bytes_cached);
    o->bytes_direct = mtc_load_relaxed(&_st.bytes_direct);
    o->bytes_buffered = mtc_load_relaxed(&_st.bytes_buffered);
    o->bytes_pread = mtc_load_relaxed(&_st.bytes_pread);
    o->direct_reads = mtc_load_relaxed(&_st.direct_reads);
    o->direct_refused = mtc_load_relaxed(&_st.direct_refused);
    o->submits = mtc_load_relaxed(&_st.submits);
    o->short_reads = mtc_load_relaxed(&_st.short_reads);
    o->errors = mtc_load_relaxed(&_st.errors);
}

/* Caller holds _u.lock. */
static void _teardown_locked(void)
{
#ifdef MTC_HAVE_LIBURING
    if (_u.state == MTC_URING_MODE_URING) io_uring_queue_exit(&_u.ring);
#endif
    _u.state = 0;
}

/* In the child of a fork: the parent's ring is the parent's (its mapping and
 * fd were copied, its in-flight reads are not ours); drop our copy and build
 * a ring of our own on first use. The child has one thread, and the lock may
 * have been held by a thread that does not exist here: re-create it. */
static void _after_fork_child(void)
{
    pthread_mutex_init(&_u.lock, NULL);
    _teardown_locked();
}

static pthread_once_t _once = PTHREAD_ONCE_INIT;

static void _init_once(void)
{
    pthread_atfork(NULL, NULL, _after_fork_child);
}

/* Caller holds _u.lock. */
static void _read_env_locked(void)
{
    if (_u.env_read) return;
    _u.env_read = 1;
    int64_t v;
    if (mtc_env_int(MTC_ENV_URING_DEPTH, &v) == 1) _u.depth = (unsigned)v;
    if (mtc_env_int(MTC_ENV_URING_MAX_IO, &v) == 1) _u.max_io = (uint64_t)v;
    /* words: "0", "1", "auto", "always" (-1: unset or refused, the default) */
    int d = mtc_env_enum(MTC_ENV_FILE_DIRECT, -1);
    if (d == 0) _u.direct = MTC_URING_DIRECT_OFF;
    else if (d == 3) _u.direct = MTC_URING_DIRECT_ALWAYS;
    else if (d > 0) _u.direct = MTC_URING_DIRECT_UNCACHED;
    /* words: "pread", "uring" */
    int m = mtc_env_enum(MTC_ENV_FILE_READER, -1);
    if (m >= 0) _u.want_mode = m == 0 ? MTC_URING_MODE_PREAD : MTC_URING_MODE_URING;
}

/* Sets the mode up (the ring, when io_uring works). Caller holds _u.lock. */
static void _setup_locked(void)
{
    _read_env_locked();
    if (_u.state) return;
    _u.forced = 0;
    if (_u.want_mode == MTC_URING_MODE_PREAD) {
        _u.state = MTC_URING_MODE_PREAD;
        _u.forced = 1;
        _u.why = "MTC_FILE_READER=pread asked for it";
        return;
    }
#ifdef MTC_HAVE_LIBURING
    int rc = io_uring_queue_init(_u.depth, &_u.ring, 0);
    if (rc < 0) {
        /* ENOSYS: kernel without io_uring; EPERM: io_uring_disabled or a
         * seccomp filter; ENOMEM: RLIMIT_MEMLOCK on old kernels */
        snprintf(_u.why_buf, sizeof _u.why_buf, "io_uring_queue_init(%u) failed: %s", _u.depth, strerror(-rc));
        _u.why = _u.why_buf;
        _u.state = MTC_URING_MODE_PREAD;
        return;
    }
    /* IORING_OP_READ arrived in Linux 5.6; earlier rings cannot serve us */
    struct io_uring_probe *p = io_uring_get_probe_ring(&_u.ring);
    int can_read = p && io_uring_opcode_supported(p, IORING_OP_READ);
    if (p) io_uring_free_probe(p);
    if (!can_read) {
        io_uring_queue_exit(&_u.ring);
        _u.why = "the kernel's io_uring lacks IORING_OP_READ (Linux < 5.6)";
        _u.state = MTC_URING_MODE_PREAD;
        return;
    }
    _u.state = MTC_URING_MODE_URING;
    _u.why = NULL;
#else
    _u.why = "liburing was absent when mtc_loader was built";
    _u.state = MTC_URING_MODE_PREAD;
#endif
}

int mtc_uring_mode(const char **why, int *forced)
{
    pthread_once(&_once, _init_once);
    pthread_mutex_lock(&_u.lock);
    _setup_locked();
    int mode = _u.state;
    if (why) *why = _u.why;
    if (forced) *forced = _u.forced;
    pthread_mutex_unlock(&_u.lock);
    return mode;
}

void mtc_uring_configure(unsigned depth, uint64_t max_io, int direct, int mode)
{
    pthread_once(&_once, _init_once);
    pthread_mutex_lock(&_u.lock);
    _read_env_locked();
    _teardown_locked();
    _u.depth = depth;
    _u.max_io = max_io;
    _u.direct = direct;
    _u.want_mode = mode;
    pthread_mutex_unlock(&_u.lock);
}

void mtc_uring_shutdown(void)
{
    pthread_mutex_lock(&_u.lock);
    _teardown_locked();
    pthread_mutex_unlock(&_u.lock);
}

/* Opens a FileTensor's file for reading: a descriptor, or -errno. Only a
 * regular file or a block device is read at offsets: a FIFO's open would wait
 * for a writer (forever, in a worker) and a FIFO, socket or character device
 * has no offsets, so they are refused (-ESPIPE, what pread says of a pipe)
 * without blocking: opened O_NONBLOCK, checked, then made blocking again
 * (io_uring would return -EAGAIN for a non-blocking descriptor's reads
 * rather than wait for the device). A directory is -EISDIR. A socket, which
 * open() refuses with ENXIO, is -ESPIPE too. */
static int _open_data(const char *path, int flags)
{
    int fd = open(path, flags | O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    struct stat sb;
    if (fd < 0) {
        int e = errno;
        /* a Unix socket cannot be opened at all (ENXIO): refused as what it is */
        if (e == ENXIO && stat(path, &sb) == 0 && !S_ISREG(sb.st_mode) && !S_ISBLK(sb.st_mode)) return -ESPIPE;
        return -e;
    }
    int rc = 0;
    if (fstat(fd, &sb)) rc = -errno;
    else if (S_ISDIR(sb.st_mode)) rc = -EISDIR;
    else if (!S_ISREG(sb.st_mode) && !S_ISBLK(sb.st_mode)) rc = -ESPIPE;
    else if (fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK)) rc = -errno;
    if (rc) {
        close(fd);
        return rc;
    }
    return fd;
}

/* Reads len bytes of fd at off into dst with pread, completing short reads.
 * 0, or -errno / -ENODATA with *got = the bytes that arrived. */
static int _pread_fd(int fd, uint64_t off, uint64_t len, char *dst, uint64_t max_io, uint64_t *got)
{
    uint64_t done = 0;
    int rc = 0;
    while (done < len) {
        uint64_t want = len - done;
        if (want > _MAX_ONE_READ) want = _MAX_ONE_READ;
        if (max_io && want > max_io) want = max_io;
        ssize_t n = pread(fd, dst + done, (size_t)want, (off_t)(off + done));
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN) continue;
            rc = -errno;
            break;
        }
        if (n == 0) { /* end of file before the request's end */
            rc = -ENODATA;
            break;
        }
        if ((uint64_t)n < len - done) _COUNT(short_reads, 1); /* counted as by the ring */
        done += (uint64_t)n;
    }
    *got = done;
    return rc;
}

/* The same for a path, opened and closed here. */
static int _pread_full(const char *path, uint64_t off, uint64_t len, char *dst, uint64_t max_io, uint64_t *got)
{
    int fd = _open_data(path, 0);
    if (fd < 0) {
        *got = 0;
        return fd;
    }
    int rc = _pread_fd(fd, off, len, dst, max_io, got);
    close(fd);
    return rc;
}

int mtc_uring_pread_range(const void *spec, uint64_t begin, uint64_t len, void *dst, mtc_uring_err *err)
{
    mtc_file_spec s;
    if (mtc_uring_spec_view(spec, mtc_uring_spec_size(spec), &s)) return -EINVAL;
    uint64_t max_io = _u.max_io; /* a plain read of a setting tests change between runs */
    uint64_t at = 0; /* leaf offset of part k */
    for (uint32_t k = 0; k < s.h.nparts && len; k++) {
        mtc_file_part p;
        const char *path;
        mtc_uring_spec_part(&s, k, &p, &path);
        if (begin < at + p.nbytes) {
            uint64_t in = begin - at, n = p.nbytes - in < len ? p.nbytes - in : len, got;
            int rc = _pread_full(path, p.offset + in, n, dst, max_io, &got);
            if (rc) {
                _COUNT(errors, 1);
                err->index = k;
                err->got = in + got;
                return rc;
            }
            _COUNT(reads_pread, 1);
            _COUNT(bytes, n);
            _COUNT(bytes_pread, n);
            dst = (char *)dst + n;
            begin += n;
            len -= n;
        }
        at += p.nbytes;
    }
    return 0;
}

/* ---- pieces of requests read with pread on the helper threads: the pread
 * fallback's every piece, and the io_uring reader's cached ones ---- */

/* Bytes [off, off + len) of request req; fd: the request's open descriptor
 * (the io_uring reader's window holds it), or -1: the task opens the file. */
typedef struct _ptask { uint32_t req; int fd; uint64_t off; uint64_t len; } _ptask;

typedef struct _pctx {
    const mtc_uring_req *reqs;
    _ptask *tasks;
    int *err;        /* per task */
    uint64_t *got;   /* per task: bytes read before an error */
    uint64_t max_io;
} _pctx;

static void _pread_task(void *arg, uint32_t t)
{
    _pctx *c = arg;
    const _ptask *pt = &c->tasks[t];
    const mtc_uring_req *r = &c->reqs[pt->req];
    uint64_t got;
    char *dst = (char *)r->dst + pt->off;
    c->err[t] = pt->fd >= 0 ? _pread_fd(pt->fd, r->offset + pt->off, pt->len, dst, c->max_io, &got)
                            : _pread_full(r->path, r->offset + pt->off, pt->len, dst, c->max_io, &got);
    c->got[t] = pt->off + got;
}

static int _read_pread(const mtc_uring_req *reqs, uint32_t n, mtc_uring_err *err, uint64_t max_io)
{
    uint64_t ntasks = 0;
    for (uint32_t i = 0; i < n; i++)
        ntasks += reqs[i].nbytes ? (reqs[i].nbytes + _PREAD_PIECE - 1) / _PREAD_PIECE : 1;
    if (ntasks > UINT32_MAX) return -E2BIG;
    int rc = 0;
    _pctx c = {reqs, calloc(ntasks ? ntasks : 1, sizeof *c.tasks), calloc(ntasks ? ntasks : 1, sizeof *c.err),
               calloc(ntasks ? ntasks : 1, sizeof *c.got), max_io};
    if (!c.tasks || !c.err || !c.got) {
        rc = -ENOMEM;
        goto out;
    }
    uint32_t t = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t off = 0;
        do { /* a zero-byte request still opens its file: a missing file is an error */
            uint64_t len = reqs[i].nbytes - off < _PREAD_PIECE ? reqs[i].nbytes - off : _PREAD_PIECE;
            c.tasks[t++] = (_ptask){i, -1, off, len};
            off += len;
        } while (off < reqs[i].nbytes);
    }
    mtc_parallel_for(_pread_task, &c, (uint32_t)ntasks);
    /* Report the failure of the lowest request (tasks are in request order);
     * a short file fails in its first piece past the end, so `got` of that
     * piece counts the bytes the file had. */
    for (t = 0; t < ntasks; t++)
        if (c.err[t]) {
            rc = c.err[t];
            err->index = c.tasks[t].req;
            err->got = c.got[t];
            break;
        }
    if (!rc) {
        uint64_t sum = 0;
        for (uint32_t i = 0; i < n; i++) sum += reqs[i].nbytes;
        _COUNT(reads_pread, n);
        _COUNT(bytes, sum);
        _COUNT(bytes_pread, sum);
    }
out:
    free(c.tasks);
    free(c.err);
    free(c.got);
    return rc;
}

/* ---- io_uring, and the route of each piece ---- */

static _Atomic int _no_cachestat; /* cachestat(2) gave ENOSYS, or a test asked for mincore(2) */

void mtc_uring_probe_mincore(int on) { mtc_store_relaxed(&_no_cachestat, on); }

#ifdef MTC_HAVE_LIBURING

/* One read of the ring in flight or waiting: the buffered head / O_DIRECT
 * middle / buffered tail of an uncached span of a request. */
typedef struct _unit {
    uint32_t req;
    int direct;
    uint64_t off;      /* file offset of the unit's first byte */
    char *dst;
    uint64_t len, done;
    uint64_t asked;    /* length of the read in flight */
    uint64_t base;     /* bytes of the request before this unit */
} _unit;

/* Requests read together: each one's pieces the page cache holds go to the
 * helpers (copy), the others to the ring (units). */
typedef struct _win {
    const mtc_uring_req *reqs;
    uint32_t first, n;   /* requests of the window */
    int *fd, *dfd;       /* per request: buffered and O_DIRECT descriptors (-1 none, -2 O_DIRECT refused) */
    _unit *units;
    uint32_t nunits;
    uint32_t *pending;   /* stack of unit indices waiting for a submission slot */
    uint32_t npending;
    _pctx copy;          /* the cached pieces, read with pread by the helpers */
    uint32_t ncopy;
    uint64_t cap;        /* pieces the arrays have room for */
    uint64_t direct_bytes, buffered_bytes; /* what the ring read, by route */
} _win;

static uint64_t _round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

/* The pieces of a request: cut at the multiples of _PREAD_PIECE of the file. */
static uint64_t _npieces(const mtc_uring_req *r)
{
    return r->nbytes ? (r->offset + r->nbytes - 1) / _PREAD_PIECE - r->offset / _PREAD_PIECE + 1 : 0;
}

/* Whether the page cache holds a range. cachestat(2), Linux 6.5: how many
 * pages of a file range are cached, one system call, no I/O started. Before
 * it, mincore(2) on a mapping of the range (three system calls; for a file
 * the caller neither owns nor may write, Linux reports every page as cached:
 * such pieces are then read with pread by the helpers, in parallel but
 * through the page cache). A buffered RWF_NOWAIT read is no probe: on a miss
 * it starts readahead of the range before it returns -EAGAIN, so that the
 * O_DIRECT read after it would read the bytes from the device a second time. */
#ifndef SYS_cachestat
#if defined(__x86_64__) || defined(__aarch64__)
#define SYS_cachestat 451
#endif
#endif
static int _cached_mincore(int fd, uint64_t off, uint64_t len)
{
    uint64_t pg = (uint64_t)sysconf(_SC_PAGESIZE), a = off / pg * pg, e = _round_up(off + len, pg);
    unsigned char vec[_PREAD_PIECE / 4096 + 2]; /* a piece's pages, at most */
    if ((e - a) / pg > sizeof vec) return 0;
    void *m = mmap(NULL, (size_t)(e - a), PROT_READ, MAP_SHARED, fd, (off_t)a);
    if (m == MAP_FAILED) return 0;
    int all = mincore(m, (size_t)(e - a), vec) == 0;
    munmap(m, (size_t)(e - a));
    for (uint64_t k = 0; all && k < (e - a) / pg; k++) all = vec[k] & 1;
    return all;
}

/* 1 when every page of [off, off + len) of fd is in the page cache, 0 when
 * some is not or we cannot tell. */
static int _cached(int fd, uint64_t off, uint64_t len)
{
#ifdef SYS_cachestat
    if (!mtc_load_relaxed(&_no_cachestat)) {
        struct { uint64_t off, len; } range = {off, len};
        struct { uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted; } cs;
        if (syscall(SYS_cachestat, fd, &range, &cs, 0) == 0) {
            uint64_t page = 4096, pages = (off + len + page - 1) / page - off / page;
            return cs.nr_cache >= pages;
        }
        if (errno != ENOSYS) return 0;
        mtc_store_relaxed(&_no_cachestat, 1);
    }
#endif
    return _cached_mincore(fd, off, len);
}

/* Queues bytes [s, e) of request i (file offsets), which the page cache does
 * not hold all of, as units of the ring: O_DIRECT for the aligned middle when
 * the destination lines up with the file (dst + (mid_a - offset) aligned as
 * mid_a is) and it is two blocks at least (or the second open costs more than
 * it saves), buffered heads and tails. 0 or -errno (the O_DIRECT open failed
 * otherwise than by the filesystem's refusal). */
static int _win_span(_win *w, uint32_t i, uint64_t s, uint64_t e, int direct)
{
    const mtc_uring_req *r = &w->reqs[w->first + i];
    uint64_t mid_a = _round_up(s, _DIRECT_ALIGN), mid_e = e / _DIRECT_ALIGN * _DIRECT_ALIGN;
    int dir = 0;
    if (direct && mid_e > mid_a && mid_e - mid_a >= 2 * _DIRECT_ALIGN &&
        ((uintptr_t)r->dst + (mid_a - r->offset)) % _DIRECT_ALIGN == 0) {
        if (w->dfd[i] == -1) {
            int dfd = _open_data(r->path, O_DIRECT);
            /* EINVAL: a filesystem without O_DIRECT (tmpfs before Linux 6.6,
             * some overlays and network filesystems): read buffered through
             * the ring, and counted (file_direct_refused) */
            if (dfd == -EINVAL) _COUNT(direct_refused, 1);
            else if (dfd < 0) return dfd;
            w->dfd[i] = dfd >= 0 ? dfd : -2;
        }
        dir = w->dfd[i] >= 0;
    }
    uint64_t cuts[4] = {s, s, e, e};
    if (dir) cuts[1] = mid_a, cuts[2] = mid_e;
    for (int k = 0; k < 3; k++) {
        if (cuts[k + 1] <= cuts[k]) continue;
        _unit *u = &w->units[w->nunits];
        *u = (_unit){.req = i, .direct = k == 1 && dir, .off = cuts[k], .dst = (char *)r->dst + (cuts[k] - r->offset),
                     .len = cuts[k + 1] - cuts[k], .base = cuts[k] - r->offset};
        w->pending[w->npending++] = w->nunits++;
    }
    return 0;
}

/* Opens request i of the window and gives each of its pieces its route: the
 * helpers' pread for a piece the page cache holds (a copy from memory, done
 * in parallel), the ring for a run of pieces it does not (O_DIRECT where
 * aligned; MTC_URING_DIRECT_ALWAYS sends every piece there). 0 or -errno. */
static int _win_add(_win *w, uint32_t i, int direct)
{
    const mtc_uring_req *r = &w->reqs[w->first + i];
    int fd = _open_data(r->path, 0);
    if (fd < 0) return fd;
    w->fd[i] = fd;
    uint64_t a = r->offset, e = r->offset + r->nbytes, span = a; /* span: the uncached run's start */
    for (uint64_t s = a; s < e;) {
        uint64_t t = (s / _PREAD_PIECE + 1) * _PREAD_PIECE < e ? (s / _PREAD_PIECE + 1) * _PREAD_PIECE : e;
        if (direct != MTC_URING_DIRECT_ALWAYS && _cached(fd, s, t - s)) {
            int rc = span < s ? _win_span(w, i, span, s, direct) : 0;
            if (rc) return rc;
            w->copy.tasks[w->ncopy++] = (_ptask){w->first + i, fd, s - a, t - s};
            span = t;
        }
        s = t;
    }
    return span < e ? _win_span(w, i, span, e, direct) : 0;
}

/* Room for a window of `pieces` pieces: a task each at most, and three units
 * per run of uncached ones. 0 or -ENOMEM. */
static int _win_reserve(_win *w, uint64_t pieces)
{
    if (pieces <= w->cap) return 0;
    if (pieces > UINT32_MAX / 3) return -ENOMEM;
    _unit *u = realloc(w->units, 3 * pieces * sizeof *u);
    if (u) w->units = u;
    uint32_t *p = realloc(w->pending, 3 * pieces * sizeof *p);
    if (p) w->pending = p;
    _ptask *t = realloc(w->copy.tasks, pieces * sizeof *t);
    if (t) w->copy.tasks = t;
    int *e = realloc(w->copy.err, pieces * sizeof *e);
    if (e) w->copy.err = e;
    uint64_t *g = realloc(w->copy.got, pieces * sizeof *g);
    if (g) w->copy.got = g;
    if (!u || !p || !t || !e || !g) return -ENOMEM;
    w->cap = pieces;
    return 0;
}

/* Queues SQEs for pending units while the ring has room; returns how many. */
static uint32_t _win_prep(_win *w, struct io_uring *ring, uint32_t inflight, uint32_t depth, uint64_t max_io)
{
    uint32_t queued = 0;
    while (w->npending && inflight + queued < depth) {
        struct io_uring_sqe *sqe = io_uring_get_sqe(ring);
        if (!sqe) break;
        uint32_t ui = w->pending[--w->npending];
        _unit *u = &w->units[ui];
        uint64_t want = u->len - u->done;
        if (want > _MAX_ONE_READ) want = _MAX_ONE_READ;
        if (max_io && want > max_io) {
            /* an O_DIRECT read must stay a whole number of blocks */
            uint64_t cap = u->direct ? (max_io / _DIRECT_ALIGN ? max_io / _DIRECT_ALIGN : 1) * _DIRECT_ALIGN : max_io;
            if (want > cap) want = cap;
        }
        int fd = u->direct ? w->dfd[u->req] : w->fd[u->req];
        io_uring_prep_read(sqe, fd, u->dst + u->done, (unsigned)want, u->off + u->done);
        u->asked = want;
        io_uring_sqe_set_data64(sqe, ui);
        queued++;
    }
    return queued;
}

/* The bytes of a request that its file holds, when unit u found the end of
 * the file: where the unit stands, or less when the file ends before it (a
 * tail unit read in parallel with the middle finds the end at its own start,
 * and the units before it stop once an error is seen). */
static uint64_t _win_got(const _win *w, const _unit *u)
{
    uint64_t got = u->base + u->done;
    const mtc_uring_req *r = &w->reqs[w->first + u->req];
    struct stat sb;
    if (fstat(w->fd[u->req], &sb) == 0 && S_ISREG(sb.st_mode)) {
        uint64_t size = (uint64_t)sb.st_size, has = size > r->offset ? size - r->offset : 0;
        if (has < got) got = has;
    }
    return got;
}

/* Handles one completion: done, resubmitted for its remainder, or an error.
 * Returns 0 or the error (with *err filled). */
static int _win_complete(_win *w, uint32_t ui, int res, mtc_uring_err *err)
{
    _unit *u = &w->units[ui];
    if (res == -EINTR || res == -EAGAIN) {
        w->pending[w->npending++] = ui;
        return 0;
    }
    if (res < 0 || res == 0) {
        err->index = w->first + u->req;
        err->got = res < 0 ? u->base + u->done : _win_got(w, u);
        return res < 0 ? res : -ENODATA; /* 0: the file ended before the request's end */
    }
    if (u->direct) w->direct_bytes += (uint64_t)res;
    else w->buffered_bytes += (uint64_t)res;
    u->done += (uint64_t)res;
    if (u->done < u->len) {
        /* Not all of the unit yet: a read cut by max_io or the 1 GiB step,
         * or a short read (the end of the file, a signal, the kernel's
         * choice). After a short one, the rest of an O_DIRECT unit may start
         * unaligned: it continues buffered, which any offset allows. */
        _COUNT(short_reads, 1);
        if ((uint64_t)res < u->asked) u->direct = 0;
        w->pending[w->npending++] = ui;
    } else if (u->direct) {
        _COUNT(direct_reads, 1);
    }
    return 0;
}

/* Runs the window: every unit submitted and completed, or the first error
 * (then the reads in flight are waited for and nothing new is submitted, so
 * no read writes into the destination after we return). Caller holds
 * _u.lock. */
static int _win_run(_win *w, struct io_uring *ring, mtc_uring_err *err)
{
    uint32_t inflight = 0; /* prepared SQEs whose completion is not reaped yet */
    int rc = 0;
    while ((w->npending && !rc) || inflight) {
        inflight += rc ? 0 : _win_prep(w, ring, inflight, _u.depth, _u.max_io);
        /* one io_uring_enter submits every queued read and waits for a completion */
        int s = io_uring_submit_and_wait(ring, 1);
        if (s < 0 && s != -EINTR && s != -EAGAIN && s != -EBUSY) {
            /* the ring itself is broken (EBADF, EFAULT: never in a sound
             * process): drop it; closing it makes the kernel cancel what it
             * took before our caller's memory goes */
            _teardown_locked();
            if (!rc) {
                err->index = w->first;
                err->got = 0;
            }
            return rc ? rc : s;
        }
        if (s > 0) _COUNT(submits, 1);
        struct io_uring_cqe *cqe;
        unsigned head, seen = 0;
        io_uring_for_each_cqe(ring, head, cqe)
        {
            uint32_t ui = (uint32_t)io_uring_cqe_get_data64(cqe);
            int res = cqe->res;
            seen++;
            inflight--;
            if (!rc) rc = _win_complete(w, ui, res, err); /* after an error: only drain */
        }
        io_uring_cq_advance(ring, seen);
    }
    return rc;
}

/* The failure of the window's cached pieces to report, if it comes before
 * the ring's (rc, *err): the lowest request's, and of one request the fewest
 * bytes arrived (a file that ends fails every piece past its end). */
static int _win_copy_err(const _win *w, int rc, mtc_uring_err *err)
{
    for (uint32_t t = 0; t < w->ncopy; t++) {
        if (!w->copy.err[t]) continue;
        uint32_t req = w->copy.tasks[t].req;
        uint64_t got = w->copy.got[t];
        if (!rc || req < err->index || (req == err->index && got < err->got)) {
            rc = w->copy.err[t];
            *err = (mtc_uring_err){req, got};
        }
    }
    return rc;
}

static int _read_uring(const mtc_uring_req *reqs, uint32_t n, mtc_uring_err *err)
{
    struct io_uring *ring = &_u.ring;
    /* A window holds as many requests as the ring has slots, so that
     * descriptors stay bounded: open files are at most 2 x depth, whatever
     * the batch. */
    uint32_t per = _u.depth ? _u.depth : 1;
    int rc = 0;
    uint64_t cached_bytes = 0;
    _win w = {.reqs = reqs, .copy = {.reqs = reqs, .max_io = _u.max_io}};
    w.fd = malloc(per * sizeof *w.fd);
    w.dfd = malloc(per * sizeof *w.dfd);
    if (!w.fd || !w.dfd) {
        rc = -ENOMEM;
        goto out;
    }
    for (uint32_t first = 0; first < n && !rc; first += per) {
        w.first = first;
        w.n = n - first < per ? n - first : per;
        w.nunits = w.npending = w.ncopy = 0;
        uint64_t pieces = 0;
        for (uint32_t i = 0; i < w.n; i++) {
            w.fd[i] = w.dfd[i] = -1;
            pieces += _npieces(&reqs[first + i]);
        }
        if ((rc = _win_reserve(&w, pieces))) {
            *err = (mtc_uring_err){first, 0};
            break;
        }
        for (uint32_t i = 0; i < w.n && !rc; i++)
            if ((rc = _win_add(&w, i, _u.direct))) *err = (mtc_uring_err){first + i, 0};
        /* the helpers copy the cached pieces while this thread runs the ring,
         * then takes the copies that are left */
        mtc_batch b;
        uint32_t ncopy = rc ? 0 : w.ncopy;
        for (uint32_t t = 0; t < ncopy; t++) w.copy.err[t] = 0;
        if (ncopy) mtc_batch_submit(&b, _pread_task, &w.copy, ncopy);
        if (!rc) rc = _win_run(&w, ring, err);
        if (ncopy) {
            mtc_batch_help(&b);
            mtc_batch_wait(&b);
        }
        w.ncopy = ncopy;
        rc = _win_copy_err(&w, rc, err);
        for (uint32_t t = 0; t < ncopy; t++) cached_bytes += w.copy.tasks[t].len;
        for (uint32_t i = 0; i < w.n; i++) {
            if (w.fd[i] >= 0) close(w.fd[i]);
            if (w.dfd[i] >= 0) close(w.dfd[i]);
        }
    }
    if (!rc) {
        uint64_t sum = 0;
        for (uint32_t i = 0; i < n; i++) sum += reqs[i].nbytes;
        _COUNT(reads_uring, n);
        _COUNT(bytes, sum);
        _COUNT(bytes_cached, cached_bytes);
        _COUNT(bytes_direct, w.direct_bytes);
        _COUNT(bytes_buffered, w.buffered_bytes);
    }
out:
    free(w.fd);
    free(w.dfd);
    free(w.units);
    free(w.pending);
    free(w.copy.tasks);
    free(w.copy.err);
    free(w.copy.got);
    return rc;
}
#endif /* MTC_HAVE_LIBURING */

int mtc_uring_read(const mtc_uring_req *reqs, uint32_t n, mtc_uring_err *err)
{
    if (!n) return 0;
    pthread_once(&_once, _init_once);
    pthread_mutex_lock(&_u.lock);
    _setup_locked();
    int rc;
    uint64_t max_io = _u.max_io;
#ifdef MTC_HAVE_LIBURING
    if (_u.state == MTC_URING_MODE_URING) {
        rc = _read_uring(reqs, n, err);
        pthread_mutex_unlock(&_u.lock);
        if (rc) _COUNT(errors, 1);
        return rc;
    }
#endif
    pthread_mutex_unlock(&_u.lock);
    rc = _read_pread(reqs, n, err, max_io);
    if (rc) _COUNT(errors, 1);
    return rc;
}

int mtc_uring_read_leaves(const mtc_uring_leaf *leaves, uint32_t n, mtc_uring_err *err, int32_t *tag)
{
    uint32_t nreq = 0;
    for (uint32_t i = 0; i < n; i++) {
        mtc_file_spec_hdr h;
        memcpy(&h, leaves[i].spec, sizeof h);
        nreq += h.nparts;
    }
    if (!nreq) return 0;
    mtc_uring_req *reqs = malloc(nreq * sizeof *reqs);
    if (!reqs) {
        *err = (mtc_uring_err){MTC_URING_UNPLANNED, 0};
        *tag = leaves[0].tag;
        return -ENOMEM;
    }
    uint32_t q = 0;
    for (uint32_t i = 0; i < n; i++) {
        mtc_file_spec s;
        /* checked when the leaf was read (files.c); the bytes are immutable */
        mtc_uring_spec_view(leaves[i].spec, mtc_uring_spec_size(leaves[i].spec), &s);
        char *dst = leaves[i].dst;
        for (uint32_t k = 0; k < s.h.nparts; k++) {
            mtc_file_part p;
            const char *path;
            mtc_uring_spec_part(&s, k, &p, &path);
            reqs[q++] = (mtc_uring_req){.path = path, .offset = p.offset, .nbytes = p.nbytes, .dst = dst,
                                        .tag = leaves[i].tag, .part = k};
            dst += p.nbytes;
        }
    }
    mtc_uring_err fe = {0, 0};
    int rc = mtc_uring_read(reqs, nreq, &fe);
    if (rc) {
        *err = (mtc_uring_err){reqs[fe.index].part, fe.got};
        *tag = reqs[fe.index].tag;
    }
    free(reqs);
    return rc;
}
