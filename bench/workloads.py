"""Deterministic workload builders for the mtc_loader benchmarks.

Every builder takes a seed and returns the same data for the same arguments. All tensors are
ordinary (pageable) CPU tensors; the benchmark moves them elsewhere itself when it needs GPU
sources.

Workloads (named as in shared/MEASURED.md):

- ``seed_batch(n_samples, seed)``: the multi-camera detection meta-data of the reference example
  (a list of per-sample dicts of many small, variable-size tensors). 16 samples ("seed16") give
  528 tensors and about 150 KB; "seed4" and "seed64" scale the batch.
- ``uniform(n, nbytes, seed)``: ``n`` float32 tensors of ``nbytes`` bytes each
  ("4096x64B", "256x64KB", "16x16MB").

Helpers: ``count_tensors`` (tensor count and bytes of a nested structure), ``tree_map`` (a
generic recursive map over list / tuple / dict) and ``to_numpy`` (the same structure with numpy
arrays as leaves).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import torch

NUM_CAMERAS = 6
NUM_CLASSES = 10

# Objects visible per camera image and ground-truth objects per sample. Together these span the
# 10..120 objects of the reference example; the means (37 visible, 82 GT) make a 16-sample batch
# about 150 KB, the size of the reference batch measured in shared/MEASURED.md.
VISIBLE_PER_CAM_RANGE = (10, 64)
GT_PER_SAMPLE_RANGE = (45, 120)


def _randint(gen: torch.Generator, low: int, high: int) -> int:
    """One integer drawn uniformly from ``[low, high]`` (both inclusive)."""
    return int(torch.randint(low, high + 1, (1,), generator=gen).item())


def _camera(gen: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """One camera's 2D ground truth with ``n`` visible objects."""
    return {
        "bounding_boxes": torch.rand(n, 4, generator=gen),
        "class_ids": torch.randint(0, NUM_CLASSES, (n,), generator=gen),
        "active": torch.randint(0, 2, (n,), generator=gen, dtype=torch.bool),
        "depths": torch.rand(n, generator=gen) * 80.0,
        "proj_mat": torch.rand(3, 4, generator=gen),
    }


def _gt_data(gen: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    """One sample's 3D ground truth with ``n`` objects."""
    return {
        "bounding_boxes_3d": torch.rand(n, 7, generator=gen),
        "class_ids": torch.randint(0, NUM_CLASSES, (n,), generator=gen),
        "active": torch.randint(0, 2, (n,), generator=gen, dtype=torch.bool),
    }


def seed_sample(gen: torch.Generator) -> dict[str, Any]:
    """One sample: 6 camera dicts (``"cams_gt"``) and the 3D ground truth (``"gt_data"``).

    33 tensors: 5 per camera and 3 for the 3D ground truth.
    """
    cams = [_camera(gen, _randint(gen, *VISIBLE_PER_CAM_RANGE)) for _ in range(NUM_CAMERAS)]
    gt = _gt_data(gen, _randint(gen, *GT_PER_SAMPLE_RANGE))
    return {"cams_gt": cams, "gt_data": gt}


def seed_batch(n_samples: int = 16, seed: int = 0) -> list[dict[str, Any]]:
    """A batch of ``n_samples`` per-sample meta-data dicts (33 tensors per sample).

    Parameters
    ----------
    n_samples:
        Batch size: 16 is the reference batch ("seed16": 528 tensors, ~150 KB).
    seed:
        Seed of the private generator: the same arguments give the same batch.
    """
    gen = torch.Generator().manual_seed(seed)
    return [seed_sample(gen) for _ in range(n_samples)]


def uniform(n: int, nbytes: int, seed: int = 0) -> list[torch.Tensor]:
    """``n`` float32 CPU tensors of ``nbytes`` bytes each (``nbytes`` a multiple of 4)."""
    if nbytes % 4:
        raise ValueError(f"nbytes must be a multiple of 4 (float32), got {nbytes}")
    gen = torch.Generator().manual_seed(seed)
    return [torch.rand(nbytes // 4, generator=gen) for _ in range(n)]


def tree_map(fn: Callable[[Any], Any], data: Any) -> Any:
    """Apply ``fn`` to every tensor / ndarray leaf of a list / tuple / dict structure.

    Container types are kept (list, tuple, dict); other leaves are returned unchanged. This is
    the generic recursive map a user would write around ``tensor.to(device)``.
    """
    if isinstance(data, (torch.Tensor, np.ndarray)):
        return fn(data)
    if isinstance(data, dict):
        return {k: tree_map(fn, v) for k, v in data.items()}
    if isinstance(data, list):
        return [tree_map(fn, v) for v in data]
    if isinstance(data, tuple):
        return tuple(tree_map(fn, v) for v in data)
    return data


def iter_leaves(data: Any, path: str = "data"):
    """Yield ``(path, leaf)`` for every tensor / ndarray leaf, in traversal order.

    ``path`` spells the leaf's position, e.g. ``data[3]["cams_gt"][2]["depths"]``.
    """
    if isinstance(data, (torch.Tensor, np.ndarray)):
        yield path, data
    elif isinstance(data, dict):
        for k, v in data.items():
            yield from iter_leaves(v, f"{path}[{k!r}]")
    elif isinstance(data, (list, tuple)):
        for i, v in enumerate(data):
            yield from iter_leaves(v, f"{path}[{i}]")


def count_tensors(data: Any) -> tuple[int, int]:
    """Number of tensor / ndarray leaves in ``data`` and their total size in bytes."""
    count = nbytes = 0
    for _, leaf in iter_leaves(data):
        count += 1
        nbytes += int(leaf.nbytes)
    return count, nbytes


def to_numpy(data: Any) -> Any:
    """The same structure with every (CPU) tensor leaf replaced by a numpy array."""
    return tree_map(lambda t: t.numpy() if isinstance(t, torch.Tensor) else t, data)


# The named workloads of shared/MEASURED.md: name -> builder taking a seed.
WORKLOADS: dict[str, Callable[[int], Any]] = {
    "seed16": lambda seed: seed_batch(16, seed),
    "seed4": lambda seed: seed_batch(4, seed),
    "seed64": lambda seed: seed_batch(64, seed),
    "4096x64B": lambda seed: uniform(4096, 64, seed),
    "256x64KB": lambda seed: uniform(256, 64 * 1024, seed),
    "16x16MB": lambda seed: uniform(16, 16 * 1024 * 1024, seed),
}


def machine_speed(iterations: int = 20000) -> float:
    """Seconds for a fixed pure-CPU loop (Python integers, no allocation, no memory traffic): how
    fast the machine's CPU runs right now. On a shared virtual machine it can run markedly slower
    for seconds at a time, which stretches every call timed then, whatever the code."""
    t0 = time.perf_counter()
    s = 0
    for i in range(iterations):
        s += i
    return time.perf_counter() - t0


if __name__ == "__main__":
    for name, build in WORKLOADS.items():
        n, b = count_tensors(build(0))
        print(f"{name:>10}: {n:5d} tensors, {b / 1024:10.1f} KiB")

