"""The engine reads a plain tensor's metadata (data pointer, device, dtype, shape, strides, the
lazy negative and conjugate bits) through torch's C shim from the tensor inside the Python
object, where this torch passes the reader's checks (2.10 and later); else through torch's
DLPack C exchange table in one C call, where torch offers one (2.10 and later); and through
five tensor attributes otherwise. Every reader must describe every leaf the same way: the
batches below are copied with each and compared, bitwise and stride for stride, against
``tensor.to()``."""
from __future__ import annotations

import collections
import ctypes
import warnings

import pytest
import torch

import mtc_loader
from mtc_loader import _engine
from mtc_loader._dtypes import DTYPES
from conftest import requires_cuda
from test_layouts import LAYOUTS, check, make

HAS_TABLE = getattr(torch.Tensor, "__dlpack_c_exchange_api__", None) is not None
needs_table = pytest.mark.skipif(not HAS_TABLE, reason="this torch has no DLPack C exchange table")
HAS_READER = _engine._shim_parts()["reader"]
CUDA = pytest.param("cuda:0", marks=[pytest.mark.cuda, requires_cuda], id="cuda")
READERS = ["shim", "dlpack", "attributes"]


@pytest.fixture
def reader(request):
    """Sets the engine's reader for the test ("shim", "dlpack" or "attributes"), restoring it
    afterwards. A reader this torch lacks skips the test."""
    if request.param == "shim" and not HAS_READER:
        pytest.skip("this torch's tensors cannot be read through the C shim")
    if request.param == "dlpack" and not HAS_TABLE:
        pytest.skip("this torch has no DLPack C exchange table")
    prev = _engine._use_shim_reader(request.param == "shim"), _engine._use_dlpack(request.param != "attributes")
    yield request.param
    _engine._use_shim_reader(prev[0])
    _engine._use_dlpack(prev[1])


def _reads(fn, which: str = "leaves_read_dlpack") -> int:
    before = mtc_loader.stats()[which]
    fn()
    return mtc_loader.stats()[which] - before


def _dlpack_reads(fn) -> int:
    """Leaves read through the DLPack table while fn runs, the shim reader set aside."""
    prev = _engine._use_shim_reader(False)
    try:
        return _reads(fn)
    finally:
        _engine._use_shim_reader(prev)


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


@pytest.mark.parametrize("reader", READERS, indirect=True)
@pytest.mark.parametrize("dt", _other_dtypes(), ids=str)
def test_every_reader_refuses_a_dtype_the_engine_does_not_copy(reader, dt):
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


@pytest.mark.parametrize("reader", READERS, indirect=True)
@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_every_reader_copies_every_layout_and_dtype_as_to_does(reader, device):
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


@pytest.mark.parametrize("reader", READERS, indirect=True)
def test_every_reader_refuses_the_same_leaves(reader):
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


needs_reader = pytest.mark.skipif(not HAS_READER, reason="this torch's tensors cannot be read through the C shim")


@needs_reader
def test_plain_tensors_are_read_through_the_shim():
    batch = [torch.randn(4, 3), torch.arange(5), torch.zeros(2, 2, dtype=torch.bool), torch.randn(3, 1, 2)[:, :, 1:],
             torch.tensor(2.0), torch.empty(0, 3)]
    pc = mtc_loader.PackedCollate(list)
    assert _reads(lambda: pc(batch), "leaves_read_shim") == len(batch)
    assert _reads(lambda: mtc_loader.start_copy(batch, "cpu").get(), "leaves_read_shim") == len(batch)
    # a subclass may override what the shim reads: it is read through its attributes
    sub = [torch.nn.Parameter(torch.randn(3), requires_grad=False), torch.randn(2)]
    assert _reads(lambda: pc(sub), "leaves_read_shim") == 1
    # as are the dtypes the engine does not copy, and sparse tensors (both refused, by the other readers)
    with pytest.raises(TypeError):
        pc([torch.eye(2).to_sparse()])


@needs_reader
def test_the_shim_reads_what_python_reads():
    """Sizes, strides (those of dims of size 0 and 1 too, which tensor.to() keeps), the data
    pointer of views with an offset, and the lazy bits read in C (where torch exports them)."""
    base = torch.arange(60.0).reshape(3, 4, 5)
    leaves = {"t": base.transpose(0, 2), "s": base[1:, ::2, 3:], "one": base[:1, :, :1], "empty": base[:, :0],
              "e": torch.empty_strided((2, 1, 3), (7, 100, 2)), "x": torch.empty_strided((0, 4), (9, 3))}
    before = mtc_loader.stats()["leaves_read_shim"]
    out = mtc_loader.PackedCollate(list)([leaves]).unpack("cpu")[0]
    assert mtc_loader.stats()["leaves_read_shim"] - before == len(leaves)
    for name, t in leaves.items():
        check(out[name], t, "cpu", name)
    neg = torch._neg_view(torch.arange(4.0))
    out = mtc_loader.start_copy([neg], "cpu").get()[0]
    assert not out.is_neg() and torch.equal(out, -torch.arange(4.0))


@needs_reader
@pytest.mark.parametrize("case", ["nested", "vmap"])
def test_the_shim_reader_declines_tensors_without_plain_storage_quietly(case, capfd):
    """A strided nested tensor (sizes torch cannot give) and a tensor inside vmap (no storage)
    are plain torch.Tensor objects: the reader sees them decline before any getter that could
    fail, and the leaf meets the same message as with the attribute reader, with nothing printed."""
    if case == "nested":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the strided layout is a prototype
            nt = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
        fn = lambda: mtc_loader.start_copy({"x": nt}, "cpu").get()  # noqa: E731
    else:
        fn = lambda: torch.vmap(lambda a: mtc_loader.start_copy({"x": a}, "cpu").get()["x"])(torch.ones(2, 3))  # noqa: E731
    messages = []
    for use in (True, False):
        prev = _engine._use_shim_reader(use)
        try:
            with pytest.raises((TypeError, RuntimeError)) as e:
                fn()
            messages.append(str(e.value))
        finally:
            _engine._use_shim_reader(prev)
    assert messages[0] == messages[1] and "data['x']" in messages[0]
    assert capfd.readouterr().err == ""


def test_mtc_torch_shim_0_turns_the_reader_off():
    from conftest import run_child
    code = """
        import json, mtc_loader
        p = mtc_loader._engine._shim_parts()
        print(json.dumps([p["reader"], p["reader_on"]]))
    """
    off = run_child(code, MTC_TORCH_SHIM="0")
    assert off[1] is False
    on = run_child(code)
    assert on[0] == HAS_READER and on[1] == HAS_READER


@pytest.mark.parametrize("reader", ["shim", "dlpack"], indirect=True)
@pytest.mark.parametrize("how", ["packed", "start_copy"])
def test_lazy_views_are_counted_once_by_the_reader_that_read_them(reader, how):
    """A lazy conj/neg view is resolved during the walk and its replacement read in its place:
    3 leaves are 3 reads, not 6. A leaf cloned for a contiguous copy is one read too."""
    z = torch.complex(torch.arange(6.0), -torch.arange(6.0)).reshape(2, 3)
    data = {"conj": z.conj(), "neg": torch._neg_view(torch.arange(4.0)), "imag": z.conj().imag}
    which = f"leaves_read_{reader}"
    if how == "packed":
        pc = mtc_loader.PackedCollate(list, arena_bytes=1 << 20)
        assert _reads(lambda: pc([data]).unpack("cpu"), which) == 3
    else:
        assert _reads(lambda: mtc_loader.start_copy(data, "cpu", use_background_thread=False).get(), which) == 3


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("reader", ["shim", "dlpack"], indirect=True)
def test_a_leaf_made_contiguous_for_the_gpu_is_counted_once(reader):
    """A strided CPU leaf that a direct copy needs in one block is cloned and read again: one
    leaf, one read."""
    t = torch.arange(4096.0).reshape(64, 64)[:, ::2]
    before = mtc_loader.stats()
    out = mtc_loader.start_copy([t], "cuda:0", pack_cpu_tensors=False, use_background_thread=False).get()
    after = mtc_loader.stats()
    assert after["made_contiguous"] - before["made_contiguous"] == 1
    assert after[f"leaves_read_{reader}"] - before[f"leaves_read_{reader}"] == 1
    assert torch.equal(out[0].cpu(), t)
