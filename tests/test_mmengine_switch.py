"""mtc_loader.mmengine's switch as users write it: in a child config of the configs shipped with
mmdet3d and mmdet (``_base_``), with ``switch_config`` and the ``train`` command; what hooks and
metrics receive; the iteration loop's end; the arena's message; metainfo copies; slots; the
bounded per-class table.

Skipped where mmengine is not installed; the tests of a real config where mmdet / mmdet3d is not.
"""
from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import textwrap
import time
import warnings
import weakref
from unittest import mock

import numpy as np
import pytest
import torch

with warnings.catch_warnings():  # mmengine's imports warn (deprecations)
    warnings.simplefilter("ignore")
    pytest.importorskip("mmengine", reason="needs mmengine (the test extra installs it)")
    from mmengine.config import Config
    from mmengine.evaluator import BaseMetric
    from mmengine.hooks import Hook
    from mmengine.model import BaseModel
    from mmengine.registry import DATASETS, LOOPS, METRICS, MODELS, RUNNERS, DefaultScope
    from mmengine.runner import Runner
    from mmengine.structures import BaseDataElement, InstanceData

    import mtc_loader
    import mtc_loader.mmengine as mm

from conftest import ROOT, fenced_block, mmengine_switch_lines, package_parent  # noqa: E402,I100

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

POINTPILLARS = "mmdet3d::pointpillars/pointpillars_hv_secfpn_8xb6-160e_kitti-3d-3class.py"
RETINANET = "mmdet::retinanet/retinanet_r50_fpn_1x_coco.py"

# the documented child-config lines (docs/mmengine.md)
THREE_LINES = """
custom_imports = dict(imports=["mtc_loader.mmengine"], allow_failed_imports=False)
runner_type = "MTCRunner"
"""
LINE_BY_LINE = """
custom_imports = dict(imports=["mtc_loader.mmengine"], allow_failed_imports=False)
runner_type = "MTCRunner"
train_dataloader = dict(collate_fn=dict(type="mtc_packed_collate"))
val_dataloader = dict(collate_fn=dict(type="mtc_packed_collate"))
test_dataloader = dict(collate_fn=dict(type="mtc_packed_collate"))
model = dict(data_preprocessor=dict(type="MTCDataPreprocessor", preprocessor="{pre}", arena_bytes=64 << 20))
train_cfg = dict(type="MTCEpochBasedTrainLoop", prefetch_depth=3)
val_cfg = dict(type="MTCValLoop")
test_cfg = dict(type="MTCTestLoop")
"""


def child(tmp_path, base: str, lines: str, name: str = "child.py") -> Config:
    path = tmp_path / name
    path.write_text(f"_base_ = [{base!r}]\n" + textwrap.dedent(lines))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Config.fromfile(str(path))


# ------------------------------------------------------------------------- a small model and data

class Sample(BaseDataElement):
    pass


SHARED = {"lidar2img": np.arange(16.0).reshape(4, 4), "cams": ["a", "b"]}


class Samples(torch.utils.data.Dataset):
    """Samples that hold the dataset's own metainfo objects (as a dataset that caches them)."""

    metainfo = {"classes": ("a", "b")}

    calls = [0]  # samples loaded (the Runner deep-copies the dataset of a config dict)

    def __init__(self, n: int = 8) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        self.calls[0] += 1
        g = torch.Generator().manual_seed(i)
        ds = Sample(metainfo={"lidar2img": SHARED["lidar2img"], "cams": SHARED["cams"], "idx": i})
        ds.gt_instances = InstanceData(labels=torch.randint(0, 2, (1 + i % 3,), generator=g))
        return {"inputs": torch.rand(3, 4, generator=g), "data_samples": ds}


class Toy(BaseModel):
    def __init__(self, data_preprocessor=None) -> None:
        super().__init__(data_preprocessor=data_preprocessor)
        self.w = torch.nn.Parameter(torch.ones(1))

    def forward(self, inputs, data_samples=None, mode="tensor"):
        loss = self.w.sum() * sum(float(x.sum()) for x in inputs)
        if mode == "loss":
            return {"loss": loss}
        return list(data_samples)


SEEN: list = []


class ReadsBatch(Hook):
    """A hook that reads ``data_batch['data_samples']``, as users' hooks and visualizers do."""

    def _read(self, where, data_batch):
        SEEN.append((where, type(data_batch["data_samples"][0]).__name__, data_batch["inputs"][0].device.type))

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        self._read("before_train_iter", data_batch)

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        self._read("after_train_iter", data_batch)

    def before_val_iter(self, runner, batch_idx, data_batch=None):
        self._read("before_val_iter", data_batch)

    def after_val_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        self._read("after_val_iter", data_batch)

    def after_test_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        self._read("after_test_iter", data_batch)


@METRICS.register_module(force=True)
class ReadsBatchMetric(BaseMetric):
    def process(self, data_batch, data_samples):
        SEEN.append(("metric", type(data_batch["data_samples"][0]).__name__, data_batch["inputs"][0].device.type))
        self.results.append(len(data_samples))

    def compute_metrics(self, results):
        return {"n": float(sum(results))}


def toy_config(work_dir, *, loop="epoch", prefetch_depth=None, n=8) -> dict:
    loader = dict(dataset=Samples(n), sampler=dict(type="DefaultSampler", shuffle=False), batch_size=4,
                  num_workers=0)
    train_cfg = dict(by_epoch=True, max_epochs=1) if loop == "epoch" else dict(by_epoch=False, max_iters=2)
    if prefetch_depth is not None:
        train_cfg["prefetch_depth"] = prefetch_depth
    return dict(
        model=Toy(), work_dir=str(work_dir), train_dataloader=loader, val_dataloader=dict(loader),
        test_dataloader=dict(loader), train_cfg=train_cfg, val_cfg=dict(), test_cfg=dict(),
        val_evaluator=dict(type="ReadsBatchMetric"), test_evaluator=dict(type="ReadsBatchMetric"),
        optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.01)), custom_hooks=[ReadsBatch()],
        default_hooks=dict(checkpoint=None, logger=None), log_level="ERROR", default_scope="mmengine", cfg=dict(),
        env_cfg=dict(cudnn_benchmark=False, dist_cfg=dict(backend="gloo")))


# ------------------------------------------------------------------------- child configs of real ones

@pytest.fixture
def mmdet3d_models():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("mmdet3d.models", reason="needs mmdet3d (README: OpenMMLab's stack)")


@pytest.mark.parametrize("lines", ["three", "line_by_line"])
def test_child_of_mmdet3d_pointpillars(tmp_path, mmdet3d_models, lines):
    """The documented lines in a child of mmdet3d's PointPillars config: the wrapped preprocessor
    is the base's (Det3DDataPreprocessor with its voxel arguments), the loops accept the
    schedule's by_epoch, the loaders are packed."""
    cfg = child(tmp_path, POINTPILLARS, THREE_LINES if lines == "three" else
                LINE_BY_LINE.format(pre="Det3DDataPreprocessor"))
    base = child(tmp_path, POINTPILLARS, "", "plain.py")
    assert cfg.train_cfg.get("by_epoch") is True  # inherited from cyclic-40e.py
    switched = mm.switch_config(cfg)
    assert switched.train_cfg.type == "MTCEpochBasedTrainLoop" and "by_epoch" not in switched.train_cfg
    assert switched.train_cfg.max_epochs == base.train_cfg.max_epochs
    assert switched.val_cfg.type == "MTCValLoop" and switched.test_cfg.type == "MTCTestLoop"
    for kind in ("train", "val", "test"):
        assert switched[f"{kind}_dataloader"].collate_fn.type == "mtc_packed_collate"
    with DefaultScope.overwrite_default_scope("mmdet3d"):
        model = MODELS.build(switched.model)
        ref = MODELS.build(base.model).data_preprocessor
    pre = model.data_preprocessor
    assert type(pre) is mm.MTCDataPreprocessor
    assert type(pre.preprocessor).__name__ == "Det3DDataPreprocessor"
    assert pre.preprocessor.voxel is True
    assert pre.preprocessor.voxel_layer is not None
    assert pre.preprocessor.voxel_type == ref.voxel_type
    # the train loop built from the child's train_cfg (type and the inherited by_epoch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runner = mm.MTCRunner(**dict(toy_config(tmp_path / "wd"), train_cfg=cfg.train_cfg.to_dict()
                                     if lines == "line_by_line" else dict(cfg.train_cfg)))
        loop = runner.build_train_loop(runner._train_loop)
    assert type(loop) is mm.MTCEpochBasedTrainLoop and loop.max_epochs == base.train_cfg.max_epochs
    if lines == "line_by_line":
        assert loop.prefetch_depth == 3


def test_plain_runner_refuses_what_mtcrunner_takes(tmp_path):
    """mmengine's Runner refuses a train_cfg with type and by_epoch (a child's merge); MTCRunner
    builds the mtc_loader loop, which checks by_epoch itself."""
    cfg = toy_config(tmp_path, prefetch_depth=2)
    cfg["train_cfg"]["type"] = "MTCEpochBasedTrainLoop"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = Runner(**dict(cfg, work_dir=str(tmp_path / "plain")))
        with pytest.raises(RuntimeError, match="Only one of"):
            plain.build_train_loop(plain._train_loop)
        runner = mm.MTCRunner(**cfg)
        assert type(runner.build_train_loop(runner._train_loop)) is mm.MTCEpochBasedTrainLoop
    with pytest.raises(ValueError, match="MTCIterBasedTrainLoop"):
        LOOPS.build(dict(type="MTCEpochBasedTrainLoop", by_epoch=False, max_epochs=1),
                    default_args=dict(runner=runner, dataloader=runner._train_dataloader))


def test_child_of_mmdet3d_runner_builds(tmp_path, mmdet3d_models):
    """RUNNERS.build (tools/train.py with a runner_type) on the three-line child of PointPillars."""
    pytest.importorskip("pyquaternion", reason="mmdet3d's runtime imports (README: OpenMMLab's stack)")
    cfg = child(tmp_path, POINTPILLARS, THREE_LINES)
    cfg.work_dir = str(tmp_path / "wd")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runner = RUNNERS.build(cfg)
    assert type(runner) is mm.MTCRunner
    assert type(runner.model.data_preprocessor.preprocessor).__name__ == "Det3DDataPreprocessor"
    assert runner.cfg.train_cfg.type == "MTCEpochBasedTrainLoop"  # the config it keeps is the switched one


@pytest.mark.parametrize("lines", ["three", "line_by_line"])
def test_child_of_mmdet_retinanet(tmp_path, lines):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("mmdet.models", reason="needs mmdet (README: OpenMMLab's stack)")
        cfg = child(tmp_path, RETINANET, THREE_LINES if lines == "three" else
                    LINE_BY_LINE.format(pre="DetDataPreprocessor"))
        base = child(tmp_path, RETINANET, "", "plain.py")
        cfg.work_dir = str(tmp_path / "wd")
        cfg.model.backbone.init_cfg = None
        runner = RUNNERS.build(cfg)
    pre = runner.model.data_preprocessor
    assert type(pre) is mm.MTCDataPreprocessor and type(pre.preprocessor).__name__ == "DetDataPreprocessor"
    ref_mean = torch.tensor(base.model.data_preprocessor.mean).view(-1, 1, 1)
    assert torch.equal(pre.preprocessor.mean, ref_mean)
    assert pre.preprocessor.pad_size_divisor == base.model.data_preprocessor.pad_size_divisor
    assert runner.cfg.train_cfg.type == "MTCEpochBasedTrainLoop"
    assert runner.cfg.train_cfg.max_epochs == base.train_cfg.max_epochs
    assert runner.cfg.val_cfg.type == "MTCValLoop"


def test_preprocessor_inherited_keys_without_a_type_say_what_to_add():
    with pytest.raises(TypeError, match="preprocessor='Det3DDataPreprocessor'.*runner_type='MTCRunner'"):
        mm.MTCDataPreprocessor(voxel=True, voxel_layer=dict())
    pre = mm.MTCDataPreprocessor(preprocessor=dict(type="BaseDataPreprocessor"), non_blocking=True)
    assert type(pre.preprocessor).__name__ == "BaseDataPreprocessor"


def test_switch_config_keeps_others_and_is_idempotent():
    cfg = Config(dict(
        model=dict(type="X", data_preprocessor=dict(type="P", a=1)),
        train_dataloader=dict(collate_fn=dict(type="default_collate")),
        val_dataloader=dict(), test_dataloader=dict(),
        train_cfg=dict(by_epoch=False, max_iters=5), val_cfg=dict(type="TeacherStudentValLoop"), test_cfg=dict(),
        custom_imports=dict(imports=["project.mod"], allow_failed_imports=False)))
    once = mm.switch_config(cfg)
    assert "data_preprocessor" in cfg.model and cfg.model.data_preprocessor.type == "P"  # not changed
    assert once.model.data_preprocessor == dict(type="MTCDataPreprocessor", preprocessor=dict(type="P", a=1))
    assert once.train_cfg == dict(type="MTCIterBasedTrainLoop", max_iters=5)
    assert once.train_dataloader.collate_fn == dict(type="mtc_packed_collate", collate_fn="default_collate")
    assert once.val_cfg.type == "TeacherStudentValLoop" and "collate_fn" not in once.val_dataloader
    assert once.test_cfg.type == "MTCTestLoop"
    assert once.custom_imports.imports == ["project.mod", "mtc_loader.mmengine"]
    assert mm.switch_config(once).to_dict() == once.to_dict()


# ------------------------------------------------------------------------- the README's switch

README_BASE = """
model = dict(type="MtcReadmeToy")
train_dataloader = dict(dataset=dict(type="MtcReadmeSamples"), sampler=dict(type="DefaultSampler", shuffle=False),
                        batch_size=4, num_workers=0)
train_cfg = dict(by_epoch=True, max_epochs=2, val_interval=1)   # as mmdet3d's schedules write it
optim_wrapper = dict(type="OptimWrapper", optimizer=dict(type="SGD", lr=0.01))
default_hooks = dict(logger=None, checkpoint=None)
default_scope = "mmengine"
log_level = "ERROR"
"""
MODELS.register_module(name="MtcReadmeToy", module=Toy, force=True)
DATASETS.register_module(name="MtcReadmeSamples", module=Samples, force=True)


def test_readme_shows_the_docs_switch():
    """The README's OpenMMLab paragraph shows the child config docs/mmengine.md leads with (the
    config trained, and two lines), and the command; not the line-by-line switch, whose
    train_cfg type fails under a base schedule's by_epoch without runner_type."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    with open(os.path.join(ROOT, "docs", "mmengine.md")) as f:
        docs = f.read()
    block = fenced_block(readme, "With OpenMMLab's mmengine")
    assert block == fenced_block(docs, "## Switching a config")
    assert 'runner_type = "MTCRunner"' in block and '"mtc_loader.mmengine"' in block
    start = readme.index("With OpenMMLab's mmengine")
    paragraph = readme[start:readme.index("\n\n", readme.index("```\n", readme.index("```python", start) + 9) + 4)]
    assert "python3 -m mtc_loader.mmengine train" in paragraph
    for old in ("MTCEpochBasedTrainLoop", "mtc_packed_collate", "MTCDataPreprocessor"):
        assert old not in paragraph, old


def _train_file(path: str, work_dir) -> tuple:
    """Trains a config file as the OpenMMLab projects' tools/train.py builds its runner; returns
    the runner and its weights."""
    cfg = Config.fromfile(path)
    cfg.work_dir = str(work_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runner = RUNNERS.build(cfg) if "runner_type" in cfg else Runner.from_cfg(cfg)
        runner.train()
    return runner, {k: v.clone() for k, v in runner.model.state_dict().items()}


def test_child_config_of_the_readme_trains(tmp_path):
    """A child config written from the README's lines, under a base whose schedule has
    by_epoch=True: it trains with the switch on, to the base's weights, bit for bit."""
    _, lines = mmengine_switch_lines()
    (tmp_path / "base.py").write_text(README_BASE)
    (tmp_path / "child.py").write_text('_base_ = ["./base.py"]\n' + lines)
    plain, plain_state = _train_file(str(tmp_path / "base.py"), tmp_path / "plain")
    runner, state = _train_file(str(tmp_path / "child.py"), tmp_path / "child")
    assert type(plain.train_loop).__name__ == "EpochBasedTrainLoop"
    assert type(runner) is mm.MTCRunner and type(runner.train_loop) is mm.MTCEpochBasedTrainLoop
    assert type(runner.model.data_preprocessor) is mm.MTCDataPreprocessor
    assert runner.train_loop.epoch == plain.train_loop.epoch == 2
    assert list(state) == list(plain_state)
    for k in state:
        assert torch.equal(state[k], plain_state[k]), k
    assert not torch.equal(state["w"], torch.ones(1))  # it trained


# ------------------------------------------------------------------------- a plain Runner from the switched config

def _mtc_warnings(records) -> list:
    return [str(w.message) for w in records if "mtc_loader" in str(w.message)]


def test_plain_runner_from_cfg_says_runner_type_is_ignored(tmp_path, monkeypatch):
    """Runner.from_cfg on a config naming MTCRunner builds mmengine's Runner (it ignores
    runner_type): said once, with the two ways to build the runner the config names."""
    monkeypatch.setattr(mm._switch, "_said_ignored", False, raising=False)
    (tmp_path / "base.py").write_text(README_BASE + f"work_dir = {str(tmp_path / 'wd')!r}\n")
    (tmp_path / "child.py").write_text('_base_ = ["./base.py"]\n' + THREE_LINES)
    cfg, plain = Config.fromfile(str(tmp_path / "child.py")), Config.fromfile(str(tmp_path / "base.py"))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        runner = Runner.from_cfg(cfg)
        again = Runner.from_cfg(cfg)  # once
    said = _mtc_warnings(seen)
    assert len(said) == 1, said
    assert "runner_type='MTCRunner'" in said[0] and "without mtc_loader's switch" in said[0]
    assert "RUNNERS.build(cfg)" in said[0] and "MTCRunner.from_cfg(cfg)" in said[0]
    assert type(runner) is Runner and type(again) is Runner  # mmengine's behaviour is kept
    assert seen[[str(w.message) for w in seen].index(said[0])].filename == __file__  # points at the call
    # the builds that honour runner_type, and a config without it, say nothing
    monkeypatch.setattr(mm._switch, "_said_ignored", False, raising=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert type(RUNNERS.build(cfg)) is mm.MTCRunner
        assert type(mm.MTCRunner.from_cfg(cfg)) is mm.MTCRunner
        assert type(Runner.from_cfg(plain)) is Runner
    assert not _mtc_warnings(seen)


# ------------------------------------------------------------------------- the train command

CLI_MODULE = '''
import torch
from mmengine.model import BaseModel
from mmengine.registry import DATASETS, MODELS
from mmengine.structures import BaseDataElement


@DATASETS.register_module()
class MtcCliSamples(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return {"inputs": torch.full((2,), float(i)), "data_samples": BaseDataElement(metainfo={"i": i})}


@MODELS.register_module()
class MtcCliModel(BaseModel):
    def __init__(self, data_preprocessor=None):
        super().__init__(data_preprocessor=data_preprocessor)
        self.w = torch.nn.Parameter(torch.ones(1))

    def forward(self, inputs, data_samples=None, mode="tensor"):
        print("MTC-CLI", type(self.data_preprocessor).__name__, type(data_samples[0]).__name__, flush=True)
        return {"loss": self.w.sum() * sum(float(x.sum()) for x in inputs)}
'''

CLI_CONFIG = '''
custom_imports = dict(imports=["mtc_cli_toy"], allow_failed_imports=False)
model = dict(type="MtcCliModel")
train_dataloader = dict(dataset=dict(type="MtcCliSamples"), sampler=dict(type="DefaultSampler", shuffle=False),
                        batch_size=4, num_workers=0)
train_cfg = dict(by_epoch=True, max_epochs=3)
optim_wrapper = dict(type="OptimWrapper", optimizer=dict(type="SGD", lr=0.01))
default_hooks = dict(logger=dict(type="LoggerHook", interval=1), checkpoint=dict(type="CheckpointHook", interval=1))
env_cfg = dict(cudnn_benchmark=False, dist_cfg=dict(backend="gloo"))
log_level = "WARNING"
'''


def test_train_command_parses_as_tools_train(tmp_path):
    from mtc_loader.mmengine.__main__ import _parser, build_config

    (tmp_path / "mtc_cli_toy.py").write_text(CLI_MODULE)
    (tmp_path / "cfg.py").write_text(CLI_CONFIG)
    sys.path.insert(0, str(tmp_path))
    try:
        args = _parser().parse_args(["train", str(tmp_path / "cfg.py"), "--work-dir", str(tmp_path / "wd"),
                                     "--amp", "--resume", "--launcher", "pytorch", "--prefetch-depth", "0",
                                     "--arena-bytes", str(32 << 20),
                                     "--cfg-options", "train_cfg.max_epochs=1", "train_dataloader.batch_size=2"])
        cfg = build_config(args)
    finally:
        sys.path.remove(str(tmp_path))
    assert cfg.work_dir == str(tmp_path / "wd") and cfg.launcher == "pytorch"
    assert cfg.resume is True and cfg.load_from is None
    assert cfg.optim_wrapper.type == "AmpOptimWrapper"
    assert cfg.train_cfg == dict(type="MTCEpochBasedTrainLoop", max_epochs=1, prefetch_depth=0)
    assert cfg.train_dataloader.batch_size == 2 and cfg.train_dataloader.collate_fn.type == "mtc_packed_collate"
    assert cfg.model.data_preprocessor == dict(type="MTCDataPreprocessor", arena_bytes=32 << 20)
    args = _parser().parse_args(["train", str(tmp_path / "cfg.py"), "--resume", "ckpt.pth"])
    with mock.patch.dict(sys.modules):
        sys.path.insert(0, str(tmp_path))
        try:
            cfg = build_config(args)
        finally:
            sys.path.remove(str(tmp_path))
    assert cfg.resume is True and cfg.load_from == "ckpt.pth"
    assert cfg.work_dir == os.path.join("./work_dirs", "cfg")


def test_train_command_trains_and_resumes_on_the_cpu(tmp_path):
    """``python3 -m mtc_loader.mmengine train``: a real run (3 epochs of a toy model), then a
    resume, which loads mmengine's checkpoint (torch >= 2.6's weights-only default refuses what
    it holds) with nothing set."""
    (tmp_path / "mtc_cli_toy.py").write_text(CLI_MODULE)
    (tmp_path / "cfg.py").write_text(CLI_CONFIG)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), package_parent()]), CUDA_VISIBLE_DEVICES="")
    env.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
    cmd = [sys.executable, "-W", "ignore", "-m", "mtc_loader.mmengine", "train", str(tmp_path / "cfg.py"),
           "--work-dir", str(tmp_path / "wd"), "--cfg-options", "train_cfg.max_epochs=2"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("MTC-CLI MTCDataPreprocessor BaseDataElement") == 4  # 2 epochs of 2 batches
    assert (tmp_path / "wd" / "epoch_2.pth").exists()
    out = subprocess.run(cmd[:-1] + ["train_cfg.max_epochs=3", "--resume"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("MTC-CLI") == 2  # the third epoch only
    assert (tmp_path / "wd" / "epoch_3.pth").exists()
    assert "weights_only=False" in out.stdout + out.stderr  # the trust it takes is said


BAD_CONFIGS = {
    "syntax": ("cfg.py", "a = 1\nb = dict(\nc = 2\n", r"cfg\.py, line 2: SyntaxError: .*never closed"),
    "base_syntax": ("cfg.py", '_base_ = ["./base.py"]\n', r"cfg\.py: \S*base\.py, line 2: SyntaxError: .*never closed"),
    "name": ("cfg.py", "a = 1\nb = undefined_name\n", r"cfg\.py, line 2: NameError: name 'undefined_name'"),
    "base_missing": ("cfg.py", '_base_ = ["./nothere.py"]\n', r"cfg\.py: no file .*nothere\.py"),
}


@pytest.mark.parametrize("case", ["missing"] + sorted(BAD_CONFIGS))
def test_train_command_config_errors(tmp_path, monkeypatch, capsys, case):
    """A config that is not there, or that does not parse or run: argparse's way (the usage,
    ``error: ...`` naming the file and line, exit status 2), no traceback."""
    from mtc_loader.mmengine.__main__ import main

    monkeypatch.chdir(tmp_path)
    # the command sets LOCAL_RANK, as mmengine's tools/train.py does; here it runs in the test's
    # process, whose later tests (accelerate's) would read it as a distributed launch
    monkeypatch.setenv("LOCAL_RANK", "0")
    (tmp_path / "base.py").write_text("a = 1\nb = (\n")
    if case == "missing":
        path, expected = "missing.py", r"no config file missing\.py\n"
    else:
        path, text, expected = BAD_CONFIGS[case]
        (tmp_path / path).write_text(text)
    with pytest.raises(SystemExit) as e:
        main(["train", path])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python3 -m mtc_loader.mmengine train"), err
    expected = expected if case == "missing" else r"config file (\S*/)?" + expected
    assert re.search(r"train: error: " + expected, err), err
    assert "Traceback" not in err


DIST_MODULE = """
import os
import threading

import torch
import torch.distributed as dist
from mmengine.hooks import Hook
from mmengine.model import BaseDataPreprocessor, BaseModel
from mmengine.registry import DATASETS, HOOKS, MODELS
from mmengine.structures import BaseDataElement


def record(line):
    with open(os.path.join(os.environ["MTC_RECORDS"], f"rank{dist.get_rank()}.txt"), "a") as f:
        f.write(line + "\\n")


@DATASETS.register_module()
class MtcDistSamples(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"inputs": torch.randn(4, generator=g), "data_samples": BaseDataElement(metainfo={"i": i})}


@MODELS.register_module()
class MtcDistModel(BaseModel):
    def __init__(self, data_preprocessor=None):
        super().__init__(data_preprocessor=data_preprocessor)
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, inputs, data_samples=None, mode="tensor"):
        loss = self.lin(torch.stack(inputs)).pow(2).mean()
        record(f"{type(self.data_preprocessor).__name__} {[d.i for d in data_samples]} {loss.item().hex()}")
        return {"loss": loss}


@MODELS.register_module()
class MtcDistPre(BaseDataPreprocessor):
    mtc_run_ahead = True

    def forward(self, data, training=False):
        with open(os.path.join(os.environ["MTC_RECORDS"], f"pre{dist.get_rank()}.txt"), "a") as f:
            f.write(threading.current_thread().name + "\\n")
        return super().forward(data, training)


@HOOKS.register_module()
class MtcDistLoopHook(Hook):
    def before_train(self, runner):
        record(f"loop {type(runner.train_loop).__name__} {type(runner.model).__name__}")

    def after_train(self, runner):
        record("weight " + " ".join(x.hex() for x in runner.model.module.lin.weight.view(-1).tolist()))
"""

DIST_CONFIG = """
custom_imports = dict(imports=["mtc_dist_toy"], allow_failed_imports=False)
model = dict(type="MtcDistModel")
train_dataloader = dict(dataset=dict(type="MtcDistSamples"), sampler=dict(type="DefaultSampler", shuffle=True),
                        batch_size=2, num_workers=1)
train_cfg = dict(by_epoch=True, max_epochs=2)
optim_wrapper = dict(type="OptimWrapper", optimizer=dict(type="SGD", lr=0.1))
custom_hooks = [dict(type="MtcDistLoopHook")]
default_hooks = dict(logger=dict(type="LoggerHook", interval=1), checkpoint=None)
env_cfg = dict(cudnn_benchmark=False, dist_cfg=dict(backend="nccl"))
randomness = dict(seed=0)
log_level = "WARNING"
"""

# tools/train.py's path with mmengine's own Runner, made to work on the CPU by hand: the process
# group set up (gloo) before the Runner, whose init_dist calls torch.cuda.set_device, and DDP
# without device_ids
PLAIN_TRAIN = """
import sys

import torch.distributed as dist
from mmengine.config import Config
from mmengine.runner import Runner

cfg = Config.fromfile(sys.argv[1])
cfg.launcher, cfg.work_dir = "pytorch", sys.argv[2]
dist.init_process_group("gloo")
cfg.model_wrapper_cfg = dict(type="MMDistributedDataParallel", device_ids=None, broadcast_buffers=False)
Runner.from_cfg(cfg).train()
"""


def test_train_command_two_ranks_on_the_cpu(tmp_path):
    """``torchrun --nproc_per_node=2 -m mtc_loader.mmengine train CONFIG --launcher pytorch`` on
    the CPU (gloo): both ranks train with the switch, on the same data, to the same losses and
    weights as mmengine's Runner on two ranks, bit for bit; and so with the preprocessor run
    ahead (``run_ahead=True``: MMDistributedDataParallel calls it outside DDP's forward)."""
    (tmp_path / "mtc_dist_toy.py").write_text(DIST_MODULE)
    (tmp_path / "cfg.py").write_text(DIST_CONFIG)
    (tmp_path / "ahead.py").write_text('_base_ = ["./cfg.py"]\n'
                                       'model = dict(data_preprocessor=dict(type="MtcDistPre", run_ahead=True))\n')
    (tmp_path / "plain_train.py").write_text(PLAIN_TRAIN)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), package_parent()]), CUDA_VISIBLE_DEVICES="",
               OMP_NUM_THREADS="1")
    torchrun = [sys.executable, "-W", "ignore", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    records = {}
    cfg = str(tmp_path / "cfg.py")
    for kind, cmd in (("plain", [str(tmp_path / "plain_train.py"), cfg, str(tmp_path / "wd-plain")]),
                      ("switched", ["-m", "mtc_loader.mmengine", "train", cfg, "--launcher", "pytorch",
                                    "--work-dir", str(tmp_path / "wd-switched")]),
                      ("ahead", ["-m", "mtc_loader.mmengine", "train", str(tmp_path / "ahead.py"), "--launcher",
                                 "pytorch", "--work-dir", str(tmp_path / "wd-ahead")])):
        (tmp_path / kind).mkdir()
        out = subprocess.run(torchrun + cmd, env=dict(env, MTC_RECORDS=str(tmp_path / kind)), cwd=str(tmp_path),
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, (kind, out.stdout[-3000:], out.stderr[-5000:])
        records[kind] = [(tmp_path / kind / f"rank{r}.txt").read_text().splitlines() for r in (0, 1)]
    for rank in (0, 1):
        plain, switched = records["plain"][rank], records["switched"][rank]
        assert plain[0] == "loop EpochBasedTrainLoop MMDistributedDataParallel"
        assert switched[0] == "loop MTCEpochBasedTrainLoop MMDistributedDataParallel"
        assert len(plain) == len(switched) == 1 + 4 + 1  # 2 epochs of 2 batches per rank, the weights
        for p, s in zip(plain[1:-1], switched[1:-1]):
            assert p.split(" ", 1) == ["BaseDataPreprocessor", s.split(" ", 1)[1]]
            assert s.startswith("MTCDataPreprocessor ")
        assert plain[-1] == switched[-1] and plain[-1].startswith("weight ")
        assert records["ahead"][rank][1:] == switched[1:]
        ahead = (tmp_path / "ahead" / f"pre{rank}.txt").read_text().split()
        assert 4 <= len(ahead) and set(ahead) == {"mtc_loader-prefetch"}  # run ahead, on every rank
    batches = [[line.split(" ", 1)[1] for line in records["switched"][r][1:-1]] for r in (0, 1)]
    assert batches[0] != batches[1]  # each rank its own share of the data
    assert records["switched"][0][-1] == records["switched"][1][-1]  # DDP: one model


# ------------------------------------------------------------------------- hooks and metrics

@pytest.mark.parametrize("loop,prefetch_depth", [("epoch", 0), ("epoch", 2), ("iter", 0), ("iter", 2)])
def test_hooks_and_metrics_receive_the_batch(tmp_path, loop, prefetch_depth):
    """Train, validation and test loops with packed loaders (MTCRunner's switch), with and without
    prefetching: every hook and the metric read data_batch['data_samples']."""
    SEEN.clear()
    cfg = toy_config(tmp_path, loop=loop, prefetch_depth=prefetch_depth)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runner = mm.MTCRunner(**cfg)
        runner.train()
        runner.val()
        runner.test()
    assert type(runner.train_loop) is (mm.MTCEpochBasedTrainLoop if loop == "epoch" else mm.MTCIterBasedTrainLoop)
    assert type(runner.val_loop) is mm.MTCValLoop and type(runner.test_loop) is mm.MTCTestLoop
    assert runner.train_loop.prefetch_depth == prefetch_depth
    where = [w for w, _, _ in SEEN]
    assert where.count("before_train_iter") == where.count("after_train_iter") == 2
    # validation at the end of training, and runner.val()
    assert where.count("after_val_iter") == where.count("before_val_iter") == 4
    assert where.count("after_test_iter") == 2 and where.count("metric") == 6
    device = next(runner.model.parameters()).device.type  # (CUDA where there is one: the Runner's choice)
    assert {(t, d) for _, t, d in SEEN} == {("Sample", device)}


@pytest.mark.parametrize("stage", ["train", "val"])
def test_mmengine_loops_over_a_packed_loader_name_the_switch(tmp_path, stage):
    """A config that packs the loaders but keeps mmengine's loops (the collate switched, the
    runner not): the first hook that reads the PackedBatch is told to set runner_type."""
    cfg = toy_config(tmp_path)
    cfg["train_dataloader"]["collate_fn"] = cfg["val_dataloader"]["collate_fn"] = dict(type="mtc_packed_collate")
    cfg["model"] = Toy(data_preprocessor=dict(type="MTCDataPreprocessor"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runner = Runner(**cfg)
        with pytest.raises(TypeError, match="PackedBatch") as e:
            runner.train() if stage == "train" else runner.val()
    msg = str(e.value)
    assert 'runner_type = "MTCRunner"' in msg and "MTCEpochBasedTrainLoop" in msg and "MTCValLoop" in msg, msg
    assert "PrefetchLoader" not in msg, msg


def test_packed_batch_outside_mmengine_keeps_its_message():
    batch = mtc_loader.PackedCollate(list, arena_bytes=1 << 20)([{"x": torch.zeros(2)}])
    with pytest.raises(TypeError, match=r"batch\.to\(device\).*PrefetchLoader") as e:
        batch["x"]
    assert "runner_type" not in str(e.value)
    batch.to("cpu")


# ------------------------------------------------------------------------- the iteration loop's end

def test_iteration_loop_prefetches_no_batch_past_max_iters(tmp_path):
    """max_iters = one epoch's batches: the prefetching loop does not restart the DataLoader (no
    'Reach the end of the dataloader' warning, no sample loaded twice), as mmengine's loop."""
    cfg = toy_config(tmp_path, loop="iter", prefetch_depth=2)
    cfg["val_dataloader"] = cfg["test_dataloader"] = cfg["val_cfg"] = cfg["test_cfg"] = None
    cfg["val_evaluator"] = cfg["test_evaluator"] = None
    cfg["custom_hooks"] = None
    Samples.calls[0] = 0
    with warnings.catch_warnings(), mock.patch("mmengine.runner.loops.print_log") as log:
        warnings.simplefilter("ignore")
        runner = mm.MTCRunner(**cfg)
        runner.train()
    assert runner.train_loop.iter == 2
    assert not any("Reach the end" in str(c) for c in log.call_args_list)
    assert Samples.calls[0] == 8


# ------------------------------------------------------------------------- the arena's message

def test_arena_too_small_names_what_mmengine_users_set():
    pc = mm.PackedPseudoCollate()
    pc.arm(1 << 20)
    batch = [{"inputs": torch.zeros(1 << 20, dtype=torch.uint8)} for _ in range(2)]
    with pytest.raises(RuntimeError, match=r"MTCDataPreprocessor\(arena_bytes=\.\.\.\)") as e:
        pc(batch)
    assert "PackedCollate(arena_bytes" not in str(e.value)
    assert "model = dict(data_preprocessor=dict(arena_bytes=...))" in str(e.value)
    pc.arena.close() if hasattr(pc.arena, "close") else None


def test_arena_is_replaced_when_a_later_model_asks_for_more():
    """A model rebuilt in the same process with a larger arena_bytes (what the arena's message
    asks for) gets an arena of that size; a batch already in the old one unpacks as before (the
    old arena is kept while it holds one); None, or no more than the arena holds, keeps it."""
    pc = mm.PackedPseudoCollate()
    small = pc.arm(1 << 20)
    assert pc.arm(1 << 19) is small and pc.arm(None) is small and pc.arm(1 << 20) is small
    held = pc([{"inputs": torch.arange(4.)}])
    large = pc.arm(4 << 20)
    assert large is not small and large.stats()["bytes"] == 4 << 20 and pc.arena is large
    batch = pc([{"inputs": torch.zeros(3 << 20, dtype=torch.uint8)}])  # too big for the old one
    assert batch.unpack("cpu")["inputs"][0].shape == (3 << 20,)
    token = small.token
    del small
    assert mtc_loader._arena.ARENAS.get(token) is not None  # kept for the batch in it
    assert torch.equal(held.unpack("cpu")["inputs"][0], torch.arange(4.))
    del held
    pc.arm(None)  # drops the old arena now that it is empty
    gc.collect()
    assert mtc_loader._arena.ARENAS.get(token) is None and pc._retired == []
    with pytest.raises(ValueError, match="arena_bytes must be positive, got -1"):
        pc.arm(-1)
    assert pc.arm(4 << 20) is large


def test_a_replaced_arena_goes_with_its_last_batch():
    """Without loaders on it, the replaced arena is held only by the batches still in it: it is
    unmapped (its descriptor closed) as the last one goes, with no later call."""
    pc = mm.PackedPseudoCollate()
    small = pc.arm(1 << 20)
    token, fd = small.token, small._a.fileno()
    held = pc([{"inputs": torch.arange(4.)}])
    del small
    pc.arm(4 << 20)
    assert mtc_loader._arena.ARENAS.get(token) is not None
    assert torch.equal(held.unpack("cpu")["inputs"][0], torch.arange(4.))
    del held
    gc.collect()
    assert mtc_loader._arena.ARENAS.get(token) is None
    assert not os.path.exists(f"/proc/self/fd/{fd}") or "memfd" not in os.readlink(f"/proc/self/fd/{fd}")


def test_a_child_process_that_is_no_worker_of_it_does_not_hold_the_replaced_arena():
    """Only the DataLoader workers started on an arena hold it once it is replaced: another live
    child of the training process (a worker of another loader, a helper process) does not."""
    import multiprocessing
    pc = mm.PackedPseudoCollate()
    other = mm.PackedPseudoCollate()
    other.arm(1 << 20)
    token = pc.arm(1 << 20).token
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(30,), daemon=True)
    child.start()
    loader = torch.utils.data.DataLoader(_Numbered(), batch_size=2, num_workers=1, collate_fn=other,
                                         persistent_workers=True)
    try:
        assert next(iter(loader)).unpack("cpu")["inputs"][0].shape == (3,)
        pc.arm(4 << 20)
        gc.collect()
        assert pc._retired == [] and mtc_loader._arena.ARENAS.get(token) is None
    finally:
        child.kill()
        child.join()
        del loader


class _Numbered(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return {"inputs": torch.full((3,), float(i))}


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_persistent_workers_keep_their_arena_when_a_later_model_replaces_it(context):
    """A persistent-workers loader started on arena A keeps packing into A after a second model
    asks for a larger arena while A is empty: every later epoch unpacks (the arena is held while
    those workers live), a loader started after it uses the new arena, and A goes with the
    first loader's workers."""
    from functools import partial
    pc = mm.PackedPseudoCollate()
    old = pc.arm(1 << 20)
    token = old.token
    del old
    loader = torch.utils.data.DataLoader(_Numbered(), batch_size=2, num_workers=2, persistent_workers=True,
                                         multiprocessing_context=context, collate_fn=partial(pc))
    want = [[[float(2 * n + i)] * 3 for i in range(2)] for n in range(2)]

    def epoch(dl):
        return [[x.tolist() for x in b.unpack("cpu")["inputs"]] for b in dl]

    assert epoch(loader) == want
    assert pc.arena.stats()["slots_in_use"] == 0
    new = pc.arm(4 << 20)  # a second model, while the first loader's arena is empty
    assert new.token != token
    for _ in range(2):
        assert epoch(loader) == want  # the workers still pack into the old arena
    later = torch.utils.data.DataLoader(_Numbered(), batch_size=2, num_workers=1, multiprocessing_context=context,
                                        collate_fn=partial(pc))
    assert epoch(later) == want and new.stats()["allocs"] == 2
    assert mtc_loader._arena.ARENAS.get(token) is not None
    del loader, later
    gc.collect()
    assert mtc_loader._arena.ARENAS.get(token) is None


@pytest.mark.parametrize("value,kind", [(True, "bool"), (1.5e6, "float"), ("1.5M", "'1.5M'"), (0, "positive")])
def test_the_first_models_arena_bytes_is_checked_as_a_later_ones(value, kind):
    """arena_bytes=True or 1.5e6 was taken through int() by the first model (a one-slot arena, a
    1507328-byte one), and refused by a later one and by PackedCollate: refused alike now, with
    the same message as Arena's, and the train command's config check agrees."""
    msg = f"arena_bytes must be .*{kind}"
    first = mm.PackedPseudoCollate()
    with pytest.raises(ValueError, match=msg):
        first.arm(value)
    assert first.arena is None
    later = mm.PackedPseudoCollate()
    later.arm(1 << 20)
    with pytest.raises(ValueError, match=msg):
        later.arm(value)
    with pytest.raises(ValueError, match=msg):
        mtc_loader.PackedCollate(arena_bytes=value)
    with pytest.raises(ValueError, match=msg):
        mm.MTCDataPreprocessor(arena_bytes=value)


def test_every_entry_point_takes_arena_bytes_with_a_unit():
    """A size with a unit ("1MiB") is taken alike by the first model, a later one, PackedCollate
    and the train command's config check (which takes "512M" on its command line too)."""
    from mtc_loader.mmengine.__main__ import _check_switched
    first = mm.PackedPseudoCollate()
    assert first.arm("1MiB").stats()["bytes"] == 1 << 20
    later = mm.PackedPseudoCollate()
    later.arm(1 << 20)
    assert later.arm("2MiB").stats()["bytes"] == 2 << 20
    assert mtc_loader.PackedCollate(arena_bytes="1MiB").arena.stats()["bytes"] == 1 << 20
    errors = []
    _check_switched("cfg.py", {"model": {"data_preprocessor": {"arena_bytes": "1MiB"}}}, errors.append)
    _check_switched("cfg.py", {"model": {"data_preprocessor": {"arena_bytes": 1.5e6}}}, errors.append)
    assert len(errors) == 1 and "arena_bytes=1500000.0" in errors[0], errors


def test_the_preprocessors_default_keeps_the_arena_of_an_earlier_model():
    """MTCDataPreprocessor() after a model that asked for a smaller arena than 256 MiB keeps that
    arena (the default asks for no size); an explicit larger one replaces it."""
    pc = mm.packed_collate
    before = pc.arena
    try:
        pc.arena = None
        mm.MTCDataPreprocessor(arena_bytes=2 << 20)
        first = pc.arena
        assert first.stats()["bytes"] == 2 << 20
        mm.MTCDataPreprocessor()
        assert pc.arena is first
        mm.MTCDataPreprocessor(arena_bytes=3 << 20)
        assert pc.arena is not first and pc.arena.stats()["bytes"] == 3 << 20
    finally:
        pc.arena = before
        pc._packers.clear()


def test_a_config_arena_line_reaches_the_wrapper_not_the_wrapped(tmp_path):
    """model = dict(data_preprocessor=dict(arena_bytes=...)) in a child config: the switch gives
    it to MTCDataPreprocessor, and the base's preprocessor is built without it."""
    pytest.importorskip("mmdet", reason="needs mmdet (README: OpenMMLab's stack)")
    cfg = child(tmp_path, RETINANET, THREE_LINES + "model = dict(data_preprocessor=dict(arena_bytes=8 << 20))\n")
    pre = mm.switch_config(cfg).model.data_preprocessor
    assert pre.type == "MTCDataPreprocessor" and pre.arena_bytes == 8 << 20
    assert pre.preprocessor.type == "DetDataPreprocessor" and "arena_bytes" not in pre.preprocessor
    assert cfg.model.data_preprocessor.arena_bytes == 8 << 20  # the config itself is left as it was
    # over a base that names no preprocessor: the line alone, and the default preprocessor
    (tmp_path / "base.py").write_text(README_BASE)
    (tmp_path / "one.py").write_text('_base_ = ["./base.py"]\n' + THREE_LINES
                                     + "model = dict(data_preprocessor=dict(arena_bytes=8 << 20))\n")
    pre = mm.switch_config(Config.fromfile(str(tmp_path / "one.py"))).model.data_preprocessor
    assert pre == dict(type="MTCDataPreprocessor", arena_bytes=8 << 20)
    built = mm.MTCDataPreprocessor(**{k: v for k, v in pre.items() if k != "type"})
    assert type(built.preprocessor).__name__ == "BaseDataPreprocessor"
    assert mm.packed_collate.arena.stats()["bytes"] >= 8 << 20


# ------------------------------------------------------------------------- metainfo copies

def test_metainfo_values_are_copies_with_num_workers_0():
    """Packed in the process that trains, the model's metainfo values are copies of the
    dataset's (mmengine's .to deep-copies them), equal in value: a model that edits them in
    place does not edit a dataset that caches its samples."""
    cached = [Samples(4)[i] for i in range(4)]
    loader = torch.utils.data.DataLoader(cached, batch_size=2, num_workers=0, collate_fn=mm.packed_collate)
    for k, packed in enumerate(loader):
        batch = packed.to("cpu")
        for j, ds in enumerate(batch["data_samples"]):
            own = cached[2 * k + j]["data_samples"]
            assert ds.lidar2img is not own.lidar2img and np.array_equal(ds.lidar2img, own.lidar2img)
            assert ds.cams is not own.cams and ds.cams == own.cams
            ds.lidar2img[0, 0] = -1
            ds.cams.append("z")
    for sample in cached:
        assert sample["data_samples"].lidar2img[0, 0] == 0 and sample["data_samples"].cams == ["a", "b"]


# ------------------------------------------------------------------------- slots

class SlottedElement(BaseDataElement):
    __slots__ = ("track_ids",)


def test_slots_of_a_data_element_subclass_are_kept():
    el = SlottedElement(metainfo={"k": 1})
    el.boxes = torch.rand(3, 4)
    object.__setattr__(el, "track_ids", [7, 8, 9])
    out = mtc_loader.start_copy({"x": el}, "cpu").get()["x"]
    assert type(out) is SlottedElement and out.track_ids == [7, 8, 9] and out.k == 1
    assert torch.equal(out.boxes, el.boxes)


def test_slots_of_a_box_subclass_are_kept():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        structures = pytest.importorskip("mmdet3d.structures", reason="needs mmdet3d (README: OpenMMLab's stack)")

    class TrackedBoxes(structures.LiDARInstance3DBoxes):
        __slots__ = ("track_ids", "__secret")

        def __init__(self, tensor, track_ids):
            super().__init__(tensor)
            self.track_ids = track_ids
            self.__secret = "s"

    boxes = TrackedBoxes(torch.rand(3, 7), torch.arange(3))
    boxes.extra = "in __dict__"
    for out in (mtc_loader.start_copy([boxes], "cpu").get()[0],
                mm.packed_collate([{"b": boxes}]).to("cpu")["b"][0]):
        assert type(out) is TrackedBoxes
        assert torch.equal(out.track_ids, boxes.track_ids) and out._TrackedBoxes__secret == "s"
        assert out.extra == "in __dict__" and out.box_dim == 7 and torch.equal(out.tensor, boxes.tensor)


# ------------------------------------------------------------------------- the per-class table

def test_per_class_tables_are_bounded():
    """Classes made per batch are not kept alive by mtc_loader.mmengine's tables."""
    first = None
    for i in range(1200):
        cls = type(f"Made{i}", (BaseDataElement,), {})
        el = cls()
        el.t = torch.zeros(1)
        mtc_loader.start_copy([el], "cpu").get()
        if first is None:
            first = weakref.ref(cls)
        del cls, el
    gc.collect()
    assert mm._elements._moves_lists.cache_info().currsize <= 512
    assert mm._elements._slots.cache_info().currsize <= 512
    assert first() is None


def test_every_name_is_registered_on_import_and_by_custom_imports(tmp_path):
    """The module's rooms (data elements, collate, preprocessor, loops, hooks, switch) register
    everything when ``mtc_loader.mmengine`` is imported, and a config's ``custom_imports`` makes
    that import: in a fresh interpreter, each name is found in its registry as the object the
    package exports, the data elements and the structure types are containers of the walk, and
    the package exports what its ``__all__`` says."""
    (tmp_path / "cfg.py").write_text('custom_imports = dict(imports=["mtc_loader.mmengine"], allow_failed_imports=False)\n')
    code = f"""
        import sys, types, warnings
        warnings.simplefilter("ignore")
        from mmengine.config import Config
        from mmengine.registry import FUNCTIONS, LOOPS, MODELS, RUNNERS
        from mmengine.structures import InstanceData
        from mtc_loader import _tree
        assert "mtc_loader.mmengine" not in sys.modules and FUNCTIONS.get("mtc_packed_collate") is None
        assert _tree.element_kind(InstanceData) == _tree.LEAF_KIND
        Config.fromfile({str(tmp_path / "cfg.py")!r})
        mm = sys.modules["mtc_loader.mmengine"]
        assert FUNCTIONS.get("mtc_packed_collate") is mm.packed_collate
        assert MODELS.get("MTCDataPreprocessor") is mm.MTCDataPreprocessor
        for name in ("MTCEpochBasedTrainLoop", "MTCIterBasedTrainLoop", "MTCValLoop", "MTCTestLoop"):
            assert LOOPS.get(name) is getattr(mm, name), name
        assert RUNNERS.get("MTCRunner") is mm.MTCRunner
        assert _tree.element_kind(InstanceData) == _tree.GENERIC
        public = sorted(n for n, v in vars(mm).items() if not n.startswith("_") and n != "annotations"
                        and not isinstance(v, types.ModuleType))
        assert public == sorted(mm.__all__), public
        print("ok")
    """
    env = dict(os.environ, PYTHONPATH=package_parent())
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=package_parent(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


# every argument of the train command checked before anything starts: (arguments, config text or
# None for CLI_CONFIG, what error: says)
BAD_ARGUMENTS = {
    "arena_negative": (["--arena-bytes", "-1"], None, r"argument --arena-bytes: '-1' is not a size"),
    "arena_zero": (["--arena-bytes", "0"], None, r"argument --arena-bytes: '0' is not from 1 byte"),
    "arena_words": (["--arena-bytes", "lots"], None, r"argument --arena-bytes: 'lots' is not a size"),
    "arena_too_large": (["--arena-bytes", "65T"], None, r"argument --arena-bytes: '65T' is not from 1 byte to 64 TiB"),
    "depth_negative": (["--prefetch-depth", "-1"], None, r"argument --prefetch-depth: '-1' is not an int >= 0"),
    "depth_word": (["--prefetch-depth", "two"], None, r"argument --prefetch-depth: 'two' is not an int >= 0"),
    "local_rank": (["--local_rank", "-1"], None, r"argument --local_rank/--local-rank: '-1' is not an int >= 0"),
    "amp_no_wrapper": (["--amp"], "no_wrapper", r"--amp needs an optim_wrapper in the config .*has none"),
    "amp_other_wrapper": (["--amp"], "other_wrapper", r"--amp needs the optimizer wrapper type OptimWrapper"),
    "auto_scale_lr": (["--auto-scale-lr"], None, r"--auto-scale-lr needs \"auto_scale_lr\""),
    "resume_missing": (["--resume", "nothere.pth"], None, r"--resume nothere\.pth: no checkpoint file nothere\.pth"),
    "launcher_pytorch": (["--launcher", "pytorch"], None, r"--launcher pytorch reads RANK, WORLD_SIZE, MASTER_ADDR, "
                         r"MASTER_PORT from the environment, which are not set: start the command as torchrun"),
    "launcher_slurm": (["--launcher", "slurm"], None, r"--launcher slurm reads SLURM_PROCID"),
    "launcher_mpi": (["--launcher", "mpi"], None, r"--launcher mpi reads OMPI_COMM_WORLD_LOCAL_RANK"),
    "sync_bn": (["--sync_bn", "yes"], None, r"argument --sync_bn: invalid choice: 'yes'"),
    "cfg_options": (["--cfg-options", "train_dataloader.batch_size.x=2"], None, r"--cfg-options "),
    "work_dir_file": (["--work-dir", "a_file"], None, r"work dir a_file is a file, not a directory"),
    "work_dir_under_file": (["--work-dir", "a_file/wd"], None, r"work dir a_file/wd cannot be created: \S*a_file is a file"),
    "config_depth": ([], "bad_depth", r"config file cfg\.py: train_cfg\.prefetch_depth=-2: prefetch_depth must be "
                     r"an int >= 0"),
    "config_arena": ([], "bad_arena", r"config file cfg\.py: model\.data_preprocessor\.arena_bytes=0: arena_bytes "
                     r"must be positive"),
}
CONFIG_VARIANTS = {
    "no_wrapper": CLI_CONFIG.replace('optim_wrapper = dict(type="OptimWrapper", optimizer=dict(type="SGD", lr=0.01))', ""),
    "other_wrapper": CLI_CONFIG.replace('type="OptimWrapper"', 'type="mmengine::ZeroRedundancyOptimizer"'),
    "bad_depth": CLI_CONFIG.replace("max_epochs=3)", "max_epochs=3, prefetch_depth=-2)"),
    "bad_arena": CLI_CONFIG + 'model = dict(type="MtcCliModel", data_preprocessor=dict(type="MTCDataPreprocessor", '
                              'arena_bytes=0))\n',
}


@pytest.mark.parametrize("case", sorted(BAD_ARGUMENTS))
def test_train_command_bad_arguments_stop_before_anything_starts(tmp_path, monkeypatch, capsys, case):
    """Each argument of the command (and what the switch puts in the config) is checked before
    the runner starts: the usage, ``error: ...`` naming the argument, exit status 2, no traceback,
    and no work dir, log or config dump left behind."""
    from mtc_loader.mmengine.__main__ import main

    args, variant, expected = BAD_ARGUMENTS[case]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LOCAL_RANK", "0")  # (see test_train_command_config_errors)
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "OMPI_COMM_WORLD_LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "mtc_cli_toy.py").write_text(CLI_MODULE)
    (tmp_path / "cfg.py").write_text(CLI_CONFIG if variant is None else CONFIG_VARIANTS[variant])
    (tmp_path / "a_file").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    with mock.patch.dict(sys.modules), pytest.raises(SystemExit) as e:
        main(["train", "cfg.py", *args] + ([] if "--work-dir" in args else ["--work-dir", "wd"]))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python3 -m mtc_loader.mmengine train"), err
    assert re.search(r"train: error: " + expected, err), err
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "cfg.py", "mtc_cli_toy.py"]


def test_train_command_takes_sizes_with_units_and_shows_defaults(tmp_path, capsys):
    """``--arena-bytes`` takes bytes or K, M, G, T (powers of 1024, with or without iB / B);
    ``train --help`` gives each option's default."""
    from mtc_loader.mmengine.__main__ import _parser

    sizes = {"536870912": 512 << 20, "512M": 512 << 20, "512MiB": 512 << 20, "512mb": 512 << 20, "64K": 64 << 10,
             "1G": 1 << 30, "2 GiB": 2 << 30, "1T": 1 << 40, "4096B": 4096}
    for text, n in sizes.items():
        args = _parser().parse_args(["train", "cfg.py", "--arena-bytes", text])
        assert args.arena_bytes == n, text
    with pytest.raises(SystemExit):
        _parser().parse_args(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for option, default in (("--arena-bytes", "(default: the config's, else 256M)"),
                            ("--prefetch-depth", "(default: the config's, else 2)"),
                            ("--launcher", "(default: none"), ("--sync_bn", "(default: none)"),
                            ("--work-dir", "(default: the config's work_dir, else ./work_dirs/<config name>)"),
                            ("--local-rank", "(default: 0)"), ("--no-pack-eval", "(default: packed)")):
        assert default in out.split(option, 2)[-1].split(" --", 1)[0], (option, out)
    assert "mmdet3d::pointpillars/" in out.replace(" ", "")


@pytest.mark.parametrize("scoped", [POINTPILLARS, RETINANET])
def test_configs_of_installed_packages_by_scope(tmp_path, monkeypatch, capsys, scoped):
    """A config of an installed package named by its scope, as ``_base_`` names one (a pip
    install keeps mmdet3d's and mmdet's configs inside the package, under .mim/configs): through
    switch_config and through the train command, which reads it (its work dir named after the
    file) and stops at a bad argument checked after the config is read."""
    from mtc_loader.mmengine.__main__ import _parser, build_config, main

    scope = scoped.split("::")[0]
    pytest.importorskip(scope, reason=f"needs {scope}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = mm.switch_config(scoped)
        plain = Config.fromfile(os.path.join(os.path.dirname(__import__(scope).__file__), ".mim", "configs",
                                             scoped.split("::")[1]))
    assert cfg.model.data_preprocessor == dict(type="MTCDataPreprocessor", preprocessor=plain.model.data_preprocessor)
    assert cfg.train_cfg.type == "MTCEpochBasedTrainLoop"
    assert cfg.train_dataloader.collate_fn.type == "mtc_packed_collate"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LOCAL_RANK", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = build_config(_parser().parse_args(["train", scoped, "--arena-bytes", "512M"]))
    name = os.path.splitext(os.path.basename(scoped))[0]
    assert cfg.work_dir == os.path.join("./work_dirs", name)
    assert cfg.model.data_preprocessor.arena_bytes == 512 << 20
    (tmp_path / "a_file").write_text("")
    with pytest.raises(SystemExit) as e, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        main(["train", scoped, "--work-dir", "a_file"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error: work dir a_file is a file" in err and "no config file" not in err, err


@pytest.mark.parametrize("name, error, says", [
    ("mmdet3d::nothere/x.py", FileNotFoundError, r"the installed mmdet3d has no config nothere/x\.py \(its configs "
                                                 r"are in \S*mmdet3d/\.mim/configs\)"),
    ("mmfoo::a/b.py", ValueError, r"mmengine knows no package of scope 'mmfoo'; the scopes it knows are .*mmdet3d"),
    ("mmdet3d::x.py", ValueError, r"named 'mmdet3d::<folder>/<file>\.py'"),
])
def test_scope_form_errors(tmp_path, monkeypatch, capsys, name, error, says):
    """A scope-form name that finds no config says why, through both entry points."""
    from mtc_loader.mmengine.__main__ import main

    pytest.importorskip("mmdet3d", reason="needs mmdet3d")
    with pytest.raises(error, match=says):
        mm.switch_config(name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(SystemExit) as e:
        main(["train", name])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert re.search(r"train: error: config '" + re.escape(name) + "': .*" + says, err), err
    assert list(tmp_path.iterdir()) == []


MISSING_DEP = '''
import mtc_not_installed_dep  # a dependency of this package's, not installed
'''
MISSING_DEP_MODEL = '''
from mmengine.model import BaseModel
from mmengine.registry import MODELS


@MODELS.register_module()
class MtcNeedsADep(BaseModel):
    def __init__(self, data_preprocessor=None):
        super().__init__(data_preprocessor=data_preprocessor)
        import mtc_not_installed_dep  # noqa: F401  (imported when the model is built, as mmdet3d's devkits are)

    def forward(self, inputs, data_samples=None, mode="tensor"):
        return {}
'''


def _notes(e: BaseException) -> str:
    return "\n".join(getattr(e, "__notes__", [])) + str(e)


def test_missing_dependency_of_a_custom_import_is_named_as_its_own(tmp_path, monkeypatch):
    """A config whose custom_imports (or a module they import) needs a module that is not
    installed: the ImportError names the module and says whose dependency it is, not the
    switch's, through switch_config, MTCRunner and the train command."""
    from mtc_loader.mmengine.__main__ import main

    (tmp_path / "mtc_dep_user.py").write_text(MISSING_DEP)
    (tmp_path / "mtc_dep_model.py").write_text(MISSING_DEP_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LOCAL_RANK", "0")
    for module, says in (("mtc_dep_user", r"mtc_dep_user imports 'mtc_not_installed_dep', which is not installed: "
                                          r"a dependency of mtc_dep_user itself, not of mtc_loader"),
                         ("mtc_nothere_module", r"the module 'mtc_nothere_module' cannot be imported: the config "
                                                r"\(its custom_imports.*names it")):
        (tmp_path / "cfg.py").write_text(f"custom_imports = dict(imports=[{module!r}], allow_failed_imports=False)\n")
        with mock.patch.dict(sys.modules), pytest.raises(ImportError) as e:
            mm.switch_config(str(tmp_path / "cfg.py"))
        assert re.search(says, _notes(e.value)), _notes(e.value)
        with mock.patch.dict(sys.modules), pytest.raises(SystemExit):  # the command: argparse's error
            main(["train", "cfg.py"])
    # a model that imports it when it is built, inside MTCRunner's Runner
    with mock.patch.dict(sys.modules), pytest.raises(ImportError) as e:
        import mtc_dep_model  # noqa: F401
        mm.MTCRunner(model=dict(type="MtcNeedsADep"), work_dir=str(tmp_path / "wd"))
    note = _notes(e.value)
    assert "mtc_dep_model imports 'mtc_not_installed_dep', which is not installed: a dependency of mtc_dep_model" \
        in note, note
    assert note.count("mtc_loader:") == 1  # said once, however many of the package's frames it passed


def test_train_command_says_whose_the_missing_module_is(tmp_path, monkeypatch, capsys):
    from mtc_loader.mmengine.__main__ import main

    (tmp_path / "mtc_dep_user.py").write_text(MISSING_DEP)
    (tmp_path / "cfg.py").write_text('custom_imports = dict(imports=["mtc_dep_user"], allow_failed_imports=False)\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LOCAL_RANK", "0")
    with mock.patch.dict(sys.modules), pytest.raises(SystemExit) as e:
        main(["train", "cfg.py"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert re.search(r"error: config file cfg\.py: \S*mtc_dep_user\.py, line 2: ModuleNotFoundError: No module named "
                     r"'mtc_not_installed_dep' \(mtc_dep_user imports 'mtc_not_installed_dep', which is not installed: "
                     r"a dependency of mtc_dep_user itself", err), err


def test_mmdet3d_extras_named_where_mmdet3d_imports_them():
    """What a pip install of mmdet3d leaves out is named, as in docs/mmengine.md and
    tools/install_openmmlab.sh."""
    from mtc_loader.mmengine._switch import _MMDET3D_EXTRAS, _explained

    def mmdet3d_import():
        exec("import mtc_not_installed_dep", {"__name__": "mmdet3d.datasets.convert_utils"})

    with pytest.raises(ImportError) as e:
        try:
            mmdet3d_import()
        except ImportError as err:
            raise _explained(err) from None
    note = _notes(e.value)
    assert "a dependency of mmdet3d itself" in note and _MMDET3D_EXTRAS in note, note
    script = open(os.path.join(ROOT, "tools", "install_openmmlab.sh")).read()
    for command in _MMDET3D_EXTRAS.split(" && "):
        assert command.replace("pip install", "-m pip install -q") in script, command
    page = " ".join(open(os.path.join(ROOT, "docs", "mmengine.md")).read().split())
    assert _MMDET3D_EXTRAS in page
