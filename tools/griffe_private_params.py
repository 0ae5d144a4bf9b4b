"""A griffe extension for the docs site (mkdocs.yml): the signatures the Reference page shows
leave out parameters whose names start with ``_`` (``Arena(nbytes, *, _engine_arena, _token)``
is how the package builds an arena from one it received; a user passes ``nbytes``). Classes
show their ``__init__``'s parameters (``merge_init_into_class``); ``inspect.signature`` still
shows every parameter."""
from __future__ import annotations

from typing import Any

import griffe


class PrivateParameters(griffe.Extension):
    def on_package(self, *, pkg: Any, **kwargs: Any) -> None:
        self._walk(pkg, set())

    # griffe < 1.0 name for the same event
    def on_package_loaded(self, *, pkg: Any, **kwargs: Any) -> None:
        self._walk(pkg, set())

    def _walk(self, obj: Any, seen: set[int]) -> None:
        if id(obj) in seen or getattr(obj, "is_alias", False):
            return
        seen.add(id(obj))
        params = getattr(obj, "parameters", None)
        if getattr(obj, "is_function", False) and params is not None:
            for name in [p.name for p in params if p.name.startswith("_")]:
                del params[name]
        for member in getattr(obj, "members", {}).values():
            self._walk(member, seen)
