"""The position the caller has reached in a stateful iterable: the snapshots that travel with the
batches, and what a loader over an iterable without state says when asked for one."""
from __future__ import annotations

import sys
from typing import Any, Callable

_NO_STATE = object()  # a batch of an iterable without state_dict (or no snapshot taken)
_UNSET = object()  # PrefetchLoader._state before its first hand-out: the iterable's own state


class _FailedSnapshot:
    """The service's snapshot of the iterable's state when ``state_dict()`` raised: the batch is
    handed out all the same, and ``PrefetchLoader.state_dict()`` raises while it is the last."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error.with_traceback(None)  # its frames would keep the iterator alive


# the object's type itself, past any __class__ property of a subclass (accelerate's stand-in
# reports the class of the DataLoader it wraps through one)
_set_class: Callable[[Any, type], None] = object.__dict__["__class__"].__set__
STATE_METHODS = ("state_dict", "load_state_dict")


def is_stateful(iterable: Any) -> bool:
    """Whether an iterable has a position to save (torchdata's ``StatefulDataLoader``, any object
    with ``state_dict`` and ``load_state_dict``)."""
    return callable(getattr(iterable, "state_dict", None)) and callable(getattr(iterable, "load_state_dict", None))


def _snapshots_may_change(iterable: Any) -> bool:
    """Whether what ``iterable.state_dict()`` returns may be changed by the iterable later (the
    service then deep-copies each snapshot). A ``StatefulDataLoader`` builds new dicts on every
    call (with workers, from states that crossed a pipe) and torch's and torchdata's samplers
    return new ones; it puts in as they are what other samplers' ``state_dict()`` return and,
    without workers, the dataset's."""
    module = sys.modules.get("torchdata.stateful_dataloader")
    loader_type = getattr(module, "StatefulDataLoader", None)
    if loader_type is None or not isinstance(iterable, loader_type):
        return True
    parts = [getattr(iterable, "sampler", None), getattr(iterable, "batch_sampler", None)]
    if not iterable.num_workers:
        parts.append(iterable.dataset)
    return any(callable(getattr(p, "state_dict", None))
               and not type(p).__module__.startswith(("torch.", "torchdata.")) for p in parts)


class _NotResumableError(AttributeError, TypeError):
    """``state_dict`` / ``load_state_dict`` of a PrefetchLoader whose iterable has no state: a
    TypeError for the caller, and an AttributeError, so that ``hasattr()`` (what Lightning and
    accelerate probe) says the loader has none."""


def not_resumable(owner: str, name: str, iterable: object) -> _NotResumableError:
    """The error of ``owner.name`` (a loader class's name, ``state_dict`` or ``load_state_dict``)
    where the loader wraps ``iterable``, which has no state."""
    return _NotResumableError(
        f"mtc_loader: {owner}.{name} needs an iterable with state_dict() and "
        f"load_state_dict(), and this one wraps a {type(iterable).__name__}, which has none; "
        "to save and resume the position in an epoch, wrap torchdata's StatefulDataLoader "
        "(from torchdata.stateful_dataloader import StatefulDataLoader; pip install torchdata) instead "
        "of a DataLoader")


class _Position:
    """The wrapped iterable's state after the last batch handed out (what the hand-out swaps in)."""

    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state: Any = _UNSET
