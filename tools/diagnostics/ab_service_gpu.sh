#!/bin/bash
# The prefetch service's rules, alternating processes on one machine (GPU): bench_train's launch
# loop and bench_loader's __next__ with the defaults (the service thread runs the early
# collection and the inline staging of small jobs, as any caller of start_copy does), with the
# service thread marked to skip both (skips: _engine.service_thread), and with both rules turned
# off for the whole process by their environment switches (off). One line per run.
# Usage: tools/diagnostics/ab_service_gpu.sh RUNS OUTDIR  (RUNS a multiple of 3 puts each arm first, second
# and last equally often)
set -u
runs=${1:-5}; out=${2:-/tmp/ab}; mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
SKIPS='import sys, runpy, mtc_loader._engine as e; e.keep_temporaries = e.service_thread; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name="__main__")'
TRAIN="bench/bench_train.py --config launch --methods ideal packed --rounds 2 --batches 80"
frac() { python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['results']['launch']['packed']; print(f\"{100*r['fraction_of_ideal']:.1f} next_steady_ms={r['next_steady_ms']:.3f}\")" "$1/bench_train.json" 2>&1 | tail -1; }
# one arm of bench_train: ARM RUN
train() {
  case "$1" in
  defaults) python3 $TRAIN --out "$out/$1$2" > "$out/$1$2.log" 2>&1 ;;
  skips) python3 -c "$SKIPS" $TRAIN --out "$out/$1$2" > "$out/$1$2.log" 2>&1 ;;
  off) MTC_EARLY_GC=0 MTC_INLINE_MAX_BYTES=0 python3 $TRAIN --out "$out/$1$2" > "$out/$1$2.log" 2>&1 ;;
  esac
  echo "train $1 $2: $(frac "$out/$1$2")"
}
# the arms' order rotates from run to run (defaults skips off, skips off defaults, off defaults
# skips, ...), so that a machine whose speed drifts during a run favours no arm
arms=(defaults skips off)
for i in $(seq "$runs"); do
  for k in 0 1 2; do train "${arms[$(( (i - 1 + k) % 3 ))]}" "$i"; done
done
LOADER="bench/bench_loader.py --workers 4 --step-ms 5 --methods packed_prefetch"
loader_defaults() { python3 $LOADER --out "$out/ldefaults$1" 2>&1 | grep -E "__next__" | sed "s/^/loader defaults $1: /"; }
loader_off() {
  MTC_EARLY_GC=0 MTC_INLINE_MAX_BYTES=0 python3 $LOADER --out "$out/loff$1" 2>&1 | grep -E "__next__" | sed "s/^/loader off $1: /"
}
# defaults, off, off, defaults
loader_defaults 1; loader_off 1; loader_off 2; loader_defaults 2
