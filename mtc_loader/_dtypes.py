"""The dtypes the engine copies, and numpy's type numbers mapped onto them.

The lowest layer of the package after the C engine: it knows torch and numpy only. Codes are
indices into :data:`DTYPES`: first the dtypes of :data:`_KNOWN` this torch has, in that fixed
order, then any dtype a newer torch adds, by name. Everything here is built on the CPU with
torch's modes set aside (:func:`outside_modes`), so that the table is the same whatever device
or mode the importing code has made the default, and with only the ops no caller setting changes
(deterministic mode fills new memory, which torch cannot do for every dtype, see :func:`_probe`);
:data:`TABLE` identifies it, and a process whose table differs from the arena creator's is
refused (``mismatch``).
"""
from __future__ import annotations

import contextlib
import hashlib
import warnings
from collections.abc import Iterator

import numpy as np
import torch

# Flags understood by the engine (csrc/binding/state.h): MTC_DT_FLOAT, MTC_DT_COMPLEX.
_DT_FLOAT, _DT_COMPLEX = 0x1, 0x2

_QUANTIZED = {getattr(torch, n) for n in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")
              if hasattr(torch, n)}

# The dtypes the engine copies, in code order (the order of torch 2.13's names): a code means
# the same dtype in every process with the same torch, whatever the probe of a newer dtype finds.
_KNOWN = ("bfloat16", "bits16", "bits1x8", "bits2x4", "bits4x2", "bits8", "bool", "complex128",
          "complex32", "complex64", "float16", "float32", "float4_e2m1fn_x2", "float64",
          "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
          "int16", "int32", "int64", "int8", "uint16", "uint32", "uint64", "uint8")

# Sub-byte shells torch names but cannot copy: never copied, whatever a probe would find.
_SHELLS = frozenset([f"int{b}" for b in range(1, 8)] + [f"uint{b}" for b in range(1, 8)])


@contextlib.contextmanager
def outside_modes() -> Iterator[None]:
    """torch with no mode in the way: the torch-function modes (``with torch.device("meta")``,
    ``torch.set_default_device``) and the dispatch modes (``FakeTensorMode`` and others) active
    in this thread are set aside inside, and restored after. What is built at import goes
    through this, with an explicit ``device="cpu"`` as well, for a torch whose
    ``DisableTorchFunction`` leaves modes on."""
    with contextlib.ExitStack() as stack:
        disable = getattr(torch._C, "DisableTorchFunction", None)
        if disable is not None:
            stack.enter_context(disable())
        if _dispatch_modes():
            from torch.utils._python_dispatch import _disable_current_modes
            stack.enter_context(_disable_current_modes())
        yield


def _dispatch_modes() -> int:
    """Dispatch modes active in this thread (with the pre-dispatch ones, where torch has them)."""
    n = int(getattr(torch._C, "_len_torch_dispatch_stack", lambda: 0)())
    pre_dispatch = getattr(getattr(torch, "_ops", None), "_len_torch_dispatch_stack_pre_dispatch", None)
    return n + (int(pre_dispatch()) if pre_dispatch is not None else 0)


def _bytewise_dtypes() -> list[torch.dtype]:
    """The dtypes of :data:`_KNOWN` this torch can view raw bytes as and copy, in that order,
    then the others it can (a dtype newer than this list), by name."""
    def usable(dt: torch.dtype) -> bool:
        try:
            with warnings.catch_warnings():  # "ComplexHalf support is experimental"
                warnings.simplefilter("ignore")
                _probe(dt, dt.itemsize)
        except Exception:
            return False
        return True

    known = [getattr(torch, n) for n in _KNOWN if isinstance(getattr(torch, n, None), torch.dtype)]
    seen = set(known) | _QUANTIZED
    newer: dict[str, torch.dtype] = {}
    for name in dir(torch):
        dt = getattr(torch, name)
        if isinstance(dt, torch.dtype) and dt not in seen and str(dt).rpartition(".")[2] not in _SHELLS:
            newer[str(dt)] = dt
    return [dt for dt in known if usable(dt)] + [newer[n] for n in sorted(newer) if usable(newer[n])]


def _probe(dt: torch.dtype, size: int) -> None:
    """Raises unless torch can view bytes as dt and copy dt, on the CPU (shell dtypes such as
    uint1..7 / int1..7 can be viewed on some torch versions but not copied). Only ``zeros`` of
    uint8, ``view`` and ``copy_`` run: no caller setting changes what they do. (``clone`` or
    ``empty`` of dt would fill new memory under ``torch.use_deterministic_algorithms(True)``,
    which torch cannot do for the bits dtypes, and the table would depend on that setting.)"""
    src = torch.zeros(2 * size, dtype=torch.uint8, device="cpu").view(dt)
    torch.zeros(2 * size, dtype=torch.uint8, device="cpu").view(dt).copy_(src)


def empty_sample(dt: torch.dtype) -> torch.Tensor:
    """An empty CPU tensor of dtype dt, made as a view of uint8 bytes: ``torch.empty(0, dtype=dt)``
    fails for the bits dtypes under ``torch.use_deterministic_algorithms(True)``."""
    return torch.empty(0, dtype=torch.uint8, device="cpu").view(dt)


def _fingerprint(dtypes: list[torch.dtype]) -> str:
    """A short hash of the table: each code's dtype name and size."""
    text = ",".join(f"{dt}:{dt.itemsize}" for dt in dtypes)
    return hashlib.blake2s(text.encode(), digest_size=4).hexdigest()


with outside_modes():
    DTYPES = _bytewise_dtypes()
_SUPPORTED = set(DTYPES)
# (torch version, fingerprint of the table): what the process that creates an arena hands its
# users, and what they compare theirs with before they pack or unpack a batch of its
TABLE = (str(torch.__version__), _fingerprint(DTYPES))


def mismatch(theirs: tuple[str, str], where: str) -> str:
    """The message of a process whose dtype table is not the arena creator's ``theirs``; where:
    what this process is doing ("packs", "unpacks")."""
    return (f"mtc_loader: this process {where} a batch with another dtype table than the process that "
            f"created the arena: this process's torch {TABLE[0]} (dtype table {TABLE[1]}), the arena "
            f"creator's torch {theirs[0]} (dtype table {theirs[1]}); a dtype's code would mean another "
            "dtype. Run the DataLoader workers (and every process sharing the PackedCollate) with the "
            "same torch as the main process")


def other_samples() -> list[torch.Tensor]:
    """An empty CPU tensor of each dtype this torch has that is not in :data:`DTYPES` (shell
    dtypes such as int1..int7, quantized ones), where torch can make one."""
    out = []
    others = {d for d in vars(torch).values() if isinstance(d, torch.dtype)} - _SUPPORTED
    for dt in sorted(others, key=str):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out.append(empty_sample(dt))
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
