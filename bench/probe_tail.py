"""Where the slow calls of start_copy spend their time: each call timed (sync before and after,
the garbage collector on) with the engine's stage counters read around it, then the stages of
the median calls compared with those of the slowest 1%.

    python3 bench/probe_tail.py [--device cuda:0] [--calls 3000] [--only seed16 seed64]

Per workload and direction it prints the distribution, the collections that ran inside slow
calls, and per stage (traverse, plan, outputs, views, waiting in get; on the transfer thread
queueing, staging, issuing DMAs, synchronizing) the mean over the calls between p40 and p60 and
over the calls at or above p99, in microseconds, so that the stage that grows in the tail is
named rather than guessed.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mtc_loader  # noqa: E402
from workloads import seed_batch, tree_map, uniform  # noqa: E402

STAGES = ["ns_traverse", "ns_plan", "ns_outputs", "ns_views", "ns_get_wait", "ns_queue", "ns_stage",
          "ns_dma_issue", "ns_sync", "jobs_inline", "jobs_taken_back", "worker_wakeups", "pinned_allocs", "gc_early_collections"]
WORKLOADS = {"seed16": lambda: seed_batch(16, 0), "seed64": lambda: seed_batch(64, 0),
             "4096x64B": lambda: uniform(4096, 64, 0)}


class _GcWatch:
    def __init__(self) -> None:
        self.gens: list[int] = []
        self.t0 = 0.0
        self.ms = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.t0 = time.perf_counter()
            self.gens.append(info["generation"])
        else:
            self.ms += (time.perf_counter() - self.t0) * 1e3


def probe(name: str, src, target, calls: int, opts: dict) -> None:
    sync = torch.cuda.synchronize
    for _ in range(50):
        mtc_loader.start_copy(src, target, **opts).get()
    watch = _GcWatch()
    gc.callbacks.append(watch)
    wall = np.zeros(calls)
    stages = np.zeros((calls, len(STAGES)))
    gcs: list[tuple[int, ...]] = []
    gc_ms = np.zeros(calls)
    try:
        for i in range(calls):
            before = mtc_loader.stats()
            watch.gens, watch.ms = [], 0.0
            sync()
            t0 = time.perf_counter()
            mtc_loader.start_copy(src, target, **opts).get()
            sync()
            wall[i] = (time.perf_counter() - t0) * 1e3
            after = mtc_loader.stats()
            stages[i] = [after[k] - before[k] for k in STAGES]
            gcs.append(tuple(watch.gens))
            gc_ms[i] = watch.ms
    finally:
        gc.callbacks.remove(watch)
    p50, p99 = np.percentile(wall, 50), np.percentile(wall, 99)
    mid = (wall >= np.percentile(wall, 40)) & (wall <= np.percentile(wall, 60))
    tail = wall >= p99
    print(f"\n{name}: {calls} calls, mean {wall.mean():.3f} p50 {p50:.3f} p90 {np.percentile(wall, 90):.3f} "
          f"p99 {p99:.3f} max {wall.max():.3f} ms; p99/p50 {p99 / p50:.2f}")
    slow = wall > 1.4 * p50
    blocks = [f"{b.mean():.2f}" for b in np.array_split(wall, 10)]
    print(f"  calls above 1.4x p50: {slow.mean() * 100:.1f}%; mean of each tenth of the run: {' '.join(blocks)}")
    with_gc = [i for i in range(calls) if gcs[i]]
    print(f"  calls with a collection: {len(with_gc)} (gen2 in {sum(2 in g for g in gcs)}); "
          f"tail calls with one: {sum(1 for i in np.flatnonzero(tail) if gcs[i])} of {int(tail.sum())}; "
          f"mean collection ms inside a call that had one: "
          f"{gc_ms[with_gc].mean() if with_gc else 0:.3f}")
    print(f"  {'stage':<16} {'p40-p60':>10} {'>=p99':>10}  (us per call; counts for the last five)")
    for k, s in enumerate(STAGES):
        scale = 1e-3 if s.startswith("ns_") else 1.0
        print(f"  {s:<16} {stages[mid, k].mean() * scale:10.2f} {stages[tail, k].mean() * scale:10.2f}")
    worst = np.argsort(wall)[-8:][::-1]
    print("  slowest calls (index: ms, gc gens, traverse/views/get_wait us):")
    for i in worst:
        print(f"    {i}: {wall[i]:.3f} {gcs[i]} {stages[i, 0] / 1e3:.0f}/{stages[i, 3] / 1e3:.0f}/"
              f"{stages[i, 4] / 1e3:.0f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--only", nargs="+", choices=sorted(WORKLOADS), default=["seed16", "seed64"])
    ap.add_argument("--no-thread", action="store_true", help="use_background_thread=False")
    ap.add_argument("--h2d-only", action="store_true")
    ap.add_argument("--pin-main", type=int, default=None, metavar="CPU",
                    help="after the engine's threads have started, bind the calling thread (only) to CPU")
    a = ap.parse_args()
    opts = {"use_background_thread": False} if a.no_thread else {}
    if a.pin_main is not None:
        mtc_loader.start_copy(WORKLOADS["seed16"](), a.device).get()  # the engine's threads start unbound
        os.sched_setaffinity(0, {a.pin_main})  # 0: the calling thread on Linux
    print(f"gc thresholds {gc.get_threshold()}, options {opts}, main thread on CPUs {sorted(os.sched_getaffinity(0))}")
    for name in a.only:
        data = WORKLOADS[name]()
        probe(f"{name} H2D", data, a.device, a.calls, opts)
        if not a.h2d_only:
            probe(f"{name} D2H", tree_map(lambda t: t.to(a.device), data), "cpu", a.calls, opts)


if __name__ == "__main__":
    main()
