"""The models bench_openmmlab_train.py trains: each a config shipped inside the installed mmdet or
mmdet3d, the synthetic set it reads, what its child configs set, and the stand-ins its step needs
(ops.py). A child config sets only the run's data, size and settings; the model and the pipeline
are the shipped config's, shrunk only under ``--quick``."""
from __future__ import annotations

import copy
import dataclasses
import math
import os
from typing import Any, Callable

from . import coco, nuscenes, waymo


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    package: str  # the installed package whose .mim/configs holds the config
    config: str
    batch_size: int  # the config's own
    workers: int  # the config's own
    iters: int  # the most iterations per arm (--iters): the data set is written for them
    warmup: int  # iterations left out of the timings
    unique: int  # distinct samples on disk (entries name them in turn)
    quick_unique: int  # the same under --quick
    stand_ins: tuple[str, ...]  # ops.STAND_INS the step needs on a device without mmcv's kernels
    # (data_root, iterations, batch, unique, quick) -> the set's summary
    write: Callable[[str, int, int, int, bool], dict[str, Any]]
    # (data_root, batch, workers, parent config, quick) -> the child config's values
    values: Callable[[str, int, int, Any, bool], dict[str, Any]]
    # (iterations, batch) -> the cfg options that give the epoch exactly that many iterations
    samples: Callable[[int, int], dict[str, Any]]
    # the step between iteration counts the data can give exactly, for a batch size
    granularity: Callable[[int], int]
    what: str  # one line for the report
    # the switched arm's shared arena where the preprocessor's default (256 MiB) cannot hold the
    # batches in flight (the error names the size needed); None: the default
    arena_bytes: int | None = None


def base_config(model: Model, name: str | None = None) -> str:
    """The path of a config shipped inside the installed package (``PACKAGE/.mim/configs/NAME``),
    or ``name`` itself where it is a file."""
    name = name or model.config
    if os.path.isfile(name):
        return os.path.abspath(name)
    import importlib

    package = importlib.import_module(model.package)
    path = os.path.join(os.path.dirname(package.__file__ or ""), ".mim", "configs", name)
    if not os.path.isfile(path):
        raise SystemExit(f"bench_openmmlab_train: no config {name!r} in the installed {model.package} ({path})")
    return path


def rewrite(node: Any, key: str, value: Any) -> Any:
    """A deep copy of a config's list / dict tree with every ``key`` set to ``value``."""
    if isinstance(node, dict):
        return {k: (value if k == key else rewrite(v, key, value)) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(rewrite(v, key, value) for v in node)
    return copy.deepcopy(node)


def _plain(node: Any) -> Any:
    """A config's ConfigDicts as plain dicts (for the child config's text)."""
    if isinstance(node, dict):
        return {k: _plain(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(_plain(v) for v in node)
    return node


# ------------------------------------------------------------------------- YOLOv3 (mmdet)

def _yolo_write(root: str, iters: int, batch: int, unique: int, quick: bool) -> dict[str, Any]:
    return coco.write(root, iters * batch, batch, unique, quick)


def _yolo_values(root: str, batch: int, workers: int, parent: Any, quick: bool) -> dict[str, Any]:
    dataset: dict[str, Any] = dict(data_root=root + os.sep, ann_file="annotations/train.json",
                                   data_prefix=dict(img="images/"))
    if quick:  # tiny images: the multi-scale range shrunk, the rest of the pipeline as it is
        dataset["pipeline"] = [dict(step, scale=[(96, 96), (160, 160)]) if step["type"] == "RandomResize"
                               else dict(step) for step in _plain(parent.train_pipeline)]
    return dict(
        train_dataloader=dict(batch_size=batch, num_workers=workers, persistent_workers=True, dataset=dataset),
        model=dict(backbone=dict(init_cfg=None)),
    )


YOLOV3 = Model(
    name="yolov3", package="mmdet", config="yolo/yolov3_d53_8xb8-ms-608-273e_coco.py", batch_size=8,
    workers=4, iters=304, warmup=5, unique=64, quick_unique=16, stand_ins=(),
    write=_yolo_write, values=_yolo_values,
    samples=lambda iters, batch: {"train_dataloader.dataset.indices": iters * batch},
    granularity=lambda batch: 8,
    what="mmdet YOLOv3 (Darknet-53, multi-scale 320..608) on COCO-format JPEGs of 640x480..1280x720",
)


# ------------------------------------------------------------------------- CenterPoint (mmdet3d)

QUICK_RANGE = [-25.6, -25.6, -5.0, 25.6, 25.6, 3.0]  # a 64 x 64 pillar grid of 0.8 m
QUICK_VOXEL = [0.8, 0.8, 8]


def _centerpoint_write(root: str, iters: int, batch: int, unique: int, quick: bool) -> dict[str, Any]:
    # CBGSDataset resamples N entries into 10 N (each holds all 10 classes)
    return nuscenes.write(root, math.ceil(iters * batch / 10), unique, quick)


def _centerpoint_values(root: str, batch: int, workers: int, parent: Any, quick: bool) -> dict[str, Any]:
    pipeline = _plain(parent.train_pipeline)
    pipeline = rewrite(pipeline, "data_root", root + os.sep)
    pipeline = rewrite(pipeline, "info_path", os.path.join(root, "nuscenes_dbinfos_train.pkl"))
    values: dict[str, Any] = dict(
        train_dataloader=dict(batch_size=batch, num_workers=workers, persistent_workers=True,
                              dataset=dict(dataset=dict(data_root=root + os.sep, pipeline=pipeline))))
    if quick:  # a 64 x 64 grid of 0.8 m pillars and narrow layers: CPU time
        pcr, voxel = QUICK_RANGE, QUICK_VOXEL
        values["train_dataloader"]["dataset"]["dataset"]["pipeline"] = rewrite(pipeline, "point_cloud_range", pcr)
        values["model"] = dict(
            data_preprocessor=dict(voxel_layer=dict(point_cloud_range=pcr, voxel_size=voxel, max_voxels=(4000, 4000))),
            pts_voxel_encoder=dict(feat_channels=[16], point_cloud_range=pcr, voxel_size=voxel),
            pts_middle_encoder=dict(in_channels=16, output_shape=(64, 64)),
            pts_backbone=dict(in_channels=16, layer_nums=[1, 1, 1], out_channels=[16, 32, 64]),
            pts_neck=dict(in_channels=[16, 32, 64], out_channels=[32, 32, 32]),
            pts_bbox_head=dict(in_channels=96, share_conv_channel=16,
                               bbox_coder=dict(pc_range=pcr[:2], voxel_size=voxel[:2], max_num=100)),
            train_cfg=dict(pts=dict(grid_size=[64, 64, 1], point_cloud_range=pcr, voxel_size=voxel)),
            test_cfg=dict(pts=dict(pc_range=pcr[:2], voxel_size=voxel[:2])))
    return values


def _centerpoint_samples(iters: int, batch: int) -> dict[str, Any]:
    n = iters * batch // 10
    assert n * 10 == iters * batch, (iters, batch)
    return {"train_dataloader.dataset.dataset.indices": n}


CENTERPOINT = Model(
    name="centerpoint", package="mmdet3d",
    config="centerpoint/centerpoint_pillar02_second_secfpn_8xb4-cyclic-20e_nus-3d.py", batch_size=4,
    workers=4, iters=200, warmup=3, unique=8, quick_unique=2, stand_ins=("voxelization",),
    write=_centerpoint_write, values=_centerpoint_values, samples=_centerpoint_samples,
    granularity=lambda batch: 10 // math.gcd(10, batch),
    what="mmdet3d CenterPoint (0.2 m pillars, SECOND + FPN, CenterHead) on nuScenes-format LiDAR: "
         "the key frame and 9 sweeps of ~34k points, ObjectSample from the GT database",
)


# ------------------------------------------------------------------------- multi-view FCOS3D++ (mmdet3d)

def _mvfcos3d_write(root: str, iters: int, batch: int, unique: int, quick: bool) -> dict[str, Any]:
    return waymo.write(root, 5 * iters * batch, unique, quick)  # the config loads every 5th frame


def _mvfcos3d_values(root: str, batch: int, workers: int, parent: Any, quick: bool) -> dict[str, Any]:
    dataset: dict[str, Any] = dict(data_root=root + os.sep)
    values: dict[str, Any] = dict(
        train_dataloader=dict(batch_size=batch, num_workers=workers, persistent_workers=True, dataset=dataset),
        model=dict(backbone=dict(init_cfg=None)))
    if quick:  # images of a tenth the size, ResNet-50 with its DCN stages, 4 m voxels, narrow layers
        pipeline = rewrite(_plain(parent.train_pipeline), "scale", (125, 83))
        dataset["pipeline"] = rewrite(pipeline, "crop_size", (108, 72))
        values["model"] = dict(
            backbone=dict(depth=50, init_cfg=None), neck=dict(out_channels=16),
            neck_3d=dict(in_channels=16, out_channels=32), voxel_size=(4.0, 4.0, 0.5),
            bbox_head_3d=dict(in_channels=32, feat_channels=32))
    return values


MVFCOS3D = Model(
    name="mvfcos3d", package="mmdet3d", config="mvfcos3d/multiview-fcos3d_r101-dcn_8xb2_waymoD5-3d-3class.py",
    batch_size=2, workers=2, iters=100, warmup=3, unique=8, quick_unique=2,
    stand_ins=("dcnv2", "grid_sample", "focal_loss"),
    write=_mvfcos3d_write, values=_mvfcos3d_values,
    samples=lambda iters, batch: {"train_dataloader.dataset.indices": iters * batch},
    granularity=lambda batch: 1,
    arena_bytes=1 << 30,  # 89 MiB batches (5 uint8 camera images a sample), 7 in flight
    what="mmdet3d multi-view FCOS3D++ (MultiViewDfM: ResNet-101 with DCNv2, FPN, a 3D voxel neck, "
         "Anchor3DHead) on Waymo-format data: 5 cameras (1920x1280, 1920x886 JPEGs) per sample",
)

MODELS = {m.name: m for m in (YOLOV3, CENTERPOINT, MVFCOS3D)}
