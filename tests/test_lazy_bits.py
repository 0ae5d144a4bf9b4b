"""Lazily negated and conjugated views (``torch._neg_view(x)``, ``z.conj()``, ``z.conj().imag``
and views of those): every path gives the resolved values, whatever the leaf's dtype and layout,
as ``x.to(device)`` / ``x.resolve_neg()`` would. Neither the DLPack description nor the dims of
a tensor carry these bits, so a reader that skips them copies the un-negated bytes."""
from __future__ import annotations

import warnings

import pytest
import torch

import mtc_loader
from mtc_loader import PackedCollate, start_copy
from mtc_loader._dtypes import DTYPES
from mtc_loader._tree import OnHost

from conftest import HAS_CUDA, requires_cuda


def _source(dt: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bytes viewed as dt (finite values for floating dtypes, so that equality is
    bitwise-meaningful), of the given shape."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    if (dt.is_floating_point or dt.is_complex) and dt.itemsize >= 2:
        with warnings.catch_warnings():  # "ComplexHalf support is experimental"
            warnings.simplefilter("ignore")
            t = (torch.rand(n * 2, generator=g, dtype=torch.float64) * 200 - 100)
            t = torch.view_as_complex(t.view(n, 2)) if dt.is_complex else t[:n]
            return t.to(dt).reshape(shape)
    raw = torch.randint(0, 256, (n * dt.itemsize,), dtype=torch.uint8, generator=g)
    if dt == torch.bool:
        raw = raw & 1
    return raw.view(dt).reshape(shape)


def _negatable(dt: torch.dtype) -> bool:
    """Whether torch can compute -x for dt (bool, float8, uint16..64, bits* it cannot)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch._neg_view(torch.zeros(2 * max(dt.itemsize, 1), dtype=torch.uint8).view(dt)[:1]).resolve_neg()
        return True
    except (NotImplementedError, RuntimeError):
        return False


NEGATABLE = [dt for dt in DTYPES if _negatable(dt)]
NOT_NEGATABLE = [dt for dt in DTYPES if not _negatable(dt)]
COMPLEX = [dt for dt in DTYPES if dt.is_complex]

# layouts of the negated view: contiguous (the case the bits were once skipped for), one
# element, 0-d, transposed, sliced with gaps, channels_last, expanded, empty
LAYOUTS = {
    "contiguous": lambda t: t,
    "one": lambda t: t.reshape(-1)[:1],
    "scalar": lambda t: t.reshape(-1)[0],
    "transposed": lambda t: t.t(),
    "sliced": lambda t: t[:, ::2],
    "channels_last": lambda t: t.reshape(1, 2, 3, 4).contiguous(memory_format=torch.channels_last),
    "expanded": lambda t: t[:1].expand(5, 12),
    "empty": lambda t: t[:0],
}


def _neg_view(dt: torch.dtype, layout: str, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    base = LAYOUTS[layout](_source(dt, (2, 12), seed).to(device))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        v = torch._neg_view(base)
    assert v.is_neg()
    return v


def _conj_view(dt: torch.dtype, layout: str, imag: bool, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    v = LAYOUTS[layout](_source(dt, (2, 12), seed).to(device)).conj()
    return v.imag if imag else v


def _resolved(v: torch.Tensor, device: str = "cpu") -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return v.to(device).resolve_conj().resolve_neg()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of t's values in row-major order, on the CPU (t has no lazy bit)."""
    flat = torch.empty(t.numel(), dtype=t.dtype).copy_(t.detach().cpu().reshape(-1))
    return flat.view(torch.uint8)


def _check(out: torch.Tensor, ref: torch.Tensor, where: str) -> None:
    """out has no lazy bit and is bitwise ref (values, dtype, shape, device)."""
    assert isinstance(out, torch.Tensor), where
    assert not out.is_neg() and not out.is_conj(), f"{where}: lazy bit still set"
    assert out.dtype == ref.dtype and out.shape == ref.shape and out.device == ref.device, where
    assert not ref.is_neg() and not ref.is_conj(), where
    assert torch.equal(_bytes(out), _bytes(ref)), f"{where}: bytes differ"


def _views(dt: torch.dtype, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Lazy views of every layout, made on ``device`` (copying a lazy view resolves it)."""
    views = {f"neg_{k}": _neg_view(dt, k, i, device) for i, k in enumerate(LAYOUTS)}
    if dt.is_complex:
        for i, k in enumerate(LAYOUTS):
            views[f"conj_{k}"] = _conj_view(dt, k, False, 100 + i, device)
            views[f"conj_imag_{k}"] = _conj_view(dt, k, True, 200 + i, device)
    return views


def _cpu_paths(data: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """The CPU-side paths: start_copy to the CPU (reuse, on the calling thread and the
    transfer thread), a packed batch unpacked on the CPU, and the same under OnHost."""
    out = {
        "start_copy_cpu": start_copy(data, "cpu").get(),
        "start_copy_cpu_sync": start_copy(data, "cpu", use_background_thread=False).get(),
    }
    pc = PackedCollate(collate_fn=lambda s: s[0], arena_bytes=4 << 20)
    out["packed"] = pc([data]).unpack()
    out["packed_on_host"] = pc([{"h": OnHost(data)}]).unpack()["h"]
    return out


@pytest.mark.parametrize("dt", NEGATABLE, ids=str)
def test_lazy_views_every_dtype_and_layout_cpu(dt):
    data = _views(dt)
    for path, got in _cpu_paths(data).items():
        assert list(got) == list(data), path
        for k, v in data.items():
            _check(got[k], _resolved(v), f"{path}: data[{k!r}] ({dt})")


def test_neg_view_of_contiguous_tensor_packed_and_reused():
    """The plain case: a contiguous float and int negated view of more than one element."""
    for base in (torch.tensor([1.0, 2.0, -4.0, 8.0]), torch.tensor([1, 2, -4, 8])):
        v = torch._neg_view(base)
        out = start_copy(v, "cpu").get()
        assert out is not v and not out.is_neg()
        assert torch.equal(out, -base)
        out.numpy()  # a tensor with the negative bit cannot become an array
        packed = PackedCollate(collate_fn=lambda s: s[0], arena_bytes=1 << 20)([{"a": v}]).unpack()["a"]
        assert torch.equal(packed, -base) and not packed.is_neg()


def test_lazy_views_through_tensor_subclass_and_without_dlpack_reader():
    """The attribute reader (tensor subclasses, and the engine without the DLPack reader)
    reads the bits as the DLPack reader does."""
    class Sub(torch.Tensor):
        pass

    base = torch.tensor([3.0, -1.0, 2.0])
    v = torch._neg_view(base)
    out = start_copy([v.as_subclass(Sub)], "cpu").get()[0]
    assert not out.is_neg() and torch.equal(out.as_subclass(torch.Tensor), -base)
    prev = mtc_loader._engine._use_dlpack(False)
    try:
        out = start_copy([v], "cpu").get()[0]
        assert not out.is_neg() and torch.equal(out, -base)
    finally:
        mtc_loader._engine._use_dlpack(prev)


@pytest.mark.parametrize("dt", NOT_NEGATABLE, ids=str)
def test_neg_view_of_dtype_torch_cannot_negate_is_refused(dt):
    """A negated view whose values torch cannot compute (.to() fails on it too) is refused with
    a TypeError naming the leaf, on every path, rather than copied as its un-negated bytes."""
    v = _neg_view(dt, "contiguous")
    with pytest.raises(TypeError, match=r"^mtc_loader: data\[0\]\['x'\] is a lazily negated view"):
        start_copy([{"x": v}], "cpu").get()
    with pytest.raises(TypeError, match=r"is a lazily negated view \(is_neg\(\)\) of dtype"):
        PackedCollate(collate_fn=lambda s: s[0], arena_bytes=1 << 20)([{"x": v}])


def _cuda_paths(data: dict[str, torch.Tensor], dev: str) -> dict[str, dict[str, torch.Tensor]]:
    out = {
        "packed_h2d": start_copy(data, dev).get(),
        "staged_h2d": start_copy(data, dev, pack_cpu_tensors=False).get(),
        "direct_h2d": start_copy(data, dev, use_pinned_staging=False, pack_cpu_tensors=False).get(),
        "sync_h2d": start_copy(data, dev, use_background_thread=False).get(),
    }
    pc = PackedCollate(collate_fn=lambda s: s[0], arena_bytes=4 << 20)
    out["packed_batch_to_cuda"] = pc([data]).to(dev)
    out["packed_batch_on_host"] = pc([{"h": OnHost(data)}]).to(dev)["h"]
    torch.cuda.synchronize()
    return out


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dt", NEGATABLE, ids=str)
def test_lazy_views_every_dtype_and_layout_cuda(dt):
    """CPU lazy views to the GPU (packed, staged, direct, calling thread, PackedBatch and
    OnHost), and GPU lazy views to the CPU (packed D2H, own outputs, pageable) and to the same
    GPU (reuse)."""
    data = _views(dt)
    for path, got in _cuda_paths(data, "cuda:0").items():
        where_cpu = path == "packed_batch_on_host"
        for k, v in data.items():
            _check(got[k], _resolved(v, "cpu" if where_cpu else "cuda:0"), f"{path}: data[{k!r}] ({dt})")
    gpu = _views(dt, "cuda:0")
    assert all(v.is_neg() or v.is_conj() for v in gpu.values())
    for name, kw in (("d2h_packed", {}), ("d2h_own", {"pack_cpu_tensors": False}),
                     ("d2h_pageable", {"use_pinned_staging": False})):
        got = start_copy(gpu, "cpu", **kw).get()
        torch.cuda.synchronize()
        for k, v in gpu.items():
            _check(got[k], _resolved(v, "cpu"), f"{name}: data[{k!r}] ({dt})")
    got = start_copy(gpu, "cuda:0").get()
    torch.cuda.synchronize()
    for k, v in gpu.items():
        _check(got[k], _resolved(v, "cuda:0"), f"d2d_same: data[{k!r}] ({dt})")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.cuda
def test_lazy_views_gpu_to_gpu():
    data = {**_views(torch.float32), **{f"c_{k}": v for k, v in _views(torch.complex64).items()}}
    gpu = {k: v.to("cuda:0") for k, v in data.items()}
    got = start_copy(gpu, "cuda:1").get()
    torch.cuda.synchronize()
    for k, v in gpu.items():
        _check(got[k], _resolved(v, "cuda:1"), f"d2d: data[{k!r}]")


def test_the_reference_to_keeps_bits_on_the_cpu():
    """Why the reference above is resolved: .to() on the same device returns the view itself."""
    v = torch._neg_view(torch.ones(3))
    assert v.to("cpu") is v and v.is_neg()
    assert not HAS_CUDA or not torch._neg_view(torch.ones(3)).to("cuda").resolve_neg().is_neg()
