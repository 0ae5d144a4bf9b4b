"""Torch's modes around a copy: which of them the engine can copy under.

The engine allocates its outputs with ``torch.empty`` and writes them from C. A
``TorchDispatchMode`` or ``TorchFunctionMode`` active on the calling thread sees that call; one
that hands out ordinary tensors (a flop counter, a logging mode, torch's default-device
context) is harmless, one that hands out fake or meta tensors (``FakeTensorMode``, a tracing
mode) would have the engine write through no memory. :func:`refusal` tells them apart.
"""
from __future__ import annotations

from typing import Any, Optional

import torch


def _names() -> list[str]:
    """The active modes' class names, innermost last."""
    names: list[str] = []
    try:
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
        names += [type(m).__name__ for m in _get_current_dispatch_mode_stack()]
    except Exception:  # another torch's internals: the probe alone decides
        pass
    try:
        from torch.overrides import _get_current_function_mode_stack
        names += [type(m).__name__ for m in _get_current_function_mode_stack()]  # type: ignore[no-untyped-call]
    except Exception:
        pass
    return names


def _device_contexts_only() -> bool:
    """True when the only active modes are torch's default-device contexts
    (``with torch.device(...)``, ``torch.set_default_device``), which leave a ``torch.empty``
    with an explicit device, as the engine's are, alone."""
    try:
        from torch.overrides import _get_current_function_mode_stack
        from torch.utils._device import DeviceContext
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
        return not _get_current_dispatch_mode_stack() and all(
            type(m) is DeviceContext for m in _get_current_function_mode_stack())  # type: ignore[no-untyped-call]
    except Exception:
        return False


def refusal() -> Optional[str]:
    """None when ``torch.empty`` under the active modes gives an ordinary CPU tensor with
    memory, else the message of the error the copy raises. Called by the engine only while a
    mode is active."""
    if _device_contexts_only():
        return None
    try:
        probe = torch.empty(1, dtype=torch.uint8, device="cpu")
        ok = type(probe) is torch.Tensor and probe.device.type == "cpu" and probe.data_ptr() != 0
    except Exception:
        ok = False
    if ok:
        return None
    names = ", ".join(_names()) or "a mode"
    return (f"mtc_loader: a TorchDispatchMode or TorchFunctionMode ({names}) is active and makes "
            "torch.empty's tensors fake or without memory, which the engine would write through; "
            "copy outside the mode, or move the tensors with tensor.to() inside it")


def _describe(t: Any) -> str:
    """What a tensor torch handed the engine is, as far as it can be read."""
    kind = f"{type(t).__module__}.{type(t).__qualname__}"
    try:
        held = t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()
        return (f"a {kind} of dtype {t.dtype}, shape {tuple(t.shape)}, strides {t.stride()} on {t.device}, "
                f"with {held} bytes of storage from its first element")
    except Exception as e:  # a tensor without strides or storage says so itself
        return f"a {kind} ({type(e).__name__}: {e})"


def buffer_refusal(got: Any, dtype: torch.dtype, shape: tuple[int, ...], strides: Optional[tuple[int, ...]],
                   device: torch.device) -> str:
    """The message of the error a copy raises when torch, asked for a buffer the engine writes
    (an output, or the tensor of a packed chunk's dtype), gave another one: the engine would
    write past its memory. Called by the engine only then."""
    layout = f"strides {strides}" if strides is not None else "contiguous"
    numel = 1
    for n in shape:
        numel *= n
    asked = (f"a torch.Tensor of dtype {dtype}, shape {tuple(shape)}, {layout}, on {device} "
             f"({numel * dtype.itemsize} bytes)")
    names = ", ".join(_names()) or "none"
    return (f"mtc_loader: torch.empty gave the engine {_describe(got)}, where it asked for {asked}; the copy "
            "would write past that tensor's memory or in another layout. The active TorchDispatchMode or "
            f"TorchFunctionMode ({names}) changes what torch.empty makes: copy outside the mode, or move the "
            "tensors with tensor.to() inside it")
