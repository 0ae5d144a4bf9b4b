#!/usr/bin/env bash
# The GPU machine's checks, in one place (see docs/benchmarks.md for the figures they produced).
#   bash bench/gpu_checks.sh tests     # build in place; the whole test suite (CUDA tests run)
#   bash bench/gpu_checks.sh sanitize  # compute-sanitizer memcheck + racecheck over the CUDA tests
#   bash bench/gpu_checks.sh bench     # bench_copy.py and bench_loader.py
#   bash bench/gpu_checks.sh soak      # bench/soak.py (100,000 start_copy, 10,000 loader batches)
# Results go to $OUT (the device tool's output folder) or bench/results.
set -uo pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-bench/results}
mkdir -p "$out"
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | grep -v "root user" | tail -3
cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
cuda_tests="tests/test_copy_cuda.py tests/test_loader_cuda.py"
for t in tests/test_loader.py tests/test_faults.py tests/test_fuzz.py; do [ -f "$t" ] && cuda_tests="$cuda_tests $t"; done
case "${1:-tests}" in
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
    python3 bench/soak.py --out "$out" 2>&1 | tail -25 ;;
esac
