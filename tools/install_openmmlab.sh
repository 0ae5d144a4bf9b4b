#!/usr/bin/env bash
# Installs OpenMMLab's stack into the current Python environment, for the tests and the benchmark
# on real mmdet3d / mmdet samples (tests/test_openmmlab.py, bench/bench_openmmlab.py): mmengine
# 0.10.7, mmcv 2.1.0 built from its source distribution with its ops (mmdet3d.structures imports
# mmcv.ops, so mmcv-lite does not do; no wheel of it exists for recent torch), mmdet 3.3.0 and
# mmdet3d 1.4.0 (without their runtime extras, which the structures and models do not need;
# mmdet's own needs are installed: mmdet3d.structures imports mmdet.models).
#
#   tools/install_openmmlab.sh [WORKDIR]
#
# Needs torch installed first (mmcv's ops are compiled against it), a C++ compiler, and a
# setuptools older than 81 (mmcv's setup.py imports pkg_resources): this script installs one.
# On 2 cores the mmcv build takes about 10 minutes (MAX_JOBS, default the CPU count). With
# MMCV_WHEEL_DIR set, a wheel of mmcv already there is installed instead of building one.
set -euo pipefail
work=${1:-$(mktemp -d)}
py=${PYTHON:-python3}
mkdir -p "$work"
"$py" -c 'import torch' || { echo "install_openmmlab: install torch first" >&2; exit 1; }
"$py" -m pip install -q "setuptools>=77.0.3,<81" wheel ninja numba "mmengine==0.10.7" \
    terminaltables shapely scipy pycocotools six tqdm
wheel=$(ls "${MMCV_WHEEL_DIR:-/nonexistent}"/mmcv-2.1.0-*.whl 2>/dev/null | head -1 || true)
if [ -z "$wheel" ]; then
    "$py" -m pip download -q --no-deps --no-binary :all: --no-build-isolation "mmcv==2.1.0" -d "$work"
    tar xzf "$work/mmcv-2.1.0.tar.gz" -C "$work"
    (cd "$work/mmcv-2.1.0" && MMCV_WITH_OPS=1 MAX_JOBS=${MAX_JOBS:-$(nproc)} \
        "$py" -m pip wheel -q --no-build-isolation --no-deps -w "$work/wheels" .)
    wheel=$(ls "$work"/wheels/mmcv-2.1.0-*.whl)
fi
"$py" -m pip install -q --no-deps "$wheel"
"$py" -m pip install -q --no-deps "mmdet==3.3.0" "mmdet3d==1.4.0"
# what mmdet3d's datasets and models import at run time (tests/test_openmmlab_models.py trains
# them); the two devkits without their own pins, which would move numpy and others
"$py" -m pip install -q pyquaternion trimesh pandas scikit-learn cachetools
"$py" -m pip install -q --no-deps lyft_dataset_sdk nuscenes-devkit
"$py" -c 'import mmcv.ops, mmdet.structures, mmdet3d.structures, mmdet3d.datasets, mmdet3d.models; print("install_openmmlab: mmcv", mmcv.__version__, "with ops")'
