"""Where a benchmark's figures come from: the commit, the machine and the command, for its JSON.

Every bench script stores ``provenance(argv)`` under ``"provenance"`` in the JSON it writes, and
``tools/release/render_results.py`` prints it under each table of docs/benchmarks.md.

The commit is ``git rev-parse --short HEAD`` of this tree (``+dirty`` when tracked files differ
from it), or ``$MTC_BENCH_COMMIT`` where the tree has no git history (the GPU machine receives a
copy of the working tree: ``MTC_BENCH_COMMIT=$(git rev-parse --short HEAD)`` is set where the
run is started).
"""
from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import time
from typing import Any, Optional

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git(*args: str) -> Optional[str]:
    try:
        r = subprocess.run(["git", "-C", _ROOT, *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def commit() -> str:
    """The commit the measured tree is at, or "unknown"."""
    env = os.environ.get("MTC_BENCH_COMMIT")
    if env:
        return env
    head = _git("rev-parse", "--short", "HEAD")
    if head is None:
        return "unknown"
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return head + ("+dirty" if dirty else "")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine() -> str:
    """One line: GPU, CPUs, torch and Python versions."""
    import torch
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    gpu = f"{len(gpus)} x {gpus[0]}" if len(gpus) > 1 else gpus[0] if gpus else "no GPU"
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"{gpu}, {cpus} CPUs ({_cpu_model()}), torch {torch.__version__}, "
            f"Python {platform.python_version()}")


def provenance(argv: Optional[list[str]] = None) -> dict[str, Any]:
    """{"commit", "machine", "command", "time"} for the running benchmark (argv: its arguments,
    default sys.argv[1:])."""
    script = os.path.relpath(os.path.abspath(sys.argv[0]), _ROOT) if sys.argv and sys.argv[0] else "?"
    args = sys.argv[1:] if argv is None else list(argv)
    return {
        "commit": commit(),
        "machine": machine(),
        "command": shlex.join(["python3", script, *args]),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
