"""The docs site's reference covers the public surface: every name in mtc_loader.__all__ has a
mkdocstrings entry in docs/reference.md (``mkdocs build --strict`` in .ci/run checks that each
entry resolves and every link and anchor exists)."""
from __future__ import annotations

import pathlib
import re

import mtc_loader

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"


def test_reference_lists_every_public_name():
    entries = set(re.findall(r"^::: mtc_loader\.(\w+)$", (DOCS / "reference.md").read_text(), re.M))
    missing = sorted(set(mtc_loader.__all__) - entries)
    assert not missing, f"docs/reference.md lacks ::: entries for {missing}"
    for name in mtc_loader.__all__:
        assert getattr(mtc_loader, name).__doc__, f"mtc_loader.{name} has no docstring"


def test_the_reference_names_the_whole_public_surface():
    """docs/reference.md's opening list of the public surface names every name in __all__."""
    text = (DOCS / "reference.md").read_text()
    surface = text[text.index("The public surface"):text.index("## Copies")]
    missing = sorted(n for n in mtc_loader.__all__ if f"`{n}`" not in surface)
    assert not missing, f"docs/reference.md's public surface lacks {missing}"


def _code_lines(text: str) -> list[str]:
    """The lines inside fenced code blocks of a markdown page."""
    lines, inside = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            inside = not inside
        elif inside:
            lines.append(line)
    return lines


def test_pages_fit_a_1300_px_window():
    """At 1300 px the page's contents sit in the left sidebar (toc.integrate), which leaves a code
    block about 100 characters; the home page's quick start fits a phone's 80; names in table
    cells are not broken inside a word (docs/stylesheets/extra.css)."""
    config = (DOCS.parent / "mkdocs.yml").read_text()
    assert "- toc.integrate" in config and "stylesheets/extra.css" in config
    css = (DOCS / "stylesheets" / "extra.css").read_text()
    assert "white-space: nowrap" in css and "th code" in css
    long = [ln for ln in _code_lines((DOCS / "index.md").read_text()) if len(ln) > 80]
    assert not long, long
    for page in ("benchmarks.md", "accelerate.md", "lightning.md", "design_notes.md", "getting_started.md",
                 "which_api.md", "dataloader.md", "copies.md", "files.md", "engine.md", "troubleshooting.md"):
        long = [ln for ln in _code_lines((DOCS / page).read_text()) if len(ln) > 100]
        assert not long, (page, long)


def _row(text: str, workload: str) -> list[str]:
    """The cells of the first table row of ``workload`` on a page."""
    line = next(ln for ln in text.splitlines() if ln.startswith(f"| {workload} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def _median(cell: str) -> float:
    return float(re.match(r"([\d.]+)", cell).group(1))


def test_the_per_tensor_figures_are_the_tables():
    """The figures the home pages open with (the cost of .to() per tensor and per seed batch) are
    those of the copy benchmark's table, and link to the benchmarks page, which names the machine."""
    bench = (DOCS / "benchmarks.md").read_text()
    cells = _row(bench, "seed16 (H2D)")
    tensors = int(cells[1].split(",")[0])
    ms = _median(cells[2])
    per_tensor = f"about {round(ms * 1000 / tensors)} µs"
    assert per_tensor in bench, per_tensor
    for page, link in ((DOCS.parent / "README.md", "(docs/benchmarks.md)"), (DOCS / "index.md", "(benchmarks.md)")):
        text = " ".join(page.read_text().split())
        assert f"{tensors} small tensors (147 KB) takes {ms} ms" in text, page
        assert f"costs {per_tensor} of CPU time per tensor" in text, page
        assert f"On the [benchmarks]{link}' machine" in text, page


def test_the_large_tensor_claim_is_the_tables():
    """What the benchmarks page says of few large tensors is what its 16x16MB figures show."""
    bench = (DOCS / "benchmarks.md").read_text()
    rates = re.search(r"16x16MB: start_copy moves ([\d.]+) .*?GB/s; one pinned 256 MB .*?: ([\d.]+) ", bench)
    ours, pinned = float(rates.group(1)), float(rates.group(2))
    claim = " ".join(bench[bench.index("**Few large tensors**"):bench.index("**GPU-bound loop**")].split())
    assert f"moves {ours:.0f} GB/s" in claim and f"moves {pinned:.0f} GB/s" in claim, claim
    assert ours < pinned and "matches" not in claim
    cells = _row(bench, "16x16MB (H2D)")
    assert f"({_median(cells[6]):.2f}x against {_median(cells[4]):.2f}x `.to()`)" in claim, claim


def test_every_page_with_h200_figures_is_one_the_benchmarks_page_names():
    """Figures come from the benchmarks page's machine: its top names the H100 machine and the
    H200 host of the real models' table; the design notes, which summarise earlier studies, may
    name the hosts too; no other page names either (tests/test_doc_budgets.py holds the user pages)."""
    bench = (DOCS / "benchmarks.md").read_text()
    top = bench[:bench.index("\n## ")]
    assert "torch 2.11.0+cu130" in top and "Xeon" in top and "H100" in top and "H200" in top
    for page in sorted(DOCS.glob("*.md")):
        if page.name not in ("benchmarks.md", "design.md", "design_notes.md"):
            assert "H200" not in page.read_text(), page.name


def test_no_page_asks_for_a_package_to_build_nvtx():
    """NVTX's headers come with the source: no page makes a package a build requirement."""
    assert (DOCS.parent / "csrc" / "third_party" / "nvtx3").is_dir()
    requires = re.search(r"^requires = (.*)$", (DOCS.parent / "pyproject.toml").read_text(), re.M).group(1)
    assert "nvtx" not in requires, requires
    for page in [DOCS.parent / "README.md", *DOCS.glob("*.md")]:
        assert "nvidia-nvtx" not in page.read_text(), page.name


def test_the_process_page_names_the_before_fork_hook():
    """A hook that runs before every fork() of the process is process-wide state that
    ``import mtc_loader`` sets: "What it changes in your process" names it."""
    package = pathlib.Path(mtc_loader.__file__).parent
    hooks = [p.name for p in sorted(package.rglob("*.py"))
             if re.search(r"register_at_fork\([^)]*\bbefore=", p.read_text())]
    assert hooks, "no before-fork hook found: drop this test, and the line of docs/engine.md"
    page = " ".join((DOCS / "engine.md").read_text().split())
    assert "registers a hook that runs before each `os.fork()`" in page, hooks
