"""Containers the C traversal does not handle itself, and diagnosis of bad leaves.

The engine walks exact ``list``, ``tuple`` and ``dict`` in C. For any other type it asks
:func:`classify` once (the answer is cached per type in C), and for the containers among them it
calls :func:`flatten` and, to rebuild, :func:`unflatten`. A leaf that fails the engine's fast
checks, and a container whose flatten raised, is handed to :func:`diagnose`, which raises an
exception naming its path, or returns a resolved replacement (lazily conjugated or negated
tensors). :data:`LEAF` marks a tensor's place in the skeleton of a packed batch.

Containers of other types are taught with :func:`register_container` (looked up along the
type's MRO, so a registered base class covers its subclasses); types registered with
``torch.utils._pytree`` are containers too. Both are resolved once per type, in
:func:`classify`: the per-instance cost is one dict lookup in :func:`flatten`.
"""
from __future__ import annotations

import copy as _copy
import dataclasses
import os
import pickle
import threading
import warnings
import weakref
from typing import Any, Callable, NamedTuple, Optional, Sequence

import numpy as np
import torch
import torch.utils._pytree as _pytree

from . import _engine
from ._dtypes import supported_dtype
from .files import FileTensor

LEAF_KIND, TENSOR, NDARRAY, GENERIC, FILE, HOST = 0, 1, 2, 3, 4, 5

_NAMEDTUPLE, _TUPLE, _LIST, _DICT, _DATACLASS, _STRUCTSEQ, _SAME, _REGISTERED, _TORCH = range(9)

_DISALLOW_INSTANTIATION = 1 << 7  # Py_TPFLAGS_DISALLOW_INSTANTIATION


class _Slot:
    """A placeholder in a packed batch's skeleton, pickled by reference (its module-level name):
    ``LEAF``, the place of a tensor; ``ATOM``, the place of a per-batch atom (a str, int, float,
    bool, None or bytes that is not a dict key) in the structure that batches of one shape
    share."""

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __reduce__(self) -> str:
        return self._name

    def __repr__(self) -> str:
        return f"<{self._name.lower()}>"


LEAF = _Slot("LEAF")
ATOM = _Slot("ATOM")


class OnHost:
    """Marks a value whose tensors cross the process boundary inside a packed batch but are placed
    on the host: in a :class:`~mtc_loader.PackedBatch`, the tensors under it are packed into the
    region like any other and come back as CPU tensors of their own memory (never views of the
    arena), whatever the target device; numpy arrays under it pass through as they are. The
    output holds ``value`` rebuilt, without the marker. :func:`~mtc_loader.start_copy` (a batch
    that is not packed) passes ``value`` through as it is, the same object, as ``.to()`` leaves
    what it does not move. Used by :mod:`mtc_loader.mmengine` for what mmengine leaves on the CPU
    (lists of tensors in data fields, tensors in metainfo)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __reduce__(self) -> tuple[Any, ...]:
        return (OnHost, (self.value,))

    def __repr__(self) -> str:
        return f"OnHost({self.value!r})"


class _Registration(NamedTuple):
    cls: type
    flatten: Callable[[Any], Any]
    unflatten: Callable[[list[Any], Any], Any]
    names: Optional[Callable[[Any], Sequence[str]]]
    source: int  # _REGISTERED (register_container) or _TORCH (torch.utils._pytree)


# register_container's registrations by class, and the registration each type met so far
# resolved to (along its MRO; torch's pytree for an exact type; None: none): a memo of
# _lookup, complete for every type it holds, read under the GIL
_REGISTRY: dict[type, _Registration] = {}
_RESOLVED: dict[type, Optional[_Registration]] = {}
# the engine's kind of each type met by element_kind (the mmengine registrations ask it)
_KINDS: dict[type, int] = {}
# Both memos hold their types strongly: bounded (as the engine's cache is), so that classes
# made per batch (namedtuples, dataclasses) are not kept alive. A change of the registrations
# bumps the generation under the lock; an answer computed across a change is used, not kept.
_MAX_TYPES = 512
_LOCK = threading.Lock()
_GEN = [0]

# handled by the C traversal before it asks classify: a registration would never be consulted
_NATIVE = (list, tuple, dict, str, bytes, int, float, bool, type(None))


# Registrations of classes named by their module and qualified name, for libraries that must not
# be imported to be known (mtc_loader.mmengine names mmdet's and mmdet3d's structure types): a
# class whose name matches is registered when the walk first meets it (or a subclass).
_BY_NAME: dict[str, tuple[Callable[[Any], Any], Callable[[list[Any], Any], Any],
                          Optional[Callable[[Any], Sequence[str]]]]] = {}


def register_container_by_name(qualname: str, flatten: Callable[[Any], Any],
                               unflatten: Callable[[list[Any], Any], Any], *,
                               names: Optional[Callable[[Any], Sequence[str]]] = None) -> None:
    """:func:`register_container` for the class named ``qualname`` (``module.QualName``, where
    the class is defined), without importing its module: it takes effect when a walk meets the
    class or one of its subclasses. A class registered by :func:`register_container` comes first."""
    with _LOCK:
        _BY_NAME[qualname] = (flatten, unflatten, names)
    _forget()


def _resolve(tp: type) -> Optional[_Registration]:
    """The registration of ``tp``'s nearest class along its MRO that has one (by class first, then
    by name, at each class)."""
    for base in tp.__mro__:
        reg = _REGISTRY.get(base)
        if reg is not None:
            return reg
        if _BY_NAME:
            named = _BY_NAME.get(f"{base.__module__}.{base.__qualname__}")
            if named is not None:
                return _Registration(base, named[0], named[1], named[2], _REGISTERED)
    return None


def _torch_node(tp: type) -> Optional[_Registration]:
    node = _pytree.SUPPORTED_NODES.get(tp)
    if node is None:
        return None
    return _Registration(tp, node.flatten_fn, node.unflatten_fn, None, _TORCH)


def _lookup(tp: type) -> Optional[_Registration]:
    """The registration instances of ``tp`` are walked with: register_container's along the MRO,
    else torch's pytree node of the exact type (but for the list, tuple and dict subclasses and
    the dataclasses, which are walked as such)."""
    reg = _resolve(tp)
    if reg is None and not issubclass(tp, (list, tuple, dict)) and not dataclasses.is_dataclass(tp):
        reg = _torch_node(tp)
    return reg


def _memo(table: dict[type, Any], tp: type, value: Any, gen: int) -> None:
    """Keeps ``value`` for ``tp`` unless the registrations changed since ``gen`` was read."""
    with _LOCK:
        if gen == _GEN[0]:
            if len(table) >= _MAX_TYPES:
                table.clear()
            table[tp] = value


def _registration(tp: type) -> Optional[_Registration]:
    """:func:`_lookup`'s answer, memoized. Never guessed from a memo another thread has just
    emptied: a miss looks the registrations up again."""
    try:
        return _RESOLVED[tp]
    except KeyError:
        pass
    gen = _GEN[0]
    reg = _lookup(tp)
    _memo(_RESOLVED, tp, reg, gen)
    return reg


def classify(tp: type) -> int:
    """How the traversal treats instances of ``tp`` (a type that is not exactly list/tuple/dict):
    the engine's question, asked once per type (its answer is cached in C). A class that is passed
    through as it is, although it has a ``to`` method (a class of the user's that holds tensors
    and moves them itself), is warned about once: the engine does not call that method."""
    kind = _classify(tp)
    if kind == LEAF_KIND and callable(getattr(tp, "to", None)):
        _warn_passed_through(tp)
    return kind


# the classes _warn_passed_through has warned about (weakly: classes made per batch may go)
_WARNED_TO: "weakref.WeakSet[type]" = weakref.WeakSet()


def _warn_passed_through(tp: type) -> None:
    with _LOCK:
        if tp in _WARNED_TO:
            return
        _WARNED_TO.add(tp)
    warnings.warn(
        f"mtc_loader: {_qualname(tp)} has a to() method but is not a container mtc_loader walks: "
        "its instances are passed through as the same objects, and the tensors they hold are not "
        f"copied (nor is its to() called). Register it with mtc_loader.register_container("
        f"{tp.__qualname__}, flatten, unflatten) to have its tensors copied, or move it yourself "
        "after the copy", UserWarning, stacklevel=2)


def _classify(tp: type) -> int:
    if issubclass(tp, torch.Tensor):
        return TENSOR
    if issubclass(tp, np.ndarray):
        return NDARRAY
    if issubclass(tp, FileTensor):
        return FILE
    if tp is OnHost:
        return HOST
    if _registration(tp) is not None or issubclass(tp, (list, tuple, dict)) or dataclasses.is_dataclass(tp):
        return GENERIC
    return LEAF_KIND


def element_kind(tp: type) -> int:
    """:func:`classify`'s answer for ``tp``, cached here until the registrations change."""
    k = _KINDS.get(tp)
    if k is None:
        gen = _GEN[0]
        if tp in _NATIVE:
            k = GENERIC if tp in (list, tuple, dict) else LEAF_KIND
        else:
            k = _classify(tp)
        _memo(_KINDS, tp, k, gen)
    return k


def _forget() -> None:
    """Every type is classified anew: after a registration changed. The generation moves first,
    so that no answer computed from the old registrations is kept after this."""
    with _LOCK:
        _GEN[0] += 1
        _RESOLVED.clear()
        _KINDS.clear()
    _engine._forget_types()


def _qualname(tp: type) -> str:
    return f"{tp.__module__}.{tp.__qualname__}"


def register_container(cls: type, flatten: Callable[[Any], tuple[Sequence[Any], Any]],
                       unflatten: Callable[[list[Any], Any], Any], *,
                       names: Optional[Callable[[Any], Sequence[str]]] = None) -> None:
    """Teach mtc_loader a container type: its instances (and those of its subclasses) are
    walked like lists and dicts by :func:`~mtc_loader.start_copy`,
    :class:`~mtc_loader.PackedCollate`, :class:`~mtc_loader.PrefetchLoader` and
    :meth:`~mtc_loader.PackedBatch.to`: the tensors they hold are copied, and each one comes
    back as the object ``unflatten`` builds (same class, its other fields as they were).

    The convention is ``torch.utils._pytree.register_pytree_node``'s: ``flatten(obj)`` returns
    ``(children, context)``, a list of the values to walk (tensors, arrays, nested containers;
    anything else is passed through) and whatever rebuilding needs; ``unflatten(values,
    context)`` returns the object holding ``values`` in the children's places. ``unflatten``
    must store the values without checking them (build with ``cls.__new__`` and set the
    attributes; do not run validating constructors): to describe a packed batch, mtc_loader calls
    it, and ``flatten`` again on its result, with a placeholder in each tensor's place. The
    children's order must survive that round trip and pickling (fixed field names, or a dict's
    insertion order; not a set's iteration order). The context of a packed batch's container
    travels to the main process pickled inside the object ``unflatten`` built.

    Types registered with ``torch.utils._pytree.register_pytree_node`` (exact types) are
    containers too, with no call to this function. Registrations are resolved once per type, the
    first time mtc_loader meets the type; a registration made later takes effect at once (the
    resolved answers are dropped). A DataLoader worker started by spawn or forkserver receives
    the registrations whose functions pickle by reference with the
    :class:`~mtc_loader.PackedCollate` it runs; register at import of the module that defines
    the class so that every process has them.

    Args:
        cls: The container class. Not ``list``, ``tuple``, ``dict`` or a scalar type (the
            traversal handles those itself), nor a tensor, numpy array or ``FileTensor`` type
            (leaves). Subclasses of ``list``, ``tuple`` and ``dict`` and dataclasses may be
            registered: the registration replaces their built-in handling.
        flatten: ``flatten(obj) -> (children, context)``.
        unflatten: ``unflatten(values, context) -> obj``.
        names: Optional ``names(context) -> sequence of str``: the children's attribute names,
            used only to name a leaf's path in error messages (``data[2].boxes``); without it,
            children are named by position (``data[2][0]``).

    Raises:
        TypeError: For an argument of the wrong kind or a type that cannot be registered.
        ValueError: When ``cls`` is registered already (:func:`unregister_container` first).
    """
    if not isinstance(cls, type):
        raise TypeError(f"mtc_loader.register_container: cls must be a class, got {cls!r} "
                        f"({type(cls).__name__})")
    what = _qualname(cls)
    for arg, fn in (("flatten", flatten), ("unflatten", unflatten), ("names", names)):
        if fn is None and arg == "names":
            continue
        if not callable(fn):
            raise TypeError(f"mtc_loader.register_container({what}): {arg} must be callable, got "
                            f"{fn!r} ({type(fn).__name__})")
    if cls in _NATIVE:
        raise TypeError(f"mtc_loader.register_container: {what} is walked by mtc_loader itself "
                        "(list, tuple and dict are containers, scalars and strings pass through); "
                        "register a subclass of it instead")
    for leaf, kind in ((torch.Tensor, "a tensor type"), (np.ndarray, "a numpy array type"),
                       (FileTensor, "a FileTensor type")):
        if issubclass(cls, leaf):
            raise TypeError(f"mtc_loader.register_container: {what} is {kind}, a leaf that is "
                            "copied as a whole; only containers that hold tensors can be registered "
                            "(wrap the tensor in a class of your own)")
    if cls in _REGISTRY:
        raise ValueError(f"mtc_loader.register_container: {what} is registered already; call "
                         f"mtc_loader.unregister_container({cls.__qualname__}) first to replace it")
    _REGISTRY[cls] = _Registration(cls, flatten, unflatten, names, _REGISTERED)
    _forget()


def unregister_container(cls: type) -> None:
    """Undo :func:`register_container` for ``cls`` (KeyError if it is not registered)."""
    if cls not in _REGISTRY:
        raise KeyError(f"mtc_loader.unregister_container: {cls!r} is not registered")
    del _REGISTRY[cls]
    _forget()


def _install(regs: tuple[Any, ...]) -> "_CarriedRegistrations":
    """In a process started by spawn or forkserver: the registrations its parent carried, unless
    this process registered the class itself (at import of the module that defines it). Each one
    travels as a pickle of its own: one that cannot be unpickled here (a class defined in the
    parent's ``__main__``: a notebook, ``python -c``, a REPL) is skipped, and said once, rather
    than failing the process's start-up."""
    lost = []
    for entry in regs:
        name, blob = entry
        try:
            cls, flatten, unflatten, names = pickle.loads(blob)
        except Exception as e:
            lost.append(f"{name} ({type(e).__name__}: {e})")
            continue
        if cls not in _REGISTRY:
            register_container(cls, flatten, unflatten, names=names)
    if lost and not _UNCARRIED_WARNED:
        _UNCARRIED_WARNED.append(True)
        warnings.warn(
            f"mtc_loader: process {os.getpid()} (a DataLoader worker started by spawn or forkserver) "
            f"could not receive {len(lost)} container registration(s) of the process that started it: "
            f"{'; '.join(lost)}. Instances of those classes are passed through here as they are, "
            "not walked (a class defined in __main__ of a notebook, python -c or a REPL cannot be "
            "found by such a process: define it in a module and register it at that module's "
            "import)", RuntimeWarning, stacklevel=2)
    return CARRIED


_UNCARRIED_WARNED: list[bool] = []


class _CarriedRegistrations:
    """Pickles as this process's registrations (those whose functions pickle): a
    :class:`~mtc_loader.PackedCollate` holds one, so that a DataLoader worker started by spawn or
    forkserver walks the same containers as the process that started it. Each registration
    travels as a pickle of its own, unpickled by :func:`_install`: one the receiving process
    cannot unpickle is skipped there."""

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, ...]:
        regs = []
        for r in _REGISTRY.values():
            for entry in ((r.cls, r.flatten, r.unflatten, r.names), (r.cls, r.flatten, r.unflatten, None)):
                try:
                    blob = pickle.dumps(entry)
                except Exception:  # a lambda or a local function: the worker must register itself
                    continue
                regs.append((_qualname(r.cls), blob))  # (without its names where only they do not pickle)
                break
        return (_install, (tuple(regs),))


CARRIED = _CarriedRegistrations()


class _Names:
    """The path segments of a registered container's children, computed only when an error
    message needs one."""

    __slots__ = ("reg", "context", "n", "_names")

    def __init__(self, reg: _Registration, context: Any, n: int) -> None:
        self.reg, self.context, self.n = reg, context, n
        self._names: Optional[list[Any]] = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> str:
        if self.reg.names is not None:
            if self._names is None:
                # names only builds messages: one that raises or returns too few names must not
                # hide the error being reported, so its children are then named by position
                try:
                    self._names = list(self.reg.names(self.context))
                except Exception:
                    self._names = []
            if i < len(self._names) and isinstance(self._names[i], str):
                return f".{self._names[i]}"
        return f"[{i}]"


def same_kind(exc: BaseException, msg: str) -> BaseException:
    """An exception of ``exc``'s class with ``msg`` (a RuntimeError where that class cannot be
    built from a message)."""
    try:
        new = type(exc)(msg)
        if str(new) == msg:
            return new
    except Exception:
        pass
    return RuntimeError(msg)


def _flatten_registered(reg: _Registration, obj: Any) -> tuple[list[Any], tuple[Any, ...]]:
    out = reg.flatten(obj)
    if not (isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[0], (list, tuple))):
        hint = (f"a {type(out).__name__} of {len(out)}" if isinstance(out, (tuple, list))
                else f"a {type(out).__name__}")
        raise TypeError(f"the flatten registered for {_qualname(reg.cls)} returned {hint}; it must "
                        "return (children, context): a list of the values to walk and what "
                        "unflatten needs to rebuild the object")
    children = list(out[0])
    return children, ((reg.source, reg.cls, out[1]), _Names(reg, out[1], len(children)))


def _unflatten_registered(kind: int, cls: type, context: Any, values: list[Any]) -> Any:
    reg = _registration(cls) if kind == _REGISTERED else _torch_node(cls)
    if reg is not None and reg.source != kind:
        reg = None
    if reg is None:
        raise TypeError(f"mtc_loader: {_qualname(cls)} is not a registered container in this process "
                        f"(pid {os.getpid()}): register it at import of the module that defines it, "
                        "so that every process has the registration")
    try:
        return reg.unflatten(values, context)
    except Exception as e:
        raise same_kind(e, f"mtc_loader: the unflatten registered for {_qualname(cls)} raised "
                            f"{type(e).__name__}: {e} (unflatten must store the values without "
                            "checking them: mtc_loader also passes placeholders in the tensors' "
                            "places to describe a packed batch)") from e


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


def _is_structseq(obj: Any) -> bool:
    """A C struct sequence (``os.stat_result``, ``time.struct_time``, ``torch.return_types.*``)."""
    tp = type(obj)
    return (isinstance(obj, tuple) and isinstance(getattr(tp, "n_sequence_fields", None), int)
            and isinstance(getattr(tp, "n_fields", None), int))


def flatten(obj: Any) -> tuple[list[Any], tuple[Any, ...]]:
    """Children of a container, and ``(context, path segments)`` to rebuild it and name them."""
    reg = _registration(type(obj))
    if reg is not None:
        return _flatten_registered(reg, obj)
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
    if not dataclasses.is_dataclass(obj):
        # its registration went away after the engine classified the type
        raise TypeError(f"{_qualname(type(obj))} is no longer a registered container")
    names = [f.name for f in dataclasses.fields(obj)]
    return [getattr(obj, n) for n in names], ((_DATACLASS, obj, names), [f".{n}" for n in names])


def unflatten(context: tuple[Any, ...], values: list[Any]) -> Any:
    """The container of ``context`` (same type, same attributes) holding ``values``."""
    kind = context[0]
    if kind == _REGISTERED or kind == _TORCH:
        return _unflatten_registered(kind, context[1], context[2], values)
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
_SPARSE_LAYOUTS = {torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc}


def _without_data(leaf: torch.Tensor, path: str) -> Optional[str]:
    """The message for a tensor that has no data of its own to copy (a fake tensor, a
    functionalized one, a wrapper subclass such as DTensor), or None."""
    fake_tensor = getattr(getattr(getattr(torch, "_subclasses", None), "fake_tensor", None), "FakeTensor", None)
    if fake_tensor is not None and isinstance(leaf, fake_tensor):
        return (f"mtc_loader: {path} is a fake tensor (made under FakeTensorMode, e.g. by torch.compile or "
                "a model built with fake tensors), which has no data to copy: copy real tensors, outside "
                "the FakeTensorMode")
    is_functional = getattr(torch, "_is_functional_tensor", None)
    if is_functional is not None and is_functional(leaf):
        return (f"mtc_loader: {path} is a functional tensor (torch._to_functional_tensor, functionalization), "
                "which wraps its data rather than holding it: copy torch._from_functional_tensor(t) (after "
                "torch._sync(t)), or pass plain tensors")
    if type(leaf) is not torch.Tensor and _python_dispatched(leaf) and not _has_data(leaf):
        name = _qualname(type(leaf))
        if hasattr(leaf, "full_tensor") or hasattr(leaf, "to_local"):
            todo = ("call .full_tensor() for the whole tensor (or .to_local() for this rank's shard) and "
                    "pass the result")
        else:
            todo = "convert it to a plain torch.Tensor first (the method the subclass offers for that)"
        return (f"mtc_loader: {path} is a {name}, a wrapper tensor subclass (with __torch_dispatch__, like "
                f"DTensor) whose data lives in the tensors it wraps, not in a storage of its own: {todo}, "
                "or pass plain tensors")
    return None


def _python_dispatched(leaf: torch.Tensor) -> bool:
    """Whether torch dispatches leaf's operators to Python (a subclass with __torch_dispatch__)."""
    try:
        return bool(torch._C._dispatch_keys(leaf).has(torch._C.DispatchKey.Python))
    except (AttributeError, RuntimeError, TypeError):
        return getattr(type(leaf), "__torch_dispatch__", None) is not getattr(
            torch.Tensor, "__torch_dispatch__", None)


def _has_data(leaf: torch.Tensor) -> bool:
    """Whether leaf's data pointer is one (a wrapper subclass's is 0, or raises)."""
    try:
        return leaf.numel() == 0 or bool(leaf.data_ptr())
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def _freed_storage(leaf: torch.Tensor, path: str) -> Optional[str]:
    """The message for a tensor whose storage is smaller than its elements need (freed with
    ``untyped_storage().resize_(0)``, as FSDP and activation offloading do), or None."""
    if leaf.numel() == 0:
        return None
    try:
        have = leaf.untyped_storage().nbytes()
        extent = leaf.storage_offset() + sum((n - 1) * abs(st) for n, st in zip(leaf.shape, leaf.stride())) + 1
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    need = extent * leaf.element_size()
    if have >= need:
        return None
    return (f"mtc_loader: {path} is a tensor whose storage was freed or shrunk (it holds {have} bytes, the "
            f"tensor's elements need {need}; e.g. untyped_storage().resize_(0), as FSDP and activation "
            "offloading do): copy it while its storage holds its data, or pass a tensor that owns its data")


def diagnose(leaf: Any, path: str, exc: BaseException | None) -> Any:
    """Raise an exception that names ``path`` and what to do; or return a resolved tensor."""
    if isinstance(leaf, np.ndarray):
        # (arrays of strings, bytes, objects, records and dates pass through before this: only
        # numeric and bool arrays are read as tensors)
        dt = leaf.dtype
        if not dt.isnative:
            raise TypeError(
                f"mtc_loader: {path} is a numpy array with non-native byte order ({dt.str}); "
                "convert it with arr.astype(arr.dtype.newbyteorder('='))")
        shown = str(dt) if str(dt) == dt.str else f"{dt} ({dt.str})"
        like = {"c": "np.complex128", "f": "np.float64"}.get(dt.kind, "np.int64")
        raise TypeError(
            f"mtc_loader: {path} is a numpy array of dtype {shown}, for which torch has no dtype; "
            f"convert it to one torch has first (e.g. arr.astype({like}))")
    if isinstance(leaf, torch.Tensor):
        if leaf.is_nested:  # before the layout: a jagged nested tensor has layout torch.jagged
            raise TypeError(
                f"mtc_loader: {path} is a nested tensor; only dense strided tensors are copied: pass "
                "its components as a list (list(nt.unbind())) or one "
                "padded tensor (torch.nested.to_padded_tensor(nt, 0.0)), or copy it separately "
                "with .to()")
        if leaf.layout != torch.strided or leaf.is_sparse:
            kind = "a sparse tensor" if leaf.is_sparse or leaf.layout in _SPARSE_LAYOUTS else "a tensor"
            raise TypeError(
                f"mtc_loader: {path} is {kind} (layout {leaf.layout}); only dense "
                f"strided tensors are copied: {_UNSUPPORTED_LAYOUT_HINT}")
        if leaf.is_quantized:
            raise TypeError(
                f"mtc_loader: {path} is a quantized tensor ({leaf.dtype}); dequantize() it "
                "first or copy it separately with .to()")
        without_data = _without_data(leaf, path)
        if without_data is not None:
            raise TypeError(without_data)
        if leaf.is_meta:
            raise TypeError(f"mtc_loader: {path} is a meta tensor, which has no data to copy")
        if leaf.device.type not in ("cpu", "cuda"):
            raise TypeError(
                f"mtc_loader: {path} lives on device {leaf.device}; only CPU and CUDA tensors "
                "are supported")
        freed = _freed_storage(leaf, path)  # before a resolution would read the missing bytes
        if freed is not None:
            raise TypeError(freed)
        if leaf.is_conj() or leaf.is_neg():
            # lazily conjugated/negated views: materialise the values, as .to() would
            try:
                return leaf.detach().resolve_conj().resolve_neg()
            except (NotImplementedError, RuntimeError) as e:
                # torch._neg_view of a dtype torch cannot negate (bool, unsigned wider than 8
                # bits, float8, bits*): its values do not exist, and .to() fails on it too
                raise TypeError(
                    f"mtc_loader: {path} is a lazily negated view (is_neg()) of dtype "
                    f"{leaf.dtype}, which torch cannot negate ({e}); pass the tensor it views, "
                    "or convert it to a dtype torch negates first") from e
        if not supported_dtype(leaf.dtype):
            raise TypeError(
                f"mtc_loader: {path} has dtype {leaf.dtype}, which mtc_loader cannot copy "
                "bytewise; convert it (e.g. .to(torch.uint8)) first")
        if exc is None:
            raise RuntimeError(
                f"mtc_loader: cannot read the tensor at {path} (a {_qualname(type(leaf))} of shape "
                f"{tuple(leaf.shape)}, dtype {leaf.dtype}, on {leaf.device}): torch gave no data pointer "
                "for it; pass a plain dense tensor that owns its data (t.detach().clone())")
        raise RuntimeError(f"mtc_loader: cannot read the tensor at {path}: {exc}") from exc
    if exc is not None:  # a container whose flatten raised
        reg = _registration(type(leaf))
        if reg is None:
            who = "flattening it"
        elif reg.source == _REGISTERED:
            who = "the flatten registered with mtc_loader.register_container"
        else:
            who = "the flatten registered with torch.utils._pytree"
        detail = str(exc) if isinstance(exc, TypeError) and str(exc).startswith("the flatten") \
            else f"{who} raised {type(exc).__name__}: {exc}"
        raise same_kind(exc, f"mtc_loader: {path} (a {_qualname(type(leaf))}): {detail}") from exc
    raise TypeError(f"mtc_loader: cannot copy {path} of type {type(leaf).__name__}")
