"""The user pages stay short and plain, and every figure they quote lives on the benchmarks page.

The user pages are the ones a user reads to get going: the README, the site's home page, "which
API when", getting started, the guide pages, the recipes and troubleshooting (``USER_PAGES``).
The design pages, the trust model, the benchmarks page and the generated reference may be longer.

Budgets: the README at most 1,200 words; the user pages at most 20,000 words in all, at most 20
words a sentence on average, and at most three sentences over 50 words. Words and sentences are
counted in the prose: code blocks, tables, HTML comments and the targets of links are left out.
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
MAX_LONG = 3
PAGE_WORDS = {"docs/mmengine.md": 2500, "docs/profiler.md": 1500}

_FENCE = re.compile(r"^ *```.*?^ *```[^\n]*$", re.M | re.S)
_COMMENT = re.compile(r"<!--.*?-->", re.S)
_LINK = re.compile(r"\[([^\]]*)\]\([^)]*\)")
_WORD = re.compile(r"[\w`'’./+*=<>-]*\w[\w`'’./+*=<>-]*")
# a sentence ends at . ! ? followed by a blank or the end, or at the end of a heading or list item
_END = re.compile(r"(?<=[.!?])[)\"']?\s+(?=[A-Z`(\[*\"0-9])")


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


def sentences(text: str) -> list[str]:
    """The sentences of a page's prose: a paragraph, list item or heading is split at each end of
    sentence inside it."""
    out = []
    block: list[str] = []

    def flush() -> None:
        if block:
            para = " ".join(block)
            out.extend(p for p in _END.split(para) if _WORD.search(p))
            block.clear()

    for line in prose(text).splitlines():
        if not line:
            flush()
        elif line.startswith("#") or re.match(r"^([-*]|\d+\.) ", line):
            flush()
            block.append(re.sub(r"^(#+|[-*]|\d+\.) ", "", line))
            if line.startswith("#"):
                flush()
        else:
            block.append(line)
    flush()
    return out


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


def test_the_user_pages_speak_in_short_sentences():
    lengths, long = [], []
    for rel in USER_PAGES:
        for s in sentences(_read(rel)):
            n = len(_WORD.findall(s))
            lengths.append(n)
            if n > LONG_SENTENCE:
                long.append(f"{rel}: {n} words: {s[:120]}")
    mean = sum(lengths) / len(lengths)
    assert mean <= MEAN_SENTENCE, f"{mean:.1f} words a sentence on average"
    assert len(long) <= MAX_LONG, "\n".join(long)


def test_the_counter_sees_long_text():
    """The counters count what a reader reads, and not the code."""
    text = "# Title\n\nOne two three. Four five [six](x.md#y).\n\n```python\na = b + c\n```\n\n- an item. Two.\n"
    assert words(text) == 10, words(text)
    assert [len(_WORD.findall(s)) for s in sentences(text)] == [1, 3, 3, 2, 1], sentences(text)
    assert words("| a | b |\n|---|---|\n| c | d |\n<!-- test: runs -->\n") == 0
    assert len(_WORD.findall(sentences(" ".join(["word"] * 60) + ".")[0])) == 60


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
