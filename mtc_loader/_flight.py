"""How many packed batches a PrefetchLoader over a DataLoader keeps in flight, and how many the
arena must hold for the DataLoader to go on at all: told to the arena its
:class:`~mtc_loader.PackedCollate` packs into.

A batch holds its arena region from the moment a worker packs it until its copy has read it.
A DataLoader with workers has at most ``num_workers * prefetch_factor`` batches out at once
(indices sent, batch not yet handed out), all of which may be packed: in the workers, in the
pipe, or in the DataLoader's own hands (it hands batches out in order, and keeps those that
arrive ahead of the one it waits for). The PrefetchLoader's thread holds the batch it copies;
for a CUDA device, the ``depth`` batches it keeps ready may still be read by their DMAs (a region
is freed when its DMA completes; for the CPU, the copy out of the arena is done before the batch
is ready). So the loader runs without waiting for room when the arena holds
``num_workers * prefetch_factor + 1`` batches (+ ``depth`` for a CUDA device).

With less room, workers wait for room (backpressure), which is fine as long as the batch the
DataLoader hands out next can still be packed. Its worker has packed all of its earlier ones
(they were handed out), and the DataLoader sends indices to the workers in turn, so the other
``num_workers - 1`` workers hold at most ``prefetch_factor`` batches each ahead of it; the
copies free their regions by themselves. An arena that holds fewer than
``(num_workers - 1) * prefetch_factor + 1`` batches can leave every worker waiting for room that
only that next batch would free: a stall until the worker's timeout. The first batch each process
packs is checked against that (``_engine.pack``) and refused at once, with the number of bytes
that holds the whole flight. (A DataLoader with ``in_order=False`` hands batches out as they come:
one batch of room always lets it go on.)
"""
from __future__ import annotations

import functools
import os
import sys
import types
from typing import Any, Optional

import torch

from ._arena import Arena, expect, has_loaders_word, set_word_at_start, withdraw_word

__all__: list[str] = []


def _arena_of(collate_fn: Any) -> Optional[Arena]:
    """The arena a DataLoader's collate function packs into (a PackedCollate, or any collate
    function with an ``arena``, inside ``functools.partial`` as mmengine builds it), or None."""
    while isinstance(collate_fn, functools.partial):
        collate_fn = collate_fn.func
    arena = getattr(collate_fn, "arena", None)
    return arena if isinstance(arena, Arena) else None


def in_flight(num_workers: int, prefetch_factor: Optional[int], depth: int, cuda: bool,
              in_order: bool = True, consumer: str = "1 the PrefetchLoader copies") -> tuple[int, str, int, str]:
    """``(batches in flight, what they are, the least the arena must hold, what they are)`` for a
    PrefetchLoader of ``depth`` over a DataLoader, on a CUDA device or the CPU (``consumer``: the
    batch the consumer holds, a PrefetchLoader's or a plain loop's)."""
    parts = []
    batches = least = 1
    least_why = "the batch being packed"
    if num_workers:
        factor = 2 if prefetch_factor is None else prefetch_factor
        batches += num_workers * factor
        parts.append(f"{num_workers} workers x prefetch_factor {factor} in the DataLoader")
        if in_order and num_workers > 1:
            least += (num_workers - 1) * factor
            others = "the other worker" if num_workers == 2 else f"each of the {num_workers - 1} other workers"
            least_why = (f"the batch it hands out next, and up to {factor} packed ahead of it by {others}, "
                         "since it hands batches out in order")
    parts.append(consumer)
    if cuda:
        batches += depth
        parts.append(f"{depth} ready (the PrefetchLoader depth), whose copies to the GPU may still read the arena")
    return batches, ", ".join(parts), least, least_why


Told = Optional[tuple[Arena, tuple[int, str, int, str]]]


def expect_in_flight(iterable: Any, depth: int, cuda: bool, numpy_tensors: bool = False) -> Told:
    """Tells the arena of a DataLoader over PackedCollate (or of mmengine's endless iterator over
    one) what a PrefetchLoader of ``depth`` over it keeps in flight; does nothing for any other
    iterable. Call it before the DataLoader's workers start (they take the word with the arena).
    Returns what :func:`withdraw` takes back at the end of the epoch."""
    loader = iterable
    if not isinstance(loader, torch.utils.data.DataLoader):
        loader = getattr(iterable, "_dataloader", None)  # mmengine's _InfiniteDataloaderIterator
    if not isinstance(loader, torch.utils.data.DataLoader):
        return None
    arena = _arena_of(loader.collate_fn)
    if arena is None:
        return None
    word = in_flight(loader.num_workers, loader.prefetch_factor, depth, cuda, bool(getattr(loader, "in_order", True)))
    expect(arena, word, True, numpy_tensors)
    return arena, word


def withdraw(told: Told) -> None:
    """The epoch is over: the arena no longer has this loader's word (workers started later, for
    a loop without a PrefetchLoader, count as they would without it), unless another loader's
    word has replaced it meanwhile."""
    if told is not None:
        withdraw_word(*told)


_STARTING = getattr(getattr(torch.utils.data, "dataloader", None), "_MultiProcessingDataLoaderIter", None)


def word_at_start(arena: Optional[Arena]) -> None:
    """Where a DataLoader iterator is starting its workers (its ``__init__`` on this thread's
    stack: before a fork, or while the arena is pickled for a spawn or forkserver child), tells
    the arena of its PackedCollate what it keeps in flight, unless a PrefetchLoader has said so:
    its workers then refuse an arena too small for it at their first batch, as under a
    PrefetchLoader, rather than stall in a plain loop (``for batch in loader: batch.to(device)``).
    ``arena``: the one being pickled (None before a fork: the iterator's)."""
    code = getattr(getattr(_STARTING, "__init__", None), "__code__", None)
    f: Optional[types.FrameType] = sys._getframe(1)
    while f is not None and f.f_code is not code:
        f = f.f_back
    if f is None:
        return
    it = f.f_locals.get("self")
    found = _arena_of(getattr(it, "_collate_fn", None))
    if found is None or (arena is not None and found is not arena) or has_loaders_word(found):
        return
    word = in_flight(it._num_workers, it._prefetch_factor, 0, False,  # type: ignore[union-attr]
                     bool(getattr(it, "_in_order", True)), "1 the loop unpacks")
    expect(found, word, False)


set_word_at_start(word_at_start)
os.register_at_fork(before=lambda: word_at_start(None))
