"""Benchmark file-backed samples: disk -> worker -> main process -> device.

Usage::

    python3 bench/bench_files.py [--device cuda:0|cpu|none] [--workers 4] [--batch-size 8]
                                 [--samples 48] [--rounds 3] [--warmup 6] [--quick] [--dir DIR]
                                 [--out DIR]

The data, written by the benchmark itself into ``--dir`` (default: ``bench_files_data`` in
``--out``, on the repository's disk rather than a /tmp that may be tmpfs; removed at the end): per sample 10 LiDAR-like sweeps stored as raw float32 ``.bin`` files (35,000 points
x 5 floats, 700 KB each, nuScenes-style) and 6 camera arrays stored as ``.npy`` (uint8,
3 x 256 x 448, 344 KB each): 9.1 MB per sample.

``--device none`` drops each batch in the main process (a packed batch's region is freed
unread): the workers' side alone, which a CPU target hides behind the main process's 72 MB copy
out of the arena per batch.

Methods, each a ``DataLoader(..., batch_size=8, num_workers=4, persistent_workers=True)`` over
the same files, ``collate_fn`` keeping the samples separate (``list``), batches taken to
``--device``:

- ``numpy_plain``: ``np.fromfile`` / ``np.load`` + ``torch.from_numpy`` in the dataset, the plain
  DataLoader (``pin_memory=True`` for a CUDA device), per-tensor ``.to(device, non_blocking=True)``;
- ``numpy_packed``: the same loading, ``PackedCollate(list)`` + ``PrefetchLoader(loader, device)``;
- ``files_packed``: the dataset returns ``FileTensor`` / ``FileTensor.npy`` leaves,
  ``PackedCollate(list)`` reads them in the worker straight into the batch's arena region
  (io_uring, or pread where it is unavailable), + ``PrefetchLoader``;
- ``files_packed_direct``: the same with ``min_packed_alignment_bytes=4096``, so that the
  ``.bin`` sweeps (offset 0) land 4 KiB-aligned and are read with ``O_DIRECT`` (bypassing the
  page cache) except for their unaligned tails, and except where the page cache holds them (a
  warm cache: read buffered, ``file_reads_direct_cached``);
- ``files_packed_async``: ``files_packed`` with its workers' buffered reads submitted with
  ``IOSQE_ASYNC`` (``MTC_URING_ASYNC=1``): copied from the page cache by io-wq threads in
  parallel instead of one after another inside ``io_uring_enter``.

What is timed: ``--warmup`` untimed epochs per loader (default 6; a worker maps the whole arena
into its page tables at its first pack, ``MTC_ARENA_POPULATE``, which the warm-up pays), then
``--rounds`` rounds; in each round every
method runs one epoch with the page cache warm (every file read just before) and one with it
cold (every file's pages dropped with ``posix_fadvise(POSIX_FADV_DONTNEED)`` right before the
epoch), methods interleaved and their order rotated between rounds (which cache state goes first
alternating). Per method and cache state:
``ms/batch`` (epoch wall time / batches, median over rounds; the device synchronized at each
batch) and ``GB/s`` (file bytes per batch / ms per batch). In the same run, the raw read
bandwidth of the same files: a sequential ``O_DIRECT`` read of each (cold, one thread, 8 MiB
reads) and a buffered read (warm).

Targets (ratios in one run): ``files_packed`` >= 2x ``numpy_packed`` per batch with a warm
cache, and >= 80% of the raw O_DIRECT read bandwidth with a cold cache.

Outputs: ``bench_files.json`` in ``--out`` (default ``bench/results``: machine, config, every
epoch time, reader mode, counters) and a table on stdout.
"""
from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import mtc_loader
from mtc_loader import FileTensor, PackedCollate, PrefetchLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from provenance import provenance  # noqa: E402

SWEEPS, POINTS, CAMS, CAM_SHAPE = 10, 35_000, 6, (3, 256, 448)
METHODS = ["numpy_plain", "numpy_packed", "files_packed", "files_packed_direct", "files_packed_async"]
TARGET_WARM_RATIO = 2.0   # files_packed vs numpy_packed, warm cache, per batch
TARGET_COLD_FRACTION = 0.8  # files_packed GB/s vs raw O_DIRECT read GB/s, cold cache


class Samples(Dataset):
    """Sample i: its sweeps and camera arrays, loaded with numpy or named as FileTensors."""

    def __init__(self, root: str, n: int, files: bool):
        self.root, self.n, self.files = root, n, files

    def __len__(self) -> int:
        return self.n

    def paths(self, i: int) -> tuple[list, list]:
        return ([os.path.join(self.root, f"{i:04d}_sweep{k}.bin") for k in range(SWEEPS)],
                [os.path.join(self.root, f"{i:04d}_cam{k}.npy") for k in range(CAMS)])

    def __getitem__(self, i: int) -> dict:
        sweeps, cams = self.paths(i)
        if self.files:
            return {"lidar": [FileTensor(p, torch.float32, (POINTS, 5)) for p in sweeps],
                    "cams": [FileTensor.npy(p) for p in cams], "token": i}
        return {"lidar": [torch.from_numpy(np.fromfile(p, dtype=np.float32).reshape(POINTS, 5)) for p in sweeps],
                "cams": [torch.from_numpy(np.load(p)) for p in cams], "token": i}


def write_files(root: str, n: int) -> list[str]:
    rng = np.random.default_rng(0)
    out = []
    ds = Samples(root, n, True)
    for i in range(n):
        sweeps, cams = ds.paths(i)
        for p in sweeps:
            rng.standard_normal((POINTS, 5), dtype=np.float32).tofile(p)
            out.append(p)
        for p in cams:
            np.save(p, rng.integers(0, 255, CAM_SHAPE, dtype=np.uint8))
            out.append(p)
    os.sync()
    return out


def drop_cache(paths: list[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_cache(paths: list[str]) -> None:
    for p in paths:
        with open(p, "rb") as f:
            while f.read(8 << 20):
                pass


def raw_read_gbps(paths: list[str], direct: bool) -> float:
    """Sequential read of every file, one thread, 8 MiB reads into an aligned buffer. A
    filesystem without O_DIRECT (tmpfs) is read buffered (the caller drops the cache first)."""
    buf = mmap.mmap(-1, 8 << 20)
    total = 0
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    if direct:
        try:
            os.close(os.open(paths[0], flags))
        except OSError:
            flags = os.O_RDONLY
    t0 = time.perf_counter()
    for p in paths:
        fd = os.open(p, flags)
        try:
            while True:
                n = os.readv(fd, [buf])
                total += n
                if n < len(buf):
                    break
        finally:
            os.close(fd)
    dt = time.perf_counter() - t0
    buf.close()
    return total / dt / 1e9


def make_loader(method: str, root: str, args) -> tuple:
    files = method.startswith("files")
    ds = Samples(root, args.samples, files)
    cuda = args.device.startswith("cuda")
    kw = dict(batch_size=args.batch_size, num_workers=args.workers, persistent_workers=args.workers > 0,
              prefetch_factor=args.prefetch if args.workers > 0 else None)
    if method == "numpy_plain":
        dl = DataLoader(ds, collate_fn=list, pin_memory=cuda, **kw)
        return dl, None
    align = 4096 if method == "files_packed_direct" else 16
    pc = PackedCollate(list, arena_bytes=args.arena_mib << 20, min_packed_alignment_bytes=align)
    if method == "files_packed_async":
        kw["worker_init_fn"] = async_reads
    return DataLoader(ds, collate_fn=pc, **kw), pc


def async_reads(worker_id: int) -> None:
    """files_packed_async's workers: buffered reads submitted with IOSQE_ASYNC (MTC_URING_ASYNC=1
    for this loader's workers only; the other settings are the defaults)."""
    from mtc_loader import _engine
    _engine.file_configure(128, 0, 1, 0, 1)


def run_epoch(method: str, loader, device: str) -> float:
    cuda = device.startswith("cuda")
    t0 = time.perf_counter()
    n = 0
    if device == "none":  # the workers' side alone: batches taken and dropped (regions freed unread)
        for batch in loader:
            n += 1
            del batch
    elif method == "numpy_plain":
        for batch in loader:
            out = [{"lidar": [t.to(device, non_blocking=True) for t in s["lidar"]],
                    "cams": [t.to(device, non_blocking=True) for t in s["cams"]], "token": s["token"]}
                   for s in batch]
            if cuda:
                torch.cuda.synchronize()
            n += 1
            del out
    else:
        for out in PrefetchLoader(loader, device):
            if cuda:
                torch.cuda.synchronize()
            n += 1
            del out
    return (time.perf_counter() - t0) / n


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu",
                   help="cuda:N, cpu, or none (batches dropped in the main process: the workers' side alone)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--samples", type=int, default=0, help="samples (default 48; --quick 16)")
    p.add_argument("--rounds", type=int, default=0, help="rounds (default 3; --quick 1)")
    p.add_argument("--warmup", type=int, default=-1, help="untimed epochs per loader first (default 6; --quick 1)")
    p.add_argument("--prefetch", type=int, default=2, help="DataLoader prefetch_factor (default 2)")
    p.add_argument("--arena-mib", type=int, default=0,
                   help="PackedCollate arena (default: room for every batch in flight)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=METHODS)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--dir", default=None, help="folder for the data files (default: a new one in --out, removed after)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    a = p.parse_args(argv)
    a.samples = a.samples or (16 if a.quick else 48)
    a.rounds = a.rounds or (1 if a.quick else 3)
    a.warmup = a.warmup if a.warmup >= 0 else (1 if a.quick else 6)
    per_batch = a.batch_size * (SWEEPS * POINTS * 5 * 4 + CAMS * int(np.prod(CAM_SHAPE)) + 16 * 4096)
    if not a.arena_mib:
        a.arena_mib = ((a.workers * a.prefetch + 4) * per_batch >> 20) + 16
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    root = args.dir or tempfile.mkdtemp(prefix="bench_files_data_", dir=os.makedirs(args.out, exist_ok=True) or args.out)
    os.makedirs(root, exist_ok=True)
    try:
        t0 = time.perf_counter()
        paths = write_files(root, args.samples)
        file_bytes = sum(os.path.getsize(p) for p in paths)
        print(f"wrote {len(paths)} files, {file_bytes / 1e6:.0f} MB, in {time.perf_counter() - t0:.1f} s to {root}")
        bytes_per_batch = file_bytes / args.samples * args.batch_size
        batches = args.samples // args.batch_size
        reader = mtc_loader.file_reader()
        print(f"device {args.device}, {args.workers} workers, batch {args.batch_size}, {batches} batches per "
              f"epoch, {bytes_per_batch / 1e6:.1f} MB of files per batch; FileTensor reads: {reader['mode']}"
              + (f" ({reader['reason']})" if reader["reason"] else ""))

        loaders = {m: make_loader(m, root, args) for m in args.methods}
        for m, (dl, _) in loaders.items():  # warm-up: workers started, arena and pinned memory in place
            for _ in range(args.warmup):
                run_epoch(m, dl, args.device)
        times = {m: {"warm": [], "cold": []} for m in args.methods}
        raw = {"direct_cold": [], "buffered_warm": []}
        order = list(args.methods)
        for r in range(args.rounds):
            drop_cache(paths)
            raw["direct_cold"].append(raw_read_gbps(paths, direct=True))
            warm_cache(paths)
            raw["buffered_warm"].append(raw_read_gbps(paths, direct=False))
            # the first epoch after another method's runs slower (its workers were idle): the
            # cache states take turns at going first
            states = ("warm", "cold") if r % 2 == 0 else ("cold", "warm")
            for m in order:
                for state in states:
                    if state == "cold":
                        drop_cache(paths)
                    else:
                        warm_cache(paths)
                    times[m][state].append(run_epoch(m, loaders[m][0], args.device))
                    gc.collect()
            order = order[1:] + order[:1]
            print(f"round {r + 1}/{args.rounds} done")
        stats = mtc_loader.stats()
        del loaders
        gc.collect()
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)

    med = {m: {s: statistics.median(v) for s, v in d.items()} for m, d in times.items()}
    raw_med = {k: statistics.median(v) for k, v in raw.items()}
    gbps = {m: {s: bytes_per_batch / t / 1e9 for s, t in d.items()} for m, d in med.items()}
    print()
    print(f"bench_files: {args.device}, {platform.node()}, {os.cpu_count()} CPUs, FileTensor reads via "
          f"{reader['mode']}")
    print(f"raw read of the same files: O_DIRECT cold {raw_med['direct_cold']:.2f} GB/s, "
          f"buffered warm {raw_med['buffered_warm']:.2f} GB/s")
    hdr = f"| {'method':<22} | {'warm ms/batch':>13} | {'warm GB/s':>9} | {'cold ms/batch':>13} | {'cold GB/s':>9} |"
    print(hdr)
    print("|" + "|".join("-" * (len(c)) for c in hdr.split("|")[1:-1]) + "|")
    for m in args.methods:
        print(f"| {m:<22} | {med[m]['warm'] * 1e3:13.1f} | {gbps[m]['warm']:9.2f} | {med[m]['cold'] * 1e3:13.1f} "
              f"| {gbps[m]['cold']:9.2f} |")
    checks = {}
    if "files_packed" in med and "numpy_packed" in med:
        ratio = med["numpy_packed"]["warm"] / med["files_packed"]["warm"]
        checks["warm_ratio_files_vs_numpy_packed"] = ratio
        print(f"warm: files_packed is {ratio:.2f}x numpy_packed per batch (target >= {TARGET_WARM_RATIO}x): "
              f"{'MET' if ratio >= TARGET_WARM_RATIO else 'NOT MET'}")
    if "files_packed_async" in med and "numpy_packed" in med:
        ratio = med["numpy_packed"]["warm"] / med["files_packed_async"]["warm"]
        checks["warm_ratio_files_async_vs_numpy_packed"] = ratio
        print(f"warm: files_packed_async is {ratio:.2f}x numpy_packed per batch (MTC_URING_ASYNC=1; the target "
              f"is for the defaults)")
    for m in ("files_packed", "files_packed_direct", "files_packed_async"):
        if m in gbps:
            frac = gbps[m]["cold"] / raw_med["direct_cold"]
            checks[f"cold_fraction_{m}"] = frac
            print(f"cold: {m} reaches {frac * 100:.0f}% of the raw O_DIRECT read bandwidth "
                  f"(target >= {TARGET_COLD_FRACTION * 100:.0f}%): {'MET' if frac >= TARGET_COLD_FRACTION else 'NOT MET'}")
    os.makedirs(args.out, exist_ok=True)
    report = {"machine": {"node": platform.node(), "cpus": os.cpu_count(), "platform": platform.platform(),
                          "torch": torch.__version__, "device": args.device,
                          "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None},
              "config": vars(args), "reader": reader, "file_bytes": file_bytes, "bytes_per_batch": bytes_per_batch,
              "epoch_s_per_batch": times, "raw_read_gbps": raw, "median_ms": {m: {s: v * 1e3 for s, v in d.items()}
                                                                              for m, d in med.items()},
              "gbps": gbps, "checks": checks, "stats_main_process": stats, "provenance": provenance(argv)}
    path = os.path.join(args.out, "bench_files.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
