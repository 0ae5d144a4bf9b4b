"""bench/bench_openmmlab_train.py's pieces, without training: its two child configs inherit each
model's shipped config and differ by the switch alone, its synthetic sets are read by the real
dataset classes in full batches, and the losses' agreement is counted bitwise
(its stand-ins for mmcv's kernels: tests/test_bench_openmmlab_ops.py). (The benchmark itself:
``python3 bench/bench_openmmlab_train.py --device cpu --quick --model MODEL``, a few minutes on 2
cores.)"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import warnings

import pytest

pytest.importorskip("mmdet", reason="needs mmdet (README: OpenMMLab's stack)")
pytest.importorskip("mmcv.ops", reason="needs mmcv with its ops (README: OpenMMLab's stack)")

import torch  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import bench_openmmlab_train as bench  # noqa: E402
from openmmlab_train import coco  # noqa: E402
from openmmlab_train.models import MODELS, base_config  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::ImportWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]


def _mmdet3d():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in ("mmdet3d", "pyquaternion", "trimesh"):
            pytest.importorskip(name, reason="needs mmdet3d and its runtime imports (README: OpenMMLab's stack)")


def _configs(tmp_path, name: str, quick: bool = True) -> dict:
    from mmengine.config import Config

    model = MODELS[name]
    base = base_config(model)
    args = argparse.Namespace(batch_size=2, workers=2, quick=quick)
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfgs = {}
    for arm in ("plain", "switched", "ahead"):
        path = tmp_path / f"{arm}.py"
        path.write_text(bench.child_config(arm, model, base, str(tmp_path / "data"), args))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfgs[arm] = Config.fromfile(str(path)).to_dict()
    return cfgs


def _only_the_switch_differs(cfgs: dict, arena_bytes: int | None = None) -> dict:
    plain, switched = cfgs["plain"], dict(cfgs["switched"])
    # the recipe's two lines for a child config, nothing else
    assert switched.pop("custom_imports") == dict(imports=["mtc_loader.mmengine"], allow_failed_imports=False)
    assert switched.pop("runner_type") == "MTCRunner"
    if arena_bytes is not None:  # and the arena the model's batches need, as the arena's error asks
        pre = dict(switched["model"]["data_preprocessor"])
        switched["model"] = dict(switched["model"], data_preprocessor=plain["model"]["data_preprocessor"])
        wrapped = plain["model"]["data_preprocessor"]
        assert pre == dict(wrapped, type="MTCDataPreprocessor", preprocessor=wrapped["type"], arena_bytes=arena_bytes)
    assert "runner_type" not in plain
    # the ahead arm: the switched one and the preprocessor's run-ahead line
    ahead, ahead_pre = dict(cfgs["ahead"]), dict(cfgs["ahead"]["model"]["data_preprocessor"])
    assert ahead_pre.pop("run_ahead") is True
    assert dict(ahead, model=dict(ahead["model"], data_preprocessor=ahead_pre)) == cfgs["switched"]
    assert plain == switched
    assert plain["randomness"] == dict(seed=0, deterministic=True)
    assert plain["val_dataloader"] is None and plain["val_cfg"] is None
    return plain


def test_yolov3_configs_differ_by_the_switch_alone(tmp_path):
    plain = _only_the_switch_differs(_configs(tmp_path, "yolov3"))
    assert plain["model"]["data_preprocessor"] == dict(type="DetDataPreprocessor", mean=[0, 0, 0],
                                                       std=[255.0, 255.0, 255.0], bgr_to_rgb=True,
                                                       pad_size_divisor=32)
    assert plain["train_cfg"] == dict(type="EpochBasedTrainLoop", max_epochs=1, val_interval=7)
    assert plain["model"]["type"] == "YOLOV3" and plain["model"]["backbone"]["init_cfg"] is None
    steps = [s["type"] for s in plain["train_dataloader"]["dataset"]["pipeline"]]
    assert steps == ["LoadImageFromFile", "LoadAnnotations", "Expand", "MinIoURandomCrop", "RandomResize",
                     "RandomFlip", "PhotoMetricDistortion", "PackDetInputs"]


def test_mmdet3d_configs_differ_by_the_switch_alone_and_keep_the_real_model(tmp_path):
    _mmdet3d()
    cp = _only_the_switch_differs(_configs(tmp_path / "cp", "centerpoint", quick=False))
    assert cp["model"]["type"] == "CenterPoint"
    assert cp["model"]["data_preprocessor"]["voxel_layer"]["voxel_size"] == [0.2, 0.2, 8]
    assert cp["model"]["pts_middle_encoder"]["output_shape"] == (512, 512)  # the real grid, not shrunk
    loader = cp["train_dataloader"]
    assert (loader["batch_size"], loader["dataset"]["type"]) == (2, "CBGSDataset")
    steps = loader["dataset"]["dataset"]["pipeline"]
    sweeps = next(s for s in steps if s["type"] == "LoadPointsFromMultiSweeps")
    assert sweeps["sweeps_num"] == 9
    sampler = next(s for s in steps if s["type"] == "ObjectSample")["db_sampler"]
    assert sampler["info_path"] == str(tmp_path / "cp" / "data" / "nuscenes_dbinfos_train.pkl")
    mv = _only_the_switch_differs(_configs(tmp_path / "mv", "mvfcos3d", quick=False), arena_bytes=1 << 30)
    assert mv["model"]["type"] == "MultiViewDfM" and mv["model"]["backbone"]["depth"] == 101
    assert mv["model"]["backbone"]["dcn"]["type"] == "DCNv2" and mv["model"]["backbone"]["init_cfg"] is None
    assert mv["train_dataloader"]["dataset"]["load_interval"] == 5


def test_coco_set_is_read_by_cocodataset_in_full_batches(tmp_path):
    from mmdet.datasets import AspectRatioBatchSampler, CocoDataset
    from mmengine.dataset import DefaultSampler

    root = str(tmp_path / "data")
    spec = coco.write(root, entries=8 * 2 * 2, batch_size=2, unique=10, quick=True)
    assert coco.write(root, entries=32, batch_size=2, unique=10, quick=True) == spec  # kept
    with open(os.path.join(root, "annotations", "train.json")) as f:
        assert len(json.load(f)["images"]) == 32
    assert len(os.listdir(os.path.join(root, "images"))) == 10
    for n in (16, 32):  # the first n entries (the dataset's indices): n / 2 full batches
        ds = CocoDataset(data_root=root + "/", ann_file="annotations/train.json", data_prefix=dict(img="images/"),
                         filter_cfg=dict(filter_empty_gt=True, min_size=16), pipeline=[], indices=n)
        assert len(ds) == n and ds[0]["instances"] and os.path.isfile(ds[0]["img_path"])
        batches = list(AspectRatioBatchSampler(DefaultSampler(ds, shuffle=True, seed=0), batch_size=2))
        assert len(batches) == n // 2 and all(len(b) == 2 for b in batches)


def _mmdet3d_dataset(tmp_path, name: str, iters: int):
    """The training dataset of model ``name``'s plain child config over its synthetic set (written
    for ``iters`` iterations of 2, 2 unique entries), built as the Runner builds it, and the set's
    summary."""
    _mmdet3d()
    from mmengine.config import Config
    from mmengine.registry import DATASETS, init_default_scope

    from mmdet3d.utils import register_all_modules

    model = MODELS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        register_all_modules(init_default_scope=False)
        cfg = Config.fromfile(_write_child(tmp_path, name))
    summary = model.write(str(tmp_path / "data"), iters, 2, 2, True)
    cfg.merge_from_dict(model.samples(iters, 2))
    init_default_scope("mmdet3d")
    return DATASETS.build(cfg.train_dataloader.dataset), summary


def test_nuscenes_set_gives_cbgs_ten_entries_per_info_and_the_pipeline_its_sweeps(tmp_path):
    ds, summary = _mmdet3d_dataset(tmp_path, "centerpoint", 10)  # 10 iterations of 2: 2 infos, resampled into 20
    assert summary["boxes_per_sample"] == 10 and min(summary["database"]) == 10
    assert len(ds) == 20
    sample = ds[0]
    points = sample["inputs"]["points"]
    assert points.shape[1] == 5 and len(points) > 5 * 4096  # the key frame and 9 sweeps, range-filtered
    assert (points[:, 4] > 0).any() and (points[:, 4] == 0).any()  # the sweeps' time lags, the key frame's 0
    assert len(sample["data_samples"].gt_instances_3d.labels_3d) >= 10


def _write_child(tmp_path, name: str) -> str:
    model = MODELS[name]
    path = tmp_path / f"{name}_plain.py"
    path.write_text(bench.child_config("plain", model, base_config(model), str(tmp_path / "data"),
                                       argparse.Namespace(batch_size=2, workers=0, quick=True)))
    return str(path)


def test_waymo_set_is_read_by_waymodataset_with_five_cameras(tmp_path):
    ds, _ = _mmdet3d_dataset(tmp_path, "mvfcos3d", 3)
    assert len(ds) == 6
    sample = ds[1]
    assert tuple(sample["inputs"]["img"].shape) == (5, 3, 72, 108)  # 5 views, cropped as the quick pipeline says
    assert sample["data_samples"].metainfo["num_views"] == 5
    assert len(sample["data_samples"].gt_instances_3d.labels_3d) > 0


def test_agreement_is_bitwise_per_iteration():
    ref = dict(loss=[1.0, 2.0, 3.0, float("nan")], loss_cls=[0.5, 0.5, 0.5, 0.5])
    same = bench.agreement(dict(ref), ref)
    assert all(a["bitwise"] and a["max_abs_diff"] == 0 for a in same)  # NaN is bitwise equal to itself
    off = bench.agreement(dict(loss=[1.0, 2.0 + 2 ** -20, 3.0, float("nan")], loss_cls=[0.5, 0.5, 0.25, 0.5]), ref)
    assert [a["bitwise"] for a in off] == [True, False, False, True]
    assert off[1]["max_abs_diff"] == 2 ** -20 and off[2]["max_abs_diff"] == 0.25
    missing = bench.agreement(dict(loss=[1.0]), ref)
    assert not missing[0]["bitwise"]
