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


DOCS_EXTRA = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("mkdocs", "mkdocstrings", "mmengine")),
    reason="needs the docs extra (pip install -e '.[docs]')")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site") / "site"
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    return out


@DOCS_EXTRA
def test_built_site_has_no_raw_roles(site):
    problems, _warnings = check_site.check(site)
    assert not problems, "\n".join(problems)


@DOCS_EXTRA
def test_the_reference_shows_each_public_class_with_its_parameters(site):
    """Each public class's heading on the Reference page is its signature: the parameters
    inspect.signature gives (its __init__'s), less the package's own (named with a leading _)."""
    import html
    import inspect
    import re

    import mtc_loader

    page = (site / "reference" / "index.html").read_text()
    for name in mtc_loader.__all__:
        cls = getattr(mtc_loader, name)
        if not isinstance(cls, type):
            continue
        m = re.search(rf'<h\d id="mtc_loader\.{name}" class="doc doc-heading">(.*?)</h\d>', page, re.S)
        assert m, name
        shown = " ".join(html.unescape(re.sub(r"<[^>]+>", "", m.group(1))).replace("¶", "").split())
        params = [("**" if p.kind == p.VAR_KEYWORD else "*" if p.kind == p.VAR_POSITIONAL else "") + p.name
                  for p in inspect.signature(cls).parameters.values() if not p.name.startswith("_")]
        printed = [p.split("=")[0].strip() for p in shown.partition("(")[2].rstrip(")").split(",") if p.strip()]
        assert [p for p in printed if p != "*"] == params, (name, shown, params)
    for name, first in (("PackedCollate", "collate_fn=None, *, arena_bytes=256 << 20"), ("Arena", "nbytes=256 << 20)"),
                        ("PrefetchLoader", "iterable, device, depth=2, *, gil_switch_interval=0.0005"),
                        ("FileTensor", "path, dtype, shape=None, offset=0)")):
        assert f"mtc_loader.{name}({first}" in html.unescape(re.sub(r"<[^>]+>", "", page)), name


def test_checker_finds_a_heading_without_its_signature(tmp_path):
    (tmp_path / "index.html").write_text(
        '<div class="doc doc-object doc-class">\n<h2 id="mtc_loader.Arena" class="doc doc-heading">'
        '<code>mtc_loader.Arena</code><a class="headerlink">&para;</a></h2>'
        '<div class="doc doc-object doc-class">\n<h2 id="mtc_loader.FileTensor" class="doc doc-heading">'
        '<code>mtc_loader.FileTensor(path, dtype)</code></h2>')
    problems, _ = check_site.check(tmp_path)
    assert len(problems) == 1 and "mtc_loader.Arena shows no signature" in problems[0], problems


def test_checker_finds_raw_roles(tmp_path):
    (tmp_path / "index.html").write_text("<p>returns an :class:<code>AsyncCopyHandle</code> whose\n"
                                          ":meth:<code>~AsyncCopyHandle.get</code></p><p>:func:`x`</p>")
    problems, _ = check_site.check(tmp_path)
    assert len(problems) == 2, problems
