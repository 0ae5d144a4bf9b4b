"""tools/diagnostics/epoch_cpu.py: each epoch of a loader method against ideal's training CPU
time per step, on bench_train results of known figures."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load():
    path = os.path.join(_ROOT, "tools", "diagnostics", "epoch_cpu.py")
    spec = importlib.util.spec_from_file_location("mtc_epoch_cpu", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _epoch(step, cpu, n=5):
    return {"step_ms": [step] * n, "step_cpu_ms": [cpu] * n}


def _write(d, packed_epochs):
    os.makedirs(d)
    res = {"launch4": {"ideal": {"epochs": [_epoch(8.0, 6.5), _epoch(8.0, 6.5)]},
                       "packed": {"epochs": packed_epochs}}}
    with open(os.path.join(d, "bench_train.json"), "w") as f:
        json.dump({"results": res}, f)


def test_epochs_are_split_by_the_training_threads_cpu_against_ideal():
    mod = _load()
    methods = {"ideal": {"epochs": [_epoch(8.0, 6.4), _epoch(8.0, 6.6)]},
               "packed": {"epochs": [_epoch(8.0, 6.6), _epoch(10.0, 8.5), _epoch(7.6, 6.0)]}}
    eps = mod.split(methods, margin_ms=0.2)["packed"]
    assert [g for g, *_ in eps] == ["as fast", "slower", "as fast"]  # in epoch order
    assert eps[1][1] == pytest.approx(80.0) and eps[1][2] == pytest.approx(2.0) and eps[1][3] == pytest.approx(2.0)
    assert eps[2][1] == pytest.approx(100 * 8.0 / 7.6) and eps[2][2] == pytest.approx(-0.5)
    assert mod.split({"packed": methods["packed"]}, 0.2) == {}  # no ideal: nothing to compare with
    no_cpu = {"ideal": {"epochs": [{"step_ms": [8.0]}]}, "packed": methods["packed"]}
    assert mod.split(no_cpu, 0.2) == {}  # results of a bench_train that did not time the CPU


def test_the_arms_of_ab_pairs_are_pooled_per_build(tmp_path, capsys):
    mod = _load()
    _write(str(tmp_path / "new1" / "train"), [_epoch(8.0, 6.5), _epoch(10.0, 8.5)])
    _write(str(tmp_path / "old1" / "train"), [_epoch(10.0, 8.5), _epoch(16.0, 14.5)])
    assert mod.arm(os.path.join("new12", "train")) == "new" and mod.arm("results") == "-"
    assert mod.main([str(tmp_path), "--config", "launch4"]) == 0
    out = capsys.readouterr().out
    rows = {tuple(line.split()[:4]): line.split() for line in out.splitlines() if line.startswith("launch4 ")}
    assert rows[("launch4", "packed", "new", "as")][5] == "1" and rows[("launch4", "packed", "new", "as")][6] == "100.0"
    assert rows[("launch4", "packed", "old", "slower")][4] == "2"
    assert rows[("launch4", "packed", "old", "slower")][5] == "65.0"  # median of 80% and 50%
    assert "old1/train" in out and "50.0% +8.00*" in out


def test_no_results_is_an_error(tmp_path):
    with pytest.raises(SystemExit, match="no bench_train.json"):
        _load().main([str(tmp_path)])
