"""Summarise the NVTX ranges mtc_loader pushed, from a log written by tests/nvtx_tool.c with
MTC_NVTX_TIMES set (lines "<ns> <pid> <tid> push <domain> <name>" / "<ns> <pid> <tid> pop - -").

    python3 tools/diagnostics/nvtx_summary.py LOG [--main PID]

Prints, per range name: the count, the total and mean time, and where it ran (the main process's
threads, or worker processes). The main process is the first process that initialised the tool
(forked DataLoader workers inherit the tool and do not initialise it again). Times include the
tool's own cost (an fopen/fprintf/fclose per event, a few microseconds each): read the short
ranges as upper bounds. Exit code 1 when the log holds no range or an unbalanced push/pop.
"""
from __future__ import annotations

import argparse
import collections
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log")
    ap.add_argument("--main", type=int, default=None, help="pid of the main process (default: the first init)")
    args = ap.parse_args()
    events = []
    with open(args.log) as f:
        for line in f:
            parts = line.rstrip("\n").split(" ", 5)
            if len(parts) < 4:
                continue
            ns, pid, tid, what = int(parts[0]), int(parts[1]), int(parts[2]), parts[3]
            events.append((ns, pid, tid, what, parts[5] if len(parts) > 5 else "-"))
    main_pid = args.main
    if main_pid is None:
        main_pid = next((e[1] for e in events if e[3] == "init"), None)
    stacks: dict = collections.defaultdict(list)
    agg: dict = collections.defaultdict(lambda: [0, 0, set(), set()])  # count, ns, main tids, worker pids
    bad = 0
    for ns, pid, tid, what, name in sorted(events, key=lambda e: e[0]):
        if what == "push":
            stacks[(pid, tid)].append((name, ns))
        elif what == "pop":
            if not stacks[(pid, tid)]:
                bad += 1
                continue
            name, t0 = stacks[(pid, tid)].pop()
            a = agg[name]
            a[0] += 1
            a[1] += ns - t0
            (a[2].add(tid) if pid == main_pid else a[3].add(pid))
    open_ranges = sum(len(s) for s in stacks.values())
    print(f"NVTX ranges of the mtc_loader domain ({len(events)} events, main process {main_pid}):")
    print(f"{'range':34s} {'count':>6s} {'total ms':>9s} {'mean us':>8s}  where")
    for name, (n, ns, tids, pids) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        where = []
        if tids:
            where.append(f"main process, {len(tids)} thread{'s' * (len(tids) > 1)}")
        if pids:
            where.append(f"{len(pids)} worker process{'es' * (len(pids) > 1)}")
        print(f"{name:34s} {n:6d} {ns / 1e6:9.2f} {ns / n / 1e3:8.1f}  {'; '.join(where)}")
    if bad or open_ranges:
        print(f"unbalanced: {bad} pops without a push, {open_ranges} pushes without a pop")
    return 0 if agg and not bad else 1


if __name__ == "__main__":
    sys.exit(main())
