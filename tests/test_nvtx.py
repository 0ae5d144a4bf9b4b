"""NVTX ranges around the engine's stages, seen by a real NVTX tool: tests/nvtx_tool.c, loaded
by NVTX through NVTX_INJECTION64_PATH as Nsight Systems is, logs every push and pop. A run with
the tool sees pack (in the DataLoader worker), unpack, start_copy, traverse, views, the transfer
thread's job and copy ops, and the prefetch service's ranges, balanced per thread; a run
without it initialises nothing."""
from __future__ import annotations

import collections
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest

from mtc_loader import _engine

HERE = pathlib.Path(__file__).resolve().parent

SCRIPT = textwrap.dedent("""
    import numpy as np, torch, mtc_loader
    from torch.utils.data import DataLoader
    from mtc_loader import _engine
    assert _engine.nvtx_info() == {"compiled": True, "enabled": %(enabled)r}, _engine.nvtx_info()
    ro = np.arange(64.0); ro.setflags(write=False)   # copied by the transfer thread, not wrapped
    out = mtc_loader.start_copy([torch.ones(3), ro], "cpu").get()
    assert out[1].tolist() == ro.tolist()
    ds = [{"x": torch.full((3,), float(i))} for i in range(6)]
    loader = DataLoader(ds, batch_size=2, num_workers=1, collate_fn=mtc_loader.PackedCollate(arena_bytes=1 << 20))
    seen = [b["x"][:, 0].tolist() for b in mtc_loader.PrefetchLoader(loader, "cpu")]
    assert seen == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]], seen
""")


def nvtx_headers():
    try:
        spec = importlib.util.find_spec("nvidia.nvtx")
    except ImportError:
        spec = None
    dirs = [os.environ.get("MTC_NVTX_INCLUDE", "")]  # as setup.py
    dirs += [os.path.join(d, "include") for d in (spec.submodule_search_locations if spec else [])]
    dirs.append(os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "include"))
    dirs.append(str(HERE.parent / "csrc" / "third_party"))  # the copy the build uses by default
    return next((d for d in dirs if d and os.path.exists(os.path.join(d, "nvtx3", "nvToolsExt.h"))), None)


@pytest.fixture(scope="module")
def tool(tmp_path_factory):
    if not _engine.nvtx_info()["compiled"]:
        pytest.skip("the engine was built without the nvtx3 headers")
    include = nvtx_headers()
    cc = shutil.which("cc") or shutil.which("gcc")
    if include is None or cc is None:
        pytest.skip("no nvtx3 headers or C compiler to build the test tool")
    so = tmp_path_factory.mktemp("nvtx") / "nvtx_tool.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-I", include, str(HERE / "nvtx_tool.c"), "-o", str(so),
                    "-lpthread"], check=True)
    return so


def run(tmp_path, tool=None) -> list:
    log = tmp_path / "nvtx.log"
    env = dict(os.environ, MTC_NVTX_LOG=str(log))
    env.pop("NVTX_INJECTION64_PATH", None)
    if tool is not None:
        env["NVTX_INJECTION64_PATH"] = str(tool)
    script = SCRIPT % {"enabled": tool is not None}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=120)
    return [line.split(" ", 4) for line in log.read_text().splitlines()] if log.exists() else []


def test_ranges_seen_by_a_tool(tmp_path, tool):
    events = run(tmp_path, tool)
    assert any(e[2] == "init" for e in events)
    main = int(next(e[0] for e in events if e[2] == "init"))
    pushes = collections.Counter((int(e[0]) == main, e[4]) for e in events if e[2] == "push")
    assert all(e[3] == "mtc_loader" for e in events if e[2] in ("push", "pop"))
    # the worker packs; the main process unpacks, copies and hands out
    assert pushes[(False, "pack")] == 3, pushes
    assert pushes[(True, "unpack")] == 3, pushes
    assert pushes[(True, "start_copy")] == 1 and pushes[(True, "traverse")] == 1, pushes
    assert pushes[(True, "views and rebuild")] == 1, pushes
    assert pushes[(True, "transfer job")] >= 1 and pushes[(True, "copy op")] >= 1, pushes
    assert pushes[(True, "mtc_loader.prefetch.copy_batch")] == 3, pushes
    assert pushes[(True, "mtc_loader.prefetch.next")] == 4, pushes  # 3 batches and the end
    # every thread pops what it pushed, innermost first
    depth = collections.Counter()
    for pid, tid, what, *_ in events:
        if what in ("push", "pop"):
            depth[(pid, tid)] += 1 if what == "push" else -1
            assert depth[(pid, tid)] >= 0, "a pop without its push"
    assert all(d == 0 for d in depth.values()), depth


def test_nothing_without_a_tool(tmp_path):
    if not _engine.nvtx_info()["compiled"]:
        pytest.skip("the engine was built without the nvtx3 headers")
    assert run(tmp_path) == []


FILES_SCRIPT = textwrap.dedent("""
    import sys, numpy as np, torch, mtc_loader
    np.arange(100, dtype=np.float32).tofile(sys.argv[1])
    ft = mtc_loader.FileTensor(sys.argv[1], torch.float32)
    out = mtc_loader.PackedCollate(list, arena_bytes=1 << 20)([ft, ft]).unpack()
    assert torch.equal(out[1], torch.arange(100, dtype=torch.float32))
    assert torch.equal(ft.load(), torch.arange(100, dtype=torch.float32))
""")


def test_file_reads_range(tmp_path, tool):
    """FileTensor reads show as a "file reads" range inside pack and inside a copy op."""
    log = tmp_path / "nvtx.log"
    env = dict(os.environ, MTC_NVTX_LOG=str(log), NVTX_INJECTION64_PATH=str(tool))
    subprocess.run([sys.executable, "-c", FILES_SCRIPT, str(tmp_path / "f.bin")], env=env, check=True,
                   timeout=120)
    events = [line.split(" ", 4) for line in log.read_text().splitlines()]
    stack: dict = collections.defaultdict(list)
    inside = collections.Counter()
    for pid, tid, what, *rest in events:
        if what == "push":
            if rest[1] == "file reads":
                inside[stack[(pid, tid)][-1] if stack[(pid, tid)] else None] += 1
            stack[(pid, tid)].append(rest[1])
        elif what == "pop":
            stack[(pid, tid)].pop()
    assert inside == {"copy op": 2}, inside  # the pack's host-copy op, and load()'s
    assert all(not s for s in stack.values()), stack
