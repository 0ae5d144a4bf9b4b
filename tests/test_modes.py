"""torch's modes around a copy. The engine allocates its outputs with ``torch.empty`` and writes
them from C: under a ``TorchDispatchMode`` that fakes them (``FakeTensorMode``) it must raise a
clear error, never write through the fake tensor's null data pointer (which would kill the
interpreter), and a packed batch is still consumed (its arena region freed). A mode that hands
out ordinary tensors (a flop counter, a logging mode) is copied under as before. Each case runs
in a fresh interpreter, where a crash fails the test instead of killing pytest.
"""
from __future__ import annotations

import pytest

from conftest import run_child

_PRELUDE = """
import json, numpy as np, torch, mtc_loader
from torch._subclasses.fake_tensor import FakeTensorMode
pc = mtc_loader.PackedCollate(list, arena_bytes=1 << 20)
batch = pc([{"a": torch.arange(5.0), "b": torch.arange(3), "c": torch.ones(4, dtype=torch.uint8)}])
ro = np.arange(4.0)
ro.setflags(write=False)  # a read-only array is copied on the host (torch cannot wrap it)
y = [torch.arange(2)]  # made outside any mode: the inputs are real tensors
calls = {
    "unpack": lambda: batch.unpack("cpu"),
    "to": lambda: batch.to("cpu"),
    "start_copy": lambda: mtc_loader.start_copy({"x": ro, "y": y}, "cpu").get(),
}
"""

_FAKE = _PRELUDE + """
err = None
with FakeTensorMode():
    try:
        calls[ENTRY]()
    except RuntimeError as e:
        err = str(e)
s = pc.arena.stats()
# the engine still works after the error, and the batch was consumed
again = None
try:
    batch.unpack("cpu")
except RuntimeError as e:
    again = str(e)
fresh = pc([{"a": torch.arange(5.0)}]).unpack("cpu")
out = mtc_loader.start_copy({"x": ro}, "cpu").get()
print(json.dumps({"err": err, "in_use": s["slots_in_use"], "frees": s["frees"], "again": again,
                  "fresh": bool(torch.equal(fresh[0]["a"], torch.arange(5.0))),
                  "copied": bool(torch.equal(out["x"], torch.arange(4.0, dtype=torch.float64)))}))
"""


@pytest.mark.parametrize("entry", ["unpack", "to", "start_copy"])
def test_fake_tensor_mode_is_an_error_not_a_crash(entry):
    r = run_child(_FAKE.replace("ENTRY", repr(entry)))
    assert r["err"] is not None and "FakeTensorMode" in r["err"], r["err"]
    assert "copy outside the mode" in r["err"]
    assert r["fresh"] and r["copied"]
    if entry != "start_copy":
        # the batch is consumed: its region freed, a second unpack refused
        assert r["in_use"] == 0 and r["frees"] == 1, r
        assert "already unpacked" in r["again"]


_PASSING = _PRELUDE + """
from torch.utils._python_dispatch import TorchDispatchMode
from torch.overrides import TorchFunctionMode
seen = []
class Logging(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        seen.append(str(func))
        return func(*args, **(kwargs or {}))
class Functions(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))
ok = []
for mode in (Logging, Functions):
    b = pc([{"a": torch.arange(5.0), "b": torch.arange(3)}])
    with mode():
        out = b.unpack("cpu")
        sc = mtc_loader.start_copy({"x": ro}, "cpu").get()
    ok.append(bool(torch.equal(out[0]["a"], torch.arange(5.0)) and torch.equal(out[0]["b"], torch.arange(3))
                   and torch.equal(sc["x"], torch.arange(4.0, dtype=torch.float64))))
print(json.dumps({"ok": ok, "saw_empty": any("empty" in f for f in seen),
                  "in_use": pc.arena.stats()["slots_in_use"]}))
"""


def test_modes_that_give_ordinary_tensors_still_copy():
    r = run_child(_PASSING)
    assert r["ok"] == [True, True] and r["saw_empty"] and r["in_use"] == 1  # `batch` is never unpacked


_POINTER = _PRELUDE + """
from torch.utils._python_dispatch import TorchDispatchMode
class Sly(TorchDispatchMode):
    # ordinary tensors for the engine's probe (one element), meta tensors (no memory) otherwise:
    # the pointer check must refuse them where the mode check let the copy through
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.ops.aten.empty.memory_format and list(args[0]) != [1]:
            kwargs["device"] = torch.device("meta")
        return func(*args, **kwargs)
err = None
with Sly():
    try:
        calls[ENTRY]()
    except RuntimeError as e:
        err = str(e)
fresh = pc([{"a": torch.arange(5.0)}]).unpack("cpu")
print(json.dumps({"err": err, "in_use": pc.arena.stats()["slots_in_use"],
                  "fresh": bool(torch.equal(fresh[0]["a"], torch.arange(5.0)))}))
"""


@pytest.mark.parametrize("entry", ["unpack", "start_copy"])
def test_a_tensor_without_memory_is_never_written(entry):
    # the unpack's tensors come from torch's allocator through the C shim where it is on, where
    # no Python mode sees them: torch.empty from Python (and the pointer check) without it
    r = run_child(_POINTER.replace("ENTRY", repr(entry)), MTC_TORCH_SHIM="0")
    assert r["err"] is not None and "data_ptr() is 0" in r["err"], r["err"]
    assert r["fresh"]
    if entry == "unpack":
        assert r["in_use"] == 0


def test_an_unpack_through_the_shim_is_out_of_a_modes_reach():
    """Through the C shim a packed batch's tensors are allocated where no Python mode can swap
    them: the mode that hands out meta tensors leaves the unpack whole."""
    from mtc_loader import _engine
    if not _engine._shim_info()[0]:
        pytest.skip("this torch has no AOTInductor C shim")
    code = _POINTER.replace(
        "        calls[ENTRY]()", "        out = calls['unpack']()\n        same = bool(torch.equal(out[0]['c'], "
        "torch.ones(4, dtype=torch.uint8)) and torch.equal(out[0]['a'], torch.arange(5.0)))")
    code = code.replace("ENTRY", repr("unpack")).replace(
        'print(json.dumps({"err": err,', 'print(json.dumps({"same": same, "err": err,')
    r = run_child(code)
    assert r["err"] is None and r["same"] and r["fresh"] and r["in_use"] == 0, r


_DEVICE = _PRELUDE + """
ok = []
with torch.device("meta"):
    ok.append(bool(torch.equal(batch.unpack("cpu")[0]["b"], torch.arange(3, device="cpu"))))
    ok.append(mtc_loader._modes._device_contexts_only())
print(json.dumps({"ok": ok}))
"""


def test_a_default_device_context_is_no_mode_to_refuse():
    """``with torch.device("meta")`` (model construction code) is a TorchFunctionMode that leaves
    the engine's ``torch.empty(..., device=...)`` alone: copied under without a probe."""
    assert run_child(_DEVICE)["ok"] == [True, True]
