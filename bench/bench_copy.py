"""Benchmark ``mtc_loader.start_copy`` against the ways PyTorch users copy nested batches.

Usage::

    python3 bench/bench_copy.py [--device cuda:0] [--rounds N] [--quick] [--out DIR]
                                [--only WORKLOAD ...] [--keep-going] [--no-ceiling]

What is timed, per batch: from just before the call until the result is usable, i.e. the host
clock (``time.perf_counter``) around the copy and a ``torch.cuda.synchronize()`` of every CUDA
device involved (for ``start_copy`` that is ``start_copy(...).get()`` and then the
synchronize, since ``get()`` returns once the copies are enqueued, like
``.to(non_blocking=True)``).

How: first, for every workload, every method's output is checked bitwise against ``.to()`` (a
failure aborts before any timing, unless ``--keep-going`` drops the failing methods); then
every method runs a few warm-up rounds (so pinned slabs and caching-allocator blocks exist), then
interleaved rounds: each round runs every method once on the same data, with the method order
rotated from round to round, so that drifts of the machine (clocks, other tenants) hit all
methods alike. The garbage collector runs as in a user's program (``--gc-off`` disables it while
timing). Reported per workload and method: median, p10, p90, mean, p99 and max in ms, and the ratio
``median(.to()) / median(method)`` (above 1 means faster than ``.to()``).

With a CUDA device, a ceiling measurement runs first (skip it with ``--no-ceiling``): the
aggregate copy bandwidth from pageable into pinned memory with 1, 2, 4, 8 and 16 threads (the
engine's probe, with memcpy and with streaming stores, and torch's ``copy_`` under
``torch.set_num_threads``), the H2D DMA from pinned memory alone and while the staging copies
run, and ``cudaHostRegister`` of a source in place. It is printed before and after the table
and stored under ``"ceiling"``. The workloads include ``16x16MB_d2h``: 16 x 16 MB from the GPU
into new CPU tensors.

Outputs (in ``--out``, default ``bench/results``): ``bench_copy.json`` (machine info, every
sample, ``mtc_loader.stats()``), ``bench_copy.png`` (ratio vs ``.to()`` per workload, with the
targets), and a table on stdout.

With ``--device cpu`` (no GPU needed, e.g. as a smoke test) only the CPU-meaningful case runs:
numpy -> CPU tensor conversion of the seed workloads.
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
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import torch.utils._pytree as pytree

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import WORKLOADS, count_tensors, iter_leaves, to_numpy, tree_map  # noqa: E402
from provenance import provenance  # noqa: E402

try:
    import mtc_loader

    MTC_IMPORT_ERROR: str | None = None
except Exception as exc:  # the engine may not be built: still measure the baselines
    mtc_loader = None
    MTC_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

# Targets (ratio median(.to()) / median(mtc)) from the issue, drawn on the plot.
TARGETS: dict[str, float] = {
    "seed16": 9.0,
    "seed64": 10.0,
    "4096x64B": 12.0,
    "16x16MB": 4.0,
    "seed16_d2h": 5.0,
}

BASELINE = "to"
BIG_WORKLOADS = {"16x16MB", "16x16MB_d2h"}  # fewer rounds, and bandwidth is reported
SEED = 0

# A method copies a structure to a device and returns the result (not yet synchronized).
Method = Callable[[Any, torch.device], Any]


# --------------------------------------------------------------------------------------------
# Methods
# --------------------------------------------------------------------------------------------


def _as_tensor(x: Any) -> torch.Tensor:
    """A numpy leaf as a tensor (zero-copy); tensors unchanged."""
    return torch.from_numpy(x) if isinstance(x, np.ndarray) else x


def m_to(data: Any, device: torch.device) -> Any:
    """Per-tensor ``.to(device)`` over the structure (a generic recursive tree map)."""
    return tree_map(lambda t: _as_tensor(t).to(device), data)


def m_to_nb(data: Any, device: torch.device) -> Any:
    """Per-tensor ``.to(device, non_blocking=True)``."""
    return tree_map(lambda t: _as_tensor(t).to(device, non_blocking=True), data)


def m_pin_to_nb(data: Any, device: torch.device) -> Any:
    """Per-tensor ``t.pin_memory().to(device, non_blocking=True)`` (CPU sources only)."""
    return tree_map(lambda t: _as_tensor(t).pin_memory().to(device, non_blocking=True), data)


def m_pytree_nb(data: Any, device: torch.device) -> Any:
    """``torch.utils._pytree.tree_map`` with ``.to(device, non_blocking=True)``."""

    def leaf(x: Any) -> Any:
        if isinstance(x, (torch.Tensor, np.ndarray)):
            return _as_tensor(x).to(device, non_blocking=True)
        return x

    return pytree.tree_map(leaf, data)


def _mtc(**kwargs: Any) -> Method:
    """A method running ``mtc_loader.start_copy(data, device, **kwargs).get()``."""

    def run(data: Any, device: torch.device) -> Any:
        return mtc_loader.start_copy(data, device, **kwargs).get()

    run.__doc__ = f"mtc_loader.start_copy(data, device, {kwargs or 'defaults'}).get()"
    return run


BASELINE_METHODS: dict[str, Method] = {
    "to": m_to,
    "to_nb": m_to_nb,
    "pin_to_nb": m_pin_to_nb,
    "pytree_nb": m_pytree_nb,
}
MTC_METHODS: dict[str, Method] = {
    "mtc": _mtc(),
    "mtc_no_pack": _mtc(pack_cpu_tensors=False),
    "mtc_no_pinned": _mtc(use_pinned_staging=False),
    "mtc_no_thread": _mtc(use_background_thread=False),
}
ALL_METHODS: dict[str, Method] = {**BASELINE_METHODS, **MTC_METHODS}

# Which methods make sense per copy direction (pinning a GPU tensor does not; packing and
# pinned staging have no effect on GPU -> GPU copies).
METHODS_BY_DIRECTION: dict[str, list[str]] = {
    "H2D": list(ALL_METHODS),
    "D2H": ["to", "to_nb", "pytree_nb", *MTC_METHODS],
    "D2D": ["to", "to_nb", "pytree_nb", "mtc", "mtc_no_thread"],
    "np2cpu": ["to", "pytree_nb", "mtc", "mtc_no_thread"],
}


# --------------------------------------------------------------------------------------------
# Workloads
# --------------------------------------------------------------------------------------------


@dataclass
class Workload:
    """One benchmark case: data on its source device, where it goes, and which methods run."""

    name: str
    direction: str  # "H2D", "D2H", "D2D" or "np2cpu"
    data: Any
    target: torch.device
    methods: list[str]
    rounds: int
    sync_devices: list[torch.device] = field(default_factory=list)


def build_workloads(args: argparse.Namespace) -> tuple[list[Workload], dict[str, str]]:
    """The workloads to run (filtered by ``--only``) and the skipped ones with their reason."""
    device = torch.device(args.device)
    skipped: dict[str, str] = {}
    specs: list[tuple[str, str, str]] = []  # (name, direction, builder name)

    if device.type == "cpu":
        # No GPU: the only copy worth timing is numpy -> CPU tensor; tensor -> CPU is reuse.
        specs = [(f"{w}_np", "np2cpu", w) for w in ("seed16", "seed4", "seed64")]
    else:
        specs = [(w, "H2D", w) for w in WORKLOADS]
        specs += [("seed16_d2h", "D2H", "seed16"), ("16x16MB_d2h", "D2H", "16x16MB"),
                  ("seed16_d2d", "D2D", "seed16")]

    workloads = []
    for name, direction, builder in specs:
        if args.only and name not in args.only:
            continue
        methods = list(METHODS_BY_DIRECTION[direction])
        if mtc_loader is None:
            methods = [m for m in methods if m in BASELINE_METHODS]
        rounds = rounds_for(name, args)
        data = WORKLOADS[builder](SEED)

        if direction == "np2cpu":
            workloads.append(Workload(name, direction, to_numpy(data), device, methods, rounds))
        elif direction == "H2D":
            workloads.append(Workload(name, direction, data, device, methods, rounds, [device]))
        elif direction == "D2H":
            data = m_to(data, device)
            torch.cuda.synchronize(device)
            cpu = torch.device("cpu")
            workloads.append(Workload(name, direction, data, cpu, methods, rounds, [device]))
        elif direction == "D2D":
            other = _other_cuda_device(device)
            if other is None:
                skipped[name] = (
                    "needs 2 GPUs (a copy to the same device is reuse, meaningless to time); "
                    f"{torch.cuda.device_count()} visible"
                )
                continue
            data = m_to(data, device)
            torch.cuda.synchronize(device)
            workloads.append(
                Workload(name, direction, data, other, methods, rounds, [device, other])
            )

    unknown = set(args.only or ()) - {w.name for w in workloads} - set(skipped)
    if unknown:
        names = ", ".join(name for name, _, _ in specs)
        sys.exit(f"unknown workload(s) {sorted(unknown)} for device {device}; have: {names}")
    return workloads, skipped


def _other_cuda_device(device: torch.device) -> torch.device | None:
    """A CUDA device other than ``device``, or None if there is only one."""
    for i in range(torch.cuda.device_count()):
        if i != (device.index or 0):
            return torch.device("cuda", i)
    return None


def rounds_for(name: str, args: argparse.Namespace) -> int:
    """Timed rounds for a workload: ``--rounds``, else 30 (10 for the 256 MB one); 5 if quick."""
    if args.rounds:
        return args.rounds
    if args.quick:
        return 3 if name in BIG_WORKLOADS else 5
    return 10 if name in BIG_WORKLOADS else 30


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


def synchronize(devices: list[torch.device]) -> None:
    """Wait for all work on every given CUDA device."""
    for d in devices:
        torch.cuda.synchronize(d)


def time_once(method: Method, w: Workload) -> float:
    """Seconds for one copy of ``w.data`` by ``method``, until its result is usable."""
    t0 = time.perf_counter()
    out = method(w.data, w.target)
    synchronize(w.sync_devices)
    t1 = time.perf_counter()
    del out
    return t1 - t0


def check_correct(w: Workload) -> dict[str, str]:
    """Compare every method's output with ``.to()``'s, leaf by leaf, bitwise.

    Returns ``{method: what went wrong}`` for each method that raised or whose output differs
    (empty when all agree).
    """
    ref = m_to(w.data, w.target)
    synchronize(w.sync_devices)
    ref_leaves = list(iter_leaves(ref))
    failures: dict[str, str] = {}
    for name in w.methods:
        try:
            out = ALL_METHODS[name](w.data, w.target)
            synchronize(w.sync_devices)
        except Exception as exc:
            failures[name] = f"raised {type(exc).__name__}: {exc}"
            continue
        problem = _compare(ref, ref_leaves, out, w.target)
        if problem:
            failures[name] = f"MISMATCH: {problem}"
    return failures


def check_all(workloads: list[Workload], keep_going: bool) -> dict[str, dict[str, str]]:
    """Check every workload's methods before any timing; abort on the first failing workload.

    With ``keep_going``, failing methods are dropped from their workload instead, and the
    failures are returned (``{workload: {method: what went wrong}}``) for the report.
    """
    failed: dict[str, dict[str, str]] = {}
    for w in workloads:
        failures = check_correct(w)
        if not failures:
            continue
        lines = "\n".join(f"  {m}: {msg}" for m, msg in failures.items())
        if not keep_going:
            sys.exit(f"correctness check failed in workload {w.name!r} ({w.direction}):\n"
                     f"{lines}\n(--keep-going times the other methods anyway)")
        print(f"WARNING: dropping failing methods of {w.name!r}:\n{lines}")
        w.methods = [m for m in w.methods if m not in failures]
        failed[w.name] = failures
    return failed


def _compare(ref: Any, ref_leaves: list, out: Any, target: torch.device) -> str | None:
    """A description of the first difference between ``out`` and ``ref``, or None."""
    if _skeleton(out) != _skeleton(ref):
        return "output structure (containers, keys, leaf positions) differs from the input's"
    out_leaves = list(iter_leaves(out))
    for (path, r), (_, o) in zip(ref_leaves, out_leaves):
        if not isinstance(o, torch.Tensor):
            return f"{path} is a {type(o).__name__}, not a tensor"
        if o.device != target and not (target.index is None and o.device.type == target.type):
            return f"{path} is on {o.device}, expected {target}"
        if o.dtype != r.dtype or o.shape != r.shape:
            return f"{path}: {o.dtype}{tuple(o.shape)} vs expected {r.dtype}{tuple(r.shape)}"
        if not torch.equal(o.cpu(), r.cpu()):
            return f"{path}: values differ"
    return None


def _skeleton(data: Any) -> Any:
    """The container skeleton of ``data`` with every leaf replaced by a marker."""
    if isinstance(data, dict):
        return (type(data), tuple((k, _skeleton(v)) for k, v in data.items()))
    if isinstance(data, (list, tuple)):
        return (type(data), tuple(_skeleton(v) for v in data))
    if isinstance(data, (torch.Tensor, np.ndarray)):
        return "leaf"
    return ("other", repr(data))


# The garbage collector's setting while timing: on (as users run), unless --gc-off.
GC_ON = True


def run_workload(w: Workload, warmup: int) -> dict[str, list[float]]:
    """Warm up, then time ``w.rounds`` interleaved rounds; seconds per method. The collector
    runs as in the user's program (its collections land in the calls that trigger them: the
    mean and the tail show them), unless ``--gc-off``."""
    methods = [(name, ALL_METHODS[name]) for name in w.methods]
    for _ in range(warmup):
        for _, method in methods:
            time_once(method, w)

    samples: dict[str, list[float]] = {name: [] for name, _ in methods}
    gc_was_enabled = gc.isenabled()
    gc.collect()
    if not GC_ON:
        gc.disable()  # a collection inside one timed call would land on one method only
    try:
        for r in range(w.rounds):
            k = r % len(methods)
            for name, method in methods[k:] + methods[:k]:
                samples[name].append(time_once(method, w))
            if not GC_ON:
                gc.collect()
    finally:
        if gc_was_enabled:
            gc.enable()
    return samples


def summarize(samples: list[float], baseline_median: float | None, nbytes: int) -> dict:
    """Median / p10 / p90, mean, p99 and max in ms, ratio vs the baseline, GB/s, and the raw
    samples."""
    ms = [s * 1e3 for s in samples]
    med = statistics.median(ms)
    return {
        "median_ms": med,
        "p10_ms": float(np.percentile(ms, 10)),
        "p90_ms": float(np.percentile(ms, 90)),
        "mean_ms": statistics.fmean(ms),
        "p99_ms": float(np.percentile(ms, 99)),
        "max_ms": max(ms),
        "min_ms": min(ms),
        "ratio_vs_to": (baseline_median / med) if baseline_median else None,
        "gbps": nbytes / (med * 1e-3) / 1e9,
        "samples_ms": ms,
    }


def measure_bandwidth(device: torch.device, nbytes: int = 256 << 20, reps: int = 5) -> dict:
    """Reference H2D bandwidths in GB/s (median of ``reps``): pinned non_blocking, pageable."""
    pinned = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    pinned.fill_(1)
    pageable = torch.ones(nbytes, dtype=torch.uint8)

    def rate(fn: Callable[[], Any]) -> float:
        fn()  # warm-up: allocator blocks, first-touch of pages
        synchronize([device])
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            out = fn()
            synchronize([device])
            times.append(time.perf_counter() - t0)
            del out
        return nbytes / statistics.median(times) / 1e9

    return {
        "bytes": nbytes,
        "h2d_pinned_nb_gbps": rate(lambda: pinned.to(device, non_blocking=True)),
        "h2d_pageable_to_gbps": rate(lambda: pageable.to(device)),
    }


CEILING_THREADS = (1, 2, 4, 8, 16)
WINDOW_BYTES = 512 << 10  # per thread, for the ceiling's cache-resident copy


def _median_rate(nbytes: int, secs: list[float]) -> float:
    """GB/s of ``nbytes`` at the median of ``secs``."""
    return nbytes / statistics.median(secs) / 1e9


def measure_ceiling(device: torch.device, nbytes: int = 256 << 20, reps: int = 7) -> dict:
    """What bounds a staged pageable-source H2D copy, measured in this process.

    - ``memcpy_gbps[n]`` / ``memcpy_nt_gbps[n]``: aggregate copy bandwidth from pageable into
      pinned memory of ``n`` threads (the engine's ``_memcpy_bench``: memcpy, and streaming
      stores), and ``torch_copy_gbps[n]``: ``pinned.copy_(pageable)`` with
      ``torch.set_num_threads(n)`` (torch's intra-op pool, as in ``pin_memory()``);
    - ``window_gbps``: the helpers' number of threads copying with memcpy into a pinned window
      of ``WINDOW_BYTES`` each, reused (the destination stays in the cache): the copy rate
      without the writes to memory;
    - ``dma_gbps``: H2D from pinned memory alone; ``overlap``: the same DMA while the helpers'
      number of threads copy pageable -> pinned (memcpy, streaming stores, and the cached
      window): how much the staging copy and the DMA slow each other through memory bandwidth;
    - ``register_gbps``: ``cudaHostRegister`` + ``cudaHostUnregister`` of a pageable source in
      place (16 MB and 256 MB), as bytes per second of that work.
    """
    engine = getattr(mtc_loader, "_engine", None) if mtc_loader else None
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst.zero_()
    out: dict[str, Any] = {"bytes": nbytes, "reps": reps, "cpus": os.cpu_count()}
    if engine is not None:
        for key, nt in (("memcpy_gbps", 0), ("memcpy_nt_gbps", 1)):
            out[key] = {}
            for n in CEILING_THREADS:
                secs = engine._memcpy_bench(dst.data_ptr(), src.data_ptr(), nbytes, n, reps, nt)
                out[key][n] = _median_rate(nbytes, secs[1:])
    helpers = (os.cpu_count() or 4) - 2 if (os.cpu_count() or 4) > 3 else 1
    helpers = int(os.environ.get("MTC_HELPER_THREADS", helpers))
    if engine is not None:
        secs = engine._memcpy_bench(dst.data_ptr(), src.data_ptr(), nbytes, helpers, reps, 0,
                                    WINDOW_BYTES)
        out["window_gbps"] = _median_rate(nbytes, secs[1:])
    threads_before = torch.get_num_threads()
    out["torch_threads_default"] = threads_before
    out["torch_copy_gbps"] = {}
    try:
        for n in CEILING_THREADS:
            torch.set_num_threads(n)
            dst.copy_(src)
            secs = []
            for _ in range(reps):
                t0 = time.perf_counter()
                dst.copy_(src)
                secs.append(time.perf_counter() - t0)
            out["torch_copy_gbps"][n] = _median_rate(nbytes, secs)
    finally:
        torch.set_num_threads(threads_before)

    # DMA alone, then DMA + concurrent staging copies into another pinned buffer.
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
    other = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    other.fill_(2)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def dma(times: int) -> None:
        start.record()
        for _ in range(times):
            gpu.copy_(other, non_blocking=True)
        end.record()

    dma(1)
    synchronize([device])
    secs = []
    for _ in range(reps):
        dma(1)
        end.synchronize()
        secs.append(start.elapsed_time(end) / 1e3)
    out["dma_gbps"] = _median_rate(nbytes, secs)
    if engine is not None:
        out["overlap"] = {"threads": helpers}
        for key, nt, window in (("memcpy", 0, 0), ("memcpy_nt", 1, 0), ("window", 0, WINDOW_BYTES)):
            copy_secs, dma_rates = [], []
            for _ in range(3):
                dma(4)  # about 20 ms of DMA: the copies below run inside it
                copy_secs += engine._memcpy_bench(dst.data_ptr(), src.data_ptr(), nbytes, helpers, 2,
                                                  nt, window)
                busy = not end.query()
                end.synchronize()
                dma_rates.append(4 * nbytes / (start.elapsed_time(end) / 1e3) / 1e9)
                out["overlap"][f"{key}_inside_dma"] = busy
            out["overlap"][f"{key}_gbps"] = _median_rate(nbytes, copy_secs)
            out["overlap"][f"dma_with_{key}_gbps"] = statistics.median(dma_rates)
    del gpu, other

    try:
        cudart = torch.cuda.cudart()
        out["register_gbps"] = {}
        for size in (16 << 20, nbytes):
            t = torch.ones(size, dtype=torch.uint8)
            secs = []
            for _ in range(reps):
                t0 = time.perf_counter()
                cudart.cudaHostRegister(t.data_ptr(), size, 0)
                cudart.cudaHostUnregister(t.data_ptr())
                secs.append(time.perf_counter() - t0)
            out["register_gbps"][size] = _median_rate(size, secs)
    except Exception as exc:  # an older torch without the binding: report, go on
        out["register_error"] = f"{type(exc).__name__}: {exc}"
    return out


def print_ceiling(c: dict) -> None:
    """The ceiling measurement as a few lines of text."""
    mb = c["bytes"] >> 20
    print(f"ceiling ({mb} MB, median of {c['reps']}, {c['cpus']} CPUs; GB/s):")
    print(f"  {'threads':<34}" + "".join(f"{n:>8}" for n in CEILING_THREADS))
    for key, label in (("memcpy_gbps", "memcpy pageable -> pinned"),
                       ("memcpy_nt_gbps", "streaming stores pageable -> pinned"),
                       ("torch_copy_gbps", "torch pinned.copy_(pageable)")):
        if key in c:
            print(f"  {label:<34}" + "".join(f"{c[key][n]:>8.2f}" for n in CEILING_THREADS))
    print(f"  torch intra-op threads by default: {c['torch_threads_default']}")
    if "window_gbps" in c:
        print(f"  memcpy into a reused {WINDOW_BYTES >> 10} KiB window per thread "
              f"(cache-resident), {c.get('overlap', {}).get('threads', '?')} threads: "
              f"{c['window_gbps']:.2f}")
    print(f"  H2D DMA from pinned, alone: {c['dma_gbps']:.2f}")
    ov = c.get("overlap")
    if ov:
        for key in ("memcpy", "memcpy_nt", "window"):
            if key + "_gbps" not in ov:
                continue
            print(f"  {key} with {ov['threads']} threads during a pinned H2D DMA: copy "
                  f"{ov[key + '_gbps']:.2f}, DMA {ov['dma_with_' + key + '_gbps']:.2f}"
                  f"{'' if ov[key + '_inside_dma'] else ' (the copy outlasted the DMA)'}")
    for size, gbps in c.get("register_gbps", {}).items():
        print(f"  cudaHostRegister + Unregister of {int(size) >> 20} MB in place: {gbps:.2f}")
    if "register_error" in c:
        print(f"  cudaHostRegister: {c['register_error']}")


# --------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------


def machine_info(device: torch.device) -> dict:
    """What the numbers were measured on."""
    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "numpy": np.__version__,
        "device": str(device),
        "gpus": [],
        "mtc_loader": getattr(mtc_loader, "__version__", None) if mtc_loader else None,
        "mtc_loader_import_error": MTC_IMPORT_ERROR,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def print_table(results: dict[str, dict]) -> None:
    """Workload | method | median ms | p10 | p90 | mean | p99 | max | ratio vs .to() [| GB/s]."""
    header = (
        f"{'workload':<13} {'dir':<6} {'method':<14} {'median ms':>10} "
        f"{'p10':>8} {'p90':>8} {'mean':>8} {'p99':>8} {'max':>8} {'vs .to()':>9} {'GB/s':>7}"
    )
    print(header)
    print("-" * len(header))
    for wname, res in results.items():
        for mname, m in res["methods"].items():
            ratio = f"{m['ratio_vs_to']:.2f}x" if m["ratio_vs_to"] else "-"
            gbps = f"{m['gbps']:.2f}" if wname in BIG_WORKLOADS else ""
            print(
                f"{wname:<13} {res['direction']:<6} {mname:<14} {m['median_ms']:>10.3f} "
                f"{m['p10_ms']:>8.3f} {m['p90_ms']:>8.3f} {m['mean_ms']:>8.3f} {m['p99_ms']:>8.3f} "
                f"{m['max_ms']:>8.3f} {ratio:>9} {gbps:>7}"
            )
        if "bandwidth" in res:
            bw = res["bandwidth"]
            print(
                f"{'':<13} {'':<6} reference: 256 MB H2D pinned .to(nb) "
                f"{bw['h2d_pinned_nb_gbps']:.2f} GB/s, pageable .to() "
                f"{bw['h2d_pageable_to_gbps']:.2f} GB/s"
            )
        print()


def plot(results: dict[str, dict], path: str, title: str) -> bool:
    """Grouped horizontal bars of the ratio vs ``.to()``, log scale, targets as markers.

    Returns False (after printing a notice) when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("notice: matplotlib is not installed; skipping the plot")
        return False

    # .to() itself is the dashed line at 1x, not a bar.
    methods = [
        m for m in ALL_METHODS
        if m != BASELINE and any(m in r["methods"] for r in results.values())
    ]
    workloads = list(results)
    bar_h = 0.8 / max(len(methods), 1)
    colors = plt.get_cmap("tab10")

    def bar_y(i: int, m: str) -> float:
        """Centre of method ``m``'s bar in workload group ``i``."""
        return i + (methods.index(m) - (len(methods) - 1) / 2) * bar_h

    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.22 * len(methods) * len(workloads)))
    for j, m in enumerate(methods):
        ys, xs = [], []
        for i, w in enumerate(workloads):
            r = results[w]["methods"].get(m)
            if r and r["ratio_vs_to"]:
                ys.append(bar_y(i, m))
                xs.append(r["ratio_vs_to"])
        ax.barh(ys, xs, height=bar_h, color=colors(j % 10), label=m)

    # The targets apply to the default start_copy: mark them on the "mtc" bar.
    target_label = "target for mtc"
    for i, w in enumerate(workloads):
        target = TARGETS.get(w)
        if target is None:
            continue
        y = bar_y(i, "mtc") if "mtc" in methods else i
        ax.plot([target], [y], marker="D", color="black", markersize=7, linestyle="none",
                label=target_label)
        ax.annotate(f"target {target:g}x", (target, y), xytext=(7, -3),
                    textcoords="offset points", fontsize="small")
        target_label = "_nolegend_"

    # Where bandwidth was measured, the pinned-source copy of the same bytes is the ceiling.
    limit_label = "pinned-source limit"
    for i, w in enumerate(workloads):
        bw, base = results[w].get("bandwidth"), results[w]["methods"].get(BASELINE)
        if not bw or not base:
            continue
        limit = bw["h2d_pinned_nb_gbps"] / base["gbps"]
        ax.vlines(limit, i - 0.45, i + 0.45, color="black", linewidth=2, label=limit_label)
        ax.annotate(f"limit {limit:.1f}x", (limit, i - 0.3), xytext=(5, 0),
                    textcoords="offset points", fontsize="small")
        limit_label = "_nolegend_"

    ax.axvline(1.0, color="grey", linewidth=1, linestyle="--")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}x"))
    ax.set_yticks(range(len(workloads)))
    ax.set_yticklabels([f"{w}\n({results[w]['direction']})" for w in workloads])
    ax.invert_yaxis()
    ax.set_xlabel("speed-up vs per-tensor .to()  (median(.to()) / median(method), log scale)")
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    ax.grid(axis="x", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda:0", help="target device (default cuda:0)")
    p.add_argument("--rounds", type=int, default=0,
                   help="timed rounds per workload (default 30, 10 for 16x16MB)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up rounds per method (min 3)")
    p.add_argument("--quick", action="store_true", help="few rounds: a fast smoke run")
    p.add_argument("--gc-off", action="store_true",
                   help="time with the garbage collector off (collected between rounds instead)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"),
                   help="output folder (default bench/results)")
    p.add_argument("--only", nargs="+", metavar="WORKLOAD", help="run only these workloads")
    p.add_argument("--no-ceiling", action="store_true",
                   help="skip the ceiling measurement (copy bandwidth by threads, DMA overlap)")
    p.add_argument("--keep-going", action="store_true",
                   help="drop methods that fail the correctness check instead of aborting "
                        "(they are listed in the JSON; the exit code is then 1)")
    args = p.parse_args(argv)
    args.warmup = max(args.warmup, 3)
    return args


def main(argv: list[str] | None = None) -> int:
    global GC_ON
    args = parse_args(argv)
    GC_ON = not args.gc_off
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit(f"--device {device} asked for, but CUDA is not available (try --device cpu)")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
        args.device = str(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if MTC_IMPORT_ERROR:
        print(f"WARNING: import mtc_loader failed ({MTC_IMPORT_ERROR}): baselines only")

    ceiling = None
    if device.type == "cuda" and not args.no_ceiling:
        ceiling = measure_ceiling(device)
        print_ceiling(ceiling)

    workloads, skipped = build_workloads(args)
    for name, reason in skipped.items():
        print(f"skipping {name}: {reason}")
    failed = check_all(workloads, args.keep_going)

    results: dict[str, dict] = {}
    for w in workloads:
        n, nbytes = count_tensors(w.data)
        print(f"[{w.name}] {w.direction} -> {w.target}: {n} tensors, {nbytes / 1e3:.1f} KB, "
              f"{len(w.methods)} methods x {w.rounds} rounds", flush=True)
        samples = run_workload(w, args.warmup)
        base = statistics.median(samples[BASELINE]) * 1e3 if BASELINE in samples else None
        res = {
            "direction": w.direction,
            "source": str(next(iter_leaves(w.data))[1].device)
            if w.direction != "np2cpu" else "numpy",
            "target": str(w.target),
            "tensors": n,
            "bytes": nbytes,
            "rounds": w.rounds,
            "warmup": args.warmup,
            "methods": {m: summarize(s, base, nbytes) for m, s in samples.items()},
        }
        if w.name in BIG_WORKLOADS and w.direction == "H2D":
            res["bandwidth"] = measure_bandwidth(device)
        results[w.name] = res

    stats = None
    if mtc_loader is not None:
        try:
            stats = mtc_loader.stats()
        except Exception as exc:  # report, don't lose the timings
            stats = {"error": f"{type(exc).__name__}: {exc}"}

    print()
    print_table(results)
    if ceiling is not None:
        print_ceiling(ceiling)
    if stats is not None:
        print("mtc_loader.stats():", json.dumps(stats, indent=None, default=str))
    if MTC_IMPORT_ERROR:
        print(f"WARNING: mtc_loader was not measured: {MTC_IMPORT_ERROR}")
    for wname, failures in failed.items():
        print(f"WARNING: {wname}: {sorted(failures)} failed the correctness check, not timed")

    os.makedirs(args.out, exist_ok=True)
    info = machine_info(device)
    report = {
        "machine": info,
        "config": {k: v for k, v in vars(args).items()},
        "targets": TARGETS,
        "workloads": results,
        "skipped": skipped,
        "failed": failed,
        "mtc_stats": stats,
        "ceiling": ceiling,
        "provenance": provenance(argv),
    }
    json_path = os.path.join(args.out, "bench_copy.json")
    with open(json_path, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(f"wrote {json_path}")

    gpu = info["gpus"][0] if info["gpus"] else platform.processor() or "CPU"
    title = f"mtc_loader vs .to() on {gpu}, torch {torch.__version__}"
    png_path = os.path.join(args.out, "bench_copy.png")
    if results and plot(results, png_path, title):
        print(f"wrote {png_path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
