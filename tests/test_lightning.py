"""PyTorch Lightning: ``Trainer.fit`` with ``collate_fn=PackedCollate(...)`` and nothing else
changed (Lightning's device placement calls ``PackedBatch.to``), and with the prefetch service
added by ``mtc_loader.lightning.PrefetchCallback``; the batches the model saw are checked
bitwise. Runs on the CPU accelerator everywhere and on CUDA where a GPU is."""
from __future__ import annotations

import csv as csv_module
import time

import pytest
import torch
from torch.utils.data import DataLoader

L = pytest.importorskip("lightning.pytorch")

import mtc_loader  # noqa: E402
import mtc_loader.lightning  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from conftest import requires_cuda  # noqa: E402
from frameworks import NestedSamples, SlowLoading, check_seen, collate, record  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning"),
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    # Lightning 2.6 with torch 2.13, not ours
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated:FutureWarning"),
]


class Recording(L.LightningModule):
    """Records every batch its training and validation steps receive."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
        self.seen: list = []
        self.seen_val: list = []

    def training_step(self, batch, batch_idx):
        self.seen.append(record(batch))
        return self.layer(batch["x"]).square().mean()

    def validation_step(self, batch, batch_idx):
        self.seen_val.append(record(batch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit(accelerator: str, collate_fn, callbacks=(), epochs: int = 2, val: bool = False) -> Recording:
    ds = NestedSamples(24)
    model = Recording()
    loader = DataLoader(ds, batch_size=4, shuffle=True, num_workers=2, collate_fn=collate_fn)
    val_loader = DataLoader(NestedSamples(8), batch_size=4, num_workers=2, collate_fn=collate_fn) if val else None
    trainer = L.Trainer(accelerator=accelerator, devices=1, max_epochs=epochs, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=list(callbacks))
    trainer.fit(model, loader, val_loader)
    return model


def device_of(accelerator: str) -> torch.device:
    return torch.device("cpu") if accelerator == "cpu" else torch.device("cuda", torch.cuda.current_device())


ACCELERATORS = ["cpu", pytest.param("gpu", marks=requires_cuda)]


@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_fit_packed_collate_only(accelerator):
    """The user changes the collate_fn only: Lightning moves each PackedBatch with its .to."""
    before = mtc_loader.stats()["calls"]
    model = fit(accelerator, mtc_loader.PackedCollate(collate, arena_bytes=16 << 20), val=True)
    check_seen(model.seen, device_of(accelerator), NestedSamples(24), range(24), epochs=2)
    check_seen(model.seen_val, device_of(accelerator), NestedSamples(8), range(8), epochs=2)
    # unpack does not go through start_copy's traversal: the engine's start_copy count is unchanged
    assert mtc_loader.stats()["calls"] == before


@pytest.mark.parametrize("accelerator", ACCELERATORS)
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "plain"])
def test_fit_prefetch_callback(accelerator, packed):
    """PrefetchCallback: every loader goes through the prefetch service; the steps receive the
    same batches, on the device, and the callback reports the training loader's stats."""
    callback = mtc_loader.lightning.PrefetchCallback(depth=2)
    collate_fn = mtc_loader.PackedCollate(collate, arena_bytes=16 << 20) if packed else collate
    model = fit(accelerator, collate_fn, callbacks=[callback], val=True)
    check_seen(model.seen, device_of(accelerator), NestedSamples(24), range(24), epochs=2)
    check_seen(model.seen_val, device_of(accelerator), NestedSamples(8), range(8), epochs=2)
    stats = callback.stats()
    assert stats["batches"] == 12, stats  # 6 batches per epoch, 2 epochs, counted by the service
    assert callback._strategy is None  # teardown undid the hook


def test_prefetch_callback_sets_sampler_epoch():
    """Lightning sets the epoch of a sampler that has set_epoch through the wrapper (a
    DistributedSampler shuffles differently each epoch): the two epochs see different orders."""
    ds = NestedSamples(24)
    sampler = torch.utils.data.distributed.DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=3)
    model = Recording()
    loader = DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2,
                        collate_fn=mtc_loader.PackedCollate(collate, arena_bytes=16 << 20))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[mtc_loader.lightning.PrefetchCallback()])
    trainer.fit(model, loader)
    expect = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        expect.append(list(sampler))
    assert expect[0] != expect[1]
    seen = [i for _, _, b in model.seen for i in b["idx"].tolist()]
    assert seen == expect[0] + expect[1]
    check_seen(model.seen, torch.device("cpu"), ds, expect[0] + expect[1], epochs=1)


def test_prefetch_callback_bad_depth():
    with pytest.raises(ValueError, match="mtc_loader: depth"):
        mtc_loader.lightning.PrefetchCallback(depth=0)
    with pytest.raises(TypeError, match="mtc_loader: log_stats must be True or False"):
        mtc_loader.lightning.PrefetchCallback(log_stats="no")


class Sleepy(L.LightningModule):
    """Logs its loss; its step sleeps ``step_s`` (a step-bound loop when the data is quick)."""

    def __init__(self, step_s: float = 0.0) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
        self.step_s = step_s

    def training_step(self, batch, batch_idx):
        time.sleep(self.step_s)
        loss = self.layer(batch["x"]).square().mean()
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class SlowSamples(SlowLoading, NestedSamples):
    """NestedSamples that take ``sample_s`` each to load."""


def fit_logged(tmp_path, callback, *, step_s=0.0, sample_s=0.0, logger=True, every=2):
    """Two epochs of 6 batches with a CSVLogger (``logger=True``) writing every ``every`` steps;
    the rows of its metrics.csv (or the Trainer, for ``logger=False``)."""
    loader = DataLoader(SlowSamples(24, sample_s), batch_size=4, num_workers=0, collate_fn=collate)
    csv = CSVLogger(str(tmp_path)) if logger else False
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=csv, log_every_n_steps=every,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[callback])
    trainer.fit(Sleepy(step_s), loader)
    if not logger:
        return trainer
    with open(f"{trainer.logger.log_dir}/metrics.csv") as f:
        return list(csv_module.DictReader(f))


def test_prefetch_callback_logs_its_figures(tmp_path):
    """The figures reach the Trainer's logger: per written step (every log_every_n_steps, over
    the batches since the previous one) and per epoch (over the epoch, which together add up
    to the callback's stats() over the run)."""
    callback = mtc_loader.lightning.PrefetchCallback()
    rows = fit_logged(tmp_path, callback)
    steps = [r for r in rows if r["mtc/data_bound"]]
    epochs = [r for r in rows if r["mtc/data_bound_epoch"]]
    # 12 steps, written at every second one: the rows of steps 1, 3, ..., 11, with the loss
    assert [int(r["step"]) for r in steps] == [1, 3, 5, 7, 9, 11], rows
    assert all(r["loss"] for r in steps)
    assert [int(r["epoch"]) for r in epochs] == [0, 1], rows
    for r in steps:
        assert 0.0 < float(r["mtc/data_bound"]) < 1.0, r
        assert float(r["mtc/wait_ms_per_batch"]) > 0.0, r
    for r in epochs:
        assert 0.0 < float(r["mtc/data_bound_epoch"]) < 1.0, r
    # each epoch hands out 6 batches: the epochs' waits add up to the run's
    stats = callback.stats()
    total = sum(float(r["mtc/wait_ms_per_batch_epoch"]) * 6 for r in epochs)
    assert total == pytest.approx(stats["wait_ms"], rel=1e-4)


@pytest.mark.parametrize("bound", ["data", "step"])
def test_logged_data_bound_tells_which_side_waits(tmp_path, bound):
    """Slow samples and a quick step: the loop waits for data most of the time; a slow step and
    quick samples: hardly ever."""
    slow = dict(sample_s=0.01) if bound == "data" else dict(step_s=0.1)
    rows = fit_logged(tmp_path, mtc_loader.lightning.PrefetchCallback(), **slow)
    figures = [float(r["mtc/data_bound_epoch"]) for r in rows if r["mtc/data_bound_epoch"]]
    assert len(figures) == 2
    if bound == "data":
        assert min(figures) > 0.6, figures
    else:
        assert max(figures) < 0.4, figures


def test_prefetch_callback_logs_nothing_when_told_or_without_a_logger(tmp_path):
    rows = fit_logged(tmp_path, mtc_loader.lightning.PrefetchCallback(log_stats=False))
    assert rows and not any(k.startswith("mtc/") for k in rows[0]), rows[0]
    # logger=False: Lightning keeps what was logged for the callbacks and writes nothing
    callback = mtc_loader.lightning.PrefetchCallback()
    trainer = fit_logged(tmp_path, callback, logger=False)
    assert 0.0 < float(trainer.callback_metrics["mtc/data_bound_epoch"]) < 1.0
    assert callback.stats()["batches"] == 12


class Checking(L.LightningModule):
    """Checks every batch in the step (the ranks of ddp_spawn are other processes): the
    collated dict on the rank's device, bitwise; writes the indices it saw to a file."""

    def __init__(self, out: str) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
        self.out = out

    def training_step(self, batch, batch_idx):
        check_seen([record(batch)], self.device, NestedSamples(24), batch["idx"].tolist(), epochs=1)
        with open(f"{self.out}/rank{self.global_rank}", "a") as f:
            f.write(" ".join(map(str, batch["idx"].tolist())) + "\n")
        return self.layer(batch["x"]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize("accelerator", ACCELERATORS)
@pytest.mark.parametrize("prefetch", [False, True], ids=["collate_only", "prefetch"])
def test_ddp_spawn_with_packed_collate_built_in_the_launcher(tmp_path, prefetch, accelerator):
    """strategy="ddp_spawn": the DataLoader and its PackedCollate (and its arena) are built in
    the launching process and pickled into the ranks (two CPU processes; one per GPU); each rank
    unpacks the batches its own DataLoader workers pack into that shared arena (Lightning
    re-creates the loader with a DistributedSampler, so the ranks' shards cover the dataset once
    per epoch)."""
    ranks = 2 if accelerator == "cpu" else torch.cuda.device_count()
    loader = DataLoader(NestedSamples(24), batch_size=4, shuffle=True, num_workers=2,
                        collate_fn=mtc_loader.PackedCollate(collate, arena_bytes=16 << 20))
    callbacks = [mtc_loader.lightning.PrefetchCallback()] if prefetch else []
    trainer = L.Trainer(accelerator=accelerator, devices=ranks, strategy="ddp_spawn", max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks)
    trainer.fit(Checking(str(tmp_path)), loader)
    seen = [[int(i) for i in line.split()]
            for r in range(ranks) for line in (tmp_path / f"rank{r}").read_text().splitlines()]
    assert sum(map(len, seen)) == 2 * 24  # 2 epochs, each rank its 24 / ranks samples
    assert sorted(i for b in seen for i in b) == sorted(list(range(24)) * 2)
