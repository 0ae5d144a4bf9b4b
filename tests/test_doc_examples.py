"""The examples of README.md and docs/*.md run as shown: every ```python block compiles, and each
block marked as runnable runs, on the CPU or a GPU where there is one.

A block is marked runnable by an HTML comment on the line before its fence (hidden on GitHub and
on the docs site):

    <!-- test: runs -->                       the block is a complete program
    <!-- test: runs (needs torchdata) -->     ... that needs these modules (skipped without them)

A runnable block runs in a fresh interpreter, as ``python3 -c BLOCK`` in an empty folder, which
imports the mtc_loader under test. Blocks that are fragments (a config's lines, a signature, a
loop body around names of your own) are only compiled. Two shapes a signature or a sketch may
take are not Python and are accepted: a block that is one call-like signature (``f(a, *, b=1) ->
T``, as reference.md prints ``start_copy``), and a line that is nothing but ``...,`` (the rest of an
argument list, elided)."""
from __future__ import annotations

import ast
import importlib.util
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

from conftest import package_parent, subprocess_env

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# a fenced python block (at any indentation, as inside a list item), and the marker before it
_BLOCK = re.compile(r"^(?P<indent> *)```python\n(?P<body>.*?)^(?P=indent)```", re.M | re.S)
_MARK = re.compile(r"^ *<!-- test: runs(?: \(needs (?P<needs>[\w., ]+)\))? -->$")
_SIGNATURE = re.compile(r"^[A-Za-z_][\w.]*\(.*\)(\s*->\s*[\w.\[\], ]+)?$", re.S)
_ELIDED = re.compile(r"^ *\.\.\.,$", re.M)


def _blocks() -> list[tuple[str, str, list[str] | None]]:
    """(where, code, None or the modules a runnable block needs) of every python block."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for m in _BLOCK.finditer(text):
            indent = len(m.group("indent"))
            code = "\n".join(line[indent:] for line in m.group("body").splitlines()) + "\n"
            line = text[:m.start()].count("\n") + 1
            previous = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            mark = _MARK.match(previous) if text[:m.start()].endswith(previous + "\n") else None
            needs = None
            if mark:
                needs = [n.strip() for n in (mark.group("needs") or "").split(",") if n.strip()]
            found.append((f"{page.relative_to(ROOT)}:{line}", code, needs))
    return found


BLOCKS = _blocks()
RUNNABLE = [(where, code, needs) for where, code, needs in BLOCKS if needs is not None]


def _compiles(code: str) -> str | None:
    """None where the block is Python (or one of the accepted shapes), else the SyntaxError."""
    try:
        ast.parse(code)
        return None
    except SyntaxError as e:
        error = f"line {e.lineno}: {e.msg}"
    body = "\n".join(ln.split("#")[0].rstrip() for ln in code.splitlines()).strip()
    if _SIGNATURE.match(body) and ("*" in body or "->" in body):
        return None  # a signature, as the pages print them (tests/test_signatures.py checks it)
    if _ELIDED.search(code):
        try:
            ast.parse(_ELIDED.sub("", code))
            return None
        except SyntaxError:
            pass
    return error


def test_every_python_block_compiles():
    problems = [f"{where}: {why}" for where, code, _ in BLOCKS if (why := _compiles(code))]
    assert not problems, "\n".join(problems)


def test_the_check_sees_a_broken_example():
    assert _compiles('torch.save({"loader": loader.state_dict(), ...}, "ckpt.pt")\n')
    assert _compiles("for batch in loader:\n    train_step(batch\n")
    assert _compiles("mtc_loader.start_copy(\n    data,\n    *,\n    x=True,\n) -> AsyncCopyHandle\n") is None
    assert _compiles("model = dict(\n    type='X',\n    ...,\n)\n") is None


def test_the_first_examples_a_newcomer_meets_are_run():
    """The README's quick start, getting started's three programs and the DataLoader page's resume
    example are marked runnable (so a broken one fails here rather than on a user's machine)."""
    marked = [where.split(":")[0] for where, _, _ in RUNNABLE]
    assert marked.count("README.md") >= 1, marked
    assert marked.count("docs/getting_started.md") >= 3, marked
    assert "docs/dataloader.md" in marked, marked
    readme_first = next(code for where, code, _ in BLOCKS if where.startswith("README.md"))
    assert any(code == readme_first for _, code, _ in RUNNABLE), "the README's first block is not run"


@pytest.mark.parametrize("where,code,needs", RUNNABLE, ids=[w for w, _, _ in RUNNABLE])
def test_runnable_block_runs(where, code, needs, tmp_path):
    for module in needs:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{where} needs {module}")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=subprocess_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{where} failed:\n{textwrap.indent(code, '    ')}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    assert "Traceback" not in r.stderr, r.stderr[-5000:]


def test_a_runnable_block_runs_the_package_under_test(tmp_path):
    r = subprocess.run([sys.executable, "-c", "import mtc_loader; print(mtc_loader.__file__)"], cwd=tmp_path,
                       env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert r.stdout.strip().startswith(package_parent()), (r.stdout, package_parent())


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def test_the_readme_quick_start_runs_on_the_cpu(tmp_path):
    """The quick start's loader (two workers, PackedCollate(list), PrefetchLoader) on the CPU,
    as on a machine without a GPU, and its check command printing what the README says."""
    text = _readme()
    quick = text[text.index("## Quick start"):text.index("## Three ways in")]
    code = quick[quick.index("```python\n") + 10:]
    code = code[:code.index("```")]
    assert "num_workers=2" in code and "PackedCollate(list)" in code and "PrefetchLoader(loader, device)" in code
    env = dict(subprocess_env(), CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-5000:]
    assert r.stdout.strip() == "8 samples on cpu", r.stdout
    check = re.search(r'^cd /tmp && python3 -c "(.*)"$', quick, re.M).group(1)
    printed = re.search(r"It prints `(.*?)`", quick).group(1)
    r = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == printed, (r.stdout, r.stderr[-3000:])


def test_ci_runs_the_readme_test_command_verbatim():
    """.ci/run's job A runs the README's full test command as the README prints it."""
    text = _readme()
    section = text[text.index("## Run the example and the tests"):]
    commands = re.findall(r"```bash\n(.*?)```", section, re.S)
    full = next(c.strip() for c in commands if c.strip().endswith("python3 -m pytest"))
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(rf"^\s+{re.escape(full)}$", ci, re.M), full
