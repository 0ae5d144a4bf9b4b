/*
 * shim.c - torch's AOTInductor C shim, found at run time (see shim.h).
 */
#include "shim.h"

#include <dlfcn.h>

#include "env.h"

int mtc_shim_setup(mtc_state *st, PyObject *cfg)
{
    st->shim_offered = st->shim_on = 0;
    st->shim_reinterpret = NULL;
    st->shim_delete = NULL;
    Py_CLEAR(st->shim_handle_of);
    Py_CLEAR(st->shim_steal);
    PyObject *v = PyDict_GetItemString(cfg, "shim"); /* borrowed */
    if (!v || v == Py_None) return 0;
    PyObject *path, *handle_of, *steal;
    if (!PyArg_ParseTuple(v, "UOO;_setup: shim is (library path, handle_of, steal)", &path, &handle_of, &steal))
        return -1;
    const char *p = PyUnicode_AsUTF8(path);
    if (!p) return -1;
    /* RTLD_NOLOAD: the library torch loaded, never a second copy. The
     * reference dlopen takes is kept for the life of the process. */
    void *lib = dlopen(p, RTLD_NOW | RTLD_NOLOAD | RTLD_LOCAL);
    if (!lib) return 0;
    st->shim_reinterpret = (mtc_shim_reinterpret_fn)dlsym(lib, "aoti_torch__reinterpret_tensor");
    st->shim_delete = (mtc_shim_delete_fn)dlsym(lib, "aoti_torch_delete_tensor_object");
    if (!st->shim_reinterpret || !st->shim_delete) {
        st->shim_reinterpret = NULL;
        st->shim_delete = NULL;
        return 0;
    }
    st->shim_handle_of = Py_NewRef(handle_of);
    st->shim_steal = Py_NewRef(steal);
    st->shim_offered = 1;
    st->shim_on = mtc_env_bool(MTC_ENV_TORCH_SHIM, 1);
    return 0;
}

void *mtc_shim_handle(mtc_state *st, PyObject *tensor)
{
    PyObject *cap = PyObject_CallOneArg(st->shim_handle_of, tensor);
    if (!cap) return NULL;
    void *h = PyCapsule_IsValid(cap, PyCapsule_GetName(cap)) ? PyCapsule_GetPointer(cap, PyCapsule_GetName(cap)) : NULL;
    Py_DECREF(cap); /* no destructor: the handle stays ours */
    if (!h && !PyErr_Occurred())
        PyErr_SetString(PyExc_SystemError, "mtc_loader: torch._C._aoti returned no tensor handle");
    return h;
}

int mtc_shim_view(const mtc_state *st, void *base, int64_t ndim, const int64_t *sizes,
                  const int64_t *strides, int64_t offset, void **out)
{
    void *h = NULL;
    if (st->shim_reinterpret(base, ndim, sizes, strides, offset, &h) != 0 || !h) return -1;
    *out = h;
    return 0;
}

void mtc_shim_release(const mtc_state *st, void *handle)
{
    if (handle) st->shim_delete(handle);
}

PyObject *mtc_shim_tensors(mtc_state *st, PyObject *capsules)
{
    PyObject *v = PyObject_CallOneArg(st->shim_steal, capsules);
    if (v && (!PyList_Check(v) || PyList_GET_SIZE(v) != PyList_GET_SIZE(capsules))) {
        Py_DECREF(v);
        PyErr_SetString(PyExc_SystemError, "mtc_loader: torch._C._aoti returned an unexpected number of tensors");
        return NULL;
    }
    return v;
}
