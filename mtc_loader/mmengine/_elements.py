"""mmengine's data elements (``BaseDataElement`` and its subclasses) and OpenMMLab's structure
types (boxes, points) as containers of the walk: what ``BaseDataElement.to`` moves is copied, what
it keeps stays on the host."""
from __future__ import annotations

import copy
import functools
import threading
from typing import Any, Optional, Sequence

import torch
from mmengine.structures import BaseDataElement

from .. import _tree
from .._tree import LEAF, OnHost, register_container

__all__: list[str] = []

_TENSOR = torch.Tensor
_MOVED_KINDS = (_tree.TENSOR, _tree.FILE)
_BOOKKEEPING = ("_metainfo_fields", "_data_fields")


# ------------------------------------------------------------------------- BaseDataElement

def _is_child(value: Any, key: str, obj: Any) -> bool:
    """Whether a data field is walked: what ``BaseDataElement.to`` moves (values with a ``to``:
    tensors, data elements, registered containers such as box classes), and file-backed tensors
    (:class:`~mtc_loader.FileTensor`, read and placed as a tensor would be). Placeholders of a
    packed batch's skeleton stand for tensors."""
    if type(value) is _TENSOR or value is LEAF:
        return True
    kind = _tree.element_kind(type(value))
    if kind == _tree.FILE:
        return True  # read into the batch's memory like a tensor, wherever it sits
    if not hasattr(value, "to"):
        return False  # numpy arrays, lists, strings: BaseDataElement.to keeps them as they are
    if kind in _MOVED_KINDS or kind == _tree.GENERIC:
        return True
    raise TypeError(
        f"data field {key!r} of a {type(obj).__qualname__} holds a {type(value).__module__}."
        f"{type(value).__qualname__}, which BaseDataElement.to moves with its own .to() but "
        "mtc_loader does not know: register it with mtc_loader.register_container (see the "
        "mmengine recipe: a box class that wraps a tensor)")


# mmdet's TrackDataSample: its ``to`` moves the elements of its (list) data fields, the frames
_TRACK = "mmdet.structures.track_data_sample.TrackDataSample"


@functools.lru_cache(maxsize=_tree._MAX_TYPES)  # bounded as the walk's own tables: classes made per batch die
def _moves_lists(cls: Any) -> bool:
    """Whether ``cls.to`` is TrackDataSample's, which moves each element of a list data field
    that has a ``to`` (and keeps only those)."""
    return any(f"{c.__module__}.{c.__qualname__}" == _TRACK for c in cls.__mro__)


@functools.lru_cache(maxsize=_tree._MAX_TYPES)
def _slots(cls: Any) -> tuple[str, ...]:
    """The attribute names kept in the ``__slots__`` of ``cls`` and its bases (a subclass of a
    known structure type may keep some there), as ``getattr`` spells them."""
    names: list[str] = []
    for c in cls.__mro__:
        declared = c.__dict__.get("__slots__", ())
        for name in (declared,) if isinstance(declared, str) else declared:
            if name in ("__dict__", "__weakref__"):
                continue
            if name.startswith("__") and not name.endswith("__"):
                name = f"_{c.__name__.lstrip('_')}{name}"  # name mangling
            if name not in names:
                names.append(name)
    return tuple(names)


_UNSET = object()


def _slot_values(obj: Any) -> tuple[tuple[str, Any], ...]:
    """The set slots of ``obj`` (see :func:`_slots`), as (name, value) pairs."""
    tp: Any = type(obj)  # (a class is hashable: mypy's lru_cache stub says otherwise)
    names = _slots(tp)
    if not names:
        return ()
    pairs = ((k, getattr(obj, k, _UNSET)) for k in names)
    return tuple((k, v) for k, v in pairs if v is not _UNSET)


def _set_slots(obj: Any, slots: tuple[tuple[str, Any], ...]) -> None:
    for k, v in slots:
        object.__setattr__(obj, k, v)


def _moved_list(value: Any, key: str, obj: Any) -> Optional[list[Any]]:
    """What TrackDataSample.to makes of a list data field: a new list of the elements it moves,
    or None (no element has a ``to``: the field is kept as it is)."""
    if not isinstance(value, list):
        return None
    moved = [v for v in value if v is LEAF or hasattr(v, "to")]
    for v in moved:
        _is_child(v, key, obj)  # (refuses what mtc_loader cannot move)
    return moved or None


def _holds_tensors(value: Any) -> bool:
    """Whether a value that ``.to`` leaves on the host holds tensors (in lists, tuples and dicts,
    or in a container mtc_loader walks: boxes in a dict of evaluation annotations): those cross
    the process boundary in the packed region (:class:`~mtc_loader._tree.OnHost`), not one by
    one through torch's shared memory."""
    tp = type(value)
    if tp is _TENSOR or value is LEAF:
        return True
    if tp is list or tp is tuple:
        return any(_holds_tensors(v) for v in value)
    if tp is dict:
        return any(_holds_tensors(v) for v in value.values())
    if tp in _ATOMS:
        return False
    return _tree.element_kind(tp) in (_tree.TENSOR, _tree.FILE, _tree.GENERIC)


_ATOMS = (str, int, float, bool, type(None), bytes, type)


class _CopyMetainfo(threading.local):
    """Set while this thread packs a batch for itself (mtc_packed_collate with num_workers=0):
    the walk then deep-copies each data element's metainfo values, as ``.to`` does."""

    on = False


_COPY_METAINFO = _CopyMetainfo()


def _flatten_element(obj: BaseDataElement) -> tuple[list[Any], tuple[Any, ...]]:
    """Children: the data fields that ``.to`` would move, then (marked to stay on the host) the
    other fields, metainfo included, that hold tensors; in the order of the instance's
    ``__dict__`` (which pickling and :func:`_unflatten_element` keep). Context: the class, the
    instance's other attributes as they are (metainfo, kept data fields, the field sets), and
    the children's names."""
    state = obj.__dict__.copy()
    data_fields = state.get("_data_fields", ())
    if _COPY_METAINFO.on:
        for k in state.get("_metainfo_fields", ()):
            if k in state and type(state[k]) not in _ATOMS:
                state[k] = copy.deepcopy(state[k])
    keys: list[str] = []
    children: list[Any] = []
    tp: Any = type(obj)
    lists = _moves_lists(tp)
    for k, v in state.items():
        if type(v) is OnHost:  # a packed batch's skeleton: the marker is kept where it was put
            keys.append(k)
            children.append(v)
            continue
        if k in data_fields:
            if lists:
                moved = _moved_list(v, k, obj)
                if moved is not None:
                    keys.append(k)
                    children.append(moved)
                    continue
            if _is_child(v, k, obj):
                keys.append(k)
                children.append(v)
                continue
        elif k in _BOOKKEEPING:
            continue
        if _holds_tensors(v):  # kept by .to (metainfo, lists of tensors): on the host
            keys.append(k)
            children.append(OnHost(v))
    for k in keys:
        state[k] = None  # the context holds no tensor
    return children, (type(obj), state, tuple(keys), _slot_values(obj))


def _unflatten_element(values: list[Any], context: tuple[Any, ...]) -> BaseDataElement:
    """A new instance of the same class, no ``__init__`` or ``__setattr__`` run (the values may be
    placeholders, which ``InstanceData``'s length checks would refuse)."""
    cls, state, keys, slots = context
    new = cls.__new__(cls)
    _set_slots(new, slots)
    d = state.copy()
    for k in _BOOKKEEPING:
        if k in d:
            d[k] = set(d[k])  # its own sets: a field popped from the result stays in the source
    for k, v in zip(keys, values):
        d[k] = v
    new.__dict__.update(d)
    return new


def _element_names(context: tuple[Any, ...]) -> Sequence[str]:
    names: tuple[str, ...] = context[2]
    return names


register_container(BaseDataElement, _flatten_element, _unflatten_element, names=_element_names)


# ------------------------------------------------------------------------- OpenMMLab's structure types

def _holder_flatten(obj: Any) -> tuple[list[Any], tuple[Any, ...]]:
    """A structure that keeps its data in one ``tensor`` attribute (boxes, points): that tensor is
    the child; the class and every other attribute (``box_dim``, ``with_yaw``, ``points_dim``,
    ``attribute_dims``, ``rotation_axis``, ..., and those a subclass keeps in ``__slots__``) are
    the context, as they are."""
    state = obj.__dict__.copy()
    tensor = state["tensor"]
    state["tensor"] = None  # (keeps its place in the attributes' order)
    return [tensor], (type(obj), state, _slot_values(obj))


def _holder_unflatten(values: list[Any], context: tuple[Any, ...]) -> Any:
    """A new instance of the same class with the same attributes, its ``tensor`` the value given;
    no constructor runs (it would check, convert or clone the tensor)."""
    cls, state, slots = context
    new = cls.__new__(cls)
    _set_slots(new, slots)
    d = state.copy()
    d["tensor"] = values[0]
    new.__dict__.update(d)
    return new


def _holder_names(context: tuple[Any, ...]) -> Sequence[str]:
    return ["tensor"]


# Known by name, so that neither mmdet nor mmdet3d is imported here; their subclasses (LiDAR,
# camera and depth boxes and points; HorizontalBoxes, ...) are covered through the MRO.
_TENSOR_HOLDERS = (
    "mmdet3d.structures.bbox_3d.base_box3d.BaseInstance3DBoxes",
    "mmdet3d.structures.points.base_points.BasePoints",
    "mmdet.structures.bbox.base_boxes.BaseBoxes",
)
for _name in _TENSOR_HOLDERS:
    _tree.register_container_by_name(_name, _holder_flatten, _holder_unflatten, names=_holder_names)
