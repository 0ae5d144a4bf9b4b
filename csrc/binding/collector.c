/*
 * collector.c - the middle-generation collection a batch's outputs would
 * trigger, run before they exist (see collector.h).
 */
#include "collector.h"
#include "env.h"

#include <stdlib.h>

/* The generational collector this reasons about: CPython 3.10 to 3.13 with
 * the GIL (3.14's collector is incremental, the free-threaded build's has no
 * generations to promote through). */
#if !defined(Py_GIL_DISABLED) && PY_VERSION_HEX < 0x030E0000
#define MTC_GENERATIONAL 1
#else
#define MTC_GENERATIONAL 0
#endif

int mtc_collector_init(mtc_state *st)
{
    st->gc_early = 0;
    if (!MTC_GENERATIONAL) return 0;
    PyObject *gc = PyImport_ImportModule("gc");
    if (!gc) return -1;
    st->gc_isenabled = PyObject_GetAttrString(gc, "isenabled");
    st->gc_get_count = st->gc_isenabled ? PyObject_GetAttrString(gc, "get_count") : NULL;
    st->gc_get_threshold = st->gc_get_count ? PyObject_GetAttrString(gc, "get_threshold") : NULL;
    st->gc_collect = st->gc_get_threshold ? PyObject_GetAttrString(gc, "collect") : NULL;
    Py_DECREF(gc);
    if (!st->gc_collect) return -1;
    st->gc_early = mtc_env_bool(MTC_ENV_EARLY_GC, 1);
    return 0;
}

void mtc_collector_clear(mtc_state *st)
{
    Py_CLEAR(st->gc_isenabled);
    Py_CLEAR(st->gc_get_count);
    Py_CLEAR(st->gc_get_threshold);
    Py_CLEAR(st->gc_collect);
    st->gc_early = 0;
}

/* The three ints of gc.get_count() or gc.get_threshold(). 0 or -1. */
static int _three(PyObject *fn, long v[3])
{
    PyObject *t = PyObject_CallNoArgs(fn);
    if (!t) return -1;
    int ok = PyTuple_Check(t) && PyTuple_GET_SIZE(t) == 3;
    for (int i = 0; ok && i < 3; i++) {
        v[i] = PyLong_AsLong(PyTuple_GET_ITEM(t, i));
        if (v[i] == -1 && PyErr_Occurred()) ok = 0;
    }
    Py_DECREF(t);
    if (!ok && !PyErr_Occurred()) PyErr_SetString(PyExc_SystemError, "mtc_loader: gc returned an unexpected value");
    return ok ? 0 : -1;
}

int mtc_collector_before_outputs(mtc_state *st, int64_t nobjects)
{
    if (!st->gc_early || !st->gc_collect) return 0;
    PyObject *enabled = PyObject_CallNoArgs(st->gc_isenabled);
    if (!enabled) return -1;
    int on = PyObject_IsTrue(enabled);
    Py_DECREF(enabled);
    if (on <= 0) return on; /* off: the program's choice, no collection */
    long threshold[3], count[3];
    if (_three(st->gc_get_threshold, threshold) || _three(st->gc_get_count, count)) return -1;
    long t0 = threshold[0], t1 = threshold[1], c0 = count[0], c1 = count[1];
    if (t0 <= 0 || t1 <= 0 || c0 + nobjects <= t0) return 0; /* no young collection among the outputs */
    /* Young collections the allocations trigger: from 3.12 one, when the call
     * returns (the collector runs at the interpreter's next check); up to 3.11
     * one each time the count passes the threshold, in the middle of them.
     * Each adds one to the middle generation's count, and the one that finds
     * it above its threshold collects the middle generation instead. */
#if PY_VERSION_HEX >= 0x030C0000
    long runs = 1;
#else
    long runs = (long)((c0 + nobjects) / (t0 + 1));
#endif
    if (c1 + runs <= t1) return 0; /* (one run early: another collection may come between) */
    PyObject *one = PyLong_FromLong(1);
    PyObject *r = one ? PyObject_CallOneArg(st->gc_collect, one) : NULL;
    Py_XDECREF(one);
    if (!r) return -1;
    Py_DECREF(r);
    mtc_cnt.gc_early++;
    return 0;
}

PyObject *mtc_collector_set(PyObject *module, PyObject *flag)
{
    mtc_state *st = mtc_get_state(module);
    int on = PyObject_IsTrue(flag);
    if (on < 0) return NULL;
    PyObject *prev = PyBool_FromLong(st->gc_early);
    st->gc_early = on && st->gc_collect != NULL;
    return prev;
}
