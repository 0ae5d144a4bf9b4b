"""Containers the C traversal does not handle itself, and diagnosis of bad leaves.

The engine walks exact ``list``, ``tuple`` and ``dict`` in C. For any other type it asks
:func:`classify` once (the answer is cached per type), and for the containers among them it
calls :func:`flatten` and, to rebuild, :func:`unflatten`. A leaf that fails the engine's fast
checks is handed to :func:`diagnose`, which raises an exception naming its path, or returns
a resolved replacement (lazily conjugated or negated tensors). :data:`LEAF` marks a tensor's place
in the skeleton of a packed batch.
"""
from __future__ import annotations

import copy as _copy
import dataclasses
from typing import Any

import numpy as np
import torch

from ._dtypes import supported_dtype
from .files import FileTensor

LEAF_KIND, TENSOR, NDARRAY, GENERIC, FILE = 0, 1, 2, 3, 4

_NAMEDTUPLE, _TUPLE, _LIST, _DICT, _DATACLASS, _STRUCTSEQ, _SAME = range(7)

_DISALLOW_INSTANTIATION = 1 << 7  # Py_TPFLAGS_DISALLOW_INSTANTIATION


class _LeafSlot:
    """The place of a tensor in a packed batch's skeleton (pickled by reference)."""

    __slots__ = ()

    def __reduce__(self) -> str:
        return "LEAF"

    def __repr__(self) -> str:
        return "<leaf>"


LEAF = _LeafSlot()


def classify(tp: type) -> int:
    """How the traversal treats instances of ``tp`` (a type that is not exactly list/tuple/dict)."""
    if issubclass(tp, torch.Tensor):
        return TENSOR
    if issubclass(tp, np.ndarray):
        return NDARRAY
    if issubclass(tp, FileTensor):
        return FILE
    if issubclass(tp, (list, tuple, dict)):
        return GENERIC
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return GENERIC
    return LEAF_KIND


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


def _is_structseq(obj: Any) -> bool:
    """A C struct sequence (``os.stat_result``, ``time.struct_time``, ``torch.return_types.*``)."""
    tp = type(obj)
    return (isinstance(obj, tuple) and isinstance(getattr(tp, "n_sequence_fields", None), int)
            and isinstance(getattr(tp, "n_fields", None), int))


def flatten(obj: Any) -> tuple[list[Any], tuple[Any, ...]]:
    """Children of a container, and ``(context, path segments)`` to rebuild it and name them."""
    if _is_structseq(obj):
        if type(obj).__flags__ & _DISALLOW_INSTANTIATION:
            # sys.version_info, sys.flags: cannot be rebuilt, hold no tensors: the same object
            return [], ((_SAME, obj), [])
        # the visible fields, then the named ones only attribute access shows (st_mtime as a
        # float, tm_zone): the pickle protocol of struct sequences gives both
        cls, (seq, extra) = obj.__reduce__()
        names = list(extra)
        return (list(seq) + [extra[k] for k in names],
                ((_STRUCTSEQ, cls, len(seq), names), [f"[{i}]" for i in range(len(seq))] +
                 [f".{k}" for k in names]))
    if _is_namedtuple(obj):
        return list(obj), ((_NAMEDTUPLE, type(obj)), [f".{f}" for f in type(obj)._fields])
    if isinstance(obj, tuple):
        return list(obj), ((_TUPLE, type(obj)), [f"[{i}]" for i in range(len(obj))])
    if isinstance(obj, list):
        return list(obj), ((_LIST, obj), [f"[{i}]" for i in range(len(obj))])
    if isinstance(obj, dict):
        keys = list(obj.keys())
        return [obj[k] for k in keys], ((_DICT, obj, keys), [f"[{k!r}]" for k in keys])
    names = [f.name for f in dataclasses.fields(obj)]
    return [getattr(obj, n) for n in names], ((_DATACLASS, obj, names), [f".{n}" for n in names])


def unflatten(context: tuple[Any, ...], values: list[Any]) -> Any:
    """The container of ``context`` (same type, same attributes) holding ``values``."""
    kind = context[0]
    if kind == _STRUCTSEQ:
        n = context[2]
        return context[1](values[:n], dict(zip(context[3], values[n:])))
    if kind == _SAME:
        return context[1]
    if kind == _NAMEDTUPLE:
        return context[1]._make(values)
    if kind == _TUPLE:
        return context[1](values)
    if kind == _LIST:
        # copy.copy keeps the subclass and its instance attributes
        new = _copy.copy(context[1])
        new[:] = values
        return new
    if kind == _DICT:
        # keeps the subclass, instance attributes and a defaultdict's default_factory
        new = _copy.copy(context[1])
        new.clear()
        for k, v in zip(context[2], values):
            new[k] = v
        return new
    new = _copy.copy(context[1])  # dataclass: no __init__ / __post_init__ rerun
    for name, v in zip(context[2], values):
        object.__setattr__(new, name, v)
    return new


_UNSUPPORTED_LAYOUT_HINT = "convert it with .to_dense() first, or copy it separately"


def diagnose(leaf: Any, path: str, exc: BaseException | None) -> Any:
    """Raise an exception that names ``path`` and what to do; or return a resolved tensor."""
    if isinstance(leaf, np.ndarray):
        dt = leaf.dtype
        if dt.hasobject:
            raise TypeError(
                f"mtc_loader: {path} is a numpy array of dtype object; only numeric and bool "
                "arrays can become tensors: convert it (e.g. np.stack or .astype) before copying")
        if not dt.isnative:
            raise TypeError(
                f"mtc_loader: {path} is a numpy array with non-native byte order ({dt.str}); "
                "convert it with arr.astype(arr.dtype.newbyteorder('='))")
        raise TypeError(
            f"mtc_loader: {path} is a numpy array of dtype {dt} ({dt.str}), which has no torch "
            "equivalent; convert it to a numeric dtype first")
    if isinstance(leaf, torch.Tensor):
        if leaf.layout != torch.strided or leaf.is_sparse:
            raise TypeError(
                f"mtc_loader: {path} is a sparse tensor (layout {leaf.layout}); only dense "
                f"strided tensors are copied: {_UNSUPPORTED_LAYOUT_HINT}")
        if leaf.is_nested:
            raise TypeError(
                f"mtc_loader: {path} is a nested tensor; copy its components instead "
                "(nested.unbind()) or convert it with .to_padded_tensor()")
        if leaf.is_quantized:
            raise TypeError(
                f"mtc_loader: {path} is a quantized tensor ({leaf.dtype}); dequantize() it "
                "first or copy it separately with .to()")
        if leaf.is_meta:
            raise TypeError(f"mtc_loader: {path} is a meta tensor, which has no data to copy")
        if leaf.device.type not in ("cpu", "cuda"):
            raise TypeError(
                f"mtc_loader: {path} lives on device {leaf.device}; only CPU and CUDA tensors "
                "are supported")
        if leaf.is_conj() or leaf.is_neg():
            # lazily conjugated/negated views: materialise the values, as .to() would
            return leaf.detach().resolve_conj().resolve_neg()
        if not supported_dtype(leaf.dtype):
            raise TypeError(
                f"mtc_loader: {path} has dtype {leaf.dtype}, which mtc_loader cannot copy "
                "bytewise; convert it (e.g. .to(torch.uint8)) first")
        raise RuntimeError(f"mtc_loader: cannot read the tensor at {path}: {exc}") from exc
    raise TypeError(f"mtc_loader: cannot copy {path} of type {type(leaf).__name__}")
