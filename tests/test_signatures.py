"""Public names show their real signature (to help(), inspect.signature and so IDEs)."""
from __future__ import annotations

import inspect
import pathlib
import pydoc
import re
import warnings
from typing import Any, Optional

import mtc_loader
from mtc_loader._wrap import PrefetchingDataLoader
from mtc_loader.prefetch._loader import ResumablePrefetchLoader


def _public_params(sig: inspect.Signature) -> list[str]:
    return [p.name for p in sig.parameters.values() if not p.name.startswith("_")]


def test_public_classes_show_their_constructors_parameters():
    """A class's signature is its __init__'s: a __new__ that dispatches (to the class that has
    state_dict over a stateful iterable) would show (*args, **kwargs) instead."""
    for name in mtc_loader.__all__:
        cls = getattr(mtc_loader, name)
        if not isinstance(cls, type):
            continue
        shown = inspect.signature(cls)
        init = list(inspect.signature(cls.__init__).parameters.values())[1:]
        assert list(shown.parameters.values()) == init, (name, shown)
    for cls in (ResumablePrefetchLoader, PrefetchingDataLoader):
        assert _public_params(inspect.signature(cls)) == _public_params(inspect.signature(mtc_loader.PrefetchLoader))
    assert _public_params(inspect.signature(mtc_loader.PrefetchLoader)) == [
        "iterable", "device", "depth", "gil_switch_interval", "produce_on_caller", "numpy_to_tensors",
        "transform", "start_copy_options"]
    assert "PrefetchLoader(iterable: " in pydoc.render_doc(mtc_loader.PrefetchLoader, renderer=pydoc.plaintext)


def test_the_stateful_dispatch_still_happens():
    class Stateful:
        def __iter__(self):
            return iter([])

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    loader = mtc_loader.PrefetchLoader(Stateful(), "cpu")
    assert isinstance(loader, ResumablePrefetchLoader) and hasattr(loader, "state_dict")
    plain = mtc_loader.PrefetchLoader([], "cpu")
    assert type(plain) is mtc_loader.PrefetchLoader and not hasattr(plain, "state_dict")
    wrapped = PrefetchingDataLoader(Stateful(), "cpu")
    assert isinstance(wrapped, PrefetchingDataLoader) and isinstance(wrapped, ResumablePrefetchLoader)


# ---------------------------------------------------------------------- the signatures the pages print

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# names a page may print without their module: the public surface, and the integrations' entry
# points that are unique to them
_BARE = {"switch_config": "mmengine.switch_config", "PrefetchCallback": "lightning.PrefetchCallback"}

_SPAN = re.compile(r"`([A-Za-z_][\w.]*)\(([^`]*)\)(?:\s*->\s*[^`]*)?`")
_HEADING = re.compile(r"^#+ .*?`([A-Za-z_][\w.]*)\(([^`]*)\)")
_FENCED = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
_CALL = re.compile(r"^([A-Za-z_][\w.]*)\((.*)\)(?:\s*->\s*.*)?$", re.S)
_UNITS = {"KiB": 10, "MiB": 20, "GiB": 30}


def _resolve(name: str) -> Any:
    """The object a printed name means, or None where it names nothing public (a method printed
    without its class, a variable, a framework that is not installed)."""
    if name.startswith("mtc_loader."):
        name = name[len("mtc_loader."):]
    head = name.split(".")[0]
    if head in _BARE:
        name = _BARE[head] + name[len(head):]
    elif head not in mtc_loader.__all__ and head not in ("mmengine", "lightning", "accelerate"):
        return None
    obj: Any = mtc_loader
    for part in name.split("."):
        try:
            with warnings.catch_warnings():  # the frameworks' own imports warn (torch.jit.script)
                warnings.simplefilter("ignore")
                obj = getattr(obj, part)
        except (AttributeError, ImportError):
            return None
    return obj if callable(obj) else None


def _split(args: str) -> list[str]:
    """The top-level comma-separated parts of a parameter list."""
    parts, depth, cur = [], 0, ""
    for ch in args:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur.strip())
    return parts


def _default(text: str) -> Any:
    text = re.sub(r"(\d+) ([KMG]iB)", lambda m: f"({m.group(1)} << {_UNITS[m.group(2)]})", text)
    return eval(text, {"__builtins__": {}}, {"None": None, "True": True, "False": False})


def _printed(path: pathlib.Path) -> list[tuple[str, str, str, bool]]:
    """(where, name, parameters, heading) of every call-like print of the page: code spans,
    headings, and fenced python blocks that hold one call and nothing else."""
    text = path.read_text()
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        where = f"{path.relative_to(ROOT)}:{n}"
        m = _HEADING.match(line)
        if m:
            found.append((where, m.group(1), m.group(2), True))
            continue
        found += [(where, m.group(1), m.group(2), False) for m in _SPAN.finditer(line)]
    for m in _FENCED.finditer(text):
        body = "\n".join(ln.split("#")[0] for ln in m.group(1).splitlines()).strip()
        call = _CALL.match(body)
        if call and "\n" in body:
            where = f"{path.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 2}"
            found.append((where, call.group(1), " ".join(call.group(2).split()), True))
    return found


def _mismatch(obj: Any, args: str, heading: bool) -> Optional[str]:
    """Why the printed parameters are not the object's signature, or None when they are (or when
    the print is a call rather than a signature)."""
    params = [p for p in inspect.signature(obj).parameters.values()
              if not p.name.startswith("_") and p.name != "self"]  # (a method printed as Class.method)
    parts = _split(args)
    if any(p == "..." or p.partition("=")[2].strip() == "..." for p in parts):
        return None  # elided: an example call
    names = [p.split("=")[0].strip() for p in parts]
    starred = any(p.startswith("*") for p in parts)
    if not (heading or starred or set(names) >= {p.name for p in params}):
        return None  # a call (arguments, not the parameters)
    printed = []  # (name, kind, default or None when none is printed)
    keyword_only = False
    for part in parts:
        if part == "*":
            keyword_only = True
        elif part.startswith("**"):
            printed.append((part[2:], inspect.Parameter.VAR_KEYWORD, inspect.Parameter.empty))
        elif part.startswith("*"):
            keyword_only = True
            printed.append((part[1:], inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.empty))
        else:
            name, _, default = part.partition("=")
            kind = inspect.Parameter.KEYWORD_ONLY if keyword_only else inspect.Parameter.POSITIONAL_OR_KEYWORD
            try:
                value = _default(default) if default else inspect.Parameter.empty
            except Exception:
                return f"{part!r}: its default does not read as a value"
            printed.append((name.strip(), kind, value))
    real = [(p.name, p.kind if p.kind != p.POSITIONAL_ONLY else p.POSITIONAL_OR_KEYWORD, p.default)
            for p in params]
    if [n for n, _, _ in printed] != [n for n, _, _ in real]:
        return f"parameters {[n for n, _, _ in printed]}, the real ones are {[n for n, _, _ in real]}"
    for (name, kind, value), (_, rkind, rvalue) in zip(printed, real):
        if kind != rkind:
            return f"{name} printed as {kind.description}, it is {rkind.description}"
        if value is not rvalue and value != rvalue:
            return f"{name}: printed default {value!r}, the real one is {rvalue!r}"
    return None


def test_the_pages_print_the_real_signatures():
    """Every signature README.md and docs/ print (a heading, a code span or a fenced block that
    names a public callable with its parameters, or a span that names all of them) has the real
    parameters, in order, of the same kinds, with the real defaults ('256 MiB' reads as 256 << 20);
    a call with arguments is not a signature and is left alone."""
    problems, checked = [], set()
    for page in PAGES:
        for where, name, args, heading in _printed(page):
            obj = _resolve(name)
            if obj is None:
                continue
            why = _mismatch(obj, args, heading)
            if why:
                problems.append(f"{where}: `{name}({args})`: {why}")
            elif heading or "*" in args or "=" in args:
                checked.add(name.replace("mtc_loader.", ""))
    assert not problems, "\n".join(problems)
    # the ones the pages print in full, at least
    assert {"PackedCollate", "PrefetchLoader", "start_copy", "start_side_copy", "register_container",
            "configure", "Arena", "FileTensor"} <= checked, checked


def test_the_signature_check_sees_a_wrong_print():
    assert _mismatch(mtc_loader.PackedCollate, "collate_fn=None, *, arena_bytes=256 MiB, timeout=60.0", True)
    assert "prefetch_depth" not in (_mismatch(mtc_loader.PrefetchLoader, "iterable, device, depth=2, *, "
                                               "gil_switch_interval=0.0005, produce_on_caller=None, "
                                               "numpy_to_tensors=False, transform=None, **start_copy_options", True) or "")
    assert "default" in _mismatch(mtc_loader.PrefetchLoader, "iterable, device, depth=3, *, gil_switch_interval="
                                  "0.0005, produce_on_caller=None, numpy_to_tensors=False, transform=None, "
                                  "**start_copy_options", True)
    assert _mismatch(mtc_loader.PackedCollate, "list", False) is None  # a call
    assert _mismatch(mtc_loader.FileTensor, "path, dtype, shape, offset", False)  # all named: a signature
