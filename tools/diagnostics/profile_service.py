"""Where the prefetch service's CPU per packed batch goes, stage by stage.

    python3 tools/diagnostics/profile_service.py [--device cuda:0] [--batches 60] [--samples 8]
                                     [--height 256 --width 448] [--align 16] [--idle-ms 5]
                                     [--json PATH]

The batch is bench_train's (``collate_samples``): per sample 6 uint8 camera images stacked by
``default_collate`` and 33 small meta-data tensors kept per sample, so 8 samples make 1 image
tensor + 264 small tensors (265 leaves). Every figure is the calling thread's CPU time
(``time.thread_time``) per batch, median over ``--batches`` batches, in ms:

- ``receive``: what the main process does for the descriptor a worker sends: ``pickle.loads``
  of the ``PackedBatch`` (layout, skeleton, the arena's region taken over);
- ``start_copy``: ``PackedBatch.start_copy(dev).get()``, and the engine's own split of it
  (``ns_unpack_*`` of ``mtc_loader.stats()``): layout decode, the copy's set-up (chunk, DMA or
  memcpy), the views, the skeleton walk and rebuild;
- ``side_copy``: ``start_side_copy(batch, dev).get()`` (the service's path: + event, record);
- ``to``: ``PackedBatch.to(dev)`` in a hot loop (per leaf too), each batch and its result dropped
  before the next call, as a training loop drops them (outside the timed call);
- ``to``, asleep before each: the same with the thread asleep for ``--idle-ms`` before each call
  (as the service sleeps between batches), with the engine split;
- ``service``: a PrefetchLoader over a DataLoader of 2 workers, its consumer spinning in Python for
  ``--step-ms`` per batch: ``stats()`` (``service_cpu_ms_per_batch``, of it
  ``service_next_ms_per_batch``) and the engine split per batch; then the same with a consumer that
  sleeps (the service alone with the GIL).

The ``--height/--width`` default is bench_train's launch loop; on the CPU the copy is a memcpy of
the whole batch, so ``--device cpu`` defaults to 8x8 images to leave the per-leaf work visible.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import time
from typing import Any, Callable

import torch

# the benchmarks' workloads, in bench/
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "bench"))
import mtc_loader  # noqa: E402
from bench_train import CameraSamples, collate_samples  # noqa: E402
from workloads import count_tensors  # noqa: E402

STAGES = ["ns_unpack_decode", "ns_unpack_copy", "ns_unpack_views", "ns_unpack_rebuild"]


def make_batches(collate: mtc_loader.PackedCollate, ds: CameraSamples, n: int, samples: int) -> list:
    return [collate([ds[(k * samples + j) % len(ds)] for j in range(samples)]) for k in range(n)]


def received(collate: mtc_loader.PackedCollate, ds: CameraSamples, n: int, samples: int) -> tuple[list, list]:
    """Batches as a worker sends them: packed in a forked child, their descriptors pickled, and
    here ``pickle.loads`` + the PackedBatch's rebuild (the arena's region taken over), timed."""
    from mtc_loader._packed import _rebuild_batch
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the "worker"
        os.close(r)
        try:
            from torch.utils.data import _utils
            _utils.worker._worker_info = _utils.worker.WorkerInfo(id=0, num_workers=1, seed=0, dataset=ds)
            blobs = [pickle.dumps(b.__reduce__()[1]) for b in make_batches(collate, ds, n, samples)]
            with os.fdopen(w, "wb") as f:
                f.write(pickle.dumps(blobs))
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        blobs = pickle.loads(f.read())
    os.waitpid(pid, 0)
    times, batches = [], []
    for b in blobs:
        t0 = time.thread_time()
        batches.append(_rebuild_batch(*pickle.loads(b)))
        times.append(time.thread_time() - t0)
    return batches, times


def split_service_thread():
    """Times (thread CPU) the parts of each batch of the prefetch service started inside the
    ``with``: the iterable's next() (``next``), the start of the copy (``start``: the engine's
    unpack, views and rebuild), its finish (``finish``: wait, temporaries, buffers, event,
    record_stream); the rest of the service's CPU is its own bookkeeping. Yields a dict of seconds."""
    import contextlib
    from mtc_loader.prefetch import _handout, _service
    acc = {"next": 0.0, "start": 0.0, "finish": 0.0}

    def timed_part(name, fn):
        def wrapper(*args, **kwargs):
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[name] += time.thread_time() - t0
        return wrapper

    @contextlib.contextmanager
    def cm():
        saved = (_service._start, _service.SideCopy._finish, _service._next_of)
        _service._start = timed_part("start", saved[0])
        _service.SideCopy._finish = timed_part("finish", saved[1])
        # the service thread's iterator (the caller's, where it produces, is timed as its own)
        _service._next_of = lambda it: timed_part("next", saved[2](it))
        try:
            yield acc
        finally:
            _service._start, _service.SideCopy._finish, _service._next_of = saved

    return cm()


def service(collate: mtc_loader.PackedCollate, ds: CameraSamples, dev: str, n: int, samples: int,
            step_s: float, spin: bool = True) -> dict[str, float]:
    """The real service: PrefetchLoader over a DataLoader (2 workers) of packed batches, its
    consumer a thread that holds the GIL spinning in Python for step_s per batch (a launch-bound
    training thread), or sleeping (``spin=False``: the service alone with the GIL). stats() of the
    loader and the engine's unpack split per batch."""
    from torch.utils.data import DataLoader
    loader = DataLoader(ds, batch_size=samples, num_workers=2, collate_fn=collate, persistent_workers=True)
    pl = mtc_loader.PrefetchLoader(loader, dev, depth=2)
    for _ in pl:  # warm-up epoch
        pass
    pl.reset_stats()
    before = mtc_loader.stats()
    t0 = time.perf_counter()
    k = 0
    for _ in pl:
        end = time.perf_counter() + step_s
        if not spin:
            time.sleep(step_s)
        while time.perf_counter() < end:
            pass
        k += 1
    wall = (time.perf_counter() - t0) / k
    after = mtc_loader.stats()
    st = pl.stats()
    out = {"service_cpu_ms_per_batch": st["service_cpu_ms_per_batch"],
           "service_next_ms_per_batch": st["service_next_ms_per_batch"],
           "wait_ms_per_batch": st["wait_ms_per_batch"],
           "step_ms_per_batch": st["step_ms_per_batch"], "wall_ms_per_batch": wall * 1e3}
    for key in STAGES:
        out["engine " + key[10:]] = (after[key] - before[key]) / k / 1e6
    del pl, loader
    return out


def timed_loop(fn, items: list, idle_s: float = 0.0, device: str = "cpu") -> list[float]:
    """fn(x) timed for each x as a training loop meets it: each batch (and what it returned) is
    dropped before the next call, outside the timed call, and none is kept by the list. With
    ``idle_s``, the thread first waits for the device and sleeps that long before each call, as
    the service sleeps on its queue between batches."""
    out, items = [], items[::-1]
    result = None
    while items:
        x = items.pop()
        result = None
        if idle_s:
            sync(device)
            time.sleep(idle_s)
        t0 = time.thread_time()
        result = fn(x)
        out.append(time.thread_time() - t0)
        del x
    del result
    return out


def timed(fn, items) -> list[float]:
    out = []
    for x in items:
        t0 = time.thread_time()
        fn(x)
        out.append(time.thread_time() - t0)
    return out


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def engine_split(run: Callable[[], Any], device: str) -> dict[str, float]:
    """The engine's unpack split (ms per unpack) over what ``run()`` does."""
    before = mtc_loader.stats()
    run()
    sync(device)
    after = mtc_loader.stats()
    n = after["unpacks"] - before["unpacks"]
    return {k[10:]: (after[k] - before[k]) / max(n, 1) / 1e6 for k in STAGES}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", type=int, default=60)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--height", type=int, default=None)
    ap.add_argument("--width", type=int, default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--receive", action="store_true", help="time the receive (forks a packing child)")
    ap.add_argument("--step-ms", type=float, default=5.0, help="the spinning consumer's step (service stage)")
    ap.add_argument("--idle-ms", type=float, default=5.0, help="sleep before each call of the idle loop")
    ap.add_argument("--align", type=int, default=16, help="PackedCollate's min_packed_alignment_bytes")
    a = ap.parse_args()
    dev = a.device
    cpu = not dev.startswith("cuda")
    h = a.height or (8 if cpu else 256)
    w = a.width or (8 if cpu else 448)
    ds = CameraSamples(max(64, a.batches * a.samples), 16, h, w)
    one = collate_samples([ds[j] for j in range(a.samples)])
    leaves, nbytes = count_tensors(one)
    collate = mtc_loader.PackedCollate(collate_samples, arena_bytes=max(64 << 20, 4 * (a.batches + 8) * nbytes),
                                       min_packed_alignment_bytes=a.align)
    n = a.batches
    med = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    res: dict[str, float] = {}

    def fresh() -> list:
        return make_batches(collate, ds, n, a.samples)

    print(f"device {dev}, {a.samples} samples of {h}x{w} images: {leaves} leaves, {nbytes / 1e6:.1f} MB, "
          f"medians of {n} batches, thread CPU ms per batch", flush=True)

    def put(k: str, v: float) -> None:
        res[k] = v
        print(f"  {k:<55s} {v:8.3f}", flush=True)

    # warm-up: CUDA context, arena registration, the engine's threads
    for b in fresh()[:4]:
        b.start_copy(dev).get()
    put("start_copy(dev).get()", med(timed(lambda b: b.start_copy(dev).get(), fresh())))
    batches = fresh()

    def unpack_all() -> None:
        for b in batches:
            b.start_copy(dev).get()

    for k, v in engine_split(unpack_all, dev).items():
        put(f"  engine {k}", v)
    if not cpu:
        put("start_side_copy(dev).get()", med(timed(lambda b: mtc_loader.start_side_copy(b, dev).get(), fresh())))
    put("PackedBatch.to(dev), hot loop", med(timed_loop(lambda b: b.to(dev), fresh())))
    sync(dev)
    put("  per leaf (us)", res["PackedBatch.to(dev), hot loop"] * 1e3 / leaves)
    idle: list[float] = []
    split = engine_split(lambda: idle.extend(timed_loop(lambda b: b.to(dev), fresh(), a.idle_ms / 1e3, dev)), dev)
    put(f"PackedBatch.to(dev), {a.idle_ms:g} ms asleep before each", med(idle))
    for k, v in split.items():
        put(f"  engine {k}", v)
    for key, v in service(collate, ds, dev, n, a.samples, a.step_ms / 1e3).items():
        put(f"service: {key}", v)
    with split_service_thread() as parts:
        for key, v in service(collate, ds, dev, n, a.samples, a.step_ms / 1e3, spin=False).items():
            if key.startswith("service_") or key.startswith("engine"):
                put(f"service, sleeping consumer: {key}", v)
    for key, v in parts.items():  # both epochs (warm-up and timed) of that service
        put(f"service, sleeping consumer, thread CPU of {key}", v * 1e3 / (2 * n))
    if a.receive:
        batches, recv = received(collate, ds, n, a.samples)
        put("receive (pickle.loads + rebuild of a PackedBatch)", med(recv))
        del batches
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": dev, "leaves": leaves, "results": res}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
