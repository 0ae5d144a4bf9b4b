"""One process's copy latency and where its threads and memory sit: is this process fast or slow,
and why?

    python3 tools/diagnostics/placement.py [--device cuda:0] [--calls 1500] [--warmup 200]
                                           [--drift SECONDS] [--json PATH]

It times ``start_copy(seed16, device).get()`` with a synchronize after each call (the reference
batch: 528 small tensors), ``--calls`` calls after ``--warmup``, and prints:

- the machine: CPUs, which of them share a core (SMT siblings), NUMA nodes, the GPU's PCI address
  and NUMA node (sysfs), transparent huge pages, each CPU's clock now;
- this process: the CPUs it may run on, where its main thread and the engine's threads (named
  ``mtc-xfer-cuda<N>``: the transfer thread; ``mtc-helper-<i>``: the staging helpers) ran while it
  was timed, and the CPU time each thread used per call;
- the latency: mean, p50, p90, p99, max; the engine's stages per call (``mtc_loader.stats()``:
  the walk, the plan, the outputs, waiting in ``get``; on the transfer thread the queueing, the
  staging memcpy, the DMA's issue); the DMA's own time on the GPU (CUDA events around a call);
  a fixed pure-CPU loop timed beside it (how fast this CPU runs now: a slow process whose loop is
  as fast as a fast one's is slow for a reason of its own);
- controls in the same process: torch's ``pin_memory().to(non_blocking=True)`` and ``.to()`` of
  the same batch;
- where the pinned memory's pages are: pages per NUMA node of the process's page-locked mappings
  (``/proc/self/numa_maps``).

``--drift SECONDS`` then sweeps every CPU's speed once a second (which CPUs run slow, and for how
long they stay so): a CPU that runs the fixed loop slower is one the host shares.

The output's last line is JSON (also written to ``--json``), so that a script can collect many
processes. Run it several times, each in a fresh process: a process keeps the placement it got.
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "bench"))
import mtc_loader  # noqa: E402
from profile_stages import STAGES  # noqa: E402
from workloads import machine_speed, seed_batch, tree_map  # noqa: E402


# --------------------------------------------------------------------------- the machine

def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _cpulist(text: Optional[str]) -> list[int]:
    out: list[int] = []
    for part in (text or "").split(","):
        if "-" in part:
            a, b = part.split("-")
            out += range(int(a), int(b) + 1)
        elif part.strip():
            out.append(int(part))
    return out


def _smi(*args: str) -> Optional[str]:
    """nvidia-smi's output, or None where it cannot run."""
    try:
        return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def machine(device: str) -> dict[str, Any]:
    cpus = sorted(int(p.rsplit("cpu", 1)[1]) for p in glob.glob("/sys/devices/system/cpu/cpu[0-9]*"))
    siblings = {c: _cpulist(_read(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list")) for c in cpus}
    cores = sorted({tuple(v) for v in siblings.values() if v})
    nodes = {int(p.rsplit("node", 1)[1]): _cpulist(_read(p + "/cpulist"))
             for p in glob.glob("/sys/devices/system/node/node[0-9]*")}
    mhz = {}
    for c in cpus:
        f = _read(f"/sys/devices/system/cpu/cpu{c}/cpufreq/scaling_cur_freq")
        if f:
            mhz[c] = int(f) // 1000
    if not mhz:
        cur = None
        for line in (_read("/proc/cpuinfo") or "").splitlines():
            if line.startswith("processor"):
                cur = int(line.split(":")[1])
            elif line.startswith("cpu MHz") and cur is not None:
                mhz[cur] = int(float(line.split(":")[1]))
    model = next((ln.split(":", 1)[1].strip() for ln in (_read("/proc/cpuinfo") or "").splitlines()
                  if ln.startswith("model name")), "?")
    gpu: dict[str, Any] = {}
    if device.startswith("cuda"):
        idx = torch.device(device).index or 0
        props = torch.cuda.get_device_properties(idx)
        gpu["name"] = props.name
        bus = None
        if hasattr(props, "pci_bus_id"):
            bus = f"{getattr(props, 'pci_domain_id', 0):04x}:{props.pci_bus_id:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"
        if bus is None or not os.path.exists(f"/sys/bus/pci/devices/{bus}"):
            q = _smi("--query-gpu=pci.bus_id", "--format=csv,noheader", "-i", str(idx))
            bus = q[-12:].lower() if q else bus  # 00000000:19:00.0 -> 0000:19:00.0
        gpu["pci"] = bus
        gpu["numa_node"] = _read(f"/sys/bus/pci/devices/{bus}/numa_node") if bus else None
        gpu["local_cpus"] = _read(f"/sys/bus/pci/devices/{bus}/local_cpulist") if bus else None
        gpu["topo"] = _smi("topo", "-m")
    return {"cpus": cpus, "cores": [list(c) for c in cores], "nodes": nodes, "mhz": mhz, "model": model,
            "thp": _read("/sys/kernel/mm/transparent_hugepage/enabled"), "gpu": gpu,
            "torch": torch.__version__, "output_maker": mtc_loader.output_maker()["maker"]}


# --------------------------------------------------------------------------- this process's threads

def _stat(tid: int) -> Optional[tuple[int, int]]:
    """(the CPU the thread last ran on, its CPU time in clock ticks)."""
    s = _read(f"/proc/self/task/{tid}/stat")
    if not s:
        return None
    f = s[s.rindex(")") + 2:].split()
    return int(f[36]), int(f[11]) + int(f[12])  # processor (field 39), utime + stime (14, 15)


class ThreadWatch:
    """Samples each thread's CPU and counts its CPU time between start() and stop()."""

    def __init__(self) -> None:
        names = {int(t): _read(f"/proc/self/task/{t}/comm") for t in os.listdir("/proc/self/task")}
        self.names = {t: n for t, n in names.items() if n is not None}
        self.cpu_at_start = {t: (_stat(t) or (0, 0))[1] for t in self.names}
        self.seen: dict[int, dict[int, int]] = {t: {} for t in self.names}

    def sample(self) -> None:
        for t in self.names:
            s = _stat(t)
            if s:
                self.seen[t][s[0]] = self.seen[t].get(s[0], 0) + 1

    def stop(self, calls: int) -> dict[str, Any]:
        tick = os.sysconf("SC_CLK_TCK")
        out = {}
        for t, name in self.names.items():
            s = _stat(t)
            if s is None:
                continue
            used = (s[1] - self.cpu_at_start[t]) / tick
            key = "main" if t == os.getpid() else f"{name}[{t}]"
            out[key] = {"cpus": dict(sorted(self.seen[t].items())), "cpu_us_per_call": 1e6 * used / max(calls, 1)}
        return out


# --------------------------------------------------------------------------- pinned pages

def pinned_pages() -> dict[str, int]:
    """Pages per NUMA node of the process's locked or device-file mappings of 1 MiB or more."""
    nodes: dict[str, int] = {}
    for line in (_read("/proc/self/numa_maps") or "").splitlines():
        f = line.split()
        if not ("locked" in line or "/dev/nvidia" in line or "memfd" in line):
            continue
        kb = next((int(x.split("=")[1]) for x in f if x.startswith("kernelpagesize_kB=")), 4)
        pages = {x.split("=")[0]: int(x.split("=")[1]) for x in f if x[:1] == "N" and "=" in x}
        if sum(pages.values()) * kb < 1024:
            continue
        for n, p in pages.items():
            nodes[n] = nodes.get(n, 0) + p * kb // 4
    return nodes


# --------------------------------------------------------------------------- timing

def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def summary(ms: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(ms), "p50": _pct(ms, 0.5), "p90": _pct(ms, 0.9), "p99": _pct(ms, 0.99),
            "max": max(ms)}


def time_calls(fn: Callable[[], Any], sync: Callable[[], None], calls: int,
               watch: Optional[ThreadWatch] = None) -> list[float]:
    ms = []
    for i in range(calls):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        ms.append((time.perf_counter() - t0) * 1e3)
        if watch is not None and i % 50 == 0:
            watch.sample()
    return ms


def measure(batch: Any, device: str, calls: int) -> dict[str, Any]:
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    before = mtc_loader.stats()
    watch = ThreadWatch()
    speed0 = machine_speed()
    ms = time_calls(lambda: mtc_loader.start_copy(batch, device).get(), sync, calls, watch)
    speed1 = machine_speed()
    after = mtc_loader.stats()
    return {"ms": summary(ms), "cpu_loop_ms": 1e3 * (speed0 + speed1) / 2,
            "stages_us": {k[3:]: (after[k] - before[k]) / calls / 1e3 for k in STAGES},
            "threads": watch.stop(calls)}


def gpu_dma_us(batch: Any, device: str, calls: int = 100) -> Optional[float]:
    if not device.startswith("cuda"):
        return None
    times = []
    for _ in range(calls):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        mtc_loader.start_copy(batch, device).get()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def loop_ms_per_cpu(cpus: list[int], reps: int = 3) -> dict[int, float]:
    """The fixed loop's best of reps on each CPU in turn (this thread pinned there), in ms."""
    allowed = os.sched_getaffinity(0)
    out = {}
    for c in cpus:
        os.sched_setaffinity(0, {c})
        out[c] = min(machine_speed() for _ in range(reps)) * 1e3
    os.sched_setaffinity(0, allowed)
    return out


def drift(seconds: float, period: float = 1.0) -> dict[str, Any]:
    """Every ``period`` s for ``seconds``: the fixed loop's best of 3 on each CPU in turn (this
    thread pinned there). Which CPUs run slow, and for how long they stay so."""
    allowed = sorted(os.sched_getaffinity(0))
    sweeps: list[dict[int, float]] = []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        sweeps.append(loop_ms_per_cpu(allowed))
        time.sleep(max(0.0, period - (time.perf_counter() - t0)))
    fast = min(min(sw.values()) for sw in sweeps)
    per_cpu = {}
    for c in allowed:
        slow = [sw[c] > 1.3 * fast for sw in sweeps]
        runs, cur = [], 0
        for x in slow:
            cur = cur + 1 if x else 0
            runs.append(cur)
        per_cpu[c] = {"slow_fraction": sum(slow) / len(slow), "longest_slow_sweeps": max(runs),
                      "pattern": "".join("s" if x else "." for x in slow)}
    return {"period_s": period, "sweeps": len(sweeps), "fastest_ms": fast, "per_cpu": per_cpu,
            "slow_cpus_per_sweep": [sum(sw[c] > 1.3 * fast for c in allowed) for sw in sweeps]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--calls", type=int, default=1500)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--baseline-calls", type=int, default=100)
    ap.add_argument("--drift", type=float, default=0.0, metavar="SECONDS",
                    help="then sweep every CPU's speed once a second for SECONDS (how long slow CPUs stay slow)")
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = args.device
    batch = seed_batch(16)
    sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)
    m = machine(dev)
    time_calls(lambda: mtc_loader.start_copy(batch, dev).get(), sync, args.warmup)
    res: dict[str, Any] = {"machine": m, "affinity": sorted(os.sched_getaffinity(0))}
    res["start_copy"] = measure(batch, dev, args.calls)
    res["gpu_us"] = gpu_dma_us(batch, dev)
    # the mode: the fixed loop on the main thread's CPU now against the fastest CPU's now
    here = min(machine_speed() for _ in range(5)) * 1e3
    best = min(here, *loop_ms_per_cpu(sorted(os.sched_getaffinity(0))).values())
    res["mode"] = {"loop_here_ms": here, "loop_fastest_ms": best, "slow": here > 1.3 * best}
    res["pinned_pages_per_node"] = pinned_pages()
    if dev.startswith("cuda"):
        pin = time_calls(lambda: tree_map(lambda t: t.pin_memory().to(dev, non_blocking=True), batch), sync,
                         args.baseline_calls)
        to = time_calls(lambda: tree_map(lambda t: t.to(dev), batch), sync, args.baseline_calls)
        res["pin_memory_to_ms"] = summary(pin)
        res["to_ms"] = summary(to)
    if args.drift:
        res["drift"] = drift(args.drift)

    # the report
    g = m["gpu"]
    print(f"machine: {len(m['cpus'])} CPUs ({m['model']}), {len(m['cores'])} cores, NUMA nodes "
          f"{ {n: len(c) for n, c in m['nodes'].items()} }, THP {m['thp']}, torch {m['torch']}, "
          f"outputs made by {m['output_maker']}")
    if g:
        print(f"gpu: {g.get('name')} at {g.get('pci')}, NUMA node {g.get('numa_node')}, local CPUs {g.get('local_cpus')}")
    if m["mhz"]:
        print(f"CPU clocks now (MHz): {sorted(set(m['mhz'].values()))}")
    s = res["start_copy"]
    print(f"start_copy(seed16).get() + sync, {args.calls} calls: " +
          " ".join(f"{k} {v:.3f}" for k, v in s["ms"].items()) + f" ms; fixed CPU loop {s['cpu_loop_ms']:.3f} ms")
    mo = res["mode"]
    print(f"  mode: {'SLOW' if mo['slow'] else 'fast'} (the fixed loop on this thread's CPU {mo['loop_here_ms']:.3f} ms, "
          f"on the fastest CPU now {mo['loop_fastest_ms']:.3f} ms: the host runs some CPUs slower)")
    print("  stages per call (us): " + " ".join(f"{k}={v:.1f}" for k, v in s["stages_us"].items()))
    if res["gpu_us"] is not None:
        print(f"  on the GPU (event to event, median): {res['gpu_us']:.1f} us")
    for name, t in s["threads"].items():
        if t["cpu_us_per_call"] > 1 or name == "main" or "xfer" in name:
            print(f"  thread {name}: ran on {t['cpus']} (samples), {t['cpu_us_per_call']:.1f} us CPU per call")
    print(f"  pinned pages per NUMA node: {res['pinned_pages_per_node']}")
    for k in ("pin_memory_to_ms", "to_ms"):
        if k in res:
            print(f"control {k[:-3]}: mean {res[k]['mean']:.3f} p50 {res[k]['p50']:.3f} ms")
    if args.drift:
        d = res["drift"]
        print(f"CPU speed over {d['sweeps']} sweeps, {d['period_s']} s apart ('s': the fixed loop over 1.3x "
              f"the fastest, {d['fastest_ms']:.3f} ms):")
        for c, v in d["per_cpu"].items():
            print(f"  cpu {c:3d} {v['pattern']}  slow {100 * v['slow_fraction']:.0f}%, longest {v['longest_slow_sweeps']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    print(json.dumps(res, default=str))


if __name__ == "__main__":
    main()
