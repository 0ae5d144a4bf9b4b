"""What the outputs' storages allow, as ``tensor.to()``'s outputs do:

- ``torch.save`` / ``torch.load`` and ``pickle`` of a batch with outputs of several dtypes (torch
  refuses to save one storage viewed as two dtypes: the outputs of one chunk share a storage
  only within one dtype);
- autograd: each output is a tensor of its own (``_base`` is None, a version counter of its
  own), so that an in-place op on one output does not break backward through another, through
  torch's C shim and through the split operators alike (``MTC_TORCH_SHIM=0``, and every torch
  without the shim), for ``start_copy``, ``PackedBatch.unpack`` and ``PrefetchLoader``.
"""
from __future__ import annotations

import io
import pickle

import pytest
import torch

import mtc_loader
from conftest import requires_cuda, run_child, seed_batch
from mtc_loader import _engine

OFFERED, _ = _engine._shim_info()
# the output makers: torch's C shim where this torch has it, and the split operators
MAKERS = [pytest.param(True, id="shim", marks=pytest.mark.skipif(not OFFERED, reason="no shim")),
          pytest.param(False, id="split")]
CUDA = [pytest.mark.cuda, requires_cuda]


class maker:
    def __init__(self, shim: bool):
        self.shim = shim

    def __enter__(self) -> None:
        self.prev = _engine._use_shim(self.shim)

    def __exit__(self, *exc) -> None:
        _engine._use_shim(self.prev)


def mixed() -> list[dict]:
    """Two samples of float32, int64, uint8 and bool leaves of several shapes."""
    g = torch.Generator().manual_seed(0)
    return [{"f": torch.rand(5, generator=g), "box": torch.rand(3, 4, generator=g),
             "i": torch.randint(-9, 9, (7,), generator=g), "u": torch.randint(0, 255, (6,), dtype=torch.uint8),
             "b": torch.rand(4, generator=g) > 0.5, "m": torch.rand(2, 2, generator=g).double()}
            for _ in range(2)]


def flat(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in flat(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in flat(v)]
    return []


def assert_round_trips(out, device: str) -> None:
    """torch.save + torch.load and pickle give back bitwise the same tensors, on `device`."""
    ts = flat(out)
    assert len({t.dtype for t in ts}) > 1
    buf = io.BytesIO()
    torch.save(out, buf)
    buf.seek(0)
    back = flat(torch.load(buf, map_location=device))
    pickled = flat(pickle.loads(pickle.dumps(out))) if device == "cpu" else back
    for t, u, v in zip(ts, back, pickled, strict=True):
        for w in (u, v):
            assert (w.dtype, w.shape, w.device) == (t.dtype, t.shape, t.device)
            assert torch.equal(w.view(-1).view(torch.uint8) if w.numel() else w,
                               t.view(-1).view(torch.uint8) if t.numel() else t)
    # a storage holds outputs of one dtype
    dtypes: dict[int, set] = {}
    for t in ts:
        if t.numel():
            dtypes.setdefault(t.untyped_storage().data_ptr(), set()).add(t.dtype)
    assert all(len(d) == 1 for d in dtypes.values()), dtypes


@pytest.mark.parametrize("shim", MAKERS)
def test_unpack_cpu_saves_loads_and_pickles(shim):
    pc = mtc_loader.PackedCollate(list, arena_bytes=4 << 20)
    with maker(shim):
        assert_round_trips(pc(mixed()).unpack("cpu"), "cpu")
        assert_round_trips(pc(mixed()).start_copy("cpu").get(), "cpu")
        assert_round_trips(pc(seed_batch(4)).to("cpu"), "cpu")


@pytest.mark.parametrize("shim", MAKERS)
def test_outputs_of_one_dtype_may_share_a_storage(shim):
    """Saving works because of the dtype split, not because nothing is shared: the float32 leaves
    of one chunk share one storage (one allocation per dtype)."""
    pc = mtc_loader.PackedCollate(list, arena_bytes=4 << 20)
    with maker(shim):
        out = pc(mixed()).unpack("cpu")
    f32 = [t for t in flat(out) if t.dtype == torch.float32]
    assert len({t.untyped_storage().data_ptr() for t in f32}) == 1


@pytest.mark.parametrize("shim", MAKERS)
@pytest.mark.parametrize("target", ["cuda:0", "cpu"])
@pytest.mark.cuda
@requires_cuda
def test_start_copy_cuda_outputs_save(shim, target):
    """Packed copies to the GPU, and of GPU tensors to the CPU (gathered into pinned chunks)."""
    src = mixed() if target != "cpu" else [{k: v.cuda() for k, v in s.items()} for s in mixed()]
    with maker(shim):
        out = mtc_loader.start_copy(src, target).get()
    torch.cuda.synchronize()
    assert_round_trips(out, target)


@pytest.mark.parametrize("shim", MAKERS)
@pytest.mark.cuda
@requires_cuda
def test_prefetch_loader_outputs_save_and_are_independent(shim):
    pc = mtc_loader.PackedCollate(list, arena_bytes=4 << 20)
    loader = torch.utils.data.DataLoader([mixed()[0]] * 4, batch_size=2, collate_fn=pc)
    with maker(shim):
        for batch in mtc_loader.PrefetchLoader(loader, "cuda:0"):
            assert_round_trips(batch, "cuda:0")
            check_independent(batch[0]["f"], batch[1]["f"])
            check_independent(batch[0]["box"], batch[1]["box"])


def check_independent(a: torch.Tensor, b: torch.Tensor) -> None:
    """a and b (same dtype, same chunk): neither is an autograd view, an in-place op on a leaves
    b's version alone and backward through a product with b works."""
    assert a._base is None and b._base is None
    w = torch.ones_like(b, requires_grad=True)
    y = (b * w).sum()  # saves b for w's gradient
    v = b._version
    a.add_(1)
    assert b._version == v
    y.backward()
    assert torch.equal(w.grad, b)


@pytest.mark.parametrize("shim", MAKERS)
def test_outputs_are_not_autograd_views(shim):
    pc = mtc_loader.PackedCollate(list, arena_bytes=4 << 20)
    with maker(shim):
        out = pc(mixed()).unpack("cpu")
        sc = pc(mixed()).start_copy("cpu").get()
    for o in (out, sc):
        assert all(t._base is None for t in flat(o))
        check_independent(o[0]["f"], o[1]["f"])  # a UNIFORM segment's members
        check_independent(o[0]["box"], o[1]["box"])
        check_independent(o[0]["m"], o[1]["m"])  # float64


_NO_SHIM = """
import json, torch, mtc_loader
from mtc_loader import _engine
pc = mtc_loader.PackedCollate(list, arena_bytes=1 << 20)
out = pc([{"a": torch.arange(5.0), "b": torch.arange(3.0), "c": torch.rand(2, 3)}]).unpack("cpu")[0]
a, b, c = out["a"], out["b"], out["c"]
w = torch.ones(3, requires_grad=True)
y = (b * w).sum()
a.add_(1)
y.backward()
print(json.dumps({"shim_on": _engine._shim_info()[1], "bases": [t._base is None for t in (a, b, c)],
                  "grad": w.grad.tolist(), "versions": [a._version, b._version, c._version]}))
"""


def test_without_the_shim_outputs_are_not_views():
    r = run_child(_NO_SHIM, MTC_TORCH_SHIM="0")
    assert r["shim_on"] is False
    assert r["bases"] == [True, True, True] and r["grad"] == [0.0, 1.0, 2.0]
    assert r["versions"][1:] == [0, 0] and r["versions"][0] == 1
