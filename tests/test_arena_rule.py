"""The arena's size is given by one rule on every page that sizes it (README, the docs pages, the
docstrings the reference shows): ``num_workers * prefetch_factor + 1`` batches, plus ``depth`` on
a GPU; and no page writes another formula for it."""
from __future__ import annotations

import glob
import os
import re

import pytest

from conftest import ROOT

RULE = "num_workers * prefetch_factor + 1"
# every formula of prefetch_factor a page may write: the rule, its DataLoader part, and the least
# the DataLoader needs to go on
FORMULAS = {RULE, "num_workers * prefetch_factor", "(num_workers - 1) * prefetch_factor + 1", "prefetch_factor"}
# the pages and sources that size the arena, each of which must give the rule
SIZING = ["docs/dataloader.md", "docs/getting_started.md", "docs/mmengine.md", "mtc_loader/_flight.py",
          "mtc_loader/mmengine/_preprocessor.py", "mtc_loader/mmengine/__main__.py"]


def _pages() -> list[str]:
    paths = ["README.md"] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    paths += ["mtc_loader/collate.py", "mtc_loader/_arena.py", "mtc_loader/_packed.py", "mtc_loader/_flight.py",
              "mtc_loader/mmengine/_preprocessor.py"]
    return [os.path.relpath(os.path.join(ROOT, p), ROOT) for p in paths]


def _text(rel: str) -> str:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        text = f.read()
    if rel.endswith(".py"):  # docstrings and help strings: their lines joined as the reader sees them
        text = re.sub(r'"\s*\n\s*"', "", text)
        text = re.sub(r"\s*\n\s*", " ", text)
    return " ".join(text.split())


@pytest.mark.parametrize("rel", _pages())
def test_every_formula_for_the_arena_is_the_rule_or_one_of_its_parts(rel):
    text = _text(rel)
    for formula in re.findall(r"`+([^`\"]{0,40}prefetch_factor[^`\"]{0,20})`+", text):
        assert formula.strip() in FORMULAS, f"{rel}: `{formula}` (the rule: `{RULE}`, plus `depth` on a GPU)"
    assert not re.search(r"prefetch_factor \+ (prefetch_)?depth \+ 2", text), rel


@pytest.mark.parametrize("rel", SIZING)
def test_the_rule_on_every_page_that_sizes_the_arena(rel):
    text = _text(rel)
    found = [m.end() for m in re.finditer(re.escape(RULE), text)]
    assert found, f"{rel} sizes the arena without the rule `{RULE}`"
    assert any(re.match(r"[`]*\)?( batches)?,? \(?(plus|\+) [`]*depth[`]*( for a CUDA device| on a GPU)",
                        text[end:end + 60]) for end in found), (rel, [text[e:e + 60] for e in found])
