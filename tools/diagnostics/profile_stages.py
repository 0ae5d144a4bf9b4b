"""Where the time of one start_copy goes, stage by stage, from the engine's counters.

    python3 tools/diagnostics/profile_stages.py [--device cuda:0] [--calls 200] [--gc both|on|off]

For each workload: wall time per call (start_copy + get + synchronize), and per call the
calling thread's stages (traverse, plan, outputs, views + rebuild, waiting in get) and the
transfer thread's (queueing, staging memcpy, issuing DMAs, synchronizing), in us per call and
in ns per leaf, and the driver's copy calls per call (is the cost per tensor flat in the number of tensors?), with Python's garbage
collector on (as in a training loop) and off.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

# the benchmarks' workloads, in bench/
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "bench"))
import mtc_loader  # noqa: E402
from workloads import seed_batch, uniform  # noqa: E402

STAGES = ["ns_traverse", "ns_plan", "ns_outputs", "ns_views", "ns_get_wait",
          "ns_queue", "ns_stage", "ns_dma_issue", "ns_sync"]


def profile(name, data, device, calls, gc_on=True, **opts):
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(10):
        mtc_loader.start_copy(data, device, **opts).get()
    sync()
    (gc.enable if gc_on else gc.disable)()
    before = mtc_loader.stats()
    t0 = time.perf_counter()
    for _ in range(calls):
        mtc_loader.start_copy(data, device, **opts).get()
        sync()
    wall = (time.perf_counter() - t0) / calls * 1e6
    after = mtc_loader.stats()
    gc.enable()
    leaves = (after["leaves"] - before["leaves"]) / calls
    per = {k: (after[k] - before[k]) / calls / 1e3 for k in STAGES}
    dma = (after["dma_calls"] - before["dma_calls"]) / calls
    print(f"{name:18s} gc {'on ' if gc_on else 'off'} {wall:8.1f} us/call {wall * 1e3 / leaves:6.0f} ns/leaf | "
          + " ".join(f"{k[3:]}={v:.1f}" for k, v in per.items())
          + " | per leaf: traverse " + f"{per['ns_traverse'] * 1e3 / leaves:.0f}"
          + f" views {per['ns_views'] * 1e3 / leaves:.0f} ns | DMA calls {dma:.1f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--gc", choices=["both", "on", "off"], default="both")
    a = ap.parse_args()
    seed16 = seed_batch(16, 0)
    for gc_on in {"both": (True, False), "on": (True,), "off": (False,)}[a.gc]:
        profile("seed4", seed_batch(4, 0), a.device, a.calls, gc_on)
        profile("seed16", seed16, a.device, a.calls, gc_on)
        profile("seed64", seed_batch(64, 0), a.device, max(10, a.calls // 4), gc_on)
        profile("4096x64B", uniform(4096, 64, 0), a.device, max(10, a.calls // 4), gc_on)
        profile("seed16 no thread", seed16, a.device, a.calls, gc_on, use_background_thread=False)
        if a.device.startswith("cuda"):
            profile("seed16 d2h", [[t.to(a.device) for t in s["cams_gt"][0].values()] for s in seed16], "cpu",
                    a.calls, gc_on)
            profile("16x16MB", uniform(16, 16 << 20, 0), a.device, 10, gc_on)
    print("helpers:", mtc_loader.stats()["helper_threads"])


if __name__ == "__main__":
    main()
