"""A griffe extension for the docs site (mkdocs.yml): the docstrings use Sphinx roles
(``:class:`AsyncCopyHandle```, ``:meth:`~AsyncCopyHandle.get```, ``:func:`start_copy```), which
mkdocstrings would print as text. Each becomes a link to the object's entry on the Reference page
where it has one (an optional autorefs cross-reference), and inline code otherwise (``torch``'s
names, private helpers). ``~`` shows the last part of the name, as in Sphinx; functions and
methods get ``()``."""
from __future__ import annotations

import re
from typing import Any

import griffe

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


class SphinxRoles(griffe.Extension):
    def on_package(self, *, pkg: Any, **kwargs: Any) -> None:
        self._walk(pkg, set())

    # griffe < 1.0 name for the same event
    def on_package_loaded(self, *, pkg: Any, **kwargs: Any) -> None:
        self._walk(pkg, set())

    def _walk(self, obj: Any, seen: set[int]) -> None:
        if id(obj) in seen or getattr(obj, "is_alias", False):
            return
        seen.add(id(obj))
        doc = getattr(obj, "docstring", None)
        if doc is not None and ":" in doc.value:
            doc.value = ROLE.sub(lambda m: self._replace(obj, m), doc.value)
        for member in getattr(obj, "members", {}).values():
            self._walk(member, seen)

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
