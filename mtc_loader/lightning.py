"""PyTorch Lightning: the prefetch service as a callback.

Packed batches need no integration: with ``DataLoader(..., collate_fn=mtc_loader.PackedCollate())``
Lightning's device placement calls :meth:`~mtc_loader.PackedBatch.to`, which unpacks the batch
with one DMA per dtype from the arena. :class:`PrefetchCallback` adds the prefetch service, so that batch
k+1 is copied (on the device's copy stream) while step k trains::

    trainer = L.Trainer(callbacks=[mtc_loader.lightning.PrefetchCallback()])

The callback also logs the training loader's figures (``mtc/data_bound``,
``mtc/wait_ms_per_batch``) with ``self.log``, so that they show in the Trainer's loggers.

Importing this module needs ``lightning`` (``lightning.pytorch``) or ``pytorch_lightning``.
"""
from __future__ import annotations

from typing import Any, Optional

try:
    from lightning.pytorch import Callback, LightningModule, Trainer
except ImportError:  # the standalone package
    try:
        from pytorch_lightning import Callback, LightningModule, Trainer  # type: ignore[assignment]
    except ImportError:
        raise ImportError("mtc_loader: mtc_loader.lightning needs PyTorch Lightning "
                          "(pip install lightning)") from None

from ._wrap import PrefetchingDataLoader, wrap
from .prefetch._stats import StatsWindow

__all__ = ["PrefetchCallback"]


class PrefetchCallback(Callback):
    """Runs every DataLoader of the Trainer (training, validation, test, predict) through the
    prefetch service (:class:`~mtc_loader.PrefetchLoader`) on the Trainer's device.

    The loaders are wrapped where Lightning hands them to its strategy
    (``Strategy.process_dataloader``), i.e. after Lightning has re-created them with a
    ``DistributedSampler``, so each rank prefetches its own shard. The wrapper forwards the
    DataLoader's attributes (``sampler``, ``batch_sampler``, ``dataset``, ...), so Lightning still
    sets the sampler's epoch and sizes the epoch; it yields batches already on the device, whose
    ``to`` hands them to Lightning's ``batch_to_device`` as they are. ``transfer_batch_to_device``
    and ``on_after_batch_transfer`` run as usual; ``on_before_batch_transfer`` receives the
    prefetched batch (an object whose ``batch`` attribute is the structure on the device).

    Works with packed batches (:class:`~mtc_loader.PackedCollate`: one DMA per dtype from the arena) and
    with plain ones (copied by :func:`~mtc_loader.start_copy`). :meth:`stats` gives the
    training loader's :meth:`~mtc_loader.PrefetchLoader.stats`.

    Resuming: over torchdata's ``StatefulDataLoader`` the wrapped loader has ``state_dict`` /
    ``load_state_dict`` (the position after the last batch handed out, not where the prefetch
    thread has got to), which Lightning saves in its checkpoints and loads on
    ``fit(..., ckpt_path=...)``: a run resumed mid-epoch goes on at the batch after the last one
    the checkpoint had. Over a plain DataLoader it has neither, as the DataLoader.

    In the logs: unless ``log_stats=False``, the callback logs the training loader's figures with
    ``pl_module.log``, so they reach every logger of the Trainer (and nothing is logged with
    ``logger=False``, as for any ``self.log``):

    - ``mtc/data_bound`` and ``mtc/wait_ms_per_batch`` at the steps Lightning writes its logs
      (every ``log_every_n_steps``), each over the batches **since the previous written step**,
      not over the run: the share of the loop's time spent waiting for data and the wait per
      batch (as :meth:`~mtc_loader.PrefetchLoader.stats` defines them), so that a change in the
      middle of a run shows where it happens. These are the figures of the process's own loader
      (the logger writes rank 0's).
    - ``mtc/data_bound_epoch`` and ``mtc/wait_ms_per_batch_epoch`` at the end of each training
      epoch, over that epoch; with several processes, the highest over the ranks (the rank that
      waits most holds the others up at the next gradient synchronisation).

    Under ``Trainer(barebones=True)``, which refuses ``self.log``, nothing is logged.

    Args:
        depth: Finished batches kept ready per loader (>= 1).
        log_stats: Whether to log the figures above (``True`` or ``False``).
        **start_copy_options: Passed to :func:`~mtc_loader.start_copy` for batches that are not
            packed.

    Raises:
        ValueError: For a ``depth`` that is not an int >= 1.
        TypeError: For a ``log_stats`` that is not a bool.
    """

    def __init__(self, depth: int = 2, *, log_stats: bool = True, **start_copy_options: Any) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"mtc_loader: depth must be an int >= 1, got {depth!r}")
        if not isinstance(log_stats, bool):
            raise TypeError(f"mtc_loader: log_stats must be True or False, got {log_stats!r}")
        self.depth = depth
        self.log_stats = log_stats
        self.options = start_copy_options
        self._strategy: Any = None
        self._train: Optional[PrefetchingDataLoader] = None
        # the windows of the figures logged per step and per epoch, and the loader they count
        self._windows: Optional[tuple[PrefetchingDataLoader, StatsWindow, StatsWindow]] = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if self._strategy is strategy:
            return
        original = strategy.process_dataloader
        callback = self

        def process_dataloader(dataloader: object) -> object:
            dataloader = original(dataloader)
            device = trainer.strategy.root_device
            wrapped = wrap(dataloader, device, callback.depth, callback.options)  # type: ignore[arg-type]
            if trainer.training:
                callback._train = wrapped
            return wrapped

        # an instance attribute: only this Trainer's strategy, undone in teardown()
        strategy.process_dataloader = process_dataloader  # type: ignore[method-assign]
        self._strategy = strategy

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._strategy is not None:
            self._strategy.__dict__.pop("process_dataloader", None)
            self._strategy = None

    def stats(self) -> dict[str, Any]:
        """The training loader's :meth:`~mtc_loader.PrefetchLoader.stats` (empty before fit)."""
        return self._train.stats() if self._train is not None else {}

    def _window(self, trainer: Trainer, per_epoch: bool) -> Optional[StatsWindow]:
        """The window of the figures logged per step or per epoch, over the training loader that
        Lightning iterates now (new windows, counting from its first batch, when Lightning made a
        new loader: ``reload_dataloaders_every_n_epochs``); None when nothing is to be logged."""
        loader = self._train
        if not self.log_stats or loader is None or trainer.barebones:
            return None
        if self._windows is None or self._windows[0] is not loader:
            self._windows = (loader, StatsWindow(loader._stats, from_start=True),
                             StatsWindow(loader._stats, from_start=True))
        _, per_step_window, per_epoch_window = self._windows
        return per_epoch_window if per_epoch else per_step_window

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        window = self._window(trainer, per_epoch=False)
        # only at the steps whose logs Lightning writes (as its own monitors do): the window then
        # runs from one written step to the next
        if window is None or not trainer._logger_connector.should_update_logs:
            return
        for name, value in window.advance().items():
            pl_module.log(f"mtc/{name}", value, on_step=True, on_epoch=False, batch_size=1)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        window = self._window(trainer, per_epoch=True)
        if window is None:
            return
        for name, value in window.advance().items():
            pl_module.log(f"mtc/{name}_epoch", value, on_step=False, on_epoch=True, batch_size=1,
                          reduce_fx="max", sync_dist=True)
