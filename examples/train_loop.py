"""A small training loop on the DataLoader path: PackedCollate in the workers, PrefetchLoader in
the main process.

Every sample holds a small multi-camera image and the meta-data of a multi-camera 3D detection
pipeline (per camera: 2D boxes, class ids, an "active" mask, depths and a projection matrix;
per sample: 3D boxes, class ids, an "active" mask), i.e. 33 tensors of varying shape that cannot
be stacked. The DataLoader workers pack each batch of 16 samples (528 meta-data tensors plus the
images) into one region of a shared arena, and ``PrefetchLoader`` moves the next batches to the
device while the model trains on the current one.

The model is a tiny MLP over per-sample features pooled from the images and the 2D boxes; it
regresses the mean 3D box and the number of active objects, i.e. the loss reads the meta-data
on the device.

Run it with::

    python3 examples/train_loop.py [--steps N] [--workers N] [--device cpu|cuda]

It uses ``cuda`` when a GPU is available and the CPU otherwise, prints the loss and the time the
main thread spent waiting for each batch, and exits 0.
"""
from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import mtc_loader

NUM_CAMERAS = 6
NUM_CLASSES = 10
IMAGE_SIZE = 16  # per camera, (3, 16, 16)


class MultiCameraSamples(Dataset):
    """Deterministic synthetic samples: sample i is the same in every worker and every epoch."""

    def __init__(self, n: int = 256):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(i)

        def count(lo: int, hi: int) -> int:
            return int(torch.randint(lo, hi + 1, (1,), generator=g))

        cams = []
        for _ in range(NUM_CAMERAS):
            n = count(10, 120)
            cams.append({
                "bounding_boxes": torch.rand(n, 4, generator=g),                      # (N, 4) f32
                "class_ids": torch.randint(0, NUM_CLASSES, (n,), generator=g),        # (N,) i64
                "active": torch.rand(n, generator=g) > 0.5,                            # (N,) bool
                "depths": torch.rand(n, generator=g) * 80.0,                           # (N,) f32
                "proj_mat": torch.rand(3, 4, generator=g),                             # (3, 4) f32
            })
        n = count(10, 120)
        active = torch.rand(n, generator=g) > 0.5
        boxes_3d = torch.rand(n, 7, generator=g)
        # the images carry a little of the answer, so that there is something to learn
        image = torch.rand(NUM_CAMERAS, 3, IMAGE_SIZE, IMAGE_SIZE, generator=g) * 0.5
        image += boxes_3d.mean(0)[:3].view(1, 3, 1, 1) * 0.5
        return {
            "image": image,
            "cams_gt": cams,
            "gt_data": {
                "bounding_boxes_3d": boxes_3d,                                         # (N, 7) f32
                "class_ids": torch.randint(0, NUM_CLASSES, (n,), generator=g),        # (N,) i64
                "active": active,                                                      # (N,) bool
            },
        }


def sample_features(sample: dict) -> torch.Tensor:
    """Per-sample features on the sample's device: the image pooled to 2x2 per camera, and per
    camera the mean active 2D box, the mean depth and the active-object fraction."""
    img = nn.functional.adaptive_avg_pool2d(sample["image"], 2).flatten()     # 6 * 3 * 4 = 72
    per_cam = []
    for cam in sample["cams_gt"]:
        w = cam["active"].to(torch.float32)
        denom = w.sum().clamp(min=1.0)
        box = (cam["bounding_boxes"] * w[:, None]).sum(0) / denom                # 4
        depth = (cam["depths"] * w).sum(0, keepdim=True) / denom / 80.0         # 1
        frac = w.mean().view(1)                                                 # 1
        per_cam.append(torch.cat([box, depth, frac]))
    return torch.cat([img, torch.cat(per_cam)])                                 # 72 + 36 = 108


def sample_target(sample: dict) -> torch.Tensor:
    """What the model regresses: the mean active 3D box and the fraction of active objects."""
    gt = sample["gt_data"]
    w = gt["active"].to(torch.float32)
    mean_box = (gt["bounding_boxes_3d"] * w[:, None]).sum(0) / w.sum().clamp(min=1.0)
    return torch.cat([mean_box, w.mean().view(1)])                              # 8


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=24, help="training steps (default 24)")
    ap.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    args = ap.parse_args()

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    print(f"device: {device}" + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else
                                 " (no CUDA GPU found)" if args.device is None else ""))
    torch.manual_seed(0)

    collate = mtc_loader.PackedCollate(list)  # keeps samples separate, packs every tensor
    loader = DataLoader(MultiCameraSamples(), batch_size=args.batch_size, shuffle=True,
                        num_workers=args.workers, collate_fn=collate,
                        persistent_workers=args.workers > 0, drop_last=True)

    model = nn.Sequential(nn.Linear(108, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    model.to(device)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)

    prefetcher = mtc_loader.PrefetchLoader(loader, device, depth=2)  # iterate it once per epoch
    step, waits, first_loss, loss_value = 0, [], None, float("nan")
    t_start = time.perf_counter()
    while step < args.steps:
        batches = iter(prefetcher)
        while step < args.steps:
            t0 = time.perf_counter()
            try:
                batch = next(batches)  # already on `device` (stream-ordered on CUDA)
            except StopIteration:
                break  # end of the epoch
            wait_ms = (time.perf_counter() - t0) * 1e3

            feats = torch.stack([sample_features(s) for s in batch])
            target = torch.stack([sample_target(s) for s in batch])
            loss = nn.functional.mse_loss(model(feats), target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

            loss_value = loss.item()  # synchronizes: the step is done
            first_loss = loss_value if first_loss is None else first_loss
            waits.append(wait_ms)
            step += 1
            n_tensors = sum(1 + len(s["cams_gt"]) * 5 + 3 for s in batch)
            print(f"step {step:3d}  loss {loss_value:.5f}  main thread waited {wait_ms:7.3f} ms for the "
                  f"batch ({n_tensors} tensors)")
        del batches

    total = time.perf_counter() - t_start
    waits_sorted = sorted(waits[1:] or waits)  # the first batch includes the workers' start-up
    median = waits_sorted[len(waits_sorted) // 2]
    print(f"{step} steps in {total:.2f} s; loss {first_loss:.5f} -> {loss_value:.5f}; main thread per "
          f"batch: median {median:.3f} ms, max {waits_sorted[-1]:.3f} ms (after the first batch)")
    s = collate.stats()
    print(f"arena: {s['bytes'] >> 20} MiB, high water {s['high_water_slots'] * s['slot_bytes'] >> 10} KiB, "
          f"waits for room: {s['waits']}")
    print(packed_note(s["allocs"], step, args.workers, loader.prefetch_factor, prefetcher.depth))
    return 0


def packed_note(packed: int, steps: int, workers: int, prefetch_factor: int | None, depth: int) -> str:
    """Why more batches were packed than the loop trained on: the pipeline runs ahead of it."""
    ahead = packed - steps
    if ahead <= 0:
        return f"{packed} batches packed for {steps} steps"
    queue = (f"the DataLoader's {workers} workers keep up to {workers * prefetch_factor} ready "
             f"(prefetch_factor {prefetch_factor} each)" if workers else "the DataLoader has no workers")
    return (f"{packed} batches packed for {steps} steps: the last {ahead} were packed ahead of the loop "
            f"and not trained on when it stopped ({queue}; PrefetchLoader holds up to {depth}, its depth)")


if __name__ == "__main__":
    raise SystemExit(main())
