"""Where the tensors a packed batch lands in (one per dtype of its chunk) come from: torch's allocator through the C shim, called with the
GIL released (stats: ``unpack_chunks_shim``), or ``torch.empty`` from Python where the shim is
missing or switched off, and for the first chunk on each CUDA device (``unpack_chunks_python``):
the slow path is counted, never silent. The values are the same either way."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import mtc_loader
from conftest import requires_cuda, run_child
from mtc_loader import _engine

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

SHIM = _engine._shim_parts()
OFFERED = bool(SHIM.get("wrap")) and _engine._shim_info()[0]
needs_shim = pytest.mark.skipif(not OFFERED, reason="this torch has no AOTInductor C shim with torch's wrapper")


class Samples(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> dict:
        return {"image": torch.full((3, 8, 8), i, dtype=torch.uint8), "boxes": torch.arange(4.0) + i,
                "meta": {"id": torch.tensor(i), "flag": torch.tensor(i % 2 == 0)}}


# a batch of Samples lands in one tensor per dtype: uint8, float32, int64, bool
GROUPS = 4


def _want(i: int) -> dict:
    return Samples()[i]


def _chunks() -> tuple[int, int]:
    s = mtc_loader.stats()
    return s["unpack_chunks_shim"], s["unpack_chunks_python"]


@needs_shim
@pytest.mark.parametrize("workers", [0, 2])
def test_chunks_come_from_the_shim_on_the_cpu(workers):
    dl = DataLoader(Samples(), batch_size=3, num_workers=workers,
                    collate_fn=mtc_loader.PackedCollate(list, arena_bytes=4 << 20))
    shim0, py0 = _chunks()
    got = [s for batch in mtc_loader.PrefetchLoader(dl, "cpu") for s in batch]
    shim1, py1 = _chunks()
    assert (shim1 - shim0, py1 - py0) == (4 * GROUPS, 0)  # one tensor per dtype of a batch, none from Python
    assert len(got) == 12
    for i, s in enumerate(got):
        w = _want(i)
        assert torch.equal(s["image"], w["image"]) and torch.equal(s["boxes"], w["boxes"])
        assert s["meta"]["id"].item() == i and s["meta"]["flag"].item() == (i % 2 == 0)
        assert s["image"].dtype == torch.uint8 and s["meta"]["flag"].dtype == torch.bool
    # the chunks are torch's own: writable, freed with their last view
    got[0]["boxes"].add_(1)
    assert torch.equal(got[0]["boxes"], torch.arange(4.0) + 1)


_CHILD = """
import json, torch, mtc_loader
pc = mtc_loader.PackedCollate(list, arena_bytes=1 << 20)
before = mtc_loader.stats()
out = pc([{"a": torch.arange(5.0), "b": torch.ones(3, dtype=torch.bool)}]).unpack("cpu")
after = mtc_loader.stats()
print(json.dumps({k: after[k] - before[k] for k in ("unpack_chunks_shim", "unpack_chunks_python")}
                 | {"ok": bool(torch.equal(out[0]["a"], torch.arange(5.0)) and bool(out[0]["b"].all()))}))
"""


def test_without_the_shim_the_chunks_from_python_are_counted():
    off = run_child(_CHILD, MTC_TORCH_SHIM="0")
    # two dtypes (float32, bool): two tensors
    assert off == {"unpack_chunks_shim": 0, "unpack_chunks_python": 2, "ok": True}
    if OFFERED:
        assert run_child(_CHILD) == {"unpack_chunks_shim": 2, "unpack_chunks_python": 0, "ok": True}


@pytest.mark.cuda
@requires_cuda
@needs_shim
def test_chunks_come_from_the_shim_on_cuda_after_the_first():
    """On a CUDA device the first chunk is made by torch.empty from Python (torch initialises the
    device as a Python caller expects), every later one through the shim, from the caching
    allocator on the copy stream."""
    dl = DataLoader(Samples(), batch_size=3, num_workers=2,
                    collate_fn=mtc_loader.PackedCollate(list, arena_bytes=4 << 20))
    shim0, py0 = _chunks()
    got = [s for batch in mtc_loader.PrefetchLoader(dl, "cuda") for s in batch]
    torch.cuda.synchronize()
    shim1, py1 = _chunks()
    assert py1 - py0 <= GROUPS and shim1 - shim0 >= 3 * GROUPS, (shim1 - shim0, py1 - py0)
    for i, s in enumerate(got):
        w = _want(i)
        assert s["image"].is_cuda and torch.equal(s["image"].cpu(), w["image"])
        assert torch.equal(s["boxes"].cpu(), w["boxes"]) and s["meta"]["id"].item() == i
    # a second loader on the same device: every chunk through the shim
    shim0, py0 = _chunks()
    n = sum(1 for _ in mtc_loader.PrefetchLoader(dl, "cuda"))
    shim1, py1 = _chunks()
    assert n == 4 and (shim1 - shim0, py1 - py0) == (4 * GROUPS, 0)
