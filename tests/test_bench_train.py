"""bench/bench_train.py: a quick CPU run of its default methods, and the per-thread context
switches its JSON carries for tools/diagnostics/ab_pairs_gpu.sh."""
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
from conftest import ROOT, package_parent, subprocess_env  # noqa: E402


def test_bench_train_runs_its_default_methods_on_the_cpu(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_train.py"), "--device", "cpu", "--quick",
                        "--config", "launch4", "--batches", "20", "--rounds", "1", "--workers", "2",
                        "--out", str(tmp_path)],
                       cwd=package_parent(), env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "bench_train.json").read_text())["results"]["launch4"]
    assert list(res) == bench_train.METHODS
    for m, got in res.items():
        assert got["samples_per_s"] > 0 and got["fraction_of_ideal"] > 0, m
        assert all(e["batches"] == 20 for e in got["epochs"]), m
        assert got["step_off_cpu_ms"] >= -1.0, m  # the step's time less its CPU time (clock grain)
        if sys.platform == "linux":
            assert got["sys_ms"] >= 0.0, m  # the training thread's kernel time per batch
        if os.path.exists("/proc/thread-self/schedstat"):
            assert got["runq_ms"] >= 0.0, m  # its time waiting for a CPU per batch
        if os.path.isdir("/proc/self/task"):
            assert got["switches"]["training"][0] >= 0, m
    assert res["packed"]["prefetch_stats"]["service_cpu_ms_per_batch"] > 0
    if os.path.isdir("/proc/self/task"):
        assert res["packed"]["switches"]["mtc_loader-prefetch"][0] > 0  # the service blocks (room, data)
    assert "PackedCollate + PrefetchLoader" in r.stdout


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
    idle = threading.Thread(target=leave.wait, name="idle", daemon=True)  # blocked throughout
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
    assert sum(got["idle"]) <= 0.2, got  # each thread's own counts, not the others'
    assert all(g in ("training", "QueueFeederThread", "idle", "native") for g in got), got
