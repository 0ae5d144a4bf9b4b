#!/usr/bin/env bash
# The GPU machine's checks, in one place (see docs/benchmarks.md for the figures they produced).
#   bash bench/gpu_checks.sh tests     # build in place; the whole test suite (CUDA tests run)
#   bash bench/gpu_checks.sh sanitize  # compute-sanitizer memcheck + racecheck over the CUDA tests
#   bash bench/gpu_checks.sh bench     # bench_copy.py and bench_loader.py
#   bash bench/gpu_checks.sh soak      # bench/soak.py (100,000 start_copy, 10,000 loader batches)
#   bash bench/gpu_checks.sh cuda      # build in place; the CUDA tests only (-m cuda)
#   bash bench/gpu_checks.sh train     # bench_train.py (both loops) and bench_loader.py with a 5 ms step
#   bash bench/gpu_checks.sh ab DIR    # bench_copy.py of this tree and of the tree in DIR (built in
#                                      # place there), alternating: new, old, old, new
#   bash bench/gpu_checks.sh profile   # profile_stages.py and a helper-thread sweep of 16 x 16 MB
#   bash bench/gpu_checks.sh sanitize-prefetch  # memcheck + racecheck over the prefetch CUDA tests
#   bash bench/gpu_checks.sh ab-next DIR  # bench_loader --step-ms 5 (packed_prefetch: the training
#                                      # thread's __next__) with this tree's package and DIR's,
#                                      # alternating: new, old, old, new
# Results go to $OUT (the device tool's output folder) or bench/results.
set -uo pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-bench/results}
mkdir -p "$out"
[ -z "${NO_INSTALL:-}" ] && python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | grep -v "root user" | tail -3
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
cuda)
    python3 -m pytest -q -m cuda tests -p no:cacheprovider 2>&1 | tee "$out/cuda_tests.log" | grep -E "passed|failed|FAILED" | tail -12 ;;
train)
    python3 bench/bench_train.py --workers 4 --batches "${TRAIN_BATCHES:-30}" --rounds 2 --out "$out" > "$out/train.log" 2>&1
    echo "bench_train rc=$?"; grep -vE "^\[|^wrote" "$out/train.log" | tail -26
    python3 bench/bench_loader.py --device cuda:0 --workers 4 --rounds 2 --step-ms 5 --out /tmp/loader_step \
        > "$out/loader.log" 2>&1
    echo "bench_loader rc=$?"; tail -12 "$out/loader.log" ;;
ab)
    old=${2:?ab needs the old tree}
    (cd "$old" && python3 setup.py build_ext --inplace -q 2>&1 | grep -i " error")
    for v in new old old new; do
        p=$PWD; [ $v = old ] && p=$(cd "$old" && pwd)
        echo "== $v ($p)" >> "$out/copy.log"
        PYTHONPATH=$p python3 bench/bench_copy.py --only seed16 seed4 seed64 4096x64B --rounds 12 --out /tmp/ab_$v \
            2>&1 | grep -E " mtc | to " >> "$out/copy.log"
    done
    cat "$out/copy.log" ;;
profile)
    { python3 bench/profile_stages.py --calls 100 --gc both
      for n in 4 8 14; do
          echo "== MTC_HELPER_THREADS=$n"
          MTC_HELPER_THREADS=$n python3 bench/bench_copy.py --only 16x16MB --rounds 6 --out /tmp/sweep_$n 2>&1 \
              | grep -E " mtc | to |reference"
      done; } 2>&1 | tee -a "$out/copy.log" ;;
sanitize-prefetch)
    timeout 110 "$cs" --tool memcheck --leak-check no \
        python3 -m pytest -q -p no:cacheprovider tests/test_prefetch_cuda.py -k "kept_alive or overlaps or bitwise or switches or context" \
        > "$out/sanitize.log" 2>&1
    echo "memcheck rc=$?"; grep -E "passed|failed|ERROR SUMMARY" "$out/sanitize.log" | tail -3
    timeout 60 "$cs" --tool racecheck \
        python3 -m pytest -q -p no:cacheprovider tests/test_prefetch_cuda.py -k "kept_alive or switches" >> "$out/sanitize.log" 2>&1
    echo "racecheck rc=$?"; grep -E "passed|failed|RACECHECK SUMMARY" "$out/sanitize.log" | tail -3 ;;
ab-next)
    old=${2:?ab-next needs the old tree}
    (cd "$old" && python3 setup.py build_ext --inplace -q 2>&1 | grep -i " error")
    for v in new old old new; do
        p=$PWD; [ $v = old ] && p=$(cd "$old" && pwd)
        echo "== $v ($p)" >> "$out/next.log"
        PYTHONPATH=$p python3 bench/bench_loader.py --device cuda:0 --workers 4 --rounds 2 --step-ms 5 \
            --methods packed_prefetch --out /tmp/next_$v 2>&1 | grep -E "PrefetchLoader  |__next__" >> "$out/next.log"
    done
    cat "$out/next.log" ;;
esac
