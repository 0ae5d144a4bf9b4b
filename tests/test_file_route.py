"""The route each FileTensor read takes by default, told by the reader's counters
(``mtc_loader.stats()``): the pieces the page cache holds are copied by the helper threads
(``file_bytes_cached``), the others are read through io_uring, ``O_DIRECT`` for their aligned
middle (``file_bytes_direct``) and buffered for their heads and tails (``file_bytes_buffered``).
The pread reader reads everything with pread (``file_bytes_pread``). A cached file, an evicted one,
and a batch of both and of a file half cached; the values are compared with ``np.fromfile`` of the
same bytes. Page cache residency is checked with mincore(2) (through ctypes), in a folder of a
disk-backed filesystem (tmpfs cannot evict)."""
from __future__ import annotations

import ctypes
import mmap
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

import mtc_loader
from mtc_loader import FileTensor, PackedCollate
from mtc_loader import _engine

URING, PREAD = 1, 2
DIRECT_UNCACHED = 1
PIECE = 4 << 20  # the reader's piece: the unit of the route choice
ROUTES = ("file_bytes_cached", "file_bytes_direct", "file_bytes_buffered", "file_bytes_pread")
# name -> file_configure's arguments: depth, largest read, O_DIRECT, mode, page cache asked with mincore
READERS = {
    "uring": (128, 0, DIRECT_UNCACHED, URING, False),
    "uring_mincore": (128, 0, DIRECT_UNCACHED, URING, True),
    "pread": (128, 0, DIRECT_UNCACHED, PREAD, False),
}
DEFAULT_READER = (128, 0, DIRECT_UNCACHED, 0, False)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]


def resident(path, offset: int = 0, length: int | None = None) -> tuple[int, int]:
    """(pages of [offset, offset + length) of the file in the page cache, pages of the range)."""
    pg = mmap.PAGESIZE
    size = os.path.getsize(path)
    length = size - offset if length is None else length
    a, e = offset // pg * pg, (offset + length + pg - 1) // pg * pg
    n = (e - a) // pg
    if not n:
        return 0, 0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, e - a, mmap.PROT_READ, mmap.MAP_SHARED, fd, a)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            raise OSError(ctypes.get_errno(), "mmap")
        try:
            vec = (ctypes.c_ubyte * n)()
            if _libc.mincore(addr, e - a, vec):
                raise OSError(ctypes.get_errno(), "mincore")
            return sum(v & 1 for v in vec), n
        finally:
            _libc.munmap(addr, e - a)
    finally:
        os.close(fd)


def evict(path, offset: int = 0, length: int = 0) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages are not dropped
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm(path) -> None:
    Path(path).read_bytes()


def _evictable(folder) -> bool:
    probe = os.path.join(folder, "probe_evict.bin")
    try:
        np.zeros(1 << 16, np.uint8).tofile(probe)
        evict(probe)
        return resident(probe)[0] == 0
    except OSError:
        return False
    finally:
        if os.path.exists(probe):
            os.remove(probe)


@pytest.fixture
def disk_dir(tmp_path):
    """A folder whose files' pages can be dropped from the page cache: tmp_path, else one in the
    repository's folder or /var/tmp (removed after)."""
    if _evictable(tmp_path):
        yield tmp_path
        return
    for parent in (Path(__file__).resolve().parent.parent, Path("/var/tmp")):
        try:
            d = tempfile.mkdtemp(prefix="mtc_test_route_", dir=parent)
        except OSError:
            continue
        if _evictable(d):
            yield Path(d)
            shutil.rmtree(d, ignore_errors=True)
            return
        shutil.rmtree(d, ignore_errors=True)
    pytest.skip(f"no folder here drops its files' pages from the page cache ({tmp_path}, the repository's, "
                "/var/tmp: tmpfs or similar), so a cold read cannot be set up")


@pytest.fixture(params=list(READERS))
def reader(request):
    name = request.param
    _engine.file_configure(*READERS[name])
    if name.startswith("uring") and _engine.file_reader()[0] != "io_uring":
        _engine.file_configure(*DEFAULT_READER)
        pytest.skip(f"io_uring cannot be set up here: {_engine.file_reader()[1]}")
    yield name
    _engine.file_configure(*DEFAULT_READER)


def write(path, nbytes: int, seed: int) -> np.ndarray:
    a = np.random.default_rng(seed).standard_normal(nbytes // 4).astype(np.float32)
    a.tofile(path)
    return np.fromfile(path, dtype=np.float32)


def routes(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in ROUTES + ("file_bytes_read", "file_reads_direct")}


def read_batch(paths) -> tuple[list, dict]:
    """The files as one packed batch (one read of all of them), aligned so that their middles can
    go O_DIRECT; and the counters' change."""
    fts = [FileTensor(p, torch.float32, (os.path.getsize(p) // 4,)) for p in paths]
    pc = PackedCollate(list, arena_bytes=64 << 20, min_packed_alignment_bytes=4096)
    s0 = mtc_loader.stats()
    out = pc(fts).unpack()
    return out, routes(s0, mtc_loader.stats())


def check(out, refs) -> None:
    for i, (o, ref) in enumerate(zip(out, refs)):
        assert o.numpy().tobytes() == ref.tobytes(), f"file {i}: bytes differ from np.fromfile"


def test_cached_file_is_copied_by_the_helpers(disk_dir, reader):
    nbytes = (9 << 20) + 4096 + 12  # three pieces, an unaligned tail
    ref = write(disk_dir / "w.bin", nbytes, 1)
    for _ in range(3):  # the kernel may evict pages under memory pressure around the read
        warm(disk_dir / "w.bin")
        before = resident(disk_dir / "w.bin")
        out, d = read_batch([disk_dir / "w.bin"])
        check(out, [ref])
        if before[0] == before[1] == resident(disk_dir / "w.bin")[0]:
            break
    else:
        pytest.skip("the kernel evicted the warm file around every read (memory pressure)")
    assert d["file_bytes_read"] == nbytes
    if reader == "pread":
        assert d["file_bytes_pread"] == nbytes and sum(d[k] for k in ROUTES) == nbytes
    else:
        assert d["file_bytes_cached"] == nbytes, d
        assert d["file_bytes_direct"] == d["file_bytes_buffered"] == d["file_bytes_pread"] == 0, d


def test_evicted_file_is_read_o_direct(disk_dir, reader):
    nbytes = (9 << 20) + 4096 + 12
    ref = write(disk_dir / "c.bin", nbytes, 2)
    evict(disk_dir / "c.bin")
    assert resident(disk_dir / "c.bin")[0] == 0, "posix_fadvise(DONTNEED) left pages cached"
    out, d = read_batch([disk_dir / "c.bin"])
    check(out, [ref])
    assert d["file_bytes_read"] == nbytes
    if reader == "pread":
        assert d["file_bytes_pread"] == nbytes and sum(d[k] for k in ROUTES) == nbytes
    else:
        # the aligned middle O_DIRECT, the unaligned tail buffered
        assert d["file_bytes_cached"] == d["file_bytes_pread"] == 0, d
        assert d["file_bytes_direct"] == nbytes // 4096 * 4096, d
        assert d["file_bytes_buffered"] == nbytes % 4096, d
        assert d["file_reads_direct"] >= 1


def test_mixed_batch_takes_each_route_for_its_part(disk_dir, reader):
    """Cached and evicted files in one batch, and one file whose first piece is cached and the
    rest not: each part is read by its route."""
    sizes = [(1 << 20) + 8, 3 << 20, 700_000, (2 << 20) + 4100]
    refs, paths, warm_bytes, cold_bytes = [], [], 0, 0
    for i, n in enumerate(sizes):
        p = disk_dir / f"m{i}.bin"
        refs.append(write(p, n, 10 + i))
        paths.append(p)
    half = disk_dir / "half.bin"
    refs.append(write(half, 3 * PIECE, 20))
    paths.append(half)
    for _ in range(3):
        for i, p in enumerate(paths[:-1]):
            warm(p) if i % 2 else evict(p)
        warm(half)
        evict(half, PIECE, 0)  # the first piece stays cached
        state = [resident(p) for p in paths[:-1]] + [resident(half, 0, PIECE), resident(half, PIECE)]
        want = [(n, n) if i % 2 else (0, n) for i, (_, n) in enumerate(state[:-2])]
        want += [(state[-2][1], state[-2][1]), (0, state[-1][1])]
        assert [s[1] for s in state] == [w[1] for w in want]
        if any(s != w for s, w in zip(state, want)) and reader != "pread":
            continue  # the kernel evicted a warm page before the read: set it up again
        out, d = read_batch(paths)
        check(out, refs)
        if all(resident(p)[0] == resident(p)[1] for i, p in enumerate(paths[:-1]) if i % 2) \
                and resident(half, 0, PIECE)[0] == state[-2][1]:
            break
    else:
        pytest.skip("the kernel evicted warm files around every read (memory pressure)")
    total = sum(sizes) + 3 * PIECE
    assert d["file_bytes_read"] == total and sum(d[k] for k in ROUTES) == total, d
    if reader == "pread":
        assert d["file_bytes_pread"] == total, d
        return
    warm_bytes = sum(n for i, n in enumerate(sizes) if i % 2) + PIECE
    cold_bytes = total - warm_bytes
    assert d["file_bytes_cached"] == warm_bytes, d
    assert d["file_bytes_direct"] + d["file_bytes_buffered"] == cold_bytes, d
    assert d["file_bytes_direct"] >= 2 * PIECE + (1 << 20), d  # the half file's rest, and the 1 MiB one's middle
    assert d["file_bytes_pread"] == 0, d
