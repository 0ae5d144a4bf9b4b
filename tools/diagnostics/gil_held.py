"""How long the prefetch service holds the GIL per batch, as a training thread that spins in Python
beside it sees it (not the service's CPU time, which counts its GIL-free work too).

    python3 tools/diagnostics/gil_held.py [--device cuda:0|cpu] [--batches 200] [--workers 4]
                                          [--step-ms 5] [--rounds 3] [--gap-us 3] [--json PATH]

The loader is bench_train's (``collate_samples`` under ``PackedCollate``: per sample 6 camera
images and 33 small meta-data tensors, 265 leaves per batch of 8) in a ``PrefetchLoader`` over a
DataLoader with workers. The training thread spins for ``--step-ms`` per batch, counting loop
iterations, and takes the next batch; the same spin runs with no loader at all (``alone``),
alternating round by round. The spinning thread reads the clock on every iteration (about 0.1 us
apart); a pause longer than ``--gap-us`` is time it did not run: another thread of the process
held the GIL (or the CPU was taken from it). Per batch:

- ``held_ms``: the sum of those pauses during the step, less the same sum alone (the machine's own
  interruptions): the time the service (and any other thread of the loader) held the GIL while
  the training thread wanted it, with the hand-overs' wake-ups, which the training thread loses
  too. It does not depend on how fast the spin runs, which differs between rounds;
- ``handoffs``: how many such pauses, less those alone (the GIL's trips to the service);
- ``next_ms`` / ``next_mean_ms``: the ``__next__`` call, median and mean (the hand-out, outside
  the step);
- ``service_cpu_ms``: the service thread's CPU time per batch (``PrefetchLoader.stats()``, the
  upper bound ``held_ms`` tightens: it counts the GIL-free work too).

``ways`` (printed and in the JSON): over the measured batches, how many took each way of the
service's finish and hand-out (``side_finish_c`` / ``side_finish_python``, ``hand_out_c`` /
``hand_out_python``: ``MTC_C_HANDOFF=0`` picks the Python way, for an A/B) and had their DMA
issued in their chunk's GIL-free allocation window (``unpack_dma_in_alloc_window``); CUDA only.

The figures count the service's GIL only where the machine has a free core for each worker and
the service beside the spinning thread (the workers otherwise take CPU from it, which counts as
held too): ``--workers`` + 2 cores at the least. ``cpu_cores`` in the output says how many this
process may use. The device ``cpu`` runs the same loop with the copies on the host.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "bench"))
import mtc_loader  # noqa: E402
from bench_train import CameraSamples, collate_samples  # noqa: E402

WAYS = ("side_finish_c", "side_finish_python", "hand_out_c", "hand_out_python", "unpack_dma_in_alloc_window")


def spin(seconds: float, gap_s: float) -> tuple[int, float]:
    """Spins in Python for ``seconds``: (pauses longer than gap_s, their seconds)."""
    clock = time.perf_counter
    last = clock()
    end = last + seconds
    n, gaps = 0, 0.0
    while True:
        now = clock()
        if now - last > gap_s:
            gaps += now - last
            n += 1
        last = now
        if now >= end:
            return n, gaps


def alone(batches: int, step_s: float, gap_s: float) -> dict[str, float]:
    n = gaps = 0.0
    for _ in range(batches):
        i, g = spin(step_s, gap_s)
        n, gaps = n + i, gaps + g
    return {"pauses": n / batches, "gaps_ms": gaps * 1e3 / batches}


def with_service(loader_factory, device: str, batches: int, step_s: float, gap_s: float) -> dict[str, float]:
    pl = mtc_loader.PrefetchLoader(loader_factory(), device, depth=2)
    it = iter(pl)
    for _ in range(3):  # the epoch's start (workers, first batches) out of the figures
        next(it)
    pl.reset_stats()
    before = mtc_loader.stats()
    n = gaps = 0.0
    nexts = []
    for _ in range(batches):
        i, g = spin(step_s, gap_s)
        n, gaps = n + i, gaps + g
        t0 = time.perf_counter()
        b = next(it)
        nexts.append(time.perf_counter() - t0)
        del b
    stats = pl.stats()
    after = mtc_loader.stats()
    it.close()
    # .get: a build without one of the ways' counters (an older one, in an A/B) counts 0 there
    return {"pauses": n / batches, "gaps_ms": gaps * 1e3 / batches, "next_ms": statistics.median(nexts) * 1e3,
            "next_mean_ms": statistics.fmean(nexts) * 1e3,
            "service_cpu_ms": stats["service_cpu_ms_per_batch"], "data_bound": stats["data_bound"],
            "ways": {k: after.get(k, 0) - before.get(k, 0) for k in WAYS}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--step-ms", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gap-us", type=float, default=3.0)
    ap.add_argument("--height", type=int, default=None)
    ap.add_argument("--width", type=int, default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    cpu = not a.device.startswith("cuda")
    h = a.height or (8 if cpu else 256)
    w = a.width or (8 if cpu else 448)
    ds = CameraSamples(10 ** 7, 4 * a.samples, h, w)
    pc = mtc_loader.PackedCollate(collate_samples, arena_bytes=64 << 20 if cpu else 1 << 30)

    def factory():
        return torch.utils.data.DataLoader(ds, batch_size=a.samples, num_workers=a.workers, collate_fn=pc)

    step, gap = a.step_ms / 1e3, a.gap_us / 1e6
    rows = []
    ways = dict.fromkeys(WAYS, 0)
    for r in range(a.rounds):
        order = [False, True] if r % 2 == 0 else [True, False]
        got = {}
        for served in order:
            got[served] = with_service(factory, a.device, a.batches, step, gap) if served else alone(a.batches, step, gap)
        base, s = got[False], got[True]
        for k in WAYS:
            ways[k] += s["ways"][k]
        rows.append({"held_ms": s["gaps_ms"] - base["gaps_ms"], "handoffs": s["pauses"] - base["pauses"],
                     "next_ms": s["next_ms"], "next_mean_ms": s["next_mean_ms"],
                     "service_cpu_ms": s["service_cpu_ms"], "data_bound": s["data_bound"],
                     "alone_gaps_ms": base["gaps_ms"]})
    keys = ["held_ms", "handoffs", "next_ms", "next_mean_ms", "service_cpu_ms", "data_bound", "alone_gaps_ms"]
    cores = len(os.sched_getaffinity(0))
    print(f"device {a.device}, {a.workers} workers, batch {a.samples} ({h}x{w} images), step {a.step_ms} ms, "
          f"{a.batches} batches x {a.rounds} rounds, gaps > {a.gap_us} us, cpu_cores {cores}; per batch, ms")
    print("round " + " ".join(f"{k:>14s}" for k in keys))
    for r, row in enumerate(rows):
        print(f"{r:5d} " + " ".join(f"{row[k]:14.4f}" for k in keys))
    med = {k: statistics.median(row[k] for row in rows) for k in keys}
    print("  med " + " ".join(f"{med[k]:14.4f}" for k in keys))
    print("ways " + ", ".join(f"{k} {v}" for k, v in ways.items()))
    if cores < a.workers + 2:
        print(f"note: {cores} cores for {a.workers} workers, the service and the spinning thread: held_ms "
              "includes CPU the workers took")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "cpu_cores": cores, "rounds": rows, "median": med, "ways": ways}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
