/*
 * pipe.h - messages of Python's multiprocessing.connection on a pipe, read
 * and written only when that cannot block: what lets the prefetch service
 * take a DataLoader worker's batch from the result pipe, and send the next
 * indices down a worker's index pipe, without giving up the GIL (each time
 * it gives the GIL up, a training thread that wants it back waits for a
 * hand-over: see mtc_loader/prefetch/_pipes.py).
 *
 * A message is a 4-byte big-endian signed length and the payload; a length
 * of -1 is followed by an 8-byte big-endian length (payloads of 2 GiB and
 * more). Readers and writers of one pipe are serialized by the caller (the
 * queue's locks), so a message is never interleaved with another.
 *
 * No Python here; functions return 0 / a count, or a negative errno. Names
 * starting with `_` are internal to pipe.c.
 */
#ifndef MTC_PIPE_H
#define MTC_PIPE_H

#include <stddef.h>
#include <stdint.h>

/* Bytes waiting to be read in the pipe (FIONREAD), or -errno. */
int64_t mtc_pipe_waiting(int fd);

/* Whether a write of n bytes to the pipe returns at once, whole and alone:
 * n is at most PIPE_BUF (atomic) and the pipe holds at most half its
 * capacity less n. 1 yes, 0 no (or the pipe cannot be asked: not a pipe). */
int mtc_pipe_room(int fd, size_t n);

/* Reads exactly n bytes (a blocking read where they are not there yet;
 * EINTR retried). 0; -EPIPE at end of file before any byte (the writers are
 * gone), -EIO at end of file within the n bytes; -errno. */
int mtc_pipe_read_exact(int fd, void *buf, size_t n);

/* Writes n bytes with one write(2). 0 when all were written; -EAGAIN when
 * fewer were (nothing more is written); -errno (EPIPE: no reader). */
int mtc_pipe_write_once(int fd, const void *buf, size_t n);

/* The length of the message whose header is `head` (4 bytes, big-endian);
 * -1 when an 8-byte length follows. */
int64_t mtc_pipe_length(const unsigned char head[4]);

/* The length in an 8-byte big-endian extended header. */
uint64_t mtc_pipe_length8(const unsigned char head[8]);

#endif /* MTC_PIPE_H */
