"""bench/bench_openmmlab_train.py's pieces, without training: its two child configs inherit
mmdet's YOLOv3 config and differ by the switch alone, its synthetic set is read by mmdet's
CocoDataset in full batches, and the losses' agreement is counted bitwise. (The benchmark itself:
``python3 bench/bench_openmmlab_train.py --device cpu --quick``, a few minutes on 2 cores.)"""
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

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import bench_openmmlab_train as bench  # noqa: E402


def _args(**kw):
    base = dict(batch_size=2, workers=2, quick=True)
    base.update(kw)
    return argparse.Namespace(**base)


def _configs(tmp_path):
    from mmengine.config import Config

    base = bench.base_config(bench.DEFAULT_CONFIG)
    cfgs = {}
    for arm in ("plain", "switched"):
        path = tmp_path / f"{arm}.py"
        path.write_text(bench.child_config(arm, base, str(tmp_path / "data"), _args()))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfgs[arm] = Config.fromfile(str(path)).to_dict()
    return cfgs


def test_switched_config_differs_from_plain_by_the_switch_alone(tmp_path):
    cfgs = _configs(tmp_path)
    plain, switched = cfgs["plain"], cfgs["switched"]
    base_preprocessor = dict(type="DetDataPreprocessor", mean=[0, 0, 0], std=[255.0, 255.0, 255.0],
                             bgr_to_rgb=True, pad_size_divisor=32)
    assert plain["model"]["data_preprocessor"] == base_preprocessor
    assert plain["train_cfg"] == dict(type="EpochBasedTrainLoop", max_epochs=1, val_interval=7)
    # the recipe's two lines for a child config, nothing else
    assert switched.pop("custom_imports") == dict(imports=["mtc_loader.mmengine"], allow_failed_imports=False)
    assert switched.pop("runner_type") == "MTCRunner"
    assert "runner_type" not in plain
    # the real config's model and pipeline, seeded, no validation, no pretrained weights
    assert plain["model"]["type"] == "YOLOV3" and plain["model"]["backbone"]["type"] == "Darknet"
    assert plain["model"]["backbone"]["init_cfg"] is None
    assert plain["randomness"] == dict(seed=0, deterministic=True)
    assert plain["val_dataloader"] is None and plain["val_cfg"] is None
    steps = [s["type"] for s in plain["train_dataloader"]["dataset"]["pipeline"]]
    assert plain == switched
    assert steps == ["LoadImageFromFile", "LoadAnnotations", "Expand", "MinIoURandomCrop", "RandomResize",
                     "RandomFlip", "PhotoMetricDistortion", "PackDetInputs"]


def test_synthetic_set_is_read_by_cocodataset_in_full_batches(tmp_path):
    from mmdet.datasets import AspectRatioBatchSampler, CocoDataset
    from mmengine.dataset import DefaultSampler

    root = str(tmp_path / "data")
    spec = bench.write_dataset(root, entries=8 * 2 * 2, batch_size=2, unique=10, quick=True)
    assert bench.write_dataset(root, entries=32, batch_size=2, unique=10, quick=True) == spec  # kept
    with open(os.path.join(root, "annotations", "train.json")) as f:
        coco = json.load(f)
    assert len(coco["images"]) == 32 and len(os.listdir(os.path.join(root, "images"))) == 10
    ds = CocoDataset(data_root=root + "/", ann_file="annotations/train.json", data_prefix=dict(img="images/"),
                     filter_cfg=dict(filter_empty_gt=True, min_size=16), pipeline=[])
    assert len(ds) == 32
    info = ds[0]
    assert info["instances"] and os.path.isfile(info["img_path"])
    batches = list(AspectRatioBatchSampler(DefaultSampler(ds, shuffle=True, seed=0), batch_size=2))
    assert len(batches) == 16 and all(len(b) == 2 for b in batches)


def test_agreement_is_bitwise_per_iteration():
    ref = dict(loss=[1.0, 2.0, 3.0], loss_cls=[0.5, 0.5, 0.5])
    same = bench.agreement(dict(ref), ref)
    assert all(a["bitwise"] and a["max_abs_diff"] == 0 for a in same)
    off = bench.agreement(dict(loss=[1.0, 2.0 + 2 ** -20, 3.0], loss_cls=[0.5, 0.5, 0.25]), ref)
    assert [a["bitwise"] for a in off] == [True, False, False]
    assert off[1]["max_abs_diff"] == 2 ** -20 and off[2]["max_abs_diff"] == 0.25
    missing = bench.agreement(dict(loss=[1.0]), ref)
    assert not missing[0]["bitwise"]
