/*
 * pipes.c - see pipes.h.
 */
#include "pipes.h"

#include <errno.h>
#include <limits.h>
#include <string.h>

#include "env.h"
#include "pipe.h"

/* The OSError of a failed read: EOFError at end of file before the message
 * (as Connection.recv_bytes raises it), OSError otherwise. NULL. */
static PyObject *_read_error(int err)
{
    if (err == -EPIPE) {
        PyErr_SetNone(PyExc_EOFError);
        return NULL;
    }
    if (err == -EIO) {
        PyErr_SetString(PyExc_OSError, "got end of file during message");
        return NULL;
    }
    errno = -err;
    return PyErr_SetFromErrno(PyExc_OSError);
}

PyObject *mtc_pipes_take(PyObject *module, PyObject *fdobj)
{
    (void)module;
    int fd = PyObject_AsFileDescriptor(fdobj);
    if (fd < 0) return NULL;
    int64_t waiting = mtc_pipe_waiting(fd);
    if (waiting < 4) Py_RETURN_NONE; /* no header yet (or not a pipe): nothing read */
    unsigned char head[8];
    int rc = mtc_pipe_read_exact(fd, head, 4); /* waiting: returns at once */
    if (rc) return _read_error(rc);
    waiting -= 4;
    int64_t len = mtc_pipe_length(head);
    if (len == -1) { /* an 8-byte length follows (its writer sends it right after) */
        if (waiting >= 8) {
            rc = mtc_pipe_read_exact(fd, head, 8);
        } else {
            Py_BEGIN_ALLOW_THREADS
            rc = mtc_pipe_read_exact(fd, head, 8);
            Py_END_ALLOW_THREADS
        }
        if (rc) return _read_error(rc);
        waiting = waiting >= 8 ? waiting - 8 : 0;
        uint64_t l8 = mtc_pipe_length8(head);
        if (l8 > (uint64_t)PY_SSIZE_T_MAX) {
            PyErr_SetString(PyExc_OverflowError, "mtc_loader: a pipe message longer than this process can hold");
            return NULL;
        }
        len = (int64_t)l8;
    } else if (len < 0) {
        len = 0; /* as Connection._recv_bytes reads it: no payload */
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)len);
    if (!out) return NULL;
    char *p = PyBytes_AS_STRING(out);
    int whole = waiting >= len;
    if (whole) {
        rc = mtc_pipe_read_exact(fd, p, (size_t)len); /* all there: no wait */
    } else { /* the writer is part-way through: its rest arrives soon */
        Py_BEGIN_ALLOW_THREADS
        rc = mtc_pipe_read_exact(fd, p, (size_t)len);
        Py_END_ALLOW_THREADS
    }
    if (rc) {
        Py_DECREF(out);
        return _read_error(rc == -EPIPE ? -EIO : rc);
    }
    if (whole) mtc_cnt.pipe_reads_quiet++;
    else mtc_cnt.pipe_reads_waited++;
    return out;
}

PyObject *mtc_pipes_put(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "mtc_loader: pipe_put(fd, payload) takes 2 arguments");
        return NULL;
    }
    int fd = PyObject_AsFileDescriptor(args[0]);
    if (fd < 0) return NULL;
    Py_buffer b;
    if (PyObject_GetBuffer(args[1], &b, PyBUF_SIMPLE) < 0) return NULL;
    unsigned char msg[PIPE_BUF];
    size_t n = (size_t)b.len + 4;
    if (b.len > INT32_MAX - 4 || n > sizeof msg || !mtc_pipe_room(fd, n)) {
        PyBuffer_Release(&b);
        Py_RETURN_FALSE;
    }
    uint32_t len = (uint32_t)b.len;
    msg[0] = (unsigned char)(len >> 24);
    msg[1] = (unsigned char)(len >> 16);
    msg[2] = (unsigned char)(len >> 8);
    msg[3] = (unsigned char)len;
    memcpy(msg + 4, b.buf, (size_t)b.len);
    PyBuffer_Release(&b);
    /* at most PIPE_BUF bytes into a pipe with room: one write, whole, at once */
    int rc = mtc_pipe_write_once(fd, msg, n);
    if (rc == 0) {
        mtc_cnt.pipe_writes_quiet++;
        Py_RETURN_TRUE;
    }
    if (rc == -EAGAIN) { /* part of it written: the pipe's stream is broken (cannot happen, see above) */
        PyErr_SetString(PyExc_OSError, "mtc_loader: a pipe took part of a message it had room for");
        return NULL;
    }
    Py_RETURN_FALSE; /* nothing written (EPIPE: the worker is gone): the usual way reports it */
}

PyObject *mtc_pipes_on(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    return PyBool_FromLong(mtc_env_bool(MTC_ENV_QUIET_PIPES, 1));
}
