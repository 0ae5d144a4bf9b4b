"""Variants of the staged large H2D path, interleaved in one process.

    MTC_HELPER_THREADS=N python3 tools/diagnostics/probe_h2d.py [--device cuda:0] [--rounds 15]
                                                    [--only 16x16MB 256x64KB]

The engine reads its tuning switches at every large copy, so the variants run in a new random order every round in
one process against ``pin_memory().to(non_blocking=True)`` on the same data:

- ``MTC_H2D_RING``: slabs of the staging ring, reused in turn (default 16); 0: the windowed
  pipeline, where every piece takes its own slab from the pool;
- ``MTC_H2D_PIECE_BYTES``: bytes per pinned slab and DMA (ring: 2 MiB; windows: 4 MiB, halved
  down to 1 MiB while there are fewer than two pieces per helper);
- ``MTC_H2D_TASK_BYTES``: bytes per helper task inside a piece (ring: 256 KiB; windows: 512
  KiB; the piece size: one helper per piece);
- ``MTC_STAGE_NT``: streaming stores in the staging copy (ring: 0; windows: 1);
- ``MTC_H2D_WINDOW``: pieces per window, two windows in flight (default 2 x helpers).

The pinned cap is raised to 4 GiB, so that the variants' slabs (one size class per piece size)
do not evict each other.

The helper count is fixed per process (``MTC_HELPER_THREADS``): run the script once per count.
Every variant's output is checked bitwise against ``.to()`` first. Prints the median ms, the
p10-p90 spread and the GB/s per variant, and one JSON line (``--json``).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch

# the benchmarks' workloads, in bench/
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "bench"))
import mtc_loader  # noqa: E402
from workloads import WORKLOADS, count_tensors  # noqa: E402

MB = 1 << 20
W0 = {"MTC_H2D_RING": "0"}  # the windowed pipeline
VARIANTS: dict[str, dict[str, str]] = {
    "default": {},
    "windows": W0,
    "windows_no_nt": {**W0, "MTC_STAGE_NT": "0"},
    "windows_p2M_w4_t256K_nt0": {**W0, "MTC_H2D_PIECE_BYTES": str(2 * MB), "MTC_H2D_WINDOW": "4",
                                 "MTC_H2D_TASK_BYTES": str(256 << 10), "MTC_STAGE_NT": "0"},
    # the ring: R slabs reused in turn, a few MiB in flight that stay in the cache
    "ring8": {"MTC_H2D_RING": "8"},
    "ring8_t128K": {"MTC_H2D_RING": "8", "MTC_H2D_TASK_BYTES": str(128 << 10)},
    "ring24": {"MTC_H2D_RING": "24"},
    "ring32": {"MTC_H2D_RING": "32"},
    "ring16_p1M_t128K": {"MTC_H2D_PIECE_BYTES": str(MB), "MTC_H2D_TASK_BYTES": str(128 << 10)},
    "ring8_p4M_t512K": {"MTC_H2D_RING": "8", "MTC_H2D_PIECE_BYTES": str(4 * MB),
                        "MTC_H2D_TASK_BYTES": str(512 << 10)},
    "ring16_t128K": {"MTC_H2D_TASK_BYTES": str(128 << 10)},
    "ring32_t128K": {"MTC_H2D_RING": "32", "MTC_H2D_TASK_BYTES": str(128 << 10)},
    "ring16_nt": {"MTC_STAGE_NT": "1"},
}
KNOBS = ("MTC_H2D_PIECE_BYTES", "MTC_H2D_TASK_BYTES", "MTC_STAGE_NT", "MTC_H2D_WINDOW", "MTC_H2D_RING")


def set_env(env: dict[str, str]) -> None:
    """Sets the variant's switches and clears the others (the engine reads them per copy)."""
    for k in KNOBS:
        os.environ.pop(k, None)
    os.environ.update(env)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--only", nargs="+", default=["16x16MB", "256x64KB"])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--json", action="store_true", help="also print one JSON line of the results")
    a = ap.parse_args()
    dev = torch.device(a.device)
    torch.cuda.set_device(dev)
    # room for every variant's slabs (one size class per piece size): no evictions between them
    mtc_loader.configure(pinned_cap_bytes=4 << 30)
    results: dict[str, dict[str, dict[str, float]]] = {}
    helpers = None
    for wname in a.only:
        data = WORKLOADS[wname](0)
        _, nbytes = count_tensors(data)
        ref = [t.to(dev) for t in data]

        def run_pin() -> list[torch.Tensor]:
            return [t.pin_memory().to(dev, non_blocking=True) for t in data]

        def run_mtc() -> list[torch.Tensor]:
            return mtc_loader.start_copy(data, dev).get()

        methods = [("pin_to_nb", {}, run_pin)] + [(v, VARIANTS[v], run_mtc) for v in a.variants]
        for name, env, fn in methods:  # check, and warm up (slabs, allocator blocks)
            set_env(env)
            for _ in range(3):
                out = fn()
            torch.cuda.synchronize(dev)
            if not all(torch.equal(o, r) for o, r in zip(out, ref)):
                sys.exit(f"{wname}: {name} differs from .to()")
        samples: dict[str, list[float]] = {name: [] for name, _, _ in methods}
        rng = random.Random(0)
        for _ in range(a.rounds):
            # a new order every round: a variant that runs right after pin_memory() meets a cache
            # full of its dirty lines, and in a fixed rotation that would always be the same one
            for name, env, fn in rng.sample(methods, len(methods)):
                set_env(env)
                t0 = time.perf_counter()
                out = fn()
                torch.cuda.synchronize(dev)
                samples[name].append(time.perf_counter() - t0)
                del out
        set_env({})
        res = {}
        st = mtc_loader.stats()
        helpers = st.get("helper_threads")
        print(f"[{wname}] {nbytes / MB:.0f} MiB, helpers {helpers}, {a.rounds} rounds; pinned "
              f"slabs held {st['pinned_slabs_held']} ({st['pinned_bytes_held'] / MB:.0f} MiB, "
              f"every variant's size class)")
        for name, s in samples.items():
            ms = sorted(x * 1e3 for x in s)
            med = statistics.median(ms)
            p10, p90 = ms[len(ms) // 10], ms[(len(ms) * 9) // 10 - 1 if len(ms) >= 10 else -1]
            res[name] = {"median_ms": med, "p10_ms": p10, "p90_ms": p90, "gbps": nbytes / med / 1e6}
            print(f"  {name:<22} {med:8.3f} ms  [{p10:.3f} .. {p90:.3f}]  {nbytes / med / 1e6:6.2f} GB/s")
        results[wname] = res
    if a.json:
        print("JSON", json.dumps({"helpers": helpers, "results": results}))


if __name__ == "__main__":
    main()
