"""Benchmark the DataLoader path: worker processes -> main process -> device.

Usage::

    python3 bench/bench_loader.py [--device cuda:0] [--workers 2 4 8] [--batches N]
                                  [--rounds N] [--batch-size 16] [--step-ms MS]
                                  [--quick] [--out DIR]

The data: seed samples (bench/workloads.py; batch 16 = 528 tensors, ~150 KB), made fresh in
``__getitem__`` from a generator seeded by the index (as a real dataset decodes its samples).

Methods, each a ``DataLoader(..., num_workers=W, persistent_workers=True)`` over the same
dataset:

- ``plain_to``: ``collate_fn=list``, then a generic per-tensor ``.to(device)`` (the baseline);
- ``plain_pin_nb``: the same with ``pin_memory=True`` and ``.to(device, non_blocking=True)``;
- ``plain_start_copy``: ``collate_fn=list``, then ``mtc_loader.start_copy(batch, device).get()``;
- ``packed_prefetch``: ``collate_fn=mtc_loader.PackedCollate(list)`` wrapped in
  ``mtc_loader.PrefetchLoader(loader, device, depth=2)``.

What is timed: every loader first runs one warm-up epoch (workers started, arenas and pinned
memory in place), then ``--rounds`` timed epochs, the methods interleaved (one epoch each per
round, order rotated between rounds). Per batch, on the main thread: ``time.perf_counter`` and
``time.thread_time`` around the loader's ``__next__`` plus the copy call; then the device is
synchronized (the batch is usable), and an optional simulated training step (``--step-ms``:
on a CUDA device real GPU work, a ``torch.cuda._sleep`` kernel calibrated to that many ms, waited
for; on the CPU a sleep. It lets the workers and the prefetch service run ahead, so that the
main thread's time is its own cost rather than waiting on them). Reported per worker count and method:

- ``wall_ms``: epoch wall time / batches (median over rounds), the step excluded;
- ``main_ms``: the main thread's time in ``__next__`` + copy per batch: per epoch the total
  over its batches / batches, then the median over rounds (a median over single batches would
  mislead: with several workers, one ``__next__`` often receives and unpickles the batches that
  arrive out of order, and the next ones return at once); every batch's time is in the JSON;
- ``main_cpu_ms``: the same as CPU time of the main thread (``thread_time``), which leaves out
  waiting for the workers;
- ``main_steady_ms`` / ``main_cpu_steady_ms``: the same without each epoch's first batch (which
  waits for the persistent workers to resume and fill the pipeline): the per-batch cost in a
  long epoch;
- ratios ``wall_ms(plain_to) / wall_ms(method)`` and the same for ``main_ms``.

Outputs (in ``--out``, default ``bench/results``): ``bench_loader.json`` (machine info, config,
every sample, the arena's counters), ``bench_loader.png`` (ms per batch by worker count; skipped
with a notice without matplotlib), and a table on stdout with the targets next to the results.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
import warnings
from typing import Any, Callable

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import count_tensors, seed_sample, tree_map  # noqa: E402
from provenance import provenance  # noqa: E402

import mtc_loader  # noqa: E402

METHODS = ["plain_to", "plain_pin_nb", "plain_start_copy", "packed_prefetch"]
BASELINE = "plain_to"
LABELS = {
    "plain_to": "DataLoader(list) + .to()",
    "plain_pin_nb": "DataLoader(list, pin_memory) + .to(nb)",
    "plain_start_copy": "DataLoader(list) + start_copy",
    "packed_prefetch": "PackedCollate(list) + PrefetchLoader",
}
# The targets, checked and printed next to the results.
TARGET_GPU_RATIO_4W = 50.0   # packed_prefetch vs plain_to, wall, 4 workers, GPU machine
TARGET_MAIN_MS = 1.5         # packed_prefetch main-thread time per batch, seed16
TARGET_NEXT_MS = 0.1  # the prefetch service: __next__ only hands out a finished batch
TARGET_CPU_RATIO_2W = 10.0   # packed_prefetch vs plain_to, wall, 2 workers, device=cpu, 2 cores


class SeedSamples(Dataset):
    """Seed samples made fresh per index (deterministic): 33 tensors each."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return seed_sample(torch.Generator().manual_seed(i))


# --------------------------------------------------------------------------------------------
# Methods: (make the iterable, copy one batch)
# --------------------------------------------------------------------------------------------


def _to(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    return tree_map(lambda t: t.to(device, non_blocking=non_blocking) if isinstance(t, torch.Tensor) else t,
                    batch)


def make_method(name: str, ds: Dataset, workers: int, batch_size: int, device: torch.device,
                arena_bytes: int) -> tuple[Any, Callable[[Any], Any], Any]:
    """Returns (iterable of batches, copy function, PackedCollate or None)."""
    common = dict(batch_size=batch_size, num_workers=workers, persistent_workers=workers > 0)
    if name == "plain_to":
        return DataLoader(ds, collate_fn=list, **common), lambda b: _to(b, device), None
    if name == "plain_pin_nb":
        with warnings.catch_warnings():  # no accelerator: pin_memory is a no-op (and says so)
            warnings.simplefilter("ignore")
            dl = DataLoader(ds, collate_fn=list, pin_memory=True, **common)
        return dl, lambda b: _to(b, device, non_blocking=True), None
    if name == "plain_start_copy":
        return DataLoader(ds, collate_fn=list, **common), lambda b: mtc_loader.start_copy(b, device).get(), None
    if name == "packed_prefetch":
        pc = mtc_loader.PackedCollate(list, arena_bytes=arena_bytes)
        dl = DataLoader(ds, collate_fn=pc, **common)
        return mtc_loader.PrefetchLoader(dl, device, depth=2), lambda b: b, pc
    raise ValueError(name)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_CYCLES_PER_S: dict[int, float] = {}


def step(device: torch.device, seconds: float) -> None:
    """A simulated training step: on CUDA a spinning kernel of about ``seconds`` (calibrated once
    per device), then a synchronization; on the CPU a sleep."""
    if device.type != "cuda":
        time.sleep(seconds)
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    rate = _CYCLES_PER_S.get(index)
    if rate is None:
        cycles = 50_000_000
        torch.cuda._sleep(cycles // 10)  # warm up the kernel
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        torch.cuda._sleep(cycles)
        torch.cuda.synchronize(device)
        rate = _CYCLES_PER_S[index] = cycles / (time.perf_counter() - t0)
    torch.cuda._sleep(int(rate * seconds))
    torch.cuda.synchronize(device)


def run_epoch(iterable: Any, copy: Callable[[Any], Any], device: torch.device, step_s: float,
              check: Callable[[int, Any], None] | None = None) -> dict:
    """One epoch; per batch the main thread's time in __next__ + copy (wall and CPU)."""
    main, cpu = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pin_memory without an accelerator warns per iterator
        it = iter(iterable)
    t_epoch = time.perf_counter()
    stepped = 0.0
    k = 0
    while True:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            batch = next(it)
        except StopIteration:
            break
        out = copy(batch)
        t1, c1 = time.perf_counter(), time.thread_time()
        synchronize(device)
        main.append((t1 - t0) * 1e3)
        cpu.append((c1 - c0) * 1e3)
        if check is not None:
            check(k, out)
        del batch, out
        k += 1
        if step_s > 0:
            s0 = time.perf_counter()
            step(device, step_s)
            stepped += time.perf_counter() - s0
    wall = time.perf_counter() - t_epoch - stepped
    del it
    return {"batches": k, "wall_ms": wall * 1e3 / max(k, 1), "main_ms": main, "main_cpu_ms": cpu}


def make_checker(ds: SeedSamples, batch_size: int, device: torch.device) -> Callable[[int, Any], None]:
    """Bitwise check of a warm-up epoch's batch against the dataset's samples."""
    def check(k: int, out: Any) -> None:
        ref = [ds[k * batch_size + j] for j in range(batch_size)]
        got = tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, out)
        flat_ref, flat_got = [], []
        tree_map(lambda t: flat_ref.append(t), ref)
        tree_map(lambda t: flat_got.append(t), got)
        if len(flat_ref) != len(flat_got) or not all(
                a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
                for a, b in zip(flat_ref, flat_got)):
            raise AssertionError(f"batch {k}: the loader's output differs from the dataset's samples")
    return check


# --------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------


def machine_info(device: torch.device) -> dict:
    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "numpy": np.__version__,
        "device": str(device),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available() else [],
        "mtc_loader": mtc_loader.__version__,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    return info


def summarize(res: dict[int, dict[str, dict]]) -> None:
    """Adds medians and ratios vs the baseline, per worker count, in place."""
    for w, methods in res.items():
        for name, r in methods.items():
            r["wall_ms_median"] = statistics.median(r["wall_ms"])
            r["main_ms_per_batch"] = statistics.median(r["main_ms_rounds"])
            r["main_cpu_ms_per_batch"] = statistics.median(r["main_cpu_ms_rounds"])
            r["main_steady_ms"] = statistics.median(r["main_steady_ms_rounds"])
            r["main_cpu_steady_ms"] = statistics.median(r["main_cpu_steady_ms_rounds"])
            r["main_ms_batch_median"] = statistics.median(r["main_ms"])
            r["main_ms_batch_max"] = max(r["main_ms"])
        base = methods.get(BASELINE)
        for name, r in methods.items():
            r["ratio_wall_vs_plain_to"] = base["wall_ms_median"] / r["wall_ms_median"] if base else None
            r["ratio_main_vs_plain_to"] = base["main_ms_per_batch"] / r["main_ms_per_batch"] if base else None


def print_table(res: dict[int, dict[str, dict]]) -> None:
    print("wall: epoch time / batches (median of rounds); main: the main thread's time in __next__ + copy "
          "per batch (total / batches, median of rounds), and its CPU time; steady: without each epoch's first batch")
    header = (f"{'workers':>7}  {'method':<40} {'wall ms/batch':>13} {'main ms':>9} {'main CPU ms':>11} "
              f"{'steady main':>11} {'steady CPU':>10} {'vs .to() wall':>13} {'vs .to() main':>13}")
    print(header)
    print("-" * len(header))
    for w, methods in res.items():
        for name, r in methods.items():
            rw = f"{r['ratio_wall_vs_plain_to']:.1f}x" if r["ratio_wall_vs_plain_to"] else "-"
            rm = f"{r['ratio_main_vs_plain_to']:.1f}x" if r["ratio_main_vs_plain_to"] else "-"
            print(f"{w:>7}  {LABELS[name]:<40} {r['wall_ms_median']:>13.3f} {r['main_ms_per_batch']:>9.3f} "
                  f"{r['main_cpu_ms_per_batch']:>11.3f} {r['main_steady_ms']:>11.3f} {r['main_cpu_steady_ms']:>10.3f} "
                  f"{rw:>13} {rm:>13}")
        print()


def targets(res: dict[int, dict[str, dict]], device: torch.device, batch_size: int,
            step_ms: float = 0.0) -> list[dict]:
    """The targets, each with the measured value and whether it applies to this run."""
    out = []
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()

    def get(w: int, m: str) -> dict | None:
        return res.get(w, {}).get(m)

    p4 = get(4, "packed_prefetch")
    out.append({
        "target": f"PackedCollate+PrefetchLoader >= {TARGET_GPU_RATIO_4W:g}x vs plain + .to() at 4 workers "
                  "(GPU machine)",
        "measured": p4["ratio_wall_vs_plain_to"] if p4 else None, "goal": TARGET_GPU_RATIO_4W,
        "applies": device.type == "cuda" and p4 is not None,
    })
    packed = [(w, m["packed_prefetch"]) for w, m in res.items() if "packed_prefetch" in m]
    if packed:
        w, best = min(packed, key=lambda x: x[1]["main_steady_ms"])
        for key, what in (("main_ms_per_batch", "wall, whole epoch"), ("main_steady_ms", "wall, steady"),
                          ("main_cpu_steady_ms", "CPU, steady")):
            out.append({
                "target": f"main-thread time per batch <= {TARGET_MAIN_MS:g} ms for seed{batch_size} "
                          f"({what}, best worker count: {w})",
                "measured": best[key], "goal": TARGET_MAIN_MS, "lower_is_better": True,
                "applies": batch_size == 16,
            })
        # the prefetch service's target: the training thread only takes a finished batch
        out.append({
            "target": f"training thread's __next__ per seed{batch_size} batch, steady, <= {TARGET_NEXT_MS:g} ms "
                      f"(wall, CUDA, with a step: --step-ms; best worker count: {w})",
            "measured": best["main_steady_ms"], "goal": TARGET_NEXT_MS, "lower_is_better": True,
            "applies": batch_size == 16 and device.type == "cuda" and step_ms > 0,
        })
    p2 = get(2, "packed_prefetch")
    out.append({
        "target": f"device=cpu, 2 cores: PackedCollate+PrefetchLoader >= {TARGET_CPU_RATIO_2W:g}x vs plain "
                  f"DataLoader(list) at 2 workers (this machine: {cores} cores)",
        "measured": p2["ratio_wall_vs_plain_to"] if p2 else None, "goal": TARGET_CPU_RATIO_2W,
        "applies": device.type == "cpu" and p2 is not None,
    })
    for t in out:
        m = t["measured"]
        if m is None:
            t["met"] = None
        else:
            t["met"] = m <= t["goal"] if t.get("lower_is_better") else m >= t["goal"]
    return out


def print_targets(ts: list[dict]) -> None:
    print("targets:")
    for t in ts:
        m = t["measured"]
        unit = " ms" if t.get("lower_is_better") else "x"
        val = "not measured" if m is None else f"{m:.3g}{unit}"
        verdict = "n/a here" if not t["applies"] else ("MET" if t["met"] else "NOT MET")
        print(f"  {t['target']}: {val} [{verdict}]")


def plot(res: dict[int, dict[str, dict]], path: str, title: str) -> bool:
    """ms per batch (wall, and main thread) by worker count, log scale. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("notice: matplotlib is not installed; skipping the plot")
        return False
    workers = list(res)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, key, what in ((axes[0], "wall_ms_median", "wall ms per batch"),
                          (axes[1], "main_steady_ms", "main thread per batch: __next__ + copy (steady)")):
        for name in METHODS:
            xs = [w for w in workers if name in res[w]]
            if not xs:
                continue
            ax.plot(xs, [res[w][name][key] for w in xs], marker="o", label=LABELS[name])
        if key == "main_steady_ms":
            ax.axhline(TARGET_MAIN_MS, color="black", linestyle="--", linewidth=1,
                       label=f"target {TARGET_MAIN_MS:g} ms")
        ax.set_xscale("log", base=2)
        ax.set_xticks(workers)
        ax.set_xticklabels([str(w) for w in workers])
        ax.set_yscale("log")
        ax.set_xlabel("DataLoader workers")
        ax.set_title(what)
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("ms per batch (log scale)")
    axes[1].legend(fontsize="small")
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
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8], help="worker counts (default 2 4 8)")
    p.add_argument("--batches", type=int, default=0, help="batches per epoch (default 20; --quick 6)")
    p.add_argument("--rounds", type=int, default=0, help="timed epochs per method (default 3; --quick 1)")
    p.add_argument("--batch-size", type=int, default=16, help="samples per batch (default 16: seed16)")
    p.add_argument("--step-ms", type=float, default=0.0,
                   help="simulated training step after each batch, in ms: GPU work on a CUDA device, "
                        "a sleep on the CPU (default 0)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=METHODS)
    p.add_argument("--arena-mib", type=int, default=64, help="PackedCollate arena size (default 64 MiB)")
    p.add_argument("--quick", action="store_true", help="few batches and rounds: a smoke run")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                   help="output folder (default bench/results)")
    args = p.parse_args(argv)
    args.batches = args.batches or (6 if args.quick else 20)
    args.rounds = args.rounds or (1 if args.quick else 3)
    if BASELINE not in args.methods:
        args.methods = [BASELINE] + args.methods
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # 4 and 8 workers on a machine with fewer cores: torch warns; the benchmark means it
    warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit(f"--device {device} asked for, but CUDA is not available (try --device cpu)")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    ds = SeedSamples(args.batches * args.batch_size)
    n, nbytes = count_tensors([ds[i] for i in range(args.batch_size)])
    print(f"seed{args.batch_size}: {n} tensors, {nbytes / 1e3:.1f} KB per batch; {args.batches} batches per epoch; "
          f"device {device}; workers {args.workers}; {args.rounds} timed epoch(s) per method", flush=True)
    checker = make_checker(ds, args.batch_size, device)

    res: dict[int, dict[str, dict]] = {}
    arena_stats: dict[int, dict] = {}
    for w in args.workers:
        loaders = {m: make_method(m, ds, w, args.batch_size, device, args.arena_mib << 20) for m in args.methods}
        res[w] = {m: {"wall_ms": [], "main_ms_rounds": [], "main_cpu_ms_rounds": [], "main_steady_ms_rounds": [],
                      "main_cpu_steady_ms_rounds": [], "main_ms": [], "main_cpu_ms": []} for m in args.methods}
        for m, (iterable, copy, _) in loaders.items():  # warm-up epoch, checked bitwise
            run_epoch(iterable, copy, device, 0.0, check=checker)
        # what exists now (torch, the loaders) is never garbage: keep the collector's full passes
        # (~100 ms with torch imported) from landing in a timed batch
        gc.collect()
        gc.freeze()
        for r in range(args.rounds):
            order = args.methods[r % len(args.methods):] + args.methods[:r % len(args.methods)]
            for m in order:
                iterable, copy, _ = loaders[m]
                gc.collect()
                e = run_epoch(iterable, copy, device, args.step_ms * 1e-3)
                res[w][m]["wall_ms"].append(e["wall_ms"])
                res[w][m]["main_ms_rounds"].append(sum(e["main_ms"]) / max(e["batches"], 1))
                res[w][m]["main_cpu_ms_rounds"].append(sum(e["main_cpu_ms"]) / max(e["batches"], 1))
                steady = max(e["batches"] - 1, 1)
                res[w][m]["main_steady_ms_rounds"].append(sum(e["main_ms"][1:]) / steady)
                res[w][m]["main_cpu_steady_ms_rounds"].append(sum(e["main_cpu_ms"][1:]) / steady)
                res[w][m]["main_ms"] += e["main_ms"]
                res[w][m]["main_cpu_ms"] += e["main_cpu_ms"]
        line = ", ".join(f"{m} {statistics.median(res[w][m]['wall_ms']):.2f} ms" for m in args.methods)
        print(f"[{w} workers] wall per batch: {line}", flush=True)
        pc = loaders.get("packed_prefetch", (None, None, None))[2]
        if pc is not None:
            arena_stats[w] = pc.stats()
        del loaders
        gc.unfreeze()
        gc.collect()

    summarize(res)
    print()
    print_table(res)
    ts = targets(res, device, args.batch_size, args.step_ms)
    print_targets(ts)

    os.makedirs(args.out, exist_ok=True)
    info = machine_info(device)
    report = {"machine": info, "config": vars(args), "tensors_per_batch": n, "bytes_per_batch": nbytes,
              "results": {str(w): m for w, m in res.items()}, "targets": ts,
              "arena_stats": {str(w): s for w, s in arena_stats.items()}, "mtc_stats": mtc_loader.stats()}
    report["provenance"] = provenance(argv)
    json_path = os.path.join(args.out, "bench_loader.json")
    with open(json_path, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(f"wrote {json_path}")
    where = info["gpus"][0] if info["gpus"] and device.type == "cuda" else f"CPU ({info['cpus_usable']} cores)"
    png_path = os.path.join(args.out, "bench_loader.png")
    if plot(res, png_path, f"DataLoader path, seed{args.batch_size}, device {device} on {where}"):
        print(f"wrote {png_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
