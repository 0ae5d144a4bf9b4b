"""Benchmark a training loop with real GPU work: how close each loader comes to preloaded data.

Usage::

    python3 bench/bench_train.py [--device cuda:0] [--config launch gpu] [--workers 4]
                                 [--batches N] [--rounds N] [--batch-size 8] [--methods ...]
                                 [--quick] [--out DIR]

The loop: a small conv model trains on the 6 camera images of each sample, and the loss reads
the sample's meta-data on the device. A sample is ``{"images": uint8 (6, 3, H, W), "meta":
seed_sample(...)}`` (bench/workloads.py: 33 small tensors of varying length per sample);
``collate_samples`` stacks the images with torch's ``default_collate`` and keeps the meta-data
per sample (it cannot be stacked), so batch 8 holds 1 image tensor + 264 small tensors. Per step:
the images become float on the device, go through 4 conv/BN/ReLU layers, a pool and a linear
head; the target is made from the meta-data (per camera: the active-weighted sum of the 2D boxes,
the projection matrix, the depths summed per class; per sample: the active-weighted sum of the 3D
boxes, the active objects per class), i.e. ~22 small kernels per sample that read every meta-data
tensor; MSE loss, backward, SGD step. Nothing synchronizes inside the epoch (no ``.item()``), so
the CPU runs ahead of the GPU as in a real loop; the device is synchronized once at the end of
each epoch.

Configurations (``--config``):

- ``launch``: 256x448 images (17 MB per batch), conv width 64: a few ms per step on an H100, and
  launch-bound: the training thread's ~250 kernel launches per step take longer than the GPU's
  work, so every microsecond the loader costs the training thread shows;
- ``launch5``: the ``launch`` images with conv width 16 and a light meta-data target (``meta_sums``:
  about 15 kernels per batch), and workers that make every sample (``__getitem__`` draws the
  meta-data of index i and a new image tensor): the service's CPU per batch shows in full. A
  step of about 4.3 ms on an H100, of which the preloaded loop's training thread spends about
  1.3 ms off the CPU, waiting for its backward with the GIL released (the JSON's
  ``step_off_cpu_ms``): other threads take the GIL in that window at no cost to the loop;
- ``launch4``: the multi-camera loop of a user's report: the ``launch`` images, conv width 16,
  workers that make every sample, the full meta-data target (``meta_targets``: every meta tensor
  read, ~22 kernels per sample) and the forward and loss under bf16 autocast: a step of about
  4 ms on an H200 and 8-11 ms on an H100 host whose launches take more CPU time, launch-bound
  (off the CPU for about 1.3 ms of it), no host sync in the step;
- ``gpu``: 512x896 images (66 MB per batch), width 128: tens of ms per step (about 55 on an
  H100), the GPU is the bottleneck, and what counts is that the copies overlap the kernels.

The ``preloaded step`` line printed per configuration is the step time of the ideal loop.

Methods, each a ``DataLoader(..., num_workers=W, persistent_workers=True, collate_fn=
collate_samples)`` over the same dataset, except ``ideal``:

- ``ideal``: the same loop on one batch preloaded on the device, no loader (the upper bound);
- ``plain``: ``pin_memory=True``, then ``.to(device, non_blocking=True)`` per tensor (a
  recursive tree map);
- ``sidestream``: the apex / timm prefetcher: batch k+1 is copied (``pin_memory=True``,
  ``.to(non_blocking=True)``) on a side stream while step k trains;
  ``current_stream().wait_stream(side)`` and ``record_stream`` on every tensor at hand-out (on
  the CPU there are no streams: it is ``plain``);
- ``start_copy``: ``mtc_loader.start_copy(batch, device).get()`` per step;
- ``prefetch_plain``: ``mtc_loader.PrefetchLoader(loader, device)`` around the plain DataLoader;
- ``packed``: ``collate_fn=mtc_loader.PackedCollate(collate_samples, arena_bytes=...)`` wrapped
  in ``mtc_loader.PrefetchLoader(loader, device)``; the arena holds (workers * prefetch_factor +
  depth + 4) batches;
- ``packed_gil5ms``: ``packed`` with the service's GIL switch interval left at the interpreter's
  (``gil_switch_interval=None``).

The dataset pre-generates a pool of samples (``--pool``, default 4 batches) in ``__init__`` and
serves index i from ``pool[i % pool]``: the images as they are (the collate copies them into a new
tensor anyway) and fresh clones of the small meta-data tensors (a real dataset makes new tensors
per sample; handing out the pool's own tensors would let torch's shared-memory caches skip the
worker-side copy). Serving a sample is cheap, so the workers are not the bottleneck: the figures
measure the path from the workers' collate to the model.

What is timed: per configuration, the model is built and warmed up (``cudnn.benchmark`` picks its
algorithms on the preloaded batch), each method runs one warm-up epoch (workers started, pinned
memory and arenas in place; its first batch is checked bitwise against the dataset), then
``--rounds`` timed epochs, the methods interleaved (one epoch each per round, order rotated between
rounds). The garbage collector stays on, as in a real loop (a collection runs between epochs,
outside the timed region). Per epoch, from ``iter()`` to the synchronization after the last step:

- ``samples/s``: samples / epoch time (median over rounds), and the fraction of ``ideal``'s; the
  ``steady`` variant starts the clock when the first batch is in hand (leaves out the workers'
  resume at the start of an epoch, which a long epoch amortizes);
- ``next ms``: the training thread's time per batch in the method's ``__next__``
  (``time.perf_counter`` around ``next(it)``, which for ``plain`` and ``start_copy`` includes the
  copy calls): the epoch's total / batches, median over rounds; ``steady`` without each epoch's
  first batch; the thread's CPU time (``thread_time``) is in the JSON;
- ``step ms``: the training thread's time per batch in the step (issuing the kernels; it blocks
  only when the launch queue is full or the allocator waits), median over rounds of the mean;
- ``wall ms``: epoch time / batches;
- ``thread ms``: for the PrefetchLoader methods, the CPU time of its prefetch thread per batch
  (``PrefetchLoader.stats()`` over the timed epochs: an upper bound on the GIL it holds).

The JSON also holds, per method (Linux), the training thread's CPU time per step
(``step_cpu_ms``), the step's time off the CPU (``step_off_cpu_ms``: its backward and every wait
for the GIL), its time in the kernel (``sys_ms``) and waiting for a CPU (``runq_ms``) per batch,
and each kind of thread's context switches per batch, voluntary / involuntary (``switches``, read
from ``/proc/self/task/*/status`` after batch 2 and every 16 batches).
tools/diagnostics/ab_pairs_gpu.sh reads them.

Outputs (in ``--out``, default ``bench/results``): ``bench_train.json`` (machine info, config,
every epoch's samples and per-batch times, ``PrefetchLoader.stats()``, the arena's counters),
``bench_train.png`` (fraction of the ideal and next ms per method; skipped with a notice without
matplotlib), and a table on stdout with the project's targets next to the results. The targets are
checked only on a GPU at full size (not ``--quick``). ``--device cpu --quick`` is a smoke test:
tiny images, and everything runs on the CPU.
"""
from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import sys
import threading
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, default_collate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_loader import machine_info  # noqa: E402
from provenance import provenance  # noqa: E402
from workloads import NUM_CAMERAS, NUM_CLASSES, count_tensors, iter_leaves, seed_sample, tree_map  # noqa: E402

import mtc_loader  # noqa: E402

METHODS = ["ideal", "plain", "sidestream", "start_copy", "prefetch_plain", "packed", "packed_gil5ms"]
LABELS = {
    "ideal": "preloaded on the device (ideal)",
    "plain": "DataLoader(pin_memory) + .to(nb)",
    "sidestream": "side-stream prefetcher (apex/timm)",
    "start_copy": "DataLoader + start_copy().get()",
    "prefetch_plain": "PrefetchLoader(DataLoader)",
    "packed": "PackedCollate + PrefetchLoader",
    "packed_gil5ms": "  same, GIL switch interval left at 5 ms",
}
PREFETCH_DEPTH = 2       # PrefetchLoader's default
PREFETCH_FACTOR = 2      # the DataLoader's default


@dataclass(frozen=True)
class Config:
    """One loop: image size per camera and the conv model's width."""

    height: int
    width: int
    channels: int
    fresh: bool = False  # the workers make every sample (no pool)
    light: bool = False  # the meta-data target in a few kernels per sample (meta_sums), not ~22
    amp: bool = False  # the forward and the loss under bf16 autocast (on a CUDA device)


CONFIGS = {"launch": Config(256, 448, 64), "gpu": Config(512, 896, 128), "launch5": Config(256, 448, 16, True, True),
           "launch4": Config(256, 448, 16, True, False, True)}
QUICK_CONFIGS = {"launch": Config(32, 56, 8), "gpu": Config(64, 112, 16),  # smoke runs, CPU included
                 "launch5": Config(32, 56, 8, True, True), "launch4": Config(32, 56, 8, True, False, True)}

# The targets of PackedCollate + PrefetchLoader (fractions of the ideal, GPU machine, full sizes).
TARGET_PACKED = {"launch": 0.97, "gpu": 0.99, "launch5": 0.93, "launch4": 0.93}


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


class CameraSamples(Dataset):
    """Camera images and seed meta-data per sample, deterministic per index, cheap to serve.

    Sample i is ``{"images": uint8 (6, 3, H, W), "meta": seed_sample(...)}`` of pool entry
    ``i % pool``; entry j is drawn from a generator seeded with j. The pool is made here, in the
    main process, before the DataLoader workers fork, so that serving a sample costs the workers
    only the clones of its 33 small meta-data tensors: the workers are not the bottleneck. The
    images are served as they are (the collate copies them into the batch anyway).
    """

    def __init__(self, n: int, pool: int, height: int, width: int, fresh: bool = False):
        self.n, self.fresh = n, fresh
        self.pool = [self.make_sample(j, height, width) for j in range(pool)]

    @staticmethod
    def make_sample(j: int, height: int, width: int) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(j)
        images = torch.randint(0, 256, (NUM_CAMERAS, 3, height, width), dtype=torch.uint8, generator=gen)
        return {"images": images, "meta": seed_sample(gen)}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        s = self.pool[i % len(self.pool)]
        if self.fresh:  # a new image tensor and new meta-data drawn for index i, as a real dataset decodes
            images = s["images"].add(i // len(self.pool) % 256)  # uint8 arithmetic wraps
            return {"images": images, "meta": seed_sample(torch.Generator().manual_seed(1000003 + i))}
        return {"images": s["images"], "meta": tree_map(torch.clone, s["meta"])}


def collate_samples(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """``{"images": uint8 (B, 6, 3, H, W), "meta": [B seed dicts]}``.

    ``default_collate`` stacks the images (into shared memory in a worker, as usual); the
    meta-data tensors vary in length from sample to sample, so they stay per sample.
    """
    return {"images": default_collate([s["images"] for s in samples]), "meta": [s["meta"] for s in samples]}


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """The generic per-tensor ``.to()`` a user writes around a nested batch."""
    return tree_map(lambda t: t.to(device, non_blocking=non_blocking), batch)


# --------------------------------------------------------------------------------------------
# Model and loss
# --------------------------------------------------------------------------------------------


def _conv_bn(cin: int, cout: int, stride: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class CameraNet(nn.Module):
    """4 conv/BN/ReLU layers over every camera image, pooled; a linear head over the 6 cameras."""

    def __init__(self, channels: int, n_out: int):
        super().__init__()
        c = channels
        self.features = nn.Sequential(_conv_bn(3, c, 2), _conv_bn(c, c, 2), _conv_bn(c, 2 * c, 2),
                                      _conv_bn(2 * c, 2 * c, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(NUM_CAMERAS * 2 * c, n_out)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        b = images.shape[0]
        x = images.flatten(0, 1).float().div_(255.0).sub_(0.5)  # uint8 -> float on the device
        return self.head(self.features(x).view(b, -1))


# Per camera: the active-weighted sum of the 2D boxes (4) and the projection matrix (12); per
# sample: the active-weighted sum of the 3D boxes (7); then per camera the sum of the depths per
# class, and for the 3D ground truth the active objects per class (7 x NUM_CLASSES).
CAM_FEATURES = 4 + 12
META_FEATURES = NUM_CAMERAS * CAM_FEATURES + 7 + (NUM_CAMERAS + 1) * NUM_CLASSES


def meta_targets(metas: list[dict[str, Any]], device: torch.device) -> torch.Tensor:
    """The regression targets of a batch, (B, META_FEATURES), read from every meta-data tensor.

    About 22 small kernels per sample (3 per camera), none of which synchronizes with the host
    (no boolean indexing, no ``bincount`` / ``one_hot``, whose CUDA versions do).
    """
    per_class = torch.zeros(len(metas), NUM_CAMERAS + 1, NUM_CLASSES, device=device)
    rows = []
    for i, meta in enumerate(metas):
        parts = []
        for j, cam in enumerate(meta["cams_gt"]):
            parts += [cam["active"].to(torch.float32) @ cam["bounding_boxes"], cam["proj_mat"].flatten()]
            per_class[i, j].index_add_(0, cam["class_ids"], cam["depths"])
        gt = meta["gt_data"]
        w = gt["active"].to(torch.float32)
        parts.append(w @ gt["bounding_boxes_3d"])
        per_class[i, NUM_CAMERAS].index_add_(0, gt["class_ids"], w)
        rows.append(torch.cat(parts))
    return torch.cat([torch.stack(rows), per_class.flatten(1)], 1)


def meta_sums(metas: list[dict[str, Any]], device: torch.device) -> torch.Tensor:
    """The light target of ``launch5``, (B, 3): per sample the L1 norms of its float, integer and
    boolean meta-data tensors, every tensor read. Each group of the whole batch is concatenated
    once and cut per sample into views; one fused ``_foreach_norm`` per group reduces every sample
    (about 15 kernels per batch, not ~12 per sample)."""
    floats: list[torch.Tensor] = []
    ints: list[torch.Tensor] = []
    bools: list[torch.Tensor] = []
    lens: tuple[list[int], list[int], list[int]] = ([], [], [])
    for meta in metas:
        cams, gt = meta["cams_gt"], meta["gt_data"]
        f = [c[k].view(-1) for c in cams for k in ("bounding_boxes", "depths", "proj_mat")]
        f.append(gt["bounding_boxes_3d"].view(-1))
        i = [c["class_ids"] for c in cams] + [gt["class_ids"]]
        b = [c["active"] for c in cams] + [gt["active"]]
        for group, parts, n in ((floats, f, lens[0]), (ints, i, lens[1]), (bools, b, lens[2])):
            group += parts
            n.append(sum(t.numel() for t in parts))
    cols = []
    for group, n, scale in ((floats, lens[0], 1 / 4096), (ints, lens[1], 1 / 512), (bools, lens[2], 1 / 256)):
        flat = torch.cat(group).float().mul_(scale)
        cols.append(torch.stack(torch._foreach_norm(list(flat.split(n)), 1)))
    return torch.stack(cols, 1)


def target_scale(device: torch.device) -> torch.Tensor:
    """Brings every target feature to about 1 (sums over up to 64 visible / 120 GT objects)."""
    cam = [1 / 32] * 4 + [1.0] * 12
    per_class = [1 / 128] * (NUM_CAMERAS * NUM_CLASSES) + [1 / 8] * NUM_CLASSES
    return torch.tensor(cam * NUM_CAMERAS + [1 / 32] * 7 + per_class, device=device)


class Trainer:
    """The training step: forward, meta-data target, MSE loss, backward, SGD. No host sync."""

    def __init__(self, cfg: Config, device: torch.device):
        self.light = cfg.light
        self.amp = cfg.amp and device.type == "cuda"
        self.model = CameraNet(cfg.channels, 3 if cfg.light else META_FEATURES).to(device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.scale = target_scale(device)
        self.device = device

    def __call__(self, batch: dict[str, Any]) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.amp):
            if self.light:
                target = meta_sums(batch["meta"], self.device)
            else:
                target = meta_targets(batch["meta"], self.device) * self.scale
            loss = F.mse_loss(self.model(batch["images"]).float(), target.float())
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return loss.detach()


# --------------------------------------------------------------------------------------------
# Methods: each an iterable of device batches, iterated once per epoch
# --------------------------------------------------------------------------------------------


class Preloaded:
    """``ideal``: the same device batch, ``n`` times per epoch."""

    def __init__(self, batch: Any, n: int):
        self.batch, self.n = batch, n

    def __iter__(self) -> Iterator[Any]:
        return itertools.repeat(self.batch, self.n)


class MapLoader:
    """Applies ``fn`` (the copy) to every batch of ``loader`` as the training thread asks for it."""

    def __init__(self, loader: Iterable, fn: Callable[[Any], Any]):
        self.loader, self.fn = loader, fn

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            yield self.fn(batch)


class SideStreamPrefetcher:
    """The apex / timm prefetcher: batch k+1 is copied on a side stream while step k trains.

    At hand-out the current stream waits for the side stream (a GPU-side wait) and every tensor
    is recorded on the current stream, so that the caching allocator does not reuse its memory
    while the step's kernels may still read it. Without CUDA it is the plain loop.
    """

    def __init__(self, loader: Iterable, device: torch.device):
        self.loader, self.device = loader, device
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __iter__(self) -> Iterator[Any]:
        if self.side is None:
            for batch in self.loader:
                yield to_device(batch, self.device, non_blocking=True)
            return
        it = iter(self.loader)

        def preload() -> Any:
            try:
                batch = next(it)
            except StopIteration:
                return None
            with torch.cuda.stream(self.side):
                return to_device(batch, self.device, non_blocking=True)

        nxt = preload()
        while nxt is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self.side)
            batch = nxt
            for _, t in iter_leaves(batch):
                t.record_stream(current)
            nxt = preload()
            yield batch


def arena_bytes_for(ref_batch: Any, workers: int) -> int:
    """Room for (workers * prefetch_factor + depth + 4) batches, with alignment and slot slack."""
    n, nbytes = count_tensors(ref_batch)
    per_batch = nbytes + 16 * n + (64 << 10)  # 16-byte alignment per tensor, a 64 KiB slot's rounding
    in_flight = workers * PREFETCH_FACTOR if workers > 0 else 1
    return (in_flight + PREFETCH_DEPTH + 4) * per_batch


def make_methods(names: list[str], ds: CameraSamples, workers: int, batch_size: int, device: torch.device,
                 preloaded: Any, ref_batch: Any) -> tuple[dict[str, Iterable], dict[str, Any]]:
    """The methods' iterables, and the PackedCollate of ``packed`` (for its arena's counters)."""
    common: dict[str, Any] = dict(batch_size=batch_size, num_workers=workers, persistent_workers=workers > 0)

    def loader(pin: bool = False, collate_fn: Callable = collate_samples) -> DataLoader:
        with warnings.catch_warnings():  # no accelerator: pin_memory is a no-op (and says so)
            warnings.simplefilter("ignore")
            return DataLoader(ds, collate_fn=collate_fn, pin_memory=pin, **common)

    out: dict[str, Iterable] = {}
    extra: dict[str, Any] = {}
    for name in names:
        if name == "ideal":
            out[name] = Preloaded(preloaded, len(ds) // batch_size)
        elif name == "plain":
            out[name] = MapLoader(loader(pin=True), lambda b: to_device(b, device, non_blocking=True))
        elif name == "sidestream":
            out[name] = SideStreamPrefetcher(loader(pin=True), device)
        elif name == "start_copy":
            out[name] = MapLoader(loader(), lambda b: mtc_loader.start_copy(b, device).get())
        elif name == "prefetch_plain":
            out[name] = mtc_loader.PrefetchLoader(loader(), device, depth=PREFETCH_DEPTH)
        elif name == "packed":
            pc = mtc_loader.PackedCollate(collate_samples, arena_bytes=arena_bytes_for(ref_batch, workers))
            out[name] = mtc_loader.PrefetchLoader(loader(collate_fn=pc), device, depth=PREFETCH_DEPTH)
            extra["packed_collate"] = pc
        elif name == "packed_gil5ms":  # the service's GIL switch interval left at the interpreter's
            pc = mtc_loader.PackedCollate(collate_samples, arena_bytes=arena_bytes_for(ref_batch, workers))
            out[name] = mtc_loader.PrefetchLoader(loader(collate_fn=pc), device, depth=PREFETCH_DEPTH,
                                                  gil_switch_interval=None)
        else:
            raise ValueError(name)
    return out, extra


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


def thread_rusage() -> tuple[float, float] | None:
    """(system, user) CPU seconds of the calling thread (``RUSAGE_THREAD``, Linux), or None."""
    try:
        import resource

        ru = resource.getrusage(resource.RUSAGE_THREAD)
    except (ImportError, AttributeError, OSError):
        return None
    return ru.ru_stime, ru.ru_utime


def thread_run_delay() -> float | None:
    """Seconds the calling thread has waited for a CPU while it could run (the scheduler's
    ``run_delay``, ``/proc/thread-self/schedstat``, Linux), or None."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


SWITCH_EVERY = 16  # batches between two readings of the threads' context switches (after batch 2)


def thread_switches() -> dict[int, tuple[int, int]]:
    """Native thread id -> (voluntary, involuntary) context switches of each thread of this process,
    from /proc (Linux); {} where it cannot be read. A voluntary switch is a block (a lock, the GIL,
    a condition, a syscall that waits); an involuntary one, the scheduler taking the CPU away."""
    out: dict[int, tuple[int, int]] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                text = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        v = n = -1
        for line in text.splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                v = int(line.split()[1])
            elif line.startswith("nonvoluntary_ctxt_switches:"):
                n = int(line.split()[1])
        if v >= 0 and n >= 0:
            out[int(tid)] = (v, n)
    return out


def switch_group(tid: int, names: dict[int, str], trainer: int) -> str:
    """The kind of thread a native id is: the training thread, a Python thread by its name (the
    prefetch service, the DataLoader's index-queue feeders, ...), or ``native`` (threads Python does
    not know: the engine's transfer thread, autograd's and CUDA's)."""
    if tid == trainer:
        return "training"
    return names.get(tid, "native")


def switches_per_batch(before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]], batches: int,
                       trainer: int, names: dict[int, str]) -> dict[str, list[float]]:
    """Per kind of thread (switch_group, ``names``: the Python threads' names by native id):
    [voluntary, involuntary] context switches per batch between two readings, over the threads
    alive at both."""
    out: dict[str, list[float]] = {}
    for tid, (v1, n1) in after.items():
        if tid not in before:
            continue
        v0, n0 = before[tid]
        g = out.setdefault(switch_group(tid, names, trainer), [0.0, 0.0])
        g[0] += (v1 - v0) / batches
        g[1] += (n1 - n0) / batches
    return out


def run_epoch(iterable: Iterable, step: Callable[[Any], torch.Tensor], device: torch.device, batch_size: int,
              check: Callable[[Any], None] | None = None) -> dict[str, Any]:
    """One epoch, synchronized at its end only; the training thread's time in next() and the step.

    The threads' context switches are read after batch 2 and every SWITCH_EVERY batches after it
    (the same readings for every method, about 0.3 ms each): ``switches`` is the rate between the
    first and the last reading, per kind of thread, while every thread of the loader is alive."""
    trainer = threading.get_native_id()
    sw_first: tuple[int, dict[int, tuple[int, int]], dict[int, str]] | None = None
    sw_last: tuple[int, dict[int, tuple[int, int]], dict[int, str]] | None = None
    next_ms: list[float] = []
    next_cpu_ms: list[float] = []
    step_ms: list[float] = []
    step_cpu_ms: list[float] = []
    loss = None
    t_first = None
    ru0, rq0 = thread_rusage(), thread_run_delay()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pin_memory without an accelerator warns per iterator
        t_start = time.perf_counter()
        it = iter(iterable)
        while True:
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                batch = next(it)
            except StopIteration:
                break
            t1, c1 = time.perf_counter(), time.thread_time()
            if t_first is None:
                t_first = t1
                if check is not None:
                    check(batch)
            loss = step(batch)
            del batch
            t2, c2 = time.perf_counter(), time.thread_time()
            next_ms.append((t1 - t0) * 1e3)
            next_cpu_ms.append((c1 - c0) * 1e3)
            step_ms.append((t2 - t1) * 1e3)
            step_cpu_ms.append((c2 - c1) * 1e3)
            k = len(step_ms)
            if k >= 2 and (k - 2) % SWITCH_EVERY == 0:
                names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
                reading = (k, thread_switches(), names)
                if sw_first is None:
                    sw_first = reading
                else:
                    sw_last = reading
        synchronize(device)
        t_end = time.perf_counter()
        ru1, rq1 = thread_rusage(), thread_run_delay()
    del it
    n = len(next_ms)
    return {
        "batches": n,
        "epoch_s": t_end - t_start,
        "samples_per_s": n * batch_size / (t_end - t_start),
        "steady_samples_per_s": n * batch_size / (t_end - t_first) if t_first is not None else 0.0,
        "next_ms": next_ms,
        "next_cpu_ms": next_cpu_ms,
        "step_ms": step_ms,
        "step_cpu_ms": step_cpu_ms,
        "loss": float(loss) if loss is not None else None,
        # the training thread's CPU time in the kernel (system calls: futex wakes, the driver's
        # ioctls) over the whole epoch, -1 where the thread's own counters cannot be read
        "sys_ms": (ru1[0] - ru0[0]) * 1e3 if ru0 and ru1 else -1.0,
        # its time runnable but waiting for a CPU (another thread on its core), -1 where unknown
        "runq_ms": (rq1 - rq0) * 1e3 if rq0 is not None and rq1 is not None else -1.0,
        "switches": (switches_per_batch(sw_first[1], sw_last[1], sw_last[0] - sw_first[0], trainer, sw_last[2])
                     if sw_first is not None and sw_last is not None else {}),
    }


def make_checker(ref_batch: Any) -> Callable[[Any], None]:
    """Bitwise check of a batch against the collated dataset samples of batch 0."""
    ref = list(iter_leaves(ref_batch))

    def check(batch: Any) -> None:
        got = list(iter_leaves(batch))
        if len(got) != len(ref):
            raise AssertionError(f"batch 0 has {len(got)} tensors, the dataset's samples {len(ref)}")
        for (path, a), (_, b) in zip(ref, got):
            b = b.cpu()
            if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
                raise AssertionError(f"batch 0: {path} differs from the dataset's sample")
    return check


# --------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------


def summarize(res: dict[str, dict[str, dict]]) -> None:
    """Adds medians and fractions of the ideal, per configuration, in place."""
    for methods in res.values():
        for r in methods.values():
            eps = r["epochs"]
            r["samples_per_s"] = statistics.median(e["samples_per_s"] for e in eps)
            r["steady_samples_per_s"] = statistics.median(e["steady_samples_per_s"] for e in eps)
            r["wall_ms"] = statistics.median(e["epoch_s"] * 1e3 / e["batches"] for e in eps)
            r["next_ms"] = statistics.median(sum(e["next_ms"]) / e["batches"] for e in eps)
            r["next_steady_ms"] = statistics.median(sum(e["next_ms"][1:]) / max(e["batches"] - 1, 1) for e in eps)
            r["next_cpu_ms"] = statistics.median(sum(e["next_cpu_ms"]) / e["batches"] for e in eps)
            r["step_ms"] = statistics.median(sum(e["step_ms"]) / e["batches"] for e in eps)
            # the step's time off the CPU (blocked in a launch on a full queue, or waiting for the
            # GIL): for ideal, time the GIL is free for other threads at no cost to the loop
            r["step_cpu_ms"] = statistics.median(sum(e["step_cpu_ms"]) / e["batches"] for e in eps)
            # (per epoch, then the median: it drifts less with the host's speed than the step's time)
            r["step_off_cpu_ms"] = statistics.median((sum(e["step_ms"]) - sum(e["step_cpu_ms"])) / e["batches"]
                                                     for e in eps)
            r["sys_ms"] = statistics.median(e.get("sys_ms", -1.0) / e["batches"] for e in eps)
            r["runq_ms"] = statistics.median(e.get("runq_ms", -1.0) / e["batches"] for e in eps)
            groups = sorted({g for e in eps for g in e.get("switches", {})})
            r["switches"] = {g: [statistics.median(e.get("switches", {}).get(g, [0.0, 0.0])[i] for e in eps)
                                 for i in (0, 1)] for g in groups}
        ideal = methods.get("ideal")
        for r in methods.values():
            if ideal is None:
                r["fraction_of_ideal"] = r["steady_fraction_of_ideal"] = None
                continue
            r["fraction_of_ideal"] = r["samples_per_s"] / ideal["samples_per_s"]
            r["steady_fraction_of_ideal"] = r["steady_samples_per_s"] / ideal["steady_samples_per_s"]
            # the same ratio round by round (epochs of one round ran next to each other)
            r["round_fractions"] = [e["samples_per_s"] / i["samples_per_s"]
                                    for e, i in zip(r["epochs"], ideal["epochs"])]


def print_table(res: dict[str, dict[str, dict]], configs: dict[str, Config]) -> None:
    print("samples/s: median over rounds, whole epoch (steady: from the first batch in hand); next: the training "
          "thread's time in __next__ per batch (steady: without the epoch's first); step: its time in the step; "
          "thread: the prefetch thread's CPU time per batch")
    header = (f"{'config':<7} {'method':<36} {'samples/s':>10} {'of ideal':>9} {'steady':>7} {'next ms':>8} "
              f"{'steady':>7} {'step ms':>8} {'wall ms':>8} {'thread ms':>9}")
    print(header)
    print("-" * len(header))
    for cfg, methods in res.items():
        c = configs[cfg]
        for name, r in methods.items():
            frac = f"{100 * r['fraction_of_ideal']:.1f}%" if r["fraction_of_ideal"] is not None else "-"
            steady = f"{100 * r['steady_fraction_of_ideal']:.1f}%" if r["steady_fraction_of_ideal"] is not None else "-"
            ps = r.get("prefetch_stats")
            thread = f"{ps['service_cpu_ms_per_batch']:.3f}" if ps else "-"
            print(f"{cfg:<7} {LABELS[name]:<36} {r['samples_per_s']:>10.1f} {frac:>9} {steady:>7} "
                  f"{r['next_ms']:>8.3f} {r['next_steady_ms']:>7.3f} {r['step_ms']:>8.3f} {r['wall_ms']:>8.2f} "
                  f"{thread:>9}")
        ideal = methods.get("ideal")
        off = f", the ideal step off the CPU {ideal['step_ms'] - ideal['step_cpu_ms']:.3f} ms" if ideal else ""
        print(f"{'':<7} ({c.height}x{c.width} images, width {c.channels}{', bf16 autocast on a GPU' if c.amp else ''}{off})")
        print()


def targets(res: dict[str, dict[str, dict]], device: torch.device, quick: bool) -> list[dict]:
    """The targets, each with the measured value and whether it applies to this run."""
    full_gpu = device.type == "cuda" and not quick
    out = []
    for cfg, goal in TARGET_PACKED.items():
        r = res.get(cfg, {}).get("packed")
        out.append({"target": f"PackedCollate + PrefetchLoader, {cfg} loop: >= {100 * goal:g}% of the preloaded ideal",
                    "measured": r["fraction_of_ideal"] if r else None, "goal": goal, "unit": "%",
                    "applies": full_gpu and r is not None})
    g = res.get("gpu", {})
    pp, ss = g.get("prefetch_plain"), g.get("sidestream")
    out.append({"target": "PrefetchLoader over a plain DataLoader, gpu loop: ahead of the side-stream pattern "
                          "(samples/s ratio > 1)",
                "measured": pp["samples_per_s"] / ss["samples_per_s"] if pp and ss else None, "goal": 1.0,
                "unit": "x", "strict": True, "applies": full_gpu and pp is not None and ss is not None})
    for t in out:
        m = t["measured"]
        t["met"] = None if m is None else (m > t["goal"] if t.get("strict") else m >= t["goal"])
    return out


def print_targets(ts: list[dict]) -> None:
    print("targets (checked on a GPU at full size):")
    for t in ts:
        m = t["measured"]
        val = "not measured" if m is None else (f"{100 * m:.1f}%" if t["unit"] == "%" else f"{m:.2f}x")
        verdict = "n/a here" if not t["applies"] else ("MET" if t["met"] else "NOT MET")
        print(f"  {t['target']}: {val} [{verdict}]")


def plot(res: dict[str, dict[str, dict]], path: str, title: str) -> bool:
    """Per configuration: fraction of the ideal, and next ms per batch. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("notice: matplotlib is not installed; skipping the plot")
        return False
    cfgs = list(res)
    fig, axes = plt.subplots(2, len(cfgs), figsize=(6.5 * len(cfgs), 7), squeeze=False)
    for j, cfg in enumerate(cfgs):
        names = list(res[cfg])
        ys = range(len(names))
        ax = axes[0][j]
        fr = [100 * (res[cfg][m]["fraction_of_ideal"] or 0.0) for m in names]
        ax.barh(ys, fr, color=["gray" if m == "ideal" else "tab:blue" for m in names])
        if cfg in TARGET_PACKED:
            ax.axvline(100 * TARGET_PACKED[cfg], color="black", linestyle="--", linewidth=1)
        for y, v in zip(ys, fr):
            ax.text(v, y, f" {v:.1f}%", va="center", fontsize="small")
        ax.set_yticks(list(ys), [LABELS[m] for m in names], fontsize="small")
        ax.set_xlim(0, 115)
        ax.invert_yaxis()
        goal = f" (dashed: target for packed, {100 * TARGET_PACKED[cfg]:g}%)" if cfg in TARGET_PACKED else ""
        ax.set_title(f"{cfg}: samples/s as % of the preloaded ideal{goal}", fontsize="medium")
        ax = axes[1][j]
        nx = [max(res[cfg][m]["next_ms"], 1e-4) for m in names]
        ax.barh(ys, nx, color="tab:orange")
        ax.set_xscale("log")
        ax.set_yticks(list(ys), [LABELS[m] for m in names], fontsize="small")
        ax.invert_yaxis()
        ax.set_title(f"{cfg}: training thread in __next__, ms per batch (log)")
        ax.grid(alpha=0.3, axis="x", which="both")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu",
                   help="target device (default cuda:0 if available, else cpu)")
    p.add_argument("--config", nargs="+", choices=list(CONFIGS), default=["launch", "gpu"],
                   help="loops to run (default: launch gpu; launch5: a step of <= 5 ms; launch4: the "
                        "multi-camera loop with the full meta-data target under bf16 autocast, ~4 ms)")
    p.add_argument("--workers", type=int, default=4, help="DataLoader workers (default 4)")
    p.add_argument("--batches", type=int, default=0, help="batches per epoch (default 100; --quick 6)")
    p.add_argument("--rounds", type=int, default=0, help="timed epochs per method (default 3; --quick 1)")
    p.add_argument("--batch-size", type=int, default=8, help="samples per batch (default 8)")
    p.add_argument("--pool", type=int, default=0, help="distinct samples in the dataset (default 4 batches)")
    p.add_argument("--warmup-steps", type=int, default=0, help="model warm-up steps (default 10; --quick 1)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=METHODS,
                   help="(ideal is always run)")
    p.add_argument("--quick", action="store_true", help="tiny images, few batches and rounds: a smoke run")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                   help="output folder (default bench/results)")
    args = p.parse_args(argv)
    args.batches = args.batches or (6 if args.quick else 100)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.pool = args.pool or 4 * args.batch_size
    args.warmup_steps = args.warmup_steps or (1 if args.quick else 10)
    args.methods = ["ideal"] + [m for m in args.methods if m != "ideal"]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # more workers than this machine's cores: torch warns; the benchmark means it
    warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit(f"--device {device} asked for, but CUDA is not available (try --device cpu)")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
    configs = {c: (QUICK_CONFIGS if args.quick else CONFIGS)[c] for c in args.config}
    torch.manual_seed(0)

    res: dict[str, dict[str, dict]] = {}
    shapes: dict[str, dict] = {}
    arena_stats: dict[str, dict] = {}
    for cfg_name, cfg in configs.items():
        ds = CameraSamples(args.batches * args.batch_size, args.pool, cfg.height, cfg.width, cfg.fresh)
        ref = collate_samples([ds[i] for i in range(args.batch_size)])
        n, nbytes = count_tensors(ref)
        shapes[cfg_name] = {**asdict(cfg), "tensors_per_batch": n, "bytes_per_batch": nbytes}
        print(f"[{cfg_name}] {cfg.height}x{cfg.width} images x {NUM_CAMERAS} cameras, width {cfg.channels}; batch "
              f"{args.batch_size}: {n} tensors, {nbytes / 1e6:.1f} MB; {args.batches} batches per epoch, "
              f"{args.workers} workers, device {device}, {args.rounds} timed epoch(s) per method", flush=True)

        step = Trainer(cfg, device)
        preloaded = to_device(ref, device)
        for _ in range(args.warmup_steps):  # cudnn.benchmark picks its algorithms here
            step(preloaded)
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(args.warmup_steps):
            step(preloaded)
        synchronize(device)
        print(f"[{cfg_name}] preloaded step: {(time.perf_counter() - t0) * 1e3 / args.warmup_steps:.2f} ms",
              flush=True)

        methods, extra = make_methods(args.methods, ds, args.workers, args.batch_size, device, preloaded, ref)
        res[cfg_name] = {m: {"epochs": []} for m in args.methods}
        check = make_checker(ref)
        for m, iterable in methods.items():  # warm-up epoch; its first batch checked bitwise
            e = run_epoch(iterable, step, device, args.batch_size, check=check)
            res[cfg_name][m]["warmup"] = e
            if hasattr(iterable, "reset_stats"):  # PrefetchLoader: count the timed epochs only
                iterable.reset_stats()
        for r in range(args.rounds):
            k = r % len(args.methods)
            for m in args.methods[k:] + args.methods[:k]:
                gc.collect()
                res[cfg_name][m]["epochs"].append(run_epoch(methods[m], step, device, args.batch_size))
        line = ", ".join(f"{m} {statistics.median(e['samples_per_s'] for e in res[cfg_name][m]['epochs']):.1f}"
                         for m in args.methods)
        print(f"[{cfg_name}] samples/s: {line}", flush=True)
        for m, iterable in methods.items():
            if hasattr(iterable, "stats"):  # PrefetchLoader: its service thread's CPU time, waits
                res[cfg_name][m]["prefetch_stats"] = iterable.stats()
        if "packed_collate" in extra:
            arena_stats[cfg_name] = extra["packed_collate"].stats()
        del methods, extra, step, preloaded, ds
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    summarize(res)
    print()
    print_table(res, configs)
    ts = targets(res, device, args.quick)
    print_targets(ts)

    os.makedirs(args.out, exist_ok=True)
    info = machine_info(device)
    info["cudnn"] = torch.backends.cudnn.version() if device.type == "cuda" else None
    report = {"machine": info, "config": vars(args), "shapes": shapes, "results": res, "targets": ts,
              "arena_stats": arena_stats, "mtc_stats": mtc_loader.stats(), "provenance": provenance(argv)}
    json_path = os.path.join(args.out, "bench_train.json")
    with open(json_path, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(f"wrote {json_path}")
    where = info["gpus"][device.index or 0] if device.type == "cuda" else f"CPU ({info['cpus_usable']} cores)"
    png_path = os.path.join(args.out, "bench_train.png")
    if plot(res, png_path, f"training loop, batch {args.batch_size}, {args.workers} workers, {device} on {where}"):
        print(f"wrote {png_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
