/*
 * buffers.h - the check of every tensor torch hands the engine to write into
 * (an output of start_copy, a packed group's tensor, an unpack's chunk made
 * from Python), before anything is written (GIL held). Functions return 0,
 * or -1 with an exception set. Names starting with `_` are internal to
 * buffers.c.
 */
#ifndef MTC_BUFFERS_H
#define MTC_BUFFERS_H

#include "state.h"

/* Checks a tensor torch handed the engine to write into (an output, a packed
 * group's tensor), before anything is written: an exact torch.Tensor, strided,
 * of the engine's dtype `code`, on device `dev` (-1: the CPU, else cuda:dev),
 * of dims shape[0..ndim) with element strides `strides` (NULL: contiguous;
 * dims of size 0 or 1 are not compared), whose storage holds every byte of
 * them, with memory where there are bytes. Its data pointer into *ptr. A mode
 * that hands out another tensor (a smaller dtype, fewer elements, other
 * strides, another device) would have the engine write past its memory.
 * Through the shim's getters for an exact tensor where the leaf reader is on
 * (plain C calls), else through its attributes. 0, or -1 with RuntimeError
 * saying what torch gave, what was asked for, and the active modes. */
int mtc_buffer_check(mtc_state *st, PyObject *tensor, int code, int dev, int64_t ndim, const int64_t *shape,
                     const int64_t *strides, uintptr_t *ptr);

#endif /* MTC_BUFFERS_H */
