"""Mistakes are caught where they are made: a PrefetchLoader over something that is not an iterable
of batches, a device name in the wrong case, and arena sizes with units."""
import pytest
import torch

import mtc_loader as m


@pytest.mark.parametrize("args", [(5, "cpu"), ("cpu", [1]), (torch.device("cpu"), [1])])
def test_prefetch_loader_refuses_what_is_not_an_iterable_of_batches(args):
    with pytest.raises(TypeError, match=r"PrefetchLoader wraps an iterable of batches .*PrefetchLoader\(loader, device\)"):
        m.PrefetchLoader(*args)


@pytest.mark.parametrize("device,meant", [("CPU", "cpu"), (" Cpu", "cpu"), ("CUDA", "cuda"), ("GPU:1", "cuda:1")])
def test_a_device_in_the_wrong_case_gets_did_you_mean(device, meant):
    with pytest.raises(ValueError, match=f"did you mean '{meant}'"):
        m.start_copy(torch.zeros(2), device)


@pytest.mark.parametrize("text,nbytes", [("512K", 512 << 10), ("1M", 1 << 20), ("2MiB", 2 << 20), ("1mb", 1 << 20),
                                         ("65536", 65536), (1 << 20, 1 << 20)])
def test_arena_bytes_take_the_train_commands_units(text, nbytes):
    assert m.PackedCollate(arena_bytes=text).stats()["bytes"] == nbytes
    assert m.Arena(text).stats()["bytes"] == nbytes


@pytest.mark.parametrize("bad", ["512X", "M", "-1M", 1.5, "0"])
def test_a_bad_arena_size_says_what_it_takes(bad):
    with pytest.raises(ValueError, match=r"arena_bytes must be|arena_bytes must be positive"):
        m.PackedCollate(arena_bytes=bad)
