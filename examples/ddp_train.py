"""Data-parallel training with mtc_loader: one process per GPU, each with its own loader.

Run it with torchrun, one process per GPU (or two CPU processes with gloo, no GPU needed)::

    torchrun --nproc_per_node=2 examples/ddp_train.py [--epochs 3] [--workers 2] [--batch-size 8]
    torchrun --nproc_per_node=2 examples/ddp_train.py --device cpu

Every rank does what a single-GPU loop does, on its share of the data:

- ``torch.cuda.set_device(local_rank)`` first, so that ``"cuda"`` means this rank's GPU from then
  on: the model, DistributedDataParallel, and ``PrefetchLoader(loader, device="cuda")`` all follow
  the current device, so each rank copies to its own GPU (with its own transfer thread and arena);
- a ``DistributedSampler`` gives the rank its indices (``set_epoch(epoch)`` reshuffles per epoch);
- the DataLoader's workers pack each batch into a shared arena (``PackedCollate()`` around torch's
  default collate: the samples here have fixed shapes; for samples whose tensors vary in length
  use ``PackedCollate(list)``, see examples/train_loop.py), and ``PrefetchLoader`` copies the next
  batches to the GPU while the model trains.

Each sample holds its own index, so each rank can check its batches: every batch of an epoch is
kept until the epoch ends (which also shows that no batch's memory is reused while it is still
referenced), then compared bitwise with what the dataset returns for the indices the sampler
gave this rank. Each rank prints its samples/s per epoch (the check is not timed) and
``rank R: N batches OK``; a rank that finds a mismatch prints it and exits with status 1.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler, default_collate

import mtc_loader

NUM_CAMERAS = 6
OBJECTS = 16      # per camera (fixed, so that default_collate can stack them)
IMAGE_SIZE = 64   # per camera, 3 x 64 x 64 uint8


class CameraSamples(Dataset):
    """Deterministic synthetic samples: sample i is the same in every rank, worker and epoch."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(i)
        cams = [{
            "boxes": torch.rand(OBJECTS, 4, generator=g),                  # (16, 4) f32
            "depths": torch.rand(OBJECTS, generator=g) * 80.0,             # (16,) f32
            "active": torch.rand(OBJECTS, generator=g) > 0.5,              # (16,) bool
            "proj_mat": torch.rand(3, 4, generator=g),                     # (3, 4) f32
        } for _ in range(NUM_CAMERAS)]
        images = torch.randint(0, 256, (NUM_CAMERAS, 3, IMAGE_SIZE, IMAGE_SIZE), dtype=torch.uint8, generator=g)
        return {"index": torch.tensor(i), "images": images, "cams": cams}


class Model(nn.Module):
    """A small conv net over the camera images; it predicts each camera's mean active depth."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(),
                                 nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 1))

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # (B, 6, 3, H, W) uint8 -> (B, 6)
        b = images.shape[0]
        return self.net(images.flatten(0, 1).float() / 255.0).view(b, NUM_CAMERAS)


def target(batch: dict[str, Any]) -> torch.Tensor:
    """The meta-data, read on the device: each camera's mean depth over its active objects."""
    per_cam = []
    for cam in batch["cams"]:
        w = cam["active"].float()
        per_cam.append((cam["depths"] * w).sum(1) / w.sum(1).clamp(min=1.0) / 80.0)
    return torch.stack(per_cam, 1)


def leaves(data: Any, path: str = "batch") -> Iterator[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` for every tensor in a nested dict / list, e.g. ``batch['cams'][2]['boxes']``."""
    if isinstance(data, torch.Tensor):
        yield path, data
    elif isinstance(data, dict):
        for k, v in data.items():
            yield from leaves(v, f"{path}[{k!r}]")
    elif isinstance(data, (list, tuple)):
        for i, v in enumerate(data):
            yield from leaves(v, f"{path}[{i}]")


def check_batch(ds: Dataset, batch: Any, indices: list[int], device: torch.device) -> list[str]:
    """Mismatches between a received batch and the dataset's samples at ``indices`` (none: [])."""
    expected = list(leaves(default_collate([ds[i] for i in indices])))
    got = list(leaves(batch))
    if [p for p, _ in got] != [p for p, _ in expected]:
        return [f"structure differs: {[p for p, _ in got]} != {[p for p, _ in expected]}"]
    errors = []
    for (path, want), (_, have) in zip(expected, got):
        if have.device != device:
            errors.append(f"{path} is on {have.device}, not {device}")
        elif have.dtype != want.dtype or have.shape != want.shape or not torch.equal(have.cpu(), want):
            errors.append(f"{path} differs from the dataset's samples {indices}")
    return errors


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--samples", type=int, default=512, help="dataset size, split over the ranks (default 512)")
    ap.add_argument("--batch-size", type=int, default=8, help="per rank (default 8)")
    ap.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank (default 2)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()

    # torchrun sets RANK, LOCAL_RANK and WORLD_SIZE; one process per GPU
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)           # "cuda" now means this rank's GPU
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)                            # the same initial weights on every rank

    ds = CameraSamples(args.samples)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0)
    # The arena holds every batch in flight: workers * prefetch_factor + 1, + depth on a GPU
    # (~0.5 MB each here); 16 MiB leaves ample room.
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        collate_fn=mtc_loader.PackedCollate(arena_bytes=16 << 20),
                        persistent_workers=args.workers > 0)
    batches = mtc_loader.PrefetchLoader(loader, device=args.device, depth=2)  # "cuda": the current device

    model = Model().to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    n_ok, errors = 0, []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        indices = list(sampler)  # this rank's indices for the epoch, in the order the loader uses them
        received = []
        t0 = time.perf_counter()
        for batch in batches:
            loss = nn.functional.mse_loss(model(batch["images"]), target(batch))
            opt.zero_grad(set_to_none=True)
            loss.backward()  # DDP all-reduces the gradients over the ranks
            opt.step()
            received.append(batch)  # kept to the epoch's end: no batch's memory may be reused under it
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        n_samples = sum(len(b["index"]) for b in received)
        print(f"rank {rank} ({device}): epoch {epoch}: {len(received)} batches, "
              f"{n_samples / elapsed:.0f} samples/s, loss {loss.item():.4f}", flush=True)

        for k, batch in enumerate(received):  # the check, outside the timed loop
            want = indices[k * args.batch_size:(k + 1) * args.batch_size]
            errs = check_batch(ds, batch, want, device)
            errors += [f"epoch {epoch} batch {k}: {e}" for e in errs]
            n_ok += not errs
        if len(received) != len(loader):
            errors.append(f"epoch {epoch}: {len(received)} batches received, len(loader) is {len(loader)}")

    for e in errors[:10]:
        print(f"rank {rank}: MISMATCH {e}", file=sys.stderr, flush=True)
    print(f"rank {rank}: {n_ok} batches OK" + (f", {len(errors)} mismatches" if errors else ""), flush=True)
    failed = torch.tensor([len(errors)], device=device)
    dist.all_reduce(failed)  # every rank learns whether any rank failed
    if rank == 0:
        print("all ranks OK" if failed.item() == 0 else f"{int(failed.item())} mismatches over the ranks", flush=True)
    del batches, loader
    dist.destroy_process_group()
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
