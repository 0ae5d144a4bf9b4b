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
