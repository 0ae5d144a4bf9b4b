"""tools/release/render_results.py: docs/benchmarks.md is what its committed JSON renders to, and the
renderer reads what the benchmarks write (bench_copy.py's CPU mode, run here)."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools" / "release"))

import render_results  # noqa: E402


def test_page_is_rendered_from_the_committed_results():
    assert render_results.main(["--check"]) == 0, (
        "docs/benchmarks.md differs from its tables rendered from bench/results/release: run "
        "python3 tools/release/render_results.py")


def _page(tmp_path: pathlib.Path) -> pathlib.Path:
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "benchmarks.md"
    shutil.copyfile(ROOT / "docs" / "benchmarks.md", page)
    return page


def test_placeholders_without_results(tmp_path):
    page = _page(tmp_path)
    assert render_results.main(["--results", str(tmp_path / "none"), "--page", str(page)]) == 0
    text = page.read_text()
    for name in render_results.SECTIONS:
        json_name = "bench_openmmlab_train_*.json" if name == "models" else f"bench_{name}.json"
        assert f"No `{json_name}` in `bench/results/release/`" in text, name
    assert "**The machine:** no release run yet." in text


def test_renders_what_bench_copy_writes(tmp_path):
    results = tmp_path / "release"
    env = dict(os.environ, MTC_BENCH_COMMIT="abc1234")  # mtc_loader: the one this run tests
    for n in (1, 2):
        r = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_copy.py"), "--device", "cpu", "--quick",
                            "--only", "seed4_np", "--out", str(results / "copy" / str(n))],
                           capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((results / "copy" / "1" / "bench_copy.json").read_text())
    assert report["provenance"]["commit"] == "abc1234"
    assert report["provenance"]["command"].startswith("python3 bench/bench_copy.py --device cpu")
    page = _page(tmp_path)
    assert render_results.main(["--results", str(results), "--page", str(page)]) == 0
    text = page.read_text()
    copy = text.split("<!-- BEGIN render:copy -->")[1].split("<!-- END render:copy -->")[0]
    assert "| seed4_np (np2cpu) | 132, 35 KB |" in copy
    assert "2 processes of `python3 bench/bench_copy.py --device cpu --quick" in copy
    assert "abc1234" not in copy  # the commit stays in the JSON: the page cites none
    machine = text.split("<!-- BEGIN render:machine -->")[1].split("<!-- END render:machine -->")[0]
    named = json.loads((results / "copy" / "1" / "bench_copy.json").read_text())["provenance"]["machine"]
    assert machine.strip() == f"**The machine:** {named}.", machine
    assert named not in copy  # named once, at the top
    assert "--out" not in copy
    assert "Not measured" not in copy and "Not measured" in text  # the other three stay placeholders


def _model_report(model: str, ratios: list[float], commit: str = "abc1234") -> dict:
    """What bench/bench_openmmlab_train.py writes, in the fields the renderer reads."""
    sys.path.insert(0, str(ROOT / "bench"))
    from openmmlab_train import paired
    plain = dict(it_per_s_mean=6.4, step_ms=156.9, data_time_ms=16.8, cpu_pre_ms=17.6, gpu_model_ms=120.0)
    switched = dict(it_per_s_mean=7.5, step_ms=133.5, data_time_ms=2.1, cpu_pre_ms=9.0, gpu_model_ms=120.9)
    return dict(benchmark="bench_openmmlab_train", model=model, batch_size=8, workers=4, iters=19,
                pairs=len(ratios), paired=paired.summarise_pairs(ratios),
                medians=dict(plain=plain, switched=switched), law=dict(predicted_ratio=1.174),
                versions=dict(mmengine="0.10.7", mmcv="2.1.0", mmdet="3.3.0"),
                provenance=dict(commit=commit, machine="a GPU, 16 CPUs", time="2026-12-07T00:00:00Z",
                                command="python3 bench/bench_openmmlab_train.py --model yolov3 --out x"))


def test_renders_the_real_models_paired_table(tmp_path):
    results = tmp_path / "release"
    (results / "models" / "yolov3").mkdir(parents=True)
    (results / "models" / "yolov3" / "bench_openmmlab_train_yolov3.json").write_text(
        json.dumps(_model_report("yolov3", [1.11, 1.15, 1.2, 1.13, 1.66, 1.14])))
    page = _page(tmp_path)
    assert render_results.main(["--results", str(results), "--page", str(page)]) == 0
    text = page.read_text()
    models = text.split("<!-- BEGIN render:models -->")[1].split("<!-- END render:models -->")[0]
    assert "| YOLOv3, mmdet (8, 4; 19) | **1.145x** (1.110–1.660) | 6 of 6, p=0.031 | 1.174x |" in models, models
    assert "| YOLOv3, mmdet | 156.9 -> 133.5 ms | 16.8 -> 2.1 ms | 17.6 -> 9.0 ms | 120.0 -> 120.9 ms |" in models
    assert "6 pairs of arms" in models and "--out" not in models
    assert "**The machine:** a GPU, 16 CPUs." in text
    # a models run of another build than the tables' is refused: the page shows one release run
    (results / "models" / "yolov3" / "bench_openmmlab_train_yolov3.json").write_text(
        json.dumps(_model_report("yolov3", [1.1, 1.2], commit="def5678")))
    (results / "copy").mkdir()
    (results / "copy" / "bench_copy.json").write_text(json.dumps(dict(provenance=dict(commit="abc1234"))))
    with pytest.raises(SystemExit, match="several commits"):
        render_results.main(["--results", str(results), "--page", str(page)])


@pytest.mark.parametrize("n_groups", [1, 3, 8])
def test_a_plots_legend_covers_neither_its_x_label_nor_its_bars(n_groups):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    groups = [(f"group {g}", [(f"method {m}", 1.0 + m) for m in range(4)]) for g in range(n_groups)]
    fig = render_results._barh(plt, groups, "a long x label, with its unit (log scale)", "title", log=True)
    fig.tight_layout()
    fig.canvas.draw()
    ax = fig.axes[0]
    legend = ax.get_legend().get_window_extent()
    assert not legend.overlaps(ax.xaxis.label.get_window_extent())
    assert not legend.overlaps(ax.get_window_extent())
    plt.close(fig)


def _tables(text: str) -> list[list[str]]:
    """The markdown tables of text, each as its lines."""
    tables: list[list[str]] = []
    prev = False
    for line in text.splitlines():
        is_row = line.startswith("|")
        if is_row and not prev:
            tables.append([])
        if is_row:
            tables[-1].append(line)
        prev = is_row
    return tables


def test_page_tables_fit_a_page_and_cite_no_commit():
    """Every table of the benchmarks page has at most 7 columns (10 do not fit a 1300 px window),
    the copy table's start_copy variants sit in a table of their own, and no commit is named."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    for t in _tables(text):
        assert t[0].count("|") - 1 <= 7, t[0]
    copy = text.split("<!-- BEGIN render:copy -->")[1].split("<!-- END render:copy -->")[0]
    headers = [t[0] for t in _tables(copy)]
    assert len(headers) == 2, headers
    assert "no packing" not in headers[0] and "pin_memory" in headers[0]
    assert "no packing" in headers[1] and "no background thread" in headers[1] and "start_copy" in headers[1]
    assert "Commit `" not in text and "commit `" not in text
