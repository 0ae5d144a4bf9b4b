"""The service: the daemon thread of one epoch, which takes each batch from the iterable, copies it
on the device's copy stream and queues it for the caller; the GIL switch interval it lowers while
it works; the registry of iterables whose epochs share one iterator."""
from __future__ import annotations

import copy
import functools
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator as _AnIterator
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from .. import _engine, _trace
from .._arena import consumed_here
from .._packed import PackedBatch
from .._tree import same_kind
from ._pipes import standins
from ._resume import _NO_STATE, _FailedSnapshot
from ._side import SideCopy, _copy_stream, _start

_END = object()


class _Raised:
    """An exception the caller's thread met producing a batch, posted to the service (which
    hands it back in order, as one of its own)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


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
                 caller_produces: bool = False, keep_numpy: bool = True,
                 transform: Optional[Callable[[Any], Any]] = None) -> None:
        self.iterable, self.index, self.device, self.depth = iterable, index, device, depth
        # caller_produces: the caller's thread takes each batch from the iterable in its
        # __next__ (where a plain loop takes it) and posts it here; this thread only copies it
        self.inbox: Optional[deque[Any]] = deque() if caller_produces else None
        # applied to each batch that is not packed before its copy starts (mtc_loader.mmengine
        # marks what mmengine leaves on the host), on this thread
        self.prepare = prepare
        # numpy arrays of batches that are not packed stay numpy arrays (PrefetchLoader's
        # numpy_to_tensors=False); a packed batch's were kept or packed by its worker
        self.keep_numpy = keep_numpy
        # PrefetchLoader's transform, applied to each batch after its copy on this thread, and
        # the index in the epoch of the next batch taken (which its errors name)
        self.transform, self.taken = transform, 0
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
        self.iterator: Callable[[], Any] = _none  # (weakly) the thread's iterator of the iterable
        self.cond = threading.Condition(threading.Lock())
        self.stopping = False
        # the thread is inside next() of its iterator of the iterable (a weak reference to that
        # iterator, for stop's wake-up), or None
        self.in_next: Optional[Callable[[], Any]] = None
        self.thread = threading.Thread(target=self._run, name="mtc_loader-prefetch", daemon=True)
        _SERVICES.add(self)
        self.thread.start()

    # -- the daemon thread
    def _run(self) -> None:
        it = take = None
        # the copies this thread starts keep their temporary views for the hand-out to drop
        # (SideCopy._keep; a copy started on any other thread drops them as it goes). They
        # keep the early collection and the staging of small jobs on this thread, as any
        # caller's copies do: without the early collection the batches meet full collections
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
                self.iterator = _weak(it)
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
            self.in_next = self.iterator
            try:
                batch = take()
            except StopIteration:
                if self.snapshot is not None:
                    self.end_state = self._snap()
                return None, None, True
            finally:
                self.in_next = None
            self.stats["service_next_s"] += time.thread_time() - t0
            self.taken += 1
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
                    side = SideCopy(_start(batch, self.device, self.options, self.keep_numpy), self.index)
                    del batch
                    side._finish(self.consumer)
            else:
                side = SideCopy(_start(batch, self.device, self.options, self.keep_numpy), self.index)
                del batch
                side._finish(self.consumer)
            if self.transform is not None:
                self._transform(side)
            side._state = state
            return side, None, False
        except BaseException as e:
            if self.stopping:  # (stop's wake-up among them): nobody takes it
                return None, None, True
            return None, e, False
        finally:
            if interval is not None:
                _SWITCH.exit(interval)

    def _transform(self, side: SideCopy) -> None:
        """The transform applied to the copied batch; its exception comes back naming the
        transform and the batch (of the same class where it can be rebuilt from a message)."""
        fn = self.transform
        assert fn is not None
        try:
            result = fn(side._result)
        except Exception as e:
            name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
            raise same_kind(e, f"mtc_loader: PrefetchLoader's transform {name} raised on batch "
                                f"{self.taken - 1} of the epoch: {type(e).__name__}: {e}") from e
        side._replace(result, self.consumer)

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

    def stop(self, timeout: float, wake: bool = False) -> None:
        """Stops the thread after the batch it is on and drops the finished batches; waits at
        most ``timeout`` seconds for the thread to end, and not at all for a thread inside
        ``next()`` of the iterable (a slow or stalled batch): that one ends by itself once
        ``next()`` returns, dropping the batch and the iterator (a DataLoader's workers shut
        down). ``wake``: a thread waiting inside a DataLoader iterator's ``next()`` for a
        worker's batch is woken now (:func:`_wake`), so that the workers are told to stop at
        once (an interrupt, the interpreter's exit), rather than after that batch."""
        with self.cond:
            self.stopping = True
            self.items.clear()
            if self.inbox is not None:
                self.inbox.clear()
            self.cond.notify_all()
        inside = self.in_next
        if wake and inside is not None:
            _wake(inside())
        if self.thread is not threading.current_thread() and (inside is None or wake and timeout > _STOP_JOIN_S):
            self.thread.join(timeout)
        with self.cond:
            self.items.clear()  # what it finished while stopping
        if not self.thread.is_alive():
            _SERVICES.discard(self)


_SERVICES: "weakref.WeakSet[_Service]" = weakref.WeakSet()

# The caller's thread waits at most this long for a stopped service's thread to end: long enough
# for one that was waiting for room or had finished its batch. One inside the iterable's next() is
# not waited for (an interrupt must reach the caller at once; that thread ends by itself).
_STOP_JOIN_S = 0.5


def _none() -> None:
    return None


def _weak(obj: Any) -> Callable[[], Any]:
    """A weak reference to ``obj`` (a callable returning None where it takes none): the service
    never keeps its iterator, whose end shuts a DataLoader's workers down, alive."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return _none


def _wake(it: Any) -> None:
    """Wakes a thread waiting inside ``next()`` of a DataLoader iterator with workers for a
    worker's batch: the iterator's result queue gets the item the DataLoader itself posts to
    wake its pin-memory thread at shutdown, ``(None, None)``, which its ``next()`` refuses (an
    error the stopped service drops), so that the thread drops the iterator and the workers are
    told to stop now rather than once a slow batch arrives. Where the thread got a batch first,
    the item stays in the queue: a DataLoader iterator that is not used again is shut down
    unread, and one with persistent workers discards what its queue holds when its next epoch
    starts. Any other iterable: nothing is done (its thread ends once its ``next()`` returns)."""
    if _DataLoaderIter is None or not isinstance(it, _DataLoaderIter) or getattr(it, "_shutdown", True):
        return
    queue = getattr(it, "_data_queue", None)
    if queue is None or not getattr(it, "_num_workers", 0):
        return
    try:
        queue.put((None, None))
        # a worker-result queue (no pin-memory thread) sends it through this process's feeder
        # thread, which the interpreter's exit must not wait for (the pipe may be full)
        cancel = getattr(queue, "cancel_join_thread", None)
        if cancel is not None:
            cancel()
    except Exception:  # closed meanwhile (the thread is shutting it down): nothing to wake
        pass

# Iterables whose iterations share one iterator (a DataLoader with persistent workers, an
# iterator): id -> the service of the epoch that iterates it (which holds the iterable).
_BUSY: dict[int, _Service] = {}
_BUSY_LOCK = threading.Lock()


_DataLoaderIter = getattr(torch.utils.data.dataloader, "_BaseDataLoaderIter", None)
_MAP = getattr(getattr(torch.utils.data.dataloader, "_DatasetKind", None), "Map", None)


def _next_of(it: Iterator[Any]) -> Callable[[], Any]:
    """The function the service calls for each batch of ``it``: ``it.__next__``, except for a
    DataLoader iterator (whose queues the call reads and writes through ``_pipes``' stand-ins)
    over a map-style dataset while no profiler runs.

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
    """The next batch of a DataLoader iterator, its queues replaced for the call by the stand-ins
    that read and write their pipes without giving up the GIL where nothing waits (_pipes.py)."""
    quiet = standins(dl)
    if quiet is None:
        return _dataloader_batch(dl)
    data_queue, index_queues = dl._data_queue, dl._index_queues
    try:
        dl._data_queue, dl._index_queues = quiet
        return _dataloader_batch(dl)
    finally:
        dl._data_queue, dl._index_queues = data_queue, index_queues


def _dataloader_batch(dl: Any) -> Any:
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
        service.stop(timeout=30.0, wake=True)


threading._register_atexit(_stop_all_services)  # type: ignore[attr-defined]


def _reclaim_dead() -> None:
    """Frees the arena regions of worker processes that have exited (the arenas this process
    consumes)."""
    for arena in consumed_here():
        arena.reclaim_dead()
