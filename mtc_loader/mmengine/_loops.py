"""The loops: mmengine's train loops with the batches prefetched (:class:`MTCEpochBasedTrainLoop`,
:class:`MTCIterBasedTrainLoop`), and its validation and test loops unpacking packed batches
(:class:`MTCValLoop`, :class:`MTCTestLoop`), in mmengine's ``LOOPS``."""
from __future__ import annotations

import contextlib
import functools
import itertools
from typing import Any, Callable, ContextManager, Iterator, Optional

import torch
from mmengine.optim import AmpOptimWrapper
from mmengine.registry import LOOPS
from mmengine.runner import EpochBasedTrainLoop, IterBasedTrainLoop, TestLoop, ValLoop
from mmengine.runner.amp import autocast

from .._packed import PackedBatch
from ..prefetch import PrefetchLoader
from ..prefetch._resume import is_stateful
from ._collate import place_as_cast_data
from ._hooks import _check_log_stats, _LoaderStateHook, _StatsHook
from ._preprocessor import _MOVED, MTCDataPreprocessor, _Ahead, _RunAhead

__all__ = ["MTCEpochBasedTrainLoop", "MTCIterBasedTrainLoop", "MTCTestLoop", "MTCValLoop"]


def _device_of(runner: Any) -> torch.device:
    """The device the model trains on: its data preprocessor's (mmengine keeps it there)."""
    model = runner.model
    model = getattr(model, "module", model)  # DistributedDataParallel and mmengine's wrappers
    pre = getattr(model, "data_preprocessor", None)
    dev = getattr(pre, "device", None)
    if isinstance(dev, torch.device):
        return dev
    for p in model.parameters():
        found: torch.device = p.device
        return found
    return torch.device("cpu")


def _run_ahead(runner: Any) -> Optional[_RunAhead]:
    """The prefetch thread's transform where the model's preprocessor runs ahead (an
    ``MTCDataPreprocessor(run_ahead=True)``), in the autocast that an ``AmpOptimWrapper``'s
    ``optim_context`` enters around ``train_step``'s preprocessor call; else None."""
    model = runner.model
    model = getattr(model, "module", model)  # DistributedDataParallel and mmengine's wrappers
    pre = getattr(model, "data_preprocessor", None)
    if not isinstance(pre, MTCDataPreprocessor) or not pre.run_ahead:
        return None
    wrapper = getattr(runner, "optim_wrapper", None)
    context: Callable[[], ContextManager[Any]] = contextlib.nullcontext
    if isinstance(wrapper, AmpOptimWrapper):
        context = functools.partial(autocast, dtype=wrapper.cast_dtype)
    return _RunAhead(pre, context)


class _Prefetching:
    """The batches of an iterable (or of a PrefetchLoader), prefetched on the model's device; each
    one handed out is marked for :class:`MTCDataPreprocessor` as on the device already (with its
    preprocessor's result where that runs ahead)."""

    def __init__(self, iterable: Any, device: torch.device, depth: int, ahead: Optional[_RunAhead] = None) -> None:
        self.loader = iterable if isinstance(iterable, PrefetchLoader) else PrefetchLoader(iterable, device, depth)
        # a batch that is not packed is copied by start_copy: what cast_data leaves on the host
        # stays there (the structure types the walk knows would otherwise be moved)
        self.loader._prepare = place_as_cast_data  # type: ignore[attr-defined]
        self.loader.transform = ahead
        self.it = iter(self.loader)

    def __iter__(self) -> "_Prefetching":
        return self

    def __next__(self) -> Any:
        _MOVED.batch = _MOVED.ahead = None
        batch = next(self.it)
        if type(batch) is _Ahead:
            _MOVED.ahead = batch
            batch = batch.batch
        _MOVED.batch = batch
        return batch

    def close(self) -> None:
        _MOVED.batch = _MOVED.ahead = None
        self.it.close()  # type: ignore[attr-defined]  # a generator: stops the service thread


def _unpacked(data_batch: Any, runner: Any) -> Any:
    """What hooks, the model and evaluators receive for a batch of the loader: a
    :class:`~mtc_loader.PackedBatch` unpacked on the model's device (one DMA per dtype) and marked for
    :class:`MTCDataPreprocessor` as moved; any other batch as it is."""
    if not isinstance(data_batch, PackedBatch):
        return data_batch
    batch = data_batch.to(_device_of(runner))
    _MOVED.batch = batch
    return batch


def _check_depth(prefetch_depth: Any) -> int:
    if isinstance(prefetch_depth, bool) or not isinstance(prefetch_depth, int) or prefetch_depth < 0:
        raise ValueError(f"mtc_loader: prefetch_depth must be an int >= 0 (0: no prefetching), got {prefetch_depth!r}")
    return prefetch_depth


def _check_by_epoch(by_epoch: Any, expected: bool, loop: str) -> None:
    """A schedule's ``by_epoch`` (kept by a child config's ``train_cfg``) must be the loop's kind."""
    if by_epoch is not None and bool(by_epoch) is not expected:
        other = "MTCIterBasedTrainLoop" if expected else "MTCEpochBasedTrainLoop"
        raise ValueError(f"mtc_loader: train_cfg has by_epoch={by_epoch!r}, which {loop} is not: use {other} "
                         "(with max_iters or max_epochs as the schedule gives)")


class _Pass:
    """One pass of mmengine's endless iterator (``_InfiniteDataloaderIterator``) over its
    DataLoader: the iterator it holds now, after the pass's first batch when the restart took it."""

    def __init__(self, endless: Any) -> None:
        self.endless = endless
        self._dataloader = endless._dataloader  # (PrefetchLoader: where the pipeline runs)
        self.first: Any = _NO_BATCH

    def __iter__(self) -> Iterator[Any]:
        first, self.first = self.first, _NO_BATCH
        it: Iterator[Any] = self.endless._iterator
        return it if first is _NO_BATCH else itertools.chain((first,), it)


_NO_BATCH = object()


class _PrefetchedPasses(_Prefetching):
    """The batches of mmengine's endless iterator, prefetched one pass of its DataLoader at a time:
    at a pass's end mmengine's restart (its warning, ``set_epoch``, a new DataLoader iterator, whose
    seed comes from torch's global generator) runs on the training thread in ``__next__``, where
    the plain loop runs it, never on the service thread during a step."""

    def __init__(self, endless: Any, device: torch.device, depth: int, ahead: Optional[_RunAhead] = None) -> None:
        self.endless = endless
        super().__init__(_Pass(endless), device, depth, ahead)

    def __next__(self) -> Any:
        try:
            return super().__next__()
        except StopIteration:
            pass
        self.endless._iterator = iter(())  # spent: mmengine's next() restarts it, here
        first = next(self.endless)
        self.loader.iterable.first = first  # type: ignore[attr-defined]
        self.it = iter(self.loader)
        return super().__next__()


@LOOPS.register_module()
class MTCEpochBasedTrainLoop(EpochBasedTrainLoop):  # type: ignore[misc]
    """mmengine's ``EpochBasedTrainLoop`` with the batches prefetched on the model's device by
    :class:`~mtc_loader.PrefetchLoader` (batch k+1 copied on the copy stream while step k
    trains). Hooks and the model receive each batch on the device. Works with packed batches
    (``mtc_packed_collate``: one DMA per dtype each) and with plain ones.

    Resuming: over a stateful DataLoader (torchdata's ``StatefulDataLoader``, passed to the
    Runner as ``train_dataloader=StatefulDataLoader(...)``), every checkpoint holds the position
    after the last batch handed out (the loop's hook adds it under ``"mtc_loader"``), and
    ``runner.resume`` / ``resume=True`` continue the epoch at the batch after the last one
    trained on. Over a DataLoader that is not stateful, a checkpoint saved mid-epoch resumes at
    the start of that epoch, as mmengine's own loop does.

    In the logs: mmengine's ``IterTimerHook`` still writes ``data_time``, which with this loop is
    the time from the end of one iteration to the start of the next: the wait for the prefetched
    batch, plus the work of the hooks that run in between (writing the log line, saving a
    checkpoint) and, at an epoch's first iteration, the start of the epoch (the DataLoader's
    workers starting). Unless ``log_stats=False``, the loop adds two scalars to the runner's
    message hub at every iteration (``train/data_bound``, ``train/data_wait_time``), which the
    log lines (and the visualizer's backends) show:

    - ``data_bound``: the share of the loop's time spent waiting for the loader, over the last
      ``window_size`` iterations of the log processor (the window that smooths ``time`` and
      ``data_time``): near 0 when the batches are always ready, near 1 when the loop waits for
      data most of the time;
    - ``data_wait_time``: the loop's wait for each batch inside the loader, in seconds, averaged
      over that window as ``data_time`` is (it leaves out the hooks that ``data_time`` counts).

    :meth:`stats` gives the loader's figures over the run.

    Hooks and evaluators receive the batch the model receives (on the device), never a
    :class:`~mtc_loader.PackedBatch`; with ``prefetch_depth=0`` the loop does not prefetch, and
    each packed batch is unpacked on the training thread before the hooks run.

    Config: ``train_cfg=dict(type="MTCEpochBasedTrainLoop", max_epochs=..., prefetch_depth=2,
    log_stats=True)``. ``by_epoch=True``, which mmdet3d's schedules set, is accepted (a
    config's ``train_cfg`` with both ``type`` and ``by_epoch`` needs
    ``runner_type="MTCRunner"``: mmengine's ``Runner`` refuses the pair).
    """

    def __init__(self, runner: Any, dataloader: Any, max_epochs: int, *, prefetch_depth: int = 2,
                 log_stats: bool = True, by_epoch: Optional[bool] = None, **kwargs: Any) -> None:
        _check_by_epoch(by_epoch, True, "MTCEpochBasedTrainLoop")
        super().__init__(runner, dataloader, max_epochs, **kwargs)
        self.prefetch_depth = _check_depth(prefetch_depth)
        self.log_stats = _check_log_stats(log_stats)
        self._prefetch: Optional[PrefetchLoader] = None  # made at the first epoch, kept for all
        self._done = 0  # batches of the current epoch handed out (0 once it has ended)
        self._saved_position: Optional[dict[str, Any]] = None  # from the checkpoint resumed from
        runner.register_hook(_LoaderStateHook(self))
        if self.log_stats:
            runner.register_hook(_StatsHook(self))

    def stats(self) -> dict[str, Any]:
        """The loop's loader's :meth:`~mtc_loader.PrefetchLoader.stats`, over the run (empty
        before the first epoch)."""
        return self._prefetch.stats() if self._prefetch is not None else {}

    def _loader(self) -> PrefetchLoader:
        if self._prefetch is None or self._prefetch.iterable is not self.dataloader:
            self._prefetch = PrefetchLoader(self.dataloader, _device_of(self.runner), self.prefetch_depth)
        return self._prefetch

    def _loader_state(self) -> Optional[dict[str, Any]]:
        """What a checkpoint keeps of the loader: its state after the last batch handed out (the
        one the step that saves has trained on) and how many batches of the epoch that makes;
        None for a DataLoader that is not stateful."""
        if not is_stateful(self.dataloader) or self.prefetch_depth == 0:
            return None
        state = self._prefetch.state_dict() if self._prefetch is not None else self.dataloader.state_dict()
        return {"train_dataloader": state, "batches_done": self._done}

    def _resume_position(self, loader: PrefetchLoader) -> int:
        """On the first epoch after ``runner.resume``: loads the saved state into the loader and
        returns the index of the epoch's next batch (0 otherwise)."""
        saved, self._saved_position = self._saved_position, None
        if saved is None or (saved["epoch"], saved["iter"]) != (self._epoch, self._iter):
            return 0
        loader.load_state_dict(saved["train_dataloader"])
        done: int = saved["batches_done"]
        return done

    def run_iter(self, idx: int, data_batch: Any) -> None:
        super().run_iter(idx, _unpacked(data_batch, self.runner))

    def run_epoch(self) -> None:
        if self.prefetch_depth == 0:
            super().run_epoch()  # mmengine's, with run_iter's unpacking before the hooks
            return
        self.runner.call_hook("before_train_epoch")
        self.runner.model.train()
        loader = self._loader()
        start = self._resume_position(loader)
        batches = _Prefetching(loader, _device_of(self.runner), self.prefetch_depth, _run_ahead(self.runner))
        try:
            for idx, data_batch in enumerate(batches, start):
                self._done = idx + 1
                self.run_iter(idx, data_batch)
                del data_batch
        finally:
            batches.close()
        self._done = 0
        self.runner.call_hook("after_train_epoch")
        self._epoch += 1


@LOOPS.register_module()
class MTCIterBasedTrainLoop(IterBasedTrainLoop):  # type: ignore[misc]
    """mmengine's ``IterBasedTrainLoop`` with the batches prefetched on the model's device by
    :class:`~mtc_loader.PrefetchLoader` (see :class:`MTCEpochBasedTrainLoop`).

    In the logs: ``data_time``, ``data_bound`` and ``data_wait_time`` as with
    :class:`MTCEpochBasedTrainLoop` (``log_stats=False`` leaves the last two out); :meth:`stats`
    gives the loader's figures over the run.

    The loop prefetches within one pass of the DataLoader: at a pass's end the DataLoader is
    restarted on the training thread when the loop asks for the next batch, as with the plain
    loop, so a run that ends with a pass restarts nothing. Hooks and evaluators receive the batch the
    model receives; ``prefetch_depth=0`` does not prefetch (see :class:`MTCEpochBasedTrainLoop`).

    Config: ``train_cfg=dict(type="MTCIterBasedTrainLoop", max_iters=..., prefetch_depth=2,
    log_stats=True)``; ``by_epoch=False`` is accepted.
    """

    def __init__(self, runner: Any, dataloader: Any, max_iters: int, *, prefetch_depth: int = 2,
                 log_stats: bool = True, by_epoch: Optional[bool] = None, **kwargs: Any) -> None:
        _check_by_epoch(by_epoch, False, "MTCIterBasedTrainLoop")
        super().__init__(runner, dataloader, max_iters, **kwargs)
        self.prefetch_depth = _check_depth(prefetch_depth)
        self.log_stats = _check_log_stats(log_stats)
        self._prefetch: Optional[PrefetchLoader] = None  # the loader of the run under way
        if self.log_stats:
            runner.register_hook(_StatsHook(self))

    def stats(self) -> dict[str, Any]:
        """The loop's loader's :meth:`~mtc_loader.PrefetchLoader.stats`, over the run (empty
        before it starts)."""
        return self._prefetch.stats() if self._prefetch is not None else {}

    def run_iter(self, data_batch: Any) -> None:
        super().run_iter(_unpacked(data_batch, self.runner))

    def run(self) -> Any:
        if self.prefetch_depth == 0:
            return super().run()
        endless: Any = self.dataloader_iterator  # type: ignore[has-type]
        passes = hasattr(endless, "_iterator") and hasattr(endless, "_dataloader")  # mmengine's own
        prefetching = (_PrefetchedPasses if passes else _Prefetching)(endless, _device_of(self.runner),
                                                                      self.prefetch_depth, _run_ahead(self.runner))
        self._prefetch = prefetching.loader
        self.dataloader_iterator = prefetching
        try:
            return super().run()
        finally:
            prefetching.close()
            self.dataloader_iterator = endless


# ------------------------------------------------------------------------- validation and test loops

@LOOPS.register_module()
class MTCValLoop(ValLoop):  # type: ignore[misc]
    """mmengine's ``ValLoop`` for a loader whose batches are packed (``mtc_packed_collate``):
    each :class:`~mtc_loader.PackedBatch` is unpacked on the model's device (one DMA per dtype) before
    the hooks run, so that hooks (``before_val_iter``, ``after_val_iter``), the model and the
    evaluator's metrics (``process(data_batch, data_samples)``) all receive the batch's
    structure. Other batches go through as with ``ValLoop``.

    Config: ``val_cfg=dict(type="MTCValLoop")`` (``ValLoop``'s arguments).
    """

    def run_iter(self, idx: int, data_batch: Any) -> None:
        try:
            super().run_iter(idx, _unpacked(data_batch, self.runner))
        finally:
            _MOVED.batch = None


@LOOPS.register_module()
class MTCTestLoop(TestLoop):  # type: ignore[misc]
    """mmengine's ``TestLoop`` with packed batches unpacked before the hooks (see
    :class:`MTCValLoop`).

    Config: ``test_cfg=dict(type="MTCTestLoop")`` (``TestLoop``'s arguments).
    """

    def run_iter(self, idx: int, data_batch: Any) -> None:
        try:
            super().run_iter(idx, _unpacked(data_batch, self.runner))
        finally:
            _MOVED.batch = None
