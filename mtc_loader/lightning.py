"""PyTorch Lightning: the prefetch service as a callback.

Packed batches need no integration: with ``DataLoader(..., collate_fn=mtc_loader.PackedCollate())``
Lightning's device placement calls :meth:`~mtc_loader.PackedBatch.to`, which unpacks the batch
with one DMA from the arena. :class:`PrefetchCallback` adds the prefetch service, so that batch
k+1 is copied (on the device's copy stream) while step k trains::

    trainer = L.Trainer(callbacks=[mtc_loader.lightning.PrefetchCallback()])

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

    Works with packed batches (:class:`~mtc_loader.PackedCollate`: one DMA from the arena) and
    with plain ones (copied by :func:`~mtc_loader.start_copy`). :meth:`stats` gives the
    training loader's :meth:`~mtc_loader.PrefetchLoader.stats`.

    Resuming: over torchdata's ``StatefulDataLoader`` the wrapped loader has ``state_dict`` /
    ``load_state_dict`` (the position after the last batch handed out, not where the prefetch
    thread has got to), which Lightning saves in its checkpoints and loads on
    ``fit(..., ckpt_path=...)``: a run resumed mid-epoch goes on at the batch after the last one
    the checkpoint had. Over a plain DataLoader it has neither, as the DataLoader.

    Args:
        depth: Finished batches kept ready per loader (>= 1).
        **start_copy_options: Passed to :func:`~mtc_loader.start_copy` for batches that are not
            packed.
    """

    def __init__(self, depth: int = 2, **start_copy_options: Any) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"mtc_loader: depth must be an int >= 1, got {depth!r}")
        self.depth = depth
        self.options = start_copy_options
        self._strategy: Any = None
        self._train: Optional[PrefetchingDataLoader] = None

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
