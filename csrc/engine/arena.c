/*
 * arena.c - the shared arena and its lock-free slot allocator (see arena.h).
 */
#include "arena.h"
#include "env.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define _PID(s) ((uint32_t)((s) & 0xffffffffu))
#define _LEN(s) ((uint32_t)(((s) >> 32) & 0x7fffffffu))
#define _IS_HEAD(s) (((s) & MTC_ARENA_HEAD) != 0)

static uint64_t _header_bytes(uint32_t nslots)
{
    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
    uint64_t h = sizeof(mtc_arena_header) + (uint64_t)nslots * sizeof(uint64_t);
    return (h + page - 1) / page * page;
}

static int _map(int fd, size_t bytes, mtc_arena **out)
{
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) return -errno;
    mtc_arena *a = calloc(1, sizeof *a);
    if (!a) {
        munmap(p, bytes);
        return -ENOMEM;
    }
    a->fd = fd;
    a->base = p;
    a->bytes = bytes;
    a->hdr = p;
    atomic_init(&a->refs, 1);
    *out = a;
    return 0;
}

int mtc_arena_create(size_t bytes, mtc_arena **out)
{
    if (!bytes || bytes > ((size_t)1 << 46)) return -EINVAL;
    uint64_t nslots64 = (bytes + MTC_ARENA_SLOT_BYTES - 1) / MTC_ARENA_SLOT_BYTES;
    if (nslots64 > UINT32_MAX / 2) return -EINVAL;
    uint32_t nslots = (uint32_t)nslots64;
    uint64_t data_offset = _header_bytes(nslots);
    uint64_t total = data_offset + (uint64_t)nslots * MTC_ARENA_SLOT_BYTES;
    /* anonymous, close-on-exec; sealing keeps another process from shrinking
     * it under our mappings (SIGBUS) or growing it */
    int fd = (int)syscall(SYS_memfd_create, "mtc_loader_arena", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) return -errno;
    int rc;
    if (ftruncate(fd, (off_t)total) || fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)) {
        rc = -errno;
        close(fd);
        return rc;
    }
    mtc_arena *a;
    if ((rc = _map(fd, total, &a))) {
        close(fd);
        return rc;
    }
    mtc_arena_header *h = a->hdr; /* zero-filled by ftruncate */
    h->version = MTC_ARENA_VERSION;
    h->creator_pid = (uint32_t)getpid();
    h->arena_bytes = total;
    h->data_offset = data_offset;
    h->slot_bytes = MTC_ARENA_SLOT_BYTES;
    h->nslots = nslots;
    /* the magic last: an attacher that sees it sees a complete header */
    mtc_store_release((_Atomic uint64_t *)&h->magic, MTC_ARENA_MAGIC);
    a->nslots = nslots;
    a->data_offset = data_offset;
    a->slot_bytes = MTC_ARENA_SLOT_BYTES;
    a->populated = calloc(nslots, 1); /* NULL: never populate */
    *out = a;
    return 0;
}

int mtc_arena_attach(int fd, mtc_arena **out)
{
    struct stat sb;
    if (fstat(fd, &sb)) return -errno;
    if (sb.st_size < (off_t)sizeof(mtc_arena_header)) return -EINVAL;
    int nfd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (nfd < 0) return -errno;
    mtc_arena *a;
    int rc = _map(nfd, (size_t)sb.st_size, &a);
    if (rc) {
        close(nfd);
        return rc;
    }
    /* The header is untrusted: keep private copies of its geometry, checked
     * against the real size of the file, and use only those. */
    mtc_arena_header *h = a->hdr;
    uint32_t nslots = h->nslots;
    uint64_t data_offset = h->data_offset, slot_bytes = h->slot_bytes;
    if (h->magic != MTC_ARENA_MAGIC || h->version != MTC_ARENA_VERSION ||
        slot_bytes != MTC_ARENA_SLOT_BYTES || nslots == 0 || nslots > UINT32_MAX / 2 ||
        data_offset != _header_bytes(nslots) ||
        data_offset + (uint64_t)nslots * slot_bytes != (uint64_t)sb.st_size) {
        mtc_arena_unref(a);
        return -EINVAL;
    }
    a->nslots = nslots;
    a->data_offset = data_offset;
    a->slot_bytes = slot_bytes;
    a->populated = calloc(nslots, 1); /* NULL: never populate */
    *out = a;
    return 0;
}

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif

static _Atomic int _populate_off = -1; /* MTC_ARENA_POPULATE=0, read once */

int mtc_arena_populate(mtc_arena *a, uint64_t off, uint64_t nbytes)
{
    if (!nbytes || !a->populated || off < a->data_offset) return 0;
    if (mtc_load_relaxed(&_populate_off) < 0) {
        mtc_store_relaxed(&_populate_off, !mtc_env_bool(MTC_ENV_ARENA_POPULATE, 1));
    }
    if (mtc_load_relaxed(&_populate_off)) return 0;
    int32_t me = (int32_t)getpid();
    if (mtc_load_relaxed(&a->populated_pid) != me) {
        /* a new process (fork copied the bitmap of its parent): nothing is
         * mapped here yet. Two threads may both reset it: harmless. */
        for (uint32_t i = 0; i < a->nslots; i++) mtc_store_relaxed(&a->populated[i], 0);
        mtc_store_relaxed(&a->populated_pid, me);
    }
    uint64_t first = (off - a->data_offset) / a->slot_bytes;
    uint64_t end = (off - a->data_offset + nbytes + a->slot_bytes - 1) / a->slot_bytes;
    if (end > a->nslots) end = a->nslots;
    int rc = 0;
    for (uint64_t i = first; i < end;) {
        if (mtc_load_relaxed(&a->populated[i])) {
            i++;
            continue;
        }
        uint64_t j = i;
        while (j < end && !mtc_load_relaxed(&a->populated[j])) j++;
        /* slots are whole pages: data_offset and slot_bytes are page multiples */
        if (madvise(a->base + a->data_offset + i * a->slot_bytes, (size_t)((j - i) * a->slot_bytes),
                    MADV_POPULATE_WRITE)) {
            rc = -errno;
            break;
        }
        for (uint64_t k = i; k < j; k++) mtc_store_relaxed(&a->populated[k], 1);
        i = j;
    }
    return rc;
}

void mtc_arena_ref(mtc_arena *a) { mtc_fetch_add_relaxed(&a->refs, 1); }

void mtc_arena_unref(mtc_arena *a)
{
    /* acq_rel: the last owner sees every other owner's use before unmapping */
    if (mtc_fetch_sub_acq_rel(&a->refs, 1) != 1) return;
    munmap(a->base, a->bytes);
    close(a->fd);
    free((void *)a->populated);
    free(a);
}

static void _wake(mtc_arena *a)
{
    mtc_fetch_add_acq_rel(&a->hdr->free_seq, 1);
    /* not FUTEX_PRIVATE: waiters live in other processes */
    syscall(SYS_futex, (uint32_t *)&a->hdr->free_seq, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static void _note_use(mtc_arena *a, int64_t delta)
{
    uint64_t now = mtc_fetch_add_acq_rel(&a->hdr->slots_in_use, (uint64_t)delta) + (uint64_t)delta;
    uint64_t hw = mtc_load_relaxed(&a->hdr->high_water);
    while (delta > 0 && now > hw && !mtc_cas_weak_relaxed(&a->hdr->high_water, &hw, now)) {
    }
}

/* An owner is a pid: 1 .. INT32_MAX (pid_t is signed; a state word keeps 32 bits). */
static inline int _owner_ok(uint32_t owner) { return owner && owner <= INT32_MAX; }

int mtc_arena_try_alloc(mtc_arena *a, uint64_t nbytes, uint32_t owner, uint64_t *off)
{
    if (!_owner_ok(owner)) return -EINVAL;
    /* slots needed, rounded up without overflowing for nbytes near 2^64 */
    uint64_t k64 = nbytes ? nbytes / a->slot_bytes + (nbytes % a->slot_bytes != 0) : 1;
    if (k64 > a->nslots) return -E2BIG;
    uint32_t k = (uint32_t)k64, n = a->nslots;
    _Atomic uint64_t *sl = a->hdr->slots;
    uint32_t start = mtc_load_relaxed(&a->hdr->hint) % n;
    /* Two passes over the slots starting at the hint; runs do not wrap. */
    for (uint32_t scanned = 0, i = start; scanned < 2 * n;) {
        if (i + k > n) { /* no room before the end: continue at 0 */
            scanned += n - i;
            i = 0;
            continue;
        }
        uint64_t s = mtc_load_relaxed(&sl[i]);
        if (s) {
            uint32_t step = _IS_HEAD(s) && _LEN(s) ? _LEN(s) : 1;
            if (step > n - i) step = n - i;
            i += step;
            scanned += step;
            continue;
        }
        /* Claim i+k-1 down to i+1 as continuations, then the head. */
        uint32_t j = i + k;
        uint32_t claimed_to = j;
        int ok = 1;
        while (j-- > i + 1) {
            uint64_t expect = 0;
            /* acq_rel: pairs with the release stores of a free of this slot */
            if (!atomic_compare_exchange_strong_explicit(&sl[j], &expect, (uint64_t)owner,
                                                        memory_order_acq_rel, memory_order_relaxed)) {
                ok = 0;
                break;
            }
            claimed_to = j;
        }
        if (ok) {
            uint64_t expect = 0;
            uint64_t head = MTC_ARENA_HEAD | ((uint64_t)k << 32) | owner;
            if (atomic_compare_exchange_strong_explicit(&sl[i], &expect, head, memory_order_acq_rel,
                                                        memory_order_relaxed)) {
                mtc_store_relaxed(&a->hdr->hint, (i + k) % n);
                mtc_fetch_add_relaxed(&a->hdr->allocs, 1);
                _note_use(a, k);
                *off = a->data_offset + (uint64_t)i * a->slot_bytes;
                return 0;
            }
        }
        /* lost a race: give back what we claimed, move past the conflict */
        for (uint32_t q = claimed_to; q < i + k; q++)
            if (q != i) mtc_store_release(&sl[q], 0); /* pairs with the CAS of the next claimer */
        uint32_t skip = (ok ? i : j) + 1 - i;
        i += skip;
        scanned += skip;
    }
    return -ENOSPC;
}

static int64_t _now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

void mtc_arena_wait_init(mtc_arena_wait *w, int64_t timeout_ns)
{
    /* a timeout too long to add to the clock is no deadline at all */
    if (timeout_ns < 0 || __builtin_add_overflow(_now_ns(), timeout_ns, &w->deadline_ns)) w->deadline_ns = -1;
    w->waited = 0;
}

int mtc_arena_alloc_slice(mtc_arena *a, uint64_t nbytes, uint32_t owner, mtc_arena_wait *w, int64_t slice_ns,
                          uint64_t *off)
{
    int64_t slice_end;
    if (slice_ns < 0 || __builtin_add_overflow(_now_ns(), slice_ns, &slice_end)) slice_end = INT64_MAX;
    for (;;) {
        /* read the futex word before trying: a free after the try changes it */
        uint32_t seq = mtc_load_acquire(&a->hdr->free_seq); /* pairs with _wake's bump */
        int rc = mtc_arena_try_alloc(a, nbytes, owner, off);
        if (rc != -ENOSPC) return rc;
        if (!w->waited) {
            w->waited = 1; /* one wait per allocation, however many slices */
            mtc_fetch_add_relaxed(&a->hdr->waits, 1);
        }
        int64_t now = _now_ns();
        if (w->deadline_ns >= 0 && now >= w->deadline_ns) {
            mtc_fetch_add_relaxed(&a->hdr->timeouts, 1);
            return -ETIMEDOUT;
        }
        if (now >= slice_end) return -EAGAIN;
        /* sleep until a free, the end of the slice or the deadline, and re-check at least
         * every 50 ms: a worker may bump the futex word or not */
        int64_t until = slice_end;
        if (w->deadline_ns >= 0 && w->deadline_ns < until) until = w->deadline_ns;
        int64_t ns = until - now < 50000000 ? until - now : 50000000;
        struct timespec ts = {(time_t)(ns / 1000000000), (long)(ns % 1000000000)};
        if (syscall(SYS_futex, (uint32_t *)&a->hdr->free_seq, FUTEX_WAIT, seq, &ts, NULL, 0) == -1 &&
            errno == EINTR)
            return -EAGAIN; /* a signal: let the caller look at it now */
    }
}

int mtc_arena_alloc(mtc_arena *a, uint64_t nbytes, uint32_t owner, int64_t timeout_ns, uint64_t *off)
{
    mtc_arena_wait w;
    mtc_arena_wait_init(&w, timeout_ns);
    int rc;
    while ((rc = mtc_arena_alloc_slice(a, nbytes, owner, &w, -1, off)) == -EAGAIN) {
    }
    return rc;
}

/* Slot index of a region offset, or -1 when it is not a slot boundary. */
static int64_t _slot_of(mtc_arena *a, uint64_t off)
{
    if (off < a->data_offset) return -1;
    uint64_t rel = off - a->data_offset;
    if (rel % a->slot_bytes) return -1;
    uint64_t i = rel / a->slot_bytes;
    return i < a->nslots ? (int64_t)i : -1;
}

int mtc_arena_check(mtc_arena *a, uint64_t off, uint64_t nbytes, uint32_t owner)
{
    int64_t i = _slot_of(a, off);
    if (i < 0 || !_owner_ok(owner)) return -EINVAL;
    uint64_t s = mtc_load_acquire(&a->hdr->slots[i]); /* pairs with the claimer's CAS */
    if (!_IS_HEAD(s) || _PID(s) != owner) return -EINVAL;
    uint64_t len = _LEN(s);
    if (!len || (uint64_t)i + len > a->nslots || nbytes > len * a->slot_bytes) return -EINVAL;
    return 0;
}

int mtc_arena_retag(mtc_arena *a, uint64_t off, uint32_t from, uint32_t to)
{
    int64_t i = _slot_of(a, off);
    if (i < 0 || !_owner_ok(from) || !_owner_ok(to)) return -EINVAL;
    uint64_t s = mtc_load_acquire(&a->hdr->slots[i]);
    if (!_IS_HEAD(s) || _PID(s) != from) return -EINVAL;
    uint32_t len = _LEN(s);
    if (!len || (uint64_t)i + len > a->nslots) return -EINVAL;
    /* the head first: once it names `to`, no reclaim of `from` frees the run's head */
    uint64_t want = (s & ~0xffffffffull) | to;
    if (!atomic_compare_exchange_strong(&a->hdr->slots[i], &s, want)) return -EINVAL;
    for (uint32_t q = 1; q < len; q++) {
        uint64_t c = from;
        atomic_compare_exchange_strong(&a->hdr->slots[i + q], &c, (uint64_t)to);
    }
    return 0;
}

static void _free_run(mtc_arena *a, uint32_t i, uint32_t len)
{
    /* count first: a claimer that takes the slots right after the stores
     * below must not see the count still including them (high water) */
    _note_use(a, -(int64_t)len);
    for (uint32_t q = len; q-- > 0;) mtc_store_release(&a->hdr->slots[i + q], 0); /* pairs with claim CAS */
    mtc_fetch_add_relaxed(&a->hdr->frees, 1);
    _wake(a);
}

int mtc_arena_free(mtc_arena *a, uint64_t off, uint32_t owner)
{
    int64_t i = _slot_of(a, off);
    if (i < 0 || !_owner_ok(owner)) return -EINVAL;
    uint64_t s = mtc_load_acquire(&a->hdr->slots[i]);
    if (!_IS_HEAD(s) || _PID(s) != owner) return -EINVAL;
    uint32_t len = _LEN(s);
    if (!len || (uint64_t)i + len > a->nslots) return -EINVAL;
    _free_run(a, (uint32_t)i, len);
    return 0;
}

/* A process that exited and can never touch the arena again: gone (ESRCH),
 * or a zombie not yet reaped by its parent (kill() still succeeds on those). */
static int _pid_dead(uint32_t pid)
{
    /* no process has such a pid (a forged state word); and kill() of a
     * negative pid_t would ask about a process group */
    if (pid > INT32_MAX) return 1;
    if (kill((pid_t)pid, 0) != 0) return errno == ESRCH;
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%u/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return errno == ENOENT;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    /* "pid (comm) S ...": the state follows the last ')' (comm may hold ')') */
    char *p = strrchr(buf, ')');
    return p && p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X');
}

int mtc_arena_creator_gone(const mtc_arena *a)
{
    return _pid_dead(a->hdr->creator_pid);
}

int mtc_arena_pid_gone(uint32_t pid) { return _pid_dead(pid); }

static int _reclaimable(uint32_t pid, uint32_t keep, uint32_t only)
{
    if (!pid || pid == keep) return 0;
    if (only) return pid == only;
    return _pid_dead(pid);
}

/*
 * Frees the runs of owners that `_reclaimable` selects. It walks runs, not
 * slots: a run is taken by a CAS of its head (so a concurrent retag of the
 * same head either wins, and the run is skipped, or loses and fails), then its
 * continuations are cleared. A live head's run is stepped over whole, so a
 * retag moving its continuations one by one is never disturbed. Continuations
 * outside any run are the claims of a process that died mid-claim.
 */
static uint64_t _reclaim(mtc_arena *a, uint32_t keep, uint32_t only)
{
    uint64_t freed = 0;
    _Atomic uint64_t *sl = a->hdr->slots;
    for (uint32_t i = 0; i < a->nslots;) {
        uint64_t s = mtc_load_acquire(&sl[i]); /* pairs with the claimer's CAS */
        if (!s) {
            i++;
            continue;
        }
        if (_IS_HEAD(s)) {
            uint32_t len = _LEN(s);
            if (!len || len > a->nslots - i) len = 1; /* corrupt: treat as one slot */
            if (_reclaimable(_PID(s), keep, only) && atomic_compare_exchange_strong(&sl[i], &s, 0)) {
                uint64_t n = 1;
                for (uint32_t q = 1; q < len; q++) {
                    uint64_t c = _PID(s);
                    if (atomic_compare_exchange_strong(&sl[i + q], &c, 0)) n++;
                }
                _note_use(a, -(int64_t)n);
                freed += n;
            }
            i += len;
            continue;
        }
        /* an orphan continuation (its claimer died before claiming the head) */
        if (_reclaimable(_PID(s), keep, only) && atomic_compare_exchange_strong(&sl[i], &s, 0)) freed++;
        i++;
    }
    if (freed) {
        mtc_fetch_add_relaxed(&a->hdr->reclaims, freed);
        _wake(a);
    }
    return freed;
}

uint64_t mtc_arena_reclaim_dead(mtc_arena *a, uint32_t keep) { return _reclaim(a, keep, 0); }
uint64_t mtc_arena_reclaim_owner(mtc_arena *a, uint32_t owner) { return owner ? _reclaim(a, 0, owner) : 0; }

void mtc_arena_get_stats(mtc_arena *a, mtc_arena_stats *o)
{
    mtc_arena_header *h = a->hdr;
    o->bytes = (uint64_t)a->nslots * a->slot_bytes;
    o->slot_bytes = a->slot_bytes;
    o->nslots = a->nslots;
    o->allocs = mtc_load_relaxed(&h->allocs);
    o->frees = mtc_load_relaxed(&h->frees);
    o->waits = mtc_load_relaxed(&h->waits);
    o->timeouts = mtc_load_relaxed(&h->timeouts);
    o->reclaims = mtc_load_relaxed(&h->reclaims);
    o->slots_in_use = mtc_load_relaxed(&h->slots_in_use);
    o->high_water = mtc_load_relaxed(&h->high_water);
}

void mtc_arena_usage(mtc_arena *a, uint32_t owner, mtc_arena_usage_t *u)
{
    memset(u, 0, sizeof *u);
    for (uint32_t i = 0; i < a->nslots; i++) {
        uint64_t s = mtc_load_relaxed(&a->hdr->slots[i]);
        if (!s) continue;
        int mine = (uint32_t)s == owner;
        int head = (s & MTC_ARENA_HEAD) != 0;
        if (mine) {
            u->owner_slots++;
            u->owner_regions += head;
        } else {
            u->other_slots++;
            u->other_regions += head;
        }
    }
}

int mtc_arena_valid(mtc_arena *a)
{
    uint64_t used = 0;
    for (uint32_t i = 0; i < a->nslots;) {
        uint64_t s = mtc_load_acquire(&a->hdr->slots[i]);
        if (!s) {
            i++;
            continue;
        }
        if (!_IS_HEAD(s)) return 0; /* a continuation without its head */
        uint32_t len = _LEN(s);
        if (!len || (uint64_t)i + len > a->nslots) return 0;
        for (uint32_t q = 1; q < len; q++)
            if (mtc_load_acquire(&a->hdr->slots[i + q]) != (uint64_t)_PID(s)) return 0;
        used += len;
        i += len;
    }
    return used == mtc_load_relaxed(&a->hdr->slots_in_use);
}
