/*
 * shim.c - torch's AOTInductor C shim, found at run time (see shim.h).
 */
#include "shim.h"

#include <dlfcn.h>
#include <string.h>

#include "env.h"

/* 1 when the reader's getters read `sample`'s sizes, strides, data
 * pointer, storage offset and storage bytes as Python reads them, 0 when
 * not, -1 with an exception. */
static int _reader_reads_sample(const mtc_shim_reader *r, PyObject *sample)
{
    void *inside = (char *)sample + r->cdata;
    int64_t dim, *sizes, *strides, offset, nbytes;
    void *data;
    int ok = r->dim(inside, &dim) == 0 && r->sizes(inside, &sizes) == 0 && r->strides(inside, &strides) == 0 &&
             r->data_ptr(inside, &data) == 0 && r->storage_offset(inside, &offset) == 0 &&
             r->storage_size(inside, &nbytes) == 0;
    PyObject *shape = ok ? PyObject_GetAttrString(sample, "shape") : NULL;
    PyObject *stride = shape ? PyObject_CallMethod(sample, "stride", NULL) : NULL;
    PyObject *ptr = stride ? PyObject_CallMethod(sample, "data_ptr", NULL) : NULL;
    PyObject *off = ptr ? PyObject_CallMethod(sample, "storage_offset", NULL) : NULL;
    PyObject *storage = off ? PyObject_CallMethod(sample, "untyped_storage", NULL) : NULL;
    PyObject *size = storage ? PyObject_CallMethod(storage, "nbytes", NULL) : NULL;
    Py_XDECREF(storage);
    if (ok && !size) {
        Py_XDECREF(shape);
        Py_XDECREF(stride);
        Py_XDECREF(ptr);
        Py_XDECREF(off);
        return -1;
    }
    ok = ok && PyTuple_Check(shape) && PyTuple_GET_SIZE(shape) == dim && PyTuple_Check(stride) &&
         PyTuple_GET_SIZE(stride) == dim && PyLong_AsVoidPtr(ptr) == data && PyLong_AsLongLong(off) == offset &&
         PyLong_AsLongLong(size) == nbytes;
    Py_XDECREF(off);
    Py_XDECREF(size);
    for (int64_t d = 0; ok && d < dim; d++)
        ok = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, d)) == sizes[d] &&
             PyLong_AsLongLong(PyTuple_GET_ITEM(stride, d)) == strides[d];
    Py_XDECREF(shape);
    Py_XDECREF(stride);
    Py_XDECREF(ptr);
    return PyErr_Occurred() ? -1 : ok;
}

/* The leaf reader (state.h's mtc_shim_reader): offered only where this torch
 * passes every check below on sample tensors, so that a torch whose layout
 * differs reads its leaves the DLPack or attribute way instead.
 * - torch.Tensor's Python object holds its at::Tensor (one TensorImpl
 *   pointer) right after the object header (torch 2.10 and later; before, a
 *   MaybeOwned): the word there must be the TensorImpl the shim's own handle
 *   of the same tensor points to, for every sample;
 * - the getters must read each sample's dtype, layout, device, sizes,
 *   strides, data pointer, storage offset and storage bytes as Python reads
 *   them (cfg["reader_sample"]: a strided view with an offset);
 * - at::native::is_neg / is_conj (bool of a const at::Tensor &), where
 *   exported, must tell cfg["bit_samples"] (plain, negative view, conjugate
 *   view) apart; without them the bits are read through the Python methods.
 * samples: the empty tensors of each of the engine's dtypes. 0 or -1. */
static int _setup_reader(mtc_state *st, void *lib, PyObject *cfg, PyObject *samples)
{
    mtc_shim_reader *r = &st->sr;
    memset(r, 0, sizeof *r);
    memset(r->to_code, -1, sizeof r->to_code);
    PyObject *sample = PyDict_GetItemString(cfg, "reader_sample");
    PyObject *bits = PyDict_GetItemString(cfg, "bit_samples");
    if (!sample || !bits || !PyTuple_Check(bits) || PyTuple_GET_SIZE(bits) != 3 ||
        PyList_GET_SIZE(samples) != st->ndtypes) {
        st->reader_why = "this torch cannot make the sample tensors the reader is checked against (it has "
                         "no torch._neg_view)";
        return 0;
    }
    if (((PyTypeObject *)st->tensor_type)->tp_basicsize < (Py_ssize_t)(sizeof(PyObject) + sizeof(void *))) {
        st->reader_why = "torch.Tensor's Python object is too small to hold the tensor where the reader looks";
        return 0;
    }
#define SYM(field, name, type) r->field = (type)dlsym(lib, name)
    SYM(layout, "aoti_torch_get_layout", mtc_shim_get_i32_fn);
    SYM(device_type, "aoti_torch_get_device_type", mtc_shim_get_i32_fn);
    SYM(device_index, "aoti_torch_get_device_index", mtc_shim_get_i32_fn);
    SYM(dtype, "aoti_torch_get_dtype", mtc_shim_get_i32_fn);
    SYM(dim, "aoti_torch_get_dim", mtc_shim_get_i64_fn);
    SYM(sizes, "aoti_torch_get_sizes", mtc_shim_get_i64p_fn);
    SYM(strides, "aoti_torch_get_strides", mtc_shim_get_i64p_fn);
    SYM(data_ptr, "aoti_torch_get_data_ptr", mtc_shim_get_ptr_fn);
    SYM(storage_size, "aoti_torch_get_storage_size", mtc_shim_get_i64_fn);
    SYM(storage_offset, "aoti_torch_get_storage_offset", mtc_shim_get_i64_fn);
    SYM(is_neg, "_ZN2at6native6is_negERKNS_6TensorE", mtc_native_bit_fn);
    SYM(is_conj, "_ZN2at6native7is_conjERKNS_6TensorE", mtc_native_bit_fn);
#undef SYM
    mtc_shim_code_fn strided = (mtc_shim_code_fn)dlsym(lib, "aoti_torch_layout_strided");
    mtc_shim_code_fn cpu = (mtc_shim_code_fn)dlsym(lib, "aoti_torch_device_type_cpu");
    mtc_shim_code_fn cuda = (mtc_shim_code_fn)dlsym(lib, "aoti_torch_device_type_cuda");
    if (!r->layout || !r->device_type || !r->device_index || !r->dtype || !r->dim || !r->sizes || !r->strides ||
        !r->data_ptr || !r->storage_size || !r->storage_offset || !strided || !cpu || !cuda) {
        memset(r, 0, sizeof *r);
        st->reader_why = "the library lacks some of the shim's getters (aoti_torch_get_*)";
        return 0;
    }
    r->strided = strided();
    r->dev_cpu = cpu();
    r->dev_cuda = cuda();
    r->cdata = (Py_ssize_t)sizeof(PyObject);
    if (!r->is_neg || !r->is_conj) r->is_neg = r->is_conj = NULL;
    /* every sample: its TensorImpl where the reader looks for it, its dtype code */
    Py_ssize_t n = PyList_GET_SIZE(samples);
    int ok = 1;
    for (Py_ssize_t i = 0; ok && i < n + 4; i++) {
        PyObject *t = i < n ? PyList_GET_ITEM(samples, i) : i == n ? sample : PyTuple_GET_ITEM(bits, i - n - 1);
        if ((PyObject *)Py_TYPE(t) != st->tensor_type) {
            ok = 0;
            break;
        }
        void *h = mtc_shim_handle(st, t);
        if (!h) return -1;
        void *inside = (char *)t + r->cdata;
        ok = *(void **)h == *(void **)inside;
        mtc_shim_release(st, h);
        int32_t code, layout, dev;
        ok = ok && r->dtype(inside, &code) == 0 && r->layout(inside, &layout) == 0 && layout == r->strided &&
             r->device_type(inside, &dev) == 0 && dev == r->dev_cpu && code >= 0 && code < 256;
        if (ok && i < n) {
            if (r->to_code[code] != -1 && r->to_code[code] != (int8_t)i) ok = 0; /* two dtypes, one code */
            r->to_code[code] = (int8_t)i;
        }
    }
    /* the sample's sizes, strides and data pointer as Python reads them */
    if (ok && (ok = _reader_reads_sample(r, sample)) < 0) return -1;
    /* the lazy bits: plain, negative view, conjugate view */
    if (ok && r->is_neg) {
        const void *plain = (char *)PyTuple_GET_ITEM(bits, 0) + r->cdata;
        const void *neg = (char *)PyTuple_GET_ITEM(bits, 1) + r->cdata;
        const void *conj = (char *)PyTuple_GET_ITEM(bits, 2) + r->cdata;
        if (r->is_neg(plain) || !r->is_neg(neg) || r->is_neg(conj) || r->is_conj(plain) || r->is_conj(neg) ||
            !r->is_conj(conj))
            r->is_neg = r->is_conj = NULL;
    }
    if (!ok) {
        memset(r, 0, sizeof *r);
        memset(r->to_code, -1, sizeof r->to_code);
        st->reader_why = "this torch's tensors failed the reader's check on sample tensors (where the Python "
                         "object holds the tensor, or what the getters read)";
        return 0;
    }
    r->offered = 1;
    st->reader_why = NULL;
    return 0;
}

/* torch's wrapper of an at::Tensor as a Python tensor (libtorch_python's
 * THPVariable_Wrap(at::TensorBase &&), cfg["shim_python"]: that library's
 * path), offered where it turns a view of cfg["reader_sample"] into a
 * torch.Tensor over the sample's memory. The handle it is given is moved
 * from and then released (mtc_shim_wrap). 0 or -1. */
static int _setup_wrap(mtc_state *st, PyObject *cfg)
{
    st->shim_wrap = NULL;
    st->shim_wrap_on = 0;
    PyObject *path = PyDict_GetItemString(cfg, "shim_python");
    PyObject *sample = PyDict_GetItemString(cfg, "reader_sample");
    st->wrap_why = NULL; /* no path: the Python side says why */
    if (!path || !PyUnicode_Check(path) || !sample || (PyObject *)Py_TYPE(sample) != st->tensor_type) return 0;
    const char *p = PyUnicode_AsUTF8(path);
    if (!p) return -1;
    void *lib = dlopen(p, RTLD_NOW | RTLD_NOLOAD | RTLD_LOCAL);
    st->wrap_why = "libtorch_python is not loaded in this process at that path (dlopen with RTLD_NOLOAD)";
    if (!lib) return 0;
    mtc_shim_wrap_fn wrap = (mtc_shim_wrap_fn)dlsym(lib, "_Z16THPVariable_WrapON2at10TensorBaseE");
    st->wrap_why = "libtorch_python exports no THPVariable_Wrap(at::TensorBase&&)";
    if (!wrap) return 0;
    void *h = mtc_shim_handle(st, sample), *v = NULL;
    if (!h) return -1;
    int64_t size = 2, stride = 1;
    int rc = mtc_shim_view(st, h, 1, &size, &stride, 0, &v);
    mtc_shim_release(st, h);
    st->wrap_why = "the shim refused a view of the sample tensor";
    if (rc) return 0;
    PyObject *o = wrap(v);
    mtc_shim_release(st, v);
    if (!o) return -1;
    PyObject *mine = PyObject_CallMethod(o, "data_ptr", NULL), *theirs = PyObject_CallMethod(sample, "data_ptr", NULL);
    PyObject *shape = PyObject_GetAttrString(o, "shape");
    int ok = mine && theirs && shape && (PyObject *)Py_TYPE(o) == st->tensor_type &&
             PyObject_RichCompareBool(mine, theirs, Py_EQ) == 1 && PyTuple_Check(shape) &&
             PyTuple_GET_SIZE(shape) == 1 && PyLong_AsLong(PyTuple_GET_ITEM(shape, 0)) == 2;
    Py_XDECREF(mine);
    Py_XDECREF(theirs);
    Py_XDECREF(shape);
    Py_DECREF(o);
    if (PyErr_Occurred()) return -1;
    st->wrap_why = ok ? NULL : "torch's wrapper failed the check on a sample tensor (a view of it must become a "
                               "torch.Tensor over its memory)";
    if (ok) st->shim_wrap = wrap;
    return 0;
}

/* The chunk allocator (mtc_shim_empty) and the current-stream getter
 * (mtc_shim_current_stream): plain C calls into torch, found by name in the
 * libraries torch loaded (cfg["shim_cuda"]: libtorch_cuda's path, or None on
 * a torch without CUDA). Either missing leaves its NULL. */
static void _setup_empty(mtc_state *st, void *lib, PyObject *cfg)
{
    mtc_shim_code_fn u8 = (mtc_shim_code_fn)dlsym(lib, "aoti_torch_dtype_uint8");
    mtc_shim_code_fn cpu = (mtc_shim_code_fn)dlsym(lib, "aoti_torch_device_type_cpu");
    mtc_shim_code_fn cuda = (mtc_shim_code_fn)dlsym(lib, "aoti_torch_device_type_cuda");
    st->shim_empty = (mtc_shim_empty_fn)dlsym(lib, "aoti_torch_empty_strided");
    st->shim_data_ptr = (mtc_shim_get_ptr_fn)dlsym(lib, "aoti_torch_get_data_ptr");
    st->shim_get_dtype = (mtc_shim_get_i32_fn)dlsym(lib, "aoti_torch_get_dtype");
    st->shim_storage_offset = (mtc_shim_get_i64_fn)dlsym(lib, "aoti_torch_get_storage_offset");
    st->shim_storage_size = (mtc_shim_get_i64_fn)dlsym(lib, "aoti_torch_get_storage_size");
    if (!u8 || !cpu || !cuda || !st->shim_empty || !st->shim_data_ptr || !st->shim_get_dtype ||
        !st->shim_storage_offset || !st->shim_storage_size) {
        st->shim_empty = NULL;
        st->shim_data_ptr = NULL;
        st->shim_get_dtype = NULL;
        st->shim_storage_offset = st->shim_storage_size = NULL;
    } else {
        st->shim_uint8 = u8();
        st->shim_dev_cpu = cpu();
        st->shim_dev_cuda = cuda();
    }
    PyObject *path = PyDict_GetItemString(cfg, "shim_cuda"); /* borrowed */
    const char *p = path && PyUnicode_Check(path) ? PyUnicode_AsUTF8(path) : NULL;
    if (!p) {
        PyErr_Clear();
        return;
    }
    void *culib = dlopen(p, RTLD_NOW | RTLD_NOLOAD | RTLD_LOCAL);
    if (culib) st->shim_stream = (mtc_shim_stream_fn)dlsym(culib, "aoti_torch_get_current_cuda_stream");
}

int mtc_shim_empty(const mtc_state *st, int target, int code, int64_t numel, void **out, uintptr_t *ptr)
{
    if (!st->shim_empty) return -1;
    int32_t dtype = code < 0 ? st->shim_uint8 : code < MTC_MAX_DTYPES ? st->shim_dtype[code] : -1;
    if (dtype < 0) return -1;
    int64_t one = 1, offset = -1, nbytes = -1, need;
    int32_t got = -1;
    void *h = NULL, *data = NULL;
    if (st->shim_empty(1, &numel, &one, dtype, target < 0 ? st->shim_dev_cpu : st->shim_dev_cuda,
                       target < 0 ? 0 : target, &h) != 0 || !h)
        return -1;
    /* the chunk holds what will be written into it: its dtype, and its bytes
     * from its data pointer (else torch.empty from Python makes it, checked
     * there with an error that says what differs) */
    int elsize = code < 0 ? 1 : st->elsize[code];
    if (st->shim_data_ptr(h, &data) != 0 || (!data && numel) || st->shim_get_dtype(h, &got) != 0 || got != dtype ||
        st->shim_storage_offset(h, &offset) != 0 || st->shim_storage_size(h, &nbytes) != 0 || offset < 0 ||
        __builtin_add_overflow(numel, offset, &need) || __builtin_mul_overflow(need, (int64_t)elsize, &need) ||
        need > nbytes) {
        st->shim_delete(h);
        return -1;
    }
    *out = h;
    *ptr = (uintptr_t)data;
    return 0;
}

int mtc_shim_current_stream(const mtc_state *st, int dev, void **stream)
{
    if (!st->shim_stream || !st->shim_on) return -1;
    return st->shim_stream(dev, stream) == 0 ? 0 : -1;
}

PyObject *mtc_shim_wrap(const mtc_state *st, void *handle)
{
    PyObject *o = st->shim_wrap(handle);
    mtc_shim_release(st, handle);
    return o;
}

int mtc_shim_setup(mtc_state *st, PyObject *cfg)
{
    st->shim_offered = st->shim_on = 0;
    st->shim_empty = NULL;
    st->shim_data_ptr = NULL;
    st->shim_get_dtype = NULL;
    st->shim_storage_offset = st->shim_storage_size = NULL;
    st->shim_stream = NULL;
    st->shim_cuda_ready = 0;
    st->shim_reinterpret = NULL;
    st->shim_delete = NULL;
    memset(&st->sr, 0, sizeof st->sr);
    memset(st->sr.to_code, -1, sizeof st->sr.to_code);
    Py_CLEAR(st->shim_handle_of);
    Py_CLEAR(st->shim_steal);
    st->shim_env_off = 0;
    /* not offered: the Python side says why (no shim in torch._C._aoti, no library found) */
    st->shim_why = st->wrap_why = st->reader_why = NULL;
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
    if (!lib) {
        st->shim_why = "libtorch_cpu is not loaded in this process at that path (dlopen with RTLD_NOLOAD)";
        return 0;
    }
    st->shim_reinterpret = (mtc_shim_reinterpret_fn)dlsym(lib, "aoti_torch__reinterpret_tensor");
    st->shim_delete = (mtc_shim_delete_fn)dlsym(lib, "aoti_torch_delete_tensor_object");
    if (!st->shim_reinterpret || !st->shim_delete) {
        st->shim_reinterpret = NULL;
        st->shim_delete = NULL;
        st->shim_why = "libtorch_cpu exports no aoti_torch__reinterpret_tensor or aoti_torch_delete_tensor_object";
        return 0;
    }
    st->shim_handle_of = Py_NewRef(handle_of);
    st->shim_steal = Py_NewRef(steal);
    st->shim_offered = 1;
    /* each dtype's code in the shim, asked of torch (the chunk allocator's
     * dtypes: mtc_shim_empty) */
    mtc_shim_get_dtype_fn get_dtype = (mtc_shim_get_dtype_fn)dlsym(lib, "aoti_torch_get_dtype");
    for (int c = 0; c < MTC_MAX_DTYPES; c++) st->shim_dtype[c] = -1;
    PyObject *samples = PyDict_GetItemString(cfg, "dlpack_samples");
    if (get_dtype && samples && PyList_Check(samples) && PyList_GET_SIZE(samples) == st->ndtypes) {
        for (int c = 0; c < st->ndtypes; c++) {
            void *h = mtc_shim_handle(st, PyList_GET_ITEM(samples, c));
            int32_t code;
            if (!h) return -1;
            if (get_dtype(h, &code) == 0) st->shim_dtype[c] = code;
            mtc_shim_release(st, h);
        }
    }
    if (samples && PyList_Check(samples) && _setup_reader(st, lib, cfg, samples)) return -1;
    if (_setup_wrap(st, cfg)) return -1;
    _setup_empty(st, lib, cfg);
    st->shim_on = mtc_env_bool(MTC_ENV_TORCH_SHIM, 1);
    st->shim_env_off = !st->shim_on;
    st->sr.on = st->sr.offered && st->shim_on;
    st->shim_wrap_on = st->shim_wrap != NULL;
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
