"""Where the slow calls of start_copy spend their time: each call timed (sync before and after,
the garbage collector on) with the engine's stage counters read around it, then the stages of
the median calls compared with those of the slowest 1%.

    python3 tools/diagnostics/probe_tail.py [--device cuda:0] [--calls 3000] [--only seed16 seed64]

Per workload and direction it prints the distribution, the collections that ran inside slow
calls, and per stage (traverse, plan, outputs, views, waiting in get; on the transfer thread
queueing, staging, issuing DMAs, synchronizing) the mean over the calls between p40 and p60 and
over the calls at or above p99, in microseconds, so that the stage that grows in the tail is
named rather than guessed.

Beside the stages it reads the calling thread's own counters around each call (perf_event_open:
instructions and cycles where the machine exposes a hardware PMU; time on the CPU, page faults,
context switches and migrations always), so that a slow call is classed by what grew: more
instructions (more work in the call), more cycles for the same instructions (a slower core:
caches or a busy sibling), or more wall time for the same cycles and CPU time (a clock that runs
slower, or a virtual CPU the host did not run). After each call it also times a fixed piece of
pure-CPU work (the yardstick: workloads.machine_speed's loop, about ten microseconds, outside
the call's time): if the yardstick is slow
right beside the slow calls, the machine was slow, not the call.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import os
import platform
import struct
import sys
import time

import numpy as np
import torch

# the benchmarks' workloads, in bench/
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "bench"))
import mtc_loader  # noqa: E402
from workloads import machine_speed, seed_batch, tree_map, uniform  # noqa: E402

STAGES = ["ns_traverse", "ns_plan", "ns_outputs", "ns_views", "ns_get_wait", "ns_queue", "ns_stage",
          "ns_dma_issue", "ns_sync", "jobs_inline", "jobs_taken_back", "worker_wakeups", "pinned_allocs", "gc_early_collections"]
WORKLOADS = {"seed16": lambda: seed_batch(16, 0), "seed64": lambda: seed_batch(64, 0),
             "4096x64B": lambda: uniform(4096, 64, 0)}


class _ThreadCounters:
    """The calling thread's counters, opened with perf_event_open (Linux x86-64 and arm64)."""

    SYSCALL = {"x86_64": 298, "aarch64": 241}  # __NR_perf_event_open

    EVENTS = [("instructions", 0, 1), ("cycles", 0, 0), ("cpu_ns", 1, 1), ("faults", 1, 2),
              ("switches", 1, 3), ("migrations", 1, 4)]

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.names: list[str] = []
        self.fds: list[int] = []
        self.missing: list[str] = []
        nr = self.SYSCALL.get(platform.machine())
        for name, kind, config in self.EVENTS:
            if nr is None:
                self.missing.append(f"{name} (no perf_event_open number for {platform.machine()})")
                continue
            attr = ctypes.create_string_buffer(struct.pack("=IIQQQQQIIQ", kind, 64, config, 0, 0, 0, 0, 0, 0, 0))
            fd = libc.syscall(nr, attr, 0, -1, -1, 0)  # this thread, any CPU
            if fd < 0:
                self.missing.append(f"{name} ({os.strerror(ctypes.get_errno())})")
            else:
                self.names.append(name)
                self.fds.append(fd)

    def read(self) -> list[int]:
        return [int.from_bytes(os.read(fd, 8), "little") for fd in self.fds]

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)


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
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(50):
        mtc_loader.start_copy(src, target, **opts).get()
    watch = _GcWatch()
    counters = _ThreadCounters()
    counts = np.zeros((calls, len(counters.names)))
    yard = np.zeros(calls)
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
            c0 = counters.read()
            t0 = time.perf_counter()
            mtc_loader.start_copy(src, target, **opts).get()
            sync()
            wall[i] = (time.perf_counter() - t0) * 1e3
            counts[i] = np.subtract(counters.read(), c0)
            yard[i] = machine_speed(300) * 1e6  # us
            after = mtc_loader.stats()
            stages[i] = [after[k] - before[k] for k in STAGES]
            gcs.append(tuple(watch.gens))
            gc_ms[i] = watch.ms
    finally:
        gc.callbacks.remove(watch)
        counters.close()
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
    _print_counters(counters, counts, wall, mid, tail)
    print(f"  yardstick after the call: p40-p60 calls {yard[mid].mean():.2f} us, >=p99 calls "
          f"{yard[tail].mean():.2f} us (all calls: p50 {np.median(yard):.2f}, p99 {np.percentile(yard, 99):.2f}); "
          f"correlation with the call's wall time {np.corrcoef(wall, yard)[0, 1]:.2f}")
    worst = np.argsort(wall)[-8:][::-1]
    print("  slowest calls (index: ms, gc gens, traverse/views/get_wait us):")
    for i in worst:
        print(f"    {i}: {wall[i]:.3f} {gcs[i]} {stages[i, 0] / 1e3:.0f}/{stages[i, 3] / 1e3:.0f}/"
              f"{stages[i, 4] / 1e3:.0f}")


def _print_counters(counters: _ThreadCounters, counts: np.ndarray, wall: np.ndarray,
                    mid: np.ndarray, tail: np.ndarray) -> None:
    """The calling thread's counters of the median and the tail calls, and what they make."""
    if counters.missing:
        print(f"  counters not available here: {', '.join(counters.missing)}")
    if not counters.names:
        return
    col = {n: counts[:, k] for k, n in enumerate(counters.names)}
    rows = [("wall us", wall * 1e3)] + [(n, col[n]) for n in counters.names]
    if "cpu_ns" in col:
        rows.append(("cpu/wall", col["cpu_ns"] / (wall * 1e6)))
    if "instructions" in col and "cycles" in col:
        rows.append(("IPC", col["instructions"] / np.maximum(col["cycles"], 1)))
        if "cpu_ns" in col:
            rows.append(("GHz on CPU", col["cycles"] / np.maximum(col["cpu_ns"], 1)))
    print(f"  {'thread counter':<16} {'p40-p60':>12} {'>=p99':>12} {'ratio':>7}  (mean per call)")
    for name, v in rows:
        m, t = v[mid].mean(), v[tail].mean()
        print(f"  {name:<16} {m:12.4g} {t:12.4g} {t / m if m else float('nan'):7.2f}")
    if "cpu_ns" in col:
        r = np.corrcoef(wall, col["cpu_ns"])[0, 1]
        print(f"  correlation of wall time with time on the CPU over all calls: {r:.2f}")
    if "instructions" in col:
        r = np.corrcoef(wall, col["instructions"])[0, 1]
        print(f"  correlation of wall time with instructions over all calls: {r:.2f}")


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
