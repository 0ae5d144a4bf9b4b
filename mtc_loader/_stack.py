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
memory is reused by the next call on the same thread. Outside a ``PackedCollate`` call (or for
tensors it cannot stack that way: mixed dtypes, which ``torch.stack`` promotes; tensors that
require grad; nested, sparse, quantized, non-contiguous or non-CPU tensors; subclasses) the
original function runs unchanged.

Registered in ``default_collate_fn_map`` (torch's documented way to extend ``default_collate``)
on import, like FileTensor's collate (files.py), in place of torch's own ``collate_tensor_fn``
only: a program that put its own function there keeps it, inside PackedCollate too.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import torch

__all__: list[str] = []

_ALIGN = 64  # every stacked tensor starts on a cache line
_MIN_BUFFER = 1 << 20


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

    def end(self) -> None:
        self.peak = max(self.peak, self.taken)

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

    def __exit__(self, *exc: Any) -> None:
        if self.outer is None:
            _TLS.active.end()
            _TLS.active = None


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
    if default_collate_fn_map.get(torch.Tensor) is collate_tensor_fn:
        default_collate_fn_map[torch.Tensor] = _wrap(collate_tensor_fn)


_register()
