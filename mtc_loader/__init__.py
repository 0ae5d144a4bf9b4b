"""mtc_loader: fast asynchronous copies of nested batches of many small tensors.

Three ways in, one C engine:

- :func:`start_copy` / :class:`AsyncCopyHandle`: copy a nested structure to a device.
- :class:`PackedCollate`: a DataLoader ``collate_fn`` that packs each batch into a shared arena.
- :class:`PrefetchLoader`: a daemon thread copies the next batches on the device's copy stream.
- :func:`start_side_copy` / :func:`copy_stream`: one copy on the copy stream, for a custom loop.
- :func:`register_container`: teach the traversal a container type of your own (mmengine's data
  elements: :mod:`mtc_loader.mmengine`).
- :class:`FileTensor`: a leaf naming bytes in a file, read by io_uring straight into the batch's
  pinned memory when it is packed or copied (:func:`file_reader` says how reads run here).
- :func:`stats`, :func:`configure`, :func:`trim`: the engine's counters and settings.
"""
from __future__ import annotations

import atexit
import sys
from typing import Any, Optional

import torch  # noqa: F401  (the engine reaches torch through objects _setup hands it)


def _source_folder_error() -> Optional[ImportError]:
    """The error to raise when this package is a source folder whose C engine was never built:
    Python's own message ("partially initialized module ... circular import") misleads. None
    where an engine file is here (then the import's own error says what is wrong with it)."""
    import importlib.machinery
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    if any(os.path.exists(os.path.join(here, "_engine" + s)) for s in importlib.machinery.EXTENSION_SUFFIXES):
        return None
    parent = os.path.dirname(here)
    others = [p for p in sys.path if os.path.abspath(p or os.curdir) != parent]
    spec = importlib.machinery.PathFinder.find_spec(__name__, others)
    installed = spec.submodule_search_locations[0] if spec and spec.submodule_search_locations else None
    build = ("build the engine in place (`python3 setup.py build_ext --inplace` in the repository "
             "root) or install it editable (`python3 -m pip install -e .`)")
    if installed:
        return ImportError(
            f"mtc_loader was imported from the source folder {here}, whose C engine (_engine) is not "
            f"built; it hides the installed mtc_loader in {installed}, because {parent} comes first "
            f"on sys.path (the current directory, or PYTHONPATH). Run Python from another folder to "
            f"use the installed package, or {build}.", name=__name__)
    return ImportError(
        f"mtc_loader was imported from the source folder {here}, whose C engine (_engine) is not "
        f"built: {build}, or install the package (`python3 -m pip install .`) and run Python from "
        f"another folder.", name=__name__)


try:
    from . import _engine
except ImportError:
    _err = _source_folder_error()
    if _err is None:
        raise
    raise _err from None
from . import _setup, _stack  # noqa: F401,E402  (_setup configures the engine on import)
from ._options import positive_int, warn_environment
from ._tree import register_container, unregister_container
from .collate import Arena, PackedBatch, PackedCollate
from .copy import AsyncCopyHandle, start_copy
from .files import FileTensor, file_reader
from .prefetch import PrefetchLoader, SideCopy, copy_stream, start_side_copy
from .prefetch._side import python_ways

__all__ = ["AsyncCopyHandle", "start_copy", "PackedCollate", "PackedBatch", "PrefetchLoader", "Arena",
           "SideCopy", "copy_stream", "start_side_copy", "FileTensor", "file_reader", "stats", "configure",
           "trim", "output_maker", "register_container", "unregister_container"]
__version__ = "0.1.0"

# The framework integrations, imported on first attribute access (PEP 562), so that
# `mtc_loader.lightning.PrefetchCallback()` works after a plain `import mtc_loader` while
# `import mtc_loader` itself imports none of the frameworks.
_SUBMODULES = ("lightning", "accelerate", "mmengine")


def __getattr__(name: str) -> object:
    if name in _SUBMODULES:
        import importlib
        try:
            return importlib.import_module(f"{__name__}.{name}")  # also sets it as an attribute
        except ImportError as e:
            # The framework is missing: no such attribute, so that hasattr(), dir()-walking
            # tools (inspect.getmembers, help, IDEs) and getattr(..., default) see none.
            # `import mtc_loader.<name>` still raises the ImportError that says what to install.
            raise AttributeError(f"module {__name__!r} has no attribute {name!r} ({e})", name=name,
                                 obj=sys.modules[__name__]) from e
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_SUBMODULES))


def stats() -> dict[str, int]:
    """The engine's counters: calls, tensors by path (packed, reused, staged, ...), bytes per
    direction, DMA calls, per-stage times in ns, pinned-memory use (held, in use, high water,
    waits at the cap), threads; file-backed reads of this process by path (``file_reads_uring``,
    ``file_reads_pread``: file parts read; ``file_bytes_read``, and its bytes by route:
    ``file_bytes_cached`` copied from the page cache by the helpers, ``file_bytes_direct`` and
    ``file_bytes_buffered`` read through io_uring, ``file_bytes_pread`` by the pread reader;
    ``file_reads_direct``: O_DIRECT segments, ``file_direct_refused``: files whose filesystem
    refused O_DIRECT, ``file_uring_submits``, ``file_short_reads``, ``file_read_errors``)."""
    out = _engine.stats()
    out.update(python_ways())  # the prefetch service's batches the Python way (MTC_C_HANDOFF)
    warn_environment()  # a variable first read since import (the pinned cap, by this call)
    return out


def output_maker() -> dict[str, Any]:
    """How this process makes the output tensors of packed batches and reads the tensors it
    copies: ``{"maker": "shim" | "split", "reason": str | None, "wrap": bool, "reader": "shim" |
    "dlpack" | "attributes", "library": str | None, "reasons": {route: str | None}}``.

    ``"shim"``: through torch's AOTInductor C shim (where this torch has it: 2.11 and 2.13 do),
    one C call per output, a fraction of a microsecond of the GIL per tensor; ``wrap`` True: each
    output becomes a Python tensor through torch's own wrapper, one more C call (where this
    torch passed the check at import), else a batch's outputs go through one Python call.
    ``"split"``: with torch's split operators, one or two operator calls per group of tensors,
    plus a piece for every alignment gap between tensors (three to four times the GIL time
    per tensor); ``reason`` says why. ``reader``: how each tensor's metadata is read: through
    the shim's getters, torch's DLPack exchange table, or the tensor's attributes.
    ``library``: the libtorch_cpu the shim was found in (wherever this process loaded it from).
    ``reasons``: for each route (``"shim"``, ``"wrap"``, ``"shim_reader"``,
    ``"dlpack_reader"``), None where it is on, else why it is off: a torch without it, a
    library not found, a check at import that failed, or ``MTC_TORCH_SHIM=0``. All give the
    same tensors: dtype, shape, strides, storage offsets and storage sharing."""
    return _setup.routes()


def configure(*, pinned_cap_bytes: Optional[int] = None) -> None:
    """Change engine settings.

    Args:
        pinned_cap_bytes: Cap on the pinned staging memory each CUDA device may hold (default
            1 GiB, or the ``MTC_PINNED_CAP_BYTES`` environment variable). At the cap, staging
            waits for earlier copies to finish with their slabs instead of pinning more.
    """
    if pinned_cap_bytes is not None:
        _engine.set_pinned_cap(positive_int("pinned_cap_bytes", pinned_cap_bytes))


def trim() -> int:
    """Free the idle pinned slabs of every device, and the idle blocks that ``default_collate``
    stacked into inside :class:`PackedCollate` calls of this process; returns the bytes freed."""
    return _engine.trim() + _stack.release()


atexit.register(_engine.shutdown)
warn_environment(check=True)  # every MTC_* variable set now: a refused value is said at import
