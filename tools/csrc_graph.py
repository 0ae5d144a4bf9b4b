#!/usr/bin/env python3
"""The include and call graph of the C sources, drawn as layers, and the rules it must keep.

    python3 tools/csrc_graph.py [ROOT]        (ROOT defaults to csrc/ beside this tools/ folder)

A node is a file, named with its wing (``engine/slab.c``, ``binding/state.h``). An edge A -> B is
an ``#include "B"`` in A, or, from a source A, a call of a function (or a use of a global) that
source B defines, not ``static`` (found roughly, by pattern: enough for this code base's layout,
not a C parser). A header and its source are two nodes: the source includes the header; a circle
is two sources that call each other, directly or around a ring, or headers that include each
other.

Layers come from the whole graph: a file with no edge out is on layer 0, any other one floor
above the highest file it reaches; the files of one circle share a floor. An upward edge is one
whose target is not on a lower floor than its source (an edge inside a circle).

The rules (exit status 1 when one is broken, with each breach printed):
  * the engine wing (csrc/engine/) never includes Python.h, nor a header of the binding wing;
  * no circle (a strongly connected set of more than one unit);
  * no function longer than 100 lines (from the line of its name to its closing brace);
  * no file longer than 800 lines.
Vendored code (third_party/) is not drawn. With a flat ROOT (no engine/ and binding/ folders)
the graph and the numbers are printed the same way; the wing rules then have nothing to check.
"""
from __future__ import annotations

import os
import re
import sys
from collections import defaultdict

MAX_FUNCTION_LINES = 100
MAX_FILE_LINES = 800
WINGS = ("engine", "binding")

_INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)
_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
_STRING = re.compile(r'"(?:\\.|[^"\\\n])*"' + r"|'(?:\\.|[^'\\\n])*'")
# A definition at file scope: a line starting at column 0 with a type and a name, then "(".
_FUNC_HEAD = re.compile(r"^(?!static\b|typedef\b|#|extern\b|struct\b[^(]*;|\s)([A-Za-z_][\w \t\*]*?)\b([A-Za-z_]\w*)\s*\(",
                        re.M)
_STATIC_FUNC_HEAD = re.compile(r"^static\b[\w \t\*]*?\b([A-Za-z_]\w*)\s*\(", re.M)
_GLOBAL_VAR = re.compile(r"^(?!static\b|typedef\b|extern\b|#|\s)[A-Za-z_][\w \t\*]*?\b([A-Za-z_]\w*)\s*(?:=[^;]*)?;", re.M)
_IDENT = re.compile(r"[A-Za-z_]\w*")


def _strip(text: str) -> str:
    """The text without comments and string literals, with its line breaks kept."""
    text = _COMMENT.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return _STRING.sub('""', text)


class Source:
    def __init__(self, root: str, rel: str):
        self.rel = rel
        self.path = os.path.join(root, rel)
        with open(self.path, encoding="utf-8") as f:
            self.text = f.read()
        self.code = _strip(self.text)
        self.lines = self.text.count("\n") + (0 if self.text.endswith("\n") else 1)
        parts = rel.split("/")
        self.wing = parts[0] if len(parts) > 1 and parts[0] in WINGS else ""
        self.name = parts[-1]
        self.unit = rel
        self.includes = [(kind, target) for kind, target in _INCLUDE.findall(self.text)]

    def functions(self) -> list[tuple[str, int, int, bool]]:
        """(name, first line, length in lines, static) of each function defined here."""
        out = []
        lines = self.code.split("\n")
        for pat, static in ((_FUNC_HEAD, False), (_STATIC_FUNC_HEAD, True)):
            for m in pat.finditer(self.code):
                name = m.group(2) if not static else m.group(1)
                start = self.code.count("\n", 0, m.start())
                # a definition: the first of ";" or "{" after the parameters is "{"
                depth, i = 0, m.end() - 1
                while i < len(self.code):
                    c = self.code[i]
                    if c == "(":
                        depth += 1
                    elif c == ")":
                        depth -= 1
                    elif depth == 0 and c in ";{":
                        break
                    i += 1
                if i >= len(self.code) or self.code[i] != "{":
                    continue
                depth, j = 0, i
                while j < len(self.code):
                    if self.code[j] == "{":
                        depth += 1
                    elif self.code[j] == "}":
                        depth -= 1
                        if depth == 0:
                            break
                    j += 1
                end = self.code.count("\n", 0, j)
                if lines[start].startswith("static inline") or not lines[start][:1].isspace():
                    out.append((name, start + 1, end - start + 1, static or lines[start].startswith("static")))
        return out

    def globals(self) -> list[str]:
        """Names of the variables defined at file scope here, not static."""
        return [m.group(1) for m in _GLOBAL_VAR.finditer(self.code) if "(" not in m.group(0)]


def collect(root: str) -> list[Source]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "third_party")
        for fn in sorted(filenames):
            if fn.endswith((".c", ".h")):
                out.append(Source(root, os.path.relpath(os.path.join(dirpath, fn), root).replace(os.sep, "/")))
    return out


def build(sources: list[Source]):
    """(units, edges {(a, b): set of kinds}, problems list)."""
    problems: list[str] = []
    units = sorted({s.unit for s in sources})
    by_name: dict[str, list[Source]] = defaultdict(list)
    for s in sources:
        by_name[s.name].append(s)
    for name, group in by_name.items():
        if len(group) > 1:
            problems.append(f"two files named {name}: {', '.join(s.rel for s in group)}")
    edges: dict[tuple[str, str], set[str]] = defaultdict(set)

    def resolve(src: Source, target: str) -> Source | None:
        base = target.split("/")[-1]
        group = by_name.get(base, [])
        same = [s for s in group if s.wing == src.wing]
        return (same or group or [None])[0]

    for s in sources:
        for kind, target in s.includes:
            if kind == "<":
                if target == "Python.h" and s.wing == "engine":
                    problems.append(f"{s.rel}: includes <Python.h> (the engine wing never sees Python)")
                continue
            t = resolve(s, target)
            if t is None:
                continue
            if s.wing == "engine" and t.wing == "binding":
                problems.append(f"{s.rel}: includes {t.rel} (the engine never includes the binding)")
            if t.unit != s.unit:
                edges[(s.unit, t.unit)].add("include")
    # definitions that other units may call: non-static functions and globals of .c files
    defined: dict[str, str] = {}
    for s in sources:
        if s.name.endswith(".c"):
            for name, _, _, static in s.functions():
                if not static:
                    defined[name] = s.unit
            for name in s.globals():
                defined[name] = s.unit
    for s in sources:
        if not s.name.endswith(".c"):
            continue
        for ident in set(_IDENT.findall(s.code)):
            u = defined.get(ident)
            if u and u != s.unit:
                edges[(s.unit, u)].add("call")
                if s.wing == "engine" and u.startswith("binding/"):
                    problems.append(f"{s.rel}: uses {ident} of {u} (the engine never calls the binding)")
    for s in sources:
        if s.lines > MAX_FILE_LINES:
            problems.append(f"{s.rel}: {s.lines} lines (at most {MAX_FILE_LINES})")
        for name, line, length, _ in s.functions():
            if length > MAX_FUNCTION_LINES:
                problems.append(f"{s.rel}:{line}: {name} is {length} lines (at most {MAX_FUNCTION_LINES})")
    return units, dict(edges), problems


def circles(units: list[str], edges) -> list[list[str]]:
    """Strongly connected sets of the graph (Tarjan), each sorted; singletons included."""
    succ: dict[str, list[str]] = defaultdict(list)
    for a, b in edges:
        succ[a].append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in succ[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in units:
        if v not in index:
            visit(v)
    return out


def layers(units: list[str], edges, comps: list[list[str]]) -> dict[str, int]:
    comp_of = {u: i for i, c in enumerate(comps) for u in c}
    succ: dict[int, set[int]] = defaultdict(set)
    for a, b in edges:
        if comp_of[a] != comp_of[b]:
            succ[comp_of[a]].add(comp_of[b])
    floor: dict[int, int] = {}
    # Tarjan emits components in reverse topological order: successors come first
    for i in range(len(comps)):
        floor[i] = 1 + max((floor[j] for j in succ[i]), default=-1)
    return {u: floor[comp_of[u]] for u in units}


def main(argv: list[str]) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    root = argv[1] if len(argv) > 1 else os.path.join(here, "..", "csrc")
    sources = collect(root)
    units, edges, problems = build(sources)
    comps = circles(units, edges)
    floor = layers(units, edges, comps)
    upward = sorted((a, b) for a, b in edges if floor[b] >= floor[a])
    loops = [c for c in comps if len(c) > 1]
    top = max(floor.values(), default=-1)
    print(f"{len(sources)} files, {sum(s.lines for s in sources)} lines, {len(units)} units, "
          f"{len(edges)} edges, {top + 1} layers, {len(upward)} upward edges, {len(loops)} circles")
    for f in range(top, -1, -1):
        print(f"  layer {f:2d}: {' '.join(u for u in units if floor[u] == f)}")
    for a, b in upward:
        print(f"upward: {a} -> {b} ({', '.join(sorted(edges[(a, b)]))})")
    for c in loops:
        print(f"circle: {' <-> '.join(c)}")
        problems.append(f"circle: {' <-> '.join(c)}")
    longest = max(((length, s.rel, name) for s in sources for name, _, length, _ in s.functions()), default=None)
    if longest:
        print(f"longest function: {longest[1]} {longest[2]} ({longest[0]} lines); "
              f"longest file: {max((s.lines, s.rel) for s in sources)[1]} "
              f"({max(s.lines for s in sources)} lines)")
    for p in problems:
        print(f"ERROR: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
