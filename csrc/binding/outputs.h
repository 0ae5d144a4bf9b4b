/*
 * outputs.h - the torch boundary of the outputs (GIL held everywhere): new
 * tensors from torch.empty, their data pointers, the output views of packed
 * segments over a chunk buffer (a handful of torch calls per segment, not one
 * per tensor), device objects, and the capture of each device's current
 * stream. Functions return 0 / a new reference, or -1 / NULL with an
 * exception set. Names starting with `_` are internal to outputs.c.
 */
#ifndef MTC_OUTPUTS_H
#define MTC_OUTPUTS_H

#include "state.h"
#include "plan.h"
#include "transfer.h"
#include "traverse.h"

/* The shape of leaf l from dimension `from` on, as a tuple. New reference. */
PyObject *mtc_out_shape(const mtc_tree *t, const mtc_leaf *l, int from);

/* torch.empty(shape, dtype=dtype, device=device[, pin_memory=True]). New reference. */
PyObject *mtc_out_empty(mtc_state *st, PyObject *shape, PyObject *dtype, PyObject *device, int pin);

/* A new tensor of leaf l's shape (the tuple `shape`), dtype and output
 * strides (t->ostrides: MTC_LEAF_STRIDED) on `device` (pinned when pin),
 * what tensor.to() makes: proto.new_empty_strided(...), where *proto is an
 * empty uint8 tensor made on first use (the caller releases it). New
 * reference. */
PyObject *mtc_out_empty_strided(mtc_state *st, PyObject *shape, const mtc_tree *t, const mtc_leaf *l,
                                PyObject *device, int pin, PyObject **proto);

/* tensor.data_ptr() into *out. 0 or -1. */
int mtc_out_data_ptr(mtc_state *st, PyObject *tensor, uintptr_t *out);

/* Creates the output views of every segment of plan p over the chunk tensors
 * (a leaf with MTC_LEAF_STRIDED, alone in its segment, is viewed with its
 * output strides, t->ostrides)
 * chunk_t (1-D uint8, each at offset 0 of its own storage, since the views are
 * made with as_strided at storage offsets, and each chunk_skip[c] + the plan's
 * payload of chunk c bytes long; chunk c starts chunk_skip[c] bytes
 * in, at 0 when chunk_skip is NULL: start_copy and unpack put every chunk at
 * 0, see copy.c) and stores them (new references) in outputs[]: per chunk
 * one typed view per dtype, per segment one as_strided view, cut into its
 * members with one split_with_sizes or unbind. A segment whose start is not a
 * multiple of its element size (which the planner and the layout decoder never
 * make) is a SystemError. With `keep` not NULL, the temporary tensors made on
 * the way (typed and segment views) are appended to it, so that none is
 * dropped here (dropping a tensor releases the GIL), and a segment whose
 * members leave gaps is sliced member by member (torch's indexing keeps the
 * GIL) rather than split, which would make a piece of every gap for the
 * caller to drop. Without it they are dropped as they are used. 0 or -1. */
int mtc_out_views(mtc_state *st, const mtc_tree *t, const mtc_plan *p, PyObject *const *chunk_t,
                  const Py_ssize_t *chunk_skip, PyObject **outputs, PyObject *keep);

/* torch.device("cpu") for dev < 0, torch.device("cuda", dev) otherwise. New reference. */
PyObject *mtc_out_device(mtc_state *st, int dev);

/* Captures the current raw stream of every device in j->dev_mask into
 * j->streams (the calling thread's current streams). 0 or -1. */
int mtc_out_capture_streams(mtc_state *st, mtc_job *j);

#endif /* MTC_OUTPUTS_H */
