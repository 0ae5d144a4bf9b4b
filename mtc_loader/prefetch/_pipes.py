"""A DataLoader's pipes as the prefetch service uses them: each batch taken from the result pipe, and
the next indices sent down a worker's index pipe, without giving up the GIL where nothing waits.

Per batch, a DataLoader with workers reads its result queue (``multiprocessing.Queue.get``: a
``poll`` and two ``read`` calls) and puts the next indices on a worker's index queue (``put``,
which wakes that queue's feeder thread to pickle and write them). Each of those gives up the GIL
and takes it back, and the feeder takes it twice. Beside a training thread that holds the GIL
(a launch-bound loop), every such hand-over makes the training thread wait for the GIL, so the
service's own reads and writes keep the GIL where the pipe call cannot block.

Here the service's calls into a DataLoader iterator (``_service._dataloader_next``: its
``__next__``, or its ``_next_data`` where the service skips the profiler range) see the iterator's
queues through two stand-ins, for that call only:

- the result queue's ``get`` takes a message that is already in the pipe with one C call that
  keeps the GIL (``_engine.pipe_take``: a header there means its payload follows; a payload that
  is still arriving is waited for GIL-free), under the queue's reader lock, as ``get`` does;
  with nothing in the pipe it is the queue's own ``get`` (its timeout, and the DataLoader's
  checks of dead workers and timeouts around it, unchanged);
- an index queue's ``put`` of the DataLoader's ``(task, indices)`` writes the message itself with
  one ``write`` that cannot block (``_engine.pipe_put``: at most ``PIPE_BUF`` bytes into a pipe
  that holds at most half its capacity), under the queue's writer lock and counted by its
  semaphore as ``put`` counts it, when the feeder thread has nothing waiting; otherwise (and for
  anything else put there: the epoch's resume, the end) it is the queue's own ``put``.

A message either way is the same bytes, read or written whole, so the worker and the DataLoader
cannot tell. A ``put`` that overtakes a message the feeder has taken but not yet written (the
two are batches apart) reorders two tasks of one worker, which the DataLoader receives in any
order and hands out in its own. ``MTC_QUIET_PIPES=0`` (read once, at import) uses the queues'
own methods; ``mtc_loader.stats()`` counts ``pipe_reads_quiet`` (whole messages),
``pipe_reads_waited`` (the rest waited for) and ``pipe_writes_quiet``.
"""
from __future__ import annotations

import multiprocessing.queues
import weakref
from multiprocessing.reduction import ForkingPickler
from typing import Any, Optional

from .. import _engine

_ON = bool(_engine._quiet_pipes())
_PIPE_TAKE = _engine.pipe_take
_PIPE_PUT = _engine.pipe_put
_LOADS = ForkingPickler.loads
_DUMPS = ForkingPickler.dumps
_MP_QUEUE = multiprocessing.queues.Queue
# what the stand-ins read of a multiprocessing.Queue (CPython 3.8 and later)
_QUEUE_ATTRS = ("_reader", "_writer", "_rlock", "_wlock", "_sem", "_closed", "_buffer", "_thread")


class _Results:
    """The result queue as the service's ``get`` sees it (see the module's docstring); every other
    attribute is the queue's."""

    __slots__ = ("q",)

    def __init__(self, q: Any) -> None:
        self.q = q

    def get(self, block: bool = True, timeout: Optional[float] = None) -> Any:
        q = self.q
        if not q._closed and q._rlock.acquire(False):
            try:
                msg = _PIPE_TAKE(q._reader.fileno())
                if msg is not None:
                    q._sem.release()
            finally:
                q._rlock.release()
            if msg is not None:
                return _LOADS(msg)
        return q.get(block, timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.q, name)


class _Indices:
    """A worker's index queue as the service's ``put`` sees it (see the module's docstring)."""

    __slots__ = ("q",)

    def __init__(self, q: Any) -> None:
        self.q = q

    def put(self, obj: Any, block: bool = True, timeout: Optional[float] = None) -> None:
        q = self.q
        # a task (the DataLoader's (index, indices)); the feeder started and holding nothing
        if type(obj) is tuple and not q._closed and q._thread is not None and not q._buffer and not q._writer.closed:
            fd = q._writer.fileno()
            payload = _DUMPS(obj)  # (before any lock: a failure leaves nothing held)
            if q._sem.acquire(False):
                sent = False
                if q._wlock.acquire(False):
                    try:
                        sent = _PIPE_PUT(fd, payload)
                    finally:
                        q._wlock.release()
                if sent:
                    return
                q._sem.release()  # put takes it again
        q.put(obj, block, timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.q, name)


def _is_mp_queue(q: Any) -> bool:
    return isinstance(q, _MP_QUEUE) and all(hasattr(q, a) for a in _QUEUE_ATTRS) and getattr(q, "_wlock") is not None


# per DataLoader iterator: (its result queue, its list of index queues, and their stand-ins)
_STANDINS: "weakref.WeakKeyDictionary[Any, tuple[Any, Any, Any, Any]]" = weakref.WeakKeyDictionary()


def standins(dl: Any) -> Optional[tuple[Any, Any]]:
    """The stand-ins of a DataLoader iterator's result queue and index queues, or None where they
    do not apply (turned off; a pin-memory thread reads the results; not multiprocessing queues).
    Made once per iterator, and anew if the iterator's queues change."""
    if not _ON:
        return None
    data, indices = getattr(dl, "_data_queue", None), getattr(dl, "_index_queues", None)
    got = _STANDINS.get(dl)
    if got is not None and got[0] is data and got[1] is indices:
        return got[2], got[3]
    if (data is None or data is not getattr(dl, "_worker_result_queue", None) or not _is_mp_queue(data)
            or type(indices) is not list or not all(_is_mp_queue(q) for q in indices)):
        return None
    made = (_Results(data), [_Indices(q) for q in indices])
    try:
        _STANDINS[dl] = (data, indices, *made)
    except TypeError:  # not weakly referenceable: made again next time
        pass
    return made
