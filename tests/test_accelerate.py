"""Hugging Face accelerate: a training loop over a loader from ``accelerator.prepare`` with
``collate_fn=PackedCollate(...)`` and nothing else changed (``send_to_device`` calls
``PackedBatch.to``), with the prefetch service added by ``mtc_loader.accelerate.prefetch``, and
over the per-process DataLoaders accelerate re-creates for two processes; the batches the loop
saw are checked bitwise. Runs on the CPU everywhere and on CUDA where a GPU is."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

accelerate = pytest.importorskip("accelerate")

import mtc_loader  # noqa: E402
import mtc_loader.accelerate  # noqa: E402
from accelerate.data_loader import prepare_data_loader  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.tracking import GeneralTracker  # noqa: E402
from conftest import requires_cuda  # noqa: E402
from frameworks import NestedSamples, check_seen, collate, record  # noqa: E402
from mtc_loader.prefetch import PrefetchLoader  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]


@pytest.fixture
def accelerator(request):
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = accelerate.Accelerator(cpu=request.param == "cpu", gradient_accumulation_steps=2)
    yield acc
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def packed() -> mtc_loader.PackedCollate:
    return mtc_loader.PackedCollate(collate, arena_bytes=16 << 20)


def train(acc, loader, model, optimizer, epochs: int = 2) -> list:
    """The loop accelerate's documentation shows, with gradient accumulation; records every
    batch and whether accelerate saw the end of the loader at it."""
    seen = []
    for _ in range(epochs):
        for batch in loader:
            with acc.accumulate(model):
                seen.append(record(batch) + (acc.gradient_state.end_of_dataloader, acc.sync_gradients))
                loss = model(batch["x"]).square().mean()
                acc.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
    return seen


def run(acc, collate_fn, with_prefetch: bool, n: int = 20) -> list:
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(NestedSamples(n), batch_size=4, shuffle=True, num_workers=2, collate_fn=collate_fn)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    if with_prefetch:
        assert mtc_loader.accelerate.prefetch(loader) is loader
        assert isinstance(loader.base_dataloader, PrefetchLoader)
        assert isinstance(loader, DataLoader)  # accelerate's own isinstance guarantee holds
    return train(acc, loader, model, optimizer)


def check_end_flags(seen: list, per_epoch: int) -> None:
    """accelerate marks the end of the loader at the last batch of each epoch, and only there:
    prefetching ahead must not move it (gradient accumulation syncs on it)."""
    ends = [s[3] for s in seen]
    assert ends == ([False] * (per_epoch - 1) + [True]) * (len(seen) // per_epoch)
    # gradient_accumulation_steps=2: every second step syncs, and the last step of an epoch
    # (an odd count: only because accelerate saw the end there)
    syncs = [s[4] for s in seen]
    epoch = [(k + 1) % 2 == 0 or k == per_epoch - 1 for k in range(per_epoch)]
    assert syncs == epoch * (len(seen) // per_epoch), syncs


@pytest.mark.parametrize("accelerator", DEVICES, indirect=True)
@pytest.mark.parametrize("with_prefetch", [False, True], ids=["collate_only", "prefetch"])
def test_accelerate_loop_packed(accelerator, with_prefetch):
    seen = run(accelerator, packed(), with_prefetch)
    check_seen([s[:3] for s in seen], accelerator.device, NestedSamples(20), range(20), epochs=2)
    check_end_flags(seen, per_epoch=5)


@pytest.mark.parametrize("accelerator", DEVICES, indirect=True)
def test_accelerate_prefetch_plain_batches(accelerator):
    seen = run(accelerator, collate, with_prefetch=True)
    check_seen([s[:3] for s in seen], accelerator.device, NestedSamples(20), range(20), epochs=2)
    check_end_flags(seen, per_epoch=5)


@pytest.mark.parametrize("accelerator", DEVICES, indirect=True)
@pytest.mark.parametrize("with_prefetch", [False, True], ids=["collate_only", "prefetch"])
def test_accelerate_recreated_for_two_processes(accelerator, with_prefetch):
    """accelerate re-creates the DataLoader per process (a sharded batch sampler); one
    PackedCollate serves both re-created loaders, and each process's shard arrives intact."""
    ds = NestedSamples(24)
    collate_fn = packed()
    indices = []
    for rank in range(2):
        base = DataLoader(ds, batch_size=4, shuffle=False, num_workers=2, collate_fn=collate_fn)
        loader = prepare_data_loader(base, accelerator.device, num_processes=2, process_index=rank,
                                     put_on_device=True)
        assert loader.collate_fn is collate_fn
        if with_prefetch:
            mtc_loader.accelerate.prefetch(loader, depth=1)
        seen = [record(b) for b in loader]
        check_seen(seen, accelerator.device, ds, [i for _, _, b in seen for i in b["idx"].tolist()], epochs=1)
        indices += [i for _, _, b in seen for i in b["idx"].tolist()]
    assert sorted(indices) == list(range(24))


@pytest.mark.parametrize("accelerator", ["cpu"], indirect=True)
def test_prefetch_errors(accelerator):
    with pytest.raises(TypeError, match="mtc_loader: prefetch needs a DataLoader returned by accelerator.prepare"):
        mtc_loader.accelerate.prefetch(DataLoader(NestedSamples(4)))
    loader = accelerator.prepare(DataLoader(NestedSamples(4), collate_fn=collate))
    inner = mtc_loader.accelerate.prefetch(loader).base_dataloader
    assert mtc_loader.accelerate.prefetch(loader).base_dataloader is inner  # once
    unplaced = accelerate.data_loader.prepare_data_loader(DataLoader(NestedSamples(4)), put_on_device=False)
    with pytest.raises(ValueError, match="mtc_loader: this loader was prepared without device placement"):
        mtc_loader.accelerate.prefetch(unplaced)


class Recorder(GeneralTracker):
    """A tracker that keeps what accelerator.log gives it."""

    name = "recorder"
    requires_logging_directory = False

    def __init__(self) -> None:
        super().__init__()
        self.logged: list = []

    @property
    def tracker(self):
        return self

    def log(self, values, step=None, **kwargs):
        self.logged.append((step, dict(values), kwargs))


@pytest.fixture
def tracked():
    """An Accelerator on the CPU whose one tracker is a Recorder."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    recorder = Recorder()
    acc = accelerate.Accelerator(cpu=True, log_with=[recorder])
    acc.init_trackers("mtc")
    assert acc.trackers == [recorder]
    yield acc, recorder
    acc.end_training()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def test_log_stats_reaches_the_trackers(tracked):
    """The figures go to the trackers at the step the loop gives, each over the batches since
    the previous call: together the windows make up the loader's stats() over the run."""
    acc, recorder = tracked
    model = torch.nn.Linear(8, 1)
    loader = DataLoader(NestedSamples(20), batch_size=4, num_workers=2, collate_fn=collate)
    model, loader = acc.prepare(model, loader)
    loader = mtc_loader.accelerate.prefetch(loader)
    step, batches, returned = 0, [0], []
    for _ in range(2):
        for batch in loader:
            model(batch["x"]).sum().backward()
            step += 1
            if step % 2 == 0:
                acc.log({"loss": 1.0}, step=step)
                returned.append(mtc_loader.accelerate.log_stats(acc, loader, step=step,
                                                                log_kwargs={"recorder": {"note": step}}))
                batches.append(loader.base_dataloader.stats()["batches"])
    ours = [(s, v, kw) for s, v, kw in recorder.logged if "loss" not in v]
    assert [s for s, _, _ in ours] == [2, 4, 6, 8, 10]
    assert [kw for _, _, kw in ours[:2]] == [{"note": 2}, {"note": 4}]
    assert [v for _, v, _ in ours] == returned
    for _, values, _ in ours:
        assert set(values) == {"mtc/data_bound", "mtc/wait_ms_per_batch"}, values
        assert 0.0 <= values["mtc/data_bound"] <= 1.0 and values["mtc/wait_ms_per_batch"] >= 0.0, values
    counts = [b - a for a, b in zip(batches, batches[1:])]
    assert sum(counts) == 10  # (the prepared loader takes a batch ahead: the last window has the end)
    total = sum(v["mtc/wait_ms_per_batch"] * n for (_, v, _), n in zip(ours, counts))
    assert total == pytest.approx(loader.base_dataloader.stats()["wait_ms"], rel=1e-9)
    # nothing counted since: nothing logged
    assert mtc_loader.accelerate.log_stats(acc, loader, step=step) == {}
    assert len(recorder.logged) == len(ours) + 5


@pytest.mark.parametrize("accelerator", ["cpu"], indirect=True)
def test_log_stats_without_trackers_logs_nothing_and_returns_the_figures(accelerator):
    assert accelerator.trackers == []
    loader = mtc_loader.accelerate.prefetch(accelerator.prepare(DataLoader(NestedSamples(8), batch_size=4,
                                                                           collate_fn=collate)))
    assert len([b for b in loader]) == 2
    figures = mtc_loader.accelerate.log_stats(accelerator, loader, step=2)
    assert set(figures) == {"mtc/data_bound", "mtc/wait_ms_per_batch"}


@pytest.mark.parametrize("accelerator", ["cpu"], indirect=True)
def test_log_stats_after_reset_stats_counts_from_the_reset(accelerator):
    """reset_stats() between two calls: the second window starts at the reset, even when more
    batches have been counted since than before it."""
    loader = mtc_loader.accelerate.prefetch(accelerator.prepare(DataLoader(NestedSamples(16), batch_size=4,
                                                                           collate_fn=collate)))
    base = loader.base_dataloader
    assert len([b for b in loader]) == 4
    assert mtc_loader.accelerate.log_stats(accelerator, loader)
    base.reset_stats()
    for _ in range(2):
        assert len([b for b in loader]) == 4  # 8 batches since the reset, more than before it
    figures = mtc_loader.accelerate.log_stats(accelerator, loader)
    stats = base.stats()
    assert stats["batches"] == 8
    assert figures["mtc/wait_ms_per_batch"] == pytest.approx(stats["wait_ms_per_batch"], rel=1e-12)
    assert figures["mtc/data_bound"] == pytest.approx(stats["data_bound"], rel=1e-12)


@pytest.mark.parametrize("accelerator", ["cpu"], indirect=True)
def test_log_stats_errors(accelerator):
    loader = accelerator.prepare(DataLoader(NestedSamples(4), collate_fn=collate))
    with pytest.raises(TypeError, match="mtc_loader: log_stats needs the loader that .*got a prepared loader"):
        mtc_loader.accelerate.log_stats(accelerator, loader)
    with pytest.raises(TypeError, match="mtc_loader: log_stats needs the loader that .*got DataLoader"):
        mtc_loader.accelerate.log_stats(accelerator, DataLoader(NestedSamples(4)))
    loader = mtc_loader.accelerate.prefetch(loader)
    with pytest.raises(TypeError, match="mtc_loader: log_stats needs the Accelerator, got DataLoaderShard"):
        mtc_loader.accelerate.log_stats(loader, accelerator)
