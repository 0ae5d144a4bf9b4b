"""``MTCDataPreprocessor(run_ahead=True)`` (CPU): the model's preprocessor runs on the prefetch thread
for the next batch, and ``train_step`` takes its result, bitwise what running it in the step gives
(mmdet's ``DetDataPreprocessor`` through mmengine's Runner, mmdet3d's ``Det3DDataPreprocessor``
with voxelization through the loop's prefetching); what may not run ahead is refused, naming it;
a result made while the model's mode changed is made again in the step.

Skipped where mmengine is not installed; the tests of mmdet's and mmdet3d's preprocessors where
those are not.
"""
from __future__ import annotations

import contextlib
import copy
import importlib.util
import os
import threading
import warnings
from unittest import mock

import numpy as np
import pytest
import torch

with warnings.catch_warnings():  # mmengine's imports warn (deprecations)
    warnings.simplefilter("ignore")
    pytest.importorskip("mmengine", reason="needs mmengine (the test extra installs it)")
    from mmengine.config import Config
    from mmengine.model import BaseDataPreprocessor
    from mmengine.registry import MODELS, DefaultScope

    import mtc_loader.mmengine as mm
    from mtc_loader.mmengine._loops import _Prefetching
    from mtc_loader.mmengine._preprocessor import _MOVED, _Ahead, _RunAhead

from conftest import ROOT, assert_tree_bitwise, requires_cuda  # noqa: E402,I100
from test_mmengine_switch import THREE_LINES, child, toy_config  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")]

RUN_AHEAD_LINE = "model = dict(data_preprocessor=dict(run_ahead=True))\n"


def _mmdet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("mmdet.models", reason="needs mmdet (README: OpenMMLab's stack)")
        from mmdet.models.data_preprocessors import DetDataPreprocessor
    return DetDataPreprocessor


# ------------------------------------------------------------------------- the rule

def test_batch_sync_random_resize_is_refused_from_the_config(tmp_path):
    """YOLOX's config: its DetDataPreprocessor has BatchSyncRandomResize (an iteration counter,
    a random size broadcast across ranks); the run-ahead line is refused, naming both."""
    _mmdet()
    cfg = mm.switch_config(child(tmp_path, "mmdet::yolox/yolox_s_8xb8-300e_coco.py", THREE_LINES + RUN_AHEAD_LINE))
    pre = cfg.model.data_preprocessor
    assert pre.type == "MTCDataPreprocessor" and pre.run_ahead is True and "run_ahead" not in pre.preprocessor
    with DefaultScope.overwrite_default_scope("mmdet"), pytest.raises(
            ValueError, match=r"MTCDataPreprocessor\(run_ahead=True\) cannot run DetDataPreprocessor ahead of the "
                              r"step: its batch_augments \(BatchSyncRandomResize\) .*Leave run_ahead out .*or "
                              r"remove batch_augments"):
        MODELS.build(pre)


def test_any_batch_augments_are_refused_and_plain_ones_run_ahead():
    DetDataPreprocessor = _mmdet()
    plain = dict(type="DetDataPreprocessor", mean=[1.0, 2.0, 3.0], std=[4.0, 5.0, 6.0], bgr_to_rgb=True,
                 pad_size_divisor=32)
    with DefaultScope.overwrite_default_scope("mmdet"):
        assert mm.MTCDataPreprocessor(plain, run_ahead=True).run_ahead is True
        pad = dict(plain, batch_augments=[dict(type="BatchFixedSizePad", size=(64, 64))])
        with pytest.raises(ValueError, match=r"its batch_augments \(BatchFixedSizePad\)"):
            mm.MTCDataPreprocessor(pad, run_ahead=True)
        assert mm.MTCDataPreprocessor(pad).run_ahead is False  # in the step, as before


def test_a_type_not_known_is_refused_unless_it_says_it_is_a_function_of_its_batch():
    DetDataPreprocessor = _mmdet()

    class Mine(DetDataPreprocessor):
        pass

    class Declared(DetDataPreprocessor):
        mtc_run_ahead = True

    with pytest.raises(ValueError, match=r"cannot run Mine ahead of the step: only preprocessors known to be "
                                         r"functions of their batch run ahead \(BaseDataPreprocessor, "
                                         r"ImgDataPreprocessor, DetDataPreprocessor, Det3DDataPreprocessor\).*"
                                         r"set the class attribute mtc_run_ahead = True on Mine"):
        mm.MTCDataPreprocessor(Mine(), run_ahead=True)
    assert mm.MTCDataPreprocessor(Declared(), run_ahead=True).run_ahead is True
    assert mm.MTCDataPreprocessor(BaseDataPreprocessor(), run_ahead=True).run_ahead is True
    with pytest.raises(TypeError, match="run_ahead must be True or False, got 'yes'"):
        mm.MTCDataPreprocessor(run_ahead="yes")


def test_random_voxels_are_refused():
    pytest.importorskip("mmdet3d.models", reason="needs mmdet3d")
    with DefaultScope.overwrite_default_scope("mmdet3d"), pytest.raises(
            ValueError, match=r"cannot run Det3DDataPreprocessor ahead of the step: with voxel_type='minkunet' "
                              r"and max_voxels it draws the voxels it keeps at random"):
        mm.MTCDataPreprocessor(dict(type="Det3DDataPreprocessor", voxel=True, voxel_type="minkunet",
                                    max_voxels=80000, batch_first=False,
                                    voxel_layer=dict(voxel_size=[0.1, 0.1, 0.1], max_voxels=80000,
                                                     point_cloud_range=[-100, -100, -20, 100, 100, 20],
                                                     max_num_points=-1)),
                               run_ahead=True)


# ------------------------------------------------------------------------- taking the result

def test_a_result_made_across_a_mode_change_is_made_again_in_the_step():
    """Validation inside an iteration loop switches the model to eval and back while the prefetch
    thread works: a result made before (or during) the change is not taken."""
    calls = []

    class Counting(BaseDataPreprocessor):
        mtc_run_ahead = True

        def forward(self, data, training=False):
            calls.append((threading.current_thread().name, self.training))
            return {"inputs": data["inputs"] + (1 if training else 0) + (10 if self.training else 0)}

    pre = mm.MTCDataPreprocessor(Counting(), run_ahead=True)
    pre.train()
    batch = {"inputs": torch.zeros(2)}
    made = _RunAhead(pre, contextlib.nullcontext)(batch)
    assert made.changes == pre._mode_changes and calls == [("MainThread", True)]
    _MOVED.batch, _MOVED.ahead = batch, made
    assert pre(batch, True) is made.result  # taken: the preprocessor does not run again
    assert len(calls) == 1 and _MOVED.batch is None and _MOVED.ahead is None
    pre.eval()
    pre.train()  # validation came and went
    pre.train()  # (mmengine's loop calls it at every iteration: no change)
    _MOVED.batch, _MOVED.ahead = batch, made
    again = pre(batch, True)
    assert again is not made.result and torch.equal(again["inputs"], made.result["inputs"])
    assert len(calls) == 2
    # the mode changed while it was being made
    pre.eval()
    changing = _Ahead(batch, made.result, pre, -1)
    pre.train()
    _MOVED.batch, _MOVED.ahead = batch, changing
    assert pre(batch, True) is not made.result and len(calls) == 3
    # training=False (a val_step) never takes it
    _MOVED.batch, _MOVED.ahead = batch, _RunAhead(pre, contextlib.nullcontext)(batch)
    assert torch.equal(pre(batch, False)["inputs"], batch["inputs"] + 10)


def test_run_ahead_without_prefetching_warns_once(tmp_path):
    cfg = toy_config(tmp_path / "wd", prefetch_depth=0)
    cfg["model"].data_preprocessor = mm.MTCDataPreprocessor(run_ahead=True)
    cfg["train_cfg"] = dict(type="MTCEpochBasedTrainLoop", max_epochs=1, prefetch_depth=0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        mm.MTCRunner(**cfg).train()
    ours = [str(w.message) for w in seen if "run_ahead" in str(w.message)]
    assert ours == ["mtc_loader: MTCDataPreprocessor(run_ahead=True) runs its preprocessor in the step: the train "
                    "loop does not prefetch. Use MTCEpochBasedTrainLoop or MTCIterBasedTrainLoop with "
                    "prefetch_depth >= 1 (runner_type='MTCRunner' does)"]


# ------------------------------------------------------------------------- bitwise as in place

def _smoke():
    spec = importlib.util.spec_from_file_location("mtc_mmengine_smoke", os.path.join(ROOT, "examples", "mmengine_smoke.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module._register()
    return module


def _train_recording(smoke, path, work_dir, DetDataPreprocessor):
    """Trains a config; its losses, and each DetDataPreprocessor call's thread and output."""
    calls = []
    forward = DetDataPreprocessor.forward

    def recording(self, data, training=False):
        out = forward(self, data, training)
        calls.append((threading.current_thread().name, training, {
            "inputs": out["inputs"].clone(),
            "meta": [{k: v for k, v in s.metainfo.items()} for s in out["data_samples"]],
            "boxes": [s.gt_instances.bboxes.clone() for s in out["data_samples"]],
            "labels": [s.gt_instances.labels.clone() for s in out["data_samples"]]}))
        return out

    with mock.patch.object(DetDataPreprocessor, "forward", recording), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        losses = smoke._train(str(path), str(work_dir))
    return losses, calls


@pytest.mark.parametrize("loop", [pytest.param("iter", marks=pytest.mark.slow), "epoch"])
def test_det_preprocessor_ahead_is_bitwise_the_one_in_the_step(tmp_path, loop):
    """mmdet's RetinaNet (ResNet-18) on synthetic 64x64 images through mmengine's Runner, switched:
    its DetDataPreprocessor (mean/std, bgr_to_rgb, pad_size_divisor=32) in the step and, with the
    run-ahead line, on the prefetch thread, once per batch; the same outputs and losses, bit for
    bit."""
    DetDataPreprocessor = _mmdet()
    smoke = _smoke()
    iters = 3
    base = smoke.BASE.format(iters=iters)
    if loop == "epoch":  # 6 samples in batches of 2: one epoch of 3 iterations
        base = base.replace('type="IterBasedTrainLoop", max_iters=3, val_interval=1000',
                            'type="EpochBasedTrainLoop", max_epochs=1, val_interval=1000')
        base = base.replace("n=16", "n=6")
        assert "EpochBasedTrainLoop" in base
    (tmp_path / "base.py").write_text(base)
    (tmp_path / "in_step.py").write_text(smoke.CHILD)
    (tmp_path / "ahead.py").write_text(smoke.CHILD + RUN_AHEAD_LINE)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    in_step, calls_in_step = _train_recording(smoke, tmp_path / "in_step.py", tmp_path / "a", DetDataPreprocessor)
    ahead, calls_ahead = _train_recording(smoke, tmp_path / "ahead.py", tmp_path / "b", DetDataPreprocessor)
    assert len(in_step) == iters and len(calls_in_step) == iters
    assert {(name, training) for name, training, _ in calls_in_step} == {("MainThread", True)}
    # on the prefetch thread only (train_step took each result), for the trained batches and at
    # most the loader's depth (2) beyond them (prefetched, never trained on)
    assert iters <= len(calls_ahead) <= iters + 2
    assert {(name, training) for name, training, _ in calls_ahead} == {("mtc_loader-prefetch", True)}
    for k, ((_, _, got), (_, _, ref)) in enumerate(zip(calls_ahead, calls_in_step)):
        assert got["inputs"].shape[-1] % 32 == 0
        assert_tree_bitwise(got, ref, f"batch {k}")
    assert ahead == in_step


def test_det3d_voxelization_ahead_is_bitwise_the_one_in_the_step():
    """mmdet3d's Det3DDataPreprocessor with hard voxelization (mmcv's op): the loop's prefetching
    runs it on the prefetch thread, and the model's call takes that result, bitwise the result of
    running it in place on the same batch."""
    pytest.importorskip("mmdet3d.models", reason="needs mmdet3d")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from mmdet3d.structures import Det3DDataSample
    config = dict(type="Det3DDataPreprocessor", voxel=True, voxel_type="hard",
                  voxel_layer=dict(max_num_points=8, point_cloud_range=[0, -8, -3, 16, 8, 1],
                                   voxel_size=[0.5, 0.5, 4], max_voxels=(60, 80)))
    with DefaultScope.overwrite_default_scope("mmdet3d"):
        pre = mm.MTCDataPreprocessor(config, run_ahead=True)
        reference = mm.MTCDataPreprocessor(config)
    pre.train(), reference.train()

    def batch(k):
        g = torch.Generator().manual_seed(k)
        points = [torch.rand(200 + 50 * j, 4, generator=g) * torch.tensor([16.0, 16, 4, 1]) - torch.tensor(
            [0.0, 8, 3, 0]) for j in range(2)]
        return {"inputs": {"points": points}, "data_samples": [Det3DDataSample() for _ in points]}

    batches = [batch(k) for k in range(4)]
    threads = []
    inner = type(pre.preprocessor).forward

    def recording(self, data, training=False):
        threads.append(threading.current_thread().name)
        return inner(self, data, training)

    with mock.patch.object(type(pre.preprocessor), "forward", recording):
        prefetching = _Prefetching(copy.deepcopy(batches), torch.device("cpu"), 2,
                                   _RunAhead(pre, contextlib.nullcontext))
        got = []
        for b in prefetching:
            assert isinstance(_MOVED.ahead, _Ahead) and _MOVED.ahead.batch is b
            made = _MOVED.ahead.result
            out = pre(b, True)
            assert out is made
            got.append(out)
        prefetching.close()
    assert threads == ["mtc_loader-prefetch"] * 4
    for k, (out, b) in enumerate(zip(got, batches)):
        ref = reference(b, True)
        assert set(out["inputs"]["voxels"]) == {"voxels", "coors", "num_points", "voxel_centers"}
        assert out["inputs"]["voxels"]["voxels"].shape[0] > 10
        assert_tree_bitwise(out["inputs"], ref["inputs"], f"batch {k}")


def test_an_error_of_the_preprocessor_ahead_names_it_and_the_batch():
    class Failing(BaseDataPreprocessor):
        mtc_run_ahead = True

        def forward(self, data, training=False):
            if int(data["inputs"][0]) == 2:
                raise ValueError("cannot pad")
            return data

    pre = mm.MTCDataPreprocessor(Failing(), run_ahead=True)
    batches = [{"inputs": torch.full((2,), float(k))} for k in range(4)]
    prefetching = _Prefetching(batches, torch.device("cpu"), 2, _RunAhead(pre, contextlib.nullcontext))
    for k in range(2):
        b = next(prefetching)
        assert pre(b, True) is b and int(b["inputs"][0]) == k  # the result made ahead (the batch itself)
    with pytest.raises(ValueError, match=r"PrefetchLoader's transform Failing \(run ahead by MTCDataPreprocessor\) "
                                         r"raised on batch 2 of the epoch: ValueError: cannot pad") as e:
        next(prefetching)
    assert str(e.value.__cause__) == "cannot pad"
    prefetching.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, requires_cuda])])
def test_det_preprocessor_ahead_after_the_copy_is_bitwise_the_one_in_the_step(device):
    """The copy, then DetDataPreprocessor (mean/std, bgr_to_rgb, padding) on the prefetch thread
    (on a GPU: on the copy stream); train_step's call takes that result, bitwise the one of the
    preprocessor run in place on the same batch (on a GPU: read on the caller's stream behind a
    long kernel)."""
    _mmdet()
    from mmdet.structures import DetDataSample

    config = dict(type="DetDataPreprocessor", mean=[123.675, 116.28, 103.53], std=[58.395, 57.12, 57.375],
                  bgr_to_rgb=True, pad_size_divisor=32)
    with DefaultScope.overwrite_default_scope("mmdet"):
        pre = mm.MTCDataPreprocessor(config, run_ahead=True).to(device)
        reference = mm.MTCDataPreprocessor(config).to(device)

    def batch(k):
        g = torch.Generator().manual_seed(k)
        sizes = [(3, 60 + 7 * k, 90 - 5 * j) for j in range(3)]
        return {"inputs": [torch.randint(0, 256, s, generator=g, dtype=torch.uint8) for s in sizes],
                "data_samples": [DetDataSample(metainfo={"img_shape": s[1:]}) for s in sizes]}

    batches = [batch(k) for k in range(6)]
    target = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    prefetching = _Prefetching(copy.deepcopy(batches), target, 2, _RunAhead(pre, contextlib.nullcontext))
    got = []
    for b in prefetching:
        made = _MOVED.ahead.result
        out = pre(b, True)
        assert out is made and out["inputs"].device.type == device
        if device == "cuda":
            torch.cuda._sleep(50_000_000)
        got.append(out["inputs"].clone())
    prefetching.close()
    if device == "cuda":
        torch.cuda.synchronize()
    for k, (inputs, b) in enumerate(zip(got, batches)):
        ref = reference(b, True)["inputs"]
        assert inputs.shape[-1] % 32 == 0
        assert_tree_bitwise(inputs, ref, f"batch {k}")
