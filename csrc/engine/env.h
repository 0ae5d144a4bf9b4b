/*
 * env.h - the engine's MTC_* environment variables, each read through one
 * strict parser for its kind (integer in a range, boolean, one of a few
 * words). A value is taken whole or not at all: "512MB", "1e99" or "10" for
 * a boolean are not half-read; they are refused, the caller's default is
 * used, and the refusal is recorded once per variable, for the binding
 * layer to warn about (mtc_env_take_problem).
 *
 * No Python here; any thread may call these (the problem list has a lock).
 * Names starting with `_` are internal to env.c.
 */
#ifndef MTC_ENV_H
#define MTC_ENV_H

#include <stddef.h>
#include <stdint.h>

typedef enum {
    MTC_ENV_PINNED_CAP_BYTES,
    MTC_ENV_NO_BATCH_MEMCPY,
    MTC_ENV_SLAB_HUGEPAGES,
    MTC_ENV_H2D_RING,
    MTC_ENV_INLINE_MAX_BYTES,
    MTC_ENV_EARLY_GC,
    MTC_ENV_HELPER_THREADS,
    MTC_ENV_FILE_READER,
    MTC_ENV_URING_DEPTH,
    MTC_ENV_FILE_DIRECT,
    MTC_ENV_ARENA_POPULATE,
    MTC_ENV_URING_MAX_IO,
    MTC_ENV_TORCH_SHIM,
    MTC_ENV_C_HANDOFF,
    MTC_ENV_QUIET_PIPES,
    MTC_ENV_PACK_NT,
    MTC_ENV_COUNT
} mtc_env_id;

/* The variable's name ("MTC_PINNED_CAP_BYTES"). */
const char *mtc_env_name(mtc_env_id id);

/* An integer variable: 1 with *out set when it is set to a decimal integer
 * (surrounding blanks allowed) within its range; 0 when unset or empty; -1
 * when set to anything else (problem recorded; *out untouched). */
int mtc_env_int(mtc_env_id id, int64_t *out);

/* A boolean variable: 1/0, true/false, yes/no, on/off (any case). The value,
 * or dflt when unset, empty or refused (problem recorded). */
int mtc_env_bool(mtc_env_id id, int dflt);

/* A word variable: the index of its value among the variable's words, or
 * dflt when unset, empty or refused (problem recorded). */
int mtc_env_enum(mtc_env_id id, int dflt);

/* Checks every variable (as the readers would), recording the problems. */
void mtc_env_check_all(void);

/* Copies the next problem not yet taken into buf (a message naming the
 * variable, its value, what it accepts and what is used instead) and returns
 * 1; 0 when none is left. Each variable's problem is taken once. */
int mtc_env_take_problem(char *buf, size_t cap);

#endif /* MTC_ENV_H */
