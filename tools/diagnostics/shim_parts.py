"""What each part of torch's C shim saves per call, in one process: the reference batch (seed16,
528 small tensors) with the leaf reader and the output wrapper switched on and off in turn.

    python3 tools/diagnostics/shim_parts.py [--device cuda:0 | cpu] [--rounds 6] [--calls 250]

The parts (``mtc_loader._engine._shim_parts()``):

- ``reader``: each exact tensor's metadata read from the tensor inside its Python object through
  the shim's getters (off: torch's DLPack C exchange table, one call per tensor, and the
  ``is_neg()`` / ``is_conj()`` methods);
- ``wrap``: each output handle turned into a Python tensor by torch's own wrapper, one C call
  (off: the batch's handles through ``torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs``
  in one Python call);

and ``split``: torch's split operators make the outputs (the shim's maker off; the reader on).

On a GPU each call is ``start_copy(seed16, device).get()`` and a synchronize (the walk and the
views are the stages ``traverse`` and ``views`` of ``mtc_loader.stats()``). With ``--device
cpu`` (no GPU needed) each call is ``PackedCollate(list)(seed16)`` (the walk, in ``pack``)
followed by ``.unpack("cpu")`` (the views in ``unpack_views``). The variants alternate in blocks
of ``--calls`` calls, their order rotating from round to round; the garbage collector stays on.
Per variant: the latency's p50, mean, p99 and max (ms) and the medians of the stages (us per
call).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "bench"))
import mtc_loader  # noqa: E402
from mtc_loader import _engine  # noqa: E402
from workloads import seed_batch  # noqa: E402

# variant -> (reader, wrap, shim maker)
VARIANTS = {"reader+wrap": (True, True, True), "wrap": (False, True, True), "reader": (True, False, True),
            "neither": (False, False, True), "split": (True, False, False)}


def _select(reader: bool, wrap: bool, shim: bool) -> None:
    _engine._use_shim_reader(reader)
    _engine._use_shim_wrap(wrap)
    _engine._use_shim(shim)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--calls", type=int, default=250)
    args = ap.parse_args()
    batch = seed_batch(16)
    parts = _engine._shim_parts()
    print(f"torch {torch.__version__}, {args.device}, output maker {mtc_loader.output_maker()}, parts {parts}")
    if not (parts["reader"] and parts["wrap"]):
        print("note: this torch lacks a part; its variants run as the fallback they name")
    if args.device == "cpu":
        pc = mtc_loader.PackedCollate(list)
        stages = {"pack": None, "unpack_views": "ns_unpack_views", "unpack_rebuild": "ns_unpack_rebuild"}

        def call() -> tuple[float, float]:
            t0 = time.perf_counter()
            pb = pc(batch)
            t1 = time.perf_counter()
            pb.unpack("cpu")
            return time.perf_counter() - t0, t1 - t0
    else:
        stages = {"traverse": "ns_traverse", "views": "ns_views", "plan": "ns_plan", "outputs": "ns_outputs"}

        def call() -> tuple[float, float]:
            t0 = time.perf_counter()
            mtc_loader.start_copy(batch, args.device).get()
            torch.cuda.synchronize()
            return time.perf_counter() - t0, 0.0
    prev = _engine._use_shim_reader(True), _engine._use_shim_wrap(True), _engine._use_shim(True)
    try:
        lat: dict[str, list[float]] = {v: [] for v in VARIANTS}
        per: dict[str, dict[str, list[float]]] = {v: {s: [] for s in stages} for v in VARIANTS}
        for _ in range(100):
            call()
        names = list(VARIANTS)
        for r in range(args.rounds):
            for v in names[r % len(names):] + names[:r % len(names)]:
                _select(*VARIANTS[v])
                for _ in range(20):
                    call()
                before, pack = mtc_loader.stats(), 0.0
                for _ in range(args.calls):
                    total, p = call()
                    lat[v].append(total)
                    pack += p
                after = mtc_loader.stats()
                for s, key in stages.items():
                    ns = pack * 1e9 if key is None else after[key] - before[key]
                    per[v][s].append(ns / args.calls / 1000)
    finally:
        _select(*prev)
    print(f"{args.rounds} rounds x {args.calls} calls per variant; latency in ms, stages in us per call (median of rounds)")
    for v, xs in lat.items():
        xs.sort()
        n = len(xs)
        print(f"  {v:12s} p50 {1e3 * xs[n // 2]:.3f} mean {1e3 * statistics.mean(xs):.3f} "
              f"p99 {1e3 * xs[min(n - 1, int(n * 0.99))]:.3f} max {1e3 * xs[-1]:.3f} | "
              + " ".join(f"{s}={statistics.median(x):.0f}" for s, x in per[v].items()))


if __name__ == "__main__":
    main()
