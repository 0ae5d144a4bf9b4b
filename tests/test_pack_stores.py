"""tools/diagnostics/pack_stores.py times a worker's collate and pack with the arena written by
streaming stores and by memcpy, alternated in one process: a small run prints both settings'
figures and leaves MTC_PACK_NT as it found it."""
from __future__ import annotations

import importlib.util
import os
import re

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load():
    spec = importlib.util.spec_from_file_location(
        "mtc_pack_stores", os.path.join(_ROOT, "tools", "diagnostics", "pack_stores.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("before", [None, "0"])
def test_pack_stores_times_both_settings_and_restores_the_variable(capsys, monkeypatch, before):
    if before is None:
        monkeypatch.delenv("MTC_PACK_NT", raising=False)
    else:
        monkeypatch.setenv("MTC_PACK_NT", before)
    assert _load().main(["--rounds", "2", "--per-round", "2", "--height", "16", "--width", "24"]) == 0
    out = capsys.readouterr().out
    for label in ("streaming stores (MTC_PACK_NT=1)", "memcpy (MTC_PACK_NT=0)"):
        m = re.search(re.escape(label) + r"\s+median (\S+)\s+min (\S+)\s+max (\S+)", out)
        assert m, out
        med, lo, hi = map(float, m.groups())
        assert 0 < lo <= med <= hi
    assert "ratio of medians" in out
    assert os.environ.get("MTC_PACK_NT") == before


def test_pack_stores_refuses_zero_rounds():
    with pytest.raises(SystemExit):
        _load().main(["--rounds", "0"])
