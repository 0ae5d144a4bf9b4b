"""Ranges of the Python side (the prefetch service) for the two tools a user looks at a batch's
time with: an NVTX range in the engine's ``mtc_loader`` domain when an NVTX tool is attached
(Nsight Systems: ``NVTX_INJECTION64_PATH`` set at import), and a ``torch.profiler``
``record_function`` range while a profiler runs. :func:`active` is the cheap test the callers
make first (a bool and a module flag), so that a range costs nothing otherwise."""
from __future__ import annotations

from types import TracebackType
from typing import Any, Optional

import torch.autograd.profiler as _profiler

from . import _engine

__all__ = ["Range", "active", "profiling"]

_NVTX: bool = bool(_engine.nvtx_info()["enabled"])


def active() -> bool:
    """True when a range would be recorded by a tool."""
    return _NVTX or _profiler._is_profiler_enabled


def profiling() -> bool:
    """True while a ``torch.profiler`` / ``torch.autograd.profiler`` session runs."""
    return bool(_profiler._is_profiler_enabled)


class Range:
    """``with Range(name):`` one NVTX range and/or one ``record_function`` range."""

    __slots__ = ("name", "_rf")

    def __init__(self, name: str) -> None:
        self.name = name
        self._rf: Any = None

    def __enter__(self) -> "Range":
        if _NVTX:
            _engine.nvtx_push(self.name)
        if _profiler._is_profiler_enabled:
            self._rf = _profiler.record_function(self.name)
            self._rf.__enter__()
        return self

    def __exit__(self, kind: Optional[type[BaseException]], value: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        if self._rf is not None:
            self._rf.__exit__(kind, value, tb)
            self._rf = None
        if _NVTX:
            _engine.nvtx_pop()
