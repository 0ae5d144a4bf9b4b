"""``AsyncCopyHandle``: the Python face of one copy in flight (its C side: csrc/binding/handle.c)."""
from __future__ import annotations

from typing import Any

__all__ = ["AsyncCopyHandle"]


class AsyncCopyHandle:
    """Handle to an in-progress asynchronous copy started by :func:`start_copy`.

    Use :meth:`ready` to poll for completion without blocking, or :meth:`get` to block until
    the result is available. The handle must be kept alive until the copy is consumed or goes
    out of scope; dropping it early triggers a synchronous wait in the destructor to ensure
    staging buffers are not freed while transfers are in flight.
    """

    __slots__ = ("_h",)

    def __init__(self, _h: Any) -> None:
        self._h = _h

    def ready(self) -> bool:
        """Return whether the copy has completed.

        Returns:
            bool: ``True`` if the copy has completed (``get()`` would return without
                blocking), ``False`` otherwise.
        """
        return bool(self._h.ready())

    def get(self) -> Any:
        """Block until the copy is done and return the result.

        The returned structure mirrors the input to :func:`start_copy`, with all tensors copied
        to the target device. GPU-resident outputs are ready in order on the CUDA stream that
        was current at ``start_copy`` (like ``tensor.to(device, non_blocking=True)``): work
        queued on that stream sees the data; ``get()`` does not wait for the GPU to drain.

        Raises:
            RuntimeError: If the copy failed (``MemoryError`` when out of memory); the message
                names the leaf by its path in the structure.
        """
        return self._h.get()

    def __getitem__(self, key: Any) -> Any:
        # (also what a for loop over the handle, or unpacking it, reaches)
        raise TypeError("mtc_loader: an AsyncCopyHandle is a copy in flight, not its result: "
                        "handle.get() returns the copied structure")

    def __repr__(self) -> str:
        return f"<AsyncCopyHandle ready={self.ready()}>"
