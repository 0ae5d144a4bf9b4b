"""What the docs show a user writing type-checks under ``mypy --strict`` against the package's
hints (py.typed, mtc_loader/_engine.pyi): start_copy of any structure (a dataclass instance, a
namedtuple, a plain object, as the docs say it accepts), the DataLoader path, the engine's calls.
Skips where mypy is not installed (the test extra has it)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import package_parent

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="needs mypy (the test extra)")

USER_CODE = '''
from __future__ import annotations

import collections
import dataclasses
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import mtc_loader


@dataclasses.dataclass
class Frame:
    boxes: torch.Tensor
    names: np.ndarray[Any, Any]
    token: str


Pair = collections.namedtuple("Pair", "image depth")


class Opaque:
    pass


frame = Frame(torch.zeros(2, 4), np.array(["car", "bus"]), "t0")
out: Any = mtc_loader.start_copy(frame, "cpu").get()
mtc_loader.start_copy(Pair(torch.ones(3), torch.ones(1)), torch.device("cpu"), use_background_thread=False).get()
mtc_loader.start_copy([frame, {"k": (frame, 1.5)}], "cpu").get()
mtc_loader.start_copy(Opaque(), "cpu").get()
mtc_loader.start_copy("a string", "cpu").get()
mtc_loader.start_copy(np.ones(3), "cpu").get()
ready: bool = mtc_loader.start_copy(torch.ones(2), "cpu").ready()
side = mtc_loader.start_side_copy(frame, "cpu")


class Samples(Dataset[dict[str, torch.Tensor]]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"boxes": torch.zeros(i + 1, 4), "labels": torch.zeros(i + 1, dtype=torch.long)}


loader = DataLoader(Samples(), batch_size=2, collate_fn=mtc_loader.PackedCollate(list, arena_bytes=8 << 20))
for batch in mtc_loader.PrefetchLoader(loader, device="cpu", depth=2):
    boxes: torch.Tensor = batch[0]["boxes"]
waits: dict[str, Any] = mtc_loader.PrefetchLoader(loader, "cpu").stats()
packed = mtc_loader.PackedCollate()([{"x": torch.ones(2)}])
on_cpu: Any = packed.to("cpu")
arena = mtc_loader.Arena(1 << 20)
counters: dict[str, int] = mtc_loader.stats()
'''


def _mypy(tmp_path, code: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "user_code.py").write_text(textwrap.dedent(code))
    # the package under test: the source tree (mypy searches the working directory), or the
    # installed wheel (found in site-packages); the source tree keeps its cache beside it
    installed = bool(os.environ.get("MTC_TEST_INSTALLED"))
    cwd = str(tmp_path) if installed else package_parent()
    cache = str(tmp_path / "cache") if installed else os.path.join(ROOT, ".mypy_cache")
    return subprocess.run([sys.executable, "-m", "mypy", "--strict", "--no-error-summary", "--cache-dir", cache,
                           str(tmp_path / "user_code.py")],
                          cwd=cwd, capture_output=True, text=True, timeout=600)


def test_the_documented_calls_type_check_strict(tmp_path):
    r = _mypy(tmp_path, USER_CODE + '''
wrong = mtc_loader.start_copy(frame, 3.5)  # a float is no device
mtc_loader.PrefetchLoader(loader, "cpu", depth="2")  # nor a str a depth
''')
    errors = [ln for ln in r.stdout.splitlines() if ": error:" in ln]
    # the two wrong calls are caught (so mypy read the package's hints), and nothing else
    assert len(errors) == 2, r.stdout + r.stderr
    assert 'Argument 2 to "start_copy" has incompatible type "float"' in errors[0], errors
    assert '"depth"' in errors[1] or 'Argument "depth"' in errors[1], errors
