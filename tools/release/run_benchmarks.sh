#!/usr/bin/env bash
# The benchmark run of a release, in one command, on a GPU machine: the figures of
# docs/benchmarks.md all come from the run this script makes.
#
#   tools/release/run_benchmarks.sh [--quick] [--device cuda:0] [--out DIR] [--no-render]
#   tools/release/run_benchmarks.sh --models [--quick] [--device cuda:0] [--out DIR] [--no-render]
#
# It runs bench/bench_copy.py (3 processes), bench/bench_loader.py, bench/bench_files.py and
# bench/bench_train.py (2 processes), each process writing its JSON and log into
# DIR/<benchmark>/<n>/ (DIR: bench/results/release/ by default, emptied first), then renders
# docs/benchmarks.md's tables and plots from that folder (tools/release/render_results.py).
# With --out elsewhere, the page is rendered into DIR/preview/benchmarks.md instead, with its
# plots beside it, and DIR is packed into DIR.tgz too: copy DIR to bench/results/release/ and run
# `python3 tools/release/render_results.py` to put it on the page.
#
# About 7 minutes on one H100. RELEASE_BUDGET_S (default 420) caps the benchmarks' time: each
# process gets its own cap, or what is left of the budget; one killed at its cap writes no JSON,
# and the page renders from the others. --quick runs a few rounds of each (a minute or two): a
# check that everything runs, not figures for the page. Without a GPU: --device cpu --quick.
# MTC_BENCH_COMMIT names the commit where the tree has no git history.
#
# --models runs the real models instead, into DIR/models/ (the rest of DIR is kept, so run it
# after the benchmarks, on the same build): bench/bench_openmmlab_train.py for each model of
# RELEASE_MODELS (default: yolov3 centerpoint mvfcos3d), 6 pairs of plain and switched arms
# each, sharing MODELS_BUDGET_S (default 530) seconds by weights 2 : 3 : 3. It needs OpenMMLab's
# stack (tools/install_openmmlab.sh) and mmdet3d's runtime imports; about 9 minutes.
set -uo pipefail
cd "$(dirname "$0")/../.."
quick="" dev=cuda:0 out=bench/results/release render=1 models=""
while [ $# -gt 0 ]; do
    case "$1" in
    --quick) quick=1 ;;
    --device) dev=${2:?--device needs a device}; shift ;;
    --out) out=${2:?--out needs a folder}; shift ;;
    --no-render) render="" ;;
    --models) models=1 ;;
    -h|--help) sed -n '2,26p' "$0" | cut -c3-; exit 0 ;;
    *) echo "unknown argument: $1 (--help)" >&2; exit 2 ;;
    esac
    shift
done
export PYTHONUNBUFFERED=1
export MTC_BENCH_COMMIT=${MTC_BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
default_out=0
[ "$(realpath -m "$out")" = "$(realpath -m bench/results/release)" ] && default_out=1
if [ -n "$models" ]; then
    rm -rf "$out/models" && mkdir -p "$out/models" || exit 1
else
    rm -rf "$out" && mkdir -p "$out" || exit 1
fi
python3 -c "import mtc_loader; print('mtc_loader', mtc_loader.__version__, 'from', mtc_loader.__file__,
      '| FileTensor reader:', mtc_loader.file_reader())" || exit 1
t0=$SECONDS
budget=${RELEASE_BUDGET_S:-420}
# one NAME N CAP SCRIPT ARGS...: one benchmark process into $out/NAME/N, killed after CAP seconds
# or when the budget is spent
one() {
    local name=$1 n=$2 cap=$3 left rc
    shift 3
    left=$(( budget - (SECONDS - t0) ))
    [ "$left" -lt "$cap" ] && cap=$left
    if [ "$cap" -lt 20 ]; then echo "$name $n: skipped, the budget is spent"; return; fi
    mkdir -p "$out/$name/$n"
    timeout "$cap" python3 "$@" ${quick:+--quick} --out "$out/$name/$n" > "$out/$name/$n/log.txt" 2>&1
    rc=$?
    echo "$name $n: rc=$rc ($(( SECONDS - t0 )) s; cap $cap s)"
    [ $rc -ne 0 ] && tail -5 "$out/$name/$n/log.txt"
}
# full ARGS...: ARGS in a full run, nothing under --quick
full() { [ -z "$quick" ] && echo "$@"; }
if [ -n "$models" ]; then
    budget=${MODELS_BUDGET_S:-530}
    weight() { case $1 in yolov3) echo 2 ;; *) echo 3 ;; esac; }
    weights=0
    for m in ${RELEASE_MODELS:-yolov3 centerpoint mvfcos3d}; do weights=$(( weights + $(weight "$m") )); done
    for m in ${RELEASE_MODELS:-yolov3 centerpoint mvfcos3d}; do
        # this model's share of the time left, by weight among the models still to run
        w=$(weight "$m")
        share=$(( (budget - (SECONDS - t0)) * w / weights ))
        weights=$(( weights - w ))
        [ "$share" -lt 60 ] && share=60
        mkdir -p "$out/models/$m"
        timeout $(( share + 120 )) python3 bench/bench_openmmlab_train.py --model "$m" --device "$dev" \
            --pairs "${MODELS_PAIRS:-6}" --budget-s "$share" ${quick:+--quick} --out "$out/models/$m" \
            > "$out/models/$m/log.txt" 2>&1
        rc=$?
        echo "models $m: rc=$rc ($(( SECONDS - t0 )) s; share $share s)"
        [ $rc -ne 0 ] && tail -5 "$out/models/$m/log.txt"
    done
    echo "JSON files: $(find "$out/models" -name 'bench_openmmlab_train_*.json' | wc -l)"
else
for n in 1 2 3; do
    one copy $n 75 bench/bench_copy.py --device "$dev" $(full --rounds "${COPY_ROUNDS:-12}")
done
one loader 1 75 bench/bench_loader.py --device "$dev" --workers 4 $(full --rounds 3) --step-ms 5
# the data files outside the results (about 440 MB; a run cut short leaves them behind)
one files 1 75 bench/bench_files.py --device "$dev" --dir /tmp/mtc_release_files $(full --rounds 2)
for n in 1 2; do
    one train $n 100 bench/bench_train.py --device "$dev" --workers 4 \
        $(full --batches "${TRAIN_BATCHES:-30}" --rounds 1)
done
echo "JSON files: $(find "$out" -name 'bench_*.json' | wc -l) of 7"
fi
[ -z "$render" ] && exit 0
if [ $default_out = 1 ]; then
    python3 tools/release/render_results.py
else
    mkdir -p "$out/preview" && cp docs/benchmarks.md "$out/preview/benchmarks.md"
    python3 tools/release/render_results.py --results "$out" --page "$out/preview/benchmarks.md"
    tar -C "$(dirname "$out")" -czf "$out.tgz" "$(basename "$out")" && echo "archive: $out.tgz"
fi
