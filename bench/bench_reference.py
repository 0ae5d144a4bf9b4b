"""``start_copy`` timed the way the reference package's own evaluation times it, and as a
distribution: the mean a user comparing the two sees, and the tail.

Usage::

    python3 bench/bench_reference.py [--device cuda:0] [--runs 10] [--iters 1000] [--warmup 100]
                                     [--calls 3000] [--baseline-calls 300] [--only seed16 ...]
                                     [--early-gc-off]
                                     [--out DIR]

Two parts, the garbage collector on throughout (as in a user's program; nothing here changes
its settings):

1. The reference's harness, on its example batch (seed16, the 16-sample multi-camera meta-data):
   ``--runs`` runs of ``--warmup`` untimed and ``--iters`` timed iterations per method, each
   timed as ``torch.cuda.synchronize(); t0; copy; torch.cuda.synchronize(); t1``; per run the
   mean, then the mean and standard deviation over runs, and the speedup as the reference
   reports it (the mean of the runs' ratios). Methods, alternating run by run:
   ``start_copy(batch, dev).get()``, ``.to()`` with the structure written out by hand
   (``to_hardcoded``, what the reference's evaluation compares against), a generic recursive
   ``.to()`` (``to_generic``), and the reference package itself
   (``accvlab.multi_tensor_copier``) when it is importable (it is not part of this project: put a
   build of its sources on PYTHONPATH).
2. Distributions: ``--calls`` calls of start_copy (``--baseline-calls`` of each baseline), one
   at a time with a sync before and after each, for H2D and D2H of seed16, seed64 and
   4096 x 64 B: mean, p50, p90, p99 and max, the machine's own speed meanwhile (a fixed
   pure-CPU loop timed after every 100 calls: its slowest against its median), and the
   collections the collector ran per generation meanwhile (of them, the middle-generation ones the engine ran ahead of a batch's
   outputs; ``--early-gc-off`` adds start_copy without those, ``mtc_no_early_gc``).

Targets (one run on the GPU machine): harness mean of ``start_copy`` at least 9x
``to_hardcoded``; for seed16 and seed64, H2D and D2H: p99 at most 1.5x p50, max under 5 ms,
mean within 10% of p50.

Writes ``bench_reference.json`` in ``--out`` (default ``bench/results``) and prints the tables.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import machine_speed, seed_batch, tree_map, uniform  # noqa: E402

import mtc_loader  # noqa: E402

try:  # the reference package, for the comparison its users make
    from accvlab.multi_tensor_copier import start_copy as ref_start_copy  # type: ignore
except Exception:  # not installable here
    ref_start_copy = None

WORKLOADS: dict[str, Callable[[], Any]] = {
    "seed16": lambda: seed_batch(16, 0),
    "seed64": lambda: seed_batch(64, 0),
    "4096x64B": lambda: uniform(4096, 64, 0),
}
CAMS = ("bounding_boxes", "class_ids", "active", "depths", "proj_mat")
GT = ("bounding_boxes_3d", "class_ids", "active")


def to_hardcoded(batch: Any, dev: Any) -> Any:
    """``.to()`` per tensor with the seed workload's structure written out by hand."""
    return [
        {
            "cams_gt": [
                {
                    "bounding_boxes": c["bounding_boxes"].to(dev),
                    "class_ids": c["class_ids"].to(dev),
                    "active": c["active"].to(dev),
                    "depths": c["depths"].to(dev),
                    "proj_mat": c["proj_mat"].to(dev),
                }
                for c in s["cams_gt"]
            ],
            "gt_data": {
                "bounding_boxes_3d": s["gt_data"]["bounding_boxes_3d"].to(dev),
                "class_ids": s["gt_data"]["class_ids"].to(dev),
                "active": s["gt_data"]["active"].to(dev),
            },
        }
        for s in batch
    ]


def to_list(batch: Any, dev: Any) -> Any:
    """``.to()`` per tensor of a flat list (the 4096 x 64 B workload), written out."""
    return [t.to(dev) for t in batch]


def to_generic(batch: Any, dev: Any) -> Any:
    """A generic recursive ``.to()`` over lists, tuples and dicts."""
    return tree_map(lambda t: t.to(dev), batch)


def mtc(batch: Any, dev: Any) -> Any:
    return mtc_loader.start_copy(batch, dev).get()


def reference(batch: Any, dev: Any) -> Any:
    return ref_start_copy(batch, dev).get()


def methods_for(name: str) -> dict[str, Callable[[Any, Any], Any]]:
    out = {"mtc": mtc, "to_hardcoded": to_list if name == "4096x64B" else to_hardcoded,
           "to_generic": to_generic}
    if ref_start_copy is not None:
        out["reference"] = reference
    return out


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn: Callable[[Any, Any], Any], batch: Any, dev: Any) -> float:
    _sync()
    t0 = time.perf_counter()
    fn(batch, dev)  # the result is dropped at once, as in the reference's harness
    _sync()
    return time.perf_counter() - t0


class _Collections:
    def __init__(self) -> None:
        self.by_gen = [0, 0, 0]

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.by_gen[info["generation"]] += 1


def harness(batch: Any, dev: Any, runs: int, iters: int, warmup: int, methods: dict) -> dict:
    """The reference's method: per run and method ``warmup`` untimed calls, then ``iters`` timed
    ones; the mean per run; mean and std over runs, and the speedup over ``.to()`` written out
    as the reference reports it: the mean over runs of each run's ratio."""
    per_run: dict[str, list[float]] = {m: [] for m in methods}
    speed: dict[str, list[float]] = {m: [] for m in methods}  # machine_speed() after each run, in ms
    names = list(methods)
    for r in range(runs):
        k = r % len(names)
        for m in names[k:] + names[:k]:  # alternating, the order rotated run by run
            for _ in range(warmup):
                methods[m](batch, dev)
            secs = [_timed(methods[m], batch, dev) for _ in range(iters)]
            per_run[m].append(statistics.fmean(secs) * 1e3)
            speed[m].append(machine_speed() * 1e3)
    out = {}
    base_runs = per_run["to_hardcoded"]
    for m, means in per_run.items():
        ratios = [b / x for b, x in zip(base_runs, means)]
        out[m] = {"mean_ms": statistics.fmean(means),
                  "std_ms": statistics.stdev(means) if len(means) > 1 else 0.0, "runs_ms": means,
                  "speedup_vs_to_hardcoded": statistics.fmean(ratios),
                  "speedup_std": statistics.stdev(ratios) if len(ratios) > 1 else 0.0,
                  "machine_loop_ms": speed[m]}
    return out


def distribution(batch: Any, dev: Any, calls: int, fn: Callable[[Any, Any], Any]) -> dict:
    """``calls`` calls, sync before and after each: mean and percentiles in ms, collections, and
    the machine's speed (``machine_speed``) measured after every 100 calls."""
    for _ in range(20):
        _timed(fn, batch, dev)
    seen = _Collections()
    speed: list[float] = []
    gc.callbacks.append(seen)
    try:
        ms = np.zeros(calls)
        for i in range(calls):
            ms[i] = _timed(fn, batch, dev) * 1e3
            if i % 100 == 99:
                speed.append(machine_speed() * 1e3)
    finally:
        gc.callbacks.remove(seen)
    return {"mean_ms": float(ms.mean()), "p50_ms": float(np.percentile(ms, 50)),
            "p90_ms": float(np.percentile(ms, 90)), "p99_ms": float(np.percentile(ms, 99)),
            "max_ms": float(ms.max()), "median_ms": float(np.median(ms)),
            "collections_by_generation": seen.by_gen,
            "machine_loop_ms": speed, "machine_slowest_vs_median": (max(speed) / statistics.median(speed))
            if speed else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--runs", type=int, default=10, help="runs of the reference's harness (0: skip it)")
    p.add_argument("--iters", type=int, default=1000)
    p.add_argument("--warmup", type=int, default=100, help="untimed calls per method and run")
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--baseline-calls", type=int, default=300,
                   help="calls of each baseline (.to() per tensor) in the distributions")
    p.add_argument("--only", nargs="+", choices=sorted(WORKLOADS), default=sorted(WORKLOADS))
    p.add_argument("--early-gc-off", action="store_true",
                   help="in the distributions, also time start_copy with the engine's middle-generation "
                        "collections ahead of the outputs turned off (mtc_no_early_gc): the before and after "
                        "of one process")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        sys.exit(f"--device {dev} asked for, but CUDA is not available")
    print(f"gc enabled: {gc.isenabled()}, thresholds {gc.get_threshold()}; reference package: "
          f"{'imported' if ref_start_copy else 'not available (its comparison is skipped)'}")
    results: dict[str, Any] = {"device": str(dev), "gc_threshold": gc.get_threshold(), "harness": {},
                               "distribution": {}}
    if dev.type == "cuda" and args.runs > 0:
        seed16 = WORKLOADS["seed16"]()
        h = harness(seed16, dev, args.runs, args.iters, args.warmup, methods_for("seed16"))
        results["harness"]["seed16_h2d"] = h
        print(f"\nreference harness, seed16 H2D: {args.runs} runs x ({args.warmup} warm-up + {args.iters}) "
              "iterations (mean per run; mean +- std over runs; speedup: mean +- std of the runs' ratios)")
        for m, v in h.items():
            print(f"  {m:<14} {v['mean_ms']:8.3f} +- {v['std_ms']:.3f} ms   "
                  f"{v['speedup_vs_to_hardcoded']:6.2f}x +- {v['speedup_std']:.2f}x to_hardcoded; runs "
                  + " ".join(f"{x:.3f}" for x in v["runs_ms"]))
        loops = [x for v in h.values() for x in v["machine_loop_ms"]]
        print(f"  machine: a fixed CPU loop after each run took {min(loops):.2f} to {max(loops):.2f} ms")
    print(f"\ndistributions: {args.calls} calls each, sync before and after each (ms)")
    print(f"  {'workload':<10} {'dir':<4} {'method':<16} {'mean':>8} {'p50':>8} {'p90':>8} {'p99':>8} "
          f"{'max':>8}  collections (gen0, gen1, gen2), of them run ahead by the engine; machine: "
          "the slowest run of a fixed CPU loop against its median")
    cpu = torch.device("cpu")
    for name in args.only:
        data = WORKLOADS[name]()
        cases = [("H2D", data, dev)] if dev.type == "cuda" else [("np2cpu", tree_map(lambda t: t.numpy(), data), cpu)]
        if dev.type == "cuda":
            cases.append(("D2H", tree_map(lambda t: t.to(dev), data), cpu))
        for direction, src, target in cases:
            methods = methods_for(name)
            if args.early_gc_off:
                methods = {"mtc": methods.pop("mtc"), "mtc_no_early_gc": mtc, **methods}
            for m, fn in methods.items():
                if direction == "np2cpu" and not m.startswith("mtc"):
                    continue
                prev = mtc_loader._engine._early_gc(m != "mtc_no_early_gc")
                early = mtc_loader.stats()["gc_early_collections"]
                try:
                    d = distribution(src, target, args.calls if m.startswith("mtc") else args.baseline_calls, fn)
                finally:
                    mtc_loader._engine._early_gc(prev)
                d["gc_early_collections"] = mtc_loader.stats()["gc_early_collections"] - early
                results["distribution"][f"{name}_{direction}_{m}"] = d
                slow = d["machine_slowest_vs_median"]
                print(f"  {name:<10} {direction:<4} {m:<16} {d['mean_ms']:8.3f} {d['p50_ms']:8.3f} "
                      f"{d['p90_ms']:8.3f} {d['p99_ms']:8.3f} {d['max_ms']:8.3f}  "
                      f"{tuple(d['collections_by_generation'])}, {d['gc_early_collections']}"
                      + (f"; machine {slow:.2f}x" if slow else ""))
    results["stats"] = mtc_loader.stats()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_reference.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1, default=str)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
