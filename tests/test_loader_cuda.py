"""The DataLoader path on CUDA: packed batches DMA'd straight from the registered arena.

Skipped without a GPU; run them on a machine with a GPU whenever csrc/ or a CUDA path changes.
"""
from __future__ import annotations

import gc

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import mtc_loader
from conftest import assert_tree_bitwise, requires_cuda, seed_batch, tree_kept

pytestmark = [pytest.mark.cuda, requires_cuda]


class SeedSamples(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return seed_batch(1, seed=i)[0]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("background", [True, False])
def test_packed_batches_to_cuda(workers, background):
    pc = mtc_loader.PackedCollate(list)
    dl = DataLoader(SeedSamples(), batch_size=16, num_workers=workers, collate_fn=pc)
    for epoch in range(2):
        n = 0
        for k, b in enumerate(mtc_loader.PrefetchLoader(dl, "cuda:0", use_background_thread=background)):
            torch.cuda.current_stream().synchronize()
            ref = [SeedSamples()[16 * k + j] for j in range(16)]
            assert_tree_bitwise(b, tree_kept(ref, "cuda:0"))
            n += 1
        assert n == 4
    del b
    gc.collect()
    torch.cuda.synchronize()
    s = pc.stats()
    assert s["registered"] and s["slots_in_use"] == 0, s


def test_region_freed_only_after_the_dma():
    """The region is freed by a callback after the DMA: with a long kernel queued first, the
    region stays held until the stream reaches the copy."""
    pc = mtc_loader.PackedCollate(list)
    packed = pc([SeedSamples()[i] for i in range(16)])
    torch.cuda._sleep(int(1e9))
    h = mtc_loader.start_copy(packed, "cuda:0")
    out = h.get()
    held_during = pc.stats()["slots_in_use"]
    torch.cuda.synchronize()
    for _ in range(100):
        if pc.stats()["slots_in_use"] == 0:
            break
        torch.cuda._sleep(1000)
        torch.cuda.synchronize()
    assert held_during > 0
    assert pc.stats()["slots_in_use"] == 0
    assert_tree_bitwise(out, tree_kept([SeedSamples()[i] for i in range(16)], "cuda:0"))


def test_default_collate_images_to_cuda():
    class Images(Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            return {"img": torch.rand(3, 64, 64, generator=g), "label": i, "name": f"s{i}"}

    pc = mtc_loader.PackedCollate()
    dl = DataLoader(Images(), batch_size=8, num_workers=2, collate_fn=pc)
    plain = DataLoader(Images(), batch_size=8, num_workers=0)
    for b, ref in zip(mtc_loader.PrefetchLoader(dl, "cuda:0"), plain):
        torch.cuda.synchronize()
        assert_tree_bitwise(b, tree_kept(ref, "cuda:0"))
