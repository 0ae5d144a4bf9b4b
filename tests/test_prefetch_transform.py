"""PrefetchLoader's ``transform`` (CPU): applied to every batch on the service thread after its copy,
in order, whatever structure it returns; its errors reach the loop in order, as copy errors do,
naming the transform and the batch; the position saved for resuming is the one without it. The
same on CUDA (the copy stream, the event recorded after it, its tensors recorded on the caller's
stream) is tested in test_prefetch_cuda.py."""
from __future__ import annotations

import threading

import pytest
import torch

import mtc_loader
from conftest import assert_tree_bitwise, seed_batch, tree_kept
from mtc_loader.prefetch._side import _device_tensors
from test_prefetch import Recorder, service_threads, wait_no_service_threads

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


class Summed:
    """A transform that returns a structure of its own, and records the thread of each call."""

    def __init__(self, fail_at: int = -1, error: type = ValueError):
        self.fail_at, self.error = fail_at, error
        self.threads: list[str] = []
        self.calls = 0

    def __call__(self, batch):
        k = self.calls
        self.calls += 1
        self.threads.append(threading.current_thread().name)
        if k == self.fail_at:
            raise self.error(f"bad batch {k}")
        return {"k": k, "total": reference_sum(batch), "batch": batch}


def reference_sum(batch) -> torch.Tensor:
    """The sum of the batch's 3D boxes (a tensor the transform makes)."""
    return torch.stack([sample["gt_data"]["bounding_boxes_3d"].double().sum() for sample in batch]).sum()


@pytest.mark.parametrize("on_caller", [True, False])
def test_transform_applied_to_every_batch_in_order_on_the_service_thread(on_caller):
    fn = Summed()
    loader = mtc_loader.PrefetchLoader(Recorder(6), "cpu", depth=2, produce_on_caller=on_caller, transform=fn)
    got = list(loader)
    assert [b["k"] for b in got] == list(range(6))
    for k, b in enumerate(got):
        ref = tree_kept(seed_batch(2, seed=k), "cpu")
        assert_tree_bitwise(b["batch"], ref, f"batch {k}")
        assert torch.equal(b["total"], reference_sum(ref))
    assert set(fn.threads) == {"mtc_loader-prefetch"}
    got = list(loader)  # the next epoch too
    assert [b["k"] for b in got] == list(range(6, 12))
    wait_no_service_threads()


def test_transform_none_is_the_default_and_hands_out_the_copy():
    loader = mtc_loader.PrefetchLoader(Recorder(3), "cpu")
    assert loader.transform is None
    for k, b in enumerate(loader):
        assert_tree_bitwise(b, tree_kept(seed_batch(2, seed=k), "cpu"), f"batch {k}")


@pytest.mark.parametrize("bad", [1, "scale", [len]])
def test_a_transform_that_is_not_callable_is_refused_at_construction(bad):
    with pytest.raises(TypeError, match=r"mtc_loader: transform must be a function of one batch \(or None\), got "
                                        + type(bad).__name__):
        mtc_loader.PrefetchLoader(Recorder(3), "cpu", transform=bad)
    assert not service_threads()


@pytest.mark.parametrize("on_caller", [True, False])
@pytest.mark.parametrize("error, raised", [(ValueError, ValueError), (KeyError, RuntimeError)])
def test_transform_error_comes_in_order_and_ends_the_epoch_as_a_copy_error_does(on_caller, error, raised):
    fn = Summed(fail_at=2, error=error)
    loader = mtc_loader.PrefetchLoader(Recorder(6), "cpu", produce_on_caller=on_caller, transform=fn)
    it = iter(loader)
    assert [next(it)["k"] for _ in range(2)] == [0, 1]
    with pytest.raises(raised, match=r"mtc_loader: PrefetchLoader's transform Summed raised on batch 2 of the "
                                     rf"epoch: {error.__name__}: .*bad batch 2") as e:
        next(it)
    assert type(e.value.__cause__) is error and "bad batch 2" in str(e.value.__cause__)
    with pytest.raises(StopIteration):  # the epoch ended there, as with a copy error
        next(it)
    wait_no_service_threads()
    assert [b["k"] for b in loader] == list(range(3, 9))  # the loader is usable: the next epoch is whole


def test_transform_error_names_a_function_by_its_qualified_name():
    def scale(batch):
        raise ZeroDivisionError("no scale")

    with pytest.raises(ZeroDivisionError, match=r"transform test_transform_error_names_a_function_by_its_qualified_"
                                                r"name.<locals>.scale raised on batch 0 of the epoch"):
        next(iter(mtc_loader.PrefetchLoader(Recorder(2), "cpu", transform=scale)))


def test_breaking_out_of_a_transformed_epoch_stops_the_thread():
    fn = Summed()
    for b in mtc_loader.PrefetchLoader(Recorder(50), "cpu", depth=2, produce_on_caller=False, transform=fn):
        if b["k"] == 1:
            break
    wait_no_service_threads()
    assert fn.calls <= 2 + 2 + 1  # what the thread had finished or was on


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_state_dict_with_a_transform_is_the_position_after_the_last_batch_handed_out():
    tdl = pytest.importorskip("torchdata.stateful_dataloader", reason="needs torchdata")
    from test_resume import BS, N, numbers, yielded

    loader = mtc_loader.PrefetchLoader(numbers(2), "cpu", depth=2, transform=lambda b: b * 10)
    assert isinstance(numbers(0), tdl.StatefulDataLoader)
    it = iter(loader)
    first = [next(it) for _ in range(3)]
    assert [int(x) for b in first for x in b] == [10 * i for i in range(3 * BS)]
    state = loader.state_dict()
    assert yielded(state) == 3
    it.close()
    resumed = mtc_loader.PrefetchLoader(numbers(2), "cpu", transform=lambda b: b + 1)
    resumed.load_state_dict(state)
    assert [int(x) for b in resumed for x in b] == list(range(3 * BS + 1, N + 1))


class _Slotted:
    __slots__ = ("__hidden", "shown")

    def __init__(self, hidden, shown):
        self.__hidden, self.shown = hidden, shown


class _One:
    __slots__ = "only"

    def __init__(self, only):
        self.only = only


class _Holder:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_the_tensors_a_transform_returns_are_found_wherever_they_are():
    """What the service records on the caller's stream: every tensor of the device in lists,
    tuples, sets, dicts (keys too), attributes and slots (private ones mangled), each once."""
    t = [torch.full((1,), float(i)) for i in range(8)]
    out = {"a": [t[0], (t[1],)], t[2]: _Holder(x=t[3], y=_Slotted(t[4], t[5])), "s": {_One(t[6])},
           "again": t[0], "n": 3, "str": "x", "module": torch.nn.Linear(1, 1), "h": _Holder(z=[t[7]])}
    found = _device_tensors(out, -1)  # -1: the CPU's index
    assert sorted(int(x) for x in found) == list(range(8))
    assert _device_tensors(out, 0) == []  # none on the GPU
