"""torch.profiler ranges of the prefetch service: the caller's wait and hand-out
(``mtc_loader.prefetch.next``) and the service thread's copy of each batch
(``mtc_loader.prefetch.copy_batch``, in traces that profile every thread); none outside a
profiler. The CUDA variant also finds the copies on the device's copy stream."""
from __future__ import annotations

import pytest
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import mtc_loader
from conftest import requires_cuda, seed_batch

ALL_THREADS = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)

# torch 2.11 warns once, at prof.events(), that a profiler without a schedule keeps only the
# current cycle's events: these traces are one cycle
pytestmark = pytest.mark.filterwarnings("ignore:Warning. Profiler clears events:UserWarning")


def names(prof) -> list:
    return [e.name for e in prof.events()]


def run(device: str, n: int = 4) -> None:
    for batch in mtc_loader.PrefetchLoader([seed_batch(2, seed=k) for k in range(n)], device):
        del batch


def test_ranges_in_a_trace_of_every_thread():
    with profile(activities=[ProfilerActivity.CPU], experimental_config=ALL_THREADS) as prof:
        run("cpu")
    seen = names(prof)
    assert seen.count("mtc_loader.prefetch.next") == 5  # 4 batches and the end
    assert seen.count("mtc_loader.prefetch.copy_batch") == 4


def test_caller_range_in_a_default_trace():
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run("cpu")
    assert names(prof).count("mtc_loader.prefetch.next") == 5


def test_no_range_without_profiler(monkeypatch):
    entered = []
    real = torch.autograd.profiler.record_function
    monkeypatch.setattr(torch.autograd.profiler, "record_function",
                        lambda name, *a: entered.append(name) or real(name, *a))
    run("cpu")
    assert entered == []
    with profile(activities=[ProfilerActivity.CPU]):
        run("cpu", n=1)
    assert "mtc_loader.prefetch.next" in entered


@requires_cuda
def test_cuda_trace_shows_ranges_and_copies():
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], experimental_config=ALL_THREADS) as prof:
        run("cuda", n=6)
        torch.cuda.synchronize()
    seen = names(prof)
    # each range once on the CPU; a range in which the service thread itself issued the copies
    # (small batches are staged and sent on it) also shows on the GPU's timeline
    on_cpu = [e.name for e in prof.events() if e.device_type == DeviceType.CPU]
    assert on_cpu.count("mtc_loader.prefetch.copy_batch") == 6
    assert any("Memcpy HtoD" in s for s in seen), sorted(set(seen))
