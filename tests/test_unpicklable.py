"""A leaf that cannot be pickled (a generator, a lock) in a DataLoader worker's batch is refused at
pack time, naming its path, instead of leaving the main process waiting for the batch."""
import threading

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import mtc_loader as m


class WithGenerator(torch.utils.data.Dataset):
    def __len__(self):
        return 2  # one batch: no later batch is being packed when the region is counted

    def __getitem__(self, i):
        return {"x": torch.zeros(2), "meta": {"frames": (j for j in range(3)), "name": "a"}}


class WithLockInObjectArray(torch.utils.data.Dataset):
    def __len__(self):
        return 2  # one batch: no later batch is being packed when the region is counted

    def __getitem__(self, i):
        arr = np.empty(2, dtype=object)
        arr[0], arr[1] = "ok", threading.Lock()
        return {"x": torch.zeros(2), "objs": arr}


@pytest.mark.parametrize("ds,path,what", [
    (WithGenerator(), r"data\[0\]\['meta'\]\['frames'\] \(generator\)", "generator"),
    (WithLockInObjectArray(), r"data\[0\]\['objs'\]\[1\] \(lock\)", "lock"),
])
def test_unpicklable_leaf_is_refused_at_pack_time(ds, path, what):
    pc = m.PackedCollate(list, arena_bytes=1 << 20)
    dl = DataLoader(ds, batch_size=2, num_workers=1, collate_fn=pc, multiprocessing_context="fork", timeout=60)
    with pytest.raises(TypeError, match=path + r" cannot be pickled .*make it a value that pickles"):
        next(iter(dl))
    assert pc.stats()["slots_in_use"] == 0


def test_in_the_main_process_nothing_is_pickled():
    pc = m.PackedCollate(list, arena_bytes=1 << 20)
    out = pc([WithGenerator()[0]]).to("cpu")
    assert list(out[0]["meta"]["frames"]) == [0, 1, 2]
