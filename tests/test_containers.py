"""Containers taught with ``mtc_loader.register_container`` (and torch's pytree registry): walked
by start_copy, PackedCollate (fork and spawn workers), PackedBatch.to and PrefetchLoader; the
same class comes back with its other fields kept and its tensors on the device.

CPU tests run everywhere; the ``cuda`` variants run the same checks where a GPU is. The
classes and datasets are module-level so that workers started by spawn can unpickle them.
"""
from __future__ import annotations

import collections
import pickle

import numpy as np
import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils.data import DataLoader, Dataset

import mtc_loader
from mtc_loader import _tree
from conftest import assert_bitwise, requires_cuda

DEVICES = ["cpu", pytest.param("cuda:0", marks=requires_cuda)]


class Boxes:
    """A LiDARInstance3DBoxes-like class: one tensor plus plain fields; its constructor checks."""

    def __init__(self, tensor: torch.Tensor, box_dim: int = 7, with_yaw: bool = True):
        assert isinstance(tensor, torch.Tensor) and tensor.dim() == 2, "boxes need an (N, dim) tensor"
        self.tensor, self.box_dim, self.with_yaw = tensor, box_dim, with_yaw


def _boxes_flatten(b: Boxes):
    return [b.tensor], (type(b), b.box_dim, b.with_yaw)


def _boxes_unflatten(values, context):
    cls, box_dim, with_yaw = context
    b = cls.__new__(cls)  # no validating constructor: the values may be placeholders
    b.tensor, b.box_dim, b.with_yaw = values[0], box_dim, with_yaw
    return b


def _boxes_names(context):
    return ("tensor",)


mtc_loader.register_container(Boxes, _boxes_flatten, _boxes_unflatten, names=_boxes_names)


class DepthBoxes(Boxes):
    """A subclass: the base class's registration covers it."""


class Frame:
    """A container of several tensors and a nested registered container."""

    def __init__(self, image, boxes, meta):
        self.image, self.boxes, self.meta = image, boxes, meta


def _frame_flatten(f: Frame):
    return [f.image, f.boxes], f.meta


def _frame_unflatten(values, meta):
    f = Frame.__new__(Frame)
    f.image, f.boxes, f.meta = values[0], values[1], meta
    return f


mtc_loader.register_container(Frame, _frame_flatten, _frame_unflatten, names=lambda ctx: ("image", "boxes"))


def make_sample(i: int) -> dict:
    g = torch.Generator().manual_seed(i)
    n = 3 + i % 5
    cls = DepthBoxes if i % 2 else Boxes
    return {
        "frame": Frame(torch.rand(3, 4, 5, generator=g), cls(torch.rand(n, 7, generator=g), 7, bool(i % 3)),
                       {"token": f"s{i}", "lidar2img": np.eye(4) * i}),
        "labels": torch.randint(0, 10, (n,), generator=g),
        "idx": i,
    }


class BoxSamples(Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, i):
        return make_sample(i)


def check_same(out, ref, device, where="data"):
    """``out`` is ``ref`` with every tensor on ``device``, bitwise; other fields equal."""
    if isinstance(ref, torch.Tensor):
        assert out.device == torch.device(device), where
        assert_bitwise(out.cpu(), ref, where)
    elif isinstance(ref, (Boxes, Frame)):
        assert type(out) is type(ref), f"{where}: {type(out)} != {type(ref)}"
        assert out is not ref
        for k, v in vars(ref).items():
            check_same(getattr(out, k), v, device, f"{where}.{k}")
    elif isinstance(ref, dict):
        assert type(out) is type(ref) and list(out) == list(ref), where
        for k in ref:
            check_same(out[k], ref[k], device, f"{where}[{k!r}]")
    elif isinstance(ref, (list, tuple)):
        assert type(out) is type(ref) and len(out) == len(ref), where
        for i, (o, r) in enumerate(zip(out, ref)):
            check_same(o, r, device, f"{where}[{i}]")
    elif isinstance(ref, np.ndarray):  # a passthrough field (the frame's meta)
        np.testing.assert_array_equal(out, ref)
    else:
        assert out == ref, f"{where}: {out!r} != {ref!r}"


# --------------------------------------------------------------------------- start_copy

@pytest.mark.parametrize("device", DEVICES)
def test_start_copy_rebuilds_registered_containers(device):
    batch = [make_sample(i) for i in range(6)]
    out = mtc_loader.start_copy(batch, device).get()
    check_same(out, batch, device)
    assert type(out[1]["frame"].boxes) is DepthBoxes and out[1]["frame"].boxes.with_yaw is True
    assert out[0]["frame"].meta is batch[0]["frame"].meta  # the context is kept as it is


@pytest.mark.parametrize("device", DEVICES)
def test_packed_batch_to(device):
    batch = [make_sample(i) for i in range(4)]
    pc = mtc_loader.PackedCollate(list, arena_bytes=8 << 20)
    packed = pc(batch)
    assert packed.nbytes >= sum(s["frame"].image.numel() * 4 for s in batch)  # the tensors are in the arena
    check_same(packed.to(device), batch, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ctx,workers", [(None, 0), ("fork", 2), ("spawn", 2)])
def test_packed_collate_in_workers(ctx, workers, device):
    ds = BoxSamples()
    pc = mtc_loader.PackedCollate(list, arena_bytes=16 << 20)
    dl = DataLoader(ds, batch_size=4, num_workers=workers, collate_fn=pc, multiprocessing_context=ctx)
    n = 0
    for k, batch in enumerate(mtc_loader.PrefetchLoader(dl, device)):
        check_same(batch, [make_sample(i) for i in range(4 * k, 4 * k + 4)], device)
        n += 1
    assert n == 3


class LateBox:
    """Registered only after mtc_loader has met it (as an opaque leaf)."""

    def __init__(self, t):
        self.t = t


def test_registration_after_first_use_takes_effect():
    box = LateBox(torch.arange(4.0))
    out = mtc_loader.start_copy([box], "cpu").get()
    assert out[0] is box  # a leaf: passed through
    mtc_loader.register_container(LateBox, lambda b: ([b.t], None),
                                  lambda v, c: _late(v[0]))
    try:
        out = mtc_loader.start_copy([box], "cpu").get()
        assert type(out[0]) is LateBox and out[0] is not box
        assert_bitwise(out[0].t, box.t)
    finally:
        mtc_loader.unregister_container(LateBox)
    assert mtc_loader.start_copy([box], "cpu").get()[0] is box  # a leaf again


def _late(t):
    b = LateBox.__new__(LateBox)
    b.t = t
    return b


class Pair:
    def __init__(self, a, b):
        self.a, self.b = a, b


pytree.register_pytree_node(Pair, lambda p: ([p.a, p.b], None), lambda v, c: Pair(*v))


def test_torch_pytree_registrations_are_honoured():
    p = Pair(torch.arange(3), torch.ones(2, 2))
    out = mtc_loader.start_copy({"p": p}, "cpu").get()["p"]
    assert type(out) is Pair and out is not p
    assert_bitwise(out.a, p.a)
    assert_bitwise(out.b, p.b)
    packed = mtc_loader.PackedCollate(list, arena_bytes=1 << 20)([p])
    out = packed.unpack("cpu")[0]
    assert type(out) is Pair and torch.equal(out.b, p.b)


def test_deque_is_a_container_through_torch_pytree():
    d = collections.deque([torch.arange(2), "x"], maxlen=5)
    out = mtc_loader.start_copy(d, "cpu").get()
    assert type(out) is collections.deque and out.maxlen == 5 and out[1] == "x"
    assert_bitwise(out[0], d[0])


def test_registrations_travel_with_packed_collate_pickles():
    pc = mtc_loader.PackedCollate(list, arena_bytes=1 << 20)
    # each registration travels as a pickle of its own, named by its class
    carried = pickle.loads(pickle.dumps(pc.containers.__reduce__()[1][0]))
    regs = [pickle.loads(blob) for _, blob in carried]
    assert [name for name, _ in carried] == [f"{r[0].__module__}.{r[0].__qualname__}" for r in regs]
    classes = [r[0] for r in regs]
    assert Boxes in classes and Frame in classes
    assert [r[3] for r in regs if r[0] is Boxes] == [_boxes_names]
    assert [r[3] for r in regs if r[0] is Frame] == [None]  # its names are a lambda: left out
    # a lambda's registration does not pickle: left out (the worker must register it itself)
    mtc_loader.register_container(LateBox, lambda b: ([b.t], None), lambda v, c: _late(v[0]))
    try:
        assert LateBox not in [pickle.loads(blob)[0] for _, blob in pc.containers.__reduce__()[1][0]]
    finally:
        mtc_loader.unregister_container(LateBox)


# --------------------------------------------------------------------------- errors

class Thing:
    pass


def test_bad_registrations_are_refused_clearly():
    with pytest.raises(TypeError, match="cls must be a class, got 3"):
        mtc_loader.register_container(3, _boxes_flatten, _boxes_unflatten)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"register_container\(.*Thing\): unflatten must be callable"):
        mtc_loader.register_container(Thing, _boxes_flatten, "nope")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"Thing\): names must be callable"):
        mtc_loader.register_container(Thing, _boxes_flatten, _boxes_unflatten, names=("a",))  # type: ignore[arg-type]
    for native in (list, dict, tuple, str, int):
        with pytest.raises(TypeError, match="walked by mtc_loader itself"):
            mtc_loader.register_container(native, _boxes_flatten, _boxes_unflatten)

    class MyTensor(torch.Tensor):
        pass

    with pytest.raises(TypeError, match="MyTensor is a tensor type, a leaf"):
        mtc_loader.register_container(MyTensor, _boxes_flatten, _boxes_unflatten)
    with pytest.raises(TypeError, match="numpy array type"):
        mtc_loader.register_container(np.ndarray, _boxes_flatten, _boxes_unflatten)
    with pytest.raises(ValueError, match="Boxes is registered already; call mtc_loader.unregister_container"):
        mtc_loader.register_container(Boxes, _boxes_flatten, _boxes_unflatten)
    with pytest.raises(KeyError):
        mtc_loader.unregister_container(Thing)
    assert Thing not in _tree._REGISTRY


@pytest.mark.parametrize("bad", [torch.arange(3), ([1], None, 3), ([1],), {"a": 1}, (3, None)])
def test_flatten_returning_the_wrong_shape_names_the_path(bad):
    mtc_loader.register_container(Thing, lambda obj: bad, _boxes_unflatten)
    try:
        with pytest.raises(TypeError, match=r"data\[1\]\['t'\] \(a .*Thing\): the flatten registered for "
                                            r".*Thing returned .*; it must return \(children, context\)"):
            mtc_loader.start_copy([0, {"t": Thing()}], "cpu").get()
    finally:
        mtc_loader.unregister_container(Thing)


def test_flatten_errors_name_the_path():
    def flatten(obj):
        raise AttributeError("no field 'boxes'")

    mtc_loader.register_container(Thing, flatten, _boxes_unflatten)
    try:
        with pytest.raises(AttributeError, match=r"mtc_loader: data\[0\]\['frame'\]\.boxes \(a .*Thing\): the "
                                                 r"flatten registered with mtc_loader.register_container raised "
                                                 r"AttributeError: no field 'boxes'") as ei:
            mtc_loader.start_copy([{"frame": Frame(torch.ones(1), Thing(), None)}], "cpu").get()
        assert isinstance(ei.value.__cause__, AttributeError)
        # in a worker's collate too
        with pytest.raises(AttributeError, match=r"data\[1\] \(a .*Thing\)"):
            mtc_loader.PackedCollate(list, arena_bytes=1 << 20)([torch.ones(1), Thing()])
    finally:
        mtc_loader.unregister_container(Thing)


def test_unflatten_errors_say_what_unflatten_must_do():
    mtc_loader.register_container(Thing, lambda obj: ([torch.ones(2, 7)], None), lambda v, c: Boxes(v[0]))
    try:
        # start_copy calls unflatten with the copies: fine even for a checking constructor ...
        assert type(mtc_loader.start_copy(Thing(), "cpu").get()) is Boxes
        # ... packing calls it with placeholders: the checking constructor fails, and the error says why
        with pytest.raises(AssertionError, match=r"(?s)unflatten registered for .*Thing raised AssertionError: "
                                                 r"boxes need .* must store the values without checking them"):
            mtc_loader.PackedCollate(list, arena_bytes=1 << 20)([Thing()])
    finally:
        mtc_loader.unregister_container(Thing)


# ------------------------------------------------------- registrations changing under a copy

class Tagged(list):
    """A list subclass with a registration: it comes back built by its unflatten (tagged)."""


def _tagged_flatten(t):
    return list(t), None


def _tagged_unflatten(values, context):
    t = Tagged(values)
    t.rebuilt_by = "unflatten"
    return t


class Unrelated:
    pass


def test_registering_unrelated_classes_never_changes_a_walk():
    """One thread registers and unregisters an unrelated class in a loop while another copies a
    registered list subclass: every copy is rebuilt by its registered unflatten."""
    import sys
    import threading
    mtc_loader.register_container(Tagged, _tagged_flatten, _tagged_unflatten)
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            mtc_loader.register_container(Unrelated, lambda u: ([], None), lambda v, c: Unrelated())
            mtc_loader.unregister_container(Unrelated)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    t = threading.Thread(target=churn)
    t.start()
    wrong = 0
    try:
        data = [Tagged([torch.ones(2), torch.zeros(3)]) for _ in range(4)]
        for _ in range(1500):
            out = mtc_loader.start_copy(data, "cpu").get()
            wrong += sum(getattr(x, "rebuilt_by", None) != "unflatten" for x in out)
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(old)
        mtc_loader.unregister_container(Tagged)
    assert wrong == 0, f"{wrong} elements rebuilt by the built-in list handling"


def test_classes_met_by_the_walk_are_not_kept_alive():
    """Classes made per batch (namedtuples, dataclasses, plain pass-through classes): the caches
    of the engine and of _tree hold at most a bounded number of them."""
    import dataclasses
    import gc
    import weakref
    refs = []
    for i in range(3 * _tree._MAX_TYPES):
        NT = collections.namedtuple(f"NT{i}", "a b")

        @dataclasses.dataclass
        class DC:
            x: torch.Tensor

        class Plain:
            pass

        batch = {"nt": NT(torch.ones(1), 2), "dc": DC(torch.zeros(1)), "plain": Plain()}
        out = mtc_loader.start_copy(batch, "cpu").get()
        assert type(out["nt"]) is NT and type(out["dc"]) is DC and out["plain"] is batch["plain"]
        _tree.element_kind(NT)
        refs += [weakref.ref(NT), weakref.ref(DC), weakref.ref(Plain)]
        del NT, DC, Plain, batch, out
    gc.collect()
    alive = sum(r() is not None for r in refs)
    assert alive <= 2 * _tree._MAX_TYPES, f"{alive} of {len(refs)} classes still alive"
    assert all(r() is None for r in refs[:3 * 10])  # the first ones are long gone
