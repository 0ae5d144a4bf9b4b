"""File-backed leaves (mtc_loader.FileTensor): read by io_uring or pread into packed batches,
start_copy outputs and .load(), compared bitwise with numpy loading (np.fromfile / np.load).

Every read test runs under several reader settings (``reader`` fixture): io_uring with the
defaults (the page cache's pieces copied by the helpers, the others read O_DIRECT where aligned);
io_uring with a 4-deep ring, reads cut to a few KiB (many submissions, every read completed in
several short steps) and every piece through the ring, O_DIRECT even for cached pages; io_uring
without O_DIRECT; io_uring with a 16-deep ring and the page cache asked with mincore(2) rather
than cachestat(2); pread on the helpers; pread cut into short reads. The io_uring settings skip
where io_uring cannot be set up (the pread ones always run). CUDA variants run where a GPU is.
tests/test_file_route.py checks which route each read took.
"""
from __future__ import annotations

import gc
import os
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

import mtc_loader
from mtc_loader import FileTensor, PackedCollate, PrefetchLoader, start_copy
from mtc_loader import _engine
from mtc_loader._dtypes import DTYPES
from conftest import assert_tree_bitwise, requires_cuda

CUDA = pytest.param("cuda:0", marks=[pytest.mark.cuda, requires_cuda], id="cuda")
DEVICES = ["cpu", CUDA]
ARENA = 32 << 20

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

URING, PREAD = 1, 2
DIRECT_OFF, DIRECT_UNCACHED, DIRECT_ALWAYS = 0, 1, 2
# name -> (queue depth, largest single read (0: any), O_DIRECT, mode, page cache asked with mincore)
READERS = {
    "uring": (128, 0, DIRECT_UNCACHED, URING, False),
    "uring_short": (4, 3000, DIRECT_ALWAYS, URING, False),
    "uring_buffered": (128, 0, DIRECT_OFF, URING, False),
    "uring_mincore": (16, 0, DIRECT_UNCACHED, URING, True),
    "pread": (128, 0, DIRECT_UNCACHED, PREAD, False),
    "pread_short": (128, 3000, DIRECT_UNCACHED, PREAD, False),
}
DEFAULT_READER = (128, 0, DIRECT_UNCACHED, 0, False)


def _uring_works() -> bool:
    _engine.file_configure(*READERS["uring"])
    try:
        return _engine.file_reader()[0] == "io_uring"
    finally:
        _engine.file_configure(*DEFAULT_READER)


BUILT_WITH_LIBURING = mtc_loader.file_reader()["liburing"]


@pytest.fixture(autouse=True)
def _no_fallback_warning_here(monkeypatch):
    """Where io_uring cannot run, tests that do not choose a reader ask for pread explicitly (in
    this process and in spawned workers), so that the one-time fallback warning, which pytest
    turns into an error, is not raised; test_fallback_warns_once_with_reason covers it."""
    if not _uring_works():
        monkeypatch.setenv("MTC_FILE_READER", "pread")
        _engine.file_configure(128, 0, True, PREAD)
        yield
        _engine.file_configure(*DEFAULT_READER)
    else:
        yield


@pytest.fixture(params=list(READERS))
def reader(request):
    name = request.param
    if name.startswith("uring") and not _uring_works():
        pytest.skip(f"io_uring cannot be set up here: {_engine.file_reader()[1]}")
    _engine.file_configure(*READERS[name])
    yield name
    _engine.file_configure(*DEFAULT_READER)


def _reads(name: str) -> str:
    return "file_reads_uring" if name.startswith("uring") else "file_reads_pread"


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# --------------------------------------------------------------------------- data on disk

def numpy_dtypes() -> list:
    """Every engine dtype that numpy can hold, as (torch dtype, numpy dtype)."""
    out = []
    for dt in DTYPES:
        try:
            npdt = torch.empty(0, dtype=dt).numpy().dtype
        except TypeError:
            continue
        out.append((dt, npdt))
    return out


def random_bytes(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def write_raw(path, arr: np.ndarray, head: int = 0, tail: int = 0, seed: int = 0) -> None:
    """arr's bytes at offset `head` of a file, with `tail` random bytes after them."""
    with open(path, "wb") as f:
        f.write(random_bytes(head, seed).tobytes())
        f.write(arr.tobytes())
        f.write(random_bytes(tail, seed + 1).tobytes())


def bytes_as(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def check_equal(out: torch.Tensor, ref: np.ndarray, dtype: torch.dtype, where: str = "") -> None:
    assert isinstance(out, torch.Tensor) and not isinstance(out, FileTensor), where
    assert out.dtype == dtype, f"{where}: {out.dtype} != {dtype}"
    assert tuple(out.shape) == ref.shape, f"{where}: {tuple(out.shape)} != {ref.shape}"
    assert bytes_as(out.cpu()) == ref.tobytes(), f"{where}: bytes differ"


# --------------------------------------------------------------------------- bitwise equality

@pytest.mark.parametrize("dt,npdt", numpy_dtypes(), ids=lambda x: str(x))
def test_every_dtype_start_copy_and_pack(tmp_path, reader, dt, npdt):
    rng = np.random.default_rng(7)
    ref = rng.integers(0, 256, 3 * 5 * 7 * npdt.itemsize, dtype=np.uint8)
    if npdt.kind == "b":
        ref &= 1
    ref = ref.view(npdt).reshape(3, 5, 7)
    write_raw(tmp_path / "x.bin", ref, head=13, tail=5)
    ft = FileTensor(tmp_path / "x.bin", dt, (3, 5, 7), offset=13)
    check_equal(start_copy(ft, "cpu").get(), ref, dt, "start_copy")
    check_equal(ft.load(), ref, dt, "load")
    pb = PackedCollate(list, arena_bytes=ARENA)([{"x": ft}, {"x": ft}])
    out = pb.unpack()
    check_equal(out[0]["x"], ref, dt, "packed[0]")
    check_equal(out[1]["x"], ref, dt, "packed[1]")


SHAPES = [(), (0,), (1,), (7,), (4096,), (3, 0, 2), (2, 3, 4), (1000, 5), (64, 64, 3)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("offset", [0, 1, 4095, 4096, 12345])
def test_shapes_and_offsets(tmp_path, reader, shape, offset):
    ref = np.random.default_rng(offset).standard_normal(shape).astype(np.float32)
    write_raw(tmp_path / "a.bin", ref, head=offset, tail=offset % 7)
    ft = FileTensor(str(tmp_path / "a.bin"), torch.float32, shape, offset)
    check_equal(start_copy([ft], "cpu").get()[0], ref, torch.float32)
    pc = PackedCollate(list, arena_bytes=ARENA, min_packed_alignment_bytes=4096)
    check_equal(pc([ft]).unpack()[0], ref, torch.float32, "packed")


def test_random_batches(tmp_path, reader):
    """Random leaves (dtype, shape, offset, file or stacked files) in random containers, packed
    and copied, against numpy reading the same bytes; prints the seed when it fails."""
    seed = int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    dts = numpy_dtypes()
    try:
        for rnd in range(4):
            batch, refs = [], []
            for i in range(int(rng.integers(1, 40))):
                dt, npdt = dts[int(rng.integers(len(dts)))]
                shape = tuple(int(d) for d in rng.integers(0, 9, int(rng.integers(0, 4))))
                n = int(np.prod(shape, dtype=np.int64)) * npdt.itemsize
                head, rows = int(rng.integers(0, 9000)), int(rng.integers(1, 4))
                fts, arrs = [], []
                for r in range(rows):
                    a = rng.integers(0, 256, n, dtype=np.uint8)
                    if npdt.kind == "b":
                        a &= 1
                    path = tmp_path / f"{rnd}_{i}_{r}.bin"
                    write_raw(path, a, head=head, tail=int(rng.integers(0, 3)), seed=i)
                    fts.append(FileTensor(path, dt, shape, head))
                    arrs.append(a.view(npdt).reshape(shape))
                leaf, ref = (fts[0], arrs[0]) if rows == 1 else (FileTensor.stack(fts), np.stack(arrs))
                batch.append({"x": leaf, "i": i} if rng.integers(2) else (leaf,))
                refs.append((ref, dt))
            align = int(2 ** rng.integers(0, 13))
            for how, out in (("start_copy", start_copy(batch, "cpu").get()),
                             ("packed", PackedCollate(list, arena_bytes=ARENA, min_packed_alignment_bytes=align)(
                                 batch).unpack())):
                for i, (ref, dt) in enumerate(refs):
                    got = out[i]["x"] if isinstance(out[i], dict) else out[i][0]
                    check_equal(got, ref, dt, f"{how} round {rnd} leaf {i} (align {align})")
    except BaseException:
        print(f"test_random_batches: seed {seed}")
        raise


def test_shape_none_and_minus_one(tmp_path, reader):
    ref = np.arange(35 * 5, dtype=np.float32).reshape(35, 5)
    write_raw(tmp_path / "s.bin", ref, head=8)
    a = FileTensor(tmp_path / "s.bin", torch.float32, offset=8)
    assert a.shape == (175,)
    check_equal(a.load(), ref.reshape(-1), torch.float32)
    b = FileTensor(tmp_path / "s.bin", np.float32, (-1, 5), offset=8)
    assert b.shape == (35, 5)
    check_equal(b.load(), ref, torch.float32)
    with pytest.raises(ValueError, match="not a whole number"):
        FileTensor(tmp_path / "s.bin", torch.float64, offset=6)
    with pytest.raises(ValueError, match="cannot cover"):
        FileTensor(tmp_path / "s.bin", torch.float32, (-1, 4), offset=8)


def test_offsets_and_sizes_beyond_int64_refused_at_construction(tmp_path):
    """A file offset is an off_t: an offset or a size past 2**63 - 1 is refused when the
    FileTensor is made, naming the file and the offset or shape (not later, as a malformed
    _spec, nor as a struct.error or a bare OverflowError)."""
    path = str(tmp_path / "x.bin")
    for offset in (2**63 - 8, 2**63, 2**64, 2**70):
        with pytest.raises(ValueError, match=rf"mtc_loader: FileTensor '.*x\.bin': offset {offset} \+ 16 bytes"):
            FileTensor(path, torch.float32, (4,), offset)
    FileTensor(path, torch.float32, (4,), 2**63 - 17)  # ends at the last addressable byte
    for shape in [(2**32, 2**32), (2**61,), (2**62, 2), (2**40, 2**40, 2**40)]:
        with pytest.raises(ValueError, match=r"mtc_loader: FileTensor '.*x\.bin': shape .* of torch.float32 is "
                                             r"\d+ bytes, more than a file can hold"):
            FileTensor(path, torch.float32, shape)
    with pytest.raises(ValueError, match=r"mtc_loader: FileTensor shape \(1180591620717411303424,\) has a "
                                         r"dimension beyond 2\*\*63 - 1"):
        FileTensor(path, torch.float32, (2**70,))
    big = FileTensor(path, torch.uint8, (2**62,))
    assert big.numel() == 2**62 and big.nbytes == 2**62
    with pytest.raises(ValueError, match="3 stacked FileTensors of 4611686018427387904 bytes each"):
        FileTensor.stack([big, big, big])


def test_npy_files(tmp_path, reader):
    arrays = {
        "u8": np.random.default_rng(0).integers(0, 255, (3, 256, 448), dtype=np.uint8),
        "f64": np.random.default_rng(1).standard_normal((17, 3)),
        "i16": np.arange(-50, 50, dtype=np.int16),
        "scalar": np.array(3.5, dtype=np.float32),
        "empty": np.zeros((0, 4), dtype=np.int64),
        "bool": np.random.default_rng(2).integers(0, 2, 33).astype(bool),
    }
    for k, a in arrays.items():
        np.save(tmp_path / f"{k}.npy", a)
    fts = {k: FileTensor.npy(tmp_path / f"{k}.npy") for k in arrays}
    out = start_copy(fts, "cpu").get()
    for k, a in arrays.items():
        ref = np.load(tmp_path / f"{k}.npy")
        check_equal(out[k], ref, torch.from_numpy(ref).dtype, k)
    packed = PackedCollate(list, arena_bytes=ARENA)([fts]).unpack()[0]
    for k in arrays:
        check_equal(packed[k], np.load(tmp_path / f"{k}.npy"), out[k].dtype, f"packed {k}")
    # version 2.0 headers
    big = np.arange(12, dtype=np.float32).reshape(3, 4)
    with open(tmp_path / "v2.npy", "wb") as f:
        np.lib.format.write_array(f, big, version=(2, 0))
    check_equal(FileTensor.npy(tmp_path / "v2.npy").load(), big, torch.float32, "v2")


@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
def test_npy_header_fast_path_matches_numpy(tmp_path, version):
    """FileTensor.npy parses np.save's canonical header itself (files._npy_header_fast) and
    hands anything else to numpy's reader: both agree wherever the fast path answers."""
    from mtc_loader import files as F
    p = tmp_path / "x.npy"
    answered = 0
    for dt in ["u1", "i1", "<i2", "<i4", "<i8", "<f2", "<f4", "<f8", "?", "<c8", "<u8", ">f4"]:
        for shape in [(), (0,), (5,), (3, 4), (2, 3, 4, 5), (1,) * 10]:
            for fortran in (False, True):
                a = np.zeros(shape, np.dtype(dt))
                with open(p, "wb") as f:
                    np.lib.format.write_array(f, np.asfortranarray(a) if fortran else a, version=version)
                fast = F._npy_header_fast(str(p))
                assert fast is not None, (dt, shape)
                answered += 1
                assert fast == F._npy_header(str(p)), (dt, shape, fortran)
                if not fortran and dt[0] != ">":
                    ft = FileTensor.npy(p)
                    assert torch.equal(ft.load(), torch.from_numpy(np.load(p)))
    assert answered
    # a valid header in another spelling: numpy's public readers take it (every version)
    hdr = b"{'shape': (2, 3), 'fortran_order': False, 'descr': '<f4'}"
    size = 2 if version == (1, 0) else 4
    hdr += b" " * (127 - 8 - size - len(hdr)) + b"\n"  # data at 128
    with open(p, "wb") as f:
        f.write(b"\x93NUMPY" + bytes(version) + len(hdr).to_bytes(size, "little") + hdr)
        f.write(np.arange(6, dtype="<f4").tobytes())
    assert F._npy_header_fast(str(p)) is None
    ft = FileTensor.npy(p)
    assert (ft.dtype, tuple(ft.shape), ft.offset) == (torch.float32, (2, 3), 128)
    assert torch.equal(ft.load(), torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert torch.equal(ft.load(), torch.from_numpy(np.load(p)))


@pytest.mark.parametrize("version", [b"\x09\x00", b"\x01\x05", b"\x00\x00"])
def test_npy_corrupt_version_is_a_value_error_naming_the_file(tmp_path, version):
    p = tmp_path / "bad.npy"
    np.save(p, np.arange(6, dtype=np.float32))
    data = bytearray(p.read_bytes())
    data[6:8] = version
    p.write_bytes(bytes(data))
    with pytest.raises(ValueError):
        np.load(p)  # what numpy says too
    with pytest.raises(ValueError, match=r"mtc_loader: '.*bad\.npy' has \.npy format version \d\.\d, which is "
                                         r"none of 1\.0, 2\.0, 3\.0"):
        FileTensor.npy(p)
    p.write_bytes(b"\x93NUMPX\x01\x00" + bytes(data[8:]))
    with pytest.raises(ValueError, match=r"mtc_loader: '.*bad\.npy' is not a \.npy file"):
        FileTensor.npy(p)


def test_npy_refusals(tmp_path):
    np.save(tmp_path / "f.npy", np.asfortranarray(np.ones((3, 4))))
    with pytest.raises(ValueError, match="mtc_loader: .*Fortran"):
        FileTensor.npy(tmp_path / "f.npy")
    np.save(tmp_path / "o.npy", np.array([1, "a"], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="mtc_loader: "):
        FileTensor.npy(tmp_path / "o.npy")
    np.save(tmp_path / "be.npy", np.arange(4, dtype=">i4"))
    with pytest.raises(ValueError, match="byte order"):
        FileTensor.npy(tmp_path / "be.npy")


def test_files_larger_than_a_piece_and_unaligned(tmp_path, reader):
    # 9 MiB + 3 bytes: more than the 4 MiB pieces of the pread path and of staging, an
    # unaligned length (O_DIRECT middle with buffered head and tail)
    n = (9 << 20) + 3
    ref = random_bytes(n, 3)
    write_raw(tmp_path / "big.bin", ref, head=100)
    ft = FileTensor(tmp_path / "big.bin", torch.uint8, (n,), 100)
    check_equal(start_copy(ft, "cpu").get(), ref, torch.uint8)
    pc = PackedCollate(list, arena_bytes=ARENA, min_packed_alignment_bytes=4096)
    check_equal(pc([ft]).unpack()[0], ref, torch.uint8, "packed")
    # aligned offset and destination: the O_DIRECT path proper
    write_raw(tmp_path / "al.bin", ref[: 8 << 20], head=4096)
    ft = FileTensor(tmp_path / "al.bin", torch.uint8, (8 << 20,), 4096)
    before = mtc_loader.stats()
    check_equal(pc([ft]).unpack()[0], ref[: 8 << 20], torch.uint8, "aligned")
    after = mtc_loader.stats()
    if reader == "uring_short":  # O_DIRECT although the file's pages are cached
        assert after["file_reads_direct"] > before["file_reads_direct"]
    if reader in ("uring", "uring_mincore") and _cache_droppable(tmp_path / "al.bin"):
        # in the page cache (just read through it): the helpers copy it from there. The kernel
        # may evict pages under memory pressure before the read, which then rightly goes
        # O_DIRECT; a wrong reader would do so every time
        for _ in range(3):
            (tmp_path / "al.bin").read_bytes()
            before = mtc_loader.stats()
            check_equal(pc([ft]).unpack()[0], ref[: 8 << 20], torch.uint8, "aligned, warm")
            after = mtc_loader.stats()
            if after["file_reads_direct"] == before["file_reads_direct"]:
                break
        else:
            pytest.fail("a file in the page cache was read O_DIRECT three times in a row")
        assert after["file_bytes_cached"] - before["file_bytes_cached"] == 8 << 20
        # cold: the aligned middle goes O_DIRECT
        _drop_cache(tmp_path / "al.bin")
        check_equal(pc([ft]).unpack()[0], ref[: 8 << 20], torch.uint8, "aligned, cold")
        assert mtc_loader.stats()["file_reads_direct"] > after["file_reads_direct"]


def _drop_cache(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages are not dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _cache_droppable(path) -> bool:
    """Whether dropping cached pages works here (not tmpfs, where O_DIRECT is not offered
    either): read a probe file of tmp_path warm, then cold, with MTC_FILE_DIRECT's default and see
    whether the helpers copied it, then the ring read it O_DIRECT."""
    probe = os.path.join(os.path.dirname(path), "probe_direct.bin")
    np.zeros(4 << 16, np.uint8).tofile(probe)
    ft = FileTensor(probe, torch.uint8, (4 << 16,))
    pc = PackedCollate(list, arena_bytes=1 << 20, min_packed_alignment_bytes=4096)
    s0 = mtc_loader.stats()
    pc([ft]).unpack()
    s1 = mtc_loader.stats()
    _drop_cache(probe)
    pc([ft]).unpack()
    s2 = mtc_loader.stats()
    return (s1["file_bytes_cached"] > s0["file_bytes_cached"]
            and s2["file_reads_direct"] > s1["file_reads_direct"])


def test_many_files_in_one_batch(tmp_path, reader):
    """More files than the ring is deep: several windows of submissions."""
    refs, samples = [], []
    for i in range(300):
        a = np.random.default_rng(i).integers(0, 1 << 30, ((i % 37) + 1) * 97, dtype=np.int32)
        write_raw(tmp_path / f"{i}.bin", a, head=i % 5)
        refs.append(a)
        samples.append(FileTensor(tmp_path / f"{i}.bin", torch.int32, a.shape, i % 5))
    pc = PackedCollate(list, arena_bytes=ARENA)
    pc(samples[:1]).unpack()  # the ring exists from here on
    before = mtc_loader.stats()
    fds = open_fds()
    out = pc(samples).unpack()
    for i, a in enumerate(refs):
        check_equal(out[i], a, torch.int32, f"[{i}]")
    after = mtc_loader.stats()
    assert after[_reads(reader)] - before[_reads(reader)] == 300
    routes = ("file_bytes_cached", "file_bytes_direct", "file_bytes_buffered", "file_bytes_pread")
    assert (sum(after[k] - before[k] for k in routes)
            == after["file_bytes_read"] - before["file_bytes_read"] == sum(a.nbytes for a in refs))
    if reader.startswith("uring"):
        assert after["file_reads_pread"] == before["file_reads_pread"]
        assert after["file_bytes_pread"] == before["file_bytes_pread"]
    if reader == "uring_short":  # every piece through the ring, cached or not
        assert after["file_uring_submits"] > before["file_uring_submits"]
        assert after["file_bytes_cached"] == before["file_bytes_cached"]
    if reader.endswith("short"):
        assert after["file_short_reads"] > before["file_short_reads"]
    assert open_fds() == fds


def test_mixed_with_tensors_and_numpy(tmp_path, reader):
    lidar = np.random.default_rng(0).standard_normal((3500, 5)).astype(np.float32)
    lidar.tofile(tmp_path / "l.bin")
    batch = [{"lidar": FileTensor(tmp_path / "l.bin", torch.float32, (-1, 5)),
              "t": torch.arange(10) + i, "n": np.full(3, i, np.int16), "name": f"s{i}"} for i in range(4)]
    for out, kept in ((start_copy(batch, "cpu").get(), False),
                      (PackedCollate(list, arena_bytes=ARENA)(batch).unpack(), True)):
        for i, s in enumerate(out):
            check_equal(s["lidar"], lidar, torch.float32)
            assert torch.equal(s["t"], torch.arange(10) + i)
            if kept:  # a packed batch keeps its numpy arrays
                assert s["n"].dtype == np.int16 and np.array_equal(s["n"], np.full(3, i, np.int16))
            else:  # start_copy converts them
                assert torch.equal(s["n"], torch.full((3,), i, dtype=torch.int16))
            assert s["name"] == f"s{i}"


# --------------------------------------------------------------------------- default_collate

def test_default_collate_stacks_file_tensors(tmp_path, reader):
    refs = []
    for i in range(6):
        a = np.random.default_rng(i).integers(0, 255, (3, 16, 24), dtype=np.uint8)
        np.save(tmp_path / f"c{i}.npy", a)
        refs.append(a)
    samples = [{"img": FileTensor.npy(tmp_path / f"c{i}.npy"), "label": i} for i in range(6)]
    col = default_collate(samples)
    assert isinstance(col["img"], FileTensor)
    assert col["img"].shape == (6, 3, 16, 24) and len(col["img"].parts) == 6
    ref = np.stack(refs)
    check_equal(col["img"].load(), ref, torch.uint8, "load")
    out = PackedCollate(arena_bytes=ARENA)(samples).unpack()
    check_equal(out["img"], ref, torch.uint8, "packed")
    assert torch.equal(out["label"], torch.arange(6))
    # picklable (a worker returns it)
    back = pickle.loads(pickle.dumps(col["img"]))
    assert back.parts == col["img"].parts and back.shape == col["img"].shape
    check_equal(back.load(), ref, torch.uint8, "unpickled")


def test_default_collate_refuses_different_shapes(tmp_path):
    np.save(tmp_path / "a.npy", np.zeros((2, 3), np.float32))
    np.save(tmp_path / "b.npy", np.zeros((3, 3), np.float32))
    with pytest.raises(RuntimeError, match=r"mtc_loader: default_collate stacks FileTensors of one shape"):
        default_collate([FileTensor.npy(tmp_path / "a.npy"), FileTensor.npy(tmp_path / "b.npy")])


# --------------------------------------------------------------------------- the FileTensor object

def test_file_tensor_object(tmp_path):
    np.arange(12, dtype=np.int64).tofile(tmp_path / "x.bin")
    ft = FileTensor(tmp_path / "x.bin", "<i8", (3, 4))
    assert ft.dtype == torch.int64 and ft.shape == torch.Size([3, 4]) and ft.ndim == 2
    assert ft.numel() == 12 and ft.nbytes == 96 and ft.size(1) == 4 and ft.dim() == 2
    assert ft.path == str(tmp_path / "x.bin") and ft.offset == 0
    assert "x.bin" in repr(ft)
    with pytest.raises(AttributeError, match="immutable"):
        ft.shape = (12,)
    back = pickle.loads(pickle.dumps(ft))
    assert back._spec == ft._spec
    with pytest.raises(ValueError, match="offset"):
        FileTensor(tmp_path / "x.bin", torch.int64, (3,), offset=-1)
    with pytest.raises(ValueError, match="shape"):
        FileTensor(tmp_path / "x.bin", torch.int64, (3, -2))
    with pytest.raises(TypeError, match="dtype"):
        FileTensor(tmp_path / "x.bin", "not a dtype", (3,))
    with pytest.raises(TypeError, match="byte order"):
        FileTensor(tmp_path / "x.bin", ">i8", (3,))
    with pytest.raises(FileNotFoundError):
        FileTensor(tmp_path / "missing.bin", torch.int64)  # shape None looks at the file


def test_forged_spec_is_refused(tmp_path):
    np.arange(4, dtype=np.int32).tofile(tmp_path / "x.bin")
    ft = FileTensor(tmp_path / "x.bin", torch.int32, (4,))
    for bad in (ft._spec[:-3], ft._spec[:10], b"x" + ft._spec[1:], ft._spec[:24] + b"\xff" * 8 + ft._spec[32:]):
        forged = FileTensor.__new__(FileTensor)
        object.__setattr__(forged, "dtype", torch.int32)
        object.__setattr__(forged, "shape", torch.Size([4]))
        object.__setattr__(forged, "parts", ft.parts)
        object.__setattr__(forged, "_spec", bad)
        with pytest.raises(ValueError, match="mtc_loader: a FileTensor's _spec"):
            start_copy([forged], "cpu")
        with pytest.raises(ValueError, match="mtc_loader: a FileTensor's _spec"):
            PackedCollate(list, arena_bytes=ARENA)([forged])


# --------------------------------------------------------------------------- errors

def _arena_idle(pc) -> bool:
    return pc.arena.stats()["slots_in_use"] == 0


def test_missing_file_names_path_and_leaf(tmp_path, reader):
    np.zeros(10, np.float32).tofile(tmp_path / "ok.bin")
    np.zeros(10, np.float32).tofile(tmp_path / "gone.bin")
    good = FileTensor(tmp_path / "ok.bin", torch.float32)
    gone = FileTensor(tmp_path / "gone.bin", torch.float32)
    os.remove(tmp_path / "gone.bin")
    batch = [{"a": good}, {"cams": [good, gone]}]
    pc = PackedCollate(list, arena_bytes=ARENA)
    pc([good]).unpack()  # the ring exists from here on
    fds = open_fds()
    with pytest.raises(FileNotFoundError) as ei:
        pc(batch)
    msg = str(ei.value)
    assert msg.startswith("mtc_loader: cannot read data[1]['cams'][1] from ")
    assert str(tmp_path / "gone.bin") in msg and "No such file" in msg
    assert _arena_idle(pc), "the region was not freed"
    with pytest.raises(FileNotFoundError, match=r"mtc_loader: cannot read data\[1\]\['cams'\]\[1\]"):
        start_copy(batch, "cpu").get()
    assert open_fds() == fds


def test_short_file(tmp_path, reader):
    np.arange(100, dtype=np.float32).tofile(tmp_path / "s.bin")
    ft = FileTensor(tmp_path / "s.bin", torch.float32, (100,), offset=0)
    with open(tmp_path / "s.bin", "r+b") as f:
        f.truncate(250)
    pc = PackedCollate(list, arena_bytes=ARENA)
    with pytest.raises(EOFError) as ei:
        pc([[ft]])
    msg = str(ei.value)
    assert msg.startswith("mtc_loader: cannot read data[0][0] from ") and "s.bin" in msg
    assert "250 bytes long" in msg and "[0, 400)" in msg and "ended after 250" in msg
    assert _arena_idle(pc)
    with pytest.raises(EOFError, match="ended after 250"):
        ft.load()
    # a stacked leaf names the file of the row that failed
    np.arange(100, dtype=np.float32).tofile(tmp_path / "t.bin")
    st = FileTensor.stack([FileTensor(tmp_path / "t.bin", torch.float32, (100,)), ft])
    with pytest.raises(EOFError, match=r"mtc_loader: cannot read data from '.*s\.bin'"):
        start_copy(st, "cpu").get()


def test_short_file_message_counts_the_bytes_the_file_has(tmp_path, reader):
    """A file that ends inside a read's aligned middle (O_DIRECT where the reader uses it, with a
    buffered tail read in parallel): the message counts the bytes the file has, not where the
    tail's read started."""
    n, size = 3154825, 3149825
    ref = random_bytes(n, 4)
    write_raw(tmp_path / "d.bin", ref)
    ft = FileTensor(tmp_path / "d.bin", torch.uint8, (n,))
    os.truncate(tmp_path / "d.bin", size)
    _drop_cache(tmp_path / "d.bin")  # cold: the default reader goes O_DIRECT where it can
    pc = PackedCollate(list, arena_bytes=ARENA, min_packed_alignment_bytes=4096)
    for read in (lambda: pc([ft]), ft.load):
        with pytest.raises(EOFError) as ei:
            read()
        msg = str(ei.value)
        assert f"the file is {size} bytes long" in msg and f"ended after {size} of its {n} bytes" in msg, msg
    assert _arena_idle(pc)


def test_directory_and_eio(tmp_path, reader):
    os.mkdir(tmp_path / "d")
    ft = FileTensor.stack([FileTensor(tmp_path / "d", torch.uint8, (8,))])
    with pytest.raises(IsADirectoryError, match="mtc_loader: cannot read data"):
        start_copy(ft, "cpu").get()
    # /proc/self/mem has no page at address 0: the read fails with EIO
    mem = FileTensor("/proc/self/mem", torch.uint8, (16,), offset=0)
    pc = PackedCollate(list, arena_bytes=ARENA)
    with pytest.raises(OSError, match=r"mtc_loader: cannot read data\[0\]\['m'\] from '/proc/self/mem'.*"
                                      r"Input/output error"):
        pc([{"m": mem}])
    assert _arena_idle(pc)


def _bounded(fn, fifo, seconds: float = 10.0):
    """fn() on a daemon thread; a call still blocked after `seconds` (an open of the FIFO waiting
    for a writer) is released by opening the FIFO for writing, and the test fails."""
    import threading
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - returned to the test
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # a reader waits: the open succeeds
        t.join(seconds)
        pytest.fail(f"blocked for more than {seconds} s on a FIFO")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def test_fifo_and_character_device_refused_without_blocking(tmp_path, reader):
    fifo = str(tmp_path / "pipe")
    os.mkfifo(fifo)
    # explicit shape: the file is opened when it is read
    ft = FileTensor(fifo, torch.uint8, (8,))
    for read in (ft.load, lambda: start_copy(ft, "cpu").get(),
                 lambda: PackedCollate(list, arena_bytes=ARENA)([{"x": ft}])):
        with pytest.raises(OSError, match=r"mtc_loader: cannot read .* from '.*pipe'.*"
                                          "not a regular file or block device"):
            _bounded(read, fifo)
    # shape=None and .npy look at the file at construction
    for make in (lambda: FileTensor(fifo, torch.uint8), lambda: FileTensor(fifo, torch.uint8, (-1, 2)),
                 lambda: FileTensor.npy(fifo)):
        with pytest.raises(OSError, match=r"mtc_loader: '.*pipe' is not a regular file or block device"):
            _bounded(make, fifo)
    with pytest.raises(OSError, match="not a regular file or block device"):
        FileTensor("/dev/zero", torch.uint8, (4,)).load()


class _FifoSamples(torch.utils.data.Dataset):
    def __init__(self, path):
        self.path = path

    def __len__(self):
        return 2

    def __getitem__(self, i):
        return FileTensor(self.path, torch.uint8, (8,))


def test_fifo_in_a_worker_ends_the_epoch(tmp_path):
    fifo = str(tmp_path / "pipe")
    os.mkfifo(fifo)
    dl = DataLoader(_FifoSamples(fifo), batch_size=2, num_workers=1, multiprocessing_context="fork",
                    collate_fn=PackedCollate(arena_bytes=ARENA), timeout=20)
    with pytest.raises(OSError, match="not a regular file or block device"):
        _bounded(lambda: list(dl), fifo, 30.0)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their permissions")
def test_permission_denied(tmp_path, reader):
    np.zeros(4, np.int8).tofile(tmp_path / "p.bin")
    ft = FileTensor(tmp_path / "p.bin", torch.int8)
    os.chmod(tmp_path / "p.bin", 0)
    with pytest.raises(PermissionError, match="mtc_loader: cannot read data"):
        PackedCollate(list, arena_bytes=ARENA)([ft])


# --------------------------------------------------------------------------- fallback switch

def _run(code: str, **env) -> subprocess.CompletedProcess:
    e = dict(os.environ, **env)
    e["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(mtc_loader.__file__)),
                                       e.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c", textwrap.dedent(code)],
                          capture_output=True, text=True, env=e, timeout=120)


_CHILD = """
    import sys, warnings, numpy as np, torch, mtc_loader
    np.arange(1000, dtype=np.float32).tofile({path!r})
    ft = mtc_loader.FileTensor({path!r}, torch.float32)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = mtc_loader.PackedCollate(list, arena_bytes=1 << 20)([ft, ft]).unpack()
        out2 = mtc_loader.start_copy([ft], "cpu").get()
    assert torch.equal(out[1], torch.arange(1000, dtype=torch.float32))
    assert torch.equal(out2[0], torch.arange(1000, dtype=torch.float32))
    s = mtc_loader.stats()
    print(mtc_loader.file_reader()["mode"], s["file_reads_uring"], s["file_reads_pread"], len(w))
    for x in w:
        print("WARNING", x.category.__name__, x.message)
"""


def test_env_switch_forces_pread(tmp_path):
    r = _run(_CHILD.format(path=str(tmp_path / "f.bin")), MTC_FILE_READER="pread", MTC_URING_DEPTH="")
    assert r.returncode == 0, r.stderr
    mode, uring, pread, nwarn = r.stdout.split("\n")[0].split()
    assert (mode, uring, pread, nwarn) == ("pread", "0", "3", "0")  # asked for: no warning


def test_fallback_warns_once_with_reason(tmp_path):
    # a ring of depth 0 cannot be set up: the reader falls back to pread and says why, once
    env = dict(MTC_URING_DEPTH="0", MTC_FILE_READER="")
    if not BUILT_WITH_LIBURING:
        r = _run(_CHILD.format(path=str(tmp_path / "f.bin")), **env)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split("\n")[0].split() == ["pread", "0", "3", "1"]
        assert "liburing was absent when mtc_loader was built" in r.stdout
        return
    r = _run(_CHILD.format(path=str(tmp_path / "f.bin")), **env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().split("\n")
    mode, uring, pread, nwarn = lines[0].split()
    assert (mode, uring, pread, nwarn) == ("pread", "0", "3", "1")
    assert lines[1].startswith("WARNING RuntimeWarning mtc_loader: file-backed tensors are read with pread")
    assert "io_uring_queue_init(0) failed: Invalid argument" in lines[1]


def test_fallback_warning_once_per_process_whatever_the_settings(tmp_path):
    # the reader's settings changed between reads (file_configure) do not warn a second time
    code = """
        import warnings, numpy as np, torch, mtc_loader
        from mtc_loader import _engine
        np.arange(10, dtype=np.int16).tofile({path!r})
        ft = mtc_loader.FileTensor({path!r}, torch.int16)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for max_io in (0, 3000, 0):  # a ring of depth 0 cannot be set up: pread each time
                _engine.file_configure(0, max_io, 1, 0)
                out = mtc_loader.start_copy([ft], "cpu").get()
                assert torch.equal(out[0], torch.arange(10, dtype=torch.int16))
        print(mtc_loader.file_reader()["mode"], len(w))
    """
    r = _run(code.format(path=str(tmp_path / "g.bin")), MTC_URING_DEPTH="", MTC_FILE_READER="")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["pread", "1"], r.stdout


def test_uring_path_runs_here_when_available(tmp_path):
    if not _uring_works():
        pytest.skip(f"io_uring cannot be set up here: {_engine.file_reader()[1]}")
    r = _run(_CHILD.format(path=str(tmp_path / "f.bin")), MTC_FILE_READER="", MTC_URING_DEPTH="")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[0].split() == ["io_uring", "3", "0", "0"]


# --------------------------------------------------------------------------- worker processes

class LidarCams(Dataset):
    """nuScenes-like samples: LiDAR sweeps (.bin) and camera arrays (.npy) as FileTensors, or
    loaded with numpy (the reference)."""

    def __init__(self, root: str, n: int, files: bool = True, broken_at: int = -1):
        self.root, self.n, self.files, self.broken_at = root, n, files, broken_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        sweeps = [os.path.join(self.root, f"s{i}_{k}.bin") for k in range(3)]
        cams = [os.path.join(self.root, f"c{i}_{k}.npy") for k in range(2)]
        if i == self.broken_at:
            sweeps[1] += ".missing"
        if self.files:
            return {"sweeps": [FileTensor(p, torch.float32, (-1, 5)) if os.path.exists(p)
                               else FileTensor(p, torch.float32, (10, 5)) for p in sweeps],
                    "cams": [FileTensor.npy(p) for p in cams], "idx": i}
        return {"sweeps": [torch.from_numpy(np.fromfile(p, np.float32).reshape(-1, 5)) for p in sweeps],
                "cams": [torch.from_numpy(np.load(p)) for p in cams], "idx": i}


def make_dataset_files(root, n: int) -> None:
    for i in range(n):
        rng = np.random.default_rng(i)
        for k in range(3):
            rng.standard_normal((100 + 37 * k + i, 5)).astype(np.float32).tofile(os.path.join(root, f"s{i}_{k}.bin"))
        for k in range(2):
            np.save(os.path.join(root, f"c{i}_{k}.npy"), rng.integers(0, 255, (3, 8, 12 + k), dtype=np.uint8))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ctx,workers", [(None, 0), ("fork", 2), ("spawn", 1), ("forkserver", 2)])
def test_workers_start_methods(tmp_path, ctx, workers, device):
    make_dataset_files(str(tmp_path), 12)
    ref = list(DataLoader(LidarCams(str(tmp_path), 12, files=False), batch_size=4, collate_fn=list))
    pc = PackedCollate(list, arena_bytes=ARENA)
    dl = DataLoader(LidarCams(str(tmp_path), 12), batch_size=4, num_workers=workers, collate_fn=pc,
                    multiprocessing_context=ctx)
    n = 0
    for k, b in enumerate(PrefetchLoader(dl, device)):
        if device != "cpu":
            torch.cuda.synchronize()
        want = [{"sweeps": [t.to(device) for t in s["sweeps"]], "cams": [t.to(device) for t in s["cams"]],
                 "idx": s["idx"]} for s in ref[k]]
        assert_tree_bitwise(b, want, f"batch {k}")
        n += 1
    assert n == 3
    del dl
    gc.collect()


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_error_in_worker_names_file_and_leaf(tmp_path, ctx):
    make_dataset_files(str(tmp_path), 8)
    pc = PackedCollate(list, arena_bytes=ARENA)
    dl = DataLoader(LidarCams(str(tmp_path), 8, broken_at=5), batch_size=4, num_workers=1, collate_fn=pc,
                    multiprocessing_context=ctx)
    it = iter(dl)
    next(it).unpack()
    with pytest.raises(FileNotFoundError) as ei:
        next(it)
    msg = str(ei.value)
    assert "mtc_loader: cannot read data[1]['sweeps'][1] from " in msg and "s5_1.bin.missing" in msg
    del it, dl
    gc.collect()


# --------------------------------------------------------------------------- CUDA

@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("staging", [True, False])
@pytest.mark.parametrize("pack", [True, False])
def test_start_copy_to_cuda(tmp_path, reader, staging, pack):
    small = np.random.default_rng(0).standard_normal((100, 5)).astype(np.float32)
    big = random_bytes((6 << 20) + 5, 1)  # staged in pieces, each read by pread on a helper
    write_raw(tmp_path / "s.bin", small, head=3)
    write_raw(tmp_path / "b.bin", big, head=4096)
    data = {"s": [FileTensor(tmp_path / "s.bin", torch.float32, (100, 5), 3)] * 3,
            "b": FileTensor(tmp_path / "b.bin", torch.uint8, (big.size,), 4096), "t": torch.arange(5)}
    out = start_copy(data, "cuda:0", use_pinned_staging=staging, pack_cpu_tensors=pack).get()
    torch.cuda.synchronize()
    for i in range(3):
        assert out["s"][i].device.type == "cuda"
        check_equal(out["s"][i], small, torch.float32, f"s[{i}]")
    check_equal(out["b"], big, torch.uint8, "b")
    assert torch.equal(out["t"].cpu(), torch.arange(5))


@requires_cuda
@pytest.mark.cuda
def test_start_copy_to_cuda_errors(tmp_path, reader):
    np.zeros(10, np.float32).tofile(tmp_path / "x.bin")
    small = FileTensor(tmp_path / "x.bin", torch.float32, (10,))
    big = FileTensor(tmp_path / "x.bin", torch.float32, (1 << 20,))  # staged: the file is short
    with pytest.raises(EOFError, match=r"mtc_loader: cannot read data\[1\]"):
        start_copy([small, big], "cuda:0").get()
    os.remove(tmp_path / "x.bin")
    with pytest.raises(FileNotFoundError, match=r"mtc_loader: cannot read data\[0\]"):
        start_copy([small], "cuda:0").get()
    # the engine is still usable
    assert torch.equal(start_copy([torch.arange(3)], "cuda:0").get()[0].cpu(), torch.arange(3))
