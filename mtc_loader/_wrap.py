"""What the framework integrations (``mtc_loader.lightning``, ``mtc_loader.accelerate``) share:
a prefetching stand-in for a DataLoader, and the batch it yields.

Both frameworks move every batch with ``batch.to(device, ...)`` when the batch has a ``to``
method (Lightning's ``move_data_to_device``, accelerate's ``send_to_device``); otherwise they walk
the structure in Python and call ``tensor.to`` per tensor. A prefetched batch is on the device
already, so the loader yields it wrapped in :class:`OnDevice`, whose ``to`` hands the structure
back as it is: the framework's device placement costs one call per batch.
"""
from __future__ import annotations

from typing import Any, Generator, Iterable, Iterator

from . import _engine
from ._device import target_index
from .handle import AsyncCopyHandle
from .prefetch import PrefetchLoader
from .prefetch._loader import RESUMABLE, ResumablePrefetchLoader
from .prefetch._resume import STATE_METHODS, not_resumable

__all__ = ["OnDevice", "PrefetchingDataLoader"]


class OnDevice:
    """A batch that the prefetch service has already moved to a device.

    ``to(device)`` returns the structure itself when ``device`` is that device (the framework's
    device placement), and a copy of it on ``device`` otherwise.
    """

    __slots__ = ("batch", "index")

    def __init__(self, batch: Any, index: int) -> None:
        self.batch = batch
        self.index = index

    def to(self, device: Any, non_blocking: bool = False, **ignored: Any) -> Any:
        """The batch on ``device`` (the structure itself when it is there already)."""
        index = target_index(device)
        if index == self.index:
            return self.batch
        return AsyncCopyHandle(_engine.start_copy(self.batch, index, True, True, 16, 33554432, True)).get()

    def __repr__(self) -> str:
        where = "cpu" if self.index < 0 else f"cuda:{self.index}"
        return f"<OnDevice {where}: {type(self.batch).__name__}>"


class PrefetchingDataLoader(PrefetchLoader):
    """A :class:`~mtc_loader.PrefetchLoader` that stands in for the DataLoader it wraps: every
    attribute it does not have itself (``sampler``, ``batch_sampler``, ``dataset``,
    ``worker_init_fn``, ...) is the DataLoader's, so that a framework can still set the sampler's
    epoch, size the epoch and seed the workers; it yields :class:`OnDevice` batches.

    Over a stateful DataLoader (torchdata's ``StatefulDataLoader``) it has ``state_dict`` and
    ``load_state_dict``, those of :class:`~mtc_loader.PrefetchLoader`: the position after the
    last batch handed out, not the DataLoader's (which the service thread has moved ahead). Over
    any other it has neither, as the DataLoader, so that Lightning and accelerate do not take it
    for stateful.
    """

    def __getattr__(self, name: str) -> Any:
        # only reached for names the loader lacks; "iterable" missing means __init__ has not run
        # (copy / unpickling): no forwarding then
        iterable = self.__dict__.get("iterable")
        if iterable is None or name.startswith("__"):
            raise AttributeError(name)
        if name in STATE_METHODS:  # the DataLoader's own would tell where the service has got to
            raise not_resumable(type(self).__name__, name, iterable)
        return getattr(iterable, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # an attribute of the DataLoader that a framework sets after its processing (Lightning's
        # worker_init_fn) goes to the DataLoader; the loader's own stay here
        iterable = self.__dict__.get("iterable")
        if (iterable is None or name in _OWN or name.startswith("_") or name in self.__dict__
                or not hasattr(iterable, name)):
            object.__setattr__(self, name, value)
        else:
            setattr(iterable, name, value)

    def __iter__(self) -> Iterator[Any]:
        index = target_index(self.device)
        inner = super().__iter__()
        assert isinstance(inner, Generator)
        try:
            for batch in inner:
                yield OnDevice(batch, index)
        finally:
            inner.close()  # stops the service thread now, not when the generator is collected


class _ResumablePrefetchingDataLoader(PrefetchingDataLoader, ResumablePrefetchLoader):
    """A :class:`PrefetchingDataLoader` over a stateful DataLoader (``PrefetchingDataLoader(...)``
    makes one)."""


RESUMABLE[PrefetchingDataLoader] = _ResumablePrefetchingDataLoader

# what PrefetchLoader.__init__ sets (a DataLoader subclass may have attributes of these names)
_OWN = frozenset(("iterable", "device", "depth", "options", "gil_switch_interval", "produce_on_caller",
                  "numpy_to_tensors", "transform"))


def wrap(loader: Iterable[Any], device: Any, depth: int, options: dict[str, Any]) -> PrefetchingDataLoader:
    """The loader wrapped once (a loader already wrapped is returned as it is)."""
    if isinstance(loader, PrefetchingDataLoader):
        return loader
    return PrefetchingDataLoader(loader, device, depth, **options)
