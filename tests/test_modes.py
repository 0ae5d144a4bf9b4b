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


_NUMPY_UNDER = """
import json, numpy as np, torch, mtc_loader
from torch._subclasses.fake_tensor import FakeTensorMode
from torch._subclasses.functional_tensor import FunctionalTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
class Sub(torch.Tensor):
    pass
class Lifted(TorchDispatchMode):
    # ordinary tensors from torch.empty (the probe passes), a subclass from torch.from_numpy
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out.as_subclass(Sub) if func is torch.ops.aten.lift_fresh.default else out
got = {}
for mode in (FakeTensorMode, FunctionalTensorMode, Lifted):
    for with_tensor in (False, True):
        for background in (False, True):
            data = {"n": np.arange(3.0)}
            if with_tensor:
                data["t"] = torch.arange(3.0)  # reused: the numpy leaf alone would reach the mode
            try:
                with mode():
                    out = mtc_loader.start_copy(data, "cpu", use_background_thread=background).get()
                r = "no error: " + ", ".join(type(v).__name__ for v in out.values())
            except RuntimeError as e:
                r = str(e)
            got.setdefault(mode.__name__, []).append(r)
print(json.dumps(got))
"""


def test_a_numpy_leaf_under_a_fake_or_functional_mode_is_refused_naming_the_mode():
    """torch.from_numpy under FakeTensorMode gives a FakeTensor with no data, under
    FunctionalTensorMode a FunctionalTensor: refused like the outputs torch.empty makes, and a
    mode that turns from_numpy's tensor into a subclass is refused naming the leaf."""
    got = run_child(_NUMPY_UNDER)
    for name in ("FakeTensorMode", "FunctionalTensorMode"):
        assert len(got[name]) == 4
        for msg in got[name]:
            assert msg.startswith(f"mtc_loader: a TorchDispatchMode or TorchFunctionMode ({name}) is active"), msg
            assert "copy outside the mode" in msg
    assert len(got["Lifted"]) == 4
    for msg in got["Lifted"]:
        assert msg.startswith("mtc_loader: torch.from_numpy gave data['n'] (a numpy array) back as a Sub, not a "
                              "plain torch.Tensor"), msg


_SMALLER = """
import json, numpy as np, torch, mtc_loader
from torch.utils._python_dispatch import TorchDispatchMode
from torch.overrides import TorchFunctionMode
KIND = {kind!r}
def smaller(func, kwargs, args):
    # what the engine's probe (one uint8 element) never shows: float64 buffers made float16, or
    # half as many elements, or (new_empty_strided) contiguous where strides were asked for
    if KIND == "dtype" and kwargs.get("dtype") == torch.float64:
        kwargs["dtype"] = torch.float16
    elif KIND == "numel" and kwargs.get("dtype") == torch.float64 and len(args) and len(args[0]) == 1:
        args = ([max(1, args[0][0] // 2)],) + tuple(args[1:])
    elif KIND == "strides" and len(args) >= 3 and isinstance(args[2], (tuple, list)):
        args = args[:2] + (tuple(torch.empty(args[1], device="meta").stride()),) + tuple(args[3:])
    return args, kwargs
class Dispatch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {{}})
        if func in (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
                    torch.ops.aten.new_empty_strided.default):
            args, kwargs = smaller(func, kwargs, list(args) if func is not torch.ops.aten.new_empty_strided.default
                                   else args)
        return func(*args, **kwargs)
class Function(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {{}})
        if func is torch.empty:
            args = (tuple(args[0]),) if args and isinstance(args[0], (tuple, list)) else args
            args, kwargs = smaller(func, kwargs, args)
        elif func is torch.Tensor.new_empty_strided:
            args, kwargs = smaller(func, kwargs, args)
        return func(*args, **kwargs)
x = np.arange(1 << 16, dtype=np.float64)
ro = x.copy()
ro.setflags(write=False)  # read-only: copied on the host into a buffer from torch.empty
tr = np.arange(1 << 16, dtype=np.float64).reshape(256, 256).T.copy().T  # a transposed layout, kept
tr.setflags(write=False)
pc = mtc_loader.PackedCollate(list, arena_bytes=16 << 20)
got = {{}}
for mode in (Dispatch, Function):
    for route in ("inline", "thread", "unpack"):
        batch = pc([{{"x": torch.from_numpy(x), "i": torch.arange(5)}}])
        try:
            with mode():
                if route == "unpack":
                    out = batch.unpack("cpu")[0]["x"]
                else:
                    out = mtc_loader.start_copy({{"x": tr if KIND == "strides" else ro}}, "cpu",
                                                use_background_thread=route == "thread").get()["x"]
            r = "same" if torch.equal(out, torch.from_numpy(x)) and out.stride() == torch.from_numpy(
                tr if KIND == "strides" and route != "unpack" else x).stride() else "different"
        except RuntimeError as e:
            r = str(e)
        got[mode.__name__ + " " + route] = r
got["in_use"] = pc.arena.stats()["slots_in_use"]
print(json.dumps(got))
"""


@pytest.mark.parametrize("shim", ["1", "0"])
@pytest.mark.parametrize("kind", ["dtype", "numel", "strides"])
def test_a_mode_that_hands_out_smaller_buffers_is_refused_before_anything_is_written(kind, shim):
    """A mode that makes torch.empty's float64 buffers float16 (half the bytes), or gives half
    the elements, or contiguous strides where new_empty_strided asked for others, passes the
    one-byte probe: every buffer is checked against the bytes the engine writes into it
    (dtype, dims, strides, storage), on the host copy inline and on the transfer thread, and on
    an unpack through torch.empty (MTC_TORCH_SHIM=0), with an error naming what torch gave and
    the mode; the batch is consumed. Through the shim an unpack's tensors come from torch's
    allocator, out of the mode's reach: the copy is whole."""
    got = run_child(_SMALLER.format(kind=kind), MTC_TORCH_SHIM=shim)
    assert got.pop("in_use") == 0
    for key, r in got.items():
        mode, route = key.split()
        if kind == "strides" and route == "unpack" or route == "unpack" and shim == "1":
            assert r == "same", (key, r)  # no strided buffer asked for / out of the mode's reach
            continue
        assert r.startswith("mtc_loader: torch.empty gave the engine a torch.Tensor of dtype "), (key, r)
        assert "where it asked for a torch.Tensor of dtype torch.float64" in r, (key, r)
        assert "would write past that tensor's memory or in another layout" in r and f"({mode})" in r, (key, r)
        assert "copy outside the mode" in r


_SMALLER_CUDA = """
import json, torch, mtc_loader
from torch.utils._python_dispatch import TorchDispatchMode
class Half(TorchDispatchMode):
    # float64 buffers made float16 (half the bytes) wherever the engine asks torch for them
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
                    torch.ops.aten.new_empty_strided.default) and kwargs.get("dtype") == torch.float64:
            kwargs["dtype"] = torch.float16
        return func(*args, **kwargs)
small = torch.arange(64, dtype=torch.float64)            # packed
large = torch.arange(1 << 20, dtype=torch.float64)       # staged
on_gpu = {"small": small.cuda(), "large": large.cuda()}
pc = mtc_loader.PackedCollate(list, arena_bytes=64 << 20)
calls = {
    "h2d": lambda: mtc_loader.start_copy({"small": small, "large": large}, "cuda").get(),
    "h2d_inline": lambda: mtc_loader.start_copy({"small": small, "large": large}, "cuda",
                                                use_background_thread=False).get(),
    "d2h": lambda: mtc_loader.start_copy(on_gpu, "cpu").get(),
    "d2h_unpinned": lambda: mtc_loader.start_copy(on_gpu, "cpu", use_pinned_staging=False).get(),
    "d2d": lambda: mtc_loader.start_copy(on_gpu, "cuda:1" if torch.cuda.device_count() > 1 else "cpu").get(),
}
batch = pc([{"small": small, "large": large}])
pc([{"x": small}]).unpack("cuda")  # the device's first chunk (made from Python) is behind us
calls["unpack"] = lambda: batch.unpack("cuda")
got = {}
for name, call in calls.items():
    try:
        with Half():
            out = call()
        got[name] = "no error"
    except RuntimeError as e:
        got[name] = str(e)
torch.cuda.synchronize()
got["in_use"] = pc.arena.stats()["slots_in_use"]
print(json.dumps(got))
"""


@pytest.mark.cuda
@pytest.mark.parametrize("shim", ["1", "0"])
def test_a_mode_that_hands_out_smaller_cuda_buffers_is_refused(shim):
    """The buffer check on the GPU routes: packed chunks and staged outputs of a host-to-device
    copy (transfer thread and inline), pinned and unpinned device-to-host outputs, and an unpack
    to the GPU: through torch.empty (MTC_TORCH_SHIM=0), and through the shim, whose allocation the
    dispatch mode reaches too (its chunk is checked, found short, and made again by torch.empty,
    which names the mode)."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    got = run_child(_SMALLER_CUDA, MTC_TORCH_SHIM=shim)
    assert got.pop("in_use") == 0
    assert set(got) == {"h2d", "h2d_inline", "d2h", "d2h_unpinned", "d2d", "unpack"}
    for name, r in got.items():
        assert r.startswith("mtc_loader: torch.empty gave the engine a torch.Tensor of dtype torch.float16"), (name, r)
        assert "(Half)" in r, (name, r)
