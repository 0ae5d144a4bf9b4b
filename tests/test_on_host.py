"""Host-placed leaves (``mtc_loader._tree.OnHost``): in a packed batch the tensors under an OnHost
cross the worker boundary inside the region and come back as CPU tensors of their own memory
(never views of the arena), bitwise equal, with their layouts and classes, whatever the target;
numpy arrays under one pass through as they are; the marker is gone from the output. start_copy
(a batch that is not packed) passes the marked value through as the same object.

CPU tests run everywhere; the ``cuda`` variants run the same checks where a GPU is. Classes and
datasets are module-level so that workers started by spawn can unpickle them.
"""
from __future__ import annotations

import gc
import os

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import mtc_loader
from mtc_loader import FileTensor, PackedCollate, PrefetchLoader, start_copy
from mtc_loader._tree import LEAF, OnHost
from conftest import assert_bitwise, requires_cuda

DEVICES = ["cpu", pytest.param("cuda:0", marks=[requires_cuda, pytest.mark.cuda])]
ARENA = 16 << 20


class HostBoxes:
    """A registered container (mmdet's InstanceData-like) holding a tensor and a nested one."""

    def __init__(self, tensor, inner=None, tag="boxes"):
        self.tensor, self.inner, self.tag = tensor, inner, tag


def _hb_flatten(b):
    return [b.tensor, b.inner], b.tag


def _hb_unflatten(values, tag):
    b = HostBoxes.__new__(HostBoxes)
    b.tensor, b.inner, b.tag = values[0], values[1], tag
    return b


mtc_loader.register_container(HostBoxes, _hb_flatten, _hb_unflatten, names=lambda tag: ("tensor", "inner"))


def write_files(root: str, n: int) -> None:
    rng = np.random.default_rng(7)
    for i in range(n):
        rng.standard_normal((3 + i, 5)).astype(np.float32).tofile(os.path.join(root, f"h{i}.bin"))


def make_sample(i: int, root: str | None = None) -> dict:
    """Device leaves (a tensor, a channels_last one, a numpy array) beside OnHost values: a dict
    with a tensor, a numpy array and atoms; a list of tensors; nested registered containers; a
    channels_last tensor; an empty tensor; a FileTensor (when root is given)."""
    g = torch.Generator().manual_seed(i)
    n = 2 + i % 4
    s = {
        "img": torch.randn(3, 8, 8, generator=g),
        "img_cl": torch.randn(1, 3, 4, 5, generator=g).to(memory_format=torch.channels_last),
        "arr": np.arange(6, dtype=np.int16).reshape(2, 3) + i,
        "meta": OnHost({"scale": torch.tensor([1.5, 2.0]) * i, "flip": np.array([i % 2, 1], dtype=np.int64),
                        "name": f"s{i}", "shape": (8, 8)}),
        "gt": OnHost([torch.arange(n), torch.randn(n, 4, generator=g), torch.empty(0, 4)]),
        "boxes": OnHost(HostBoxes(torch.randn(n, 7, generator=g).double(),
                                  HostBoxes(torch.randint(0, 9, (n,), generator=g, dtype=torch.uint8)))),
        "cl": OnHost(torch.randn(2, 3, 4, 5, generator=g).to(memory_format=torch.channels_last)),
        "mask": OnHost(torch.rand(n, 6, generator=g) > 0.5),
    }
    if root is not None:
        s["file"] = OnHost([FileTensor(os.path.join(root, f"h{i}.bin"), torch.float32, (3 + i, 5))])
    return s


def plain_sample(i: int) -> dict:
    """Only plain containers and atoms: a structure batches share (its skeleton walked once)."""
    return {"img": torch.full((4,), float(i)), "meta": OnHost({"scale": torch.arange(3) + i, "name": f"p{i}"}),
            "ids": OnHost([torch.tensor([i]), torch.tensor([i, i])])}


class HostSamples(Dataset):
    def __init__(self, root: str | None = None, n: int = 8, plain: bool = False):
        self.root, self.n, self.plain = root, n, plain

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return plain_sample(i) if self.plain else make_sample(i, self.root)


def arena_ranges() -> list[tuple[int, int]]:
    """The address ranges of this process's arena mappings (memfd 'mtc_loader_arena')."""
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            if "mtc_loader_arena" in line:
                lo, hi = line.split()[0].split("-")
                ranges.append((int(lo, 16), int(hi, 16)))
    return ranges


def check(out, src, device, ranges, host=False, where="data") -> None:
    """out is src moved as a packed batch: src's OnHost values on the CPU (own memory), numpy
    arrays as they were wherever they are, everything else on device; same classes, layouts and bytes."""
    if isinstance(src, OnHost):
        assert not isinstance(out, OnHost), f"{where}: the OnHost marker is in the output"
        return check(out, src.value, device, ranges, True, where)
    if isinstance(src, FileTensor):
        src = start_copy(src, "cpu").get()
    if isinstance(src, torch.Tensor):
        want = torch.device("cpu") if host else torch.device(device)
        assert type(out) is torch.Tensor, f"{where}: {type(out)}"
        assert out.device == want, f"{where}: on {out.device}, not {want}"
        assert_bitwise(out.cpu(), src, where)
        if out.numel() > 1:
            assert out.stride() == src.stride(), f"{where}: strides {out.stride()} != {src.stride()}"
        if out.device.type == "cpu" and out.numel():
            p = out.untyped_storage().data_ptr()
            assert not any(lo <= p < hi for lo, hi in ranges), f"{where}: a view of the arena"
    elif isinstance(src, np.ndarray):  # a packed batch keeps numpy arrays, inside an OnHost or not
        assert type(out) is np.ndarray and out.dtype == src.dtype, f"{where}: {type(out)}"
        assert np.array_equal(out, src), f"{where}: values differ"
    elif isinstance(src, HostBoxes):
        assert type(out) is HostBoxes and out.tag == src.tag, where
        check(out.tensor, src.tensor, device, ranges, host, f"{where}.tensor")
        check(out.inner, src.inner, device, ranges, host, f"{where}.inner")
    elif isinstance(src, dict):
        assert type(out) is dict and list(out) == list(src), where
        for k in src:
            check(out[k], src[k], device, ranges, host, f"{where}[{k!r}]")
    elif isinstance(src, (list, tuple)):
        assert type(out) is type(src) and len(out) == len(src), where
        for k, (o, s) in enumerate(zip(out, src)):
            check(o, s, device, ranges, host, f"{where}[{k}]")
    else:
        assert out == src, f"{where}: {out!r} != {src!r}"


def sync(device) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------ start_copy


@pytest.mark.parametrize("device", DEVICES)
def test_start_copy_passes_the_value_through(device):
    value = [torch.arange(3), {"a": torch.ones(2), "n": np.zeros(2)}]
    data = {"x": torch.ones(4), "h": OnHost(value), "deep": [OnHost(value)]}
    out = start_copy(data, device).get()
    sync(device)
    assert out["h"] is value and out["deep"][0] is value
    assert out["x"].device == torch.device(device)
    assert start_copy(OnHost(value), device).get() is value


def test_prefetch_of_unpacked_batches_passes_the_value_through():
    value = [torch.arange(3)]
    batches = [{"x": torch.ones(2), "h": OnHost(value)} for _ in range(3)]
    for b in PrefetchLoader(batches, "cpu"):
        assert b["h"] is value


# ------------------------------------------------------------------------ packed


@pytest.mark.parametrize("device", DEVICES)
def test_packed_batch(tmp_path, device):
    write_files(str(tmp_path), 4)
    pc = PackedCollate(list, arena_bytes=ARENA)
    batch = [make_sample(i, str(tmp_path)) for i in range(4)]
    pb = pc(batch)
    # the skeleton keeps the markers (the receiving process knows the host-placed leaves from it)
    assert isinstance(pb._skeleton[0]["meta"], OnHost) and pb._skeleton[0]["gt"].value[0] is LEAF
    out = pb.to(device)
    sync(device)
    ranges = arena_ranges()
    assert ranges
    check(out, batch, device, ranges)
    # the host-placed leaves of one batch share one CPU chunk of their own
    if device != "cpu":
        storages = {out[i]["gt"][1].untyped_storage().data_ptr() for i in range(4)}
        assert len(storages) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_only_host_leaves(device):
    pc = PackedCollate(list, arena_bytes=ARENA)
    batch = [OnHost([torch.arange(5), torch.randn(2, 3)]), "x"]
    out = pc(batch).to(device)
    sync(device)
    check(out, batch, device, arena_ranges())


@pytest.mark.parametrize("device", DEVICES)
def test_shared_structure(device):
    """A structure of plain containers, atoms and OnHost markers is shared between batches."""
    pc = PackedCollate(list, arena_bytes=ARENA)
    for k in range(3):
        batch = [plain_sample(2 * k), plain_sample(2 * k + 1)]
        pb = pc(batch)
        assert pb._atoms is not None
        out = pb.to(device)
        sync(device)
        check(out, batch, device, arena_ranges())


def test_host_leaves_survive_reuse_of_the_arena():
    """The arena region is reused by later batches: host leaves taken out of it keep their values."""
    pc = PackedCollate(list, arena_bytes=1 << 20)
    batch = [make_sample(1)]
    out = pc(batch).unpack("cpu")
    for k in range(40):  # every slot of the arena written over
        pc([{"junk": OnHost([torch.full((4096,), float(k))]), "d": torch.full((4096,), -1.0)}]).unpack("cpu")
    check(out, batch, "cpu", arena_ranges())


def test_skeleton_that_does_not_match_the_layout_is_refused():
    pc = PackedCollate(list, arena_bytes=ARENA)
    pb = pc([{"h": OnHost([torch.arange(3)]), "d": torch.ones(2)}])
    pb._skeleton = [{"h": [LEAF], "d": LEAF}]  # forged: the marker dropped
    with pytest.raises(ValueError, match="skeleton does not match its layout"):
        pb.unpack("cpu")
    pb = pc([{"h": [torch.arange(3)], "d": torch.ones(2)}])
    pb._skeleton = [{"h": OnHost([LEAF]), "d": LEAF}]  # forged: a marker added
    with pytest.raises(ValueError, match="skeleton does not match its layout"):
        pb.unpack("cpu")


def test_bad_leaf_under_on_host_is_named_without_the_marker():
    pc = PackedCollate(list, arena_bytes=ARENA)
    sparse = torch.eye(3).to_sparse()
    with pytest.raises(TypeError, match=r"data\[0\]\['h'\]\[1\] is a sparse tensor"):
        pc([{"h": OnHost([torch.ones(2), sparse])}])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ctx,workers", [(None, 0), ("fork", 2), ("spawn", 2)])
def test_packed_collate_in_workers(tmp_path, ctx, workers, device):
    root = str(tmp_path)
    write_files(root, 8)
    pc = PackedCollate(list, arena_bytes=ARENA)
    dl = DataLoader(HostSamples(root), batch_size=4, num_workers=workers, collate_fn=pc,
                    multiprocessing_context=ctx)
    n = 0
    for k, batch in enumerate(PrefetchLoader(dl, device)):
        sync(device)
        check(batch, [make_sample(i, root) for i in range(4 * k, 4 * k + 4)], device, arena_ranges())
        n += 1
    assert n == 2
    for k, pb in enumerate(dl):
        out = pb.unpack(device) if k else pb.to(device)
        sync(device)
        check(out, [make_sample(i, root) for i in range(4 * k, 4 * k + 4)], device, arena_ranges())
    # plain structures: the skeleton crosses as a shared structure, walked once here
    dl = DataLoader(HostSamples(n=6, plain=True), batch_size=2, num_workers=workers, collate_fn=pc,
                    multiprocessing_context=ctx)
    for k, batch in enumerate(PrefetchLoader(dl, device)):
        sync(device)
        check(batch, [plain_sample(2 * k), plain_sample(2 * k + 1)], device, arena_ranges())
    del dl
    gc.collect()


# ------------------------------------------------------------------------ CUDA only


@requires_cuda
@pytest.mark.cuda
def test_cuda_leaf_under_on_host_is_refused_by_name():
    pc = PackedCollate(list, arena_bytes=ARENA)
    with pytest.raises(TypeError, match=r"data\[0\]\['h'\]\[0\] is a CUDA tensor"):
        pc([{"h": OnHost([torch.ones(2, device="cuda:0")])}])


@requires_cuda
@pytest.mark.cuda
def test_cuda_device_leaves_share_their_dtypes_tensor_host_leaves_another():
    pc = PackedCollate(list, arena_bytes=ARENA)
    batch = [make_sample(3)]
    pb = pc(batch)
    out = pb.to("cuda:0")
    assert pb.to("cuda:0") is out
    torch.cuda.synchronize()
    check(out, batch, "cuda:0", arena_ranges())
    f32 = {out[0]["img"].untyped_storage().data_ptr(), out[0]["img_cl"].untyped_storage().data_ptr()}
    assert len(f32) == 1  # one tensor per dtype of the chunk: the float32 leaves share it
    # a numpy array stays a numpy array on the host, as the collate made it
    assert isinstance(out[0]["arr"], np.ndarray) and np.array_equal(out[0]["arr"], batch[0]["arr"])
    dev = f32
    assert all(o.is_cuda for o in (out[0]["img"], out[0]["img_cl"]))
    host = out[0]["cl"]
    assert host.device.type == "cpu" and host.is_contiguous(memory_format=torch.channels_last)
    assert out[0]["gt"][0].untyped_storage().data_ptr() not in dev
