/* test_pipe.c - multiprocessing.connection messages on a pipe (csrc/engine/pipe.c):
 * the header's lengths, whole reads and their ends, the room check that keeps a
 * write from blocking, and a reader and a writer on two threads (TSan). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* F_GETPIPE_SZ */
#endif
#include "pipe.h"

#include "check.h"

#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

enum { MSGS = 2000 };

static void *_writer(void *arg)
{
    int fd = *(int *)arg;
    unsigned char msg[4 + 64];
    for (uint32_t i = 0; i < MSGS; i++) {
        uint32_t len = 4 + i % 60;
        msg[0] = 0; msg[1] = 0; msg[2] = 0; msg[3] = (unsigned char)len;
        memcpy(msg + 4, &i, 4);
        memset(msg + 8, (int)(i & 0xff), len - 4);
        while (!mtc_pipe_room(fd, 4 + len)) sleep_ms(0); /* the reader drains it */
        CHECK_EQ(mtc_pipe_write_once(fd, msg, 4 + len), 0);
    }
    return NULL;
}

int main(void)
{
    unsigned char h[8] = {0, 0, 0x12, 0x34};
    CHECK_EQ(mtc_pipe_length(h), 0x1234);
    unsigned char m1[4] = {0xff, 0xff, 0xff, 0xff};
    CHECK_EQ(mtc_pipe_length(m1), -1);
    unsigned char l8[8] = {0, 0, 0, 1, 0, 0, 0, 2};
    CHECK_EQ(mtc_pipe_length8(l8), ((uint64_t)1 << 32) + 2);

    int p[2];
    CHECK_EQ(pipe(p), 0);
    CHECK_EQ(mtc_pipe_waiting(p[0]), 0);
    CHECK_EQ(mtc_pipe_room(p[1], 10), 1);
    CHECK_EQ(mtc_pipe_room(p[1], PIPE_BUF + 1), 0); /* not atomic: never */
    CHECK_EQ(mtc_pipe_write_once(p[1], "abcdef", 6), 0);
    CHECK_EQ(mtc_pipe_waiting(p[0]), 6);
    char buf[16];
    CHECK_EQ(mtc_pipe_read_exact(p[0], buf, 6), 0);
    CHECK(memcmp(buf, "abcdef", 6) == 0);

    /* half the capacity held: no room; drained: room again */
    int cap = fcntl(p[1], F_GETPIPE_SZ);
    CHECK(cap > 0);
    char *fill = calloc(1, (size_t)cap / 2);
    CHECK(fill != NULL);
    CHECK_EQ(mtc_pipe_write_once(p[1], fill, (size_t)cap / 2), 0);
    CHECK_EQ(mtc_pipe_room(p[1], 1), 0);
    CHECK_EQ(mtc_pipe_read_exact(p[0], fill, (size_t)cap / 2), 0);
    CHECK_EQ(mtc_pipe_room(p[1], 1), 1);
    free(fill);

    /* not a pipe: no room (a regular descriptor is never written this way) */
    int devnull = open("/dev/null", O_WRONLY);
    CHECK(devnull >= 0);
    CHECK_EQ(mtc_pipe_room(devnull, 1), 0);
    close(devnull);

    /* a reader and a writer on two threads: every message whole and in order */
    pthread_t t;
    CHECK_EQ(pthread_create(&t, NULL, _writer, &p[1]), 0);
    for (uint32_t i = 0; i < MSGS; i++) {
        unsigned char head[4], body[64];
        CHECK_EQ(mtc_pipe_read_exact(p[0], head, 4), 0);
        int64_t len = mtc_pipe_length(head);
        CHECK_EQ(len, 4 + i % 60);
        CHECK_EQ(mtc_pipe_read_exact(p[0], body, (size_t)len), 0);
        uint32_t got;
        memcpy(&got, body, 4);
        CHECK_EQ(got, i);
        for (int64_t k = 4; k < len; k++) CHECK_EQ(body[k], (unsigned char)(i & 0xff));
    }
    CHECK_EQ(pthread_join(t, NULL), 0);

    /* the writers gone: end of file before a message, and within one */
    CHECK_EQ(mtc_pipe_write_once(p[1], "xy", 2), 0);
    close(p[1]);
    CHECK_EQ(mtc_pipe_read_exact(p[0], buf, 4), -EIO);
    CHECK_EQ(mtc_pipe_read_exact(p[0], buf, 4), -EPIPE);
    close(p[0]);

    /* no reader: the write fails (EPIPE; SIGPIPE ignored as Python ignores it) */
    CHECK_EQ(pipe(p), 0);
    close(p[0]);
    signal(SIGPIPE, SIG_IGN);
    CHECK_EQ(mtc_pipe_write_once(p[1], "z", 1), -EPIPE);
    close(p[1]);
    printf("test_pipe: %ld checks passed\n", (long)g_checks);
    return 0;
}
