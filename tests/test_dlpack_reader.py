"""The engine reads a plain tensor's metadata (data pointer, device, dtype, shape, strides)
through torch's DLPack C exchange table in one C call, where torch offers one (2.10 and
later), and through five tensor attributes otherwise. Both readers must describe every leaf
the same way: the batches below are copied with each and compared, bitwise and stride for
stride, against ``tensor.to()``."""
from __future__ import annotations

import collections
import ctypes

import pytest
import torch

import mtc_loader
from mtc_loader import _engine
from mtc_loader._dtypes import DTYPES
from conftest import requires_cuda
from test_layouts import LAYOUTS, check, make

HAS_TABLE = getattr(torch.Tensor, "__dlpack_c_exchange_api__", None) is not None
needs_table = pytest.mark.skipif(not HAS_TABLE, reason="this torch has no DLPack C exchange table")
CUDA = pytest.param("cuda:0", marks=[pytest.mark.cuda, requires_cuda], id="cuda")


@pytest.fixture
def reader(request):
    """Sets the engine's reader for the test (True: DLPack), restoring it afterwards."""
    prev = _engine._use_dlpack(request.param)
    yield request.param
    _engine._use_dlpack(prev)


def _dlpack_reads(fn) -> int:
    before = mtc_loader.stats()["leaves_read_dlpack"]
    fn()
    return mtc_loader.stats()["leaves_read_dlpack"] - before


def _one_of_each_dtype() -> list[torch.Tensor]:
    out = []
    for k, dt in enumerate(DTYPES):
        raw = torch.arange(k, k + 32, dtype=torch.uint8)  # bytes, viewed as the dtype: 2 rows
        out.append(raw.view(dt).reshape(2, -1))
    return out


@needs_table
def test_plain_tensors_are_read_through_the_table():
    batch = [torch.randn(4, 3), torch.arange(5), torch.zeros(2, 2, dtype=torch.bool), torch.randn(3, 1, 2)]
    pc = mtc_loader.PackedCollate(list)
    assert _dlpack_reads(lambda: pc(batch)) == 4
    # a subclass may override what the table reads: it is read through its attributes
    sub = [torch.nn.Parameter(torch.randn(3), requires_grad=False), torch.randn(2)]
    assert _dlpack_reads(lambda: pc(sub)) == 1


def _dlpack_dtype(dt: torch.dtype):
    """(code, bits, lanes) of the DLPack description torch gives an empty tensor of dt, read from
    the DLManagedTensor in the capsule (its DLTensor's dtype field, at a fixed offset in every
    DLPack version); None where torch has no DLPack form for dt."""
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    try:
        cap = torch.utils.dlpack.to_dlpack(torch.empty(0, dtype=torch.uint8).view(dt))
    except Exception:
        return None
    # DLTensor: void *data; DLDevice device (2 x int32); int32 ndim; DLDataType dtype
    raw = ctypes.string_at(get(cap, b"dltensor") + 20, 4)
    return raw[0], raw[1], int.from_bytes(raw[2:], "little")


def _torch_dtypes() -> set:
    return {d for d in vars(torch).values() if isinstance(d, torch.dtype)}


@needs_table
def test_the_table_reads_exactly_the_dtypes_dlpack_describes_as_theirs_alone():
    """Which dtypes torch's DLPack describes, and how, is read from the running torch: a dtype
    with no DLPack form (bits*, bcomplex32 where torch has it), one of another width
    (float4_e2m1fn_x2) or one it shares with another dtype is read through its attributes."""
    forms = {dt: _dlpack_dtype(dt) for dt in _torch_dtypes()}
    ours = collections.Counter(forms[dt] for dt in DTYPES if forms[dt])
    expected = [dt for dt in DTYPES if forms[dt] and forms[dt][2] == 1 and forms[dt][1] == 8 * dt.itemsize
                and ours[forms[dt]] == 1]
    tensors = _one_of_each_dtype()
    pc = mtc_loader.PackedCollate(list)
    assert _dlpack_reads(lambda: pc(tensors)) == len(expected), expected
    assert torch.int8 in expected and torch.float32 in expected and torch.bool in expected


def _other_dtypes() -> list:
    """The dtypes the running torch has and the engine does not copy, of which a tensor can be
    made from bytes (int1..int7 and uint1..uint7: torch cannot copy them either)."""
    out = []
    for dt in sorted(_torch_dtypes() - set(DTYPES), key=str):
        try:
            torch.empty(0, dtype=torch.uint8).view(dt)
        except Exception:
            continue
        out.append(dt)
    return out


@pytest.mark.parametrize("reader", [True, False], ids=["dlpack", "attributes"], indirect=True)
@pytest.mark.parametrize("dt", _other_dtypes(), ids=str)
def test_both_readers_refuse_a_dtype_the_engine_does_not_copy(reader, dt):
    """torch's DLPack describes int4 as int8 and uint3 as uint8: the table must not copy them
    as those (the attribute reader refuses them, as does torch's own copy)."""
    t = torch.arange(8, dtype=torch.uint8).view(dt)
    for fn in (lambda: mtc_loader.PackedCollate(list)([{"x": t}]),
               lambda: mtc_loader.start_copy({"x": t, "y": torch.ones(2)}, "cpu", use_background_thread=False).get()):
        with pytest.raises(TypeError, match=rf"\['x'\] has dtype {dt}, which mtc_loader cannot copy bytewise"):
            fn()


@needs_table
def test_int8_and_uint8_stay_on_the_table_beside_dtypes_that_share_their_description():
    batch = [torch.arange(4, dtype=torch.int8), torch.arange(4, dtype=torch.uint8)]
    assert _dlpack_reads(lambda: mtc_loader.PackedCollate(list)(batch)) == 2


@pytest.mark.parametrize("reader", [True, False], ids=["dlpack", "attributes"], indirect=True)
@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_both_readers_copy_every_layout_and_dtype_as_to_does(reader, device):
    if reader and not HAS_TABLE:
        pytest.skip("this torch has no DLPack C exchange table")
    src = {c[0]: make(c) for c in LAYOUTS}
    src.update({f"dtype{k}": t for k, t in enumerate(_one_of_each_dtype())})
    src["scalar"] = torch.tensor(3.5)
    src["pinned"] = torch.arange(6.0).reshape(2, 3).pin_memory() if torch.cuda.is_available() else torch.ones(2)
    out = mtc_loader.PackedCollate(list, arena_bytes=16 << 20)([src]).unpack(device)[0]
    if device != "cpu":
        torch.cuda.synchronize()
    for k in src:
        check(out[k], src[k], device, k)
    if device != "cpu":
        out = mtc_loader.start_copy(src, device).get()
        torch.cuda.synchronize()
        for k in src:
            check(out[k], src[k], device, k)
        back = mtc_loader.start_copy(out, "cpu").get()
        for k in src:
            check(back[k], out[k], "cpu", k)


@pytest.mark.parametrize("reader", [True, False], ids=["dlpack", "attributes"], indirect=True)
def test_both_readers_refuse_the_same_leaves(reader):
    """Leaves DLPack declines or describes wrongly for a copy (lazily conjugated or negated
    views, meta and sparse tensors) meet the same checks and messages with either reader."""
    z = torch.randn(3, dtype=torch.complex64)
    cases = {"conj": z.conj(), "neg": z.conj().imag, "meta": torch.empty(3, device="meta"),
             "sparse": torch.eye(3).to_sparse()}
    for name, t in cases.items():
        try:
            out = mtc_loader.start_copy({"x": t}, "cpu").get()["x"]
        except (TypeError, ValueError, RuntimeError) as e:
            msg = str(e)
            assert "x" in msg, (name, msg)
            continue
        # accepted leaves are resolved (a materialised conjugate), as .to() would give them
        assert torch.equal(out, t.resolve_conj().resolve_neg()), name
