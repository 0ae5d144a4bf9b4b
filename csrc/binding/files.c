/*
 * files.c - the binding layer of file-backed leaves (see files.h).
 */
#include "files.h"

#include <errno.h>
#include <string.h>
#include <sys/stat.h>

#include "uring.h"

static PyObject *_s_spec; /* interned "_spec", guarded by the GIL */
static int _warned;       /* the fallback warning was given in this process (a forked child inherits it) */

/* Warns once per process when reads take the pread path without being asked
 * to (file_configure, a test hook, does not re-arm it: a program meets it
 * once, and a test suite can expect it once). 0, or -1 when the warning was
 * turned into an exception. */
static int _warn_fallback_once(void)
{
    if (_warned) return 0;
    const char *why;
    int forced;
    int mode;
    Py_BEGIN_ALLOW_THREADS
    mode = mtc_uring_mode(&why, &forced);
    Py_END_ALLOW_THREADS
    if (mode == MTC_URING_MODE_URING || forced) return 0;
    _warned = 1;
    return PyErr_WarnFormat(PyExc_RuntimeWarning, 1,
                            "mtc_loader: file-backed tensors are read with pread on helper threads, not "
                            "io_uring: %s", why ? why : "unknown reason");
}

int mtc_files_leaf(mtc_state *st, PyObject *obj, mtc_leaf *l, int64_t *dims, PyObject **spec)
{
    *spec = NULL;
    if (!_s_spec && !(_s_spec = PyUnicode_InternFromString("_spec"))) return -1;
    PyObject *b = PyObject_GetAttr(obj, _s_spec);
    if (!b) return -1;
    mtc_file_spec s;
    if (!PyBytes_CheckExact(b) ||
        mtc_uring_spec_view(PyBytes_AS_STRING(b), (size_t)PyBytes_GET_SIZE(b), &s) ||
        s.h.dtype >= st->ndtypes || s.h.ndim > MTC_MAX_NDIM) {
        PyErr_SetString(PyExc_ValueError, "mtc_loader: a FileTensor's _spec is malformed "
                        "(build FileTensors with mtc_loader.FileTensor(...), do not edit them)");
        goto error;
    }
    memset(l, 0, sizeof *l);
    l->dtype = s.h.dtype;
    l->elsize = (uint16_t)st->elsize[s.h.dtype];
    l->ndim = s.h.ndim;
    l->dev = MTC_DEV_CPU;
    l->flags = MTC_LEAF_FILE;
    l->data = (uintptr_t)PyBytes_AS_STRING(b);
    int64_t numel = 1;
    for (int d = 0; d < l->ndim; d++) {
        memcpy(&dims[d], &s.dims[d], sizeof dims[d]);
        if (dims[d] < 0 || (dims[d] && numel > INT64_MAX / dims[d])) numel = -1;
        else numel *= dims[d];
    }
    if (numel < 0 || numel > INT64_MAX / l->elsize || numel * l->elsize != s.h.nbytes) {
        PyErr_SetString(PyExc_ValueError, "mtc_loader: a FileTensor's _spec does not match its shape and dtype");
        goto error;
    }
    if (_warn_fallback_once()) goto error;
    *spec = b;
    return 0;
error:
    Py_DECREF(b);
    return -1;
}

PyObject *mtc_files_error(const void *spec, PyObject *where, uint32_t part, int err, uint64_t got)
{
    mtc_file_spec s;
    mtc_file_part p;
    const char *path;
    PyObject *msg = NULL, *exc = NULL, *pypath = NULL;
    if (mtc_uring_spec_view(spec, mtc_uring_spec_size(spec), &s) || part >= s.h.nparts) {
        PyErr_SetString(PyExc_SystemError, "mtc_loader: a file read failed on a leaf without a valid spec");
        return NULL;
    }
    mtc_uring_spec_part(&s, part, &p, &path);
    if (!(pypath = PyUnicode_DecodeFSDefault(path))) goto error;
    PyObject *type = PyExc_OSError;
    if (err == -ENODATA) {
        struct stat sb;
        long long size = stat(path, &sb) == 0 ? (long long)sb.st_size : -1;
        msg = PyUnicode_FromFormat(
            "mtc_loader: cannot read %U from %R: the file is %lld bytes long, and the leaf needs bytes "
            "[%llu, %llu) of it (it ended after %llu of its %llu bytes); check the FileTensor's offset, "
            "shape and dtype", where, pypath, size, (unsigned long long)p.offset,
            (unsigned long long)(p.offset + p.nbytes), (unsigned long long)got, (unsigned long long)p.nbytes);
        type = PyExc_EOFError;
    } else {
        int e = -err;
        if (e == ENOENT || e == ENOTDIR) type = PyExc_FileNotFoundError;
        else if (e == EACCES || e == EPERM) type = PyExc_PermissionError;
        else if (e == EISDIR) type = PyExc_IsADirectoryError;
        /* _open_data's refusal of a FIFO, socket or character device */
        const char *why = e == ESPIPE ? "not a regular file or block device (a FileTensor is read at offsets)"
                                      : strerror(e);
        msg = PyUnicode_FromFormat("mtc_loader: cannot read %U from %R (bytes [%llu, %llu)): %s", where, pypath,
                                   (unsigned long long)p.offset, (unsigned long long)(p.offset + p.nbytes), why);
    }
    if (!msg) goto error;
    if (!(exc = PyObject_CallOneArg(type, msg))) goto error;
    /* errno / strerror / filename are left unset: OSError's str() would then
     * print them instead of the message; the type says which errno it was */
    Py_DECREF(pypath);
    Py_DECREF(msg);
    return exc;
error:
    Py_XDECREF(exc);
    Py_XDECREF(msg);
    Py_XDECREF(pypath);
    return NULL;
}

int mtc_files_stats(PyObject *d)
{
    mtc_uring_stats s;
    mtc_uring_get_stats(&s);
    struct { const char *k; uint64_t v; } kv[] = {
        {"file_reads_uring", s.reads_uring}, {"file_reads_pread", s.reads_pread}, {"file_bytes_read", s.bytes},
        {"file_bytes_cached", s.bytes_cached}, {"file_bytes_direct", s.bytes_direct},
        {"file_bytes_buffered", s.bytes_buffered}, {"file_bytes_pread", s.bytes_pread},
        {"file_reads_direct", s.direct_reads}, {"file_direct_refused", s.direct_refused},
        {"file_uring_submits", s.submits},
        {"file_short_reads", s.short_reads}, {"file_read_errors", s.errors},
    };
    for (size_t i = 0; i < sizeof kv / sizeof kv[0]; i++) {
        PyObject *o = PyLong_FromUnsignedLongLong(kv[i].v);
        if (!o) return -1;
        int rc = PyDict_SetItemString(d, kv[i].k, o);
        Py_DECREF(o);
        if (rc) return -1;
    }
    return 0;
}

PyObject *mtc_files_reader(PyObject *module, PyObject *unused)
{
    const char *why;
    int forced, mode;
    Py_BEGIN_ALLOW_THREADS
    mode = mtc_uring_mode(&why, &forced);
    Py_END_ALLOW_THREADS
#ifdef MTC_HAVE_LIBURING
    PyObject *built = Py_True;
#else
    PyObject *built = Py_False;
#endif
    return Py_BuildValue("(szOO)", mode == MTC_URING_MODE_URING ? "io_uring" : "pread", why,
                         forced ? Py_True : Py_False, built);
}

PyObject *mtc_files_configure(PyObject *module, PyObject *args)
{
    unsigned int depth;
    unsigned long long max_io;
    int direct, mode, mincore = 0;
    if (!PyArg_ParseTuple(args, "IKii|p", &depth, &max_io, &direct, &mode, &mincore)) return NULL;
    if (direct < MTC_URING_DIRECT_OFF || direct > MTC_URING_DIRECT_ALWAYS) {
        PyErr_SetString(PyExc_ValueError, "file_configure: direct is 0 (off), 1 (uncached) or 2 (always)");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    mtc_uring_configure(depth, max_io, direct, mode);
    mtc_uring_probe_mincore(mincore);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}
