"""File-backed leaves: :class:`FileTensor` names bytes in a file instead of holding them.

A dataset returns a ``FileTensor`` wherever it would return a tensor loaded with ``np.fromfile``
or ``np.load``. :class:`~mtc_loader.PackedCollate` reads every file of a batch straight into the
batch's arena region (io_uring, one ring per worker process, batched submissions, ``O_DIRECT``
where aligned), so the bytes reach the GPU with one host copy; ``start_copy`` reads them on the
transfer thread into pinned memory (to ``"cpu"``: into ordinary tensors). Where io_uring is
unavailable the same reads run as ``pread`` on helper threads (see :func:`file_reader`).

The engine reads a FileTensor's ``_spec``: one immutable bytes object with its dtype, shape and
file parts (csrc/engine/uring.h describes the layout). ``default_collate`` stacks same-shaped
FileTensors into one FileTensor with one part per file (registered in torch's
``default_collate_fn_map`` on import), so a stacked batch is still read in place.
"""
from __future__ import annotations

import errno
import math
import os
import re
import stat
import struct
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from . import _engine
from ._dtypes import DTYPES

__all__ = ["FileTensor", "file_reader"]

_CODE = {dt: i for i, dt in enumerate(DTYPES)}
_MAGIC = 0x4654434D  # csrc/engine/uring.h: MTC_FILE_SPEC_MAGIC
_HDR = struct.Struct("=IHHIIq")  # mtc_file_spec_hdr
_PART = struct.Struct("=QQII")  # mtc_file_part

_NP_TO_TORCH = {np.dtype(k): v for k, v in {
    "?": torch.bool, "i1": torch.int8, "i2": torch.int16, "i4": torch.int32, "i8": torch.int64,
    "u1": torch.uint8, "u2": torch.uint16, "u4": torch.uint32, "u8": torch.uint64,
    "f2": torch.float16, "f4": torch.float32, "f8": torch.float64,
    "c8": torch.complex64, "c16": torch.complex128}.items()}

PathLike = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]
Part = tuple[Union[str, bytes], int, int]  # (path, offset, nbytes)


def _torch_dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        dt = dtype
    else:
        try:
            npdt = np.dtype(dtype)
        except TypeError:
            raise TypeError(f"mtc_loader: FileTensor dtype must be a torch.dtype or a numpy dtype, "
                            f"got {dtype!r}") from None
        if not npdt.isnative and npdt.itemsize > 1:
            raise TypeError(f"mtc_loader: FileTensor dtype {npdt.str} has non-native byte order; the "
                            "bytes are read as they are in the file, so only native order is supported")
        found = _NP_TO_TORCH.get(npdt.newbyteorder("="))
        if found is None:
            raise TypeError(f"mtc_loader: numpy dtype {npdt} has no torch equivalent that mtc_loader reads")
        dt = found
    if dt not in _CODE:
        raise TypeError(f"mtc_loader: dtype {dt} cannot be read bytewise from a file")
    return dt


def _spec(dtype: torch.dtype, shape: tuple[int, ...], parts: Sequence[Part]) -> bytes:
    """The engine's view of a FileTensor (csrc/engine/uring.h: header, dims, parts, path pool)."""
    pool = bytearray()
    packed = []
    for path, offset, nbytes in parts:
        p = os.fsencode(path)
        if b"\0" in p:
            raise ValueError(f"mtc_loader: a file path contains a NUL byte: {path!r}")
        packed.append(_PART.pack(offset, nbytes, len(pool), len(p)))
        pool += p + b"\0"
    nbytes = sum(n for _, _, n in parts)
    return b"".join([_HDR.pack(_MAGIC, _CODE[dtype], len(shape), len(parts), len(pool), nbytes),
                     struct.pack(f"={len(shape)}q", *shape), *packed, bytes(pool)])


# np.save's header, as numpy >= 1.x writes it: "{'descr': '<f4', 'fortran_order': False, 'shape':
# (3, 256, 448), }" padded with spaces and ended by a newline. A header in this exact form is
# parsed here without numpy's reader (which runs ast.literal_eval: ~90 us a file, most of a
# FileTensor.npy); anything else goes to numpy's reader.
_NPY_FAST = re.compile(rb"\{'descr': '([<>|=][a-zA-Z][0-9]*)', 'fortran_order': (True|False), "
                       rb"'shape': \(((?:[0-9]+, )*(?:[0-9]+,?)?)\), \} *\n")
_NPY_DTYPES: dict[bytes, np.dtype] = {}


def _open_data(path: Union[str, bytes]) -> tuple[int, int]:
    """(descriptor, size in bytes) of a FileTensor's file, opened for reading without blocking:
    only a regular file or a block device is read at offsets (a FIFO's open would wait for a
    writer; a FIFO, socket or character device has no offsets), as the engine checks its opens
    (csrc/engine/uring.c: _open_data)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        # a Unix socket cannot be opened at all (ENXIO): say what it is, as for a FIFO
        if e.errno == errno.ENXIO and not _regular_or_block(path):
            raise _not_regular(path) from None
        raise
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode):
            size = st.st_size
        elif stat.S_ISBLK(st.st_mode):
            size = os.lseek(fd, 0, os.SEEK_END)
        elif stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(f"mtc_loader: {os.fsdecode(path)!r} is a directory; a FileTensor reads "
                                    "a regular file or a block device at offsets")
        else:
            raise _not_regular(path)
        os.set_blocking(fd, True)
        return fd, size
    except BaseException:
        os.close(fd)
        raise


def _regular_or_block(path: Union[str, bytes]) -> bool:
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return True  # nothing to add to open's own error
    return stat.S_ISREG(mode) or stat.S_ISBLK(mode)


def _not_regular(path: Union[str, bytes]) -> OSError:
    """The refusal of a FIFO, socket or character device."""
    return OSError(f"mtc_loader: {os.fsdecode(path)!r} is not a regular file or block device; a FileTensor "
                   "reads a regular file or a block device at offsets")


def _npy_header_fast(path: Union[str, bytes]) -> Optional[tuple[tuple[int, ...], bool, np.dtype, int]]:
    """(shape, fortran_order, dtype, data offset) of a .npy file whose header has np.save's
    canonical form (versions 1.0, 2.0 and 3.0), or None (numpy's reader decides)."""
    fd, _ = _open_data(path)
    try:
        head = os.read(fd, 4096)
    finally:
        os.close(fd)
    if head[:6] != b"\x93NUMPY" or len(head) < 12:
        return None
    if head[6:8] == b"\x01\x00":
        start = 10
        hlen = head[8] | head[9] << 8
    elif head[6:8] in (b"\x02\x00", b"\x03\x00"):  # 3.0: 2.0's layout, header in UTF-8
        start = 12
        hlen = int.from_bytes(head[8:12], "little")
    else:
        return None
    m = _NPY_FAST.fullmatch(head, start, start + hlen) if start + hlen <= len(head) else None
    if m is None:
        return None
    dt = _NPY_DTYPES.get(m.group(1))
    if dt is None:
        try:
            dt = np.dtype(m.group(1).decode())
        except TypeError:
            return None
        _NPY_DTYPES[m.group(1)] = dt
    shape = tuple(int(x) for x in m.group(3).split(b",") if x.strip())
    return shape, m.group(2) == b"True", dt, start + hlen


def _npy_header(path: Union[str, bytes]) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """(shape, fortran_order, dtype, data offset) of a .npy file, by numpy's public readers."""
    fd, _ = _open_data(path)
    with os.fdopen(fd, "rb") as f:
        try:
            version = np.lib.format.read_magic(f)
        except ValueError as e:
            raise ValueError(f"mtc_loader: {os.fsdecode(path)!r} is not a .npy file: {e}") from None
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        elif version in ((2, 0), (3, 0)):
            # 3.0 differs from 2.0 only in the header's encoding (UTF-8 rather than latin-1), which
            # only a structured dtype's field names use: FileTensor refuses those dtypes anyway
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            raise ValueError(f"mtc_loader: {os.fsdecode(path)!r} has .npy format version "
                             f"{version[0]}.{version[1]}, which is none of 1.0, 2.0, 3.0 (a corrupt file?)")
        return shape, fortran, dtype, f.tell()


class FileTensor:
    """A tensor whose bytes live in a file (C order, native byte order), read when copied.

    Args:
        path: The file.
        dtype: A ``torch.dtype`` (or a numpy dtype / type string such as ``"<f4"``).
        shape: The tensor's shape; ``None`` means 1-D over the rest of the file after ``offset``
            (the file is looked at once, here; its remaining size must be a multiple of the
            element size).
        offset: Byte offset of the first element in the file.

    A FileTensor is small and picklable (a DataLoader worker can return it); it is read, not
    held: the file must not change between its creation and its copy. ``.load()`` reads it
    into a plain CPU tensor.

    Examples:
        >>> ft = FileTensor("sweep.bin", torch.float32, (-1, 5))  # doctest: +SKIP
        >>> img = FileTensor.npy("cam0.npy")                       # doctest: +SKIP
    """

    __slots__ = ("dtype", "shape", "parts", "_spec")
    dtype: torch.dtype
    shape: torch.Size
    parts: tuple[Part, ...]
    _spec: bytes

    def __init__(self, path: PathLike, dtype: Any, shape: Optional[Sequence[int]] = None, offset: int = 0):
        dt = _torch_dtype(dtype)
        path = os.fspath(path)
        where = os.fsdecode(path)
        if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)) or offset < 0:
            raise ValueError(f"mtc_loader: FileTensor offset must be a non-negative int, got {offset!r}")
        offset = int(offset)
        size = dt.itemsize
        if shape is None or (isinstance(shape, (tuple, list)) and -1 in shape):
            fd, file_size = _open_data(path)
            os.close(fd)
            rest = file_size - offset
            if rest < 0 or rest % size:
                raise ValueError(f"mtc_loader: {where!r} has {max(rest, 0)} bytes after offset {offset}, "
                                 f"not a whole number of {dt} elements ({size} bytes each)")
            shape = (rest // size,) if shape is None else _fill_minus_one(where, tuple(shape), rest // size)
        dims = _check_shape(shape)
        nbytes = math.prod(dims) * size
        if nbytes == 0 and math.prod(d for d in dims if d) * size > _MAX_OFFSET:
            raise ValueError(f"mtc_loader: FileTensor {where!r}: shape {dims} of {dt} holds no element, but its "
                             "non-zero dimensions span more than 2**63 - 1 bytes, which torch cannot "
                             "make a tensor of (a wrong shape?)")
        if nbytes > _MAX_OFFSET:
            raise ValueError(f"mtc_loader: FileTensor {where!r}: shape {dims} of {dt} is {nbytes} bytes, more "
                             f"than a file can hold (at most 2**63 - 1 bytes)")
        if offset + nbytes > _MAX_OFFSET:
            raise ValueError(f"mtc_loader: FileTensor {where!r}: offset {offset} + {nbytes} bytes ends beyond "
                             "the largest file offset (2**63 - 1)")
        self._init(dt, dims, ((path, offset, nbytes),))

    def _init(self, dtype: torch.dtype, shape: tuple[int, ...], parts: tuple[Part, ...]) -> None:
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "shape", torch.Size(shape))
        object.__setattr__(self, "parts", parts)
        object.__setattr__(self, "_spec", _spec(dtype, shape, parts))

    @classmethod
    def npy(cls, path: PathLike) -> "FileTensor":
        """The array of a ``.npy`` file: its header gives dtype, shape and where the data starts.

        Raises ValueError for a Fortran-ordered array or a dtype without a torch equivalent
        (object, structured, non-native byte order).
        """
        path = os.fspath(path)
        fast = _npy_header_fast(path)
        if fast is not None:
            shape, fortran, dtype, offset = fast
        else:
            shape, fortran, dtype, offset = _npy_header(path)
        if fortran and len(shape) > 1:
            raise ValueError(f"mtc_loader: {path!r} holds a Fortran-ordered array; FileTensor reads C "
                             "order (save it with np.save(path, np.ascontiguousarray(a)))")
        try:
            dt = _torch_dtype(dtype)
        except TypeError as e:
            raise ValueError(f"mtc_loader: {path!r}: {e}") from None
        return cls(path, dt, shape, offset)

    # ---- a tensor-like surface: what a collate function may look at


    @property
    def path(self) -> Union[str, bytes]:
        """The file (of a single-file FileTensor; a stacked one has ``parts``)."""
        if len(self.parts) != 1:
            raise AttributeError("mtc_loader: a stacked FileTensor has one file per row: see .parts")
        return self.parts[0][0]

    @property
    def offset(self) -> int:
        if len(self.parts) != 1:
            raise AttributeError("mtc_loader: a stacked FileTensor has one offset per row: see .parts")
        return self.parts[0][1]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel() * self.dtype.itemsize

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim: Optional[int] = None) -> Union[torch.Size, int]:
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return math.prod(self.shape)

    def load(self) -> torch.Tensor:
        """The tensor, read now into ordinary (pageable) CPU memory by the engine."""
        # the engine's start_copy to the CPU (target -1) with start_copy's defaults, run on this
        # thread: staging, packing, 16-byte alignment, 32 MiB chunks, no background thread
        out: torch.Tensor = _engine.start_copy(self, -1, True, True, 16, 33554432, False).get()
        return out

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("mtc_loader: a FileTensor is immutable")

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self.dtype, tuple(self.shape), self.parts))

    def __repr__(self) -> str:
        where = (f"{self.parts[0][0]!r}, offset={self.parts[0][1]}" if len(self.parts) == 1
                 else f"{len(self.parts)} files")
        return f"FileTensor({where}, dtype={self.dtype}, shape={tuple(self.shape)})"

    @staticmethod
    def stack(items: Sequence["FileTensor"]) -> "FileTensor":
        """Same-shaped, same-dtype FileTensors as one of shape ``(len(items), *shape)``: one part
        per file, read in place into consecutive rows (what ``default_collate`` does with them)."""
        if not items:
            raise ValueError("mtc_loader: cannot stack an empty list of FileTensors")
        first = items[0]
        for i, it in enumerate(items):
            if not isinstance(it, FileTensor):
                raise TypeError(f"mtc_loader: cannot stack a FileTensor with a {type(it).__name__} "
                                f"(element {i})")
            if it.dtype != first.dtype or it.shape != first.shape:
                raise RuntimeError(
                    f"mtc_loader: default_collate stacks FileTensors of one shape and dtype: element 0 is "
                    f"{tuple(first.shape)} {first.dtype}, element {i} is {tuple(it.shape)} {it.dtype}; "
                    "return them in a list (collate_fn=list, or a custom collate) to keep them apart")
        parts = tuple(p for it in items for p in it.parts)
        total = sum(n for _, _, n in parts)
        if total > _MAX_OFFSET:
            raise ValueError(f"mtc_loader: {len(items)} stacked FileTensors of {first.nbytes} bytes each are "
                             f"{total} bytes, more than one tensor can hold (at most 2**63 - 1 bytes)")
        if total == 0 and len(items) * math.prod(d for d in first.shape if d) * first.dtype.itemsize > _MAX_OFFSET:
            raise ValueError(f"mtc_loader: {len(items)} stacked FileTensors of shape {tuple(first.shape)} hold no "
                             "element, but the stack's non-zero dimensions span more than 2**63 - 1 bytes, "
                             "which torch cannot make a tensor of")
        return _rebuild(first.dtype, (len(items), *first.shape), parts)


def _check_shape(shape: Any) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (shape,)
    try:
        dims = tuple(int(d) for d in shape)
        ok = all(not isinstance(d, bool) and int(d) == d for d in shape)
    except (TypeError, ValueError):
        ok = False
    if not ok or any(d < 0 for d in dims):
        raise ValueError(f"mtc_loader: FileTensor shape must be a sequence of non-negative ints, got {shape!r}")
    if any(d > _MAX_OFFSET for d in dims):
        raise ValueError(f"mtc_loader: FileTensor shape {shape!r} has a dimension beyond 2**63 - 1")
    if len(dims) > _MAX_NDIM:
        raise ValueError(f"mtc_loader: FileTensor shape has {len(dims)} dimensions; mtc_loader copies "
                         f"tensors of at most {_MAX_NDIM}")
    return dims


_MAX_NDIM = 1024  # MTC_MAX_NDIM in csrc/engine/plan.h
_MAX_OFFSET = (1 << 63) - 1  # a file offset (off_t), and the engine's bound on a part's end


def _fill_minus_one(path: str, shape: tuple[int, ...], numel: int) -> tuple[int, ...]:
    if shape.count(-1) != 1:
        raise ValueError(f"mtc_loader: FileTensor shape {shape} may hold one -1 at most")
    known = math.prod(d for d in shape if d != -1)
    if known == 0 or numel % known:
        raise ValueError(f"mtc_loader: {path!r} holds {numel} elements, which shape {shape} cannot cover")
    return tuple(numel // known if d == -1 else d for d in shape)


def _rebuild(dtype: torch.dtype, shape: Sequence[int], parts: Sequence[Part]) -> FileTensor:
    ft = FileTensor.__new__(FileTensor)
    ft._init(dtype, tuple(shape), tuple((p, int(o), int(n)) for p, o, n in parts))
    return ft


def _collate_file_tensors(batch: Sequence[FileTensor], *, collate_fn_map: Any = None) -> FileTensor:
    return FileTensor.stack(batch)


def _register_default_collate() -> None:
    """default_collate of FileTensors stacks them (torch >= 1.13 has the registry)."""
    try:
        from torch.utils.data._utils.collate import default_collate_fn_map
    except ImportError:  # older torch: default_collate raises on FileTensors, use PackedCollate(list)
        return
    default_collate_fn_map.setdefault(FileTensor, _collate_file_tensors)


_register_default_collate()


def file_reader() -> dict[str, Any]:
    """How this process reads FileTensors: ``{"mode": "io_uring" | "pread", "reason": str | None,
    "forced": bool, "liburing": bool}``. ``MTC_FILE_READER=pread`` forces the pread path;
    otherwise pread runs only where io_uring cannot be set up (``reason`` says why) or liburing
    was absent at build time (``liburing`` is False: the package was built without it; install
    liburing's development files, e.g. ``apt-get install liburing-dev``, and reinstall)."""
    mode, reason, forced, liburing = _engine.file_reader()
    return {"mode": mode, "reason": reason, "forced": forced, "liburing": liburing}
