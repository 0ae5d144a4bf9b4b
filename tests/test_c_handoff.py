"""A prefetched batch's finish and hand-out, each one C call (``Handle.finish``,
``_engine.hand_out``), or the Python way of several calls: ``MTC_C_HANDOFF`` (read once, at
import) picks, the hand-out takes the Python way by itself where libtorch_cuda's current-stream
getter is not in use, and ``mtc_loader.stats()`` counts both ways (``side_finish_c`` /
``side_finish_python``, ``hand_out_c`` / ``hand_out_python``; CUDA batches only). The packed
path's device chunk is allocated and its DMA issued in one GIL-free window
(``unpack_dma_in_alloc_window``)."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import mtc_loader
from conftest import assert_tree_bitwise, requires_cuda, run_child
from mtc_loader import _engine
from mtc_loader.prefetch import _side

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

WAYS = ("side_finish_c", "side_finish_python", "hand_out_c", "hand_out_python", "unpack_dma_in_alloc_window")


def _ways() -> dict:
    s = mtc_loader.stats()
    return {k: s[k] for k in WAYS}


def _batch(i: int = 0) -> dict:
    return {"a": torch.arange(6.0) + i, "b": {"c": torch.ones(2, 3, dtype=torch.int16) * i}}


def test_finish_on_the_cpu_is_get_with_its_temporaries_and_no_event():
    pc = mtc_loader.PackedCollate(list, arena_bytes=1 << 20)
    h = pc([_batch(3)])._start(-1, True)
    result, keep, buffers, event = h.finish(-1, 0)
    assert isinstance(keep, list) and buffers == [] and event == 0
    assert torch.equal(result[0]["a"], torch.arange(6.0) + 3) and result[0]["b"]["c"].dtype == torch.int16
    assert h.get() is result, "the handle's result stays"
    assert h.finish(-1, 0)[1] == [], "the temporaries were taken out"


@pytest.mark.parametrize("args, err, match", [
    ((-2, 0), ValueError, "device index in \\[0, 64\\), or -1 for the CPU, got -2"),
    ((64, 0), ValueError, "got 64"),
    ((0,), TypeError, "takes 2 arguments"),
    ((0, "s"), TypeError, "integer"),
])
def test_finish_refuses_bad_arguments(args, err, match):
    pc = mtc_loader.PackedCollate(list, arena_bytes=1 << 20)
    h = pc([_batch()])._start(-1, True)
    with pytest.raises(err, match=match):
        h.finish(*args)
    assert torch.equal(h.get()[0]["a"], torch.arange(6.0)), "nothing was taken"


def test_finish_without_a_driver_says_why():
    if torch.cuda.is_available():
        pytest.skip("a CUDA driver is present (covered by the CUDA tests below)")
    pc = mtc_loader.PackedCollate(list, arena_bytes=1 << 20)
    h = pc([_batch()])._start(-1, True)  # a finished CPU copy asked for a CUDA device's event
    with pytest.raises(RuntimeError, match="recording a batch's event on its copy stream 0 of cuda:0 failed: libcuda"):
        h.finish(0, 0)


@pytest.mark.parametrize("args, err, match", [
    ((-1, 8), ValueError, "device index in \\[0, 64\\).*got device -1"),
    ((64, 8), ValueError, "got device 64"),
    ((0, 0), ValueError, "a recorded event"),
    ((0,), TypeError, "takes 2 arguments"),
    ((0, "e"), TypeError, "integer"),
])
def test_hand_out_refuses_bad_arguments(args, err, match):
    with pytest.raises(err, match=match):
        _engine.hand_out(*args)


def test_hand_out_without_the_stream_getter_leaves_the_event_to_the_python_way():
    """No libtorch_cuda getter (a CPU torch, or MTC_TORCH_SHIM=0): None, nothing done, nothing
    counted; the caller then takes the Python way (counted there as hand_out_python)."""
    if _engine._c_handoff()[1]:
        pytest.skip("this torch offers the current-stream getter")
    before = _ways()
    assert _engine.hand_out(0, 8) is None  # never touches the (made-up) event
    assert _ways() == before


_SWITCH_CHILD = """
import json, warnings
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    import torch, mtc_loader
    from mtc_loader.prefetch import _side
pc = mtc_loader.PackedCollate(list, arena_bytes=1 << 20)
got = [b for b in mtc_loader.PrefetchLoader([pc([{"a": torch.arange(4.0) + i}]) for i in range(3)], "cpu")]
print(json.dumps({"on": _side._C_HANDOFF, "engine": mtc_loader._engine._c_handoff()[0],
                  "ok": all(torch.equal(g[0]["a"], torch.arange(4.0) + i) for i, g in enumerate(got)),
                  "warnings": [str(x.message) for x in w if "MTC_C_HANDOFF" in str(x.message)]}))
"""


@pytest.mark.parametrize("value, on", [(None, True), ("1", True), ("0", False), ("off", False)])
def test_the_switch_is_read_at_import(value, on):
    env = {} if value is None else {"MTC_C_HANDOFF": value}
    out = run_child(_SWITCH_CHILD, **env)
    assert out == {"on": on, "engine": on, "ok": True, "warnings": []}


def test_a_refused_switch_value_warns_and_keeps_the_default():
    out = run_child(_SWITCH_CHILD, MTC_C_HANDOFF="maybe")
    assert out["on"] is True and out["ok"]
    assert len(out["warnings"]) == 1 and "'maybe'" in out["warnings"][0]


class _FakeHandle:
    """Not an engine handle: the C way does not apply to it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def get(self):
        self.calls.append("get")
        return "result"

    def temporaries(self):
        self.calls.append("temporaries")
        return []


def test_the_python_way_for_what_is_not_an_engine_handle(monkeypatch):
    monkeypatch.setattr(_side, "_C_HANDOFF", True)
    h = _FakeHandle()
    side = _side.SideCopy(h, -1)
    assert side.get() == "result" and h.calls == ["get", "temporaries"]


def test_the_c_way_is_taken_for_an_engine_handle(monkeypatch):
    """With the switch on, _finish makes the one C call (and never get()); off, the Python way."""
    pc = mtc_loader.PackedCollate(list, arena_bytes=1 << 20)
    for on in (True, False):
        monkeypatch.setattr(_side, "_C_HANDOFF", on)
        h = pc([_batch(1)])._start(-1, True)
        seen = []

        class Spy:  # records which of the handle's methods _finish calls
            def __getattr__(self, name):
                seen.append(name)
                return getattr(h, name)

        side = _side.SideCopy(h, -1)
        side._handle = Spy()
        monkeypatch.setattr(_side, "_HANDLE", Spy)
        side._finish()
        assert seen == (["finish"] if on else ["get", "temporaries"]), (on, seen)
        assert torch.equal(side.get()[0]["a"], torch.arange(6.0) + 1)


# ---------------------------------------------------------------- CUDA

_CUDA_CHILD = """
import json, torch, mtc_loader
from torch.utils.data import DataLoader
import sys; sys.path.insert(0, {tests!r})
from conftest import assert_tree_bitwise, tree_kept
from test_loader import ARENA, SeedSamples, reference
ds = SeedSamples(n=24)
pc = mtc_loader.PackedCollate(list, arena_bytes=ARENA)
dl = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=pc)
refs = reference(ds, batch_size=4)
WAYS = {ways!r}
list(mtc_loader.PrefetchLoader(dl, "cuda"))  # the device's first chunk (torch.empty from Python)
torch.cuda.synchronize()
before = mtc_loader.stats()
n = 0
for k, b in enumerate(mtc_loader.PrefetchLoader(dl, "cuda", depth=2)):
    assert_tree_bitwise(b, tree_kept(refs[k], "cuda:0"), f"batch {{k}}")
    n += 1
torch.cuda.synchronize()
after = mtc_loader.stats()
print(json.dumps({{"n": n, **{{w: after[w] - before[w] for w in WAYS}}}}))
"""


def _cuda_child(**env):
    import os
    tests = os.path.dirname(os.path.abspath(__file__))
    return run_child(_CUDA_CHILD.format(tests=tests, ways=WAYS), **env)


@pytest.mark.cuda
@requires_cuda
def test_the_c_way_on_cuda_is_bitwise_and_counted():
    out = _cuda_child()
    n = out["n"]
    assert n == 6
    assert out["side_finish_c"] == n and out["side_finish_python"] == 0, out
    if _engine._c_handoff()[1]:
        assert out["hand_out_c"] == n and out["hand_out_python"] == 0, out
        assert out["unpack_dma_in_alloc_window"] == n, out
    else:
        assert out["hand_out_c"] == 0 and out["hand_out_python"] == n, out


@pytest.mark.cuda
@requires_cuda
def test_the_python_way_on_cuda_is_bitwise_and_counted():
    out = _cuda_child(MTC_C_HANDOFF="0")
    n = out["n"]
    assert n == 6 and out["side_finish_c"] == 0 and out["side_finish_python"] == n, out
    assert out["hand_out_c"] == 0 and out["hand_out_python"] == n, out


@pytest.mark.cuda
@requires_cuda
def test_the_hand_out_falls_back_by_itself_without_the_getter():
    """MTC_TORCH_SHIM=0: no current-stream getter, so the hand-out takes the Python way, counted;
    the finish stays the C call; no chunk from the shim, so no DMA in its window."""
    out = _cuda_child(MTC_TORCH_SHIM="0")
    n = out["n"]
    assert out["side_finish_c"] == n and out["hand_out_c"] == 0 and out["hand_out_python"] == n, out
    assert out["unpack_dma_in_alloc_window"] == 0, out


class _Same(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return [torch.full((1 << 18,), float(i)), torch.arange(1000, dtype=torch.int64) + i]


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("c_way", [True, False])
def test_the_consumer_waits_for_a_copy_stream_held_back(monkeypatch, c_way):
    """The copy stream is held back by ~250 ms of GPU work queued on it before each batch's DMA;
    a kernel queued on the consumer's stream right after the hand-out reads the batch: it must
    see the copied values, not what the fresh chunk held before (the consumer's stream waits for
    the batch's event, whichever way the hand-out went)."""
    monkeypatch.setattr(_side, "_C_HANDOFF", c_way)
    from test_prefetch_cuda import LONG_KERNEL_CYCLES
    pc = mtc_loader.PackedCollate(list, arena_bytes=64 << 20)
    dl = DataLoader(_Same(), batch_size=2, num_workers=0, collate_fn=pc)
    side = mtc_loader.copy_stream("cuda:0")
    consumer = torch.cuda.Stream()
    sums = []

    def hold_back(b):  # runs on the service thread before each batch's copy
        with torch.cuda.stream(side):
            torch.cuda._sleep(LONG_KERNEL_CYCLES // 4)
        return b

    class Held:
        def __iter__(self):
            for b in dl:
                yield hold_back(b)

    before = _ways()
    with torch.cuda.stream(consumer):
        for b in mtc_loader.PrefetchLoader(Held(), "cuda", depth=1):
            # two samples [x, y] a batch; read on `consumer` at once
            sums.append(torch.stack([(b[0][0].sum() + b[1][0].sum()).double(),
                                     (b[0][1].sum() + b[1][1].sum()).double()]))
            del b
    torch.cuda.synchronize()
    after = _ways()
    for k, s in enumerate(sums):
        i, j = 2 * k, 2 * k + 1
        want = [(i + j) * float(1 << 18), float(2 * sum(range(1000)) + 1000 * (i + j))]
        assert s.tolist() == want, (k, s.tolist(), want)
    n = len(sums)
    assert n == 8
    key = "side_finish_c" if c_way else "side_finish_python"
    assert after[key] - before[key] == n


_OOM_CHILD = """
import json, torch, mtc_loader
pc = mtc_loader.PackedCollate(list, arena_bytes=256 << 20)
big = lambda i: [{"x": torch.full((16 << 20,), i, dtype=torch.uint8)}]  # 16 MiB a batch
first = pc(big(1)).to("cuda")  # the device's first chunk, from Python
torch.cuda.synchronize()
torch.cuda.empty_cache()  # no cached block serves the next chunk
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_allocated() + (1 << 20)) / total)
before = mtc_loader.stats()
err = None
try:
    list(mtc_loader.PrefetchLoader([pc(big(2))], "cuda"))
except Exception as e:
    err = type(e).__name__ + ": " + str(e)[:200]
torch.cuda.synchronize()
mid = mtc_loader.stats()
in_use = pc.arena.stats()["bytes_in_use"]
torch.cuda.set_per_process_memory_fraction(1.0)
got = list(mtc_loader.PrefetchLoader([pc(big(3))], "cuda"))
ok = bool((got[0][0]["x"] == 3).all())
print(json.dumps({"err": err, "in_use": in_use, "ok": ok,
                  "window": mid["unpack_dma_in_alloc_window"] - before["unpack_dma_in_alloc_window"],
                  "python_chunks": mid["unpack_chunks_python"] - before["unpack_chunks_python"]}))
"""


@pytest.mark.cuda
@requires_cuda
def test_a_refused_allocation_raises_torchs_error_and_frees_the_region():
    """The caching allocator refuses the chunk (a memory fraction just above what is allocated):
    nothing is issued in the window, torch.empty raises torch's OutOfMemoryError through the
    loader, the batch's arena region is freed, and the next batch copies once memory is back."""
    out = run_child(_OOM_CHILD)
    assert out["err"] and out["err"].startswith("OutOfMemoryError"), out
    assert out["in_use"] == 0 and out["ok"] and out["window"] == 0, out
