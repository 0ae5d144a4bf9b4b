"""One collated batch packed into an arena region (:class:`PackedBatch`): what a DataLoader
worker sends to the main process, and how it is unpacked there.
"""
from __future__ import annotations

import os
import pickle
from typing import Any, Optional

import torch

from . import _engine
from ._arena import ARENAS, Arena, check_dtypes, consumes, engine_arena, unpack_hint
from ._device import target_index
from ._options import positive_int
from .handle import AsyncCopyHandle

__all__ = ["PackedBatch"]


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
                        f"its structure: {unpack_hint(self._arena)}")

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
        return engine_arena(self._arena)

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
            check_dtypes(self._arena, "unpacks")
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
                engine_arena(self._arena).release(self._off, os.getpid())
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
    arena = ARENAS.get(token)
    if arena is None:
        raise RuntimeError("mtc_loader: a PackedBatch arrived in a process that does not hold its arena")
    if owner == os.getpid():
        raise RuntimeError(_NOT_COPIED)
    if consumes(arena):
        # the consuming process takes the region over from the worker that filled it, so that
        # the worker's death cannot free it any more
        owner = engine_arena(arena).adopt(off, owner)
        return PackedBatch(arena, off, nbytes, owner, layout, skeleton, "held", atoms)
    return PackedBatch(arena, off, nbytes, owner, layout, skeleton, "sent", atoms)
