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

from ._handout import (
    _EpochEnd as _EpochEnd, _HandOut as _HandOut)
from ._loader import (
    _RESUMABLE as _RESUMABLE, PrefetchLoader as PrefetchLoader, _check_options as _check_options,
    _ResumablePrefetchLoader as _ResumablePrefetchLoader, _resumable_class as _resumable_class)
from ._resume import (
    _NO_STATE as _NO_STATE, _STATE_METHODS as _STATE_METHODS, _UNSET as _UNSET,
    _FailedSnapshot as _FailedSnapshot, _is_stateful as _is_stateful, _not_resumable as _not_resumable,
    _NotResumableError as _NotResumableError, _Position as _Position,
    _snapshots_may_change as _snapshots_may_change)
from ._service import (
    _END as _END, _STOP_JOIN_S as _STOP_JOIN_S, _SWITCH as _SWITCH, _next_of as _next_of,
    _produces_in_process as _produces_in_process, _reclaim_dead as _reclaim_dead, _Service as _Service,
    _SwitchInterval as _SwitchInterval)
from ._side import (
    SideCopy as SideCopy, _copy_stream as _copy_stream, _start as _start, copy_stream as copy_stream,
    start_side_copy as start_side_copy)
from ._stats import (
    _figures as _figures, _new_stats as _new_stats, _Window as _Window)

__all__ = ["PrefetchLoader", "SideCopy", "copy_stream", "start_side_copy"]

# the public names are documented where the package exports them
for _cls in (PrefetchLoader, SideCopy):
    _cls.__module__ = __name__
copy_stream.__module__ = start_side_copy.__module__ = __name__
del _cls
