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


def test_the_api_page_names_the_whole_public_surface():
    """docs/api.md's opening list of the public surface names every name in __all__."""
    text = (DOCS / "api.md").read_text()
    surface = text[text.index("The public surface"):text.index("## `start_copy`")]
    missing = sorted(n for n in mtc_loader.__all__ if f"`{n}`" not in surface)
    assert not missing, f"docs/api.md's public surface lacks {missing}"
    assert text.startswith("# API and semantics\n")  # the Reference page is the API reference


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
    for page in ("benchmarks.md", "accelerate.md", "lightning.md", "design_notes.md"):
        long = [ln for ln in _code_lines((DOCS / page).read_text()) if len(ln) > 100]
        assert not long, (page, long)
