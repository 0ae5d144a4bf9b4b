"""The recipes run as written: every ```python block of docs/lightning.md and docs/accelerate.md
runs in a fresh interpreter after a plain ``import mtc_loader`` (so a recipe that needs an
import it does not show fails here, as it would for a reader) and the few names the page leaves
to the reader (``dataset``, ``my_collate``, ``model``, ...), defined below on the CPU; every
block of docs/getting_started.md runs on its own, as a reader's first script would.

The one change made to a block: ``accelerator="gpu"`` becomes ``"cpu"`` on a machine without a
GPU. A block preceded by ``<!-- recipe-test: skip REASON -->`` is not run (it needs state a
reader's earlier run made, such as a checkpoint)."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest
import torch

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"

# What a reader has before the recipe: a dataset of dict samples, a collate function, a model
# (a LightningModule for Lightning; a module that returns its loss for accelerate) and its
# optimizer, and a packed DataLoader (blocks that show only the change use it).
_COMMON = """
import torch
import mtc_loader
from torch.utils.data import DataLoader, default_collate

dataset = [{"x": torch.full((3,), float(i)), "ids": [torch.arange(2) + i]} for i in range(8)]
my_collate = default_collate
loader = DataLoader(dataset, batch_size=4, num_workers=2,
                    collate_fn=mtc_loader.PackedCollate(my_collate, arena_bytes=1 << 20))
"""

PRELUDES = {
    "getting_started.md": "",
    "lightning.md": _COMMON + """
import lightning as L

class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))
        self.seen = 0

    def training_step(self, batch, batch_idx):
        assert isinstance(batch, dict) and batch["x"].shape == (len(batch["x"]), 3), batch
        self.seen += 1
        return (self.w * batch["x"]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

model = Model()
""",
    "accelerate.md": _COMMON + """
from accelerate import Accelerator

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))

    def forward(self, batch):
        assert isinstance(batch, dict) and batch["x"].shape == (len(batch["x"]), 3), batch
        return (self.w * batch["x"]).sum()

model = Model()
optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
accelerator = Accelerator(cpu=not torch.cuda.is_available())
""",
}


def _blocks(page: str) -> list[tuple[int, str]]:
    """(line, code) of each ```python block of the page that is not marked to be skipped."""
    text = (DOCS / page).read_text()
    out = []
    for m in re.finditer(r"^```python\n(.*?)^```", text, re.M | re.S):
        before = text[:m.start()].rstrip().splitlines()
        if before and before[-1].startswith("<!-- recipe-test: skip"):
            continue
        out.append((text[:m.start()].count("\n") + 1, m.group(1)))
    return out


CASES = [pytest.param(page, line, code, id=f"{page}:{line}") for page in PRELUDES for line, code in _blocks(page)]


def test_every_recipe_page_has_blocks():
    for page in PRELUDES:
        assert len(_blocks(page)) >= 2, page


@pytest.mark.parametrize("page,line,code", CASES)
def test_recipe_block_runs(page, line, code, tmp_path):
    framework = {"lightning.md": "lightning", "accelerate.md": "accelerate"}.get(page)
    if framework:
        pytest.importorskip(framework)
    if not torch.cuda.is_available():
        code = code.replace('accelerator="gpu"', 'accelerator="cpu"')
    script = tmp_path / "recipe.py"
    script.write_text(PRELUDES[page] + f"\n# ---- docs/{page}, the block at line {line}\n" + code
                      + "\nprint('recipe ran')\n")
    env = dict(os.environ, PYTHONWARNINGS="ignore")  # Lightning's advice on workers and logging
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0 and "recipe ran" in r.stdout, (
        f"docs/{page}: the block at line {line} failed:\n{textwrap.indent(code, '    ')}\n"
        f"--- stdout\n{r.stdout[-4000:]}\n--- stderr\n{r.stderr[-8000:]}")
