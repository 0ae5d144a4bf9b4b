"""Checks of the options the public API takes: each error names the option and what it takes."""
from __future__ import annotations

import difflib
import math
import numbers
import os
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
    if check:
        for message in unknown_environment():
            warnings.warn(message, RuntimeWarning, stacklevel=3)


# Every MTC_* variable the project reads: the engine's (csrc/engine/env.c), the build's (setup.py),
# and those of its tests, benchmarks and tools (tests/test_env.py checks the list against them).
KNOWN_ENVIRONMENT = frozenset({
    "MTC_PINNED_CAP_BYTES", "MTC_NO_BATCH_MEMCPY", "MTC_SLAB_HUGEPAGES", "MTC_H2D_RING", "MTC_INLINE_MAX_BYTES",
    "MTC_EARLY_GC",
    "MTC_HELPER_THREADS", "MTC_FILE_READER", "MTC_URING_DEPTH", "MTC_FILE_DIRECT", "MTC_ARENA_POPULATE",
    "MTC_URING_MAX_IO", "MTC_TORCH_SHIM", "MTC_C_HANDOFF", "MTC_QUIET_PIPES", "MTC_PACK_NT",
    # the build
    "MTC_SANITIZE", "MTC_DEBUG", "MTC_NVTX_INCLUDE", "MTC_NO_LIBURING", "MTC_REQUIRE_LIBURING",
    "MTC_LIBURING_PREFIX",
    # tests, benchmarks and tools
    "MTC_ARENA_STRESS_CYCLES", "MTC_BENCH_COMMIT", "MTC_EXIT_TRAP_LOG", "MTC_EXIT_TRAP_PID", "MTC_NVTX_LOG",
    "MTC_NVTX_TIMES", "MTC_PLAN_CASES", "MTC_PLAN_SEED", "MTC_RECORDS", "MTC_RING_STRESS_ITEMS", "MTC_TEST_SEED",
    "MTC_TEST_INSTALLED",
})
_UNKNOWN_SAID: set[str] = set()


def unknown_environment() -> list[str]:
    """The messages for ``MTC_*`` environment variables that mtc_loader does not read (a misspelled
    name is otherwise ignored in silence), each name once per process, with the closest known name."""
    out = []
    for name in sorted(os.environ):
        if not name.startswith("MTC_") or name in KNOWN_ENVIRONMENT or name in _UNKNOWN_SAID:
            continue
        _UNKNOWN_SAID.add(name)
        close = difflib.get_close_matches(name, sorted(KNOWN_ENVIRONMENT), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else "it is not one of mtc_loader's (docs/engine.md lists them)"
        out.append(f"mtc_loader: the environment variable {name} is not one mtc_loader reads, and has no effect: {hint}")
    return out
