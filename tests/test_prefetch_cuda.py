"""The prefetch service on CUDA: copies on the device's copy stream, hand-out by event (no CPU
sync), output memory recorded on the consumer's stream. Skipped without a GPU."""
from __future__ import annotations

import gc
import threading
import time

import pytest
import torch
from torch.utils.data import DataLoader

import mtc_loader
from conftest import assert_tree_bitwise, requires_2gpus, requires_cuda, seed_batch, tree_kept, tree_to
from test_loader import ARENA, SeedSamples, reference, settle
from test_prefetch import Recorder, wait_no_service_threads

pytestmark = [pytest.mark.cuda, requires_cuda,
              pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")]

# ~1 s of GPU time on an H100 (cycles at ~1.7 GHz)
LONG_KERNEL_CYCLES = 1_700_000_000


def packed_loader(n=48, workers=2, batch_size=4):
    ds = SeedSamples(n=n)
    pc = mtc_loader.PackedCollate(list, arena_bytes=ARENA)
    dl = DataLoader(ds, batch_size=batch_size, num_workers=workers, collate_fn=pc)
    return ds, pc, dl, reference(ds, batch_size=batch_size)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("consumer", ["default", "side"])
def test_bitwise_on_the_consumer_stream(workers, consumer):
    ds, pc, dl, refs = packed_loader(workers=workers)
    stream = torch.cuda.Stream() if consumer == "side" else torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        n = 0
        for k, b in enumerate(mtc_loader.PrefetchLoader(dl, "cuda", depth=2)):
            # consume on the consumer stream only: clone there, compare after a sync
            copies = torch.utils._pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, b)
            stream.synchronize()
            assert_tree_bitwise(copies, tree_kept(refs[k], "cuda:0"), f"batch {k}")
            n += 1
    assert n == len(refs)
    wait_no_service_threads()
    assert settle(pc.arena, "cuda:0")["slots_in_use"] == 0


def test_plain_batches_through_start_copy_on_the_copy_stream():
    got = list(mtc_loader.PrefetchLoader(Recorder(6), "cuda:0", depth=2))
    torch.cuda.synchronize()
    for k, b in enumerate(got):
        assert_tree_bitwise(b, tree_kept(seed_batch(2, seed=k), "cuda:0"), f"batch {k}")


def test_copy_overlaps_a_long_kernel():
    """start_side_copy: the copy completes while a long kernel still runs on the current stream;
    start_copy on the current stream would wait behind it."""
    data = seed_batch(16, seed=3)
    mtc_loader.start_side_copy(data, "cuda").get()  # warm up: threads, pinned slabs
    torch.cuda.synchronize()
    cur = torch.cuda.current_stream()
    torch.cuda._sleep(LONG_KERNEL_CYCLES)
    side = mtc_loader.start_side_copy(data, "cuda")
    side._finish()
    copies = mtc_loader.copy_stream("cuda")  # its last work: the copy and the event after it
    deadline = time.monotonic() + 0.5
    while not copies.query() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert copies.query(), "the side copy did not finish while the kernel ran"
    assert not cur.query(), "the long kernel ended too soon for this test to mean anything"
    out = side.get()  # the current stream now waits for the copy (already done)
    plain = mtc_loader.start_copy(data, "cuda").get()
    done = torch.cuda.Event()
    done.record(cur)
    assert not done.query(), "start_copy's copy should be queued behind the kernel"
    torch.cuda.synchronize()
    assert_tree_bitwise(out, tree_to(data, "cuda:0"))
    assert_tree_bitwise(plain, tree_to(data, "cuda:0"))


def test_next_batch_is_ready_while_the_step_runs():
    """PrefetchLoader: while step k's long kernel runs, batch k+1 is copied on the copy stream and
    __next__ returns it without a CPU wait for the GPU."""
    ds, pc, dl, refs = packed_loader(n=24, workers=2)
    pl = mtc_loader.PrefetchLoader(dl, "cuda", depth=2)
    it = iter(pl)
    first = next(it)
    torch.cuda._sleep(LONG_KERNEL_CYCLES)  # "step 0"
    time.sleep(0.2)  # the service finishes the next batches meanwhile
    t0 = time.perf_counter()
    second = next(it)
    took = time.perf_counter() - t0
    assert took < 0.1, f"__next__ waited {took:.3f} s: it waited for the GPU"
    assert not torch.cuda.current_stream().query(), "the long kernel ended too soon"
    torch.cuda.synchronize()
    assert_tree_bitwise(first, tree_kept(refs[0], "cuda:0"), "batch 0")
    assert_tree_bitwise(second, tree_kept(refs[1], "cuda:0"), "batch 1")
    del it
    wait_no_service_threads()


def test_batches_kept_alive_across_many_steps():
    """Every batch is kept while later batches arrive and the consumer allocates and frees on its
    stream: no buffer is reused under a live batch (run under compute-sanitizer too)."""
    ds, pc, dl, refs = packed_loader(n=64, workers=2)
    kept = []
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for k, b in enumerate(mtc_loader.PrefetchLoader(dl, "cuda", depth=3)):
            kept.append(b)
            for _ in range(3):  # churn the caching allocator on the consumer stream
                x = torch.empty(1 << 16, device="cuda").fill_(k)
                del x
            if k % 4 == 3:
                kept = kept[-8:]  # drop old batches: their memory goes back to the allocator
                refs_k = refs[k - len(kept) + 1:k + 1]
                side.synchronize()
                for j, (got, ref) in enumerate(zip(kept, refs_k)):
                    assert_tree_bitwise(got, tree_kept(ref, "cuda:0"), f"batch {k - len(kept) + 1 + j}")
    torch.cuda.synchronize()
    del kept
    gc.collect()
    wait_no_service_threads()
    assert settle(pc.arena, "cuda:0")["slots_in_use"] == 0


def test_early_break_exception_and_del_on_cuda():
    got = []
    with pytest.raises(TypeError, match=r"data\[1\]\['bad'\] is a sparse tensor"):
        for k, b in enumerate(mtc_loader.PrefetchLoader(Recorder(6, bad_at=3), "cuda", depth=2)):
            got.append(k)
    assert got == [0, 1, 2]
    ds, pc, dl, refs = packed_loader(n=40, workers=2)
    for k, b in enumerate(mtc_loader.PrefetchLoader(dl, "cuda", depth=3)):
        if k == 1:
            break
    it = iter(mtc_loader.PrefetchLoader(dl, "cuda", depth=3))
    next(it)
    time.sleep(0.2)
    del it, b
    wait_no_service_threads()
    assert settle(pc.arena, "cuda:0")["slots_in_use"] == 0
    assert pc.arena._a.valid()


def test_loop_stats_on_cuda():
    ds, pc, dl, refs = packed_loader(n=32, workers=2)
    pl = mtc_loader.PrefetchLoader(dl, "cuda", depth=2)
    for b in pl:
        torch.cuda._sleep(10_000_000)  # a ~6 ms step of real GPU work
    s = pl.stats()
    assert s["batches"] == len(refs)
    assert 0.0 <= s["data_bound"] <= 1.0
    assert s["service_cpu_ms_per_batch"] > 0


def test_interpreter_exit_with_the_service_busy_on_cuda(tmp_path):
    script = tmp_path / "exit_busy_cuda.py"
    script.write_text(
        "import torch, mtc_loader\n"
        "from torch.utils.data import DataLoader\n"
        "class DS(torch.utils.data.Dataset):\n"
        "    def __len__(self): return 10_000\n"
        "    def __getitem__(self, i): return {'x': torch.full((256, 1024), float(i)), 'y': [torch.arange(i % 50)] * 20}\n"
        "dl = DataLoader(DS(), batch_size=8, num_workers=2, collate_fn=mtc_loader.PackedCollate(list, arena_bytes=256 << 20))\n"
        "it = iter(mtc_loader.PrefetchLoader(dl, 'cuda', depth=4))\n"
        "for _ in range(3):\n"
        "    b = next(it)\n"
        "    torch.cuda._sleep(100_000_000)\n"
        "print('exiting', flush=True)\n")
    import subprocess
    import sys
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert "exiting" in r.stdout and "terminate called" not in r.stderr


class SameSize(torch.utils.data.Dataset):
    """Samples of one size, so that every batch's packed chunk has the same size and the caching
    allocator hands a freed chunk's block to the next copy whenever the block is free to reuse."""

    def __len__(self):
        return 48

    def __getitem__(self, i):
        return [torch.full((16384,), float(i)), torch.arange(1000, dtype=torch.int64) + i]


def test_consumer_that_switches_streams_keeps_its_batches_safe():
    """The service records each batch's buffers on the stream predicted from the last hand-out;
    a consumer that switches streams mid-epoch is recorded at hand-out. Each batch is read by a
    kernel queued behind ~20 ms of GPU work on the consumer's stream and dropped at once: if its
    buffers were not recorded on that stream, the allocator would give the freed block to a
    later batch's copy (issued meanwhile on the copy stream) before the read."""
    ds = SameSize()
    pc = mtc_loader.PackedCollate(list, arena_bytes=ARENA)
    dl = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=pc)
    refs = [[ds[4 * k + j] for j in range(4)] for k in range(len(ds) // 4)]
    # none of them the legacy default stream: an event recorded there at a free would wait for
    # every other stream's work and hide a missing record on the stream that read the batch
    # and the stream current at iter() (the service's first prediction) never runs anything, so
    # that an event recorded there is complete at once
    first, s1, s2 = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
    clone = lambda b: torch.utils._pytree.tree_map(  # noqa: E731
        lambda t: t.clone() if isinstance(t, torch.Tensor) else t, b)
    with torch.cuda.stream(first):
        it = iter(mtc_loader.PrefetchLoader(dl, "cuda", depth=1))
        clones = [clone(next(it))]  # the epoch starts at the first next(): prediction `first`
    k = 1
    while True:
        s = (s1, s2)[((k - 1) // 3) % 2]  # three batches per stream, then switch
        with torch.cuda.stream(s):  # the hand-out (next) and every use on s
            try:
                b = next(it)
            except StopIteration:
                break
            torch.cuda._sleep(34_000_000)
            clones.append(clone(b))
        del b
        k += 1
    torch.cuda.synchronize()
    assert len(clones) == len(refs)
    for k, (got, ref) in enumerate(zip(clones, refs)):
        assert_tree_bitwise(got, tree_kept(ref, "cuda:0"), f"batch {k}")
    del it
    wait_no_service_threads()
    assert settle(pc.arena, "cuda:0")["slots_in_use"] == 0


def test_pooled_event_orders_the_waiting_stream_and_is_reused():
    """The service's event (engine pool, recorded with the GIL held) makes a waiting stream wait
    for the work recorded before it; once waited for, it goes back to the pool and is reused."""
    producer, waiter = torch.cuda.Stream(), torch.cuda.Stream()
    after = torch.cuda.Event()
    gc.collect()  # no SideCopy of an earlier test gives an event back in the middle of this one
    gc.disable()
    try:
        with torch.cuda.stream(producer):
            torch.cuda._sleep(LONG_KERNEL_CYCLES // 4)  # ~250 ms
        ev = mtc_loader._engine.event_record(0, producer.cuda_stream)
        assert ev
        mtc_loader._engine.stream_wait_event(0, waiter.cuda_stream, ev)
        mtc_loader._engine.event_release(0, ev)
        after.record(waiter)
        assert not after.query(), "the waiting stream did not wait for the event"
        again = mtc_loader._engine.event_record(0, waiter.cuda_stream)
        assert again == ev, "a released event is reused"
        mtc_loader._engine.event_release(0, again)
    finally:
        gc.enable()
    after.synchronize()
    assert producer.query()


def test_stream_wait_event_from_a_thread_without_a_cuda_context():
    """The hand-out's wait is a driver call; a thread that never used CUDA has no current context,
    so the engine pushes the device's primary context for the call. The wait must hold: work
    queued on the waiting stream after it does not finish before the event's kernel."""
    producer, waiter = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(producer):
        torch.cuda._sleep(LONG_KERNEL_CYCLES // 4)  # ~250 ms
        ev = torch.cuda.Event()
        ev.record(producer)
    errors = []

    def fresh_thread():
        try:
            mtc_loader._engine.stream_wait_event(0, waiter.cuda_stream, ev.cuda_event)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    t = threading.Thread(target=fresh_thread)
    t.start()
    t.join()
    assert not errors, errors
    after = torch.cuda.Event()
    after.record(waiter)
    assert not after.query(), "the waiting stream did not wait for the event"
    after.synchronize()
    assert ev.query()


@requires_2gpus
def test_hand_out_while_another_device_is_current():
    """The caller's current device is cuda:1 while it consumes batches copied to cuda:0: the
    hand-out's driver-level wait runs in cuda:0's context (pushed for the call), on the caller's
    current stream of cuda:0, and the thread's own device stays cuda:1."""
    ds, pc, dl, refs = packed_loader(n=24, workers=2)
    side0 = torch.cuda.Stream(device=0)
    with torch.cuda.stream(side0):  # this thread's current stream of cuda:0 (and device 0)...
        with torch.cuda.device(1):  # ...then current device cuda:1; the stream of cuda:0 stays
            got = []
            for b in mtc_loader.PrefetchLoader(dl, "cuda:0", depth=2):
                assert torch.cuda.current_device() == 1
                got.append(torch.utils._pytree.tree_map(
                    lambda t: t.clone() if isinstance(t, torch.Tensor) else t, b))
    torch.cuda.synchronize(0)
    for k, (g, ref) in enumerate(zip(got, refs)):
        assert_tree_bitwise(g, tree_kept(ref, "cuda:0"), f"batch {k}")
    wait_no_service_threads()


def test_service_path_keeps_the_gil_next_to_a_spinning_thread():
    """The service's per-batch path (unpack of a packed batch on the copy stream, finish) must
    not release the GIL per tensor: dropping a tensor releases it, and next to a thread that
    holds it (a launch-bound training loop, here a loop in Python) every release can cost a
    forced switch. Dropping the temporary views here cost ~110 per 265-leaf batch on the GPU
    machine; what remains is the few torch calls per segment that make the views (each releases
    it, and torch retakes it for the view's base): ~24 there."""
    import statistics
    import sys

    pc = mtc_loader.PackedCollate(list)
    batches = [pc(seed_batch(8, seed=k)) for k in range(12)]
    mtc_loader.start_side_copy(pc(seed_batch(8, seed=99)), "cuda:0").get()  # warm-up
    torch.cuda.synchronize()
    stop = []

    def spin():
        x = 0
        while not stop:
            x += 1

    interval = 0.002
    saved = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    th = threading.Thread(target=spin, daemon=True)
    th.start()
    waits, outs = [], []
    try:
        for b in batches:
            w0, c0 = time.perf_counter(), time.thread_time()
            side = mtc_loader.start_side_copy(b, "cuda:0")
            side._finish()
            outs.append(side)  # handed out (and dropped) by the consumer, not here
            waits.append((time.perf_counter() - w0) - (time.thread_time() - c0))
    finally:
        stop.append(1)
        th.join()
        sys.setswitchinterval(saved)
    switches = statistics.median(waits) / interval
    assert switches < 50, f"{switches:.0f} forced switches per batch on the service's path"
    for side in outs:
        side.get()
    torch.cuda.synchronize()


def _first_box_spread(batch):
    """A transform: one 1 MiB tensor per sample, allocated on the thread's current stream and
    filled there with the sample's first 3D-box value."""
    return [torch.empty(1 << 18, device="cuda").copy_(s["gt_data"]["bounding_boxes_3d"].flatten()[0].expand(1 << 18))
            for s in batch]


def test_transform_runs_on_the_copy_stream_ordered_before_the_callers_kernels():
    """The transform's kernels (a long sleep, then its result) go to the copy stream after the
    copy, and the hand-out's event is recorded after them: the caller's clone reads the result,
    not the memory before the transform wrote it, and next() does not wait on the CPU."""
    streams = []

    def slow(batch):
        streams.append(torch.cuda.current_stream().cuda_stream)
        torch.cuda._sleep(LONG_KERNEL_CYCLES // 4)
        return _first_box_spread(batch)

    got = []
    for b in mtc_loader.PrefetchLoader(Recorder(4), "cuda:0", depth=1, transform=slow):
        got.append([t.clone() for t in b])
    torch.cuda.synchronize()
    for k, ts in enumerate(got):
        for j, (t, s) in enumerate(zip(ts, seed_batch(2, seed=k))):
            value = s["gt_data"]["bounding_boxes_3d"].flatten()[0]
            assert torch.equal(t.cpu(), value.expand(1 << 18)), f"batch {k} sample {j}"
    assert set(streams) == {mtc_loader.copy_stream("cuda").cuda_stream}
    wait_no_service_threads()


def test_transform_outputs_are_recorded_on_the_callers_streams():
    """The transform allocates on the copy stream: its outputs are recorded on the stream that
    takes the batch (predicted, or at the hand-out when the caller switches streams), so that a
    dropped output is not given to the next transform while the caller's queued read runs."""
    first, s1, s2 = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(first):
        it = iter(mtc_loader.PrefetchLoader(Recorder(13), "cuda:0", depth=1, transform=_first_box_spread))
        clones = [[t.clone() for t in next(it)]]
    k = 1
    while True:
        with torch.cuda.stream((s1, s2)[((k - 1) // 3) % 2]):
            try:
                b = next(it)
            except StopIteration:
                break
            torch.cuda._sleep(34_000_000)
            clones.append([t.clone() for t in b])
        del b
        k += 1
    torch.cuda.synchronize()
    assert len(clones) == 13
    for k, ts in enumerate(clones):
        for j, (t, s) in enumerate(zip(ts, seed_batch(2, seed=k))):
            value = s["gt_data"]["bounding_boxes_3d"].flatten()[0]
            assert torch.equal(t.cpu(), value.expand(1 << 18)), f"batch {k} sample {j}"
    del it
    wait_no_service_threads()
