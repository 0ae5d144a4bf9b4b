"""bench/bench_openmmlab_train.py's pairing: the order of the arms and what the pairs' ratios say
(median, spread, the exact sign test, the bootstrap interval of the median)."""
from __future__ import annotations

import math
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "bench"))

from openmmlab_train import paired  # noqa: E402


def test_pairs_alternate_which_arm_runs_first():
    order = paired.arm_order(6)
    assert len(order) == 12
    assert order[:4] == [(1, "plain"), (1, "switched"), (2, "switched"), (2, "plain")]
    firsts = [arms for k, arms in order[::2]]
    assert firsts == ["plain", "switched"] * 3  # each arm first in half the pairs
    for k in range(1, 7):
        assert sorted(a for j, a in order if j == k) == ["plain", "switched"]
    ahead = paired.arm_order(4, ("switched", "ahead"))
    assert ahead == [(1, "switched"), (1, "ahead"), (2, "ahead"), (2, "switched"),
                     (3, "switched"), (3, "ahead"), (4, "ahead"), (4, "switched")]


@pytest.mark.parametrize("above, below, p", [
    (6, 0, 2 / 64),             # all six on one side: the smallest p six pairs can give
    (5, 1, 2 * 7 / 64),         # P(X <= 1) = (1 + 6) / 64, two-sided
    (3, 3, 1.0),
    (0, 4, 2 / 16),
])
def test_sign_test_is_the_exact_binomial(above, below, p):
    ratios = [1.1] * above + [0.9] * below
    assert paired.sign_test(ratios) == pytest.approx(p)


def test_sign_test_leaves_out_ties():
    assert paired.sign_test([1.0, 1.0, 1.2]) == pytest.approx(1.0)  # one pair left: p = 1
    assert paired.sign_test([1.0] * 4) == 1.0


def test_six_pairs_all_above_one_are_distinguishable_five_are_not():
    s = paired.summarise_pairs([1.21, 1.25, 1.19, 1.30, 1.22, 1.24])
    assert s["distinguishable"] and s["above_one"] == 6
    assert s["median"] == pytest.approx((1.22 + 1.24) / 2)
    assert (s["min"], s["max"]) == (1.19, 1.30)
    lo, hi = s["ci95"]
    assert 1.19 <= lo <= s["median"] <= hi <= 1.30
    assert "distinguishable from 1" in paired.verdict(s) and "not" not in paired.verdict(s)
    mixed = paired.summarise_pairs([1.02, 0.99, 1.03, 1.01, 0.98, 1.04])
    assert not mixed["distinguishable"] and mixed["sign_p"] > 0.05
    assert "not distinguishable" in paired.verdict(mixed)


def test_bootstrap_interval_is_seeded_and_contains_the_median():
    ratios = [1.05, 0.97, 1.12, 1.01, 1.08, 0.99, 1.03]
    a = paired.bootstrap_median_ci(ratios)
    assert a == paired.bootstrap_median_ci(ratios)
    assert min(ratios) <= a[0] <= 1.03 <= a[1] <= max(ratios)


def test_no_pairs():
    s = paired.summarise_pairs([])
    assert s["pairs"] == 0 and not s["distinguishable"] and math.isnan(s["median"])
    assert paired.verdict(s) == "no complete pair"


def _row(arm, it_s, data_ms, pre_ms):
    return dict(arm=arm, kind=arm.split("_")[0], it_per_s_mean=it_s, data_time_ms_mean=data_ms,
                split_ms={"cpu_pre_s": pre_ms, "gpu_model_s": 80.0}, workers_cpu_ms_per_iter=None)


def test_report_pairs_arms_by_number_and_predicts_the_gain():
    import bench_openmmlab_train as bench

    rows = [_row("plain_1", 8.0, 12.0, 9.0), _row("switched_1", 10.0, 2.0, 1.0),
            _row("switched_2", 9.0, 2.0, 1.0), _row("plain_2", 7.5, 12.0, 9.0), _row("plain_3", 8.0, 12.0, 9.0)]
    pairs = bench.pair_ratios(rows)
    assert [(q["pair"], q["base_first"]) for q in pairs] == [(1, True), (2, False)]  # pair 3 is incomplete
    assert [q["ratio"] for q in pairs] == pytest.approx([10 / 8, 9 / 7.5])
    medians = bench.kind_medians(rows)
    assert medians["plain"]["it_per_s_mean"] == 8.0 and medians["switched"]["it_per_s_mean"] == 9.5
    assert medians["plain"]["cpu_pre_ms"] == 9.0 and medians["switched"]["gpu_model_ms"] == 80.0
    law = bench.law(medians, 1.22)
    assert law["data_saved_ms"] == 10.0 and law["pre_saved_ms"] == 8.0 and law["saved_ms"] == 18.0
    assert law["predicted_ratio"] == pytest.approx(125.0 / (125.0 - 18.0))  # a 125 ms plain step
    assert law["measured_ratio"] == 1.22


def test_pairs_of_the_preprocessor_ahead_against_switched():
    import bench_openmmlab_train as bench

    rows = [_row("switched_1", 8.0, 2.0, 9.0), _row("ahead_1", 10.0, 2.0, 0.1),
            _row("ahead_2", 9.0, 2.0, 0.1), _row("switched_2", 7.5, 2.0, 9.0)]
    pairs = bench.pair_ratios(rows, ("switched", "ahead"))
    assert [(q["pair"], q["base_first"], q["switched"], q["ahead"]) for q in pairs] == [
        (1, True, 8.0, 10.0), (2, False, 7.5, 9.0)]
    assert [q["ratio"] for q in pairs] == pytest.approx([10 / 8, 9 / 7.5])
    medians = bench.kind_medians(rows)
    assert medians["ahead"]["cpu_pre_ms"] == 0.1 and medians["switched"]["cpu_pre_ms"] == 9.0
    assert paired.verdict(paired.summarise_pairs([q["ratio"] for q in pairs]), "ahead / switched").startswith(
        "ahead / switched it/s over 2 pairs: median 1.225x")


def test_the_plan_fits_the_arms_in_the_time_left():
    from openmmlab_train.child import plan_iters

    # a warm-up of 5 s set-up, 1 s tear-down, 2 s for its first batch, a cold first step, then 0.5 s steps
    warm = dict(setup_s=5.0, teardown_s=1.0, iter_s=[12.0] + [0.5] * 9, data_time_s=[2.0] + [0.01] * 9)
    iters, est = plan_iters(warm, arms=12, seconds_left=12 * 18.0, cap=100, floor=5, granularity=5, warmup=3)
    assert est["overhead_s"] == 8.0 and est["step_s"] == 0.5
    assert iters == 20 and est["per_arm_s"] == 18.0  # (18 - 8) / 0.5
    assert plan_iters(warm, 12, 12 * 18.0, cap=15, floor=5, granularity=5, warmup=3)[0] == 15  # at most the cap
    assert plan_iters(warm, 12, 12 * 9.0, cap=100, floor=10, granularity=5, warmup=3)[0] == 10  # at least the floor
    assert plan_iters(warm, 12, 12 * 18.3, cap=100, floor=5, granularity=8, warmup=3)[0] == 16  # rounded down
