"""PackedBatch.to: the batch's structure on a device, as the frameworks' device placement calls
it (once, twice, on another device), and its errors."""
from __future__ import annotations

import pytest
import torch

import mtc_loader
from conftest import assert_tree_bitwise, requires_cuda, tree_to
from frameworks import NestedSamples, collate

DS = NestedSamples(8)


def batch_and_ref(collate_fn: mtc_loader.PackedCollate, lo: int = 0) -> tuple:
    samples = [DS[i] for i in range(lo, lo + 4)]
    return collate_fn(samples), collate(samples)


@pytest.fixture(scope="module")
def packer():
    return mtc_loader.PackedCollate(collate, arena_bytes=4 << 20)


def test_to_cpu_twice_same_structure(packer):
    batch, ref = batch_and_ref(packer)
    out = batch.to("cpu")
    assert_tree_bitwise(out, ref)
    assert batch.to(torch.device("cpu"), non_blocking=True) is out  # moved once, remembered
    assert batch.to("cpu", copy=False, memory_format=torch.preserve_format) is out


def test_to_after_unpack_and_unpack_after_to(packer):
    batch, _ = batch_and_ref(packer)
    batch.unpack()
    with pytest.raises(RuntimeError, match="mtc_loader: this PackedBatch was already unpacked"):
        batch.to("cpu")
    batch, _ = batch_and_ref(packer)
    batch.to("cpu")
    with pytest.raises(RuntimeError, match="mtc_loader: this PackedBatch was already unpacked"):
        batch.unpack()


def test_to_dtype_refused(packer):
    batch, ref = batch_and_ref(packer)
    with pytest.raises(TypeError, match="mtc_loader: PackedBatch.to moves a batch to a device and keeps"):
        batch.to("cpu", dtype=torch.float16)
    with pytest.raises(TypeError, match="mtc_loader: PackedBatch.to moves"):
        batch.to("cpu", torch.float16)
    with pytest.raises(TypeError, match="mtc_loader: PackedBatch.to moves"):
        batch.to(torch.float16)  # a dtype in the device's place, as Tensor.to(dtype) takes it
    with pytest.raises(ValueError, match="mtc_loader: invalid device"):
        batch.to("nonsense")
    assert_tree_bitwise(batch.to("cpu"), ref)  # the refusals consumed nothing


def test_region_freed_after_to(packer):
    in_use = packer.stats()["slots_in_use"]
    batch, _ = batch_and_ref(packer)
    assert packer.stats()["slots_in_use"] > in_use
    out = batch.to("cpu")
    del batch
    assert packer.stats()["slots_in_use"] == in_use
    del out


def test_frameworks_move_a_packed_batch(packer):
    """The frameworks' own device-placement functions, inside a structure too."""
    lightning = pytest.importorskip("lightning.fabric.utilities.apply_func")
    ops = pytest.importorskip("accelerate.utils.operations")
    batch, ref = batch_and_ref(packer)
    assert_tree_bitwise(lightning.move_data_to_device(batch, torch.device("cpu")), ref)
    b1, ref1 = batch_and_ref(packer, 2)
    b2, ref2 = batch_and_ref(packer, 4)
    out = ops.send_to_device({"a": b1, "b": [b2]}, torch.device("cpu"), non_blocking=True)
    assert_tree_bitwise(out, {"a": ref1, "b": [ref2]})


@requires_cuda
@pytest.mark.parametrize("non_blocking", [False, True])
def test_to_cuda_then_elsewhere(packer, non_blocking):
    batch, ref = batch_and_ref(packer)
    out = batch.to("cuda", non_blocking=non_blocking)
    assert out["x"].is_cuda
    assert batch.to(torch.device("cuda", torch.cuda.current_device())) is out
    back = batch.to("cpu")  # another device: a copy of the structure
    assert back["x"].device.type == "cpu"
    torch.cuda.current_stream().synchronize()
    assert_tree_bitwise(back, ref)
    assert_tree_bitwise(out, tree_to(ref, out["x"].device))


def test_prefetching_loader_stands_in_for_its_dataloader(packer):
    """The integrations' wrapper: the DataLoader's attributes read and set through it, its own
    kept, batches yielded on the device with a to() that hands them over as they are."""
    from mtc_loader._wrap import OnDevice, PrefetchingDataLoader
    loader = torch.utils.data.DataLoader(DS, batch_size=4, collate_fn=packer)
    wrapped = PrefetchingDataLoader(loader, "cpu", 1)
    assert wrapped.sampler is loader.sampler and wrapped.batch_size == 4 and len(wrapped) == 2

    def init(worker_id):
        return None
    wrapped.worker_init_fn = init  # Lightning seeds workers this way
    assert loader.worker_init_fn is init
    wrapped.depth = 2
    assert wrapped.depth == 2 and not hasattr(loader, "depth")
    batches = list(wrapped)
    assert all(type(b) is OnDevice for b in batches)
    out = batches[1].to(torch.device("cpu"))
    assert out is batches[1].batch
    assert_tree_bitwise(out, collate([DS[i] for i in range(4, 8)]))
    with pytest.raises(AttributeError):
        wrapped.no_such_attribute


def test_prefetching_loader_keeps_its_own_options_off_a_dataloader_that_has_the_same_names():
    """A DataLoader subclass with attributes named as the loader's options (``transform``, ...):
    the wrapper's options stay the wrapper's, the DataLoader's are left as they were."""
    from mtc_loader._wrap import PrefetchingDataLoader

    class Augmenting(torch.utils.data.DataLoader):
        transform = "the loader's own"
        produce_on_caller = "the loader's own"
        numpy_to_tensors = "the loader's own"

    loader = Augmenting(DS, batch_size=4, collate_fn=list)
    wrapped = PrefetchingDataLoader(loader, "cpu", 1)
    for name in ("transform", "produce_on_caller", "numpy_to_tensors"):
        assert getattr(loader, name) == "the loader's own", name
    assert wrapped.transform is None and wrapped.produce_on_caller is None and wrapped.numpy_to_tensors is False
    assert len(list(wrapped)) == 2
