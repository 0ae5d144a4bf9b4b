"""bench/bench_openmmlab_train.py's plain-torch stand-ins (bench/openmmlab_train/ops.py) for the
kernels its models' steps call on the device and an mmcv built with its CPU ops lacks: they agree
with mmcv's CPU kernels (the voxelization bit for bit) and with torch's ``grid_sample``, are put in
place and taken back by ``install``, and the counter of mmcv's kernels counts."""
from __future__ import annotations

import pathlib
import sys
import warnings

import pytest

pytest.importorskip("mmcv.ops", reason="needs mmcv with its ops (README: OpenMMLab's stack)")
pytest.importorskip("mmdet", reason="needs mmdet (README: OpenMMLab's stack)")

import torch  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "bench"))

from openmmlab_train import ops  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::ImportWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_voxelization_is_bitwise_mmcvs(seed):
    """The stand-in against mmcv's CPU kernel on random points: hard (with the voxel cap and the
    per-voxel cap reached) and dynamic, every output bit for bit."""
    from mmcv.ops import voxelization

    g = torch.Generator().manual_seed(seed)
    n = [20000, 3000, 1][seed]
    pts = torch.rand(n, 5, generator=g) * torch.tensor([110.0, 110.0, 10.0, 255.0, 0.5]) \
        - torch.tensor([55.0, 55.0, 6.0, 0.0, 0.0])
    if seed == 1:  # crowded: many points per voxel
        pts[:, :2] = torch.rand(n, 2, generator=g) * 3
    rng, size = [-51.2, -51.2, -5.0, 51.2, 51.2, 3.0], [0.2, 0.2, 8]
    for max_points, max_voxels in ((20, 30000), (3, 40), (20, 5)):
        want = voxelization(pts, size, rng, max_points, max_voxels, True)
        got = ops.voxelization(pts, size, rng, max_points, max_voxels)
        for w, o in zip(want, got):
            assert w.dtype == o.dtype and w.shape == o.shape and torch.equal(w, o), (max_points, max_voxels)
    assert torch.equal(voxelization(pts, size, rng, -1, -1), ops.voxelization(pts, size, rng, -1, -1))
    empty = ops.voxelization(pts[:0], size, rng, 20, 100)
    assert [tuple(t.shape) for t in empty] == [(0, 20, 5), (0, 3), (0,)]


@pytest.mark.parametrize("stride, padding, dilation, deform_groups", [(1, 1, 1, 1), (2, 1, 1, 2), (1, 2, 2, 1)])
def test_deform_conv_matches_mmcvs(stride, padding, dilation, deform_groups):
    from mmcv.ops import modulated_deform_conv2d

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 9, 11, dtype=torch.float64, generator=g, requires_grad=True)
    ho = (9 + 2 * padding - (dilation * 2 + 1)) // stride + 1
    wo = (11 + 2 * padding - (dilation * 2 + 1)) // stride + 1
    off = (3 * torch.randn(2, 2 * deform_groups * 9, ho, wo, dtype=torch.float64, generator=g)).requires_grad_()
    mask = torch.rand(2, deform_groups * 9, ho, wo, dtype=torch.float64, generator=g).requires_grad_()
    w = torch.randn(6, 8, 3, 3, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, generator=g, requires_grad=True)
    args = (stride, padding, dilation, 1, deform_groups)
    want = modulated_deform_conv2d(x, off, mask, w, b, *args)
    got = ops.modulated_deform_conv2d(x, off, mask, w, b, *args)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    grad = torch.randn_like(want)
    for gw, go in zip(torch.autograd.grad(want, [x, off, mask, w, b], grad),
                      torch.autograd.grad(got, [x, off, mask, w, b], grad)):
        torch.testing.assert_close(go, gw, rtol=1e-12, atol=1e-12)


def test_deform_conv_pack_has_mmcvs_parameters_and_output():
    from mmcv.ops import ModulatedDeformConv2dPack

    torch.manual_seed(0)
    theirs = ModulatedDeformConv2dPack(8, 8, 3, padding=1, deform_groups=2)
    ours = ops.ModulatedDeformConv2dPack(8, 8, 3, padding=1, deform_groups=2)
    assert {k: v.shape for k, v in theirs.state_dict().items()} == {k: v.shape for k, v in ours.state_dict().items()}
    assert not ours.conv_offset.weight.any() and not ours.conv_offset.bias.any()  # offsets start at 0, as mmcv's
    with torch.no_grad():
        theirs.conv_offset.weight.normal_(0, 0.1)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 8, 12, 10)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["nearest", "bilinear"])
@pytest.mark.parametrize("align_corners", [True, False])
def test_grid_sample_matches_torchs(mode, align_corners):
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    inp = torch.randn(2, 5, 13, 17, generator=g, requires_grad=True)
    grid = torch.rand(2, 3, 100, 2, generator=g) * 2.4 - 1.2  # some outside the image
    want = F.grid_sample(inp, grid, mode=mode, padding_mode="zeros", align_corners=align_corners)
    got = ops.grid_sample(inp, grid, mode=mode, padding_mode="zeros", align_corners=align_corners)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    (gw,), (go,) = torch.autograd.grad(want.sum(), inp), torch.autograd.grad(got.sum(), inp)
    torch.testing.assert_close(go, gw, rtol=1e-5, atol=1e-5)
    if mode == "nearest":
        assert torch.equal(got, want)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_focal_loss_is_mmdets_formula(reduction):
    """mmcv's kernel has no CPU implementation: compared with mmdet's own route for CPU tensors
    (one-hot targets, ``py_sigmoid_focal_loss``), whose formula is the same."""
    import torch.nn.functional as F

    from mmdet.models.losses.focal_loss import py_sigmoid_focal_loss

    g = torch.Generator().manual_seed(0)
    pred = torch.randn(50, 3, generator=g, requires_grad=True)
    target = torch.randint(0, 4, (50,), generator=g)  # 3: no class
    got = ops.sigmoid_focal_loss(pred, target, 2.0, 0.25, None, reduction)
    one_hot = F.one_hot(target, 4)[:, :3]
    want = py_sigmoid_focal_loss(pred, one_hot, None, 2.0, 0.25, "none")
    want = {"none": want, "sum": want.sum(), "mean": want.sum() / 50}[reduction]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    (gw,), (go,) = torch.autograd.grad(want.sum(), pred), torch.autograd.grad(got.sum(), pred)
    torch.testing.assert_close(go, gw, rtol=1e-4, atol=1e-6)


def test_install_puts_the_stand_ins_in_place_and_back():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in ("mmdet3d", "pyquaternion", "trimesh"):
            pytest.importorskip(name, reason="needs mmdet3d and its runtime imports (README: OpenMMLab's stack)")
    import mmdet.models.losses.focal_loss as focal
    import mmdet3d.models.data_preprocessors.voxelize as voxelize
    import mmdet3d.models.layers.fusion_layers.point_fusion as point_fusion
    from mmengine.registry import MODELS as REGISTRY

    before = (voxelize.voxelization, focal._sigmoid_focal_loss, point_fusion.F, REGISTRY.get("DCNv2"))
    restore = ops.install(list(ops.STAND_INS))
    try:
        assert voxelize.voxelization is ops.voxelization
        assert focal._sigmoid_focal_loss is ops.sigmoid_focal_loss
        assert point_fusion.F.grid_sample is ops.grid_sample and point_fusion.F.relu is torch.nn.functional.relu
        assert REGISTRY.get("DCNv2") is ops.ModulatedDeformConv2dPack
    finally:
        restore()
    assert (voxelize.voxelization, focal._sigmoid_focal_loss, point_fusion.F, REGISTRY.get("DCNv2")) == before
    with pytest.raises(ValueError, match="no stand-in"):
        ops.install(["nonesuch"])


def test_kernel_counter_counts_mmcvs_kernels():
    from mmcv.ops import voxelization

    pts = torch.rand(100, 4) * 10
    with ops.KernelCounter() as counter:
        voxelization(pts, [1.0, 1.0, 10.0], [0, 0, 0, 10, 10, 10], 5, 50, True)
        ops.voxelization(pts, [1.0, 1.0, 10.0], [0, 0, 0, 10, 10, 10], 5, 50)
    assert counter.calls == {"hard_voxelize_forward": 1}
    voxelization(pts, [1.0, 1.0, 10.0], [0, 0, 0, 10, 10, 10], 5, 50, True)
    assert counter.calls == {"hard_voxelize_forward": 1}  # no longer counting
