#!/usr/bin/env bash
# Downloads, on a machine with a package index, the wheels `bash tools/release/gpu_checks.sh frameworks`,
# `mmengine`, `openmmlab` and `openmmlab-train` install on the GPU machine (which has no network) where
# they are missing there: Lightning, accelerate, mmengine, mmdet, mmdet3d, pytest and hypothesis and their
# pure-Python or abi3 needs for CPython 3.12 on
# x86-64 Linux, never torch or the nvidia-* CUDA libraries (torch is installed there).
# nvidia-nvtx-cu12 is the header-only NVTX v3 (85 KB), the engine's build requirement: the
# GPU machine rebuilds the engine against it if its own build found no nvtx3 headers.
#   bash tools/release/fetch_wheels.sh [DIR]     # default DIR: .whl (ignored by git; carry it: [".whl"])
# The versions are those the integration tests were last run with on the CPU machine.
# mmengine's other needs: numpy, pyyaml (carried above), rich (the GPU machine has it) and
# opencv-python, which is installed with no dependency resolution and so never pulled: the GPU
# machine's opencv-python-headless gives the same cv2 module. Matplotlib: the Visualizer that
# every Runner builds imports it. mmdet3d's datasets and visualization import pyquaternion and
# trimesh (both pure Python; what an mmdet3d Runner imports besides, scipy and numba, is on the GPU
# machine; the devkits, nuscenes-devkit and lyft_dataset_sdk, only its metrics and converters
# import, and scikit-learn only an optional import of mmdet's). mmcv 2.1.0 comes as its sdist.
set -euo pipefail
dir=${1:-.whl}
mkdir -p "$dir"
wheels=(
    lightning==2.6.6 lightning-utilities==0.15.3 torchmetrics==1.9.0   # Lightning (lightning.pytorch)
    accelerate==1.15.0 huggingface_hub==2.4.0 safetensors==0.8.0 psutil==7.2.2  # accelerate
    PyYAML==6.0.3 tqdm==4.70.1 packaging==26.2                         # shared by both
    pytest==9.0.3 pluggy==1.7.0 iniconfig==2.3.1 pygments==2.21.0      # pytest
    hypothesis==6.155.2 sortedcontainers==2.4.0                        # hypothesis
    mmengine==0.10.7 addict==2.4.0 yapf==0.43.0 platformdirs==4.14.7 termcolor==3.3.0  # mmengine
    matplotlib==3.11.2 contourpy==1.3.3 cycler==0.12.1 fonttools==4.68.0 kiwisolver==1.5.1 \
    pillow==13.0.0 pyparsing==3.3.2 python-dateutil==2.9.0.post0 six==1.17.0  # mmengine's Visualizer
    nvidia-nvtx-cu12==12.9.79                                          # nvtx3 headers
    mmdet==3.3.0 mmdet3d==1.4.0 pycocotools==2.0.11 terminaltables==3.1.10 shapely==2.2.0 \
    setuptools==80.10.2                                                # openmmlab modes (mmcv's setup.py: <81)
    pyquaternion==0.9.9 trimesh==5.2.0                                 # mmdet3d.datasets, mmdet3d.visualization
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dir" "${wheels[@]}" 2>&1 \
    | grep -v "is ignored" || true
# mmcv 2.1.0 as its source distribution: no wheel of it exists for recent torch; the openmmlab
# modes build it on the GPU machine with its CPU ops
python3 -m pip download -q --no-deps --no-binary :all: -d "$dir" mmcv==2.1.0 2>&1 | grep -v "is ignored" || true
ls "$dir"/mmcv-2.1.0.tar.gz
ls "$dir"/*.whl | wc -l | xargs echo "wheels in $dir:"
du -sh "$dir"
