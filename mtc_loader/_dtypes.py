"""The dtypes the engine copies, and numpy's type numbers mapped onto them.

The lowest layer of the package after the C engine: it knows torch and numpy only. Codes are
indices into :data:`DTYPES`, sorted by name so that every process agrees on them.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch

# Flags understood by the engine (csrc/binding/state.h): MTC_DT_FLOAT, MTC_DT_COMPLEX.
_DT_FLOAT, _DT_COMPLEX = 0x1, 0x2

_QUANTIZED = {getattr(torch, n) for n in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")
              if hasattr(torch, n)}


def _bytewise_dtypes() -> list[torch.dtype]:
    """Every torch dtype whose tensors can be rebuilt from raw bytes with ``.view(dtype)``."""
    seen, out = set(), []
    for name in dir(torch):
        dt = getattr(torch, name)
        if not isinstance(dt, torch.dtype) or dt in seen or dt in _QUANTIZED:
            continue
        seen.add(dt)
        try:
            size = dt.itemsize
            with warnings.catch_warnings():  # "ComplexHalf support is experimental"
                warnings.simplefilter("ignore")
                _probe(dt, size)
        except Exception:
            continue
        out.append(dt)
    # a stable order, so that codes are the same in every process
    out.sort(key=str)
    return out


def _probe(dt: torch.dtype, size: int) -> None:
    """Raises unless torch can view bytes as dt and copy dt (shell dtypes such as uint1..7 /
    int1..7 can be viewed on some torch versions but not copied)."""
    torch.empty(2 * size, dtype=torch.uint8).view(dt).clone()


DTYPES = _bytewise_dtypes()
_SUPPORTED = set(DTYPES)


def other_samples() -> list[torch.Tensor]:
    """An empty tensor of each dtype this torch has that is not in :data:`DTYPES` (shell dtypes
    such as int1..int7, quantized ones), where torch can make one."""
    out = []
    for dt in {d for d in vars(torch).values() if isinstance(d, torch.dtype)} - _SUPPORTED:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out.append(torch.empty(0, dtype=torch.uint8).view(dt))
        except Exception:
            continue
    return out


def supported_dtype(dt: torch.dtype) -> bool:
    return dt in _SUPPORTED


def flags(dt: torch.dtype) -> int:
    if dt.is_complex:
        return _DT_COMPLEX
    if dt.is_floating_point:
        return _DT_FLOAT
    return 0


def numpy_table() -> dict[int, int]:
    """numpy type number -> engine dtype code, by kind and size (``long`` and ``longlong``
    are distinct numpy types of the same size)."""
    code = {dt: i for i, dt in enumerate(DTYPES)}
    by_kind = {("b", 1): torch.bool, ("i", 1): torch.int8, ("i", 2): torch.int16,
               ("i", 4): torch.int32, ("i", 8): torch.int64, ("u", 1): torch.uint8,
               ("u", 2): torch.uint16, ("u", 4): torch.uint32, ("u", 8): torch.uint64,
               ("f", 2): torch.float16, ("f", 4): torch.float32, ("f", 8): torch.float64,
               ("c", 8): torch.complex64, ("c", 16): torch.complex128}
    table: dict[int, int] = {}
    for c in "?bBhHiIlLqQefdFD":
        npdt = np.dtype(c)
        tdt = by_kind.get((npdt.kind, npdt.itemsize))
        if tdt in code:
            table[npdt.num] = code[tdt]
    return table


def numpy_zero_copy() -> list[int]:
    """numpy type numbers that torch.from_numpy accepts (it refuses e.g. ``ulonglong``,
    although ``ulong`` is the same size): other arrays are copied."""
    out: list[int] = []
    for c in "?bBhHiIlLqQefdFD":
        try:
            torch.from_numpy(np.zeros(1, dtype=c))
        except TypeError:
            continue
        out.append(np.dtype(c).num)
    return out
