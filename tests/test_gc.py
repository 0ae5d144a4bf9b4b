"""The garbage collector's view of a copy: a batch unpacked or copied allocates no more
GC-tracked objects than building the same structure in Python does, so that a training loop
with the collector on (default thresholds) runs no full collection because of the copies; a
batch of more objects than the collector's first threshold is not promoted to the oldest
generation either (the engine runs the middle-generation collection its outputs would trigger
before making them, collector.h)."""
import contextlib
import gc
import subprocess
import sys
import sysconfig
import threading

import pytest
import torch

import mtc_loader
from conftest import package_parent, requires_cuda, seed_batch, subprocess_env, tree_to


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


# The collector of CPython 3.10 to 3.13 with the GIL: the one the engine times its collections for
generational = pytest.mark.skipif(
    sys.version_info >= (3, 14) or bool(sysconfig.get_config_var("Py_GIL_DISABLED")),
    reason="the engine runs collections ahead only for the generational collector of CPython 3.10-3.13")


@contextlib.contextmanager
def _early_gc(on):
    prev = mtc_loader._engine._early_gc(on)
    try:
        yield
    finally:
        mtc_loader._engine._early_gc(prev)


def _uniform(n, nbytes):
    g = torch.Generator().manual_seed(0)
    return [torch.rand(nbytes // 4, generator=g) for _ in range(n)]


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
    assert copy <= python + 8, (copy, python)  # the handle and its buffers (a tensor per dtype of the chunk)


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


def _large(name):
    return seed_batch(64) if name == "seed64" else _uniform(4096, 64)


def _calls(how, batch, target="cpu"):
    if how == "unpack":
        pc = mtc_loader.PackedCollate(list)
        return lambda: pc(batch).unpack(target)
    src = _numpy(batch) if target == "cpu" and how == "copy" else batch
    return lambda: mtc_loader.start_copy(src, target).get()


@generational
@pytest.mark.parametrize("how,name", [("unpack", "seed64"), ("unpack", "4096x64B"), ("copy", "seed64")])
def test_batches_above_the_threshold_run_no_full_collection(how, name, default_collector):
    # 2112 or 4096 tensors a batch: every call triggers young collections with the batch alive;
    # without the engine's collections ahead, a full one runs every couple of hundred calls
    call = _calls(how, _large(name))
    for _ in range(20):
        call()
    thresholds = gc.get_threshold()
    early = mtc_loader.stats()["gc_early_collections"]
    with _early_gc(True), _Collections() as seen:
        for _ in range(2000):
            call()
    assert seen.by_gen[2] == 0, seen.by_gen
    assert seen.by_gen[0] > 0 and mtc_loader.stats()["gc_early_collections"] > early, seen.by_gen
    # nothing of the program's collector settings changed
    assert gc.isenabled() and gc.get_threshold() == thresholds


@generational
def test_without_collections_ahead_the_batches_reach_the_oldest_generation(default_collector):
    # the control of the test above: the same loop with the engine's collections ahead off
    call = _calls("unpack", _large("4096x64B"))
    for _ in range(20):
        call()
    with _early_gc(False), _Collections() as seen:
        for _ in range(2000):
            call()
    assert seen.by_gen[2] > 0, seen.by_gen


def test_a_disabled_collector_sees_no_collection():
    call = _calls("unpack", _large("4096x64B"))
    early = mtc_loader.stats()["gc_early_collections"]
    enabled = gc.isenabled()
    gc.disable()
    try:
        with _Collections() as seen:
            for _ in range(50):
                call()
    finally:
        if enabled:
            gc.enable()
    assert seen.by_gen == [0, 0, 0]
    assert mtc_loader.stats()["gc_early_collections"] == early


@requires_cuda
@generational
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("name", ["seed64", "4096x64B"])
def test_3000_large_gpu_copies_run_no_full_collection(direction, name, default_collector):
    batch = _large(name)
    src, target = (batch, "cuda:0") if direction == "h2d" else (tree_to(batch, "cuda:0"), "cpu")
    for _ in range(20):
        mtc_loader.start_copy(src, target).get()
    torch.cuda.synchronize()
    with _early_gc(True), _Collections() as seen:
        for _ in range(3000):
            mtc_loader.start_copy(src, target).get()
    torch.cuda.synchronize()
    assert seen.by_gen[2] == 0, seen.by_gen


@generational
@pytest.mark.parametrize("value,expected", [("0", False), ("1", True)])
def test_mtc_early_gc_turns_it_off(value, expected):
    env = subprocess_env()
    env["MTC_EARLY_GC"] = value
    code = "import mtc_loader; print(mtc_loader._engine._early_gc(True))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         cwd=package_parent())
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(expected)


@generational
def test_a_thread_marked_as_a_service_thread_skips_the_collections_ahead(default_collector):
    # _engine.service_thread(True) (tools/diagnostics' variant of the prefetch service) marks the
    # calling thread alone: its copies run no collection ahead; another thread's still do
    call = _calls("unpack", _large("4096x64B"))
    for _ in range(20):
        call()
    counts = {}

    def run(marked: bool) -> None:
        prev = mtc_loader._engine.service_thread(marked)
        try:
            before = mtc_loader.stats()["gc_early_collections"]
            for _ in range(400):
                call()
            counts[marked] = mtc_loader.stats()["gc_early_collections"] - before
        finally:
            mtc_loader._engine.service_thread(prev)

    with _early_gc(True):
        for marked in (True, False):
            t = threading.Thread(target=run, args=(marked,))
            t.start()
            t.join()
    assert counts[True] == 0 and counts[False] > 0, counts
