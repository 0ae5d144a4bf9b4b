"""``start_copy`` and ``AsyncCopyHandle``: the explicit API (docs/copies.md describes it)."""
from __future__ import annotations

from typing import Any, Union

import torch

from . import _engine
from ._device import target_index
from ._options import positive_int
from ._packed import PackedBatch
from .handle import AsyncCopyHandle

__all__ = ["AsyncCopyHandle", "start_copy"]


def start_copy(
    data: Any,
    device: Union[str, torch.device],
    *,
    use_pinned_staging: bool = True,
    pack_cpu_tensors: bool = True,
    min_packed_alignment_bytes: int = 16,
    max_packed_chunk_bytes: int = 33554432,
    use_background_thread: bool = True,
) -> AsyncCopyHandle:
    """Asynchronously copy tensors in a nested structure to ``device``.

    Traverses an arbitrarily nested combination of ``list``, ``tuple`` and ``dict`` containers,
    copies every ``torch.Tensor`` and ``numpy.ndarray`` (automatically converted to PyTorch
    tensors) leaf to ``device``, and returns an :class:`AsyncCopyHandle` whose
    :meth:`~AsyncCopyHandle.get` method yields the copied structure. The output preserves
    container types and passes through non-tensor, non-container leaves (e.g. strings)
    unchanged (the same objects).

    mtc_loader also traverses namedtuples, ``OrderedDict`` / ``defaultdict`` and other
    list/tuple/dict subclasses, and dataclass instances, rebuilding each as the same type.

    The primary optimization target is CPU → GPU transfers of many small tensors in non-pinned
    memory. Other copy directions (GPU → CPU, GPU → GPU, CPU → CPU) are supported.

    Note:
        The input tensors do not need to all be on the same device. If some tensors are
        already on the target device, they are re-used as is (the same objects). At the time
        of the call, the current CUDA stream of every involved device is captured; all copy
        work is enqueued on, or made to wait for, those streams.

    Important:
        Packing of small tensors (``pack_cpu_tensors``) is the major optimization against
        per-tensor ``.to()`` calls. Non-contiguous small CPU tensors are packed too (gathered
        by the staging copy).

    Warning:
        The caller must not free or modify in-place any input tensors until the copy has
        completed (i.e. until ``get()`` returns or ``ready()`` returns ``True``).

    Outputs are new tensors that do not require grad (``requires_grad=False``, no autograd
    history), like the outputs of a DataLoader; a tensor already on ``device`` is returned as
    is and keeps its flags. Numeric and bool numpy leaves come back as tensors; for a CPU target
    they share memory with the array (as ``torch.from_numpy``) unless the array is read-only or
    has negative or unaligned strides, in which case they are copied. Arrays no tensor can hold
    (strings, bytes, objects, records, datetimes) are passed through as the same objects, as
    strings are.

    Args:
        data: The structure to copy: a single ``torch.Tensor`` or ``numpy.ndarray``, or nested
            ``list`` / ``tuple`` / ``dict`` objects, namedtuples, dataclass instances or
            registered containers holding them; any other object is passed through (hence
            ``Any``).
        device: Target PyTorch device (e.g. ``"cuda:0"``, ``"cpu"``).
        use_pinned_staging: Stage CPU → CUDA copies through pinned (page-locked) buffers of
            the engine's slab allocator, so that the DMA is asynchronous; for CUDA → CPU the
            pinned buffer is the returned output. No effect on CPU → CPU or GPU → GPU copies.
        pack_cpu_tensors: Pack small (≤ 256 KB) CPU tensors, mixed dtypes, into chunks of at
            most ``max_packed_chunk_bytes`` and issue one H2D copy per chunk instead of one per
            tensor; for CUDA → CPU with pinned staging, small GPU tensors are likewise copied
            into one pinned chunk.
        min_packed_alignment_bytes: Minimum byte alignment of each packed tensor's start
            within its storage (one per dtype of a chunk): ``t.data_ptr() -
            t.untyped_storage().data_ptr()`` is a multiple of ``round_up(max(
            min_packed_alignment_bytes, element_size), element_size)`` (the reference
            implementation's rule): ``max(...)`` for powers of two; 8 for 6 and float32, 16 for
            6 and complex128, 6 for 6 and uint8. The address ``t.data_ptr()`` is a multiple of
            that alignment too where the allocator's alignment is (64 bytes on the CPU, 512 on
            a GPU, with torch's allocators), and of the element size always.
        max_packed_chunk_bytes: Maximum payload of each packed chunk (data plus alignment
            padding); the chunk's allocation is its payload.
        use_background_thread: Run the copy (staging, allocation of pinned memory, copy
            submission) on the engine's per-device transfer thread, so that this function
            returns before the copies complete. When ``False``, the same work runs on the
            calling thread (with the GIL released) before this function returns.

    Returns:
        AsyncCopyHandle: Call ``get()`` to block until completion and retrieve the result, or
            ``ready()`` to poll without blocking.

    Raises:
        ValueError / TypeError: For invalid arguments, or a leaf that cannot be copied (the
            message names it by its path, e.g. ``data[3]['cams_gt'][2]``).
        RuntimeError: If the copy fails (raised by ``get()``).

    Examples:
        >>> data = [torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6])]
        >>> handle = start_copy(data, "cuda:0")  # doctest: +SKIP
        >>> result = handle.get()                # doctest: +SKIP

        >>> data = [np.array([1, 2, 3]), np.array([4, 5, 6])]
        >>> start_copy(data, "cpu").get()
        [tensor([1, 2, 3]), tensor([4, 5, 6])]
    """
    return start_copy_keeping(data, device, False, use_pinned_staging=use_pinned_staging,
                       pack_cpu_tensors=pack_cpu_tensors, min_packed_alignment_bytes=min_packed_alignment_bytes,
                       max_packed_chunk_bytes=max_packed_chunk_bytes, use_background_thread=use_background_thread)


def start_copy_keeping(data: Any, device: Union[str, torch.device], keep_numpy: bool, *,
                       use_pinned_staging: bool = True, pack_cpu_tensors: bool = True,
                       min_packed_alignment_bytes: int = 16, max_packed_chunk_bytes: int = 33554432,
                       use_background_thread: bool = True) -> AsyncCopyHandle:
    """:func:`start_copy`; ``keep_numpy``: numpy arrays stay the same objects on the host (what a
    :class:`~mtc_loader.PrefetchLoader` does, so that a batch keeps the types its collate made)."""
    target = target_index(device)
    align = positive_int("min_packed_alignment_bytes", min_packed_alignment_bytes)
    max_chunk = positive_int("max_packed_chunk_bytes", max_packed_chunk_bytes)
    if isinstance(data, PackedBatch):  # checked alike: the batch is packed already
        return data.start_copy(device, use_background_thread=use_background_thread)
    h = _engine.start_copy(data, target, bool(use_pinned_staging), bool(pack_cpu_tensors),
                           align, max_chunk, bool(use_background_thread), bool(keep_numpy))
    return AsyncCopyHandle(h)
