"""Plain-torch stand-ins for the few kernels that bench_openmmlab_train.py's models call on the
device in a training step and that an mmcv built with its CPU ops lacks (or that torch has no
deterministic CUDA backward for). They are installed in the benchmark's own process only, by
:func:`install`, never by mtc_loader; both arms of a pair use the same ones, so they change
neither arm's data path.

- mmcv's hard voxelization (``hard_voxelize_forward``), in mmdet3d's ``Det3DDataPreprocessor``
  with ``voxel=True`` (CenterPoint): :func:`voxelization`, equal bit for bit to mmcv's CPU
  kernel (the same float operations, the same order of voxels and of points in them);
- mmcv's ``DCNv2`` (modulated deformable convolution), in mmdet's ResNet with ``dcn=`` (the
  multi-view FCOS3D's backbone): :class:`ModulatedDeformConv2dPack`, the same parameters,
  initialisation and sampling;
- ``F.grid_sample``, whose CUDA backward adds atomically (no deterministic kernel), in mmdet3d's
  ``point_sample`` (the multi-view FCOS3D's lifting of image features into its voxels):
  :func:`grid_sample`, nearest or bilinear with zero padding;
- mmcv's ``sigmoid_focal_loss``, which mmdet's ``FocalLoss`` calls for CUDA tensors (the
  multi-view FCOS3D's Anchor3DHead): :func:`sigmoid_focal_loss`, mmcv's formula elementwise.

The sampling ones take whole pixels with ``index_select``: their backward adds them back with one
sorted index per pixel, which torch does deterministically on CUDA.
"""
from __future__ import annotations

import math
import sys
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import Tensor, nn

Pair = Union[int, Sequence[int]]


# ------------------------------------------------------------------------- voxelization

def _float3(values: Any, device: torch.device) -> Tensor:
    return torch.as_tensor(values, dtype=torch.float32).to(device).flatten()


def voxel_coords(points: Tensor, voxel_size: Any, coors_range: Any) -> tuple[Tensor, Tensor, list[int]]:
    """Each point's voxel, (z, y, x) as int32, whether it lies inside the grid, and the grid's
    shape (x, y, z): mmcv's ``floor((p - range_min) / voxel_size)`` in float32, the grid
    ``round((max - min) / size)``."""
    size = _float3(voxel_size, points.device)
    rng = _float3(coors_range, points.device)
    grid = torch.round((rng[3:] - rng[:3]) / size).to(torch.int64)
    c = torch.floor((points[:, :3].to(torch.float32) - rng[:3]) / size).to(torch.int64)
    inside = ((c >= 0) & (c < grid)).all(dim=1)
    return c.flip(1).to(torch.int32), inside, [int(g) for g in grid.tolist()]


def voxelization(points: Tensor, voxel_size: Any, coors_range: Any, max_points: int = 35,
                 max_voxels: int = 20000, deterministic: bool = True) -> Any:
    """mmdet3d's / mmcv's ``voxelization`` (``_Voxelization.apply``) in plain torch, on any device.

    Hard voxelization (``max_points`` and ``max_voxels`` not -1): voxels numbered in the order of
    their first point, at most ``max_voxels`` of them, each holding its first ``max_points``
    points in the order given; returns ``(voxels [M, max_points, C], coors [M, 3] int32 (z, y, x),
    num_points [M] int32)``. Dynamic (either is -1): each point's ``coors`` (-1 outside the grid).
    ``deterministic`` is accepted for the signature: this is always deterministic."""
    coors, inside, (gx, gy, _) = voxel_coords(points, voxel_size, coors_range)
    if max_points == -1 or max_voxels == -1:
        return torch.where(inside[:, None], coors, torch.full_like(coors, -1))
    n, channels = points.shape
    dev = points.device
    idx = torch.nonzero(inside).flatten()  # the points inside, in order
    if idx.numel() == 0:
        return (points.new_zeros((0, max_points, channels)), coors.new_zeros((0, 3)),
                coors.new_zeros((0,)))
    c = coors[idx].to(torch.int64)
    key = (c[:, 0] * gy + c[:, 1]) * gx + c[:, 2]
    key_sorted, order = torch.sort(key, stable=True)  # same voxel: consecutive, in point order
    starts = torch.ones_like(key_sorted, dtype=torch.bool)
    starts[1:] = key_sorted[1:] != key_sorted[:-1]
    group = torch.cumsum(starts.to(torch.int64), 0) - 1  # the voxel (by key) of each sorted point
    start_pos = torch.nonzero(starts).flatten()
    rank_in_voxel = torch.arange(len(order), device=dev) - start_pos[group]
    first_point = order[start_pos]  # per voxel (by key): its first point (an index into idx)
    # voxels numbered in the order of their first point
    voxel_order = torch.argsort(first_point, stable=True)
    number = torch.empty_like(voxel_order)
    number[voxel_order] = torch.arange(len(voxel_order), device=dev)
    n_voxels = min(len(voxel_order), max_voxels)
    vox = number[group]  # each sorted point's voxel number
    keep = (vox < n_voxels) & (rank_in_voxel < max_points)
    voxels = points.new_zeros((n_voxels, max_points, channels))
    voxels[vox[keep], rank_in_voxel[keep]] = points[idx[order[keep]]]
    counts = torch.zeros(n_voxels, dtype=torch.int64, device=dev)
    kept_voxels = number < n_voxels
    sizes = torch.diff(torch.cat([start_pos, start_pos.new_tensor([len(order)])]))
    counts[number[kept_voxels]] = sizes[kept_voxels].clamp(max=max_points)
    out_coors = coors.new_zeros((n_voxels, 3))
    out_coors[number[kept_voxels]] = coors[idx[first_point[kept_voxels]]]
    return voxels, out_coors, counts.to(torch.int32)


# ------------------------------------------------------------------------- sampling

def _bilinear_taps(h: Tensor, w: Tensor, height: int, width: int) -> list[tuple[Tensor, Tensor]]:
    """The four corners of (h, w) (float, any shape): each corner's flat index into a
    ``height x width`` plane (clamped inside) and its weight (0 where the corner is outside),
    with mmcv's ``dmcn_im2col_bilinear`` / torch's arithmetic."""
    h_low = torch.floor(h)
    w_low = torch.floor(w)
    lh, lw = h - h_low, w - w_low
    hh, hw = 1 - lh, 1 - lw
    h0, w0 = h_low.to(torch.int64), w_low.to(torch.int64)
    taps = []
    for dh, dw, weight in ((0, 0, hh * hw), (0, 1, hh * lw), (1, 0, lh * hw), (1, 1, lh * lw)):
        hi, wi = h0 + dh, w0 + dw
        valid = (hi >= 0) & (hi <= height - 1) & (wi >= 0) & (wi <= width - 1)
        flat = hi.clamp(0, height - 1) * width + wi.clamp(0, width - 1)
        taps.append((flat, torch.where(valid, weight, torch.zeros_like(weight))))
    return taps


def modulated_deform_conv2d(x: Tensor, offset: Tensor, mask: Tensor, weight: Tensor, bias: Optional[Tensor],
                            stride: Pair = 1, padding: Pair = 0, dilation: Pair = 1, groups: int = 1,
                            deform_groups: int = 1) -> Tensor:
    """mmcv's ``modulated_deform_conv2d`` (DCNv2) in plain torch: the offsets' layout (per
    deformable group and kernel tap: dh, dw), the sampling (bilinear, zero outside the image, 0
    where the point lies beyond a pixel of it) and the mask as mmcv's kernel has them; then the
    columns times the weight. The samples are whole pixels (all channels) taken by
    ``index_select`` from the image as rows: its backward adds them back with one sorted index per
    pixel, deterministic on CUDA (a gather of every channel would sort an index per value)."""
    sh, sw = torch.nn.modules.utils._pair(stride)
    ph, pw = torch.nn.modules.utils._pair(padding)
    dh, dw = torch.nn.modules.utils._pair(dilation)
    b, c, height, width = x.shape
    c_out, c_in_g, kh, kw = weight.shape
    taps = kh * kw
    ho = (height + 2 * ph - (dh * (kh - 1) + 1)) // sh + 1
    wo = (width + 2 * pw - (dw * (kw - 1) + 1)) // sw + 1
    dg = deform_groups
    dev = x.device
    off = offset.reshape(b, dg, taps, 2, ho, wo)
    ki = torch.arange(kh, device=dev).repeat_interleave(kw)
    kj = torch.arange(kw, device=dev).repeat(kh)
    base_h = (torch.arange(ho, device=dev) * sh - ph).view(1, 1, 1, ho, 1) + (ki * dh).view(1, 1, taps, 1, 1)
    base_w = (torch.arange(wo, device=dev) * sw - pw).view(1, 1, 1, 1, wo) + (kj * dw).view(1, 1, taps, 1, 1)
    h = base_h.to(x.dtype) + off[:, :, :, 0]  # (b, dg, taps, ho, wo)
    w = base_w.to(x.dtype) + off[:, :, :, 1]
    inside = (h > -1) & (w > -1) & (h < height) & (w < width)
    # the image as rows: (b, dg, pixel) -> the group's channels
    rows = x.reshape(b, dg, c // dg, height * width).transpose(2, 3).reshape(b * dg * height * width, c // dg)
    plane = (torch.arange(b * dg, device=dev) * (height * width)).view(b, dg, 1, 1, 1)
    cols: Optional[Tensor] = None
    for flat, wt in _bilinear_taps(h, w, height, width):
        wt = torch.where(inside, wt, torch.zeros_like(wt))
        v = rows.index_select(0, (flat + plane).reshape(-1)) * wt.reshape(-1, 1)
        cols = v if cols is None else cols + v
    assert cols is not None
    cols = cols * mask.reshape(-1, 1)  # (b * dg * taps * ho * wo, c/dg)
    cols = cols.reshape(b, dg, taps, ho * wo, c // dg).permute(0, 1, 4, 2, 3)  # (b, dg, c/dg, taps, L)
    cols = cols.reshape(b, groups, c_in_g * taps, ho * wo)  # (channel, tap) as the weight's layout
    out = torch.matmul(weight.reshape(groups, c_out // groups, c_in_g * taps), cols)
    out = out.reshape(b, c_out, ho, wo)
    if bias is not None:
        out = out + bias.view(1, -1, 1, 1)
    return out


class ModulatedDeformConv2dPack(nn.Module):
    """mmcv's ``ModulatedDeformConv2dPack`` (registered as ``DCNv2``) with the same parameters,
    buffers' names and initialisation, computed by :func:`modulated_deform_conv2d`."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: Pair, stride: Pair = 1,
                 padding: Pair = 0, dilation: Pair = 1, groups: int = 1, deform_groups: int = 1,
                 bias: Union[bool, str] = True) -> None:
        super().__init__()
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size = torch.nn.modules.utils._pair(kernel_size)
        self.stride = torch.nn.modules.utils._pair(stride)
        self.padding = torch.nn.modules.utils._pair(padding)
        self.dilation = torch.nn.modules.utils._pair(dilation)
        self.groups, self.deform_groups = groups, deform_groups
        self.transposed, self.output_padding = False, (0, 0)
        self.weight = nn.Parameter(torch.Tensor(out_channels, in_channels // groups, *self.kernel_size))
        self.bias: Optional[nn.Parameter]
        if bias:
            self.bias = nn.Parameter(torch.Tensor(out_channels))
        else:
            self.register_parameter("bias", None)
        self.conv_offset = nn.Conv2d(in_channels, deform_groups * 3 * self.kernel_size[0] * self.kernel_size[1],
                                     kernel_size=self.kernel_size, stride=self.stride, padding=self.padding,
                                     dilation=self.dilation, bias=True)
        self.init_weights()

    def init_weights(self) -> None:
        n = self.in_channels * self.kernel_size[0] * self.kernel_size[1]
        stdv = 1.0 / math.sqrt(n)
        self.weight.data.uniform_(-stdv, stdv)
        if self.bias is not None:
            self.bias.data.zero_()
        self.conv_offset.weight.data.zero_()
        assert self.conv_offset.bias is not None
        self.conv_offset.bias.data.zero_()

    def forward(self, x: Tensor) -> Tensor:
        out = self.conv_offset(x)
        o1, o2, mask = torch.chunk(out, 3, dim=1)
        offset = torch.cat((o1, o2), dim=1)
        return modulated_deform_conv2d(x, offset, torch.sigmoid(mask), self.weight, self.bias, self.stride,
                                       self.padding, self.dilation, self.groups, self.deform_groups)


def grid_sample(input: Tensor, grid: Tensor, mode: str = "bilinear", padding_mode: str = "zeros",
                align_corners: Optional[bool] = None) -> Tensor:
    """``F.grid_sample`` for 4-D input, ``mode`` nearest or bilinear, ``padding_mode`` zeros, by
    ``index_select`` of whole pixels (torch's CUDA backward of ``grid_sample`` adds atomically:
    not deterministic; this one's adds with a sorted index, deterministic). The coordinates are
    unnormalised and rounded as torch's kernel does (nearest: half to even)."""
    if padding_mode != "zeros" or mode not in ("nearest", "bilinear") or input.dim() != 4:
        raise NotImplementedError(f"bench grid_sample: mode={mode!r}, padding_mode={padding_mode!r}, "
                                  f"{input.dim()}-D input")
    n, c, height, width = input.shape
    gx, gy = grid[..., 0], grid[..., 1]  # (n, Hg, Wg)
    if align_corners:
        x = ((gx + 1) / 2) * (width - 1)
        y = ((gy + 1) / 2) * (height - 1)
    else:
        x = ((gx + 1) * width - 1) / 2
        y = ((gy + 1) * height - 1) / 2
    rows = input.reshape(n, c, height * width).transpose(1, 2).reshape(n * height * width, c)
    plane = (torch.arange(n, device=input.device) * (height * width)).view(n, 1, 1)

    def take(flat: Tensor) -> Tensor:  # (n, Hg, Wg) pixel indices -> (n * Hg * Wg, c)
        return rows.index_select(0, (flat + plane).reshape(-1))

    if mode == "nearest":
        xi, yi = torch.round(x).to(torch.int64), torch.round(y).to(torch.int64)
        valid = (xi >= 0) & (xi < width) & (yi >= 0) & (yi < height)
        out = take(yi.clamp(0, height - 1) * width + xi.clamp(0, width - 1)) * valid.reshape(-1, 1).to(input.dtype)
    else:
        result: Optional[Tensor] = None
        for flat, wt in _bilinear_taps(y, x, height, width):
            v = take(flat) * wt.reshape(-1, 1)
            result = v if result is None else result + v
        assert result is not None
        out = result
    return out.reshape(n, grid.shape[1], grid.shape[2], c).permute(0, 3, 1, 2)


def sigmoid_focal_loss(input: Tensor, target: Tensor, gamma: float = 2.0, alpha: float = 0.25,
                       weight: Optional[Tensor] = None, reduction: str = "mean") -> Tensor:
    """mmcv's ``sigmoid_focal_loss`` (targets as class indices, ``num_classes`` meaning none),
    elementwise in plain torch with its formula: ``-alpha (1-p)^gamma log(p)`` for the target
    class, ``-(1-alpha) p^gamma log(1-p)`` for the others, logs of at least FLT_MIN."""
    p = 1.0 / (1.0 + torch.exp(-input))
    tiny = torch.finfo(torch.float32).tiny
    classes = torch.arange(input.shape[1], device=input.device)
    is_target = (target.view(-1, 1) == classes).to(input.dtype)
    term_p = torch.pow(1.0 - p, gamma) * torch.log(torch.clamp(p, min=tiny))
    term_n = torch.pow(p, gamma) * torch.log(torch.clamp(1.0 - p, min=tiny))
    loss = -is_target * alpha * term_p - (1.0 - is_target) * (1.0 - alpha) * term_n
    if weight is not None:
        raise NotImplementedError("bench sigmoid_focal_loss: a class weight (mmdet passes none)")
    if reduction == "mean":
        return loss.sum() / input.size(0)
    if reduction == "sum":
        return loss.sum()
    return loss


class _FunctionalWithGridSample:
    """``torch.nn.functional`` with :func:`grid_sample` in place of its own, for one module's
    ``F`` (mmdet3d's point_fusion)."""

    def __getattr__(self, name: str) -> Any:
        if name == "grid_sample":
            return grid_sample
        return getattr(torch.nn.functional, name)


# ------------------------------------------------------------------------- installing them

STAND_INS = {
    "voxelization": "mmcv hard voxelization (Det3DDataPreprocessor) -> plain torch, bitwise equal to mmcv's CPU kernel",
    "dcnv2": "mmcv DCNv2 (ResNet dcn=) -> plain torch ModulatedDeformConv2dPack (index_select of pixels)",
    "grid_sample": "F.grid_sample in mmdet3d point_sample -> index_select of pixels (deterministic backward on CUDA)",
    "focal_loss": "mmcv sigmoid_focal_loss (mmdet FocalLoss on CUDA) -> plain torch, mmcv's formula",
}


def install(names: Sequence[str]) -> Callable[[], None]:
    """Puts the stand-ins ``names`` (keys of :data:`STAND_INS`) in place in this process: module
    attributes of mmdet3d / mmdet and mmengine's ``DCNv2`` registration. Returns the function
    that puts the originals back."""
    undo: list[Callable[[], None]] = []

    def swap(module: Any, attr: str, value: Any) -> None:
        old = getattr(module, attr)
        setattr(module, attr, value)
        undo.append(lambda: setattr(module, attr, old))

    for name in names:
        if name == "voxelization":
            import mmdet3d.models.data_preprocessors.voxelize as voxelize
            swap(voxelize, "voxelization", voxelization)
        elif name == "dcnv2":
            import mmcv.ops  # noqa: F401  (registers mmcv's DCNv2 first)
            from mmengine.registry import MODELS
            old = MODELS.get("DCNv2")
            MODELS.register_module("DCNv2", force=True, module=ModulatedDeformConv2dPack)

            def register_old(old: Any = old) -> None:
                MODELS.register_module("DCNv2", force=True, module=old)
            undo.append(register_old)
        elif name == "grid_sample":
            import mmdet3d.models.layers.fusion_layers.point_fusion as point_fusion
            swap(point_fusion, "F", _FunctionalWithGridSample())
        elif name == "focal_loss":
            import mmdet.models.losses.focal_loss as focal
            swap(focal, "_sigmoid_focal_loss", sigmoid_focal_loss)
        else:
            raise ValueError(f"no stand-in {name!r} (known: {', '.join(STAND_INS)})")

    def restore() -> None:
        for fn in reversed(undo):
            fn()
    return restore


class KernelCounter:
    """Counts the calls of every function of mmcv's compiled extension (``mmcv._ext``) in this
    process while active: which mmcv kernels a training step still calls."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> "KernelCounter":
        ext = sys.modules.get("mmcv._ext")
        if ext is None:
            return self
        for attr in dir(ext):
            fn = getattr(ext, attr)
            if attr.startswith("_") or not callable(fn):
                continue
            self._saved[attr] = fn

            def counted(*args: Any, _fn: Any = fn, _name: str = attr, **kwargs: Any) -> Any:
                self.calls[_name] = self.calls.get(_name, 0) + 1
                return _fn(*args, **kwargs)
            setattr(ext, attr, counted)
        return self

    def __exit__(self, *exc: Any) -> None:
        ext = sys.modules.get("mmcv._ext")
        for attr, fn in self._saved.items():
            setattr(ext, attr, fn)
        self._saved.clear()
