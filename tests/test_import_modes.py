"""What mtc_loader builds at import does not depend on the importing code's default device or
torch's modes, a dtype's code means the same dtype in every process that shares an arena (and a
process whose table differs is refused, naming both sides), and torch's libraries are found
wherever this process loaded them from (output_maker() says why a route is off)."""
import multiprocessing
import os

import pytest
import torch
import torch.utils.data

import mtc_loader
from mtc_loader import _dtypes, _engine

from conftest import run_child

# What a child prints about its import: the dtype table, its fingerprint and the routes.
_REPORT = """
import json
from mtc_loader import _dtypes, _engine
print(json.dumps({"dtypes": [str(d) for d in _dtypes.DTYPES], "table": _dtypes.TABLE,
                  "routes": mtc_loader.output_maker(), "parts": _engine._shim_parts()}))
"""

_UNDER = {
    "set_default_device": 'import torch\ntorch.set_default_device("meta")\nimport mtc_loader\n',
    "device_context": 'import torch\nwith torch.device("meta"):\n    import mtc_loader\n',
    "fake_mode": ("import torch\nfrom torch._subclasses.fake_tensor import FakeTensorMode\n"
                  "with FakeTensorMode():\n    import mtc_loader\n"),
    "functional_mode": ("import torch\nfrom torch._subclasses.functional_tensor import FunctionalTensorMode\n"
                        "with FunctionalTensorMode():\n    import mtc_loader\n"),
    "deterministic": "import torch\ntorch.use_deterministic_algorithms(True)\nimport mtc_loader\n",
    "deterministic_warn_only": ("import torch\ntorch.use_deterministic_algorithms(True, warn_only=True)\n"
                                "import mtc_loader\n"),
    "deterministic_debug_error": 'import torch\ntorch.set_deterministic_debug_mode("error")\nimport mtc_loader\n',
    "deterministic_debug_warn": 'import torch\ntorch.set_deterministic_debug_mode("warn")\nimport mtc_loader\n',
    "default_dtype_float64": "import torch\ntorch.set_default_dtype(torch.float64)\nimport mtc_loader\n",
    "default_dtype_bfloat16": "import torch\ntorch.set_default_dtype(torch.bfloat16)\nimport mtc_loader\n",
    "no_grad": "import torch\nwith torch.no_grad():\n    import mtc_loader\n",
    "inference_mode": "import torch\nwith torch.inference_mode():\n    import mtc_loader\n",
    "anomaly_mode": "import torch\ntorch.autograd.set_detect_anomaly(True)\nimport mtc_loader\n",
    "mkldnn_off": "import torch\ntorch.backends.mkldnn.enabled = False\nimport mtc_loader\n",
    "no_fill": "import torch\ntorch.utils.deterministic.fill_uninitialized_memory = False\nimport mtc_loader\n",
}


@pytest.fixture(scope="module")
def plain_import():
    return run_child("import mtc_loader\n" + _REPORT)


@pytest.mark.parametrize("how", sorted(_UNDER))
def test_import_under_a_default_device_or_mode_builds_the_same_tables(plain_import, how):
    """Under a meta default device, a FakeTensorMode or FunctionalTensorMode, deterministic mode
    (and its debug mode), another default dtype, no_grad or inference mode, anomaly detection or
    a torch.backends flag, the import builds the same dtype table (no int1..7 probed on meta) and
    turns on the same readers as a plain import."""
    under = run_child(_UNDER[how] + _REPORT)
    assert under["dtypes"] == plain_import["dtypes"]
    assert under["table"] == plain_import["table"]
    assert under["routes"] == plain_import["routes"]
    assert under["parts"] == plain_import["parts"]
    assert not any(d in under["dtypes"] for d in ("torch.int4", "torch.uint3", "torch.int1"))


_DETERMINISTIC = """
import torch
torch.use_deterministic_algorithms(True)
torch.set_deterministic_debug_mode("warn")
import json, mtc_loader
from mtc_loader import _dtypes
from torch.utils.data import DataLoader
settings = [torch.are_deterministic_algorithms_enabled(), torch.get_deterministic_debug_mode()]
bits = {"b8": torch.arange(4, dtype=torch.uint8, device="cpu").view(torch.bits8),
        "b16": torch.arange(4, dtype=torch.uint8, device="cpu").view(torch.bits16),
        "f4": torch.arange(4, dtype=torch.uint8, device="cpu").view(torch.float4_e2m1fn_x2)}
copied = mtc_loader.start_copy(bits, "cpu").get()
packed = mtc_loader.PackedCollate(list, arena_bytes=1 << 20)([bits]).unpack("cpu")[0]
same = [torch.equal(o[k].view(torch.uint8), bits[k].view(torch.uint8)) and o[k].dtype == bits[k].dtype
        for o in (copied, packed) for k in bits]
samples = [{"u8": torch.arange(5, dtype=torch.uint8) + i, "f": torch.full((2,), float(i))} for i in range(4)]
batches = {}
for context in ("spawn", "forkserver"):
    loader = DataLoader(samples, batch_size=2, num_workers=2, multiprocessing_context=context,
                        collate_fn=mtc_loader.PackedCollate(arena_bytes=1 << 20))
    batches[context] = [{k: v.tolist() for k, v in b.unpack("cpu").items()} for b in loader]
print(json.dumps({"table": _dtypes.TABLE, "settings": settings, "same": same, "batches": batches}))
"""


def test_deterministic_mode_before_the_import_keeps_the_whole_table_and_spawn_workers_agree(plain_import):
    """torch.use_deterministic_algorithms(True) at a script's top, before the import: the dtype
    table is the whole one (the bits dtypes copy), so that spawn and forkserver workers, which
    import without it, agree with the main process; the setting itself is left as it was."""
    got = run_child(_DETERMINISTIC)
    assert got["table"] == plain_import["table"] == list(_dtypes.TABLE)
    assert got["settings"] == [True, 1]
    assert got["same"] == [True] * 6
    want = [{"u8": [[x + 2 * n + i for x in range(5)] for i in range(2)],
             "f": [[float(2 * n + i)] * 2 for i in range(2)]} for n in range(2)]
    assert got["batches"] == {"spawn": want, "forkserver": want}


def test_dtype_table_is_the_fixed_list_in_its_order():
    names = [str(d).rpartition(".")[2] for d in _dtypes.DTYPES]
    known = [n for n in names if n in _dtypes._KNOWN]
    assert known == [n for n in _dtypes._KNOWN if n in known]
    assert names[:len(known)] == known  # newer dtypes only after the fixed list
    assert not set(names) & _dtypes._SHELLS


def test_tables_are_built_outside_modes_and_modes_come_back():
    """outside_modes sets a FakeTensorMode and a device context aside, and restores both."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    with torch.device("meta"), FakeTensorMode():
        with _dtypes.outside_modes():
            t = torch.zeros(2)
        after = torch.empty(2)
    assert type(t) is torch.Tensor and t.device.type == "cpu"
    assert isinstance(after, FakeTensor) and after.device.type == "meta"


_ROUND_TRIP = """
import torch
torch.set_default_device("meta")
import json, mtc_loader
torch.set_default_device(None)  # model construction done: the loop runs as usual
from torch.utils.data import DataLoader
cpu = dict(device="cpu")
samples = [{"u8": torch.arange(5, dtype=torch.uint8, **cpu) + i, "i8": -torch.arange(3, dtype=torch.int8, **cpu),
            "i16": torch.arange(4, dtype=torch.int16, **cpu) * 300, "i64": torch.arange(2, dtype=torch.int64, **cpu) << 40,
            "f": torch.full((2,), 0.5, **cpu)} for i in range(4)]
loader = DataLoader(samples, batch_size=2, num_workers=2, multiprocessing_context="spawn",
                    collate_fn=mtc_loader.PackedCollate(arena_bytes=1 << 20))
out = []
for b in loader:
    got = b.unpack("cpu")
    out.append({k: [str(v.dtype), v.device.type, v.tolist()] for k, v in got.items()})
print(json.dumps({"batches": out, "stats": mtc_loader.stats(), "reader": mtc_loader.output_maker()["reader"]}))
"""


def test_spawn_workers_round_trip_small_integer_dtypes_when_the_main_process_imported_under_meta():
    """uint8, int8, int16 and int64 leaves come back as themselves through spawn workers when the
    main process imported under meta: a dtype's code means the same dtype in every process."""
    got = run_child(_ROUND_TRIP)
    want = [torch.uint8, torch.int8, torch.int16, torch.int64, torch.float32]
    assert len(got["batches"]) == 2
    for n, batch in enumerate(got["batches"]):
        assert [batch[k][0] for k in ("u8", "i8", "i16", "i64", "f")] == [str(d) for d in want]
        assert all(v[1] == "cpu" for v in batch.values())
        assert batch["u8"][2] == [[x + 2 * n + i for x in range(5)] for i in range(2)]
        assert batch["i8"][2] == [[0, -1, -2]] * 2
        assert batch["i16"][2] == [[0, 300, 600, 900]] * 2
        assert batch["i64"][2] == [[0, 1 << 40]] * 2
    # the main process reads its own leaves (the unpack walks none): the readers are on there
    assert got["reader"] == mtc_loader.output_maker()["reader"]


_READERS = """
import torch
torch.set_default_device("meta")
import json, mtc_loader
x = {"a": torch.arange(6.0, device="cpu"), "b": torch.ones(3, dtype=torch.int64, device="cpu")}
before = mtc_loader.stats()
mtc_loader.start_copy(x, "cpu", use_background_thread=False).get()
after = mtc_loader.stats()
refused = []
for dt in (getattr(torch, f"{k}int{b}") for k in ("", "u") for b in range(1, 8)):
    t = torch.arange(8, dtype=torch.uint8, device="cpu").view(dt)
    for fn in (lambda: mtc_loader.PackedCollate(list, arena_bytes=1 << 20)([{"x": t}]),
               lambda: mtc_loader.start_copy({"x": t}, "cpu", use_background_thread=False).get()):
        try:
            fn()
        except TypeError as e:
            refused.append(str(e))
print(json.dumps({k: after[k] - before[k] for k in ("leaves_read_shim", "leaves_read_dlpack")}
                 | {"routes": mtc_loader.output_maker(), "refused": refused}))
"""


def test_readers_stay_on_and_shell_dtypes_are_refused_after_an_import_under_meta():
    got = run_child(_READERS)
    routes = mtc_loader.output_maker()
    assert got["routes"] == routes
    if routes["reader"] == "shim":
        assert got["leaves_read_shim"] == 2
    elif routes["reader"] == "dlpack":
        assert got["leaves_read_dlpack"] == 2
    assert len(got["refused"]) == 28
    assert all("which mtc_loader cannot copy bytewise" in m and "['x']" in m for m in got["refused"])


# --- the dtype table of another process


def test_a_process_with_another_dtype_table_is_refused_naming_both_sides():
    """An arena whose creator had another torch (its table travels with the arena): packing
    and unpacking its batches here is refused, and the batch is consumed (its region freed)."""
    pc = mtc_loader.PackedCollate(list, arena_bytes=1 << 20)
    batch = pc([{"x": torch.arange(3)}])
    pc.arena._dtype_table = ("2.99.0", "0badc0de")
    try:
        with pytest.raises(RuntimeError) as e:
            batch.unpack("cpu")
        msg = str(e.value)
        assert f"this process's torch {torch.__version__} (dtype table {_dtypes.TABLE[1]})" in msg
        assert "the arena creator's torch 2.99.0 (dtype table 0badc0de)" in msg and "unpacks" in msg
        assert "same torch" in msg
        with pytest.raises(RuntimeError, match="already unpacked"):
            batch.unpack("cpu")
        assert pc.arena.stats()["slots_in_use"] == 0
        with pytest.raises(RuntimeError, match=r"packs a batch .*arena creator's torch 2\.99\.0"):
            pc([{"x": torch.arange(3)}])
    finally:
        pc.arena._dtype_table = _dtypes.TABLE
    assert torch.equal(pc([{"x": torch.arange(3)}]).unpack("cpu")[0]["x"], torch.arange(3))


def _forge_table(worker_id):
    _dtypes.TABLE = ("2.99.0", "0badc0de")


def test_a_worker_with_another_dtype_table_fails_the_loader_with_both_sides():
    """A spawn worker whose torch differs from the main process's: the loader raises the
    worker's error, which names both torches, instead of delivering other dtypes."""
    loader = torch.utils.data.DataLoader([torch.arange(3, dtype=torch.uint8)] * 2, batch_size=2, num_workers=1,
                                         multiprocessing_context="spawn", worker_init_fn=_forge_table,
                                         collate_fn=mtc_loader.PackedCollate(arena_bytes=1 << 20))
    with pytest.raises(RuntimeError) as e:
        next(iter(loader))
    msg = str(e.value)
    assert "this process's torch 2.99.0 (dtype table 0badc0de)" in msg
    assert f"the arena creator's torch {torch.__version__} (dtype table {_dtypes.TABLE[1]})" in msg


def test_arena_carries_its_creators_table_to_the_processes_it_is_pickled_to():
    import pickle
    arena = mtc_loader.Arena(1 << 16)
    args = arena.__reduce__()[1]
    assert args[3] == _dtypes.TABLE  # (dupfd, token, expected, the creator's table, ...)
    pickle.dumps(arena)  # the resource sharer's registration; closed with the arena


# --- torch's libraries, wherever they lie

_ELSEWHERE = """
import os, os.path
real_exists = os.path.exists
def exists(p):
    # a torch whose libraries are not in torch/lib (conda-forge's keeps them in $PREFIX/lib)
    return False if os.path.join("torch", "lib") in os.fspath(p) else real_exists(p)
os.path.exists = exists
import json, mtc_loader
from mtc_loader import _engine
os.path.exists = real_exists
print(json.dumps({"info": _engine._shim_info(), "routes": mtc_loader.output_maker()}))
"""


@pytest.mark.skipif(not _engine._shim_info()[0], reason="this torch has no AOTInductor C shim")
def test_shim_is_found_through_the_loaded_libraries_when_torch_lib_has_none():
    """The shim is found through the process's loaded libraries wherever torch keeps them (not
    only as torch/lib/libtorch_cpu.so)."""
    got = run_child(_ELSEWHERE)
    assert got["info"] == [True, True]
    assert got["routes"]["maker"] == "shim" and got["routes"]["reasons"]["shim"] is None
    assert os.path.basename(got["routes"]["library"]).startswith("libtorch_cpu.so")
    assert got["routes"] == mtc_loader.output_maker()


def test_loaded_library_is_read_from_the_maps_and_says_why_when_missing(monkeypatch):
    from mtc_loader import _setup
    path, why = _setup._loaded_library("libtorch_cpu.so")
    assert why is None and os.path.basename(path).startswith("libtorch_cpu.so") and os.path.exists(path)
    with open("/proc/self/maps") as maps:
        assert path in maps.read()
    path, why = _setup._loaded_library("libmtc_no_such_library.so")
    assert path is None and "libmtc_no_such_library.so is neither among this process's loaded libraries" in why


@pytest.mark.skipif(not _engine._shim_info()[0], reason="this torch has no AOTInductor C shim")
def test_output_maker_says_why_each_route_is_off():
    off = run_child("import json, mtc_loader\nprint(json.dumps(mtc_loader.output_maker()))", MTC_TORCH_SHIM="0")
    assert off["maker"] == "split" and off["reason"] == "MTC_TORCH_SHIM=0 turned it off"
    assert off["reasons"]["shim"] == off["reason"] and off["reasons"]["shim_reader"] == off["reason"]
    assert off["reasons"]["wrap"].startswith("the outputs are not made through the shim: MTC_TORCH_SHIM=0")
    assert off["reader"] in ("dlpack", "attributes")
    prev = _engine._use_dlpack(False)
    prev_reader = _engine._use_shim_reader(False)
    try:
        r = mtc_loader.output_maker()
        assert r["reader"] == "attributes"
        assert r["reasons"]["dlpack_reader"] in ("mtc_loader._engine._use_dlpack(False) turned it off",
                                                 _engine._shim_parts()["dlpack_why"])
        if _engine._shim_parts()["reader"]:
            assert r["reasons"]["shim_reader"] == "mtc_loader._engine._use_shim_reader(False) turned it off"
    finally:
        _engine._use_dlpack(prev)
        _engine._use_shim_reader(prev_reader)
    assert mtc_loader.output_maker()["reasons"]["shim"] is None


_NO_LIBRARY = """
import os, os.path, builtins
real_open, real_exists = builtins.open, os.path.exists
def fake_open(p, *a, **k):
    if p == "/proc/self/maps":
        raise PermissionError(13, "Permission denied", p)
    return real_open(p, *a, **k)
builtins.open = fake_open
os.path.exists = lambda p: False if os.path.join("torch", "lib") in os.fspath(p) else real_exists(p)
import json, mtc_loader
builtins.open, os.path.exists = real_open, real_exists
print(json.dumps(mtc_loader.output_maker()))
"""


def test_output_maker_says_the_library_was_not_found():
    got = run_child(_NO_LIBRARY)
    assert got["maker"] == "split" and got["library"] is None
    assert "libtorch_cpu.so is neither among this process's loaded libraries" in got["reason"]
    assert got["reasons"]["shim_reader"].startswith("this torch's shim is not used: ")
