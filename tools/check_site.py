"""Checks the built docs site (``mkdocs build``) for what a reader must not see: Sphinx roles left
as text (``:class:`` / ``:meth:`` / ``:func:`` ... from docstrings that griffe_extensions.py did
not convert), reST's literal-block marker ``::`` left at the end of a sentence, a docstring's
Returns description cut into several rows (its continuation lines were not indented), a class or
function heading of the reference without its signature (``PackedCollate`` where
``PackedCollate(collate_fn=None, *, ...)`` belongs), and names of files or machines that only the
project's developers have.

    python3 tools/check_site.py SITE_DIR            # exit 1 on a raw role; internal names warn
    python3 tools/check_site.py --strict SITE_DIR   # internal names fail too
"""
from __future__ import annotations

import html
import pathlib
import re
import sys

ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|attr|exc|obj|data|const):`?")
LITERAL_MARK = re.compile(r"\w::\s*$")
RETURNS = re.compile(r'doc-section-title">Returns:</span></p>\s*(<table>.*?</table>)', re.S)
ROW = re.compile(r'<tr class="doc-section-item">', re.S)
# a mkdocstrings object: its kind, and the text of its heading
HEADING = re.compile(r'<div class="doc doc-object doc-(class|function)">\s*<h\d id="([\w.]+)" class="doc doc-heading">(.*?)</h\d>',
                     re.S)
INTERNAL = re.compile(r"shared/[A-Z_]+\.md|\bMEASURED\b|example\.txt|\b[Tt]he GPU machine")


def check(site: pathlib.Path, strict: bool = False) -> tuple[list[str], list[str]]:
    """(problems, warnings) of the built site."""
    problems: list[str] = []
    warnings: list[str] = []
    pages = sorted(site.rglob("*.html"))
    if not pages:
        return [f"{site}: no HTML pages (build the site first)"], []
    for page in pages:
        raw = page.read_text(errors="replace")
        for table in RETURNS.findall(raw):
            rows = len(ROW.findall(table))
            if rows > 1:
                first = html.unescape(re.sub(r"<[^>]+>", " ", table)).split()
                problems.append(f"{page.relative_to(site)}: a Returns table of {rows} rows (a description's "
                                f"continuation lines not indented?): {' '.join(first)[:160]}")
        for kind, ident, heading in HEADING.findall(raw):
            shown = " ".join(html.unescape(re.sub(r"<[^>]+>", "", heading)).replace("¶", "").split())
            name, paren, _ = shown.partition("(")
            if not paren or name.rsplit(".", 1)[-1] != ident.rsplit(".", 1)[-1]:
                problems.append(f"{page.relative_to(site)}: the {kind} heading {ident} shows no signature: {shown[:160]}")
        text = html.unescape(re.sub(r"<[^>]+>", "", raw))
        for n, line in enumerate(text.splitlines(), 1):
            where = f"{page.relative_to(site)}:{n}"
            if ROLE.search(line):
                problems.append(f"{where}: a raw Sphinx role: {line.strip()[:160]}")
            if LITERAL_MARK.search(line):
                problems.append(f"{where}: reST's '::' left in the text: {line.strip()[:160]}")
            if INTERNAL.search(line):
                (problems if strict else warnings).append(f"{where}: an internal name: {line.strip()[:160]}")
    return problems, warnings


def main(argv: list[str]) -> int:
    strict = "--strict" in argv
    argv = [a for a in argv if a != "--strict"]
    if len(argv) != 1:
        print(__doc__)
        return 2
    problems, warnings = check(pathlib.Path(argv[0]), strict)
    for w in warnings:
        print("warning:", w)
    for p in problems:
        print(p)
    print(f"check_site: {len(problems)} problem(s), {len(warnings)} warning(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
