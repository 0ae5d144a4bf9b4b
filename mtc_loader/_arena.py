"""The shared arena that DataLoader workers pack batches into (:class:`Arena`).

A region of it holds one packed batch (``_packed.py``); ``collate.py`` packs into it.
"""
from __future__ import annotations

import os
import weakref
from multiprocessing import context as _mp_context
from multiprocessing import reduction, resource_sharer
from typing import Any, Callable, Optional

from torch.utils.data import get_worker_info

from . import _dtypes, _engine
from ._options import size

__all__ = ["ARENAS", "Arena", "MAX_ARENA_BYTES", "check_dtypes", "consumed_here", "consumes", "engine_arena", "expect",
           "has_loaders_word", "pack_word", "set_unpack_hint", "set_word_at_start", "unpack_hint", "withdraw_word"]


# Arenas of this process by token, so that an unpickled PackedBatch finds its arena.
ARENAS: "weakref.WeakValueDictionary[tuple[int, int, int], Arena]" = weakref.WeakValueDictionary()


def check_arena_bytes(value: Any) -> int:
    """``arena_bytes`` as every entry point takes it (Arena, PackedCollate, mmengine's switch and
    its command): a positive int, or a string with a unit (``"512M"``), within the arena's limit;
    anything else is a ValueError, as it always was for a bad arena_bytes."""
    try:
        return size("arena_bytes", value, MAX_ARENA_BYTES)
    except TypeError as e:
        raise ValueError(str(e)) from None


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
            nbytes = check_arena_bytes(nbytes)
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
        # unpacks this arena's batches checks that its own is the same (check_dtypes)
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
        ARENAS[_token] = self

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

    def stats(self) -> dict[str, int]:
        """Allocator counters: bytes, slots in use, allocs, frees, waits, timeouts, reclaimed."""
        return self._a.stats()

    def reclaim_dead(self) -> int:
        """Free the regions of processes that died (a killed worker); returns slots freed."""
        return self._a.reclaim_dead()

    def __repr__(self) -> str:
        s = self.stats()
        return f"<Arena {s['bytes'] >> 20} MiB, {s['bytes_in_use'] >> 10} KiB in use>"


# What the other modules of the package do with an arena beyond its public methods: the engine's
# handle, the dtype check, and the word of the loader that unpacks its batches.

def engine_arena(arena: Arena) -> _engine.Arena:
    """The engine's handle of ``arena``: what ``_engine.pack`` packs into, and what a region is
    released to or adopted from."""
    return arena._a


def check_dtypes(arena: Arena, doing: str) -> None:
    """Raises unless this process's dtype codes mean what the arena creator's do (the same
    torch): a batch packed with one table and unpacked with another would come back with
    other dtypes."""
    if arena._dtype_table is not _dtypes.TABLE and arena._dtype_table != _dtypes.TABLE:
        raise RuntimeError(_dtypes.mismatch(arena._dtype_table, doing))


def expect(arena: Arena, expected: tuple[int, str, int, str], loaders: bool = True,
           numpy_tensors: bool = False) -> None:
    """The loader that unpacks ``arena``'s batches keeps up to ``expected[0]`` in flight and
    needs room for ``expected[2]`` at the least (``[1]``, ``[3]``: what they are;
    ``_flight.in_flight``): the first batch each process packs after this is refused at once,
    with the size to configure, where the arena cannot hold the least of its size.
    ``loaders``: the word is a PrefetchLoader's; ``numpy_tensors``: it wants numpy arrays
    packed as tensors."""
    arena._expected = expected
    arena._checked = 0
    arena._loaders, arena._numpy_tensors = loaders, numpy_tensors


def withdraw_word(arena: Arena, expected: tuple[int, str, int, str]) -> None:
    """The end of a PrefetchLoader's epoch: ``arena`` no longer has the word ``expected`` (the
    object :func:`expect` was given), unless another loader's word has replaced it meanwhile."""
    if arena._expected is expected:
        arena._expected = None
        arena._loaders = arena._numpy_tensors = False


def has_loaders_word(arena: Arena) -> bool:
    """Whether ``arena``'s word is a PrefetchLoader's (not a DataLoader's taken at its start)."""
    return arena._loaders


def pack_word(arena: Arena) -> tuple[tuple[int, str, int, str, bool], bool]:
    """What ``_engine.pack`` is told: ``(batches in flight, what they are, the least the arena
    must hold, checked at this process's first pack only (0 after), what they are, whether the
    consumer's regions are its loaders' own)``, and whether the consumer wants numpy arrays
    packed as tensors. Without a PrefetchLoader's word, a DataLoader worker counts its
    DataLoader's workers at the default ``prefetch_factor`` (which it cannot see) and the batch
    the loop unpacks, and checks nothing."""
    expected = arena._expected
    if expected is not None:
        me = os.getpid()
        first, arena._checked = arena._checked != me, me
        batches, why, least, least_why = expected
        return (batches, why, least if first else 0, least_why, arena._loaders), arena._numpy_tensors
    info = get_worker_info()
    if info is None or not info.num_workers:
        return (1, "the one the loop unpacks", 0, "", False), arena._numpy_tensors
    return ((2 * info.num_workers + 1,
             f"{info.num_workers} workers x prefetch_factor 2 in the DataLoader (its default; count yours if "
             "you set another), 1 the loop unpacks", 0, "", False), arena._numpy_tensors)


def unpack_hint(arena: Arena) -> str:
    """What a PackedBatch of ``arena`` read as its structure tells the user to do."""
    return arena._unpack_hint


def set_unpack_hint(arena: Arena, hint: str) -> None:
    """An integration whose loops unpack the batches (mtc_loader.mmengine) names its own way."""
    arena._unpack_hint = hint


MAX_ARENA_BYTES = 1 << 46  # mtc_arena_create's limit


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


# Set by _flight.py (set_word_at_start): tells the arena of a DataLoader iterator that is starting
# its workers (found on the caller's stack) what that DataLoader keeps in flight, where no
# PrefetchLoader has said it, so that a plain loop's workers check their first batch as a
# PrefetchLoader's do. Called while the arena is pickled for a spawn or forkserver child.
_WORD_AT_START: Optional[Callable[[Optional[Arena]], None]] = None


def set_word_at_start(hook: Callable[[Optional[Arena]], None]) -> None:
    """Installs the hook that gives an arena pickled for a starting worker its DataLoader's word."""
    global _WORD_AT_START
    _WORD_AT_START = hook


def _word_at_start(arena: Arena) -> None:
    if _WORD_AT_START is not None:
        _WORD_AT_START(arena)


def consumes(arena: Arena) -> bool:
    """Whether this process unpacks the batches packed into ``arena``: the process that created
    it, and any other process holding it that is not a DataLoader worker. The second case is a
    process started with a ``PackedCollate`` built in its launcher (Lightning's ``ddp_spawn``,
    ``ddp_fork`` and notebook launchers, ``torch.multiprocessing.spawn``): each such process
    consumes the batches its own DataLoader workers pack into the shared arena."""
    return arena.creator == os.getpid() or get_worker_info() is None


def _attach(dupfd: Any, token: tuple[int, int, int], expected: Optional[tuple[int, str, int, str]] = None,
            dtypes: Optional[tuple[str, str]] = None, loaders: bool = True, numpy_tensors: bool = False) -> Arena:
    existing = ARENAS.get(token)
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


def consumed_here() -> list[Arena]:
    """The arenas of this process whose batches it unpacks (:func:`consumes`)."""
    return [arena for arena in list(ARENAS.values()) if consumes(arena)]
