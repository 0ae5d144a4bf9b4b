"""Hugging Face accelerate: the prefetch service behind a prepared DataLoader.

Packed batches need no integration: with ``DataLoader(..., collate_fn=mtc_loader.PackedCollate())``
the loader that ``accelerator.prepare`` returns moves each batch with ``send_to_device``, which
calls :meth:`~mtc_loader.PackedBatch.to` (one DMA per dtype from the arena). :func:`prefetch` adds the
prefetch service, so that batch k+1 is copied (on the device's copy stream) while step k trains::

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    loader = mtc_loader.accelerate.prefetch(loader)

:func:`log_stats` puts the prefetch service's figures (is the loop waiting for data?) in the
trackers of ``accelerator.log``, at the steps your loop logs.

Importing this module needs ``accelerate``.
"""
from __future__ import annotations

from typing import Any, Optional

try:
    from accelerate import Accelerator  # type: ignore[import-untyped]
    from accelerate.data_loader import DataLoaderShard  # type: ignore[import-untyped]
except ImportError:
    raise ImportError("mtc_loader: mtc_loader.accelerate needs accelerate (pip install accelerate)") from None

from ._wrap import PrefetchingDataLoader
from .prefetch._stats import StatsWindow

__all__ = ["log_stats", "prefetch"]


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
            (``loader.base_dataloader.stats()`` says whether the loop waited for data, over the
            run; :func:`log_stats` logs the figures over the steps between two calls); calling
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
    prefetching = _BaseLoader(base, device, depth, **start_copy_options)
    prefetching._log_window = StatsWindow(prefetching._stats)  # what log_stats reports
    loader.base_dataloader = prefetching
    return loader


def log_stats(accelerator: Any, loader: Any, step: Optional[int] = None,
              log_kwargs: Optional[dict[str, Any]] = None) -> dict[str, float]:
    """Logs the prefetch service's figures with ``accelerator.log`` (to the trackers of
    ``Accelerator(log_with=...)`` once ``init_trackers`` has run; without trackers nothing is
    logged) and returns them. Call it where your loop logs, with the same ``step``:

        if step % 100 == 0:
            accelerator.log({"loss": loss.item()}, step=step)
            mtc_loader.accelerate.log_stats(accelerator, loader, step=step)

    The figures are those of the batches handed out **since the previous call** (since
    :func:`prefetch`, for the first), not over the run, so that a change in the middle of a run
    shows where it happens (``loader.base_dataloader.stats()`` gives the run's):

    - ``mtc/data_bound``: the share of the loop's time spent waiting for data, from 0 (the
      batches are always ready) to 1 (as :meth:`~mtc_loader.PrefetchLoader.stats` defines it);
    - ``mtc/wait_ms_per_batch``: the loop's wait for a batch, in milliseconds.

    accelerate logs from the main process only: these are the main process's figures. Each
    process may call it (the others log nothing); the dict returned is the calling process's.

    Args:
        accelerator: The ``Accelerator`` whose trackers receive the figures.
        loader: A loader that :func:`prefetch` made prefetching.
        step: Passed to ``accelerator.log`` (the step your loop logs its own values at).
        log_kwargs: Passed to ``accelerator.log`` (per tracker: ``{"wandb": {...}}``).

    Returns:
        dict[str, float]: The figures logged, named as above; an empty dict (and nothing
            logged) when the loader counted nothing since the previous call.

    Raises:
        TypeError: For an ``accelerator`` that is not an ``Accelerator``, or a ``loader`` that
            :func:`prefetch` has not made prefetching.
    """
    if not isinstance(accelerator, Accelerator):
        raise TypeError(f"mtc_loader: log_stats needs the Accelerator, got {type(accelerator).__name__}")
    base = getattr(loader, "base_dataloader", None) if isinstance(loader, DataLoaderShard) else None
    window = base.__dict__.get("_log_window") if isinstance(base, PrefetchingDataLoader) else None
    if window is None:
        what = ("a prepared loader without prefetch" if isinstance(loader, DataLoaderShard)
                else type(loader).__name__)
        raise TypeError("mtc_loader: log_stats needs the loader that mtc_loader.accelerate.prefetch(loader) "
                        f"returned, got {what}")
    figures = {f"mtc/{name}": value for name, value in window.advance().items()}
    if figures:
        accelerator.log(figures, step=step, log_kwargs=log_kwargs)
    return figures
