"""Where the GIL time goes per batch in a launch-bound loop fed by the prefetch service.

    python3 tools/diagnostics/gil_budget.py [--device cuda:0] [--batches 300] [--workers 2] [--step-ms 5]
                                [--rounds 2] [--height 256 --width 448] [--json PATH]

The loader is bench_train's (``collate_samples`` under ``PackedCollate``: per sample 6 camera
images and 33 small meta-data tensors, 265 leaves per batch of 8) in a ``PrefetchLoader`` over a
DataLoader with workers; the consumer spins in Python for ``--step-ms`` per batch, holding the
GIL as a launch-bound training thread does. Per batch, in ms:

- training thread: ``__next__`` (median and mean; the hand-out: event wait, position);
- service thread: its CPU time (``service_cpu``; an upper bound on the time it holds the GIL),
  of which: taking the batch from the DataLoader (``receive``: the pipe read, unpickling the
  descriptor), and the engine's stages of the copy: ``decode`` (the layout), ``dma_issue`` (the
  region's DMA set up and handed to the transfer thread), ``objects`` (the output tensors made
  over the chunk), ``walk`` (the skeleton walked and the structure rebuilt), plus the garbage
  collections that ran on the service thread (``collection``, from ``gc.callbacks``);
- how many collections of each generation ran, and, every ``--probe`` batches, whether the batch
  handed out was already in the oldest generation when the consumer dropped it.

Two variants alternate in one process, ``--rounds`` times each: ``defaults`` (the service thread
runs the early collection and the inline staging, as a caller of ``start_copy`` does) and
``service_skips`` (the service thread marked with ``_engine.service_thread``: it skips both). The
same batches, the same step.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "bench"))
import mtc_loader  # noqa: E402
from bench_train import CameraSamples, collate_samples  # noqa: E402

ENGINE = {"decode": "ns_unpack_decode", "dma_issue": "ns_unpack_copy", "objects": "ns_unpack_views",
          "walk": "ns_unpack_rebuild"}


class GcClock:
    """Time spent in collections per thread, and the count per generation (gc.callbacks)."""

    def __init__(self) -> None:
        self.start: dict[int, float] = {}
        self.spent: dict[int, float] = {}
        self.count = [0, 0, 0]

    def __call__(self, phase: str, info: dict) -> None:
        tid = threading.get_ident()
        if phase == "start":
            self.start[tid] = time.thread_time()
            self.count[info["generation"]] += 1
        elif tid in self.start:
            self.spent[tid] = self.spent.get(tid, 0.0) + time.thread_time() - self.start.pop(tid)


def in_oldest(batch) -> bool:
    """Whether the batch's containers are in the oldest generation (a diagnostic: slow)."""
    ids = {id(o) for o in gc.get_objects(generation=2)}
    seen = [batch] if isinstance(batch, (dict, list, tuple)) else []
    while seen:
        x = seen.pop()
        if id(x) in ids:
            return True
        if isinstance(x, dict):
            seen += [v for v in x.values() if isinstance(v, (dict, list, tuple))]
        elif isinstance(x, (list, tuple)):
            seen += [v for v in x if isinstance(v, (dict, list, tuple))]
    return False


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def one_round(loader_factory, device: str, batches: int, step_s: float, probe: int, rules: bool) -> dict:
    engine = mtc_loader._engine
    real = engine.keep_temporaries
    if not rules:  # the service thread marked as such: it skips the early collection and inline staging
        engine.keep_temporaries = engine.service_thread
    clock = GcClock()
    service_ids: set[int] = set()
    gc.callbacks.append(clock)
    try:
        pl = mtc_loader.PrefetchLoader(loader_factory(), device, depth=2)
        it = iter(pl)
        next(it)  # the epoch's start (workers, first batch) out of the figures
        for t in threading.enumerate():
            if t.name == "mtc_loader-prefetch":
                service_ids.add(t.ident)
        pl.reset_stats()
        before = mtc_loader.stats()
        gc_before = list(clock.count)
        spent_before = {k: v for k, v in clock.spent.items()}
        waits, oldest, probed = [], 0, 0
        for k in range(batches):
            spin(step_s)
            t0 = time.perf_counter()
            b = next(it)
            waits.append((time.perf_counter() - t0) * 1e3)
            if probe and k % probe == probe - 1:
                spin(step_s)  # the batch lives through its step, as in training
                probed += 1
                oldest += in_oldest(b)
            del b
        stats = pl.stats()
        after = mtc_loader.stats()
        it.close()
    finally:
        gc.callbacks.remove(clock)
        engine.keep_temporaries = real
    n = stats["batches"]
    out = {
        "next_median_ms": statistics.median(waits[len(waits) // 10:]),
        "next_mean_ms": statistics.fmean(waits[len(waits) // 10:]),
        "service_cpu_ms": stats["service_cpu_ms_per_batch"],
        "receive_ms": stats["service_next_ms_per_batch"],
        "collection_ms": sum(clock.spent.get(t, 0.0) - spent_before.get(t, 0.0) for t in service_ids) * 1e3 / n,
        "collections_by_generation": [a - b for a, b in zip(clock.count, gc_before)],
        "probed": probed, "probed_in_oldest": oldest,
    }
    for name, key in ENGINE.items():
        out[name + "_ms"] = (after[key] - before[key]) / 1e6 / n
    out["gc_early_collections"] = after["gc_early_collections"] - before["gc_early_collections"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", type=int, default=300)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--step-ms", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--probe", type=int, default=50, help="check every N-th batch for the oldest generation (0: never)")
    ap.add_argument("--height", type=int, default=None)
    ap.add_argument("--width", type=int, default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    cpu = not a.device.startswith("cuda")
    h = a.height or (8 if cpu else 256)
    w = a.width or (8 if cpu else 448)
    ds = CameraSamples(10 ** 7, 4 * a.samples, h, w)
    pc = mtc_loader.PackedCollate(collate_samples, arena_bytes=max(64 << 20, 40 * batch_bytes(ds, a.samples)))

    def factory():
        return torch.utils.data.DataLoader(ds, batch_size=a.samples, num_workers=a.workers, collate_fn=pc)

    results: dict[str, list[dict]] = {"defaults": [], "service_skips": []}
    for r in range(a.rounds):
        for name in results:
            results[name].append(one_round(factory, a.device, a.batches, a.step_ms / 1e3, a.probe,
                                           name == "defaults"))
    keys = ["next_median_ms", "next_mean_ms", "service_cpu_ms", "receive_ms", "decode_ms", "dma_issue_ms",
            "objects_ms", "walk_ms", "collection_ms"]
    print(f"device {a.device}, {a.workers} workers, batch {a.samples} ({h}x{w} images), step {a.step_ms} ms, "
          f"{a.batches} batches x {a.rounds} rounds; ms per batch, median over rounds")
    print(f"{'variant':14s} " + " ".join(f"{k[:-3]:>12s}" for k in keys) + "  gen0/1/2   early  oldest")
    for name, rows in results.items():
        med = {k: statistics.median(r[k] for r in rows) for k in keys}
        gens = [sum(r["collections_by_generation"][g] for r in rows) for g in range(3)]
        print(f"{name:14s} " + " ".join(f"{med[k]:12.4f}" for k in keys)
              + f"  {gens[0]}/{gens[1]}/{gens[2]}  {sum(r['gc_early_collections'] for r in rows):5d}"
              + f"  {sum(r['probed_in_oldest'] for r in rows)}/{sum(r['probed'] for r in rows)}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "results": results}, f, indent=1)
    return 0


def batch_bytes(ds, samples: int) -> int:
    """One batch's bytes (the arena holds a few dozen)."""
    x = collate_samples([ds[i] for i in range(samples)])
    return sum(t.numel() * t.element_size() for t in _leaves(x))


def _leaves(x) -> list:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _leaves(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _leaves(v)]
    return []


if __name__ == "__main__":
    sys.exit(main())
