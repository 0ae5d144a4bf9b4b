"""Warm memory for the tensors that ``default_collate`` stacks while a ``PackedCollate`` runs.

Inside a DataLoader worker, torch's ``default_collate`` stacks each group of sample tensors into
a **new shared-memory segment** (so that the stacked tensor can cross to the main process by
file descriptor). Under :class:`~mtc_loader.PackedCollate` that segment is pure cost: the
batch is copied into the arena right after, and the segment is dropped. Its pages are new on
every batch, so the stack pays a page fault and the kernel's zeroing for every 4 KiB (in
bench/bench_train.py's GPU-bound loop, 66 MB of images per batch, this was most of the wait for
an epoch's first batch: docs/benchmarks.md).

While a ``PackedCollate`` call runs on a thread, the tensors that ``default_collate`` (or any
collate function that goes through ``default_collate_fn_map``, as a user's function that calls
``default_collate`` on parts of a sample does) stacks are written into this thread's
:class:`_Scratch` instead: a few CPU buffers kept from one batch to the next, bump-allocated
per call, so after the first batch their pages are warm. The stacked tensors are views of that
memory: they are valid until the batch is packed, which is all ``PackedCollate`` needs, and the
memory is reused by the next call on the same thread.

A stacked tensor can outlive its batch: inside an object the packer does not open (a user's class
around a ``default_collate`` result travels in the batch's skeleton, pickled whole, and pickling
a CPU tensor moves its storage into shared memory in place), or kept by the ``collate_fn`` (a
cache, a global). So when a call ends, each buffer's storage is checked for references other than
the scratch's own; a buffer still referenced is **retired**: the scratch drops it (whoever holds
the views keeps that memory) and the next call stacks into a fresh buffer. Nothing a user holds
ever aliases memory that is reused. A retirement is the slow path (fresh pages on the next call,
and the pickling of the whole buffer): it is counted (``PackedCollate.stats()["scratch_retired"]``)
and warned about once per process. Outside a ``PackedCollate`` call (or for
tensors it cannot stack that way: mixed dtypes, which ``torch.stack`` promotes; tensors that
require grad; nested, sparse, quantized, non-contiguous or non-CPU tensors; subclasses) the
original function runs unchanged.

Registered in ``default_collate_fn_map`` (torch's documented way to extend ``default_collate``)
on import, like FileTensor's collate (files.py), in place of torch's own ``collate_tensor_fn``
only: a program that put its own function there keeps it, inside PackedCollate too.
"""
from __future__ import annotations

import threading
import warnings
from typing import Any, Callable, Optional

import torch

__all__: list[str] = []

_ALIGN = 64  # every stacked tensor starts on a cache line
_MIN_BUFFER = 1 << 20

# torch's count of the references to a storage (c10's intrusive use count); where this torch lacks
# it, nothing is stacked into scratch (_register)
_use_count: Optional[Callable[[int], int]] = getattr(torch._C, "_storage_Use_Count", None)

# buffers retired in this process (still referenced after their call), and whether it was said
RETIRED = [0]
_WARNED = [False]


def _storage_uses(t: torch.Tensor) -> int:
    assert _use_count is not None  # (_register)
    return _use_count(t.untyped_storage()._cdata)


# what a tensor that nothing else refers to counts (itself, and the storage object made to ask)
_UNSHARED = _storage_uses(torch.empty(1, dtype=torch.uint8)) if _use_count is not None else 0


def _referenced_elsewhere(buf: torch.Tensor) -> bool:
    """Whether anything but ``buf`` itself holds ``buf``'s storage (a view made by a stack, or a
    numpy array over one)."""
    return _storage_uses(buf) > _UNSHARED


class _Scratch:
    """Bump allocation over CPU uint8 buffers, reset per PackedCollate call. A call that needed
    more than the buffers hold adds a buffer; the next call then finds one buffer as large as
    everything the previous call took (so the steady state is one buffer, the high-water mark of
    one batch's stacked tensors)."""

    __slots__ = ("buffers", "index", "offset", "taken", "peak")

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.index = self.offset = self.taken = self.peak = 0

    def begin(self) -> None:
        if len(self.buffers) > 1 or (self.buffers and self.buffers[0].numel() < self.peak):
            self.buffers = [torch.empty(self.peak, dtype=torch.uint8)]
        self.index = self.offset = self.taken = 0

    def end(self, failed: bool = False) -> None:
        """Ends a call: retires the buffers that something outside still references (their
        views escaped the batch), so that the next call never writes into memory a user holds.
        ``failed``: the call raised (its traceback's frames may hold stacked tensors): counted,
        not warned about."""
        self.peak = max(self.peak, self.taken)
        kept = [buf for buf in self.buffers if not _referenced_elsewhere(buf)]
        retired = len(self.buffers) - len(kept)
        if retired:
            self.buffers = kept
            self.index = len(kept)  # (nothing takes before the next begin())
            _retired(retired, warn=not failed)

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 view of ``nbytes`` bytes, aligned to a cache line."""
        size = -(-nbytes // _ALIGN) * _ALIGN
        self.taken += size
        while self.index < len(self.buffers):
            buf = self.buffers[self.index]
            if self.offset + size <= buf.numel():
                view = buf[self.offset:self.offset + nbytes]
                self.offset += size
                return view
            self.index, self.offset = self.index + 1, 0
        buf = torch.empty(max(size, _MIN_BUFFER), dtype=torch.uint8)
        self.buffers.append(buf)
        self.index, self.offset = len(self.buffers) - 1, size
        return buf[:nbytes]


def _retired(n: int, warn: bool) -> None:
    RETIRED[0] += n
    if warn and not _WARNED[0]:
        _TLS.warn = True  # said by warn_escaped(), once the caller's batch is safe


def warn_escaped() -> None:
    """Emits the once-per-process warning about a retired buffer, if one is due on this thread.
    Called by PackedCollate after its batch is packed and accounted for, so that a warning turned
    into an error (``-W error``) leaks nothing."""
    if not getattr(_TLS, "warn", False):
        return
    _TLS.warn = False
    if _WARNED[0]:
        return
    _WARNED[0] = True
    warnings.warn(
        "mtc_loader: a tensor that default_collate stacked inside a PackedCollate call is still "
        "referenced after the batch was packed: inside an object PackedCollate does not open (a "
        "class of yours around a default_collate result; it travels pickled in the batch's "
        "skeleton, not through the arena), or kept by the collate_fn. It keeps its own memory, "
        "and this process stacks the next batch into fresh memory (slower: see "
        "PackedCollate.stats()['scratch_retired']). Return such data in lists, tuples, dicts or "
        "dataclasses, or register its class with mtc_loader.register_container, to keep the "
        "fast path.", RuntimeWarning, stacklevel=3)


_TLS = threading.local()


class stacking_into_scratch:
    """Context manager: while it is active on this thread, default_collate stacks into the
    thread's scratch memory (see the module's docstring)."""

    __slots__ = ("outer",)

    def __enter__(self) -> None:
        self.outer = getattr(_TLS, "active", None)
        if self.outer is not None:  # a PackedCollate inside a collate_fn: share the outer call's memory
            return
        scratch = getattr(_TLS, "scratch", None)
        if scratch is None:
            scratch = _TLS.scratch = _Scratch()
        scratch.begin()
        _TLS.active = scratch

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if self.outer is None:
            scratch, _TLS.active = _TLS.active, None
            scratch.end(failed=exc_type is not None)


def _stackable(batch: Any) -> bool:
    elem = batch[0]
    if type(elem) is not torch.Tensor or elem.is_nested or elem.layout != torch.strided \
            or elem.device.type != "cpu" or elem.is_quantized or not elem.is_contiguous():
        return False  # (torch.stack keeps a channels_last layout, which out= would not)
    dtype, shape = elem.dtype, elem.shape
    for t in batch:
        if type(t) is not torch.Tensor or t.is_nested or t.dtype != dtype or t.shape != shape \
                or t.requires_grad or t.device.type != "cpu":
            return False  # the original function stacks (or refuses) these as it always has
    return True


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    def collate_tensor_into_scratch(batch: Any, *, collate_fn_map: Optional[dict[Any, Any]] = None) -> Any:
        scratch = getattr(_TLS, "active", None)
        if scratch is None or not _stackable(batch):
            return original(batch, collate_fn_map=collate_fn_map)
        elem = batch[0]
        nbytes = len(batch) * elem.numel() * elem.element_size()
        out = scratch.take(nbytes).view(elem.dtype).view(len(batch), *elem.shape)
        return torch.stack(batch, 0, out=out)

    collate_tensor_into_scratch._mtc_original = original  # type: ignore[attr-defined]
    return collate_tensor_into_scratch


def _register() -> None:
    """Wraps torch's own tensor collate in default_collate_fn_map; an entry a program put there
    itself is left alone (PackedCollate then stacks with it, as default_collate would)."""
    try:
        from torch.utils.data._utils.collate import collate_tensor_fn, default_collate_fn_map
    except ImportError:  # older torch: no registry; default_collate stacks as it always has
        return
    if _use_count is None:  # no way to tell whether a stacked tensor outlived its batch
        return
    if default_collate_fn_map.get(torch.Tensor) is collate_tensor_fn:
        default_collate_fn_map[torch.Tensor] = _wrap(collate_tensor_fn)


_register()
