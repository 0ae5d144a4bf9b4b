"""Fault injection: every case ends with a clear exception or correct results, and afterwards
the engine still works (a follow-up copy is bitwise correct) and holds nothing: no job in
flight, no pinned slab in use, no arena slot in use.

CPU cases run everywhere; CUDA cases are marked ``cuda`` and skip without a GPU.
"""
from __future__ import annotations

import _thread
import gc
import multiprocessing as mp
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import mtc_loader
from conftest import (assert_tree_bitwise, package_parent, requires_cuda, seed_batch, subprocess_env, terminal_stderr,
                      tree_to)
from mtc_loader import PackedBatch, PackedCollate, PrefetchLoader, start_copy


# ----------------------------------------------------------------------------------- helpers

def ref_of(data):
    """The expected result on the CPU: numpy leaves as (writable, contiguous) tensor copies."""
    if isinstance(data, np.ndarray):
        return torch.from_numpy(np.array(data))
    if isinstance(data, dict):
        return type(data)((k, ref_of(v)) for k, v in data.items())
    if isinstance(data, (list, tuple)):
        return type(data)(ref_of(v) for v in data)
    return data


def assert_clean(*arenas, timeout: float = 10.0) -> dict:
    """Nothing held: no job in flight, no pinned slab in use, no arena slot in use. Completion
    callbacks (region frees after a DMA) may trail get() briefly: poll up to ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        for a in arenas:  # workers that exited since (their iterator was collected just now)
            a.arena.reclaim_dead() if hasattr(a, "arena") else a.reclaim_dead()
        s = mtc_loader.stats()
        slots = [a.stats()["slots_in_use"] for a in arenas]
        if (s["jobs_in_flight"] == 0 and s["pinned_slabs_in_use"] == 0 and not any(slots)) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert s["jobs_in_flight"] == 0, s
    assert s["pinned_slabs_in_use"] == 0, s
    assert not any(slots), [a.stats() for a in arenas]
    return s


def follow_up(device: str = "cpu") -> None:
    """The engine still works: a mixed copy (packed tensors, numpy copies) is bitwise correct."""
    data = {"seed": seed_batch(2, seed=7),
            "np": [np.arange(1000, dtype=np.int32)[::-1], np.linspace(0, 1, 77)],
            "big": np.arange(300_000, dtype=np.float32)[::-1], "tag": "x"}
    data["np"][1].flags.writeable = False
    out = start_copy(data, device).get()
    if device != "cpu":
        torch.cuda.synchronize()
    assert_tree_bitwise(out, tree_to(ref_of(data), device))


def slow_host_copy_inputs(total_bytes: int = 512 << 20, n: int = 4) -> list:
    """numpy arrays that the engine must copy (negative strides), ~total_bytes: a CPU copy that
    takes a good fraction of a second."""
    per = total_bytes // n // 8
    return [(np.arange(per, dtype=np.float64) * (i + 1))[::-1] for i in range(n)]


def wait_child(pid: int, timeout: float = 60.0) -> int:
    """The exit code of a forked child; kills it and fails if it does not finish in time."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"forked child {pid} hung for {timeout} s")
        time.sleep(0.01)


def fork_quietly() -> int:
    # Python >= 3.12 warns about fork() in a multi-threaded process: forking with the engine's
    # threads running is exactly what these tests do
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return os.fork()


class Samples(Dataset):
    """Seed-batch samples; __getitem__(kill_index) SIGKILLs the worker after it packed a batch
    of its own into the arena (a region owned by the worker that nobody will ever adopt)."""

    def __init__(self, n: int = 64, pc: PackedCollate | None = None, kill_index: int | None = None,
                 bad_index: int | None = None):
        self.n, self.pc, self.kill_index, self.bad_index = n, pc, kill_index, bad_index

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if i == self.kill_index and torch.utils.data.get_worker_info() is not None:
            self._orphan = self.pc([seed_batch(1, seed=999)[0]])  # owned by this worker
            os.kill(os.getpid(), signal.SIGKILL)
        s = seed_batch(1, seed=i)[0]
        if i == self.bad_index:
            s["cams_gt"][3]["depths"] = s["cams_gt"][3]["depths"].to_sparse()
        return s


def expected(i0: int, n: int) -> list:
    return [seed_batch(1, seed=i)[0] for i in range(i0, i0 + n)]


@pytest.fixture(autouse=True)
def _restore_pinned_cap_and_guard_hangs():
    """Restores the pinned cap; a test that hangs (a deadlock is a possible outcome of fault
    injection) dumps every thread's stack on the terminal (past pytest's capture, which the
    run's end would discard) and ends the run instead of hanging it."""
    import faulthandler
    cap = mtc_loader.stats()["pinned_cap_bytes"]
    faulthandler.dump_traceback_later(240, exit=True, file=terminal_stderr())
    yield
    faulthandler.cancel_dump_traceback_later()
    mtc_loader.configure(pinned_cap_bytes=cap)


# --------------------------------------------------------------------- DataLoader worker death

def test_worker_sigkilled_mid_batch_then_next_epoch_works():
    pc = PackedCollate(list, arena_bytes=32 << 20)
    ds = Samples(64, pc=pc, kill_index=37)
    dl = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=pc)
    got = []
    with pytest.raises(RuntimeError, match="DataLoader worker"):
        for b in PrefetchLoader(dl, "cpu"):
            got.append(b)
    # batches before the failure were correct
    assert len(got) < 16
    for k, b in enumerate(got):
        assert_tree_bitwise(b, expected(4 * k, 4), f"batch{k}")
    del dl, got
    gc.collect()
    # the dead worker's orphan region is reclaimed: by PrefetchLoader's error path, or here
    # once the DataLoader reaped its workers (a zombie still counts as alive)
    pc.arena.reclaim_dead()
    s = pc.stats()
    assert s["reclaimed_slots"] >= 1, s
    assert_clean(pc)
    assert pc.arena._a.valid()

    # the next epoch, a new DataLoader on the same PackedCollate
    ds.kill_index = None
    dl = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=pc)
    n = 0
    for k, b in enumerate(PrefetchLoader(dl, "cpu")):
        assert_tree_bitwise(b, expected(4 * k, 4), f"epoch2 batch{k}")
        n += 1
    assert n == 16
    del b
    assert_clean(pc)
    follow_up()


def test_prefetch_loader_reclaims_dead_owners_on_error():
    """Deterministic: a process that packed a region and died; the iterable then fails. The
    PrefetchLoader re-raises after the good batches and has freed the dead process's region."""
    pc = PackedCollate(list, arena_bytes=8 << 20)
    pid = fork_quietly()
    if pid == 0:  # child: pack a region and die without sending it
        try:
            signal.alarm(40)
            torch.set_num_threads(1)
            pc(expected(0, 2))
        finally:
            os._exit(0)
    assert wait_child(pid) == 0
    assert pc.stats()["slots_in_use"] == 1

    def batches():
        yield pc(expected(0, 2))
        yield pc(expected(2, 2))
        raise ValueError("the dataset broke")

    got = []
    with pytest.raises(ValueError, match="the dataset broke"):
        for b in PrefetchLoader(batches(), "cpu"):
            got.append(b)
    assert len(got) == 2
    assert_tree_bitwise(got[0], expected(0, 2))
    assert_tree_bitwise(got[1], expected(2, 2))
    s = pc.stats()
    assert s["reclaimed_slots"] == 1 and s["slots_in_use"] == 0, s
    assert_clean(pc)


def test_early_break_over_workers_frees_their_regions():
    """Batches the workers had packed but the main process never received (the loop stopped
    early) are reclaimed once PrefetchLoader has shut the workers down."""
    pc = PackedCollate(list, arena_bytes=32 << 20)
    for epoch in range(2):
        dl = DataLoader(Samples(128), batch_size=4, num_workers=2, collate_fn=pc)
        for k, b in enumerate(PrefetchLoader(dl, "cpu")):
            if k == 2:
                time.sleep(0.3)  # the workers fill their queues
                break
        del b, dl
        gc.collect()
        assert pc.stats()["slots_in_use"] == 0, (epoch, pc.stats())


def test_worker_exception_bad_leaf_names_path_and_nothing_leaks():
    pc = PackedCollate(list, arena_bytes=32 << 20)
    # one worker: torch 2.13 takes 5 s per worker to shut down after a worker's exception
    dl = DataLoader(Samples(32, bad_index=13), batch_size=4, num_workers=1, collate_fn=pc)
    got = []
    with pytest.raises(TypeError, match=r"sparse") as ei:
        for b in PrefetchLoader(dl, "cpu"):
            got.append(b)
    assert "['cams_gt'][3]['depths']" in str(ei.value)
    del ei
    assert len(got) == 3  # batches 0..2 come before the failing batch 3 (indices 12..15)
    for k, b in enumerate(got):
        assert_tree_bitwise(b, expected(4 * k, 4))
    del dl, got
    gc.collect()
    # batches the worker had packed ahead: PrefetchLoader's own reclaim ran while the exception's
    # traceback still held the DataLoader iterator, and so the worker, alive
    pc.arena.reclaim_dead()
    assert_clean(pc)
    follow_up()


def test_kept_exception_does_not_keep_the_workers_or_regions():
    """A caller that keeps a worker's exception (``e = err``, a logger, sys.last_value): its
    traceback must not hold the DataLoader iterator, whose workers then shut down and whose
    batches packed ahead are freed."""
    import multiprocessing
    pc = PackedCollate(list, arena_bytes=32 << 20)
    dl = DataLoader(Samples(32, bad_index=13), batch_size=4, num_workers=2, collate_fn=pc)
    kept = None
    try:
        for b in PrefetchLoader(dl, "cpu"):
            pass
    except TypeError as err:
        kept = err
    assert kept is not None and "sparse" in str(kept)
    del dl, b
    deadline = time.monotonic() + 30
    while multiprocessing.active_children() and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert not multiprocessing.active_children(), "the kept exception keeps the workers alive"
    assert_clean(pc)
    assert kept.__traceback__ is not None  # the caller's frames are still there to read


# ----------------------------------------------------------------------- corrupt descriptors

def test_corrupt_descriptors_raise_clear_errors():
    from mtc_loader._packed import _rebuild_batch
    pc = PackedCollate(list, arena_bytes=4 << 20)
    ref = expected(0, 2)
    # a descriptor naming a region its sender does not hold (forged or stale owner)
    b = pc(ref)
    with pytest.raises(RuntimeError, match="does not hold it"):
        _rebuild_batch(pc.arena.token, b._off, b._nbytes, 1, b._layout, b._skeleton)
    # an arena this process does not hold
    with pytest.raises(RuntimeError, match="does not hold its arena"):
        _rebuild_batch((1, 2, 3), b._off, b._nbytes, os.getpid() + 1, b._layout, b._skeleton)
    # an offset outside this process's part of the arena
    forged = PackedBatch(pc.arena, b._off + 65536, b._nbytes, os.getpid(), b._layout, b._skeleton)
    with pytest.raises(ValueError, match="outside this process's part"):
        forged.unpack("cpu")
    assert_tree_bitwise(b.unpack("cpu"), ref)
    # a skeleton that does not match the layout: the region is freed
    b = pc(ref)
    b._skeleton = b._skeleton[:1]
    with pytest.raises(ValueError, match="skeleton does not match"):
        b.unpack("cpu")
    del b, forged
    assert_clean(pc)
    follow_up()


def test_malformed_layout_frees_the_region():
    """A consumed batch whose layout is rejected still gives its region back."""
    pc = PackedCollate(list, arena_bytes=4 << 20)
    b = pc(expected(0, 2))
    b._layout = b._layout[:-1]
    with pytest.raises(ValueError, match="layout is malformed"):
        b.unpack("cpu")
    del b
    gc.collect()
    assert pc.stats()["slots_in_use"] == 0


def test_copied_packed_batch_is_refused_not_double_freed():
    """A held batch copied in the process that holds its region would be a second owner of it
    (a double free, then another batch's bytes): copy and pickle are refused there."""
    import copy
    pc = PackedCollate(list, arena_bytes=65536)  # one slot: every batch reuses it
    b1 = pc(expected(0, 2))
    for dup in (copy.copy, copy.deepcopy, lambda b: pickle.loads(pickle.dumps(b))):
        with pytest.raises(RuntimeError, match="cannot be copied or pickled"):
            dup(b1)
    del b1
    b3 = pc(expected(2, 2))
    with pytest.raises(RuntimeError, match="arena_bytes"):
        PackedCollate(list, arena=pc.arena, timeout=0.1)(expected(4, 2))
    assert_tree_bitwise(b3.unpack("cpu"), expected(2, 2))
    del b3
    assert_clean(pc)


# ------------------------------------------------------------------------------- arena full

def test_arena_full_times_out_naming_arena_bytes_then_recovers():
    pc = PackedCollate(list, arena_bytes=4 * 65536, timeout=2.0)
    held = [pc(expected(2 * i, 2)) for i in range(4)]  # one 64 KiB slot each
    assert pc.stats()["slots_in_use"] == 4
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="arena_bytes"):
        pc(expected(8, 2))
    assert 1.9 < time.monotonic() - t0 < 30
    assert pc.stats()["timeouts"] == 1
    assert pc.stats()["slots_in_use"] == 4  # the failed pack took nothing
    # a batch that can never fit fails at once, also naming arena_bytes
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="arena_bytes"):
        pc([{"x": torch.zeros(1 << 20)}])
    assert time.monotonic() - t0 < 1.5  # not the 2 s timeout
    for i, b in enumerate(held):
        assert_tree_bitwise(b.unpack("cpu"), expected(2 * i, 2))
    del held, b
    assert pc.stats()["slots_in_use"] == 0
    assert_tree_bitwise(pc(expected(8, 2)).unpack("cpu"), expected(8, 2))
    assert_clean(pc)


def test_arena_full_in_worker_then_works_after_consuming():
    pc = PackedCollate(list, arena_bytes=4 * 65536, timeout=0.5)
    dl = DataLoader(Samples(40), batch_size=2, num_workers=1, collate_fn=pc)
    held = []
    with pytest.raises(RuntimeError, match="arena_bytes"):
        for b in dl:  # never consumed: the arena fills up
            held.append(b)
    assert len(held) == 4
    for k, b in enumerate(held):
        assert_tree_bitwise(b.unpack("cpu"), expected(2 * k, 2))
    del held, b, dl
    assert_clean(pc)
    # consumed as they come: the same tiny arena is enough (a patient collate on it, so that
    # a loaded machine's slow consumer cannot time the worker out)
    patient = PackedCollate(list, arena=pc.arena, timeout=30.0)
    dl = DataLoader(Samples(40), batch_size=2, num_workers=1, collate_fn=patient)
    n = 0
    for k, b in enumerate(PrefetchLoader(dl, "cpu")):
        assert_tree_bitwise(b, expected(2 * k, 2))
        n += 1
    assert n == 20
    del b
    assert_clean(pc)


# ------------------------------------------------------------------------ pinned-memory cap

@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("ring", ["16", "0"])
def test_large_tensors_under_a_pinned_cap_of_a_few_slabs(ring, monkeypatch):
    """Under a cap that holds one 2 MiB staging slab but not the ring's two (or the windowed
    pipeline's two windows), the pieces shrink and the copy completes exactly, instead of
    waiting for room that only its own slabs take; so do two copies at once on one device."""
    monkeypatch.setenv("MTC_H2D_RING", ring)
    torch.cuda.synchronize()
    mtc_loader.trim()
    mtc_loader.configure(pinned_cap_bytes=3 << 20)
    g = torch.Generator().manual_seed(8)
    data = [torch.rand((5 << 20) + 3, generator=g), torch.randint(0, 255, (9 << 20,), dtype=torch.uint8,
                                                                   generator=g)]
    side = torch.cuda.Stream()
    for _ in range(2):
        a = start_copy(data, "cuda:0")
        with torch.cuda.stream(side):
            b = start_copy(data[::-1], "cuda:0", use_background_thread=False)
        out_a, out_b = a.get(), b.get()
        torch.cuda.synchronize()
        assert_tree_bitwise(out_a, tree_to(data, "cuda:0"))
        assert_tree_bitwise(out_b, tree_to(data[::-1], "cuda:0"))
    assert mtc_loader.stats()["pinned_bytes_held"] <= 3 << 20


@pytest.mark.cuda
@requires_cuda
def test_pinned_cap_reached_waits_instead_of_growing():
    torch.cuda.synchronize()
    mtc_loader.trim()
    cap = 16 << 20  # the batches below would pin ~150 MiB without the cap
    mtc_loader.configure(pinned_cap_bytes=cap)
    before = mtc_loader.stats()
    g = torch.Generator().manual_seed(3)
    batches = [{"seed": seed_batch(4, seed=i),
                "big": [torch.rand(1 << 20, generator=g) for _ in range(3)],  # 4 MiB each: staged
                "np": np.arange(200_000, dtype=np.float32)[::-1] + i}
               for i in range(12)]
    peak = [0]
    stop = threading.Event()

    def monitor():
        while not stop.is_set():
            peak[0] = max(peak[0], mtc_loader.stats()["pinned_bytes_held"])
            time.sleep(0.0005)

    mon = threading.Thread(target=monitor)
    mon.start()
    try:
        for rnd in range(3):
            handles = [start_copy(b, "cuda:0") for b in batches]
            outs = [h.get() for h in handles]
            torch.cuda.synchronize()
            for b, o in zip(batches, outs):
                assert_tree_bitwise(o, tree_to(ref_of(b), "cuda:0"))
            assert mtc_loader.stats()["pinned_bytes_held"] <= cap
    finally:
        stop.set()
        mon.join()
    after = mtc_loader.stats()
    assert peak[0] <= cap, (peak[0], cap)
    assert after["pinned_bytes_held"] <= cap
    assert after["pinned_waits"] >= before["pinned_waits"]
    del outs, handles
    assert_clean()
    follow_up("cuda:0")


# --------------------------------------------------------------------------- GPU out of memory

@pytest.mark.cuda
@requires_cuda
def test_gpu_oom_allocating_outputs_then_works():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    hog = torch.empty(max(free - (256 << 20), 1), dtype=torch.uint8, device="cuda:0")
    batch = {"seed": seed_batch(4), "big": [torch.ones(64 << 20, dtype=torch.uint8) for _ in range(8)]}
    try:
        with pytest.raises((torch.OutOfMemoryError, MemoryError)) as ei:
            start_copy(batch, "cuda:0").get()
        assert "memory" in str(ei.value).lower()
    finally:
        del hog
        gc.collect()
        torch.cuda.empty_cache()
    out = start_copy(batch, "cuda:0").get()
    torch.cuda.synchronize()
    assert_tree_bitwise(out, tree_to(batch, "cuda:0"))
    del out
    assert_clean()
    follow_up("cuda:0")


# --------------------------------------------------------------------------- KeyboardInterrupt

@pytest.mark.parametrize("how", ["pthread_kill", "interrupt_main"])
def test_keyboard_interrupt_while_get_waits(how):
    main_id = threading.main_thread().ident
    assert threading.get_ident() == main_id
    where = None
    for attempt in range(3):  # the interrupt must land while get() waits: retry with more data
        data = slow_host_copy_inputs(256 << (2 * attempt) << 20)
        ro = np.arange(1 << 20, dtype=np.int64)
        ro.flags.writeable = False
        data.append(ro)
        h = start_copy(data, "cpu", use_background_thread=True)
        started, fired = threading.Event(), threading.Event()

        def interrupter():
            started.wait()
            time.sleep(0.05)
            if not h.ready():
                fired.set()
                if how == "pthread_kill":
                    signal.pthread_kill(main_id, signal.SIGINT)
                else:
                    _thread.interrupt_main()

        t = threading.Thread(target=interrupter)
        t.start()
        try:
            try:
                started.set()
                h.get()
                where = "none"
            except KeyboardInterrupt:
                where = "get"
            t.join()
            if fired.is_set() and where != "get":
                time.sleep(0.5)  # a late interrupt must land here, not in pytest
        except KeyboardInterrupt:
            where = "late"
        t.join()
        if where == "get":
            break
        del h, data
    assert where == "get", f"the interrupt was not raised from get() ({where})"
    out = h.get()  # the copy went on: a second get() collects it
    assert h.ready()
    assert_tree_bitwise(out, ref_of(data))
    del out, h
    assert_clean()
    follow_up()


# ----------------------------------------------------------------------- handles dropped early

def test_handles_dropped_without_get_many_times_cpu():
    before = mtc_loader.stats()
    a = slow_host_copy_inputs(32 << 20, n=2)
    for i in range(200):
        h = start_copy({"a": a if i % 20 == 0 else a[0][:1000], "s": seed_batch(1, seed=i),
                        "n": np.ones((50, 3))[::-1]}, "cpu", use_background_thread=bool(i % 3))
        del h
    hs = [start_copy([np.arange(i + 10)[::-1]], "cpu") for i in range(100)]
    del hs
    s = assert_clean()
    assert s["jobs_done"] - before["jobs_done"] == s["jobs_submitted"] + s["jobs_inline"] - \
        before["jobs_submitted"] - before["jobs_inline"]
    assert s["jobs_failed"] == before["jobs_failed"]
    follow_up()


def test_packed_batches_dropped_without_unpack_free_their_regions():
    pc = PackedCollate(list, arena_bytes=2 << 20, timeout=2.0)
    for i in range(300):  # 32 slots: leaked regions would fill the arena within 32 rounds
        b = pc(expected(i % 50, 2))
        if i % 3 == 0:
            h = b.start_copy("cpu")
            del h
        del b
    assert_clean(pc)
    follow_up()


@pytest.mark.cuda
@requires_cuda
def test_handles_dropped_without_get_many_times_cuda():
    pc = PackedCollate(list, arena_bytes=16 << 20, timeout=2.0)
    big = torch.rand(4 << 20)
    torch.cuda._sleep(int(2e8))  # the stream is busy: drops happen with copies in flight
    for i in range(200):
        data = {"s": seed_batch(1, seed=i), "big": big if i % 25 == 0 else big[:100],
                "np": np.arange(1000)[::-1]}
        h = start_copy(data, "cuda:0", use_background_thread=bool(i % 2))
        del h
        h = pc(expected(i % 50, 2)).start_copy("cuda:0")
        del h
    d2h = [torch.rand(100, device="cuda:0") for _ in range(50)]
    for i in range(50):
        h = start_copy(d2h, "cpu")
        del h
    torch.cuda.synchronize()
    assert_clean(pc)
    follow_up("cuda:0")


# ------------------------------------------------------------------------------------- fork

def _child_work(parent_pc: PackedCollate, send) -> bool:
    """In a forked child: CPU copies with fresh engine threads, packing into a new arena and
    into the parent's (the batch goes back to the parent). True when all is well."""
    data = {"s": seed_batch(2, seed=5), "np": slow_host_copy_inputs(8 << 20, n=2),
            "ro": np.arange(5000, dtype=np.int16)}
    data["ro"].flags.writeable = False
    for bg in (True, False):
        out = start_copy(data, "cpu", use_background_thread=bg).get()
        assert_tree_bitwise(out, ref_of(data))
    own = PackedCollate(list, arena_bytes=4 << 20)
    for i in range(5):
        assert_tree_bitwise(own(expected(i, 3)).unpack("cpu"), expected(i, 3))
    send(pickle.dumps(parent_pc(expected(10, 3))))  # a worker's packed batch, for the parent
    return True


def _run_child(parent_pc, send) -> None:
    ok = False
    signal.alarm(40)  # a hung child dies (SIGALRM's default action) instead of hanging the suite
    # torch's OpenMP pool does not survive fork (a parallel op would wait forever in libgomp's
    # barrier): DataLoader workers do the same
    torch.set_num_threads(1)
    try:
        ok = _child_work(parent_pc, send)
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        os._exit(0 if ok else 1)


def test_os_fork_after_engine_threads_started():
    pc = PackedCollate(list, arena_bytes=8 << 20)
    # start the transfer and helper threads, and leave a copy in flight during the fork
    follow_up()
    h = start_copy(slow_host_copy_inputs(64 << 20, n=2), "cpu", use_background_thread=True)
    assert mtc_loader.stats()["transfer_threads"] >= 1
    r, w = os.pipe()
    pid = fork_quietly()
    if pid == 0:
        os.close(r)
        _run_child(pc, lambda b: (os.write(w, len(b).to_bytes(8, "little") + b), os.close(w)))
    os.close(w)
    code = wait_child(pid)  # the payload is small: it fits in the pipe's buffer
    with os.fdopen(r, "rb") as f:
        n = int.from_bytes(f.read(8) or b"\0" * 8, "little")
        payload = f.read(n)
    assert code == 0
    batch = pickle.loads(payload)  # the parent adopts the child's region
    assert_tree_bitwise(batch.unpack("cpu"), expected(10, 3))
    h.get()
    del h, batch
    assert_clean(pc)
    follow_up()


def _mp_child(pc, q):
    _run_child(pc, q.put)


def test_multiprocessing_fork_context_after_engine_threads_started():
    pc = PackedCollate(list, arena_bytes=8 << 20)
    follow_up()
    h = start_copy(slow_host_copy_inputs(64 << 20, n=2), "cpu", use_background_thread=True)
    ctx = mp.get_context("fork")
    q = ctx.SimpleQueue()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        p = ctx.Process(target=_mp_child, args=(pc, q))
        p.start()
    p.join(60)
    if p.is_alive():
        p.kill()
        pytest.fail("the forked child hung")
    assert p.exitcode == 0
    payload = q.get()
    batch = pickle.loads(payload)
    assert_tree_bitwise(batch.unpack("cpu"), expected(10, 3))
    h.get()
    del h, batch
    assert_clean(pc)
    follow_up()


# ------------------------------------------------------------------- interpreter exit

_EXIT_CPU = """
import threading, numpy as np, torch, mtc_loader
big = [(np.arange(4 << 20, dtype=np.float64) * (i + 1))[::-1] for i in range(4)]   # 128 MiB
kept = [mtc_loader.start_copy({"b": big, "i": i}, "cpu") for i in range(3)]
mtc_loader.start_copy(big, "cpu", use_background_thread=False)   # dropped at once
pc = mtc_loader.PackedCollate(list, arena_bytes=4 << 20)
held = pc([{"x": torch.arange(1000)}])                              # a region never unpacked
queued = [mtc_loader.start_copy([np.arange(1000)[::-1], big], "cpu") for _ in range(6)]
waiting = threading.Event()
def wait_all():   # a daemon thread blocked in get() while the copies run on at shutdown
    waiting.set()
    while True:
        for h in queued:
            h.get()
threading.Thread(target=wait_all, daemon=True).start()
waiting.wait()
print("started", flush=True)
"""

# The daemon thread above only waits in mtc_loader's own C code. A daemon thread that is
# inside a torch op at exit (torch's bindings release the GIL in C++) can be aborted by
# libstdc++ ("terminate called without an active exception") on CPython <= 3.13, which ends
# such threads with pthread_exit: torch and CPython behaviour, documented in docs/copies.md.

_EXIT_CUDA = """
import numpy as np, torch, mtc_loader
b = [torch.rand(1 << 20) for _ in range(8)] + [torch.rand(10) for _ in range(500)]
torch.cuda._sleep(int(5e8))
kept = [mtc_loader.start_copy(b, "cuda:0") for _ in range(4)]
back = mtc_loader.start_copy([torch.rand(100, device="cuda:0") for _ in range(50)], "cpu")
pc = mtc_loader.PackedCollate(list, arena_bytes=4 << 20)
h = pc([{"x": torch.arange(1000)}]).start_copy("cuda:0")
print("started", flush=True)
"""


def _run_exit_script(src: str) -> None:
    env = subprocess_env()
    t0 = time.monotonic()
    try:
        r = subprocess.run([sys.executable, "-c", textwrap.dedent(src)], capture_output=True,
                           text=True, timeout=60, env=env, cwd=package_parent())
    except subprocess.TimeoutExpired:
        pytest.fail("the interpreter hung at exit with copies in flight")
    assert r.returncode == 0, (r.returncode, r.stderr)
    assert r.stdout.strip() == "started"
    assert r.stderr == "", r.stderr
    assert time.monotonic() - t0 < 60


def test_interpreter_exit_with_copies_in_flight_cpu():
    _run_exit_script(_EXIT_CPU)


@pytest.mark.cuda
@requires_cuda
def test_interpreter_exit_with_copies_in_flight_cuda():
    _run_exit_script(_EXIT_CUDA)


# ------------------------------------------------------------------------ many threads at once

def _mixed_structure(tid: int, i: int) -> tuple[object, dict]:
    rng = np.random.default_rng(tid * 1000 + i)
    g = torch.Generator().manual_seed(tid * 1000 + i)
    ro = rng.integers(0, 100, size=int(rng.integers(1, 300)), dtype=np.int64)
    ro.flags.writeable = False
    data = {
        "t": [torch.rand(int(rng.integers(0, 50)), 3, generator=g) for _ in range(int(rng.integers(1, 6)))],
        "np_view": rng.random((int(rng.integers(1, 40)), 4)).astype(np.float32),   # zero copy
        "np_neg": rng.random(int(rng.integers(1, 5000)))[::-1],                      # copied
        "np_ro": ro,                                                                 # copied
        "np_big": (np.arange(int(rng.integers(1, 4)) << 16, dtype=np.float32) + i)[::-2],
        "meta": (tid, i, "label"),
    }
    opts = {"use_background_thread": bool((tid + i) % 3), "pack_cpu_tensors": bool(i % 2),
            "min_packed_alignment_bytes": [16, 64, 256][i % 3]}
    return data, opts


def test_eight_threads_start_copy_at_once():
    barrier = threading.Barrier(8)
    errors: list = []

    def worker(tid: int) -> None:
        try:
            barrier.wait()
            for i in range(100):
                data, opts = _mixed_structure(tid, i)
                out = start_copy(data, "cpu", **opts).get()
                assert_tree_bitwise(out, ref_of(data), f"t{tid} call{i}")
                assert out["t"][0] is data["t"][0]  # CPU tensors are reused
        except BaseException as e:  # reported by the main thread
            errors.append((tid, e))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors[:3]
    assert_clean()
    follow_up()


# ------------------------------------------------------------------ bad input mid-structure

@pytest.mark.parametrize("background", [True, False])
@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_sparse_tensor_after_many_valid_leaves(background, layout):
    before = mtc_loader.stats()
    data = [{"a": torch.rand(3, 2), "b": np.arange(40)[::-1], "c": np.ones(8, dtype=np.float32)}
            for _ in range(200)]
    dense = torch.eye(4)
    with warnings.catch_warnings():  # "Sparse CSR tensor support is in beta state"
        warnings.simplefilter("ignore", UserWarning)
        data[150]["b"] = dense.to_sparse() if layout == "coo" else dense.to_sparse_csr()
    with pytest.raises(TypeError, match=r"data\[150\]\['b'\].*sparse"):
        start_copy(data, "cpu", use_background_thread=background)
    after = assert_clean()
    assert after["jobs_submitted"] == before["jobs_submitted"]
    # same in the packing path: nothing allocated in the arena
    pc = PackedCollate(list, arena_bytes=4 << 20)
    with pytest.raises(TypeError, match=r"\[150\]\['b'\].*sparse"):
        pc(data)
    assert_clean(pc)
    assert pc.stats()["allocs"] == 0
    data[150]["b"] = np.arange(40)[::-1]
    assert_tree_bitwise(start_copy(data, "cpu", use_background_thread=background).get(), ref_of(data))
    assert_tree_bitwise(pc(data).unpack("cpu"), data)  # a packed batch keeps its numpy arrays
    assert_clean(pc)
    follow_up()


@pytest.mark.cuda
@requires_cuda
def test_sparse_tensor_mid_structure_cuda():
    data = seed_batch(8) + [{"bad": torch.eye(3).to_sparse()}] + seed_batch(2)
    with pytest.raises(TypeError, match=r"data\[8\]\['bad'\].*sparse"):
        start_copy(data, "cuda:0")
    assert_clean()
    follow_up("cuda:0")



_ORPHANS = """
import os, sys, time, torch, mtc_loader
from torch.utils.data import DataLoader

class Big(torch.utils.data.Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        return torch.full((64 << 10,), i, dtype=torch.int32)  # 256 KiB: four slots of the arena

if __name__ == "__main__":
    pc = mtc_loader.PackedCollate(arena_bytes=1 << 20, timeout=-1)  # room for 4 batches: workers wait
    # in_order=False: the batches kept are whichever came first (in order, a worker's later
    # batches could fill the arena before the one the loop waits for, which then never comes);
    # prefetch_factor=4: each worker has indices left once the arena is full, so both wait for room
    dl = DataLoader(Big(), batch_size=1, num_workers=2, collate_fn=pc, multiprocessing_context=sys.argv[1],
                    prefetch_factor=4, in_order=False)
    it = iter(dl)
    kept = [next(it) for _ in range(3)]  # held: the arena stays full
    print(" ".join(str(w.pid) for w in it._workers), flush=True)
    time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


_LAUNCHER = """
import os, sys, time, torch, mtc_loader
import torch.multiprocessing as tmp
from torch.utils.data import DataLoader

class Big(torch.utils.data.Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        return torch.full((64 << 10,), i, dtype=torch.int32)  # 256 KiB: four slots of the arena

def rank(index, pc, ctx, out):
    # prefetch_factor=4: each worker has indices left once the arena is full, so both wait for
    # room (a worker with none waits in torch's own loop, which torch's watchdog ends);
    # in_order=False: the batches kept are whichever came, so the arena cannot fill with
    # batches the loop does not reach yet
    dl = DataLoader(Big(), batch_size=1, num_workers=2, collate_fn=pc, multiprocessing_context=ctx,
                    prefetch_factor=4, in_order=False)
    it = iter(dl)
    kept = [next(it) for _ in range(3)]  # held: the arena stays full, the workers wait for room
    with open(out, "w") as f:
        f.write(" ".join(str(p) for p in [os.getpid()] + [w.pid for w in it._workers]))
    time.sleep(600)

if __name__ == "__main__":
    # the launcher creates the PackedCollate (and its arena) and hands it to a rank process, as
    # torch.multiprocessing.spawn / Lightning's ddp_spawn do; the launcher stays alive
    pc = mtc_loader.PackedCollate(arena_bytes=1 << 20, timeout=-1)
    tmp.spawn(rank, args=(pc, sys.argv[1], sys.argv[2]), nprocs=1, join=False)
    time.sleep(600)
"""


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_workers_waiting_for_room_exit_with_their_rank_process_not_the_arenas_creator(ctx, tmp_path):
    """A launcher creates the PackedCollate and passes it to a rank process, whose DataLoader
    workers wait for room (timeout=-1). SIGKILL of the rank (the launcher, which created the
    arena, lives on): the workers notice that the process they pack for is gone and exit within a
    few seconds."""
    script = tmp_path / "launch.py"
    script.write_text(textwrap.dedent(_LAUNCHER))
    out = tmp_path / "pids"
    p = subprocess.Popen([sys.executable, str(script), ctx, str(out)], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, env=subprocess_env(), cwd=package_parent())
    workers: list[int] = []
    rank_pid = 0
    try:
        deadline = time.monotonic() + 240
        while not (out.exists() and out.read_text().strip()):
            assert p.poll() is None, "the launcher exited"
            assert time.monotonic() < deadline, "the rank wrote no pids"
            time.sleep(0.2)
        pids = [int(x) for x in out.read_text().split()]
        rank_pid, workers = pids[0], pids[1:]
        assert len(workers) == 2, pids
        time.sleep(1.0)  # the workers are now waiting for room
        assert all(_alive(w) for w in workers)
        os.kill(rank_pid, signal.SIGKILL)
        killed = time.monotonic()
        while any(_alive(w) for w in workers) and time.monotonic() < killed + 5:
            time.sleep(0.1)
        left = [w for w in workers if _alive(w)]
        assert not left, f"workers {left} outlived their rank process by 5 s"
        assert p.poll() is None  # the arena's creator is alive: only the rank was watched for
    finally:
        for w in workers + ([rank_pid] if rank_pid else []):
            if _alive(w):
                os.kill(w, signal.SIGKILL)
        p.kill()
        p.wait(10)


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_workers_waiting_for_room_exit_with_their_training_process(ctx, tmp_path):
    """timeout=-1: a worker waiting for room in a full arena notices that the training process
    is gone (SIGTERM, no clean-up) and exits, instead of waiting forever as an orphan."""
    env = subprocess_env()
    script = tmp_path / "train.py"  # a file: spawn workers import its dataset class from it
    script.write_text(textwrap.dedent(_ORPHANS))
    p = subprocess.Popen([sys.executable, str(script), ctx], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True, env=env, cwd=package_parent())
    try:
        line = p.stdout.readline()
        workers = [int(x) for x in line.split()]
        assert len(workers) == 2, line
        time.sleep(1.0)  # the workers are now waiting for room
        assert all(_alive(w) for w in workers)
        p.send_signal(signal.SIGTERM)
        p.wait(10)
        deadline = time.monotonic() + 10
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [w for w in workers if _alive(w)]
        for w in left:
            os.kill(w, signal.SIGKILL)
        assert not left, f"workers {left} outlived their training process"
    finally:
        if p.poll() is None:
            p.kill()
        p.stdout.close()
