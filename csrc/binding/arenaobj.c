/*
 * arenaobj.c - the _engine.Arena type (wrapped by mtc_loader.collate.Arena)
 * over a shared memfd arena (arena.c): create, attach, stats, release and
 * adopt of regions, and the parsing of a packed batch descriptor's region
 * (offset, owner). See arenaobj.h.
 */
#include "arenaobj.h"

#include <errno.h>
#include <limits.h>
#include <sched.h>
#include <unistd.h>

#include "cuda.h"

mtc_arena *mtc_arenaobj_of(mtc_state *st, PyObject *o)
{
    if (!PyObject_TypeCheck(o, st->arena_type)) {
        PyErr_SetString(PyExc_TypeError, "mtc_loader: expected an _engine.Arena");
        return NULL;
    }
    return ((mtc_arena_object *)o)->a;
}

static PyObject *_arena_wrap(mtc_state *st, mtc_arena *a)
{
    mtc_arena_object *o = PyObject_New(mtc_arena_object, st->arena_type);
    if (!o) {
        mtc_arena_unref(a);
        return NULL;
    }
    Py_INCREF(st->arena_type);
    o->a = a;
    o->registered_dev = -1;
    return (PyObject *)o;
}

static void Arena_dealloc(mtc_arena_object *o)
{
    PyTypeObject *tp = Py_TYPE(o);
    if (o->a) {
        if (o->registered_dev >= 0) {
            /* DMAs in flight hold references (released by their completion
             * callbacks): unregister only once none reads the arena */
            Py_BEGIN_ALLOW_THREADS
            while (mtc_load_acquire(&o->a->refs) > 1) sched_yield();
            if (!mtc_cuda_set_device(o->registered_dev)) mtc_cu.cuMemHostUnregister(o->a->base);
            Py_END_ALLOW_THREADS
        }
        mtc_arena_unref(o->a);
    }
    tp->tp_free((PyObject *)o);
    Py_DECREF(tp);
}

static PyObject *Arena_fileno(mtc_arena_object *o, PyObject *unused) { return PyLong_FromLong(o->a->fd); }

static PyObject *Arena_stats(mtc_arena_object *o, PyObject *unused)
{
    mtc_arena_stats s;
    mtc_arena_get_stats(o->a, &s);
    return Py_BuildValue("{sKsKsKsKsKsKsKsKsKsKsKsi}", "bytes", s.bytes, "slot_bytes", s.slot_bytes,
                         "slots", s.nslots, "allocs", s.allocs, "frees", s.frees, "waits", s.waits,
                         "timeouts", s.timeouts, "reclaimed_slots", s.reclaims, "slots_in_use",
                         s.slots_in_use, "bytes_in_use", s.slots_in_use * s.slot_bytes,
                         "high_water_slots", s.high_water, "registered", o->registered_dev >= 0);
}

static PyObject *Arena_reclaim_dead(mtc_arena_object *o, PyObject *unused)
{
    uint64_t n;
    Py_BEGIN_ALLOW_THREADS
    n = mtc_arena_reclaim_dead(o->a, (uint32_t)getpid());
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLongLong(n);
}

/* A descriptor's region offset: an int in [0, 2^64), never truncated (an
 * offset of 2^64 + x must not name region x). 0, or -1 with ValueError. */
int mtc_arenaobj_parse_offset(PyObject *v, uint64_t *out)
{
    if (PyLong_Check(v)) {
        unsigned long long x = PyLong_AsUnsignedLongLong(v);
        if (!(x == (unsigned long long)-1 && PyErr_Occurred())) {
            *out = x;
            return 0;
        }
        PyErr_Clear();
    }
    PyErr_Format(PyExc_ValueError, "mtc_loader: a packed batch names arena offset %R, which is not an "
                 "offset in an arena (a corrupt or forged descriptor)", v);
    return -1;
}

/* A descriptor's owner: a pid, an int in 1 .. INT32_MAX, never truncated (an
 * owner of getpid() + 2^32 must not pass for this process). 0, or -1 with
 * ValueError. */
int mtc_arenaobj_parse_owner(PyObject *v, uint32_t *out)
{
    if (PyLong_Check(v)) {
        long long x = PyLong_AsLongLong(v);
        if (x >= 1 && x <= INT32_MAX) {
            *out = (uint32_t)x;
            return 0;
        }
        PyErr_Clear();
    }
    PyErr_Format(PyExc_ValueError, "mtc_loader: a packed batch names owner %R, which is not a process id "
                 "(a corrupt or forged descriptor)", v);
    return -1;
}

/* (offset, owner) of Arena.release / Arena.adopt. 0, or -1 with an exception. */
static int _parse_region(PyObject *args, uint64_t *off, uint32_t *owner)
{
    if (!PyTuple_Check(args) || PyTuple_GET_SIZE(args) != 2) {
        PyErr_SetString(PyExc_TypeError, "mtc_loader: expected (offset, owner)");
        return -1;
    }
    if (mtc_arenaobj_parse_offset(PyTuple_GET_ITEM(args, 0), off)) return -1;
    return mtc_arenaobj_parse_owner(PyTuple_GET_ITEM(args, 1), owner);
}

static PyObject *Arena_release(mtc_arena_object *o, PyObject *args)
{
    uint64_t off;
    uint32_t owner;
    if (_parse_region(args, &off, &owner)) return NULL;
    return PyBool_FromLong(mtc_arena_free(o->a, off, owner) == 0);
}

static PyObject *Arena_adopt(mtc_arena_object *o, PyObject *args)
{
    uint64_t off;
    uint32_t owner;
    if (_parse_region(args, &off, &owner)) return NULL;
    uint32_t me = (uint32_t)getpid();
    if (owner != me && mtc_arena_retag(o->a, off, owner, me)) {
        PyErr_Format(PyExc_RuntimeError,
                     "mtc_loader: a packed batch names arena region %llu of process %u, which does not "
                     "hold it (a stale or forged descriptor, or the region was reclaimed)",
                     (unsigned long long)off, owner);
        return NULL;
    }
    return PyLong_FromUnsignedLong(me);
}

static PyObject *Arena_valid(mtc_arena_object *o, PyObject *unused) { return PyBool_FromLong(mtc_arena_valid(o->a)); }

static PyMethodDef Arena_methods[] = {
    {"fileno", (PyCFunction)Arena_fileno, METH_NOARGS, "The arena's memfd."},
    {"stats", (PyCFunction)Arena_stats, METH_NOARGS, "Allocator counters."},
    {"reclaim_dead", (PyCFunction)Arena_reclaim_dead, METH_NOARGS, "Free regions of dead processes."},
    {"release", (PyCFunction)Arena_release, METH_VARARGS, "release(offset, owner): free a region."},
    {"adopt", (PyCFunction)Arena_adopt, METH_VARARGS, "adopt(offset, owner): take over a region."},
    {"valid", (PyCFunction)Arena_valid, METH_NOARGS, "Invariant check (quiescent arena)."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot Arena_slots[] = {
    {Py_tp_dealloc, Arena_dealloc},
    {Py_tp_methods, Arena_methods},
    {Py_tp_doc, "A shared arena mapping (wrapped by mtc_loader.collate.Arena)."},
    {0, NULL},
};

PyType_Spec mtc_arena_spec = {
    .name = "mtc_loader._engine.Arena",
    .basicsize = sizeof(mtc_arena_object),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = Arena_slots,
};

PyObject *mtc_collate_arena_create(PyObject *module, PyObject *arg)
{
    unsigned long long n = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) return NULL;
    mtc_arena *a;
    int rc = mtc_arena_create((size_t)n, &a);
    if (rc) {
        errno = -rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return _arena_wrap(mtc_get_state(module), a);
}

PyObject *mtc_collate_arena_attach(PyObject *module, PyObject *arg)
{
    long fd = PyLong_AsLong(arg);
    if (PyErr_Occurred()) return NULL;
    if (fd < 0 || fd > INT_MAX) { /* never truncated into another descriptor */
        PyErr_Format(PyExc_ValueError, "mtc_loader: %ld is not a file descriptor", fd);
        return NULL;
    }
    mtc_arena *a;
    int rc = mtc_arena_attach((int)fd, &a);
    if (rc == -EINVAL) {
        PyErr_SetString(PyExc_ValueError, "mtc_loader: that file descriptor is not an mtc_loader arena");
        return NULL;
    }
    if (rc) {
        errno = -rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return _arena_wrap(mtc_get_state(module), a);
}
