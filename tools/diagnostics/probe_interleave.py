"""Why is start_copy slower inside the interleaved benchmark than in a hot loop?

    python3 tools/diagnostics/probe_interleave.py [--device cuda:0] [--calls 100]

Times one seed16 start_copy(...).get() + synchronize in three conditions: back to back (hot),
right after a per-tensor .to() of the same batch (caches and branch predictors polluted), and
after 8 ms of sleep (idle CPU: frequency, idle states, sleeping engine threads). Prints medians,
in-process ratios, and the engine's per-stage times for each condition.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch

# the benchmarks' workloads, in bench/
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "bench"))
import mtc_loader  # noqa: E402
from workloads import seed_batch, tree_map  # noqa: E402

STAGES = ["ns_traverse", "ns_outputs", "ns_views", "ns_get_wait", "ns_queue"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--calls", type=int, default=100)
    a = ap.parse_args()
    data = seed_batch(16, 0)
    sync = lambda: torch.cuda.synchronize()  # noqa: E731

    def one(**opts) -> float:
        t0 = time.perf_counter()
        out = mtc_loader.start_copy(data, a.device, **opts).get()
        sync()
        t = time.perf_counter() - t0
        del out
        return t

    def to_once() -> None:
        out = tree_map(lambda t: t.to(a.device), data)
        sync()
        del out

    conditions = {
        "hot": lambda: None,
        "after .to()": to_once,
        "after 8 ms sleep": lambda: time.sleep(0.008),
    }
    gc.collect()
    gc.disable()
    for opts in ({}, {"use_background_thread": False}):
        for name, before in conditions.items():
            for _ in range(5):
                before()
                one(**opts)
            s0 = mtc_loader.stats()
            ts = []
            for _ in range(a.calls):
                before()
                ts.append(one(**opts))
            s1 = mtc_loader.stats()
            per = " ".join(f"{k[3:]}={(s1[k] - s0[k]) / a.calls / 1e3:.0f}" for k in STAGES)
            print(f"{str(opts):32s} {name:18s} median {statistics.median(ts) * 1e3:6.3f} ms  "
                  f"p10 {sorted(ts)[len(ts) // 10] * 1e3:6.3f}  | us/call {per}")
    t_to = []
    for _ in range(a.calls // 4):
        t0 = time.perf_counter()
        to_once()
        t_to.append(time.perf_counter() - t0)
    print(f".to() median {statistics.median(t_to) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
