"""Summarise a torch.profiler Chrome trace (``prof.export_chrome_trace``) for mtc_loader: the
``mtc_loader.*`` record_function ranges (count, total time, threads), the device's memory
copies and kernels by CUDA stream, the CUDA API calls that issue copies or order streams, and
how much of the host-to-device copy time ran while a kernel was running (the overlap the
prefetch service is for).

    python3 tools/diagnostics/trace_summary.py trace.json
"""
from __future__ import annotations

import collections
import json
import sys


def merged(intervals: list) -> list:
    out: list = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def covered(a: float, b: float, spans: list) -> float:
    """Length of [a, b) covered by the sorted, disjoint spans."""
    return sum(max(0.0, min(b, e) - max(a, s)) for s, e in spans if s < b and e > a)


def main() -> int:
    with open(sys.argv[1]) as f:
        trace = json.load(f)
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    groups: dict = collections.defaultdict(lambda: [0, 0.0, set(), 0])  # count, us, where, bytes
    kernels, h2d = [], []
    for e in events:
        cat, name, dur = e.get("cat", ""), e.get("name", ""), float(e.get("dur", 0))
        args = e.get("args", {}) or {}
        if cat in ("user_annotation", "gpu_user_annotation") and name.startswith("mtc_loader."):
            key, where = (cat, name), f"tid {e.get('tid')}" if cat == "user_annotation" else f"stream {e.get('tid')}"
        elif cat == "gpu_memcpy":
            key, where = (cat, name), f"stream {args.get('stream', e.get('tid'))}"
            if "HtoD" in name:
                h2d.append((float(e["ts"]), float(e["ts"]) + dur))
        elif cat == "kernel":
            key, where = (cat, "kernels"), f"stream {args.get('stream', e.get('tid'))}"
            kernels.append((float(e["ts"]), float(e["ts"]) + dur))
        elif cat in ("cuda_driver", "cuda_runtime") and any(
                s in name for s in ("Memcpy", "StreamWaitEvent", "EventRecord", "HostRegister")):
            key, where = (cat, name), f"tid {e.get('tid')}"
        else:
            continue
        g = groups[key]
        g[0] += 1
        g[1] += dur
        g[2].add(where)
        g[3] += int(args.get("bytes", 0) or 0)
    print(f"{'category':20s} {'name':44s} {'count':>6s} {'total ms':>9s} {'MB':>8s}  where")
    for (cat, name), (n, us, where, nbytes) in sorted(groups.items()):
        mb = f"{nbytes / 1e6:8.2f}" if nbytes else f"{'':8s}"
        print(f"{cat:20s} {name[:44]:44s} {n:6d} {us / 1e3:9.3f} {mb}  {', '.join(sorted(where))}")
    if h2d:
        spans = merged(kernels)
        total = sum(b - a for a, b in h2d)
        over = sum(covered(a, b, spans) for a, b in h2d)
        print(f"host-to-device copies: {len(h2d)}, {total / 1e3:.3f} ms, of which {over / 1e3:.3f} ms "
              f"({100 * over / total if total else 0:.0f}%) ran while a kernel was running")
    return 0 if groups else 1


if __name__ == "__main__":
    sys.exit(main())
