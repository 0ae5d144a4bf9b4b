"""The data preprocessor: :class:`MTCDataPreprocessor` in mmengine's ``MODELS``, wrapping the
model's own."""
from __future__ import annotations

import threading
from typing import Any, Optional, Union

from mmengine.model import BaseDataPreprocessor
from mmengine.registry import MODELS

from .._packed import PackedBatch
from ._collate import packed_collate

__all__ = ["MTCDataPreprocessor"]


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
        **inherited: Arguments of the wrapped preprocessor (those a child config inherits from
            its base's ``data_preprocessor``); the keys of a ``preprocessor`` dict win over them.
    """

    def __init__(self, preprocessor: Union[str, dict[str, Any], BaseDataPreprocessor, None] = None,
                 arena_bytes: Optional[Union[int, str]] = None, non_blocking: bool = False, **inherited: Any) -> None:
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
        """A packed batch unpacked on the device (one DMA per dtype), a prefetched one as it is, anything
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
