"""The prefetch service: a daemon thread that takes each batch as it is produced, copies it on a
dedicated copy stream of the device and builds it, so the training loop never waits for data.

:class:`PrefetchLoader` wraps any iterable of batches. For each epoch it starts one thread that
pulls batches from the iterable as soon as they are produced (at most ``depth`` finished batches
wait for the caller), and for each one starts the copy (:meth:`~mtc_loader.PackedBatch.start_copy`
for a packed batch: one DMA per dtype from the arena; :func:`~mtc_loader.start_copy` otherwise) with the
device's **copy stream** current, waits until the copy is enqueued and the output structure is
built (the GIL released while it waits), and records an event on the copy stream. The caller's
``__next__`` only takes a finished batch: its current stream waits for that event on the GPU (no
CPU synchronisation), and the batch's device buffers are recorded on the caller's stream for
torch's caching allocator. :func:`start_side_copy` is the same unit of work for a hand-written
loop.

The package's rooms: ``_side`` (the copy streams and one batch's copy on them: SideCopy,
start_side_copy), ``_service`` (the daemon thread of an epoch and the switch interval),
``_pipes`` (a DataLoader's pipes read and written by that thread without giving up the GIL),
``_handout`` (the caller's ``__next__``), ``_resume`` (the position the caller has reached),
``_stats`` (where the time went) and ``_loader`` (PrefetchLoader itself).
"""
from __future__ import annotations

from ._loader import PrefetchLoader
from ._side import SideCopy, copy_stream, start_side_copy

__all__ = ["PrefetchLoader", "SideCopy", "copy_stream", "start_side_copy"]

# the public names are documented where the package exports them
for _cls in (PrefetchLoader, SideCopy):
    _cls.__module__ = __name__
copy_stream.__module__ = start_side_copy.__module__ = __name__
del _cls
