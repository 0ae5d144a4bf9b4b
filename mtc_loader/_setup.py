"""Hands the engine the torch objects it needs: it never imports torch itself."""
from __future__ import annotations

import os

import torch

from . import _dtypes, _engine, _tree
from ._dtypes import DTYPES, supported_dtype  # noqa: F401  (re-exported for tests and tools)

_CUDA_DEVICES: dict[int, torch.device] = {}


def _cuda_device(index: int) -> torch.device:
    dev = _CUDA_DEVICES.get(index)
    if dev is None:
        dev = _CUDA_DEVICES[index] = torch.device("cuda", index)
    return dev


def _shim() -> "tuple[str, object, object] | None":
    """torch's AOTInductor C shim, where this torch has it: the library that exports it (already
    loaded by torch; the engine only looks it up) and the handle converters of torch._C._aoti. The
    engine then reads each tensor's metadata with the shim's getters, makes each output view with
    one C call and turns it into a Python tensor with torch's own wrapper (``shim_python``), or a
    batch's tensors with one Python call; without the shim, with torch's split operators."""
    aoti = getattr(torch._C, "_aoti", None)
    handle_of = getattr(aoti, "unsafe_alloc_void_ptr_from_tensor", None)
    steal = getattr(aoti, "alloc_tensors_by_stealing_from_void_ptrs", None)
    lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    if handle_of is None or steal is None or not os.path.exists(lib):
        return None
    return (lib, handle_of, steal)


def _bit_samples() -> "tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None":
    """A plain tensor, a negative view and a conjugate view: what the leaf reader's C functions
    for the lazy bits are checked against at setup (None where this torch cannot make them: the
    reader is then not used)."""
    neg_view = getattr(torch, "_neg_view", None)
    if neg_view is None:
        return None
    return (torch.zeros(2), neg_view(torch.zeros(2)), torch.zeros(2, dtype=torch.complex64).conj())


def _raw_stream_unavailable(index: int) -> int:
    raise RuntimeError("mtc_loader: this torch build has no CUDA support")


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
    "dlpack_samples": [torch.empty(0, dtype=dt) for dt in DTYPES],
    # and of the dtypes it does not copy, whose DLPack form may be one of its own (int4 as int8)
    "dlpack_others": _dtypes.other_samples(),
    "shim": _shim(),
    # libtorch_python, whose THPVariable_Wrap turns each output handle into a Python tensor
    "shim_python": os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_python.so"),
    # libtorch_cuda (a torch with CUDA): its shim's current-stream getter, a C call where the
    # engine captures the streams of a copy (the library is only looked up, never loaded)
    "shim_cuda": os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cuda.so"),
    # what the leaf reader through the shim is checked against before it is used: a strided view
    # with an offset, and a plain, a negative and a conjugate view (the lazy bits)
    "reader_sample": torch.zeros(4, 6)[1:, 2:5],
    "bit_samples": _bit_samples(),
    "leaf_slot": _tree.LEAF,
    "atom_slot": _tree.ATOM,
    # torch.Tensor's own descriptors: the engine calls them directly for exact tensors
    **{f"d_{n}": torch.Tensor.__dict__.get(n) or getattr(torch._C.TensorBase, "__dict__")[n]
       for n in ("dtype", "shape", "is_cuda")},
    **{f"m_{n}": getattr(torch._C.TensorBase, n)
       for n in ("data_ptr", "get_device", "is_contiguous", "stride", "is_neg", "is_conj")},
})
