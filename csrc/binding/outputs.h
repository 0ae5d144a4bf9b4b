/*
 * outputs.h - the torch boundary of the outputs (GIL held everywhere): new
 * tensors from torch.empty, their data pointers, the outputs of packed
 * segments over a tensor per dtype of a chunk (one C call per output through
 * torch's shim, else a handful of torch calls per segment), the checks of
 * torch's modes, device
 * objects, and the capture of each device's current stream. Functions return 0 / a new reference, or -1 / NULL with an
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

/* A storage group: consecutive segments of a plan that share a chunk, a dtype
 * and host placement (MTC_LEAF_HOST). Their bytes [lo, hi) of the chunk get a
 * tensor of that dtype of their own (mtc_out_group_empty), so that outputs of
 * different dtypes never share a storage (torch.save and pickle refuse a
 * storage viewed as two dtypes). The planner lays a chunk's segments out by
 * dtype, so a chunk has one group per dtype (and per dtype of its host-placed
 * leaves); a decoded layout that interleaves dtypes only makes more groups.
 * lo is the first segment's offset, so every member's offset from its
 * group's start is still a multiple of its alignment. */
typedef struct mtc_group {
    int32_t chunk;
    uint16_t dtype;
    uint8_t host;
    int64_t lo, hi;        /* bytes [lo, hi) of the chunk: multiples of the element size */
    uint32_t seg0, nsegs;  /* segments [seg0, seg0 + nsegs) of the plan */
} mtc_group;

/* The groups of plan p (segments in plan order, each after the last in its
 * chunk) into a new PyMem array *out of *n (NULL and 0 for a plan without
 * segments). 0, or -1 with MemoryError. */
int mtc_out_groups(const mtc_tree *t, const mtc_plan *p, mtc_group **out, uint32_t *n);

/* torch.empty(((hi - lo) / element size,), dtype=the group's, device=device[,
 * pin_memory=True]): the group's tensor, whose storage its outputs share.
 * New reference. */
PyObject *mtc_out_group_empty(mtc_state *st, const mtc_group *g, PyObject *device, int pin);

/* Creates the output tensors of every segment of plan p over the group
 * tensors group_t[0..ngroups) (each of its group's dtype and hi - lo bytes, at
 * offset 0 of its own storage; a leaf with MTC_LEAF_STRIDED, alone in its
 * segment, gets its output strides, t->ostrides) and stores them (new
 * references) in outputs[]. Through torch's C shim where it is on: one C
 * call per output. Else per segment one as_strided view, cut into its members
 * with one split_with_sizes or unbind, and each member made a tensor of its
 * own for autograd (`.data`: no view record, a version counter of its own).
 * A segment whose start is not a multiple of its element size (which the
 * planner and the layout decoder never make) is a SystemError. With `keep`
 * not NULL, the temporary tensors made on the way (segment views) are
 * appended to it, so that none is dropped here (dropping a tensor releases
 * the GIL), and a segment whose members leave gaps is sliced member by member
 * (torch's indexing keeps the GIL) rather than split, which would make a
 * piece of every gap for the caller to drop. Without it they are dropped as
 * they are used. 0 or -1. */
int mtc_out_views(mtc_state *st, const mtc_tree *t, const mtc_plan *p, const mtc_group *groups, uint32_t ngroups,
                  PyObject *const *group_t, PyObject **outputs, PyObject *keep);

/* 0 when no TorchDispatchMode or TorchFunctionMode (other than torch's
 * default-device context) is active on this thread; with one, 0 when the
 * mode hands out ordinary tensors with memory (a probe: torch.empty(1)
 * under it), else -1 with RuntimeError naming the mode and what to do. The
 * engine allocates its outputs with torch.empty and writes them from C: a
 * mode that turns them into fake or meta tensors would have the engine write
 * through no memory. */
int mtc_out_check_modes(mtc_state *st);

/* torch.device("cpu") for dev < 0, torch.device("cuda", dev) otherwise. New reference. */
PyObject *mtc_out_device(mtc_state *st, int dev);

/* Captures the current raw stream of every device in j->dev_mask into
 * j->streams (the calling thread's current streams). 0 or -1. */
int mtc_out_capture_streams(mtc_state *st, mtc_job *j);

#endif /* MTC_OUTPUTS_H */
