"""The pairs of tools/diagnostics/ab_pairs_gpu.sh side by side: one row per figure and build (new,
old, and prev where the pairs had a third arm), each pair's value and their median; then new less
old within each pair, the median of those differences and in how many pairs new came out higher
(a pair's processes ran one after the other, so its difference drifts less with the machine).

Usage: ``python3 tools/diagnostics/ab_table.py OUTDIR/ab.log [more ab.log ...] [--markdown]``.
Several logs (calls that shared one rotation) are read as one; a line in two of them counts once.
"""
from __future__ import annotations

import argparse
import re
import statistics
from collections import defaultdict
from typing import Optional

NUM = r"(-?[\d.]+|nan)"
# (figure, regular expression over one line of ab.log, group of the value)
PATTERNS: list[tuple[str, str]] = [
    ("{c} % of preloaded", rf"train (?P<c>\S+): {NUM}%"),
    ("{c} steady %", rf"train (?P<c>\S+): .* steady={NUM}%"),
    ("{c} preloaded step ms", rf"train (?P<c>\S+): .* ideal_step_ms={NUM}"),
    ("{c} __next__ steady ms", rf"train (?P<c>\S+): .* next_steady_ms={NUM}"),
    ("{c} service CPU ms/batch", rf"train (?P<c>\S+): .* service_cpu_ms={NUM}"),
    ("{c} training thread's blocks/step", rf"train (?P<c>\S+): .* training_switches={NUM}/"),
    ("{c} training thread's CPU ms/step", rf"train (?P<c>\S+): .* cpu_ms={NUM}/"),
    ("{c} training thread's CPU ms/step, preloaded", rf"train (?P<c>\S+): .* cpu_ms=\S+?/{NUM}"),
    ("{c} packed step p99 ms", rf"tails (?P<c>\S+) packed step_ms: .* p99 {NUM}"),
    ("{c} packed step max ms", rf"tails (?P<c>\S+) packed step_ms: .* max {NUM}"),
    ("harness seed16 start_copy ms", rf"harness seed16 mtc: {NUM} ms"),
    ("harness seed16 x .to()", rf"harness seed16 mtc: \S+ ms {NUM}x"),
    ("H2D latency mean ms", rf"latency seed16_H2D_mtc: mean {NUM}"),
    ("H2D latency p50 ms", rf"latency seed16_H2D_mtc: .* p50 {NUM}"),
    ("H2D latency p99 ms", rf"latency seed16_H2D_mtc: .* p99 {NUM}"),
    ("H2D latency max ms", rf"latency seed16_H2D_mtc: .* max {NUM}"),
    ("H2D latency: slowest CPU loop / median", rf"latency seed16_H2D_mtc: .* machine {NUM}x"),
    ("seed16 start_copy + get us/call (stages)", rf"stages seed16 +gc on +{NUM} us/call"),
    ("seed16 outputs us/call", rf"stages seed16 .* outputs={NUM}"),
    ("seed16 views us/call", rf"stages seed16 .* views={NUM}"),
    ("seed16 get wait us/call", rf"stages seed16 .* get_wait={NUM}"),
    ("seed16 staging us/call", rf"stages seed16 .* stage={NUM}"),
    ("seed16 DMA issue us/call", rf"stages seed16 .* dma_issue={NUM}"),
    ("seed16 DMA calls/call", rf"stages seed16 .* DMA calls {NUM}"),
]
ARMS = ("new", "old", "prev")  # this build, the one a target names, the build before this change
LINE = re.compile(r"pair (\d+) (new|old|prev) (.*)")


def read(paths: list[str]) -> dict[tuple[str, str], dict[int, float]]:
    """{(figure, arm): {pair: value}} over the logs' lines."""
    seen: set[str] = set()
    rows: dict[tuple[str, str], dict[int, float]] = defaultdict(dict)
    for path in paths:
        with open(path) as f:
            for line in f:
                line = line.rstrip("\n")
                if line in seen:
                    continue
                seen.add(line)
                m = LINE.match(line)
                if not m:
                    continue
                pair, arm, rest = int(m.group(1)), m.group(2), m.group(3)
                for name, pattern in PATTERNS:
                    f_ = re.match(pattern, rest)
                    if f_:
                        figure = name.format(c=f_.groupdict().get("c", ""))
                        rows[(figure, arm)][pair] = float(f_.groups()[-1])
    return rows


def fmt(v: Optional[float]) -> str:
    if v is None:
        return "-"
    return f"{v:.3f}" if abs(v) < 1 else f"{v:.2f}" if abs(v) < 20 else f"{v:.1f}"


def paired(new: dict[int, float], old: dict[int, float]) -> Optional[tuple[float, int, int]]:
    """(median of new - old over the pairs that have both, pairs where new is higher, pairs
    compared), or None where no pair has both."""
    diffs = [new[p] - old[p] for p in sorted(set(new) & set(old))]
    if not diffs:
        return None
    return statistics.median(diffs), sum(d > 0 for d in diffs), len(diffs)


def fmt_paired(d: Optional[tuple[float, int, int]]) -> str:
    if d is None:
        return "-"
    med, higher, n = d
    return f"{'+' if med >= 0 else ''}{fmt(med)} ({higher}/{n} higher)"


def table(rows: dict[tuple[str, str], dict[int, float]], markdown: bool) -> str:
    pairs = sorted({p for v in rows.values() for p in v})
    figures = list(dict.fromkeys(f for f, _ in rows))
    arms = [a for a in ARMS if any(arm == a for _, arm in rows)] or ["new", "old"]
    titles = {"new": "this build", "old": "the other", "prev": "the build before"}
    out = []
    if markdown:
        out.append("| figure | " + " | ".join(f"{titles[a]}, pairs " + " ".join(map(str, pairs)) + " (median)"
                                            for a in arms) + " | this build less the other, paired: median |")
        out.append("|---" * (len(arms) + 2) + "|")
    for figure in figures:
        cells = []
        for arm in arms:
            v = rows.get((figure, arm), {})
            vals = [v[p] for p in pairs if p in v]
            med = statistics.median(vals) if vals else None
            cells.append(" ".join(fmt(v.get(p)) for p in pairs) + f" ({fmt(med)})")
        diff = fmt_paired(paired(rows.get((figure, "new"), {}), rows.get((figure, "old"), {})))
        if markdown:
            out.append(f"| {figure} | " + " | ".join(cells) + f" | {diff} |")
        else:
            lines = [f"{figure if k == 0 else '':44s} {a:4s} {c}" for k, (a, c) in enumerate(zip(arms, cells))]
            out.append("\n".join(lines + [f"{'':44s} new-old paired {diff}"]))
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+", help="ab.log files of ab_pairs_gpu.sh")
    ap.add_argument("--markdown", action="store_true", help="a Markdown table")
    args = ap.parse_args()
    print(table(read(args.logs), args.markdown))


if __name__ == "__main__":
    main()
