"""Device arguments: ``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``torch.device`` or an int, as the
engine's target index (-1 for the CPU)."""
from __future__ import annotations

from typing import Any, Optional, Union

import torch

_TARGETS: dict[Any, int] = {}

MAX_DEVICES = 64  # MTC_MAX_DEVICES in csrc/engine/cuda.h


def target_index(device: Union[str, torch.device, int]) -> int:
    """-1 for the CPU, the CUDA index otherwise; raises for anything else."""
    try:
        cached = _TARGETS.get(device)
    except TypeError:  # unhashable: torch.device() below says what is wrong with it
        cached = None
    if cached is not None:
        return cached
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        meant = _meant(device)
        if meant is not None:
            raise ValueError(f"mtc_loader: invalid device {device!r}; did you mean {meant!r}? mtc_loader "
                             "copies to 'cpu' and 'cuda[:N]'") from None
        raise ValueError(f"mtc_loader: invalid device {device!r}: {e}") from None
    if dev.type == "cpu":
        index = -1
    elif dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"mtc_loader: device {device!r} requested, but CUDA is not available "
                "(torch.cuda.is_available() is False)")
        count = torch.cuda.device_count()
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if not 0 <= index < count:
            raise ValueError(
                f"mtc_loader: invalid device {device!r}: this machine has {count} CUDA "
                f"device(s) (cuda:0 .. cuda:{count - 1})")
        if index >= MAX_DEVICES:
            raise ValueError(
                f"mtc_loader: invalid device {device!r}: mtc_loader copies to CUDA devices "
                f"0 .. {MAX_DEVICES - 1}")
        if dev.index is None:
            return index  # "cuda" follows the current device: not cached
    else:
        raise ValueError(
            f"mtc_loader: unsupported device type {dev.type!r} in {device!r}; "
            "mtc_loader copies to 'cpu' and 'cuda[:N]'")
    if isinstance(device, (str, torch.device)):
        _TARGETS[device] = index
    return index


# names of a GPU that torch does not know, and the device they mean
_GPU_NAMES = ("gpu", "nvidia", "cuda")


def _meant(device: Any) -> Optional[str]:
    """The device a string such as ``"CPU"``, ``"gpu"``, ``"GPU:1"`` or ``"cuda1"`` means, or None."""
    if not isinstance(device, str):
        return None
    name = device.strip().lower()
    if name in ("cpu", "host"):
        return "cpu"
    for prefix in _GPU_NAMES:
        if name.startswith(prefix):
            rest = name[len(prefix):].lstrip(":")
            if rest == "":
                return "cuda"
            if rest.isdigit():
                return f"cuda:{int(rest)}"
    return None
