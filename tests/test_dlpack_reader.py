"""The engine reads a plain tensor's metadata (data pointer, device, dtype, shape, strides)
through torch's DLPack C exchange table in one C call, where torch offers one (2.10 and
later), and through five tensor attributes otherwise. Both readers must describe every leaf
the same way: the batches below are copied with each and compared, bitwise and stride for
stride, against ``tensor.to()``."""
from __future__ import annotations

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


@needs_table
def test_every_byte_dtype_torch_describes_is_read_through_the_table():
    """Dtypes whose DLPack description is theirs alone; bits* and sub-byte dtypes (no
    DLPack form, or one of another width) are read through their dtype."""
    tensors = _one_of_each_dtype()
    pc = mtc_loader.PackedCollate(list)
    n = _dlpack_reads(lambda: pc(tensors))
    assert n >= len([dt for dt in DTYPES if not str(dt).startswith(("torch.bits", "torch.float4"))])


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
