"""The test suite's own guard against a hung test: faulthandler's dump of every thread, written
to conftest's terminal_stderr(), reaches the terminal even though the run then ends before pytest
shows what it captured (the dump written to sys.stderr would be lost with the capture)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

_TESTS = os.path.dirname(os.path.abspath(__file__))

_CONFTEST = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("mtc_conftest", {os.path.join(_TESTS, "conftest.py")!r})
mtc_conftest = importlib.util.module_from_spec(spec)
sys.modules["mtc_conftest"] = mtc_conftest
spec.loader.exec_module(mtc_conftest)
pytest_configure = mtc_conftest.pytest_configure  # the session's config, for terminal_stderr()
pytest_unconfigure = mtc_conftest.pytest_unconfigure
"""

_HANG = """
import faulthandler, sys, time
import mtc_conftest

def test_that_hangs_in_its_own_frame():
    print("captured output")
    where = mtc_conftest.terminal_stderr() if TO_TERMINAL else sys.stderr
    faulthandler.dump_traceback_later(1, exit=True, file=where)
    time.sleep(60)
"""


@pytest.mark.parametrize("to_terminal", [True, False])
def test_a_hung_tests_dump_reaches_the_terminal(tmp_path, to_terminal):
    (tmp_path / "conftest.py").write_text(textwrap.dedent(_CONFTEST))
    test = tmp_path / "test_hang.py"
    test.write_text(textwrap.dedent(_HANG).replace("TO_TERMINAL", repr(to_terminal)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                        str(test)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out  # faulthandler's exit=True: the run ends, no summary
    assert "passed" not in out and "failed" not in out, out
    if to_terminal:
        assert "Timeout (0:00:01)!" in r.stderr, out
        assert "test_that_hangs_in_its_own_frame" in r.stderr, out  # the hung test's frame
    else:  # what the guard replaces: the dump went into the capture, gone with the process
        assert "test_that_hangs_in_its_own_frame" not in out, out
