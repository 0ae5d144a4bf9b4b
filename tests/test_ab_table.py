"""tools/diagnostics/ab_table.py reads the lines that ab_pairs_gpu.sh's summary writes: the
summary is run here on a bench_train result and a bench_reference result of known figures, and
the table must carry those figures, pair by pair, with their medians."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DIAG = os.path.join(_ROOT, "tools", "diagnostics")


def _load_table():
    spec = importlib.util.spec_from_file_location("mtc_ab_table", os.path.join(_DIAG, "ab_table.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _method(fraction, step, switches, epochs):
    return {"fraction_of_ideal": fraction, "steady_fraction_of_ideal": fraction + 0.01, "step_ms": step,
            "next_steady_ms": 0.04, "step_cpu_ms": step - 1.5, "step_off_cpu_ms": 1.5,
            "switches": {"training": [switches, 0.0]},
            "prefetch_stats": {"service_cpu_ms_per_batch": 0.45},
            "epochs": [{"step_ms": epochs, "next_ms": [9.0] + [0.04] * (len(epochs) - 1)}]}


def _arm(d, fraction, latency):
    os.makedirs(os.path.join(d, "train"))
    os.makedirs(os.path.join(d, "ref"))
    steps = [4.0 + 0.01 * k for k in range(100)]
    train = {"results": {"launch4": {"ideal": _method(1.0, 4.2, 1.0, steps),
                                     "packed": _method(fraction, 4.3, 4.2, steps)}}}
    with open(os.path.join(d, "train", "bench_train.json"), "w") as f:
        json.dump(train, f)
    ref = {"harness": {"seed16_h2d": {"mtc": {"mean_ms": 0.3, "speedup_vs_to_hardcoded": 19.5}}},
           "distribution": {"seed16_H2D_mtc": {"mean_ms": latency, "p50_ms": latency, "p99_ms": 0.35,
                                               "max_ms": 0.4, "machine_slowest_vs_median": 1.05}}}
    with open(os.path.join(d, "ref", "bench_reference.json"), "w") as f:
        json.dump(ref, f)


def _summary(arm, pair, d):
    """The summary function of ab_pairs_gpu.sh, run on one arm's directory."""
    with open(os.path.join(_DIAG, "ab_pairs_gpu.sh")) as f:
        script = f.read()
    start = script.index("summary() {")
    end = script.index("\n}\n", start) + 3
    out = subprocess.run(["bash", "-c", script[start:end] + f'summary {arm} {pair} "{d}"'],
                         capture_output=True, text=True, check=True)
    return out.stdout


@pytest.mark.skipif(not os.path.exists("/bin/bash"), reason="needs bash")
def test_the_table_carries_each_pairs_figures(tmp_path):
    lines = []
    for pair, (new, old) in enumerate([(0.95, 0.90), (0.93, 0.91), (0.97, 0.89)], start=1):
        for arm, fraction in (("new", new), ("old", old)):
            d = tmp_path / f"{arm}{pair}"
            _arm(str(d), fraction, 0.28 + 0.01 * pair)
            lines.append(_summary(arm, pair, str(d)))
    log = tmp_path / "ab.log"
    log.write_text("".join(lines) + lines[0])  # a line twice (two calls' logs) counts once
    table = _load_table()
    rows = table.read([str(log)])
    assert rows[("launch4 % of preloaded", "new")] == {1: 95.0, 2: 93.0, 3: 97.0}
    assert rows[("launch4 % of preloaded", "old")] == {1: 90.0, 2: 91.0, 3: 89.0}
    assert rows[("launch4 training thread's blocks/step", "new")][2] == 4.2
    assert rows[("launch4 training thread's CPU ms/step", "new")][2] == pytest.approx(2.8)
    assert rows[("launch4 training thread's CPU ms/step, preloaded", "old")][1] == pytest.approx(2.7)
    assert rows[("launch4 packed step p99 ms", "old")][1] == pytest.approx(4.99)
    assert rows[("H2D latency mean ms", "new")] == {1: 0.29, 2: 0.30, 3: 0.31}
    assert rows[("harness seed16 x .to()", "old")][3] == 19.5
    md = table.table(rows, markdown=True)
    assert "| launch4 % of preloaded | 95.0 93.0 97.0 (95.0) | 90.0 91.0 89.0 (90.0) | +5.00 (3/3 higher) |" in md
    assert "| H2D latency mean ms | 0.290 0.300 0.310 (0.300) |" in md


def test_a_figure_an_arm_did_not_measure_is_left_out(tmp_path):
    log = tmp_path / "ab.log"
    log.write_text("pair 1 new latency seed16_H2D_mtc: mean 0.300 p50 0.290 p99 0.350 max 0.400 ms machine 1.02x\n"
                   "pair 1 old harness seed16 mtc: 0.250 ms 19.00x to_hardcoded\n"
                   "pair 1 new: done at 10 s\n")
    table = _load_table()
    rows = table.read([str(log)])
    assert set(rows) == {("H2D latency mean ms", "new"), ("H2D latency p50 ms", "new"),
                         ("H2D latency p99 ms", "new"), ("H2D latency max ms", "new"),
                         ("H2D latency: slowest CPU loop / median", "new"),
                         ("harness seed16 start_copy ms", "old"), ("harness seed16 x .to()", "old")}
    text = table.table(rows, markdown=False)
    assert "0.300 (0.300)" in text and " - (-)" in text


def test_a_third_arm_and_the_stage_profile_get_their_own_column(tmp_path):
    """Pairs with AB_PREV: the arm "prev" is a column of its own, after new and old, and the
    seed16 line of profile_stages.py (as the script copies it into ab.log) is read per stage."""
    stage = ("seed16             gc on     281.4 us/call    980 ns/leaf | traverse=41.0 plan=6.2 "
             "outputs=30.1 views=70.3 get_wait=80.9 queue=0.0 stage=12.5 dma_issue=14.2 sync=0.0 | "
             "per leaf: traverse 143 views 245 ns | DMA calls 3.0\n")
    log = tmp_path / "ab.log"
    log.write_text(f"pair 1 prev stages {stage}"
                   f"pair 1 new stages {stage.replace('DMA calls 3.0', 'DMA calls 1.0')}"
                   "pair 2 old latency seed16_H2D_mtc: mean 0.300 p50 0.270 p99 0.350 max 0.400 ms machine 1.02x\n")
    table = _load_table()
    rows = table.read([str(log)])
    assert rows[("seed16 DMA calls/call", "prev")] == {1: 3.0}
    assert rows[("seed16 DMA calls/call", "new")] == {1: 1.0}
    assert rows[("seed16 outputs us/call", "new")] == {1: 30.1}
    assert rows[("seed16 start_copy + get us/call (stages)", "prev")] == {1: 281.4}
    md = table.table(rows, markdown=True)
    assert md.splitlines()[0].startswith("| figure | this build, pairs 1 2 (median) | the other, pairs 1 2")
    assert "the build before, pairs 1 2 (median) |" in md.splitlines()[0]
    assert "| seed16 DMA calls/call | 1.00 - (1.00) | - - (-) | 3.00 - (3.00) | - |" in md


def test_the_pairs_are_compared_only_where_both_builds_ran():
    """The paired column: new less old in each pair that has both (a pair that lost an arm to the
    deadline is left out), their median, and in how many of them new came out higher."""
    table = _load_table()
    assert table.paired({1: 90.0, 2: 80.0, 3: 70.0}, {2: 85.0, 3: 71.0, 4: 60.0}) == (-3.0, 0, 2)
    assert table.paired({1: 2.0, 2: 5.0, 3: 1.0}, {1: 1.0, 2: 1.0, 3: 3.0}) == (1.0, 2, 3)
    assert table.paired({1: 1.0}, {2: 1.0}) is None
    rows = {("launch4 % of preloaded", "new"): {1: 82.0, 2: 96.2, 3: 74.4},
            ("launch4 % of preloaded", "old"): {1: 88.4, 2: 92.5, 3: 91.2}}
    text = table.table(rows, markdown=False)
    assert text.splitlines()[-1].split() == ["new-old", "paired", "-6.40", "(1/3", "higher)"]
    assert "| -6.40 (1/3 higher) |" in table.table(rows, markdown=True)
