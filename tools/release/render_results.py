"""Render the tables of docs/benchmarks.md from the benchmark JSON in bench/results/release/.

Usage::

    python3 tools/release/render_results.py [--results bench/results/release] [--page docs/benchmarks.md]
    python3 tools/release/render_results.py --check   # exit 1 when the page differs from a fresh render

``tools/release/run_benchmarks.sh`` (on a GPU machine) writes one folder per benchmark
process under ``bench/results/release``: ``copy/N/bench_copy.json``, ``loader/N/bench_loader.json``,
``train/N/bench_train.json`` and ``files/N/bench_files.json`` (tracked by git, so the page's
figures stay next to the page), then runs
this script: it replaces what stands between the page's markers ``<!-- BEGIN render:NAME -->``
and ``<!-- END render:NAME -->`` with the table rendered from every JSON of that benchmark (the
median over processes, and their spread), its machine, date and command, and draws each
section's plot next to the page (``docs/bench_NAME.png``, with matplotlib) from the same
numbers as its table: the plots show what the tables say, nothing else (no targets).
The page's runs must come from one commit: a results folder that mixes commits is refused.
A benchmark without JSON renders as a marked placeholder.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import sys
from typing import Any, Callable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "bench", "results", "release")
PAGE = os.path.join(ROOT, "docs", "benchmarks.md")

COPY_LABELS = {
    "to": "`.to()`",
    "to_nb": "`.to(non_blocking)` + sync",
    "pin_to_nb": "`pin_memory().to(nb)`",
    "pytree_nb": "pytree `.to(nb)`",
    "mtc": "**start_copy**",
    "mtc_no_pack": "no packing",
    "mtc_no_pinned": "no pinned staging",
    "mtc_no_thread": "no background thread",
}
VARIANT_LABELS = {COPY_LABELS[m] for m in ("mtc_no_pack", "mtc_no_pinned", "mtc_no_thread")}
LOADER_LABELS = {
    "plain_to": "DataLoader(list) + `.to()`",
    "plain_pin_nb": "DataLoader(list, pin_memory) + `.to(nb)`",
    "plain_start_copy": "DataLoader(list) + `start_copy`",
    "packed_prefetch": "**PackedCollate(list) + PrefetchLoader**",
}
TRAIN_LABELS = {
    "ideal": "preloaded on the GPU (the ideal)",
    "plain": "DataLoader(pin_memory) + `.to(nb)`",
    "sidestream": "side-stream prefetcher (apex/timm)",
    "start_copy": "DataLoader + `start_copy().get()`",
    "prefetch_plain": "PrefetchLoader(DataLoader)",
    "packed": "**PackedCollate + PrefetchLoader**",
    "packed_gil5ms": "same, GIL switch interval left at 5 ms",
    "packed_align1": "same, `min_packed_alignment_bytes=1`",
}
FILES_LABELS = {
    "numpy_plain": "np.load in the dataset, DataLoader + `.to()`",
    "numpy_packed": "np.load in the dataset, PackedCollate + PrefetchLoader",
    "files_packed": "**FileTensor, PackedCollate + PrefetchLoader**",
    "files_packed_direct": "FileTensor, 4 KiB alignment (O_DIRECT for cold data)",
    "files_packed_async": "FileTensor, `MTC_URING_ASYNC=1`",
    "files_packed_pread": "FileTensor, `MTC_FILE_READER=pread`",
}
TRAIN_CONFIGS = {"launch": "launch-bound loop", "gpu": "GPU-bound loop"}


# ------------------------------------------------------------------------------------ helpers

def load(results: str, name: str) -> list[dict[str, Any]]:
    """Every bench_NAME.json under results (one per process), in folder order; the models' section
    reads bench_openmmlab_train_*.json, those with the paired figures."""
    pattern = "openmmlab_train_*" if name == "models" else name
    out = []
    for p in sorted(glob.glob(os.path.join(results, "**", f"bench_{pattern}.json"), recursive=True)):
        with open(p) as f:
            d = json.load(f)
        if name != "models" or ("paired" in d and "medians" in d):
            out.append(d)
    return out


def spread(values: list[float], fmt: Callable[[float], str]) -> str:
    """median [min-max] of values (one per process or round); the median alone for one value."""
    values = [v for v in values if v is not None]
    if not values:
        return "—"
    med = fmt(statistics.median(values))
    if len(values) == 1:
        return med
    return f"{med} ({fmt(min(values))}–{fmt(max(values))})"


def ms(v: float) -> str:
    return f"{v:.3f}" if v < 1 else f"{v:.2f}" if v < 10 else f"{v:.1f}"


def ratio(v: float) -> str:
    return f"{v:.1f}x" if v >= 10 else f"{v:.2f}x"


def pct(v: float) -> str:
    return f"{v * 100:.1f}%"


gbps = "{:.2f}".format


def _command(cmd: str) -> str:
    """The command as a user would type it: without the output and data folders."""
    return re.sub(r"\s--(out|dir)\s+\S+", "", cmd)


def provenance_line(runs: list[dict[str, Any]], what: str) -> str:
    """Date and command of a table's runs (the machine is named once, at the page's top, by
    machine_line; the commit stays in the JSON)."""
    provs = [r.get("provenance") or {} for r in runs]
    commands = sorted({_command(p.get("command", "?")) for p in provs})
    times = sorted(p.get("time", "") for p in provs if p.get("time"))
    n = len(runs)
    procs = f"{n} processes" if n > 1 else "one process"
    when = f"{times[0][:10]}; " if times else ""
    return (f"{when}{procs} of " + ", ".join(f"`{c}`" for c in commands) + f". {what}")


def machine_line(runs: list[dict[str, Any]]) -> list[str]:
    """The machine (or machines) of the release run's tables, named once at the page's top."""
    machines = sorted({(r.get("provenance") or {}).get("machine", "unknown machine") for r in runs})
    return [f"**The machine:** {'; '.join(machines)}." if machines else "**The machine:** no release run yet."]


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table; a first cell equal to the row above's is left blank (a group's rows)."""
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    prev = None
    for r in rows:
        first = "" if r[0] == prev else r[0]
        prev = r[0]
        out.append("| " + " | ".join([first, *r[1:]]) + " |")
    return out


def placeholder(name: str) -> list[str]:
    if name == "models":
        return ["!!! warning \"Not measured at this release yet\"",
                "    No `bench_openmmlab_train_*.json` in `bench/results/release/`: run",
                "    `tools/release/run_benchmarks.sh --models` on a GPU machine with OpenMMLab's stack."]
    return [f"!!! warning \"Not measured at this release yet\"",
            f"    No `bench_{name}.json` in `bench/results/release/`: run",
            "    `tools/release/run_benchmarks.sh` on a GPU machine (it renders this page when it is done)."]


DRAW = [True]  # plots are drawn (not under --check, which only checks the page's text)


def plot(name: str, docs: str, alt: str, draw: Callable[[Any], Any]) -> list[str]:
    """The markdown that shows docs/bench_NAME.png, drawn by draw(plt) (which returns the
    figure) from the numbers of the section's table. Under --check, or without matplotlib, an
    existing PNG is kept as it is."""
    path = os.path.join(docs, f"bench_{name}.png")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        plt = None
    if DRAW[0] and plt is not None:
        fig = draw(plt)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
    if not os.path.exists(path):
        return []
    return [f"![{alt}](bench_{name}.png)", ""]


def _barh(plt: Any, groups: list[tuple[str, list[tuple[str, float]]]], xlabel: str, title: str,
          log: bool = False, fmt: Callable[[float], str] = str, ref: Optional[float] = None) -> Any:
    """Horizontal bars, one block per group (a workload, a loop), one bar per method, each
    labelled with its value; ref draws a vertical line (the baseline, 1x or 100%)."""
    values, colors, ticks = [], [], []
    methods = list(dict.fromkeys(m for _, bars in groups for m, _ in bars))
    y = 0.0
    for g, bars in groups:
        start = y
        for m, v in bars:
            values.append((y, v))
            colors.append(f"C{methods.index(m) % 10}")
            y += 1
        ticks.append(((start + y - 1) / 2, g))
        y += 0.8
    height = max(3.0, 0.22 * y + 2.2)
    fig, ax = plt.subplots(figsize=(9, height))
    for (pos, v), c in zip(values, colors):
        ax.barh(pos, v, color=c, height=0.8)
        ax.text(v, pos, " " + fmt(v), va="center", fontsize=7)
    if log:
        ax.set_xscale("log")
    if ref is not None:
        ax.axvline(ref, color="0.3", linewidth=1, linestyle=":")
    ax.set_yticks([t for t, _ in ticks], [g for _, g in ticks], fontsize=8)
    ax.invert_yaxis()
    lo, hi = ax.get_xlim()
    ax.set_xlim(lo, hi * (3 if log else 1.15))
    ax.set_xlabel(xlabel, fontsize=9)
    ax.set_title(title, fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=f"C{i % 10}") for i in range(len(methods))]
    # below the axes and their x label, so that it covers no bar and no text: a fixed distance in
    # points under the axes (tick labels, label pad, the label), whatever the figure's height
    from matplotlib.transforms import offset_copy
    below_label = offset_copy(ax.transAxes, fig=fig, x=0, y=-(8 + 3.5 + 4 + 9 + 10), units="points")
    ax.legend(handles, [m.replace("*", "").replace("`", "") for m in methods], fontsize=7, loc="upper center",
              bbox_to_anchor=(0.5, 0.0), bbox_transform=below_label, ncol=3, frameon=False)
    return fig


# ----------------------------------------------------------------------------------- sections

def render_copy(runs: list[dict[str, Any]], docs: str) -> list[str]:
    names = list(dict.fromkeys(w for r in runs for w in r["workloads"]))
    methods = list(dict.fromkeys(m for r in runs for res in r["workloads"].values() for m in res["methods"]))
    header = ["workload", "tensors, bytes", "`.to()` ms"] + [COPY_LABELS.get(m, m) for m in methods if m != "to"]
    rows: list[list[str]] = []
    groups: list[tuple[str, list[tuple[str, float]]]] = []
    for w in names:
        res = [r["workloads"][w] for r in runs if w in r["workloads"]]
        first = res[0]
        kb = first["bytes"] / 1e3
        size = f"{first['tensors']}, {kb / 1e3:.0f} MB" if kb >= 1000 else f"{first['tensors']}, {kb:.0f} KB"
        row = [f"{w} ({first['direction']})", size,
               spread([x["methods"]["to"]["median_ms"] for x in res if "to" in x["methods"]], ms)]
        for m in methods:
            if m == "to":
                continue
            vals = [x["methods"][m].get("ratio_vs_to") for x in res if m in x["methods"]]
            row.append(spread(vals, ratio) if vals else "—")
            vals = [v for v in vals if v is not None]
            if vals:
                if not groups or groups[-1][0] != row[0]:
                    groups.append((row[0], []))
                groups[-1][1].append((COPY_LABELS.get(m, m), statistics.median(vals)))
        rows.append(row)
    out = plot("copy", docs, "start_copy against .to() per workload", lambda plt: _barh(
        plt, groups, "times faster than .to() (median over processes; log scale; 1 = .to())",
        "start_copy and the other methods against .to(), per workload", log=True, fmt=ratio, ref=1.0))
    # two tables, each narrow enough for a page: the other ways against start_copy's defaults, then
    # start_copy with one optimization off at a time
    first = [i for i, h in enumerate(header) if h not in VARIANT_LABELS]
    second = [0] + [i for i, h in enumerate(header) if h == COPY_LABELS["mtc"] or h in VARIANT_LABELS]
    out += table([header[i] for i in first], [[r[i] for i in first] for r in rows])
    if len(second) > 2:
        out += ["", "The same runs, `start_copy` with one optimization switched off at a time:", ""]
        out += table([header[i] for i in second], [[r[i] for i in second] for r in rows])
    bw = [r["workloads"][w]["bandwidth"] for r in runs for w in r["workloads"] if "bandwidth" in r["workloads"][w]]
    big = [(w, r["workloads"][w]) for r in runs for w in r["workloads"] if r["workloads"][w].get("bandwidth")]
    if big:
        w = big[0][0]
        mtc = [x["methods"]["mtc"]["gbps"] for _, x in big if "mtc" in x["methods"] and x["methods"]["mtc"].get("gbps")]
        pinned = [b.get("h2d_pinned_nb_gbps") for b in bw if isinstance(b, dict)]
        out += ["", f"{w}: start_copy moves {spread(mtc, gbps)} GB/s; one pinned 256 MB `.to(non_blocking=True)` "
                f"in the same process: {spread(pinned, gbps)} GB/s."]
    out += ["", provenance_line(runs, "Cells: the ratio `median(.to()) / median(method)` within a process "
            "(above 1: faster than `.to()`), the median over processes, and in parentheses the lowest "
            "and highest process.")]
    return out


def render_loader(runs: list[dict[str, Any]], docs: str) -> list[str]:
    rows = []
    groups: list[tuple[str, list[tuple[str, float]]]] = []
    workers = sorted({int(w) for r in runs for w in r["results"]})
    for w in workers:
        res = [r["results"][str(w)] for r in runs if str(w) in r["results"]]
        methods = [m for m in LOADER_LABELS if any(m in x for x in res)]
        methods += [m for x in res for m in x if m not in methods]
        for m in methods:
            xs = [x[m] for x in res if m in x]
            rows.append([str(w), LOADER_LABELS.get(m, m),
                         spread([v for x in xs for v in x["wall_ms"]], ms),
                         spread([v for x in xs for v in x["main_steady_ms_rounds"]], ms),
                         spread([v for x in xs for v in x["main_cpu_steady_ms_rounds"]], ms),
                         spread([v for x in xs for v in x["main_ms_rounds"]], ms),
                         spread([x.get("ratio_wall_vs_plain_to") for x in xs], ratio)])
            if not groups or groups[-1][0] != f"{w} workers":
                groups.append((f"{w} workers", []))
            groups[-1][1].append((LOADER_LABELS.get(m, m),
                                  statistics.median(v for x in xs for v in x["main_steady_ms_rounds"])))
    header = ["workers", "method", "wall ms/batch", "**training thread ms/batch** (steady)",
              "its CPU ms (steady)", "training thread ms/batch (whole epoch)", "wall vs `.to()`"]
    cfg = runs[0]["config"]
    step = f", a {cfg['step_ms']:g} ms GPU step per batch" if cfg.get("step_ms") else ""
    out = plot("loader", docs, "the DataLoader path: training thread ms per batch", lambda plt: _barh(
        plt, groups, "training thread ms per batch, steady (median over epochs; log scale)",
        "What each DataLoader path costs the training thread", log=True, fmt=ms))
    out += table(header, rows)
    out += ["", provenance_line(runs, f"Batches of {cfg['batch_size']} seed samples "
            f"({runs[0]['tensors_per_batch']} tensors){step}. The training thread's time is its time in "
            "`__next__` plus the copy call per batch; \"steady\" leaves out each epoch's first batch. "
            "Cells: the median over epochs (all processes), in parentheses the lowest and highest epoch.")]
    return out


def render_train(runs: list[dict[str, Any]], docs: str) -> list[str]:
    rows = []
    groups: list[tuple[str, list[tuple[str, float]]]] = []
    for cfg, label in TRAIN_CONFIGS.items():
        res = [r["results"][cfg] for r in runs if cfg in r.get("results", {})]
        if not res:
            continue
        ideal = [x["ideal"] for x in res if "ideal" in x]
        step = statistics.median(i["step_ms"] for i in ideal) if ideal else None
        shape = runs[0].get("shapes", {}).get(cfg, {})
        title = f"{label} ({shape.get('height')}x{shape.get('width')}, {step:.1f} ms step)" if step else label
        methods = [m for m in TRAIN_LABELS if any(m in x for x in res)]
        for m in methods:
            xs = [x[m] for x in res if m in x]
            sps = spread([e["samples_per_s"] for x in xs for e in x["epochs"]], lambda v: f"{v:.1f}")
            if m == "ideal":
                rows.append([title, TRAIN_LABELS[m], sps, "100%", "100%", spread([x["next_ms"] for x in xs], ms)])
                continue
            fracs = [f for x in xs for f in x.get("round_fractions", [])]
            if fracs:
                if not groups or groups[-1][0] != label:
                    groups.append((label, []))
                groups[-1][1].append((TRAIN_LABELS.get(m, m), 100 * statistics.median(fracs)))
            rows.append([title, TRAIN_LABELS.get(m, m), sps,
                         spread(fracs, pct),
                         spread([x["steady_fraction_of_ideal"] for x in xs], pct),
                         spread([x["next_steady_ms"] for x in xs], ms)])
    header = ["loop", "method", "samples/s", "**of the ideal** (whole epoch)", "of the ideal (steady)",
              "`__next__` ms (steady)"]
    cfg = runs[0]["config"]
    out = plot("train", docs, "training loop: fraction of preloaded data", lambda plt: _barh(
        plt, groups, "% of the samples/s with data preloaded on the GPU (whole epoch, median)",
        "Training throughput as a share of preloaded data", fmt=lambda v: f"{v:.1f}%", ref=100.0))
    out += table(header, rows)
    out += ["", provenance_line(runs, f"A conv model over 6 camera images per sample plus the seed "
            f"meta-data, batch {cfg['batch_size']}, {cfg['workers']} workers, {cfg['batches']} batches per "
            "epoch. \"Of the ideal\": samples/s over the same loop fed one batch preloaded on the GPU, "
            "epoch by epoch within a round; \"steady\" counts from the first batch in hand. Cells: the "
            "median over epochs (all processes), in parentheses the lowest and highest.")]
    return out


def file_limits(r: dict[str, Any]) -> tuple[list[float], list[float], bool]:
    """(warm, cold) limits of one files run in GB/s, and whether they are the limits (a parallel
    memcpy, O_DIRECT at the best queue depth) rather than an older run's single-thread raw reads."""
    if "limits_gbps" in r:
        return r["limits_gbps"]["memcpy_warm"], r["limits_gbps"]["direct_cold_best"], True
    return r["raw_read_gbps"]["buffered_warm"], r["raw_read_gbps"]["direct_cold"], False


def plot_files(plt: Any, runs: list[dict[str, Any]], methods: list[str]) -> Any:
    """A bar chart of GB/s per method (the table's), warm and cold page cache, with the limits of
    the same run as dashed lines."""
    b = runs[0]["bytes_per_batch"]
    limits = [file_limits(r) for r in runs]
    labels = (("parallel memcpy from the page cache", "O_DIRECT, best queue depth") if limits[0][2]
              else ("raw read (buffered, warm)", "raw read (O_DIRECT, cold)"))
    fig, ax = plt.subplots(figsize=(9, 4.2))
    for k, state in enumerate(("warm", "cold")):
        vals = [b / statistics.median([t for r in runs for t in r["epoch_s_per_batch"][m][state]]) / 1e9
                for m in methods]
        ax.bar([i + k * 0.4 for i in range(len(methods))], vals, width=0.4, label=f"{state} page cache")
        ax.axhline(statistics.median(v for lim in limits for v in lim[k]), linestyle="--", color=f"C{k}",
                   linewidth=1, label=labels[k])
    names = [FILES_LABELS.get(m, m).replace("*", "").replace("`", "").replace(", ", ",\n", 1) for m in methods]
    ax.set_xticks([i + 0.2 for i in range(len(methods))], names, fontsize=7)
    ax.set_ylabel("GB/s of files per batch")
    ax.set_title(f"File-backed samples: batch of {b / 1e6:.0f} MB, {runs[0]['config']['workers']} workers",
                 fontsize=10)
    ax.legend(fontsize=8)
    return fig


def render_files(runs: list[dict[str, Any]], docs: str) -> list[str]:
    rows = []
    methods = [m for m in FILES_LABELS if any(m in r["median_ms"] for r in runs)]
    for m in methods:
        warm = [t * 1e3 for r in runs if m in r["epoch_s_per_batch"] for t in r["epoch_s_per_batch"][m]["warm"]]
        cold = [t * 1e3 for r in runs if m in r["epoch_s_per_batch"] for t in r["epoch_s_per_batch"][m]["cold"]]
        b = runs[0]["bytes_per_batch"]
        rows.append([FILES_LABELS.get(m, m), spread(warm, ms), gbps(b / statistics.median(warm) / 1e6),
                     spread(cold, ms), gbps(b / statistics.median(cold) / 1e6)])
    limits = [file_limits(r) for r in runs]
    raw_warm, raw_cold, limit = [v for lim in limits for v in lim[0]], [v for lim in limits for v in lim[1]], limits[0][2]
    cfg = runs[0]["config"]
    reader = runs[0].get("reader", {}).get("mode", "?")
    header = ["method", "warm cache ms/batch", "warm GB/s", "cold cache ms/batch", "cold GB/s"]
    out = plot("files", docs, "file-backed samples: GB/s per method", lambda plt: plot_files(plt, runs, methods))
    out += table(header, rows)
    out += ["", (f"Limits of the same files, same run: `O_DIRECT` from a cold cache at the best queue depth "
                 f"{spread(raw_cold, gbps)} GB/s, a parallel memcpy out of the page cache "
                 f"{spread(raw_warm, gbps)} GB/s."
                 if limit else
                 f"Raw read of the same files, same run: `O_DIRECT` from a cold cache {spread(raw_cold, gbps)} "
                 f"GB/s (one thread), buffered from a warm cache {spread(raw_warm, gbps)} GB/s."), "",
            provenance_line(runs, f"Batch {cfg['batch_size']} ({runs[0]['bytes_per_batch'] / 1e6:.1f} MB of "
                            f"files), {cfg['workers']} workers, FileTensor reads via {reader}. Cells: the median "
                            "epoch's ms per batch, in parentheses the lowest and highest epoch.")]
    return out


MODEL_LABELS = {"yolov3": "YOLOv3, mmdet", "centerpoint": "CenterPoint pillars, mmdet3d",
                "mvfcos3d": "multi-view FCOS3D++, mmdet3d"}


def render_models(runs: list[dict[str, Any]], docs: str) -> list[str]:
    """The real models trained through mmengine's Runner, plain and switched, in pairs
    (bench/bench_openmmlab_train.py, one JSON per model): the pairs' ratio and where the step goes."""
    del docs
    ratios, parts = [], []
    for r in sorted(runs, key=lambda r: list(MODEL_LABELS).index(r["model"]) if r["model"] in MODEL_LABELS else 99):
        s, law, m = r["paired"], r.get("law") or {}, r["medians"]
        name = MODEL_LABELS.get(r["model"], r["model"])
        ratio = f"**{s['median']:.3f}x** ({s['min']:.3f}–{s['max']:.3f})"
        sign = f"{s['above_one']} of {s['pairs']}, p={s['sign_p']:.3f}"
        predicted = f"{law['predicted_ratio']:.3f}x" if law.get("predicted_ratio") is not None else "—"
        ratios.append([f"{name} ({r['batch_size']}, {r['workers']}; {r['iters']})", ratio, sign, predicted])
        p, w = m.get("plain", {}), m.get("switched", {})

        def pair(key: str) -> str:
            return f"{p[key]:.1f} -> {w[key]:.1f} ms" if key in p and key in w else "—"
        parts.append([name, pair("step_ms"), pair("data_time_ms"), pair("cpu_pre_ms"), pair("gpu_model_ms")])
    out = table(["model (batch, workers; timed iterations per arm)", "switched / plain it/s: median of the pairs "
                 "(min–max)", "above 1, sign test", "law's prediction"], ratios)
    out += ["", "Where the step goes, per model (medians over the arms of each kind):", ""]
    out += table(["model", "step, plain -> switched", "`data_time`", "preprocessor on the training thread",
                  "model on the GPU"], parts)
    versions = runs[0].get("versions", {})
    stack = ", ".join(f"{k} {versions[k]}" for k in ("mmengine", "mmcv", "mmdet", "mmdet3d") if k in versions)
    out += ["", provenance_line(runs, f"{stack}. Each model's own config and batch, "
                                f"{runs[0]['pairs']} pairs of arms; the ratio of a pair is its switched arm's mean "
                                "it/s over its plain arm's. The law: step / (step - saved), saved = the fall in "
                                "`data_time` plus the fall in the preprocessor's time on the training thread.")]
    return out


SECTIONS: dict[str, Callable[[list[dict[str, Any]], str], list[str]]] = {
    "copy": render_copy, "loader": render_loader, "train": render_train, "files": render_files,
    "models": render_models,
}


def render(page: str, results: str) -> str:
    docs = os.path.dirname(os.path.abspath(page))
    with open(page) as f:
        text = f.read()
    runs = {name: load(results, name) for name in SECTIONS}
    commits = {(r.get("provenance") or {}).get("commit", "unknown") for rs in runs.values() for r in rs}
    if len(commits) > 1:
        raise SystemExit(f"{results}: runs of several commits ({', '.join(sorted(commits))}): the page shows one "
                         "release run; run `tools/release/run_benchmarks.sh`, which empties the folder first")
    bodies: dict[str, Callable[[], list[str]]] = {"machine": lambda: machine_line(sum(runs.values(), []))}
    for name, fn in SECTIONS.items():
        bodies[name] = (lambda fn=fn, name=name: fn(runs[name], docs) if runs[name] else placeholder(name))
    for name, make in bodies.items():
        begin, end = f"<!-- BEGIN render:{name} -->", f"<!-- END render:{name} -->"
        if begin not in text or end not in text:
            raise SystemExit(f"{page}: the markers {begin} ... {end} are missing")
        try:
            body = make()
        except (KeyError, TypeError, ValueError, statistics.StatisticsError) as exc:
            raise SystemExit(f"bench_{name}.json in {results}: not in the form this renderer reads "
                             f"({type(exc).__name__}: {exc})")
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = head + begin + "\n" + "\n".join(body) + "\n" + end + tail
    return text


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default=RESULTS, help="folder of the JSON (default bench/results/release)")
    p.add_argument("--page", default=PAGE, help="the page to render into (default docs/benchmarks.md)")
    p.add_argument("--check", action="store_true", help="exit 1 when the page is not up to date")
    args = p.parse_args(argv)
    DRAW[0] = not args.check
    text = render(args.page, args.results)
    with open(args.page) as f:
        old = f.read()
    if args.check:
        print("up to date" if text == old else f"{args.page} differs from a fresh render")
        return 0 if text == old else 1
    if text != old:
        with open(args.page, "w") as f:
            f.write(text)
    print(f"rendered {args.page} from {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
