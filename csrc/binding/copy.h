/*
 * copy.h - the start_copy pipeline (the engine side of mtc_loader.copy):
 * read the leaves, plan, allocate outputs, submit, make views and rebuild.
 * GIL held; the copy itself runs on the transfer thread (transfer.c).
 */
#ifndef MTC_COPY_H
#define MTC_COPY_H

#include "state.h"
#include "transfer.h"
#include "traverse.h"

/* _engine.start_copy(data, target, staging, pack, align, max_chunk, background)
 * -> Handle. New reference, or NULL with an exception set. */
PyObject *mtc_copy_start(PyObject *module, PyObject *const *args, Py_ssize_t nargs);

/* Fills job item *it from leaf i of t (source, size, shape and strides when
 * not contiguous), with destination dst. Borrows t's arrays. */
void mtc_item_of_leaf(mtc_item *it, const mtc_tree *t, uint32_t i, uintptr_t dst);

#endif /* MTC_COPY_H */
