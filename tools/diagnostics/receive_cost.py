"""What receiving one packed batch costs the main process, part by part: the descriptor a worker
sends (its size, the objects its pickle makes and the classes it calls), and the time to unpickle
it against the floor that any DataLoader batch of that size pays.

    python3 tools/diagnostics/receive_cost.py [--batches 200] [--samples 8] [--height 8 --width 8]

The batches are bench_train's (``collate_samples`` under ``PackedCollate``: per sample 6 camera
images and 33 small meta-data tensors). A forked process packs them (as a DataLoader worker does)
and sends their pickles; this process then times, per descriptor, in us:

- ``loads``: ``pickle.loads`` of the descriptor (what the DataLoader's ``_data_queue.get`` runs
  after the pipe read): the region adopted, the skeleton looked up, the PackedBatch made;
- ``loads_bytes``: ``pickle.loads`` of a bytes object of the same size (the floor: the pipe's
  payload itself);
- ``rebuild``: the part of ``loads`` in ``_rebuild_batch`` (adopt and construct), and
  ``skeleton``: in ``_skeleton_of`` (the shared structure found by its pickle);

and prints the pickle's opcodes by kind, the globals it calls, and its size in bytes. The
DataLoader's own part of the receive (the pipe read, its index bookkeeping) is what a plain loop
pays for any batch too: compare ``service_next_ms_per_batch`` in ``PrefetchLoader.stats()`` with
``loads`` here.
"""
from __future__ import annotations

import argparse
import collections
import multiprocessing
import os
import pickle
import pickletools
import statistics
import sys
import time
from multiprocessing.reduction import ForkingPickler

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "bench"))
import mtc_loader  # noqa: E402
from mtc_loader import collate as _collate  # noqa: E402
from bench_train import CameraSamples, collate_samples  # noqa: E402


def _pack(pc, ds, samples: int, n: int, conn) -> None:
    out = []
    for k in range(n):
        b = pc([ds[k * samples + i] for i in range(samples)])
        out.append(bytes(ForkingPickler.dumps(b)))
    conn.send(out)
    conn.recv()  # the regions stay this process's until the receiver has adopted them


class _Census(pickle.Unpickler):
    """Records the globals a pickle calls, calling none of them."""

    def __init__(self, blob: bytes) -> None:
        import io
        super().__init__(io.BytesIO(blob))
        self.called: list[str] = []

    def find_class(self, module: str, name: str):
        self.called.append(f"{module}.{name}")
        return lambda *args: None


def census(blob: bytes) -> tuple[collections.Counter, list[str], list[int]]:
    """The pickle's opcodes by kind, the globals it calls, the sizes of its bytes objects."""
    ops: collections.Counter = collections.Counter()
    sizes = []
    for op, arg, _ in pickletools.genops(blob):
        ops[op.name] += 1
        if isinstance(arg, bytes):
            sizes.append(len(arg))
    c = _Census(blob)
    c.load()
    return ops, c.called, sizes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--height", type=int, default=8)
    ap.add_argument("--width", type=int, default=8)
    a = ap.parse_args()
    ds = CameraSamples(10 ** 7, a.batches * a.samples, a.height, a.width)
    pc = mtc_loader.PackedCollate(collate_samples, arena_bytes=max(64 << 20, a.batches * (1 << 17)))
    ctx = multiprocessing.get_context("fork")
    mine, theirs = ctx.Pipe()
    p = ctx.Process(target=_pack, args=(pc, ds, a.samples, a.batches, theirs))
    p.start()
    blobs = mine.recv()
    ops, globals_, sizes = census(blobs[0])
    parts = {"rebuild": 0.0, "skeleton": 0.0}
    real = {"rebuild": _collate._rebuild_batch, "skeleton": _collate._skeleton_of}

    def timed(name):
        def wrapper(*args):
            t0 = time.perf_counter()
            try:
                return real[name](*args)
            finally:
                parts[name] += time.perf_counter() - t0
        return wrapper

    loads, floor, kept = [], [], []
    half = len(blobs) // 2
    for k, blob in enumerate(blobs):
        same = bytes(len(blob))
        t0 = time.perf_counter()
        pickle.loads(pickle.dumps(same, protocol=5))
        t1 = time.perf_counter()
        if k == half:  # the second half with the parts timed
            _collate._rebuild_batch, _collate._skeleton_of = timed("rebuild"), timed("skeleton")
        t2 = time.perf_counter()
        b = pickle.loads(blob)
        t3 = time.perf_counter()
        kept.append(b)
        loads.append(t3 - t2)
        floor.append(t1 - t0)
    _collate._rebuild_batch, _collate._skeleton_of = real["rebuild"], real["skeleton"]
    mine.send(None)
    p.join()
    del kept
    n = len(blobs) - half
    us = 1e6
    print(f"{len(blobs)} descriptors of batch {a.samples}; descriptor {len(blobs[0])} bytes "
          f"(median {statistics.median(len(b) for b in blobs):.0f})")
    print(f"loads {statistics.median(loads[:half]) * us:.1f} us (median, untimed half), "
          f"loads_bytes {statistics.median(floor) * us:.1f} us; of loads: rebuild {parts['rebuild'] / n * us:.1f} us, "
          f"skeleton {parts['skeleton'] / n * us:.1f} us (timed half, mean)")
    print("opcodes: " + ", ".join(f"{k} {v}" for k, v in ops.most_common()))
    print(f"bytes objects in it: {sizes} (the layout, the skeleton's pickle)")
    print("globals: " + ", ".join(f"{g} x{c}" for g, c in collections.Counter(globals_).most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
