"""start_copy to a CPU target: every output against ``tensor.to("cpu")`` / ``torch.from_numpy``.

Runs everywhere (no GPU needed). Behaviour under test is the docstring of
``mtc_loader.start_copy`` (mtc_loader/copy.py):

- CPU tensors are reused as is (the same objects, flags kept);
- numpy leaves become tensors that share memory with the array (as ``torch.from_numpy``)
  unless the array is read-only or has negative or unaligned strides: then they are copied;
- list / tuple / dict, namedtuples, OrderedDict / defaultdict and other subclasses, and
  dataclasses come back as the same types; other objects pass through as the same objects.

Tests that use randomness take a fixed seed and name it in their assert messages.
"""
from __future__ import annotations

import collections
import dataclasses
import gc
import itertools
import random
import threading
import time
import warnings

import numpy as np
import pytest
import torch

import mtc_loader
from mtc_loader import AsyncCopyHandle, start_copy
from conftest import random_array, random_tensor

ALL_DTYPES = list(mtc_loader._setup.DTYPES)

# numpy type characters with a torch equivalent ('Q', numpy.ulonglong, is tested apart:
# torch.from_numpy refuses that type object although it is uint64)
NP_CHARS = "?bBhHiIlLqefdFD"
NP_DTYPES = [np.dtype(c) for c in NP_CHARS]


# --------------------------------------------------------------------------- helpers

_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64,
                  16: torch.complex128}


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of t's values in row-major order (t must not be lazily conjugated/negated).

    Viewed first as a plain dtype of the same element size: exotic dtypes (float8, bits*,
    int1..7) have no copy kernel for .contiguous()."""
    assert not t.is_conj() and not t.is_neg()
    flat = t.detach().view(_SAME_SIZE_INT[t.element_size()]).contiguous().view(-1)
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return flat.view(torch.uint8)


def assert_bitwise(out, ref, where: str = "") -> None:
    """out equals ref bitwise: a tensor of the same dtype, shape and device, with the same bytes."""
    assert isinstance(out, torch.Tensor), f"{where}: {type(out).__name__} is not a tensor"
    assert out.dtype == ref.dtype, f"{where}: dtype {out.dtype} != {ref.dtype}"
    assert out.shape == ref.shape, f"{where}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert out.device == ref.device, f"{where}: device {out.device} != {ref.device}"
    ref = ref.resolve_conj().resolve_neg()
    assert torch.equal(as_bytes(out), as_bytes(ref)), f"{where}: bytes differ"


def np_ref(a: np.ndarray) -> torch.Tensor:
    """The expected values of a numpy leaf: a fresh, writeable, C-contiguous copy."""
    c = np.array(a, order="C", copy=True)
    if c.dtype.char == "Q":
        c = c.view(np.uint64)
    return torch.from_numpy(c)






def unaligned(a: np.ndarray) -> np.ndarray:
    """A writeable copy of a whose data is not aligned to its element size."""
    buf = bytearray(a.nbytes + 1)
    u = np.frombuffer(buf, dtype=a.dtype, count=a.size, offset=1).reshape(a.shape)
    u[...] = a
    return u


def jobs_in_flight(s: dict) -> int:
    """Jobs started and not done: background (submitted) plus inline ones, less the done."""
    return s["jobs_submitted"] + s.get("jobs_inline", 0) - s["jobs_done"]


def wait_jobs_settled(timeout: float = 20.0) -> dict:
    """Waits until every started job is done; returns the stats."""
    deadline = time.monotonic() + timeout
    while True:
        s = mtc_loader.stats()
        if jobs_in_flight(s) == 0 or time.monotonic() > deadline:
            return s
        time.sleep(0.01)


def copy_cpu(data, **kw):
    return start_copy(data, "cpu", **kw).get()


# --------------------------------------------------------------------------- CPU tensors

@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_cpu_tensors_reused_every_dtype(dtype):
    g = torch.Generator().manual_seed(11)
    base = random_tensor(dtype, (6, 8), g)
    data = [random_tensor(dtype, s, g) for s in [(), (0,), (1,), (7,), (5, 3), (2, 0, 4)]]
    data += [base[:, ::2], base.t(), base[1:, 2:5]]  # views, non-contiguous
    out = copy_cpu(data)
    assert type(out) is list and out is not data
    for i, (o, x) in enumerate(zip(out, data)):
        assert o is x, f"data[{i}] not reused (seed 11)"
        assert_bitwise(o, x.to("cpu"), f"data[{i}] (seed 11)")


def test_cpu_tensors_bool_complex_float8_bf16_bitwise():
    g = torch.Generator().manual_seed(12)
    dts = [torch.bool, torch.complex64, torch.complex128, torch.bfloat16, torch.float16,
           torch.float8_e4m3fn, torch.float8_e5m2, torch.float64, torch.uint64, torch.int8]
    data = {str(dt): random_tensor(dt, (4, 5), g) for dt in dts}
    out = copy_cpu(data)
    assert list(out) == list(data)
    for k in data:
        assert out[k] is data[k]
        assert_bitwise(out[k], data[k].to("cpu"), f"data[{k!r}] (seed 12)")


def test_passthrough_leaves_are_same_objects():
    class Custom:
        pass

    c = Custom()
    s = "a string"
    big = 10 ** 30
    f = 1.5
    b = b"bytes"
    fs = frozenset({1, 2})
    st = {1, 2}
    fn = len
    t = torch.ones(2)
    data = [s, big, None, c, f, b, fs, st, fn, True, t, torch.float32, torch.device("cpu"),
            Ellipsis, slice(1, 2), range(3), np.float32(2.5), np.int64(3)]
    out = copy_cpu(data)
    assert len(out) == len(data)
    for i, (o, x) in enumerate(zip(out, data)):
        assert o is x, f"data[{i}] ({type(x).__name__}) is not the same object"


def test_single_tensor_and_single_ndarray():
    t = torch.arange(5)
    assert copy_cpu(t) is t
    a = np.arange(5, dtype=np.float32)
    out = copy_cpu(a)
    assert_bitwise(out, torch.from_numpy(a))
    assert out.data_ptr() == a.ctypes.data
    ro = np.arange(5, dtype=np.int16)
    ro.flags.writeable = False
    out = copy_cpu(ro)
    assert_bitwise(out, np_ref(ro))
    assert not np.shares_memory(out.numpy(), ro)
    assert copy_cpu("leaf") == "leaf"
    assert copy_cpu(None) is None


def test_requires_grad_of_reused_tensor_is_kept():
    x = torch.randn(3, requires_grad=True)
    y = x * 2  # non-leaf with history
    out = copy_cpu({"x": x, "y": y, "n": np.ones(2, np.float32)})
    assert out["x"] is x and out["x"].requires_grad and out["x"].is_leaf
    assert out["y"] is y and out["y"].grad_fn is not None
    # numpy leaves become tensors without autograd
    assert not out["n"].requires_grad and out["n"].grad_fn is None


def test_requires_grad_resolved_conj_output_is_new_without_grad():
    # the resolved copy of a lazy view is a new tensor: no grad, no history (docstring)
    z = torch.randn(3, dtype=torch.complex64, requires_grad=True)
    out = copy_cpu([z.conj()])[0]
    assert_bitwise(out, z.detach().conj().resolve_conj())
    assert not out.requires_grad and out.grad_fn is None


def test_conj_and_neg_views_values():
    # Lazily conjugated / negated views are not errors: the values are those of .to("cpu")
    # (whether the output is the view itself or a resolved copy).
    g = torch.Generator().manual_seed(13)
    z = torch.randn(4, 6, dtype=torch.complex64, generator=g)
    zc = z.conj()
    z0 = torch.tensor(1 + 2j).conj()
    data = [zc, zc.imag, zc[:, ::2], zc.t(), zc[:, ::2].imag, z0, z0.imag, zc[:1, :1].imag,
            torch.tensor([3 - 4j], dtype=torch.complex128).conj()]
    out = copy_cpu(data)
    for i, (o, x) in enumerate(zip(out, data)):
        ref = x.to("cpu")
        assert o.dtype == ref.dtype and o.shape == ref.shape and o.device == ref.device
        assert torch.equal(o, ref.resolve_conj().resolve_neg()), f"data[{i}] (seed 13)"
        assert torch.equal(o.resolve_conj().resolve_neg(), ref.resolve_conj().resolve_neg())


# --------------------------------------------------------------------------- numpy leaves

@pytest.mark.parametrize("dt", NP_DTYPES, ids=lambda d: d.char)
def test_numpy_zero_copy_every_dtype(dt):
    rng = np.random.default_rng(21)
    arrays = [random_array(dt, s, rng) for s in [(7,), (3, 5), (2, 3, 4), (1,)]]
    arrays.append(np.array(random_array(dt, (1,), rng)[0]))  # 0-d
    base = random_array(dt, (6, 8), rng)
    arrays += [base.T, base[:, 1::3], base[2:4]]  # writeable views with positive strides
    out = copy_cpu(list(arrays))
    for i, (o, a) in enumerate(zip(out, arrays)):
        ref = torch.from_numpy(a)
        assert_bitwise(o, ref, f"data[{i}] dtype {dt} (seed 21)")
        # zero-copy: as torch.from_numpy, same memory and strides
        assert o.data_ptr() == ref.data_ptr(), f"data[{i}] dtype {dt} copied"
        assert o.stride() == ref.stride()
        assert np.shares_memory(o.numpy(), a)
    # true sharing: writes to the array are seen by the tensor
    a0 = arrays[0]
    a0[0] = a0[1]
    assert_bitwise(out[0], torch.from_numpy(a0.copy()))


@pytest.mark.parametrize("dt", NP_DTYPES, ids=lambda d: d.char)
def test_numpy_zero_size(dt):
    arrays = [np.zeros((0,), dt), np.zeros((0, 3), dt), np.zeros((3, 0, 2), dt)]
    arrays.append(np.zeros((4, 0), dt)[::-1])  # negative stride, nothing to copy
    ro = np.zeros((0, 5), dt)
    ro.flags.writeable = False
    arrays.append(ro)
    out = copy_cpu(arrays)
    for i, (o, a) in enumerate(zip(out, arrays)):
        assert_bitwise(o, np_ref(a), f"data[{i}] dtype {dt}")


def torch_layout(a: np.ndarray) -> tuple:
    """The strides torch.from_numpy(a).to(device) has (tensor.to() keeps a dense layout and
    makes any other one dense in its own order), or row-major ones where torch cannot hold a's
    strides (negative, or not a multiple of the item size)."""
    if any(s < 0 or s % a.itemsize for s in a.strides):
        return torch.empty(a.shape).stride()
    el = [s // a.itemsize for s in a.strides]
    span = 1 + sum((n - 1) * s for n, s in zip(a.shape, el)) if a.size else 0
    return torch.empty(span).as_strided(a.shape, el).clone().stride()


@pytest.mark.parametrize("dt", NP_DTYPES, ids=lambda d: d.char)
def test_numpy_copied_when_readonly_negative_or_unaligned(dt):
    rng = np.random.default_rng(22)
    base = random_array(dt, (6, 8), rng)
    ro = random_array(dt, (3, 4), rng)
    ro.flags.writeable = False
    ro0 = np.array(random_array(dt, (1,), rng)[0])
    ro0.flags.writeable = False
    ro_t = base.copy().T
    ro_t.flags.writeable = False
    cases = {
        "readonly": ro,
        "readonly 0-d": ro0,
        "readonly transposed": ro_t,
        "negative": base[::-1],
        "negative cols": base[:, ::-1],
        "negative step": base[::-2, 1::3],
        "negative 1-d": base[0][::-1],
        "broadcast (read-only, zero stride)": np.broadcast_to(base[0], (3, 8)),
    }
    if dt.itemsize > 1:
        cases["unaligned"] = unaligned(random_array(dt, (5, 3), rng))
    out = copy_cpu(cases)
    assert list(out) == list(cases)
    for name, a in cases.items():
        o = out[name]
        assert_bitwise(o, np_ref(a), f"{name} dtype {dt} (seed 22)")
        assert o.stride() == torch_layout(a), f"{name}: strides {o.stride()}"
        if a.size:
            assert not np.shares_memory(o.numpy(), a), f"{name}: shares memory with the array"


def test_numpy_odd_layouts():
    from numpy.lib.stride_tricks import as_strided, sliding_window_view

    b = np.arange(40, dtype=np.float32)
    shared = {  # writeable, aligned, non-negative strides: wrapped as torch.from_numpy does
        "zero stride": as_strided(b, shape=(4, 3), strides=(0, 4), writeable=True),
        "overlapping": as_strided(b, shape=(4, 3), strides=(4, 4), writeable=True),
        "fortran": np.asfortranarray(b[:12].reshape(3, 4)),
        "ndarray subclass": b[:5].view(type("Sub", (np.ndarray,), {})),
        "many dims": np.zeros((1,) * 40 + (3,), np.int8),
    }
    copied = {
        "sliding window (read-only, overlapping)": sliding_window_view(b, 3),
        "negative and zero strides": as_strided(b[5:], shape=(3, 2), strides=(-4, 0),
                                                writeable=False),
    }
    out = copy_cpu({**shared, **copied})
    for k, a in shared.items():
        ref = torch.from_numpy(a)
        assert_bitwise(out[k], ref, k)
        assert out[k].data_ptr() == ref.data_ptr() and out[k].stride() == ref.stride(), k
    for k, a in copied.items():
        assert_bitwise(out[k], np_ref(a), k)
        assert out[k].is_contiguous(), k


def test_tensor_subclasses_reused():
    class MyT(torch.Tensor):
        pass

    p = torch.nn.Parameter(torch.ones(3))
    mt = torch.arange(4).as_subclass(MyT)
    out = copy_cpu([p, {"m": mt}])
    assert out[0] is p and out[1]["m"] is mt
    conj = torch.tensor([1 + 1j, 2 - 3j]).conj().as_subclass(MyT)
    o = copy_cpu([conj])[0]
    assert torch.equal(o.as_subclass(torch.Tensor).resolve_conj(), torch.tensor([1 - 1j, 2 + 3j]))


def test_numpy_longlong_and_long_both_int64():
    for c in "lqL":
        a = np.arange(10, dtype=c)
        o = copy_cpu([a])[0]
        assert_bitwise(o, torch.from_numpy(a))
        assert o.data_ptr() == a.ctypes.data


def test_numpy_ulonglong_zero_copy():
    a = np.arange(10, dtype="Q")
    try:
        o = copy_cpu([[a]])[0][0]
    except TypeError as e:  # acceptable only when the message names the leaf
        assert "data[0][0]" in str(e), str(e)
    else:
        assert_bitwise(o, torch.from_numpy(a.view(np.uint64)))


def test_numpy_ulonglong_copy_path():
    a = np.arange(10, dtype="Q")
    o = copy_cpu([a[::-1]])[0]
    assert_bitwise(o, np_ref(a[::-1]))


def test_numpy_large_negative_stride_64mb():
    rng = np.random.default_rng(23)
    a = rng.integers(0, 2 ** 31, size=16 * 1024 * 1024, dtype=np.int32)  # 64 MiB
    before = mtc_loader.stats()
    views = {"rev": a[::-1], "rev2d": a.reshape(4096, 4096)[::-1, ::-2],
             "ro_t": a.reshape(2048, 8192).T}
    views["ro_t"].flags.writeable = False
    for bg in (True, False):
        out = copy_cpu(views, use_background_thread=bg)
        for k, v in views.items():
            assert_bitwise(out[k], np_ref(v), f"{k} background={bg} (seed 23)")
            assert out[k].stride() == torch_layout(v), k  # ro_t stays transposed, as .to() keeps it
    after = wait_jobs_settled()
    assert after["host_copies"] - before["host_copies"] == 6
    nbytes = sum(v.nbytes for v in views.values())
    assert after["bytes_host_copy"] - before["bytes_host_copy"] == 2 * nbytes


def test_numpy_input_not_modified():
    rng = np.random.default_rng(24)
    a = random_array(np.dtype("f8"), (50, 7), rng)
    keep = a.copy()
    data = [a, a[::-1], a.T]
    out = copy_cpu(data)
    out[1].zero_()  # a copy: the input stays as it was
    assert np.array_equal(a, keep, equal_nan=True)
    assert data[0] is a


# --------------------------------------------------------------------------- containers

NT = collections.namedtuple("NT", "a b c")


class DictSub(dict):
    pass


class ListSub(list):
    pass


class TupleSub(tuple):
    pass


POST_INIT_CALLS = [0]


@dataclasses.dataclass
class DC:
    x: object
    y: object
    label: str = "default"
    extra: list = dataclasses.field(default_factory=list)

    def __post_init__(self):
        POST_INIT_CALLS[0] += 1


@dataclasses.dataclass(frozen=True)
class FrozenDC:
    x: object
    n: int = 7


def test_list_tuple_dict():
    t1, t2 = torch.ones(2), torch.zeros(3, dtype=torch.int8)
    a = np.arange(4.0)
    data = {"l": [t1, a, "s"], "t": (t2, (a, 1)), "d": {"k": {"kk": [a]}}, 3: None, (1, 2): t1}
    out = copy_cpu(data)
    assert type(out) is dict and out is not data
    assert list(out) == list(data)
    assert type(out["l"]) is list and out["l"] is not data["l"]
    assert out["l"][0] is t1 and out["l"][2] == "s"
    assert_bitwise(out["l"][1], torch.from_numpy(a))
    assert type(out["t"]) is tuple and type(out["t"][1]) is tuple
    assert out["t"][0] is t2 and out["t"][1][1] == 1
    assert_bitwise(out["d"]["k"]["kk"][0], torch.from_numpy(a))
    assert out[3] is None and out[(1, 2)] is t1
    # the input structure is untouched
    assert data["l"][1] is a and type(data["l"][1]) is np.ndarray


def test_empty_containers():
    assert copy_cpu([]) == [] and type(copy_cpu([])) is list
    assert copy_cpu({}) == {} and type(copy_cpu({})) is dict
    assert copy_cpu(()) == () and type(copy_cpu(())) is tuple
    out = copy_cpu([[], {}, (), [[]], {"a": {}}, ListSub(), DictSub(), TupleSub()])
    assert out == [[], {}, (), [[]], {"a": {}}, [], {}, ()]
    assert [type(x) for x in out[5:]] == [ListSub, DictSub, TupleSub]


def test_shared_substructure_is_not_a_cycle():
    inner = [np.arange(3)]
    out = copy_cpu([inner, inner, {"again": inner}])
    for o in (out[0][0], out[1][0], out[2]["again"][0]):
        assert_bitwise(o, torch.from_numpy(inner[0]))


def _deep_list(depth, leaf):
    root = cur = []
    for _ in range(depth - 1):
        nxt = []
        cur.append(nxt)
        cur = nxt
    cur.append(leaf)
    return root


def test_nested_1000_levels_list():
    a = np.arange(6, dtype=np.int16)[::-1]
    out = copy_cpu(_deep_list(1000, a))
    cur, depth = out, 0
    while isinstance(cur, list):
        assert type(cur) is list and len(cur) == 1
        cur = cur[0]
        depth += 1
    assert depth == 1000
    assert_bitwise(cur, np_ref(a))


def test_nested_1000_levels_dict_and_tuple():
    t = torch.arange(3)
    root = cur = {}
    for i in range(999):
        nxt = {}
        cur["k"] = nxt
        cur["i"] = i
        cur = nxt
    cur["leaf"] = np.ones(2, np.float32)
    out = copy_cpu(root)
    cur, depth = out, 0
    while "k" in cur:
        assert type(cur) is dict and cur["i"] == depth
        cur = cur["k"]
        depth += 1
    assert depth == 999
    assert_bitwise(cur["leaf"], torch.ones(2))

    tup = t
    for _ in range(1000):
        tup = (tup,)
    out = copy_cpu(tup)
    for _ in range(1000):
        assert type(out) is tuple and len(out) == 1
        out = out[0]
    assert out is t


def test_namedtuple():
    a = np.arange(4, dtype=np.uint8)
    t = torch.ones(2)
    out = copy_cpu([NT(a, t, "c"), NT([a], {"t": t}, None)])
    assert type(out[0]) is NT and type(out[1]) is NT
    assert_bitwise(out[0].a, torch.from_numpy(a))
    assert out[0].b is t and out[0].c == "c"
    assert_bitwise(out[1].a[0], torch.from_numpy(a))
    assert out[1].b["t"] is t and out[1].c is None
    assert out[0]._fields == ("a", "b", "c")


def test_ordered_dict_order_preserved():
    od = collections.OrderedDict()
    for k in "edcba":
        od[k] = np.full(2, ord(k), np.int32)
    od["plain"] = 5
    od.move_to_end("c")
    od.move_to_end("a", last=False)
    out = copy_cpu(od)
    assert type(out) is collections.OrderedDict
    assert list(out) == list(od) == ["a", "e", "d", "b", "plain", "c"]
    for k, v in od.items():
        if isinstance(v, np.ndarray):
            assert_bitwise(out[k], torch.from_numpy(v))
        else:
            assert out[k] == v


def test_defaultdict():
    dd = collections.defaultdict(list)
    dd["a"].append(np.arange(3))
    dd["b"] = torch.ones(1)
    out = copy_cpu({"dd": dd})["dd"]
    assert type(out) is collections.defaultdict and out is not dd
    assert out.default_factory is list
    assert_bitwise(out["a"][0], torch.arange(3))
    assert out["b"] is dd["b"]
    assert out["missing"] == [] and "missing" in out  # still works
    assert "missing" not in dd


def test_dict_list_tuple_subclasses():
    d = DictSub(x=np.arange(2), y="s")
    d.attr = {"meta": 1}
    lst = ListSub([np.arange(3), 4])
    lst.tag = "list-tag"
    tup = TupleSub((np.arange(4), torch.zeros(1)))
    out = copy_cpu([d, lst, tup])
    od, ol, ot = out
    assert type(od) is DictSub and od is not d and od.attr == {"meta": 1}
    assert list(od) == ["x", "y"] and od["y"] == "s"
    assert_bitwise(od["x"], torch.arange(2))
    assert type(ol) is ListSub and ol is not lst and ol.tag == "list-tag"
    assert_bitwise(ol[0], torch.arange(3)) and ol[1] == 4
    assert type(ot) is TupleSub and len(ot) == 2
    assert_bitwise(ot[0], torch.arange(4)) and ot[1] is tup[1]
    # the inputs are untouched
    assert isinstance(d["x"], np.ndarray) and isinstance(lst[0], np.ndarray)


def test_dataclass():
    POST_INIT_CALLS[0] = 0
    a = np.arange(5, dtype=np.float64)[::-1]
    obj = DC(x=a, y=[torch.ones(2), np.zeros(1)], label="lbl", extra=[1, 2])
    obj.not_a_field = "kept"
    assert POST_INIT_CALLS[0] == 1
    out = copy_cpu({"obj": obj})["obj"]
    assert POST_INIT_CALLS[0] == 1, "__post_init__ ran again"
    assert type(out) is DC and out is not obj
    assert_bitwise(out.x, np_ref(a))
    assert out.y[0] is obj.y[0]
    assert_bitwise(out.y[1], torch.zeros(1, dtype=torch.float64))
    assert out.label == "lbl" and out.extra == [1, 2]
    assert out.not_a_field == "kept"
    assert isinstance(obj.x, np.ndarray)  # the input is untouched


def test_frozen_dataclass():
    a = np.arange(3, dtype=np.int64)
    obj = FrozenDC(x=[a])
    out = copy_cpu([obj])[0]
    assert type(out) is FrozenDC and out.n == 7
    assert_bitwise(out.x[0], torch.from_numpy(a))
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.n = 1
    assert isinstance(obj.x[0], np.ndarray)


def test_dataclass_class_is_a_leaf():
    out = copy_cpu([DC, FrozenDC])
    assert out[0] is DC and out[1] is FrozenDC


def test_torch_size_leaf():
    s = torch.Size([2, 3])
    out = copy_cpu([s, {"shape": torch.Size([])}])
    assert type(out[0]) is torch.Size and out[0] == s
    assert type(out[1]["shape"]) is torch.Size and out[1]["shape"] == torch.Size([])


# --------------------------------------------------------------------------- options

OPTION_BOOLS = list(itertools.product([True, False], repeat=3))


def _options_batch(seed):
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    ro = random_array(np.dtype("f4"), (9, 3), rng)
    ro.flags.writeable = False
    return {
        "t": [random_tensor(torch.bfloat16, (5, 2), g), random_tensor(torch.bool, (7,), g)],
        "n": [random_array(np.dtype(c), (3, 4), rng) for c in "?bhidFD"],
        "neg": random_array(np.dtype("i8"), (20, 3), rng)[::-1],
        "ro": ro,
        "un": unaligned(random_array(np.dtype("f8"), (4,), rng)),
        "big": random_array(np.dtype("u2"), (300 * 1024,), rng)[::-1],  # > 256 KiB
        "zero": np.zeros((0, 2), np.float32),
        "s": "passthrough",
    }


@pytest.mark.parametrize("max_chunk", [1, 1000, 33554432])
@pytest.mark.parametrize("align", [1, 3, 16, 4096])
@pytest.mark.parametrize("staging,pack,background", OPTION_BOOLS)
def test_every_option_combination(staging, pack, background, align, max_chunk):
    data = _options_batch(31)
    h = start_copy(data, "cpu", use_pinned_staging=staging, pack_cpu_tensors=pack,
                   min_packed_alignment_bytes=align, max_packed_chunk_bytes=max_chunk,
                   use_background_thread=background)
    assert isinstance(h, AsyncCopyHandle)
    if not background:
        assert h.ready(), "use_background_thread=False: the copy is done when start_copy returns"
    out = h.get()
    assert h.ready()
    for i, t in enumerate(data["t"]):
        assert out["t"][i] is t
    for i, a in enumerate(data["n"]):
        assert_bitwise(out["n"][i], torch.from_numpy(a), f"n[{i}] (seed 31)")
        assert out["n"][i].data_ptr() == a.ctypes.data
    for k in ("neg", "ro", "un", "big", "zero"):
        assert_bitwise(out[k], np_ref(data[k]), f"{k} (seed 31)")
    assert out["s"] is data["s"]


def test_numpy_integer_options_accepted():
    out = copy_cpu([np.arange(3)], min_packed_alignment_bytes=np.int64(8),
                   max_packed_chunk_bytes=np.int32(4096))
    assert_bitwise(out[0], torch.arange(3))


def test_background_false_same_result():
    data = _options_batch(32)
    a = start_copy(data, "cpu", use_background_thread=True).get()
    h = start_copy(data, "cpu", use_background_thread=False)
    assert h.ready()
    b = h.get()
    for k in ("neg", "ro", "un", "big"):
        assert_bitwise(a[k], b[k], f"{k} (seed 32)")
    for x, y in zip(a["n"], b["n"]):
        assert_bitwise(x, y)


# --------------------------------------------------------------------------- handle

def test_ready_and_get_twice():
    a = np.arange(4 * 1024 * 1024, dtype=np.float32)[::-1]  # a real copy job
    h = start_copy({"a": a}, "cpu")
    r1 = h.get()
    assert h.ready()
    r2 = h.get()
    assert r1 is r2
    assert h.ready()
    assert_bitwise(r1["a"], np_ref(a))
    assert "ready=True" in repr(h)


def test_ready_becomes_true_without_get():
    a = np.arange(2 * 1024 * 1024, dtype=np.int64)[::-1]
    h = start_copy([a], "cpu")
    deadline = time.monotonic() + 20
    while not h.ready():
        assert time.monotonic() < deadline, "ready() never became True"
        time.sleep(0.001)
    assert_bitwise(h.get()[0], np_ref(a))


def test_ready_for_jobless_copies():
    # nothing to copy (reuse / zero-copy only): ready at once
    h = start_copy([torch.ones(2), np.ones(3), "x"], "cpu")
    assert h.ready()
    h.get()
    assert h.ready()


def test_handle_dropped_without_get():
    before = mtc_loader.stats()
    a = np.arange(8 * 1024 * 1024, dtype=np.float64)[::-1]  # 64 MiB
    for _ in range(3):
        h = start_copy([a, np.arange(10)[::-1]], "cpu")
        del h
    handles = [start_copy({"x": np.ones((100, 3))[::-1]}, "cpu") for _ in range(20)]
    del handles
    gc.collect()
    out = copy_cpu([a[:1000]])
    assert_bitwise(out[0], np_ref(a[:1000]))
    s = wait_jobs_settled()
    assert jobs_in_flight(s) == 0, s
    assert s["jobs_submitted"] - before["jobs_submitted"] == 24
    assert s["jobs_done"] - before["jobs_done"] == 24
    assert s["jobs_failed"] == before["jobs_failed"]


STATS_KEYS = {
    "calls", "leaves", "tensors_packed", "tensors_reused", "numpy_zero_copy", "host_copies",
    "tensors_staged", "tensors_direct", "tensors_d2h", "tensors_d2d", "made_contiguous",
    "jobs_submitted", "jobs_done", "jobs_failed", "bytes_h2d", "bytes_d2h", "bytes_d2d",
    "bytes_host_copy", "dma_calls", "ns_traverse", "ns_plan", "pinned_bytes_held",
    "pinned_bytes_in_use", "pinned_high_water", "pinned_waits", "pinned_cap_bytes",
    "transfer_threads",
}


def test_stats_keys_and_counters():
    s0 = wait_jobs_settled()
    assert STATS_KEYS <= set(s0), sorted(STATS_KEYS - set(s0))
    for k, v in s0.items():
        assert isinstance(v, int) and v >= 0, (k, v)
    t = torch.ones(3)
    zc = np.arange(5, dtype=np.int32)
    cp = np.arange(6, dtype=np.int16)[::-1]
    copy_cpu([t, zc, cp, "s"])
    s1 = wait_jobs_settled()
    assert s1["calls"] == s0["calls"] + 1
    assert s1["leaves"] == s0["leaves"] + 3
    assert s1["tensors_reused"] == s0["tensors_reused"] + 1
    assert s1["numpy_zero_copy"] == s0["numpy_zero_copy"] + 1
    assert s1["host_copies"] == s0["host_copies"] + 1
    assert s1["bytes_host_copy"] == s0["bytes_host_copy"] + cp.nbytes
    assert s1["jobs_submitted"] == s0["jobs_submitted"] + 1
    assert s1["jobs_done"] == s0["jobs_done"] + 1
    assert jobs_in_flight(s1) == 0

    if "jobs_inline" in s1:  # use_background_thread=False runs the job on the caller
        copy_cpu([cp], use_background_thread=False)
        s2 = mtc_loader.stats()
        assert s2["jobs_inline"] == s1["jobs_inline"] + 1
        assert s2["jobs_submitted"] == s1["jobs_submitted"]
        assert s2["jobs_done"] == s1["jobs_done"] + 1
        assert jobs_in_flight(s2) == 0
        if "jobs_in_flight" in s2:
            assert s2["jobs_in_flight"] == 0
    # CPU targets never touch pinned memory or CUDA
    for k in ("bytes_h2d", "bytes_d2h", "bytes_d2d", "tensors_packed", "tensors_staged"):
        assert s1[k] == s0[k], k


@pytest.mark.parametrize("background", [False, True])
def test_tensors_reused_counts_only_leaves_returned_as_is(background):
    """A lazy conj or neg view already on the target comes back as a new, resolved tensor: it is
    not counted in tensors_reused ("returned as is"); the plain tensor beside it is."""
    z = torch.complex(torch.ones(3), torch.ones(3))
    data = {"conj": z.conj(), "neg": torch._neg_view(torch.ones(4)), "conj_part": z.conj().imag[1:],
            "plain": torch.ones(2)}
    s0 = mtc_loader.stats()
    out = start_copy(data, "cpu", use_background_thread=background).get()
    s1 = mtc_loader.stats()
    assert out["plain"] is data["plain"]
    assert all(out[k] is not data[k] and not out[k].is_conj() and not out[k].is_neg()
               for k in ("conj", "neg", "conj_part"))
    assert torch.equal(out["conj"], z.conj().resolve_conj()) and torch.equal(out["neg"], -torch.ones(4))
    assert s1["tensors_reused"] - s0["tensors_reused"] == 1
    assert s1["leaves"] - s0["leaves"] == 4


# --------------------------------------------------------------------------- threads

_NP_POOL = [np.dtype(c) for c in "?bBhHiIlLqefdFD"]
_TORCH_POOL = [torch.bfloat16, torch.float8_e5m2, torch.bool, torch.complex64, torch.int64]


def _random_leaf(rng: random.Random, nrng: np.random.Generator, g: torch.Generator):
    r = rng.random()
    if r < 0.1:
        return rng.choice(["s", 1, None, 2.5])
    if r < 0.2:
        return random_tensor(rng.choice(_TORCH_POOL), (rng.randint(0, 5), 3), g)
    dt = rng.choice(_NP_POOL)
    shape = tuple(rng.randint(0, 6) for _ in range(rng.randint(0, 3)))
    a = random_array(dt, shape, nrng)
    kind = rng.randrange(5)
    if kind == 0 and a.ndim:
        a = a[::-1]
    elif kind == 1:
        a.flags.writeable = False
    elif kind == 2 and a.ndim >= 2:
        a = a.T
    elif kind == 3 and dt.itemsize > 1:
        a = unaligned(a)
    return a


def _random_tree(rng, nrng, g, depth=0):
    r = rng.random()
    if depth >= 4 or r < 0.35:
        return _random_leaf(rng, nrng, g)
    n = rng.randint(0, 5)
    kids = [_random_tree(rng, nrng, g, depth + 1) for _ in range(n)]
    if r < 0.6:
        return kids
    if r < 0.75:
        return tuple(kids)
    return {f"k{i}": k for i, k in enumerate(kids)}


def _check_tree(out, ref, where):
    if isinstance(ref, np.ndarray):
        assert_bitwise(out, np_ref(ref), where)
        zero_copy = ref.flags.writeable and ref.flags.aligned and all(s >= 0 for s in ref.strides)
        if zero_copy and ref.size:
            assert out.data_ptr() == ref.ctypes.data, f"{where}: not zero-copy"
    elif isinstance(ref, torch.Tensor):
        assert out is ref, f"{where}: tensor not reused"
    elif isinstance(ref, dict):
        assert type(out) is dict and list(out) == list(ref), where
        for k in ref:
            _check_tree(out[k], ref[k], f"{where}[{k!r}]")
    elif isinstance(ref, (list, tuple)):
        assert type(out) is type(ref) and len(out) == len(ref), where
        for i, (o, r) in enumerate(zip(out, ref)):
            _check_tree(o, r, f"{where}[{i}]")
    else:
        assert out is ref, where


def test_many_threads():
    n_threads, n_calls, base_seed = 8, 200, 4100
    errors = []
    barrier = threading.Barrier(n_threads)

    def worker(tid):
        seed = base_seed + tid
        rng = random.Random(seed)
        nrng = np.random.default_rng(seed)
        g = torch.Generator().manual_seed(seed)
        try:
            barrier.wait()
            for call in range(n_calls):
                data = [_random_tree(rng, nrng, g) for _ in range(rng.randint(1, 4))]
                h = start_copy(data, "cpu", use_background_thread=rng.random() < 0.8,
                               min_packed_alignment_bytes=rng.choice([1, 16, 64]))
                if rng.random() < 0.5:
                    h.ready()
                _check_tree(h.get(), data, f"seed {seed} call {call}: data")
        except BaseException as e:  # collected and re-raised on the main thread
            errors.append(f"thread {tid} (seed {seed}): {type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, "\n".join(errors)
    s = wait_jobs_settled()
    assert jobs_in_flight(s) == 0, s


def test_no_warnings_from_copies():
    # read-only arrays must not trigger torch.from_numpy's non-writable warning
    ro = np.arange(6.0)
    ro.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = copy_cpu([ro, np.arange(3)[::-1]])
    assert_bitwise(out[0], np_ref(ro))
