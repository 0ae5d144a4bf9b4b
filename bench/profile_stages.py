"""Where the time of one start_copy goes, stage by stage, from the engine's counters.

    python3 bench/profile_stages.py [--device cuda:0] [--calls 200]

For each workload: wall time per call (start_copy + get + synchronize), and per call the
calling thread's stages (traverse, plan, outputs, views + rebuild, waiting in get) and the
transfer thread's (queueing, staging memcpy, issuing DMAs, synchronizing).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mtc_loader  # noqa: E402
from workloads import seed_batch, uniform  # noqa: E402

STAGES = ["ns_traverse", "ns_plan", "ns_outputs", "ns_views", "ns_get_wait",
          "ns_queue", "ns_stage", "ns_dma_issue", "ns_sync"]


def profile(name, data, device, calls, **opts):
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(10):
        mtc_loader.start_copy(data, device, **opts).get()
    sync()
    before = mtc_loader.stats()
    t0 = time.perf_counter()
    for _ in range(calls):
        mtc_loader.start_copy(data, device, **opts).get()
        sync()
    wall = (time.perf_counter() - t0) / calls * 1e6
    after = mtc_loader.stats()
    per = {k: (after[k] - before[k]) / calls / 1e3 for k in STAGES}
    print(f"{name:22s} {wall:8.1f} us/call | " + " ".join(f"{k[3:]}={v:.1f}" for k, v in per.items()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--calls", type=int, default=200)
    a = ap.parse_args()
    seed16 = seed_batch(16, 0)
    profile("seed16", seed16, a.device, a.calls)
    profile("seed16 no thread", seed16, a.device, a.calls, use_background_thread=False)
    profile("4096x64B", uniform(4096, 64, 0), a.device, max(10, a.calls // 4))
    if a.device.startswith("cuda"):
        profile("seed16 d2h", [[t.to(a.device) for t in s["cams_gt"][0].values()] for s in seed16], "cpu", a.calls)
        profile("16x16MB", uniform(16, 16 << 20, 0), a.device, 10)
    print("helpers:", mtc_loader.stats()["helper_threads"])


if __name__ == "__main__":
    main()
