"""Paired plain / switched runs: the order of the arms, pair by pair, and what the pairs' ratios
say (median, spread, and whether they are told apart from 1)."""
from __future__ import annotations

import math
import random
import statistics
from typing import Any, Sequence


def arm_order(pairs: int, kinds: Sequence[str] = ("plain", "switched")) -> list[tuple[int, str]]:
    """The arms of ``pairs`` pairs of ``kinds`` (base, candidate) in the order they run: pair k
    (from 1) runs the base first when k is odd, the candidate first when k is even, so that each
    arm takes each position in a pair equally often (and any drift over the run weighs on both)."""
    order: list[tuple[int, str]] = []
    for k in range(1, pairs + 1):
        arms = tuple(kinds) if k % 2 else tuple(reversed(kinds))
        order += [(k, arm) for arm in arms]
    return order


def sign_test(ratios: Sequence[float]) -> float:
    """The two-sided exact sign test's p-value for ``median(ratio) = 1``: the chance, with each
    ratio as likely above 1 as below, of a split between above and below at least as uneven
    as the one seen (ratios equal to 1 left out)."""
    above = sum(r > 1 for r in ratios)
    below = sum(r < 1 for r in ratios)
    n = above + below
    if n == 0:
        return 1.0
    k = min(above, below)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def bootstrap_median_ci(ratios: Sequence[float], level: float = 0.95, resamples: int = 10000,
                        seed: int = 0) -> tuple[float, float]:
    """A percentile bootstrap interval of the ratios' median (seeded: the same ratios give the
    same interval)."""
    rng = random.Random(seed)
    n = len(ratios)
    medians = sorted(statistics.median(rng.choices(ratios, k=n)) for _ in range(resamples))
    lo = medians[int(math.floor((1 - level) / 2 * resamples))]
    hi = medians[min(resamples - 1, int(math.ceil((1 + level) / 2 * resamples)) - 1)]
    return lo, hi


def summarise_pairs(ratios: Sequence[float], alpha: float = 0.05) -> dict[str, Any]:
    """What the pairs' ratios (switched over plain, one per pair) say: their median, min and max,
    the sign test's p-value, the bootstrap interval of the median, and ``distinguishable``: True
    where the sign test rejects a median of 1 at ``alpha`` (with 6 pairs: all 6 on one side)."""
    if not ratios:
        return dict(pairs=0, median=math.nan, min=math.nan, max=math.nan, sign_p=1.0,
                    ci95=(math.nan, math.nan), distinguishable=False, above_one=0)
    p = sign_test(ratios)
    lo, hi = bootstrap_median_ci(ratios)
    return dict(pairs=len(ratios), median=statistics.median(ratios), min=min(ratios), max=max(ratios),
                sign_p=p, ci95=(lo, hi), distinguishable=p < alpha, above_one=sum(r > 1 for r in ratios))


def verdict(summary: dict[str, Any], what: str = "switched / plain") -> str:
    """One line: the median ratio, the spread and whether it is told apart from 1."""
    if not summary["pairs"]:
        return "no complete pair"
    s = summary
    told = ("distinguishable from 1" if s["distinguishable"] else "not distinguishable from 1")
    return (f"{what} it/s over {s['pairs']} pairs: median {s['median']:.3f}x "
            f"(min {s['min']:.3f}, max {s['max']:.3f}; {s['above_one']} of {s['pairs']} above 1; "
            f"sign test p={s['sign_p']:.3f}, bootstrap 95% CI of the median "
            f"{s['ci95'][0]:.3f}..{s['ci95'][1]:.3f}): {told}")
