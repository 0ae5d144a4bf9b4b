"""Worker-side packing: a drop-in ``collate_fn`` that writes each batch into a shared arena.

With ``DataLoader(..., num_workers=N)``, every tensor of a batch normally crosses from the
worker to the main process through its own shared-memory segment and file descriptor: a cost
paid per tensor, so a batch of many small tensors pays it many times over its bytes.
:class:`PackedCollate` runs the usual collate function in the worker, then writes every tensor
of the result into one region of an :class:`Arena` (a sealed memfd mapping created by the main
process) and returns a :class:`PackedBatch`: the region's offset, the layout and the skeleton,
a few hundred bytes.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from multiprocessing import reduction
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch.utils.data import default_collate, get_worker_info

from . import _engine, _tree
from ._arena import Arena, check_dtypes, engine_arena, pack_word
from ._options import seconds
from ._packed import PackedBatch
from ._stack import RETIRED, RaggedStack, stacking_into_scratch, warn_escaped
from ._tree import LEAF

__all__ = ["Arena", "PackedBatch", "PackedCollate", "LEAF"]


# This process's parent as it was when the process started (imported mtc_loader, as a worker
# started by spawn or forkserver does to unpickle its PackedCollate) or was forked: the process a
# DataLoader worker packs for, watched while the worker waits for room in the arena. After the
# parent's exit, getppid() names another process, and only this record names the one to watch.
_PARENT = (os.getpid(), os.getppid())


def _record_parent() -> None:
    global _PARENT
    _PARENT = (os.getpid(), os.getppid())


os.register_at_fork(after_in_child=_record_parent)


def _exit_orphaned(message: str) -> None:
    try:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
    finally:
        os._exit(1)


def _consumer() -> int:
    """The pid a DataLoader worker packs for (its parent), or 0 outside a worker."""
    if get_worker_info() is None:
        return 0
    pid, parent = _PARENT
    return parent if pid == os.getpid() else os.getppid()


def _ragged_at(samples: list[Any], path: str = "sample") -> Optional[tuple[str, int, list[int], list[int]]]:
    """Where the samples' tensors (or arrays) differ in shape, walking them as ``default_collate``
    does: ``(path, sample, first shape, its shape)``, or None."""
    first = samples[0]
    if isinstance(first, (torch.Tensor, np.ndarray)):
        for i, x in enumerate(samples):
            if isinstance(x, (torch.Tensor, np.ndarray)) and tuple(x.shape) != tuple(first.shape):
                return path, i, list(first.shape), list(x.shape)
        return None
    if isinstance(first, Mapping):
        for key in first:
            if all(isinstance(x, Mapping) and key in x for x in samples):
                found = _ragged_at([x[key] for x in samples], f"{path}[{key!r}]")
                if found:
                    return found
    elif isinstance(first, (list, tuple)):
        for j in range(len(first)):
            if all(isinstance(x, (list, tuple)) and len(x) > j for x in samples):
                found = _ragged_at([x[j] for x in samples], f"{path}[{j}]")
                if found:
                    return found
    return None


def _ragged_message(samples: list[Any], e: RaggedStack, by_default_collate: bool) -> str:
    """The error for samples whose tensors ``default_collate`` cannot stack: where, and what to do."""
    found = _ragged_at(samples) if by_default_collate else None
    if found is not None:
        path, i, shape0, shape = found
        if path == "sample":  # the samples are tensors
            what = (f"mtc_loader: default_collate cannot stack the samples into one tensor: sample 0 has shape "
                    f"{shape0}, sample {i} {shape}.")
        else:
            what = (f"mtc_loader: default_collate cannot stack {path} across the batch: it has shape {shape0} "
                    f"in sample 0 and {shape} in sample {i}, and default_collate stacks each tensor of the "
                    "samples into one tensor of the batch.")
    else:
        (a, b), (shape0, shape) = e.entries, e.shapes
        what = (f"mtc_loader: default_collate (called by the collate_fn) cannot stack tensors of shapes "
                f"{shape0} and {shape} (entries {a} and {b} of one stack): tensors stack only when their "
                "shapes are equal.")
    return (f"{what} For samples whose tensors vary in size, keep the samples apart: PackedCollate(list) "
            "makes each batch the list of its samples and packs every tensor as it is; or pass a "
            "collate_fn of your own that pads them to one shape")


def _check_picklable(skeleton: Any, atoms: Optional[tuple[Any, ...]], batch: Any) -> None:
    """In a DataLoader worker: raises where the batch's structure cannot be pickled to the main
    process (a generator, a lock, an open file among its leaves). The DataLoader would fail in
    its feeder thread, print the error, and leave the main process waiting for the batch.
    ``batch``: the structure the skeleton was made from, where the error looks for the leaf."""
    if atoms is not None:  # a shared structure: plain containers and atoms; only an object array may hold anything
        if not any(type(a) is np.ndarray and a.dtype.hasobject for a in atoms):
            return
        skeleton = atoms
    try:
        reduction.ForkingPickler.dumps(skeleton)
    except Exception as e:
        path, leaf, err = _unpicklable_leaf(batch, "data", e)  # (the batch's paths, as the walk names them)
        raise TypeError(
            f"mtc_loader: {path} ({type(leaf).__name__}) cannot be pickled ({type(err).__name__}: {err}), and a "
            "batch leaves a DataLoader worker pickled: make it a value that pickles in the dataset or the "
            "collate function (list(...) of a generator, the path instead of an open file, no locks), or "
            "leave it out of the sample") from None


def _unpicklable_leaf(obj: Any, path: str, error: Exception) -> tuple[str, Any, Exception]:
    """The innermost part of ``obj`` (through lists, tuples, dicts and object arrays) that does
    not pickle: ``(its path, it, the error)``."""
    if isinstance(obj, Mapping):
        items: Any = obj.items()
    elif isinstance(obj, (list, tuple)) or (type(obj) is np.ndarray and obj.dtype.hasobject):
        items = enumerate(obj.ravel() if isinstance(obj, np.ndarray) else obj)
    else:
        return path, obj, error
    for key, value in items:
        try:
            reduction.ForkingPickler.dumps(value)
        except Exception as e:
            return _unpicklable_leaf(value, f"{path}[{key!r}]", e)
    return path, obj, error


class PackedCollate:
    """A picklable drop-in ``collate_fn`` that packs each batch into a shared arena.

    In the worker it runs ``collate_fn`` (torch's ``default_collate`` when None; ``list`` keeps
    samples separate), then writes every tensor of the result into one arena region and returns
    a small :class:`PackedBatch`. With ``num_workers=0`` it works the same in the main process.
    Unpacked, the batch is what ``collate_fn`` made with only its tensors moved: numpy arrays
    travel pickled, as through a plain DataLoader, and stay numpy arrays on the host. In a worker,
    a leaf that cannot be pickled (a generator, a lock) is refused here, by its path.

    While ``collate_fn`` runs, the CPU tensors that ``default_collate`` stacks (directly, or
    inside a collate function of yours that calls it) are written into blocks of memory that the
    process keeps from one batch to the next, instead of a new shared-memory segment per batch:
    after the first batch, stacking costs no page faults. Each stacked tensor has a block of its
    own, reused only once torch has freed the tensor's storage (nothing references that memory
    any more). A stacked tensor that outlives the batch (inside an object the packer does not
    open, such as a class of yours around a ``default_collate`` result, or kept by
    ``collate_fn``) keeps its block, and the next batch stacks that tensor into fresh memory:
    correct, but the slow path this avoids, counted in :meth:`stats` (``scratch_retired``) and
    warned about once. The process keeps at most as many idle blocks as one batch stacked, until
    the last ``PackedCollate`` that stacked in it goes or :func:`mtc_loader.trim` is called.

    ``default_collate`` stacks each tensor of the samples into one tensor of the batch, so it
    cannot take samples whose tensors differ in shape (a varying number of boxes per sample):
    ``PackedCollate(list)`` keeps each batch the list of its samples, every tensor packed as it
    is. Where ``default_collate`` meets such samples, the error names the tensor and says so.

    Args:
        collate_fn: The collate function to wrap (``list`` keeps samples apart).
        arena_bytes: Size of the shared arena, in bytes or as a string with a unit (``"512M"``,
            K, M, G or T, powers of 1024), rounded up to whole 64 KiB slots; a batch takes
            whole slots (a batch of 1 KB one slot, of 100 KB two). Workers never wait for room
            when it holds every batch in flight: ``num_workers * prefetch_factor`` in the
            DataLoader, one that the loop (or a :class:`~mtc_loader.PrefetchLoader`) unpacks, and
            for a CUDA device the ``depth`` batches a PrefetchLoader keeps ready, whose copies
            may still read the arena. With less, workers wait for room; the DataLoader goes on
            as long as the arena holds ``(num_workers - 1) * prefetch_factor + 1`` batches (it
            hands batches out in order, and the other workers may have packed theirs ahead of
            the next one). Under a PrefetchLoader, an arena smaller than that, for batches the
            size of the first one a worker packs, is refused at that batch, with the number of
            bytes that holds the whole flight; in a plain loop, for the DataLoader's in-flight
            batches with one the loop unpacks.
        timeout: Seconds a worker waits for room in a full arena before it raises an error that
            says which size to configure (negative: wait forever; a worker stops waiting either
            way, with an error, once the process it packs for (its parent, the DataLoader's
            process) or the process that created the arena has exited).
        min_packed_alignment_bytes: Alignment of every tensor in the region (a power of two).
        arena: An :class:`Arena` to pack into instead of a new one of ``arena_bytes`` (which is
            then not used): the ``PackedCollate`` objects that share an arena share its room.
    """

    def __init__(self, collate_fn: Optional[Callable[[list[Any]], Any]] = None, *, arena_bytes: int = 256 << 20,
                 timeout: float = 60.0, min_packed_alignment_bytes: int = 16,
                 arena: Optional[Arena] = None):
        if collate_fn is None:
            collate_fn = default_collate
        align = min_packed_alignment_bytes
        if isinstance(align, bool) or not isinstance(align, int) or not 1 <= align <= 4096 or align & (align - 1):
            raise ValueError("mtc_loader: min_packed_alignment_bytes must be a power of two from 1 to "
                             f"4096, got {align!r}")
        self.collate_fn = collate_fn
        self.timeout = seconds("timeout", timeout)
        self.arena = arena if arena is not None else Arena(arena_bytes)
        self.align = align
        # pickles as the registered containers: a worker started by spawn walks the same types
        self.containers = _tree.CARRIED

    def __getstate__(self) -> dict[str, Any]:
        # pickled to DataLoader workers started by spawn or forkserver: a collate_fn that does not
        # pickle (a lambda, a local function) would fail there with no word of what to do
        try:
            reduction.ForkingPickler.dumps(self.collate_fn)
        except Exception as e:
            raise _tree.same_kind(e, (
                f"mtc_loader: PackedCollate's collate_fn {self.collate_fn!r} cannot be pickled "
                f"({type(e).__name__}: {e}), and a PackedCollate travels pickled to DataLoader workers "
                "started by spawn or forkserver (and to processes of launchers such as "
                "torch.multiprocessing.spawn): define the collate function with def at a module's top "
                "level (functools.partial of such a function works too), or start the workers with "
                "multiprocessing_context='fork'")) from e
        return self.__dict__

    def __call__(self, samples: list[Any]) -> PackedBatch:
        # the tensors default_collate stacks go to this process's warm blocks rather than
        # a new shared-memory segment per batch (_stack.py); a block is reused once its tensor is freed
        check_dtypes(self.arena, "packs")
        consumer = _consumer()
        with stacking_into_scratch(self):
            try:
                batch = self.collate_fn(samples)
            except RaggedStack as e:
                raise RuntimeError(_ragged_message(samples, e, self.collate_fn is default_collate)) from None
            try:
                word, numpy_tensors = pack_word(self.arena)
                off, nbytes, layout, skeleton, atoms = _engine.pack(engine_arena(self.arena), batch, self.align,
                                                                       self.timeout, consumer, word, numpy_tensors)
            except RuntimeError as e:
                if consumer and os.getppid() != consumer:
                    # The process this worker packs for has exited: nobody reads the error,
                    # torch's worker loop would carry on for seconds, and the interpreter's
                    # teardown takes as long again on a loaded machine. The worker ends now,
                    # its message on its stderr; its arena regions are reclaimed as a dead
                    # owner's.
                    _exit_orphaned(str(e))
                raise
            if consumer:
                try:
                    _check_picklable(skeleton, atoms, batch)
                except BaseException:  # a leaf that cannot travel: the region goes with it
                    engine_arena(self.arena).release(off, os.getpid())
                    raise
            del batch
        me = os.getpid()
        try:
            warn_escaped()
        except BaseException:  # the warning made an error (-W error): the region goes with it
            engine_arena(self.arena).release(off, me)
            raise
        state = "held" if self.arena.creator == me else "own" if get_worker_info() is None else "sent"
        return PackedBatch(self.arena, off, nbytes, me, layout, skeleton, state, atoms)

    def stats(self) -> dict[str, int]:
        """The arena's counters, and ``scratch_retired``: the stacked tensors of this process that
        outlived their batch (see the class's docstring; 0 on the fast path)."""
        out = self.arena.stats()
        out["scratch_retired"] = RETIRED[0]
        return out
