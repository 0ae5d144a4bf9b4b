"""The DataLoader path: PackedCollate in worker processes, PackedBatch, PrefetchLoader.

Every batch that comes out of ``PrefetchLoader(DataLoader(..., collate_fn=PackedCollate(c)))``
is compared bitwise with what a plain ``DataLoader(..., collate_fn=c)`` (no packing, no worker
processes) gives for the same indices, moved with per-tensor ``.to(device)`` (conftest.tree_to).

CPU tests run everywhere (device "cpu"); the ``cuda`` variants run the same checks with
device "cuda:0" where a GPU is (skipped elsewhere). The datasets are module-level classes so
that workers started by spawn / forkserver can unpickle them.
"""
from __future__ import annotations

import gc
import mmap
import multiprocessing
import os
import pickle
import random
import signal
import time

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, get_worker_info

import mtc_loader
from mtc_loader.collate import PackedBatch
from conftest import assert_tree_bitwise, requires_cuda, seed_batch, tree_kept, tree_to

CUDA = pytest.param("cuda:0", marks=[pytest.mark.cuda, requires_cuda], id="cuda")
DEVICES = ["cpu", CUDA]
ARENA = 16 << 20  # enough for every test below; keeps the memfds small

# 4 workers on a 2-core machine: torch warns, the test means it
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


# --------------------------------------------------------------------------- datasets

class SeedSamples(Dataset):
    """One seed sample per index (33 tensors of varying shape), plus a numpy and a str leaf;
    deterministic per index. Optionally raises ValueError or kills its worker at one index."""

    def __init__(self, n: int = 52, fail_at: int = -1, kill_at: int = -1, collate=None):
        self.n, self.fail_at, self.kill_at, self.collate = n, fail_at, kill_at, collate

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i == self.fail_at:
            raise ValueError(f"boom at {i}")
        if i == self.kill_at and get_worker_info() is not None:
            if self.collate is not None:
                # hold an arena region, as a worker killed between packing and sending would
                self.collate([seed_sample(i)])
            os.kill(os.getpid(), signal.SIGKILL)
        return seed_sample(i)


def seed_sample(i: int) -> dict:
    s = seed_batch(1, seed=i)[0]
    s["meta"] = {"token": f"sample-{i}", "ego_pose": np.arange(16, dtype=np.float64).reshape(4, 4) + i}
    return s


class FixedSamples(Dataset):
    """Fixed-size samples that torch's default_collate can stack: image, int label, numpy
    arrays, a string, a float and nested dicts / tuples."""

    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(1000 + i)
        return {
            "img": torch.rand(3, 8, 8, generator=g),
            "label": i,
            "name": f"img{i:03d}",
            "arr": np.linspace(0, i, 5, dtype=np.float32),
            "nested": {
                "mask": torch.rand(4, generator=g) > 0.5,
                "pair": (torch.randint(0, 1 << 20, (2,), generator=g), np.arange(3, dtype=np.int16) * i),
                "scale": 0.5 * i,
            },
        }


# --------------------------------------------------------------------------- helpers

def sync(device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def reference(ds, collate=list, **kw) -> list:
    """The plain DataLoader's batches (same collate, no packing, in this process)."""
    return list(DataLoader(ds, num_workers=0, collate_fn=collate, **kw))


def check_epoch(loader, refs, device, **pl_kw) -> int:
    n = 0
    for k, b in enumerate(mtc_loader.PrefetchLoader(loader, device, **pl_kw)):
        sync(device)
        assert_tree_bitwise(b, tree_kept(refs[k], device), f"batch {k}")
        n += 1
    assert n == len(refs)
    return n


def settle(arena, device="cpu", want_zero=True, timeout=20.0) -> dict:
    """Collects garbage (DataLoader iterators shut their workers down), reaps exited workers,
    and waits for DMA callbacks (CUDA) until no slot is in use."""
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        multiprocessing.active_children()  # reaps terminated workers (no zombie keeps a pid)
        sync(device)
        if want_zero:
            # workers that packed batches past an error die once their iterator is collected
            # (an exception's traceback can keep it alive for a while): reclaim what they held
            arena.reclaim_dead()
        s = arena.stats()
        if not want_zero or s["slots_in_use"] == 0 or time.monotonic() > deadline:
            return s
        time.sleep(0.01)


def packed(n: int = 2, seed: int = 0, **kw):
    pc = mtc_loader.PackedCollate(list, arena_bytes=kw.pop("arena_bytes", ARENA), **kw)
    samples = [seed_sample(seed + j) for j in range(n)]
    return pc, samples, pc(samples)


@pytest.fixture
def fast_worker_shutdown(monkeypatch):
    """After a worker raised (or died), torch's DataLoader shuts its remaining workers down only
    after MP_STATUS_CHECK_INTERVAL (5 s) per worker (they are never sent the final signal; the
    same with a plain DataLoader and collate_fn=list). Shorter here: the join times out sooner
    and torch terminates them. Fork workers inherit the patched value."""
    from torch.utils.data import _utils
    monkeypatch.setattr(_utils, "MP_STATUS_CHECK_INTERVAL", 0.2)
    monkeypatch.setattr(_utils.worker, "MP_STATUS_CHECK_INTERVAL", 0.2)


# --------------------------------------------------------------------------- worker processes

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ctx,workers", [(None, 0), ("fork", 1), ("fork", 4), ("spawn", 1), ("forkserver", 2)])
def test_start_methods_and_worker_counts(ctx, workers, device):
    ds = SeedSamples()
    pc = mtc_loader.PackedCollate(list, arena_bytes=ARENA)
    dl = DataLoader(ds, batch_size=8, num_workers=workers, collate_fn=pc, multiprocessing_context=ctx)
    assert check_epoch(dl, reference(ds, batch_size=8), device) == 7  # 6 x 8 + one of 4
    s = settle(pc.arena, device)
    assert s["slots_in_use"] == 0 and s["allocs"] == s["frees"] == 7, s
    assert pc.arena._a.valid()


@pytest.mark.parametrize("device", DEVICES)
def test_default_collate_fixed_size_samples(device):
    ds = FixedSamples()
    pc = mtc_loader.PackedCollate(arena_bytes=ARENA)  # wraps default_collate
    dl = DataLoader(ds, batch_size=6, num_workers=2, collate_fn=pc)
    refs = reference(ds, collate=torch.utils.data.default_collate, batch_size=6)
    assert isinstance(refs[0]["nested"]["pair"][1], torch.Tensor)  # default_collate made tensors
    check_epoch(dl, refs, device)
    assert settle(pc.arena, device)["slots_in_use"] == 0


@pytest.mark.parametrize("device", DEVICES)
def test_persistent_workers_two_epochs(device):
    ds = SeedSamples(n=40)
    order = list(range(40))
    random.Random(5).shuffle(order)
    pc = mtc_loader.PackedCollate(list, arena_bytes=ARENA)
    dl = DataLoader(ds, batch_size=8, sampler=order, num_workers=2, persistent_workers=True, collate_fn=pc)
    refs = reference(ds, batch_size=8, sampler=order)
    pl = mtc_loader.PrefetchLoader(dl, device)
    # an early break with persistent workers: the next epoch drains what was in flight
    for k, b in enumerate(pl):
        if k == 1:
            break
    del b
    for _ in range(2):
        check_epoch(dl, refs, device)
    s = settle(pc.arena, device)
    assert s["slots_in_use"] == 0, s
    assert pc.arena._a.valid()


@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true but no accelerator:UserWarning")
@pytest.mark.parametrize("device", DEVICES)
def test_pin_memory_true(device):
    ds = SeedSamples(n=24)
    pc = mtc_loader.PackedCollate(list, arena_bytes=ARENA)
    dl = DataLoader(ds, batch_size=8, num_workers=2, pin_memory=True, collate_fn=pc)
    check_epoch(dl, reference(ds, batch_size=8), device)
    assert settle(pc.arena, device)["slots_in_use"] == 0


@pytest.mark.parametrize("device", DEVICES)
def test_distributed_sampler(device):
    ds = SeedSamples(n=30)
    pc = mtc_loader.PackedCollate(list, arena_bytes=ARENA)
    seen = []
    for rank in (0, 1):
        def sampler():
            s = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=7)
            s.set_epoch(3)
            return s
        seen += list(sampler())
        dl = DataLoader(ds, batch_size=4, sampler=sampler(), num_workers=2, collate_fn=pc)
        check_epoch(dl, reference(ds, batch_size=4, sampler=sampler()), device)
    assert sorted(set(seen)) == list(range(30))
    assert settle(pc.arena, device)["slots_in_use"] == 0


# --------------------------------------------------------------------------- PrefetchLoader

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("depth", [1, 2, 4])
def test_prefetch_depths_len_and_epochs(depth, device):
    ds = SeedSamples(n=36)
    pc = mtc_loader.PackedCollate(list, arena_bytes=ARENA)
    dl = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=pc)
    refs = reference(ds, batch_size=4)
    pl = mtc_loader.PrefetchLoader(dl, device, depth=depth)
    assert len(pl) == len(dl) == 9
    for _ in range(3):  # the same PrefetchLoader, once per epoch
        n = 0
        for k, b in enumerate(pl):
            sync(device)
            assert_tree_bitwise(b, tree_kept(refs[k], device), f"depth {depth} batch {k}")
            n += 1
        assert n == 9
    assert settle(pc.arena, device)["slots_in_use"] == 0


@pytest.mark.parametrize("device", DEVICES)
def test_non_packed_batches_go_through_start_copy(device):
    ds = SeedSamples(n=24)
    dl = DataLoader(ds, batch_size=8, num_workers=2, collate_fn=list)
    calls = mtc_loader.stats()["calls"]
    check_epoch(dl, reference(ds, batch_size=8), device)
    assert mtc_loader.stats()["calls"] - calls == 3


@pytest.mark.parametrize("device", DEVICES)
def test_plain_list_of_batches(device):
    pc = mtc_loader.PackedCollate(list, arena_bytes=ARENA)
    refs = [[seed_sample(4 * k + j) for j in range(4)] for k in range(5)]
    # ordinary batches (start_copy) and packed batches (arena) mixed in one list
    batches = [pc(r) if k % 2 else r for k, r in enumerate(refs)]
    pl = mtc_loader.PrefetchLoader(batches, device, depth=2)
    assert len(pl) == 5
    check_epoch(batches, refs, device)
    assert settle(pc.arena, device)["slots_in_use"] == 0
    # the packed batches were consumed: a second epoch over the same list must refuse them
    with pytest.raises(RuntimeError, match="already unpacked"):
        list(pl)


@pytest.mark.parametrize("depth", [0, -1, True, 1.5, "2", None])
def test_bad_depth(depth):
    with pytest.raises(ValueError, match="depth"):
        mtc_loader.PrefetchLoader([], "cpu", depth=depth)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("workers", [
    0, 2])
def test_early_break_releases_everything(workers, device):
    ds = SeedSamples(n=48)
    pc = mtc_loader.PackedCollate(list, arena_bytes=ARENA)
    dl = DataLoader(ds, batch_size=4, num_workers=workers, collate_fn=pc)
    refs = reference(ds, batch_size=4)
    pl = mtc_loader.PrefetchLoader(dl, device, depth=2)
    for k, b in enumerate(pl):
        if k == 2:
            time.sleep(0.3)  # the workers pack the batches they prefetch meanwhile
            break
    del b, pl
    s = settle(pc.arena, device)
    assert s["slots_in_use"] == 0, s
    assert pc.arena._a.valid()
    check_epoch(dl, refs, device)  # the next epoch works


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("workers", [
    0, 2])
def test_iterator_deleted_mid_epoch(workers, device):
    ds = SeedSamples(n=48)
    pc = mtc_loader.PackedCollate(list, arena_bytes=ARENA)
    dl = DataLoader(ds, batch_size=4, num_workers=workers, collate_fn=pc)
    it = iter(mtc_loader.PrefetchLoader(dl, device, depth=3))
    b = next(it)
    sync(device)
    assert_tree_bitwise(b, tree_kept(reference(ds, batch_size=4)[0], device))
    time.sleep(0.3)
    del it
    s = settle(pc.arena, device)
    assert s["slots_in_use"] == 0, s


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("workers", [0, 2])
def test_early_exit_then_reclaim_and_next_epoch(workers, device):
    """What does hold today: after reclaim_dead() nothing is left, and the next epoch works."""
    ds = SeedSamples(n=48)
    pc = mtc_loader.PackedCollate(list, arena_bytes=ARENA)
    dl = DataLoader(ds, batch_size=4, num_workers=workers, collate_fn=pc)
    it = iter(mtc_loader.PrefetchLoader(dl, device))
    next(it)
    next(it)
    time.sleep(0.2)
    del it
    settle(pc.arena, device, want_zero=False)
    pc.arena.reclaim_dead()
    assert settle(pc.arena, device)["slots_in_use"] == 0
    assert pc.arena._a.valid()
    check_epoch(dl, reference(ds, batch_size=4), device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("workers", [0, 2])
def test_dataset_exception_surfaces_in_order(workers, device, fast_worker_shutdown):
    ds = SeedSamples(n=40, fail_at=21)  # batch 5 of 4 samples
    pc = mtc_loader.PackedCollate(list, arena_bytes=ARENA)
    dl = DataLoader(ds, batch_size=4, num_workers=workers, collate_fn=pc)
    refs = reference(SeedSamples(n=20), batch_size=4)
    got = []
    with pytest.raises(ValueError, match="boom at 21"):
        for k, b in enumerate(mtc_loader.PrefetchLoader(dl, device, depth=2)):
            sync(device)
            assert_tree_bitwise(b, tree_kept(refs[k], device), f"batch {k}")
            got.append(k)
    assert got == [0, 1, 2, 3, 4]
    settle(pc.arena, device, want_zero=False)
    pc.arena.reclaim_dead()  # batches the workers had packed past the error
    assert settle(pc.arena, device)["slots_in_use"] == 0
    assert pc.arena._a.valid()
    check_epoch(DataLoader(SeedSamples(n=20), batch_size=4, num_workers=workers, collate_fn=pc), refs, device)


@pytest.mark.parametrize("device", DEVICES)
def test_worker_killed_mid_epoch(device, fast_worker_shutdown):
    pc = mtc_loader.PackedCollate(list, arena_bytes=ARENA)
    # the worker that gets index 13 packs a batch (its region is never sent) and SIGKILLs itself
    ds = SeedSamples(n=40, kill_at=13, collate=pc)
    dl = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=pc)
    refs = reference(SeedSamples(n=40), batch_size=4)
    got = []
    with pytest.raises(RuntimeError, match="DataLoader worker"):
        for k, b in enumerate(mtc_loader.PrefetchLoader(dl, device)):
            sync(device)
            assert_tree_bitwise(b, tree_kept(refs[k], device), f"batch {k}")
            got.append(k)
    assert got == list(range(len(got))) and len(got) <= 3
    del dl
    settle(pc.arena, device, want_zero=False)
    pc.arena.reclaim_dead()
    s = settle(pc.arena, device)
    assert s["slots_in_use"] == 0, s
    assert s["reclaimed_slots"] >= 1, s  # the dead worker's region, by PrefetchLoader or by us
    assert pc.arena._a.valid()
    dl = DataLoader(SeedSamples(n=40), batch_size=4, num_workers=2, collate_fn=pc)
    check_epoch(dl, refs, device)
    assert settle(pc.arena, device)["slots_in_use"] == 0


# --------------------------------------------------------------------------- PackedBatch

def test_unpack_and_start_copy_cpu():
    pc, samples, pb = packed(4)
    assert isinstance(pb, PackedBatch) and pb.nbytes > 0
    assert pc.stats()["slots_in_use"] >= 1
    assert pb.pin_memory() is pb
    assert_tree_bitwise(pb.unpack("cpu"), tree_kept(samples, "cpu"))
    assert pc.stats()["slots_in_use"] == 0  # the CPU path copies out and frees at once
    with pytest.raises(RuntimeError, match="already unpacked"):
        pb.unpack("cpu")
    pb2 = pc(samples)
    h = mtc_loader.start_copy(pb2, "cpu")
    assert isinstance(h, mtc_loader.AsyncCopyHandle)
    assert_tree_bitwise(h.get(), tree_kept(samples, "cpu"))
    with pytest.raises(RuntimeError, match="already unpacked"):
        mtc_loader.start_copy(pb2, "cpu")
    assert pc.stats()["slots_in_use"] == 0


@pytest.mark.parametrize("nt", ["1", "0"], ids=["streaming", "memcpy"])
@pytest.mark.parametrize("align", [1, 64])
def test_pack_writes_the_same_bytes_with_and_without_streaming_stores(monkeypatch, nt, align):
    """MTC_PACK_NT (read at every pack) picks how the pack writes contiguous leaves into the
    arena; either way every byte arrives: leaves of every length around the streaming copy's
    16-byte steps and 256-byte floor, at odd offsets (align 1), one above the helpers' split
    (8 MiB), and a strided one (copied element by element either way)."""
    monkeypatch.setenv("MTC_PACK_NT", nt)
    g = torch.Generator().manual_seed(5)
    sizes = [1, 15, 16, 17, 63, 255, 256, 257, 1000, 4097, 65537, (9 << 20) + 3]
    sample = {f"t{n}": torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes}
    sample["strided"] = torch.randn(64, 33, generator=g)[:, ::2]
    sample["f64"] = torch.randn(1001, dtype=torch.float64, generator=g)
    pc = mtc_loader.PackedCollate(list, arena_bytes=64 << 20, min_packed_alignment_bytes=align)
    for _ in range(2):
        pb = pc([sample])
        assert_tree_bitwise(pb.unpack("cpu"), [sample])
    assert pc.stats()["slots_in_use"] == 0


@requires_cuda
@pytest.mark.cuda
def test_unpack_cuda():
    pc, samples, pb = packed(4)
    out = pb.unpack("cuda:0")
    torch.cuda.synchronize()
    assert_tree_bitwise(out, tree_kept(samples, "cuda:0"))
    assert settle(pc.arena, "cuda:0")["slots_in_use"] == 0


def test_unconsumed_batch_frees_its_region():
    pc, samples, pb = packed(4)
    s = pc.stats()
    assert s["slots_in_use"] >= 1
    del pb
    assert pc.stats()["slots_in_use"] == 0
    assert pc.stats()["frees"] == s["frees"] + 1


def test_outputs_are_not_views_of_the_arena():
    # a one-slot arena: the next batch lands in the same region
    pc = mtc_loader.PackedCollate(list, arena_bytes=64 << 10)
    a_samples = [seed_sample(0), seed_sample(1)]
    pa = pc(a_samples)
    off = pa._off
    out = pa.unpack("cpu")
    snapshot = pickle.loads(pickle.dumps(out))  # deep copy of every tensor
    b_samples = [seed_sample(7), seed_sample(8)]
    pb = pc(b_samples)
    assert pb._off == off  # the same bytes were overwritten
    assert_tree_bitwise(out, snapshot)
    # scribble over the whole data area of the arena
    nbytes = pc.stats()["bytes"]
    with mmap.mmap(pc.arena._a.fileno(), 0) as mm:
        start = len(mm) - nbytes
        mm[start:] = b"\xa5" * nbytes
    assert_tree_bitwise(out, snapshot)
    assert_tree_bitwise(out, tree_kept(a_samples, "cpu"))
    out_b = pb.unpack("cpu")  # what the scribble left (not b's data any more), now a copy
    with mmap.mmap(pc.arena._a.fileno(), 0) as mm:
        mm[len(mm) - nbytes:] = b"\x00" * nbytes
    assert all(torch.equal(t.view(torch.uint8), torch.full_like(t.view(torch.uint8), 0xA5))
               for t in out_b[0]["cams_gt"][0].values())
    assert pc.arena._a.valid() and pc.stats()["slots_in_use"] == 0


# --------------------------------------------------------------------------- arena full

@pytest.mark.parametrize("workers", [0, 1])
def test_arena_full_times_out_with_advice(workers, fast_worker_shutdown):
    # 4 slots of 64 KiB; 2 seed samples take one slot
    pc = mtc_loader.PackedCollate(list, arena_bytes=256 << 10, timeout=1.0)
    ds = SeedSamples(n=20)
    refs = reference(ds, batch_size=2)
    dl = DataLoader(ds, batch_size=2, num_workers=workers, collate_fn=pc)
    held = []
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"arena_bytes") as ei:
        for b in dl:  # batches held, never consumed: the arena fills up
            held.append(b)
    assert time.monotonic() - t0 >= 0.9
    assert "stayed full" in str(ei.value)
    assert len(held) == 4
    del ei
    s = pc.stats()
    assert s["timeouts"] >= 1 and s["waits"] >= 1, s
    for k, b in enumerate(held):
        assert_tree_bitwise(b.unpack("cpu"), tree_kept(refs[k], "cpu"))
    del held, b
    settle(pc.arena, want_zero=False)
    pc.arena.reclaim_dead()
    assert settle(pc.arena)["slots_in_use"] == 0
    assert pc.arena._a.valid()
    # the arena still works (a patient collate on it: a loaded machine never times it out)
    patient = mtc_loader.PackedCollate(list, arena=pc.arena, timeout=30.0)
    check_epoch(DataLoader(ds, batch_size=2, num_workers=workers, collate_fn=patient), refs, "cpu")


@pytest.mark.parametrize("workers", [0, 1])
def test_batch_larger_than_the_arena(workers, fast_worker_shutdown):
    pc = mtc_loader.PackedCollate(list, arena_bytes=256 << 10, timeout=30.0)
    ds = SeedSamples(n=40)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"arena_bytes"):
        next(iter(DataLoader(ds, batch_size=40, num_workers=workers, collate_fn=pc)))
    assert time.monotonic() - t0 < 20  # no waiting (30 s) for room that never comes
    s = settle(pc.arena, want_zero=False)
    assert s["slots_in_use"] == 0 and s["timeouts"] == 0, s
    refs = reference(ds, batch_size=2)
    check_epoch(DataLoader(ds, batch_size=2, num_workers=workers, collate_fn=pc), refs, "cpu")
    assert pc.arena._a.valid()


def test_backpressure_waits_for_room():
    # two slots; one worker with 4 batches prefetched; a slow consumer: the worker waits
    pc = mtc_loader.PackedCollate(list, arena_bytes=128 << 10, timeout=10.0)
    ds = SeedSamples(n=16)
    dl = DataLoader(ds, batch_size=2, num_workers=1, prefetch_factor=4, collate_fn=pc)
    refs = reference(ds, batch_size=2)
    for k, b in enumerate(mtc_loader.PrefetchLoader(dl, "cpu", depth=1)):
        assert_tree_bitwise(b, tree_kept(refs[k], "cpu"), f"batch {k}")
        time.sleep(0.05)
    s = settle(pc.arena)
    assert s["waits"] >= 1 and s["timeouts"] == 0 and s["high_water_slots"] <= 2, s


def test_bad_arena_arguments():
    for bad in (0, -1, 1.5, True, None, "0", "abc", "-1M", "1.5M"):
        with pytest.raises(ValueError, match="arena_bytes"):
            mtc_loader.PackedCollate(list, arena_bytes=bad)
    # a size string is read as the train command reads it: "1" is one byte, rounded up to one slot
    assert mtc_loader.PackedCollate(list, arena_bytes="1").arena.stats()["bytes"] == 64 << 10
    with pytest.raises(ValueError, match="power of two"):
        mtc_loader.PackedCollate(list, arena_bytes=ARENA, min_packed_alignment_bytes=3)


# --------------------------------------------------------------------------- descriptor tampering

_FIELDS = ("token", "off", "nbytes", "owner", "layout", "skeleton", "atoms")


def forge(pb: PackedBatch, **changes):
    """A copy of pb rebuilt from its pickled form with some fields changed (what a hostile or
    buggy worker could send)."""
    f = _fields(pb)
    f.update(changes)
    if f["token"] != pb._arena.token:
        return mtc_loader._packed._rebuild_batch(*(f[k] for k in _FIELDS))  # unknown arena: refused
    # Built directly: pickling a held batch within its own process is refused by
    # PackedBatch itself, and what matters here is what the engine does with the fields.
    forged = PackedBatch.__new__(PackedBatch)
    forged._arena = pb._arena
    forged._off, forged._nbytes, forged._owner = f["off"], f["nbytes"], f["owner"]
    forged._layout, forged._skeleton, forged._atoms = f["layout"], f["skeleton"], f["atoms"]
    forged._state = "held"
    if f["owner"] != os.getpid():
        # what unpickling in the main process does first: take the region over from its sender
        forged._state = "sent"
        forged._owner = pb._arena._a.adopt(f["off"], f["owner"])
        forged._state = "held"
    return forged


def _attempt(pc, pb, samples, **changes):
    """Forges and unpacks; returns the exception. The genuine batch is then consumed (it must
    either still unpack correctly, or refuse cleanly if the forged copy used up its region)."""
    err = None
    try:
        forged = forge(pb, **changes)
        forged.unpack("cpu")
    except (ValueError, RuntimeError) as e:
        err = e
    forged = None
    try:
        out = pb.unpack("cpu")
    except ValueError as e:
        assert "stale or forged" in str(e)
    else:
        assert_tree_bitwise(out, tree_kept(samples, "cpu"))
    assert pc.arena._a.valid()
    return err


def _fields(pb):
    """The descriptor's fields as a worker sends them (a shared structure unwrapped)."""
    # (read from the batch itself: a batch this process holds refuses to be pickled or copied)
    return dict(zip(_FIELDS, (pb._arena.token, pb._off, pb._nbytes, pb._owner, pb._layout, pb._skeleton,
                              pb._atoms)))


def test_forged_offsets_owners_sizes():
    pc = mtc_loader.PackedCollate(list, arena_bytes=1 << 20)
    slot = pc.stats()["slot_bytes"]
    cases = {
        "next slot": lambda f: dict(off=f["off"] + slot),
        "previous slot": lambda f: dict(off=f["off"] - slot),
        "unaligned": lambda f: dict(off=f["off"] + 16),
        "header": lambda f: dict(off=0),
        "past the end": lambda f: dict(off=1 << 40),
        "huge": lambda f: dict(off=(1 << 64) - slot),
        "owner init": lambda f: dict(owner=1),
        "owner unknown": lambda f: dict(owner=os.getpid() + 100000),
        "nbytes larger than the region": lambda f: dict(nbytes=f["nbytes"] + 2 * slot),
        "nbytes smaller": lambda f: dict(nbytes=f["nbytes"] - 16),
        "nbytes negative": lambda f: dict(nbytes=-1),
        "unknown arena": lambda f: dict(token=("no", "such", "arena")),
    }
    keep = pc([seed_sample(9)])  # a live neighbour region at the start of the arena
    for name, ch in cases.items():
        samples = [seed_sample(3), seed_sample(4)]
        pb = pc(samples)
        err = _attempt(pc, pb, samples, **ch(_fields(pb)))
        assert err is not None, f"{name}: accepted"
        assert "mtc_loader" in str(err), (name, err)
    assert_tree_bitwise(keep.unpack("cpu"), tree_kept([seed_sample(9)], "cpu"))
    assert settle(pc.arena)["slots_in_use"] == 0


def test_forged_layouts_truncated():
    pc, samples, pb = packed(2, arena_bytes=1 << 20)
    layout = _fields(pb)["layout"]
    del pb
    for cut in sorted({0, 1, 4, 8, 16, 31, 32, 33, 40, len(layout) // 2, len(layout) - 12,
                       len(layout) - 1}):
        samples = [seed_sample(5), seed_sample(6)]
        pb = pc(samples)
        err = _attempt(pc, pb, samples, layout=_fields(pb)["layout"][:cut])
        assert isinstance(err, ValueError), (cut, err)
    # trailing garbage
    pb = pc(samples)
    assert isinstance(_attempt(pc, pb, samples, layout=_fields(pb)["layout"] + b"\0" * 8), ValueError)
    del pb
    assert pc.arena._a.valid()


def test_forged_layouts_every_single_bit_flip():
    """Every single-bit flip of a one-sample layout is refused, or (dtype codes of the same
    element size, smaller dims, the reserved field) decodes to views inside the region; it never
    crashes, and the arena stays valid."""
    pc = mtc_loader.PackedCollate(list, arena_bytes=1 << 20)
    samples = [seed_batch(1, seed=11)[0]]
    pb = pc(samples)
    layout = _fields(pb)["layout"]
    refused = accepted = 0
    for pos in range(len(layout)):
        for bit in range(8):
            bad = bytearray(layout)
            bad[pos] ^= 1 << bit
            forged = forge(pb, layout=bytes(bad))
            try:
                out = forged.unpack("cpu")
            except (ValueError, RuntimeError):
                refused += 1
            else:
                accepted += 1
                assert isinstance(out, list) and len(out) == 1
            del forged
            if pc.stats()["slots_in_use"] == 0:  # the forged copy used up the region
                with pytest.raises(ValueError):
                    pb.unpack("cpu")
                pb = pc(samples)
            assert pc.arena._a.valid()
    assert refused >= 0.9 * (refused + accepted), (refused, accepted)
    assert_tree_bitwise(pb.unpack("cpu"), tree_kept(samples, "cpu"))


def test_forged_skeletons():
    pc = mtc_loader.PackedCollate(list, arena_bytes=1 << 20)
    for name, mk in {
        "one leaf fewer": lambda sk: [sk[0], {**sk[1], "cams_gt": sk[1]["cams_gt"][:-1]}],
        "one leaf more": lambda sk: sk + [mtc_loader.collate.LEAF],
        "no leaves": lambda sk: [],
        "a sample fewer": lambda sk: sk[:1],
        "a real tensor in it": lambda sk: sk + [torch.zeros(3)],
    }.items():
        samples = [seed_sample(0), seed_sample(1)]
        pb = pc(samples)
        err = _attempt(pc, pb, samples, skeleton=mk(_fields(pb)["skeleton"]))
        assert isinstance(err, ValueError), (name, err)
    assert settle(pc.arena)["slots_in_use"] == 0


def test_forged_shared_skeletons():
    """A structure shared between batches arrives pickled and is walked once: a walk whose leaf
    count does not match the layout, or a pickle holding anything but plain containers and atoms,
    is refused as a forged descriptor."""
    from mtc_loader import _engine
    from mtc_loader._packed import _skeleton_of
    from mtc_loader.collate import LEAF
    pc = mtc_loader.PackedCollate(list, arena_bytes=1 << 20)
    samples = [seed_sample(0), seed_sample(1)]
    pb = pc(samples)
    sk = _fields(pb)["skeleton"]
    for forged in ([sk[0], {**sk[1], "cams_gt": sk[1]["cams_gt"][:-1]}], sk + [LEAF], sk[:1]):
        err = _attempt(pc, pc(samples), samples, skeleton=_engine.skeleton(forged))
        assert isinstance(err, ValueError) and "does not match" in str(err), err
    atoms = _fields(pb)["atoms"]
    # the per-batch atoms of this structure: each sample's numpy ego_pose (kept a numpy array) and token
    assert [a if isinstance(a, str) else type(a) for a in atoms] == ["sample-0", np.ndarray, "sample-1", np.ndarray]
    for forged in (atoms[:1], atoms + ("x",), list(atoms), None):
        err = _attempt(pc, pc(samples), samples, atoms=forged)
        assert isinstance(err, ValueError) and "does not match" in str(err), (forged, err)
    for bad in ([LEAF, object()], {(1, 2): LEAF}, [LEAF, torch.zeros(2)], [np.float64(1.0)]):
        with pytest.raises(ValueError, match="forged"):
            _skeleton_of(pickle.dumps(bad))
    del pb
    assert settle(pc.arena)["slots_in_use"] == 0


class _Box:
    def __init__(self, tag: str):
        self.tag = tag


class TaggedSamples(SeedSamples):
    """Seed samples with one passthrough object that is not an atom."""

    def __getitem__(self, i: int):
        s = super().__getitem__(i)
        s["box"] = _Box(f"box-{i}")
        return s


def test_a_shared_structure_is_walked_once_and_its_outputs_share_nothing():
    """Batches whose structure holds only plain containers and atoms carry it pickled; the main
    process walks each distinct structure once and rebuilds every batch from that walk: new
    containers per batch, the same values as the collate made. A batch holding any other object
    carries its skeleton as before (its objects are its own)."""
    from mtc_loader import _packed as C
    from mtc_loader._engine import Skeleton
    C._SKELETONS.clear()
    pc = mtc_loader.PackedCollate(list, arena_bytes=ARENA)
    dl = DataLoader(SeedSamples(n=24), batch_size=4, num_workers=2, collate_fn=pc)
    outs = []
    for k, pb in enumerate(dl):
        assert isinstance(pb._skeleton, Skeleton) and pb._skeleton.leaves == 4 * 33  # numpy ego_pose: an atom
        assert pb._atoms[0::2] == tuple(f"sample-{4 * k + j}" for j in range(4))
        assert all(type(a) is np.ndarray for a in pb._atoms[1::2])
        out = pb.unpack("cpu")
        assert_tree_bitwise(out, tree_kept([seed_sample(4 * k + j) for j in range(4)], "cpu"))
        outs.append(out)
    assert len(C._SKELETONS) == 1
    a, b = outs[0], outs[1]
    assert a is not b and a[0] is not b[0] and a[0]["cams_gt"] is not b[0]["cams_gt"]
    a[0]["cams_gt"].append("mine")  # the next batch of the structure does not see it
    assert "mine" not in pc([seed_sample(0)]).unpack("cpu")[0]["cams_gt"]
    dl = DataLoader(TaggedSamples(n=8), batch_size=4, num_workers=2, collate_fn=pc)
    for k, pb in enumerate(dl):
        assert not isinstance(pb._skeleton, Skeleton)
        out = pb.unpack("cpu")
        assert [s["box"].tag for s in out] == [f"box-{4 * k + j}" for j in range(4)]
    # more distinct structures than the cache holds: it starts over, every batch still right
    for n in range(1, C._MAX_SKELETONS + 6):
        blob = pickle.dumps([LEAF_OF] * n)
        assert C._skeleton_of(blob).leaves == n
        assert len(C._SKELETONS) <= C._MAX_SKELETONS
    assert settle(pc.arena)["slots_in_use"] == 0


LEAF_OF = mtc_loader.collate.LEAF


_LEAK_BUG = ("csrc/binding/module.c engine_unpack: when the region check passes but the layout fails to "
             "decode (or does not match nbytes), it returns before `region_owned` is set and never "
             "frees the region; the PackedBatch is already marked consumed, so a corrupt descriptor "
             "from a worker leaks its region for good (owned by the main process: reclaim_dead "
             "cannot free it). The skeleton-mismatch path frees it.")


class CorruptingCollate(mtc_loader.PackedCollate):
    """Packs, then damages the layout it sends (a buggy or hostile worker)."""

    def __call__(self, samples):
        pb = super().__call__(samples)
        pb._layout = pb._layout[:-8]
        return pb


def test_rejected_descriptor_from_a_worker_frees_its_region():
    pc = CorruptingCollate(list, arena_bytes=ARENA)
    dl = DataLoader(SeedSamples(n=8), batch_size=4, num_workers=1, collate_fn=pc)
    with pytest.raises(ValueError, match="malformed"):
        for _ in mtc_loader.PrefetchLoader(dl, "cpu", depth=1):
            pass
    s = settle(pc.arena)
    assert s["slots_in_use"] == 0, s


def test_rejected_descriptor_from_a_worker_is_an_error_not_a_crash():
    pc = CorruptingCollate(list, arena_bytes=ARENA)
    dl = DataLoader(SeedSamples(n=8), batch_size=4, num_workers=1, collate_fn=pc)
    with pytest.raises(ValueError, match="malformed"):
        for _ in mtc_loader.PrefetchLoader(dl, "cpu", depth=1):
            pass
    settle(pc.arena, want_zero=False)
    assert pc.arena._a.valid()
    # the arena still serves good batches
    good = mtc_loader.PackedCollate(list, arena=pc.arena)
    check_epoch(DataLoader(SeedSamples(n=8), batch_size=4, num_workers=1, collate_fn=good),
                reference(SeedSamples(n=8), batch_size=4), "cpu")


def test_a_held_batch_cannot_be_duplicated_in_its_process():
    pc = mtc_loader.PackedCollate(list, arena_bytes=1 << 20)
    pb = pc([seed_sample(0)])
    import pickle
    with pytest.raises(RuntimeError, match="consumed once"):
        pickle.loads(pickle.dumps(pb))
    assert_tree_bitwise(pb.unpack("cpu"), tree_kept([seed_sample(0)], "cpu"))
    assert pc.stats()["slots_in_use"] == 0


# --------------------------------------------------------------------------- launchers

def _rank(rank: int, collate, worker_ctx: str, device: str) -> None:
    """One rank of a launcher (torch.multiprocessing.spawn, as Lightning's ddp_spawn): its
    DataLoader workers pack into the launcher's arena, and the rank unpacks, through
    PackedBatch.to, PrefetchLoader, and with num_workers=0 (packing in the rank itself)."""
    ds = SeedSamples(12)
    refs = reference(ds, batch_size=3)
    for workers in (2, 0):
        kw = {"multiprocessing_context": worker_ctx} if workers else {}
        loader = DataLoader(ds, batch_size=3, num_workers=workers, collate_fn=collate, **kw)
        for k, b in enumerate(loader):
            out = b.to(device)
            sync(device)
            assert_tree_bitwise(out, tree_kept(refs[k], device), f"rank {rank} batch {k}")
        check_epoch(loader, refs, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("worker_ctx", ["fork", "spawn"])
def test_packed_collate_built_in_a_launcher(worker_ctx, device):
    """A PackedCollate built in a launching process and pickled into the processes it starts
    (ddp_spawn, a notebook launcher): every such process unpacks what its own workers pack.
    The ranks share the launcher's arena; each frees what it took."""
    collate = mtc_loader.PackedCollate(list, arena_bytes=ARENA)
    torch.multiprocessing.spawn(_rank, args=(collate, worker_ctx, device), nprocs=2)
    assert settle(collate.arena)["slots_in_use"] == 0


def _unpack_on_cpu(pc, data, keep: bool):
    """pc(data) unpacked on the CPU on this thread with keep_temporaries(keep): (handle, outputs)."""
    previous = mtc_loader._engine.keep_temporaries(keep)
    try:
        h = pc(data).start_copy("cpu")
        return h, h.get()
    finally:
        mtc_loader._engine.keep_temporaries(previous)


@pytest.fixture
def split_maker():
    """The outputs made with torch's split operators (the maker without torch's C shim), whose
    temporary views these tests follow; through the shim there are none."""
    prev = mtc_loader._engine._use_shim(False)
    yield
    mtc_loader._engine._use_shim(prev)


def test_unpack_hands_its_temporary_views_to_the_caller(split_maker):
    """Dropping a tensor releases the GIL, so on a thread that asks for it (the prefetch service:
    keep_temporaries) the views the unpack makes on the way to the outputs (typed chunk views,
    segment views) are not dropped inside it: the handle holds them until its owner takes them.
    Elsewhere they are dropped as they are used (nothing outlives the call)."""
    data = seed_batch(4, seed=7)
    pc = mtc_loader.PackedCollate(list)
    h = pc(data).start_copy("cpu")
    out = h.get()
    assert h._h.temporaries() == []  # the default: none kept
    h, out = _unpack_on_cpu(pc, data, True)
    temps = h._h.temporaries()
    assert temps and all(isinstance(t, (torch.Tensor, tuple, list)) for t in temps)
    assert h._h.temporaries() == [], "taken out once"
    del temps
    gc.collect()
    assert_tree_bitwise(out, data)


def _tensors_in(items) -> int:
    return sum(_tensors_in(x) if isinstance(x, (tuple, list)) else isinstance(x, torch.Tensor) for x in items)


@pytest.mark.parametrize("shim", [False, True], ids=["split", "shim"])
@pytest.mark.parametrize("keep", [True, False], ids=["kept", "dropped"])
def test_members_apart_leave_no_piece_per_gap_for_the_hand_out(keep, shim):
    """Members of one dtype and trailing shape whose lengths are not multiples of the alignment
    lie apart, with padding rows between them. Cutting their segment with one split makes a
    tensor of every gap too: on a thread that keeps its temporaries for the caller (the prefetch
    service, whose hand-out drops them on the training thread, a release of the GIL each) they
    are sliced out member by member instead, and the temporaries stay a few per segment however
    many members and gaps; elsewhere one split cuts them (faster) and its pieces are dropped in
    the call. Either way the outputs are the tensors' values with the strides and storage
    offsets that .to() and the reference's alignment give."""
    # 1-D lengths 1..3 (not multiples of the 16-byte alignment for int64 / float32 / bool) and
    # (n, 3) float32 rows: almost every member is followed by a gap
    data = [[(torch.arange(1 + k % 3) % 2).to(dt) for k in range(40)] for dt in (torch.int64, torch.float32, torch.bool)]
    data.append([torch.randn(1 + k % 3, 3) for k in range(40)])
    pc = mtc_loader.PackedCollate(list, min_packed_alignment_bytes=16)
    if shim and not mtc_loader._engine._shim_info()[0]:
        pytest.skip("this torch has no AOTInductor C shim")
    prev = mtc_loader._engine._use_shim(shim)
    try:
        h, out = _unpack_on_cpu(pc, data, keep)
    finally:
        mtc_loader._engine._use_shim(prev)
    temps = h._h.temporaries()
    assert_tree_bitwise(out, data)
    leaves = [t for group in out for t in group]
    assert len(leaves) == 160
    if shim:
        # torch's C shim makes every member in place, with no temporary tensor
        assert temps == []
    elif keep:
        # a few views per segment and dtype, and the view each output was made from (an output
        # is a tensor of its own, not an autograd view), never one per gap
        assert 0 < _tensors_in(temps) <= 12 + len(leaves), _tensors_in(temps)
    else:
        assert temps == []
    for t, ref in zip(leaves, [t for group in data for t in group]):
        assert t.stride() == ref.stride() and t.is_contiguous()
        assert (t.storage_offset() * t.element_size()) % 16 == 0
    # what the segment views were cut from: one storage per dtype, the members at distinct offsets
    storages: dict[int, set] = {}
    for t in leaves:
        storages.setdefault(t.untyped_storage().data_ptr(), set()).add(t.storage_offset() * t.element_size())
    assert len(storages) == 3 and sum(len(offsets) for offsets in storages.values()) == 160
