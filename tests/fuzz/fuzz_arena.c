/*
 * fuzz_arena.c - fuzzes the shared arena (csrc/engine/arena.h) against a hostile
 * header: every process that maps the arena can write its header and slot
 * table, and a descriptor's offsets come from a worker.
 *
 * Byte 0 (bit 0) selects the arena:
 *   real   an arena from mtc_arena_create (1..8 slots), whose header and slot
 *          words are then overwritten with fuzz bytes (patches), as a rogue
 *          worker could; operations run on the creator's arena (private,
 *          trusted geometry, untrusted slot words) and on a second mapping
 *          from mtc_arena_attach when that accepts the file.
 *   fake   a file crafted from fuzz bytes (an unsealed memfd of any size,
 *          header fields right or fuzzed), handed to mtc_arena_attach.
 * mtc_arena_attach must fail or give geometry inside the file. Then a
 * sequence of operations with fuzzed offsets, owners and sizes (try_alloc,
 * alloc with timeout 0, check, retag, free, reclaim_owner, reclaim_dead,
 * stats, valid, and more slot-word patches in between) must keep every
 * access inside the mapping: the data area of every mapping is made
 * PROT_NONE (the allocator never touches data) and PROT_NONE guard pages are
 * put right after and before each mapping where the address space is free,
 * so a stray access faults and ASan reports it. Successful calls must return
 * regions inside the data area; and when an input made no hostile write, the
 * arena must still pass mtc_arena_valid() after all its calls.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "arena.h"
#include "fuzz.h"

#define MAX_SLOTS 8
#define MAX_OPS 64

static uint64_t page_size(void)
{
    static uint64_t ps;
    if (!ps) ps = (uint64_t)sysconf(_SC_PAGESIZE);
    return ps;
}

static uint64_t header_bytes(uint64_t nslots)
{
    uint64_t h = sizeof(mtc_arena_header) + nslots * sizeof(uint64_t);
    return (h + page_size() - 1) / page_size() * page_size();
}

/* PROT_NONE guard pages around [base, base+bytes) where nothing is mapped yet */
typedef struct guards {
    void *pre, *post;
} guards;

static guards guard(uint8_t *base, size_t bytes)
{
    guards g = {NULL, NULL};
    size_t ps = page_size();
    uint8_t *want[2] = {base + ((bytes + ps - 1) / ps * ps), base - ps};
    for (int k = 0; k < 2; k++) {
        void *q = mmap(want[k], ps, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
        if (q == MAP_FAILED) continue;
        if (q != want[k]) { /* a kernel without MAP_FIXED_NOREPLACE took it as a hint */
            munmap(q, ps);
            continue;
        }
        if (k) g.pre = q;
        else g.post = q;
    }
    return g;
}

static void unguard(guards g)
{
    if (g.post) munmap(g.post, page_size());
    if (g.pre) munmap(g.pre, page_size());
}

/* The allocator never reads or writes slot data: make it inaccessible. */
static void protect_data(mtc_arena *a)
{
    FZ_CHECK(a->data_offset <= a->bytes && a->data_offset % page_size() == 0);
    if (a->bytes > a->data_offset)
        FZ_CHECK(mprotect(a->base + a->data_offset, a->bytes - a->data_offset, PROT_NONE) == 0);
}

/* geometry of an arena as this process uses it: inside the mapping */
static void check_geometry(const mtc_arena *a, uint64_t file_bytes)
{
    FZ_CHECK(a->bytes == file_bytes, "mapping %zu, file %llu", a->bytes, (unsigned long long)file_bytes);
    FZ_CHECK(a->nslots >= 1 && a->slot_bytes >= 1, "nslots %u slot_bytes %llu", a->nslots,
             (unsigned long long)a->slot_bytes);
    FZ_CHECK(sizeof(mtc_arena_header) + (uint64_t)a->nslots * sizeof(uint64_t) <= a->data_offset,
             "slot table (%u) past data_offset %llu", a->nslots, (unsigned long long)a->data_offset);
    uint64_t data;
    FZ_CHECK(!__builtin_mul_overflow((uint64_t)a->nslots, a->slot_bytes, &data) && a->data_offset <= a->bytes &&
                 data <= a->bytes - a->data_offset,
             "%u slots of %llu at %llu exceed %zu", a->nslots, (unsigned long long)a->slot_bytes,
             (unsigned long long)a->data_offset, a->bytes);
    FZ_CHECK((uint8_t *)a->hdr == a->base);
}

/* a region [off, off+nbytes) a call accepted: whole slots inside the data area */
static void check_region(const mtc_arena *a, uint64_t off, uint64_t nbytes, const char *what)
{
    FZ_CHECK(off >= a->data_offset && (off - a->data_offset) % a->slot_bytes == 0 && off < a->bytes &&
                 nbytes <= a->bytes - off,
             "%s: region [%llu, +%llu) outside the data area [%llu, %zu)", what, (unsigned long long)off,
             (unsigned long long)nbytes, (unsigned long long)a->data_offset, a->bytes);
}

static uint64_t fuzz_off(fz *f, const mtc_arena *a)
{
    uint8_t k = fz_u8(f);
    switch (k & 3) {
    case 0: return a->data_offset + (uint64_t)fz_below(f, a->nslots + 2) * a->slot_bytes; /* a slot (or past) */
    case 1: return a->data_offset + (uint64_t)fz_below(f, a->nslots + 2) * a->slot_bytes + (int8_t)fz_u8(f);
    case 2: return fz_u64(f);
    default: return (uint64_t)fz_u32(f);
    }
}

static uint32_t fuzz_owner(fz *f, uint32_t me)
{
    uint8_t k = fz_u8(f);
    switch (k & 3) {
    case 0: return me;
    case 1: return (uint32_t)fz_below(f, 4);       /* 0 (invalid), tiny pids */
    case 2: return fz_u32(f);                       /* any, past INT32_MAX too */
    default: return 0x7ffffff0u + fz_below(f, 32); /* around INT32_MAX */
    }
}

static uint64_t fuzz_nbytes(fz *f, const mtc_arena *a)
{
    uint8_t k = fz_u8(f);
    switch (k & 3) {
    case 0: return fz_below(f, (a->nslots + 2) * a->slot_bytes);
    case 1: return (uint64_t)fz_below(f, a->nslots + 2) * a->slot_bytes;
    case 2: return fz_u64(f);
    default: return 0;
    }
}

/* a state word as a worker could write it */
static uint64_t fuzz_word(fz *f, uint32_t me)
{
    uint8_t k = fz_u8(f);
    uint64_t len = fz_below(f, 12);
    switch (k & 3) {
    case 0: return 0;
    case 1: return MTC_ARENA_HEAD | (len << 32) | ((k & 4) ? me : fz_u32(f));
    case 2: return (k & 4) ? me : fz_u32(f);
    default: return fz_u64(f);
    }
}

static void patch_slot(mtc_arena *a, fz *f, uint32_t me)
{
    uint32_t i = (uint32_t)fz_below(f, a->nslots);
    atomic_store(&a->hdr->slots[i], fuzz_word(f, me));
}

/* Returns the number of slot words it overwrote (hostile writes). */
static int run_ops(mtc_arena *a, fz *f, uint32_t me)
{
    int patched = 0;
    int nops = (int)fz_below(f, MAX_OPS + 1);
    for (int k = 0; k < nops && fz_left(f); k++) {
        uint8_t op = fz_u8(f);
        uint64_t off, nbytes, got;
        uint32_t owner, to;
        int rc;
        switch (op % 10) {
        case 0:
        case 1:
            nbytes = fuzz_nbytes(f, a);
            owner = fuzz_owner(f, me);
            rc = op % 10 ? mtc_arena_alloc(a, nbytes, owner, 0, &got) : mtc_arena_try_alloc(a, nbytes, owner, &got);
            FZ_CHECK(rc == 0 || rc == -ENOSPC || rc == -E2BIG || rc == -EINVAL || rc == -ETIMEDOUT,
                     "alloc rc %d", rc);
            if (rc == 0) {
                fz_stat(4, "op: alloc ok");
                FZ_CHECK(owner && owner <= INT32_MAX, "alloc for owner %u", owner);
                check_region(a, got, nbytes ? nbytes : 1, "alloc");
                /* just allocated, single-threaded: it is ours */
                FZ_CHECK(mtc_arena_check(a, got, nbytes, owner) == 0, "fresh region fails check");
            }
            break;
        case 2:
            off = fuzz_off(f, a);
            nbytes = fuzz_nbytes(f, a);
            owner = fuzz_owner(f, me);
            rc = mtc_arena_check(a, off, nbytes, owner);
            FZ_CHECK(rc == 0 || rc == -EINVAL, "check rc %d", rc);
            if (rc == 0) {
                fz_stat(5, "op: check ok");
                check_region(a, off, nbytes, "check");
            }
            break;
        case 3:
            off = fuzz_off(f, a);
            owner = fuzz_owner(f, me);
            to = fuzz_owner(f, me);
            rc = mtc_arena_retag(a, off, owner, to);
            FZ_CHECK(rc == 0 || rc == -EINVAL, "retag rc %d", rc);
            if (rc == 0) {
                fz_stat(6, "op: retag ok");
                check_region(a, off, 1, "retag");
            }
            break;
        case 4:
            off = fuzz_off(f, a);
            owner = fuzz_owner(f, me);
            rc = mtc_arena_free(a, off, owner);
            FZ_CHECK(rc == 0 || rc == -EINVAL, "free rc %d", rc);
            if (rc == 0) {
                fz_stat(7, "op: free ok");
                check_region(a, off, 1, "free");
            }
            break;
        case 5:
            FZ_CHECK(mtc_arena_reclaim_owner(a, fuzz_owner(f, me)) <= a->nslots);
            break;
        case 6:
            /* kill(pid, 0) on fuzzed pids: signal 0 only tests for existence */
            FZ_CHECK(mtc_arena_reclaim_dead(a, fuzz_owner(f, me)) <= a->nslots);
            break;
        case 7: {
            mtc_arena_stats s;
            mtc_arena_get_stats(a, &s);
            FZ_CHECK(s.nslots == a->nslots && s.slot_bytes == a->slot_bytes);
            (void)mtc_arena_valid(a); /* 0 or 1 on a hostile header; must not fault */
            break;
        }
        default:
            patch_slot(a, f, me);
            patched++;
            break;
        }
    }
    return patched;
}

/* patches: (field selector / offset, bytes) written over the header page(s) */
static int patch_header(uint8_t *base, uint64_t header_len, fz *f, uint32_t me)
{
    mtc_arena_header *h = (mtc_arena_header *)base;
    int npatch = (int)fz_below(f, 8);
    for (int k = 0; k < npatch; k++) {
        uint8_t sel = fz_u8(f);
        switch (sel % 8) {
        case 0: h->nslots = (sel & 8) ? h->nslots + (uint32_t)(int8_t)fz_u8(f) : fz_u32(f); break;
        case 1:
            h->data_offset = (sel & 8) ? h->data_offset + (uint64_t)(int64_t)(int16_t)fz_u16(f) : fz_u64(f);
            break;
        case 2: h->slot_bytes = (sel & 8) ? h->slot_bytes * 2 : fz_u64(f); break;
        case 3: h->magic = fz_u64(f); break;
        case 4: h->version = fz_u32(f); break;
        case 5: atomic_store(&h->hint, fz_u32(f)); break;
        case 6: atomic_store(&h->slots[fz_below(f, MAX_SLOTS)], fuzz_word(f, me)); break; /* within the header page */
        default: { /* raw bytes anywhere in the header page(s) */
            uint64_t at = fz_below(f, header_len);
            uint64_t nb = 1 + fz_below(f, 16);
            for (uint64_t j = 0; j < nb && at + j < header_len; j++) base[at + j] = fz_u8(f);
            break;
        }
        }
    }
    return npatch;
}

static void real_mode(fz *f, uint32_t me)
{
    uint32_t nslots = 1 + (uint32_t)fz_below(f, MAX_SLOTS);
    mtc_arena *a = NULL;
    int rc = mtc_arena_create((size_t)nslots * MTC_ARENA_SLOT_BYTES - fz_below(f, 4096), &a);
    FZ_CHECK(rc == 0, "mtc_arena_create: %d", rc);
    FZ_CHECK(a->nslots == nslots && mtc_arena_valid(a));
    check_geometry(a, a->bytes);
    /* the creator's geometry is private; its slot words are anyone's */
    int hostile = 0;
    for (int k = (int)fz_below(f, 4); k > 0; k--, hostile++) patch_slot(a, f, me);
    hostile += patch_header(a->base, a->data_offset, f, me);
    mtc_arena *b = NULL;
    rc = mtc_arena_attach(a->fd, &b);
    FZ_CHECK(rc == 0 || rc == -EINVAL, "attach rc %d", rc);
    if (rc) fz_stat(0, "real: attach refused");
    else fz_stat(1, "real: attach ok");
    guards ga = guard(a->base, a->bytes), gb = {NULL, NULL};
    protect_data(a);
    if (rc == 0) {
        check_geometry(b, a->bytes);
        FZ_CHECK(b->nslots == a->nslots && b->data_offset == a->data_offset && b->slot_bytes == a->slot_bytes,
                 "attached geometry differs from the file's");
        gb = guard(b->base, b->bytes);
        protect_data(b);
    }
    /* interleave operations through both mappings */
    hostile += run_ops(a, f, me);
    if (b) hostile += run_ops(b, f, me);
    hostile += run_ops(a, f, me);
    /* no hostile write: whatever the calls, the slot table is consistent (runs with
     * their continuations, the in-use count matching) */
    if (!hostile) {
        fz_stat(8, "real: no hostile write");
        FZ_CHECK(mtc_arena_valid(a) == 1, "a sequence of calls broke the arena's invariants");
    }
    if (b) mtc_arena_unref(b);
    mtc_arena_unref(a);
    unguard(ga);
    unguard(gb);
}

static int fake_fd = -1;

static void fake_mode(fz *f, uint32_t me)
{
    if (fake_fd < 0) {
        fake_fd = (int)syscall(SYS_memfd_create, "fuzz_arena_fake", MFD_CLOEXEC);
        FZ_CHECK(fake_fd >= 0);
    }
    uint8_t k = fz_u8(f);
    uint32_t nslots = (k & 1)   ? (uint32_t)fz_below(f, MAX_SLOTS + 2)
                      : (k & 2) ? fz_u32(f)
                                : 1 + (uint32_t)fz_below(f, 4);
    uint64_t data_offset = (k & 4) ? fz_u64(f) : header_bytes(nslots);
    uint64_t slot_bytes = (k & 8) ? fz_u64(f) : MTC_ARENA_SLOT_BYTES;
    uint64_t want = data_offset + (uint64_t)nslots * slot_bytes; /* wraps on hostile values: fine */
    uint64_t size;
    switch ((k >> 4) & 3) {
    case 0: size = want; break;
    case 1: size = want + (uint64_t)(int64_t)(int16_t)fz_u16(f); break;
    case 2: size = fz_below(f, 3 * MTC_ARENA_SLOT_BYTES); break;
    default: size = header_bytes(MAX_SLOTS) + (uint64_t)fz_below(f, MAX_SLOTS + 1) * MTC_ARENA_SLOT_BYTES; break;
    }
    if (size > header_bytes(MAX_SLOTS + 2) + (MAX_SLOTS + 2) * MTC_ARENA_SLOT_BYTES) /* keep files small */
        size = fz_below(f, 3 * MTC_ARENA_SLOT_BYTES);
    FZ_CHECK(ftruncate(fake_fd, 0) == 0 && ftruncate(fake_fd, (off_t)size) == 0);
    /* the header, in the first page(s) of the file */
    size_t hlen = (size_t)(header_bytes(MAX_SLOTS + 2) < size ? header_bytes(MAX_SLOTS + 2) : size);
    uint8_t *hdr = calloc(1, header_bytes(MAX_SLOTS + 2));
    FZ_CHECK(hdr);
    mtc_arena_header *h = (mtc_arena_header *)hdr;
    h->magic = (k & 0x40) ? fz_u64(f) : MTC_ARENA_MAGIC;
    h->version = (k & 0x80) ? fz_u32(f) : MTC_ARENA_VERSION;
    h->creator_pid = me;
    h->arena_bytes = size;
    h->data_offset = data_offset;
    h->slot_bytes = slot_bytes;
    h->nslots = nslots;
    for (uint32_t i = 0; i < MAX_SLOTS + 2; i++) atomic_store(&h->slots[i], fz_u8(f) & 1 ? fuzz_word(f, me) : 0);
    patch_header(hdr, header_bytes(MAX_SLOTS + 2), f, me);
    if (hlen) FZ_CHECK(pwrite(fake_fd, hdr, hlen, 0) == (ssize_t)hlen);
    free(hdr);
    mtc_arena *b = NULL;
    int rc = mtc_arena_attach(fake_fd, &b);
    FZ_CHECK(rc == 0 || rc == -EINVAL, "attach rc %d (file %llu bytes)", rc, (unsigned long long)size);
    if (rc) {
        fz_stat(2, "fake: attach refused");
        return;
    }
    fz_stat(3, "fake: attach ok");
    check_geometry(b, size);
    guards gb = guard(b->base, b->bytes);
    protect_data(b);
    run_ops(b, f, me);
    mtc_arena_unref(b);
    unguard(gb);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static uint32_t me;
    if (!me) me = (uint32_t)getpid();
    fz f = {data, data + size};
    uint8_t mode = fz_u8(&f);
    if (mode & 1) fake_mode(&f, me);
    else real_mode(&f, me);
    return 0;
}
