"""Checks of the options the public API takes: each error names the option and what it takes."""
from __future__ import annotations

import math
import numbers
import warnings
from typing import Any

INT64_MAX = (1 << 63) - 1


def positive_int(name: str, value: Any, maximum: int = INT64_MAX) -> int:
    """``value`` as an int in ``1 .. maximum`` (bool refused; numpy integers accepted)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"mtc_loader: {name} must be an int, got {type(value).__name__}")
    n = int(value)
    if n <= 0:
        raise ValueError(f"mtc_loader: {name} must be positive, got {n}")
    if n > maximum:
        raise ValueError(f"mtc_loader: {name} must be at most {maximum}, got {n}")
    return n


def seconds(name: str, value: Any) -> float:
    """``value`` as a float number of seconds: any real number but nan (inf: no limit)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"mtc_loader: {name} must be a number of seconds, got {type(value).__name__}")
    x = float(value)
    if math.isnan(x):
        raise ValueError(f"mtc_loader: {name} must be a number of seconds, got nan")
    return x


def warn_environment(check: bool = False) -> None:
    """One RuntimeWarning per ``MTC_*`` environment variable whose value the engine refused (not
    an integer in range, a boolean or one of its words), naming the variable, its value and what
    is used instead; each is reported once. ``check``: parse every variable now, as the engine's
    readers will when they first need it."""
    from . import _engine
    for message in _engine._env_problems(check):
        warnings.warn(message, RuntimeWarning, stacklevel=3)
