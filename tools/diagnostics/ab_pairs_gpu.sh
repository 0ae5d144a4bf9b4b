#!/bin/bash
# This tree against another build, in pairs of processes on one machine (GPU), the pair's order
# rotating (new old, old new, ...) so that a machine whose speed drifts favours neither build.
# Per arm (AB_PARTS, default "train gpu ref"):
#   train: bench_train's launch-bound loops (AB_CONFIGS, default launch4: the multi-camera loop
#          under bf16 autocast, and launch), AB_METHODS (default: ideal packed, i.e. the
#          preloaded loop against PackedCollate + PrefetchLoader), AB_TRAIN_ROUNDS (2) rounds
#          of 60 batches;
#   gpu:   the GPU-bound loop, AB_GPU_BATCHES (60) batches, in every pair (AB_GPU=first: only in
#          pair FIRST; AB_GPU=0: in none). The whole-epoch figure carries the epoch's first batch (a wait no loader
#          avoids); over 30 batches of this 47 ms step that alone is about 1.3%;
#   ref:   the reference's harness on seed16 (bench_reference.py: start_copy's mean against .to(),
#          AB_REF_RUNS (2) runs, and its latency distribution);
#   stages: where one start_copy's time goes (profile_stages.py: the engine's stage counters and
#          its driver calls per call), collector on.
# AB_PREV=TREE adds a third arm, "prev" (say the build before this change, beside the older
# build OLD that a target names); the three arms' order rotates from pair to pair.
# Every arm runs this tree's benchmarks and diagnostics with its own build's package on
# PYTHONPATH. One line per pair, arm and figure in OUTDIR/ab.log; each process's output in
# OUTDIR/arms.tgz, written again after every arm (a scratch folder holds the processes' files, so
# that OUTDIR holds those two files alone, for machines that send few files back);
# tools/diagnostics/ab_table.py OUTDIR/ab.log ... puts the pairs side by side.
# Usage: tools/diagnostics/ab_pairs_gpu.sh OLD FIRST LAST OUTDIR [DEADLINE_S]
#   pairs FIRST..LAST (several calls can share the rotation); a pair that would start after
#   DEADLINE_S seconds (default 540) is not started.
set -u
old=$(cd "${1:?the tree to compare with}" && pwd); first=${2:-1}; last=${3:-5}; out=${4:-/tmp/ab_pairs}
deadline=${5:-540}
mkdir -p "$out"
scratch=$(mktemp -d) && trap 'rm -rf "$scratch"' EXIT
pack() {  # every arm's files so far, in OUTDIR/arms.tgz
  local tgz; tgz=$(mktemp) && (cd "$scratch" && tar czf "$tgz" .) && mv "$tgz" "$out/arms.tgz"
}
export PYTHONUNBUFFERED=1
(cd "$old" && python3 setup.py build_ext --inplace -q 2>&1 | grep -i " error")
prev=
if [ -n "${AB_PREV:-}" ]; then
  prev=$(cd "$AB_PREV" && pwd)
  (cd "$prev" && python3 setup.py build_ext --inplace -q 2>&1 | grep -i " error")
fi
TRAIN="bench/bench_train.py --config ${AB_CONFIGS:-launch4 launch} --methods ${AB_METHODS:-ideal packed} --rounds ${AB_TRAIN_ROUNDS:-2} --batches 60"
GPU="bench/bench_train.py --config gpu --methods ideal packed --rounds 1 --batches ${AB_GPU_BATCHES:-60}"
REF="bench/bench_reference.py --runs ${AB_REF_RUNS:-2} --iters 300 --warmup 50 --calls 500 --baseline-calls 100 --only seed16"
STAGES="tools/diagnostics/profile_stages.py --device cuda:0 --calls 300 --gc on"
summary() {  # ARM PAIR DIR: the figures of one arm
  python3 - "$@" <<'EOF'
import json, sys
arm, pair, d = sys.argv[1:4]
r = {}
for part in ("train", "gpu"):
    try:
        r.update(json.load(open(f"{d}/{part}/bench_train.json"))["results"])
    except OSError:
        pass
nan = float("nan")
sw = lambda m: m.get("switches", {}).get("training", [nan])[0]
off = lambda m: m.get("step_off_cpu_ms", nan)
cpu = lambda m: m.get("step_cpu_ms", nan)
try:
    for c in [c for c in ("launch4", "launch5", "launch", "gpu") if c in r]:
        i = r[c]["ideal"]
        for m, p in r[c].items():
            if m == "ideal":
                continue
            name = c if m == "packed" else f"{c}/{m}"
            print(f"pair {pair} {arm} train {name}: {100 * p['fraction_of_ideal']:.1f}% ideal_step_ms={i['step_ms']:.2f} "
                  f"steady={100 * p['steady_fraction_of_ideal']:.1f}% next_steady_ms={p['next_steady_ms']:.3f} "
                  f"service_cpu_ms={p.get('prefetch_stats', {}).get('service_cpu_ms_per_batch', nan):.3f} "
                  f"cpu_ms={cpu(p):.3f}/{cpu(i):.3f} off_cpu_ms={off(p):.3f}/{off(i):.3f} training_switches={sw(p):.2f}/{sw(i):.2f} ({m}/ideal)")
        for m in r[c]:  # tails over the arm's rounds (collector on); next: each epoch's first
            for k, skip in (("step_ms", 0), ("next_ms", 1)):  # batch left out
                v = sorted(x for e in r[c][m]["epochs"] for x in e[k][skip:])
                if v:
                    print(f"pair {pair} {arm} tails {c} {m} {k}{'_steady' * skip}: median {v[len(v) // 2]:.3f} mean "
                          f"{sum(v) / len(v):.3f} p99 {v[min(len(v) - 1, int(0.99 * len(v)))]:.3f} max {v[-1]:.3f}")
except Exception as e:
    print(f"pair {pair} {arm} train: {e!r}")
try:
    r = json.load(open(f"{d}/ref/bench_reference.json"))
    for m, v in r["harness"]["seed16_h2d"].items():
        print(f"pair {pair} {arm} harness seed16 {m}: {v['mean_ms']:.3f} ms "
              f"{v['speedup_vs_to_hardcoded']:.2f}x to_hardcoded")
    for k, v in r["distribution"].items():
        if k.endswith("_mtc"):
            print(f"pair {pair} {arm} latency {k}: mean {v['mean_ms']:.3f} p50 {v['p50_ms']:.3f} "
                  f"p99 {v['p99_ms']:.3f} max {v['max_ms']:.3f} ms machine "
                  f"{v.get('machine_slowest_vs_median', float('nan')):.2f}x")
except OSError:
    pass
except Exception as e:
    print(f"pair {pair} {arm} ref: {e!r}")
EOF
}
t0=$SECONDS
for i in $(seq "$first" "$last"); do
  [ $((SECONDS - t0)) -gt "$deadline" ] && { echo "pair $i: not started (deadline)" | tee -a "$out/ab.log"; break; }
  if [ -n "$prev" ]; then
    arms=(new old prev); k=$(( (i - 1) % 3 )); order="${arms[*]:k} ${arms[*]:0:k}"
  elif [ $((i % 2)) = 1 ]; then order="new old"; else order="old new"; fi
  for a in $order; do
    root=$PWD; [ "$a" = old ] && root=$old; [ "$a" = prev ] && root=$prev
    d="$scratch/$a$i"; mkdir -p "$d"
    parts=" ${AB_PARTS:-train gpu ref} "; gpu=${AB_GPU:-each}
    [[ $parts == *" train "* ]] && PYTHONPATH=$root python3 $TRAIN --out "$d/train" > "$d/train.log" 2>&1
    [[ $parts == *" gpu "* ]] && { [ "$gpu" = each ] || { [ "$gpu" = first ] && [ "$i" = "$first" ]; }; } &&
      PYTHONPATH=$root python3 $GPU --out "$d/gpu" > "$d/gpu.log" 2>&1
    [[ $parts == *" ref "* ]] && PYTHONPATH=$root python3 $REF --out "$d/ref" > "$d/ref.log" 2>&1
    [[ $parts == *" stages "* ]] && PYTHONPATH=$root python3 $STAGES > "$d/stages.log" 2>&1
    { summary "$a" "$i" "$d"
      grep -sE "^seed16 +gc" "$d/stages.log" | sed "s/^/pair $i $a stages /"
    } | tee -a "$out/ab.log"
    echo "pair $i $a: done at $((SECONDS - t0)) s" | tee -a "$out/ab.log"
    pack
  done
done
