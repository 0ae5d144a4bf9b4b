"""Prints the wheels in DIR whose distribution this Python does not have installed (all of them
with --all), one path a line: what `bash tools/release/gpu_checks.sh frameworks` installs, without
dependency resolution, on a machine with no package index. Installing only what is missing
keeps the machine's own packages (pytest and its plugins, torch's needs) in charge. nvidia-*
wheels are never listed: an ``nvidia`` folder first on the path could stand in front of the
CUDA libraries torch loads (gpu_checks.sh takes only the nvtx3 headers out of that wheel).

    python3 tools/release/missing_wheels.py DIR [--all]
"""
from __future__ import annotations

import glob
import importlib.metadata
import os
import re
import sys


def main() -> int:
    folder = sys.argv[1]
    everything = "--all" in sys.argv[2:]
    for path in sorted(glob.glob(os.path.join(folder, "*.whl"))):
        name = re.sub(r"[-_.]+", "-", os.path.basename(path).split("-")[0]).lower()
        if name.startswith("nvidia-"):
            continue
        try:
            importlib.metadata.version(name)
            if not everything:
                continue
        except importlib.metadata.PackageNotFoundError:
            pass
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
