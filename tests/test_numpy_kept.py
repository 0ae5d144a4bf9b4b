"""A batch keeps the types its collate function made: on the DataLoader path (PackedCollate with
PackedBatch.to / unpack, PrefetchLoader over a packed or a plain collate) numpy arrays come back
as numpy arrays on the host, bitwise as a plain DataLoader hands them out (every numeric dtype,
0-d, non-native byte order, non-contiguous; fork and spawn workers). ``numpy_to_tensors=True``
converts them; ``start_copy`` converts them as the reference API says. Datasets are module-level
so that spawn workers can unpickle them."""
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import mtc_loader as m

DTYPES = [np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64,
          np.float16, np.float32, np.float64, np.complex64, np.complex128]


def _arrays(i):
    out = {}
    for dt in DTYPES:
        name = np.dtype(dt).name
        base = (np.arange(24) % 7 + i).astype(dt).reshape(2, 3, 4)
        out[name] = base
        out[name + "_0d"] = np.array(base.flat[3])
        out[name + "_nc"] = base[:, ::2, 1:]            # not contiguous
        out[name + "_f"] = np.asfortranarray(base)      # Fortran order
        if np.dtype(dt).itemsize > 1:
            out[name + "_swapped"] = base.astype(np.dtype(dt).newbyteorder(">" if np.little_endian else "<"))
    return out


class NumpyData(torch.utils.data.Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return {"img": torch.full((3,), float(i)), "meta": _arrays(i), "name": f"s{i}"}


def _same(a, b, path="batch"):
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.dtype.byteorder == b.dtype.byteorder, (path, a.dtype, b.dtype)
        assert a.shape == b.shape and a.strides == b.strides, (path, a.shape, b.shape, a.strides, b.strides)
        assert a.tobytes() == b.tobytes(), path
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            _same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for j, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{j}]")
    else:
        assert a == b, path


def _plain(ctx, workers):
    return list(DataLoader(NumpyData(), batch_size=2, collate_fn=list, num_workers=workers,
                           multiprocessing_context=ctx if workers else None))


@pytest.mark.parametrize("ctx,workers", [(None, 0), ("fork", 2), ("spawn", 2)])
def test_packed_batches_keep_numpy_arrays(ctx, workers):
    plain = _plain(ctx, workers)
    assert type(plain[0][0]["meta"]["float64"]) is np.ndarray
    pc = m.PackedCollate(list, arena_bytes=4 << 20)
    mc = ctx if workers else None
    dl = DataLoader(NumpyData(), batch_size=2, collate_fn=pc, num_workers=workers, multiprocessing_context=mc,
                    persistent_workers=workers > 0)
    _same(plain, [b.to("cpu") for b in dl])
    _same(plain, [b.unpack() for b in dl])
    _same(plain, list(m.PrefetchLoader(dl, "cpu")))


def test_plain_prefetch_loader_keeps_numpy_arrays():
    plain = _plain(None, 0)
    dl = DataLoader(NumpyData(), batch_size=2, collate_fn=list)
    _same(plain, list(m.PrefetchLoader(dl, "cpu")))


def _native(d):
    return {k: v for k, v in d.items() if not k.endswith("_swapped")}


class NativeData(NumpyData):
    def __getitem__(self, i):
        s = super().__getitem__(i)
        s["meta"] = _native(s["meta"])
        return s


@pytest.mark.parametrize("packed", [False, True])
def test_numpy_to_tensors_converts(packed):
    plain = list(DataLoader(NativeData(), batch_size=2, collate_fn=list))
    collate = m.PackedCollate(list, arena_bytes=4 << 20) if packed else list
    dl = DataLoader(NativeData(), batch_size=2, collate_fn=collate, num_workers=2 if packed else 0,
                    multiprocessing_context="fork" if packed else None)
    ways = [list(m.PrefetchLoader(dl, "cpu", numpy_to_tensors=True))]
    if packed:
        ways.append([b.to("cpu", numpy_to_tensors=True) for b in dl])
        ways.append([b.unpack("cpu", numpy_to_tensors=True) for b in dl])
    for got in ways:
        for pb, gb in zip(plain, got):
            for ps, gs in zip(pb, gb):
                assert type(gs["img"]) is torch.Tensor
                for k, a in ps["meta"].items():
                    t = gs["meta"][k]
                    assert type(t) is torch.Tensor, k
                    assert torch.equal(t, torch.from_numpy(a.copy(order="C"))), k
    with pytest.raises(TypeError, match="numpy_to_tensors"):
        m.PrefetchLoader(dl, "cpu", numpy_to_tensors="yes")


def test_start_copy_still_converts_numpy():
    out = m.start_copy({"a": np.arange(3), "b": np.array(2.5)}, "cpu").get()
    assert type(out["a"]) is torch.Tensor and type(out["b"]) is torch.Tensor
    assert torch.equal(out["a"], torch.arange(3))
