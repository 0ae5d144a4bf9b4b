#!/usr/bin/env python3
"""Soak: many copies and many loader batches, watching for anything that grows.

Two phases, one process. ``copy``: ``--copies`` calls of ``start_copy`` (default 100,000), two in
flight, of a seed-like batch (132 small tensors) plus fresh numpy leaves the engine must copy (a
negative-stride and a read-only array), to ``--device`` (cuda when available, else cpu).
``loader``: ``--batches`` batches (default 10,000) through ``PrefetchLoader`` over a DataLoader
with ``--workers`` workers (default 4) and ``PackedCollate(list)``, new workers every epoch of
``--batches-per-epoch`` batches.

About ``--samples`` times per phase it records: resident memory (VmRSS, RssAnon, RssShmem: VmRSS
takes in the arena's pages as slots are first used, bounded by ``--arena-bytes``, default 8 MiB),
``stats()['pinned_bytes_held']``, the arena's ``slots_in_use``, the open descriptors, the time,
and the reference count of one input tensor (a reference leak shows there first). After every
epoch it records the arena's slots and the descriptors once the workers are gone (both must come
back to their baseline). Sampled batches are checked bitwise against their reference.

**Flat**: over the last half of a phase's samples, every sample lies within ``max(2 % of their
median, slack)`` of that median, and the least-squares trend over that half moves the series by
less than the same bound. Slack: RSS 32 MiB, pinned 8 MiB, arena slots ``workers *
prefetch_factor + depth + 2`` in an epoch and 0 at its end, descriptors 16 in an epoch and 2 at
its end, reference count 0. Time per sample is reported, not judged.

Writes ``soak.json`` and ``soak.png`` to ``--out`` (default ``bench/results``), prints a summary
and exits with 1 if a series is not flat or a batch was wrong. ``--quick``: 10,000 copies, 1,000
batches.

    python3 tools/diagnostics/soak.py                # on the GPU machine: a few minutes
    python3 tools/diagnostics/soak.py --quick --device cpu
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
from collections import deque
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

# the benchmarks' workloads, in bench/
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "bench"))
from workloads import seed_batch  # noqa: E402

import mtc_loader  # noqa: E402

MiB = 1 << 20
PREFETCH_FACTOR = 2
DEPTH = 2

# series: (key in a sample, label, unit divisor, band slack while running, slack at epoch ends)
SERIES = {
    "rss": ("resident memory (MiB)", MiB, 32 * MiB),
    "pinned": ("pinned bytes held (MiB)", MiB, 8 * MiB),
    "slots": ("arena slots in use", 1, None),  # set from the worker count
    "fds": ("open file descriptors", 1, 16),
    "refcount": ("refcount of an input tensor", 1, 0),
}
EPOCH_END_SLACK = {"slots": 0, "fds": 2}


# --------------------------------------------------------------------------------- probes

def proc_status(*keys: str) -> list[int]:
    """Values of /proc/self/status in bytes (kB lines), 0 for a missing key."""
    out = dict.fromkeys(keys, 0)
    with open("/proc/self/status") as f:
        for line in f:
            k = line.split(":", 1)[0]
            if k in out:
                out[k] = int(line.split()[1]) * 1024
    return [out[k] for k in keys]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def tree_equal(out: Any, ref: Any) -> bool:
    """Bitwise equality of two structures (tensors compared on the CPU, dtype and shape too)."""
    if isinstance(ref, np.ndarray):
        ref = torch.from_numpy(np.array(ref))
    if isinstance(ref, torch.Tensor):
        if not isinstance(out, torch.Tensor) or out.dtype != ref.dtype or out.shape != ref.shape:
            return False
        a, b = out.detach().cpu().contiguous(), ref.detach().cpu().contiguous()
        return a.numel() == 0 or torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    if isinstance(ref, dict):
        return type(out) is type(ref) and list(out) == list(ref) and all(tree_equal(out[k], ref[k]) for k in ref)
    if isinstance(ref, (list, tuple)):
        return type(out) is type(ref) and len(out) == len(ref) and all(map(tree_equal, out, ref))
    return out == ref


# ----------------------------------------------------------------------------- recording

class Recorder:
    def __init__(self, arena_stats: Callable[[], dict], device: str, probe: Any):
        self.samples: list[dict] = []
        self.epoch_ends: list[dict] = []
        self.arena_stats = arena_stats
        self.cuda = device.startswith("cuda")
        self.probe = probe  # a tensor the inputs hold: its refcount must not grow
        self.t0 = time.monotonic()
        self.t_last = self.t0
        self.it_last = 0

    def sample(self, phase: str, it: int, global_it: int) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        now = time.monotonic()
        s = mtc_loader.stats()
        rss, anon, shmem = proc_status("VmRSS", "RssAnon", "RssShmem")
        self.samples.append({
            "phase": phase, "iter": it, "global_iter": global_it, "t": now - self.t0,
            "s_per_iter": (now - self.t_last) / max(1, global_it - self.it_last),
            "rss": rss, "rss_anon": anon, "rss_shmem": shmem, "pinned": s["pinned_bytes_held"],
            "slots": self.arena_stats()["slots_in_use"], "fds": open_fds(),
            "refcount": sys.getrefcount(self.probe),
            "jobs_in_flight": s["jobs_in_flight"],
            "cuda_allocated": torch.cuda.memory_allocated() if self.cuda else 0,
        })
        self.t_last, self.it_last = now, global_it

    def epoch_end(self, epoch: int, global_it: int) -> None:
        """After an epoch: the workers are gone, their queues' pipes close as the queues'
        threads finish; settle up to 1 s (fds back to the last epoch end's count) first."""
        target = self.epoch_ends[-1]["fds"] if self.epoch_ends else None
        deadline = time.monotonic() + 1.0
        while True:
            gc.collect()
            fds = open_fds()
            if (target is not None and fds <= target) or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        self.epoch_ends.append({"epoch": epoch, "global_iter": global_it, "t": time.monotonic() - self.t0,
                                "slots": self.arena_stats()["slots_in_use"], "fds": fds,
                                "rss": proc_status("VmRSS")[0]})


# --------------------------------------------------------------------------------- phases

def fresh_numpy(i: int) -> dict:
    """Per-call numpy leaves the engine must copy (fresh objects every call)."""
    ro = np.arange(i % 97, i % 97 + 3000, dtype=np.int32)
    ro.flags.writeable = False
    return {"neg": np.arange(20000, dtype=np.float32)[::-1] + np.float32(i % 13), "ro": ro}


def run_copies(n: int, device: str, rec: Recorder, every: int, pool: list, start_iter: int = 0) -> int:
    """n start_copy calls, DEPTH in flight. Returns the number of wrong results. At a sample
    point the copies in flight are collected first, so that the probe's count is comparable."""
    bad = 0
    pending: deque = deque()

    def collect_one() -> None:
        nonlocal bad
        h, ref = pending.popleft()
        out = h.get()
        if ref is not None and not tree_equal(out, ref):
            bad += 1

    for i in range(n):
        data = {"batch": pool[i % len(pool)], "np": fresh_numpy(i), "step": i}
        pending.append((mtc_loader.start_copy(data, device), data if i % every == 0 else None))
        del data
        while len(pending) > DEPTH or (pending and i % every == 0):
            collect_one()
        if i % every == 0:
            rec.sample("copy", i, start_iter + i)
    while pending:
        collect_one()
    return bad


class PoolSamples(Dataset):
    """Samples from a pool built before the workers fork (cheap __getitem__)."""

    def __init__(self, pool: list, n: int):
        self.pool, self.n = pool, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return self.pool[i % len(self.pool)]


def run_loader(n_batches: int, device: str, rec: Recorder, every: int, pool: list, workers: int,
               batch_size: int, per_epoch: int, pc: mtc_loader.PackedCollate, start_iter: int = 0) -> int:
    """Whole epochs of per_epoch batches (at least n_batches in all) through PrefetchLoader;
    new DataLoader workers every epoch. Returns the number of wrong batches."""
    bad = 0
    done = 0
    ds = PoolSamples(pool, per_epoch * batch_size)
    epochs = max(1, -(-n_batches // per_epoch))
    for epoch in range(epochs):
        dl = DataLoader(ds, batch_size=batch_size, num_workers=workers, collate_fn=pc,
                        prefetch_factor=PREFETCH_FACTOR if workers else None)
        for k, b in enumerate(mtc_loader.PrefetchLoader(dl, device, depth=DEPTH)):
            if done % every == 0:
                ref = [pool[(k * batch_size + j) % len(pool)] for j in range(batch_size)]
                if not tree_equal(b, ref):
                    bad += 1
                rec.sample("loader", done, start_iter + done)
            done += 1
            del b
        del dl
        rec.epoch_end(epoch, start_iter + done)
    return bad


# ----------------------------------------------------------------------------- judgement

def flat(values: list[float], iters: list[int], slack: float) -> dict:
    """Flatness of the last 50 % of a series (see the module docstring)."""
    n = len(values)
    if n < 4:
        return {"flat": True, "reason": "too few samples", "n": n}
    half_v = [float(v) for v in values[n // 2:]]
    half_x = [float(x) for x in iters[n // 2:]]
    med = statistics.median(half_v)
    bound = max(0.02 * abs(med), slack)
    dev = max(abs(v - med) for v in half_v)
    mx = statistics.fmean(half_x)
    my = statistics.fmean(half_v)
    sxx = sum((x - mx) ** 2 for x in half_x)
    slope = sum((x - mx) * (y - my) for x, y in zip(half_x, half_v)) / sxx if sxx else 0.0
    trend = slope * (half_x[-1] - half_x[0])
    ok = dev <= bound and abs(trend) <= max(bound, 1e-9) and not (slack == 0 and trend > 0)
    return {"flat": bool(ok), "median": med, "max_dev": dev, "bound": bound, "trend": trend, "n": n}


def summarize(rec: Recorder, workers: int) -> dict:
    out: dict[str, Any] = {}
    slots_slack = workers * PREFETCH_FACTOR + DEPTH + 2
    for phase in ("copy", "loader"):
        ss = [s for s in rec.samples if s["phase"] == phase]
        if not ss:
            continue
        ph: dict[str, Any] = {}
        for key, (label, div, slack) in SERIES.items():
            if key == "slots":
                slack = slots_slack if phase == "loader" else 0
            vals = [s[key] for s in ss]
            res = flat(vals, [s["global_iter"] for s in ss], slack)
            res.update(start=vals[0], end=vals[-1], max=max(vals), slack=slack, label=label, div=div)
            ph[key] = res
        for key in ("rss_anon", "rss_shmem"):  # reported, not judged (VmRSS is)
            vals = [s[key] for s in ss]
            ph[key] = {"flat": True, "judged": False, "start": vals[0], "end": vals[-1], "max": max(vals),
                       "label": key, "div": MiB}
        spi = [s["s_per_iter"] for s in ss[1:]] or [0.0]
        ph["time"] = {"start_s_per_iter": spi[0], "end_s_per_iter": spi[-1], "max_s_per_iter": max(spi),
                      "median_s_per_iter": statistics.median(spi), "wall_s": ss[-1]["t"] - ss[0]["t"],
                      "judged": False}
        out[phase] = ph
    if rec.epoch_ends:
        ee: dict[str, Any] = {}
        for key, slack in EPOCH_END_SLACK.items():
            vals = [e[key] for e in rec.epoch_ends]
            res = flat(vals, [e["global_iter"] for e in rec.epoch_ends], slack)
            # at an epoch's end every region is back: exactly zero slots
            if key == "slots":
                tail = vals[len(vals) // 2:]
                res["flat"] = res["flat"] and all(v == 0 for v in tail)
            res.update(start=vals[0], end=vals[-1], max=max(vals), slack=slack,
                       label=SERIES[key][0] + " at epoch end", div=1)
            ee[key] = res
        out["epoch_end"] = ee
    return out


def all_flat(summary: dict) -> bool:
    return all(r["flat"] for ph in summary.values() for k, r in ph.items() if k != "time")


def print_summary(summary: dict, bad: int) -> None:
    for phase, ph in summary.items():
        print(f"[{phase}]")
        for key, r in ph.items():
            if key == "time":
                print(f"  {'s/iter':<10} start {r['start_s_per_iter'] * 1e6:9.1f} us  end "
                      f"{r['end_s_per_iter'] * 1e6:9.1f} us  max {r['max_s_per_iter'] * 1e6:9.1f} us  "
                      f"(wall {r['wall_s']:.1f} s, not judged)")
                continue
            d = r["div"]
            unit = " MiB" if d == MiB else ""
            verdict = ("(part of rss, not judged)" if r.get("judged") is False else
                       f"{'flat' if r['flat'] else 'NOT FLAT'} (max dev {r.get('max_dev', 0) / d:.1f}, "
                       f"trend {r.get('trend', 0) / d:+.1f}, bound {r.get('bound', 0) / d:.1f})")
            print(f"  {key:<10} start {r['start'] / d:10.1f}{unit}  end {r['end'] / d:10.1f}{unit}  "
                  f"max {r['max'] / d:10.1f}{unit}  {verdict}")
    print(f"wrong batches: {bad}")


def plot(rec: Recorder, path: str, title: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return False
    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    for ax, key in zip(axes, ("rss", "pinned", "slots", "fds")):
        label, div, _ = SERIES[key]
        for phase, color in (("copy", "tab:blue"), ("loader", "tab:orange")):
            ss = [s for s in rec.samples if s["phase"] == phase]
            if ss:
                ax.plot([s["global_iter"] for s in ss], [s[key] / div for s in ss], ".-", ms=2, lw=0.8,
                        color=color, label=f"{phase} phase")
        if key == "rss":
            ax.plot([s["global_iter"] for s in rec.samples if s["phase"] != "final"],
                    [s["rss_anon"] / div for s in rec.samples if s["phase"] != "final"], "-", lw=0.6,
                    color="tab:gray", label="of which anonymous (RssAnon)")
        if key in EPOCH_END_SLACK and rec.epoch_ends:
            ax.plot([e["global_iter"] for e in rec.epoch_ends], [e[key] for e in rec.epoch_ends], "kx",
                    ms=5, label="epoch end")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
    axes[-1].set_xlabel("iteration (copies, then loader batches)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------------- main

def run(copies: int, batches: int, device: str, workers: int, batch_samples: int = 4,
        loader_batch_size: int = 2, per_epoch: int = 500, samples: int = 200,
        arena_bytes: int = 8 * MiB) -> tuple[Recorder, dict, int]:
    """Both phases; returns the recorder, the summary and the count of wrong results."""
    pool = [seed_batch(batch_samples, seed=s) for s in range(8)]
    sample_pool = [seed_batch(1, seed=100 + s)[0] for s in range(64)]
    pc = mtc_loader.PackedCollate(list, arena_bytes=arena_bytes)
    rec = Recorder(pc.stats, device, pool[0][0]["cams_gt"][0]["proj_mat"])
    bad = 0
    if copies:
        bad += run_copies(copies, device, rec, max(1, copies // samples), pool)
    if batches:
        bad += run_loader(batches, device, rec, max(1, batches // samples), sample_pool, workers,
                          loader_batch_size, per_epoch, pc, start_iter=copies)
    gc.collect()
    rec.sample("final", 0, copies + batches)
    return rec, summarize(rec, workers), bad


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--copies", type=int, default=100_000, help="start_copy calls (default 100,000)")
    p.add_argument("--batches", type=int, default=10_000, help="loader batches (default 10,000)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--batches-per-epoch", type=int, default=500)
    p.add_argument("--samples", type=int, default=200, help="samples per phase (default 200)")
    p.add_argument("--arena-bytes", type=int, default=8 * MiB, help="PackedCollate arena (default 8 MiB)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    here = os.path.dirname(os.path.abspath(__file__))
    p.add_argument("--out", default=os.path.normpath(os.path.join(here, os.pardir, os.pardir, "bench", "results")))
    p.add_argument("--quick", action="store_true", help="10,000 copies, 1,000 batches, 100 per epoch")
    a = p.parse_args(argv)
    if a.quick:
        a.copies, a.batches, a.batches_per_epoch, a.samples = 10_000, 1_000, 100, 100
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.monotonic()
    rec, summary, bad = run(a.copies, a.batches, device, a.workers, per_epoch=a.batches_per_epoch,
                            samples=a.samples, arena_bytes=a.arena_bytes)
    wall = time.monotonic() - t0
    ok = all_flat(summary) and bad == 0
    os.makedirs(a.out, exist_ok=True)
    cfg = {"copies": a.copies, "batches": a.batches, "workers": a.workers, "device": device,
           "batches_per_epoch": a.batches_per_epoch, "arena_bytes": a.arena_bytes, "quick": a.quick, "wall_s": wall,
           "python": platform.python_version(), "torch": torch.__version__,
           "machine": platform.node(), "cpus": os.cpu_count(),
           "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None}
    with open(os.path.join(a.out, "soak.json"), "w") as f:
        json.dump({"config": cfg, "ok": ok, "wrong_batches": bad, "summary": summary,
                   "samples": rec.samples, "epoch_ends": rec.epoch_ends}, f, indent=1)
    title = (f"mtc_loader soak: {a.copies} start_copy + {a.batches} loader batches "
             f"({a.workers} workers) to {device}, {wall:.0f} s")
    plotted = plot(rec, os.path.join(a.out, "soak.png"), title)
    print(title)
    print_summary(summary, bad)
    print(f"wrote {os.path.join(a.out, 'soak.json')}" + (" and soak.png" if plotted else ""))
    print("OK: every series stayed flat" if ok else "FAIL: a series grew or a batch was wrong")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
