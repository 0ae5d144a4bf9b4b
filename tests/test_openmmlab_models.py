"""Real OpenMMLab models trained from the configs shipped inside the installed packages
(``mmdet3d/.mim/configs``, ``mmdet/.mim/configs``), plain and with the config switch of
docs/mmengine.md: per iteration, the model's inputs (after its data preprocessor) and its losses
are bitwise equal, and so are the validation pass's inputs and predictions, the weights after
training, and a resumed run.

Each model's config is inherited as a user writes it: a child config file whose ``_base_`` is the
real config, shrunk only where CPU time needs it (fewer channels, a smaller point-cloud range or
image size, a few samples), reading a small synthetic dataset written in the dataset's own
on-disk format (tests/openmmlab_data.py) through the real dataset class, pipeline and metric.
The switched config is a child of that one written from the README's lines. The matrix knobs
(workers, loop, resume) are set as ``tools/train.py --cfg-options`` sets them.

Skipped where the stack or mmdet3d's runtime imports are absent (README: "OpenMMLab's stack for
the tests").
"""
from __future__ import annotations

import os
import pprint
import time
import warnings
from unittest import mock

import pytest
import torch

with warnings.catch_warnings():  # the stack's imports warn (deprecations)
    warnings.simplefilter("ignore")
    pytest.importorskip("mmengine", reason="needs mmengine")
    pytest.importorskip("mmcv.ops", reason="needs mmcv with its ops (README: OpenMMLab's stack)")
    pytest.importorskip("mmdet", reason="needs mmdet (README: OpenMMLab's stack)")
    pytest.importorskip("mmdet3d", reason="needs mmdet3d (README: OpenMMLab's stack)")
    for _name in ("pyquaternion", "trimesh", "pandas", "sklearn", "cachetools", "nuscenes",
                  "lyft_dataset_sdk"):
        pytest.importorskip(_name, reason="needs mmdet3d's runtime imports (README: OpenMMLab's stack)")
    import mmdet
    import mmdet3d
    from mmengine.config import Config, ConfigDict
    from mmengine.model import BaseModel
    from mmdet3d.utils import register_all_modules as register_mmdet3d
    from mmdet.utils import register_all_modules as register_mmdet
    from mmengine.registry import RUNNERS
    from mmengine.runner import Runner

    # the registries' modules, imported once here where their import-time warnings are ignored
    register_mmdet(init_default_scope=False)
    register_mmdet3d(init_default_scope=False)

import openmmlab_data as data  # noqa: E402,I100
from conftest import mmengine_switch_lines  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::ImportWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]


def real_config(package, rel: str) -> str:
    return os.path.join(os.path.dirname(package.__file__), ".mim", "configs", rel)


def _plain(v):
    if isinstance(v, (ConfigDict, dict)):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_plain(x) for x in v)
    return v


def _merge(a, b):
    if isinstance(a, dict) and isinstance(b, dict):
        return {**a, **{k: _merge(a.get(k), v) for k, v in b.items()}}
    return b


def write_config(path: str, base: str, values: dict) -> str:
    """A child config file: ``_base_`` and the top-level values given (merged into the base's
    dicts by mmengine, lists and other values replacing the base's)."""
    lines = [f"_base_ = [{base!r}]"] + [f"{k} = {pprint.pformat(_plain(v), width=100)}" for k, v in values.items()]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def write_switched(path: str, base: str) -> str:
    """A child config of ``base`` written from the README's lines (docs/mmengine.md shows the same)."""
    _, lines = mmengine_switch_lines()
    with open(path, "w") as f:
        f.write(f"_base_ = [{base!r}]\n" + lines)
    return path


def rewrite(node, key: str, value):
    """node with every dict's ``key`` set to value, at any depth (a pipeline's ranges)."""
    if isinstance(node, (dict, ConfigDict)):
        return {k: value if k == key else rewrite(v, key, value) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(rewrite(v, key, value) for v in node)
    return node


# ---------------------------------------------------------------------------------------------
# The models: each writes its dataset and the plain child config's values


def pointpillars(root: str) -> tuple[str, dict]:
    base = real_config(mmdet3d, "pointpillars/pointpillars_hv_secfpn_8xb6-160e_kitti-3d-3class.py")
    real = Config.fromfile(base)
    pcr = [0, -5.12, -3, 10.24, 5.12, 1]  # a 64 x 64 pillar grid instead of 432 x 496
    data.write_kitti(root, n_train=2, n_val=2, xy_range=(pcr[0], pcr[1], pcr[3], pcr[4]))
    ranges = [[pcr[0], pcr[1], z, pcr[3], pcr[4], z] for z in (-0.6, -0.6, -1.78)]
    pipeline = rewrite(real.train_pipeline, "point_cloud_range", pcr)
    pipeline = rewrite(pipeline, "data_root", root + "/")
    pipeline = rewrite(pipeline, "info_path", root + "/kitti_dbinfos_train.pkl")
    test_pipeline = rewrite(real.test_pipeline, "point_cloud_range", pcr)
    values = dict(
        model=dict(
            data_preprocessor=dict(voxel_layer=dict(point_cloud_range=pcr, max_voxels=(4000, 4000))),
            voxel_encoder=dict(feat_channels=[16], point_cloud_range=pcr),
            middle_encoder=dict(in_channels=16, output_shape=[64, 64]),
            backbone=dict(in_channels=16, layer_nums=[1, 1, 1], out_channels=[16, 32, 64]),
            neck=dict(in_channels=[16, 32, 64], out_channels=[32, 32, 32]),
            bbox_head=dict(in_channels=96, feat_channels=96, anchor_generator=dict(ranges=ranges))),
        train_dataloader=dict(batch_size=2, dataset=dict(dataset=dict(data_root=root + "/", pipeline=pipeline))),
        val_dataloader=dict(dataset=dict(data_root=root + "/", pipeline=test_pipeline)),
        test_dataloader=dict(dataset=dict(data_root=root + "/", pipeline=test_pipeline)),
        # KITTI's evaluation computes rotated IoUs with numba.cuda: on the CPU the metric writes
        # the predictions in KITTI's submission format instead
        val_evaluator=dict(ann_file=root + "/kitti_infos_val.pkl", format_only=True,
                           submission_prefix=root + "/submission"),
        test_evaluator=dict(ann_file=root + "/kitti_infos_val.pkl", format_only=True,
                            submission_prefix=root + "/submission"),
    )
    return base, values


def retinanet(root: str) -> tuple[str, dict]:
    base = real_config(mmdet, "retinanet/retinanet_r50_fpn_1x_coco.py")
    real = Config.fromfile(base)
    data.write_coco(root, n_train=4, n_val=2, size=(160, 120))
    # ResNet-18 with no pretrained weights for ResNet-50 from torchvision, 128 x 96 images
    # instead of 1333 x 800, 64 channels in the neck and head instead of 256
    pipeline = rewrite(real.train_pipeline, "scale", (128, 96))
    test_pipeline = rewrite(real.test_pipeline, "scale", (128, 96))
    values = dict(
        model=dict(
            backbone=dict(depth=18, init_cfg=None),
            neck=dict(in_channels=[64, 128, 256, 512], out_channels=64),
            bbox_head=dict(in_channels=64, feat_channels=64, stacked_convs=2)),
        train_dataloader=dict(batch_size=2, dataset=dict(data_root=root + "/", pipeline=pipeline)),
        val_dataloader=dict(dataset=dict(data_root=root + "/", pipeline=test_pipeline)),
        val_evaluator=dict(ann_file=root + "/annotations/instances_val2017.json"),
    )
    return base, values


def centerpoint(root: str) -> tuple[str, dict]:
    base = real_config(mmdet3d, "centerpoint/centerpoint_pillar02_second_secfpn_8xb4-cyclic-20e_nus-3d.py")
    real = Config.fromfile(base)
    pcr = [-6.4, -6.4, -5.0, 6.4, 6.4, 3.0]  # a 64 x 64 pillar grid instead of 512 x 512
    # CBGSDataset needs every class in the training set: five in each of the 2 samples, which it
    # resamples into 10 (batches of 5 instead of 4)
    data.write_nuscenes(root, n_train=2, n_val=2, xy_range=(pcr[0], pcr[1], pcr[3], pcr[4]),
                        classes=[data.NUS_CLASSES[:5], data.NUS_CLASSES[5:]])
    pipeline = rewrite(real.train_pipeline, "point_cloud_range", pcr)
    pipeline = rewrite(pipeline, "data_root", root + "/")
    pipeline = rewrite(pipeline, "info_path", root + "/nuscenes_dbinfos_train.pkl")
    values = dict(
        model=dict(
            data_preprocessor=dict(voxel_layer=dict(point_cloud_range=pcr, max_voxels=(4000, 4000))),
            pts_voxel_encoder=dict(feat_channels=[16], point_cloud_range=pcr),
            pts_middle_encoder=dict(in_channels=16, output_shape=(64, 64)),
            pts_backbone=dict(in_channels=16, layer_nums=[1, 1, 1], out_channels=[16, 32, 64]),
            pts_neck=dict(in_channels=[16, 32, 64], out_channels=[32, 32, 32]),
            # at most 100 boxes: the 16 x 16 heatmap has fewer cells than 500
            pts_bbox_head=dict(in_channels=96, share_conv_channel=16,
                               bbox_coder=dict(pc_range=pcr[:2], max_num=100)),
            train_cfg=dict(pts=dict(grid_size=[64, 64, 1], point_cloud_range=pcr)),
            test_cfg=dict(pts=dict(pc_range=pcr[:2]))),
        train_dataloader=dict(batch_size=5, dataset=dict(dataset=dict(data_root=root + "/", pipeline=pipeline))),
        val_dataloader=dict(dataset=dict(data_root=root + "/")),
        # nuScenes' evaluation reads the devkit's tables: the metric writes the predictions in
        # nuScenes' submission format instead
        val_evaluator=dict(ann_file=root + "/nuscenes_infos_val.pkl", format_only=True,
                           jsonfile_prefix=root + "/submission"),
    )
    return base, values


def pgd(root: str) -> tuple[str, dict]:
    base = real_config(mmdet3d, "pgd/pgd_r101-caffe_fpn_head-gn_4xb3-4x_kitti-mono3d.py")
    real = Config.fromfile(base)
    # 312 x 94 images instead of 1242 x 375 (the pipeline's Resize is to the images' own size,
    # as in the real config), ResNet-18 with no pretrained ResNet-101, 32 channels instead of 256
    data.write_kitti(root, n_train=4, n_val=2, xy_range=(8, -3, 30, 3), image_size=(312, 94))
    pipeline = rewrite(real.train_pipeline, "scale", (312, 94))
    branch = (32,)
    values = dict(
        model=dict(
            backbone=dict(depth=18, init_cfg=None),
            neck=dict(in_channels=[64, 128, 256, 512], out_channels=32),
            bbox_head=dict(in_channels=32, feat_channels=32, cls_branch=branch, reg_branch=(branch,) * 6,
                           dir_branch=branch, attr_branch=branch, centerness_branch=branch,
                           depth_branch=branch)),
        train_dataloader=dict(batch_size=2, dataset=dict(data_root=root + "/", pipeline=pipeline)),
        val_dataloader=dict(dataset=dict(data_root=root + "/")),
        val_evaluator=dict(ann_file=root + "/kitti_infos_val.pkl", format_only=True,
                           submission_prefix=root + "/submission"),
    )
    return base, values


MODELS = {"pointpillars": pointpillars, "retinanet": retinanet, "centerpoint": centerpoint, "pgd": pgd}


# ---------------------------------------------------------------------------------------------
# Training and recording


def configs(tmp_path, model: str) -> dict:
    """The four config files of a model: plain and switched, epoch and iteration loops."""
    root = str(tmp_path / "data")
    base, values = MODELS[model](root)
    common = dict(
        train_dataloader=dict(sampler=dict(shuffle=False)),
        train_cfg=dict(max_epochs=2, val_interval=1),
        default_hooks=dict(checkpoint=dict(interval=1), logger=dict(interval=1)),
        randomness=dict(seed=0, deterministic=False),
        log_level="WARNING",
    )
    for k, v in common.items():
        values[k] = _merge(values.get(k), v)
    out = {}
    out["plain", "Epoch"] = write_config(str(tmp_path / "plain_epoch.py"), base, values)
    out["plain", "Iter"] = write_config(str(tmp_path / "plain_iter.py"), out["plain", "Epoch"], dict(
        train_cfg=dict(_delete_=True, type="IterBasedTrainLoop", max_iters=3, val_interval=3),
        default_hooks=dict(checkpoint=dict(by_epoch=False))))
    for loop in ("Epoch", "Iter"):
        out["switched", loop] = write_switched(str(tmp_path / f"switched_{loop.lower()}.py"), out["plain", loop])
    return out


snap = data.snapshot
RECORDS: list = []  # (mode, what the model's forward received, what it returned), call by call
_run_forward = BaseModel._run_forward


def _recording_run_forward(self, data, mode):
    out = _run_forward(self, data, mode)
    RECORDS.append((mode, snap(data), snap(out)))
    return out


WARM: set = set()


def warm_up(cfg: Config) -> None:
    """Runs the training pipeline once on its first sample, in this process: numba compiles
    mmdet3d's box functions here once (seconds) instead of in the first run and again in every
    DataLoader worker."""
    if cfg.filename in WARM:
        return
    from mmengine.registry import DATASETS, init_default_scope

    init_default_scope(cfg.default_scope)
    DATASETS.build(cfg.train_dataloader.dataset)[0]
    WARM.add(cfg.filename)


def train(cfg_path: str, work_dir: str, workers: int, resume: str | None = None,
          zero_edit: bool = False) -> tuple[list, dict, bool]:
    """Trains cfg_path with mmengine's Runner (as tools/train.py does), returning what the model's
    forward received and returned at each call, the weights after training, and whether the run
    had the switch (mtc_loader's loop, preprocessor and collate). With zero_edit, the config goes
    through ``mtc_loader.mmengine.switch_config`` first."""
    cfg = Config.fromfile(cfg_path)
    cfg.merge_from_dict({
        "train_dataloader.num_workers": workers, "train_dataloader.persistent_workers": workers > 0,
        "val_dataloader.num_workers": workers, "val_dataloader.persistent_workers": workers > 0,
        "test_dataloader.num_workers": workers, "test_dataloader.persistent_workers": workers > 0,
    })
    cfg.work_dir = work_dir
    cfg.experiment_name = f"{os.path.basename(cfg_path)}-{time.monotonic_ns()}"
    if resume:
        cfg.resume, cfg.load_from = True, resume
    if zero_edit:
        from mtc_loader.mmengine import switch_config

        cfg = switch_config(cfg)
    RECORDS.clear()
    warm_up(cfg)
    # Config.pretty_text formats the whole config with yapf (seconds on a small CPU) for the log
    # and the checkpoints' meta: the tests leave it out
    with mock.patch.object(BaseModel, "_run_forward", _recording_run_forward), \
            mock.patch.object(Config, "pretty_text", new_callable=mock.PropertyMock, return_value="# not formatted"):
        # as the projects' tools/train.py builds it
        runner = RUNNERS.build(cfg) if "runner_type" in cfg else Runner.from_cfg(cfg)
        runner.train()
    state = {k: snap(v) for k, v in runner.model.state_dict().items()}
    collate = runner.train_dataloader.collate_fn
    collate = getattr(collate, "func", collate)  # mmengine passes it as a functools.partial
    switched = (type(runner.train_loop).__name__.startswith("MTC")
                and type(runner.model.data_preprocessor).__name__ == "MTCDataPreprocessor"
                and str(getattr(collate, "__module__", "")).startswith("mtc_loader"))
    return list(RECORDS), state, switched


def assert_same_runs(ref, got, what: str) -> None:
    """got (the switch on) and ref (off) trained on the same data, with the same losses and
    predictions, to the same weights."""
    (ref_records, ref_state, ref_switched), (got_records, got_state, got_switched) = ref, got
    assert got_switched and not ref_switched, f"{what}: the switch is not where it should be"
    assert [r[0] for r in got_records] == [r[0] for r in ref_records], f"{what}: forward calls differ"
    for k, (r, g) in enumerate(zip(ref_records, got_records)):
        data.assert_same(r[1], g[1], f"{what}: call {k} ({r[0]}) inputs")
        data.assert_same(r[2], g[2], f"{what}: call {k} ({r[0]}) outputs")
    assert list(got_state) == list(ref_state)
    for name in ref_state:
        data.assert_same(ref_state[name], got_state[name], f"{what}: weight {name}")


@pytest.mark.parametrize("model", sorted(MODELS))
def test_epoch_loop_workers_validation_resume(tmp_path, monkeypatch, model):
    """2 workers, 2 epochs with a validation pass after each, then each run resumed from its
    first epoch's checkpoint: plain and switched agree call for call, in both."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # mmengine 0.10 on torch >= 2.6
    cfgs = configs(tmp_path, model)
    runs = {}
    for kind in ("plain", "switched"):
        runs[kind] = train(cfgs[kind, "Epoch"], str(tmp_path / kind), workers=2)
        assert sum(r[0] == "loss" for r in runs[kind][0]) == 4
        assert sum(r[0] == "predict" for r in runs[kind][0]) == 4
    assert_same_runs(runs["plain"], runs["switched"], "switched vs plain")
    # mmengine seeds each DataLoader worker from the seed alone: the resumed runs' workers start
    # afresh, so their data is not the whole run's second epoch (persistent workers), but the
    # same in both
    resumed = {kind: train(cfgs[kind, "Epoch"], str(tmp_path / (kind + "-resumed")), workers=2,
                           resume=str(tmp_path / kind / "epoch_1.pth")) for kind in ("plain", "switched")}
    assert sum(r[0] == "loss" for r in resumed["plain"][0]) == 2
    assert_same_runs(resumed["plain"], resumed["switched"], "resumed: switched vs plain")


@pytest.mark.parametrize("model", sorted(MODELS))
def test_iter_loop_no_workers(tmp_path, model):
    """num_workers=0, 3 iterations across an epoch's end, a validation pass at the end."""
    cfgs = configs(tmp_path, model)
    runs = {kind: train(cfgs[kind, "Iter"], str(tmp_path / kind), workers=0) for kind in ("plain", "switched")}
    assert sum(r[0] == "loss" for r in runs["plain"][0]) == 3
    assert sum(r[0] == "predict" for r in runs["plain"][0]) == 2
    assert_same_runs(runs["plain"], runs["switched"], "switched vs plain")


@pytest.mark.parametrize("model", ["pointpillars"])
def test_switch_config_without_editing_the_config(tmp_path, model):
    """switch_config on the plain config, built by Runner.from_cfg, 2 workers: the same as the
    plain run."""
    cfgs = configs(tmp_path, model)
    plain = train(cfgs["plain", "Iter"], str(tmp_path / "plain"), workers=2)
    switched = train(cfgs["plain", "Iter"], str(tmp_path / "switched"), workers=2, zero_edit=True)
    assert_same_runs(plain, switched, "switch_config vs plain")
