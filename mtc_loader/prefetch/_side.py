"""The copy streams, and one batch's copy issued on its device's copy stream (:class:`SideCopy`,
:func:`start_side_copy`): the unit of work of the prefetch service."""
from __future__ import annotations

import threading
from typing import Any, Optional

import numpy as np
import torch

from .. import _engine
from .._device import target_index
from .._packed import PackedBatch
from ..copy import start_copy, start_copy_keeping
from ..handle import AsyncCopyHandle
from ._resume import _NO_STATE

# MTC_C_HANDOFF (read once, here; default on): a batch's finish (Handle.finish) and its hand-out
# (_engine.hand_out) are one C call each; off, each is the several calls of the Python way
# (the reference the C way is measured against). The hand-out takes the Python way by itself
# where libtorch_cuda's current-stream getter is not in use (no shim, MTC_TORCH_SHIM=0).
# mtc_loader.stats() counts both ways: side_finish_c / side_finish_python and hand_out_c /
# hand_out_python (CUDA batches only).
_C_HANDOFF = bool(_engine._c_handoff()[0])
_HANDLE = _engine.mtc_handle
_PYTHON_WAYS = {"side_finish_python": 0, "hand_out_python": 0}


def python_ways() -> dict[str, int]:
    """The CUDA batches finished and handed out the Python way (merged into mtc_loader.stats())."""
    return dict(_PYTHON_WAYS)


_COPY_STREAMS: dict[int, "torch.cuda.Stream"] = {}
_COPY_RAW: dict[int, int] = {}  # the raw handles of _COPY_STREAMS
_STREAMS_LOCK = threading.Lock()


def copy_stream(device: Any) -> "torch.cuda.Stream":
    """The dedicated copy stream of a CUDA device (one per device and process, created on first
    use), on which :class:`PrefetchLoader` and :func:`start_side_copy` issue their copies.

    Args:
        device: A CUDA device (``"cuda"`` means the current device).

    Raises:
        ValueError: For a device that is not a CUDA device.
    """
    index = target_index(device)
    if index < 0:
        raise ValueError(f"mtc_loader: copy_stream needs a CUDA device, got {device!r}")
    return _copy_stream(index)


def _raw_current_stream(index: int) -> int:
    """The raw handle (``cudaStream_t``) of the calling thread's current stream on a device."""
    get = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if get is not None:  # no Stream object built: a few hundred ns
        return int(get(index))
    return int(torch.cuda.current_stream(index).cuda_stream)


def _copy_stream(index: int) -> "torch.cuda.Stream":
    stream = _COPY_STREAMS.get(index)
    if stream is None:
        with _STREAMS_LOCK:
            stream = _COPY_STREAMS.get(index)
            if stream is None:
                stream = torch.cuda.Stream(device=index)  # type: ignore[no-untyped-call]
                _COPY_RAW[index] = int(stream.cuda_stream)
                _COPY_STREAMS[index] = stream
    return stream


class SideCopy:
    """A copy issued on the device's copy stream (:func:`start_side_copy`); :meth:`get` hands the
    result to the calling thread's current stream without a CPU synchronisation."""

    __slots__ = ("_handle", "_index", "_result", "_event", "_buffers", "_keep", "_recorded", "_done", "_state")

    def __init__(self, handle: Any, index: int) -> None:
        # the engine's handle (an AsyncCopyHandle's, or one PackedBatch._start made)
        self._handle = handle._h if isinstance(handle, AsyncCopyHandle) else handle
        self._index = index
        self._result: Any = None
        self._event = 0  # raw handle of the copy stream's pooled event (_engine.event_record), 0: none
        self._buffers: list[torch.Tensor] = []
        # the temporary views the engine made on the way to the outputs: dropping a tensor releases
        # the GIL, and the service thread, sharing it with a launch-bound training thread, would
        # wait for a forced switch after each; they are dropped with the buffers at hand-out
        self._keep: Optional[list[torch.Tensor]] = None
        self._recorded: Optional[int] = None  # raw handle of the stream the buffers are recorded on
        self._done = False
        # PrefetchLoader: the wrapped iterable's state_dict() right after this batch was taken
        self._state: Any = _NO_STATE

    def ready(self) -> bool:
        """True when :meth:`get` would return without waiting for the CPU side of the copy (the
        GPU side may still run: :meth:`get` makes the caller's stream wait for it)."""
        return self._done or self._handle.ready()

    def _finish(self, consumer: Optional["torch.cuda.Stream"] = None) -> None:
        """Waits (GIL released) until every copy is enqueued on the copy stream and the output
        structure is built, then records the copy stream's event. Any thread may call it; the
        copy stream must be the one the copy was started on.

        ``consumer``: the stream expected to use the batch; its buffers are recorded on it now
        (``record_stream`` only adds the stream to what the allocator waits for when the memory
        is freed, so recording early is as safe as at hand-out), which spares the hand-out the
        torch calls (each releases and retakes the GIL) when the prediction holds.
        """
        if self._done:
            return
        h, index = self._handle, self._index
        raw = 0
        if index >= 0:
            if index not in _COPY_RAW:
                _copy_stream(index)
            raw = _COPY_RAW[index]
        if _C_HANDOFF and type(h) is _HANDLE:
            # one C call: the wait (GIL released), the outputs, the temporaries, the buffers, and
            # a pooled driver event recorded on the copy stream with the GIL held (torch's
            # Event.record releases it, and the service thread then waits for a launch-bound
            # training thread to give it back)
            self._result, self._keep, self._buffers, self._event = h.finish(index, raw)
        else:
            self._result = h.get()
            self._keep = h.temporaries()
            if index >= 0:
                self._buffers = h.buffers()
                self._event = _engine.event_record(index, raw)
                _PYTHON_WAYS["side_finish_python"] += 1
        if index >= 0 and consumer is not None:
            # Tensor.record_stream has no entry in torch's C shim: it stays a Python call, one per
            # buffer (one tensor per dtype of the batch's chunk, not each output)
            for buf in self._buffers:
                buf.record_stream(consumer)
            self._recorded = int(consumer.cuda_stream)
        self._handle = None  # the engine's handle is no longer needed
        self._done = True

    def _replace(self, result: Any, consumer: Optional["torch.cuda.Stream"]) -> None:
        """Replaces the finished result with ``result``: what PrefetchLoader's transform returned,
        run on this thread after :meth:`_finish`, with the copy stream current. On a GPU, the
        event is recorded again, after the transform's kernels, and the CUDA tensors of
        ``result`` join the buffers: they are recorded on ``consumer`` now, and on the
        hand-out's stream if that one differs, since the transform allocated them on the copy
        stream."""
        assert self._done
        self._result = result
        index = self._index
        if index < 0 or not self._event:
            return
        found = _device_tensors(self._result, index)
        if consumer is not None:
            for t in found:
                t.record_stream(consumer)
        self._buffers.extend(found)
        event, self._event = self._event, 0
        _engine.event_release(index, event)
        self._event = _engine.event_record(index, _COPY_RAW[index])

    def _hand_to_current(self) -> Optional["torch.cuda.Stream"]:
        """Makes the calling thread's current stream wait (on the GPU) for the copy's event and
        records the buffers on it unless :meth:`_finish` already did. No call here releases the
        GIL. Returns the current stream when its buffers had to be recorded here (the prediction
        missed), else None."""
        assert self._event
        event, self._event = self._event, 0
        # one C call: the current stream read through libtorch_cuda's shim getter, its wait for
        # the event, and the event's release; None where the getter is not in use
        raw = _engine.hand_out(self._index, event) if _C_HANDOFF else None
        if raw is None:
            raw = _raw_current_stream(self._index)
            _PYTHON_WAYS["hand_out_python"] += 1
            try:
                _engine.stream_wait_event(self._index, raw, event)
            finally:  # the wait took the record's state: the event is free again
                _engine.event_release(self._index, event)
        fresh = None
        if raw != self._recorded:
            fresh = torch.cuda.current_stream(self._index)
            for buf in self._buffers:
                buf.record_stream(fresh)
        self._buffers = []
        self._keep = None
        return fresh

    def get(self) -> Any:
        """The copied structure, usable in order on the calling thread's current stream.

        The current stream waits (on the GPU) for the copy stream's event, and every output
        buffer is recorded on it (``Tensor.record_stream``), so the caching allocator does not
        reuse the memory while kernels queued there may still read it.

        Raises:
            RuntimeError: If the copy failed (as :meth:`AsyncCopyHandle.get`).
        """
        self._finish()
        if self._event:
            self._hand_to_current()
        return self._result

    def __del__(self) -> None:
        if getattr(self, "_event", 0):  # never handed out: its event goes back to the pool
            try:
                _engine.event_release(self._index, self._event)
            except Exception:  # interpreter shutdown
                pass


_ATOMS = (str, bytes, int, float, complex, type(None), np.ndarray, np.generic, torch.device, torch.dtype,
          type, torch.nn.Module)


def _device_tensors(obj: Any, index: int) -> list[torch.Tensor]:
    """The tensors on CUDA device ``index`` in ``obj``: in lists, tuples, sets, dicts (keys and
    values) and the attributes of any other object (``__dict__`` and ``__slots__``), each
    object visited once."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, _ATOMS) or id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            if o.get_device() == index:
                found.append(o)
        elif isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
        else:
            attrs = getattr(o, "__dict__", None)
            if isinstance(attrs, dict):
                stack.extend(attrs.values())
            for cls in type(o).__mro__:
                slots = cls.__dict__.get("__slots__", ())
                for name in (slots,) if isinstance(slots, str) else slots:
                    if name in ("__dict__", "__weakref__"):
                        continue
                    if name.startswith("__") and not name.endswith("__"):  # a private name, mangled
                        name = f"_{cls.__name__.lstrip('_')}{name}"
                    stack.append(getattr(o, name, None))
    return found


def start_side_copy(data: Any, device: Any, **start_copy_options: Any) -> SideCopy:
    """Start copying ``data`` (a nested structure or a :class:`~mtc_loader.PackedBatch`) to
    ``device`` on the device's dedicated copy stream (:func:`copy_stream`) instead of the current
    stream, so that the DMA overlaps the kernels queued on the current stream.

    Unlike :func:`~mtc_loader.start_copy`, the copy does not wait for work queued earlier on the
    caller's stream; :meth:`SideCopy.get` makes the caller's current stream wait for the copy
    instead. This is what :class:`PrefetchLoader` does for every batch. For ``"cpu"`` it is
    ``start_copy``. Inputs that live on a GPU must therefore be complete: a tensor that kernels
    queued on another stream are still writing would be read early (host inputs, the usual case,
    have no such concern).

    Args:
        data: The structure to copy, or a packed batch.
        device: Target device.
        **start_copy_options: Passed to :func:`~mtc_loader.start_copy`.
    """
    index = target_index(device)
    if index < 0:
        return SideCopy(_start(data, device, start_copy_options), index)
    with torch.cuda.stream(_copy_stream(index)):
        return SideCopy(_start(data, index, start_copy_options), index)


def _start(batch: Any, device: Any, options: dict[str, Any], keep_numpy: bool = False) -> Any:
    """The copy of one batch started: the engine's handle of a packed batch (its region DMA'd,
    the structure built), or an AsyncCopyHandle. ``keep_numpy``: numpy arrays stay numpy arrays
    on the host (a PrefetchLoader's batches keep the types their collate made)."""
    if type(batch) is PackedBatch and (not options or set(options) == {"use_background_thread"}):
        return batch._start(target_index(device), bool(options.get("use_background_thread", True)))
    if isinstance(batch, PackedBatch):
        return batch.start_copy(device, **options)
    if keep_numpy:
        return start_copy_keeping(batch, device, True, **options)
    return start_copy(batch, device, **options)
