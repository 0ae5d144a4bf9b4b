"""What default_collate stacks inside a PackedCollate goes to warm scratch memory (_stack.py).

Every batch is compared bitwise with the plain collate function's result; the scratch memory is
reused from one batch to the next, so a batch packed after its memory was reused would differ.
The datasets are module-level classes so that spawn workers can unpickle them.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, default_collate, get_worker_info
from torch.utils.data._utils.collate import default_collate_fn_map

import mtc_loader
from mtc_loader import _stack
from conftest import assert_tree_bitwise, requires_cuda

ARENA = 32 << 20
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


class Images(Dataset):
    """Camera images (stacked by default_collate), a depth map of another dtype, per-sample
    meta-data of varying length (kept per sample), a numpy array and a label whose dtype
    alternates (default_collate promotes: the original function must stack it)."""

    def __init__(self, n: int = 40, size: int = 32):
        self.n, self.size = n, size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        return {
            "img": torch.randint(0, 256, (6, 3, self.size, self.size), dtype=torch.uint8, generator=g),
            "depth": torch.rand(self.size, self.size, generator=g, dtype=torch.float64),
            "boxes": torch.rand(1 + i % 7, 4, generator=g),
            "arr": np.full(5, i, dtype=np.int16),
            "label": torch.tensor([i], dtype=torch.int32 if i % 2 else torch.float32),
        }


def collate_parts(samples):
    """A user's collate function: default_collate on the fixed-size parts, the rest per sample;
    it also reports whether the stacked images are in a shared-memory segment."""
    fixed = default_collate([{k: s[k] for k in ("img", "depth", "arr")} for s in samples])
    fixed["boxes"] = [s["boxes"] for s in samples]
    fixed["label"] = default_collate([s["label"] for s in samples])
    fixed["img_shared"] = torch.tensor(fixed["img"].is_shared())
    fixed["in_worker"] = torch.tensor(get_worker_info() is not None)
    return fixed


def without_flags(b):
    return {k: v for k, v in b.items() if k not in ("img_shared", "in_worker")}


@pytest.mark.parametrize("ctx,workers", [(None, 0), ("fork", 2), ("spawn", 1)])
def test_batches_bitwise_across_reuse(ctx, workers):
    ds = Images()
    pc = mtc_loader.PackedCollate(collate_parts, arena_bytes=ARENA)
    dl = DataLoader(ds, batch_size=4, num_workers=workers, collate_fn=pc, multiprocessing_context=ctx,
                    persistent_workers=workers > 0)
    refs = list(DataLoader(ds, batch_size=4, num_workers=0, collate_fn=collate_parts))
    for epoch in range(2):
        # keep every batch of the epoch: a region packed from reused memory would differ
        got = [b.to("cpu") for b in dl]
        assert len(got) == len(refs) == 10
        for k, (b, r) in enumerate(zip(got, refs)):
            assert_tree_bitwise(without_flags(b), without_flags(r), f"epoch {epoch} batch {k}")
            assert b["label"].dtype == torch.float32  # int32 and float32 promoted, as default_collate does
            assert not bool(b["img_shared"])  # stacked into the scratch, not a shared-memory segment
            assert bool(b["in_worker"]) == (workers > 0)


def test_default_collate_outside_packed_collate_is_unchanged():
    """In a plain worker, default_collate still stacks into shared memory (what crosses to the
    main process), and in the main process into ordinary memory."""
    ds = Images(n=8)
    for b in DataLoader(ds, batch_size=4, num_workers=1, collate_fn=collate_parts):
        assert bool(b["in_worker"]) and bool(b["img_shared"])
    b = collate_parts([ds[i] for i in range(4)])
    assert not bool(b["img_shared"])
    assert getattr(_stack._TLS, "active", None) is None


def test_hook_only_while_a_call_runs_and_delegates(monkeypatch):
    """torch's own function is in default_collate_fn_map except while a PackedCollate call runs
    (import changes nothing); a program's own entry is left alone, inside the call too."""
    from torch.utils.data._utils.collate import collate_tensor_fn
    assert default_collate_fn_map[torch.Tensor] is collate_tensor_fn
    seen = {}

    def spy(samples):
        seen["fn"] = default_collate_fn_map[torch.Tensor]
        return default_collate(samples)

    mtc_loader.PackedCollate(spy, arena_bytes=ARENA)([torch.ones(3), torch.ones(3)]).to("cpu")
    assert seen["fn"]._mtc_original is collate_tensor_fn
    assert default_collate_fn_map[torch.Tensor] is collate_tensor_fn

    def mine(batch, *, collate_fn_map=None):  # a program's own entry is left alone
        return torch.stack(batch).neg()

    monkeypatch.setitem(default_collate_fn_map, torch.Tensor, mine)
    out = mtc_loader.PackedCollate(arena_bytes=ARENA)([torch.ones(3), torch.ones(3)]).to("cpu")
    assert torch.equal(out, -torch.ones(2, 3))
    assert default_collate_fn_map[torch.Tensor] is mine
    x = [torch.ones(2, dtype=torch.int64), torch.zeros(2, dtype=torch.float32)]
    assert default_collate(x).dtype == torch.float32


@pytest.mark.filterwarnings("ignore:mtc_loader. a tensor that default_collate stacked:RuntimeWarning")
def test_unstackable_tensors_take_the_original_path():
    """Mixed shapes raise an error that names them and PackedCollate(list); tensors that require
    grad, subclasses, channels_last tensors and numpy inputs give what default_collate gives
    without the scratch."""
    pc = mtc_loader.PackedCollate(default_collate, arena_bytes=ARENA)
    with pytest.raises(RuntimeError, match=r"cannot stack the samples into one tensor: sample 0 has shape \[2\], "
                                           r"sample 1 \[3\]\. .*PackedCollate\(list\)"):
        pc([torch.ones(2), torch.ones(3)])
    assert getattr(_stack._TLS, "active", None) is None  # left on the error

    class Sub(torch.Tensor):
        pass

    seen = {}

    def spy(samples):
        out = default_collate(samples)
        seen["out"] = out
        return out.detach() if out.requires_grad else out

    pc = mtc_loader.PackedCollate(spy, arena_bytes=ARENA)
    grads = [torch.ones(3, requires_grad=True), torch.zeros(3, requires_grad=True)]
    assert torch.equal(pc(grads).to("cpu"), torch.stack([g.detach() for g in grads]))
    assert seen["out"].requires_grad  # torch.stack's result, with autograd, as without the scratch
    subs = [torch.ones(2).as_subclass(Sub), torch.zeros(2).as_subclass(Sub)]
    pc(subs)
    assert type(seen["out"]) is Sub
    nested = [torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged) for _ in range(2)]
    with pytest.raises(RuntimeError, match="nested tensors are not currently supported"):
        pc(nested)  # torch's own message
    cl = [torch.rand(1, 3, 4, 4).contiguous(memory_format=torch.channels_last) for _ in range(2)]
    pc(cl)  # not contiguous: the original torch.stack, which keeps the layout
    assert seen["out"].stride() == torch.stack(cl).stride()
    arrays = [np.arange(4, dtype=np.float32), np.ones(4, dtype=np.float32)]
    assert torch.equal(pc(arrays).to("cpu"), torch.from_numpy(np.stack(arrays)))


def test_size_classes():
    assert [_stack.size_class(n) for n in (0, 1, 64, 65, 4096)] == [64, 64, 64, 128, 4096]
    for n in (4097, 5000, 100_000, 3 << 20, (3 << 20) + 1, 123_456_789):
        c = _stack.size_class(n)
        assert n <= c <= n * 1.125 + 1, (n, c)
        assert _stack.size_class(c) == c  # a class is its own class


def test_blocks_are_reused_only_when_their_tensors_are_gone():
    """Each stacked tensor has a block of its own; it goes back to the pool when its storage is
    freed, and only then."""
    pool, call = _stack._Pool(), _stack._Call()
    a = pool.take(100, call)
    b = pool.take(3 << 20, call)
    assert a.data_ptr() % 64 == 0 and b.data_ptr() % 64 == 0 and a.numel() == 100
    pa, pb = a.data_ptr(), b.data_ptr()
    kept = b[10:].untyped_storage()  # a storage object: enough to keep the block
    del a, b
    assert pool.end(call) == 1  # b's block is still referenced
    call = _stack._Call()
    assert pool.take(100, call).data_ptr() == pa  # a's block, warm
    c = pool.take(3 << 20, call)
    assert c.data_ptr() != pb  # b's is still held
    del kept
    pool.end(call)
    call = _stack._Call()
    assert pool.take(3 << 20, call).data_ptr() in (pb, c.data_ptr())
    assert pool.take(0, call).numel() == 0


def test_exception_in_collate_fn_leaves_scratch_inactive():
    def bad(samples):
        default_collate(samples)
        raise KeyError("boom")

    with pytest.raises(KeyError):
        mtc_loader.PackedCollate(bad, arena_bytes=ARENA)([torch.ones(4), torch.ones(4)])
    assert getattr(_stack._TLS, "active", None) is None
    pc = mtc_loader.PackedCollate(arena_bytes=ARENA)
    assert torch.equal(pc([torch.ones(4), torch.zeros(4)]).to("cpu"), torch.stack([torch.ones(4), torch.zeros(4)]))


def test_threads_have_their_own_scratch():
    pc = mtc_loader.PackedCollate(arena_bytes=ARENA)
    errors = []

    def run(seed):
        try:
            g = torch.Generator().manual_seed(seed)
            for _ in range(30):
                samples = [torch.rand(64, 64, generator=g) for _ in range(4)]
                out = pc(samples).to("cpu")
                assert torch.equal(out, torch.stack(samples))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.cuda
@requires_cuda
def test_prefetch_to_cuda_bitwise():
    ds = Images(n=24, size=64)
    pc = mtc_loader.PackedCollate(collate_parts, arena_bytes=ARENA)
    dl = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=pc)
    refs = list(DataLoader(ds, batch_size=4, num_workers=0, collate_fn=collate_parts))
    got = list(mtc_loader.PrefetchLoader(dl, "cuda:0"))
    torch.cuda.synchronize()
    for k, (b, r) in enumerate(zip(got, refs)):
        assert_tree_bitwise(without_flags(b), {k2: (v.to("cuda:0") if isinstance(v, torch.Tensor) else
                                                    [t.to("cuda:0") for t in v])
                                               for k2, v in without_flags(r).items()}, f"batch {k}")


# ------------------------------------------------------------------ stacked tensors that escape

class Full(Dataset):
    """Sample i is an image full of i: a batch shows at a glance which samples it holds."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int):
        return torch.full((3, 8, 8), i)


class Boxed:
    """A user's class around a default_collate result: PackedCollate does not open it, so the
    stacked tensor inside travels in the skeleton (pickled), not through the arena."""

    def __init__(self, images: torch.Tensor):
        self.images = images


def collate_boxed(samples):
    return {"boxed": Boxed(default_collate(samples)), "plain": default_collate(samples)}


_KEPT: list = []


def collate_keeping(samples):
    """Keeps every stacked batch in a global (a cache, a logger): what it keeps must stay right."""
    out = default_collate(samples)
    _KEPT.append(out[1:])  # a view of the stacked tensor, not the tensor itself
    return out


def _expected(k: int) -> torch.Tensor:
    return torch.stack([torch.full((3, 8, 8), i) for i in range(4 * k, 4 * k + 4)])


ESCAPE_WARNING = "ignore:mtc_loader. a tensor that default_collate stacked:RuntimeWarning"


@pytest.mark.filterwarnings(ESCAPE_WARNING)
@pytest.mark.parametrize("ctx,workers", [(None, 0), ("fork", 2), ("spawn", 2)])
def test_stacked_tensor_inside_an_unopened_object_keeps_its_values(ctx, workers):
    pc = mtc_loader.PackedCollate(collate_boxed, arena_bytes=ARENA)
    dl = DataLoader(Full(), batch_size=4, num_workers=workers, collate_fn=pc, multiprocessing_context=ctx)
    for epoch in range(2):
        got = [b.to("cpu") for b in dl]  # every batch kept until the end of the epoch
        assert len(got) == 4
        for k, b in enumerate(got):
            assert isinstance(b["boxed"], Boxed)
            assert torch.equal(b["boxed"].images, _expected(k)), (epoch, k, b["boxed"].images[:, 0, 0, 0])
            assert torch.equal(b["plain"], _expected(k))
    if workers == 0:  # each batch left its scratch memory to the Boxed that holds it
        assert pc.stats()["scratch_retired"] >= 8


@pytest.mark.filterwarnings(ESCAPE_WARNING)
def test_stacked_tensor_kept_by_the_collate_fn_keeps_its_values():
    _KEPT.clear()
    pc = mtc_loader.PackedCollate(collate_keeping, arena_bytes=ARENA)
    got = [b.to("cpu") for b in DataLoader(Full(), batch_size=4, collate_fn=pc)]
    assert len(_KEPT) == 4
    for k, (b, kept) in enumerate(zip(got, _KEPT)):
        assert torch.equal(b, _expected(k))
        assert torch.equal(kept, _expected(k)[1:]), k
    _KEPT.clear()


def collate_recording(samples):
    out = default_collate(samples)
    _PTRS.append(out.data_ptr())
    return out


_PTRS: list = []


def test_scratch_reused_when_nothing_escapes():
    """The fast path stays: a batch whose stacked tensors are all packed leaves its blocks to the
    next batch (the same memory, nothing new allocated, nothing retired)."""
    _PTRS.clear()
    pc = mtc_loader.PackedCollate(collate_recording, arena_bytes=ARENA)
    before = pc.stats()["scratch_retired"]
    for k in range(6):
        samples = [torch.full((3, 8, 8), i) for i in range(4 * k, 4 * k + 4)]
        assert torch.equal(pc(samples).to("cpu"), torch.stack(samples))
        if k == 1:
            allocated = _stack._POOL.allocated
    assert len(set(_PTRS[1:])) == 1
    assert _stack._POOL.allocated == allocated
    assert pc.stats()["scratch_retired"] == before


def test_escape_is_warned_once_and_counted(monkeypatch):
    monkeypatch.setattr(_stack, "_WARNED", [False])
    pc = mtc_loader.PackedCollate(collate_boxed, arena_bytes=ARENA)
    before = pc.stats()["scratch_retired"]
    samples = [torch.full((3, 8, 8), i) for i in range(4)]
    with pytest.warns(RuntimeWarning, match="stacked inside a PackedCollate call is still referenced"):
        first = pc(samples).to("cpu")
    second = pc(samples[::-1]).to("cpu")  # once per process
    assert pc.stats()["scratch_retired"] == before + 2
    assert torch.equal(first["boxed"].images, torch.stack(samples))
    assert torch.equal(second["boxed"].images, torch.stack(samples[::-1]))


def test_failed_call_retires_without_warning():
    """A collate_fn that raises with a stacked tensor in its frame (kept by the traceback)."""
    def bad(samples):
        stacked = default_collate(samples)
        raise KeyError(stacked.shape)

    pc = mtc_loader.PackedCollate(bad, arena_bytes=ARENA)
    before = pc.stats()["scratch_retired"]
    with pytest.raises(KeyError) as ei:
        pc([torch.ones(4), torch.ones(4)])
    assert pc.stats()["scratch_retired"] == before + 1  # the traceback holds the frame
    del ei


@pytest.mark.filterwarnings(ESCAPE_WARNING)
def test_numpy_view_of_a_stacked_tensor_keeps_its_values():
    """A numpy array over a stacked tensor, inside an unopened object: it holds the storage too."""
    pc = mtc_loader.PackedCollate(lambda s: Boxed(default_collate(s).numpy()), arena_bytes=ARENA)
    got = [pc([torch.full((3, 8, 8), i) for i in range(4 * k, 4 * k + 4)]).to("cpu") for k in range(4)]
    for k, b in enumerate(got):
        assert np.array_equal(b.images, _expected(k).numpy()), k


@pytest.mark.cuda
@requires_cuda
@pytest.mark.filterwarnings(ESCAPE_WARNING)
def test_unopened_object_through_prefetch_to_cuda():
    """The escaped tensor stays in its (unopened) object on the CPU; the packed one reaches the
    GPU; both right for every batch of the epoch, kept to its end."""
    pc = mtc_loader.PackedCollate(collate_boxed, arena_bytes=ARENA)
    dl = DataLoader(Full(), batch_size=4, num_workers=2, collate_fn=pc, multiprocessing_context="fork")
    got = list(mtc_loader.PrefetchLoader(dl, "cuda:0"))
    torch.cuda.synchronize()
    assert len(got) == 4
    for k, b in enumerate(got):
        assert b["plain"].is_cuda and torch.equal(b["plain"].cpu(), _expected(k))
        assert torch.equal(b["boxed"].images, _expected(k)), k


def test_escape_warning_as_an_error_leaks_no_region(monkeypatch):
    import warnings
    monkeypatch.setattr(_stack, "_WARNED", [False])
    pc = mtc_loader.PackedCollate(collate_boxed, arena_bytes=ARENA)
    in_use = pc.stats()["slots_in_use"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeWarning, match="still referenced"):
            pc([torch.full((3, 8, 8), i) for i in range(4)])
    assert pc.stats()["slots_in_use"] == in_use
    assert getattr(_stack._TLS, "active", None) is None


# ------------------------------------------------ whatever holds the memory keeps it from reuse

def _keep_storage(t):
    return t.untyped_storage()


def _keep_typed_storage(t):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # TypedStorage is deprecated
        return t.storage()


def _keep_numpy(t):
    return t.numpy()


def _keep_memoryview(t):
    return memoryview(t.numpy())


def _keep_dlpack(t):
    return torch.utils.dlpack.to_dlpack(t)


def _keep_view_of_numpy(t):
    return t.numpy()[1:].view(np.uint8)


def _read_back(kind, kept):
    """The int64 values of what was kept, read through the kept object itself."""
    if kind == "storage":
        return torch.tensor([], dtype=torch.int64).set_(kept)
    if kind == "typed_storage":
        return torch.tensor([], dtype=torch.int64).set_(kept.untyped())
    if kind == "dlpack":
        return torch.utils.dlpack.from_dlpack(kept)
    if kind == "memoryview":
        return torch.from_numpy(np.asarray(kept))
    if kind == "view_of_numpy":
        return torch.from_numpy(kept.view(np.int64))
    return torch.from_numpy(kept)


_KEEPERS = {"storage": _keep_storage, "typed_storage": _keep_typed_storage, "numpy": _keep_numpy,
            "memoryview": _keep_memoryview, "dlpack": _keep_dlpack, "view_of_numpy": _keep_view_of_numpy}


@pytest.mark.filterwarnings(ESCAPE_WARNING)
@pytest.mark.parametrize("kind", sorted(_KEEPERS))
def test_memory_kept_in_any_form_is_never_reused(kind):
    """A collate_fn that keeps the stacked tensor's memory through any object (a storage, a numpy
    array, a memoryview, a DLPack capsule), the tensor itself dropped: every kept object still
    shows its own batch's values after later batches were stacked."""
    kept = []

    def collate(samples):
        out = default_collate(samples)
        kept.append(_KEEPERS[kind](out))
        return out

    pc = mtc_loader.PackedCollate(collate, arena_bytes=ARENA)
    for k in range(6):
        samples = [torch.full((3, 8, 8), i) for i in range(4 * k, 4 * k + 4)]
        assert torch.equal(pc(samples).to("cpu"), torch.stack(samples))
    for k, obj in enumerate(kept):
        got = _read_back(kind, obj).flatten()
        want = (_expected(k)[1:] if kind == "view_of_numpy" else _expected(k)).flatten()
        assert torch.equal(got, want), (kind, k, got[:4])


def collate_keeping_labels(samples):
    """Keeps each batch's 4-element label tensor (a logger, a class-balance counter)."""
    out = default_collate(samples)
    _KEPT.append(out["label"])
    return out


class ImageAndLabel(Dataset):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int):
        return {"img": torch.full((3, 256, 256), i % 256, dtype=torch.uint8).expand(4, 3, 256, 256).contiguous(),
                "label": torch.tensor(i)}


@pytest.mark.filterwarnings(ESCAPE_WARNING)
def test_a_kept_small_tensor_keeps_only_its_own_memory():
    """Ten kept label tensors of 4 elements hold ten small blocks, not ten batches of images."""
    _KEPT.clear()
    pool = _stack._POOL
    pc = mtc_loader.PackedCollate(collate_keeping_labels, arena_bytes=ARENA)
    for b in DataLoader(ImageAndLabel(), batch_size=4, collate_fn=pc):
        b.to("cpu")
    assert len(_KEPT) == 10
    for k, labels in enumerate(_KEPT):
        assert torch.equal(labels, torch.arange(4 * k, 4 * k + 4))
    held = sum(cls for ref, cls, _ in pool.out.values() if ref() is not None)
    assert held <= 10 * 64, held  # (3 MiB of images per batch)
    _KEPT.clear()


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no RssAnon")


_RELEASE_SCRIPT = """
import gc, torch, mtc_loader
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) << 10
samples = [torch.ones(8 << 20) for _ in range(4)]  # one stacked tensor of 128 MiB
base = rss()
pc = mtc_loader.PackedCollate(arena_bytes=160 << 20)
out = pc(samples).to("cpu")
assert torch.equal(out[3], samples[3])
del out
kept = rss() - base
freed = mtc_loader.trim()
trimmed = rss() - base
out = pc(samples).to("cpu")
del out, pc
gc.collect()
print(kept >> 20, freed >> 20, trimmed >> 20, (rss() - base) >> 20)
"""


def test_scratch_of_the_main_process_is_released():
    """num_workers=0: the blocks a 128 MiB batch was stacked into stay warm while its
    PackedCollate lives, and are freed by mtc_loader.trim() or when the last PackedCollate that
    stacked in the process goes (measured in a fresh process: in this one, other tests'
    PackedCollates may still be alive)."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", _RELEASE_SCRIPT], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    kept, freed, trimmed, gone = (int(x) for x in r.stdout.split())
    assert kept > 100 and freed >= 128, (kept, freed)  # MiB: kept for the next batch, then trimmed
    assert trimmed < 16 and gone < 16, (trimmed, gone)
