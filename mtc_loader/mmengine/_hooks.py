"""The hooks the prefetching train loops register: the loader's position in checkpoints, and
the loop's figures in the message hub."""
from __future__ import annotations

from collections import deque
from typing import Any, Optional, Protocol

from mmengine.hooks import Hook

from ..prefetch import PrefetchLoader
from ..prefetch._stats import StatsWindow, window_figures

__all__: list[str] = []

_CKPT_KEY = "mtc_loader"  # the checkpoint's entry for the train loader's position


class _Prefetching(Protocol):
    """What the hooks read and set of the prefetching train loop that registers them."""

    _prefetch: Optional[PrefetchLoader]
    _saved_position: Optional[dict[str, Any]]

    def _loader_state(self) -> Optional[dict[str, Any]]: ...


class _LoaderStateHook(Hook):  # type: ignore[misc]
    """Saves the position of the prefetching train loop's loader in every checkpoint (when its
    DataLoader is stateful) and hands the saved one back to the loop on resume."""

    priority = "VERY_LOW"

    def __init__(self, loop: _Prefetching) -> None:
        self.loop = loop

    def before_save_checkpoint(self, runner: Any, checkpoint: dict[str, Any]) -> None:
        state = self.loop._loader_state()
        if state is not None:
            checkpoint[_CKPT_KEY] = state

    def after_load_checkpoint(self, runner: Any, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get(_CKPT_KEY)
        meta = checkpoint.get("meta") or {}
        # applied only where runner.resume() puts the loop (a load_from leaves it at the start)
        self.loop._saved_position = None if saved is None else dict(
            saved, epoch=meta.get("epoch"), iter=meta.get("iter"))


class _StatsHook(Hook):  # type: ignore[misc]
    """Puts the prefetching train loop's figures (``train/data_bound``, ``train/data_wait_time``:
    see :class:`MTCEpochBasedTrainLoop`) in the runner's message hub after each training
    iteration, before ``LoggerHook`` (``BELOW_NORMAL``) takes the scalars of its log line."""

    priority = "NORMAL"  # after IterTimerHook (NORMAL, registered with the runner's default hooks)

    def __init__(self, loop: _Prefetching) -> None:
        self.loop = loop
        self.window: Optional[StatsWindow] = None
        self.recent: deque[tuple[float, float, int]] = deque()  # (wait, step, batches) per iteration

    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None) -> None:
        loader = self.loop._prefetch
        if loader is None:
            return
        if self.window is None or self.window.stats is not loader._stats:  # a new loader
            self.window = StatsWindow(loader._stats, from_start=True)
            self.recent.clear()
        size = _window_size(runner)
        recent = self.recent
        wait, step, batches = self.window.delta()
        recent.append((wait, step, batches))
        while len(recent) > size:
            recent.popleft()
        figures = window_figures(sum(r[0] for r in recent), sum(r[1] for r in recent), sum(r[2] for r in recent))
        hub = runner.message_hub
        if "data_bound" in figures:
            hub.update_scalar("train/data_bound", figures["data_bound"])
        if batches:  # the log processor's mean: the wait per batch over its window
            hub.update_scalar("train/data_wait_time", wait, count=batches)


def _window_size(runner: Any) -> int:
    """The window (iterations) over which the runner's log processor smooths its time figures."""
    size = getattr(runner.log_processor, "window_size", 10)  # mmengine's LogProcessor's default
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError("mtc_loader: the prefetching train loop logs data_bound over the log processor's "
                         f"window_size, which must be an int >= 1, got {size!r}; set "
                         "log_processor=dict(window_size=...) or the loop's log_stats=False")
    return size


def _check_log_stats(log_stats: Any) -> bool:
    if not isinstance(log_stats, bool):
        raise TypeError(f"mtc_loader: log_stats must be True or False, got {log_stats!r}")
    return log_stats
