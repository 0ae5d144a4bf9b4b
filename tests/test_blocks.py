"""bench/blocks.py: the sampler that reads where a thread of another process waits."""
from __future__ import annotations

import os
import pathlib
import sys
import threading
import time

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "bench"))

import blocks  # noqa: E402

linux = pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads /proc (Linux)")


def test_classify_reads_running_a_futex_and_other_calls():
    names, futex = blocks.SYSCALLS["x86_64"], blocks.FUTEX["x86_64"]
    assert blocks.classify(b"running\n", names, futex) == "running"
    assert blocks.classify(b"202 0x7f3fe0000ba0 0x89 0x0 0x0 0x0 0x0 0x7ffd 0x7f3f\n", names, futex) == \
        "futex 0x7f3fe0000ba0"
    assert blocks.classify(b"7 0x3 0x1 0x0 0x0 0x0 0x0 0x7ffd 0x7f3f\n", names, futex) == "poll"
    assert blocks.classify(b"999 0x0 0x0 0x0 0x0 0x0 0x0 0x1 0x2\n", names, futex) == "syscall 999"
    assert blocks.classify(b"-1 0x7ffd 0x7f3f\n", names, futex) == "fault"
    assert blocks.classify(b"", names, futex) == "gone"


def test_locate_names_the_library_the_heap_and_a_library_bss():
    maps = blocks.parse_maps(  # in address order, as /proc lists them
        "55d000000000-55d000100000 rw-p 00000000 00:00 0 [heap]\n"
        "7f0000000000-7f0000100000 r--p 00000000 08:01 11 /usr/lib/libpython3.12.so.1.0\n"
        "7f0000100000-7f0000200000 rw-p 00100000 08:01 11 /usr/lib/libpython3.12.so.1.0\n"
        "7f0000200000-7f0000210000 rw-p 00000000 00:00 0 \n")
    assert blocks.locate(0x7f0000100040, maps) == "libpython3.12.so.1.0+0x100040"
    assert blocks.locate(0x7f0000200010, maps) == "libpython3.12.so.1.0 bss+0x10"
    assert blocks.locate(0x55d000000123, maps) == "[heap]+0x123"
    assert blocks.locate(0x1000, maps) == "?" and blocks.locate(0x7f0000300000, maps) == "?"
    assert blocks.locate(0x55d000100000, maps) == "?"  # between two mappings


def test_summary_merges_one_cache_line_and_puts_running_first():
    report = {"counts": {"a": {"t running": 10, "t futex 0x1000": 30, "t futex 0x1004": 20, "t poll": 40,
                               "u running": 5}},
              "seconds": {"a": 1.0}, "where": {"futex 0x1000": "lib+0x0", "futex 0x1004": "lib+0x4"}}
    rows = blocks.summary(report, "a", "t")
    assert rows[0] == ("running", 0.1)
    assert dict(rows)["futex lib+0x0"] == pytest.approx(0.5) and dict(rows)["poll"] == pytest.approx(0.4)
    assert blocks.summary(report, "a", "u") == [("running", 1.0)]
    assert blocks.summary(report, "missing", "t") == []


@linux
def test_the_sampler_sees_a_thread_wait_on_a_condition_and_run():
    stop = threading.Event()
    waiting = threading.Thread(target=stop.wait, args=(30,))
    waiting.start()
    sampler = blocks.BlockSampler({"waiter": waiting.native_id})
    spinning = [True]

    def spin():
        while spinning[0]:
            sum(range(100))

    spinner = threading.Thread(target=spin)
    try:
        sampler.label("waiting")
        time.sleep(0.3)
        sampler.label(None)
        time.sleep(0.1)  # not counted
        spinner.start()
        sampler.watch("spinner", spinner.native_id)
        sampler.label("spinning")
        time.sleep(0.3)
        sampler.label(None)
    finally:
        spinning[0] = False
        stop.set()
        waiting.join()
        spinner.join()
        report = sampler.finish()
    c = report["counts"]["waiting"]
    futex = sum(n for k, n in c.items() if k.startswith("waiter futex "))
    assert futex > 0.9 * sum(c.values()), c
    # the 0.3 s labelled, on this process's clock however late the sampler reads the labels
    assert 0.29 < report["seconds"]["waiting"] < 2.0
    assert all(report["where"]["futex " + k.split()[2]] for k in c if " futex " in k)
    rows = dict(blocks.summary(report, "spinning", "spinner"))
    assert rows.get("running", 0) > 0.2, rows  # it runs, or waits for the GIL beside this thread
    assert dict(blocks.summary(report, "spinning", "waiter")).get("running", 0) < 0.1


@linux
def test_a_thread_watched_inside_a_label_leaves_the_labels_time_as_it_is():
    stop = threading.Event()
    waiting = threading.Thread(target=stop.wait, args=(30,))
    waiting.start()
    sampler = blocks.BlockSampler({"main": threading.get_native_id()})
    try:
        t0 = time.monotonic()
        sampler.label("epoch")
        time.sleep(0.3)
        sampler.watch("waiter", waiting.native_id)  # as bench_train does at an epoch's first batch
        time.sleep(0.05)
        sampler.label(None)
        t1 = time.monotonic()
        time.sleep(0.1)  # not counted
        t2 = time.monotonic()
        sampler.label("epoch")
        time.sleep(0.05)
        sampler.label(None)
        labelled = t1 - t0 + time.monotonic() - t2
    finally:
        stop.set()
        waiting.join()
        report = sampler.finish()
    # 0.35 s + 0.05 s labelled (and what the sleeps overran); the time before the watch counted
    # twice would add 0.3 s
    assert 0.39 < report["seconds"]["epoch"] <= labelled
    assert any(k.startswith("waiter ") for k in report["counts"]["epoch"])


def test_a_label_line_carries_the_writers_time():
    r, w = os.pipe()
    os.write(w, b"@100.0 first\n+gone 1\n@100.5 -\n@101.0 first\n@101.25 second\nthird\n")
    os.close(w)
    t0 = time.monotonic()
    report = blocks.sample(os.getpid(), {}, control=r)
    os.close(r)
    assert report["seconds"]["first"] == pytest.approx(0.75)  # 0.5 + 0.25, the watch line not counted
    # a line without a time is counted at the sampler's reading: here, from this process's clock
    assert t0 - 101.25 - 0.01 < report["seconds"]["second"] < time.monotonic() - 101.25 + 0.01
    assert "third" not in report["seconds"]  # still open when the control ended


@linux
def test_the_sampler_ends_with_a_report_when_the_thread_has_ended():
    t = threading.Thread(target=lambda: None)
    t.start()
    sampler = blocks.BlockSampler({"ended": t.native_id})
    t.join()
    time.sleep(0.05)
    sampler.label("gone")
    time.sleep(0.05)
    report = sampler.finish()
    c = report["counts"]["gone"]
    assert c.get("ended gone", 0) > 0 and c.get("ended running", 0) == 0, c


def test_a_label_is_one_line():
    if not os.path.exists("/proc/self/task"):
        pytest.skip("reads /proc (Linux)")
    with pytest.raises(ValueError):
        blocks.BlockSampler({"two words": threading.get_native_id()})
    sampler = blocks.BlockSampler({"me": threading.get_native_id()})
    try:
        with pytest.raises(ValueError):
            sampler.label("a\nb")
        with pytest.raises(ValueError):
            sampler.watch("a=b", 1)
    finally:
        sampler.finish()
