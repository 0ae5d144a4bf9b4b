"""The caller's side of an epoch: ``__next__`` takes a finished batch from the service and hands it
to the caller's current stream."""
from __future__ import annotations

import time
from typing import Any, Callable, Iterator, Optional

from .. import _trace
from ._resume import _NO_STATE, _Position
from ._service import _END, _RANGE_NEXT, _forget_iterator, _next_of, _Raised, _Service
from ._side import SideCopy

class _HandOut:
    """The caller's side of one epoch: takes finished batches and counts the time it waited."""

    __slots__ = ("service", "stats", "last", "done", "position", "it", "next")

    def __init__(self, service: _Service, stats: dict[str, Any], position: _Position) -> None:
        self.service, self.stats, self.position = service, stats, position
        self.last: Optional[float] = None
        self.done = False
        # where the caller produces the batches: its iterator of the iterable (made at the
        # epoch's first next, as a plain loop's for statement makes it) and that one's next
        self.it: Optional[Iterator[Any]] = None
        self.next: Optional[Callable[[], Any]] = None

    def _produce(self) -> None:
        """The next batch taken from the iterable on this thread and posted to the service (or
        the end, or the exception that producing raised)."""
        service = self.service
        try:
            if self.next is None:
                self.it = iter(service.iterable)
                self.next = _next_of(self.it)
            batch = self.next()
        except StopIteration:
            service.give(_END)
            return
        except BaseException as e:
            _forget_iterator(e, self.it)
            service.give(_Raised(e))
            return
        service.give(batch)

    def pending(self) -> bool:
        return not self.done

    def take(self) -> Any:
        """The next batch, handed to the caller's current stream; raises the epoch's error;
        at the end returns nothing and marks the epoch done (the generator then returns)."""
        stats = self.stats
        t0 = time.perf_counter()
        if self.last is not None:
            stats["step_s"] += t0 - self.last
            stats["steps"] += 1
        if self.service.inbox is not None:  # this thread produces the batch, the service copies it
            self._produce()
        if _trace.active():  # free when no tool is attached
            with _trace.Range(_RANGE_NEXT):
                side, error = self.service.take()
                batch = self._hand_out(side) if error is None and side is not _END else None
        else:
            side, error = self.service.take()
            batch = self._hand_out(side) if error is None and side is not _END else None
        self.service.room()
        if error is not None:
            self.done = True
            raise error
        if side is _END:
            self.done = True
            if self.service.end_state is not _NO_STATE:
                self.position.state = self.service.end_state  # the iterable's state at its end
            raise _EpochEnd
        self.last = time.perf_counter()
        stats["wait_s"] += self.last - t0
        stats["batches"] += 1
        return batch


    def _hand_out(self, side: SideCopy) -> Any:
        # No call here releases the GIL (the event wait is one driver call made with it held,
        # the buffers were recorded on the predicted stream by the service): releasing it would
        # let the service thread, woken for the next batch, take it for up to a switch interval.
        if side._event:
            fresh = side._hand_to_current()
            if fresh is not None:
                self.service.consumer = fresh
        side._keep = None  # the temporary views go here, before the service is woken
        self.position.state = side._state  # the iterable's position after this batch
        return side._result


class _EpochEnd(Exception):
    """Internal: the service has no more batches."""
