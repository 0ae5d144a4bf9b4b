"""The package's modules keep to their own private names: an Arena's underscore attributes are read
and written in ``_arena.py`` only (the other modules go through its functions), and an underscore
name is imported only by a sibling module of the same subpackage (``prefetch/``, ``mmengine/``
share theirs between their rooms), never across a subpackage's border."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "mtc_loader"

def _modules() -> dict[str, ast.Module]:
    return {p.relative_to(PKG).as_posix(): ast.parse(p.read_text(), str(p)) for p in sorted(PKG.rglob("*.py"))}


def _arena_private_names(tree: ast.Module) -> set[str]:
    """The underscore attributes and methods of class Arena (not dunders)."""
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Arena")
    names = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            names.add(node.attr)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_arena_private_names_stay_in_arena_module() -> None:
    modules = _modules()
    private = _arena_private_names(modules["_arena.py"])
    assert {"_a", "_expected", "_loaders", "_numpy_tensors", "_unpack_hint"} <= private, private
    reach = []
    for rel, tree in modules.items():
        if rel == "_arena.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in private:
                # another class's own attribute of the same name (self._x) is its own
                if isinstance(node.value, ast.Name) and node.value.id == "self":
                    continue
                reach.append(f"{rel}:{node.lineno}: .{node.attr}")
    assert not reach, "modules that reach into an Arena's private names (use _arena's functions):\n" + "\n".join(reach)


def _source_of(rel: str, node: ast.ImportFrom) -> Path:
    """The file or folder a relative ``from ... import`` reads from."""
    base = (PKG / rel).parent
    for _ in range(node.level - 1):
        base = base.parent
    return base.joinpath(*(node.module or "").split(".")) if node.module else base


def test_private_names_stay_inside_their_subpackage() -> None:
    crossing = []
    for rel, tree in _modules().items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and node.level > 0):
                continue
            src = _source_of(rel, node)
            for alias in node.names:
                n = alias.name
                if not n.startswith("_") or n.startswith("__") or n == "_engine":
                    continue
                if (src / f"{n}.py").exists() or (src / n).is_dir():
                    continue  # a private module imported whole: its public names are used
                module = src.with_suffix(".py") if src.with_suffix(".py").exists() else src / "__init__.py"
                if module.parent == (PKG / rel).parent and module.parent != PKG:
                    continue  # a sibling of the same subpackage
                crossing.append(f"{rel}:{node.lineno}: {n} from {module.relative_to(PKG).as_posix()}")
    assert not crossing, "underscore names imported across modules:\n" + "\n".join(crossing)
