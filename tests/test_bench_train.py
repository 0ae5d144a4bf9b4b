"""bench/bench_train.py's ``ideal_beside_*`` methods: the step trains on the preloaded batch while
a thread takes one batch of the loader per step handed out, at most the prefetch depth ahead, and
stops with the epoch; and a quick CPU run of the benchmark with them."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import threading
import time

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "bench"))

import bench_train  # noqa: E402
from conftest import ROOT, package_parent, requires_cuda, subprocess_env  # noqa: E402


class _Counted:
    """A loader that counts the batches taken from it (and notes the thread that took them)."""

    def __init__(self, n: int):
        self.n, self.taken, self.threads, self.closed = n, 0, set(), 0

    def __iter__(self):
        outer = self

        class It:
            def __next__(self):
                if outer.taken >= outer.n:
                    raise StopIteration
                outer.taken += 1
                outer.threads.add(threading.current_thread().name)
                return outer.taken

            def close(self):
                outer.closed += 1

        return It()


def test_beside_takes_one_background_batch_per_step_at_most_depth_ahead():
    bg = _Counted(100)
    beside = bench_train.Beside(bench_train.Preloaded("batch", 10), bg)
    seen = []
    for k, batch in enumerate(beside):
        assert batch == "batch"
        time.sleep(0.02)  # the step: the thread has had time to take all it may
        assert bg.taken <= k + 1 + bench_train.PREFETCH_DEPTH, (k, bg.taken)
        seen.append(bg.taken)
    assert max(seen) >= 8  # it kept up: one per step handed out
    assert bg.taken <= 10 + bench_train.PREFETCH_DEPTH
    assert bg.threads == {"bench-beside"} and bg.closed == 1
    assert not [t for t in threading.enumerate() if t.name == "bench-beside"]  # joined with the epoch


def test_beside_ends_when_the_background_loader_ends_first():
    bg = _Counted(3)
    got = []
    for batch in bench_train.Beside(bench_train.Preloaded(7, 8), bg):
        got.append(batch)
        time.sleep(0.01)  # the step
    assert got == [7] * 8  # the epoch is the preloaded one's
    assert bg.taken == 3 and bg.closed == 1
    assert not [t for t in threading.enumerate() if t.name == "bench-beside"]


def test_bench_train_runs_the_beside_methods_on_the_cpu(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_train.py"), "--device", "cpu", "--quick",
                        "--config", "launch4", "--methods", "ideal", "ideal_beside_loader", "ideal_beside_service",
                        "packed", "packed_memcpy", "ideal_beside_spin", "ideal_beside_nogil", "ideal_beside_stream",
                        "ideal_beside_workers", "ideal_beside_packers", "packed_gil100us", "packed_nobg",
                        "--beside-ms", "0.2",
                        "--batches", "6", "--rounds", "1", "--workers", "1", "--out", str(tmp_path)],
                       cwd=package_parent(), env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "bench_train.json").read_text())["results"]["launch4"]
    for m in ("ideal", "ideal_beside_loader", "ideal_beside_service", "packed", "packed_memcpy",
              "ideal_beside_spin", "ideal_beside_nogil", "ideal_beside_stream", "ideal_beside_workers",
              "ideal_beside_packers", "packed_gil100us", "packed_nobg"):
        assert res[m]["epochs"][0]["batches"] == 6 and res[m]["epochs"][0]["samples_per_s"] > 0, m
    assert res["ideal_beside_service"]["prefetch_stats"]["batches"] >= 6  # the service ran, beside
    assert "ideal + packed's service beside" in r.stdout
    assert "ideal + busy thread beside, GIL held" in r.stdout and "ideal + busy thread beside, no GIL" in r.stdout
    assert "ideal + batch-writing thread beside" in r.stdout and "packed, arena written by memcpy" in r.stdout
    assert "ideal + workers collating beside" in r.stdout and "ideal + workers packing beside" in r.stdout


def test_collate_and_drop_builds_the_batch_and_gives_a_packed_region_back():
    import mtc_loader
    from bench_train import CollateAndDrop, CameraSamples, collate_samples

    ds = CameraSamples(4, 4, 8, 8, fresh=True)
    samples = [ds[i] for i in range(4)]
    assert CollateAndDrop(collate_samples)(samples) == 4
    pc = mtc_loader.PackedCollate(collate_samples, arena_bytes=4 << 20)
    drop = CollateAndDrop(pc)
    for _ in range(50):  # more batches than the arena holds: each region goes back
        assert drop(samples) == 4
    assert pc.stats()["bytes_in_use"] == 0


@pytest.mark.parametrize("kind", ["spin", "nogil"])
def test_busy_work_spends_its_cpu_time_per_item_on_the_thread_that_takes_it(kind):
    work = bench_train.BusyWork(5.0, kind)
    it = iter(work)
    for _ in range(3):
        t0 = time.thread_time()
        assert next(it) is None
        spent = time.thread_time() - t0
        assert 0.005 <= spent < 0.5, spent  # at least its 5 ms; the loop checks the clock often


def test_busy_work_stream_writes_its_bytes_per_item_without_the_gil():
    work = bench_train.BusyWork(0.4, "stream", nbytes=64 << 20)
    work.dst[:] = 0
    it = iter(work)
    assert next(it) is None
    assert (work.dst == 8).all()  # every byte read and written
    # the GIL is released while it writes: a Python thread runs in the middle of the call
    seen, stop = [], threading.Event()

    def tick():
        while not stop.is_set():
            seen.append(time.perf_counter())
            time.sleep(0)

    t = threading.Thread(target=tick)
    t.start()
    try:
        spans = []
        for _ in range(3):
            t0 = time.perf_counter()
            work.one()
            t1 = time.perf_counter()
            spans.append((t0 + (t1 - t0) / 4, t1 - (t1 - t0) / 4))
    finally:
        stop.set()
        t.join()
    assert any(lo < x < hi for lo, hi in spans for x in seen), spans


def test_busy_work_refuses_an_unknown_kind():
    with pytest.raises(ValueError, match="spin, nogil or stream"):
        bench_train.BusyWork(0.4, "gil")


def test_dma_beside_needs_a_cuda_device():
    with pytest.raises(ValueError, match="--device cuda:N"):
        bench_train.DmaWork(1 << 20, bench_train.torch.device("cpu"), host_fn=False)


@requires_cuda
@pytest.mark.parametrize("host_fn", [False, True], ids=["dma", "dma_fn"])
def test_dma_beside_copies_the_bytes_to_the_device(host_fn):
    torch = bench_train.torch
    work = bench_train.DmaWork(3 << 20, torch.device("cuda", 0), host_fn=host_fn)
    work.src.fill_(5)
    it = iter(work)
    for _ in range(3):
        assert next(it) is None
    work.stream.synchronize()
    assert torch.equal(work.dst.cpu(), work.src)


def test_parse_cpu_list_reads_sysfs_ranges():
    assert bench_train.parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert bench_train.parse_cpu_list("5") == {5}


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="thread affinity is Linux's")
def test_loop_placement_gives_the_loop_a_core_of_its_own():
    allowed = os.sched_getaffinity(0)
    assert bench_train.loop_placement(None) is None
    if len(allowed) < 2:
        pytest.skip("needs two CPUs")
    loop, rest = bench_train.loop_placement("auto")
    assert loop == {max(allowed)} and rest and not rest & bench_train.core_siblings(max(allowed))
    assert rest <= allowed
    with pytest.raises(SystemExit, match="not one this process may use"):
        bench_train.loop_placement(str(max(allowed) + 1000))


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="thread affinity is Linux's; needs two CPUs")
def test_run_epoch_moves_the_training_thread_for_the_epoch_and_back():
    allowed = os.sched_getaffinity(0)
    loop, rest = bench_train.loop_placement("auto")
    seen = []
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, rest)

        def step(batch):
            seen.append(os.sched_getaffinity(0))
            return bench_train.torch.zeros(())

        e = bench_train.run_epoch(bench_train.Preloaded("b", 3), step, bench_train.torch.device("cpu"), 1,
                                  placement=(loop, rest))
        assert e["batches"] == 3 and seen == [loop] * 3
        assert os.sched_getaffinity(0) == rest
    finally:
        os.sched_setaffinity(0, before)
    assert allowed == before


def test_pin_loop_takes_a_cpu_number_or_auto():
    with pytest.raises(SystemExit):
        bench_train.parse_args(["--pin-loop", "first"])
    assert bench_train.parse_args(["--pin-loop", "auto"]).pin_loop == "auto"
    assert bench_train.parse_args(["--pin-loop", "3"]).pin_loop == "3"


def test_beside_ms_must_be_positive():
    with pytest.raises(SystemExit):
        bench_train.parse_args(["--beside-ms", "0"])
    assert bench_train.parse_args(["--beside-ms", "0.25"]).beside_ms == 0.25


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="per-thread switch counts are read from Linux's /proc")
def test_switches_per_batch_counts_the_blocks_of_each_kind_of_thread():
    """A thread that blocks on an event once per round shows about one voluntary switch per round
    between two readings, under its name; the caller's thread is ``training``. Where the two
    threads share one core (a loaded machine), one thread's switches are the scheduler's (the
    woken thread preempts the other) rather than its own blocks: each is counted both ways."""
    go, done, leave = threading.Event(), threading.Event(), threading.Event()
    rounds = 40

    def waiter():
        for _ in range(rounds):
            go.wait()
            go.clear()
            done.set()
        leave.wait()  # alive at the second reading

    t = threading.Thread(target=waiter, name="QueueFeederThread", daemon=True)
    idle = threading.Thread(target=leave.wait, name="bench-beside", daemon=True)  # blocked throughout
    t.start()
    idle.start()
    time.sleep(0.05)
    before = bench_train.thread_switches()
    for _ in range(rounds):
        done.clear()
        go.set()
        done.wait()
    after = bench_train.thread_switches()
    leave.set()
    t.join()
    idle.join()
    names = {t.native_id: t.name, idle.native_id: idle.name}
    got = bench_train.switches_per_batch(before, after, rounds, threading.get_native_id(), names)
    assert 0.5 <= sum(got["QueueFeederThread"]) <= 6, got  # its wait on `go`, or its preemption
    assert 0.5 <= sum(got["training"]) <= 6, got  # the caller's wait on `done`, or its preemption
    assert sum(got["bench-beside"]) <= 0.2, got  # each thread's own counts, not the others'
    assert all(g in ("training", "QueueFeederThread", "bench-beside", "native") for g in got), got


def test_bench_train_prints_the_step_off_the_cpu_and_the_switches(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_train.py"), "--device", "cpu", "--quick",
                        "--config", "launch4", "--methods", "ideal", "packed", "--batches", "20", "--rounds", "1",
                        "--workers", "2", "--out", str(tmp_path)],
                       cwd=package_parent(), env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "bench_train.json").read_text())["results"]["launch4"]
    for m in ("ideal", "packed"):
        assert res[m]["step_off_cpu_ms"] >= -1.0, m  # the step's time less its CPU time (clock grain)
        if sys.platform == "linux":
            assert res[m]["sys_ms"] >= 0.0, m  # the training thread's kernel time per batch
        if os.path.exists("/proc/thread-self/schedstat"):
            assert res[m]["runq_ms"] >= 0.0, m  # its time waiting for a CPU per batch
        if os.path.isdir("/proc/self/task"):
            assert res[m]["switches"]["training"][0] >= 0, m
    if os.path.isdir("/proc/self/task"):
        assert "context switches per batch" in r.stdout
        assert res["packed"]["switches"]["mtc_loader-prefetch"][0] > 0  # the service blocks (room, data)


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads /proc (Linux)")
def test_bench_train_samples_where_the_training_thread_waits(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_train.py"), "--device", "cpu", "--quick",
                        "--config", "launch4", "--methods", "ideal", "ideal_beside_spin", "--beside-ms", "5",
                        "--batches", "10", "--rounds", "1", "--workers", "1", "--sample-blocks", "--out",
                        str(tmp_path)],
                       cwd=package_parent(), env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "bench_train.json").read_text())["results"]["launch4"]
    for m in ("ideal", "ideal_beside_spin"):
        b = res[m]["blocks"]
        rows = b["threads"]["training"]
        assert b["ms_per_batch"] > 0 and rows[0][0] == "running", (m, b)
        assert sum(ms for _, ms in rows) <= b["ms_per_batch"] * 1.0001
    assert "beside" in res["ideal_beside_spin"]["blocks"]["threads"]  # the busy thread, watched too
    # a thread that holds the GIL for 5 ms per step beside it: the loop waits on the GIL (a futex
    # of the interpreter's)
    waits = dict(res["ideal_beside_spin"]["blocks"]["threads"]["training"])
    assert any(k.startswith("futex ") and ("python" in k) for k in waits), waits
    assert "threads sampled" in r.stdout
