"""The framework integrations (``mtc_loader.lightning``, ``.accelerate``, ``.mmengine``) load on
attribute access. Where a framework is not installed, the attribute does not exist
(``hasattr`` is False, ``inspect.getmembers`` and ``help`` work), while importing or using the
submodule raises the ImportError that says what to install. Each case runs in a fresh
interpreter with the framework hidden (``sys.modules[name] = None`` makes its import fail)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from conftest import package_parent, subprocess_env

FRAMEWORKS = {
    "lightning": ("lightning", "pytorch_lightning"),
    "accelerate": ("accelerate",),
    "mmengine": ("mmengine",),
}
NEEDS = {"lightning": "needs PyTorch Lightning", "accelerate": "needs accelerate", "mmengine": "needs mmengine"}


def _run(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=package_parent(),
                       env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_missing_frameworks_are_no_attributes_but_import_says_what_to_install():
    hidden = [m for mods in FRAMEWORKS.values() for m in mods]
    out = _run(f"""
        import sys
        for m in {hidden!r}:
            sys.modules[m] = None
        import inspect, pydoc
        import mtc_loader
        for sub, needs in {NEEDS!r}.items():
            assert sub in dir(mtc_loader)
            assert not hasattr(mtc_loader, sub), sub
            assert getattr(mtc_loader, sub, "absent") == "absent"
            try:
                getattr(mtc_loader, sub)
            except AttributeError as e:
                assert needs in str(e), str(e)
                assert isinstance(e.__cause__, ImportError), repr(e.__cause__)
            else:
                raise AssertionError(sub + ": no AttributeError")
        names = dict(inspect.getmembers(mtc_loader))
        assert not set({NEEDS!r}) & set(names) and "start_copy" in names
        assert "start_copy" in pydoc.render_doc(mtc_loader)
        for sub, needs in {NEEDS!r}.items():
            for stmt in (f"import mtc_loader.{{sub}}", f"from mtc_loader import {{sub}}"):
                try:
                    exec(stmt)
                except ImportError as e:
                    assert needs in str(e), (stmt, str(e))
                else:
                    raise AssertionError(stmt + ": no ImportError")
            # still absent on a second look: a failed import leaves nothing behind
            assert not hasattr(mtc_loader, sub), sub
        print("ok")
    """)
    assert out.strip() == "ok"


def test_installed_framework_loads_on_attribute_access():
    """Also: mmengine's Runner is left as it is until mtc_loader.mmengine is imported, which adds
    its runner_type check to Runner.from_cfg, keeping its signature and documentation."""
    pytest.importorskip("mmengine", reason="needs mmengine (the test extra installs it)")
    out = _run("""
        import inspect, sys, warnings
        import mtc_loader
        assert "mtc_loader.mmengine" not in sys.modules
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # mmengine's imports warn (deprecations)
            from mmengine.runner import Runner
        before = Runner.__dict__["from_cfg"]
        assert before.__func__.__module__ == "mmengine.runner.runner", before.__func__.__module__
        signature, doc = inspect.signature(Runner.from_cfg), Runner.from_cfg.__doc__
        assert hasattr(mtc_loader, "mmengine")
        import mtc_loader.mmengine as m
        assert mtc_loader.mmengine is m
        after = Runner.__dict__["from_cfg"]
        assert after is not before and after.__func__.__wrapped__ is before.__func__
        assert inspect.signature(Runner.from_cfg) == signature and Runner.from_cfg.__doc__ == doc
        m._switch._install_runner_check()  # installed once
        assert Runner.__dict__["from_cfg"] is after
        print("ok")
    """)
    assert out.strip() == "ok"
