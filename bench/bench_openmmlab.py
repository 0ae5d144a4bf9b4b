"""Benchmark mmengine's own data path against mtc_loader.mmengine's config switch on real
mmdet3d / mmdet structures (needs mmcv with its ops, mmdet and mmdet3d: README, "OpenMMLab's
stack").

Usage::

    python3 bench/bench_openmmlab.py [--device cuda:0] [--workers 6] [--batches N] [--rounds N]
                                     [--batch-size 4] [--step-ms MS] [--out DIR]

The sample: what mmdet3d's ``Pack3DDetInputs`` makes of a 6-camera LiDAR frame, with what real
pipelines add: ``inputs`` holds the images ((6, 3, 256, 704) uint8) and the points ((20000, 5)
float32); the ``Det3DDataSample`` holds ``gt_instances_3d`` (``LiDARInstance3DBoxes`` (M, 9),
labels), ``gt_instances`` with the per-camera 2D annotations as lists of tensors (``bboxes``,
``labels``, ``centers_2d``, ``depths``), ``gt_pts_seg`` (a ``PointData``), the ``LiDARPoints`` of
the sweep in a data field, ``eval_ann_info`` (a dict holding boxes), and metainfo with
``lidar2img`` (6, 4, 4) float64 numpy, ``pcd_rotation`` (a tensor), tokens and shapes. No
registration of ours: mtc_loader.mmengine knows these classes.

Methods, each a ``DataLoader(..., num_workers=W, persistent_workers=True)`` over the same dataset,
the model's data preprocessor called on the main thread as ``model.train_step`` calls it:

- ``mmengine``: ``pseudo_collate`` and mmengine's ``BaseDataPreprocessor`` (``cast_data``);
- ``mtc_packed``: ``mtc_packed_collate`` and ``MTCDataPreprocessor`` (one DMA on the main thread);
- ``mtc_prefetch``: also ``MTCEpochBasedTrainLoop``'s prefetching.

Per batch: the main thread's ``__next__`` plus the preprocessor call (wall and CPU), then a
device sync and a training step of ``--step-ms`` (a GPU kernel on CUDA). Also counted, in the main
process: the storages that crossed the worker queue on their own (torch's shared-memory
path: ``rebuild_storage_fd`` / ``rebuild_storage_filename``), per batch. One checked warm-up epoch
per method (what the model receives must equal mmengine's: classes, devices, bytes), then
``--rounds`` epochs, methods interleaved. Reported: the steady per-batch mean (each epoch's first
batch left out; the median over rounds), p50, p99 and max over all steady batches, the ratio to
mmengine's path, and the tensors per batch that crossed on their own. Targets (CUDA): no tensor
crosses on its own with the switch; ``mtc_prefetch`` at least 20x and ``mtc_packed`` at least
3x below mmengine's main-thread time.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import warnings
from typing import Any, Callable

import numpy as np
import torch
import torch.multiprocessing.reductions as _reductions
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_loader import machine_info, run_epoch  # noqa: E402

with warnings.catch_warnings():  # the stack's imports warn (deprecations)
    warnings.simplefilter("ignore")
    from mmdet3d.structures import Det3DDataSample, LiDARInstance3DBoxes, PointData
    from mmdet3d.structures.points import LiDARPoints
    from mmengine.dataset import pseudo_collate
    from mmengine.model import BaseDataPreprocessor
    from mmengine.structures import BaseDataElement, InstanceData

    import mtc_loader.mmengine as mm

METHODS = ["mmengine", "mtc_packed", "mtc_prefetch"]
TARGET_PREFETCH, TARGET_PACKED = 20.0, 3.0
CAMS = 6


def lidar_sample(i: int, height: int = 256, width: int = 704, points: int = 20000) -> dict:
    g = torch.Generator().manual_seed(i)
    m = 5 + i % 20
    ds = Det3DDataSample(metainfo={
        "lidar2img": np.stack([np.eye(4) * (i + k) for k in range(CAMS)]),
        "cam2img": [np.eye(4)[:3] for _ in range(CAMS)],
        "pcd_rotation": torch.eye(3) * (1 + i % 3),
        "pcd_scale_factor": 1.0, "sample_idx": i, "token": f"sample-token-{i:06d}",
        "img_shape": [(height, width)] * CAMS, "box_type_3d": LiDARInstance3DBoxes,
        "img_path": [f"samples/CAM_{k}/{i:06d}.jpg" for k in range(CAMS)],
    })
    gt3 = InstanceData()
    gt3.bboxes_3d = LiDARInstance3DBoxes(torch.rand(m, 9, generator=g), box_dim=9)
    gt3.labels_3d = torch.randint(0, 10, (m,), generator=g)
    ds.gt_instances_3d = gt3
    gt2 = InstanceData()
    per_cam = [1 + (i + k) % 7 for k in range(CAMS)]
    gt2.bboxes = [torch.rand(n, 4, generator=g) for n in per_cam]
    gt2.labels = [torch.randint(0, 10, (n,), generator=g) for n in per_cam]
    gt2.centers_2d = [torch.rand(n, 2, generator=g) for n in per_cam]
    gt2.depths = [torch.rand(n, generator=g) for n in per_cam]
    ds.gt_instances = gt2
    ds.gt_pts_seg = PointData(pts_semantic_mask=torch.randint(0, 16, (points,), dtype=torch.uint8, generator=g))
    ds.lidar_points = LiDARPoints(torch.rand(points // 4, 5, generator=g), points_dim=5,
                                  attribute_dims={"intensity": 3})
    ds.eval_ann_info = {"gt_bboxes_3d": LiDARInstance3DBoxes(torch.rand(m, 9, generator=g), box_dim=9),
                        "gt_labels_3d": np.arange(m)}
    # the images are filled, not drawn (drawing 3.2 M random bytes per sample would make the
    # workers, not the data path, what the main thread waits for)
    img = torch.empty(CAMS, 3, height, width, dtype=torch.uint8)
    for k in range(CAMS):
        img[k].fill_((i * 7 + k) % 256)
    return {"inputs": {"points": torch.rand(points, 5, generator=g), "img": img}, "data_samples": ds}


class LidarSamples(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return lidar_sample(i)


class _PrefetchEpochs:
    def __init__(self, loader: DataLoader, device: torch.device) -> None:
        self.loader, self.device = loader, device

    def __iter__(self) -> Any:
        return mm._loops._Prefetching(self.loader, self.device, 2)


def make_method(name: str, ds: Dataset, workers: int, batch_size: int, device: torch.device) -> tuple[Any, Callable[[Any], Any]]:
    common = dict(batch_size=batch_size, num_workers=workers, persistent_workers=workers > 0)
    if name == "mmengine":
        pre = BaseDataPreprocessor().to(device)
        return DataLoader(ds, collate_fn=pseudo_collate, **common), lambda b: pre(b, True)
    mpre = mm.MTCDataPreprocessor(dict(type="BaseDataPreprocessor")).to(device)
    dl = DataLoader(ds, collate_fn=mm.packed_collate, **common)
    if name == "mtc_packed":
        return dl, lambda b: mpre(b, True)
    return _PrefetchEpochs(dl, device), lambda b: mpre(b, True)


class _Tag(str):
    """Marks a tensor's snapshot (a plain "tensor" string could be an attribute's name)."""


TENSOR = _Tag("tensor")


def snapshot(x: Any) -> Any:
    """Classes, devices and bytes of what the model receives."""
    if isinstance(x, torch.Tensor):
        return (TENSOR, str(x.device), x.dtype, tuple(x.shape), x.detach().cpu())
    if isinstance(x, BaseDataElement):
        return (type(x), sorted(((k, sorted(v) if k in ("_metainfo_fields", "_data_fields") else snapshot(v))
                                 for k, v in vars(x).items()), key=lambda kv: kv[0]))
    if isinstance(x, dict):
        return (type(x), [(k, snapshot(v)) for k, v in x.items()])
    if isinstance(x, (list, tuple)):
        return (type(x), [snapshot(v) for v in x])
    if isinstance(x, np.ndarray):
        return ("ndarray", x.dtype.str, x.shape, x.tobytes())
    if hasattr(x, "__dict__") and type(x).__module__.startswith(("mmdet", "mmcv")):
        return (type(x), sorted((k, snapshot(v)) for k, v in vars(x).items()))
    return x


def same(a: Any, b: Any) -> bool:
    if isinstance(a, tuple) and a and type(a[0]) is _Tag:
        return isinstance(b, tuple) and bool(b) and type(b[0]) is _Tag and a[1:4] == b[1:4] and torch.equal(a[4], b[4])
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def make_checker(ds: LidarSamples, batch_size: int, device: torch.device) -> Callable[[int, Any], None]:
    pre = BaseDataPreprocessor().to(device)

    def check(k: int, out: Any) -> None:
        ref = pre(pseudo_collate([ds[k * batch_size + j] for j in range(batch_size)]), True)
        if not same(snapshot(ref), snapshot(out)):
            raise AssertionError(f"batch {k}: the model would receive other data than with mmengine's path")
    return check


class StorageCount:
    """Counts the storages this process receives through torch's shared-memory path (each tensor
    that crossed the worker queue on its own): torch's rebuild functions are replaced by counting
    ones defined at module level (a worker pickles them by reference, and this process's
    unpickling calls them)."""

    n = 0

    def __init__(self) -> None:
        _ORIGINAL.update(fd=_reductions.rebuild_storage_fd, filename=_reductions.rebuild_storage_filename)
        _reductions.rebuild_storage_fd = _counted_fd
        _reductions.rebuild_storage_filename = _counted_filename


_ORIGINAL: dict[str, Callable[..., Any]] = {}


def _counted_fd(*args: Any) -> Any:
    StorageCount.n += 1
    return _ORIGINAL["fd"](*args)


def _counted_filename(*args: Any) -> Any:
    StorageCount.n += 1
    return _ORIGINAL["filename"](*args)


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--step-ms", type=float, default=20.0)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    ds = LidarSamples(args.batches * args.batch_size)
    counter = StorageCount()
    mm.packed_collate.arm(1 << 30)
    print(f"device {device}, {args.workers} workers, batch {args.batch_size}, {args.batches} batches/epoch, "
          f"step {args.step_ms} ms, rounds {args.rounds}", flush=True)
    loaders = {m: make_method(m, ds, args.workers, args.batch_size, device) for m in METHODS}
    check = make_checker(ds, args.batch_size, device)
    crossed: dict[str, float] = {}
    for m, (it, copy) in loaders.items():  # warm-up epoch, checked, with the storages counted
        before = counter.n
        run_epoch(it, copy, device, args.step_ms / 1e3, check)
        crossed[m] = (counter.n - before) / args.batches
    samples: dict[str, list[dict]] = {m: [] for m in METHODS}
    for r in range(args.rounds):
        for m in METHODS[r % len(METHODS):] + METHODS[:r % len(METHODS)]:
            it, copy = loaders[m]
            samples[m].append(run_epoch(it, copy, device, args.step_ms / 1e3))
    res: dict[str, Any] = {}
    for m in METHODS:
        steady = [x for e in samples[m] for x in e["main_ms"][1:]]
        res[m] = {
            "steady_mean_ms": statistics.median(statistics.mean(e["main_ms"][1:]) for e in samples[m]),
            "p50_ms": percentile(steady, 50), "p99_ms": percentile(steady, 99), "max_ms": max(steady),
            "cpu_ms": statistics.median(statistics.mean(e["main_cpu_ms"][1:]) for e in samples[m]),
            "tensors_crossing_alone_per_batch": crossed[m], "epochs": samples[m],
        }
    base = res["mmengine"]["steady_mean_ms"]
    print(f"\n{'method':>13} {'mean ms':>9} {'p50':>8} {'p99':>8} {'max':>8} {'cpu ms':>8} {'x mmengine':>10} "
          f"{'alone/batch':>11}")
    for m in METHODS:
        r = res[m]
        r["ratio"] = base / r["steady_mean_ms"] if r["steady_mean_ms"] > 0 else float("inf")
        print(f"{m:>13} {r['steady_mean_ms']:>9.3f} {r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f} {r['max_ms']:>8.3f} "
              f"{r['cpu_ms']:>8.3f} {r['ratio']:>9.1f}x {r['tensors_crossing_alone_per_batch']:>11.1f}")
    met = (res["mtc_prefetch"]["ratio"] >= TARGET_PREFETCH and res["mtc_packed"]["ratio"] >= TARGET_PACKED
           and crossed["mtc_packed"] == 0 and crossed["mtc_prefetch"] == 0)
    print(f"targets: mtc_prefetch >= {TARGET_PREFETCH:.0f}x, mtc_packed >= {TARGET_PACKED:.0f}x mmengine's main-thread "
          f"time, no tensor crossing alone: {'met' if met else 'NOT met'}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_openmmlab.json")
    with open(path, "w") as f:
        json.dump({"machine": machine_info(device), "config": vars(args), "results": res}, f, indent=1, default=str)
    print(f"wrote {path}")
    return 0 if met or device.type != "cuda" else 1


if __name__ == "__main__":
    sys.exit(main())
