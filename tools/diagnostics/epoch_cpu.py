"""Each timed epoch of bench_train beside the training thread's CPU time per step: does a loader
method lose its share of the preloaded loop where the training thread runs its own code slower,
or also where it runs as fast as in ``ideal``?

    python3 tools/diagnostics/epoch_cpu.py RESULT [RESULT ...] [--config launch4] [--margin-ms 0.2]

RESULT: a ``bench_train.json``, or a folder searched for them (say the arms of
``ab_pairs_gpu.sh``, unpacked from its ``arms.tgz``; an arm is named by its folder). Per process
and configuration, ``ideal``'s step and its training thread's CPU time per step are the means
over its epochs of each epoch's median. Each epoch of every other method is then put in one of
two groups: its training thread's median CPU time per step at most ``--margin-ms`` above
ideal's ("as fast": the loop's own code ran at ideal's speed), or more ("slower"). Per group and
method (and build, for ab_pairs_gpu.sh's arms): how many epochs, the share of the preloaded loop (ideal's step over the epoch's median
step, median over the epochs and their range), and the median extra CPU and extra step time per
step.

The step's time is its CPU time plus its time off the CPU (the backward it waits for, the GIL).
Where the extra step time of the slower epochs is about their extra CPU time, the loss is the
training thread running its code slower (other threads on its core or on its core's sibling,
caches, the host's clock), not a wait; and the epochs that ran as fast tell what the method costs
the loop when the host leaves the thread alone. The split selects epochs by what they measure:
it is a diagnostic of where the time goes, not a figure of the method's share, which is the
whole run's (``fraction_of_ideal``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from typing import Any, Iterator


def results(paths: list[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(name, bench_train results) of every bench_train.json under the paths, in name order."""
    found: list[tuple[str, str]] = []
    for p in paths:
        if os.path.isfile(p):
            found.append((p, p))
            continue
        for root, _dirs, files in os.walk(p):
            if "bench_train.json" in files:
                found.append((os.path.relpath(root, p) if root != p else os.path.basename(os.path.abspath(p)),
                              os.path.join(root, "bench_train.json")))
    if not found:
        raise SystemExit(f"epoch_cpu: no bench_train.json in {' '.join(paths)}")
    for name, path in sorted(found):
        with open(path) as f:
            yield name, json.load(f)["results"]


def _median(v: Any) -> float:
    return float(statistics.median(v)) if isinstance(v, list) else float(v)


def split(methods: dict[str, dict[str, Any]], margin_ms: float) -> dict[str, list[tuple[str, float, float, float]]]:
    """Per method other than ideal, its epochs in order, each as (group: "as fast" or "slower",
    % of the preloaded loop, extra training CPU ms per step, extra step ms) against ideal's means."""
    ideal = methods.get("ideal")
    if ideal is None or not ideal.get("epochs"):
        return {}
    if any("step_cpu_ms" not in e for e in ideal["epochs"]):
        return {}
    i_step = statistics.fmean(_median(e["step_ms"]) for e in ideal["epochs"])
    i_cpu = statistics.fmean(_median(e["step_cpu_ms"]) for e in ideal["epochs"])
    out: dict[str, list[tuple[str, float, float, float]]] = {}
    for name, r in methods.items():
        if name == "ideal":
            continue
        eps = []
        for e in r.get("epochs", []):
            if "step_cpu_ms" not in e or not e["step_ms"]:
                continue
            step, cpu = _median(e["step_ms"]), _median(e["step_cpu_ms"])
            eps.append(("as fast" if cpu - i_cpu <= margin_ms else "slower", 100.0 * i_step / step,
                        cpu - i_cpu, step - i_step))
        out[name] = eps
    return out


def arm(name: str) -> str:
    """The build a process ran: ab_pairs_gpu.sh's arm (new, old, prev) from a folder such as
    ``new3/train``; "-" for anything else."""
    head = re.sub(r"\d+$", "", name.split(os.sep)[0])
    return head if head in ("new", "old", "prev") else "-"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="bench_train.json files, or folders holding them")
    p.add_argument("--config", default=None, help="one configuration (default: each in the results)")
    p.add_argument("--margin-ms", type=float, default=0.2,
                   help="extra training CPU per step still counted as ideal's speed (default 0.2 ms)")
    args = p.parse_args(argv)
    pooled: dict[tuple[str, str, str, str], list[tuple[float, float, float]]] = {}
    print(f"{'process':<24} {'config':<8} {'method':<28} {'epoch: % of preloaded, extra CPU ms/step'}")
    for name, res in results(args.results):
        for cfg, methods in res.items():
            if args.config and cfg != args.config:
                continue
            for method, eps in split(methods, args.margin_ms).items():
                for g in ("as fast", "slower"):
                    pooled.setdefault((cfg, method, arm(name), g), []).extend(
                        (pct, cpu, step) for g_, pct, cpu, step in eps if g_ == g)
                cells = [f"{pct:.1f}% {cpu:+.2f}" + ("" if g == "as fast" else "*") for g, pct, cpu, _ in eps]
                print(f"{name:<24} {cfg:<8} {method:<28} {'  '.join(cells)}")
    if not pooled:
        print("epoch_cpu: no configuration with ideal and the training thread's CPU time per epoch", file=sys.stderr)
        return 1
    print("(*: slower, the training thread's CPU per step more than "
          f"{args.margin_ms:g} ms above ideal's)\n")
    print(f"{'config':<8} {'method':<28} {'build':<5} {'group':<8} {'epochs':>6} {'% of preloaded, median (range)':>32} "
          f"{'extra CPU ms':>12} {'extra step ms':>13}")
    for (cfg, method, build, g), eps in sorted(pooled.items()):
        if not eps:
            print(f"{cfg:<8} {method:<28} {build:<5} {g:<8} {0:>6}")
            continue
        pct = [x[0] for x in eps]
        rng = f"{statistics.median(pct):.1f} ({min(pct):.1f}-{max(pct):.1f})"
        print(f"{cfg:<8} {method:<28} {build:<5} {g:<8} {len(eps):>6} {rng:>32} "
              f"{statistics.median(x[1] for x in eps):>+12.2f} {statistics.median(x[2] for x in eps):>+13.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
