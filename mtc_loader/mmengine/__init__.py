"""OpenMMLab's mmengine: data samples packed, one DMA per batch, and the prefetch service, with a
config change.

Importing this module (it needs ``mmengine``; ``import mtc_loader`` never imports it):

- registers mmengine's ``BaseDataElement`` and every subclass (``InstanceData``, ``PixelData``,
  ``Det3DDataSample``, your own) as containers (:func:`mtc_loader.register_container`): their
  data fields holding tensors or other data elements are copied, their metainfo and their other
  data fields (numpy arrays, lists, strings) are kept as they are, which is what
  ``BaseDataElement.to`` does;
- registers ``mtc_packed_collate`` in mmengine's ``FUNCTIONS``: ``pseudo_collate`` (or the
  collate function you name) in the DataLoader worker, its output packed into a shared arena
  (:class:`~mtc_loader.PackedCollate`);
- registers :class:`MTCDataPreprocessor` in ``MODELS``: wraps the model's data preprocessor (any
  ``BaseDataPreprocessor``, e.g. mmdet3d's ``Det3DDataPreprocessor``); a packed batch is moved
  with one DMA before the wrapped preprocessor runs, whose own ``cast_data`` then has nothing
  left to do;
- registers :class:`MTCEpochBasedTrainLoop` and :class:`MTCIterBasedTrainLoop` in ``LOOPS``:
  mmengine's loops with the batches prefetched by :class:`~mtc_loader.PrefetchLoader` (batch k+1
  copied on the copy stream while step k trains);
- registers :class:`MTCValLoop` and :class:`MTCTestLoop` in ``LOOPS``, and :class:`MTCRunner`
  in ``RUNNERS``: mmengine's ``Runner`` with all of the above applied to what the config builds
  (:func:`switch_config`);
- wraps ``Runner.from_cfg`` with a check: it ignores ``runner_type``, and warns once when the
  config it builds names ``MTCRunner``.

In a child config of the config you train (see the docs' mmengine recipe)::

    _base_ = ["mmdet3d::pointpillars/pointpillars_hv_secfpn_8xb6-160e_kitti-3d-3class.py"]

    custom_imports = dict(imports=["mtc_loader.mmengine"], allow_failed_imports=False)
    runner_type = "MTCRunner"

or, with the config left as it is, ``python3 -m mtc_loader.mmengine train CONFIG``.
"""
from __future__ import annotations

import copy
import functools
import itertools
import threading
from collections import deque
from collections.abc import Mapping
from typing import Any, Callable, Iterator, Optional, Sequence, Union

try:
    from mmengine.dataset import pseudo_collate
    from mmengine.hooks import Hook
    from mmengine.model import BaseDataPreprocessor
    from mmengine.registry import FUNCTIONS, LOOPS, MODELS
    from mmengine.runner import EpochBasedTrainLoop, IterBasedTrainLoop, TestLoop, ValLoop
    from mmengine.structures import BaseDataElement
except ImportError as e:
    raise ImportError(f"mtc_loader: mtc_loader.mmengine needs mmengine (pip install mmengine): {e}") from None

import torch
from torch.utils.data import get_worker_info

from .. import _tree
from .._tree import LEAF, OnHost, register_container
from ..collate import Arena, PackedBatch, PackedCollate
from ..prefetch import PrefetchLoader, _figures, _is_stateful, _Window

__all__ = ["MTCDataPreprocessor", "MTCEpochBasedTrainLoop", "MTCIterBasedTrainLoop", "MTCRunner", "MTCTestLoop",
           "MTCValLoop", "PackedPseudoCollate", "packed_collate", "switch_config"]

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


# ------------------------------------------------------------------------- collate

def _place(data: Any) -> Any:
    """``data`` with what ``BaseDataPreprocessor.cast_data`` leaves on the host marked so
    (:class:`~mtc_loader._tree.OnHost`), where it holds tensors the walk would otherwise move
    (boxes or points outside data samples) or is a numpy array (which ``cast_data`` keeps as
    one): cast_data's own recursion, through mappings, named tuples and sequences, moving only
    tensors and data elements (and FileTensors, which it never sees: they become tensors)."""
    if isinstance(data, Mapping):  # (cast_data makes every mapping a dict)
        return {k: _place(data[k]) for k in data}
    if isinstance(data, (str, bytes)) or data is None:
        return data
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(_place(v) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(_place(v) for v in data)
    if isinstance(data, (torch.Tensor, BaseDataElement)):
        return data
    kind = _tree.element_kind(type(data))
    if kind == _tree.FILE:
        return data
    if kind in (_tree.NDARRAY, _tree.GENERIC, _tree.TENSOR):
        return OnHost(data)
    return data


class _PlacedAsCastData:
    """A collate function whose output's ``inputs`` (and anything else outside data samples) is
    marked where ``cast_data`` would leave it on the host (:func:`_place`)."""

    def __init__(self, fn: Callable[[list[Any]], Any]) -> None:
        self.fn = fn

    def __call__(self, samples: list[Any]) -> Any:
        return _place(self.fn(samples))


# what an arena too small tells PackedCollate's users, and what mmengine's configure
_ARENA_HINT = "PackedCollate(arena_bytes=...)"
_ARENA_HINT_MM = ("MTCDataPreprocessor(arena_bytes=...) in the model's config (model=dict(data_preprocessor="
                  "dict(type='MTCDataPreprocessor', ..., arena_bytes=...)), or switch_config(cfg, arena_bytes=...))")


# what a PackedBatch read as its structure (by a hook of mmengine's own loops) tells the user
_UNPACK_HINT_MM = (
    "mmengine's own loops (EpochBasedTrainLoop, IterBasedTrainLoop, ValLoop, TestLoop) hand the hooks the "
    "batch as the loader made it. Set runner_type = \"MTCRunner\" in the config (built with RUNNERS.build(cfg) "
    "or MTCRunner.from_cfg(cfg)), or name mtc_loader's loops (train_cfg=dict(type=\"MTCEpochBasedTrainLoop\", "
    "...) or \"MTCIterBasedTrainLoop\", val_cfg=dict(type=\"MTCValLoop\"), test_cfg=dict(type=\"MTCTestLoop\")): "
    "they unpack each packed batch on the model's device before the hooks run")


class PackedPseudoCollate:
    """The collate function registered as ``mtc_packed_collate`` in mmengine's ``FUNCTIONS``:
    ``pseudo_collate`` (or ``collate_fn``) in the DataLoader worker, its output packed into one
    region of a shared arena; the DataLoader yields :class:`~mtc_loader.PackedBatch` objects,
    which :class:`MTCDataPreprocessor` (or :class:`MTCEpochBasedTrainLoop`) moves to the device.

    One instance per process, shared by every DataLoader whose config names it; its arena is
    created in the process that trains (by :class:`MTCDataPreprocessor` when the model is built,
    or on first use), before the DataLoader starts its workers, which receive it.

    Config: ``collate_fn=dict(type="mtc_packed_collate")``, or
    ``dict(type="mtc_packed_collate", collate_fn="default_collate")`` to pack what another
    function of ``FUNCTIONS`` (a name) or any callable makes.
    """

    def __init__(self) -> None:
        self.arena: Optional[Arena] = None
        self.arena_bytes = 256 << 20
        self._packers: dict[Any, PackedCollate] = {}
        self._lock = threading.Lock()

    def arm(self, arena_bytes: Optional[int] = None) -> Arena:
        """Creates the arena (``arena_bytes``, default 256 MiB) unless it exists; returns it. The
        first call sizes it. Call it in the process that trains, before the DataLoader starts."""
        with self._lock:
            if self.arena is None:
                if get_worker_info() is not None:
                    raise RuntimeError(
                        "mtc_loader: mtc_packed_collate runs in a DataLoader worker that received no arena: "
                        "its arena must be created in the training process before the DataLoader starts "
                        "its workers. Use data_preprocessor=dict(type='MTCDataPreprocessor', ...) in the "
                        "model's config (it creates the arena when the model is built), or call "
                        "mtc_loader.mmengine.packed_collate.arm() before training")
                if arena_bytes is not None:
                    self.arena_bytes = int(arena_bytes)
                self.arena = Arena(self.arena_bytes)
                self.arena._unpack_hint = _UNPACK_HINT_MM
            return self.arena

    def _packer(self, collate_fn: Union[str, Callable[[list[Any]], Any], None], kwargs: dict[str, Any]) -> PackedCollate:
        key: Any = (collate_fn, tuple(sorted(kwargs.items())))
        try:
            p = self._packers.get(key)
        except TypeError:  # an unhashable argument: keyed by its text
            key = (collate_fn, repr(sorted(kwargs.items())))
            p = self._packers.get(key)
        if p is None:
            fn = pseudo_collate if collate_fn is None else (
                FUNCTIONS.get(collate_fn) if isinstance(collate_fn, str) else collate_fn)
            if not callable(fn):
                raise ValueError(f"mtc_loader: mtc_packed_collate's collate_fn {collate_fn!r} is not a "
                                 "function registered in mmengine's FUNCTIONS nor a callable")
            if kwargs:
                fn = functools.partial(fn, **kwargs)
            p = self._packers[key] = PackedCollate(_PlacedAsCastData(fn), arena=self.arm())
        return p

    def __call__(self, data_batch: Sequence[Any], collate_fn: Union[str, Callable[[list[Any]], Any], None] = None,
                 **kwargs: Any) -> PackedBatch:
        """Packs what ``collate_fn`` (``pseudo_collate`` by default; ``kwargs`` are its other
        arguments, from the loader's ``collate_fn`` config) makes of ``data_batch``."""
        packer = self._packer(collate_fn, kwargs)
        in_worker = get_worker_info() is not None
        # packed in the process that trains (num_workers=0), the batch's metainfo would be the
        # dataset's own objects: copied here, as BaseDataElement.to deep-copies it (a worker's
        # travel pickled, which copies them)
        _COPY_METAINFO.on = not in_worker
        try:
            return packer(list(data_batch))
        except RuntimeError as e:
            if _ARENA_HINT not in str(e):
                raise
            raise RuntimeError(str(e).replace(_ARENA_HINT, _ARENA_HINT_MM).replace(
                "PrefetchLoader depth", "the train loop's prefetch_depth")) from None
        finally:
            _COPY_METAINFO.on = False

    def __getstate__(self) -> dict[str, Any]:
        # a worker started by spawn or forkserver receives the arena: created here if need be
        if get_worker_info() is None:
            self.arm()
        return {"arena": self.arena, "arena_bytes": self.arena_bytes, "containers": _tree.CARRIED}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
        self.arena, self.arena_bytes = state["arena"], state["arena_bytes"]


packed_collate = PackedPseudoCollate()
FUNCTIONS.register_module(name="mtc_packed_collate", module=packed_collate)


# ------------------------------------------------------------------------- data preprocessor

class _Moved(threading.local):
    """The batch the prefetching train loop handed out last on this thread: already on the
    device, so the preprocessor does not move it again. Its ``forward`` clears the mark when it
    takes the batch (a later call with the same batch finds its tensors on the device and moves
    nothing either)."""

    batch: Any = None


_MOVED = _Moved()


class _CastData:
    """Stands in for the wrapped preprocessor's ``cast_data``: nothing to do for a batch that is
    on the device already, the preprocessor's own ``cast_data`` otherwise."""

    def __init__(self, owner: "MTCDataPreprocessor") -> None:
        self.owner = owner

    def __call__(self, data: Any) -> Any:
        if self.owner._on_device:
            return data
        inner = self.owner.preprocessor
        return type(inner).cast_data(inner, data)


def _wrapped_config(preprocessor: Union[str, dict[str, Any], BaseDataPreprocessor, None],
                    inherited: dict[str, Any], non_blocking: bool) -> Any:
    """The wrapped preprocessor's config (or module): a type name becomes a config, the keys a
    child config inherits from its base's ``data_preprocessor`` are its arguments."""
    if isinstance(preprocessor, str):
        preprocessor = dict(type=preprocessor)
    if preprocessor is None:
        if inherited:
            raise TypeError(
                "mtc_loader: MTCDataPreprocessor received "
                f"{', '.join(sorted(inherited))}: arguments of the preprocessor it wraps (a child config's "
                "data_preprocessor=dict(type='MTCDataPreprocessor') merges the base config's "
                "data_preprocessor into it), but not that preprocessor's type: name it, e.g. "
                "data_preprocessor=dict(type='MTCDataPreprocessor', preprocessor='Det3DDataPreprocessor') "
                "(the type your base config's data_preprocessor has), or leave the model's config alone and "
                "use runner_type='MTCRunner' (docs/mmengine.md)")
        return dict(type="BaseDataPreprocessor", non_blocking=non_blocking)
    if not isinstance(preprocessor, dict):
        if inherited:
            raise TypeError(f"mtc_loader: MTCDataPreprocessor got a built preprocessor and arguments for it "
                            f"({', '.join(sorted(inherited))}): give one or the other")
        return preprocessor
    if not inherited:
        return preprocessor
    merged = dict(inherited)
    merged.update(preprocessor)  # the wrapper's own nested keys win over the inherited ones
    if non_blocking:  # an inherited key too, taken by the wrapper's own argument
        merged.setdefault("non_blocking", non_blocking)
    return merged


@MODELS.register_module()
class MTCDataPreprocessor(BaseDataPreprocessor):  # type: ignore[misc]
    """Wraps a model's data preprocessor: a :class:`~mtc_loader.PackedBatch` (from
    ``mtc_packed_collate``) is moved to the preprocessor's device with one DMA from the arena, a
    batch that :class:`MTCEpochBasedTrainLoop` prefetched is on the device already; then the
    wrapped preprocessor runs as usual (normalisation, padding, voxelisation, ...) with its
    ``cast_data`` a no-op. Any other batch goes through the wrapped preprocessor unchanged.

    Config: ``data_preprocessor=dict(type="MTCDataPreprocessor", preprocessor=<the model's
    data_preprocessor config>)``. In a child config, whose ``data_preprocessor`` merges into
    the base config's, name the wrapped type alone:
    ``model = dict(data_preprocessor=dict(type="MTCDataPreprocessor",
    preprocessor="Det3DDataPreprocessor"))``; the inherited keys (``voxel``, ``mean``, ...) are
    its arguments.

    Args:
        preprocessor: The wrapped preprocessor: a config dict, a type name of ``MODELS``, or a
            module (default: mmengine's ``BaseDataPreprocessor``, which only moves the data).
        arena_bytes: Size of ``mtc_packed_collate``'s shared arena, created here (in the process
            that trains, before the DataLoader starts): about ``num_workers * prefetch_factor +
            prefetch depth + 2`` batches.
        non_blocking: As ``BaseDataPreprocessor``'s, for batches that are not packed (also
            passed on with the inherited arguments, when set).
        **inherited: Arguments of the wrapped preprocessor (those a child config inherits from
            its base's ``data_preprocessor``); the keys of a ``preprocessor`` dict win over them.
    """

    def __init__(self, preprocessor: Union[str, dict[str, Any], BaseDataPreprocessor, None] = None,
                 arena_bytes: int = 256 << 20, non_blocking: bool = False, **inherited: Any) -> None:
        super().__init__(non_blocking)
        preprocessor = _wrapped_config(preprocessor, inherited, non_blocking)
        if isinstance(preprocessor, dict):
            preprocessor = MODELS.build(preprocessor)
        if not isinstance(preprocessor, BaseDataPreprocessor):
            raise TypeError("mtc_loader: MTCDataPreprocessor wraps a BaseDataPreprocessor (or its config), "
                            f"got {type(preprocessor).__name__}")
        self.preprocessor = preprocessor
        self._on_device = False
        # an instance attribute: the wrapped preprocessor's self.cast_data(...) calls find it first
        preprocessor.cast_data = _CastData(self)
        packed_collate.arm(arena_bytes)

    # BaseDataPreprocessor keeps its device in _device, set by its own to() / cuda() / cpu(),
    # which nn.Module.to does not call on submodules: the wrapped one follows here
    def to(self, *args: Any, **kwargs: Any) -> "MTCDataPreprocessor":
        super().to(*args, **kwargs)
        self.preprocessor._device = self._device
        return self

    def cuda(self, *args: Any, **kwargs: Any) -> "MTCDataPreprocessor":
        super().cuda(*args, **kwargs)
        self.preprocessor._device = self._device
        return self

    def cpu(self, *args: Any, **kwargs: Any) -> "MTCDataPreprocessor":
        super().cpu(*args, **kwargs)
        self.preprocessor._device = self._device
        return self

    def _move(self, data: Any) -> tuple[Any, bool]:
        """``(data on the device, True)`` for a packed or prefetched batch, else ``(data, False)``."""
        if isinstance(data, PackedBatch):
            return data.to(self.device), True
        if data is _MOVED.batch and data is not None:
            return data, True
        return data, False

    def cast_data(self, data: Any) -> Any:
        """A packed batch unpacked on the device (one DMA), a prefetched one as it is, anything
        else through the wrapped preprocessor's ``cast_data``."""
        data, moved = self._move(data)
        if moved:
            return data
        return type(self.preprocessor).cast_data(self.preprocessor, data)

    def forward(self, data: Any, training: bool = False) -> Any:
        data, moved = self._move(data)
        if not moved:
            return self.preprocessor(data, training)
        # the model has its batch: the mark lets go of it, so that the batch is freed where the
        # loop drops it (after the step) rather than inside the next hand-out
        if data is _MOVED.batch:
            _MOVED.batch = None
        self._on_device = True
        try:
            return self.preprocessor(data, training)
        finally:
            self._on_device = False


# ------------------------------------------------------------------------- train loops

def _device_of(runner: Any) -> torch.device:
    """The device the model trains on: its data preprocessor's (mmengine keeps it there)."""
    model = runner.model
    model = getattr(model, "module", model)  # DistributedDataParallel and mmengine's wrappers
    pre = getattr(model, "data_preprocessor", None)
    dev = getattr(pre, "device", None)
    if isinstance(dev, torch.device):
        return dev
    for p in model.parameters():
        found: torch.device = p.device
        return found
    return torch.device("cpu")


class _Prefetching:
    """The batches of an iterable (or of a PrefetchLoader), prefetched on the model's device; each
    one handed out is marked for :class:`MTCDataPreprocessor` as on the device already."""

    def __init__(self, iterable: Any, device: torch.device, depth: int) -> None:
        self.loader = iterable if isinstance(iterable, PrefetchLoader) else PrefetchLoader(iterable, device, depth)
        # a batch that is not packed is copied by start_copy: what cast_data leaves on the host
        # stays there (the structure types the walk knows would otherwise be moved)
        self.loader._prepare = _place  # type: ignore[attr-defined]
        self.it = iter(self.loader)

    def __iter__(self) -> "_Prefetching":
        return self

    def __next__(self) -> Any:
        _MOVED.batch = None
        batch = next(self.it)
        _MOVED.batch = batch
        return batch

    def close(self) -> None:
        _MOVED.batch = None
        self.it.close()  # type: ignore[attr-defined]  # a generator: stops the service thread


def _unpacked(data_batch: Any, runner: Any) -> Any:
    """What hooks, the model and evaluators receive for a batch of the loader: a
    :class:`~mtc_loader.PackedBatch` unpacked on the model's device (one DMA) and marked for
    :class:`MTCDataPreprocessor` as moved; any other batch as it is."""
    if not isinstance(data_batch, PackedBatch):
        return data_batch
    batch = data_batch.to(_device_of(runner))
    _MOVED.batch = batch
    return batch


def _check_depth(prefetch_depth: Any) -> int:
    if isinstance(prefetch_depth, bool) or not isinstance(prefetch_depth, int) or prefetch_depth < 0:
        raise ValueError(f"mtc_loader: prefetch_depth must be an int >= 0 (0: no prefetching), got {prefetch_depth!r}")
    return prefetch_depth


def _check_by_epoch(by_epoch: Any, expected: bool, loop: str) -> None:
    """A schedule's ``by_epoch`` (kept by a child config's ``train_cfg``) must be the loop's kind."""
    if by_epoch is not None and bool(by_epoch) is not expected:
        other = "MTCIterBasedTrainLoop" if expected else "MTCEpochBasedTrainLoop"
        raise ValueError(f"mtc_loader: train_cfg has by_epoch={by_epoch!r}, which {loop} is not: use {other} "
                         "(with max_iters or max_epochs as the schedule gives)")


class _Pass:
    """One pass of mmengine's endless iterator (``_InfiniteDataloaderIterator``) over its
    DataLoader: the iterator it holds now, after the pass's first batch when the restart took it."""

    def __init__(self, endless: Any) -> None:
        self.endless = endless
        self._dataloader = endless._dataloader  # (PrefetchLoader: where the pipeline runs)
        self.first: Any = _NO_BATCH

    def __iter__(self) -> Iterator[Any]:
        first, self.first = self.first, _NO_BATCH
        it: Iterator[Any] = self.endless._iterator
        return it if first is _NO_BATCH else itertools.chain((first,), it)


_NO_BATCH = object()


class _PrefetchedPasses(_Prefetching):
    """The batches of mmengine's endless iterator, prefetched one pass of its DataLoader at a time:
    at a pass's end mmengine's restart (its warning, ``set_epoch``, a new DataLoader iterator, whose
    seed comes from torch's global generator) runs on the training thread in ``__next__``, where
    the plain loop runs it, never on the service thread during a step."""

    def __init__(self, endless: Any, device: torch.device, depth: int) -> None:
        self.endless = endless
        super().__init__(_Pass(endless), device, depth)

    def __next__(self) -> Any:
        try:
            return super().__next__()
        except StopIteration:
            pass
        self.endless._iterator = iter(())  # spent: mmengine's next() restarts it, here
        first = next(self.endless)
        self.loader.iterable.first = first  # type: ignore[attr-defined]
        self.it = iter(self.loader)
        return super().__next__()


_CKPT_KEY = "mtc_loader"  # the checkpoint's entry for the train loader's position


class _LoaderStateHook(Hook):  # type: ignore[misc]
    """Saves the position of the prefetching train loop's loader in every checkpoint (when its
    DataLoader is stateful) and hands the saved one back to the loop on resume."""

    priority = "VERY_LOW"

    def __init__(self, loop: "MTCEpochBasedTrainLoop") -> None:
        self.loop = loop

    def before_save_checkpoint(self, runner: Any, checkpoint: dict[str, Any]) -> None:
        state = self.loop._loader_state()
        if state is not None:
            checkpoint[_CKPT_KEY] = state

    def after_load_checkpoint(self, runner: Any, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get(_CKPT_KEY)
        meta = checkpoint.get("meta") or {}
        # applied only where runner.resume() puts the loop (a load_from leaves it at the start)
        self.loop._saved_position = None if saved is None else dict(
            saved, epoch=meta.get("epoch"), iter=meta.get("iter"))


class _StatsHook(Hook):  # type: ignore[misc]
    """Puts the prefetching train loop's figures (``train/data_bound``, ``train/data_wait_time``:
    see :class:`MTCEpochBasedTrainLoop`) in the runner's message hub after each training
    iteration, before ``LoggerHook`` (``BELOW_NORMAL``) takes the scalars of its log line."""

    priority = "NORMAL"  # after IterTimerHook (NORMAL, registered with the runner's default hooks)

    def __init__(self, loop: Union["MTCEpochBasedTrainLoop", "MTCIterBasedTrainLoop"]) -> None:
        self.loop = loop
        self.window: Optional[_Window] = None
        self.recent: deque[tuple[float, float, int]] = deque()  # (wait, step, batches) per iteration

    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None) -> None:
        loader = self.loop._prefetch
        if loader is None:
            return
        if self.window is None or self.window.stats is not loader._stats:  # a new loader
            self.window = _Window(loader, from_start=True)
            self.recent.clear()
        size = _window_size(runner)
        recent = self.recent
        wait, step, batches = self.window.delta()
        recent.append((wait, step, batches))
        while len(recent) > size:
            recent.popleft()
        figures = _figures(sum(r[0] for r in recent), sum(r[1] for r in recent), sum(r[2] for r in recent))
        hub = runner.message_hub
        if "data_bound" in figures:
            hub.update_scalar("train/data_bound", figures["data_bound"])
        if batches:  # the log processor's mean: the wait per batch over its window
            hub.update_scalar("train/data_wait_time", wait, count=batches)


def _window_size(runner: Any) -> int:
    """The window (iterations) over which the runner's log processor smooths its time figures."""
    size = getattr(runner.log_processor, "window_size", 10)  # mmengine's LogProcessor's default
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError("mtc_loader: the prefetching train loop logs data_bound over the log processor's "
                         f"window_size, which must be an int >= 1, got {size!r}; set "
                         "log_processor=dict(window_size=...) or the loop's log_stats=False")
    return size


def _check_log_stats(log_stats: Any) -> bool:
    if not isinstance(log_stats, bool):
        raise TypeError(f"mtc_loader: log_stats must be True or False, got {log_stats!r}")
    return log_stats


@LOOPS.register_module()
class MTCEpochBasedTrainLoop(EpochBasedTrainLoop):  # type: ignore[misc]
    """mmengine's ``EpochBasedTrainLoop`` with the batches prefetched on the model's device by
    :class:`~mtc_loader.PrefetchLoader` (batch k+1 copied on the copy stream while step k
    trains). Hooks and the model receive each batch on the device. Works with packed batches
    (``mtc_packed_collate``: one DMA each) and with plain ones.

    Resuming: over a stateful DataLoader (torchdata's ``StatefulDataLoader``, passed to the
    Runner as ``train_dataloader=StatefulDataLoader(...)``), every checkpoint holds the position
    after the last batch handed out (the loop's hook adds it under ``"mtc_loader"``), and
    ``runner.resume`` / ``resume=True`` continue the epoch at the batch after the last one
    trained on. Over a DataLoader that is not stateful, a checkpoint saved mid-epoch resumes at
    the start of that epoch, as mmengine's own loop does.

    In the logs: mmengine's ``IterTimerHook`` still writes ``data_time``, which with this loop is
    the time from the end of one iteration to the start of the next: the wait for the prefetched
    batch, plus the work of the hooks that run in between (writing the log line, saving a
    checkpoint) and, at an epoch's first iteration, the start of the epoch (the DataLoader's
    workers starting). Unless ``log_stats=False``, the loop adds two scalars to the runner's
    message hub at every iteration (``train/data_bound``, ``train/data_wait_time``), which the
    log lines (and the visualizer's backends) show:

    - ``data_bound``: the share of the loop's time spent waiting for the loader, over the last
      ``window_size`` iterations of the log processor (the window that smooths ``time`` and
      ``data_time``): near 0 when the batches are always ready, near 1 when the loop waits for
      data most of the time;
    - ``data_wait_time``: the loop's wait for each batch inside the loader, in seconds, averaged
      over that window as ``data_time`` is (it leaves out the hooks that ``data_time`` counts).

    :meth:`stats` gives the loader's figures over the run.

    Hooks and evaluators receive the batch the model receives (on the device), never a
    :class:`~mtc_loader.PackedBatch`; with ``prefetch_depth=0`` the loop does not prefetch, and
    each packed batch is unpacked on the training thread before the hooks run.

    Config: ``train_cfg=dict(type="MTCEpochBasedTrainLoop", max_epochs=..., prefetch_depth=2,
    log_stats=True)``. ``by_epoch=True``, which mmdet3d's schedules set, is accepted (a
    config's ``train_cfg`` with both ``type`` and ``by_epoch`` needs
    ``runner_type="MTCRunner"``: mmengine's ``Runner`` refuses the pair).
    """

    def __init__(self, runner: Any, dataloader: Any, max_epochs: int, *, prefetch_depth: int = 2,
                 log_stats: bool = True, by_epoch: Optional[bool] = None, **kwargs: Any) -> None:
        _check_by_epoch(by_epoch, True, "MTCEpochBasedTrainLoop")
        super().__init__(runner, dataloader, max_epochs, **kwargs)
        self.prefetch_depth = _check_depth(prefetch_depth)
        self.log_stats = _check_log_stats(log_stats)
        self._prefetch: Optional[PrefetchLoader] = None  # made at the first epoch, kept for all
        self._done = 0  # batches of the current epoch handed out (0 once it has ended)
        self._saved_position: Optional[dict[str, Any]] = None  # from the checkpoint resumed from
        runner.register_hook(_LoaderStateHook(self))
        if self.log_stats:
            runner.register_hook(_StatsHook(self))

    def stats(self) -> dict[str, Any]:
        """The loop's loader's :meth:`~mtc_loader.PrefetchLoader.stats`, over the run (empty
        before the first epoch)."""
        return self._prefetch.stats() if self._prefetch is not None else {}

    def _loader(self) -> PrefetchLoader:
        if self._prefetch is None or self._prefetch.iterable is not self.dataloader:
            self._prefetch = PrefetchLoader(self.dataloader, _device_of(self.runner), self.prefetch_depth)
        return self._prefetch

    def _loader_state(self) -> Optional[dict[str, Any]]:
        """What a checkpoint keeps of the loader: its state after the last batch handed out (the
        one the step that saves has trained on) and how many batches of the epoch that makes;
        None for a DataLoader that is not stateful."""
        if not _is_stateful(self.dataloader) or self.prefetch_depth == 0:
            return None
        state = self._prefetch.state_dict() if self._prefetch is not None else self.dataloader.state_dict()
        return {"train_dataloader": state, "batches_done": self._done}

    def _resume_position(self, loader: PrefetchLoader) -> int:
        """On the first epoch after ``runner.resume``: loads the saved state into the loader and
        returns the index of the epoch's next batch (0 otherwise)."""
        saved, self._saved_position = self._saved_position, None
        if saved is None or (saved["epoch"], saved["iter"]) != (self._epoch, self._iter):
            return 0
        loader.load_state_dict(saved["train_dataloader"])
        done: int = saved["batches_done"]
        return done

    def run_iter(self, idx: int, data_batch: Any) -> None:
        super().run_iter(idx, _unpacked(data_batch, self.runner))

    def run_epoch(self) -> None:
        if self.prefetch_depth == 0:
            super().run_epoch()  # mmengine's, with run_iter's unpacking before the hooks
            return
        self.runner.call_hook("before_train_epoch")
        self.runner.model.train()
        loader = self._loader()
        start = self._resume_position(loader)
        batches = _Prefetching(loader, _device_of(self.runner), self.prefetch_depth)
        try:
            for idx, data_batch in enumerate(batches, start):
                self._done = idx + 1
                self.run_iter(idx, data_batch)
                del data_batch
        finally:
            batches.close()
        self._done = 0
        self.runner.call_hook("after_train_epoch")
        self._epoch += 1


@LOOPS.register_module()
class MTCIterBasedTrainLoop(IterBasedTrainLoop):  # type: ignore[misc]
    """mmengine's ``IterBasedTrainLoop`` with the batches prefetched on the model's device by
    :class:`~mtc_loader.PrefetchLoader` (see :class:`MTCEpochBasedTrainLoop`).

    In the logs: ``data_time``, ``data_bound`` and ``data_wait_time`` as with
    :class:`MTCEpochBasedTrainLoop` (``log_stats=False`` leaves the last two out); :meth:`stats`
    gives the loader's figures over the run.

    The loop prefetches within one pass of the DataLoader: at a pass's end the DataLoader is
    restarted on the training thread when the loop asks for the next batch, as with the plain
    loop, so a run that ends with a pass restarts nothing. Hooks and evaluators receive the batch the
    model receives; ``prefetch_depth=0`` does not prefetch (see :class:`MTCEpochBasedTrainLoop`).

    Config: ``train_cfg=dict(type="MTCIterBasedTrainLoop", max_iters=..., prefetch_depth=2,
    log_stats=True)``; ``by_epoch=False`` is accepted.
    """

    def __init__(self, runner: Any, dataloader: Any, max_iters: int, *, prefetch_depth: int = 2,
                 log_stats: bool = True, by_epoch: Optional[bool] = None, **kwargs: Any) -> None:
        _check_by_epoch(by_epoch, False, "MTCIterBasedTrainLoop")
        super().__init__(runner, dataloader, max_iters, **kwargs)
        self.prefetch_depth = _check_depth(prefetch_depth)
        self.log_stats = _check_log_stats(log_stats)
        self._prefetch: Optional[PrefetchLoader] = None  # the loader of the run under way
        if self.log_stats:
            runner.register_hook(_StatsHook(self))

    def stats(self) -> dict[str, Any]:
        """The loop's loader's :meth:`~mtc_loader.PrefetchLoader.stats`, over the run (empty
        before it starts)."""
        return self._prefetch.stats() if self._prefetch is not None else {}

    def run_iter(self, data_batch: Any) -> None:
        super().run_iter(_unpacked(data_batch, self.runner))

    def run(self) -> Any:
        if self.prefetch_depth == 0:
            return super().run()
        endless: Any = self.dataloader_iterator  # type: ignore[has-type]
        passes = hasattr(endless, "_iterator") and hasattr(endless, "_dataloader")  # mmengine's own
        prefetching = (_PrefetchedPasses if passes else _Prefetching)(endless, _device_of(self.runner),
                                                                      self.prefetch_depth)
        self._prefetch = prefetching.loader
        self.dataloader_iterator = prefetching
        try:
            return super().run()
        finally:
            prefetching.close()
            self.dataloader_iterator = endless


# ------------------------------------------------------------------------- validation and test loops

@LOOPS.register_module()
class MTCValLoop(ValLoop):  # type: ignore[misc]
    """mmengine's ``ValLoop`` for a loader whose batches are packed (``mtc_packed_collate``):
    each :class:`~mtc_loader.PackedBatch` is unpacked on the model's device (one DMA) before
    the hooks run, so that hooks (``before_val_iter``, ``after_val_iter``), the model and the
    evaluator's metrics (``process(data_batch, data_samples)``) all receive the batch's
    structure. Other batches go through as with ``ValLoop``.

    Config: ``val_cfg=dict(type="MTCValLoop")`` (``ValLoop``'s arguments).
    """

    def run_iter(self, idx: int, data_batch: Any) -> None:
        try:
            super().run_iter(idx, _unpacked(data_batch, self.runner))
        finally:
            _MOVED.batch = None


@LOOPS.register_module()
class MTCTestLoop(TestLoop):  # type: ignore[misc]
    """mmengine's ``TestLoop`` with packed batches unpacked before the hooks (see
    :class:`MTCValLoop`).

    Config: ``test_cfg=dict(type="MTCTestLoop")`` (``TestLoop``'s arguments).
    """

    def run_iter(self, idx: int, data_batch: Any) -> None:
        try:
            super().run_iter(idx, _unpacked(data_batch, self.runner))
        finally:
            _MOVED.batch = None


from ._switch import MTCRunner, switch_config  # noqa: E402  (registers MTCRunner; needs the loops above)
