"""numpy arrays that no tensor can hold (strings, bytes, objects, records, dates: the names and
tokens of nuScenes' and mmdet3d's info dicts) are leaves like a ``str``: ``start_copy`` passes
them through as the same objects, ``PackedCollate`` carries them in the packed batch's structure
(pickled), so a DataLoader with ``PackedCollate(list)`` gives back what one with ``list`` gives;
numeric and bool arrays still become tensors."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import mtc_loader
from conftest import requires_cuda

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


_STRING_DTYPE = getattr(getattr(np, "dtypes", None), "StringDType", None)  # numpy >= 2


def _passing(i: int) -> dict:
    """One array of each dtype kind that passes through."""
    arrays = {
        "names": np.array(["car", "pedestrian", "traffic_cone"][: 1 + i % 3]),   # <U12
        "tokens": np.array([b"e3d4", b"9f"]),                                       # |S4
        "objects": np.array([{"id": i}, None, "x"], dtype=object),                 # |O
        "records": np.zeros(2, dtype=[("a", "<f4"), ("b", "<i4")]),                 # |V8
        "void": np.frombuffer(b"abcdefgh", dtype="V4"),                             # |V4
        "stamps": np.array(["2020-01-01", "2021-06-30"], dtype="datetime64[D]"),    # <M8[D]
        "spans": np.array([i, 2], dtype="timedelta64[ms]"),                         # <m8[ms]
    }
    if _STRING_DTYPE is not None:
        arrays["strings"] = np.array(["a", "bc"], dtype=_STRING_DTYPE())                    # T
    return arrays


def _sample(i: int) -> dict:
    g = torch.Generator().manual_seed(i)
    return {
        "gt_bboxes": torch.randn(1 + i % 4, 7, generator=g),
        "gt_labels": torch.randint(0, 10, (1 + i % 4,), generator=g),
        "lidar_points": np.arange(12 * (1 + i % 3), dtype=np.float32).reshape(-1, 4),
        "valid": np.array([True, i % 2 == 0]),
        "info": _passing(i),
        "all": list(_passing(i).values()),
    }


class Infos(Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> dict:
        return _sample(i)


def _check_passed(got, ref, where: str) -> None:
    """``got`` equals array ``ref``: the same type, dtype, shape and elements."""
    assert type(got) is np.ndarray, (where, type(got))
    assert got.dtype == ref.dtype and got.shape == ref.shape, (where, got.dtype, ref.dtype)
    if ref.dtype.kind == "V" and ref.dtype.names is None:
        assert got.tobytes() == ref.tobytes(), where
    elif ref.dtype.kind == "O":
        assert list(got) == list(ref), where
    else:
        assert np.array_equal(got, ref), where


def _check_sample(got: dict, ref: dict, device: str, where: str, packed: bool = False) -> None:
    for k in ("gt_bboxes", "gt_labels"):
        assert got[k].device == torch.device(device) and torch.equal(got[k].cpu(), ref[k]), (where, k)
    for k in ("lidar_points", "valid"):
        if packed:  # a batch keeps the collate's numpy arrays
            _check_passed(got[k], ref[k], f"{where}[{k!r}]")
            continue
        # start_copy converts numeric and bool arrays to tensors
        assert isinstance(got[k], torch.Tensor) and got[k].device == torch.device(device), (where, k)
        assert torch.equal(got[k].cpu(), torch.from_numpy(ref[k])), (where, k)
    for k, v in ref["info"].items():
        _check_passed(got["info"][k], v, f"{where}['info'][{k!r}]")
    for j, v in enumerate(ref["all"]):
        _check_passed(got["all"][j], v, f"{where}['all'][{j}]")


def test_start_copy_passes_them_through_as_the_same_objects():
    data = [_sample(0), _sample(1)]
    for kw in ({}, {"use_background_thread": False}):
        out = mtc_loader.start_copy(data, "cpu", **kw).get()
        for s, ref in zip(out, data):
            _check_sample(s, ref, "cpu", "start_copy")
            for k, v in ref["info"].items():
                assert s["info"][k] is v, k
    # a lone array, and one inside a tuple
    names = np.array(["a", "b"])
    assert mtc_loader.start_copy(names, "cpu").get() is names
    assert mtc_loader.start_copy((names, np.ones(2)), "cpu").get()[0] is names


def test_views_and_subclasses_pass_through_too():
    names = np.array([["a", "b"], ["c", "d"]])[:, ::-1]
    masked = np.ma.masked_array(np.array(["x", "y"]), mask=[0, 1])
    ro = np.array([b"k"])
    ro.flags.writeable = False
    out = mtc_loader.start_copy({"v": names, "m": masked, "ro": ro}, "cpu").get()
    assert out["v"] is names and out["m"] is masked and out["ro"] is ro


def test_packed_collate_in_the_main_process():
    samples = [_sample(i) for i in range(3)]
    batch = mtc_loader.PackedCollate(list, arena_bytes=8 << 20)(samples)
    assert isinstance(batch, mtc_loader.PackedBatch)
    for i, s in enumerate(batch.to("cpu")):
        _check_sample(s, samples[i], "cpu", f"batch[{i}]", packed=True)


def test_through_a_dataloader_with_two_workers():
    """The same batches as a plain DataLoader with collate_fn=list, through PrefetchLoader and
    through PackedBatch.to."""
    ds = Infos()
    pc = mtc_loader.PackedCollate(list, arena_bytes=16 << 20)
    dl = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=pc)
    plain = list(DataLoader(ds, batch_size=4, num_workers=2, collate_fn=list))
    got = list(mtc_loader.PrefetchLoader(dl, device="cpu"))
    assert len(got) == len(plain) == 3
    for b, (batch, ref) in enumerate(zip(got, plain)):
        for i, (s, r) in enumerate(zip(batch, ref)):
            _check_sample(s, r, "cpu", f"batch {b}[{i}]", packed=True)
    for b, (packed, ref) in enumerate(zip(dl, plain)):
        for i, (s, r) in enumerate(zip(packed.to("cpu"), ref)):
            _check_sample(s, r, "cpu", f"batch {b}[{i}] (PackedBatch.to)", packed=True)
    del got, packed


def test_numeric_arrays_that_torch_cannot_hold_are_still_refused():
    # a packed batch keeps it a numpy array, as a plain DataLoader does; start_copy refuses it
    batch = mtc_loader.PackedCollate(list, arena_bytes=1 << 20)([{"x": np.zeros(2, dtype=np.longdouble)}])
    _check_passed(batch.to("cpu")[0]["x"], np.zeros(2, dtype=np.longdouble), "packed")
    with pytest.raises(TypeError) as ei:
        mtc_loader.start_copy([{"x": np.zeros(2, dtype=np.longdouble)}], "cpu")
    msg = str(ei.value)
    assert "data[0]['x'] is a numpy array of dtype float128 (<f16), for which torch has no dtype" in msg, msg
    assert "arr.astype(np.float64)" in msg, msg


@requires_cuda
def test_to_a_gpu():
    data = [_sample(0), _sample(1)]
    out = mtc_loader.start_copy(data, "cuda").get()
    torch.cuda.synchronize()
    for s, ref in zip(out, data):
        _check_sample(s, ref, "cuda:0", "start_copy to cuda")
        assert s["info"]["names"] is ref["info"]["names"]
    dl = DataLoader(Infos(), batch_size=4, num_workers=2, collate_fn=mtc_loader.PackedCollate(list, arena_bytes=16 << 20))
    plain = list(DataLoader(Infos(), batch_size=4, num_workers=0, collate_fn=list))
    for batch, ref in zip(mtc_loader.PrefetchLoader(dl, device="cuda"), plain):
        torch.cuda.synchronize()
        for i, (s, r) in enumerate(zip(batch, ref)):
            _check_sample(s, r, "cuda:0", f"[{i}]", packed=True)
