"""The prefetch service: a daemon thread that takes each batch as it is produced, copies it on a
dedicated copy stream of the device and builds it, so the training loop never waits for data.

:class:`PrefetchLoader` wraps any iterable of batches. For each epoch it starts one thread that
pulls batches from the iterable as soon as they are produced (at most ``depth`` finished batches
wait for the caller), and for each one starts the copy (:meth:`~mtc_loader.PackedBatch.start_copy`
for a packed batch: one DMA from the arena; :func:`~mtc_loader.start_copy` otherwise) with the
device's **copy stream** current, waits until the copy is enqueued and the output structure is
built (the GIL released while it waits), and records an event on the copy stream. The caller's
``__next__`` only takes a finished batch: its current stream waits for that event on the GPU (no
CPU synchronisation), and the batch's device buffers are recorded on the caller's stream for
torch's caching allocator. :func:`start_side_copy` is the same unit of work for a hand-written
loop.
"""
from __future__ import annotations

import copy
import functools
import inspect
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator as _AnIterator
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional, TypeVar

import torch

from . import _engine, _trace
from ._device import target_index
from ._flight import expect_in_flight, withdraw
from .collate import _ARENAS, PackedBatch, _consumes
from .copy import start_copy
from .handle import AsyncCopyHandle

__all__ = ["PrefetchLoader", "SideCopy", "copy_stream", "start_side_copy"]

_COPY_STREAMS: dict[int, "torch.cuda.Stream"] = {}
_COPY_RAW: dict[int, int] = {}  # the raw handles of _COPY_STREAMS
_STREAMS_LOCK = threading.Lock()


def copy_stream(device: Any) -> "torch.cuda.Stream":
    """The dedicated copy stream of a CUDA device (one per device and process, created on first
    use), on which :class:`PrefetchLoader` and :func:`start_side_copy` issue their copies.

    Args:
        device: A CUDA device (``"cuda"`` means the current device).

    Raises:
        ValueError: For a device that is not a CUDA device.
    """
    index = target_index(device)
    if index < 0:
        raise ValueError(f"mtc_loader: copy_stream needs a CUDA device, got {device!r}")
    return _copy_stream(index)


def _raw_current_stream(index: int) -> int:
    """The raw handle (``cudaStream_t``) of the calling thread's current stream on a device."""
    get = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if get is not None:  # no Stream object built: a few hundred ns
        return int(get(index))
    return int(torch.cuda.current_stream(index).cuda_stream)


def _copy_stream(index: int) -> "torch.cuda.Stream":
    stream = _COPY_STREAMS.get(index)
    if stream is None:
        with _STREAMS_LOCK:
            stream = _COPY_STREAMS.get(index)
            if stream is None:
                stream = torch.cuda.Stream(device=index)  # type: ignore[no-untyped-call]
                _COPY_RAW[index] = int(stream.cuda_stream)
                _COPY_STREAMS[index] = stream
    return stream


class SideCopy:
    """A copy issued on the device's copy stream (:func:`start_side_copy`); :meth:`get` hands the
    result to the calling thread's current stream without a CPU synchronisation."""

    __slots__ = ("_handle", "_index", "_result", "_event", "_buffers", "_keep", "_recorded", "_done", "_state")

    def __init__(self, handle: Any, index: int) -> None:
        # the engine's handle (an AsyncCopyHandle's, or one PackedBatch._start made)
        self._handle = handle._h if isinstance(handle, AsyncCopyHandle) else handle
        self._index = index
        self._result: Any = None
        self._event = 0  # raw handle of the copy stream's pooled event (_engine.event_record), 0: none
        self._buffers: list[torch.Tensor] = []
        # the temporary views the engine made on the way to the outputs: dropping a tensor releases
        # the GIL, and the service thread, sharing it with a launch-bound training thread, would
        # wait for a forced switch after each; they are dropped with the buffers at hand-out
        self._keep: Optional[list[torch.Tensor]] = None
        self._recorded: Optional[int] = None  # raw handle of the stream the buffers are recorded on
        self._done = False
        # PrefetchLoader: the wrapped iterable's state_dict() right after this batch was taken
        self._state: Any = _NO_STATE

    def ready(self) -> bool:
        """True when :meth:`get` would return without waiting for the CPU side of the copy (the
        GPU side may still run: :meth:`get` makes the caller's stream wait for it)."""
        return self._done or self._handle.ready()

    def _finish(self, consumer: Optional["torch.cuda.Stream"] = None) -> None:
        """Waits (GIL released) until every copy is enqueued on the copy stream and the output
        structure is built, then records the copy stream's event. Any thread may call it; the
        copy stream must be the one the copy was started on.

        ``consumer``: the stream expected to use the batch; its buffers are recorded on it now
        (``record_stream`` only adds the stream to what the allocator waits for when the memory
        is freed, so recording early is as safe as at hand-out), which spares the hand-out the
        torch calls (each releases and retakes the GIL) when the prediction holds.
        """
        if self._done:
            return
        h = self._handle
        self._result = h.get()
        self._keep = h.temporaries()
        if self._index >= 0:
            self._buffers = h.buffers()
            # a pooled driver event recorded with the GIL held: torch.cuda.Event's record releases
            # it, and a service thread then waits for a launch-bound training thread to give it back
            raw = _COPY_RAW.get(self._index)
            if raw is None:
                _copy_stream(self._index)
                raw = _COPY_RAW[self._index]
            self._event = _engine.event_record(self._index, raw)
            if consumer is not None:
                for buf in self._buffers:
                    buf.record_stream(consumer)
                self._recorded = int(consumer.cuda_stream)
        self._handle = None  # the engine's handle is no longer needed
        self._done = True

    def _hand_to_current(self) -> Optional["torch.cuda.Stream"]:
        """Makes the calling thread's current stream wait (on the GPU) for the copy's event and
        records the buffers on it unless :meth:`_finish` already did. The wait is one driver call
        made with the GIL held. Returns the current stream when its buffers had to be recorded
        here (the prediction missed), else None."""
        assert self._event
        raw = _raw_current_stream(self._index)
        event, self._event = self._event, 0
        try:
            _engine.stream_wait_event(self._index, raw, event)
        finally:  # the wait took the record's state: the event is free again
            _engine.event_release(self._index, event)
        fresh = None
        if raw != self._recorded:
            fresh = torch.cuda.current_stream(self._index)
            for buf in self._buffers:
                buf.record_stream(fresh)
        self._buffers = []
        self._keep = None
        return fresh

    def get(self) -> Any:
        """The copied structure, usable in order on the calling thread's current stream.

        The current stream waits (on the GPU) for the copy stream's event, and every output
        buffer is recorded on it (``Tensor.record_stream``), so the caching allocator does not
        reuse the memory while kernels queued there may still read it.

        Raises:
            RuntimeError: If the copy failed (as :meth:`AsyncCopyHandle.get`).
        """
        self._finish()
        if self._event:
            self._hand_to_current()
        return self._result

    def __del__(self) -> None:
        if getattr(self, "_event", 0):  # never handed out: its event goes back to the pool
            try:
                _engine.event_release(self._index, self._event)
            except Exception:  # interpreter shutdown
                pass


def start_side_copy(data: Any, device: Any, **start_copy_options: Any) -> SideCopy:
    """Start copying ``data`` (a nested structure or a :class:`~mtc_loader.PackedBatch`) to
    ``device`` on the device's dedicated copy stream (:func:`copy_stream`) instead of the current
    stream, so that the DMA overlaps the kernels queued on the current stream.

    Unlike :func:`~mtc_loader.start_copy`, the copy does not wait for work queued earlier on the
    caller's stream; :meth:`SideCopy.get` makes the caller's current stream wait for the copy
    instead. This is what :class:`PrefetchLoader` does for every batch. For ``"cpu"`` it is
    ``start_copy``. Inputs that live on a GPU must therefore be complete: a tensor that kernels
    queued on another stream are still writing would be read early (host inputs, the usual case,
    have no such concern).

    Args:
        data: The structure to copy, or a packed batch.
        device: Target device.
        **start_copy_options: Passed to :func:`~mtc_loader.start_copy`.
    """
    index = target_index(device)
    if index < 0:
        return SideCopy(_start(data, device, start_copy_options), index)
    with torch.cuda.stream(_copy_stream(index)):
        return SideCopy(_start(data, index, start_copy_options), index)


def _start(batch: Any, device: Any, options: dict[str, Any]) -> Any:
    """The copy of one batch started: the engine's handle of a packed batch (its region DMA'd,
    the structure built), or an AsyncCopyHandle."""
    if type(batch) is PackedBatch and (not options or set(options) == {"use_background_thread"}):
        return batch._start(target_index(device), bool(options.get("use_background_thread", True)))
    if isinstance(batch, PackedBatch):
        return batch.start_copy(device, **options)
    return start_copy(batch, device, **options)


# ------------------------------------------------------------------------------ the service

_END = object()
_NO_STATE = object()  # a batch of an iterable without state_dict (or no snapshot taken)
_UNSET = object()  # PrefetchLoader._state before its first hand-out: the iterable's own state


class _Raised:
    """An exception the caller's thread met producing a batch, posted to the service (which
    hands it back in order, as one of its own)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _FailedSnapshot:
    """The service's snapshot of the iterable's state when ``state_dict()`` raised: the batch is
    handed out all the same, and ``PrefetchLoader.state_dict()`` raises while it is the last."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error.with_traceback(None)  # its frames would keep the iterator alive

# NVTX and torch.profiler ranges (_trace), entered only when a tool is attached: the caller's wait
# and hand-out in __next__, and the service thread's copy of one batch (in torch.profiler traces
# that profile every thread: torch.profiler.profile(experimental_config=
# torch._C._profiler._ExperimentalConfig(profile_all_threads=True)))
_RANGE_NEXT = "mtc_loader.prefetch.next"
_RANGE_COPY = "mtc_loader.prefetch.copy_batch"


class _SwitchInterval:
    """Lowers the interpreter's GIL switch interval while at least one service works on a batch.

    A launch-bound training thread holds the GIL almost all the time; the service thread gets it
    only when the interpreter forces a switch, after ``sys.getswitchinterval()`` (5 ms by
    default). The service releases the GIL several times per batch (the DataLoader's pipe reads
    and polls, the wait for the copy), and each time it must wait for another forced switch: at
    5 ms per wait it falls behind a 10 ms step. A short interval while it works bounds each wait;
    the time it holds the GIL stays the same.

    While several services work at once, the interval is the shortest any of them asked for (and
    never above the program's own). The program's interval comes back exactly when no service
    works any more, unless the program changed it meanwhile (its new value is then kept, and is
    the one lowered from next). The interpreter keeps the interval in whole microseconds,
    truncating what it is given, and reports it as a float that does not always give the same
    microseconds back (after ``setswitchinterval(0.0071)``, setting ``getswitchinterval()``
    again keeps 7099 us, not 7100), so values are compared and set here in those microseconds:
    the one the program had is set back as it was, and nothing is set when nothing changes.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.wanted: list[int] = []  # the intervals of the services working now, in us
        self.saved = 0  # the program's interval, in us
        self.ours: Optional[int] = None  # the interval set or kept here while services work, in us

    @staticmethod
    def _get() -> int:
        return round(sys.getswitchinterval() * 1e6)

    @staticmethod
    def _set(us: int) -> None:
        # the interpreter keeps int(1e6 * seconds): half a microsecond above lands on us exactly
        sys.setswitchinterval((us + 0.5) / 1e6)

    def _apply(self) -> None:
        cur = self._get()
        if self.ours is None or cur != self.ours:  # no service worked, or the program changed it
            self.saved = cur
        target = min([self.saved, *self.wanted])
        if target != cur:
            self._set(target)
        self.ours = target if self.wanted else None

    def enter(self, interval: float) -> None:
        with self.lock:
            self.wanted.append(int(1e6 * interval))  # what the interpreter would keep of it
            self._apply()

    def exit(self, interval: float) -> None:
        with self.lock:
            self.wanted.remove(int(1e6 * interval))
            self._apply()


_SWITCH = _SwitchInterval()


class _Service:
    """One epoch of a PrefetchLoader: the daemon thread and the queue of finished batches.

    Queue items, in order: ``(SideCopy, None)`` for a batch, ``(None, exception)`` for an error
    (the last item then), ``(_END, None)`` at the end.
    """

    def __init__(self, iterable: Iterable[Any], index: int, device: Any, depth: int, options: dict[str, Any],
                 stats: dict[str, Any], switch_interval: Optional[float],
                 consumer: Optional["torch.cuda.Stream"], snapshot: Optional[Callable[[], Any]] = None,
                 copy_snapshots: bool = False, prepare: Optional[Callable[[Any], Any]] = None,
                 caller_produces: bool = False) -> None:
        self.iterable, self.index, self.device, self.depth = iterable, index, device, depth
        # caller_produces: the caller's thread takes each batch from the iterable in its
        # __next__ (where a plain loop takes it) and posts it here; this thread only copies it
        self.inbox: Optional[deque[Any]] = deque() if caller_produces else None
        # applied to each batch that is not packed before its copy starts (mtc_loader.mmengine
        # marks what mmengine leaves on the host), on this thread
        self.prepare = prepare
        # the iterable's state_dict (None: not stateful), called after each batch is taken and at
        # the end; copy_snapshots: its result may change later (deep-copied then)
        self.snapshot, self.copy_snapshots = snapshot, copy_snapshots
        self.end_state: Any = _NO_STATE  # the snapshot taken when the iterable ended
        # an iterable whose iterations share one iterator: the service of its last epoch, which
        # this one waits for (a stopped epoch's thread may still be inside next() on it)
        self.key, self.previous = _claim(iterable, self)
        # the stream the caller is expected to consume on (the one current at the epoch's first
        # next(), then the one of the last hand-out whose prediction missed)
        self.consumer = consumer
        self.options, self.stats, self.switch_interval = options, stats, switch_interval
        self.items: deque[tuple[Any, Optional[BaseException]]] = deque()
        self.cond = threading.Condition(threading.Lock())
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="mtc_loader-prefetch", daemon=True)
        _SERVICES.add(self)
        self.thread.start()

    # -- the daemon thread
    def _run(self) -> None:
        it = take = None
        # the copies this thread starts keep their temporary views for the hand-out to drop
        # (SideCopy._keep; a copy started on any other thread drops them as it goes). They
        # keep the early collection and the staging of small jobs on this thread: a service
        # thread that skipped both measured no faster in the launch-bound training benchmark
        # (docs/profiler.md), and without the early collection its batches met full collections
        _engine.keep_temporaries(True)
        try:
            self._wait_for_previous()
            if self.stopping:
                return
            if self.index >= 0:
                torch.cuda.set_device(self.index)
                # this thread's current stream: every copy it starts is issued on it
                torch.cuda.set_stream(_copy_stream(self.index))
            if self.inbox is None:
                it = iter(self.iterable)
                take = _next_of(it)
            else:
                take = self._from_caller
            while self._wait_for_room() and self._wait_for_batch():
                t0 = time.thread_time()
                side, error, end = self._one_batch(take)
                if error is not None:  # handed to the caller after the batches before it
                    _forget_iterator(error, it)
                    self._put((None, error))
                    return
                if end:
                    break
                self.stats["service_cpu_s"] += time.thread_time() - t0
                self.stats["service_batches"] += 1
                self._put((side, None))
                # the queue's reference is the only one: the batch is freed where the caller
                # drops it, not by this frame while it waits for room
                del side
        except BaseException as e:  # iter() failed, or CUDA setup did
            _forget_iterator(e, it)
            self._put((None, e))
            return
        finally:
            del it, take  # a DataLoader iterator shuts its workers down (take holds it too)
            _reclaim_dead()
            _release(self)
        self._put((_END, None))

    def _wait_for_previous(self) -> None:
        """Waits until the thread of the iterable's previous epoch has left its shared iterator
        (it stops after the batch it is on), unless this epoch is stopped meanwhile."""
        previous, self.previous = self.previous, None
        while previous is not None and previous.thread.is_alive() and not self.stopping:
            previous.thread.join(0.1)

    def _one_batch(self, take: Callable[[], Any]) -> tuple[Optional[SideCopy], Optional[BaseException], bool]:
        """The next batch from the iterable (``take()``, see :func:`_next_of`), its copy started on
        the copy stream and finished: ``(SideCopy, None, False)``, ``(None, exception, False)`` or
        ``(None, None, True)`` at the end (or when stopping)."""
        interval = self.switch_interval
        if interval is not None:
            _SWITCH.enter(interval)
        try:
            t0 = time.thread_time()
            try:
                batch = take()
            except StopIteration:
                if self.snapshot is not None:
                    self.end_state = self._snap()
                return None, None, True
            self.stats["service_next_s"] += time.thread_time() - t0
            # the position right after this batch, taken before the iterable moves on: what
            # PrefetchLoader.state_dict() says once the caller has this batch
            state = self._snap() if self.snapshot is not None else _NO_STATE
            if self.stopping:
                del batch  # an unconsumed PackedBatch frees its region
                return None, None, True
            if self.prepare is not None and not isinstance(batch, PackedBatch):
                batch = self.prepare(batch)
            if _trace.active():  # free when no tool is attached
                with _trace.Range(_RANGE_COPY):
                    side = SideCopy(_start(batch, self.device, self.options), self.index)
                    del batch
                    side._finish(self.consumer)
            else:
                side = SideCopy(_start(batch, self.device, self.options), self.index)
                del batch
                side._finish(self.consumer)
            side._state = state
            return side, None, False
        except BaseException as e:
            return None, e, False
        finally:
            if interval is not None:
                _SWITCH.exit(interval)

    def _snap(self) -> Any:
        assert self.snapshot is not None
        try:
            state = self.snapshot()
            return copy.deepcopy(state) if self.copy_snapshots else state
        except Exception as e:  # raised by PrefetchLoader.state_dict() while it is the last
            return _FailedSnapshot(e)

    def _wait_for_batch(self) -> bool:
        """Where the caller produces the batches: waits until it has posted the next one (or the
        end), outside the lowered switch interval (the caller runs its step meanwhile)."""
        if self.inbox is None:
            return True
        with self.cond:
            while not self.inbox and not self.stopping:
                self.cond.wait()
            return not self.stopping

    def _from_caller(self) -> Any:
        """The batch the caller posted (``take`` where the caller produces): raises
        StopIteration at the end and the caller's exception where producing failed."""
        assert self.inbox is not None
        with self.cond:
            item = self.inbox.popleft()
        if item is _END:
            raise StopIteration
        if type(item) is _Raised:
            raise item.error
        return item

    def give(self, item: Any) -> None:
        """The caller posts the batch it produced (``_END`` at the end, a ``_Raised`` for an
        exception of the iterable)."""
        assert self.inbox is not None
        with self.cond:
            self.inbox.append(item)
            self.cond.notify_all()

    def _wait_for_room(self) -> bool:
        with self.cond:
            while len(self.items) >= self.depth and not self.stopping:
                self.cond.wait()
            return not self.stopping

    def _put(self, item: tuple[Any, Optional[BaseException]]) -> None:
        with self.cond:
            self.items.append(item)
            self.cond.notify_all()

    # -- the caller
    def take(self) -> tuple[Any, Optional[BaseException]]:
        """The next item. The service is not told that room freed up (:meth:`room`) until the
        hand-out is done, so that it does not take the GIL in the middle of it."""
        with self.cond:
            while not self.items:
                self.cond.wait()
            return self.items.popleft()

    def room(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def stop(self, timeout: float) -> None:
        """Stops the thread after the batch it is on and drops the finished batches; waits at
        most ``timeout`` seconds for the thread to end. A thread still inside ``next()`` of the
        iterable (a stalled batch) ends by itself once that returns: it then drops the batch and
        the iterator (a DataLoader's workers shut down)."""
        with self.cond:
            self.stopping = True
            self.items.clear()
            if self.inbox is not None:
                self.inbox.clear()
            self.cond.notify_all()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout)
        with self.cond:
            self.items.clear()  # what it finished while stopping
        if not self.thread.is_alive():
            _SERVICES.discard(self)


_SERVICES: "weakref.WeakSet[_Service]" = weakref.WeakSet()

# The caller's thread waits at most this long for a stopped service's thread to end: long enough
# for one that was waiting for room or had finished its batch, and not for one inside a stalled
# next() (an interrupt must reach the caller promptly; that thread ends by itself).
_STOP_JOIN_S = 0.5

# Iterables whose iterations share one iterator (a DataLoader with persistent workers, an
# iterator): id -> the service of the epoch that iterates it (which holds the iterable).
_BUSY: dict[int, _Service] = {}
_BUSY_LOCK = threading.Lock()


_DataLoaderIter = getattr(torch.utils.data.dataloader, "_BaseDataLoaderIter", None)
_MAP = getattr(getattr(torch.utils.data.dataloader, "_DatasetKind", None), "Map", None)


def _next_of(it: Iterator[Any]) -> Callable[[], Any]:
    """The function the service calls for each batch of ``it``: ``it.__next__``, except for a
    DataLoader iterator over a map-style dataset while no profiler runs.

    A DataLoader's ``__next__`` opens a ``record_function`` range around the batch. With no
    profiler attached the range records nothing, and yet it is entered through ``torch.ops`` once
    per batch, from a thread whose caches the training loop keeps cold. For that
    iterator the service makes what ``__next__`` makes (``_next_data()``, the count of yielded
    batches) without the range; whenever a profiler runs, or the iterator is not in the state this
    covers (before its first batch, an iterable-style dataset, a subclass that overrides
    ``__next__``), it calls ``__next__`` itself, so that a profile shows the DataLoader's range.
    """
    if (_DataLoaderIter is None or _MAP is None or type(it).__next__ is not _DataLoaderIter.__next__
            or not all(hasattr(it, a) for a in ("_next_data", "_sampler_iter", "_num_yielded", "_dataset_kind"))):
        return it.__next__
    # a partial, not a closure: the frame of a call that raised stays in the exception's traceback
    # and keeps its function, which must not keep the iterator (_forget_iterator)
    return functools.partial(_dataloader_next, it)


def _dataloader_next(dl: Any) -> Any:
    if _trace.profiling() or dl._sampler_iter is None or dl._dataset_kind != _MAP:
        return next(dl)
    data = dl._next_data()
    dl._num_yielded += 1
    return data


def _produces_in_process(iterable: Any) -> bool:
    """Whether taking a batch from ``iterable`` runs its pipeline in this process (on the thread
    that takes it): anything but a DataLoader with workers, an iterator of one, or mmengine's
    endless iterator over one."""
    loader = iterable
    if not isinstance(loader, torch.utils.data.DataLoader):
        loader = getattr(iterable, "_dataloader", None)  # mmengine's _InfiniteDataloaderIterator
    if isinstance(loader, torch.utils.data.DataLoader):
        return not loader.num_workers
    if _DataLoaderIter is not None and isinstance(iterable, _DataLoaderIter):
        return not iterable._num_workers
    return True


def _shares_iterator(iterable: Any) -> bool:
    if isinstance(iterable, _AnIterator):
        return True  # iter() returns the iterator itself
    return (isinstance(iterable, torch.utils.data.DataLoader) and bool(iterable.persistent_workers)
            and iterable.num_workers > 0)


def _claim(iterable: Any, service: _Service) -> tuple[Optional[int], Optional[_Service]]:
    """Registers ``service`` as the one iterating ``iterable`` when its iterations share one
    iterator; returns (key, the stopped service of its previous epoch or None). Raises
    RuntimeError while another epoch iterates it."""
    if not _shares_iterator(iterable):
        return None, None
    key = id(iterable)
    with _BUSY_LOCK:
        previous = _BUSY.get(key)
        if previous is not None and previous.thread.is_alive() and not previous.stopping:
            what = ("DataLoader with persistent_workers=True (all its iterations share one "
                    "iterator and its workers)" if not isinstance(iterable, _AnIterator) else "iterator")
            raise RuntimeError(
                f"mtc_loader: this {what} is already being iterated by a PrefetchLoader epoch that has "
                "not ended; two at once would take batches from each other. Finish or break that loop "
                "first, or give each PrefetchLoader its own DataLoader (or one without persistent_workers)")
        _BUSY[key] = service
    return key, previous


def _release(service: _Service) -> None:
    if service.key is not None:
        with _BUSY_LOCK:
            if _BUSY.get(service.key) is service:
                del _BUSY[service.key]


def _forget_iterator(error: BaseException, it: Any) -> None:
    """Clears the locals of the frames of ``error``'s traceback (and of the exceptions chained to
    it) that have returned: those of ``next()`` on the iterator ``it`` (this module's, the
    DataLoader's own, whose ``self`` it is, and the iterable's). A caller who keeps the
    exception (``e = err``, a logger, ``sys.last_value``) then keeps no DataLoader iterator, and
    so no workers and no arena regions, alive; the traceback itself (files, lines, the message)
    stays. The frames are cleared whole, without reading their locals first (reading
    ``f_locals`` would keep a copy of them on the frame)."""
    if it is None:
        return
    seen: set[int] = set()
    pending: list[Optional[BaseException]] = [error]
    while pending:
        exc = pending.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        tb = exc.__traceback__
        while tb is not None:
            try:
                tb.tb_frame.clear()
            except RuntimeError:  # still executing (this thread's _run): not one of next()'s
                pass
            tb = tb.tb_next
        pending += [exc.__context__, exc.__cause__]


def _stop_all_services() -> None:
    # Runs when the interpreter starts to shut down (before daemon threads are frozen): a
    # service thread inside a torch operator at that point would abort the process.
    for service in list(_SERVICES):
        service.stop(timeout=30.0)


threading._register_atexit(_stop_all_services)  # type: ignore[attr-defined]


_L = TypeVar("_L", bound="PrefetchLoader")
# the object's type itself, past any __class__ property of a subclass (accelerate's stand-in
# reports the class of the DataLoader it wraps through one)
_set_class: Callable[[Any, type], None] = object.__dict__["__class__"].__set__
_STATE_METHODS = ("state_dict", "load_state_dict")


def _is_stateful(iterable: Any) -> bool:
    """Whether an iterable has a position to save (torchdata's ``StatefulDataLoader``, any object
    with ``state_dict`` and ``load_state_dict``)."""
    return callable(getattr(iterable, "state_dict", None)) and callable(getattr(iterable, "load_state_dict", None))


def _snapshots_may_change(iterable: Any) -> bool:
    """Whether what ``iterable.state_dict()`` returns may be changed by the iterable later (the
    service then deep-copies each snapshot). A ``StatefulDataLoader`` builds new dicts on every
    call (with workers, from states that crossed a pipe) and torch's and torchdata's samplers
    return new ones; it puts in as they are what other samplers' ``state_dict()`` return and,
    without workers, the dataset's."""
    module = sys.modules.get("torchdata.stateful_dataloader")
    loader_type = getattr(module, "StatefulDataLoader", None)
    if loader_type is None or not isinstance(iterable, loader_type):
        return True
    parts = [getattr(iterable, "sampler", None), getattr(iterable, "batch_sampler", None)]
    if not iterable.num_workers:
        parts.append(iterable.dataset)
    return any(callable(getattr(p, "state_dict", None))
               and not type(p).__module__.startswith(("torch.", "torchdata.")) for p in parts)


class _NotResumableError(AttributeError, TypeError):
    """``state_dict`` / ``load_state_dict`` of a PrefetchLoader whose iterable has no state: a
    TypeError for the caller, and an AttributeError, so that ``hasattr()`` (what Lightning and
    accelerate probe) says the loader has none."""


def _not_resumable(loader: "PrefetchLoader", name: str) -> _NotResumableError:
    return _NotResumableError(
        f"mtc_loader: {type(loader).__name__}.{name} needs an iterable with state_dict() and "
        f"load_state_dict(), and this one wraps a {type(loader.__dict__.get('iterable')).__name__}, which has none; "
        "to save and resume the position in an epoch, wrap torchdata's StatefulDataLoader "
        "(from torchdata.stateful_dataloader import StatefulDataLoader; pip install torchdata) instead "
        "of a DataLoader")


class _Position:
    """The wrapped iterable's state after the last batch handed out (what the hand-out swaps in)."""

    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state: Any = _UNSET


class PrefetchLoader:
    """Wraps a DataLoader (or any iterable of batches) and yields the batches on ``device``,
    copied ahead by a daemon thread on the device's copy stream.

    Per epoch, a daemon thread pulls batches from the iterable as soon as they are produced and,
    for each, starts its copy with the device's :func:`copy_stream` current (a
    :class:`~mtc_loader.PackedBatch` is DMA'd straight from the shared arena; any other batch goes
    through :func:`~mtc_loader.start_copy` with ``start_copy_options``), builds its structure and
    records an event. At most ``depth`` finished batches wait for the caller. ``__next__`` takes a
    finished batch: the caller's current stream waits for its event on the GPU (no CPU
    synchronisation), and its buffers are recorded on that stream for the caching allocator. The
    copy engine thus copies batch k+1 while the SMs run step k, and the caller's thread does no
    per-tensor work.

    It forwards ``len()``, can be iterated once per epoch, re-raises the iterable's exceptions
    (and copy errors) in order, after the batches that came before them, and when the loop
    breaks early or the iterator is dropped it stops the thread, drops the batches it finished
    and lets the DataLoader shut its workers down. :meth:`stats` says whether the loop waited for
    data.

    **Resuming.** Over an iterable with ``state_dict()`` and ``load_state_dict()`` (torchdata's
    ``StatefulDataLoader``), the loader has both too. ``state_dict()`` describes the position
    after the last batch **handed out** to the caller, not where the thread has got to: the
    thread takes the iterable's ``state_dict()`` right after taking each batch and the snapshot
    travels with the batch (before the first batch: the iterable's own ``state_dict()``; after a
    full epoch: its state at the end). ``load_state_dict(state)`` passes ``state`` to the
    iterable; call it before iterating: the next epoch starts at the batch after the saved one.
    Over an iterable without them the loader has neither (``hasattr`` says so, so frameworks
    that probe for them do not take the loader for stateful); calling them raises a
    ``TypeError`` that says to use ``StatefulDataLoader``.

    Args:
        iterable: The batches (e.g. a ``torch.utils.data.DataLoader``).
        device: Target device, e.g. ``"cuda"`` (the current device when iteration starts),
            ``"cuda:0"`` or ``"cpu"``.
        depth: Finished batches kept ready for the caller (>= 1).
        gil_switch_interval: The interpreter's GIL switch interval (seconds) while the thread
            works on a batch (``sys.setswitchinterval``; restored when it waits): a launch-bound
            training thread holds the GIL almost always, and the thread waits for a forced
            switch each time it needs the GIL back, 5 ms by default. ``None`` leaves the
            interval alone.
        produce_on_caller: Whether the caller's thread takes each batch from the iterable, inside
            ``__next__`` (where a plain loop takes it), the thread only copying it: then the
            pipeline's random transforms and the training step draw from the global generators
            in a plain loop's order, and the same seed gives the same data. ``None`` (default):
            for every iterable but a DataLoader with workers (or an iterator of one), whose
            pipeline runs in the workers; the thread then takes batches ahead of the step.
        **start_copy_options: Passed to :func:`~mtc_loader.start_copy` (a packed batch uses only
            ``use_background_thread``). A keyword ``start_copy`` does not take raises TypeError
            here, whatever the batches are.
    """

    def __init__(self, iterable: Iterable[Any], device: Any, depth: int = 2, *,
                 gil_switch_interval: Optional[float] = 0.0005, produce_on_caller: Optional[bool] = None,
                 **start_copy_options: Any) -> None:
        # over a stateful iterable: the class that has state_dict / load_state_dict (a class
        # lacking them otherwise, since frameworks probe for them with hasattr or the class).
        # Chosen here rather than by a __new__, whose (*args, **kwargs) help() and IDEs would
        # show instead of these parameters; the object escapes only once __init__ has run.
        cls = type(self)
        if not issubclass(cls, _ResumablePrefetchLoader) and _is_stateful(iterable):
            _set_class(self, _resumable_class(cls))
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"mtc_loader: depth must be an int >= 1, got {depth!r}")
        if gil_switch_interval is not None and (isinstance(gil_switch_interval, bool) or not (
                isinstance(gil_switch_interval, (int, float)) and 0 < gil_switch_interval <= 1)):
            raise ValueError("mtc_loader: gil_switch_interval must be None or a number of seconds in "
                             f"(0, 1], got {gil_switch_interval!r}")
        if produce_on_caller is not None and not isinstance(produce_on_caller, bool):
            raise TypeError(f"mtc_loader: produce_on_caller must be None, True or False, got {produce_on_caller!r}")
        target_index(device)  # fail early on a bad device
        _check_options(start_copy_options)
        self.produce_on_caller = produce_on_caller
        self.iterable = iterable
        self.device = device
        self.depth = depth
        self.gil_switch_interval = gil_switch_interval
        self.options = start_copy_options
        self._stats = _new_stats()
        self._position = _Position()

    if TYPE_CHECKING:  # present at run time only over a stateful iterable (see the class docstring)
        def state_dict(self) -> Any: ...

        def load_state_dict(self, state: Any) -> None: ...
    else:
        def __getattr__(self, name: str) -> Any:
            if name in _STATE_METHODS:
                raise _not_resumable(self, name)
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __len__(self) -> int:
        return len(self.iterable)  # type: ignore[arg-type]

    def stats(self) -> dict[str, Any]:
        """Where the time went, over every epoch so far.

        Keys: ``batches``; ``wait_ms`` (total) and ``wait_ms_per_batch``: the caller's time in
        ``__next__`` (waiting for a batch plus the hand-out); ``step_ms_per_batch``: the caller's
        time between two ``__next__`` calls (its training step); ``data_bound``: the share of the
        caller's time spent waiting for data (``wait / (wait + step)``; near 0 when the loop is
        not data-bound); ``service_cpu_ms_per_batch``: CPU time of the prefetch thread per batch
        (the next batch from the iterable, the copy's start, the views; an upper bound on the
        time it holds the GIL), of which ``service_next_ms_per_batch`` went to taking the next
        batch from the iterable (for a DataLoader with workers: receiving the batch from a worker
        and sending the next indices).
        """
        s = self._stats
        n, m = s["batches"], max(s["service_batches"], 1)
        wait, step = s["wait_s"] * 1e3, s["step_s"] * 1e3
        return {
            "batches": n,
            "wait_ms": wait,
            "wait_ms_per_batch": wait / n if n else 0.0,
            "step_ms_per_batch": step / s["steps"] if s["steps"] else 0.0,
            "data_bound": wait / (wait + step) if wait + step > 0 else 0.0,
            "service_cpu_ms_per_batch": s["service_cpu_s"] * 1e3 / m,
            "service_next_ms_per_batch": s["service_next_s"] * 1e3 / m,
        }

    def reset_stats(self) -> None:
        """Zero the counters of :meth:`stats` (in place: an epoch under way counts on from zero)."""
        resets = self._stats["resets"] + 1  # (what the frameworks' logging windows go by)
        self._stats.update(_new_stats(), resets=resets)

    def __iter__(self) -> Iterator[Any]:
        _reclaim_dead()  # regions left by workers of an earlier epoch that have exited since
        index = target_index(self.device)  # "cuda" is the current device of the caller
        device = self.device if index < 0 else torch.device("cuda", index)
        stats = self._stats
        consumer = torch.cuda.current_stream(index) if index >= 0 else None
        snapshot, copy_snapshots = None, False
        if isinstance(self, _ResumablePrefetchLoader):
            snapshot = self.iterable.state_dict  # type: ignore[attr-defined]
            copy_snapshots = _snapshots_may_change(self.iterable)
        on_caller = self.produce_on_caller
        if on_caller is None:
            on_caller = _produces_in_process(self.iterable)
        # before the DataLoader's workers start (the service's iter()): they check their first
        # batch against the room the arena has for what this loader keeps in flight
        told = expect_in_flight(self.iterable, self.depth, index >= 0)
        service = _Service(self.iterable, index, device, self.depth, self.options, stats,
                           self.gil_switch_interval, consumer, snapshot, copy_snapshots,
                           getattr(self, "_prepare", None), on_caller)
        hand = None
        try:
            # The generator's frame never holds the batch it handed out: a reference kept over
            # the yield would free the previous batch (hundreds of tensors) inside the next
            # __next__ instead of where the caller drops it.
            hand = _HandOut(service, stats, self._position)
            while hand.pending():
                try:
                    yield hand.take()
                except _EpochEnd:
                    return
        finally:
            if hand is not None:
                hand.it = hand.next = None  # the caller's iterator of the iterable, if any
            # bounded: a KeyboardInterrupt while the service waits for a stalled batch reaches
            # the caller now; that thread ends by itself (stop's docstring)
            service.stop(_STOP_JOIN_S)
            withdraw(told)


class _ResumablePrefetchLoader(PrefetchLoader):
    """A :class:`PrefetchLoader` over a stateful iterable (``PrefetchLoader(...)`` makes one):
    ``state_dict`` / ``load_state_dict`` of the position after the last batch handed out."""

    def state_dict(self) -> Any:
        """The wrapped iterable's state after the last batch handed out to the caller (the
        iterable's own ``state_dict()`` before the first). A dict is a new one on every call (its
        values are shared with the saved snapshot: treat them as read-only)."""
        state = self._position.state
        if state is _UNSET:
            return self.iterable.state_dict()  # type: ignore[attr-defined]
        if isinstance(state, _FailedSnapshot):
            raise RuntimeError(f"mtc_loader: the {type(self.iterable).__name__}'s state_dict() raised right "
                               "after the last batch handed out, so there is no position to save") from state.error
        return dict(state) if type(state) is dict else state

    def load_state_dict(self, state: Any) -> None:
        """Passes ``state`` (from :meth:`state_dict`) to the wrapped iterable's ``load_state_dict``;
        the next epoch (the next ``iter()``) starts after the batch it describes. Call it before
        iterating, not during an epoch."""
        self.iterable.load_state_dict(state)  # type: ignore[attr-defined]
        # the position is the loaded one (a copy: the caller may reuse its dict); {} is
        # StatefulDataLoader's "no state", for which the iterable's own state stands
        self._position.state = _UNSET if isinstance(state, dict) and not state else copy.deepcopy(state)


_RESUMABLE: dict[type, type] = {PrefetchLoader: _ResumablePrefetchLoader}


def _resumable_class(cls: type[_L]) -> type[_L]:
    """The class of a ``cls`` over a stateful iterable: ``cls`` with :class:`_ResumablePrefetchLoader`'s
    methods (registered ones for this package's classes, made once for a subclass of the caller)."""
    found = _RESUMABLE.get(cls)
    if found is None:
        found = _RESUMABLE[cls] = type(cls.__name__, (cls, _ResumablePrefetchLoader),
                                       {"__module__": cls.__module__, "__doc__": cls.__doc__})
    return found


def _check_options(options: dict[str, Any]) -> None:
    """Refuses a keyword that start_copy does not take, whatever the batches will be (a packed
    batch uses only use_background_thread, so a misspelled one would otherwise pass unseen)."""
    known = [p.name for p in inspect.signature(start_copy).parameters.values() if p.kind is p.KEYWORD_ONLY]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TypeError(f"mtc_loader: PrefetchLoader got unexpected keyword argument(s) {', '.join(unknown)}; "
                        f"besides depth and gil_switch_interval it takes start_copy's: {', '.join(known)}")


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


def _new_stats() -> dict[str, Any]:
    return {"batches": 0, "wait_s": 0.0, "step_s": 0.0, "steps": 0, "service_cpu_s": 0.0,
            "service_next_s": 0.0, "service_batches": 0, "resets": 0}


class _Window:
    """What a loader's :meth:`PrefetchLoader.stats` counted since the previous :meth:`delta` or
    :meth:`advance` (since the window was made, for the first): the framework integrations log
    the figures over their own windows rather than over the whole run. Read it on the thread that
    iterates the loader (which updates the counters)."""

    __slots__ = ("stats", "mark", "resets")

    def __init__(self, loader: PrefetchLoader, from_start: bool = False) -> None:
        self.stats = loader._stats  # updated in place, reset_stats() included
        self.resets = self.stats["resets"]
        # from_start: the first window holds all that the loader counted, not only what comes next
        self.mark: tuple[float, float, int] = (0.0, 0.0, 0) if from_start else self._now()

    def _now(self) -> tuple[float, float, int]:
        s = self.stats
        return s["wait_s"], s["step_s"], s["batches"]

    def delta(self) -> tuple[float, float, int]:
        """``(seconds waited, seconds of steps, batches handed out)`` since the previous call."""
        now = self._now()
        mark, self.mark = self.mark, now
        if self.stats["resets"] != self.resets:  # reset_stats() since the mark: counted from zero
            self.resets = self.stats["resets"]
            mark = (0.0, 0.0, 0)
        return now[0] - mark[0], now[1] - mark[1], now[2] - mark[2]

    def advance(self) -> dict[str, float]:
        """The figures since the previous call (:func:`_figures`)."""
        return _figures(*self.delta())


def _figures(wait_s: float, step_s: float, batches: int) -> dict[str, float]:
    """The figures of a window, as :meth:`PrefetchLoader.stats` defines them: ``data_bound`` (when
    any time was counted) and ``wait_ms_per_batch`` (when a batch was handed out); an empty dict
    when nothing was counted."""
    figures: dict[str, float] = {}
    if wait_s + step_s > 0:
        figures["data_bound"] = wait_s / (wait_s + step_s)
    if batches:
        figures["wait_ms_per_batch"] = wait_s * 1e3 / batches
    return figures


def _reclaim_dead() -> None:
    """Frees the arena regions of worker processes that have exited (the arenas this process
    consumes)."""
    for arena in list(_ARENAS.values()):
        if _consumes(arena):
            arena.reclaim_dead()
