"""The griffe extensions of the docs site (mkdocs.yml), each named there as
``tools/griffe_extensions.py:NAME``.

``SphinxRoles``: the docstrings use Sphinx roles (``:class:`AsyncCopyHandle```, ``:meth:`~AsyncCopyHandle.get```, ``:func:`start_copy```), which
mkdocstrings would print as text. Each becomes a link to the object's entry on the Reference page
where it has one (an optional autorefs cross-reference), and inline code otherwise (``torch``'s
names, private helpers). ``~`` shows the last part of the name, as in Sphinx; functions and
methods get ``()``.

``PrivateParameters``: the signatures the Reference page shows leave out parameters whose names start with ``_`` (``Arena(nbytes, *, _engine_arena, _token)``
is how the package builds an arena from one it received; a user passes ``nbytes``). Classes
show their ``__init__``'s parameters (``merge_init_into_class``); ``inspect.signature`` still
shows every parameter.
"""
from __future__ import annotations

import re
from typing import Any

import griffe


class _Walk(griffe.Extension):
    """Visits every object of the loaded package once (aliases left out)."""

    def on_package(self, *, pkg: Any, **kwargs: Any) -> None:
        self._walk(pkg, set())

    # griffe < 1.0 name for the same event
    def on_package_loaded(self, *, pkg: Any, **kwargs: Any) -> None:
        self._walk(pkg, set())

    def _walk(self, obj: Any, seen: set[int]) -> None:
        if id(obj) in seen or getattr(obj, "is_alias", False):
            return
        seen.add(id(obj))
        self.visit(obj)
        for member in getattr(obj, "members", {}).values():
            self._walk(member, seen)

    def visit(self, obj: Any) -> None:
        raise NotImplementedError


class PrivateParameters(_Walk):
    def visit(self, obj: Any) -> None:
        params = getattr(obj, "parameters", None)
        if getattr(obj, "is_function", False) and params is not None:
            for name in [p.name for p in params if p.name.startswith("_")]:
                del params[name]


ROLE = re.compile(r":(?:py:)?(class|meth|func|mod|attr|exc|obj|data|const):`(!?~?)([^`<]+?)(?:\s*<([^>]+)>)?`")


def _resolve(obj: Any, target: str) -> str:
    """The full path of target as seen from obj's docstring (its class, module, the package)."""
    if target.startswith("mtc_loader."):
        return target
    scopes = []
    o = obj
    while o is not None:
        scopes.append(o)
        o = o.parent
    for scope in scopes:
        try:
            scope[target]
        except Exception:  # noqa: BLE001 (KeyError, alias resolution errors)
            continue
        return f"{scope.path}.{target}"
    return f"mtc_loader.{target}"


class SphinxRoles(_Walk):
    def visit(self, obj: Any) -> None:
        doc = getattr(obj, "docstring", None)
        if doc is not None and ":" in doc.value:
            doc.value = ROLE.sub(lambda m: self._replace(obj, m), doc.value)

    @staticmethod
    def _replace(obj: Any, m: "re.Match[str]") -> str:
        kind, flags, text, explicit = m.group(1), m.group(2), m.group(3).strip(), m.group(4)
        target = (explicit or text).strip().lstrip("~!")
        shown = text.lstrip("~!")
        if "~" in flags and not explicit:
            shown = shown.rsplit(".", 1)[-1]
        if kind in ("func", "meth") and not shown.endswith(")"):
            shown += "()"
        if target.startswith(("torch", "numpy", "np.", "os.", "sys.", "typing")) or "!" in flags:
            return f"`{shown}`"
        path = _resolve(obj, target)
        return f'<autoref identifier="{path}" optional><code>{shown}</code></autoref>'
