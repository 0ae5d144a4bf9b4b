"""The two makers of output views: torch's AOTInductor C shim (one C call per output; where torch
has it) and torch's split operators (the fallback, and what ``MTC_TORCH_SHIM=0`` selects). The
shim's handles become Python tensors through torch's own wrapper, one C call each, where this
torch passes its check, else through ``torch._C._aoti`` in one Python call per batch: both
routes are compared too. Every layout rule holds for each, and they agree tensor by tensor:
dtype, shape, strides, storage offset, the storage each output shares with the others of its
dtype in its chunk, the bytes, ``requires_grad`` (False), and neither makes autograd views
(``_base`` is None, as for ``tensor.to()``'s outputs).

The structures are the fuzzer's (tests/test_fuzz.py: every dtype, 0-d, zero-size, strided,
channels-last and offset leaves, at every alignment), through the DataLoader path
(``PackedCollate(list)`` then ``unpack``) on the CPU, and on a GPU through ``start_copy`` too.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mtc_loader
from conftest import requires_cuda, run_child, seed_batch
from mtc_loader import _engine
from test_fuzz import ALIGNMENTS, FUZZ_SETTINGS, as_bytes, check_tree, packed_collate, trees

OFFERED, _ = _engine._shim_info()
WRAP = _engine._shim_parts()["wrap"]
needs_shim = pytest.mark.skipif(not OFFERED, reason="this torch has no AOTInductor C shim")
CUDA = [pytest.mark.cuda, requires_cuda]

# see tests/test_fuzz.py: a failure would otherwise hide behind an INTERNALERROR
pytestmark = pytest.mark.filterwarnings("ignore:mypy_extensions.TypedDict is deprecated:DeprecationWarning")


class maker:
    """Selects the output maker for a block: ``with maker(shim=True): ...``; ``wrap=False`` turns
    the shim's handles into tensors through torch._C._aoti (one call per batch)."""

    def __init__(self, shim: bool, wrap: bool = True):
        self.shim, self.wrap = shim, wrap

    def __enter__(self) -> None:
        self.prev = _engine._use_shim(self.shim), _engine._use_shim_wrap(self.wrap)
        assert _engine._shim_info()[1] == (self.shim and OFFERED)
        assert _engine._shim_parts()["wrap_on"] == (self.wrap and WRAP)

    def __exit__(self, *exc) -> None:
        _engine._use_shim(self.prev[0])
        _engine._use_shim_wrap(self.prev[1])


# (shim, wrap): the shim with torch's wrapper, the shim with one call per batch, split operators
MAKERS = [(True, True), (True, False), (False, False)]


def tensors(out) -> list[torch.Tensor]:
    """The tensors of a structure, in traversal order."""
    found: list[torch.Tensor] = []

    def walk(x):
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        elif hasattr(x, "__dataclass_fields__"):
            for f in x.__dataclass_fields__:
                walk(getattr(x, f))

    walk(out)
    return found


def assert_same_layout(a_out, b_out) -> None:
    """Two outputs of the same input made by the two makers (a: the shim's): the same tensors, laid out the same
    over their storages, the same storages shared."""
    a, b = tensors(a_out), tensors(b_out)
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        where = f"tensor {i} ({tuple(x.shape)} {x.dtype})"
        assert (x.dtype, x.shape, x.device) == (y.dtype, y.shape, y.device), where
        assert x.stride() == y.stride(), f"{where}: strides {x.stride()} != {y.stride()}"
        assert x.storage_offset() == y.storage_offset(), where
        assert x.is_contiguous() == y.is_contiguous(), where
        assert not x.requires_grad and not y.requires_grad, where
        assert x._base is None and y._base is None, f"{where}: an output is an autograd view"
        assert torch.equal(as_bytes(x), as_bytes(y)), f"{where}: bytes differ"
    # which outputs share a storage: the same pattern
    def groups(ts):
        ids: dict[int, int] = {}
        return [ids.setdefault(t.untyped_storage().data_ptr(), len(ids)) if t.numel() else -1 for t in ts]
    assert groups(a) == groups(b)


def _unpack_both(samples, align, device):
    pc = packed_collate(align)
    outs = []
    for shim, wrap in MAKERS:
        with maker(shim, wrap):
            outs.append(pc(samples).unpack(device))
    if device.startswith("cuda"):
        torch.cuda.current_stream().synchronize()
    return outs


UNPACK_CASES = [pytest.param("cpu", id="cpu"), pytest.param("cuda:0", id="cuda:0", marks=CUDA)]


@needs_shim
@pytest.mark.parametrize("device", UNPACK_CASES)
@settings(max_examples=150, **FUZZ_SETTINGS)
@given(samples=st.lists(trees(max_leaves=16), min_size=1, max_size=4), align=st.sampled_from(ALIGNMENTS))
def test_unpack_makers_agree(device, samples, align):
    wrapped, stolen, split_out = _unpack_both(samples, align, device)
    check_tree(wrapped, samples, device, reuse=False, packed=True)
    assert_same_layout(wrapped, split_out)
    assert_same_layout(stolen, split_out)


@needs_shim
@pytest.mark.cuda
@requires_cuda
@settings(max_examples=150, **FUZZ_SETTINGS)
@given(data=st.data(), align=st.sampled_from(ALIGNMENTS))
def test_start_copy_makers_agree(data, align):
    tree = data.draw(trees(("cpu",)), label="tree")
    outs = []
    for shim, wrap in MAKERS:
        with maker(shim, wrap):
            outs.append(mtc_loader.start_copy(tree, "cuda:0", min_packed_alignment_bytes=align).get())
    torch.cuda.current_stream().synchronize()
    check_tree(outs[0], tree, "cuda:0", reuse=True)
    assert_same_layout(outs[0], outs[2])
    assert_same_layout(outs[1], outs[2])


@needs_shim
@pytest.mark.parametrize("wrap", [True, False], ids=["wrap", "batch-call"])
@pytest.mark.parametrize("device", UNPACK_CASES)
def test_seed_batch_through_the_shim_one_storage_per_dtype_no_gap_pieces(device, wrap):
    """The reference batch (528 small tensors of three dtypes, most of them leaving alignment
    gaps): every output made through the shim (counted), one storage per dtype at 16-byte aligned
    offsets, equal to the input, and no temporary kept for the prefetch service beyond a few."""
    batch = seed_batch(16)
    pc = mtc_loader.PackedCollate(list, arena_bytes=16 << 20)
    with maker(True, wrap):
        before = mtc_loader.stats()["shim_views"]
        prev = _engine.keep_temporaries(True)
        try:
            h = pc(batch).start_copy(device)
            out = h.get()
            kept = h._h.temporaries() if hasattr(h, "_h") else None
        finally:
            _engine.keep_temporaries(prev)
        made = mtc_loader.stats()["shim_views"] - before
    if device.startswith("cuda"):
        torch.cuda.current_stream().synchronize()
    outs = tensors(out)
    assert made == len(outs) == 528
    storages: dict[int, set] = {}
    for t in outs:
        storages.setdefault(t.untyped_storage().data_ptr(), set()).add(t.dtype)
    assert len(storages) == len({t.dtype for t in outs}) == 3
    assert all(len(dtypes) == 1 for dtypes in storages.values())
    assert all(t.data_ptr() % 16 == 0 for t in outs)
    check_tree(out, batch, device, reuse=False, packed=True)
    if kept is not None:
        # never a piece per gap
        assert len(kept) <= 8, len(kept)


@needs_shim
def test_requires_grad_and_version_counters_are_the_outputs_own():
    """Outputs are independent tensors, as tensor.to() makes them: an in-place change of one
    does not bump another's version, and each can require grad on its own."""
    pc = mtc_loader.PackedCollate(list, arena_bytes=1 << 20)
    with maker(True):
        out = pc([{"a": torch.arange(5.0), "b": torch.arange(3.0)}]).unpack("cpu")
    a, b = out[0]["a"], out[0]["b"]
    v = b._version
    a.add_(1)
    assert b._version == v
    assert torch.equal(a, torch.arange(1.0, 6.0)) and torch.equal(b, torch.arange(3.0))
    a.requires_grad_(True)
    (a * 2).sum().backward()
    assert torch.equal(a.grad, torch.full((5,), 2.0)) and not b.requires_grad


_INFO = """
import json, torch, mtc_loader
from mtc_loader import _engine
pc = mtc_loader.PackedCollate(list, arena_bytes=1 << 20)
out = pc([{"a": torch.arange(5.0), "b": torch.ones(3, dtype=torch.bool)}]).unpack("cpu")
print(json.dumps({"info": _engine._shim_info(), "shim_views": mtc_loader.stats()["shim_views"],
                  "maker": mtc_loader.output_maker(), "ok": bool(torch.equal(out[0]["a"], torch.arange(5.0)))}))
"""


@needs_shim
def test_switch_off_makes_outputs_with_split_operators():
    on = run_child(_INFO)
    assert on["info"] == [True, True] and on["shim_views"] == 2 and on["ok"]
    assert {k: on["maker"][k] for k in ("maker", "reason", "wrap")} == {"maker": "shim", "reason": None, "wrap": WRAP}
    assert on["maker"]["reasons"]["shim"] is None
    off = run_child(_INFO, MTC_TORCH_SHIM="0")
    assert off["info"] == [True, False] and off["shim_views"] == 0 and off["ok"]
    assert off["maker"]["maker"] == "split" and "MTC_TORCH_SHIM=0" in off["maker"]["reason"]
