"""The room a shared arena needs: what a PrefetchLoader over a DataLoader keeps in flight, the
check of each process's first packed batch against the least the DataLoader needs to go on (an
arena too small fails at once, with the number of bytes to configure, instead of stalling until
the worker's timeout), and the messages of a full arena (who holds the room, and which size)."""
from __future__ import annotations

import functools
import re
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import mtc_loader
from mtc_loader import PackedCollate, PrefetchLoader
from mtc_loader._flight import _arena_of, in_flight
from mtc_loader._arena import _attach, expect

SLOT = 64 << 10


class Rows(Dataset):
    """Sample i: a dict of one float32 tensor of ``floats`` values, all equal to i."""

    def __init__(self, n: int = 24, floats: int = 10):
        self.n, self.floats = n, floats

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"x": torch.full((self.floats,), float(i))}


@pytest.fixture
def fast_worker_shutdown(monkeypatch):
    """torch's DataLoader waits MP_STATUS_CHECK_INTERVAL (5 s) per worker to shut the others down
    after one raised; shorter here (fork workers inherit the patched value)."""
    from torch.utils.data import _utils
    monkeypatch.setattr(_utils, "MP_STATUS_CHECK_INTERVAL", 0.2)
    monkeypatch.setattr(_utils.worker, "MP_STATUS_CHECK_INTERVAL", 0.2)


def bytes_to_configure(message: str) -> int:
    m = re.search(r"PackedCollate\(arena_bytes=\.\.\.\) of at least (\d+) bytes", message)
    assert m, message
    return int(m.group(1))


def run_epoch(pc: PackedCollate, workers: int = 2, batch_size: int = 4, n: int = 24, floats: int = 10,
              **loader_kw) -> int:
    """One epoch of PrefetchLoader(DataLoader(Rows)) to the CPU, each batch checked; its batches."""
    dl = DataLoader(Rows(n, floats), batch_size=batch_size, num_workers=workers, collate_fn=pc, **loader_kw)
    k = -1
    for k, b in enumerate(PrefetchLoader(dl, "cpu")):
        first = k * batch_size
        want = torch.arange(first, first + batch_size, dtype=torch.float32)[:, None].expand(-1, floats)
        assert torch.equal(b["x"], want), k
    return k + 1


def test_in_flight_counts_the_loaders_batches():
    # the DataLoader's workers x prefetch_factor, 1 being copied; + depth on a CUDA device
    assert in_flight(2, 2, 2, cuda=False)[0::2] == (5, 3)
    assert in_flight(2, 2, 2, cuda=True)[0::2] == (7, 3)
    assert in_flight(4, 3, 1, cuda=True)[0::2] == (4 * 3 + 1 + 1, 3 * 3 + 1)
    # one worker packs in order, without workers one batch at a time, out of order nothing waits
    assert in_flight(1, 4, 2, cuda=False)[0::2] == (5, 1)
    assert in_flight(0, None, 2, cuda=False)[0::2] == (1, 1)
    assert in_flight(0, None, 3, cuda=True)[0::2] == (4, 1)
    assert in_flight(3, 2, 2, cuda=False, in_order=False)[0::2] == (7, 1)
    batches, why, least, least_why = in_flight(3, 2, 2, cuda=True)
    assert why == ("3 workers x prefetch_factor 2 in the DataLoader, 1 the PrefetchLoader copies, 2 ready "
                   "(the PrefetchLoader depth), whose copies to the GPU may still read the arena")
    assert "up to 2 packed ahead of it by each of the 2 other workers" in least_why


def test_the_arena_of_a_collate_function():
    pc = PackedCollate(list, arena_bytes=SLOT)
    assert _arena_of(pc) is pc.arena
    assert _arena_of(functools.partial(functools.partial(pc))) is pc.arena  # as mmengine builds it
    assert _arena_of(list) is None


def test_too_small_arena_fails_at_once_with_the_bytes_to_configure(fast_worker_shutdown):
    """1024 bytes are one 64 KiB slot; 2 workers x prefetch_factor 2 need room for 3 batches to go
    on: the first batch packed fails (not after the 60 s timeout), and the number it gives works."""
    pc = PackedCollate(arena_bytes=1024)
    assert pc.stats()["bytes"] == SLOT  # rounded up to a whole slot
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"holds 1 packed batch of this one's 160 bytes, and the DataLoader "
                                           r"needs room for 3 at once") as ei:
        run_epoch(pc)
    assert time.monotonic() - t0 < 20
    message = str(ei.value)
    assert "5 batches in flight (2 workers x prefetch_factor 2 in the DataLoader, 1 the PrefetchLoader copies)" \
        in message
    assert bytes_to_configure(message) == 5 * SLOT
    del ei
    assert run_epoch(PackedCollate(arena_bytes=bytes_to_configure(message), timeout=30.0)) == 6


def test_the_check_counts_whole_slots_per_batch(fast_worker_shutdown):
    """A batch of 4 x 5000 floats (80 KB) takes 2 slots: 5 slots hold 2 such batches, fewer than 3."""
    pc = PackedCollate(arena_bytes=5 * SLOT)
    with pytest.raises(RuntimeError, match=r"holds 2 packed batches of this one's 80000 bytes") as ei:
        run_epoch(pc, floats=5000)
    assert bytes_to_configure(str(ei.value)) == 5 * 2 * SLOT
    del ei
    assert run_epoch(PackedCollate(arena_bytes=6 * SLOT, timeout=30.0), floats=5000) == 6


def test_an_arena_that_lets_the_loader_go_on_is_not_refused():
    """Room for 3 of the 5 batches in flight: the workers wait for room at times (backpressure),
    and the epoch completes; so does one worker with a 2-batch arena and prefetch_factor 4."""
    pc = PackedCollate(arena_bytes=3 * SLOT, timeout=30.0)
    assert run_epoch(pc) == 6
    assert pc.stats()["timeouts"] == 0
    assert run_epoch(PackedCollate(arena_bytes=2 * SLOT, timeout=30.0), workers=1, prefetch_factor=4) == 6


def test_the_word_lasts_for_the_epoch():
    """The arena has the loader's word while its epoch runs, so that workers started for it check
    their first batch; a loop without a PrefetchLoader afterwards counts as it would without it."""
    pc = PackedCollate(list, arena_bytes=1 << 20)
    loader = PrefetchLoader(DataLoader(Rows(8), batch_size=4, num_workers=0, collate_fn=pc), "cpu", depth=3)
    for _ in loader:
        assert pc.arena._expected == in_flight(0, None, 3, cuda=False)
    assert pc.arena._expected is None
    epoch = iter(loader)
    next(epoch)
    epoch.close()  # a loop left early
    assert pc.arena._expected is None


def test_the_word_travels_with_the_pickled_arena():
    """Workers started by spawn or forkserver receive the arena pickled: the word goes with it."""
    pc = PackedCollate(list, arena_bytes=SLOT)
    word = in_flight(2, 2, 2, cuda=False)
    expect(pc.arena, word)
    rebuild, args = pc.arena.__reduce__()
    assert rebuild is _attach and args[2] == word
    # what a process that does not hold the arena yet makes of it
    other = _attach(args[0], (0, 0, 0), args[2])
    assert other._expected == word and other._checked == 0 and other.stats()["bytes"] == SLOT


def test_full_arena_without_a_prefetch_loader_names_the_loop():
    """Batches kept by the loop: the error says that a loop keeping PackedBatch objects fills any
    arena, and that the size is not what is short."""
    pc = PackedCollate(list, arena_bytes=2 * SLOT, timeout=0.2)
    held = [pc([torch.zeros(10)]) for _ in range(2)]
    with pytest.raises(RuntimeError, match=r"stayed full too long") as ei:
        pc([torch.zeros(10)])
    message = str(ei.value)
    assert "A loop that keeps the PackedBatch objects it receives" in message
    assert "Its size is not what is short: PackedCollate(arena_bytes=...) of 65536 bytes holds the 1 batch " \
           "in flight (the one the loop unpacks)" in message
    del held


def test_full_arena_under_a_prefetch_loader_counts_its_batches_as_the_loaders():
    """Where a PrefetchLoader consumes the arena, the training process's regions are its loaders'
    (the DataLoader's batches ahead of the next, the ones being copied): the message does not blame
    the loop, and gives the size for the whole flight as a number."""
    pc = PackedCollate(list, arena_bytes=2 * SLOT, timeout=0.2)
    # (a DataLoader that hands batches out as they come needs room for 1: no check fires here)
    expect(pc.arena, in_flight(2, 2, 2, cuda=False, in_order=False))
    held = [pc([torch.zeros(10)]) for _ in range(2)]
    with pytest.raises(RuntimeError, match=r"stayed full too long") as ei:
        pc([torch.zeros(10)])
    message = str(ei.value)
    assert "all of them its loaders' own" in message and "A loop that keeps" not in message
    assert bytes_to_configure(message) == 5 * SLOT
    del held


def test_batch_larger_than_the_arena_gives_the_bytes():
    pc = PackedCollate(list, arena_bytes=SLOT)
    with pytest.raises(RuntimeError, match=r"is too small for a packed batch of \d+ bytes\. Make it larger: "
                                           r"PackedCollate\(arena_bytes=\.\.\.\) of at least 131072 bytes: 1 batch "
                                           r"in flight \(the one the loop unpacks\) x 131072 bytes"):
        pc([torch.zeros(10000), torch.zeros(10000)])


def test_the_first_pack_of_each_process_is_checked_once():
    """In the process that packs (num_workers=0, or a worker), the first batch after the word is
    checked; later ones wait for room as before."""
    pc = PackedCollate(list, arena_bytes=SLOT, timeout=0.2)
    expect(pc.arena, (5, "what", 3, "why"))
    with pytest.raises(RuntimeError, match=r"needs room for 3 at once to go on \(why\)"):
        pc([torch.zeros(10)])
    b = pc([torch.zeros(10)])  # checked already: packs (one slot is room enough for it)
    assert b.unpack("cpu")[0].shape == (10,)


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_too_small_arena_fails_at_once_in_a_plain_loop(fast_worker_shutdown, ctx):
    """Without a PrefetchLoader (``for b in loader: b.to(device)``), the workers check their first
    batch against what the DataLoader keeps in flight, as under a PrefetchLoader: no stall."""
    pc = PackedCollate(arena_bytes=1024)
    dl = DataLoader(Rows(24, 10), batch_size=4, num_workers=2, collate_fn=pc, multiprocessing_context=ctx)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"holds 1 packed batch of this one's 160 bytes, and the DataLoader "
                                           r"needs room for 3 at once") as ei:
        for b in dl:
            b.to("cpu")
    assert time.monotonic() - t0 < 20
    assert "5 batches in flight (2 workers x prefetch_factor 2 in the DataLoader, 1 the loop unpacks)" in str(ei.value)
    assert bytes_to_configure(str(ei.value)) == 5 * SLOT
    del ei


def test_the_plain_loops_arena_check_finds_the_dataloaders_worker_start():
    """The plain loop's fast arena check finds the point where torch's DataLoader starts its
    workers by that iterator's __init__: a torch that renames or restructures it would silently
    bring back the slow failure (a full arena's timeout), so this fails first."""
    import torch.utils.data.dataloader as dl
    from mtc_loader import _flight
    assert _flight._STARTING is dl._MultiProcessingDataLoaderIter
    code = _flight._STARTING.__init__.__code__
    assert "self" in code.co_varnames
    for attr in ("_collate_fn", "_num_workers", "_prefetch_factor"):
        assert attr in code.co_names, attr
