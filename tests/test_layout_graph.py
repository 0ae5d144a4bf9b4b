"""The C sources keep their two wings (tools/csrc_graph.py): the engine never sees Python nor the
binding, calls run one way with no circle, no function over 100 lines, no file over 800."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "csrc_graph.py"


def _run(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(TOOL), str(root)], capture_output=True, text=True, timeout=60)


def test_csrc_keeps_its_wings() -> None:
    r = _run(ROOT / "csrc")
    assert r.returncode == 0, r.stdout + r.stderr
    assert " 0 upward edges, 0 circles" in r.stdout, r.stdout
    assert "ERROR" not in r.stdout


def test_every_c_file_is_in_a_wing() -> None:
    loose = [p.name for p in (ROOT / "csrc").glob("*.[ch]")]
    assert not loose, f"C files outside csrc/engine and csrc/binding: {loose}"
    for p in (ROOT / "csrc" / "engine").glob("*.[ch]"):
        assert "#include <Python.h>" not in p.read_text(), p


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "csrc"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


_GOOD = {
    "engine/ring.h": "int mtc_ring_push(int x);\n",
    "engine/ring.c": '#include "ring.h"\n\nint mtc_ring_push(int x)\n{\n    return x;\n}\n',
    "binding/state.h": "#include <Python.h>\n",
    "binding/module.c": '#include "state.h"\n#include "ring.h"\n\nint f(void)\n{\n    return mtc_ring_push(1);\n}\n',
}


def test_a_clean_tree_passes(tmp_path: Path) -> None:
    r = _run(_tree(tmp_path, _GOOD))
    assert r.returncode == 0, r.stdout
    assert "binding/module.c -> engine/ring.c" not in r.stdout  # downward edges are not listed as upward
    assert "2 layers" in r.stdout or "3 layers" in r.stdout, r.stdout


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"engine/ring.c": '#include <Python.h>\n#include "ring.h"\n'}, "includes <Python.h>"),
        ({"engine/ring.c": '#include "ring.h"\n#include "state.h"\n'}, "the engine never includes the binding"),
        ({"engine/ring.c": '#include "ring.h"\n\nint mtc_ring_push(int x)\n{\n    return f() + x;\n}\n'},
         "the engine never calls the binding"),
        ({"engine/ring.c": '#include "ring.h"\n\nint mtc_ring_push(int x)\n{\n' + "    x++;\n" * 100 + "    return x;\n}\n"},
         "mtc_ring_push is 104 lines"),
        ({"engine/big.c": "int x;\n" * 801}, "801 lines (at most 800)"),
        ({"engine/plan.c": '#include "ring.h"\n\nint mtc_plan(void)\n{\n    return mtc_ring_push(0);\n}\n',
          "engine/ring.c": '#include "ring.h"\n\nint mtc_plan(void);\nint mtc_ring_push(int x)\n{\n'
                           "    return x ? mtc_plan() : 0;\n}\n"},
         "circle: engine/plan.c <-> engine/ring.c"),
    ],
    ids=["python-in-engine", "engine-includes-binding", "engine-calls-binding", "long-function", "long-file",
         "circle"],
)
def test_a_breach_fails(tmp_path: Path, change: dict[str, str], message: str) -> None:
    r = _run(_tree(tmp_path, {**_GOOD, **change}))
    assert r.returncode == 1, r.stdout
    assert message in r.stdout, r.stdout


def test_design_doc_draws_the_layers_the_tool_finds() -> None:
    """docs/design.md draws the floors (sources only) the graph has: the picture changes with the code."""
    r = _run(ROOT / "csrc")
    found: dict[int, set[str]] = {}
    for line in r.stdout.splitlines():
        if line.strip().startswith("layer "):
            head, _, files = line.partition(":")
            names = {f.split("/")[-1] for f in files.split() if f.endswith(".c")}
            if names:
                found[int(head.split()[1])] = names
    doc = (ROOT / "docs" / "design.md").read_text()
    picture = doc.split("## Two wings", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    drawn: dict[int, set[str]] = {}
    for line in picture.splitlines():
        parts = line.split()
        if parts and parts[0].isdigit():
            drawn[int(parts[0])] = {p for p in parts[1:] if p.endswith(".c")}
    assert drawn == found, (drawn, found)


def test_every_python_package_is_in_the_distribution() -> None:
    """setup.cfg's ``packages`` names each folder of mtc_loader/ that holds an ``__init__.py``: a
    subpackage left out installs from a checkout (editable) but is missing from the wheel."""
    import configparser
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    listed = {p.strip() for p in cfg["options"]["packages"].replace("\n", ",").split(",") if p.strip()}
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "mtc_loader").rglob("__init__.py")}
    assert found <= listed, f"setup.cfg's packages lacks {sorted(found - listed)}"
