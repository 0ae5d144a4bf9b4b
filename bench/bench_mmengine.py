"""Benchmark mmengine's own data path against mtc_loader.mmengine's config switch.

Usage::

    python3 bench/bench_mmengine.py [--device cuda:0] [--workers 4] [--batches N] [--rounds N]
                                    [--batch-size 16] [--step-ms MS] [--out DIR]

The data: the seed workload (bench/workloads.py; batch 16 = 528 tensors, ~150 KB) held in data
samples as an mmdet3d pipeline holds it: per sample a ``BaseDataElement`` subclass whose
``gt_instances_3d`` is an ``InstanceData`` (boxes in a box class that wraps a tensor, registered
with ``mtc_loader.register_container``; labels; flags), one ``BaseDataElement`` per camera (boxes,
class ids, flags, depths, projection matrix) and metainfo (a token, numpy matrices).

Methods, each a ``DataLoader(..., num_workers=W, persistent_workers=True)`` over the same dataset
and the model's data preprocessor called on the main thread as ``model.train_step`` calls it:

- ``mmengine``: ``collate_fn=pseudo_collate`` and mmengine's ``BaseDataPreprocessor``
  (``cast_data``: one ``.to()`` per tensor, ``BaseDataElement.to`` per data element);
- ``mtc_packed``: ``collate_fn=mtc_packed_collate`` and ``MTCDataPreprocessor`` (the batch is
  unpacked on the main thread: one DMA from the arena);
- ``mtc_prefetch``: the whole config switch: also ``MTCEpochBasedTrainLoop``'s prefetching (the
  batch is copied by the prefetch thread; the main thread takes it and the preprocessor passes
  it through).

Timed per batch on the main thread: the loader's ``__next__`` plus the preprocessor call (wall,
``main_ms``, and CPU time, ``main_cpu_ms``), as bench_loader.py times it; then the device is
synchronized and an optional simulated training step runs (``--step-ms``: a calibrated GPU
kernel, a sleep on the CPU) so that the workers and the prefetch thread run ahead. One warm-up
epoch per method (its batches checked bitwise against mmengine's), then ``--rounds`` epochs,
methods interleaved. Reported: median over rounds of the per-epoch mean, without each epoch's
first batch (``main_steady_ms``), and the ratio ``mmengine / method``. Targets: ``mtc_prefetch``
at least 30x mmengine's own path and under 0.5 ms of main thread per batch.
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
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_loader import machine_info, run_epoch  # noqa: E402
from workloads import seed_sample  # noqa: E402

import mtc_loader  # noqa: E402

with warnings.catch_warnings():  # mmengine's imports warn (torch.jit.script is deprecated)
    warnings.simplefilter("ignore")
    from mmengine.dataset import pseudo_collate
    from mmengine.model import BaseDataPreprocessor
    from mmengine.structures import BaseDataElement, InstanceData

    import mtc_loader.mmengine as mm

TARGET_RATIO = 30.0
TARGET_MAIN_MS = 0.5
METHODS = ["mmengine", "mtc_packed", "mtc_prefetch"]


class Boxes3D:
    """A LiDARInstance3DBoxes-like box class: an (N, 7) tensor plus plain fields."""

    def __init__(self, tensor: torch.Tensor, box_dim: int = 7, with_yaw: bool = True):
        self.tensor, self.box_dim, self.with_yaw = tensor, box_dim, with_yaw

    def __len__(self) -> int:
        return int(self.tensor.shape[0])

    def to(self, *args: Any, **kwargs: Any) -> "Boxes3D":
        return Boxes3D(self.tensor.to(*args, **kwargs), self.box_dim, self.with_yaw)


def _boxes_flatten(b: Boxes3D) -> tuple[list[Any], Any]:
    return [b.tensor], (b.box_dim, b.with_yaw)


def _boxes_unflatten(values: list[Any], context: Any) -> Boxes3D:
    b = Boxes3D.__new__(Boxes3D)
    b.tensor, (b.box_dim, b.with_yaw) = values[0], context
    return b


mtc_loader.register_container(Boxes3D, _boxes_flatten, _boxes_unflatten)


class DetSample(BaseDataElement):
    """A Det3DDataSample-like data sample."""


def data_sample(i: int) -> dict:
    """Seed sample ``i`` held in data samples: 33 tensors, as in bench_loader's SeedSamples."""
    s = seed_sample(torch.Generator().manual_seed(i))
    gt = s["gt_data"]
    inst = InstanceData()
    inst.bboxes_3d = Boxes3D(gt["bounding_boxes_3d"])
    inst.labels_3d = gt["class_ids"]
    inst.active = gt["active"]
    ds = DetSample(metainfo={"token": f"sample{i}", "lidar2img": np.eye(4)[None].repeat(6, 0) * i})
    ds.gt_instances_3d = inst
    for k, cam in enumerate(s["cams_gt"]):
        setattr(ds, f"cam{k}", BaseDataElement(**cam))
    return {"inputs": {}, "data_samples": ds}


class DetSamples(Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return data_sample(i)


class _PrefetchEpochs:
    """Each epoch through MTCEpochBasedTrainLoop's prefetching."""

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
    if name == "mtc_prefetch":
        return _PrefetchEpochs(dl, device), lambda b: mpre(b, True)
    raise ValueError(name)


def tensors_of(x: Any, out: list) -> list:
    """Every tensor of a batch, in a fixed order (data elements by sorted field name)."""
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, BaseDataElement):
        for k in sorted(x.all_keys()):
            tensors_of(getattr(x, k), out)
    elif isinstance(x, Boxes3D):
        out.append(x.tensor)
    elif isinstance(x, dict):
        for v in x.values():
            tensors_of(v, out)
    elif isinstance(x, (list, tuple)):
        for v in x:
            tensors_of(v, out)
    return out


def make_checker(ds: DetSamples, batch_size: int, device: torch.device) -> Callable[[int, Any], None]:
    pre = BaseDataPreprocessor().to(device)

    def check(k: int, out: Any) -> None:
        ref = tensors_of(pre(pseudo_collate([ds[k * batch_size + j] for j in range(batch_size)])), [])
        got = tensors_of(out, [])
        if len(ref) != len(got) or not all(
                a.device == b.device and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
                for a, b in zip(ref, got)):
            raise AssertionError(f"batch {k}: the model would receive other data than with mmengine's path")
    return check


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--workers", type=int, nargs="+", default=[4])
    ap.add_argument("--batches", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--step-ms", type=float, default=5.0)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    ds = DetSamples(args.batches * args.batch_size)
    n_tensors = len(tensors_of(pseudo_collate([ds[j] for j in range(args.batch_size)]), []))
    print(f"device {device}, batch {args.batch_size} samples ({n_tensors} tensors in data samples), "
          f"{args.batches} batches/epoch, step {args.step_ms} ms, rounds {args.rounds}", flush=True)
    mm.packed_collate.arm(512 << 20)
    results: dict[int, dict[str, Any]] = {}
    for w in args.workers:
        loaders = {m: make_method(m, ds, w, args.batch_size, device) for m in METHODS}
        check = make_checker(ds, args.batch_size, device)
        for m, (it, copy) in loaders.items():  # warm-up epoch, checked
            run_epoch(it, copy, device, args.step_ms / 1e3, check)
        samples: dict[str, list[dict]] = {m: [] for m in METHODS}
        for r in range(args.rounds):
            order = METHODS[r % len(METHODS):] + METHODS[:r % len(METHODS)]
            for m in order:
                it, copy = loaders[m]
                samples[m].append(run_epoch(it, copy, device, args.step_ms / 1e3))
        res = {}
        for m in METHODS:
            ep = samples[m]
            res[m] = {
                "main_ms": statistics.median(sum(e["main_ms"]) / len(e["main_ms"]) for e in ep),
                "main_steady_ms": statistics.median(statistics.mean(e["main_ms"][1:]) for e in ep),
                "main_cpu_steady_ms": statistics.median(statistics.mean(e["main_cpu_ms"][1:]) for e in ep),
                "wall_ms": statistics.median(e["wall_ms"] for e in ep),
                "epochs": ep,
            }
        results[w] = res
        del loaders
    print(f"\n{'workers':>7} {'method':>13} {'main ms':>9} {'steady ms':>10} {'cpu ms':>8} {'wall ms':>8} "
          f"{'x mmengine':>10}")
    ok = True
    for w, res in results.items():
        base = res["mmengine"]["main_steady_ms"]
        for m in METHODS:
            r = res[m]
            ratio = base / r["main_steady_ms"] if r["main_steady_ms"] > 0 else float("inf")
            r["ratio_main_steady"] = ratio
            print(f"{w:>7} {m:>13} {r['main_ms']:>9.3f} {r['main_steady_ms']:>10.3f} "
                  f"{r['main_cpu_steady_ms']:>8.3f} {r['wall_ms']:>8.2f} {ratio:>9.1f}x")
        p = res["mtc_prefetch"]
        met = p["ratio_main_steady"] >= TARGET_RATIO and p["main_steady_ms"] < TARGET_MAIN_MS
        ok &= met
        print(f"target ({w} workers): mtc_prefetch >= {TARGET_RATIO:.0f}x mmengine and < {TARGET_MAIN_MS} ms "
              f"main thread per batch: {p['ratio_main_steady']:.1f}x, {p['main_steady_ms']:.3f} ms -> "
              f"{'met' if met else 'NOT met'}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_mmengine.json")
    with open(path, "w") as f:
        json.dump({"machine": machine_info(device), "config": vars(args), "tensors_per_batch": n_tensors,
                   "results": {str(w): r for w, r in results.items()},
                   "arena": mm.packed_collate.arena.stats() if mm.packed_collate.arena else {}}, f, indent=1)
    print(f"wrote {path}")
    return 0 if ok or device.type != "cuda" else 1


if __name__ == "__main__":
    sys.exit(main())
