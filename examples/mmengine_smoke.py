"""Try mtc_loader's mmengine switch on a CPU in a few minutes, with no dataset to download.

    python3 examples/mmengine_smoke.py

It writes two configs the way users write them: ``base.py``, a small synthetic detection config
(mmdet's RetinaNet with a ResNet-18, inherited with ``_base_``, trained on random 64x64 images
whose samples carry numpy metainfo), and ``child.py``, which inherits ``base.py`` and adds the
switch's lines. It trains each for a few iterations, the base with mmengine's ``Runner`` and the
child with ``MTCRunner``, two DataLoader workers each, and checks that every iteration's losses
are the same, bit for bit. It needs mmengine, mmcv and mmdet (``tools/install_openmmlab.sh``).
"""
from __future__ import annotations

import os
import sys
import tempfile
import textwrap
import warnings

import numpy as np
import torch

ITERS = 3

BASE = """\
_base_ = ["mmdet::retinanet/retinanet_r18_fpn_1x_coco.py"]

default_scope = "mmdet"
model = dict(backbone=dict(init_cfg=None), bbox_head=dict(num_classes=3))
train_dataloader = dict(
    _delete_=True, batch_size=2, num_workers=2, persistent_workers=False,
    sampler=dict(type="DefaultSampler", shuffle=False),
    dataset=dict(type="SmokeDetection", n=16))
val_dataloader = None
val_cfg = None
val_evaluator = None
test_dataloader = None
test_cfg = None
test_evaluator = None
train_cfg = dict(_delete_=True, type="IterBasedTrainLoop", max_iters={iters}, val_interval=1000)
param_scheduler = []
optim_wrapper = dict(optimizer=dict(lr=0.001))
default_hooks = dict(checkpoint=dict(interval=1000), logger=dict(interval=1))
randomness = dict(seed=0, deterministic=True)
log_level = "WARNING"
visualizer = dict(type="DetLocalVisualizer", vis_backends=[])
env_cfg = dict(cudnn_benchmark=False, mp_cfg=dict(mp_start_method="fork"))
"""

# the lines a user adds to a child of the config they train (README, docs/mmengine.md)
CHILD = """\
_base_ = ["./base.py"]

custom_imports = dict(imports=["mtc_loader.mmengine"], allow_failed_imports=False)
runner_type = "MTCRunner"
"""


def _register() -> None:
    """The synthetic dataset, and a hook that records each iteration's losses, in mmdet's
    registries (a real project registers its own with ``custom_imports``)."""
    from mmdet.registry import DATASETS, HOOKS
    from mmdet.structures import DetDataSample
    from mmengine.hooks import Hook
    from mmengine.structures import InstanceData

    @DATASETS.register_module(force=True)
    class SmokeDetection(torch.utils.data.Dataset):
        """Random images with 1 to 4 boxes each, packed as mmdet's ``PackDetInputs`` packs them,
        with numpy metainfo (a projection matrix, as multi-camera heads read it)."""

        metainfo = {"classes": ("a", "b", "c")}

        def __init__(self, n: int):
            self.n = n

        def __len__(self) -> int:
            return self.n

        def __getitem__(self, i: int) -> dict:
            g = torch.Generator().manual_seed(i)
            k = 1 + i % 4
            xy = torch.rand(k, 2, generator=g) * 40
            wh = 8 + torch.rand(k, 2, generator=g) * 16
            sample = DetDataSample(metainfo={
                "img_id": i, "img_path": f"synthetic/{i}.png", "ori_shape": (64, 64), "img_shape": (64, 64),
                "pad_shape": (64, 64), "scale_factor": (1.0, 1.0), "flip": False, "flip_direction": None,
                "lidar2img": np.eye(4) * (i + 1)})
            sample.gt_instances = InstanceData(bboxes=torch.cat([xy, xy + wh], 1),
                                               labels=torch.randint(0, 3, (k,), generator=g))
            inputs = torch.randint(0, 256, (3, 64, 64), generator=g, dtype=torch.uint8)
            return {"inputs": inputs, "data_samples": sample}

    @HOOKS.register_module(force=True)
    class SmokeLosses(Hook):
        """Records each train iteration's losses (and checks that the metainfo the model saw
        kept its numpy arrays)."""

        def __init__(self) -> None:
            self.losses: list[dict[str, float]] = []

        def before_train_iter(self, runner, batch_idx, data_batch=None) -> None:
            for s in data_batch["data_samples"]:
                assert type(s.metainfo["lidar2img"]) is np.ndarray, type(s.metainfo["lidar2img"])

        def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
            self.losses.append({k: float(v) for k, v in outputs.items()})


def _train(path: str, work_dir: str) -> list[dict[str, float]]:
    """Trains a config file as the OpenMMLab projects' tools/train.py does; its losses."""
    from mmengine.config import Config
    from mmengine.registry import RUNNERS
    from mmengine.runner import Runner

    cfg = Config.fromfile(path)
    cfg.work_dir = work_dir
    cfg.custom_hooks = [dict(type="SmokeLosses")]
    runner = RUNNERS.build(cfg) if "runner_type" in cfg else Runner.from_cfg(cfg)
    runner.train()
    hook = next(h for h in runner.hooks if type(h).__name__ == "SmokeLosses")
    print(f"{os.path.basename(path)}: {type(runner).__name__}, {len(hook.losses)} iterations, "
          f"losses {[round(sum(d.values()), 4) for d in hook.losses]}")
    return hook.losses


def main() -> int:
    torch.set_num_threads(min(2, torch.get_num_threads()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the stack's imports warn (deprecations)
        _register()
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "base.py"), "w") as f:
                f.write(BASE.format(iters=ITERS))
            with open(os.path.join(d, "child.py"), "w") as f:
                f.write(CHILD)
            plain = _train(os.path.join(d, "base.py"), os.path.join(d, "plain"))
            switched = _train(os.path.join(d, "child.py"), os.path.join(d, "switched"))
    if len(plain) != ITERS or plain != switched:
        print(f"mmengine_smoke: the losses differ:\n  plain    {plain}\n  switched {switched}", file=sys.stderr)
        return 1
    print(f"mmengine_smoke: the switch and the plain Runner gave the same losses over {ITERS} iterations")
    return 0


if __name__ == "__main__":
    sys.exit(main())
