"""examples/mmengine_smoke.py: the switch and mmengine's Runner train a synthetic detection config
to the same losses on the CPU (skipped without the OpenMMLab stack)."""
import os
import subprocess
import sys
import warnings

import pytest

from conftest import subprocess_env

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("mmdet.models", reason="needs mmdet (README: OpenMMLab's stack)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_mmengine_smoke_gives_the_same_losses():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "mmengine_smoke.py")], env=subprocess_env(),
                       capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "base.py: Runner, 3 iterations" in out and "child.py: MTCRunner, 3 iterations" in out, out[-3000:]
    assert "gave the same losses over 3 iterations" in out, out[-3000:]
