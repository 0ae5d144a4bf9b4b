"""The prefetch service behind PrefetchLoader (CPU): a daemon thread takes each batch as it is
produced; order, errors in order, early exit, stats, interpreter exit. The same service on CUDA
(copy stream, events, record_stream) is tested in test_prefetch_cuda.py."""
from __future__ import annotations

import gc
import inspect
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import mtc_loader
from conftest import assert_tree_bitwise, seed_batch, tree_kept, tree_to
from test_loader import ARENA, SeedSamples, reference, settle

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def service_threads() -> list:
    return [t for t in threading.enumerate() if t.name == "mtc_loader-prefetch"]


def wait_no_service_threads(timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while service_threads() and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert not service_threads(), "the prefetch thread outlived its iterator"


class Recorder:
    """An iterable of plain batches that records which thread produced each one."""

    def __init__(self, n: int, bad_at: int = -1, raise_at: int = -1, delay: float = 0.0):
        self.n, self.bad_at, self.raise_at, self.delay = n, bad_at, raise_at, delay
        self.threads: list[str] = []
        self.produced = 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        for k in range(self.n):
            if self.delay:
                time.sleep(self.delay)
            self.threads.append(threading.current_thread().name)
            self.produced += 1
            if k == self.raise_at:
                raise KeyError(f"iterable failed at {k}")
            batch = seed_batch(2, seed=k)
            if k == self.bad_at:
                batch[1]["bad"] = torch.zeros(2).to_sparse()  # the copy refuses it (not a dense tensor)
            yield batch


def test_batches_come_from_the_service_thread_in_order():
    src = Recorder(6)
    got = list(mtc_loader.PrefetchLoader(src, "cpu", depth=2, produce_on_caller=False))
    assert len(got) == 6
    for k, b in enumerate(got):
        assert_tree_bitwise(b, tree_kept(seed_batch(2, seed=k), "cpu"), f"batch {k}")
    assert set(src.threads) == {"mtc_loader-prefetch"}
    wait_no_service_threads()


def test_an_in_process_iterable_is_produced_on_the_callers_thread_at_its_next():
    """Over an iterable that produces its batches in this process, each batch is taken from it
    on the caller's thread inside __next__ (where a plain loop takes it), none ahead; the
    service only copies it."""
    src = Recorder(6)
    it = iter(mtc_loader.PrefetchLoader(src, "cpu", depth=3))
    time.sleep(0.1)
    assert src.produced == 0  # iter() of the iterable comes with the first next
    for k in range(6):
        b = next(it)
        assert_tree_bitwise(b, tree_kept(seed_batch(2, seed=k), "cpu"), f"batch {k}")
        time.sleep(0.05)
        assert src.produced == k + 1  # nothing taken ahead of the caller's step
    with pytest.raises(StopIteration):
        next(it)
    assert set(src.threads) == {threading.current_thread().name}
    wait_no_service_threads()


@pytest.mark.parametrize("loader_kw, expected", [
    (dict(num_workers=0), True), (dict(num_workers=2), False)])
def test_produce_on_caller_by_default_where_the_pipeline_runs_in_process(loader_kw, expected):
    from mtc_loader.prefetch._service import _produces_in_process
    dl = torch.utils.data.DataLoader(list(range(4)), batch_size=2, **loader_kw)
    assert _produces_in_process(dl) is expected
    assert _produces_in_process(iter([1])) is True
    with pytest.raises(TypeError, match="produce_on_caller"):
        mtc_loader.PrefetchLoader(dl, "cpu", produce_on_caller=1)


@pytest.mark.parametrize("on_caller", [True, False])
def test_copy_error_comes_after_the_batches_before_it_either_way(on_caller):
    got = []
    with pytest.raises(TypeError, match=r"data\[1\]\['bad'\] is a sparse tensor"):
        for k, b in enumerate(mtc_loader.PrefetchLoader(Recorder(6, bad_at=2), "cpu", produce_on_caller=on_caller)):
            assert_tree_bitwise(b, tree_kept(seed_batch(2, seed=k), "cpu"), f"batch {k}")
            got.append(k)
    assert got == [0, 1]
    got.clear()
    with pytest.raises(KeyError, match="iterable failed at 3"):
        for k, _ in enumerate(mtc_loader.PrefetchLoader(Recorder(6, raise_at=3), "cpu", produce_on_caller=on_caller)):
            got.append(k)
    assert got == [0, 1, 2]
    wait_no_service_threads()


def test_copy_error_comes_after_the_batches_before_it():
    got = []
    with pytest.raises(TypeError, match=r"data\[1\]\['bad'\] is a sparse tensor"):
        for k, b in enumerate(mtc_loader.PrefetchLoader(Recorder(6, bad_at=2), "cpu")):
            assert_tree_bitwise(b, tree_kept(seed_batch(2, seed=k), "cpu"), f"batch {k}")
            got.append(k)
    assert got == [0, 1]
    wait_no_service_threads()


def test_iterable_error_comes_after_the_batches_before_it():
    got = []
    with pytest.raises(KeyError, match="iterable failed at 3"):
        for k, _ in enumerate(mtc_loader.PrefetchLoader(Recorder(6, raise_at=3), "cpu", depth=1)):
            got.append(k)
    assert got == [0, 1, 2]
    wait_no_service_threads()


def test_iter_error_is_raised_by_the_first_next():
    class NoIter:
        def __iter__(self):
            raise OSError("cannot open the data set")

    with pytest.raises(OSError, match="cannot open the data set"):
        next(iter(mtc_loader.PrefetchLoader(NoIter(), "cpu")))
    wait_no_service_threads()


@pytest.mark.parametrize("depth", [1, 3])
def test_depth_bounds_the_batches_taken_ahead(depth):
    src = Recorder(20)
    it = iter(mtc_loader.PrefetchLoader(src, "cpu", depth=depth, produce_on_caller=False))
    next(it)
    time.sleep(0.3)  # the service fills up to depth finished batches, plus the one it is on
    assert 1 + depth <= src.produced <= 1 + depth + 1, src.produced
    del it
    wait_no_service_threads()


def test_a_handed_out_batch_is_freed_where_the_caller_drops_it():
    # neither the service thread nor the generator keeps a batch it handed out: the caller's
    # `del` frees it, also while the service is inside next() of the iterable for the batch after
    pc = mtc_loader.PackedCollate(lambda b: b, arena_bytes=ARENA)
    batches = [pc(seed_batch(2, seed=k)) for k in range(5)]
    gate = threading.Semaphore(0)

    def gated():
        for k, b in enumerate(batches):
            if k:
                gate.acquire()  # batch k comes when the test lets it
            yield b

    it = iter(mtc_loader.PrefetchLoader(gated(), "cpu", depth=2))
    gc.disable()  # only reference counts free the batch here
    try:
        for _ in range(len(batches)):
            batch = next(it)
            time.sleep(0.05)  # the service waits inside next() for the batch after this one
            leaf = weakref.ref(batch[0]["cams_gt"][0]["depths"])
            del batch
            assert leaf() is None, "a handed-out batch outlived the caller's del"
            gate.release()
    finally:
        gc.enable()
        del it
    wait_no_service_threads()


def test_early_break_stops_the_thread_and_the_next_epoch_works():
    src = Recorder(10, delay=0.01)
    pl = mtc_loader.PrefetchLoader(src, "cpu")
    for k, _ in enumerate(pl):
        if k == 1:
            break
    wait_no_service_threads()
    assert src.produced <= 5
    assert len(list(pl)) == 10


@pytest.mark.parametrize("workers", [0, 2])
def test_packed_batches_early_break_frees_every_region(workers):
    ds = SeedSamples(n=40)
    pc = mtc_loader.PackedCollate(list, arena_bytes=ARENA)
    dl = DataLoader(ds, batch_size=4, num_workers=workers, collate_fn=pc)
    refs = reference(ds, batch_size=4)
    for k, b in enumerate(mtc_loader.PrefetchLoader(dl, "cpu", depth=3)):
        assert_tree_bitwise(b, tree_kept(refs[k], "cpu"), f"batch {k}")
        if k == 1:
            time.sleep(0.2)  # finished batches wait in the service's queue
            break
    del b
    wait_no_service_threads()
    assert settle(pc.arena)["slots_in_use"] == 0
    assert pc.arena._a.valid()


def test_stats_report_waiting_and_stepping():
    pl = mtc_loader.PrefetchLoader(Recorder(8, delay=0.02), "cpu", depth=2)
    for _ in pl:
        time.sleep(0.005)  # the "step"
    s = pl.stats()
    assert s["batches"] == 8
    assert s["step_ms_per_batch"] >= 4.0
    assert s["wait_ms"] > 0 and 0.0 < s["data_bound"] < 1.0
    assert s["service_cpu_ms_per_batch"] > 0
    assert 0 < s["service_next_ms_per_batch"] <= s["service_cpu_ms_per_batch"]
    # a loader slower than the loop is data-bound; a fast one is not
    slow = s["data_bound"]
    pl.reset_stats()
    assert pl.stats()["batches"] == 0
    fast = mtc_loader.PrefetchLoader(Recorder(8), "cpu", depth=4)
    for _ in fast:
        time.sleep(0.02)
    assert fast.stats()["data_bound"] < slow


def test_start_side_copy_on_cpu_is_start_copy():
    data = seed_batch(2, seed=5)
    side = mtc_loader.start_side_copy(data, "cpu")
    assert_tree_bitwise(side.get(), tree_kept(data, "cpu"))
    assert side.ready()
    with pytest.raises(ValueError, match="copy_stream needs a CUDA device"):
        mtc_loader.copy_stream("cpu")


def test_interpreter_exit_with_the_service_busy(tmp_path):
    """The service thread is stopped and joined when the interpreter begins to shut down, so it is
    never frozen inside a torch operator (which aborts the process)."""
    script = tmp_path / "exit_busy.py"
    script.write_text(textwrap.dedent("""
        import torch, mtc_loader
        from torch.utils.data import DataLoader, Dataset

        class Big(Dataset):
            def __len__(self):
                return 10_000
            def __getitem__(self, i):
                return {"x": torch.full((64, 1024), float(i)), "y": [torch.arange(i % 50) for _ in range(20)]}

        pc = mtc_loader.PackedCollate(list, arena_bytes=64 << 20)
        dl = DataLoader(Big(), batch_size=8, num_workers=2, collate_fn=pc)
        it = iter(mtc_loader.PrefetchLoader(dl, "cpu", depth=4))
        for _ in range(3):
            next(it)
        print("exiting", flush=True)
    """))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert "exiting" in r.stdout
    assert "terminate called" not in r.stderr


def test_gil_switch_interval_lowered_while_working_and_restored():
    default = sys.getswitchinterval()
    seen = []

    class Watch(Recorder):
        def __iter__(self):
            for b in super().__iter__():
                seen.append(sys.getswitchinterval())  # the service thread is working on a batch
                yield b

    assert len(list(mtc_loader.PrefetchLoader(Watch(5), "cpu", gil_switch_interval=0.0002,
                                              produce_on_caller=False))) == 5
    assert seen and all(abs(s - 0.0002) < 1e-9 for s in seen), seen
    wait_no_service_threads()
    assert sys.getswitchinterval() == default
    seen.clear()
    assert len(list(mtc_loader.PrefetchLoader(Watch(3), "cpu", gil_switch_interval=None,
                                              produce_on_caller=False))) == 3
    assert seen and all(s == default for s in seen)


@pytest.mark.parametrize("bad", [0, -1.0, 2.0, "fast", True])
def test_bad_gil_switch_interval(bad):
    with pytest.raises(ValueError, match="gil_switch_interval"):
        mtc_loader.PrefetchLoader([], "cpu", gil_switch_interval=bad)


@pytest.mark.parametrize("args, err, match", [
    ((-1, 0, 8), ValueError, "device index in \\[0, 64\\).*got device -1"),
    ((64, 0, 8), ValueError, "got device 64"),
    ((0, 0, 0), ValueError, "a recorded event"),
    ((0, 0), TypeError, "takes 3 arguments"),
    ((0, "s", 8), TypeError, "integer"),
])
def test_stream_wait_event_refuses_bad_arguments(args, err, match):
    """The hand-out's driver-level wait (GIL held) checks what it is given before any CUDA call."""
    with pytest.raises(err, match=match):
        mtc_loader._engine.stream_wait_event(*args)


@pytest.mark.parametrize("args, err, match", [
    ((-1, 0), ValueError, "device index in \\[0, 64\\), got -1"),
    ((64, 0), ValueError, "got 64"),
    ((0,), TypeError, "takes 2 arguments"),
    ((0, "s"), TypeError, "integer"),
])
def test_event_record_refuses_bad_arguments(args, err, match):
    """The service's pooled event (recorded with the GIL held) checks what it is given first."""
    with pytest.raises(err, match=match):
        mtc_loader._engine.event_record(*args)


def test_event_record_without_a_driver_says_why():
    if torch.cuda.is_available():
        pytest.skip("a CUDA driver is present (covered by test_prefetch_cuda.py)")
    with pytest.raises(RuntimeError, match="recording a batch's event .* failed: libcuda"):
        mtc_loader._engine.event_record(0, 0)
    mtc_loader._engine.event_release(0, 0)  # nothing to give back: ignored


def test_stream_wait_event_without_a_driver_says_why():
    if torch.cuda.is_available():
        pytest.skip("a CUDA driver is present (covered by test_prefetch_cuda.py)")
    with pytest.raises(RuntimeError, match="wait for a batch's event failed: libcuda"):
        mtc_loader._engine.stream_wait_event(0, 0, 8)


_INTERRUPT_CHILD = """
import multiprocessing, os, sys, threading, time
import torch
from torch.utils.data import DataLoader, Dataset
import mtc_loader

class Stall(Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, i):
        if i == 1:
            time.sleep({stall})
        return torch.full((4,), i)

pc = mtc_loader.PackedCollate(arena_bytes=8 << 20)
dl = DataLoader(Stall(), batch_size=1, num_workers=1, collate_fn=pc, multiprocessing_context="fork")
try:
    for k, b in enumerate(mtc_loader.PrefetchLoader(dl, "cpu")):
        print("batch", k, flush=True)
except KeyboardInterrupt:
    print("interrupted", time.monotonic(), flush=True)
del dl
# the service thread ends by itself once the stalled batch arrives, and shuts the worker down
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    threads = [t for t in threading.enumerate() if t.name == "mtc_loader-prefetch"]
    if not threads and not multiprocessing.active_children():
        break
    time.sleep(0.05)
pc.arena.reclaim_dead()
print("cleaned", len(threads), len(multiprocessing.active_children()), pc.stats()["slots_in_use"], flush=True)
"""


def test_ctrl_c_while_a_batch_stalls_reaches_the_caller_promptly():
    """SIGINT while the loop waits for a batch the worker takes 8 s to make: KeyboardInterrupt
    reaches the loop at once (a bare DataLoader's behaviour), and the service thread and the
    worker end by themselves after (the stalled batch is dropped)."""
    import os
    import signal
    stall = 8.0
    p = subprocess.Popen([sys.executable, "-c", _INTERRUPT_CHILD.format(stall=stall)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=":".join(sys.path)))
    watchdog = threading.Timer(120, p.kill)  # bounds the readline below too
    watchdog.start()
    try:
        assert p.stdout.readline().split() == ["batch", "0"]  # the loop now waits for batch 1
        time.sleep(0.3)
        sent = time.monotonic()
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        watchdog.cancel()
        p.kill()
    lines = dict(line.split(" ", 1) for line in out.splitlines())
    assert "interrupted" in lines, (out, err[-2000:])
    # at once (the caller does not wait for a service inside next()), not after the stall
    assert float(lines["interrupted"]) - sent < 3.0, "the interrupt waited for the stalled batch"
    assert lines["cleaned"].split() == ["0", "0", "0"], (out, err[-2000:])  # threads, workers, regions
    assert p.returncode == 0, err[-2000:]


def test_reset_stats_mid_epoch_counts_the_rest_of_the_epoch():
    pl = mtc_loader.PrefetchLoader(Recorder(8), "cpu")
    for k, _ in enumerate(pl):
        if k == 2:
            pl.reset_stats()
            assert pl.stats()["batches"] == 0
    assert pl.stats()["batches"] == 5  # batches 3..7


class Numbers(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int):
        return torch.tensor([i])


@pytest.mark.parametrize("packed", [False, True])
def test_two_epochs_at_once_over_persistent_workers_are_refused(packed):
    """zip(PrefetchLoader(dl, ...), PrefetchLoader(dl, ...)) over a DataLoader with persistent
    workers: both would share its one iterator. The second is refused; one after the other,
    and after a break, each epoch gets every batch once, in order."""
    collate = mtc_loader.PackedCollate(arena_bytes=ARENA) if packed else None
    dl = DataLoader(Numbers(), batch_size=2, num_workers=2, persistent_workers=True, collate_fn=collate)
    want = [torch.tensor([[2 * k], [2 * k + 1]]) for k in range(6)]
    a, b = mtc_loader.PrefetchLoader(dl, "cpu"), mtc_loader.PrefetchLoader(dl, "cpu")
    with pytest.raises(RuntimeError, match="persistent_workers=True.*already being iterated"):
        for _ in zip(a, b):
            pass
    for pl in (a, b, a):
        got = list(pl)
        assert len(got) == 6 and all(torch.equal(g, w) for g, w in zip(got, want))
    for k, _ in enumerate(a):
        if k == 1:
            break
    got = list(b)  # waits for a's thread to leave the shared iterator
    assert len(got) == 6 and all(torch.equal(g, w) for g, w in zip(got, want))
    # an iterator, too
    it = iter(range(4))
    with pytest.raises(RuntimeError, match="this iterator is already being iterated"):
        list(zip(mtc_loader.PrefetchLoader(it, "cpu"), mtc_loader.PrefetchLoader(it, "cpu")))
    # a DataLoader without persistent workers makes an iterator per epoch: both run
    dl = DataLoader(Numbers(), batch_size=2, num_workers=1, collate_fn=collate)
    for x, y in zip(mtc_loader.PrefetchLoader(dl, "cpu"), mtc_loader.PrefetchLoader(dl, "cpu")):
        assert torch.equal(x, y)


@pytest.mark.parametrize("packed", [False, True])
def test_misspelled_option_refused_at_construction(packed):
    collate = mtc_loader.PackedCollate(arena_bytes=ARENA) if packed else None
    dl = DataLoader(Numbers(), batch_size=2, collate_fn=collate)
    with pytest.raises(TypeError, match="mtc_loader: PrefetchLoader got unexpected keyword argument.*depht.*"
                                        "use_background_thread"):
        mtc_loader.PrefetchLoader(dl, "cpu", depht=3)
    # the message names every keyword the loader takes, its own and start_copy's
    with pytest.raises(TypeError) as e:
        mtc_loader.PrefetchLoader(dl, "cpu", produce_on_calller=True)
    own = [p for p in inspect.signature(mtc_loader.PrefetchLoader).parameters if p not in ("iterable", "device",
                                                                                       "start_copy_options")]
    takes = own + [p for p, v in inspect.signature(mtc_loader.start_copy).parameters.items() if v.kind is v.KEYWORD_ONLY]
    assert "produce_on_caller" in own
    for name in takes:
        assert re.search(rf"\b{name}\b", str(e.value).split(";", 1)[1]), (name, str(e.value))
    pl = mtc_loader.PrefetchLoader(dl, "cpu", use_background_thread=False, pack_cpu_tensors=True)
    assert len(list(pl)) == 6
    if packed:  # the packed batch's own start_copy takes start_copy's keywords, and no other
        with pytest.raises(TypeError, match="depht"):
            collate([torch.ones(2)]).start_copy("cpu", depht=3)
        out = collate([torch.ones(2)]).start_copy("cpu", max_packed_chunk_bytes=1 << 20).get()
        assert torch.equal(out, torch.ones(1, 2))


def test_side_copy_takes_the_temporary_views_out_of_the_handle():
    """The service thread drops the engine's handle after the copy; the temporary views (whose
    drop releases the GIL) go with the SideCopy instead and are dropped at hand-out."""
    from mtc_loader import _engine
    from mtc_loader.prefetch._side import SideCopy, _start
    data = seed_batch(2, seed=3)
    pc = mtc_loader.PackedCollate(list)
    # the split maker makes temporaries (torch's C shim makes none: see below)
    was, shim = _engine.keep_temporaries(True), _engine._use_shim(False)  # what the service thread asks for
    try:
        side = SideCopy(_start(pc(data), "cpu", {}), -1)
    finally:
        _engine.keep_temporaries(was)
        _engine._use_shim(shim)
    h = side._handle
    side._finish()
    assert side._keep, "the SideCopy holds the temporaries"
    assert h.temporaries() == [], "the handle no longer does"
    assert_tree_bitwise(side.get(), data)
    if _engine._shim_info()[0]:
        # through the shim the outputs are made with no temporary tensor at all
        was, shim = _engine.keep_temporaries(True), _engine._use_shim(True)
        try:
            side = SideCopy(_start(pc(data), "cpu", {}), -1)
        finally:
            _engine.keep_temporaries(was)
            _engine._use_shim(shim)
        side._finish()
        assert not side._keep
        assert_tree_bitwise(side.get(), data)
    # any other thread's copy drops them as it makes them: nothing outlives the call
    side = SideCopy(_start(pc(data), "cpu", {}), -1)
    h = side._handle
    side._finish()
    assert not side._keep
    assert_tree_bitwise(side.get(), data)


class _CountingRange(torch.autograd.profiler.record_function):
    entered = 0

    def __enter__(self):
        type(self).entered += 1
        return super().__enter__()


@pytest.mark.parametrize("workers", [0, 2])
def test_service_takes_dataloader_batches_without_the_profiler_range(monkeypatch, workers):
    """A DataLoader's __next__ opens a record_function range per batch, which costs the service
    thread CPU and records nothing while no profiler runs: the service takes the batches without
    it, and with it while a profiler runs (so that a profile still shows the DataLoader's range).
    Either way every batch comes once, in order, and len() of an epoch holds."""
    monkeypatch.setattr(torch.autograd.profiler, "record_function", _CountingRange)
    _CountingRange.entered = 0
    dl = DataLoader(Numbers(), batch_size=2, num_workers=workers, persistent_workers=workers > 0)
    want = [torch.tensor([[2 * k], [2 * k + 1]]) for k in range(6)]
    pl = mtc_loader.PrefetchLoader(dl, "cpu")
    for _ in range(2):
        got = list(pl)
        assert len(got) == 6 and all(torch.equal(g, w) for g, w in zip(got, want))
    # the first batch of an epoch goes through __next__ (it resets the iterator): one range each
    assert _CountingRange.entered <= 2
    _CountingRange.entered = 0
    with torch.autograd.profiler.profile():
        got = list(pl)
    assert len(got) == 6 and all(torch.equal(g, w) for g, w in zip(got, want))
    assert _CountingRange.entered >= 6
    # an iterator whose class overrides __next__ is called through it
    calls = []

    class Mine(torch.utils.data.dataloader._SingleProcessDataLoaderIter):
        def __next__(self):
            calls.append(1)
            return super().__next__()

    class MyLoader(DataLoader):
        def _get_iterator(self):
            return Mine(self)

    got = list(mtc_loader.PrefetchLoader(MyLoader(Numbers(), batch_size=2), "cpu"))
    assert len(got) == 6 and len(calls) == 7  # 6 batches and the StopIteration


_INTERRUPTED_LOOP = """
import sys, time, torch
from torch.utils.data import DataLoader, Dataset
import mtc_loader

class Slow(Dataset):  # a data-bound loop: a batch of 2 takes a worker a second
    def __len__(self):
        return 10_000

    def __getitem__(self, i):
        time.sleep(0.5)
        return {"x": torch.full((4,), i), "y": torch.arange(3)}

if __name__ == "__main__":
    dl = DataLoader(Slow(), batch_size=2, num_workers=2, collate_fn=mtc_loader.PackedCollate(arena_bytes=8 << 20))
    loader = mtc_loader.PrefetchLoader(dl, "cpu") if sys.argv[1] == "prefetch" else dl
    try:
        for n, batch in enumerate(loader):
            if n == 0:
                print("READY", flush=True)
    except KeyboardInterrupt:
        print("INTERRUPTED", time.monotonic(), flush=True)
        raise
"""


def _interrupted(script, mode: str) -> tuple[float, float]:
    """(seconds from SIGINT to the KeyboardInterrupt in the loop, seconds to the process's exit)."""
    from conftest import package_parent, subprocess_env
    with subprocess.Popen([sys.executable, str(script), mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, cwd=package_parent(), env=subprocess_env()) as p:
        watchdog = threading.Timer(120, p.kill)  # bounds the readline below too
        watchdog.start()
        try:
            ready = p.stdout.readline().strip()
            time.sleep(0.7)  # inside the wait for the next batch
            t0 = time.monotonic()
            p.send_signal(signal.SIGINT)
            line = p.stdout.readline().split()
            p.wait(timeout=60)
            t1 = time.monotonic()
            out, err = p.communicate()
        finally:
            watchdog.cancel()
            p.kill()
    assert ready == "READY" and line and line[0] == "INTERRUPTED", (ready, line, err[-2000:])
    assert "KeyboardInterrupt" in err, err[-2000:]
    return float(line[1]) - t0, t1 - t0


def test_ctrl_c_in_a_data_bound_loop_reaches_the_caller_at_once(tmp_path):
    """SIGINT while the loop waits for a slow batch: the KeyboardInterrupt reaches the loop at once
    (a bare DataLoader's takes milliseconds), and the process exits about as soon as a bare
    DataLoader's does (its workers are told to stop at once, not after the batch they are on)."""
    script = tmp_path / "loop.py"
    script.write_text(_INTERRUPTED_LOOP)
    bare = [_interrupted(script, "bare") for _ in range(2)]
    ours = [_interrupted(script, "prefetch") for _ in range(2)]
    for latency, _ in ours:
        assert latency < 0.2, (ours, bare)
    assert min(e for _, e in ours) < max(e for _, e in bare) + 1.0, (ours, bare)


class _SlowNumbers(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(0.2)
        return torch.tensor([i])


@pytest.mark.parametrize("persistent", [True, False])
def test_an_interrupted_epoch_leaves_the_next_one_whole(persistent):
    """A KeyboardInterrupt while the service waits inside the DataLoader's next() wakes that
    thread (the workers are told to stop at once); the caller who catches it and iterates again
    gets every batch of the next epoch, in order: with persistent workers the same iterator
    resumes, and what the wake-up left in its queue is discarded."""
    dl = DataLoader(_SlowNumbers(), batch_size=2, num_workers=2, persistent_workers=persistent)
    pl = mtc_loader.PrefetchLoader(dl, "cpu")
    it = iter(pl)
    assert torch.equal(next(it), torch.tensor([[0], [1]]))
    assert torch.equal(next(it), torch.tensor([[2], [3]]))  # the service now waits for the next
    main = threading.main_thread().ident
    timer = threading.Timer(0.05, signal.pthread_kill, (main, signal.SIGINT))
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        for _ in it:
            pass
    assert time.monotonic() - t0 < 0.25  # at once, not once the awaited batch came
    timer.join()
    got = [b.flatten().tolist() for b in pl]
    assert got == [[0, 1], [2, 3], [4, 5], [6, 7]]
    del it
    wait_no_service_threads()
