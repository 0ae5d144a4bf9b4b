"""Data shared by the Lightning and accelerate tests: a map-style dataset of nested samples of
small variable-size tensors whose content is a function of the index, a collate function that
keeps the ragged parts as lists, and the check that the batches a model saw are, bitwise, the
batches of the indices they carry."""
from __future__ import annotations

import time

import torch

from conftest import assert_tree_bitwise


class NestedSamples(torch.utils.data.Dataset):
    """Sample i: a fixed-size feature, an index, and a ragged list of small tensors of mixed
    dtypes (sizes depend on i), all derived from a generator seeded with i."""

    def __init__(self, n: int = 24) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(1000 + i)
        return {
            "idx": torch.tensor(i),
            "x": torch.randn(8, generator=g),
            "boxes": [torch.randn(1 + (i + k) % 4, 7, generator=g) for k in range(3)],
            "labels": torch.randint(0, 1 << 30, (1 + i % 5,), generator=g, dtype=torch.int64),
            "mask": torch.rand(3, 5, generator=g) > 0.5,
            "name": f"sample{i}",
        }


class SlowLoading:
    """Mixin for a map-style dataset taking ``(n)``: each sample takes ``sample_s`` to load (a
    data-bound loop when the step is quick). ``class Slow(SlowLoading, Dataset)``."""

    def __init__(self, n: int, sample_s: float) -> None:
        super().__init__(n)  # type: ignore[call-arg]
        self.sample_s = sample_s

    def __getitem__(self, i: int) -> dict:
        time.sleep(self.sample_s)
        return super().__getitem__(i)  # type: ignore[misc]


def collate(samples: list) -> dict:
    """default_collate for the fixed-size leaves, lists for the ragged ones."""
    stack = torch.utils.data.default_collate
    return {
        "idx": stack([s["idx"] for s in samples]),
        "x": stack([s["x"] for s in samples]),
        "boxes": [s["boxes"] for s in samples],
        "labels": [s["labels"] for s in samples],
        "mask": stack([s["mask"] for s in samples]),
        "name": [s["name"] for s in samples],
    }


def snapshot(batch: dict) -> dict:
    """A CPU copy of what a step received (the step's tensors may be views of reused memory)."""
    def cpu(x):
        if isinstance(x, torch.Tensor):
            return x.detach().to("cpu", copy=True)
        if isinstance(x, list):
            return [cpu(v) for v in x]
        if isinstance(x, dict):
            return {k: cpu(v) for k, v in x.items()}
        return x
    return cpu(batch)


def record(batch) -> tuple:
    """What a step received: its type, the devices of its tensors, and a CPU copy."""
    return type(batch), set(_devices(batch)), snapshot(batch)


def check_seen(seen: list, device: torch.device, dataset: NestedSamples, expect_indices: list,
               epochs: int) -> None:
    """Every batch a step received (``record``) was the collated dict with every tensor on
    ``device``, bitwise equal to the collate of the samples its indices name; over the epochs
    the indices are each of ``expect_indices`` exactly ``epochs`` times."""
    assert seen, "the model saw no batch"
    if device.type == "cuda" and device.index is None:  # accelerate's torch.device("cuda")
        device = torch.device("cuda", torch.cuda.current_device())
    indices = []
    for k, (kind, devices, batch) in enumerate(seen):
        assert kind is dict, f"step {k} got a {kind.__name__}, not the collated dict"
        assert devices == {device}, f"step {k}: tensors on {devices}, expected {device}"
        idx = batch["idx"].tolist()
        indices += idx
        assert_tree_bitwise(batch, collate([dataset[i] for i in idx]), f"step{k}")
    assert sorted(indices) == sorted(list(expect_indices) * epochs)


def _devices(tree) -> list:
    if isinstance(tree, torch.Tensor):
        return [tree.device]
    if isinstance(tree, dict):
        return [d for v in tree.values() for d in _devices(v)]
    if isinstance(tree, list):
        return [d for v in tree for d in _devices(v)]
    return []
