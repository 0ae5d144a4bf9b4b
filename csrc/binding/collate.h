/*
 * collate.h - the packed-batch side (the engine side of mtc_loader.collate):
 * pack() in a DataLoader worker and unpack() in the main process, over the
 * Arena type (arenaobj.h, included here for module.c). GIL held; functions
 * return a new reference, or NULL with an exception set.
 */
#ifndef MTC_COLLATE_H
#define MTC_COLLATE_H

#include "arenaobj.h"
#include "state.h"

/* _engine.pack(arena, data, align, timeout_s[, consumer_pid[, in_flight]])
 *   -> (offset, nbytes, layout, skeleton, atoms) */
PyObject *mtc_collate_pack(PyObject *module, PyObject *const *args, Py_ssize_t nargs);

/* _engine.unpack(arena, offset, nbytes, owner, layout, skeleton, target, background) -> Handle */
PyObject *mtc_collate_unpack(PyObject *module, PyObject *const *args, Py_ssize_t nargs);

#endif /* MTC_COLLATE_H */
