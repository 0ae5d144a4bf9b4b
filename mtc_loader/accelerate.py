"""Hugging Face accelerate: the prefetch service behind a prepared DataLoader.

Packed batches need no integration: with ``DataLoader(..., collate_fn=mtc_loader.PackedCollate())``
the loader that ``accelerator.prepare`` returns moves each batch with ``send_to_device``, which
calls :meth:`~mtc_loader.PackedBatch.to` (one DMA from the arena). :func:`prefetch` adds the
prefetch service, so that batch k+1 is copied (on the device's copy stream) while step k trains::

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    loader = mtc_loader.accelerate.prefetch(loader)

Importing this module needs ``accelerate``.
"""
from __future__ import annotations

from typing import Any, Optional

try:
    from accelerate.data_loader import DataLoaderShard  # type: ignore[import-untyped]
except ImportError:
    raise ImportError("mtc_loader: mtc_loader.accelerate needs accelerate (pip install accelerate)") from None

from ._wrap import PrefetchingDataLoader

__all__ = ["prefetch"]


class _BaseLoader(PrefetchingDataLoader):
    """The prefetching loader in the place of a DataLoaderShard's ``base_dataloader``. accelerate's
    shard reports its base loader's class as its own (so that ``isinstance(loader, DataLoader)``
    holds); this one reports the class of the DataLoader it wraps, for the same reason."""

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        return type(self.iterable)


def prefetch(loader: Any, device: Optional[Any] = None, depth: int = 2, **start_copy_options: Any) -> Any:
    """Puts the prefetch service (:class:`~mtc_loader.PrefetchLoader`) behind a DataLoader that
    ``accelerator.prepare`` returned, and returns that same loader.

    The shard keeps its own iteration (it still synchronises the RNG states, sets the sampler's
    epoch, marks the end of the data loader for gradient accumulation, skips batches on resume,
    and moves each batch with ``send_to_device``), but the DataLoader it reads from is replaced by
    a prefetching stand-in: a daemon thread takes each batch as the DataLoader produces it
    (sharded already: accelerate re-created the DataLoader for this process), copies it to
    ``device`` on the device's copy stream, and the shard's ``send_to_device`` receives it
    on the device (its ``to`` hands the structure over as it is).

    Args:
        loader: A loader returned by ``accelerator.prepare`` (``DataLoaderShard``; loaders that
            dispatch batches from one process, ``dispatch_batches=True``, are not supported).
        device: Target device; default: the loader's own (``accelerator.device``).
        depth: Finished batches kept ready (>= 1).
        **start_copy_options: Passed to :func:`~mtc_loader.start_copy` for batches that are not
            packed.

    Resuming: with ``DataLoaderConfiguration(use_stateful_dataloader=True)`` the prefetching
    stand-in has the ``state_dict`` / ``load_state_dict`` of the position after the last batch
    handed out (not where the prefetch thread has got to), which the shard records for each
    batch it yields; ``accelerator.save_state`` saves it and ``accelerator.load_state`` (after
    :func:`prefetch` or before it) resumes at the batch after the last one trained on.

    Returns:
        The same loader object. Its ``base_dataloader`` is a :class:`~mtc_loader.PrefetchLoader`
        (``loader.base_dataloader.stats()`` says whether the loop waited for data); calling
        :func:`prefetch` again on it changes nothing.

    Raises:
        TypeError: For a loader that is not one accelerate prepared for device placement per
            process.
        ValueError: Without a device (a loader prepared with ``device_placement=False``, and no
            ``device``).
    """
    if not isinstance(loader, DataLoaderShard):
        raise TypeError("mtc_loader: prefetch needs a DataLoader returned by accelerator.prepare "
                        f"(an accelerate DataLoaderShard), got {type(loader).__name__}")
    base = loader.base_dataloader
    if isinstance(base, PrefetchingDataLoader):
        return loader
    if device is None:
        device = loader.device
        if device is None:
            raise ValueError("mtc_loader: this loader was prepared without device placement; "
                             "pass prefetch(loader, device=accelerator.device)")
    loader.base_dataloader = _BaseLoader(base, device, depth, **start_copy_options)
    return loader
