/*
 * files.h - the binding layer of file-backed leaves (mtc_loader.FileTensor):
 * their metadata for the traversal, the exception a failed read becomes,
 * the one-time fallback warning, and the _engine functions of the reader.
 * GIL held. The reads themselves are uring.c's, run by transfer.c's ops.
 */
#ifndef MTC_FILES_H
#define MTC_FILES_H

#include "state.h"
#include "plan.h"

/*
 * Reads a FileTensor's metadata from its `_spec` bytes: *l gets dtype,
 * elsize, ndim, dev (CPU), data (the spec's address: what the reads use) and
 * MTC_LEAF_FILE; dims (room for MTC_MAX_NDIM) its shape; *spec a new
 * reference to the bytes, which must outlive every read of the leaf. Warns
 * once per process (RuntimeWarning) when reads fall back to pread without
 * being asked to. 0, or -1 with an exception.
 */
int mtc_files_leaf(mtc_state *st, PyObject *obj, mtc_leaf *l, int64_t *dims, PyObject **spec);

/*
 * The exception for a failed read of a file leaf whose spec is `spec` (the
 * leaf's data: its spec bytes) and whose place in the batch is `where` (a
 * str, borrowed): part `part` (its path and byte range named), `err` a
 * negative errno (or -ENODATA: the file is too short, `got` bytes of the part
 * arrived). A new reference to an OSError subclass chosen by errno
 * (FileNotFoundError, PermissionError, ...) with a message that starts with
 * "mtc_loader:" and names the leaf's place in the batch, or NULL with an
 * exception set.
 */
PyObject *mtc_files_error(const void *spec, PyObject *where, uint32_t part, int err, uint64_t got);

/* Adds the reader's counters to a stats dict. 0 or -1. */
int mtc_files_stats(PyObject *d);

/* _engine.file_reader() -> (mode, reason or None, forced) */
PyObject *mtc_files_reader(PyObject *module, PyObject *unused);

/* _engine.file_configure(depth, max_io, direct, mode): tests. */
PyObject *mtc_files_configure(PyObject *module, PyObject *args);

#endif /* MTC_FILES_H */
