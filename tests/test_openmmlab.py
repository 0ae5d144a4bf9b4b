"""Real OpenMMLab samples (mmdet3d 1.4 / mmdet 3.3 / mmcv 2.1 structures) through mtc_loader, with
no registration of ours: start_copy, PackedCollate (0 and 2 workers, fork and spawn) and
``Runner.train()`` with the config switch give the model what mmengine's own path gives it,
bitwise and class for class, on the device where mmengine puts each value.

Skipped where the stack is absent (README: "OpenMMLab's stack for the tests"). The dataset and the
sample builder are module-level so that spawn workers can unpickle them.
"""
from __future__ import annotations

import warnings
from unittest import mock

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

with warnings.catch_warnings():  # the stack's imports warn (deprecations)
    warnings.simplefilter("ignore")
    pytest.importorskip("mmengine", reason="needs mmengine")
    pytest.importorskip("mmcv.ops", reason="needs mmcv with its ops (README: OpenMMLab's stack)")
    pytest.importorskip("mmdet", reason="needs mmdet (README: OpenMMLab's stack)")
    pytest.importorskip("mmdet3d.structures", reason="needs mmdet3d (README: OpenMMLab's stack)")
    from mmdet.structures import DetDataSample, TrackDataSample
    from mmdet.structures.bbox import HorizontalBoxes
    from mmdet.structures.mask import BitmapMasks
    from mmdet3d.structures import (CameraInstance3DBoxes, Det3DDataSample, DepthInstance3DBoxes,
                                    LiDARInstance3DBoxes, PointData)
    from mmdet3d.structures.points import CameraPoints, DepthPoints, LiDARPoints
    from mmengine.dataset import pseudo_collate
    from mmengine.model import BaseDataPreprocessor, BaseModel
    from mmengine.runner import Runner
    from mmengine.structures import BaseDataElement, InstanceData

    import mtc_loader
    import mtc_loader.mmengine as mm
from conftest import requires_cuda  # noqa: E402,I100
from openmmlab_data import assert_same, snapshot  # noqa: E402,I100  (tensors compared bitwise)

DEVICES = ["cpu", pytest.param("cuda:0", marks=requires_cuda)]

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

CAMS = 6


def det3d_sample(i: int, size: int = 32) -> dict:
    """A 6-camera LiDAR sample as mmdet3d's Pack3DDetInputs makes it (images smaller), with what
    real pipelines add: per-camera 2D annotations as lists of tensors, a tensor in metainfo,
    points of each kind, boxes of each mode."""
    g = torch.Generator().manual_seed(i)
    m = 1 + (i * 5) % 9
    ds = Det3DDataSample(metainfo={
        "lidar2img": np.stack([np.eye(4) * (i + k) for k in range(CAMS)]),  # (6, 4, 4) float64
        "pcd_rotation": torch.eye(3) * (i + 1),  # a tensor in metainfo
        "sample_idx": i, "token": f"tok{i}", "box_type_3d": LiDARInstance3DBoxes,
        "img_shape": [(size, size)] * CAMS,
    })
    gt3 = InstanceData()
    gt3.bboxes_3d = LiDARInstance3DBoxes(torch.rand(m, 9, generator=g), box_dim=9)
    gt3.labels_3d = torch.randint(0, 10, (m,), generator=g)
    ds.gt_instances_3d = gt3
    gt2 = InstanceData()  # per camera: lists of tensors (one entry per camera)
    gt2.bboxes = [torch.rand(1 + (i + k) % 4, 4, generator=g) for k in range(CAMS)]
    gt2.labels = [torch.randint(0, 10, (1 + (i + k) % 4,), generator=g) for k in range(CAMS)]
    gt2.centers_2d = [torch.rand(1 + (i + k) % 4, 2, generator=g) for k in range(CAMS)]
    gt2.depths = [torch.rand(1 + (i + k) % 4, generator=g) for k in range(CAMS)]
    ds.gt_instances = gt2
    ds.gt_pts_seg = PointData(pts_semantic_mask=torch.randint(0, 5, (200,), generator=g))
    ds.cam_boxes = CameraInstance3DBoxes(torch.rand(2, 7, generator=g))
    ds.depth_boxes = DepthInstance3DBoxes(torch.rand(3, 6, generator=g), box_dim=6, with_yaw=False)
    ds.cam_points = CameraPoints(torch.rand(50, 4, generator=g), points_dim=4)
    ds.depth_points = DepthPoints(torch.rand(40, 6, generator=g), points_dim=6,
                                  attribute_dims={"color": [3, 4, 5]})
    ds.eval_ann_info = {"gt_bboxes_3d": LiDARInstance3DBoxes(torch.rand(m, 7, generator=g))}
    pts = LiDARPoints(torch.rand(500 + 7 * i, 5, generator=g), points_dim=5, attribute_dims={"intensity": 3})
    ds.lidar_points = pts
    return {"inputs": {"points": torch.rand(500 + 7 * i, 5, generator=g),
                       "img": torch.randint(0, 256, (CAMS, 3, size, size), dtype=torch.uint8, generator=g)},
            "data_samples": ds}


def det_sample(i: int) -> dict:
    """mmdet's PackDetInputs: HorizontalBoxes and masks in gt_instances."""
    g = torch.Generator().manual_seed(100 + i)
    n = 1 + i % 4
    ds = DetDataSample(metainfo={"img_shape": (16, 16), "scale_factor": (1.0, 1.0)})
    gt = InstanceData()
    gt.bboxes = HorizontalBoxes(torch.rand(n, 4, generator=g))
    gt.labels = torch.randint(0, 80, (n,), generator=g)
    gt.masks = BitmapMasks(np.ones((n, 16, 16), np.uint8), 16, 16)
    ds.gt_instances = gt
    ds.ignored_instances = InstanceData(bboxes=HorizontalBoxes(torch.zeros(0, 4)), labels=torch.zeros(0, dtype=torch.long))
    return {"inputs": torch.randint(0, 256, (3, 16, 16), dtype=torch.uint8, generator=g), "data_samples": ds}


def track_sample(i: int) -> dict:
    """mmdet's PackTrackInputs: a TrackDataSample holding one DetDataSample per frame."""
    frames = [det_sample(i * 3 + f)["data_samples"] for f in range(3)]
    ts = TrackDataSample(metainfo={"key_frames_inds": [0], "ref_frames_inds": [1, 2]})
    ts.video_data_samples = frames
    return {"inputs": torch.zeros(3, 3, 16, 16, dtype=torch.uint8), "data_samples": ts}


SAMPLES = {"det3d": det3d_sample, "det": det_sample, "track": track_sample}


class Samples(Dataset):
    def __init__(self, kind: str, n: int = 8) -> None:
        self.kind, self.n = kind, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return SAMPLES[self.kind](i)


def mmengine_path(batch, device):
    """What mmengine's own path gives the model: cast_data of the pseudo-collated batch."""
    pre = BaseDataPreprocessor().to(device)
    return pre.cast_data(batch)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", sorted(SAMPLES))
def test_start_copy_gives_what_cast_data_gives(kind, device):
    batch = pseudo_collate([SAMPLES[kind](i) for i in range(3)])
    ref = snapshot(mmengine_path(batch, device))
    got = snapshot(mm.MTCDataPreprocessor(dict(type="BaseDataPreprocessor")).to(device).cast_data(
        mtc_loader.start_copy(batch, device).get()))
    assert_same(ref, got, "batch")


def test_structures_keep_every_attribute():
    """Boxes and points come back as their class with every attribute, no constructor run."""
    pts = LiDARPoints(torch.rand(10, 5), points_dim=5, attribute_dims={"intensity": 3})
    pts.rotation_axis = 1  # changed after construction: kept
    boxes = LiDARInstance3DBoxes(torch.rand(4, 6), box_dim=6, with_yaw=False)  # padded to 7, no yaw
    hb = HorizontalBoxes(torch.rand(3, 4))
    out = mtc_loader.start_copy({"p": pts, "b": boxes, "h": hb}, "cpu").get()
    for k, ref in (("p", pts), ("b", boxes), ("h", hb)):
        assert type(out[k]) is type(ref)
        assert out[k] is not ref and torch.equal(out[k].tensor, ref.tensor)  # (a CPU tensor to the CPU: reused, as .to)
        assert {a: v for a, v in vars(out[k]).items() if a != "tensor"} == \
            {a: v for a, v in vars(ref).items() if a != "tensor"}
    assert out["p"].rotation_axis == 1 and out["b"].box_dim == 7 and out["b"].with_yaw is False


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", sorted(SAMPLES))
@pytest.mark.parametrize("workers,ctx", [(0, None), (2, "fork"), (2, "spawn")])
def test_packed_collate_gives_what_mmengine_gives(kind, workers, ctx, device):
    ds = Samples(kind)
    collate = mm.PackedPseudoCollate()
    collate.arm(64 << 20)
    dl = DataLoader(ds, batch_size=4, num_workers=workers, collate_fn=collate, multiprocessing_context=ctx)
    ref = [snapshot(mmengine_path(b, device)) for b in DataLoader(ds, batch_size=4, collate_fn=pseudo_collate)]
    pre = mm.MTCDataPreprocessor(dict(type="BaseDataPreprocessor")).to(device)
    got = [snapshot(pre.cast_data(b.to(device))) for b in dl]
    assert len(got) == len(ref) == 2
    for k, (r, g) in enumerate(zip(ref, got)):
        assert_same(r, g, f"{kind} batch {k}")


SEEN: list = []


class Model(BaseModel):
    def __init__(self, data_preprocessor=None) -> None:
        super().__init__(data_preprocessor=data_preprocessor)
        self.w = torch.nn.Parameter(torch.ones(1))

    def forward(self, inputs, data_samples=None, mode="tensor"):
        SEEN.append(snapshot({"inputs": inputs, "data_samples": data_samples}))
        return {"loss": self.w.sum() * 0}


def _train(tmp_path, device, kind, switch, workers):
    SEEN.clear()
    loader = dict(dataset=Samples(kind), sampler=dict(type="DefaultSampler", shuffle=False), batch_size=4,
                  num_workers=workers, persistent_workers=False)
    pre = dict(type="BaseDataPreprocessor")
    train_cfg = dict(by_epoch=True, max_epochs=1)
    if switch:
        loader["collate_fn"] = dict(type="mtc_packed_collate")
        pre = dict(type="MTCDataPreprocessor", preprocessor=pre, arena_bytes=64 << 20)
        train_cfg = dict(type="MTCEpochBasedTrainLoop", max_epochs=1)
    with mock.patch("mmengine.runner.runner.get_device", return_value=device):
        runner = Runner(
            model=Model(data_preprocessor=pre), work_dir=str(tmp_path / ("on" if switch else "off")),
            train_dataloader=loader, train_cfg=train_cfg, optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.01)),
            default_hooks=dict(checkpoint=None, logger=None), log_level="ERROR",
            env_cfg=dict(cudnn_benchmark=False, dist_cfg=dict(backend="gloo")), default_scope=None, cfg=dict())
        runner.train()
    return list(SEEN)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["det3d", "track"])
def test_runner_train_with_the_switch_gets_the_same_data(tmp_path, device, kind):
    ref = _train(tmp_path, device, kind, switch=False, workers=2)
    got = _train(tmp_path, device, kind, switch=True, workers=2)
    assert len(ref) == len(got) == 2
    for k, (r, g) in enumerate(zip(ref, got)):
        assert_same(r, g, f"step {k}")
