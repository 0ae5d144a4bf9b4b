"""Same seed, same run: mmengine's own loop against the switched one (``mtc_packed_collate``,
``MTCDataPreprocessor`` and the prefetching loops) with a pipeline of random transforms (numpy,
``random`` and torch's global generator) and a model that draws from torch's and numpy's global
generators in its step: the model's inputs, the losses and the final weights are bitwise equal,
with and without workers, over the epoch and the iteration loops (CPU)."""
from __future__ import annotations

import random
import time
import warnings
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
import torch

with warnings.catch_warnings():  # mmengine's imports warn (torch.jit.script is deprecated)
    warnings.simplefilter("ignore")
    pytest.importorskip("mmengine", reason="needs mmengine (the test extra installs it)")
    from mmengine.model import BaseModel
    from mmengine.runner import Runner

    import mtc_loader.mmengine  # noqa: F401  (registers the switch's names)
from conftest import assert_bitwise  # noqa: E402,I100

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]


class RandomPipeline(torch.utils.data.Dataset):
    """Samples made by random transforms drawing from the three global generators, slowly enough
    that a pipeline running beside the step would interleave its draws with the model's."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(i)
        points = torch.rand(16 + i, 4, generator=g)
        time.sleep(0.002)
        points = points + torch.rand(points.shape) * 0.1  # jitter: torch's global generator
        time.sleep(0.002)
        points = points[np.random.permutation(points.shape[0])]  # shuffle: numpy's
        if random.random() < 0.5:  # flip: random's
            points[:, 0] = -points[:, 0]
        return {"inputs": {"points": points}, "data_samples": None}


RECORD: dict = {"inputs": [], "losses": []}


class DrawingModel(BaseModel):
    """Draws from torch's and numpy's global generators in its step (as VoteNet's head samples
    seeds with torch.randint), and its loss depends on what it draws."""

    def __init__(self, data_preprocessor=None) -> None:
        super().__init__(data_preprocessor=data_preprocessor)
        self.lin = torch.nn.Linear(4, 1)
        with torch.no_grad():  # the same start in every run (the first Runner of a process draws
            g = torch.Generator().manual_seed(0)  # from the global generator on its own)
            self.lin.weight.copy_(torch.rand(self.lin.weight.shape, generator=g))
            self.lin.bias.zero_()

    def forward(self, inputs, data_samples=None, mode="tensor"):
        RECORD["inputs"].append([p.detach().clone() for p in inputs["points"]])
        loss = self.lin.weight.sum() * 0
        for p in inputs["points"]:
            for _ in range(3):
                idx = torch.randint(0, p.shape[0], (4,))  # seeds sampled at random
                time.sleep(0.002)
                scale = float(np.random.rand())
                loss = loss + self.lin(p[idx]).pow(2).mean() * scale
        RECORD["losses"].append(loss.detach().clone())
        return {"loss": loss}


def run(tmp_path, workers, switch, loop):
    RECORD["inputs"].clear()
    RECORD["losses"].clear()
    pre = dict(type="BaseDataPreprocessor")
    loader = dict(dataset=RandomPipeline(), sampler=dict(type="DefaultSampler", shuffle=True), batch_size=2,
                  num_workers=workers, persistent_workers=False)
    # two passes over the data: the epoch loop's second epoch, the iteration loop's restart
    train_cfg = dict(by_epoch=True, max_epochs=2) if loop == "epoch" else dict(type="IterBasedTrainLoop", max_iters=6)
    if switch:
        loader["collate_fn"] = dict(type="mtc_packed_collate")
        pre = dict(type="MTCDataPreprocessor", preprocessor=pre, arena_bytes=16 << 20)
        train_cfg = dict(train_cfg, type="MTCEpochBasedTrainLoop" if loop == "epoch" else "MTCIterBasedTrainLoop")
        train_cfg.pop("by_epoch", None)
    with mock.patch("mmengine.runner.runner.get_device", return_value="cpu"), \
            mock.patch("mmengine.runner.loops.time", SimpleNamespace(sleep=lambda s: None)):  # its 2 s at a restart
        runner = Runner(
            model=DrawingModel(data_preprocessor=pre), work_dir=str(tmp_path / ("on" if switch else "off")),
            train_dataloader=loader, train_cfg=train_cfg, optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1)),
            default_hooks=dict(checkpoint=None, logger=None), log_level="ERROR", randomness=dict(seed=1234),
            env_cfg=dict(cudnn_benchmark=False, dist_cfg=dict(backend="gloo")), default_scope=None, cfg=dict(),
        )
        runner.train()
    weights = {k: v.detach().clone() for k, v in runner.model.state_dict().items()}
    return [list(b) for b in RECORD["inputs"]], list(RECORD["losses"]), weights


@pytest.mark.parametrize("loop", ["epoch", "iter"])
@pytest.mark.parametrize("workers", [0, 2])
def test_same_seed_same_data_losses_and_weights(tmp_path, workers, loop):
    ref_inputs, ref_losses, ref_weights = run(tmp_path, workers, False, loop)
    inputs, losses, weights = run(tmp_path, workers, True, loop)
    assert len(ref_inputs) == len(inputs) == len(ref_losses) == len(losses) == 8 if loop == "epoch" else 6
    for k, (a, b) in enumerate(zip(inputs, ref_inputs)):
        assert len(a) == len(b), f"batch {k}"
        for j, (x, y) in enumerate(zip(a, b)):
            assert_bitwise(x, y, f"batch {k} sample {j} points")
    for k, (a, b) in enumerate(zip(losses, ref_losses)):
        assert_bitwise(a, b, f"loss {k}")
    assert weights.keys() == ref_weights.keys()
    for name in weights:
        assert_bitwise(weights[name], ref_weights[name], f"final {name}")
