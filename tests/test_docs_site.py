"""The built docs site shows no raw Sphinx roles (":class:`X`" printed as text): mkdocs builds
the site (the docs extra: pip install -e ".[docs]") and tools/check_site.py reads every page.
Skips where mkdocs is not installed; .ci/run builds the site and runs the same check."""
from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import check_site  # noqa: E402


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None,
                    reason="needs the docs extra (pip install -e '.[docs]')")
def test_built_site_has_no_raw_roles(tmp_path):
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    problems, _warnings = check_site.check(tmp_path / "site")
    assert not problems, "\n".join(problems)


def test_checker_finds_raw_roles(tmp_path):
    (tmp_path / "index.html").write_text("<p>returns an :class:<code>AsyncCopyHandle</code> whose\n"
                                          ":meth:<code>~AsyncCopyHandle.get</code></p><p>:func:`x`</p>")
    problems, _ = check_site.check(tmp_path)
    assert len(problems) == 2, problems
