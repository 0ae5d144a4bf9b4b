"""Hands the engine the torch objects it needs: it never imports torch itself."""
from __future__ import annotations

import os
from typing import Any, Optional

import torch

from . import _dtypes, _engine, _tree
from ._dtypes import DTYPES, supported_dtype  # noqa: F401  (re-exported for tests and tools)

_CUDA_DEVICES: dict[int, torch.device] = {}


def _cuda_device(index: int) -> torch.device:
    dev = _CUDA_DEVICES.get(index)
    if dev is None:
        dev = _CUDA_DEVICES[index] = torch.device("cuda", index)
    return dev


def _loaded_library(name: str) -> "tuple[str | None, str | None]":
    """The path of torch's library ``name`` (``libtorch_cpu.so``) as this process loaded it,
    wherever it lies (``torch/lib`` in a wheel, ``$PREFIX/lib`` in conda-forge's torch): from the
    process's memory maps, else ``torch/lib/<name>`` where that file exists. (path, None) or
    (None, why not)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = "/" + line.rstrip("\n").partition("/")[2]
                base = os.path.basename(path)
                if base == name or base.startswith(name + "."):
                    return path, None
    except OSError:
        pass
    lib = os.path.join(os.path.dirname(torch.__file__), "lib", name)
    if os.path.exists(lib):
        return lib, None
    return None, (f"{name} is neither among this process's loaded libraries (/proc/self/maps) nor in "
                  f"{os.path.dirname(lib)}")


def _shim() -> "tuple[tuple[str, object, object] | None, str | None]":
    """torch's AOTInductor C shim, where this torch has it: the library that exports it (already
    loaded by torch; the engine only looks it up) and the handle converters of torch._C._aoti. The
    engine then reads each tensor's metadata with the shim's getters, makes each output view with
    one C call and turns it into a Python tensor with torch's own wrapper (``shim_python``), or a
    batch's tensors with one Python call; without the shim, with torch's split operators.
    (shim, None), or (None, why this torch offers none)."""
    aoti = getattr(torch._C, "_aoti", None)
    handle_of = getattr(aoti, "unsafe_alloc_void_ptr_from_tensor", None)
    steal = getattr(aoti, "alloc_tensors_by_stealing_from_void_ptrs", None)
    if handle_of is None or steal is None:
        return None, (f"torch {torch.__version__} has no AOTInductor C shim converters "
                      "(torch._C._aoti; torch 2.11 and 2.13 have them)")
    lib, why = _loaded_library("libtorch_cpu.so")
    if lib is None:
        return None, why
    return (lib, handle_of, steal), None


def _bit_samples() -> "tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None":
    """A plain tensor, a negative view and a conjugate view: what the leaf reader's C functions
    for the lazy bits are checked against at setup (None where this torch cannot make them: the
    reader is then not used)."""
    neg_view = getattr(torch, "_neg_view", None)
    if neg_view is None:
        return None
    def zeros(dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(2, dtype=dtype, device="cpu")
    return (zeros(torch.float32), neg_view(zeros(torch.float32)), zeros(torch.complex64).conj())


def routes() -> dict[str, Any]:
    """What :func:`mtc_loader.output_maker` reports: the routes this process takes to make
    outputs and read tensors, and for each route it does not take, why."""
    offered, on = _engine._shim_info()
    parts = _engine._shim_parts()

    def turned_off(switch: str) -> str:
        if parts["env_off"]:
            return "MTC_TORCH_SHIM=0 turned it off"
        return f"mtc_loader._engine.{switch}(False) turned it off"

    def not_offered(python_why: Optional[str], c_why: Optional[str], lib: Optional[str]) -> str:
        if python_why is not None:
            return python_why
        why = c_why or "this torch's tensors failed the check on sample tensors at import"
        return f"{why} ({lib})" if lib else why

    lib = _SHIM[0] if _SHIM is not None else None
    shim = None if on else turned_off("_use_shim") if offered else not_offered(_SHIM_WHY, parts["shim_why"], lib)
    if not on:
        wrap: Optional[str] = f"the outputs are not made through the shim: {shim}"
    elif not parts["wrap"]:
        wrap = not_offered(_PYTHON_LIB_WHY, parts["wrap_why"], _PYTHON_LIB)
    else:
        wrap = None if parts["wrap_on"] else "mtc_loader._engine._use_shim_wrap(False) turned it off"
    if parts["reader_on"]:
        reader: Optional[str] = None
    elif parts["reader"]:
        reader = turned_off("_use_shim_reader")
    elif not offered:
        reader = f"this torch's shim is not used: {shim}"
    else:
        reader = not_offered(None, parts["reader_why"], lib)
    dlpack = (None if parts["dlpack_on"] else "mtc_loader._engine._use_dlpack(False) turned it off"
              if parts["dlpack"] else parts["dlpack_why"])
    return {"maker": "shim" if on else "split", "reason": shim, "wrap": bool(on and parts["wrap_on"]),
            "reader": "shim" if parts["reader_on"] else "dlpack" if parts["dlpack_on"] else "attributes",
            "library": lib,
            "reasons": {"shim": shim, "wrap": wrap, "shim_reader": reader, "dlpack_reader": dlpack}}


def _raw_stream_unavailable(index: int) -> int:
    raise RuntimeError("mtc_loader: this torch build has no CUDA support")


# Built on the CPU and outside torch's modes (a default device of "meta" or "cuda", a
# FakeTensorMode of the importing code): the samples the engine checks its readers against, and
# the setup's own calls into torch, are real CPU tensors whatever the caller made the default.
_SHIM, _SHIM_WHY = _shim()
_PYTHON_LIB, _PYTHON_LIB_WHY = _loaded_library("libtorch_python.so")
_CUDA_LIB = _loaded_library("libtorch_cuda.so")[0]
with _dtypes.outside_modes():
    _engine._setup({
        "tensor_type": torch.Tensor,
        "empty": torch.empty,
        "from_numpy": torch.from_numpy,
        "raw_stream": getattr(torch._C, "_cuda_getCurrentRawStream", _raw_stream_unavailable),
        "uint8": torch.uint8,
        "device_cpu": torch.device("cpu"),
        "dtypes": [(dt, dt.itemsize, _dtypes.flags(dt)) for dt in DTYPES],
        "numpy": _dtypes.numpy_table(),
        "numpy_zero_copy": _dtypes.numpy_zero_copy(),
        "classify": _tree.classify,
        "flatten": _tree.flatten,
        "unflatten": _tree.unflatten,
        "diagnose": _tree.diagnose,
        "cuda_device": _cuda_device,
        # torch's DLPack C exchange table (torch 2.10+): each exact tensor's metadata in one C call;
        # the empty samples teach the engine the DLPack dtype of each of its dtypes
        "dlpack_api": getattr(torch.Tensor, "__dlpack_c_exchange_api__", None),
        "dlpack_samples": [_dtypes.empty_sample(dt) for dt in DTYPES],
        # and of the dtypes it does not copy, whose DLPack form may be one of its own (int4 as int8)
        "dlpack_others": _dtypes.other_samples(),
        "shim": _SHIM,
        "shim_why": _SHIM_WHY,
        # libtorch_python, whose THPVariable_Wrap turns each output handle into a Python tensor
        "shim_python": _PYTHON_LIB,
        "shim_python_why": _PYTHON_LIB_WHY,
        # libtorch_cuda (a torch with CUDA): its shim's current-stream getter, a C call where the
        # engine captures the streams of a copy (the library is only looked up, never loaded)
        "shim_cuda": _CUDA_LIB,
        # what the leaf reader through the shim is checked against before it is used: a strided view
        # with an offset, and a plain, a negative and a conjugate view (the lazy bits)
        "reader_sample": torch.zeros(4, 6, dtype=torch.float32, device="cpu")[1:, 2:5],
        "bit_samples": _bit_samples(),
        "leaf_slot": _tree.LEAF,
        "atom_slot": _tree.ATOM,
        # torch.Tensor's own descriptors: the engine calls them directly for exact tensors
        **{f"d_{n}": torch.Tensor.__dict__.get(n) or getattr(torch._C.TensorBase, "__dict__")[n]
           for n in ("dtype", "shape", "is_cuda")},
        **{f"m_{n}": getattr(torch._C.TensorBase, n)
           for n in ("data_ptr", "get_device", "is_contiguous", "stride", "is_neg", "is_conj", "storage_offset",
                     "untyped_storage")},
    })
