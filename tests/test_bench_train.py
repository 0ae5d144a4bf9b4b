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

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "bench"))

import bench_train  # noqa: E402
from conftest import ROOT, package_parent, subprocess_env  # noqa: E402


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
                        "packed", "--batches", "6", "--rounds", "1", "--workers", "1", "--out", str(tmp_path)],
                       cwd=package_parent(), env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "bench_train.json").read_text())["results"]["launch4"]
    for m in ("ideal", "ideal_beside_loader", "ideal_beside_service", "packed"):
        assert res[m]["epochs"][0]["batches"] == 6 and res[m]["epochs"][0]["samples_per_s"] > 0, m
    assert res["ideal_beside_service"]["prefetch_stats"]["batches"] >= 6  # the service ran, beside
    assert "ideal + packed's service beside" in r.stdout
