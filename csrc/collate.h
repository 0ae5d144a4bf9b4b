/*
 * collate.h - the packed-batch side (the engine side of mtc_loader.collate):
 * the Arena type over a shared memfd arena (arena.c), pack() in a DataLoader
 * worker and unpack() in the main process. GIL held; functions return a new
 * reference, or NULL with an exception set.
 */
#ifndef MTC_COLLATE_H
#define MTC_COLLATE_H

#include "module.h"

/* The Arena heap type's spec (module.c creates the type in its exec slot). */
extern PyType_Spec mtc_arena_spec;

/* _engine.arena_create(nbytes) -> Arena (a new sealed memfd arena). */
PyObject *mtc_collate_arena_create(PyObject *module, PyObject *arg);

/* _engine.arena_attach(fd) -> Arena (maps an arena handed to this process). */
PyObject *mtc_collate_arena_attach(PyObject *module, PyObject *arg);

/* _engine.pack(arena, data, align, timeout_s) -> (offset, nbytes, layout, skeleton) */
PyObject *mtc_collate_pack(PyObject *module, PyObject *const *args, Py_ssize_t nargs);

/* _engine.unpack(arena, offset, nbytes, owner, layout, skeleton, target, background) -> Handle */
PyObject *mtc_collate_unpack(PyObject *module, PyObject *const *args, Py_ssize_t nargs);

#endif /* MTC_COLLATE_H */
