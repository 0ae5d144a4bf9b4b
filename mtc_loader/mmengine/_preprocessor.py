"""The data preprocessor: :class:`MTCDataPreprocessor` in mmengine's ``MODELS``, wrapping the
model's own."""
from __future__ import annotations

import threading
import warnings
from typing import Any, Callable, ContextManager, Optional, Union

from mmengine.model import BaseDataPreprocessor
from mmengine.registry import MODELS

from .._packed import PackedBatch
from ._collate import packed_collate

__all__ = ["MTCDataPreprocessor"]


class _Moved(threading.local):
    """The batch the prefetching train loop handed out last on this thread: already on the
    device, so the preprocessor does not move it again. Its ``forward`` clears the mark when it
    takes the batch (a later call with the same batch finds its tensors on the device and moves
    nothing either). ``ahead``: the wrapped preprocessor's result for that batch, made on the
    prefetch thread (an :class:`_Ahead`), or None. ``on_device``: the MTCDataPreprocessor whose
    wrapped preprocessor runs on this thread over a batch on the device already."""

    batch: Any = None
    ahead: Any = None
    on_device: Any = None


_MOVED = _Moved()


class _CastData:
    """Stands in for the wrapped preprocessor's ``cast_data``: nothing to do for a batch that is
    on the device already, the preprocessor's own ``cast_data`` otherwise."""

    def __init__(self, owner: "MTCDataPreprocessor") -> None:
        self.owner = owner

    def __call__(self, data: Any) -> Any:
        if _MOVED.on_device is self.owner:
            return data
        inner = self.owner.preprocessor
        return type(inner).cast_data(inner, data)


class _Ahead:
    """A batch handed out by the prefetch thread with the wrapped preprocessor's result for it
    (``training=True``), and the count of the owner's mode changes it was made under (-1: the
    mode changed while it was made)."""

    __slots__ = ("batch", "result", "owner", "changes")

    def __init__(self, batch: Any, result: Any, owner: "MTCDataPreprocessor", changes: int) -> None:
        self.batch, self.result, self.owner, self.changes = batch, result, owner, changes


class _RunAhead:
    """The prefetch thread's transform of a model whose preprocessor runs ahead: the wrapped
    preprocessor over the copied batch, in the autocast the step's optimizer wrapper enters."""

    def __init__(self, owner: "MTCDataPreprocessor", context: Callable[[], ContextManager[Any]]) -> None:
        self.owner, self.context = owner, context
        # what PrefetchLoader's errors name
        self.__qualname__ = f"{type(owner.preprocessor).__name__} (run ahead by MTCDataPreprocessor)"

    def __call__(self, batch: Any) -> _Ahead:
        owner = self.owner
        changes = owner._mode_changes
        outer, _MOVED.on_device = _MOVED.on_device, owner
        try:
            with self.context():
                result = owner.preprocessor(batch, True)
        finally:
            _MOVED.on_device = outer
        return _Ahead(batch, result, owner, changes if changes == owner._mode_changes else -1)


# the preprocessors known to be functions of their batch: exact types (a subclass may add state)
_RUNS_AHEAD = ("mmengine.model.base_model.data_preprocessor.BaseDataPreprocessor",
               "mmengine.model.base_model.data_preprocessor.ImgDataPreprocessor",
               "mmdet.models.data_preprocessors.data_preprocessor.DetDataPreprocessor",
               "mmdet3d.models.data_preprocessors.data_preprocessor.Det3DDataPreprocessor")


def _check_runs_ahead(pre: BaseDataPreprocessor) -> None:
    """Refuses a preprocessor that may not run ahead of the step: one with ``batch_augments``,
    one that draws random voxels, one of a type not known to be a function of its batch."""
    tp = type(pre)
    name = tp.__name__
    augments = getattr(pre, "batch_augments", None)
    if augments:
        kinds = ", ".join(type(a).__name__ for a in augments)
        raise ValueError(
            f"mtc_loader: MTCDataPreprocessor(run_ahead=True) cannot run {name} ahead of the step: its "
            f"batch_augments ({kinds}) may keep state or draw random numbers (BatchSyncRandomResize counts "
            "iterations, draws a size and broadcasts it across ranks), so running them on the prefetch thread "
            "would change their results. Leave run_ahead out (the preprocessor then runs in the training step), "
            "or remove batch_augments")
    if getattr(pre, "voxel_type", None) == "minkunet" and getattr(pre, "max_voxels", None) is not None:
        raise ValueError(
            f"mtc_loader: MTCDataPreprocessor(run_ahead=True) cannot run {name} ahead of the step: with "
            "voxel_type='minkunet' and max_voxels it draws the voxels it keeps at random (numpy's global "
            "generator). Leave run_ahead out (the preprocessor then runs in the training step)")
    if f"{tp.__module__}.{tp.__qualname__}" not in _RUNS_AHEAD and getattr(tp, "mtc_run_ahead", False) is not True:
        known = ", ".join(k.rsplit(".", 1)[1] for k in _RUNS_AHEAD)
        raise ValueError(
            f"mtc_loader: MTCDataPreprocessor(run_ahead=True) cannot run {name} ahead of the step: only "
            f"preprocessors known to be functions of their batch run ahead ({known}), and one of another type "
            "may keep state, draw random numbers or run collectives. Leave run_ahead out (the preprocessor "
            f"then runs in the training step), or, if {name} is a function of its batch (the same batch "
            "gives the same result, with no state, random numbers or collectives), set the class attribute "
            f"mtc_run_ahead = True on {name}")


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
    ``mtc_packed_collate``) is moved to the preprocessor's device with one DMA per dtype from the arena, a
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
            that trains, before the DataLoader starts): ``num_workers * prefetch_factor + 1``
            batches, plus ``depth`` on a GPU (the train loop's ``prefetch_depth``); an
            ``MTCIterBasedTrainLoop`` that validates inside a pass adds the validation loader's
            ``num_workers * prefetch_factor + 1``. ``None``: 256 MiB, or the arena an earlier
            model of this process created. A size larger than that arena replaces it for the
            loaders started from then on.
        non_blocking: As ``BaseDataPreprocessor``'s, for batches that are not packed (also
            passed on with the inherited arguments, when set).
        run_ahead: Whether the wrapped preprocessor runs on the prefetch thread, for batch k+1
            while step k trains (with :class:`MTCEpochBasedTrainLoop` or
            :class:`MTCIterBasedTrainLoop` prefetching), on the copy stream after the copy and
            in the autocast of an ``AmpOptimWrapper``; ``train_step``'s call then takes the
            finished result, bitwise what it would compute. Only a preprocessor that is a
            function of its batch may: ``BaseDataPreprocessor``, ``ImgDataPreprocessor``,
            mmdet's ``DetDataPreprocessor`` and mmdet3d's ``Det3DDataPreprocessor``, without
            ``batch_augments`` (and without random voxels: ``voxel_type='minkunet'`` with
            ``max_voxels``), or a class that sets ``mtc_run_ahead = True``; any other is refused
            here with a ``ValueError``. A batch made while the model's mode changed (validation
            inside an iteration loop) is made again in the step. Validation and test batches
            go through the preprocessor in the step (``training=False``; their loops do not
            prefetch). Hooks before the step see the batch's data samples as the preprocessor
            left them (mmdet's adds ``batch_input_shape`` and ``pad_shape`` to their metainfo).
        **inherited: Arguments of the wrapped preprocessor (those a child config inherits from
            its base's ``data_preprocessor``); the keys of a ``preprocessor`` dict win over them.
    """

    def __init__(self, preprocessor: Union[str, dict[str, Any], BaseDataPreprocessor, None] = None,
                 arena_bytes: Optional[Union[int, str]] = None, non_blocking: bool = False,
                 run_ahead: bool = False, **inherited: Any) -> None:
        super().__init__(non_blocking)
        if not isinstance(run_ahead, bool):
            raise TypeError(f"mtc_loader: MTCDataPreprocessor's run_ahead must be True or False, got {run_ahead!r}")
        preprocessor = _wrapped_config(preprocessor, inherited, non_blocking)
        if isinstance(preprocessor, dict):
            preprocessor = MODELS.build(preprocessor)
        if not isinstance(preprocessor, BaseDataPreprocessor):
            raise TypeError("mtc_loader: MTCDataPreprocessor wraps a BaseDataPreprocessor (or its config), "
                            f"got {type(preprocessor).__name__}")
        if run_ahead:
            _check_runs_ahead(preprocessor)
        self.preprocessor = preprocessor
        self.run_ahead = run_ahead
        self._mode_changes = 0  # train(mode) calls that changed the mode
        self._took_ahead = False  # a result made ahead was taken (else run_ahead warns once)
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

    def train(self, mode: bool = True) -> "MTCDataPreprocessor":
        if mode != self.training:  # (model.train() runs at every iteration of mmengine's loop)
            self._mode_changes += 1
        super().train(mode)
        return self

    def _move(self, data: Any) -> tuple[Any, bool]:
        """``(data on the device, True)`` for a packed or prefetched batch, else ``(data, False)``."""
        if isinstance(data, PackedBatch):
            return data.to(self.device), True
        if data is _MOVED.batch and data is not None:
            return data, True
        return data, False

    def cast_data(self, data: Any) -> Any:
        """A packed batch unpacked on the device (one DMA per dtype), a prefetched one as it is, anything
        else through the wrapped preprocessor's ``cast_data``."""
        data, moved = self._move(data)
        if moved:
            return data
        return type(self.preprocessor).cast_data(self.preprocessor, data)

    def forward(self, data: Any, training: bool = False) -> Any:
        data, moved = self._move(data)
        ahead = None
        # the model has its batch: the mark lets go of it, so that the batch is freed where the
        # loop drops it (after the step) rather than inside the next hand-out
        if moved and data is _MOVED.batch:
            _MOVED.batch = None
            ahead, _MOVED.ahead = _MOVED.ahead, None
        if training and self.run_ahead:
            if ahead is not None and ahead.owner is self and ahead.changes == self._mode_changes:
                self._took_ahead = True
                return ahead.result
            if ahead is None and not self._took_ahead:
                self._took_ahead = True  # (warned once)
                warnings.warn("mtc_loader: MTCDataPreprocessor(run_ahead=True) runs its preprocessor in the step: "
                              "the train loop does not prefetch. Use MTCEpochBasedTrainLoop or "
                              "MTCIterBasedTrainLoop with prefetch_depth >= 1 (runner_type='MTCRunner' does)",
                              stacklevel=2)
        if not moved:
            return self.preprocessor(data, training)
        outer, _MOVED.on_device = _MOVED.on_device, self
        try:
            return self.preprocessor(data, training)
        finally:
            _MOVED.on_device = outer
