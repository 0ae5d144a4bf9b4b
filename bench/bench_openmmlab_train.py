"""Does a real OpenMMLab model train faster, and on the same numbers, with mtc_loader.mmengine's
config switch than with mmengine's own data path? Paired runs of each, and where the step's time
goes.

Usage::

    python3 bench/bench_openmmlab_train.py [--model yolov3|centerpoint|mvfcos3d] [--device cuda:0]
                                           [--pairs 6] [--arms plain,switched|switched,ahead|plain,ahead]
                                           [--iters N | --budget-s S] [--out DIR] [--quick]

    python3 bench/bench_openmmlab_train.py --device cpu --quick --model centerpoint  # a dry run

The models (``--model``), each the config shipped inside the installed package, inherited by two
child configs written into the output folder, ``plain.py`` and ``switched.py``, which differ by the
recipe's two lines only (``custom_imports`` of ``mtc_loader.mmengine`` and
``runner_type = 'MTCRunner'``), at the config's own batch size and workers; for ``mvfcos3d``, whose
89 MiB batches the default 256 MiB arena cannot hold, also the arena's size (``MTCDataPreprocessor``
with ``arena_bytes=1 << 30``, what the arena's error asks for):

- ``yolov3``: mmdet's ``yolo/yolov3_d53_8xb8-ms-608-273e_coco.py`` (Darknet-53, multi-scale
  320..608, batch 8, 4 workers) on a synthetic COCO set of JPEGs of real sizes (640x480 to
  1280x720 and 480x640) read by ``CocoDataset`` and the config's pipeline;
- ``centerpoint``: mmdet3d's ``centerpoint/centerpoint_pillar02_second_secfpn_8xb4-cyclic-20e_nus-3d.py``
  (0.2 m pillars on a 512 x 512 grid, batch 4, 4 workers) on a synthetic nuScenes set: a simulated
  32-beam LiDAR, the key frame and 10 earlier sweeps of about 34,000 points each (x, y, z,
  intensity, ring), 36 boxes of the 10 classes a sample, a GT database; read by
  ``NuScenesDataset`` in the config's ``CBGSDataset`` and its pipeline (``LoadPointsFromFile``,
  ``LoadPointsFromMultiSweeps`` of 9 sweeps, ``ObjectSample``, ``GlobalRotScaleTrans``, ...): about
  340,000 points a sample;
- ``mvfcos3d``: mmdet3d's ``mvfcos3d/multiview-fcos3d_r101-dcn_8xb2_waymoD5-3d-3class.py``
  (``MultiViewDfM``: ResNet-101 with DCNv2, FPN, a 3D voxel neck, Anchor3DHead; batch 2, 2 workers)
  on a synthetic Waymo set: 5 cameras a sample (1920x1280 and 1920x886 JPEGs), read by
  ``WaymoDataset`` and its pipeline (``LoadMultiViewImageFromFiles``, photometric distortion,
  resize, crop, flip per view).

Both children set the same data, one epoch, ``randomness=dict(seed=0, deterministic=True)``, no
validation, no checkpoints and no pretrained backbone (the machine may have no network); the
number of iterations is set per arm as ``--cfg-options`` would (the dataset's ``indices``).

Stand-ins: where the step calls a kernel that an mmcv built with its CPU ops lacks on the device
(mmcv's hard voxelization in CenterPoint's ``Det3DDataPreprocessor``, DCNv2 in the ResNet and
``sigmoid_focal_loss`` in the Anchor3DHead's ``FocalLoss`` of the multi-view FCOS3D), or an op
that has no deterministic CUDA backward in torch (``F.grid_sample`` in mmdet3d's
``point_sample``), the benchmark replaces that op alone, in its own process and in both arms
alike, by a plain-torch equivalent (bench/openmmlab_train/ops.py; the voxelization is bitwise
equal to mmcv's, the others deterministic). The report names them, and counts the mmcv kernels
the step still called (``--ops mmcv`` keeps mmcv's where it has them).

The pairs: a warm-up arm (plain, not counted), then ``--pairs`` pairs, pair k plain first when k
is odd and switched first when k is even, all in one process (``--process model``: each arm its
own Runner, the previous one's workers stopped and its model freed) or each arm in a fresh one
(``--process arm``). Per arm and iteration it records the losses (every entry of the model's loss
dict, as float32), the iteration's wall time, mmengine's ``data_time`` and the step's split: on a
GPU, CUDA events recorded (without synchronising) at the start of ``train_step``, after the data
preprocessor and at its end give each part's time on the GPU's timeline (the preprocessor: moving
the batch, normalising, voxelising; the model: forward, backward, optimizer) and the gap between
steps; on the CPU, wall times. The first ``--warmup`` iterations are left out.

What it prints (and writes into ``DIR/bench_openmmlab_train_MODEL.json``): per arm, it/s (mean
over the steady iterations and the median iteration's), ``data_time`` (mean, p99) and the split,
and the losses' agreement with the first plain arm (iterations bitwise equal, the largest
difference); per pair, the ratio of the switched arm's mean it/s to the plain arm's; over the
pairs, the ratios' median, min and max, the exact sign test's p-value and a bootstrap 95% interval
of the median: distinguishable from 1 where the sign test rejects a median of 1 at 5% (with 6
pairs: all 6 on one side).

``--arms switched,ahead``: the pairs are switched (base) against switched with the preprocessor's
run-ahead line (``MTCDataPreprocessor(run_ahead=True)``: it runs on the prefetch thread), losses
against the warm-up arm (plain); ``thr cpu``, ``thr off`` and ``blocks`` say what the training
thread gained: its CPU time per step, its time off the CPU and its voluntary context switches.

``--budget-s S``: the run (data set included) is to take about S seconds: after the warm-up arm,
the iterations per arm are those that fit (at most ``--iters``, at least ``--min-iters``); the plan
and its estimate per arm are printed. Without it, every arm runs ``--iters``.

``--quick``: tiny sizes (images, point clouds and layers shrunk; 2 workers, batch 2, 1 pair unless
``--pairs`` says, a few iterations): a check that the stack and the stand-ins run (a few minutes
on 2 CPU cores).

On a machine without a package index, ``bash tools/release/gpu_checks.sh openmmlab-train`` sets up
the stack from carried wheels (``tools/release/fetch_wheels.sh``) and runs the three models.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import struct
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from openmmlab_train import paired  # noqa: E402
from provenance import provenance  # noqa: E402
from openmmlab_train.models import MODELS, Model, base_config  # noqa: E402

DEFAULT_CONFIG = MODELS["yolov3"].config


# ------------------------------------------------------------------------- the configs

def child_config(arm: str, model: Model, base: str, data_root: str, args: argparse.Namespace) -> str:
    """The text of a child config inheriting ``base``: the run's settings, and for ``switched``
    the recipe's two lines (``ahead``: and the preprocessor's run-ahead line)."""
    import pprint

    from mmengine.config import Config

    parent = Config.fromfile(base)
    values = model.values(data_root, args.batch_size, args.workers, parent, args.quick)
    if arm != "plain" and model.arena_bytes is not None:  # what the arena's error asks for
        values.setdefault("model", {})["data_preprocessor"] = dict(
            type="MTCDataPreprocessor", preprocessor=parent.model.data_preprocessor.type,
            arena_bytes=model.arena_bytes)
    if arm == "ahead":  # the run-ahead line: the model's preprocessor on the prefetch thread
        values.setdefault("model", {}).setdefault("data_preprocessor", {})["run_ahead"] = True
    lines = [
        f"_base_ = [{base!r}]",
        "",
        "# this run: the synthetic set, one epoch, seeded, no validation, no checkpoints, and the",
        "# backbone initialised here (its pretrained weights need a network)",
        "randomness = dict(seed=0, deterministic=True)",
    ]
    lines += [f"{key} = {pprint.pformat(value, width=100, sort_dicts=False)}" for key, value in values.items()]
    lines += ["train_cfg = dict(max_epochs=1)"]
    if arm != "plain":  # the recipe's two lines for a child config
        lines += [
            "custom_imports = dict(imports=['mtc_loader.mmengine'], allow_failed_imports=False)  # the switch",
            "runner_type = 'MTCRunner'                                                          # the switch",
        ]
    lines += [
        "val_dataloader = None",
        "val_cfg = None",
        "val_evaluator = None",
        "test_dataloader = None",
        "test_cfg = None",
        "test_evaluator = None",
        "default_hooks = dict(checkpoint=None, logger=dict(interval=50))",
    ]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------- the report

def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def _bits(v: float) -> bytes:
    return struct.pack("<f", v)  # the losses are float32: compared as their bits (NaN equal to itself)


def agreement(losses: dict[str, list[float]], ref: dict[str, list[float]]) -> list[dict[str, Any]]:
    """Per iteration: whether every loss is bitwise equal to ``ref``'s, and the largest
    absolute difference."""
    n = min(len(v) for v in list(losses.values()) + list(ref.values()))
    out = []
    for i in range(n):
        diffs = [abs(losses[k][i] - ref[k][i]) if k in ref else math.inf for k in losses]
        equal = all(k in ref and _bits(losses[k][i]) == _bits(ref[k][i]) for k in losses) and set(losses) == set(ref)
        out.append(dict(bitwise=equal, max_abs_diff=0.0 if equal else max(diffs)))
    return out


def _median_ms(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return 1e3 * statistics.median(finite) if finite else math.nan


def summarise(arm: str, rec: dict[str, Any], ref: dict[str, Any], warmup: int) -> dict[str, Any]:
    steady = rec["iter_s"][warmup:] or rec["iter_s"]
    data = rec["data_time_s"][warmup:] or rec["data_time_s"]
    agree = agreement(rec["losses"], ref["losses"])
    first_diff = next((i for i, a in enumerate(agree) if not a["bitwise"]), None)
    split = {k: _median_ms(v[warmup:] or v) for k, v in rec.get("split", {}).items()}
    return dict(
        arm=arm, kind=arm.split("_")[0], iters=len(rec["iter_s"]), device=rec["device"], loop=rec["loop"],
        preprocessor=rec["preprocessor"], train_s=rec["train_s"], setup_s=rec.get("setup_s"),
        it_per_s_mean=len(steady) / sum(steady), it_per_s_median=1.0 / statistics.median(steady),
        step_ms_median=1e3 * statistics.median(steady),
        data_time_ms_mean=1e3 * statistics.fmean(data), data_time_ms_p99=1e3 * percentile(data, 99),
        split_ms=split,
        loss_bitwise=sum(a["bitwise"] for a in agree), loss_compared=len(agree),
        loss_max_abs_diff=max((a["max_abs_diff"] for a in agree), default=0.0),
        loss_first_diff_iter=first_diff, loss_per_iter=agree,
        final_loss=rec["losses"].get("loss", [math.nan])[-1],
        nondeterministic_ops=rec.get("nondeterministic_ops", []), mmcv_kernels=rec.get("mmcv_kernels", {}),
        loader_stats=rec.get("loader_stats"), arena_stats=rec.get("arena_stats"),
        workers_cpu_ms_per_iter=(1e3 * rec["workers_cpu_s"] / len(rec["iter_s"])
                                 if rec.get("workers_cpu_s") is not None and rec["iter_s"] else None),
    )


def pair_ratios(rows: list[dict[str, Any]], kinds: tuple[str, str] = ("plain", "switched")) -> list[dict[str, Any]]:
    """Per complete pair: its arms' mean it/s and the ratio candidate / base (``kinds``)."""
    base, cand = kinds
    by_pair: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        kind, _, pair = r["arm"].partition("_")
        by_pair.setdefault(pair, {})[kind] = r
    out = []
    for pair, arms in by_pair.items():
        if base in arms and cand in arms:
            p, s = arms[base]["it_per_s_mean"], arms[cand]["it_per_s_mean"]
            out.append({"pair": int(pair), base: p, cand: s, "ratio": s / p, "base_first": int(pair) % 2 == 1})
    return sorted(out, key=lambda d: d["pair"])


SPLIT_COLUMNS = [("gpu_gap_s", "gap"), ("gpu_pre_s", "pre"), ("gpu_model_s", "model"),
                 ("cpu_pre_s", "cpu pre"), ("cpu_step_s", "cpu step"), ("thread_cpu_step_s", "thr cpu"),
                 ("thread_off_cpu_s", "thr off"), ("thread_blocks_s", "blocks"), ("process_cpu_step_s", "proc cpu")]


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = [(k, label) for k, label in SPLIT_COLUMNS if any(k in r["split_ms"] for r in rows)]
    head = (f"{'arm':<12} {'it/s mean':>9} {'it/s p50':>9} {'data ms':>8} {'data p99':>9} "
            + "".join(f"{label:>9}" for _, label in cols)
            + f" {'loss bitwise':>13} {'max |diff|':>11} {'final loss':>11}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['arm']:<12} {r['it_per_s_mean']:9.2f} {r['it_per_s_median']:9.2f} "
              f"{r['data_time_ms_mean']:8.2f} {r['data_time_ms_p99']:9.2f} "
              + "".join(f"{r['split_ms'].get(k, math.nan):9.2f}" for k, _ in cols)
              + f" {r['loss_bitwise']:>6}/{r['loss_compared']:<6} {r['loss_max_abs_diff']:11.3g} "
              f"{r['final_loss']:11.6g}")
    print("(split: medians in ms; gap / pre / model: the GPU's timeline between steps, in the data "
          "preprocessor, in the rest of train_step; cpu pre / cpu step: the training thread's wall time in the "
          "preprocessor / in train_step; thr cpu / proc cpu: the CPU time train_step took on the training thread "
          "/ in the whole process; thr off: its wall time off the CPU; blocks: the training thread's voluntary "
          "context switches in train_step, a count)")


def _ms(key: str) -> str:
    """A split's key in seconds (``gpu_pre_s``) as its median's key in ms (``gpu_pre_ms``)."""
    return key[:-2] + "_ms"


def kind_medians(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per arm kind, the medians over its arms of it/s, data_time and each part of the split."""
    out: dict[str, dict[str, float]] = {}
    for kind in ("plain", "switched", "ahead"):
        mine = [r for r in rows if r["kind"] == kind]
        if not mine:
            continue
        m = dict(it_per_s_mean=statistics.median(r["it_per_s_mean"] for r in mine),
                 step_ms=statistics.median(1e3 / r["it_per_s_mean"] for r in mine),
                 data_time_ms=statistics.median(r["data_time_ms_mean"] for r in mine))
        workers = [r["workers_cpu_ms_per_iter"] for r in mine if r["workers_cpu_ms_per_iter"] is not None]
        if workers:
            m["workers_cpu_ms"] = statistics.median(workers)
        for key, _ in SPLIT_COLUMNS:
            vals = [r["split_ms"][key] for r in mine if key in r["split_ms"] and not math.isnan(r["split_ms"][key])]
            if vals:
                m[_ms(key)] = statistics.median(vals)
        out[kind] = m
    return out


def law(medians: dict[str, dict[str, float]], ratio: float) -> dict[str, float]:
    """The switch's saving per step, from the arms' medians: what the training thread no longer
    waits for (``data_time``) and no longer does in the preprocessor (``cast_data``'s copies of
    each tensor and metainfo), and the gain it predicts, step / (step - saved), beside the
    pairs' measured median ratio."""
    p, s = medians.get("plain"), medians.get("switched")
    if not p or not s:
        return {}
    out = dict(step_plain_ms=p["step_ms"], step_switched_ms=s["step_ms"],
               data_saved_ms=p["data_time_ms"] - s["data_time_ms"], measured_ratio=ratio)
    out["pre_saved_ms"] = p.get("cpu_pre_ms", math.nan) - s.get("cpu_pre_ms", math.nan)
    saved = out["data_saved_ms"] + (out["pre_saved_ms"] if not math.isnan(out["pre_saved_ms"]) else 0.0)
    out["saved_ms"] = saved
    out["predicted_ratio"] = p["step_ms"] / (p["step_ms"] - saved) if p["step_ms"] > saved else math.inf
    return out


# ------------------------------------------------------------------------- running the arms

def run_child(plan: dict[str, Any], plan_path: str, log: str, timeout: float, env: dict[str, str]) -> tuple[Any, dict[str, Any]]:
    """Runs the plan's arms in a child process; returns (its exit status, what it wrote)."""
    with open(plan_path, "w") as f:
        json.dump(plan, f, indent=1)
    if os.path.exists(plan["result"]):
        os.remove(plan["result"])
    rc: Any
    try:
        with open(log, "a") as f:
            rc = subprocess.run([sys.executable, "-m", "openmmlab_train.child", plan_path], env=env, stdout=f,
                                stderr=subprocess.STDOUT, timeout=max(timeout, 1.0), cwd=HERE).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    out: dict[str, Any] = dict(records={}, plan={})
    if os.path.exists(plan["result"]):
        with open(plan["result"]) as f:
            out = json.load(f)
    return rc, out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="yolov3", choices=sorted(MODELS))
    p.add_argument("--device", default="cuda:0", help="cuda:N or cpu (the arms see only this device)")
    p.add_argument("--config", help="another config of the model's package: a path, or a name under .mim/configs")
    p.add_argument("--pairs", type=int, help="pairs of --arms (pair k: the first kind first when k is odd); "
                   "default 6, 1 with --quick")
    p.add_argument("--arms", default="plain,switched", choices=["plain,switched", "switched,ahead", "plain,ahead"],
                   help="the pairs' kinds, base,candidate (ahead: switched with the preprocessor's run_ahead line)")
    p.add_argument("--iters", type=int, help="iterations per arm (one epoch); the most with --budget-s")
    p.add_argument("--budget-s", type=float, help="seconds the whole run may take: sizes the iterations per arm")
    p.add_argument("--min-iters", type=int, help="the fewest iterations per arm --budget-s may choose")
    p.add_argument("--warmup", type=int, help="iterations of each arm left out of the timings")
    p.add_argument("--batch-size", type=int, help="default: the config's")
    p.add_argument("--workers", type=int, help="default: the config's")
    p.add_argument("--unique", type=int, help="distinct samples written (the entries name them in turn)")
    p.add_argument("--process", choices=["model", "arm"], default="model",
                   help="all arms in one child process (each its own Runner), or each arm in a fresh one")
    p.add_argument("--ops", choices=["torch", "mmcv"], default="torch",
                   help="torch: the model's stand-ins (ops.py); mmcv: mmcv's own kernels (an mmcv built with them)")
    p.add_argument("--data", default="/tmp/bench_openmmlab_train_data", help="where the sets are written")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a dry run")
    args = p.parse_args()
    t_begin = time.time()
    model = MODELS[args.model]
    args.batch_size = args.batch_size or (2 if args.quick else model.batch_size)
    args.workers = args.workers if args.workers is not None else (2 if args.quick else model.workers)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.quick else model.warmup)
    gran = model.granularity(args.batch_size)
    cap = args.iters or (gran * max(1, math.ceil(6 / gran)) if args.quick else model.iters)
    cap = max(gran, cap // gran * gran)
    floor = args.min_iters or args.warmup + 6
    floor = min(cap, max(gran, math.ceil(floor / gran) * gran))
    unique = args.unique or (model.quick_unique if args.quick else model.unique)
    args.pairs = args.pairs or (1 if args.quick else 6)
    if args.quick:
        args.data = args.data.rstrip("/") + "_quick"
    root = os.path.abspath(os.path.join(args.data, model.name))

    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import mmengine
        import torch
    t0 = time.perf_counter()
    summary = model.write(root, cap, args.batch_size, unique, args.quick)
    print(f"data: {root} ({summary}; {time.perf_counter() - t0:.1f} s)", flush=True)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    base = base_config(model, args.config)
    configs = {}
    kinds = tuple(args.arms.split(","))
    for arm in sorted({"plain", *kinds}):  # (the warm-up arm is plain)
        configs[arm] = os.path.join(out, f"{model.name}_{arm}.py")
        with open(configs[arm], "w") as f:
            f.write(child_config(arm, model, base, root, args))
    print(f"configs: {', '.join(configs.values())} (inheriting {args.config or model.config})")
    stand_ins = list(model.stand_ins) if args.ops == "torch" else []
    if stand_ins:
        from openmmlab_train.ops import STAND_INS
        print("stand-ins (both arms):\n" + "\n".join(f"  {STAND_INS[s]}" for s in stand_ins))

    env = dict(os.environ, PYTHONHASHSEED="0", PYTHONUNBUFFERED="1")
    env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # cuBLAS's deterministic mode (deterministic=True)
    env["CUDA_VISIBLE_DEVICES"] = "" if args.device == "cpu" else args.device.partition(":")[2] or "0"
    repo = os.path.dirname(HERE)
    env["PYTHONPATH"] = os.pathsep.join([repo, HERE] + [x for x in env.get("PYTHONPATH", "").split(os.pathsep) if x])
    device = "cpu" if args.device == "cpu" else "cuda:0"
    order = [(f"{arm}_{k}", configs[arm]) for k, arm in paired.arm_order(args.pairs, kinds)]
    warm_iters = min(cap, math.ceil((args.warmup + 5) / gran) * gran)
    arms = [dict(name="warm-up", config=configs["plain"], iters=warm_iters)]
    arms += [dict(name=name, config=config) for name, config in order]
    deadline = t_begin + args.budget_s if args.budget_s else None
    # no arm starts after the budget and 15% more: a run a little over its plan keeps its pairs
    stop_at = t_begin + 1.15 * args.budget_s if args.budget_s else None
    common = dict(model=model.name, batch_size=args.batch_size, device=device, stand_ins=stand_ins,
                  work=os.path.join(root, "work"), cap=cap, floor=floor, granularity=gran, warmup=args.warmup,
                  timed_arms=len(order), deadline=deadline, stop_at=stop_at)
    log = os.path.join(out, f"{model.name}_arms.log")
    open(log, "w").close()
    far = 1e9
    records: dict[str, Any] = {}
    plan_info: dict[str, Any] = {}
    rcs = []
    if args.process == "model":
        plan = dict(common, arms=arms, iters=None if deadline else cap,
                    result=os.path.join(out, f"{model.name}_records.json"))
        timeout = (stop_at - time.time() + 90) if stop_at else far
        rc, got = run_child(plan, os.path.join(out, f"{model.name}_plan.json"), log, timeout, env)
        rcs.append(rc)
        records, plan_info = got["records"], got.get("plan", {})
    else:
        iters = None if deadline else cap
        for step in arms:
            if iters is None and step["name"] != "warm-up":
                break  # the warm-up arm failed: nothing to size the arms by
            if stop_at is not None and time.time() > stop_at:
                print(f"bench_openmmlab_train: out of time, {step['name']} and the arms after it not run")
                break
            plan = dict(common, arms=[dict(step, iters=step.get("iters") or iters)], iters=iters,
                        result=os.path.join(out, f"{model.name}_{step['name']}.json"))
            t1 = time.time()
            timeout = (stop_at - time.time() + 90) if stop_at else far
            rc, got = run_child(plan, os.path.join(out, f"{model.name}_plan.json"), log, timeout, env)
            rcs.append(rc)
            records.update(got["records"])
            if step["name"] == "warm-up" and iters is None and "warm-up" in records:
                from openmmlab_train.child import plan_iters
                warm = dict(records["warm-up"])
                # a fresh process per arm: its start (imports, CUDA) counts as set-up
                warm["setup_s"] += (time.time() - t1) - warm["arm_s"]
                assert deadline is not None
                iters, est = plan_iters(warm, len(order), deadline - time.time(), cap, floor, gran, args.warmup)
                plan_info = dict(iters=iters, **est)
                print(f"plan: {iters} iterations per arm, about {est['per_arm_s']:.0f} s an arm", flush=True)
    for rc in rcs:
        if rc != 0:
            print(f"bench_openmmlab_train: an arm's process ended with {rc} (log {log}):")
            with open(log) as f:
                print("".join(f.readlines()[-30:]))
    with open(log) as f:
        print("".join(line for line in f if line.startswith(("plan:", "arm "))), end="")
    timed = [(name, records[name]) for name, _ in order if name in records]
    # the losses' reference: the first plain arm, else the warm-up arm (plain, its iterations)
    ref_name = next((name for name, r in timed if name.startswith("plain")), "warm-up")
    ref = dict(timed).get(ref_name, records.get("warm-up"))
    if ref is None:
        print("bench_openmmlab_train: no plain arm finished; nothing to compare")
        return 1
    rows = [summarise(name, rec, ref, args.warmup) for name, rec in timed]
    pairs = pair_ratios(rows, kinds)
    stats = paired.summarise_pairs([q["ratio"] for q in pairs])
    medians = kind_medians(rows)
    print(f"\n{model.name} ({args.config or model.config}) on {rows[0]['device']}: batch {args.batch_size}, "
          f"{args.workers} workers, {rows[0]['iters']} iterations per arm, timings without the first "
          f"{args.warmup}; losses against {ref_name}")
    print_table(rows)
    print(f"\npairs ({kinds[1]} / {kinds[0]}, mean it/s): " + ", ".join(
        f"{q['pair']}{'b' if q['base_first'] else 'c'} {q['ratio']:.3f}" for q in pairs)
        + f"   (b: {kinds[0]} ran first, c: {kinds[1]} first)")
    print(paired.verdict(stats, f"{kinds[1]} / {kinds[0]}"))
    for kind, m in medians.items():
        print(f"{kind:<9} median of arms: {m['it_per_s_mean']:.2f} it/s, step {m['step_ms']:.1f} ms, "
              f"data_time {m['data_time_ms']:.2f} ms"
              + (f", workers' CPU {m['workers_cpu_ms']:.0f} ms an iteration" if "workers_cpu_ms" in m else "")
              + "".join(f", {label} {m[_ms(key)]:.1f}{'' if label == 'blocks' else ' ms'}"
                        for key, label in SPLIT_COLUMNS if _ms(key) in m))
    the_law = law(medians, stats["median"]) if kinds == ("plain", "switched") else {}
    if the_law:
        print(f"law: saved per step = data_time {medians['plain']['data_time_ms']:.1f} -> "
              f"{medians['switched']['data_time_ms']:.1f} ms + the preprocessor on the training thread "
              f"{medians['plain'].get('cpu_pre_ms', math.nan):.1f} -> {medians['switched'].get('cpu_pre_ms', math.nan):.1f} ms"
              f" = {the_law['saved_ms']:.1f} ms of a {the_law['step_plain_ms']:.1f} ms step: step / (step - saved) "
              f"= {the_law['predicted_ratio']:.3f}x; measured (median of the pairs) {the_law['measured_ratio']:.3f}x")
    batch = next((rec.get("batch") for name, rec in timed if name.startswith("plain") and rec.get("batch")), None)
    if batch:
        print(f"a batch (as cast_data walks it): {batch['tensors']} tensors, {batch['bytes'] / 2**20:.1f} MiB, "
              f"{batch['elements']} data elements")
    for r in rows:
        for op in r["nondeterministic_ops"]:
            print(f"{r['arm']}: no deterministic kernel: {op}")
    kernels = sorted({k for r in rows for k in r["mmcv_kernels"]})
    print(f"mmcv kernels the training called: {', '.join(kernels) if kernels else 'none'}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import importlib
        import mtc_loader
        versions = dict(python=platform.python_version(), torch=torch.__version__, mmengine=mmengine.__version__,
                        mtc_loader=getattr(mtc_loader, "__version__", "?"))
        for pkg in ("mmcv", "mmdet", "mmdet3d"):
            try:
                versions[pkg] = importlib.import_module(pkg).__version__
            except ImportError:
                pass
    report = dict(
        benchmark="bench_openmmlab_train", model=model.name, config=args.config or model.config, what=model.what,
        device=rows[0]["device"], batch_size=args.batch_size, workers=args.workers, iters=rows[0]["iters"],
        warmup=args.warmup, pairs=args.pairs, arms=list(kinds), process=args.process, quick=args.quick, data=summary,
        stand_ins=stand_ins, plan=plan_info, elapsed_s=time.time() - t_begin, versions=versions,
        commit=os.environ.get("MTC_BENCH_COMMIT") or _commit(repo), command=sys.argv,
        provenance=provenance(),
        results=rows, pair_ratios=pairs, paired=stats, medians=medians, law=the_law, batch=batch,
        records={name: rec for name, rec in timed},
    )
    path = os.path.join(out, f"bench_openmmlab_train_{model.name}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path} ({time.time() - t_begin:.0f} s in all)")
    return 0 if len(timed) == len(order) and all(rc == 0 for rc in rcs) else 1


def _commit(root: str) -> str:
    try:
        return subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
