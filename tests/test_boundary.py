"""The Python/C boundary under ordinary but unkind use (issue 11): user code that mutates the
structure while the walk runs, limits (dims, depth, byte sizes, leaf counts), odd containers,
the arena's owner checks and waits, and errors that name the option or leaf.

A case that used to crash the interpreter runs in a subprocess and checks its exit status.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import pytest
import torch

import mtc_loader
from mtc_loader import PackedCollate, start_copy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(src: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs src in a fresh interpreter; a crash shows as a negative return code (the signal)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(src)], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)


def fork_quietly() -> int:
    # Python >= 3.12 warns about fork() in a multi-threaded process; these tests mean it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return os.fork()


def assert_ok(r: subprocess.CompletedProcess, stdout: str = "ok") -> None:
    assert r.returncode == 0, f"exit status {r.returncode}\n{r.stderr[-4000:]}"
    assert r.stdout.strip() == stdout, (r.stdout, r.stderr[-4000:])


# ------------------------------------------------------- 1: the walk owns the containers

# Each case drops, from user code the walk runs (through drop()), the last reference to a
# container that is open on the walk's stack (an ancestor of the object whose code runs), then
# lets the walk go on with many more children of that container.
_MUTATE_CASES = {
    "dict_subclass_keys_in_dict": """
        class Evil(dict):
            def keys(self):
                drop()
                return super().keys()
        holder = [{"a": Evil(x=torch.ones(2)), **{f"k{i}": torch.ones(1) for i in range(200)}}]
    """,
    "list_subclass_iter_in_tuple": """
        class Evil(list):
            def __iter__(self):
                drop()
                return super().__iter__()
        holder = [tuple([Evil([torch.ones(2)])] + [torch.ones(1)] * 200)]
    """,
    "list_subclass_iter_in_list": """
        class Evil(list):
            def __iter__(self):
                drop()
                return super().__iter__()
        holder = [[[Evil([torch.ones(2)])] + [torch.ones(1)] * 200]]
    """,
    "dataclass_getattribute_in_dict": """
        import dataclasses
        @dataclasses.dataclass
        class Evil:
            x: object
            def __getattribute__(self, name):
                if name == "x":
                    drop()
                return object.__getattribute__(self, name)
        holder = [{"a": [Evil(torch.ones(2))], **{f"k{i}": torch.ones(1) for i in range(200)}}]
    """,
    "tensor_subclass_property_in_dict": """
        class T(torch.Tensor):
            @property
            def shape(self):
                drop()
                return super().shape
        holder = [{"a": torch.ones(2).as_subclass(T), **{f"k{i}": torch.ones(1) for i in range(200)}}]
    """,
}

_MUTATE_PRELUDE = """
import torch
from mtc_loader import start_copy, PackedCollate
targets, junk = [], []
def drop():
    for t in targets:
        t.clear()
    # reuse the freed memory at once, so that a walk that still reads it goes wrong visibly
    junk.extend([{i: None} for i in range(64)] + [[None] * 8 for _ in range(2000)])
def tensors(x):
    if isinstance(x, torch.Tensor):
        return 1
    if isinstance(x, dict):
        return sum(tensors(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return sum(tensors(v) for v in x)
    return tensors(x.x) if hasattr(x, "x") else 0
"""

_MUTATE_RUN = {
    "start_copy": "targets.append(holder)\nout = start_copy(holder, 'cpu').get()\n",
    "pack": ("pc = PackedCollate(lambda s: s[0], arena_bytes=1 << 20)\n"
             "targets.append(holder)\nout = pc([holder]).unpack('cpu')\n"),
    # unpack walks the skeleton, which holds rebuilt copies of the same user containers (LEAF
    # placeholders for the tensors): the user code drops the skeleton's containers
    "skeleton": ("pc = PackedCollate(lambda s: s[0], arena_bytes=1 << 20)\n"
                 "b = pc([holder])\ntargets.append(b._skeleton)\nout = b.unpack('cpu')\n"),
}


@pytest.mark.parametrize("case", sorted(_MUTATE_CASES))
@pytest.mark.parametrize("path", sorted(_MUTATE_RUN))
def test_container_dropped_by_user_code_during_the_walk(case, path):
    # every case holds 201 tensors, all of which come back
    src = (_MUTATE_PRELUDE + textwrap.dedent(_MUTATE_CASES[case]) + _MUTATE_RUN[path] +
           "assert tensors(out) == 201, tensors(out)\nprint('ok')\n")
    r = run_script(src)
    # a result or a clear exception, never a crash
    assert r.returncode >= 0, f"crashed with signal {-r.returncode}\n{r.stderr[-4000:]}"
    assert_ok(r)


def test_walk_keeps_results_right_when_user_code_drops_an_ancestor():
    r = run_script("""
        import torch
        from mtc_loader import start_copy
        class Evil(dict):
            def keys(self):
                holder.clear()
                return super().keys()
        inner = {"a": Evil(x=torch.arange(3)), **{f"k{i}": torch.full((2,), i) for i in range(50)}}
        holder = [inner]
        ref = {k: v.clone() for k, v in inner.items() if k != "a"}
        del inner
        out = start_copy(holder, "cpu").get()
        assert torch.equal(out[0]["a"]["x"], torch.arange(3))
        assert list(out[0]) == ["a"] + list(ref)
        for k, v in ref.items():
            assert torch.equal(out[0][k], v)
        print("ok")
    """)
    assert_ok(r)


# ------------------------------------------------------------------ 12: the walk is linear


def _walk_time(n: int, generic: bool, deep: bool) -> float:
    """Best of 3 copies of n containers holding one tensor: nested n deep, or side by side."""
    L = type("L", (list,), {}) if generic else list
    if deep:
        d = torch.ones(1)
        for _ in range(n):
            d = L([d])
    else:
        d = L([L() for _ in range(n - 1)] + [L([torch.ones(1)])])
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        start_copy(d, "cpu").get()
        best = min(best, time.perf_counter() - t0)
    return best


@pytest.mark.parametrize("generic", [False, True], ids=["list", "list_subclass"])
def test_deep_walk_is_linear_in_depth(generic):
    # the same number of containers nested or side by side costs about the same; a cycle check
    # that scans the stack per level made 200k levels ~100x slower than 200k siblings
    n = 150_000 if generic else 200_000
    wide = _walk_time(n, generic, deep=False)
    deep = _walk_time(n, generic, deep=True)
    assert deep < 4 * max(wide, 1e-3), (wide, deep)


def test_deep_structure_round_trips_and_deep_cycle_is_found():
    d = torch.arange(4)
    for i in range(100_000):
        d = [d] if i % 2 else {"k": d}
    out = start_copy(d, "cpu").get()
    x = out
    for i in reversed(range(100_000)):
        x = x[0] if i % 2 else x["k"]
    assert torch.equal(x, torch.arange(4))
    root = cur = []
    for _ in range(50_000):
        nxt = []
        cur.append(nxt)
        cur = nxt
    cur.append(root)
    with pytest.raises(ValueError, match=r"^mtc_loader: data\[0\]\[0\].*contains itself"):
        start_copy(root, "cpu")
    # the same container twice, side by side, is not a cycle
    shared = [torch.ones(2)]
    out = start_copy([shared, shared], "cpu").get()
    assert torch.equal(out[1][0], torch.ones(2))


# ---------------------------------------------------------- 11: more than 64 dimensions


def test_tensors_of_more_than_64_dims_are_copied():
    x = torch.arange(6.0).reshape([2, 3] + [1] * 70)
    out = start_copy({"x": x}, "cpu").get()
    assert out["x"] is x  # already on the CPU: reused as is
    # a strided (permuted) 70-dim tensor and a 101-dim one through the arena: strided copy
    # into the region, layout with > 64 dims, views on the way out
    y = torch.arange(2 ** 10, dtype=torch.float32).reshape([2] * 10 + [1] * 60)
    y = y.permute(*range(69, -1, -1))
    assert not y.is_contiguous()
    z = torch.arange(5, dtype=torch.int16).reshape([5] + [1] * 100)
    pc = PackedCollate(list, arena_bytes=1 << 20)
    out = pc([y, z]).unpack("cpu")
    assert out[0].shape == y.shape and torch.equal(out[0], y)
    assert out[1].shape == z.shape and torch.equal(out[1], z)
    assert pc.stats()["slots_in_use"] == 0


def test_too_many_dims_names_the_leaf_and_the_limit():
    x = torch.zeros([1] * 1025)
    with pytest.raises(ValueError, match=r"^mtc_loader: data\['a'\]\[0\] has 1025 dimensions; "
                                         r"mtc_loader copies tensors of at most 1024"):
        start_copy({"a": [x]}, "cpu")
    pc = PackedCollate(list, arena_bytes=1 << 20)
    with pytest.raises(ValueError, match=r"data\[1\] has 1025 dimensions"):
        pc([torch.ones(2), x])
    assert pc.stats()["slots_in_use"] == 0
    out = start_copy([torch.zeros([1] * 1024)], "cpu").get()  # the limit itself is fine
    assert out[0].dim() == 1024


# ----------------------------------------------------------------- 13: struct sequences


def test_struct_sequences_keep_their_hidden_fields():
    import time as _time
    s = os.stat(ROOT)
    t = _time.localtime()
    m = torch.max(torch.arange(6.0).reshape(2, 3), 0)
    data = {"s": s, "t": t, "m": m, "v": sys.version_info, "f": sys.flags}
    for out in (start_copy(data, "cpu").get(),
                PackedCollate(lambda b: b[0], arena_bytes=1 << 20)([data]).unpack("cpu")):
        assert type(out["s"]) is os.stat_result and out["s"] == s
        assert isinstance(out["s"].st_mtime, float) and out["s"].st_mtime == s.st_mtime
        assert out["s"].st_mtime_ns == s.st_mtime_ns and out["s"].st_blksize == s.st_blksize
        assert out["t"] == t and out["t"].tm_zone == t.tm_zone and out["t"].tm_gmtoff == t.tm_gmtoff
        assert type(out["m"]) is type(m)
        assert torch.equal(out["m"].values, m.values) and torch.equal(out["m"].indices, m.indices)
        # struct sequences that cannot be instantiated come back as the same object
        assert out["v"] is sys.version_info and out["f"] is sys.flags


def test_struct_sequence_leaf_paths():
    m = torch.max(torch.arange(6.0).reshape(2, 3), 0)
    bad = torch.return_types.max((m.values, torch.ones(2).to_sparse()))
    with pytest.raises(TypeError, match=r"^mtc_loader: data\['m'\]\[1\] is a sparse tensor"):
        start_copy({"m": bad}, "cpu")


# ------------------------------------------------- docs: zombie workers are reclaimed


def _proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_zombie_worker_regions_are_reclaimed():
    # docs/trust_model.md: a worker that exited is reclaimed even before it is reaped
    pc = PackedCollate(list, arena_bytes=1 << 20)
    r, w = os.pipe()
    pid = fork_quietly()
    if pid == 0:
        try:
            b = pc([torch.ones(1000)])
            b._state = "sent"  # as if sent: the child's __del__ must not free it
            os.write(w, b"x")
        finally:
            os._exit(0)
    os.close(w)
    try:
        assert os.read(r, 1) == b"x"
        deadline = time.monotonic() + 20
        while _proc_state(pid) != "Z":
            assert time.monotonic() < deadline, "the child did not exit"
            time.sleep(0.01)
        assert pc.stats()["slots_in_use"] == 1
        assert pc.arena.reclaim_dead() == 1  # still a zombie here
        assert _proc_state(pid) == "Z"
        assert pc.stats()["slots_in_use"] == 0
    finally:
        os.close(r)
        if _proc_state(pid) != "Z":
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


# ----------------------------------------- sweep: diagnosis state is per walk, not global


def test_resolved_leaf_on_another_thread_during_a_resolve():
    # A lazily conjugated leaf is diagnosed, and the resolved replacement read again: a tensor
    # subclass's property runs there, and another thread's walk diagnoses its own conjugated
    # leaf meanwhile. It used to see the first walk's "reading a replacement" flag (a global)
    # and fail with "a leaf failed the engine's checks".
    import threading
    res = {}

    class S(torch.Tensor):
        @property
        def shape(self):
            if not self.is_conj() and "other" not in res:
                def other():
                    try:
                        res["other"] = start_copy([torch.tensor([1 + 2j]).conj()], "cpu").get()[0]
                    except Exception as e:  # noqa: BLE001 - reported below
                        res["other"] = e
                t = threading.Thread(target=other)
                t.start()
                t.join()
            return super().shape

    z = torch.tensor([3 + 4j]).conj().as_subclass(S)
    out = start_copy([z], "cpu").get()[0]
    assert not isinstance(res["other"], Exception), res["other"]
    assert torch.equal(res["other"], torch.tensor([1 - 2j])) and not res["other"].is_conj()
    assert torch.equal(out.as_subclass(torch.Tensor), torch.tensor([3 - 4j]))


# ------------------------------------------------------ 2: get() from several threads at once


def test_get_from_many_threads_at_once():
    r = run_script("""
        import threading, numpy as np, torch
        from mtc_loader import start_copy
        # read-only numpy leaves are host-copied for "cpu": a job that takes a while, so that
        # the threads are all waiting in get() when it completes
        arrs = [np.arange(4 << 20, dtype=np.float32) + i for i in range(4)]
        for a in arrs:
            a.setflags(write=False)
        for rnd in range(60):
            h = start_copy(arrs, "cpu")
            out, errs = [], []
            go = threading.Barrier(16)
            def waiter():
                go.wait()
                try:
                    out.append(h.get())
                except BaseException as e:
                    errs.append(e)
            ts = [threading.Thread(target=waiter) for _ in range(16)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            assert not errs, errs
            assert len(out) == 16 and all(o is out[0] for o in out)
            if rnd == 0:
                assert all(np.array_equal(o.numpy(), a) for o, a in zip(out[0], arrs))
        print("ok")
    """, timeout=300)
    assert r.returncode >= 0, f"crashed with signal {-r.returncode}\n{r.stderr[-4000:]}"
    assert_ok(r)


# --------------------------------------------------- 6: fork while a copy is in flight


def test_fork_with_a_copy_in_flight_child_gets_a_clear_error_and_exits():
    r = run_script("""
        import os, sys, time, warnings, numpy as np, torch
        import mtc_loader
        from mtc_loader import start_copy
        arrs = [np.arange(16 << 20, dtype=np.float32) + i for i in range(4)]
        for a in arrs:
            a.setflags(write=False)  # host-copied for "cpu": a job on the transfer thread
        for attempt in range(20):
            h = start_copy(arrs, "cpu")
            if not h.ready():
                break
            h.get()
        else:
            raise SystemExit("the copy was never still in flight at fork")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            code = 1
            try:
                assert h.ready()  # get() would not block: it raises at once
                try:
                    h.get()
                except RuntimeError as e:
                    assert str(e).startswith("mtc_loader: this copy was started before the process "
                                             "was forked"), e
                else:
                    raise AssertionError("get() of an orphaned copy returned")
                try:
                    h.get()  # the same error every time
                except RuntimeError as e:
                    assert "before the process was forked" in str(e)
                # the package works in the child, and a new copy to "cpu" completes
                out = start_copy(arrs[:1], "cpu").get()
                assert np.array_equal(out[0].numpy(), arrs[0])
                code = 0
            finally:
                sys.stdout.flush()
                # a normal exit: atexit (engine shutdown) and the handle's dealloc must not hang
                sys.exit(code)
        out = h.get()
        assert all(np.array_equal(o.numpy(), a) for o, a in zip(out, arrs))
        deadline = time.monotonic() + 60
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                raise SystemExit("the child hung")
            time.sleep(0.01)
        assert os.waitstatus_to_exitcode(status) == 0, os.waitstatus_to_exitcode(status)
        print("ok")
    """, timeout=180)
    assert_ok(r)


def test_fork_with_a_copy_in_flight_child_drops_the_handle_and_exits():
    # the inherited handle is never used: dropping it (at exit) must not wait for the job
    r = run_script("""
        import os, sys, time, warnings, numpy as np
        from mtc_loader import start_copy
        arrs = [np.arange(16 << 20, dtype=np.float32) + i for i in range(4)]
        for a in arrs:
            a.setflags(write=False)
        for attempt in range(20):
            h = start_copy(arrs, "cpu")
            if not h.ready():
                break
            h.get()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            del h
            sys.exit(0)
        h.get()
        deadline = time.monotonic() + 60
        while not os.waitpid(pid, os.WNOHANG)[0]:
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                raise SystemExit("the child hung dropping the inherited handle")
            time.sleep(0.01)
        print("ok")
    """, timeout=180)
    assert_ok(r)
