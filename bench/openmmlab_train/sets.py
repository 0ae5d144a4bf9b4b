"""What the synthetic sets (coco.py, nuscenes.py, waymo.py) share: the stamp in a set's root that
names the set written there, so that a run asking for the same set keeps it."""
from __future__ import annotations

import json
import os
from typing import Any, Optional


def kept(root: str, spec: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The summary the set under ``root`` was stamped with, when that set is ``spec``; else None."""
    path = os.path.join(root, "spec.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        summary = json.load(f)
    return dict(summary) if isinstance(summary, dict) and summary.get("spec") == spec else None


def stamp(root: str, summary: dict[str, Any]) -> dict[str, Any]:
    """Stamps the set just written under ``root`` with ``summary`` (which holds its ``spec``), and
    returns the summary."""
    with open(os.path.join(root, "spec.json"), "w") as f:
        json.dump(summary, f)
    return summary
