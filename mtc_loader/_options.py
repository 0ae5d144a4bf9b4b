"""Checks of the options the public API takes: each error names the option and what it takes."""
from __future__ import annotations

import math
import numbers
import re
import warnings
from typing import Any, Optional

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


# a size as the train command's --arena-bytes and PackedCollate(arena_bytes=...) take it: a
# number of bytes, or one with a binary unit (K, M, G, T: powers of 1024; 512M, 512MiB, 512MB)
_SIZE = re.compile(r"\s*(\d+)\s*(?:([kmgt])(?:i?b)?|b)?\s*", re.IGNORECASE)
_UNITS = {None: 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
SIZE_WORDS = "a number of bytes (536870912) or one with a unit, K, M, G or T, powers of 1024 (\"512M\", \"512MiB\")"


def parse_size(text: str) -> Optional[int]:
    """The bytes ``text`` says (``"512M"``: 512 MiB), or None where it is not a size."""
    m = _SIZE.fullmatch(text)
    if m is None:
        return None
    return int(m.group(1)) * _UNITS[m.group(2).lower() if m.group(2) else None]


def size(name: str, value: Any, maximum: int = INT64_MAX) -> int:
    """``value`` (an int, or a str with a unit as :func:`parse_size` reads it) as bytes in
    ``1 .. maximum``."""
    if isinstance(value, str):
        n = parse_size(value)
        if n is None:
            raise ValueError(f"mtc_loader: {name} must be {SIZE_WORDS}, got {value!r}")
        value = n
    elif isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"mtc_loader: {name} must be {SIZE_WORDS}, got {type(value).__name__}")
    return positive_int(name, value, maximum)


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
