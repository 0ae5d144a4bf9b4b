"""Property-based fuzzing of ``start_copy`` and ``PackedCollate`` (hypothesis).

Random nested structures (list, tuple, dict with str / int / tuple keys, namedtuples,
dataclasses, OrderedDict, defaultdict) hold torch tensors of every dtype of
``mtc_loader._setup.DTYPES`` (random bytes: every bit pattern), numpy arrays of every numpy
dtype that maps to torch, in every shape that matters (0-d, zero-size, non-contiguous:
transposed, stepped, expanded; offset views; read-only, negative-stride, unaligned and
broadcast arrays), and passthrough leaves (str, int, None, a custom object). Properties:

- ``start_copy(data, device, **options).get()``, under every option combination, equals
  ``tensor.to(device)`` for every tensor and ``torch.from_numpy(np.ascontiguousarray(a))``
  for every array, bitwise (dtype, shape, device, bytes); container types are preserved; every
  passthrough leaf is the same object; a tensor already on the target is the same object.
- ``PackedCollate(list)(samples).unpack(device)`` (the DataLoader path, in-process) equals
  the samples bitwise, numpy leaves becoming tensors.

The budget is fixed (``max_examples``), the generation derandomized and database-free, so
that a run is reproducible and the file takes well under a minute on two cores. A failure
prints the smallest structure hypothesis found. The CUDA variants (``cuda`` marker) run on
a machine with a GPU: CPU + GPU inputs to ``cuda:0``, GPU inputs back to the CPU, packed batches
DMAed to ``cuda:0``.
"""
from __future__ import annotations

import collections
import dataclasses
import typing

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mtc_loader
from conftest import random_array, random_tensor, requires_cuda
from mtc_loader import start_copy

DTYPES = list(mtc_loader._setup.DTYPES)
# numpy types with a torch equivalent ('Q', numpy.ulonglong, is uint64; torch.from_numpy
# refuses its type object, the engine copies it)
NP_CHARS = "?bBhHiIlLqQefdFD"
ALIGNMENTS = [1, 2, 4, 8, 16, 32, 64, 128, 4096]
MAX_CHUNKS = [1, 7, 64, 4096, 65536, 1 << 25]

FUZZ_SETTINGS = dict(deadline=None, derandomize=True, database=None, print_blob=True,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                            HealthCheck.filter_too_much])

CUDA = [pytest.mark.cuda, requires_cuda]

# On a failure, hypothesis's pytest plugin imports libcst (to print an @example patch), whose
# import raises this DeprecationWarning: with warnings as errors, that would hide the failure
# behind an INTERNALERROR.
pytestmark = pytest.mark.filterwarnings("ignore:mypy_extensions.TypedDict is deprecated:DeprecationWarning")


# --------------------------------------------------------------------------- containers

Point = collections.namedtuple("Point", "x y")


class Box(typing.NamedTuple):
    lo: typing.Any
    hi: typing.Any
    label: typing.Any = "box"


@dataclasses.dataclass
class Sample:
    image: typing.Any
    meta: typing.Any = None


@dataclasses.dataclass(frozen=True)
class Frozen:
    value: typing.Any


class Custom:
    """A passthrough leaf: must come back as the very same object."""

    def __repr__(self) -> str:
        return f"<Custom {id(self):#x}>"


class MyList(list):
    pass


class MyDict(dict):
    pass


def _default_factory() -> list:
    return []


# --------------------------------------------------------------------------- leaves

_SAME_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.complex128}






TENSOR_VIEWS = ["contiguous", "transpose", "step", "expand", "offset"]
ARRAY_VIEWS = ["contiguous", "transpose", "step", "negative", "offset", "readonly", "broadcast",
               "unaligned", "negative-readonly"]

shapes = st.integers(0, 3).flatmap(lambda nd: st.lists(st.integers(0, 5), min_size=nd, max_size=nd)).map(tuple)


def _build_tensor(dtype, shape, view, seed, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    nd = len(shape)

    def make(s):  # moved as a plain type of the same size (no copy kernels for float8 / bits*)
        t = random_tensor(dtype, s, g)
        if device == "cpu":
            return t
        return t.view(_SAME_SIZE[t.element_size()]).to(device).view(dtype)  # views taken on the device

    if view == "transpose" and nd >= 2:
        return make(shape[:-2] + (shape[-1], shape[-2])).transpose(-2, -1)
    if view == "step" and nd >= 1:
        return make((2 * shape[0],) + shape[1:])[::2]
    if view == "expand" and nd >= 1:
        base = make(tuple(1 if i % 2 == 0 else s for i, s in enumerate(shape)))
        return base.expand(shape)
    if view == "offset":
        if nd == 0:
            return make((2,))[1]
        return make((shape[0] + 1,) + shape[1:])[1:]
    return make(shape)


@st.composite
def tensor_leaves(draw, devices=("cpu",)):
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(shapes)
    view = draw(st.sampled_from(TENSOR_VIEWS))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    device = draw(st.sampled_from(devices))
    t = _build_tensor(dtype, shape, view, seed, device)
    assert tuple(t.shape) == shape
    return t


def _unaligned(a: np.ndarray) -> np.ndarray:
    buf = bytearray(a.nbytes + 1)
    u = np.frombuffer(buf, dtype=a.dtype, count=a.size, offset=1).reshape(a.shape)
    u[...] = a
    return u


@st.composite
def array_leaves(draw):
    dt = np.dtype(draw(st.sampled_from(NP_CHARS)))
    shape = draw(shapes)
    view = draw(st.sampled_from(ARRAY_VIEWS))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 31 - 1)))
    nd = len(shape)
    if view == "transpose" and nd >= 2:
        a = random_array(dt, shape[::-1], rng).T
    elif view == "step" and nd >= 1:
        a = random_array(dt, (2 * shape[0],) + shape[1:], rng)[::2]
    elif view.startswith("negative") and nd >= 1:
        a = random_array(dt, shape, rng)[::-1]
    elif view == "offset" and nd >= 1:
        a = random_array(dt, (shape[0] + 1,) + shape[1:], rng)[1:]
    elif view == "broadcast" and nd >= 1:  # zero strides, read-only
        a = np.broadcast_to(random_array(dt, tuple(1 if i % 2 == 0 else s for i, s in enumerate(shape)), rng),
                            shape)
    elif view == "unaligned" and dt.itemsize > 1:
        a = _unaligned(random_array(dt, shape, rng))
    else:
        a = random_array(dt, shape, rng)
    if view.endswith("readonly"):
        a.flags.writeable = False
    assert a.shape == shape and a.dtype == dt
    return a


passthrough = st.one_of(st.text(max_size=4), st.integers(-2 ** 70, 2 ** 70), st.none(),
                        st.just(None).map(lambda _: Custom()), st.floats(allow_nan=True), st.just(b"raw"),
                        st.integers(-9, 9).map(np.int64))  # a numpy scalar is not an array
dict_keys = st.one_of(st.text(max_size=3), st.integers(-3, 3), st.tuples(st.integers(0, 2), st.text(max_size=2)))


def leaves(devices=("cpu",), numpy=True, other=True):
    """Tensors (1/2), arrays (1/3), passthrough objects (1/6). (A plain one_of would flatten the
    passthrough alternatives into its own and draw mostly passthrough leaves.)"""
    kinds = {"tensor": tensor_leaves(devices), "array": array_leaves(), "other": passthrough}
    weights = ["tensor"] * 3 + ["array"] * (2 if numpy else 0) + ["other"] * (1 if other else 0)
    return st.sampled_from(weights).flatmap(kinds.__getitem__)


def containers(children):
    small = dict(max_size=5)
    return st.one_of(
        st.lists(children, **small),
        st.lists(children, **small).map(tuple),
        st.dictionaries(dict_keys, children, **small),
        st.tuples(children, children).map(lambda c: Point(*c)),
        st.tuples(children, children).map(lambda c: Box(*c)),
        st.tuples(children, children).map(lambda c: Sample(*c)),
        children.map(Frozen),
        st.dictionaries(dict_keys, children, **small).map(collections.OrderedDict),
        st.dictionaries(dict_keys, children, **small).map(
            lambda d: collections.defaultdict(_default_factory, d)),
        st.lists(children, **small).map(MyList),
        st.dictionaries(st.text(max_size=3), children, **small).map(MyDict),
    )


def trees(devices=("cpu",), numpy=True, other=True, max_leaves=24):
    """A leaf or a nested structure; a list of them; or, so that packing sees many leaves
    (hypothesis's recursion favours small trees), a wide batch: many leaves, or samples of
    dicts of leaves like the reference meta-data."""
    leaf = leaves(devices, numpy, other)
    tree = st.recursive(leaf, containers, max_leaves=max_leaves)
    return st.one_of(
        tree,
        st.lists(tree, min_size=1, max_size=6),
        st.lists(leaf, min_size=8, max_size=40),
        st.lists(st.dictionaries(st.text(max_size=3), st.one_of(leaf, st.lists(leaf, max_size=4)),
                                 min_size=1, max_size=6), min_size=2, max_size=6),
    )


options = st.fixed_dictionaries({
    "use_pinned_staging": st.booleans(),
    "pack_cpu_tensors": st.booleans(),
    "use_background_thread": st.booleans(),
    "min_packed_alignment_bytes": st.sampled_from(ALIGNMENTS),
    "max_packed_chunk_bytes": st.sampled_from(MAX_CHUNKS),
})


# --------------------------------------------------------------------------- checking

def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of t's values in row-major order, on the CPU (viewed first as a plain type
    of the same element size: float8 / bits* / complex32 have no general copy kernels)."""
    flat = t.detach().view(_SAME_SIZE[t.element_size()]).reshape(-1)
    # a fresh buffer: .contiguous() keeps any stride of a size-1 tensor, which .view(uint8) refuses
    flat = torch.empty(flat.numel(), dtype=flat.dtype, device=flat.device).copy_(flat).cpu()
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def tensor_ref(t: torch.Tensor, device: str) -> torch.Tensor:
    """t.to(device); for a dtype torch cannot copy across devices, the same bytes moved as a
    plain type of the same size (what .to() would give)."""
    try:
        return t.to(device)
    except (RuntimeError, NotImplementedError):
        return t.view(_SAME_SIZE[t.element_size()]).to(device).view(t.dtype)


def array_ref(a: np.ndarray, device: str) -> torch.Tensor:
    """torch.from_numpy(np.ascontiguousarray(a)), from a fresh copy: from_numpy refuses
    numpy.ulonglong ('Q', viewed as uint64 here) and warns about read-only arrays."""
    c = np.array(a, order="C", copy=True)
    if c.dtype.char == "Q":
        c = c.view(np.uint64)
    return torch.from_numpy(c).to(device)


def assert_bits(out, ref: torch.Tensor, where: str) -> None:
    assert isinstance(out, torch.Tensor), f"{where}: {type(out).__name__} is not a tensor"
    assert out.dtype == ref.dtype, f"{where}: dtype {out.dtype} != {ref.dtype}"
    assert out.shape == ref.shape, f"{where}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert out.device == ref.device, f"{where}: device {out.device} != {ref.device}"
    assert torch.equal(as_bytes(out), as_bytes(ref)), f"{where}: bytes differ"


def _is_namedtuple(x) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def check_tree(out, data, device: str, reuse: bool, where: str = "data", packed: bool = False) -> None:
    """out mirrors data: same container types, tensors equal to their reference bitwise,
    passthrough leaves (and, when reuse, tensors already on device) the same objects; numpy
    arrays converted (start_copy) or, ``packed``, kept as they are (a packed batch)."""
    if isinstance(data, torch.Tensor):
        assert_bits(out, tensor_ref(data, device), where)
        if reuse and data.device == torch.device(device):
            assert out is data, f"{where}: a tensor already on {device} was not returned as is"
    elif isinstance(data, np.ndarray) and packed:
        assert type(out) is np.ndarray and out.dtype == data.dtype and out.shape == data.shape, where
        assert out.tobytes() == data.tobytes(), f"{where}: bytes differ"
    elif isinstance(data, np.ndarray):
        assert_bits(out, array_ref(data, device), where)
    elif isinstance(data, (list, tuple, dict)) or (dataclasses.is_dataclass(data) and not isinstance(data, type)):
        assert type(out) is type(data), f"{where}: {type(out).__name__} is not {type(data).__name__}"
        if isinstance(data, dict):
            assert list(out.keys()) == list(data.keys()), f"{where}: keys differ"
            if isinstance(data, collections.defaultdict):
                assert out.default_factory is data.default_factory, f"{where}: default_factory lost"
            for k in data:
                check_tree(out[k], data[k], device, reuse, f"{where}[{k!r}]", packed)
        elif isinstance(data, (list, tuple)):
            assert len(out) == len(data), f"{where}: length {len(out)} != {len(data)}"
            sep = "." if _is_namedtuple(data) else ""
            names = type(data)._fields if sep else range(len(data))
            for name, o, d in zip(names, out, data):
                check_tree(o, d, device, reuse, f"{where}.{name}" if sep else f"{where}[{name}]", packed)
        else:
            for f in dataclasses.fields(data):
                check_tree(getattr(out, f.name), getattr(data, f.name), device, reuse, f"{where}.{f.name}", packed)
    else:
        assert out is data, f"{where}: passthrough leaf {data!r} came back as {out!r}"


def first_tensor(data):
    """Some tensor or array of data (to alias it elsewhere in the structure), or None."""
    if isinstance(data, (torch.Tensor, np.ndarray)):
        return data
    if isinstance(data, dict):
        data = list(data.values())
    elif dataclasses.is_dataclass(data) and not isinstance(data, type):
        data = [getattr(data, f.name) for f in dataclasses.fields(data)]
    if isinstance(data, (list, tuple)):
        for v in data:
            t = first_tensor(v)
            if t is not None:
                return t
    return None


# --------------------------------------------------------------------------- start_copy

COPY_CASES = [
    pytest.param("cpu", ("cpu",), id="cpu"),
    pytest.param("cuda:0", ("cpu", "cuda:0"), id="cuda:0", marks=CUDA),
    pytest.param("cpu", ("cpu", "cuda:0"), id="cuda:0-to-cpu", marks=CUDA),
]


@pytest.mark.parametrize("device, sources", COPY_CASES)
@settings(max_examples=400, **FUZZ_SETTINGS)
@given(data=st.data(), opts=options)
def test_start_copy_matches_to(device, sources, data, opts):
    tree = data.draw(trees(sources), label="tree")
    alias = first_tensor(tree)
    if alias is not None and data.draw(st.booleans(), label="alias"):
        tree = [tree, alias]  # one tensor twice in the structure
    handle = start_copy(tree, device, **opts)
    out = handle.get()
    assert handle.ready(), "ready() is False after get()"
    if device.startswith("cuda"):
        torch.cuda.current_stream().synchronize()  # GPU outputs are ready in stream order
    check_tree(out, tree, device, reuse=True)


# --------------------------------------------------------------------------- PackedCollate

_COLLATES: dict[int, mtc_loader.PackedCollate] = {}
_ARENA: list = []


def packed_collate(align: int) -> mtc_loader.PackedCollate:
    """PackedCollate(list) at one alignment, all on one shared arena."""
    if not _ARENA:
        _ARENA.append(mtc_loader.Arena(64 << 20))
    pc = _COLLATES.get(align)
    if pc is None:
        pc = _COLLATES[align] = mtc_loader.PackedCollate(list, arena=_ARENA[0], min_packed_alignment_bytes=align)
    return pc


PACKED_CASES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda:0", id="cuda:0", marks=CUDA),
]


@pytest.mark.parametrize("device", PACKED_CASES)
@settings(max_examples=400, **FUZZ_SETTINGS)
@given(samples=st.lists(trees(max_leaves=16), min_size=1, max_size=4), align=st.sampled_from(ALIGNMENTS),
       alias=st.booleans())
def test_packed_collate_roundtrip(device, samples, align, alias):
    t = first_tensor(samples)
    if alias and t is not None:
        samples.append(t)
    pc = packed_collate(align)
    batch = pc(samples)
    assert isinstance(batch, mtc_loader.PackedBatch)
    out = batch.unpack(device)
    if device.startswith("cuda"):
        torch.cuda.current_stream().synchronize()
    check_tree(out, samples, device, reuse=False, packed=True)
    # every region went back to the arena (CPU: at unpack; CUDA: once its DMA completed)
    if device == "cpu":
        assert pc.stats()["slots_in_use"] == 0
