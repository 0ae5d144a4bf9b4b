/*
 * pipes.h - the _engine functions over multiprocessing.connection pipes that
 * the prefetch service uses to take a DataLoader's result and send its next
 * indices without giving up the GIL where nothing has to wait
 * (mtc_loader/prefetch/_pipes.py; the pipe work is csrc/engine/pipe.c's).
 * GIL held; each returns a new reference, or NULL with an exception set.
 */
#ifndef MTC_PIPES_H
#define MTC_PIPES_H

#include "state.h"

/* pipe_take(fd) -> bytes or None: the next message of the pipe when a whole
 * header is waiting (its payload read GIL-free if it is not all there yet),
 * else None with nothing read. */
PyObject *mtc_pipes_take(PyObject *module, PyObject *fd);

/* pipe_put(fd, payload) -> bool: True when the message (header and payload,
 * at most PIPE_BUF bytes in all) was written with one write that could not
 * block; False with nothing written otherwise (too long, a pipe too full, a
 * reader gone: the caller sends it the usual way, which reports that). */
PyObject *mtc_pipes_put(PyObject *module, PyObject *const *args, Py_ssize_t nargs);

/* _quiet_pipes() -> bool: MTC_QUIET_PIPES (default on). */
PyObject *mtc_pipes_on(PyObject *module, PyObject *unused);

#endif /* MTC_PIPES_H */
