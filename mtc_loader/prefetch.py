"""``PrefetchLoader``: keeps the next batches in flight to the device while the model trains."""
from __future__ import annotations

import os
from collections import deque
from typing import Any, Iterable, Iterator

from ._device import target_index
from .collate import _ARENAS, PackedBatch
from .copy import start_copy

__all__ = ["PrefetchLoader"]


class PrefetchLoader:
    """Wraps a DataLoader (or any iterable of batches) and yields the batches on ``device``.

    While the caller works on batch k, batches k+1 .. k+depth are already on their way: a
    :class:`~mtc_loader.PackedBatch` is DMA'd straight from the shared arena, any other batch
    goes through :func:`~mtc_loader.start_copy` (``start_copy_options`` are passed on).

    It forwards ``len()``, can be iterated once per epoch, re-raises the underlying iterator's
    exceptions in order (after the batches that came before them), and when the loop breaks early
    or the iterator is dropped it waits for the copies in flight and releases their regions.

    Args:
        iterable: The batches (e.g. a ``torch.utils.data.DataLoader``).
        device: Target device, e.g. ``"cuda"``, ``"cuda:0"`` or ``"cpu"``.
        depth: Batches kept in flight (>= 1).
    """

    def __init__(self, iterable: Iterable, device: Any, depth: int = 2, **start_copy_options: Any):
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"mtc_loader: depth must be an int >= 1, got {depth!r}")
        target_index(device)  # fail early on a bad device
        self.iterable = iterable
        self.device = device
        self.depth = depth
        self.options = start_copy_options

    def __len__(self) -> int:
        return len(self.iterable)  # type: ignore[arg-type]

    def _start(self, batch: Any):
        if isinstance(batch, PackedBatch):
            return batch.start_copy(self.device, **self.options)
        return start_copy(batch, self.device, **self.options)

    def __iter__(self) -> Iterator[Any]:
        _reclaim_dead()  # regions left by workers of an earlier epoch that have exited since
        it = iter(self.iterable)
        pending: deque = deque()
        error: BaseException | None = None
        exhausted = False

        def fill() -> None:
            nonlocal error, exhausted
            while not exhausted and error is None and len(pending) < self.depth:
                try:
                    batch = next(it)
                except StopIteration:
                    exhausted = True
                except Exception as e:  # re-raised once the batches before it were handed out
                    error = e
                else:
                    pending.append(self._start(batch))

        try:
            fill()
            while pending:
                handle = pending.popleft()
                fill()  # the next copy starts before the caller gets this batch
                yield handle.get()
            if error is not None:
                raise error  # regions of a worker that died are reclaimed below
        finally:
            pending.clear()  # handles wait for their copies as they go
            del it  # a DataLoader iterator shuts its workers down
            # batches the stopped workers had packed but never sent are theirs: reclaim them
            _reclaim_dead()


def _reclaim_dead() -> None:
    """Frees the arena regions of worker processes that have exited (this process's arenas)."""
    me = os.getpid()
    for arena in list(_ARENAS.values()):
        if arena.creator == me:
            arena.reclaim_dead()
