"""The MTC_* environment variables: each is read whole by one strict parser for its kind
(integer in a range, boolean, word). A value that is not one the variable takes is ignored with
one RuntimeWarning naming the variable, its value and what is used instead; nothing is half-read
("512MB" is not 512). Each case runs in a fresh interpreter with the variable set. The parsers
themselves are checked value by value in tests/c/test_env.c."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import package_parent, run_child, subprocess_env

# every run-time variable the engine reads: a value of the right kind, and one it refuses
VARIABLES = {
    "MTC_PINNED_CAP_BYTES": ("4096", "512MB"),
    "MTC_NO_BATCH_MEMCPY": ("1", "sure"),
    "MTC_SLAB_HUGEPAGES": ("0", "10"),
    "MTC_H2D_RING": ("8", "65"),
    "MTC_INLINE_MAX_BYTES": ("0", "1e6"),
    "MTC_EARLY_GC": ("1", "maybe"),
    "MTC_HELPER_THREADS": ("2", "two"),
    "MTC_FILE_READER": ("uring", "io_uring"),
    "MTC_URING_DEPTH": ("64", "64.0"),
    "MTC_FILE_DIRECT": ("always", "never"),
    "MTC_ARENA_POPULATE": ("on", "o"),
    "MTC_URING_MAX_IO": ("4096", "4 KiB"),
    "MTC_TORCH_SHIM": ("0", "sometimes"),
    "MTC_C_HANDOFF": ("off", "C"),
    "MTC_QUIET_PIPES": ("no", "quiet"),
    "MTC_PACK_NT": ("0", "nt"),
}

_CHILD = """
import json, warnings
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    import mtc_loader
    cap = mtc_loader.stats()["pinned_cap_bytes"]
    mtc_loader.stats()
print(json.dumps({"cap": cap, "warnings": [(x.category.__name__, str(x.message)) for x in w
                                           if "MTC_" in str(x.message)]}))
"""


def _run(**env: str) -> dict:
    return run_child(_CHILD, **env)


def test_every_variable_refused_value_warns_once_naming_it():
    """All variables set to values they refuse: one warning each, at import, none again later."""
    out = _run(**{k: bad for k, (_good, bad) in VARIABLES.items()})
    msgs = [m for c, m in out["warnings"]]
    assert all(c == "RuntimeWarning" for c, m in out["warnings"])
    for name, (_good, bad) in VARIABLES.items():
        mine = [m for m in msgs if m.startswith(f"mtc_loader: {name}=")]
        assert len(mine) == 1, (name, msgs)
        assert f"{name}={bad!r}" in mine[0] and "is ignored" in mine[0] and "is used" in mine[0], mine[0]
    assert len(msgs) == len(VARIABLES), msgs
    assert out["cap"] == 1 << 30


def test_every_variable_accepted_value_gives_no_warning():
    out = _run(**{k: good for k, (good, _bad) in VARIABLES.items()})
    assert out["warnings"] == []
    assert out["cap"] == 4096


@pytest.mark.parametrize("value", ["1e99", "512MB", "0", "-1", "4096 bytes", "0x1000", "9223372036854775808"])
def test_pinned_cap_not_a_positive_integer_leaves_the_default(value):
    """docs/engine.md: a value that is not a positive integer leaves the default of 1 GiB (a parser
    that took the leading digits would make "1e99" a cap of 1 byte and "512MB" one of 512)."""
    out = _run(MTC_PINNED_CAP_BYTES=value)
    assert out["cap"] == 1 << 30
    assert len(out["warnings"]) == 1
    assert out["warnings"][0][1] == (
        f"mtc_loader: MTC_PINNED_CAP_BYTES={value!r} is not an integer from 1 to 9223372036854775807; "
        "it is ignored and the default cap (1 GiB) is used")


@pytest.mark.parametrize("value,cap", [("4096", 4096), (" 65536 ", 65536)])
def test_pinned_cap_integer_is_taken(value, cap):
    out = _run(MTC_PINNED_CAP_BYTES=value)
    assert out == {"cap": cap, "warnings": []}


def test_variable_set_after_import_warns_when_read():
    """A variable set after import is read when the engine first needs it; its refusal is
    reported by the next stats() call."""
    code = """
        import os, warnings
        import mtc_loader
        os.environ["MTC_PINNED_CAP_BYTES"] = "2GiB"
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            cap = mtc_loader.stats()["pinned_cap_bytes"]
            mtc_loader.stats()
        print(cap, len(w), str(w[0].message) if w else "")
    """
    e = {k: v for k, v in subprocess_env().items() if not k.startswith("MTC_") or k == "MTC_TEST_INSTALLED"}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=package_parent(), env=e,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    cap, n, msg = r.stdout.strip().split(" ", 2)
    assert (int(cap), int(n)) == (1 << 30, 1), r.stdout
    assert "MTC_PINNED_CAP_BYTES='2GiB'" in msg


def test_build_switches_are_read_whole():
    """setup.py's boolean and word switches: a value they do not take stops the build, naming it."""
    for env, says in (({"MTC_DEBUG": "maybe"}, "MTC_DEBUG='maybe' is not a boolean"),
                      ({"MTC_SANITIZE": "memory"}, "MTC_SANITIZE='memory' is not one of 'address', 'thread'"),
                      # read whole even where liburing is found (and the switch would not matter)
                      ({"MTC_REQUIRE_LIBURING": "maybe"}, "MTC_REQUIRE_LIBURING='maybe' is not a boolean"),
                      ({"MTC_NO_LIBURING": "perhaps"}, "MTC_NO_LIBURING='perhaps' is not a boolean")):
        e = dict(os.environ, **env)
        r = subprocess.run([sys.executable, "setup.py", "--name"], cwd=os.path.dirname(os.path.dirname(
            os.path.abspath(__file__))), env=e, capture_output=True, text=True, timeout=300)
        assert r.returncode != 0 and says in r.stderr + r.stdout, r.stderr + r.stdout


def test_an_unknown_name_warns_once_with_the_closest_known_one():
    out = _run(MTC_TORCH_SHIN="0", MTC_ZZZ_QQ="1")
    msgs = [m for c, m in out["warnings"]]
    assert [m for m in msgs if "MTC_TORCH_SHIN" in m] == [
        "mtc_loader: the environment variable MTC_TORCH_SHIN is not one mtc_loader reads, and has no effect: "
        "did you mean MTC_TORCH_SHIM?"], msgs
    assert len([m for m in msgs if "MTC_ZZZ_QQ" in m and "docs/engine.md lists them" in m]) == 1, msgs
    assert len(msgs) == 2, msgs


def test_the_known_names_are_those_the_project_reads():
    """The list the warning goes by holds every MTC_* name the engine's table, setup.py, the
    package, the tests, benchmarks and tools read, and no other."""
    import re
    from mtc_loader._options import KNOWN_ENVIRONMENT
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "csrc", "engine", "env.c")) as f:
        engine = set(re.findall(r'\{"(MTC_[A-Z0-9_]+)"', f.read()))
    assert engine and engine <= KNOWN_ENVIRONMENT, engine - KNOWN_ENVIRONMENT
    read = set()
    for top in ("setup.py", "mtc_loader", "tests", "bench", "tools", "examples"):
        path = os.path.join(root, top)
        files = [path] if top.endswith(".py") else [os.path.join(d, n) for d, _, ns in os.walk(path)
                                                     for n in ns if n.endswith((".py", ".sh"))]
        for name in files:
            with open(name, errors="replace") as f:
                read |= set(re.findall(r"(?:environ(?:\.get)?\(?\[?|getenv\(|_env_(?:bool|word)\()[\"'](MTC_[A-Z0-9_]+)",
                                       f.read()))
    assert read <= KNOWN_ENVIRONMENT, read - KNOWN_ENVIRONMENT
    text = ""
    for top in ("setup.py", "csrc", "tests", "bench", "tools", "examples"):
        path = os.path.join(root, top)
        files = [path] if top.endswith(".py") else [os.path.join(d, n) for d, _, ns in os.walk(path)
                                                     for n in ns if n.endswith((".py", ".sh", ".c", ".h"))]
        for name in files:
            if os.path.basename(name) != "test_env.py":
                with open(name, errors="replace") as f:
                    text += f.read()
    unread = {n for n in KNOWN_ENVIRONMENT if not re.search(n + r"\b", text)}
    assert not unread, unread
