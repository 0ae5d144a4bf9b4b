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
    st->shim_view_dtype = NULL;
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
    /* typed views in C too where the shim has view_dtype: each dtype's code, asked of torch */
    mtc_shim_get_dtype_fn get_dtype = (mtc_shim_get_dtype_fn)dlsym(lib, "aoti_torch_get_dtype");
    st->shim_view_dtype = (mtc_shim_view_dtype_fn)dlsym(lib, "aoti_torch_view_dtype");
    for (int c = 0; c < MTC_MAX_DTYPES; c++) st->shim_dtype[c] = -1;
    PyObject *samples = PyDict_GetItemString(cfg, "dlpack_samples");
    if (get_dtype && st->shim_view_dtype && samples && PyList_Check(samples) &&
        PyList_GET_SIZE(samples) == st->ndtypes) {
        for (int c = 0; c < st->ndtypes; c++) {
            void *h = mtc_shim_handle(st, PyList_GET_ITEM(samples, c));
            int32_t code;
            if (!h) return -1;
            if (get_dtype(h, &code) == 0) st->shim_dtype[c] = code;
            mtc_shim_release(st, h);
        }
    } else {
        st->shim_view_dtype = NULL;
    }
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

void *mtc_shim_typed(const mtc_state *st, void *base, int64_t nbytes, int code)
{
    if (!st->shim_view_dtype || code < 0 || code >= MTC_MAX_DTYPES || st->shim_dtype[code] < 0) return NULL;
    int64_t whole = nbytes - nbytes % st->elsize[code], one = 1;
    void *bytes = NULL, *typed = NULL;
    if (mtc_shim_view(st, base, 1, &whole, &one, 0, &bytes)) return NULL;
    if (st->shim_view_dtype(bytes, st->shim_dtype[code], &typed) != 0) typed = NULL;
    mtc_shim_release(st, bytes);
    return typed;
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
