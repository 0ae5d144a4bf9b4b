#!/usr/bin/env bash
# The GPU machine's checks, in one place (see docs/benchmarks.md for the figures they produced).
#   bash tools/release/gpu_checks.sh tests     # build in place; the whole test suite (CUDA tests run)
#   bash tools/release/gpu_checks.sh sanitize  # compute-sanitizer memcheck + racecheck over the CUDA tests
#   bash tools/release/gpu_checks.sh bench     # bench_copy.py and bench_loader.py; soak: tools/diagnostics/soak.py
#   bash tools/release/gpu_checks.sh cuda      # build in place; the CUDA tests only (-m cuda)
#   bash tools/release/gpu_checks.sh train     # bench_train.py (both loops) and bench_loader.py with a 5 ms step
#   bash tools/release/gpu_checks.sh profile   # profile_stages.py and a helper-thread sweep of 16 x 16 MB
#   bash tools/release/gpu_checks.sh sanitize-prefetch  # memcheck + racecheck over the prefetch CUDA tests
#   bash tools/release/gpu_checks.sh frameworks  # Lightning, accelerate and launcher tests, then
#       torch.profiler's and the engine's NVTX ranges (tests/nvtx_tool.c) over a prefetching loop
#   bash tools/release/gpu_checks.sh release    # tools/release/run_benchmarks.sh: every benchmark
#       of docs/benchmarks.md (~7 min on one H100) and a preview of the page
#   bash tools/release/gpu_checks.sh openmmlab  # OpenMMLab's stack set up offline (mmcv 2.1.0 built
#       with its CPU ops), then tests/test_openmmlab.py and bench/bench_openmmlab.py
#   bash tools/release/gpu_checks.sh openmmlab-train  # that set-up, then bench_openmmlab_train.py per model of
#       TRAIN_MODELS (yolov3 centerpoint mvfcos3d), TRAIN_PAIRS (6) pairs of TRAIN_ARMS (plain,switched; or
#       switched,ahead) each, sharing the time until TRAIN_DEADLINE_S (530) by weight (2 : 3 : 3)
#   bash tools/release/gpu_checks.sh mmengine  # the mmengine tests and bench/bench_mmengine.py
# Wheels carried in .whl (tools/release/fetch_wheels.sh) go to /tmp/site where missing (no index;
# FORCE_WHEELS=1: all). Dry runs without a GPU: FRAMEWORKS_ON_CPU=1, RELEASE_DEVICE=cpu
# (RELEASE_QUICK=1: --quick), TRAIN_DEVICE=cpu TRAIN_QUICK=1. NO_INSTALL=1 skips pip -e;
# SETUP_ONLY=1 stops openmmlab after its set-up (then: export PYTHONPATH=$PWD:/tmp/site).
# A/B comparisons of two builds: tools/diagnostics/ab_pairs_gpu.sh.
# Results go to $OUT (the device tool's output folder) or bench/results.
set -uo pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-bench/results}
mkdir -p "$out"
[ -z "${NO_INSTALL:-}" ] && python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | grep -v "root user" | tail -3
cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
cuda_tests="tests/test_copy_cuda.py tests/test_loader_cuda.py tests/test_loader.py tests/test_faults.py tests/test_fuzz.py"
# carried_wheels [WHEEL...]: the carried wheels missing here (all with FORCE_WHEELS=1) and the WHEELs
# named, into /tmp/site, which goes on PYTHONPATH after this tree; build_here: the engine in place
carried_wheels() {
    local whl
    [ -d .whl ] && whl="$(python3 tools/release/missing_wheels.py .whl ${FORCE_WHEELS:+--all}) $*"
    [ -n "${whl// }" ] && echo "installing into /tmp/site: $(for w in $whl; do basename "$w"; done | tr '\n' ' ')" \
        && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            $whl 2>&1 | grep -v "root user"
    export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
}
build_here() {  # --force: a second build, its log appended
    [ "${1:-}" = --force ] || : > "$out/build.log"
    python3 setup.py build_ext --inplace -q "$@" >> "$out/build.log" 2>&1 || { tail -20 "$out/build.log"; exit 1; }
}
# openmmlab_setup: OpenMMLab's stack on a machine with no index: the carried wheels (.whl) that
# are missing here, and setuptools<81, into /tmp/site; mmcv 2.1.0 built from the carried sdist
# with its CPU ops (no GPU visible to the build: what mmdet3d.structures imports; training a model
# whose step calls no mmcv kernel needs no more); the engine in place. Exits on a failure.
openmmlab_setup() {
    local site=/tmp/site
    carried_wheels .whl/setuptools-*.whl
    if ! python3 -c "import mmcv.ops" 2>/dev/null; then
        rm -rf /tmp/mmcv-2.1.0 && tar xzf .whl/mmcv-2.1.0.tar.gz -C /tmp
        local t0=$SECONDS
        (cd /tmp/mmcv-2.1.0 && CUDA_VISIBLE_DEVICES= MMCV_WITH_OPS=1 MAX_JOBS=$(nproc) python3 -m pip wheel -q \
            --no-build-isolation --no-deps -w /tmp/mmcv_wheel . > "$out/mmcv_build.log" 2>&1) \
            || { tail -20 "$out/mmcv_build.log"; exit 1; }
        echo "mmcv built with its CPU ops in $(( SECONDS - t0 )) s"
        python3 -m pip install -q --no-index --no-deps --target "$site" /tmp/mmcv_wheel/mmcv-*.whl 2>&1 | grep -v "root user"
    fi
    build_here
    python3 -W ignore -c "import torch, mmcv.ops, mmdet, mmdet3d.structures, mmdet3d.datasets, mmdet3d.models; print('torch', torch.__version__, '| mmcv',
        mmcv.__version__, '| mmdet', mmdet.__version__, '| cuda:', torch.cuda.is_available())" 2>&1 \
        | tee "$out/openmmlab_versions.log" || exit 1
}
case "${1:-tests}" in
release)
    # tools/release/run_benchmarks.sh into $out/release (with a preview of the page and an archive)
    bash tools/release/run_benchmarks.sh --out "$out/release" --device "${RELEASE_DEVICE:-cuda:0}" \
        ${RELEASE_QUICK:+--quick} ;;
tests)
    python3 -m pytest -q tests -p no:cacheprovider 2>&1 | tee "$out/tests.log" | tail -8 ;;
sanitize)
    timeout 500 "$cs" --tool memcheck --leak-check no --target-processes all \
        python3 -m pytest -q -p no:cacheprovider -m cuda $cuda_tests > "$out/memcheck.log" 2>&1
    echo "memcheck rc=$?"; grep -E "passed|failed|ERROR SUMMARY" "$out/memcheck.log" | tail -3
    timeout 300 "$cs" --tool racecheck --target-processes all \
        python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_copy_cuda.py tests/test_loader_cuda.py \
        -k "seed_batch or batched or mixed or packed_batches or stream" > "$out/racecheck.log" 2>&1
    echo "racecheck rc=$?"; grep -E "passed|failed|RACECHECK SUMMARY" "$out/racecheck.log" | tail -3 ;;
bench)
    python3 bench/bench_copy.py --out "$out" > "$out/bench_copy.log" 2>&1; echo "bench_copy rc=$?"
    grep -vE "^\[|mtc_loader.stats" "$out/bench_copy.log" | tail -64
    python3 bench/bench_loader.py --device cuda:0 --workers 2 4 8 --out "$out" > "$out/bench_loader.log" 2>&1
    echo "bench_loader rc=$?"; tail -30 "$out/bench_loader.log" ;;
soak)
    python3 tools/diagnostics/soak.py --out "$out" 2>&1 | tail -25 ;;
cuda)
    python3 -m pytest -q -m cuda tests -p no:cacheprovider 2>&1 | tee "$out/cuda_tests.log" | grep -E "passed|failed|FAILED" | tail -12 ;;
train)
    python3 bench/bench_train.py --workers 4 --batches "${TRAIN_BATCHES:-30}" --rounds 2 --out "$out" > "$out/train.log" 2>&1
    echo "bench_train rc=$?"; grep -vE "^\[|^wrote" "$out/train.log" | tail -26
    python3 bench/bench_loader.py --device cuda:0 --workers 4 --rounds 2 --step-ms 5 --out /tmp/loader_step \
        > "$out/loader.log" 2>&1
    echo "bench_loader rc=$?"; tail -12 "$out/loader.log" ;;
profile)
    { python3 tools/diagnostics/profile_stages.py --calls 100 --gc both
      for n in 4 8 14; do
          echo "== MTC_HELPER_THREADS=$n"
          MTC_HELPER_THREADS=$n python3 bench/bench_copy.py --only 16x16MB --rounds 6 --out /tmp/sweep_$n 2>&1 \
              | grep -E " mtc | to |reference"
      done; } 2>&1 | tee -a "$out/copy.log" ;;
sanitize-prefetch)
    timeout 300 "$cs" --tool memcheck --leak-check no \
        python3 -m pytest -q -p no:cacheprovider tests/test_prefetch_cuda.py -k "kept_alive or overlaps or bitwise or switches or context" \
        > "$out/sanitize.log" 2>&1
    echo "memcheck rc=$?"; grep -E "passed|failed|ERROR SUMMARY" "$out/sanitize.log" | tail -3
    timeout 60 "$cs" --tool racecheck \
        python3 -m pytest -q -p no:cacheprovider tests/test_prefetch_cuda.py -k "kept_alive or switches" >> "$out/sanitize.log" 2>&1
    echo "racecheck rc=$?"; grep -E "passed|failed|RACECHECK SUMMARY" "$out/sanitize.log" | tail -3 ;;
frameworks)
    carried_wheels
    # the nvtx3 headers only (never an nvidia folder on the path, in front of torch's CUDA libraries)
    for w in .whl/nvidia_nvtx_cu12-*.whl; do [ -f "$w" ] && python3 -m zipfile -e "$w" /tmp/nvtx_wheel; done
    # the engine in place, with NVTX: its own search first (nvidia.nvtx, $CUDA_HOME/include), then the carried headers
    build_here
    if ! python3 -c "from mtc_loader import _engine; assert _engine.nvtx_info()['compiled']" 2>/dev/null \
        && [ -f /tmp/nvtx_wheel/nvidia/nvtx/include/nvtx3/nvToolsExt.h ]; then
        echo "rebuilding the engine with the carried nvtx3 headers"
        export MTC_NVTX_INCLUDE=/tmp/nvtx_wheel/nvidia/nvtx/include  # test_nvtx.py builds its tool with them too
        build_here --force
    fi
    python3 - <<'PY' 2>&1 | tee "$out/versions.log" || exit 1
import importlib.metadata as md
import torch
from mtc_loader import _engine
def v(n):
    try:
        return md.version(n)
    except md.PackageNotFoundError:
        return "-"
print("torch", torch.__version__, "| cuda:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
      "|", ", ".join(f"{n} {v(n)}" for n in ("lightning", "pytorch-lightning", "accelerate", "pytest", "hypothesis")))
print("engine nvtx:", _engine.nvtx_info())
import accelerate, lightning.pytorch  # noqa: F401  (fail here: the tests would only skip)
import os
assert torch.cuda.is_available() or os.environ.get("FRAMEWORKS_ON_CPU"), "no CUDA device: the CUDA variants would skip"
PY
    timeout 360 python3 -m pytest -q -p no:cacheprovider -rs tests/test_lightning.py tests/test_accelerate.py \
        tests/test_profiler.py tests/test_nvtx.py tests/test_batch_to.py \
        "tests/test_loader.py::test_packed_collate_built_in_a_launcher" > "$out/frameworks_tests.log" 2>&1
    echo "tests rc=$?"; grep -E "passed|failed|FAILED|ERROR|SKIPPED" "$out/frameworks_tests.log" | tail -15
    # torch.profiler (every thread, CPU + CUDA) over examples/profile_prefetch.py: Chrome trace into $out
    python3 examples/profile_prefetch.py "$out/trace.json" 2>&1 | grep -v "^USDT\|profiler_st" | tee "$out/profile.log"
    echo "profile_prefetch rc=${PIPESTATUS[0]}"
    python3 tools/diagnostics/trace_summary.py "$out/trace.json" 2>&1 | tee -a "$out/profile.log"
    # the same loop with an NVTX tool attached (as Nsight Systems attaches): the engine's ranges, workers included
    inc=$(python3 -c "import sys; sys.path.insert(0, 'tests'); from test_nvtx import nvtx_headers; print(nvtx_headers() or '')")
    [ -z "$inc" ] && [ -d /tmp/nvtx_wheel/nvidia/nvtx/include ] && inc=/tmp/nvtx_wheel/nvidia/nvtx/include
    if [ -n "$inc" ] && cc -shared -fPIC -O1 -I "$inc" tests/nvtx_tool.c -o /tmp/nvtx_tool.so -lpthread; then
        rm -f /tmp/nvtx.log
        NVTX_INJECTION64_PATH=/tmp/nvtx_tool.so MTC_NVTX_LOG=/tmp/nvtx.log MTC_NVTX_TIMES=1 \
            python3 examples/profile_prefetch.py /tmp/trace_nvtx.json > /tmp/profile_nvtx.log 2>&1
        echo "profile_prefetch with the NVTX tool rc=$?"
        python3 tools/diagnostics/nvtx_summary.py /tmp/nvtx.log 2>&1 | tee -a "$out/profile.log"
    else
        echo "no nvtx3 headers or C compiler: NVTX ranges not recorded" | tee -a "$out/profile.log"
    fi ;;
openmmlab)
    openmmlab_setup
    [ -n "${SETUP_ONLY:-}" ] && exit 0
    timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/test_openmmlab.py > "$out/openmmlab_tests.log" 2>&1
    echo "tests rc=$?"; grep -E "passed|failed|FAILED|ERROR" "$out/openmmlab_tests.log" | tail -15
    python3 bench/bench_openmmlab.py --device cuda:0 --out "$out" > "$out/bench_openmmlab.log" 2>&1
    echo "bench_openmmlab rc=$?"; grep -vE "^wrote" "$out/bench_openmmlab.log" | tail -12 ;;
openmmlab-train)
    t_mode=$SECONDS
    openmmlab_setup
    train=/tmp/openmmlab_train
    rm -rf "$train" && mkdir -p "$train"
    # few files back (the device tool brings back 8): the set-up's logs go into the archive
    mv "$out/mmcv_build.log" "$out/build.log" "$out/openmmlab_versions.log" "$train/" 2>/dev/null
    models=${TRAIN_MODELS:-yolov3 centerpoint mvfcos3d}
    deadline=${TRAIN_DEADLINE_S:-530}
    weight() { case $1 in yolov3) echo 2 ;; *) echo 3 ;; esac; }
    weights=0
    for m in $models; do weights=$(( weights + $(weight "$m") )); done
    echo "set-up: $(( SECONDS - t_mode )) s" | tee "$out/openmmlab_train.log"
    for m in $models; do
        # this model's share of the time left, by weight among the models still to run
        w=$(weight "$m")
        budget=$(( (deadline - (SECONDS - t_mode)) * w / weights ))
        weights=$(( weights - w ))
        [ "$budget" -lt 60 ] && budget=60
        echo "== $m: --budget-s $budget, from $(( SECONDS - t_mode )) s" | tee -a "$out/openmmlab_train.log"
        timeout $(( budget + 120 )) python3 bench/bench_openmmlab_train.py --model "$m" \
            --device "${TRAIN_DEVICE:-cuda:0}" ${TRAIN_PAIRS:+--pairs $TRAIN_PAIRS} ${TRAIN_ARMS:+--arms $TRAIN_ARMS} --budget-s "$budget" \
            ${TRAIN_QUICK:+--quick} --out "$train" > "$train/$m.log" 2>&1
        echo "$m rc=$? ($(( SECONDS - t_mode )) s)" | tee -a "$out/openmmlab_train.log"
        grep -E "^(data|stand-ins|  |plan|arm |deadline)" "$train/$m.log" >> "$out/openmmlab_train.log"
        # the summary: from the report's heading to its end
        awk -v m="$m" 'index($0, m " (") == 1 {on = 1} on && !/^wrote/' "$train/$m.log" \
            | tee -a "$out/openmmlab_train.log"
        cp "$train/bench_openmmlab_train_$m.json" "$out/" 2>/dev/null
    done
    tar -C /tmp -czf "$out/openmmlab_train.tgz" --exclude='*_records.json' --exclude='*_plan.json' openmmlab_train ;;
mmengine)
    carried_wheels
    build_here
    python3 -W ignore -c "import torch, mmengine, cv2, matplotlib, mtc_loader.mmengine; print('torch', torch.__version__, '| mmengine',
        mmengine.__version__, '| cv2', cv2.__version__, '| cuda:', torch.cuda.is_available())" 2>&1 | tee "$out/mmengine_versions.log"
    timeout 420 python3 -m pytest -q -p no:cacheprovider -rs tests/test_mmengine.py tests/test_containers.py \
        > "$out/mmengine_tests.log" 2>&1
    echo "tests rc=$?"; grep -E "passed|failed|FAILED|ERROR|SKIPPED" "$out/mmengine_tests.log" | tail -15
    python3 bench/bench_mmengine.py --device cuda:0 --workers 2 4 --out "$out" > "$out/bench_mmengine.log" 2>&1
    echo "bench_mmengine rc=$?"; grep -vE "^wrote" "$out/bench_mmengine.log" | tail -14 ;;
esac
