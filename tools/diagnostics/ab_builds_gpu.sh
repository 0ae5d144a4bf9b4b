#!/bin/bash
# A change on the copy or prefetch path against the build before it, in alternating processes on
# one machine (GPU): bench_train's launch loop (the loop fed one batch preloaded on the GPU is the
# ideal) and bench_loader's __next__ (4 workers, 5 ms step), for three arms: this tree (new), this
# tree with the early collection and the inline staging of small jobs off for the whole process
# (new_off: MTC_EARLY_GC=0 MTC_INLINE_MAX_BYTES=0), and the tree in OLD (old, built in place there).
# The arms' order rotates from run to run, so that a machine whose speed drifts favours none. One
# line per run and arm: % of ideal (whole epochs, and steady: from the first batch in hand), the
# training thread's steady __next__, the prefetch thread's CPU per batch. Every arm runs this tree's
# benchmarks (bench/), with the package of its own tree on PYTHONPATH.
# Usage: tools/diagnostics/ab_builds_gpu.sh OLD RUNS OUTDIR [LOADER_RUNS]
set -u
old=$(cd "${1:?the tree to compare with}" && pwd); runs=${2:-6}; out=${3:-/tmp/ab_builds}; lruns=${4:-2}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
(cd "$old" && python3 setup.py build_ext --inplace -q 2>&1 | grep -i " error")
TRAIN="bench/bench_train.py --config launch --methods ideal packed --rounds 2 --batches 80"
frac() {
  python3 -c "
import json, sys
r = json.load(open(sys.argv[1]))['results']['launch']['packed']
print(f\"{100 * r['fraction_of_ideal']:.1f} steady={100 * r['steady_fraction_of_ideal']:.1f} \"
      f\"next_steady_ms={r['next_steady_ms']:.3f} service_cpu_ms={r['prefetch_stats']['service_cpu_ms_per_batch']:.3f}\")" \
    "$1/bench_train.json" 2>&1 | tail -1
}
# one process of ARM: ARM RUN SCRIPT ARGS...
arm() {
  local a=$1 i=$2 root=$PWD; shift 2
  [ "$a" = old ] && root=$old
  if [ "$a" = new_off ]; then
    MTC_EARLY_GC=0 MTC_INLINE_MAX_BYTES=0 PYTHONPATH=$root python3 "$@"
  else
    PYTHONPATH=$root python3 "$@"
  fi
}
arms=(new new_off old)
for i in $(seq "$runs"); do
  for k in 0 1 2; do
    a=${arms[$(( (i - 1 + k) % 3 ))]}
    arm "$a" "$i" $TRAIN --out "$out/$a$i" > "$out/$a$i.log" 2>&1
    echo "train $a $i: $(frac "$out/$a$i")"
  done
done
LOADER="bench/bench_loader.py --device cuda:0 --workers 4 --rounds 2 --step-ms 5 --methods packed_prefetch"
for i in $(seq "$lruns"); do
  for k in 0 1 2; do
    a=${arms[$(( (i - 1 + k) % 3 ))]}
    arm "$a" "$i" $LOADER --out "$out/l$a$i" 2>&1 | grep -E "__next__" | sed "s/^/loader $a $i: /"
  done
done
