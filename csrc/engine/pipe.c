/*
 * pipe.c - see pipe.h.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* F_GETPIPE_SZ */
#endif
#include "pipe.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <sys/ioctl.h>
#include <unistd.h>

int64_t mtc_pipe_waiting(int fd)
{
    int n = 0;
    if (ioctl(fd, FIONREAD, &n) < 0) return -errno;
    return n;
}

int mtc_pipe_room(int fd, size_t n)
{
    if (n > PIPE_BUF) return 0;
#ifdef F_GETPIPE_SZ
    int cap = fcntl(fd, F_GETPIPE_SZ);
    if (cap <= 0) return 0;
    int64_t waiting = mtc_pipe_waiting(fd);
    if (waiting < 0) return 0;
    /* Half the capacity: the kernel counts a pipe's room in pages, and small
     * writes that cannot merge into the last page take one each; half the
     * bytes leaves pages to spare for any such mix (the pipes here carry a
     * few messages of tens of bytes to a few KiB). */
    return (uint64_t)waiting + n <= (uint64_t)cap / 2;
#else
    (void)fd;
    return 0;
#endif
}

int mtc_pipe_read_exact(int fd, void *buf, size_t n)
{
    char *p = buf;
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, p + got, n - got);
        if (r < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (r == 0) return got == 0 ? -EPIPE : -EIO;
        got += (size_t)r;
    }
    return 0;
}

int mtc_pipe_write_once(int fd, const void *buf, size_t n)
{
    ssize_t w;
    do {
        w = write(fd, buf, n);
    } while (w < 0 && errno == EINTR);
    if (w < 0) return -errno;
    return (size_t)w == n ? 0 : -EAGAIN;
}

int64_t mtc_pipe_length(const unsigned char h[4])
{
    int32_t v = (int32_t)(((uint32_t)h[0] << 24) | ((uint32_t)h[1] << 16) | ((uint32_t)h[2] << 8) | h[3]);
    return v;
}

uint64_t mtc_pipe_length8(const unsigned char h[8])
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v = (v << 8) | h[i];
    return v;
}
