"""The maintainers' scripts stay small: tools/ holds at most 3,000 lines of code and bench/ at
most 5,500 (.py, .sh and .c files, counted as ``wc -l`` counts them)."""
from __future__ import annotations

import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
BUDGETS = {"tools": 3000, "bench": 5500}


def lines_of_code(folder: pathlib.Path) -> int:
    return sum(p.read_bytes().count(b"\n") for p in folder.rglob("*")
               if p.suffix in (".py", ".sh", ".c") and p.is_file())


@pytest.mark.parametrize("folder", sorted(BUDGETS))
def test_the_folder_keeps_its_line_budget(folder):
    n = lines_of_code(ROOT / folder)
    assert 0 < n <= BUDGETS[folder], f"{folder}/ holds {n} lines of code, over its budget of {BUDGETS[folder]}"
