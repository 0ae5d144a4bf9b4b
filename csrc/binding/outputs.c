/*
 * outputs.c - the torch side of the outputs: new tensors from torch.empty, their
 * data pointers, the outputs over packed chunks (a tensor per dtype of a chunk),
 * the checks of modes and pointers, device objects and the capture of current
 * streams. The only file that calls torch's tensor API (see outputs.h).
 */
#include "outputs.h"

#include <stdlib.h>
#include <string.h>

#include "shim.h"

PyObject *mtc_out_shape(const mtc_tree *t, const mtc_leaf *l, int from)
{
    PyObject *s = PyTuple_New(l->ndim - from);
    if (!s) return NULL;
    for (int d = from; d < l->ndim; d++) {
        PyObject *v = PyLong_FromLongLong(t->shape[l->dims + d]);
        if (!v) {
            Py_DECREF(s);
            return NULL;
        }
        PyTuple_SET_ITEM(s, d - from, v);
    }
    return s;
}

/* torch.empty(shape, dtype=dtype, device=device[, pin_memory=True]). New reference. */
PyObject *mtc_out_empty(mtc_state *st, PyObject *shape, PyObject *dtype, PyObject *device, int pin)
{
    PyObject *args[4] = {shape, dtype, device, Py_True};
    return PyObject_Vectorcall(st->torch_empty, args, 1, pin ? st->kw_dtype_device_pin : st->kw_dtype_device);
}

/* The output strides of leaf l (elements) from dimension `from` on, as a
 * tuple. New reference. */
static PyObject *_out_strides(const mtc_tree *t, const mtc_leaf *l, int from)
{
    PyObject *s = PyTuple_New(l->ndim - from);
    if (!s) return NULL;
    for (int d = from; d < l->ndim; d++) {
        PyObject *v = PyLong_FromLongLong(t->ostrides[l->dims + d]);
        if (!v) {
            Py_DECREF(s);
            return NULL;
        }
        PyTuple_SET_ITEM(s, d - from, v);
    }
    return s;
}

PyObject *mtc_out_empty_strided(mtc_state *st, PyObject *shape, const mtc_tree *t, const mtc_leaf *l,
                                PyObject *device, int pin, PyObject **proto)
{
    if (!*proto) {
        PyObject *zero = Py_BuildValue("(i)", 0);
        if (!zero) return NULL;
        *proto = mtc_out_empty(st, zero, st->uint8, st->device_cpu, 0);
        Py_DECREF(zero);
        if (!*proto) return NULL;
    }
    PyObject *stride = _out_strides(t, l, 0), *name = PyUnicode_FromString("new_empty_strided"), *v = NULL;
    if (stride && name) {
        PyObject *args[6] = {*proto, shape, stride, st->dtypes[l->dtype], device, Py_True};
        v = PyObject_VectorcallMethod(name, args, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                      pin ? st->kw_dtype_device_pin : st->kw_dtype_device);
    }
    Py_XDECREF(stride);
    Py_XDECREF(name);
    return v;
}

static PyObject *_call_method(PyObject *obj, PyObject *name, PyObject *const *args, size_t nargs)
{
    PyObject *stack[8];
    stack[0] = obj;
    for (size_t i = 0; i < nargs; i++) stack[i + 1] = args[i];
    return PyObject_VectorcallMethod(name, stack, (nargs + 1) | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

/* 1 when a tuple filled with unchecked new references holds a NULL (the
 * allocation failed; MemoryError is set). */
static int _tuple_has_null(PyObject *tuple)
{
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tuple); i++)
        if (!PyTuple_GET_ITEM(tuple, i)) return 1;
    return 0;
}

/* Appends a temporary tensor (a view made on the way to the outputs) to
 * `keep` when there is one. Dropping a tensor's Python object releases the
 * GIL (torch frees it without), and in a thread that shares the GIL with a
 * launch-bound one every release costs a forced switch to take it back: the
 * temporaries go with the outputs' buffers instead, and are dropped when the
 * batch is handed out. 0 or -1. */
static int _keep(PyObject *keep, PyObject *tmp)
{
    return keep ? PyList_Append(keep, tmp) : 0;
}

/* Stores the first `count` items of the sequence `parts` (torch's list or
 * tuple of views), skipping the items at the indices skip() names, as new
 * references in outputs[members[k]]. 0, or -1 with SystemError when torch
 * returned fewer views than asked for. */
static int _store_views(PyObject *parts, const mtc_tree *t, const mtc_plan *p, const mtc_seg *s,
                        int skip_padding, PyObject **outputs)
{
    if (!PyTuple_Check(parts) && !PyList_Check(parts)) goto bad;
    PyObject *fast = PySequence_Fast(parts, "views");
    if (!fast) return -1;
    Py_ssize_t j = 0, n = PySequence_Fast_GET_SIZE(fast);
    int64_t cursor = 0;
    for (uint32_t k = 0; k < s->count; k++) {
        const mtc_leaf *l = &t->leaves[p->members[s->first + k]];
        if (skip_padding) {
            if (l->slot > cursor) j++; /* the padding piece before this member */
            cursor = l->slot + t->shape[l->dims];
        }
        if (j >= n) {
            Py_DECREF(fast);
            goto bad;
        }
        outputs[p->members[s->first + k]] = Py_NewRef(PySequence_Fast_GET_ITEM(fast, j++));
    }
    if (!skip_padding && n != (Py_ssize_t)s->count) {
        Py_DECREF(fast);
        goto bad;
    }
    Py_DECREF(fast);
    return 0;
bad:
    PyErr_SetString(PyExc_SystemError, "mtc_loader: torch returned an unexpected number of views");
    return -1;
}

/* typed.as_strided(size, stride, offset): the view of a segment straight at
 * its place in the chunk, with no slice or reshape before it. Its dims are
 * proto's dims from `from` on, contiguous, with strides as torch's view()
 * makes them (a dim of 0 counts as 1), or proto's output strides for a
 * MTC_LEAF_STRIDED proto, behind a leading dim of `lead` rows
 * when lead >= 0, `lead_stride` elements apart (or contiguous with the rest
 * when lead_stride < 0). offset: elements of the dtype from the storage's
 * start. New reference, or NULL. */
static PyObject *_strided(mtc_state *st, const mtc_tree *t, const mtc_leaf *proto, int from, int64_t lead,
                          int64_t lead_stride, int64_t offset, PyObject *typed)
{
    int nd = proto->ndim - from, at = lead >= 0;
    PyObject *size = PyTuple_New(nd + at), *stride = PyTuple_New(nd + at), *off = PyLong_FromLongLong(offset);
    PyObject *v = NULL;
    if (!size || !stride || !off) goto out;
    int64_t st_el = 1;
    int own = (proto->flags & MTC_LEAF_STRIDED) != 0;
    for (int d = nd - 1; d >= 0; d--) {
        int64_t dim = t->shape[proto->dims + from + d];
        PyTuple_SET_ITEM(size, d + at, PyLong_FromLongLong(dim));
        PyTuple_SET_ITEM(stride, d + at, PyLong_FromLongLong(own ? t->ostrides[proto->dims + from + d] : st_el));
        st_el *= dim > 1 ? dim : 1; /* members have bytes: the product fits */
    }
    if (at) {
        PyTuple_SET_ITEM(size, 0, PyLong_FromLongLong(lead));
        PyTuple_SET_ITEM(stride, 0, PyLong_FromLongLong(lead_stride >= 0 ? lead_stride : st_el));
    }
    /* an item that failed to allocate is NULL: never hand torch such a tuple */
    if (_tuple_has_null(size) || _tuple_has_null(stride)) goto out;
    PyObject *args[3] = {size, stride, off};
    v = _call_method(typed, st->s_as_strided, args, 3);
out:
    Py_XDECREF(size);
    Py_XDECREF(stride);
    Py_XDECREF(off);
    return v;
}

/* [n] * count: the sizes split_with_sizes cuts `count` equal members at.
 * New list, or NULL. */
static PyObject *_equal_sizes(int64_t n, uint32_t count)
{
    PyObject *v = PyLong_FromLongLong(n), *sizes = v ? PyList_New(count) : NULL;
    if (sizes)
        for (uint32_t k = 0; k < count; k++) PyList_SET_ITEM(sizes, k, Py_NewRef(v));
    Py_XDECREF(v);
    return sizes;
}

/* A UNIFORM segment of several members at a fixed slot. Members that lie
 * back to back (the slot is their size, and they have a first dim of at
 * least one row) are one view (count * rows, *trailing) cut with one
 * split_with_sizes, which makes a view for about two thirds of what unbind
 * costs; members with room between them (or 0-dim members) are one view
 * (count, *shape), unbound. 0 or -1. */
static int _uniform_views(mtc_state *st, const mtc_tree *t, const mtc_plan *p, const mtc_seg *s,
                          PyObject *typed, int64_t offset, PyObject **outputs, PyObject *keep)
{
    const mtc_leaf *proto = &t->leaves[s->proto];
    int64_t rows = proto->ndim >= 1 ? t->shape[proto->dims] : 0;
    int packed = rows > 0 && s->row_bytes == proto->nbytes && (int64_t)s->count <= INT64_MAX / rows;
    int rc = -1;
    PyObject *shaped, *parts = NULL, *arg = NULL;
    if (packed)
        shaped = _strided(st, t, proto, 1, rows * (int64_t)s->count, -1, offset, typed);
    else
        shaped = _strided(st, t, proto, 0, s->count, s->row_bytes / proto->elsize, offset, typed);
    if (!shaped || _keep(keep, shaped)) goto out;
    if (!(arg = packed ? _equal_sizes(rows, s->count) : PyLong_FromLong(0))) goto out;
    parts = _call_method(shaped, packed ? st->s_split_with_sizes : st->s_unbind, &arg, 1);
    if (parts && !_keep(keep, parts)) rc = _store_views(parts, t, p, s, 0, outputs);
out:
    Py_XDECREF(shaped);
    Py_XDECREF(arg);
    Py_XDECREF(parts);
    return rc;
}

/* The row counts split_with_sizes cuts a SPLIT segment at: each member's
 * rows, with a padding piece before a member that does not start where the
 * last one ended, and one after the last. New list, or NULL. */
static PyObject *_split_sizes(const mtc_tree *t, const mtc_plan *p, const mtc_seg *s)
{
    PyObject *sizes = PyList_New(0);
    if (!sizes) return NULL;
    int64_t cursor = 0;
    for (uint32_t k = 0; k <= s->count; k++) {
        const mtc_leaf *l = k < s->count ? &t->leaves[p->members[s->first + k]] : NULL;
        int64_t start = l ? l->slot : s->rows;
        int64_t piece[2] = {start - cursor, l ? t->shape[l->dims] : 0};
        for (int i = 0; i < 2; i++) {
            if (i == 0 && piece[0] <= 0) continue; /* no padding here */
            if (i == 1 && !l) break;
            PyObject *v = PyLong_FromLongLong(piece[i]);
            if (!v || PyList_Append(sizes, v)) {
                Py_XDECREF(v);
                Py_DECREF(sizes);
                return NULL;
            }
            Py_DECREF(v);
        }
        if (l) cursor = l->slot + t->shape[l->dims];
    }
    return sizes;
}

/* 1 when a SPLIT segment's members leave rows between them or after the
 * last one (alignment padding), which split_with_sizes would make pieces
 * of too. */
static int _split_has_gaps(const mtc_tree *t, const mtc_plan *p, const mtc_seg *s)
{
    int64_t cursor = 0;
    for (uint32_t k = 0; k < s->count; k++) {
        const mtc_leaf *l = &t->leaves[p->members[s->first + k]];
        if (l->slot != cursor) return 1;
        cursor = l->slot + t->shape[l->dims];
    }
    return cursor != s->rows;
}

/* shaped[start:stop]: a member's rows of a segment view. Torch's indexing
 * runs with the GIL held, where an operator call (split_with_sizes) releases
 * it. New reference, or NULL. */
static PyObject *_rows(PyObject *shaped, int64_t start, int64_t stop)
{
    PyObject *a = PyLong_FromLongLong(start), *b = a ? PyLong_FromLongLong(stop) : NULL;
    PyObject *slice = b ? PySlice_New(a, b, NULL) : NULL, *v = slice ? PyObject_GetItem(shaped, slice) : NULL;
    Py_XDECREF(a);
    Py_XDECREF(b);
    Py_XDECREF(slice);
    return v;
}

/* A SPLIT segment: one view (rows, *trailing), cut at the member starts with
 * one split_with_sizes, which also makes a piece of every gap between members
 * (alignment padding), dropped here. Where the temporaries are kept for the
 * caller (keep: the prefetch service), a segment with gaps is sliced member by
 * member instead: its gap pieces would be dropped where the batch is handed
 * out, on the training thread, a release of the GIL each (a batch of a few
 * hundred small tensors has about as many gaps). Slicing costs about twice a
 * split's piece per member, which a direct call keeps. 0 or -1. */
static int _split_views(mtc_state *st, const mtc_tree *t, const mtc_plan *p, const mtc_seg *s,
                        PyObject *typed, int64_t offset, PyObject **outputs, PyObject *keep)
{
    int rc = -1;
    PyObject *shaped = _strided(st, t, &t->leaves[s->proto], 1, s->rows, -1, offset, typed), *sizes = NULL,
             *parts = NULL;
    if (!shaped || _keep(keep, shaped)) goto out;
    if (keep && _split_has_gaps(t, p, s)) {
        for (uint32_t k = 0; k < s->count; k++) {
            const mtc_leaf *l = &t->leaves[p->members[s->first + k]];
            PyObject *v = _rows(shaped, l->slot, l->slot + t->shape[l->dims]);
            if (!v) goto out;
            outputs[p->members[s->first + k]] = v;
        }
        rc = 0;
        goto out;
    }
    if (!(sizes = _split_sizes(t, p, s))) goto out;
    if ((parts = _call_method(shaped, st->s_split_with_sizes, &sizes, 1)) && !_keep(keep, parts))
        rc = _store_views(parts, t, p, s, 1, outputs);
out:
    Py_XDECREF(shaped);
    Py_XDECREF(sizes);
    Py_XDECREF(parts);
    return rc;
}

/* Creates the output views of one segment, `start` bytes from the start of
 * its group's tensor `typed` (of the segment's dtype), with one torch call
 * (a single member), or two, and stores
 * them (new references) in outputs[]. 0 or -1. */
static int _segment_views(mtc_state *st, const mtc_tree *t, const mtc_plan *p, const mtc_seg *s,
                          PyObject *typed, int64_t start, PyObject **outputs, PyObject *keep)
{
    const mtc_leaf *proto = &t->leaves[s->proto];
    if (start % proto->elsize) {
        /* the planner and the layout decoder place segments on multiples of
         * their element size: torch views no dtype elsewhere */
        PyErr_Format(PyExc_SystemError, "mtc_loader: a packed segment at byte %lld is not on a multiple of "
                     "its element size %d", (long long)start, (int)proto->elsize);
        return -1;
    }
    int64_t offset = start / proto->elsize;
    if (s->kind == MTC_SEG_UNIFORM && s->count == 1) {
        PyObject *v = _strided(st, t, proto, 0, -1, -1, offset, typed);
        if (!v) return -1;
        outputs[p->members[s->first]] = v;
        return 0;
    }
    if (s->kind == MTC_SEG_UNIFORM) return _uniform_views(st, t, p, s, typed, offset, outputs, keep);
    return _split_views(st, t, p, s, typed, offset, outputs, keep);
}

/* ---- the shim's maker (shim.h) ---- */

/* The geometry of member k of segment s, which starts `offset` elements into
 * its group's tensor: its element offset (the return value), and its sizes and
 * strides in sizes[] / strides[] (leaf->ndim of each). The same geometry the
 * split maker below gives each member: a leaf's own output strides when it is
 * MTC_LEAF_STRIDED, else contiguous strides as torch's view() makes them (a
 * dim of 0 counts as 1); SPLIT members at their first row, UNIFORM members
 * one after the other (back to back, or a slot apart). */
static int64_t _member_geometry(const mtc_tree *t, const mtc_plan *p, const mtc_seg *s, uint32_t k,
                                int64_t offset, int64_t *sizes, int64_t *strides)
{
    const mtc_leaf *l = &t->leaves[p->members[s->first + k]], *proto = &t->leaves[s->proto];
    int64_t el = 1, rows = proto->ndim >= 1 ? t->shape[proto->dims] : 0;
    for (int d = l->ndim - 1; d >= 0; d--) {
        int64_t dim = t->shape[l->dims + d];
        sizes[d] = dim;
        strides[d] = (l->flags & MTC_LEAF_STRIDED) ? t->ostrides[l->dims + d] : el;
        el *= dim > 1 ? dim : 1;
    }
    /* the elements of one row (dim 0) of the segment's view */
    int64_t row = 1;
    for (int d = 1; d < proto->ndim; d++) {
        int64_t dim = t->shape[proto->dims + d];
        row *= dim > 1 ? dim : 1;
    }
    if (s->kind == MTC_SEG_SPLIT) return offset + l->slot * row;
    if (s->count == 1) return offset;
    if (rows > 0 && s->row_bytes == proto->nbytes) return offset + (int64_t)k * rows * row; /* back to back */
    return offset + (int64_t)k * (s->row_bytes / proto->elsize);
}

/* The outputs of segment sg's members (output index i onwards), each one C
 * call over the group tensor's handle h, the segment starting `start`
 * elements into it: with torch's wrapper (mtc_shim_wrap_on) straight into outputs[],
 * else as capsules into caps[i..]. geo: room for 2 * maxdim dims. 0 or -1. */
static int _shim_members(mtc_state *st, const mtc_tree *t, const mtc_plan *p, const mtc_seg *sg, void *h,
                         int64_t start, int64_t *geo, int maxdim, PyObject **outputs, PyObject *caps, uint32_t i)
{
    for (uint32_t k = 0; k < sg->count; k++, i++) {
        uint32_t m = p->members[sg->first + k];
        int64_t off = _member_geometry(t, p, sg, k, start, geo, geo + maxdim);
        void *v;
        if (mtc_shim_view(st, h, t->leaves[m].ndim, geo, geo + maxdim, off, &v)) {
            PyErr_Format(PyExc_SystemError, "mtc_loader: torch's C shim refused an output view "
                         "(MTC_TORCH_SHIM=0 makes them with torch's split operators)");
            return -1;
        }
        if (!caps) {
            PyObject *o = mtc_shim_wrap(st, v);
            if (!o) return -1;
            Py_XSETREF(outputs[m], o);
            continue;
        }
        PyObject *cap = PyCapsule_New(v, NULL, NULL);
        if (!cap) {
            mtc_shim_release(st, v);
            return -1;
        }
        PyList_SET_ITEM(caps, i, cap);
    }
    return 0;
}

/* mtc_out_views through torch's C shim: per group a handle of its tensor, per
 * member one C call (_shim_members), and each output wrapped by torch's
 * wrapper in C or, without it, one Python call for the whole plan's tensors.
 * No piece of any gap, no segment view. 0 or -1. */
static int _shim_views(mtc_state *st, const mtc_tree *t, const mtc_plan *p, const mtc_group *groups,
                       uint32_t ngroups, PyObject *const *group_t, PyObject **outputs)
{
    uint32_t n = 0;
    int maxdim = 1;
    for (uint32_t s = 0; s < p->nsegs; s++) {
        const mtc_seg *sg = &p->segs[s];
        n += sg->count;
        for (uint32_t k = 0; k < sg->count; k++) {
            int nd = t->leaves[p->members[sg->first + k]].ndim;
            if (nd > maxdim) maxdim = nd;
        }
    }
    int rc = -1;
    void *h = NULL;
    int64_t *geo = PyMem_Malloc(2 * (size_t)maxdim * sizeof(int64_t));
    int wrap = mtc_shim_wrap_on(st);
    PyObject *caps = wrap ? NULL : PyList_New(n), *made = NULL;
    if (!geo || (!wrap && !caps)) {
        if (!geo) PyErr_NoMemory();
        goto out;
    }
    uint32_t i = 0;
    for (uint32_t g = 0; g < ngroups; g++) {
        const mtc_group *gr = &groups[g];
        mtc_shim_release(st, h);
        if (!(h = mtc_shim_handle(st, group_t[g]))) goto out;
        for (uint32_t s = gr->seg0; s < gr->seg0 + gr->nsegs; i += p->segs[s].count, s++) {
            const mtc_seg *sg = &p->segs[s];
            const mtc_leaf *proto = &t->leaves[sg->proto];
            int64_t start = sg->offset - gr->lo;
            if (start % proto->elsize) {
                PyErr_Format(PyExc_SystemError, "mtc_loader: a packed segment at byte %lld is not on a multiple "
                             "of its element size %d", (long long)start, (int)proto->elsize);
                goto out;
            }
            if (_shim_members(st, t, p, sg, h, start / proto->elsize, geo, maxdim, outputs, caps, i)) goto out;
        }
    }
    if (caps) {
        made = mtc_shim_tensors(st, caps);
        Py_CLEAR(caps); /* torch took the handles, whatever the outcome */
        if (!made) goto out;
        i = 0;
        for (uint32_t s = 0; s < p->nsegs; s++)
            for (uint32_t k = 0; k < p->segs[s].count; k++, i++)
                outputs[p->members[p->segs[s].first + k]] = Py_NewRef(PyList_GET_ITEM(made, i));
    }
    mtc_cnt.shim_views += n;
    rc = 0;
out:
    if (caps) {
        /* not handed to torch: release the handles made so far */
        for (Py_ssize_t j = 0; j < PyList_GET_SIZE(caps); j++) {
            PyObject *cap = PyList_GET_ITEM(caps, j);
            if (cap) mtc_shim_release(st, PyCapsule_GetPointer(cap, NULL));
        }
        Py_DECREF(caps);
    }
    Py_XDECREF(made);
    mtc_shim_release(st, h);
    PyMem_Free(geo);
    return rc;
}

int mtc_out_groups(const mtc_tree *t, const mtc_plan *p, mtc_group **out, uint32_t *n)
{
    *out = NULL;
    *n = 0;
    if (!p->nsegs) return 0;
    mtc_group *g = PyMem_Calloc(p->nsegs, sizeof *g);
    if (!g) {
        PyErr_NoMemory();
        return -1;
    }
    uint32_t k = 0;
    for (uint32_t s = 0; s < p->nsegs; s++) {
        const mtc_seg *sg = &p->segs[s];
        const mtc_leaf *proto = &t->leaves[sg->proto];
        uint8_t host = (proto->flags & MTC_LEAF_HOST) != 0;
        mtc_group *last = k ? &g[k - 1] : NULL;
        if (last && last->chunk == sg->chunk && last->dtype == proto->dtype && last->host == host) {
            last->nsegs++;
            if (sg->offset + sg->bytes > last->hi) last->hi = sg->offset + sg->bytes;
            continue;
        }
        g[k++] = (mtc_group){.chunk = sg->chunk, .dtype = proto->dtype, .host = host, .lo = sg->offset,
                             .hi = sg->offset + sg->bytes, .seg0 = s, .nsegs = 1};
    }
    *out = g;
    *n = k;
    return 0;
}

PyObject *mtc_out_group_empty(mtc_state *st, const mtc_group *g, PyObject *device, int pin)
{
    if (g->dtype >= MTC_MAX_DTYPES || !st->dtypes[g->dtype]) {
        PyErr_SetString(PyExc_SystemError, "mtc_loader: a packed segment has an unknown dtype code");
        return NULL;
    }
    PyObject *shape = Py_BuildValue("(L)", (long long)((g->hi - g->lo) / st->elsize[g->dtype]));
    if (!shape) return NULL;
    PyObject *v = mtc_out_empty(st, shape, st->dtypes[g->dtype], device, pin);
    Py_DECREF(shape);
    return v;
}

/* Replaces every output of plan p by its `.data`: a tensor over the same
 * memory with no autograd view record and a version counter of its own, what
 * the shim's outputs and tensor.to()'s are (the split operators make views
 * of the segment, which share one counter: an in-place op on one output
 * would break backward through another). The views go to `keep` when there
 * is one (see _keep). 0 or -1. */
static int _unview(mtc_state *st, const mtc_plan *p, PyObject **outputs, PyObject *keep)
{
    for (uint32_t j = 0; j < p->nmembers; j++) {
        PyObject **o = &outputs[p->members[j]];
        PyObject *d = PyObject_GetAttr(*o, st->s_data);
        if (!d) return -1;
        if (_keep(keep, *o)) {
            Py_DECREF(d);
            return -1;
        }
        Py_SETREF(*o, d);
    }
    return 0;
}

/* Creates the outputs of every segment of plan p over the group tensors:
 * through torch's C shim where it is on (above), else per segment one
 * as_strided view of its group's tensor at the segment's offset, cut into
 * members with split_with_sizes or unbind, each then made a tensor of its own
 * (_unview). 0 or -1 with an exception. */
int mtc_out_views(mtc_state *st, const mtc_tree *t, const mtc_plan *p, const mtc_group *groups, uint32_t ngroups,
                  PyObject *const *group_t, PyObject **outputs, PyObject *keep)
{
    if (mtc_shim_on(st) && p->nsegs) return _shim_views(st, t, p, groups, ngroups, group_t, outputs);
    for (uint32_t g = 0; g < ngroups; g++)
        for (uint32_t s = groups[g].seg0; s < groups[g].seg0 + groups[g].nsegs; s++)
            if (_segment_views(st, t, p, &p->segs[s], group_t[g], p->segs[s].offset - groups[g].lo, outputs, keep))
                return -1;
    return _unview(st, p, outputs, keep);
}

/* The mode stack lengths and the refusal of mtc_loader._modes, looked up on
 * first use. 1 when they are there, 0 on a torch without them (no error:
 * the pointer checks stay), -1 on another error. */
static int _mode_fns(mtc_state *st)
{
    if (st->mode_refusal) return st->mode_refusal != Py_None;
    PyObject *c = PyImport_ImportModule("torch._C"), *m = c ? PyImport_ImportModule("mtc_loader._modes") : NULL;
    if (!m) {
        Py_XDECREF(c);
        return -1;
    }
    st->len_dispatch = PyObject_GetAttrString(c, "_len_torch_dispatch_stack");
    st->len_function = st->len_dispatch ? PyObject_GetAttrString(c, "_len_torch_function_stack") : NULL;
    st->mode_refusal = st->len_function ? PyObject_GetAttrString(m, "refusal") : NULL;
    Py_DECREF(c);
    Py_DECREF(m);
    if (st->mode_refusal) return 1;
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return -1;
    PyErr_Clear();
    Py_CLEAR(st->len_dispatch);
    Py_CLEAR(st->len_function);
    st->mode_refusal = Py_NewRef(Py_None); /* asked once */
    return 0;
}

int mtc_out_check_modes(mtc_state *st)
{
    int have = _mode_fns(st);
    if (have <= 0) return have;
    long depth = 0;
    for (int k = 0; k < 2; k++) {
        PyObject *v = PyObject_CallNoArgs(k ? st->len_function : st->len_dispatch);
        if (!v) return -1;
        depth += PyLong_AsLong(v);
        Py_DECREF(v);
        if (PyErr_Occurred()) return -1;
    }
    if (!depth) return 0;
    PyObject *why = PyObject_CallNoArgs(st->mode_refusal);
    if (!why) return -1;
    int rc = 0;
    if (why != Py_None) {
        PyErr_SetObject(PyExc_RuntimeError, why);
        rc = -1;
    }
    Py_DECREF(why);
    return rc;
}

PyObject *mtc_out_device(mtc_state *st, int dev)
{
    if (dev < 0) return Py_NewRef(st->device_cpu);
    PyObject *i = PyLong_FromLong(dev);
    if (!i) return NULL;
    PyObject *d = PyObject_CallOneArg(st->cuda_device, i);
    Py_DECREF(i);
    return d;
}

/* Captures the current raw stream of each involved CUDA device. */

int mtc_out_capture_streams(mtc_state *st, mtc_job *j)
{
    for (int d = 0; d < MTC_MAX_DEVICES; d++) {
        if (!(j->dev_mask & (1ull << d))) continue;
        void *raw;
        if (!mtc_shim_current_stream(st, d, &raw)) { /* no Python call */
            j->streams[d] = (CUstream)raw;
            continue;
        }
        PyObject *i = PyLong_FromLong(d);
        if (!i) return -1;
        PyObject *s = PyObject_CallOneArg(st->raw_stream, i);
        Py_DECREF(i);
        if (!s) return -1;
        j->streams[d] = (CUstream)PyLong_AsVoidPtr(s);
        Py_DECREF(s);
        if (PyErr_Occurred()) return -1;
    }
    return 0;
}
