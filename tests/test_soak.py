"""A short soak (tools/diagnostics/soak.py is the long one): thousands of copies and a few hundred loader
batches must leave descriptors, arena slots, input reference counts and resident memory flat."""
from __future__ import annotations

import gc
import importlib.util
import os

import pytest

import mtc_loader

_SOAK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "diagnostics", "soak.py")
MiB = 1 << 20


def _load_soak():
    spec = importlib.util.spec_from_file_location("mtc_soak", _SOAK)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def soak_run():
    soak = _load_soak()
    workers = 2
    rec, summary, bad = soak.run(copies=3000, batches=200, device="cpu", workers=workers,
                                 loader_batch_size=2, per_epoch=25, samples=60, arena_bytes=4 * MiB)
    return soak, rec, summary, bad, workers


def test_soak_results_correct(soak_run):
    soak, rec, summary, bad, _ = soak_run
    assert bad == 0
    assert len([s for s in rec.samples if s["phase"] == "copy"]) >= 50
    assert len([s for s in rec.samples if s["phase"] == "loader"]) >= 50
    assert len(rec.epoch_ends) == 8


def test_soak_fds_flat(soak_run):
    soak, rec, summary, bad, _ = soak_run
    assert summary["copy"]["fds"]["flat"], summary["copy"]["fds"]
    assert summary["loader"]["fds"]["flat"], summary["loader"]["fds"]
    ends = [e["fds"] for e in rec.epoch_ends]
    # once an epoch's workers are gone, exactly the descriptors of before remain
    assert max(ends[2:]) - min(ends[2:]) <= 1, ends
    copy = [s["fds"] for s in rec.samples if s["phase"] == "copy"]
    assert max(copy) == min(copy), copy


def test_soak_arena_slots_flat(soak_run):
    soak, rec, summary, bad, workers = soak_run
    assert summary["loader"]["slots"]["flat"], summary["loader"]["slots"]
    in_flight = workers * soak.PREFETCH_FACTOR + soak.DEPTH + 2
    assert max(s["slots"] for s in rec.samples) <= in_flight
    assert all(e["slots"] == 0 for e in rec.epoch_ends), rec.epoch_ends


def test_soak_no_reference_leak(soak_run):
    soak, rec, summary, bad, _ = soak_run
    counts = {s["refcount"] for s in rec.samples if s["phase"] in ("copy", "loader")}
    assert len(counts) == 1, counts


def test_soak_rss_flat_after_warmup(soak_run):
    soak, rec, summary, bad, _ = soak_run
    for phase in ("copy", "loader"):
        ss = [s for s in rec.samples if s["phase"] == phase]
        warm = ss[len(ss) // 3:]  # after warm-up (allocator caches, first touch of arena pages)
        rss = [s["rss"] for s in warm]
        assert max(rss) - min(rss) < 48 * MiB, (phase, [r >> 20 for r in rss])
        r = soak.flat(rss, [s["global_iter"] for s in warm], 48 * MiB)
        assert r["flat"], (phase, r)
        # private memory (the arena's shared pages aside) must not trend upwards
        anon = [s["rss_anon"] for s in warm]
        assert soak.flat(anon, [s["global_iter"] for s in warm], 16 * MiB)["flat"], [a >> 20 for a in anon]


def test_soak_engine_idle_afterwards(soak_run):
    gc.collect()
    s = mtc_loader.stats()
    assert s["jobs_in_flight"] == 0 and s["pinned_slabs_in_use"] == 0, s
