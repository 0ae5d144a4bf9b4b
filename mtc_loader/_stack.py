"""Warm memory for the tensors that ``default_collate`` stacks while a ``PackedCollate`` runs.

Inside a DataLoader worker, torch's ``default_collate`` stacks each group of sample tensors into
a **new shared-memory segment** (so that the stacked tensor can cross to the main process by
file descriptor). Under :class:`~mtc_loader.PackedCollate` that segment is pure cost: the
batch is copied into the arena right after, and the segment is dropped. Its pages are new on
every batch, so the stack pays a page fault and the kernel's zeroing for every 4 KiB.

While a ``PackedCollate`` call runs on a thread, the tensors that ``default_collate`` (or any
collate function that goes through ``default_collate_fn_map``, as a user's function that calls
``default_collate`` on parts of a sample does) stacks are written into blocks of this process's
:class:`_Pool` instead: after the first batch, the blocks a batch takes are those the previous
batch gave back, and their pages are warm.

**When a block is reused.** Each stacked tensor is its own block, handed to torch through a numpy
array that only that tensor's storage holds (``torch.from_numpy``: the storage keeps the array
and drops it when torch frees the storage). The block goes back to the pool when that array is
deallocated, and only then: a weak reference's callback on the array. Anything that can reach the
memory holds the storage (tensors and views of it, ``untyped_storage()`` objects, numpy arrays
made with ``.numpy()``, memoryviews of those, DLPack capsules, a C extension holding any of
them), and the storage holds the array, so a block is reused only once nothing references its
memory. A stacked tensor that outlives its batch (inside an object the packer does not open, or
kept by the ``collate_fn``) keeps its own block, and only that block: the next batch takes a
fresh one for it. Those are counted (``PackedCollate.stats()["scratch_retired"]``) and warned
about once per process. Outside a ``PackedCollate`` call (or for tensors it cannot stack that
way: mixed dtypes, which ``torch.stack`` promotes; tensors that require grad; nested, sparse,
quantized, non-contiguous or non-CPU tensors; subclasses) the original function runs unchanged.

**How much is kept.** The free blocks a process keeps are bounded by the most that one call
stacked; they are released when the last ``PackedCollate`` that stacked in this process is
garbage-collected, and by :func:`mtc_loader.trim`.

The hook is an entry in ``default_collate_fn_map`` (torch's documented way to extend
``default_collate``), in place of torch's own ``collate_tensor_fn`` only while a
``PackedCollate`` call runs in the process (the first call to start puts it there, the last to
end puts torch's back); other threads meanwhile get torch's function through it. A program that
put its own function there keeps it, inside PackedCollate too.
"""
from __future__ import annotations

import collections
import mmap
import os
import threading
import warnings
import weakref
from typing import Any, Callable, Optional

import numpy as np
import torch

__all__: list[str] = []

_ALIGN = 64  # every stacked tensor starts on a cache line
_SMALL = 4096  # blocks up to this size come in multiples of _ALIGN; larger ones in eighths of a power of two
_MAPPED = 256 << 10  # blocks from this size on are mappings of their own: freeing one returns its pages

# stacked tensors that outlived their batch in this process, and whether it was said
RETIRED = [0]
_WARNED = [False]


def size_class(nbytes: int) -> int:
    """The block size that serves a request of ``nbytes``: at most 12.5% more above 4 KiB, so
    that batches whose stacked tensors differ a little in size still find their blocks."""
    if nbytes <= _SMALL:
        return max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
    grain = 1 << (nbytes.bit_length() - 4)
    return -(-nbytes // grain) * grain


class _Pool:
    """This process's stacking blocks: free ones by size, and the ones handed out, each watched
    through a weak reference to the numpy array that only its tensor's storage holds."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.free: list[tuple[int, np.ndarray]] = []  # (size class, block), oldest first
        self.free_bytes = 0
        self.limit = 0  # the most one call stacked: what the free blocks may hold
        # the blocks handed out, by the id of the weak reference that watches each (it holds the
        # reference, so the id stays its own; a numpy array cannot key a weak reference's hash)
        self.out: dict[int, tuple[weakref.ref[np.ndarray], int, np.ndarray]] = {}
        # weak references whose array died: appended by the callback (any thread, maybe inside
        # a lock of ours: a deque's append needs none), drained under the lock
        self.returned: collections.deque[weakref.ref[np.ndarray]] = collections.deque()
        self.users = 0  # PackedCollate instances that stacked in this process and are alive
        self.allocated = 0  # blocks made (not taken from the free list): for the tests

    def _drain(self) -> None:
        while self.returned:
            entry = self.out.pop(id(self.returned.popleft()), None)
            if entry is None:  # handed out before a fork (the child's pool starts empty)
                continue
            self.free.append((entry[1], entry[2]))
            self.free_bytes += entry[1]
        while self.free_bytes > self.limit and self.free:
            cls, _ = self.free.pop(0)
            self.free_bytes -= cls

    def take(self, nbytes: int, call: "_Call") -> torch.Tensor:
        """A uint8 tensor of ``nbytes`` bytes over a block of its own, aligned to a cache line."""
        cls = size_class(nbytes)
        with self.lock:
            self._drain()
            block = None
            for i in range(len(self.free) - 1, -1, -1):
                if self.free[i][0] == cls:
                    block = self.free.pop(i)[1]
                    self.free_bytes -= cls
                    break
            if block is None:
                if cls >= _MAPPED:  # a private mapping, page-aligned: unmapped when the block goes
                    block = np.frombuffer(mmap.mmap(-1, cls, flags=mmap.MAP_PRIVATE), dtype=np.uint8)
                else:
                    block = np.empty(cls + _ALIGN, dtype=np.uint8)
                self.allocated += 1
            start = -block.ctypes.data % _ALIGN
            view = block[start:start + nbytes]  # the array only this tensor's storage will hold
            ref = weakref.ref(view, self.returned.append)
            self.out[id(ref)] = (ref, cls, block)
            call.refs.append(ref)
            call.taken += cls
        return torch.from_numpy(view)

    def end(self, call: "_Call") -> int:
        """Ends a call: the number of its blocks still referenced (their tensors outlived the batch)."""
        escaped = sum(1 for ref in call.refs if ref() is not None)
        with self.lock:
            self.limit = max(self.limit, call.taken)
            self._drain()
        return escaped

    def release(self) -> int:
        """Drops the free blocks; returns their bytes."""
        with self.lock:
            self._drain()
            freed = self.free_bytes
            self.free.clear()
            self.free_bytes = 0
            self.limit = 0
        return freed

    def user_gone(self) -> None:
        self.users -= 1
        if self.users <= 0:
            self.users = 0
            self.release()


_POOL = _Pool()
_USERS: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _reset_after_fork() -> None:
    """A forked child starts with an empty pool of its own (the parent's lock may have been held
    by another thread at the fork; blocks the parent handed out are not the child's to reuse)."""
    global _POOL, _USERS
    _POOL = _Pool()
    _USERS = weakref.WeakSet()


os.register_at_fork(after_in_child=_reset_after_fork)


def release() -> int:
    """Frees this process's idle stacking blocks (:func:`mtc_loader.trim`); returns the bytes."""
    return _POOL.release()


class _Call:
    """One PackedCollate call's blocks."""

    __slots__ = ("refs", "taken")

    def __init__(self) -> None:
        self.refs: list[weakref.ref[np.ndarray]] = []
        self.taken = 0


def _retired(n: int, warn: bool) -> None:
    RETIRED[0] += n
    if warn and not _WARNED[0]:
        _TLS.warn = True  # said by warn_escaped(), once the caller's batch is safe


def warn_escaped() -> None:
    """Emits the once-per-process warning about a stacked tensor that outlived its batch, if one is
    due on this thread. Called by PackedCollate after its batch is packed and accounted for, so
    that a warning turned into an error (``-W error``) leaks nothing."""
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
        "and this process stacks the next batch's tensor into fresh memory (slower: see "
        "PackedCollate.stats()['scratch_retired']). Return such data in lists, tuples, dicts or "
        "dataclasses, or register its class with mtc_loader.register_container, to keep the "
        "fast path.", RuntimeWarning, stacklevel=3)


_TLS = threading.local()


class stacking_into_scratch:
    """Context manager: while it is active on this thread, default_collate stacks into this
    process's pool of warm blocks (see the module's docstring). ``user`` is the PackedCollate
    that stacks: the free blocks are kept while one is alive."""

    __slots__ = ("outer", "user")

    def __init__(self, user: Any) -> None:
        self.user = user

    def __enter__(self) -> None:
        self.outer = getattr(_TLS, "active", None)
        if self.outer is not None:  # a PackedCollate inside a collate_fn: one call, the outer one
            return
        _install()
        pool = _POOL
        if self.user not in _USERS:
            _USERS.add(self.user)
            pool.users += 1
            weakref.finalize(self.user, pool.user_gone)
        _TLS.active = _Call()

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if self.outer is None:
            call, _TLS.active = _TLS.active, None
            _uninstall()
            escaped = _POOL.end(call)
            if escaped:
                _retired(escaped, warn=exc_type is None)


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


class RaggedStack(RuntimeError):
    """``default_collate`` was asked, inside a PackedCollate call, to stack sample tensors whose
    shapes differ (``torch.stack`` would refuse them; in a DataLoader worker torch's message is
    about a storage it cannot resize). PackedCollate turns it into the error that names where
    and what to do."""

    def __init__(self, first: int, other: int, shapes: tuple[list[int], list[int]]) -> None:
        super().__init__(f"mtc_loader: default_collate cannot stack tensors whose shapes differ: "
                         f"{shapes[0]} (entry {first}) and {shapes[1]} (entry {other})")
        self.entries = (first, other)
        self.shapes = shapes


def _check_same_shapes(batch: Any) -> None:
    """Raises RaggedStack when ``batch`` holds strided tensors of different shapes (anything else
    goes to torch's function, which stacks or refuses it as it always has)."""
    if not all(isinstance(t, torch.Tensor) and not t.is_nested and t.layout == torch.strided for t in batch):
        return
    shape = batch[0].shape
    for i, t in enumerate(batch):
        if t.shape != shape:
            raise RaggedStack(0, i, (list(shape), list(t.shape)))


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    def collate_tensor_into_scratch(batch: Any, *, collate_fn_map: Optional[dict[Any, Any]] = None) -> Any:
        call = getattr(_TLS, "active", None)
        if call is None:
            return original(batch, collate_fn_map=collate_fn_map)
        if not _stackable(batch):
            _check_same_shapes(batch)
            return original(batch, collate_fn_map=collate_fn_map)
        elem = batch[0]
        nbytes = len(batch) * elem.numel() * elem.element_size()
        out = _POOL.take(nbytes, call).view(elem.dtype).view(len(batch), *elem.shape)
        return torch.stack(batch, 0, out=out)

    collate_tensor_into_scratch._mtc_original = original  # type: ignore[attr-defined]
    return collate_tensor_into_scratch


# PackedCollate calls running in this process, and the wrapper they put in default_collate_fn_map
_HOOK_LOCK = threading.Lock()
_HOOK: dict[str, Any] = {"calls": 0, "wrapper": None}


def _install() -> None:
    """Puts the wrapper in place of torch's own tensor collate in default_collate_fn_map while
    PackedCollate calls run; an entry a program put there itself is left alone (PackedCollate
    then stacks with it, as default_collate would)."""
    try:
        from torch.utils.data._utils.collate import collate_tensor_fn, default_collate_fn_map
    except ImportError:  # older torch: no registry; default_collate stacks as it always has
        return
    with _HOOK_LOCK:
        _HOOK["calls"] += 1
        if _HOOK["calls"] == 1 and default_collate_fn_map.get(torch.Tensor) is collate_tensor_fn:
            if _HOOK["wrapper"] is None:
                _HOOK["wrapper"] = _wrap(collate_tensor_fn)
            default_collate_fn_map[torch.Tensor] = _HOOK["wrapper"]


def _uninstall() -> None:
    """The last PackedCollate call to end puts torch's function back (unless the program replaced
    the entry meanwhile: then its own stays)."""
    try:
        from torch.utils.data._utils.collate import collate_tensor_fn, default_collate_fn_map
    except ImportError:
        return
    with _HOOK_LOCK:
        _HOOK["calls"] -= 1
        if _HOOK["calls"] == 0 and _HOOK["wrapper"] is not None \
                and default_collate_fn_map.get(torch.Tensor) is _HOOK["wrapper"]:
            default_collate_fn_map[torch.Tensor] = collate_tensor_fn


def _reset_hook_after_fork() -> None:
    """A forked child runs no PackedCollate call yet (whatever its parent's other threads were
    doing): torch's function goes back, and the first call of the child installs the wrapper."""
    global _HOOK_LOCK
    _HOOK_LOCK = threading.Lock()
    _HOOK["calls"] = 0
    try:
        from torch.utils.data._utils.collate import collate_tensor_fn, default_collate_fn_map
    except ImportError:
        return
    if _HOOK["wrapper"] is not None and default_collate_fn_map.get(torch.Tensor) is _HOOK["wrapper"]:
        default_collate_fn_map[torch.Tensor] = collate_tensor_fn


os.register_at_fork(after_in_child=_reset_hook_after_fork)
