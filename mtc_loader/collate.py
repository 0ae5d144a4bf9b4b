"""Worker-side packing: a drop-in ``collate_fn`` that writes each batch into a shared arena.

With ``DataLoader(..., num_workers=N)``, every tensor of a batch normally crosses from the
worker to the main process through its own shared-memory segment and file descriptor (~170 ms
for 528 small tensors on the GPU machine). :class:`PackedCollate` runs the usual collate
function in the worker, then writes every tensor of the result into one region
of an :class:`Arena` (a sealed memfd mapping created by the main process) and returns a
:class:`PackedBatch`: the region's offset, the layout and the skeleton, a few hundred bytes.
"""
from __future__ import annotations

import os
import pickle
import sys
import weakref
from multiprocessing import context as _mp_context
from multiprocessing import reduction, resource_sharer
from collections.abc import Mapping
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch.utils.data import default_collate, get_worker_info

from . import _dtypes, _engine, _tree
from ._device import target_index
from ._options import positive_int, seconds, size
from ._stack import RETIRED, RaggedStack, stacking_into_scratch, warn_escaped
from ._tree import LEAF
from .handle import AsyncCopyHandle

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


# Arenas of this process by token, so that an unpickled PackedBatch finds its arena.
_ARENAS: "weakref.WeakValueDictionary[tuple[int, int, int], Arena]" = weakref.WeakValueDictionary()


class Arena:
    """A shared memory arena: anonymous (memfd, no name in /dev/shm), sealed against resizing,
    reachable only by processes it is handed to (the descriptor travels with the pickled
    :class:`PackedCollate` to DataLoader workers started by fork, spawn or forkserver).

    Its data area is cut into slots of 64 KiB, and each packed batch takes a run of whole slots:
    ``Arena(1024)`` is one 64 KiB slot, and holds one batch at a time; a batch of 100 KB takes two.

    Args:
        nbytes: Size of the data area (bytes, or a string with a unit: ``"512M"``), rounded up
            to whole 64 KiB slots.
    """

    # What a PackedBatch read as its structure tells the user to do: an integration whose loops
    # unpack the batches (mtc_loader.mmengine) names its own way on the arenas it creates.
    _unpack_hint = ("get the structure with batch.to(device) (or batch.unpack()), or iterate "
                    "mtc_loader.PrefetchLoader(loader, device), which yields it on the device")

    def __init__(self, nbytes: int = 256 << 20, *, _engine_arena: Any = None, _token: Any = None,
                 _dtypes_of: Optional[tuple[str, str]] = None):
        if _engine_arena is None:
            try:
                nbytes = size("arena_bytes", nbytes, _MAX_ARENA_BYTES)
            except TypeError as e:  # a ValueError, as it always was for a bad arena_bytes
                raise ValueError(str(e)) from None
            try:
                _engine_arena = _engine.arena_create(nbytes)
            except OSError as e:
                raise OSError(e.errno, f"mtc_loader: creating a shared arena of {nbytes} bytes failed: "
                                       f"{e.strerror}") from None
            st = os.fstat(_engine_arena.fileno())
            _token = (os.getpid(), st.st_dev, st.st_ino)
        self._a: _engine.Arena = _engine_arena
        self.token = _token
        self.creator = _token[0]
        # the creator's dtype table (torch version, fingerprint): every process that packs or
        # unpacks this arena's batches checks that its own is the same (_check_dtypes)
        self._dtype_table = _dtypes.TABLE if _dtypes_of is None else _dtypes_of
        # what the loader that unpacks this arena's batches keeps in flight and needs at the
        # least, (batches, what they are, least, what they are), as a PrefetchLoader over a
        # DataLoader of it says (_flight.py); and the process whose first pack was checked
        self._expected: Optional[tuple[int, str, int, str]] = None
        self._checked = 0
        # whose word _expected is: a PrefetchLoader's (its regions are the loader's own), or the
        # DataLoader's alone, taken where its workers start (a loop unpacks: _word_at_start);
        # and whether the consumer asked for numpy arrays as tensors (numpy_to_tensors)
        self._loaders = False
        self._numpy_tensors = False
        # resource-sharer registrations of this arena's descriptor that no process has taken
        # yet (a pickle never unpickled): closed with the arena, or they would keep its memory
        self._shared: list[int] = []
        weakref.finalize(self, _unshare, self._shared)
        _ARENAS[_token] = self

    def __reduce__(self) -> tuple[Any, ...]:
        if _mp_context.get_spawning_popen() is not None:
            # a child being started (spawn / forkserver): the descriptor goes to that child only
            # (pass_fds, or SCM_RIGHTS over the forkserver's socket), no copy is left behind
            _word_at_start(self)
            return (_attach, (reduction.DupFd(self._a.fileno()), self.token, self._expected, self._dtype_table,
                              self._loaders, self._numpy_tensors))
        # Outside process start-up, multiprocessing's resource sharer keeps a dup of the
        # descriptor until a process asks for it. A pickle that is never unpickled would keep
        # that dup, and the arena's memory, for the life of this process: this arena tracks
        # its registrations and closes those still pending when it goes.
        dup = resource_sharer.DupFd(self._a.fileno())
        pending = _pending_keys()
        self._shared[:] = [k for k in self._shared if k in pending]
        self._shared.append(dup._id[1])  # type: ignore[attr-defined]  # (address, key)
        return (_attach, (dup, self.token, self._expected, self._dtype_table, self._loaders, self._numpy_tensors))

    def _check_dtypes(self, doing: str) -> None:
        """Raises unless this process's dtype codes mean what the arena creator's do (the same
        torch): a batch packed with one table and unpacked with another would come back with
        other dtypes."""
        if self._dtype_table is not _dtypes.TABLE and self._dtype_table != _dtypes.TABLE:
            raise RuntimeError(_dtypes.mismatch(self._dtype_table, doing))

    def _expect(self, expected: tuple[int, str, int, str], loaders: bool = True, numpy_tensors: bool = False) -> None:
        """The loader that unpacks this arena's batches keeps up to ``expected[0]`` in flight and
        needs room for ``expected[2]`` at the least (``[1]``, ``[3]``: what they are;
        ``_flight.in_flight``): the first batch each process packs after this is refused at once,
        with the size to configure, where the arena cannot hold the least of its size.
        ``loaders``: the word is a PrefetchLoader's; ``numpy_tensors``: it wants numpy arrays
        packed as tensors."""
        self._expected = expected
        self._checked = 0
        self._loaders, self._numpy_tensors = loaders, numpy_tensors

    def _expect_none(self) -> None:
        """No loader's word any more (the end of a PrefetchLoader's epoch)."""
        self._expected = None
        self._loaders = self._numpy_tensors = False

    def _in_flight(self) -> tuple[int, str, int, str, bool]:
        """What ``_engine.pack`` is told: ``(batches in flight, what they are, the least the arena
        must hold, checked at this process's first pack only (0 after), what they are, whether the
        consumer's regions are its loaders' own)``. Without a PrefetchLoader's word, a DataLoader
        worker counts its DataLoader's workers at the default ``prefetch_factor`` (which it cannot
        see) and the batch the loop unpacks, and checks nothing."""
        expected = self._expected
        if expected is not None:
            me = os.getpid()
            first, self._checked = self._checked != me, me
            batches, why, least, least_why = expected
            return batches, why, least if first else 0, least_why, self._loaders
        info = get_worker_info()
        if info is None or not info.num_workers:
            return 1, "the one the loop unpacks", 0, "", False
        return (2 * info.num_workers + 1,
                f"{info.num_workers} workers x prefetch_factor 2 in the DataLoader (its default; count yours if "
                "you set another), 1 the loop unpacks", 0, "", False)

    def stats(self) -> dict[str, int]:
        """Allocator counters: bytes, slots in use, allocs, frees, waits, timeouts, reclaimed."""
        return self._a.stats()

    def reclaim_dead(self) -> int:
        """Free the regions of processes that died (a killed worker); returns slots freed."""
        return self._a.reclaim_dead()

    def __repr__(self) -> str:
        s = self.stats()
        return f"<Arena {s['bytes'] >> 20} MiB, {s['bytes_in_use'] >> 10} KiB in use>"


_MAX_ARENA_BYTES = 1 << 46  # mtc_arena_create's limit


def _pending_keys() -> set[int]:
    """Keys of the resource sharer's registrations no process has taken yet."""
    sharer = resource_sharer._resource_sharer  # type: ignore[attr-defined]
    with sharer._lock:
        return set(sharer._cache)


def _unshare(keys: list[int]) -> None:
    """Closes the resource sharer's pending dups of a dead arena's descriptor."""
    sharer = resource_sharer._resource_sharer  # type: ignore[attr-defined]
    with sharer._lock:
        entries = [sharer._cache.pop(k, None) for k in keys]
    keys.clear()
    for entry in entries:
        if entry is not None:
            entry[1]()  # its close(): os.close of the dup


# Set by _flight.py (which imports this module): tells the arena of a DataLoader iterator that is
# starting its workers (found on the caller's stack) what that DataLoader keeps in flight, where no
# PrefetchLoader has said it, so that a plain loop's workers check their first batch as a
# PrefetchLoader's do. Called while the arena is pickled for a spawn or forkserver child.
_WORD_AT_START: Optional[Callable[[Optional[Arena]], None]] = None


def _word_at_start(arena: Arena) -> None:
    if _WORD_AT_START is not None:
        _WORD_AT_START(arena)


def _consumes(arena: Arena) -> bool:
    """Whether this process unpacks the batches packed into ``arena``: the process that created
    it, and any other process holding it that is not a DataLoader worker. The second case is a
    process started with a ``PackedCollate`` built in its launcher (Lightning's ``ddp_spawn``,
    ``ddp_fork`` and notebook launchers, ``torch.multiprocessing.spawn``): each such process
    consumes the batches its own DataLoader workers pack into the shared arena."""
    return arena.creator == os.getpid() or get_worker_info() is None


def _attach(dupfd: Any, token: tuple[int, int, int], expected: Optional[tuple[int, str, int, str]] = None,
            dtypes: Optional[tuple[str, str]] = None, loaders: bool = True, numpy_tensors: bool = False) -> Arena:
    existing = _ARENAS.get(token)
    fd = dupfd.detach()
    try:
        if existing is not None:
            return existing
        arena = Arena(_engine_arena=_engine.arena_attach(fd), _token=token, _dtypes_of=dtypes)
        arena._expected = expected
        arena._loaders, arena._numpy_tensors = bool(loaders), bool(numpy_tensors)
        return arena
    finally:
        os.close(fd)


class PackedBatch:
    """One collated batch packed into an arena region: what a worker sends to the main process.

    Use :meth:`unpack` (or ``mtc_loader.start_copy(batch, device)``, or
    :class:`~mtc_loader.PrefetchLoader`) to get the structure the wrapped collate function made,
    with its tensors on a device. A batch is consumed once; an unconsumed batch frees its region
    when it is garbage collected in the main process.
    """

    __slots__ = ("_arena", "_off", "_nbytes", "_owner", "_layout", "_skeleton", "_atoms", "_state", "_moved",
                 "__weakref__")

    def __init__(self, arena: Arena, off: int, nbytes: int, owner: int, layout: bytes, skeleton: Any,
                 state: Optional[str] = None, atoms: Optional[tuple[Any, ...]] = None):
        self._arena, self._off, self._nbytes, self._owner = arena, off, nbytes, owner
        # skeleton: the structure with LEAF in each tensor's place; with atoms (a structure that
        # batches may share, _SharedSkeleton), ATOM in each passthrough atom's place, or its walk
        self._layout, self._skeleton, self._atoms = layout, skeleton, atoms
        self._moved: Optional[tuple[int, Any]] = None  # (target index, structure) after to()
        # held: this process's to unpack, and to free if dropped (the arena's creator, or a
        # region adopted on arrival); own: packed here by a process that is not the creator
        # nor a DataLoader worker (a rank with num_workers=0, or a forked packer that may send
        # it): unpackable here, never freed on drop (it may have been sent); sent: not here
        if state is None:
            state = "held" if owner == os.getpid() and arena.creator == owner else "sent"
        self._state = state

    def __reduce__(self) -> tuple[Any, ...]:
        if self._state in ("held", "consumed"):
            # this process frees its region (or did): a copy would unpack or free it a second time
            # (copy.copy, copy.deepcopy and pickle all come here)
            raise RuntimeError(_NOT_COPIED)
        skeleton = self._skeleton if self._atoms is None else _SharedSkeleton(self._skeleton)
        return (_rebuild_batch, (self._arena.token, self._off, self._nbytes, self._owner,
                                 self._layout, skeleton, self._atoms))

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data (with alignment padding) in the region."""
        return self._nbytes

    def __getitem__(self, key: Any) -> Any:
        # (also what a for loop over the batch, or unpacking it, reaches)
        raise TypeError("mtc_loader: a PackedBatch is the batch packed for the trip from the worker, not "
                        f"its structure: {self._arena._unpack_hint}")

    def pin_memory(self, device: Any = None) -> "PackedBatch":
        """The arena is page-locked already: ``DataLoader(pin_memory=True)`` does no work here."""
        return self

    def _take(self) -> Any:
        if self._state == "consumed":
            raise RuntimeError("mtc_loader: this PackedBatch was already unpacked (a batch is consumed once)")
        if self._state == "sent":
            raise RuntimeError("mtc_loader: this PackedBatch is unpacked by the process it is sent to (the one "
                               "that iterates the DataLoader), not in a DataLoader worker")
        self._state = "consumed"
        return self._arena._a

    def start_copy(self, device: Any, *, use_background_thread: bool = True, use_pinned_staging: bool = True,
                   pack_cpu_tensors: bool = True, min_packed_alignment_bytes: int = 16,
                   max_packed_chunk_bytes: int = 33554432) -> AsyncCopyHandle:
        """Start the copy of the batch to ``device``: one DMA per dtype from the arena for a CUDA target (no
        host copy), one memcpy out of the arena for ``"cpu"``. Returns an AsyncCopyHandle.

        Takes :func:`~mtc_loader.start_copy`'s keywords; only ``use_background_thread`` applies
        (the batch is packed, in pinned memory, already), and any other keyword is a TypeError.
        The packing options are checked as start_copy checks them (before the batch is consumed)."""
        target = target_index(device)
        positive_int("min_packed_alignment_bytes", min_packed_alignment_bytes)
        positive_int("max_packed_chunk_bytes", max_packed_chunk_bytes)
        return AsyncCopyHandle(self._start(target, bool(use_background_thread)))

    def _start(self, target: int, background: bool) -> Any:
        """The engine's handle of the unpack to the target index (the prefetch service's path)."""
        a = self._take()
        try:
            self._arena._check_dtypes("unpacks")
        except RuntimeError:
            a.release(self._off, os.getpid())  # consumed: nobody else frees the region
            raise
        return _engine.unpack(a, self._off, self._nbytes, os.getpid(), self._layout, self._skeleton,
                              target, background, self._atoms)

    def unpack(self, device: Any = "cpu", *, numpy_to_tensors: bool = False) -> Any:
        """The batch's structure with its tensors on ``device`` (blocking); its numpy arrays stay
        numpy arrays on the host unless ``numpy_to_tensors`` (see :meth:`to`)."""
        return _numpy_converted(self.start_copy(device).get(), device, numpy_to_tensors)

    def to(self, device: Any, non_blocking: bool = False, *, numpy_to_tensors: bool = False, **ignored: Any) -> Any:
        """The batch's structure with its tensors on ``device``, as ``tensor.to(device)`` would
        move one tensor: what Lightning (``move_data_to_device``) and accelerate
        (``send_to_device``) call on any batch object that has a ``to`` method, so that a
        ``PackedCollate`` batch moves inside their loops with no other change.

        The first call unpacks the batch (:meth:`unpack`: one DMA per dtype from the page-locked arena
        for a CUDA device, no host copy). The batch remembers the result: a second ``to`` with
        the same device returns the same structure (a framework that moves a batch twice costs
        nothing), and one with another device copies that structure there with
        :func:`~mtc_loader.start_copy`'s defaults.

        Args:
            device: Target device (``"cuda"``, ``"cuda:N"``, ``torch.device``, ``"cpu"``).
            non_blocking: Accepted for compatibility and not needed: the result is ready in
                order on the current CUDA stream, as after ``tensor.to(device,
                non_blocking=True)`` from pinned memory, and the source is the arena region,
                which the engine keeps until its DMA has completed (so no host buffer can be
                reused under the copy, the hazard ``non_blocking=False`` protects against).
                Kernels queued on the current stream, and any read from the host
                (``.item()``, ``.cpu()``), see the data; another stream must wait for the
                current one, as for any tensor.
            numpy_to_tensors: Whether numpy arrays come as tensors on ``device``. By default the
                structure is what the collate function made with only its tensors moved: numpy
                arrays stay numpy arrays on the host, bitwise as the collate made them (they
                travel pickled, as through a plain DataLoader). With ``True`` numeric numpy arrays
                become tensors on ``device``, as :func:`~mtc_loader.start_copy` converts them
                (:class:`~mtc_loader.PrefetchLoader` takes the same keyword).
            **ignored: Other keywords of ``Tensor.to`` (``copy``, ``memory_format``) are
                ignored; a ``dtype`` raises ``TypeError`` (the batch keeps its dtypes).

        Raises:
            RuntimeError: When the batch was consumed by :meth:`unpack` or :meth:`start_copy`,
                or lives in another process (see :meth:`unpack`).
        """
        if ignored.get("dtype") is not None or isinstance(device, torch.dtype) \
                or isinstance(non_blocking, torch.dtype):
            raise TypeError("mtc_loader: PackedBatch.to moves a batch to a device and keeps its "
                            "dtypes; convert the tensors after the move")
        if not isinstance(numpy_to_tensors, bool):
            raise TypeError(f"mtc_loader: numpy_to_tensors must be True or False, got {numpy_to_tensors!r}")
        index = target_index(device)
        if self._moved is not None:
            moved_index, out = self._moved
            if moved_index == index:
                return _numpy_converted(out, device, numpy_to_tensors)
            h = _engine.start_copy(out, index, True, True, 16, 33554432, True, not numpy_to_tensors)
            return AsyncCopyHandle(h).get()
        out = self.start_copy(device).get()
        self._moved = (index, out)
        return _numpy_converted(out, device, numpy_to_tensors)

    def __del__(self) -> None:
        if getattr(self, "_state", None) == "held":
            try:
                self._arena._a.release(self._off, os.getpid())
            except Exception:  # interpreter shutdown: the arena is going away anyway
                pass

    def __repr__(self) -> str:
        return f"<PackedBatch {self._nbytes} bytes at {self._off} ({self._state})>"


def _numpy_converted(out: Any, device: Any, numpy_to_tensors: bool) -> Any:
    """``out`` (an unpacked batch, its numpy arrays kept as the collate made them), or with
    ``numpy_to_tensors`` the same structure with its numeric numpy arrays as tensors on ``device``
    (its tensors, on ``device`` already, are kept as they are)."""
    if not numpy_to_tensors:
        return out
    return AsyncCopyHandle(_engine.start_copy(out, target_index(device), True, True, 16, 33554432, True)).get()


class _SharedSkeleton:
    """The structure of a batch that holds only plain lists, tuples and dicts with atoms (str, int,
    float, bool, None, bytes) as keys and passthrough leaves: LEAF in each tensor's place, ATOM in
    each passthrough atom's (the atoms travel beside it, in the batch's ``_atoms``). Batches of one
    dataset mostly share their structure: only the tensors' shapes (in the layout) and the atoms
    (file names, sample tokens) differ. It crosses the process boundary as its pickle, and the
    receiving process keeps one walk of it per distinct structure (:func:`_skeleton_of`), so the
    structure is neither unpickled nor walked per batch."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __reduce__(self) -> tuple[Any, ...]:
        return (_skeleton_of, (pickle.dumps(self.obj, protocol=pickle.HIGHEST_PROTOCOL),))


# The receiving process's walked skeletons, by their pickle. Bounded: a dataset whose structure
# varies from batch to batch (a list of variable length at the top) starts over when it is full.
_SKELETONS: dict[bytes, Any] = {}
_MAX_SKELETONS = 64


def _skeleton_of(blob: bytes) -> Any:
    """The walk (``_engine.skeleton``) of the skeleton pickled in ``blob``, made the first time
    this structure arrives. A blob that does not hold plain containers and atoms is refused
    (ValueError: a corrupt or forged descriptor)."""
    sk = _SKELETONS.get(blob)
    if sk is None:
        sk = _engine.skeleton(pickle.loads(blob))
        if len(_SKELETONS) >= _MAX_SKELETONS:
            _SKELETONS.clear()
        _SKELETONS[blob] = sk
    return sk


_NOT_COPIED = ("mtc_loader: a PackedBatch cannot be copied or pickled within the process that holds its "
               "region (it is consumed once): copy the structure it unpacks to instead "
               "(copy.deepcopy(batch.to(device)))")


def _rebuild_batch(token: tuple[int, int, int], off: int, nbytes: int, owner: int, layout: bytes,
                   skeleton: Any, atoms: Optional[tuple[Any, ...]] = None) -> PackedBatch:
    arena = _ARENAS.get(token)
    if arena is None:
        raise RuntimeError("mtc_loader: a PackedBatch arrived in a process that does not hold its arena")
    if owner == os.getpid():
        raise RuntimeError(_NOT_COPIED)
    if _consumes(arena):
        # the consuming process takes the region over from the worker that filled it, so that
        # the worker's death cannot free it any more
        owner = arena._a.adopt(off, owner)
        return PackedBatch(arena, off, nbytes, owner, layout, skeleton, "held", atoms)
    return PackedBatch(arena, off, nbytes, owner, layout, skeleton, "sent", atoms)


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
            raise _tree._same_kind(e, (
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
        self.arena._check_dtypes("packs")
        consumer = _consumer()
        with stacking_into_scratch(self):
            try:
                batch = self.collate_fn(samples)
            except RaggedStack as e:
                raise RuntimeError(_ragged_message(samples, e, self.collate_fn is default_collate)) from None
            try:
                off, nbytes, layout, skeleton, atoms = _engine.pack(self.arena._a, batch, self.align,
                                                                       self.timeout, consumer,
                                                                       self.arena._in_flight(),
                                                                       self.arena._numpy_tensors)
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
                    self.arena._a.release(off, os.getpid())
                    raise
            del batch
        me = os.getpid()
        try:
            warn_escaped()
        except BaseException:  # the warning made an error (-W error): the region goes with it
            self.arena._a.release(off, me)
            raise
        state = "held" if self.arena.creator == me else "own" if get_worker_info() is None else "sent"
        return PackedBatch(self.arena, off, nbytes, me, layout, skeleton, state, atoms)

    def stats(self) -> dict[str, int]:
        """The arena's counters, and ``scratch_retired``: the stacked tensors of this process that
        outlived their batch (see the class's docstring; 0 on the fast path)."""
        out = self.arena.stats()
        out["scratch_retired"] = RETIRED[0]
        return out
