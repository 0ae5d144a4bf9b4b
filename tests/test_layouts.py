"""Layouts: every output has the strides ``tensor.to(device)`` gives it, on every path.

A dense, non-overlapping tensor (channels_last, a transpose, any permutation; dims of size 0
or 1 with any stride) keeps its strides; any other tensor (gaps, overlaps, expanded dims) gets
the dense strides torch's ``preserve_format`` infers from its own. Each check compares the
values bitwise and ``stride()`` against ``t.to(device, copy=True)`` (``copy=True``: torch's
copy for a source already on ``device``, which is what a packed batch or a host copy makes).

CPU tests run everywhere; the ``cuda`` ones where a GPU is.
"""
from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import mtc_loader
from mtc_loader import start_copy
from conftest import requires_2gpus, requires_cuda

CUDA = pytest.param("cuda:0", marks=[pytest.mark.cuda, requires_cuda], id="cuda")
DEVICES = ["cpu", CUDA]
OPTIONS = [dict(use_pinned_staging=s, pack_cpu_tensors=p, use_background_thread=b)
           for s, p, b in itertools.product([True, False], repeat=3)]
ARENA = 16 << 20

CL, CL3 = torch.channels_last, torch.channels_last_3d

# (id, base shape, dtype, view of the base): the base is made on the source device, then viewed
DENSE = [
    ("contiguous", (3, 4), torch.float32, lambda x: x),
    ("channels_last", (2, 3, 4, 5), torch.float32, lambda x: x.contiguous(memory_format=CL)),
    ("channels_last_c1", (2, 1, 4, 5), torch.float32, lambda x: x.contiguous(memory_format=CL)),
    ("channels_last_hw1", (2, 3, 1, 1), torch.float32, lambda x: x.contiguous(memory_format=CL)),
    ("channels_last_3d", (2, 3, 2, 4, 5), torch.float32, lambda x: x.contiguous(memory_format=CL3)),
    ("transposed", (4, 6), torch.float32, lambda x: x.t()),
    ("permuted_3d", (2, 3, 4), torch.float32, lambda x: x.permute(2, 0, 1)),
    ("permuted_unit", (3, 1, 5), torch.float32, lambda x: x.permute(2, 1, 0)),
    ("unit_dim_odd_stride", (12,), torch.float32, lambda x: x.as_strided((3, 1, 4), (4, 100, 1))),
    ("one_element_stride5", (25,), torch.float32, lambda x: x.as_strided((1,), (5,), 2)),
    ("unit_dims_only", (4,), torch.float32, lambda x: x.as_strided((1, 1), (7, 9), 1)),
    ("empty_transposed", (0, 3), torch.float32, lambda x: x.t()),
    ("empty_odd_strides", (4,), torch.float32, lambda x: x.as_strided((0, 5), (3, 2))),
    ("int64_transposed", (5, 3), torch.int64, lambda x: x.t()),
    ("uint8_channels_last", (2, 3, 3, 4), torch.uint8, lambda x: x.contiguous(memory_format=CL)),
    ("bool_transposed", (3, 7), torch.bool, lambda x: x.t()),
    ("float16_permuted", (2, 3, 4), torch.float16, lambda x: x.permute(1, 2, 0)),
    ("float64_channels_last", (1, 5, 2, 3), torch.float64, lambda x: x.contiguous(memory_format=CL)),
    # larger than a pack (256 KiB): own outputs, staged
    ("channels_last_large", (1, 64, 32, 64), torch.float32, lambda x: x.contiguous(memory_format=CL)),
    ("transposed_large", (500, 300), torch.float32, lambda x: x.t()),
]
NON_DENSE = [
    ("sliced", (6, 4), torch.float32, lambda x: x[::2]),
    ("transposed_sliced", (4, 6), torch.float32, lambda x: x.t()[::2]),
    ("expanded", (3, 1), torch.float32, lambda x: x.expand(3, 4)),
    ("expanded_middle", (6, 1, 2), torch.float32, lambda x: x.expand(6, 5, 2)),
    ("overlapping", (10,), torch.float32, lambda x: x.as_strided((3, 3), (1, 1))),
    ("channels_last_narrow", (2, 3, 4, 5), torch.float32,
     lambda x: x.contiguous(memory_format=CL)[..., :3]),
    ("permute_slice", (2, 3, 4, 5), torch.float32, lambda x: x.permute(0, 2, 3, 1)[:, ::2]),
    ("int64_column", (5, 5), torch.int64, lambda x: x[:, 2:3]),
    ("sliced_large", (1000, 300), torch.float32, lambda x: x.t()[::2]),
]
LAYOUTS = DENSE + NON_DENSE
IDS = [c[0] for c in LAYOUTS]


def make(case, device="cpu", seed=0) -> torch.Tensor:
    _, shape, dtype, view = case
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        base = torch.rand(shape, generator=g) > 0.5
    elif dtype.is_floating_point:
        base = torch.randn(shape, generator=g).to(dtype)
    else:
        base = torch.randint(-100, 100, shape, generator=g).to(dtype)
    return view(base.to(device))


def sync(device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def assert_bitwise(out, ref, where="") -> None:
    """Same dtype, shape, device and bytes of the values (row-major), whatever the strides
    (conftest's as_bytes cannot view a one-element tensor of stride 5 as bytes)."""
    assert isinstance(out, torch.Tensor), f"{where}: {type(out)}"
    assert (out.dtype, out.shape, out.device) == (ref.dtype, ref.shape, ref.device), where

    def row_major_bytes(t):
        c = torch.empty(t.shape, dtype=t.dtype).copy_(t.detach().cpu())
        return c.reshape(-1).view(torch.uint8)

    assert torch.equal(row_major_bytes(out), row_major_bytes(ref)), f"{where}: bytes differ"


def check(out, src, device, where=""):
    """out has the values and the strides of src.to(device)."""
    ref = src.to(device, copy=True)
    assert out.stride() == ref.stride(), f"{where}: strides {out.stride()} != {ref.stride()} " \
                                         f"(source {tuple(src.shape)} {src.stride()})"
    assert_bitwise(out, ref, where)


def all_layouts(device="cpu", seed=0) -> dict:
    return {c[0]: make(c, device, seed + k) for k, c in enumerate(LAYOUTS)}


def check_tree(out: dict, src: dict, device) -> None:
    assert list(out) == list(src)
    for k in src:
        check(out[k], src[k], device, k)


# --------------------------------------------------------------------------- the rule itself

def test_cases_cover_dense_and_not():
    """The cases are what their names say: torch's own view of each (so a test below that
    passes checks the rule it means to)."""
    for case in DENSE:
        t = make(case)
        if not t.is_contiguous():
            assert t.clone().stride() == t.stride(), case[0]
    for case in NON_DENSE:
        t = make(case)
        assert t.clone().stride() != t.stride(), case[0]


# --------------------------------------------------------------------------- CPU targets

def test_cpu_tensors_are_reused_whatever_their_strides():
    src = all_layouts()
    out = start_copy(src, "cpu").get()
    for k in src:
        assert out[k] is src[k], k


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", LAYOUTS, ids=IDS)
def test_packed_batch_keeps_layout(case, device):
    """PackedCollate in this process (num_workers=0), unpacked, and moved with .to()."""
    src = make(case)
    pc = mtc_loader.PackedCollate(list, arena_bytes=ARENA)
    out = pc([{"x": src}, {"x": src}]).unpack(device)
    sync(device)
    for s in out:
        check(s["x"], src, device, case[0])
    out = pc([src]).to(device)
    sync(device)
    check(out[0], src, device, case[0])


@pytest.mark.parametrize("device", DEVICES)
def test_packed_batch_mixed_layouts_share_a_region(device):
    """All layouts in one batch: strided leaves among row-major groups of the same dtype and
    trailing dims, in one region."""
    src = all_layouts()
    plain = {f"plain_{k}": v.contiguous() for k, v in src.items()}
    both = {**src, **plain}
    pc = mtc_loader.PackedCollate(lambda s: s[0], arena_bytes=ARENA)
    out = pc([both]).unpack(device)
    sync(device)
    check_tree(out, both, device)


class LayoutSamples(Dataset):
    """Per index: every layout (made in the worker), deterministic per index."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int):
        return all_layouts(seed=100 * i)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("workers", [0, 2])
def test_packed_collate_in_workers(workers, device):
    """DataLoader(collate_fn=PackedCollate) with and without worker processes, through
    PrefetchLoader and through PackedBatch.to()."""
    pc = mtc_loader.PackedCollate(list, arena_bytes=ARENA)
    kw = dict(num_workers=workers, batch_size=2, collate_fn=pc)
    if workers:
        kw["multiprocessing_context"] = "fork"
    refs = [[all_layouts(seed=100 * i) for i in (2 * k, 2 * k + 1)] for k in range(3)]
    n = 0
    for k, batch in enumerate(mtc_loader.PrefetchLoader(DataLoader(LayoutSamples(), **kw), device)):
        sync(device)
        for s, r in zip(batch, refs[k]):
            check_tree(s, r, device)
        n += 1
    assert n == 3
    for k, pb in enumerate(DataLoader(LayoutSamples(), **kw)):
        out = pb.to(device)
        sync(device)
        for s, r in zip(out, refs[k]):
            check_tree(s, r, device)


def test_packed_collate_fuzz_layouts():
    """Random shapes, permutations, slices and expansions: the strides of each unpacked leaf
    are torch's (.to(copy=True)), the values bitwise."""
    rng = random.Random(7)
    pc = mtc_loader.PackedCollate(lambda s: s[0], arena_bytes=ARENA)
    for round_ in range(40):
        batch = []
        for _ in range(12):
            nd = rng.randint(1, 5)
            shape = [rng.choice([0, 1, 1, 2, 3, 4]) if rng.random() < 0.1 else rng.choice([1, 2, 3, 4, 5])
                     for _ in range(nd)]
            t = torch.randn(shape, generator=torch.Generator().manual_seed(round_))
            perm = list(range(nd))
            rng.shuffle(perm)
            t = t.permute(perm)
            for d in range(nd):
                r = rng.random()
                if r < 0.2 and t.shape[d] > 1:
                    t = t.narrow(d, 0, t.shape[d] - 1)
                elif r < 0.3 and t.shape[d] > 2:
                    t = t.index_select(d, torch.arange(0, t.shape[d], 2)) if rng.random() < 0.3 else \
                        t.transpose(0, d)[::2].transpose(0, d)
                elif r < 0.4 and t.shape[d] == 1:
                    sizes = list(t.shape)
                    sizes[d] = 3
                    t = t.expand(sizes)
            batch.append(t)
        out = pc([batch]).unpack("cpu")
        for k, (o, s) in enumerate(zip(out, batch)):
            check(o, s, "cpu", f"round {round_} leaf {k}")


# --------------------------------------------------------------------------- numpy leaves

def _arrays():
    """(id, array): dense in several orders, and not dense."""
    a = np.arange(60, dtype=np.float32).reshape(3, 4, 5)
    return [
        ("c_order", a.copy()),
        ("fortran", np.asfortranarray(a)),
        ("transposed", a.copy().transpose(2, 0, 1)),
        ("column", np.arange(25, dtype=np.int64).reshape(5, 5)[:, 2:3]),
        ("row_of_column", np.arange(25, dtype=np.float64).reshape(5, 5)[2:3, :].T),
        ("sliced", a.copy()[:, ::2]),
        ("fortran_sliced", np.asfortranarray(a)[::2]),
        ("negative", a.copy()[:, ::-1]),
        ("large_fortran", np.asfortranarray(np.arange(300 * 400, dtype=np.float32).reshape(300, 400))),
        ("large_sliced", np.arange(600 * 400, dtype=np.float32).reshape(400, 600).T[::2]),
    ]


def _numpy_ref(a: np.ndarray, device):
    """torch.from_numpy(a).to(device) (copy=True): the reference layout; an array torch cannot
    hold (a negative stride) is copied row-major."""
    try:
        t = torch.from_numpy(a)
    except ValueError:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device, copy=True)
    return t.to(device, copy=True)


@pytest.mark.parametrize("name,a", _arrays(), ids=[n for n, _ in _arrays()])
def test_numpy_read_only_to_cpu_keeps_layout(name, a):
    """A read-only array is copied (torch.from_numpy cannot share it): in its own layout."""
    ref = _numpy_ref(a, "cpu")
    a.flags.writeable = False
    out = start_copy([a], "cpu").get()[0]
    assert out.stride() == ref.stride(), f"{name}: {out.stride()} != {ref.stride()}"
    assert_bitwise(out, ref, name)


@pytest.mark.parametrize("name,a", _arrays(), ids=[n for n, _ in _arrays()])
def test_numpy_writeable_to_cpu_is_shared(name, a):
    out = start_copy([a], "cpu").get()[0]
    if any(s < 0 for s in a.strides):
        ref = _numpy_ref(a, "cpu")
        assert out.stride() == ref.stride()
        assert_bitwise(out, ref, name)
    else:
        assert out.stride() == torch.from_numpy(a).stride()
        assert out.data_ptr() == a.ctypes.data


@pytest.mark.parametrize("device", DEVICES)
def test_numpy_packed_batch_keeps_layout(device):
    arrays = dict(_arrays())
    pc = mtc_loader.PackedCollate(lambda s: s[0], arena_bytes=ARENA)
    kept = pc([arrays]).unpack(device)
    assert all(type(kept[k]) is np.ndarray and kept[k].dtype == a.dtype for k, a in arrays.items())
    # packed as tensors where the consumer asks for them (PrefetchLoader(numpy_to_tensors=True) tells the arena)
    pc.arena._numpy_tensors = True
    for out in (pc([arrays]).unpack(device), pc([arrays]).unpack(device, numpy_to_tensors=True)):
        sync(device)
        for k, a in arrays.items():
            ref = _numpy_ref(a, device)
            assert out[k].stride() == ref.stride(), f"{k}: {out[k].stride()} != {ref.stride()}"
            assert_bitwise(out[k], ref, k)


# --------------------------------------------------------------------------- CUDA

@pytest.mark.parametrize("opts", OPTIONS, ids=str)
@pytest.mark.parametrize("case", LAYOUTS, ids=IDS)
@pytest.mark.cuda
@requires_cuda
def test_h2d_keeps_layout(case, opts):
    """CPU -> GPU: packed (small), staged or direct (large), every option."""
    src = make(case)
    out = start_copy({"a": src, "b": [src, src.contiguous()]}, "cuda:0", **opts).get()
    torch.cuda.synchronize()
    check(out["a"], src, "cuda:0", case[0])
    check(out["b"][0], src, "cuda:0", case[0])
    check(out["b"][1], src.contiguous(), "cuda:0", case[0])


@pytest.mark.parametrize("opts", OPTIONS, ids=str)
@pytest.mark.cuda
@requires_cuda
def test_h2d_all_layouts_in_one_batch(opts):
    src = all_layouts()
    out = start_copy(src, "cuda:0", **opts).get()
    torch.cuda.synchronize()
    check_tree(out, src, "cuda:0")


@pytest.mark.parametrize("opts", OPTIONS, ids=str)
@pytest.mark.parametrize("case", LAYOUTS, ids=IDS)
@pytest.mark.cuda
@requires_cuda
def test_d2h_keeps_layout(case, opts):
    """GPU -> CPU: packed into a pinned chunk (small, dense), own output, or made dense on the
    GPU first (not dense); every option."""
    src = make(case, "cuda:0")
    out = start_copy({"a": src, "b": [src, src.contiguous()]}, "cpu", **opts).get()
    check(out["a"], src, "cpu", case[0])
    check(out["b"][0], src, "cpu", case[0])
    check(out["b"][1], src.contiguous(), "cpu", case[0])
    if opts["use_pinned_staging"] and src.numel():
        assert out["a"].is_pinned()


@pytest.mark.parametrize("opts", OPTIONS, ids=str)
@pytest.mark.cuda
@requires_cuda
def test_d2h_all_layouts_in_one_batch(opts):
    src = all_layouts("cuda:0")
    out = start_copy(src, "cpu", **opts).get()
    check_tree(out, src, "cpu")


@pytest.mark.cuda
@requires_cuda
def test_gpu_tensors_on_target_are_reused():
    src = all_layouts("cuda:0")
    out = start_copy(src, "cuda:0").get()
    for k in src:
        assert out[k] is src[k], k


@pytest.mark.parametrize("opts", OPTIONS[:2], ids=str)
@pytest.mark.cuda
@requires_2gpus
def test_d2d_keeps_layout(opts):
    """GPU -> another GPU."""
    src = all_layouts("cuda:1")
    out = start_copy(src, "cuda:0", **opts).get()
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    check_tree(out, src, "cuda:0")


@pytest.mark.parametrize("opts", OPTIONS, ids=str)
@pytest.mark.cuda
@requires_cuda
def test_numpy_to_gpu_keeps_layout(opts):
    arrays = dict(_arrays())
    out = start_copy(arrays, "cuda:0", **opts).get()
    torch.cuda.synchronize()
    for k, a in arrays.items():
        ref = _numpy_ref(a, "cuda:0")
        assert out[k].stride() == ref.stride(), f"{k}: {out[k].stride()} != {ref.stride()}"
        assert_bitwise(out[k], ref, k)


@pytest.mark.cuda
@requires_cuda
def test_packed_batch_to_then_another_device():
    """PackedBatch.to(cuda) then .to(cpu): the second move copies the unpacked structure."""
    src = all_layouts()
    pc = mtc_loader.PackedCollate(lambda s: s[0], arena_bytes=ARENA)
    pb = pc([src])
    out = pb.to("cuda:0")
    torch.cuda.synchronize()
    check_tree(out, src, "cuda:0")
    back = pb.to("cpu")
    check_tree(back, src, "cpu")
