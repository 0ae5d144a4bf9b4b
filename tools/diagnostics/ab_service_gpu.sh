#!/bin/bash
# The prefetch service's rules, alternating processes on one machine (GPU): bench_train's launch
# loop and bench_loader's __next__ with the defaults (the service thread runs the early
# collection and the inline staging of small jobs, as any caller of start_copy does), with the
# service thread marked to skip both (skips: _engine.service_thread), and with both rules turned
# off for the whole process by their environment switches (off). One line per run.
# Usage: tools/diagnostics/ab_service_gpu.sh RUNS OUTDIR
set -u
runs=${1:-5}; out=${2:-/tmp/ab}; mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
SKIPS='import sys, runpy, mtc_loader._engine as e; e.keep_temporaries = e.service_thread; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name="__main__")'
TRAIN="bench/bench_train.py --config launch --methods ideal packed --rounds 2 --batches 80"
frac() { python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['results']['launch']['packed']; print(f\"{100*r['fraction_of_ideal']:.1f} next_steady_ms={r['next_steady_ms']:.3f}\")" "$1/bench_train.json" 2>&1 | tail -1; }
for i in $(seq "$runs"); do
  python3 $TRAIN --out "$out/defaults$i" > "$out/defaults$i.log" 2>&1; echo "train defaults $i: $(frac $out/defaults$i)"
  python3 -c "$SKIPS" $TRAIN --out "$out/skips$i" > "$out/skips$i.log" 2>&1; echo "train skips $i: $(frac $out/skips$i)"
  MTC_EARLY_GC=0 MTC_INLINE_MAX_BYTES=0 python3 $TRAIN --out "$out/off$i" > "$out/off$i.log" 2>&1; echo "train off $i: $(frac $out/off$i)"
done
LOADER="bench/bench_loader.py --workers 4 --step-ms 5 --methods packed_prefetch"
for i in 1 2; do
  python3 $LOADER --out "$out/ldefaults$i" 2>&1 | grep -E "__next__" | sed "s/^/loader defaults $i: /"
  MTC_EARLY_GC=0 MTC_INLINE_MAX_BYTES=0 python3 $LOADER --out "$out/loff$i" 2>&1 | grep -E "__next__" | sed "s/^/loader off $i: /"
done
