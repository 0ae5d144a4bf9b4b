"""The collate: ``mtc_packed_collate`` in mmengine's ``FUNCTIONS`` (:class:`PackedPseudoCollate`),
and what ``cast_data`` leaves on the host marked so."""
from __future__ import annotations

import functools
import gc
import multiprocessing
import threading
import weakref
from collections.abc import Mapping
from typing import Any, Callable, Optional, Sequence, Union

import torch
from mmengine.dataset import pseudo_collate
from mmengine.registry import FUNCTIONS
from mmengine.structures import BaseDataElement
from torch.utils.data import get_worker_info

from .. import _tree
from .._tree import OnHost
from .._arena import Arena, check_arena_bytes, set_unpack_hint
from .._packed import PackedBatch
from ..collate import PackedCollate
from ._elements import _COPY_METAINFO

__all__ = ["PackedPseudoCollate", "packed_collate"]


def place_as_cast_data(data: Any) -> Any:
    """``data`` with what ``BaseDataPreprocessor.cast_data`` leaves on the host marked so
    (:class:`~mtc_loader._tree.OnHost`), where it holds tensors the walk would otherwise move
    (boxes or points outside data samples) or is a numpy array (which ``cast_data`` keeps as
    one): cast_data's own recursion, through mappings, named tuples and sequences, moving only
    tensors and data elements (and FileTensors, which it never sees: they become tensors)."""
    if isinstance(data, Mapping):  # (cast_data makes every mapping a dict)
        return {k: place_as_cast_data(data[k]) for k in data}
    if isinstance(data, (str, bytes)) or data is None:
        return data
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(place_as_cast_data(v) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(place_as_cast_data(v) for v in data)
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
    marked where ``cast_data`` would leave it on the host (:func:`place_as_cast_data`)."""

    def __init__(self, fn: Callable[[list[Any]], Any]) -> None:
        self.fn = fn

    def __call__(self, samples: list[Any]) -> Any:
        return place_as_cast_data(self.fn(samples))


# what an arena too small tells PackedCollate's users, and what mmengine's configure
_ARENA_HINT = "PackedCollate(arena_bytes=...)"
_ARENA_HINT_MM = ("MTCDataPreprocessor(arena_bytes=...): a line model = dict(data_preprocessor=dict("
                  "arena_bytes=...)) in the config (the switch hands it to MTCDataPreprocessor, not to the "
                  "preprocessor it wraps), switch_config(cfg, arena_bytes=...), or python3 -m mtc_loader.mmengine "
                  "train's --arena-bytes,")


# what a PackedBatch read as its structure (by a hook of mmengine's own loops) tells the user
_UNPACK_HINT_MM = (
    "mmengine's own loops (EpochBasedTrainLoop, IterBasedTrainLoop, ValLoop, TestLoop) hand the hooks the "
    "batch as the loader made it. Set runner_type = \"MTCRunner\" in the config (built with RUNNERS.build(cfg) "
    "or MTCRunner.from_cfg(cfg)), or name mtc_loader's loops (train_cfg=dict(type=\"MTCEpochBasedTrainLoop\", "
    "...) or \"MTCIterBasedTrainLoop\", val_cfg=dict(type=\"MTCValLoop\"), test_cfg=dict(type=\"MTCTestLoop\")): "
    "they unpack each packed batch on the model's device before the hooks run")


def _workers_packing_with(collate: "PackedPseudoCollate") -> list[Any]:
    """The live DataLoader worker processes whose collate_fn is ``collate`` (or mmengine's
    ``functools.partial`` of it), found through their loaders' iterators (a process object forgets
    its target once started). A torch without that iterator class: every live child counts."""
    from torch.utils.data import dataloader
    starting = getattr(dataloader, "_MultiProcessingDataLoaderIter", None)
    if starting is None:
        return multiprocessing.active_children()
    found: list[Any] = []
    for it in gc.get_objects():  # only when an arena is replaced, which is rare
        if not isinstance(it, starting) or getattr(it, "_shutdown", False):
            continue
        fn = getattr(it, "_collate_fn", None)
        while isinstance(fn, functools.partial):
            fn = fn.func
        if fn is collate:
            found += [w for w in getattr(it, "_workers", ()) if w.is_alive()]
    return found


class _Replaced:
    """An arena replaced by a larger one, held while the DataLoader workers started on it live
    (persistent ones included): they pack into it until their loader ends. Batches already in
    this process hold it themselves, so it is unmapped once the last of them and those workers
    are gone. Without such workers nothing holds it here."""

    def __init__(self, owner: "PackedPseudoCollate", arena: Arena) -> None:
        workers = _workers_packing_with(owner)
        self.arena: Optional[Arena] = arena if workers else None
        self.left = len(workers)
        for w in workers:  # a worker's process object goes when its loader has ended
            weakref.finalize(w, self._gone)

    def _gone(self) -> None:
        self.left -= 1
        if self.left <= 0:
            self.arena = None  # (the empty record is dropped by the next arm())


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
        self._retired: list[_Replaced] = []  # replaced by a larger one, with loaders still on them
        self._lock = threading.Lock()

    def arm(self, arena_bytes: Optional[Union[int, str]] = None) -> Arena:
        """Creates the arena (``arena_bytes``; ``None``: 256 MiB) unless it exists; returns it. Call
        it in the process that trains, before the DataLoader starts. A later call with an
        ``arena_bytes`` larger than the arena (a model rebuilt with a larger one in the same
        process, as in a notebook after the arena's message) replaces it with one of that size for
        the loaders started from then on. The loaders started before keep the old one until they
        end (it is held while their workers live), and batches already in it unpack as before
        (each holds it): it is unmapped once both are gone. ``None``, or no more than the arena
        holds, keeps it. ``arena_bytes`` is checked as :class:`~mtc_loader.Arena` checks it."""
        want = None if arena_bytes is None else check_arena_bytes(arena_bytes)
        with self._lock:
            self._retired = [r for r in self._retired if r.arena is not None]
            if self.arena is not None and want is not None and get_worker_info() is None:
                if want > self.arena.stats()["bytes"]:
                    replaced = _Replaced(self, self.arena)
                    if replaced.arena is not None:
                        self._retired.append(replaced)
                    self.arena = None
                    self._packers.clear()  # each held the arena it packed into
            if self.arena is None:
                if get_worker_info() is not None:
                    raise RuntimeError(
                        "mtc_loader: mtc_packed_collate runs in a DataLoader worker that received no arena: "
                        "its arena must be created in the training process before the DataLoader starts "
                        "its workers. Use data_preprocessor=dict(type='MTCDataPreprocessor', ...) in the "
                        "model's config (it creates the arena when the model is built), or call "
                        "mtc_loader.mmengine.packed_collate.arm() before training")
                if want is not None:
                    self.arena_bytes = want
                self.arena = Arena(self.arena_bytes)
                set_unpack_hint(self.arena, _UNPACK_HINT_MM)
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
                "the PrefetchLoader depth", "the train loop's prefetch_depth")) from None
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
