"""Alignment of packed outputs, checked the way the reference implementation's own test checks it.

A user sees a packed output's alignment as its byte offset from the start of its storage,
``t.data_ptr() - t.untyped_storage().data_ptr()``: outputs are grouped by
``untyped_storage().data_ptr()`` (one group per packed chunk), and every member's offset must be
a multiple of ``round_up(max(min_packed_alignment_bytes, element_size), element_size)``.
Checked for ``start_copy`` (CPU -> GPU packed chunks with pinned staging on and off, GPU -> CPU
packed chunks, CPU -> CPU) and for ``PackedBatch`` unpacking to the CPU and to a GPU, across
dtypes of every element size (1, 2, 4, 8 and 16 bytes). The CPU cases run everywhere; the CUDA
ones where a GPU is.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterator

import numpy as np
import pytest
import torch

import mtc_loader
from mtc_loader import start_copy
from conftest import assert_tree_bitwise, random_tensor, requires_cuda, tree_to

ALIGNS = [1, 6, 16, 24, 100]
# PackedCollate takes powers of two up to 4096 (the arena's layout); above 64 a chunk's storage
# from torch's CPU allocator (64-byte aligned) need not start on the alignment
ARENA_ALIGNS = [1, 2, 16, 128, 4096]
DTYPES = [torch.bool, torch.uint8, torch.float16, torch.bfloat16, torch.float32, torch.int32,
          torch.float64, torch.int64, torch.complex64, torch.complex128]
ARENA = 64 << 20


def rule(align: int, elsize: int) -> int:
    """The reference's effective alignment: round_up(max(align, elsize), elsize)."""
    return -(-max(align, elsize) // elsize) * elsize


def leaves(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from leaves(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from leaves(v)


def reference_case(device: str = "cpu") -> list:
    """The reference test's structure: [f32 (8,4), [i64 (17,), (f16 (11,), [c64 (9,), c128 (5,),
    a non-contiguous f32])]]."""
    g = torch.Generator().manual_seed(20)
    data = [random_tensor(torch.float32, (8, 4), g),
            [random_tensor(torch.int64, (17,), g),
             (random_tensor(torch.float16, (11,), g),
              [random_tensor(torch.complex64, (9,), g), random_tensor(torch.complex128, (5,), g),
               random_tensor(torch.float32, (6, 8), g)[:, ::3]])]]
    return tree_to(data, device) if device != "cpu" else data


def every_size_case(device: str = "cpu", seed: int = 21) -> list:
    """Tensors of every element size and of lengths 1..13, interleaved, so that segments of
    every alignment follow one another in a chunk (and a 1-byte tensor ends on an odd offset)."""
    g = torch.Generator().manual_seed(seed)
    data = [random_tensor(dt, (n,), g) for n in range(1, 14) for dt in DTYPES]
    data += [random_tensor(dt, (3, 5), g) for dt in DTYPES]  # UNIFORM segments of 2-d members
    return tree_to(data, device) if device != "cpu" else data


VIEW_SHAPES = [(), (1,), (3,), (0,), (2, 0, 3), (1, 1), (5, 1, 2), (3, 7)]


def views_case(tail: int, device: str = "cpu", seed: int = 22) -> list:
    """Members of every element size in awkward shapes (0-d, dims of 0 and 1; several of one shape
    make a UNIFORM segment, several of one trailing shape a SPLIT one), then a uint8 tensor of
    ``tail`` bytes that ends the chunk: over tails 1..16 the chunk's length takes every residue
    modulo 16, and a dtype's view of the chunk covers its whole elements only."""
    g = torch.Generator().manual_seed(seed)
    data = [random_tensor(dt, shape, g) for dt in DTYPES if dt != torch.uint8 for shape in VIEW_SHAPES]
    data += [random_tensor(dt, (2, 3), g) for dt in (torch.float32, torch.complex128) for _ in range(3)]
    data.append(random_tensor(torch.uint8, (tail,), g))
    return tree_to(data, device) if device != "cpu" else data


def check_views(out: list, data: list, tail: int) -> None:
    """Bitwise equal, with the strides torch gives a contiguous tensor of the shape, and the
    chunk's length off a multiple of 16 by the tail (the case is not vacuous)."""
    assert_tree_bitwise(out, data)
    for o, r in zip(out, data):
        assert o.stride() == torch.empty(r.shape, dtype=r.dtype).stride(), (r.dtype, tuple(r.shape), o.stride())
    assert out[-1].untyped_storage().nbytes() % 16 == tail % 16


def check_offsets(out: Any, data: Any, align: int, packed: bool) -> None:
    """Every output's offset from its storage's start is a multiple of the rule; with packing,
    some storage holds several outputs (the check is not vacuous)."""
    groups: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)
    for o, r in zip(leaves(out), leaves(data)):
        groups[o.untyped_storage().data_ptr()].append((o, r))
    for members in groups.values():
        for o, r in members:
            e = o.element_size()
            off = o.data_ptr() - o.untyped_storage().data_ptr()
            req = rule(align, e)
            assert off % req == 0, (
                f"{o.dtype} {tuple(o.shape)}: storage offset {off} is not a multiple of {req} "
                f"(min_packed_alignment_bytes={align})")
            # the absolute address is always a multiple of the element size
            assert o.data_ptr() % e == 0, (o.dtype, o.data_ptr())
    if packed:
        assert max(len(m) for m in groups.values()) > 1, "nothing was packed: the check is vacuous"


# ------------------------------------------------------------------------------- CPU targets

@pytest.mark.parametrize("staging", [True, False], ids=["pinned", "pageable"])
@pytest.mark.parametrize("align", ALIGNS)
def test_start_copy_cpu_to_cpu(align, staging):
    # CPU -> CPU packs nothing: each tensor is returned as is, and each array that needs a copy
    # gets a tensor of its own (offset 0)
    data = every_size_case() + [np.arange(7, dtype=np.int16)[::-2], np.arange(5, dtype=np.float64)[::2]]
    out = start_copy(data, "cpu", min_packed_alignment_bytes=align, use_pinned_staging=staging).get()
    check_offsets(out, data, align, packed=False)


@pytest.mark.parametrize("align", ARENA_ALIGNS)
@pytest.mark.parametrize("case", ["reference", "every_size"])
def test_packed_batch_unpack_cpu(case, align):
    samples = reference_case() if case == "reference" else every_size_case()
    pc = mtc_loader.PackedCollate(list, arena_bytes=ARENA, min_packed_alignment_bytes=align)
    for rnd in range(4):  # several chunks, so that several allocator offsets are met
        out = pc(samples).unpack("cpu")
        assert_tree_bitwise(out, samples)
        check_offsets(out, samples, align, packed=True)


@pytest.mark.parametrize("tail", range(1, 17))
def test_packed_batch_views_cpu(tail):
    # the views of a chunk whose length is no multiple of its members' element sizes
    samples = views_case(tail)
    pc = mtc_loader.PackedCollate(list, arena_bytes=ARENA)
    out = pc(samples).unpack("cpu")
    check_views(out, samples, tail)
    check_offsets(out, samples, 16, packed=True)


def uniform_case(device: str = "cpu", seed: int = 23) -> list:
    """Groups of tensors of one dtype and shape (UNIFORM segments): members that fill their slots
    back to back (48-byte float32 (3, 4), 16-byte int64 (2,), 96-byte complex128 (2, 3)), members
    with room between them (30-byte int16 (3, 5), 1-byte bool (1,)), 0-d members and members
    with no bytes, each group interleaved with the others."""
    g = torch.Generator().manual_seed(seed)
    kinds = [(torch.float32, (3, 4)), (torch.int64, (2,)), (torch.complex128, (2, 3)), (torch.int16, (3, 5)),
             (torch.bool, (1,)), (torch.float64, ()), (torch.float32, (2, 0))]
    data = [random_tensor(dt, shape, g) for _ in range(7) for dt, shape in kinds]
    return tree_to(data, device) if device != "cpu" else data


def check_independent(out: list, data: list) -> None:
    """Bitwise equal to the per-tensor .to(), with contiguous strides, and writing to one output
    leaves every other as it was (no two outputs overlap)."""
    ref = tree_to(data, out[0].device)
    assert_tree_bitwise(out, ref)
    for o, r in zip(out, ref):
        assert o.stride() == torch.empty(r.shape, dtype=r.dtype).stride(), (r.dtype, tuple(r.shape), o.stride())
    for k, o in enumerate(out):
        if o.numel():
            new = ~ref[k] if o.dtype == torch.bool else torch.ones_like(ref[k])
            o.copy_(new)
            assert_tree_bitwise(out, ref[:k] + [new] + ref[k + 1:])
            o.copy_(ref[k])


@pytest.mark.parametrize("align", [1, 16])
def test_packed_batch_uniform_segments_cpu(align):
    data = uniform_case()
    out = mtc_loader.PackedCollate(list, arena_bytes=ARENA, min_packed_alignment_bytes=align)(data).unpack("cpu")
    check_independent(out, data)
    check_offsets(out, data, align, packed=True)


@pytest.mark.parametrize("align", [6, 24, 100])
def test_packed_collate_takes_powers_of_two(align):
    with pytest.raises(ValueError, match="power of two"):
        mtc_loader.PackedCollate(list, arena_bytes=ARENA, min_packed_alignment_bytes=align)


# ------------------------------------------------------------------------------ CUDA targets

@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("align", [1, 16])
def test_uniform_segments_cuda(align):
    data = uniform_case()
    out = start_copy(data, "cuda:0", min_packed_alignment_bytes=align).get()
    torch.cuda.synchronize()
    check_independent(out, data)
    check_offsets(out, data, align, packed=True)
    pc = mtc_loader.PackedCollate(list, arena_bytes=ARENA, min_packed_alignment_bytes=align)
    out = pc(data).to("cuda:0")
    torch.cuda.synchronize()
    check_independent(out, data)
    check_offsets(out, data, align, packed=True)


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("background", [True, False], ids=["background", "inline"])
@pytest.mark.parametrize("staging", [True, False], ids=["pinned", "pageable"])
@pytest.mark.parametrize("align", ALIGNS)
@pytest.mark.parametrize("case", ["reference", "every_size"])
def test_start_copy_h2d(case, align, staging, background):
    data = reference_case() if case == "reference" else every_size_case()
    before = mtc_loader.stats()["tensors_packed"]
    out = start_copy(data, "cuda:0", min_packed_alignment_bytes=align, use_pinned_staging=staging,
                     use_background_thread=background).get()
    torch.cuda.synchronize()
    assert mtc_loader.stats()["tensors_packed"] > before
    assert_tree_bitwise(out, tree_to(data, "cuda:0"))
    check_offsets(out, data, align, packed=True)


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("staging", [True, False], ids=["pinned", "pageable"])
@pytest.mark.parametrize("align", ALIGNS)
@pytest.mark.parametrize("case", ["reference", "every_size"])
def test_start_copy_d2h(case, align, staging):
    # GPU -> CPU packs contiguous tensors into one pinned chunk when staging is on; with it off,
    # every output is a tensor of its own
    data = reference_case("cuda:0") if case == "reference" else every_size_case("cuda:0")
    out = start_copy(data, "cpu", min_packed_alignment_bytes=align, use_pinned_staging=staging).get()
    assert_tree_bitwise(out, tree_to(data, "cpu"))
    check_offsets(out, data, align, packed=staging)


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("align", ARENA_ALIGNS)
@pytest.mark.parametrize("case", ["reference", "every_size"])
def test_packed_batch_unpack_cuda(case, align):
    samples = reference_case() if case == "reference" else every_size_case()
    pc = mtc_loader.PackedCollate(list, arena_bytes=ARENA, min_packed_alignment_bytes=align)
    for rnd in range(4):
        out = pc(samples).to("cuda:0")
        torch.cuda.synchronize()
        assert_tree_bitwise(out, tree_to(samples, "cuda:0"))
        check_offsets(out, samples, align, packed=True)


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("tail", [1, 3, 8, 15, 16])
def test_packed_views_cuda(tail):
    # the same views over a CUDA chunk (PackedBatch.to) and a pinned one (GPU -> CPU packing)
    samples = views_case(tail)
    out = mtc_loader.PackedCollate(list, arena_bytes=ARENA)(samples).to("cuda:0")
    torch.cuda.synchronize()
    check_views(out, tree_to(samples, "cuda:0"), tail)
    back = start_copy(out, "cpu").get()
    check_views(back, samples, tail)
