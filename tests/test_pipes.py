"""The DataLoader's pipes as the prefetch service reads and writes them (mtc_loader/prefetch/_pipes.py):
``_engine.pipe_take`` / ``pipe_put`` speak multiprocessing.connection's message format, never block
with the GIL held, and the queue stand-ins keep the queues' semantics (order, the semaphore's count,
the locks), so that a DataLoader behind a PrefetchLoader gives the same batches either way."""
from __future__ import annotations

import multiprocessing
import os
import threading
import time
from multiprocessing.connection import Connection

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import mtc_loader
from mtc_loader import _engine
from mtc_loader.prefetch import _pipes
from mtc_loader.prefetch._service import _dataloader_next

from conftest import run_child


def _pipe():
    r, w = os.pipe()
    return r, w, Connection(r, writable=False), Connection(w, readable=False)


def test_pipe_take_reads_what_a_connection_sends_and_nothing_when_empty():
    r, w, rc, wc = _pipe()
    try:
        assert _engine.pipe_take(r) is None  # nothing there: nothing read, at once
        for payload in (b"", b"x", b"y" * 5000, bytes(range(256)) * 300):  # small, > PIPE_BUF, > 64 KiB
            t = threading.Thread(target=wc.send_bytes, args=(payload,))  # a big one needs a reader
            t.start()
            got = None
            while got is None:
                got = _engine.pipe_take(r)
            t.join()
            assert got == payload
        assert _engine.pipe_take(r) is None
    finally:
        rc.close()
        wc.close()


def test_pipe_put_writes_what_a_connection_receives():
    r, w, rc, wc = _pipe()
    try:
        for payload in (b"", b"(3, [1, 2])", memoryview(b"z" * 4000)):
            assert _engine.pipe_put(w, payload) is True
            assert rc.recv_bytes() == bytes(payload)
        assert _engine.pipe_put(w, b"q" * 4093) is False  # header + payload over PIPE_BUF: not written
        assert not rc.poll(0)
    finally:
        rc.close()
        wc.close()


def test_pipe_put_refuses_a_pipe_half_full_and_a_pipe_without_reader():
    r, w, rc, wc = _pipe()
    try:
        cap = __import__("fcntl").fcntl(w, 1032)  # F_GETPIPE_SZ
        filler = b"f" * (cap // 2)
        os.write(w, filler)
        assert _engine.pipe_put(w, b"small") is False  # it might have to wait: nothing written
        assert len(os.read(r, cap)) == len(filler)  # only the filler was there
        assert _engine.pipe_put(w, b"small") is True
    finally:
        rc.close()
    try:
        assert _engine.pipe_put(w, b"to nobody") is False  # EPIPE: the usual way reports it
    finally:
        wc.close()


def test_pipe_take_waits_without_the_gil_for_the_rest_of_a_message():
    """A header there and the payload still coming: the rest is waited for with the GIL released
    (another Python thread runs meanwhile), and the whole message comes back."""
    r, w, rc, wc = _pipe()
    payload = b"p" * 20000
    ticks = []

    def writer():
        os.write(w, len(payload).to_bytes(4, "big"))
        time.sleep(0.2)
        os.write(w, payload)

    def ticker():
        end = time.monotonic() + 0.15
        while time.monotonic() < end:
            ticks.append(1)
            time.sleep(0.005)

    try:
        t = threading.Thread(target=writer)
        t.start()
        while not rc.poll(0):  # the header is there
            time.sleep(0.001)
        waited = _engine.stats()["pipe_reads_waited"]
        tick = threading.Thread(target=ticker)
        tick.start()
        assert _engine.pipe_take(r) == payload
        tick.join()
        t.join()
        assert len(ticks) >= 10  # the ticker ran while pipe_take waited
        assert _engine.stats()["pipe_reads_waited"] == waited + 1
    finally:
        rc.close()
        wc.close()


def test_pipe_take_raises_eoferror_when_the_writers_are_gone():
    r, w, rc, wc = _pipe()
    os.write(w, (10).to_bytes(4, "big") + b"abc")  # a header and part of its payload
    wc.close()
    try:
        with pytest.raises(OSError, match="end of file during message"):
            _engine.pipe_take(r)
    finally:
        rc.close()


def _echo(inq, outq, n):
    for _ in range(n):
        outq.put(inq.get())


def test_queue_standins_keep_order_and_the_semaphores_count():
    """Puts through the index stand-in and gets through the result stand-in, mixed with the queues'
    own calls, across a child process: every object arrives once, in order, and each queue's
    semaphore ends where it began (a put counts it down, a get back up)."""
    ctx = multiprocessing.get_context("fork")
    inq, outq = ctx.Queue(), ctx.Queue()
    n = 200
    p = ctx.Process(target=_echo, args=(inq, outq, n))
    p.start()
    try:
        inq.put((0, [0]))  # the queue's own put starts its feeder, as the DataLoader's first puts do
        time.sleep(0.05)
        puts, gets = _pipes._Indices(inq), _pipes._Results(outq)
        before = _engine.stats()
        for i in range(1, n):
            (puts.put if i % 3 else inq.put)((i, [i, i + 1]))
        got = [(gets.get if i % 2 else outq.get)(timeout=10) for i in range(n)]
        after = _engine.stats()
        assert got == [(i, [i]) if i == 0 else (i, [i, i + 1]) for i in range(n)]
        assert after["pipe_writes_quiet"] > before["pipe_writes_quiet"]
        assert after["pipe_reads_quiet"] + after["pipe_reads_waited"] > (before["pipe_reads_quiet"]
                                                                          + before["pipe_reads_waited"])
        p.join(10)
        assert p.exitcode == 0
        for q in (inq, outq):
            assert q._sem._semlock._get_value() == q._maxsize  # every put's count given back by a get
    finally:
        if p.is_alive():
            p.kill()
        for q in (inq, outq):
            q.cancel_join_thread()
            q.close()


def test_index_standin_leaves_anything_but_a_task_to_the_queue():
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    try:
        q.put((0, [0]))
        time.sleep(0.05)
        before = _engine.stats()["pipe_writes_quiet"]
        _pipes._Indices(q).put(None)  # the DataLoader's end of a worker: the feeder sends it
        _pipes._Indices(q).put("resume")
        assert _engine.stats()["pipe_writes_quiet"] == before
        assert [q.get(timeout=5) for _ in range(3)] == [(0, [0]), None, "resume"]
    finally:
        q.cancel_join_thread()
        q.close()


class _Numbers(Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"x": torch.full((i % 7 + 1,), i, dtype=torch.int64), "i": torch.tensor(i)}


def _loader(**kw):
    return DataLoader(_Numbers(96), batch_size=4, num_workers=2, collate_fn=mtc_loader.PackedCollate(list),
                      **kw)


def _flat(batches):
    return [(int(s["i"]), s["x"].tolist()) for b in batches for s in b]


@pytest.mark.parametrize("kw", [{}, {"persistent_workers": True}, {"in_order": False}, {"timeout": 30}])
def test_prefetch_over_a_dataloader_gives_the_same_batches_through_the_standins(kw):
    if "in_order" in kw and "in_order" not in DataLoader.__init__.__code__.co_varnames:
        pytest.skip("this torch's DataLoader has no in_order")
    before = _engine.stats()
    loader = _loader(**kw)
    for epoch in range(2):
        got = _flat(mtc_loader.PrefetchLoader(loader, "cpu"))
        want = [(i, [i] * (i % 7 + 1)) for i in range(96)]
        assert (sorted(got) if "in_order" in kw else got) == want, epoch
    after = _engine.stats()
    assert after["pipe_writes_quiet"] > before["pipe_writes_quiet"]
    assert after["pipe_reads_quiet"] + after["pipe_reads_waited"] > (before["pipe_reads_quiet"]
                                                                      + before["pipe_reads_waited"])


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        return iter([torch.tensor([i]) for i in range(info.id, 40, info.num_workers)])


def test_an_iterable_dataset_goes_through_the_standins_too():
    """An iterable-style dataset (its batches through the DataLoader's own ``__next__``): the
    workers' ends and every batch arrive as without the stand-ins, and the pipes are read quietly."""
    before = _engine.stats()
    loader = DataLoader(_Stream(), batch_size=2, num_workers=2, collate_fn=mtc_loader.PackedCollate())
    got = sorted(int(x) for b in mtc_loader.PrefetchLoader(loader, "cpu") for x in b)
    assert got == list(range(40))
    after = _engine.stats()
    assert after["pipe_reads_quiet"] + after["pipe_reads_waited"] > (before["pipe_reads_quiet"]
                                                                      + before["pipe_reads_waited"])


def test_the_iterator_keeps_its_own_queues_between_and_after_calls():
    """The stand-ins are the iterator's queues only inside the service's call, and it gets its own
    back when that call raises."""
    loader = _loader(persistent_workers=True)
    it = iter(loader)
    data, indices = it._data_queue, it._index_queues
    assert _pipes.standins(it) is not None
    next(it)  # the DataLoader's own first __next__
    for _ in range(5):
        _dataloader_next(it)
        assert it._data_queue is data and it._index_queues is indices
    seen = []

    def broken():
        seen.append((type(it._data_queue).__name__, [type(q).__name__ for q in it._index_queues]))
        raise RuntimeError("broken on purpose")

    it._next_data = broken
    try:
        with pytest.raises(RuntimeError, match="broken on purpose"):
            _dataloader_next(it)
    finally:
        del it._next_data  # (the function refers to the iterator)
    assert seen == [("_Results", ["_Indices", "_Indices"])]
    assert it._data_queue is data and it._index_queues is indices
    del it


def test_no_standins_where_a_pin_memory_thread_reads_the_results_or_no_workers():
    """With pin_memory=True the DataLoader's results come through a thread of its own and a
    ``queue.Queue``: that path is the DataLoader's, untouched (as without workers)."""
    import queue
    it = iter(_loader(persistent_workers=True))
    try:
        real = it._data_queue
        it._data_queue = queue.Queue()  # what a pin-memory thread fills
        assert _pipes.standins(it) is None
        it._data_queue = real
        assert _pipes.standins(it) is not None
    finally:
        del it
    assert _pipes.standins(iter(DataLoader(_Numbers(8), batch_size=4))) is None


_OFF_CHILD = """
import json, torch
from torch.utils.data import DataLoader
import mtc_loader
from mtc_loader import _engine
loader = DataLoader(list(range(64)), batch_size=4, num_workers=2, collate_fn=mtc_loader.PackedCollate())
got = [int(t) for b in mtc_loader.PrefetchLoader(loader, "cpu") for t in b]
s = _engine.stats()
print(json.dumps({"ok": got == list(range(64)), "quiet": s["pipe_reads_quiet"] + s["pipe_reads_waited"]
                  + s["pipe_writes_quiet"]}))
"""


def test_quiet_pipes_off_takes_the_queues_own_way():
    out = run_child(_OFF_CHILD, MTC_QUIET_PIPES="0")
    assert out == {"ok": True, "quiet": 0}
