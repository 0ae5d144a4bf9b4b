"""Benchmark file-backed samples: disk -> worker -> main process -> device.

Usage::

    python3 bench/bench_files.py [--device cuda:0|cpu|none] [--workers 4] [--batch-size 8]
                                 [--samples 48] [--rounds 3] [--warmup 6] [--quick] [--dir DIR]
                                 [--depths 1 4 16 64] [--copy-threads N] [--out DIR]

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
  ``PackedCollate(list)`` reads them in the worker straight into the batch's arena region (the
  default reader: pieces in the page cache copied by the helpers, the others through io_uring),
  + ``PrefetchLoader``;
- ``files_packed_direct``: the same with ``min_packed_alignment_bytes=4096``, so that the
  ``.bin`` sweeps (offset 0) land 4 KiB-aligned and their uncached middles are read ``O_DIRECT``;
- ``files_packed_pread``: ``files_packed`` with its workers on the pread reader
  (``MTC_FILE_READER=pread``): every piece read with pread on the helpers.

What is timed: ``--warmup`` untimed epochs per loader (default 6; a worker maps the whole arena
into its page tables at its first pack, ``MTC_ARENA_POPULATE``, which the warm-up pays), then
``--rounds`` rounds; in each round every
method runs one epoch with the page cache warm (every file read just before) and one with it
cold (every file's pages dropped with ``posix_fadvise(POSIX_FADV_DONTNEED)`` right before the
epoch), methods interleaved and their order rotated between rounds (which cache state goes first
alternating). Per method and cache state:
``ms/batch`` (epoch wall time / batches, median over rounds; the device synchronized at each
batch) and ``GB/s`` (file bytes per batch / ms per batch). In the same run, every round, the two
limits of the same files: warm, a parallel memcpy of their bytes out of the page cache (mapped
and populated first; ``--copy-threads``, default the helpers' count); cold, raw ``O_DIRECT``
reads of whole files with the cache dropped, ``--depths`` threads with one read in flight each
(the queue depth), the best depth taken.

Targets (ratios in one run): warm, ``files_packed`` >= 3x ``numpy_packed`` per batch and never
below ``files_packed_pread``; cold, ``files_packed`` >= 80% of the best raw ``O_DIRECT`` rate.

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
import threading
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
METHODS = ["numpy_plain", "numpy_packed", "files_packed", "files_packed_direct", "files_packed_pread"]
TARGET_WARM_RATIO = 3.0   # files_packed vs numpy_packed, warm cache, per batch
TARGET_COLD_FRACTION = 0.8  # files_packed GB/s vs the best raw O_DIRECT GB/s, cold cache


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


def memcpy_limit_gbps(paths: list[str], threads: int) -> float:
    """The warm limit: every file's bytes copied out of the page cache (mapped and populated
    first) into one buffer by `threads` threads at once, each a share of the files (numpy's copy
    releases the GIL); the second of two passes is timed (the first faults the buffer in)."""
    maps = []
    for p in paths:
        with open(p, "rb") as f:
            maps.append(mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                  prot=mmap.PROT_READ))
    src = [np.frombuffer(m, np.uint8) for m in maps]
    at = np.cumsum([0] + [a.nbytes for a in src])
    dst = np.empty(int(at[-1]), np.uint8)
    shares = [range(k, len(src), threads) for k in range(threads)]

    def copy(share: range) -> None:
        for i in share:
            np.copyto(dst[at[i]:at[i + 1]], src[i])
    dt = 0.0
    for _ in range(2):
        ts = [threading.Thread(target=copy, args=(sh,)) for sh in shares]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        dt = time.perf_counter() - t0
    del src
    for m in maps:
        m.close()
    return float(at[-1]) / dt / 1e9


def direct_limit_gbps(paths: list[str], depth: int) -> float:
    """The cold limit at one queue depth: the cache dropped, then `depth` threads, each with one
    O_DIRECT read of a whole file in flight (files taken in turn). A filesystem without O_DIRECT
    (tmpfs) is read buffered."""
    drop_cache(paths)
    flags = os.O_RDONLY | os.O_DIRECT
    try:
        os.close(os.open(paths[0], flags))
    except OSError:
        flags = os.O_RDONLY
    size = (max(os.path.getsize(p) for p in paths) + 4095) // 4096 * 4096
    todo, lock, totals = iter(paths), threading.Lock(), [0] * depth
    start = threading.Barrier(depth + 1)

    def reader(k: int) -> None:
        buf = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT wants
        start.wait()
        while True:
            with lock:
                p = next(todo, None)
            if p is None:
                break
            fd = os.open(p, flags)
            try:
                totals[k] += os.preadv(fd, [buf], 0)
            finally:
                os.close(fd)
        buf.close()
    ts = [threading.Thread(target=reader, args=(k,)) for k in range(depth)]
    for t in ts:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in ts:
        t.join()
    return sum(totals) / (time.perf_counter() - t0) / 1e9


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
    if method == "files_packed_pread":
        kw["worker_init_fn"] = pread_reader
    return DataLoader(ds, collate_fn=pc, **kw), pc


def pread_reader(worker_id: int) -> None:
    """files_packed_pread's workers: the pread reader (MTC_FILE_READER=pread for this loader's
    workers only; the other settings are the defaults)."""
    from mtc_loader import _engine
    _engine.file_configure(128, 0, 1, 2)


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
    p.add_argument("--depths", nargs="+", type=int, default=[1, 4, 16, 64],
                   help="queue depths of the raw O_DIRECT reads (the cold limit: the best of them)")
    cpus = os.cpu_count() or 1
    p.add_argument("--copy-threads", type=int, default=int(os.environ.get("MTC_HELPER_THREADS") or 0) or
                   (cpus - 2 if cpus > 3 else 1), help="threads of the warm limit's memcpy (default: the helpers')")
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
        limits = {"memcpy_warm": [], "direct_cold_best": [], "direct_cold_by_depth": {d: [] for d in args.depths}}
        order = list(args.methods)
        for r in range(args.rounds):
            for d in args.depths:
                limits["direct_cold_by_depth"][d].append(direct_limit_gbps(paths, d))
            limits["direct_cold_best"].append(max(v[-1] for v in limits["direct_cold_by_depth"].values()))
            warm_cache(paths)
            limits["memcpy_warm"].append(memcpy_limit_gbps(paths, args.copy_threads))
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
    lim = {k: statistics.median(v) for k, v in limits.items() if k != "direct_cold_by_depth"}
    by_depth = {d: statistics.median(v) for d, v in limits["direct_cold_by_depth"].items()}
    gbps = {m: {s: bytes_per_batch / t / 1e9 for s, t in d.items()} for m, d in med.items()}
    print()
    print(f"bench_files: {args.device}, {platform.node()}, {os.cpu_count()} CPUs, FileTensor reads via "
          f"{reader['mode']}")
    print(f"limits, same files: warm memcpy out of the page cache {lim['memcpy_warm']:.2f} GB/s "
          f"({args.copy_threads} thread{'s' if args.copy_threads != 1 else ''}); cold O_DIRECT "
          + ", ".join(f"{v:.2f}" for v in by_depth.values()) + f" GB/s at depth {', '.join(map(str, by_depth))}: "
          f"best {lim['direct_cold_best']:.2f} GB/s")
    hdr = f"| {'method':<22} | {'warm ms/batch':>13} | {'warm GB/s':>9} | {'cold ms/batch':>13} | {'cold GB/s':>9} |"
    print(hdr)
    print("|" + "|".join("-" * (len(c)) for c in hdr.split("|")[1:-1]) + "|")
    for m in args.methods:
        print(f"| {m:<22} | {med[m]['warm'] * 1e3:13.1f} | {gbps[m]['warm']:9.2f} | {med[m]['cold'] * 1e3:13.1f} "
              f"| {gbps[m]['cold']:9.2f} |")
    checks = {}

    def say(key: str, value: float, text: str, target: float | None = None) -> None:
        checks[key] = value
        if target is not None:
            want = f"{target * 100:.0f}%" if key.startswith("cold") else f"{target:g}x"
            text += f" (target >= {want}): {'MET' if value >= target else 'NOT MET'}"
        print(text)
    if "files_packed" in med:
        f = med["files_packed"]["warm"]
        if "numpy_packed" in med:
            say("warm_ratio_files_vs_numpy_packed", med["numpy_packed"]["warm"] / f,
                f"warm: files_packed is {med['numpy_packed']['warm'] / f:.2f}x numpy_packed per batch",
                TARGET_WARM_RATIO)
        if "files_packed_pread" in med:
            say("warm_ratio_files_vs_pread", med["files_packed_pread"]["warm"] / f,
                f"warm: files_packed is {med['files_packed_pread']['warm'] / f:.2f}x files_packed_pread", 1.0)
        say("warm_fraction_files_packed", gbps["files_packed"]["warm"] / lim["memcpy_warm"],
            f"warm: files_packed reaches {gbps['files_packed']['warm'] / lim['memcpy_warm'] * 100:.0f}% of the "
            "parallel memcpy out of the page cache")
    for m in ("files_packed", "files_packed_direct", "files_packed_pread"):
        if m in gbps:
            frac = gbps[m]["cold"] / lim["direct_cold_best"]
            say(f"cold_fraction_{m}", frac, f"cold: {m} reaches {frac * 100:.0f}% of the best raw O_DIRECT rate",
                TARGET_COLD_FRACTION if m == "files_packed" else None)
    os.makedirs(args.out, exist_ok=True)
    report = {"machine": {"node": platform.node(), "cpus": os.cpu_count(), "platform": platform.platform(),
                          "torch": torch.__version__, "device": args.device,
                          "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None},
              "config": vars(args), "reader": reader, "file_bytes": file_bytes, "bytes_per_batch": bytes_per_batch,
              "epoch_s_per_batch": times, "limits_gbps": limits, "median_ms": {m: {s: v * 1e3 for s, v in d.items()}
                                                                              for m, d in med.items()},
              "gbps": gbps, "checks": checks, "stats_main_process": stats, "provenance": provenance(argv)}
    path = os.path.join(args.out, "bench_files.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
