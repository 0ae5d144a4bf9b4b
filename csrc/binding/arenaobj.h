/*
 * arenaobj.h - the _engine.Arena type over a shared memfd arena (arena.c),
 * used by pack (collate.c) and unpack (unpack.c) and created by module.c. GIL held;
 * functions return a new reference, or NULL with an exception set, unless
 * said otherwise.
 */
#ifndef MTC_ARENAOBJ_H
#define MTC_ARENAOBJ_H

#include "arena.h"
#include "state.h"

/* An _engine.Arena object. */
typedef struct {
    PyObject_HEAD
    mtc_arena *a;
    int registered_dev;  /* device it was page-locked with, -1 none */
} mtc_arena_object;

/* The Arena heap type's spec (module.c creates the type in its exec slot). */
extern PyType_Spec mtc_arena_spec;

/* _engine.arena_create(nbytes) -> Arena (a new sealed memfd arena). */
PyObject *mtc_collate_arena_create(PyObject *module, PyObject *arg);

/* _engine.arena_attach(fd) -> Arena (maps an arena handed to this process). */
PyObject *mtc_collate_arena_attach(PyObject *module, PyObject *arg);

/* The arena of an _engine.Arena object (borrowed), or NULL with TypeError. */
mtc_arena *mtc_arenaobj_of(mtc_state *st, PyObject *o);

/* A descriptor's region offset, an int in [0, 2^64), and owner, a pid in
 * 1 .. INT32_MAX, never truncated. 0, or -1 with ValueError. */
int mtc_arenaobj_parse_offset(PyObject *v, uint64_t *out);
int mtc_arenaobj_parse_owner(PyObject *v, uint32_t *out);

#endif /* MTC_ARENAOBJ_H */
