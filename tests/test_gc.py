"""The garbage collector's view of a copy: a batch unpacked or copied allocates no more
GC-tracked objects than building the same structure in Python does, so that a training loop
with the collector on (default thresholds) runs no full collection because of the copies."""
import gc
import threading

import pytest
import torch

import mtc_loader
from conftest import requires_cuda, seed_batch, tree_to


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clone(v) for v in x]
    return x


def _numpy(x):
    if isinstance(x, torch.Tensor):
        return x.numpy()
    if isinstance(x, dict):
        return {k: _numpy(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_numpy(v) for v in x]
    return x


def _net_tracked(call, rounds=5):
    """GC-tracked objects one call leaves allocated while its result is alive (the collector off
    around the single call; the rounds before warm the interpreter's free lists)."""
    for _ in range(rounds):
        call()
    enabled = gc.isenabled()
    gc.disable()
    try:
        c0 = gc.get_count()[0]
        r = call()
        n = gc.get_count()[0] - c0
        del r
    finally:
        if enabled:
            gc.enable()
    return n


class _Collections:
    """Collections per generation while the collector runs with the program's own settings."""

    def __init__(self):
        self.by_gen = [0, 0, 0]
        self._lock = threading.Lock()

    def __call__(self, phase, info):
        if phase == "start":
            with self._lock:
                self.by_gen[info["generation"]] += 1

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)


@pytest.fixture
def default_collector():
    if not gc.isenabled() or gc.get_threshold()[0] != 700:
        pytest.skip("the collector is off or not at its default thresholds in this process")
    gc.collect()  # start from a clean slate: what earlier tests left is not this test's
    yield


def test_unpack_allocates_no_more_than_the_structure_built_in_python():
    batch = seed_batch(16)
    pc = mtc_loader.PackedCollate(list)
    unpack = _net_tracked(lambda: pc(batch).unpack("cpu"))
    python = _net_tracked(lambda: _clone(batch))
    # 528 tensors and 145 containers either way (less what the free lists give back); the
    # PackedBatch and the handle are the only objects of their own
    assert unpack <= python + 4, (unpack, python)


def test_start_copy_allocates_no_more_than_the_structure_built_in_python():
    batch = seed_batch(16)
    arrays = _numpy(batch)
    copy = _net_tracked(lambda: mtc_loader.start_copy(arrays, "cpu").get())
    python = _net_tracked(lambda: _clone(batch))
    assert copy <= python + 4, (copy, python)


def test_3000_unpacks_run_no_full_collection(default_collector):
    batch = seed_batch(16)
    pc = mtc_loader.PackedCollate(list)
    for _ in range(20):
        pc(batch).unpack("cpu")
    with _Collections() as seen:
        for _ in range(3000):
            pc(batch).unpack("cpu")
    assert seen.by_gen[2] == 0, seen.by_gen
    # the young generation is not collected batch after batch either
    assert seen.by_gen[0] < 300, seen.by_gen


@requires_cuda
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_copies_to_and_from_the_gpu_allocate_no_more_than_the_structure(direction):
    batch = seed_batch(16)
    src, target = (batch, "cuda:0") if direction == "h2d" else (tree_to(batch, "cuda:0"), "cpu")

    def call():
        out = mtc_loader.start_copy(src, target).get()
        torch.cuda.synchronize()
        return out

    copy = _net_tracked(call)
    python = _net_tracked(lambda: _clone(batch))
    assert copy <= python + 8, (copy, python)  # the handle, the chunk and its typed views


@requires_cuda
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_3000_gpu_copies_run_no_full_collection(direction, default_collector):
    batch = seed_batch(16)
    src, target = (batch, "cuda:0") if direction == "h2d" else (tree_to(batch, "cuda:0"), "cpu")
    for _ in range(20):
        mtc_loader.start_copy(src, target).get()
    torch.cuda.synchronize()
    gc.collect()
    with _Collections() as seen:
        for _ in range(3000):
            mtc_loader.start_copy(src, target).get()
    torch.cuda.synchronize()
    assert seen.by_gen[2] == 0, seen.by_gen
