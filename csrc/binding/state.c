/*
 * state.c - what every file of the binding shares, defined below all of them
 * and below module.c, which makes the module: the calling-thread counters
 * (state.h) and numpy's C API table (copy.c, leaves.c and traverse.c use it
 * with NO_IMPORT_ARRAY; it is filled here).
 */
#define PY_ARRAY_UNIQUE_SYMBOL mtc_ARRAY_API
#include "state.h"

#include <numpy/arrayobject.h>

mtc_counters mtc_cnt;

/* Fills numpy's C API table (module exec, once per process is enough;
 * again is harmless). 0, or -1 with an exception set. */
int mtc_state_import_numpy(void)
{
    return _import_array();
}
