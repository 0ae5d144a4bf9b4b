"""Profile a training loop fed by PackedCollate + PrefetchLoader with torch.profiler, and say
where a batch's time went (the profiling recipe, docs/profiler.md).

Run it with::

    python3 examples/profile_prefetch.py [OUT.json]

It uses ``cuda:0`` when a GPU is available (CPU and CUDA activities) and the CPU otherwise (CPU
activities only), profiles every thread (so the prefetch service's ranges are in the trace),
writes a Chrome trace to ``OUT.json`` (default: ``mtc_loader_trace.json`` in a new folder under
the system's temporary directory; the path is printed; open it in Perfetto), and prints, for each mtc_loader range and each copy kind, the
count, the total time and the threads (or device) it ran on; the trace shows the copies' stream.
Then it says whether the loop was data-bound, from ``PrefetchLoader.stats()``.
Exit code 0 when the trace holds the ranges it should (and, on a GPU, host-to-device copies).
"""
from __future__ import annotations

import collections
import os
import sys
import tempfile
from typing import Any

import torch
import torch.profiler
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DataLoader, Dataset

import mtc_loader


class Samples(Dataset):
    """Per-sample dicts of many small variable-size tensors (camera meta-data)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(i)
        return {"image": torch.randn(3, 64, 64, generator=g),
                "cams": [{"K": torch.randn(3, 3, generator=g), "boxes": torch.randn(1 + (i + c) % 7, 9, generator=g),
                          "labels": torch.randint(0, 10, (1 + (i + c) % 7,), generator=g)} for c in range(6)]}


def all_threads_config() -> Any:
    """profile()'s ``experimental_config`` that records every thread, or None where this torch
    has none.

    torch.profiler records CPU ranges only on the thread that started it, and has no public switch
    for the others: ``experimental_config`` is ``profile()``'s documented parameter for such
    options, and ``_ExperimentalConfig(profile_all_threads=True)`` (re-exported by
    ``torch.profiler``, which warns that its options are experimental) is the only value that
    records other threads, the prefetch service's included. Without it the trace still holds the
    loop's ranges and the copies, not the service's ranges.
    """
    config = getattr(torch.profiler, "_ExperimentalConfig", None)
    try:
        return config(profile_all_threads=True) if config is not None else None
    except TypeError:  # a torch before profile_all_threads
        return None


def verdict(stats: dict) -> str:
    """What ``PrefetchLoader.stats()`` says of the loop, in words."""
    share = stats["data_bound"]
    head = (f"the loop waited {stats['wait_ms_per_batch']:.2f} ms per batch for data and stepped "
            f"{stats['step_ms_per_batch']:.2f} ms ({100 * share:.0f}% of its time waiting; "
            f"{stats['batches']} batches, the first one's wait included)")
    if share > 0.1:
        return (f"DATA-BOUND: {head}: the GPU waits for batches; more DataLoader workers, a cheaper "
                "dataset or a deeper PrefetchLoader depth would help")
    return (f"not data-bound: {head}: batches are ready when the step wants them; the prefetch "
            f"service spent {stats['service_cpu_ms_per_batch']:.2f} ms of CPU per batch")


def quiet_cuda_build_without_gpu() -> None:
    """A CUDA build of torch on a machine without a GPU logs ``ERROR ... gpuGetDeviceCount
    failed`` from its profiler backend (Kineto) whenever a profile stops, even one of CPU
    activities only: quiet Kineto's log there (unless KINETO_LOG_LEVEL is set). It is read when
    the first profile starts."""
    if torch.version.cuda and not torch.cuda.is_available():
        os.environ.setdefault("KINETO_LOG_LEVEL", "5")


def trace_path(argv: list) -> str:
    """The trace's path: the first argument, or a file in a new temporary folder."""
    if len(argv) > 1:
        return str(argv[1])
    return os.path.join(tempfile.mkdtemp(prefix="mtc_loader_profile_"), "mtc_loader_trace.json")


def main() -> int:
    out = trace_path(sys.argv)
    cuda = torch.cuda.is_available()
    quiet_cuda_build_without_gpu()
    device = "cuda:0" if cuda else "cpu"
    loader = DataLoader(Samples(), batch_size=8, num_workers=2, collate_fn=mtc_loader.PackedCollate(list))
    prefetch = mtc_loader.PrefetchLoader(loader, device)
    weight = torch.randn(3 * 64 * 64, 256, device=device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    config = all_threads_config()
    if config is None:
        print("this torch cannot profile threads other than the loop's: the service's ranges are missing")
    with profile(activities=activities, experimental_config=config) as prof:
        for batch in prefetch:
            x = torch.stack([s["image"] for s in batch]).flatten(1)
            for _ in range(20):  # the step
                x = (x @ weight).relu() @ weight.T
        if cuda:
            torch.cuda.synchronize()
    prof.export_chrome_trace(out)

    ranges: dict = collections.defaultdict(lambda: [0, 0.0, set()])
    for e in prof.events():
        if e.name.startswith("mtc_loader.") or "Memcpy HtoD" in e.name:
            r = ranges[e.name]
            r[0] += 1
            r[1] += (e.device_time if e.device_type == torch.autograd.DeviceType.CUDA else e.cpu_time) / 1e3
            r[2].add(f"cuda:{e.device_index}" if "Memcpy" in e.name else f"thread {e.thread}")
    print(f"{'range':44s} {'count':>6s} {'total ms':>9s}  where")
    for name, (n, ms, where) in sorted(ranges.items()):
        print(f"{name:44s} {n:6d} {ms:9.2f}  {', '.join(sorted(where))}")
    print("PrefetchLoader.stats():", verdict(prefetch.stats()))
    print("trace written to", os.path.abspath(out))
    ok = ranges["mtc_loader.prefetch.next"][0] == 9 and (
        config is None or ranges["mtc_loader.prefetch.copy_batch"][0] == 8)
    if cuda:
        ok = ok and any("Memcpy HtoD" in name for name in ranges)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
