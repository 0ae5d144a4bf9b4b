/*
 * env.c - the engine's MTC_* environment variables (see env.h): one table of
 * what each accepts, one parser per kind, and the problems recorded for the
 * binding layer to warn about.
 */
#include "env.h"

#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

enum { _INT, _BOOL, _ENUM };

typedef struct {
    const char *name;
    int kind;
    int64_t lo, hi;            /* _INT: the range accepted */
    const char *const *words;  /* _ENUM: the words accepted, NULL-terminated */
    const char *used;          /* what a refused value leaves in force */
} _var;

static const char *const _readers[] = {"pread", "uring", NULL};
static const char *const _direct[] = {"0", "1", "auto", "always", NULL};

static const _var _vars[MTC_ENV_COUNT] = {
    [MTC_ENV_PINNED_CAP_BYTES] = {"MTC_PINNED_CAP_BYTES", _INT, 1, INT64_MAX, NULL, "the default cap (1 GiB)"},
    [MTC_ENV_NO_BATCH_MEMCPY] = {"MTC_NO_BATCH_MEMCPY", _BOOL, 0, 0, NULL, "the default (off: batched copies)"},
    [MTC_ENV_SLAB_HUGEPAGES] = {"MTC_SLAB_HUGEPAGES", _BOOL, 0, 0, NULL, "the default (off)"},
    [MTC_ENV_H2D_RING] = {"MTC_H2D_RING", _INT, 0, 64, NULL, "the default (16 slabs)"},
    [MTC_ENV_INLINE_MAX_BYTES] = {"MTC_INLINE_MAX_BYTES", _INT, 0, INT64_MAX, NULL, "the default (1 MiB)"},
    [MTC_ENV_EARLY_GC] = {"MTC_EARLY_GC", _BOOL, 0, 0, NULL, "the default (on)"},
    [MTC_ENV_HELPER_THREADS] = {"MTC_HELPER_THREADS", _INT, 0, 16, NULL,
                                "the default (CPU count - 2, at least 1, at most 16)"},
    [MTC_ENV_FILE_READER] = {"MTC_FILE_READER", _ENUM, 0, 0, _readers,
                             "the default (io_uring where it works, else pread)"},
    [MTC_ENV_URING_DEPTH] = {"MTC_URING_DEPTH", _INT, 0, 32768, NULL, "the default (128 entries)"},
    [MTC_ENV_FILE_DIRECT] = {"MTC_FILE_DIRECT", _ENUM, 0, 0, _direct,
                             "the default (auto: O_DIRECT for what the page cache does not hold)"},
    [MTC_ENV_ARENA_POPULATE] = {"MTC_ARENA_POPULATE", _BOOL, 0, 0, NULL, "the default (on)"},
    [MTC_ENV_URING_MAX_IO] = {"MTC_URING_MAX_IO", _INT, 0, INT64_MAX, NULL, "the default (0: unlimited)"},
    [MTC_ENV_TORCH_SHIM] = {"MTC_TORCH_SHIM", _BOOL, 0, 0, NULL, "the default (on where torch has its C shim)"},
    [MTC_ENV_C_HANDOFF] = {"MTC_C_HANDOFF", _BOOL, 0, 0, NULL, "the default (on)"},
    [MTC_ENV_QUIET_PIPES] = {"MTC_QUIET_PIPES", _BOOL, 0, 0, NULL, "the default (on)"},
    [MTC_ENV_PACK_NT] = {"MTC_PACK_NT", _BOOL, 0, 0, NULL, "the default (on)"},
};

const char *mtc_env_name(mtc_env_id id) { return _vars[id].name; }

/* ---- problems: one per variable, taken once ---- */

static pthread_mutex_t _lock = PTHREAD_MUTEX_INITIALIZER;
static char _msgs[MTC_ENV_COUNT][320];
static unsigned char _recorded[MTC_ENV_COUNT], _taken[MTC_ENV_COUNT];

/* The value for a message: printable ASCII, at most 48 characters. */
static void _quote(char *dst, size_t cap, const char *v)
{
    size_t n = 0;
    for (; *v && n + 5 < cap; v++) {
        unsigned char c = (unsigned char)*v;
        if (n >= 48) {
            memcpy(dst + n, "...", 3);
            n += 3;
            break;
        }
        if (c >= 0x20 && c < 0x7f) dst[n++] = (char)c;
        else n += (size_t)snprintf(dst + n, cap - n, "\\x%02x", c);
    }
    dst[n] = 0;
}

static void _record(mtc_env_id id, const char *value)
{
    const _var *v = &_vars[id];
    char q[64], what[160];
    _quote(q, sizeof q, value);
    if (v->kind == _INT) {
        snprintf(what, sizeof what, "an integer from %lld to %lld", (long long)v->lo, (long long)v->hi);
    } else if (v->kind == _BOOL) {
        snprintf(what, sizeof what, "a boolean (1/0, true/false, yes/no, on/off)");
    } else {
        size_t n = (size_t)snprintf(what, sizeof what, "one of");
        for (const char *const *w = v->words; *w && n < sizeof what; w++)
            n += (size_t)snprintf(what + n, sizeof what - n, "%s '%s'", w == v->words ? "" : ",", *w);
    }
    pthread_mutex_lock(&_lock);
    if (!_recorded[id]) {
        snprintf(_msgs[id], sizeof _msgs[id], "mtc_loader: %s='%s' is not %s; it is ignored and %s is used",
                 v->name, q, what, v->used);
        _recorded[id] = 1;
    }
    pthread_mutex_unlock(&_lock);
}

int mtc_env_take_problem(char *buf, size_t cap)
{
    int got = 0;
    pthread_mutex_lock(&_lock);
    for (int i = 0; i < MTC_ENV_COUNT && !got; i++) {
        if (_recorded[i] && !_taken[i]) {
            _taken[i] = 1;
            snprintf(buf, cap, "%s", _msgs[i]);
            got = 1;
        }
    }
    pthread_mutex_unlock(&_lock);
    return got;
}

/* ---- the parsers ---- */

/* The value with surrounding blanks cut into buf, or NULL when unset or
 * blank (both mean: not set). */
static const char *_get(mtc_env_id id, char *buf, size_t cap, const char **raw)
{
    const char *e = getenv(_vars[id].name);
    *raw = e;
    if (!e) return NULL;
    while (isspace((unsigned char)*e)) e++;
    size_t n = strlen(e);
    while (n && isspace((unsigned char)e[n - 1])) n--;
    if (!n) return NULL;
    if (n >= cap) n = cap - 1; /* longer than any accepted value: refused below */
    memcpy(buf, e, n);
    buf[n] = 0;
    return buf;
}

int mtc_env_int(mtc_env_id id, int64_t *out)
{
    char buf[64];
    const char *raw, *s = _get(id, buf, sizeof buf, &raw);
    if (!s) return 0;
    const _var *v = &_vars[id];
    int ok = strlen(raw) < sizeof buf; /* no accepted integer is that long */
    int64_t x = 0;
    for (const char *p = s; ok && *p; p++) {
        if (*p < '0' || *p > '9' || __builtin_mul_overflow(x, 10, &x) || __builtin_add_overflow(x, *p - '0', &x))
            ok = 0;
    }
    if (ok && x >= v->lo && x <= v->hi) {
        *out = x;
        return 1;
    }
    _record(id, raw);
    return -1;
}

int mtc_env_bool(mtc_env_id id, int dflt)
{
    static const char *const yes[] = {"1", "true", "yes", "on"}, *const no[] = {"0", "false", "no", "off"};
    char buf[16];
    const char *raw, *s = _get(id, buf, sizeof buf, &raw);
    if (!s) return dflt;
    for (int i = 0; i < 4; i++) {
        if (!strcasecmp(s, yes[i])) return 1;
        if (!strcasecmp(s, no[i])) return 0;
    }
    _record(id, raw);
    return dflt;
}

int mtc_env_enum(mtc_env_id id, int dflt)
{
    char buf[32];
    const char *raw, *s = _get(id, buf, sizeof buf, &raw);
    if (!s) return dflt;
    for (int i = 0; _vars[id].words[i]; i++)
        if (!strcmp(s, _vars[id].words[i]) && strlen(raw) < sizeof buf) return i;
    _record(id, raw);
    return dflt;
}

void mtc_env_check_all(void)
{
    for (int i = 0; i < MTC_ENV_COUNT; i++) {
        int64_t x;
        if (_vars[i].kind == _INT) (void)mtc_env_int((mtc_env_id)i, &x);
        else if (_vars[i].kind == _BOOL) (void)mtc_env_bool((mtc_env_id)i, 0);
        else (void)mtc_env_enum((mtc_env_id)i, 0);
    }
}
