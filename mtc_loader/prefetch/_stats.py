"""Where the time went: the counters behind :meth:`PrefetchLoader.stats`, and the windows over them
that the framework integrations log."""
from __future__ import annotations

from typing import Any

def _new_stats() -> dict[str, Any]:
    return {"batches": 0, "wait_s": 0.0, "step_s": 0.0, "steps": 0, "service_cpu_s": 0.0,
            "service_next_s": 0.0, "service_batches": 0, "resets": 0}


class StatsWindow:
    """What a loader's :meth:`PrefetchLoader.stats` counted since the previous :meth:`delta` or
    :meth:`advance` (since the window was made, for the first): the framework integrations log
    the figures over their own windows rather than over the whole run. Read it on the thread that
    iterates the loader (which updates the counters)."""

    __slots__ = ("stats", "mark", "resets")

    def __init__(self, stats: dict[str, Any], from_start: bool = False) -> None:
        self.stats = stats  # a loader's counters (_new_stats), updated in place, reset_stats() included
        self.resets = self.stats["resets"]
        # from_start: the first window holds all that the loader counted, not only what comes next
        self.mark: tuple[float, float, int] = (0.0, 0.0, 0) if from_start else self._now()

    def _now(self) -> tuple[float, float, int]:
        s = self.stats
        return s["wait_s"], s["step_s"], s["batches"]

    def delta(self) -> tuple[float, float, int]:
        """``(seconds waited, seconds of steps, batches handed out)`` since the previous call."""
        now = self._now()
        mark, self.mark = self.mark, now
        if self.stats["resets"] != self.resets:  # reset_stats() since the mark: counted from zero
            self.resets = self.stats["resets"]
            mark = (0.0, 0.0, 0)
        return now[0] - mark[0], now[1] - mark[1], now[2] - mark[2]

    def advance(self) -> dict[str, float]:
        """The figures since the previous call (:func:`window_figures`)."""
        return window_figures(*self.delta())


def window_figures(wait_s: float, step_s: float, batches: int) -> dict[str, float]:
    """The figures of a window, as :meth:`PrefetchLoader.stats` defines them: ``data_bound`` (when
    any time was counted) and ``wait_ms_per_batch`` (when a batch was handed out); an empty dict
    when nothing was counted."""
    figures: dict[str, float] = {}
    if wait_s + step_s > 0:
        figures["data_bound"] = wait_s / (wait_s + step_s)
    if batches:
        figures["wait_ms_per_batch"] = wait_s * 1e3 / batches
    return figures
