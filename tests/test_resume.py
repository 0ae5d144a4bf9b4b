"""Saving and resuming the position in an epoch through the prefetch service: over torchdata's
``StatefulDataLoader`` (or any iterable with ``state_dict`` / ``load_state_dict``),
``PrefetchLoader.state_dict()`` is the position after the last batch handed out to the caller,
not where the service thread has got to, and a fresh loader resumed from it goes on at the next
sample; the same through Lightning's ``ckpt_path`` resume (``PrefetchCallback``), accelerate's
``save_state`` / ``load_state`` (``prefetch``) and mmengine's ``Runner`` resume
(``MTCEpochBasedTrainLoop``). A loader over a DataLoader that is not stateful has no
``state_dict``, so that the frameworks do not take it for stateful. CPU only (``device="cpu"``).
"""
from __future__ import annotations

import threading
import time
import warnings
from unittest import mock

import pytest
import torch
from torch.utils.data import DataLoader

import mtc_loader
from mtc_loader._wrap import PrefetchingDataLoader, wrap
from mtc_loader.prefetch._service import _produces_in_process

tdl = pytest.importorskip("torchdata.stateful_dataloader", reason="needs torchdata (the test extra installs it)")
StatefulDataLoader = tdl.StatefulDataLoader

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]

N, BS = 40, 4


def numbers(workers: int, shuffle: bool = False) -> StatefulDataLoader:
    """Samples 0..N-1 in batches of BS; shuffled with a fixed seed (the same order every time)."""
    gen = torch.Generator().manual_seed(7) if shuffle else None
    return StatefulDataLoader(torch.arange(N), batch_size=BS, num_workers=workers, shuffle=shuffle, generator=gen)


def samples(batches) -> list:
    return [int(x) for b in batches for x in getattr(b, "batch", b)]  # OnDevice: its batch


def wait_until_ahead(loader: mtc_loader.PrefetchLoader, handed_out: int, limit: int = 1 << 30) -> None:
    """Waits until the service has finished ``depth`` batches beyond those handed out (and so
    taken them from the DataLoader; at most ``limit`` in all): the DataLoader's own position is
    ahead of the caller's. A loader whose caller produces the batches (no workers) runs nothing
    ahead: the DataLoader's position is the caller's already."""
    on_caller = loader.produce_on_caller
    if on_caller if on_caller is not None else _produces_in_process(loader.iterable):
        return
    deadline = time.monotonic() + 30
    while loader._stats["service_batches"] < min(handed_out + loader.depth, limit):
        assert time.monotonic() < deadline, "the service did not run ahead"
        time.sleep(0.01)
    time.sleep(0.05)


def yielded(state: dict) -> int:
    """The batches a StatefulDataLoader state has yielded (either iterator kind)."""
    if "_num_yielded" in state:
        return int(state["_num_yielded"])
    return int(state["_snapshot"]["_snapshot_step"] + state["_steps_since_snapshot"])


# ------------------------------------------------------------------------- PrefetchLoader

@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
def test_resume_after_the_last_batch_handed_out(workers, shuffle, tmp_path):
    reference = samples(numbers(workers, shuffle))
    dl = numbers(workers, shuffle)
    loader = mtc_loader.PrefetchLoader(dl, "cpu", depth=2)
    it = iter(loader)
    first = [next(it) for _ in range(3)]
    wait_until_ahead(loader, 3)
    # with workers the service has taken two batches more; without, the caller takes each one
    assert yielded(dl.state_dict()) == (5 if workers else 3)
    state = loader.state_dict()
    assert yielded(state) == 3
    torch.save(state, tmp_path / "state.pt")  # as a framework's checkpoint would
    it.close()
    assert yielded(loader.state_dict()) == 3  # stopping the epoch does not move it

    resumed = mtc_loader.PrefetchLoader(numbers(workers, shuffle), "cpu", depth=2)
    resumed.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    rest = samples(resumed)
    assert samples(first) == reference[:12]
    assert rest == reference[12:]  # sample 12 (in the epoch's order) next, not 20


@pytest.mark.parametrize("workers", [0, 2])
def test_state_after_each_batch_and_at_the_epoch_boundary(workers):
    dl = numbers(workers)
    loader = mtc_loader.PrefetchLoader(dl, "cpu", depth=2)
    # before any iteration: the DataLoader's own state (an epoch from the start)
    assert yielded(loader.state_dict()) == 0
    for k, _ in enumerate(loader, 1):
        assert yielded(loader.state_dict()) == k
        assert loader.state_dict()["_iterator_finished"] is False
    # after the full epoch: the DataLoader's state at its end, from which the next epoch is whole
    end = loader.state_dict()
    assert end["_iterator_finished"] is True and yielded(end) == N // BS
    resumed = mtc_loader.PrefetchLoader(numbers(workers), "cpu")
    resumed.load_state_dict(end)
    assert samples(resumed) == list(range(N))
    # the second epoch, stopped after two batches
    for k, _ in enumerate(loader, 1):
        if k == 2:
            break
    state = loader.state_dict()
    assert yielded(state) == 2
    resumed = mtc_loader.PrefetchLoader(numbers(workers), "cpu")
    resumed.load_state_dict(state)
    assert samples(resumed) == list(range(8, N))
    assert samples(resumed) == list(range(N))  # and the epoch after it is whole


def test_resume_before_iterating_and_state_after_load():
    dl = numbers(0)
    loader = mtc_loader.PrefetchLoader(dl, "cpu")
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    it.close()
    resumed = mtc_loader.PrefetchLoader(numbers(0), "cpu")
    resumed.load_state_dict(state)
    assert yielded(resumed.state_dict()) == 2  # the loaded position, before iterating
    state["_num_yielded"] = 99  # the caller's dict: the loader kept a copy
    assert yielded(resumed.state_dict()) == 2
    assert samples(resumed) == list(range(8, N))


def test_state_dict_is_a_new_dict_each_call():
    loader = mtc_loader.PrefetchLoader(numbers(0), "cpu")
    it = iter(loader)
    next(it)
    a = loader.state_dict()
    a["_iterator_finished"] = True  # what accelerate does to the dict it gets
    assert loader.state_dict()["_iterator_finished"] is False
    it.close()


class LiveState:
    """A stateful iterable whose state_dict() returns its live dict (changed in place as it
    moves on): the service copies each snapshot."""

    def __init__(self, n: int = 10) -> None:
        self.n = n
        self.state = {"pos": 0}

    def __iter__(self):
        while self.state["pos"] < self.n:
            self.state["pos"] += 1
            yield torch.tensor([self.state["pos"] - 1])

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = dict(state)


def test_snapshots_of_a_state_changed_in_place_are_copied():
    src = LiveState()
    loader = mtc_loader.PrefetchLoader(src, "cpu", depth=2, produce_on_caller=False)
    it = iter(loader)
    next(it), next(it), next(it)
    wait_until_ahead(loader, 3)
    assert src.state["pos"] == 5
    assert loader.state_dict() == {"pos": 3}
    it.close()
    again = LiveState()
    resumed = mtc_loader.PrefetchLoader(again, "cpu")
    resumed.load_state_dict(loader.state_dict())
    assert samples(resumed) == list(range(3, 10))


def test_snapshot_policy_copies_only_what_may_change():
    from mtc_loader.prefetch._resume import _snapshots_may_change

    assert not _snapshots_may_change(numbers(0, shuffle=True))
    assert not _snapshots_may_change(numbers(2))
    assert _snapshots_may_change(LiveState())

    class StatefulDataset(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return i

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    assert _snapshots_may_change(StatefulDataLoader(StatefulDataset(), num_workers=0))
    assert not _snapshots_may_change(StatefulDataLoader(StatefulDataset(), num_workers=2))


class FailingState(LiveState):
    def state_dict(self) -> dict:
        if self.state["pos"] >= 2:
            raise ValueError("no state here")
        return dict(self.state)


def test_a_failing_state_dict_does_not_stop_the_batches():
    loader = mtc_loader.PrefetchLoader(FailingState(4), "cpu")
    it = iter(loader)
    next(it)
    assert loader.state_dict() == {"pos": 1}
    next(it)
    with pytest.raises(RuntimeError, match="no position to save") as info:
        loader.state_dict()
    assert isinstance(info.value.__cause__, ValueError)
    assert samples(it) == [2, 3]


@pytest.mark.parametrize("make", [mtc_loader.PrefetchLoader, lambda dl, dev: wrap(dl, dev, 2, {})],
                         ids=["PrefetchLoader", "PrefetchingDataLoader"])
def test_no_state_methods_over_a_dataloader_that_is_not_stateful(make):
    loader = make(DataLoader(torch.arange(8), batch_size=4), "cpu")
    # frameworks probe with hasattr (accelerate, Lightning on Python 3.11) or on the class
    # (runtime protocols from Python 3.12): neither finds them
    assert not hasattr(loader, "state_dict") and not hasattr(loader, "load_state_dict")
    assert "state_dict" not in dir(type(loader))
    with pytest.raises(TypeError, match="wraps a DataLoader.*StatefulDataLoader"):
        loader.state_dict()
    with pytest.raises(TypeError, match="StatefulDataLoader"):
        loader.load_state_dict({})
    assert samples(loader) == list(range(8))


def test_stateful_loader_classes():
    loader = mtc_loader.PrefetchLoader(numbers(0), "cpu")
    assert isinstance(loader, mtc_loader.PrefetchLoader)
    assert callable(type(loader).state_dict) and callable(type(loader).load_state_dict)
    wrapped = wrap(numbers(0), "cpu", 2, {})
    assert isinstance(wrapped, PrefetchingDataLoader) and callable(type(wrapped).state_dict)
    assert wrap(wrapped, "cpu", 2, {}) is wrapped

    class Mine(mtc_loader.PrefetchLoader):
        pass

    mine = Mine(numbers(0), "cpu")
    assert isinstance(mine, Mine) and hasattr(mine, "state_dict")
    assert not hasattr(Mine(DataLoader(torch.arange(4)), "cpu"), "state_dict")


# ------------------------------------------------------------------------- Lightning

class _Interrupted(Exception):
    pass


def _lightning_fit(workers, ckpt_dir, *, stop_after=None, ckpt_path=None, prefetch=True):
    """Fits 2 epochs of 10 batches over a StatefulDataLoader (the steps record their samples);
    ``stop_after``: a checkpoint is saved after that many steps and the run then fails, as if
    the job had been killed."""
    L = pytest.importorskip("lightning.pytorch")
    import mtc_loader.lightning

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)
            self.seen: list = []

        def training_step(self, batch, batch_idx):
            self.seen += batch.tolist()
            return self.layer(batch.float()[:, None]).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class SaveAndFail(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == stop_after and stop_after % (N // BS):
                if prefetch:  # the service has run ahead of the step that saves
                    loader = trainer.fit_loop._combined_loader.flattened[0]
                    wait_until_ahead(loader, loader._stats["batches"])
                self.save_and_fail(trainer)

        def on_train_epoch_end(self, trainer, *args):  # where ModelCheckpoint saves by default
            if trainer.global_step == stop_after:
                self.save_and_fail(trainer)

        def save_and_fail(self, trainer):
            trainer.save_checkpoint(ckpt_dir / "mid.ckpt")
            raise _Interrupted

    callbacks = [mtc_loader.lightning.PrefetchCallback(depth=2)] if prefetch else []
    if stop_after is not None:
        callbacks.append(SaveAndFail())
    model = Module()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            trainer.fit(model, numbers(workers), ckpt_path=ckpt_path)
        except _Interrupted:
            pass
    return model.seen, trainer


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("stop_after", [3, 10], ids=["mid_epoch", "epoch_end"])
def test_lightning_resume_from_a_checkpoint(tmp_path, workers, stop_after):
    full, _ = _lightning_fit(workers, tmp_path)
    assert full == list(range(N)) * 2
    first, _ = _lightning_fit(workers, tmp_path, stop_after=stop_after)
    assert first == full[:stop_after * BS]
    rest, trainer = _lightning_fit(workers, tmp_path, ckpt_path=tmp_path / "mid.ckpt")
    assert rest == full[stop_after * BS:]  # from sample 12 (mid-epoch), not 20
    assert trainer.global_step == 2 * N // BS


def test_lightning_does_not_take_a_plain_loader_for_stateful(tmp_path):
    pytest.importorskip("lightning.pytorch")
    from lightning.fabric.utilities.types import _Stateful

    assert not isinstance(wrap(DataLoader(torch.arange(8)), "cpu", 2, {}), _Stateful)
    assert isinstance(wrap(numbers(0), "cpu", 2, {}), _Stateful)


# ------------------------------------------------------------------------- accelerate

@pytest.mark.parametrize("workers", [0, 2])
def test_accelerate_save_state_and_load_state(tmp_path, workers):
    accelerate = pytest.importorskip("accelerate")
    import mtc_loader.accelerate
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DataLoaderConfiguration

    def prepared():
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        acc = accelerate.Accelerator(cpu=True,
                                     dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
        model = torch.nn.Linear(1, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        model, optimizer, loader = acc.prepare(model, optimizer,
                                               DataLoader(torch.arange(N), batch_size=BS, num_workers=workers))
        assert mtc_loader.accelerate.prefetch(loader, depth=2) is loader
        return acc, loader

    try:
        acc, loader = prepared()
        seen = []
        for batch in loader:
            seen += batch.tolist()
            # a step long enough for the service to run ahead (the shard takes the loader's
            # state for this batch before it takes the next)
            base = loader.base_dataloader
            wait_until_ahead(base, base._stats["batches"], limit=N // BS)
            if len(seen) == 3 * BS:
                acc.save_state(str(tmp_path / "state"))
                break
        acc, loader = prepared()
        acc.load_state(str(tmp_path / "state"))
        rest = samples(loader)
        assert seen + rest == list(range(N))  # from sample 12, not 20
        assert samples(loader) == list(range(N))
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def test_accelerate_plain_loader_keeps_no_state():
    accelerate = pytest.importorskip("accelerate")
    import mtc_loader.accelerate
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        acc = accelerate.Accelerator(cpu=True)
        loader = acc.prepare(DataLoader(torch.arange(8), batch_size=4))
        mtc_loader.accelerate.prefetch(loader)
        assert not hasattr(loader.base_dataloader, "state_dict")  # accelerate's own probe
        assert samples(loader) == list(range(8))
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


# ------------------------------------------------------------------------- mmengine

SEEN_MM: list = []


def _mm_runner(tmp_path, workers, *, crash_at=None, resume_from=None, by_epoch_ckpt=False):
    """A Runner training MTCEpochBasedTrainLoop for 2 epochs of 5 batches over a
    StatefulDataLoader; a checkpoint every 3 iterations (or every epoch); ``crash_at``: the run
    fails right after the checkpoint of that iteration (epoch) is saved."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("mmengine")
        from mmengine.dataset import pseudo_collate
        from mmengine.hooks import Hook
        from mmengine.model import BaseModel
        from mmengine.runner import Runner

        import mtc_loader.mmengine  # noqa: F401

    class Model(BaseModel):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))

        def forward(self, inputs, mode="tensor"):
            SEEN_MM.extend(int(x) for x in inputs)
            return {"loss": self.w.sum() * 0}

    class Crash(Hook):
        priority = "LOWEST"  # after the CheckpointHook (VERY_LOW)

        def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
            if not by_epoch_ckpt and runner.iter + 1 == crash_at:
                prefetch = getattr(runner.train_loop, "_prefetch", None)
                if prefetch is not None:  # the service has run ahead of the step that saved
                    wait_until_ahead(prefetch, prefetch._stats["batches"], limit=5)
                raise _Interrupted

        def after_train_epoch(self, runner):
            if by_epoch_ckpt and runner.epoch + 1 == crash_at:
                raise _Interrupted

    class Slow(torch.utils.data.Dataset):
        def __len__(self):
            return 20

        def __getitem__(self, i):
            return {"inputs": torch.tensor(i)}

    loader = StatefulDataLoader(Slow(), batch_size=BS, num_workers=workers, collate_fn=pseudo_collate)
    ckpt = dict(type="CheckpointHook", interval=1, by_epoch=True) if by_epoch_ckpt else \
        dict(type="CheckpointHook", interval=3, by_epoch=False)
    with warnings.catch_warnings():  # mmengine's (a logger per Runner, deprecations)
        warnings.simplefilter("ignore")
        return Runner(
            model=Model(), work_dir=str(tmp_path), train_dataloader=loader,
            train_cfg=dict(type="MTCEpochBasedTrainLoop", max_epochs=2, prefetch_depth=2),
            optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.01)),
            default_hooks=dict(checkpoint=ckpt, logger=None), custom_hooks=[Crash()] if crash_at else None,
            log_level="ERROR", env_cfg=dict(cudnn_benchmark=False, dist_cfg=dict(backend="gloo")),
            default_scope=None, cfg=dict(),
            resume=resume_from is not None, load_from=str(resume_from) if resume_from is not None else None,
        )


@pytest.fixture
def mm_resume(monkeypatch):
    # mmengine 0.10 calls torch.load with its defaults, and its checkpoints hold its own classes
    # (the message hub's buffers), which torch >= 2.6 does not load by default: mmengine's
    # resume needs this on those versions, with or without mtc_loader
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")


def _mm_train(runner) -> list:
    SEEN_MM.clear()
    with warnings.catch_warnings(), mock.patch("mmengine.runner.runner.get_device", return_value="cpu"):
        warnings.simplefilter("ignore")
        try:
            runner.train()
        except _Interrupted:
            pass
    return list(SEEN_MM)


@pytest.mark.parametrize("workers", [0, 2])
def test_mmengine_resume_mid_epoch(mm_resume, tmp_path, workers):
    full = _mm_train(_mm_runner(tmp_path / "full", workers))
    assert full == list(range(20)) * 2
    first = _mm_train(_mm_runner(tmp_path / "run", workers, crash_at=3))
    assert first == list(range(12))
    ckpt = tmp_path / "run" / "iter_3.pth"
    runner = _mm_runner(tmp_path / "run", workers, resume_from=ckpt)
    rest = _mm_train(runner)
    assert rest == list(range(12, 20)) + list(range(20))  # batch 3 of epoch 0 next, not a new epoch
    assert runner.iter == 10 and runner.epoch == 2
    saved = torch.load(ckpt, weights_only=False)["mtc_loader"]
    assert saved["batches_done"] == 3 and yielded(saved["train_dataloader"]) == 3


def test_mmengine_resume_at_an_epoch_end(mm_resume, tmp_path):
    first = _mm_train(_mm_runner(tmp_path, 0, crash_at=1, by_epoch_ckpt=True))
    assert first == list(range(20))
    runner = _mm_runner(tmp_path, 0, resume_from=tmp_path / "epoch_1.pth", by_epoch_ckpt=True)
    assert _mm_train(runner) == list(range(20))
    assert runner.iter == 10 and runner.epoch == 2


def test_mmengine_load_from_without_resume_starts_over(mm_resume, tmp_path):
    _mm_train(_mm_runner(tmp_path / "run", 0, crash_at=3))
    runner = _mm_runner(tmp_path / "other", 0)
    runner._load_from = str(tmp_path / "run" / "iter_3.pth")  # weights only: load_from, resume=False
    assert _mm_train(runner) == list(range(20)) * 2
