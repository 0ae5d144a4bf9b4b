"""The user pages stay short and plain, and every figure they quote lives on the benchmarks page.

The user pages are the ones a user reads to get going: the README, the site's home page, "which
API when", getting started, the guide pages, the recipes and troubleshooting (``USER_PAGES``).
The design pages, the trust model, the benchmarks page and the generated reference may be longer.

Budgets: the README at most 1,200 words; the user pages at most 20,000 words in all; on each user
page at most 20 words a sentence on average, and no sentence over 50 words. Words are counted in
the prose: code blocks, tables, HTML comments and the targets of links are left out.

Sentences are counted as a strict reader counts them. A sentence ends only at ``.``, ``!`` or ``?``
followed by a blank, and before a capital letter, a digit, inline code, a quote or a bracket. A
heading, list item, table row or paragraph without that end runs on into what follows, and so does
a paragraph that opens with a bold label. Inline code, link texts and table cells count as words;
code blocks, comments and link targets do not.
"""
from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

USER_PAGES = ["README.md"] + [f"docs/{name}" for name in (
    "index.md", "which_api.md", "getting_started.md",
    # the guide, the DataLoader path first
    "dataloader.md", "copies.md", "files.md", "engine.md",
    # the recipes
    "lightning.md", "accelerate.md", "mmengine.md", "profiler.md",
    "troubleshooting.md",
)]
# the pages a user does not have to read, which may be longer
OTHER_PAGES = ["docs/reference.md", "docs/design.md", "docs/design_notes.md", "docs/trust_model.md",
               "docs/benchmarks.md"]

README_WORDS = 1200
TOTAL_WORDS = 20000
MEAN_SENTENCE = 20.0
LONG_SENTENCE = 50
PAGE_WORDS = {"docs/mmengine.md": 2500, "docs/profiler.md": 1500}

_FENCE = re.compile(r"^ *```.*?^ *```[^\n]*$", re.M | re.S)
_COMMENT = re.compile(r"<!--.*?-->", re.S)
_LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
_WORD = re.compile(r"[\w`'’./+*=<>-]*\w[\w`'’./+*=<>-]*")
# a sentence ends at . ! ? followed by a blank and what can open a sentence: a capital letter, a
# digit, inline code, a quote or a bracket. Text opening with bold ("**Fix.** Do it") or in lower
# case ("e.g. this") goes on with the sentence before it.
_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9`\"'(\[])")
_MARK = re.compile(r"^(#+|[-*+]|\d+[.)]|>)\s+")
_TABLE_RULE = re.compile(r"^\|?[\s:|-]*-[\s:|-]*$")


def prose(text: str) -> str:
    """The text a reader reads as sentences: no code blocks, tables, comments, headings' marks or
    link targets."""
    text = _FENCE.sub("\n", text)
    text = _COMMENT.sub("", text)
    text = _LINK.sub(r"\1", text)
    lines = []
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("|") or s.startswith("::: "):
            lines.append("")
            continue
        lines.append(s)
    return "\n".join(lines)


def reading(text: str) -> str:
    """All a reader reads, as one run of text: ``prose`` with the table rows' cells in it and the
    marks of headings, list items, quotes and tables taken away. Nothing here ends a sentence."""
    text = _FENCE.sub("\n", text)
    text = _COMMENT.sub("", text)
    text = _LINK.sub(r"\1", text)
    out = []
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("::: ") or _TABLE_RULE.match(s):
            continue
        if s.startswith("|"):
            s = " ".join(cell.strip() for cell in s.strip("|").split("|"))
        out.append(_MARK.sub("", s))
    return " ".join(s for s in out if s)


def sentences(text: str) -> list[str]:
    """The sentences of a page, ended only by . ! ? and a blank before a sentence's start: a
    heading, list item, table row or paragraph without one runs on into the next."""
    return [s for s in _END.split(reading(text)) if _WORD.search(s)]


def words(text: str) -> int:
    return len(_WORD.findall(prose(text)))


def _read(rel: str) -> str:
    return (ROOT / rel).read_text()


def test_every_page_is_a_user_page_or_another():
    """A new page is counted or named as one that may be longer."""
    pages = {"README.md"} | {f"docs/{p.name}" for p in DOCS.glob("*.md")}
    assert pages == set(USER_PAGES) | set(OTHER_PAGES), sorted(pages ^ (set(USER_PAGES) | set(OTHER_PAGES)))


def test_the_readme_fits_one_or_two_screens():
    assert words(_read("README.md")) <= README_WORDS, words(_read("README.md"))


def test_the_user_pages_fit_the_budget():
    counts = {rel: words(_read(rel)) for rel in USER_PAGES}
    assert sum(counts.values()) <= TOTAL_WORDS, counts
    for rel, limit in PAGE_WORDS.items():
        assert counts[rel] <= limit, (rel, counts[rel])


def _sentence_lengths(rel: str) -> list[tuple[int, str]]:
    return [(len(_WORD.findall(s)), s) for s in sentences(_read(rel))]


def test_the_user_pages_speak_in_short_sentences():
    """Each user page: at most MEAN_SENTENCE words a sentence on average, none over LONG_SENTENCE."""
    problems = []
    for rel in USER_PAGES:
        found = _sentence_lengths(rel)
        mean = sum(n for n, _ in found) / len(found)
        if mean > MEAN_SENTENCE:
            problems.append(f"{rel}: {mean:.1f} words a sentence on average")
        problems += [f"{rel}: {n} words: {s}" for n, s in found if n > LONG_SENTENCE]
    assert not problems, "\n".join(problems)


def test_the_counter_sees_long_text():
    """The counters count what a reader reads, and not the code."""
    text = "# Title\n\nOne two three. Four five [six](x.md#y).\n\n```python\na = b + c\n```\n\n- an item. Two.\n"
    assert words(text) == 10, words(text)
    assert [len(_WORD.findall(s)) for s in sentences(text)] == [4, 5, 1], sentences(text)
    assert words("| a | b |\n|---|---|\n| c | d |\n<!-- test: runs -->\n") == 0
    assert len(_WORD.findall(sentences(" ".join(["word"] * 60) + ".")[0])) == 60


def test_the_counter_runs_on_where_no_sentence_ends():
    """Headings, list items, table rows and paragraphs without . ! ? run on; inline code and link
    texts are words, link targets are not; a period ends a sentence only before a blank and the
    start of another."""
    text = ("## Set it up\n\n- first `pip install x`\n- then [the guide](a/b/c.md#d)\n\n"
            "| key | what |\n|:---|---:|\n| `A` | one cell |\n\nA line\n\nthat goes on. "
            "**Fix.** Do it, e.g. now! Really? `x` is 1. 2 is \"two\". (Yes.) [Or] not.")
    got = [len(_WORD.findall(s)) for s in sentences(text)]
    assert got == [25, 1, 3, 3, 3], sentences(text)
    assert sentences("One. Two.\n\n```\nthree. four.\n```\n") == ["One.", "Two."]


def test_the_counter_finds_a_long_page():
    """A page of headings and lists without full stops reads as one long sentence."""
    page = "\n".join(f"## Part {i}\n\n- item {i} of the list\n" for i in range(10))
    assert [len(_WORD.findall(s)) for s in sentences(page)] == [70], sentences(page)


# a machine, a run's pairing or an A/B: figures of particular hosts belong on the benchmarks page
_HOST = re.compile(r"\b(H100|H200|A100|Xeon|EPYC|vCPUs?|\d+ pairs|pairs of processes|A/B)\b")


@pytest.mark.parametrize("rel", USER_PAGES)
def test_no_user_page_names_a_host_or_a_pairing(rel):
    found = [m.group(0) for m in _HOST.finditer(prose(_read(rel)))]
    found += [m.group(0) for m in _HOST.finditer("\n".join(_FENCE.findall(_read(rel))))
              if m.group(0) != "A/B"]
    assert not found, (rel, found)


def test_the_benchmarks_page_names_its_machine_once_at_the_top():
    """Its top names the machine (tools/release/render_results.py renders it there); nothing
    below names it again, the rendered tables' footers included."""
    text = _read("docs/benchmarks.md")
    top = text[:text.index("\n## ")]
    assert re.search(r"\bH100\b", top) and "torch" in top, top
    rest = prose(text[len(top):])
    assert not re.search(r"\bH100\b", rest), re.findall(r".{60}\bH100\b.{20}", rest)


_FIGURE = re.compile(r"\b(\d+(?:\.\d+)?)\s?(?:x|ms|µs|GB/s|%)(?![\w/])")
# settings, not measurements: the GIL switch interval PrefetchLoader sets, and Python's default
SETTINGS = {"0.5 ms", "5 ms"}


@pytest.mark.parametrize("rel", USER_PAGES)
def test_every_figure_on_a_user_page_is_on_the_benchmarks_page(rel):
    """Speed-ups, latencies and bandwidths a user page quotes are figures of the benchmarks page."""
    numbers = set(re.findall(r"(?<![\w.])\d+(?:\.\d+)?(?![\d])", _read("docs/benchmarks.md")))
    missing = [m.group(0) for m in _FIGURE.finditer(prose(_read(rel)))
               if m.group(0) not in SETTINGS and m.group(1) not in numbers]
    assert not missing, (rel, missing)
