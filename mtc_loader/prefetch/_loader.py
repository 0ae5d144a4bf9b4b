"""PrefetchLoader: the iterable users wrap their DataLoader in, and its resumable form."""
from __future__ import annotations

import copy
import inspect
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional, TypeVar

import torch

from .._device import target_index
from .._flight import expect_in_flight, withdraw
from ..copy import start_copy
from ._handout import _EpochEnd, _HandOut
from ._resume import (STATE_METHODS, _UNSET, _FailedSnapshot, is_stateful, not_resumable, _Position,
                      _set_class, _snapshots_may_change)
from ._service import _STOP_JOIN_S, _produces_in_process, _reclaim_dead, _Service
from ._stats import _new_stats

_L = TypeVar("_L", bound="PrefetchLoader")


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
        numpy_to_tensors: Whether numpy arrays come as tensors on ``device``. By default a batch
            keeps the types its collate function made: its tensors move to ``device``, and its
            numpy arrays stay numpy arrays on the host, bitwise as the collate made them (as
            ``batch.to(device)`` leaves them). With ``True``, numeric numpy arrays become tensors
            on ``device``, as :func:`~mtc_loader.start_copy` converts them.
        transform: A function of one batch, or ``None``. ``transform(batch)`` runs on the thread
            after each batch's copy, and the caller receives what it returns (any structure).
            On a GPU its kernels go to the copy stream, the thread's current stream, after the
            copy; the hand-out's event orders them before the caller's kernels. The CUDA tensors
            it returns (found in lists, tuples, dicts and objects' attributes) are recorded on
            the caller's stream, as the copy's are. It runs beside the training step, so it must
            not depend on the step's state. For reproducible runs, it draws random numbers from
            a ``torch.Generator`` of its own, not the global ones. An exception it
            raises reaches the caller in order, as a copy error does: of the same class where
            it can be rebuilt from a message (else a ``RuntimeError``), naming the transform
            and the batch's index in the epoch (counted from 0 where the iteration started),
            with the original as ``__cause__``.
        **start_copy_options: Passed to :func:`~mtc_loader.start_copy` (a packed batch uses only
            ``use_background_thread``). A keyword ``start_copy`` does not take raises TypeError
            here, whatever the batches are.
    """

    def __init__(self, iterable: Iterable[Any], device: Any, depth: int = 2, *,
                 gil_switch_interval: Optional[float] = 0.0005, produce_on_caller: Optional[bool] = None,
                 numpy_to_tensors: bool = False, transform: Optional[Callable[[Any], Any]] = None,
                 **start_copy_options: Any) -> None:
        # over a stateful iterable: the class that has state_dict / load_state_dict (a class
        # lacking them otherwise, since frameworks probe for them with hasattr or the class).
        # Chosen here rather than by a __new__, whose (*args, **kwargs) help() and IDEs would
        # show instead of these parameters; the object escapes only once __init__ has run.
        if isinstance(iterable, (str, bytes, torch.device)) or not (
                hasattr(type(iterable), "__iter__") or hasattr(type(iterable), "__getitem__")):
            # (iterating it would fail at the first epoch, with "'int' object is not iterable")
            raise TypeError(f"mtc_loader: PrefetchLoader wraps an iterable of batches (a DataLoader), got "
                            f"{type(iterable).__name__} {iterable!r:.80}: call PrefetchLoader(loader, device)")
        cls = type(self)
        if not issubclass(cls, ResumablePrefetchLoader) and is_stateful(iterable):
            _set_class(self, _resumable_class(cls))
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"mtc_loader: depth must be an int >= 1, got {depth!r}")
        if gil_switch_interval is not None and (isinstance(gil_switch_interval, bool) or not (
                isinstance(gil_switch_interval, (int, float)) and 0 < gil_switch_interval <= 1)):
            raise ValueError("mtc_loader: gil_switch_interval must be None or a number of seconds in "
                             f"(0, 1], got {gil_switch_interval!r}")
        if produce_on_caller is not None and not isinstance(produce_on_caller, bool):
            raise TypeError(f"mtc_loader: produce_on_caller must be None, True or False, got {produce_on_caller!r}")
        if not isinstance(numpy_to_tensors, bool):
            raise TypeError(f"mtc_loader: numpy_to_tensors must be True or False, got {numpy_to_tensors!r}")
        if transform is not None and not callable(transform):
            raise TypeError(f"mtc_loader: transform must be a function of one batch (or None), got "
                            f"{type(transform).__name__} {transform!r:.80}")
        target_index(device)  # fail early on a bad device
        _check_options(start_copy_options)
        self.produce_on_caller = produce_on_caller
        self.iterable = iterable
        self.device = device
        self.depth = depth
        self.gil_switch_interval = gil_switch_interval
        self.options = start_copy_options
        self.numpy_to_tensors = numpy_to_tensors
        self.transform = transform
        self._stats = _new_stats()
        self._position = _Position()

    if TYPE_CHECKING:  # present at run time only over a stateful iterable (see the class docstring)
        def state_dict(self) -> Any: ...

        def load_state_dict(self, state: Any) -> None: ...
    else:
        def __getattr__(self, name: str) -> Any:
            if name in STATE_METHODS:
                raise not_resumable(type(self).__name__, name, self.__dict__.get("iterable"))
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
        if isinstance(self, ResumablePrefetchLoader):
            snapshot = self.iterable.state_dict  # type: ignore[attr-defined]
            copy_snapshots = _snapshots_may_change(self.iterable)
        on_caller = self.produce_on_caller
        if on_caller is None:
            on_caller = _produces_in_process(self.iterable)
        # before the DataLoader's workers start (the service's iter()): they check their first
        # batch against the room the arena has for what this loader keeps in flight
        told = expect_in_flight(self.iterable, self.depth, index >= 0, self.numpy_to_tensors)
        service = _Service(self.iterable, index, device, self.depth, self.options, stats,
                           self.gil_switch_interval, consumer, snapshot, copy_snapshots,
                           getattr(self, "_prepare", None), on_caller, not self.numpy_to_tensors,
                           self.transform)
        hand, interrupted = None, False
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
        except KeyboardInterrupt:
            interrupted = True
            raise
        finally:
            if hand is not None:
                hand.it = hand.next = None  # the caller's iterator of the iterable, if any
            # A KeyboardInterrupt while the service waits for a slow batch reaches the caller at
            # once: that thread is not waited for, and on an interrupt it is woken inside a
            # DataLoader's next(), so that the workers are told to stop now (stop's docstring)
            service.stop(_STOP_JOIN_S, wake=interrupted)
            withdraw(told)


class ResumablePrefetchLoader(PrefetchLoader):
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


RESUMABLE: dict[type, type] = {PrefetchLoader: ResumablePrefetchLoader}


def _resumable_class(cls: type[_L]) -> type[_L]:
    """The class of a ``cls`` over a stateful iterable: ``cls`` with :class:`ResumablePrefetchLoader`'s
    methods (registered ones for this package's classes, made once for a subclass of the caller)."""
    found = RESUMABLE.get(cls)
    if found is None:
        found = RESUMABLE[cls] = type(cls.__name__, (cls, ResumablePrefetchLoader),
                                       {"__module__": cls.__module__, "__doc__": cls.__doc__})
    return found


def _check_options(options: dict[str, Any]) -> None:
    """Refuses a keyword that start_copy does not take, whatever the batches will be (a packed
    batch uses only use_background_thread, so a misspelled one would otherwise pass unseen)."""
    known = [p.name for p in inspect.signature(start_copy).parameters.values() if p.kind is p.KEYWORD_ONLY]
    unknown = sorted(set(options) - set(known))
    if unknown:
        own = [p.name for p in inspect.signature(PrefetchLoader.__init__).parameters.values()
               if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in ("self", "iterable", "device")]
        raise TypeError(f"mtc_loader: PrefetchLoader got unexpected keyword argument(s) {', '.join(unknown)}; "
                        f"besides {', '.join(own)} it takes start_copy's: {', '.join(known)}")
