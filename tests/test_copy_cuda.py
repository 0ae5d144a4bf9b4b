"""CUDA paths of start_copy: every direction and option, against tensor.to() bitwise.

Skipped without a GPU; run them on a machine with a GPU whenever csrc/ or a CUDA path changes.
"""
from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest
import torch

import mtc_loader
from mtc_loader import start_copy
from conftest import (N_GPUS, assert_bitwise, assert_tree_bitwise, random_tensor, requires_2gpus,
                      requires_cuda, seed_batch, tree_to)

pytestmark = [pytest.mark.cuda, requires_cuda]

OPTIONS = [dict(use_pinned_staging=s, pack_cpu_tensors=p, use_background_thread=b)
           for s, p, b in itertools.product([True, False], repeat=3)]
ALL_DTYPES = [d for d in mtc_loader._setup.DTYPES]


@pytest.mark.parametrize("opts", OPTIONS, ids=str)
def test_seed_batch_h2d(opts):
    batch = seed_batch(16, seed=1)
    out = start_copy(batch, "cuda:0", **opts).get()
    torch.cuda.synchronize()
    assert_tree_bitwise(out, tree_to(batch, "cuda:0"))


@pytest.mark.parametrize("opts", OPTIONS, ids=str)
def test_seed_batch_d2h(opts):
    batch = seed_batch(16, seed=2, device="cuda:0")
    out = start_copy(batch, "cpu", **opts).get()
    assert_tree_bitwise(out, tree_to(batch, "cpu"))
    if opts["use_pinned_staging"]:
        assert all(t.is_pinned() for t in _leaves(out))


def _leaves(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _leaves(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _leaves(v)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_both_directions(dtype):
    try:
        torch.zeros(16, dtype=torch.uint8).view(dtype).to("cuda:0")
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch itself cannot .to('cuda') {dtype}, the reference: {e}")
    g = torch.Generator().manual_seed(3)
    shapes = [(), (0,), (1,), (7,), (5, 3), (2, 3, 4), (0, 5), (300000 // max(1, dtype.itemsize),)]
    data = [random_tensor(dtype, s, g) for s in shapes]
    data.append(random_tensor(dtype, (6, 8), g)[:, ::2])  # non-contiguous
    data.append(random_tensor(dtype, (6, 8), g).t())
    out = start_copy(data, "cuda:0").get()
    torch.cuda.synchronize()
    for i, (o, r) in enumerate(zip(out, data)):
        assert_bitwise(o, r.to("cuda:0"), f"h2d data[{i}] {dtype}")
    back = start_copy(out, "cpu").get()
    for i, (o, r) in enumerate(zip(back, data)):
        assert_bitwise(o, r, f"d2h data[{i}] {dtype}")


@pytest.mark.parametrize("align", [1, 2, 6, 16, 24, 64, 100, 256, 4096])
def test_alignment_of_every_output(align):
    """The reference's rule: each packed tensor starts at a multiple of
    round_up(max(min_packed_alignment_bytes, element_size), element_size) (8 for 6 and float32,
    16 for 6 and complex128, 6 for 6 and uint8) from its storage's start, dtypes of every element
    size; its address is a multiple of the rule's largest power of two, up to the 512 bytes torch's
    caching allocator aligns blocks to (tests/test_alignment.py checks every direction)."""
    g = torch.Generator().manual_seed(4)
    data = [random_tensor(dt, (n,), g) for n in range(1, 40)
            for dt in (torch.uint8, torch.float16, torch.float32, torch.float64, torch.complex128)]
    out = start_copy(data, "cuda:0", min_packed_alignment_bytes=align).get()
    torch.cuda.synchronize()
    assert mtc_loader.stats()["tensors_packed"] > 0
    for o, r in zip(out, data):
        e = r.element_size()
        eff = -(-max(align, e) // e) * e
        off = o.data_ptr() - o.untyped_storage().data_ptr()
        assert off % eff == 0, (align, r.dtype, off % eff)
        pow2 = min(eff & -eff, 512)
        assert o.data_ptr() % pow2 == 0, (align, r.dtype, o.data_ptr() % pow2)
        assert_bitwise(o, r.to("cuda:0"))


@pytest.mark.parametrize("max_chunk", [1, 64, 1000, 4096, 65536, 1 << 20])
def test_chunking(max_chunk):
    batch = seed_batch(8, seed=5)
    before = mtc_loader.stats()["chunks"]
    out = start_copy(batch, "cuda:0", max_packed_chunk_bytes=max_chunk).get()
    torch.cuda.synchronize()
    assert_tree_bitwise(out, tree_to(batch, "cuda:0"))
    if max_chunk == 4096:
        assert mtc_loader.stats()["chunks"] - before > 1


def test_large_tensors_staged_in_pieces():
    g = torch.Generator().manual_seed(6)
    data = [random_tensor(torch.float32, (5_000_001,), g), random_tensor(torch.uint8, (33 << 20,), g),
            random_tensor(torch.float64, (1000, 1000), g)[:, :999]]
    for staging in (True, False):
        out = start_copy(data, "cuda:0", use_pinned_staging=staging).get()
        torch.cuda.synchronize()
        for o, r in zip(out, data):
            assert_bitwise(o, r.to("cuda:0"))
    assert mtc_loader.stats()["pieces"] > 0


_WINDOWS = {"MTC_H2D_RING": "0"}


# (the ring's slabs, the pinned cap): a small cap shrinks the pieces until two fit in a quarter of
# it (512 KiB: 64 KiB pieces), and bounds the slabs or the window's pieces in flight
@pytest.mark.parametrize("knobs", [
    ({}, None),
    ({"MTC_H2D_RING": "2"}, None),
    ({"MTC_H2D_RING": "3"}, 512 << 10),
    ({"MTC_H2D_RING": "64"}, None),
    (_WINDOWS, None),
    (_WINDOWS, 8 << 20),
    (_WINDOWS, 2 << 20),
], ids=lambda k: ",".join([f"{n[4:]}={v}" for n, v in k[0].items()] + ([f"cap={k[1]}"] if k[1] else []))
    or "defaults")
def test_large_tensors_split_across_helpers(knobs, monkeypatch):
    """Large leaves staged piece by piece, each piece split into tasks over the helpers, through
    the ring of slabs reused in turn (down to two slabs, and 64 KiB pieces that reuse each slab
    dozens of times) or the windowed pipeline: sources at odd addresses (views at byte offsets 1
    and 13), sizes that are no multiple of a task, a piece or 16 bytes, and windows of two pieces
    arrive exactly, three times in a row."""
    env, cap = knobs
    for name, value in env.items():  # read by the engine at every large copy
        monkeypatch.setenv(name, value)
    cap_before = mtc_loader.stats()["pinned_cap_bytes"]
    if cap is not None:
        mtc_loader.configure(pinned_cap_bytes=cap)
    g = torch.Generator().manual_seed(62)
    raw = random_tensor(torch.uint8, ((19 << 20) + 77,), g)
    data = [raw[1:], raw[13:(9 << 20) + 5], random_tensor(torch.float32, (2_500_003,), g),
            random_tensor(torch.int16, (4 << 20,), g)]
    before = mtc_loader.stats()["pieces"]
    try:
        for _ in range(3):
            out = start_copy(data, "cuda:0").get()
            torch.cuda.synchronize()
            for o, r in zip(out, data):
                assert_bitwise(o, r.to("cuda:0"))
    finally:
        mtc_loader.configure(pinned_cap_bytes=cap_before)
    assert mtc_loader.stats()["pieces"] - before >= 12


_HUGE_SLABS = r'''
import os, sys, torch, mtc_loader
sys.path.insert(0, {tests!r})
from conftest import assert_bitwise, random_tensor
g = torch.Generator().manual_seed(71)
raw = random_tensor(torch.uint8, ((19 << 20) + 77,), g)
data = [raw[13:], random_tensor(torch.float32, (2_500_003,), g)] + [random_tensor(torch.int64, (1000,), g)] * 3
for round in range(3):
    out = mtc_loader.start_copy(data, "cuda:0").get()
    torch.cuda.synchronize()
    for o, r in zip(out, data):
        assert_bitwise(o, r.to("cuda:0"))
    if round == 0:  # a forked child (a DataLoader worker) does not map the slabs
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        data[0][:] = 7  # the parent writes its memory after the fork: no copy-on-write moves a slab
assert mtc_loader.stats()["pieces"] > 0
huge = [l for l in open("/proc/self/smaps_rollup") if l.startswith("AnonHugePages")]
print("ok", huge)
'''


def test_huge_page_slabs(tmp_path):
    """MTC_SLAB_HUGEPAGES=1: slabs mapped with MADV_HUGEPAGE and page-locked in place carry large
    leaves (in pieces over the helpers) and small packed ones exactly, before and after a fork."""
    import os
    import subprocess
    import sys
    script = tmp_path / "huge.py"
    script.write_text(_HUGE_SLABS.format(tests=os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, MTC_SLAB_HUGEPAGES="1")
    r = subprocess.run([sys.executable, "-W", "ignore", str(script)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("stream", ["current", "side"])
def test_large_packed_chunk(stream):
    """A packed chunk of many medium tensors (256 x ~64 KB: 16 MB, staged by the helpers in
    parallel) with odd sizes (so padding between them), mixed dtypes and a strided leaf arrives
    exactly, in one chunk, on the captured stream."""
    g = torch.Generator().manual_seed(61)
    dtypes = [torch.float32, torch.uint8, torch.int64, torch.float16, torch.bool, torch.complex64]
    data = [random_tensor(dtypes[i % len(dtypes)], ((61_000 + 37 * i) // 8,), g) for i in range(256)]
    data.insert(100, random_tensor(torch.float32, (200, 128), g)[:, ::2])  # strided, packed after staging
    before = mtc_loader.stats()
    s = torch.cuda.Stream() if stream == "side" else torch.cuda.current_stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(20_000_000)  # the copies must come after this on s
        out = start_copy(data, "cuda:0").get()
    s.synchronize()
    after = mtc_loader.stats()
    for o, r in zip(out, data):
        assert_bitwise(o, r.to("cuda:0"))
    assert after["chunks"] - before["chunks"] == 1


def test_inputs_already_on_target_are_reused():
    x = torch.arange(10, device="cuda:0")
    y = torch.ones(3)
    out = start_copy({"x": x, "y": y, "s": "keep"}, "cuda:0").get()
    assert out["x"] is x and out["s"] == "keep"
    assert_bitwise(out["y"], y.cuda())


def test_numpy_to_cuda():
    arrs = [np.arange(12, dtype=np.int32).reshape(3, 4), np.arange(5.0)[::-1], np.zeros((0, 3))]
    out = start_copy(arrs, "cuda:0").get()
    torch.cuda.synchronize()
    for o, a in zip(out, arrs):
        assert_bitwise(o, torch.from_numpy(np.ascontiguousarray(a)).cuda())


def test_mixed_inputs():
    cpu = seed_batch(2, seed=7)
    gpu = seed_batch(2, seed=8, device="cuda:0")
    data = {"cpu": cpu, "gpu": gpu, "np": np.arange(4)}
    out = start_copy(data, "cuda:0").get()
    torch.cuda.synchronize()
    assert_tree_bitwise(out, tree_to(data, "cuda:0"))
    out = start_copy(data, "cpu").get()
    assert_tree_bitwise(out["cpu"], cpu)
    assert_tree_bitwise(out["gpu"], tree_to(gpu, "cpu"))


def test_non_default_stream_is_used_and_get_does_not_wait_for_gpu():
    batch = seed_batch(16, seed=9)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(int(2e9))  # ~1 s of GPU time queued before the copy
        ev = torch.cuda.Event()
        h = start_copy(batch, "cuda:0")
        out = h.get()
        ev.record(s)
        assert h.ready()
        # get() returned while the sleep still runs: it did not drain the stream
        assert not ev.query(), "get() waited for earlier work on the stream"
    torch.cuda.default_stream().synchronize()
    s.synchronize()
    assert_tree_bitwise(out, tree_to(batch, "cuda:0"))


def test_d2h_waits_for_producing_kernel_on_current_stream():
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x = torch.zeros(1 << 20, device="cuda:0")
        torch.cuda._sleep(int(2e8))
        x.add_(7)  # queued behind the sleep on s
        out = start_copy([x, x[:10]], "cpu").get()
    assert torch.all(out[0] == 7) and torch.all(out[1] == 7)


def test_many_threads():
    batches = [seed_batch(4, seed=100 + i) for i in range(8)]
    errors = []

    def work(i):
        try:
            for _ in range(20):
                out = start_copy(batches[i], "cuda:0").get()
                torch.cuda.current_stream().synchronize()
                assert_tree_bitwise(out, tree_to(batches[i], "cuda:0"))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_handle_dropped_without_get():
    for _ in range(20):
        h = start_copy(seed_batch(4, seed=11), "cuda:0")
        del h
    out = start_copy(seed_batch(4, seed=12), "cuda:0").get()
    torch.cuda.synchronize()
    assert_tree_bitwise(out, tree_to(seed_batch(4, seed=12), "cuda:0"))
    s = mtc_loader.stats()
    assert s["jobs_in_flight"] == 0
    assert s["pinned_slabs_in_use"] == 0


def test_invalid_device_index():
    with pytest.raises(ValueError, match="cuda:99"):
        start_copy([torch.ones(1)], "cuda:99")


def test_out_of_memory_is_clear_and_engine_survives():
    free, _ = torch.cuda.mem_get_info()
    hold = torch.empty(free - (256 << 20), dtype=torch.uint8, device="cuda:0")
    big = torch.ones(1 << 28, dtype=torch.float32)  # 1 GiB: its output cannot be allocated
    try:
        with pytest.raises((MemoryError, torch.OutOfMemoryError, RuntimeError), match="(?i)memory"):
            start_copy([big, torch.ones(3)], "cuda:0").get()
    finally:
        del hold
        torch.cuda.empty_cache()
    out = start_copy(seed_batch(2, seed=13), "cuda:0").get()
    torch.cuda.synchronize()
    assert_tree_bitwise(out, tree_to(seed_batch(2, seed=13), "cuda:0"))
    s = mtc_loader.stats()
    assert s["pinned_slabs_in_use"] == 0


@requires_2gpus
def test_gpu_to_other_gpu():
    batch = seed_batch(4, seed=14, device="cuda:0")
    out = start_copy(batch, "cuda:1").get()
    torch.cuda.synchronize("cuda:1")
    assert_tree_bitwise(out, tree_to(batch, "cuda:1"))


def test_gpu_to_same_gpu_is_reuse():
    batch = seed_batch(2, seed=15, device="cuda:0")
    out = start_copy(batch, "cuda:0").get()
    assert out[0]["cams_gt"][0]["depths"] is batch[0]["cams_gt"][0]["depths"]


def test_pinned_memory_is_reused_not_grown():
    batch = seed_batch(16, seed=16)
    for _ in range(5):
        start_copy(batch, "cuda:0").get()
        torch.cuda.synchronize()
    held = mtc_loader.stats()["pinned_bytes_held"]
    for _ in range(50):
        start_copy(batch, "cuda:0").get()
        torch.cuda.synchronize()  # the slab's fence completed: it must be reused
    assert mtc_loader.stats()["pinned_bytes_held"] == held


def test_negated_and_conjugated_views_are_materialised():
    z = torch.tensor([1 - 3j, 2 + 5j])
    data = [torch.tensor(1 - 3j).conj().imag, z.conj().imag, z.conj(), z[:1].conj().imag]
    out = start_copy(data, "cuda:0").get()
    torch.cuda.synchronize()
    for i, (o, r) in enumerate(zip(out, data)):
        assert torch.equal(o.cpu(), r.resolve_conj().resolve_neg()), i


@pytest.mark.parametrize("on_side_stream", [False, True])
def test_d2h_uses_one_batched_copy_and_keeps_stream_order(on_side_stream):
    """Many small GPU tensors to the CPU: one batched driver call (on the legacy default
    stream through an internal stream ordered by events), after the producing kernels."""
    s = torch.cuda.Stream() if on_side_stream else torch.cuda.default_stream()
    with torch.cuda.stream(s):
        xs = [torch.zeros(n, device="cuda:0") for n in range(1, 200)]
        torch.cuda._sleep(int(2e8))
        for x in xs:
            x.add_(3)
        before = mtc_loader.stats()
        out = start_copy(xs, "cpu").get()
    after = mtc_loader.stats()
    assert all(torch.all(o == 3) for o in out)
    assert after["batch_memcpy_fallbacks"] == 0
    assert after["batch_memcpy_calls"] > before["batch_memcpy_calls"]


@requires_2gpus
def test_gpu_to_other_gpu_many_tensors_stream_order():
    """Many tensors from cuda:0 to cuda:1 in one batch, after the kernels producing them."""
    s = torch.cuda.Stream("cuda:0")
    with torch.cuda.stream(s):
        xs = [torch.zeros(n, device="cuda:0") for n in range(1, 300)]
        torch.cuda._sleep(int(2e8))
        for x in xs:
            x.add_(5)
        out = start_copy(xs, "cuda:1").get()
    torch.cuda.synchronize("cuda:1")
    assert all(o.device == torch.device("cuda:1") and torch.all(o == 5) for o in out)
    assert mtc_loader.stats()["batch_memcpy_fallbacks"] == 0
