"""Does a real mmdet model train faster, and on the same numbers, with mtc_loader.mmengine's
config switch than with mmengine's own data path?

Usage::

    python3 bench/bench_openmmlab_train.py [--device cuda:0] [--iters 300] [--batch-size 8]
                                           [--workers 4] [--images 256] [--out DIR] [--quick]

    python3 bench/bench_openmmlab_train.py --device cpu --quick   # a dry run without a GPU

What it trains: mmdet's own YOLOv3 config (``--config``, default
``yolo/yolov3_d53_8xb8-ms-608-273e_coco.py`` from the configs shipped inside the installed mmdet:
Darknet-53, multi-scale 320..608, the real pipeline: ``LoadImageFromFile``, ``LoadAnnotations``,
``Expand``, ``MinIoURandomCrop``, ``RandomResize``, ``RandomFlip``, ``PhotoMetricDistortion``,
``PackDetInputs``; ``DetDataPreprocessor``; SGD), inherited by two child configs written into the
output folder, ``plain.py`` and ``switched.py``, which differ by the switch of the mmengine
recipe only: ``mtc_packed_collate``, ``MTCDataPreprocessor`` around the config's own
preprocessor and ``MTCEpochBasedTrainLoop``. Both children set the same data (a synthetic
COCO-format set: ``annotations/train.json`` and JPEG images of real sizes, 640x480 to 1280x720
and 480x640, one to six boxes each, read by mmdet's ``CocoDataset``), one epoch of ``--iters``
iterations, ``randomness=dict(seed=0, deterministic=True)``, no validation, no checkpoints and
no pretrained backbone (the machine may have no network). A YOLOv3 training step calls no mmcv
CUDA kernel, so an mmcv built with its CPU ops only is enough.

The arms run alternating, each in a fresh process through mmengine's ``Runner``: plain, switched,
switched, plain (``--arms``). Per arm and iteration it records the losses (every entry of the
model's loss dict, as float32 values), the iteration's wall time (from one ``after_train_iter``
to the next) and mmengine's ``data_time``. The first ``--warmup`` iterations are left out of the
timings.

What it prints (and writes into ``DIR/bench_openmmlab_train.json``): per arm, iterations per
second (mean over the steady iterations and the median iteration's), ``data_time`` (mean and
p99, ms), and the losses' agreement with the first plain arm: the iterations whose losses are
bitwise equal, and the largest absolute difference. Two plain arms that agree bitwise show that
the GPU's kernels are deterministic in this run; then the switched arms agree bitwise too (the
model receives the same batches), and a difference would be a bug. Where the plain arms differ
from each other, the switched arms' differences are of the same size.

What to expect: the losses bitwise equal in every arm; ``data_time`` lower with the switch (the
batch is on the device before the step asks for it); iterations per second equal or higher,
by as much as the step waited for its data (a model this size on an H100 is close to data-bound
with 4 workers decoding and augmenting 8 images a batch).

``--quick``: tiny images (160x120 .. 320x180), the multi-scale range 96..160, batch 2, 2 workers,
6 iterations, warm-up 2: a check that the stack runs (a few minutes on 2 CPU cores).

On a machine without a package index, ``bash tools/release/gpu_checks.sh openmmlab-train`` sets up
the stack from carried wheels (``tools/release/fetch_wheels.sh``) and runs this benchmark.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

DEFAULT_CONFIG = "yolo/yolov3_d53_8xb8-ms-608-273e_coco.py"
LANDSCAPE = [(640, 480), (800, 600), (960, 540), (1024, 768), (1280, 720)]
PORTRAIT = [(480, 640)]
QUICK_LANDSCAPE = [(160, 120), (240, 180), (320, 180)]
QUICK_PORTRAIT = [(120, 160)]


# ------------------------------------------------------------------------- the data set

def write_dataset(root: str, entries: int, batch_size: int, unique: int, quick: bool) -> dict:
    """A COCO-format training set under ``root``: ``unique`` JPEG files and ``entries`` image
    entries in ``annotations/train.json`` naming them in turn, each with its own boxes. Every
    eighth batch's worth of entries is portrait, and each orientation holds a multiple of
    ``batch_size`` entries, so that mmdet's ``AspectRatioBatchSampler`` yields exactly
    ``entries / batch_size`` full batches. Returns a summary; kept when ``root`` already holds
    the same set."""
    import cv2
    import numpy as np

    from mmdet.datasets import CocoDataset

    spec = dict(entries=entries, batch_size=batch_size, unique=unique, quick=quick, version=1)
    stamp = os.path.join(root, "spec.json")
    if os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f) == spec:
                return spec
    os.makedirs(os.path.join(root, "images"), exist_ok=True)
    os.makedirs(os.path.join(root, "annotations"), exist_ok=True)
    landscape, portrait = (QUICK_LANDSCAPE, QUICK_PORTRAIT) if quick else (LANDSCAPE, PORTRAIT)
    rng = np.random.default_rng(0)
    files: dict[bool, list[tuple[str, int, int]]] = {False: [], True: []}
    for k in range(unique):
        tall = k % 8 == 7
        sizes = portrait if tall else landscape
        w, h = sizes[(k // 8 if tall else k) % len(sizes)]
        # smooth shapes under noise: JPEGs of a real photo's size and decoding cost
        img = np.empty((h, w, 3), np.uint8)
        img[:] = rng.integers(0, 256, 3, dtype=np.uint8)
        for _ in range(12):
            x0, y0 = int(rng.integers(0, w - 8)), int(rng.integers(0, h - 8))
            x1, y1 = int(rng.integers(x0 + 8, w + 1)), int(rng.integers(y0 + 8, h + 1))
            img[y0:y1, x0:x1] = rng.integers(0, 256, 3, dtype=np.uint8)
        img = np.clip(img.astype(np.int16) + rng.integers(-24, 25, img.shape, dtype=np.int16),
                      0, 255).astype(np.uint8)
        name = f"{k:06d}.jpg"
        cv2.imwrite(os.path.join(root, "images", name), img, [cv2.IMWRITE_JPEG_QUALITY, 90])
        files[tall].append((name, w, h))
    if not files[True]:
        files[True] = files[False]
    classes = CocoDataset.METAINFO["classes"]
    batches = entries // batch_size
    tall_batches = batches // 8
    images: list[dict] = []
    annotations: list[dict] = []
    for i in range(batches * batch_size):
        tall = i < tall_batches * batch_size
        name, w, h = files[tall][i % len(files[tall])]
        images.append(dict(id=i + 1, file_name=name, width=w, height=h))
        min_side = 16 if quick else 32
        for _ in range(int(rng.integers(1, 7))):
            bw = int(rng.integers(min_side, w // 2))
            bh = int(rng.integers(min_side, h // 2))
            x, y = int(rng.integers(0, w - bw)), int(rng.integers(0, h - bh))
            annotations.append(dict(id=len(annotations) + 1, image_id=i + 1, bbox=[x, y, bw, bh],
                                    area=bw * bh, iscrowd=0,
                                    category_id=int(rng.integers(1, len(classes) + 1))))
    coco = dict(images=images, annotations=annotations,
                categories=[dict(id=i + 1, name=n) for i, n in enumerate(classes)])
    with open(os.path.join(root, "annotations", "train.json"), "w") as f:
        json.dump(coco, f)
    with open(stamp, "w") as f:
        json.dump(spec, f)
    return spec


# ------------------------------------------------------------------------- the configs

def base_config(name: str) -> str:
    """The path of a config shipped inside the installed mmdet (``mmdet/.mim/configs/NAME``)."""
    if os.path.isfile(name):
        return os.path.abspath(name)
    import mmdet
    path = os.path.join(os.path.dirname(mmdet.__file__), ".mim", "configs", name)
    if not os.path.isfile(path):
        raise SystemExit(f"bench_openmmlab_train: no config {name!r} in the installed mmdet ({path})")
    return path


def child_config(arm: str, base: str, data_root: str, args: argparse.Namespace) -> str:
    """The text of a child config inheriting ``base``: the run's settings, and for
    ``switched`` the config switch of the mmengine recipe."""
    from mmengine.config import Config

    parent = Config.fromfile(base)
    switched = arm == "switched"
    dataset = (f"dataset=dict(data_root={data_root + os.sep!r}, ann_file='annotations/train.json', "
               "data_prefix=dict(img='images/')")
    if args.quick:  # tiny images: the multi-scale range shrunk, the rest of the pipeline as it is
        pipeline = [dict(step, scale=[(96, 96), (160, 160)]) if step["type"] == "RandomResize" else dict(step)
                    for step in parent.train_pipeline]
        dataset += f",\n                 pipeline={pipeline!r}"
    lines = [
        f"_base_ = [{base!r}]",
        "",
        "# this run: the synthetic set, one epoch, seeded, no validation, no checkpoints, and the",
        "# backbone initialised here (its pretrained weights need a network)",
        "randomness = dict(seed=0, deterministic=True)",
        "train_dataloader = dict(",
        f"    batch_size={args.batch_size}, num_workers={args.workers}, persistent_workers=True,",
        f"    {dataset}),",
    ]
    lines += [")", "model = dict(backbone=dict(init_cfg=None))", "train_cfg = dict(max_epochs=1)"]
    if switched:  # the recipe's two lines for a child config
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


# ------------------------------------------------------------------------- one arm (a child process)

def run_arm(config: str, work_dir: str, result: str) -> None:
    """Trains ``config`` through mmengine's Runner in this process and writes what it recorded
    (losses, iteration times, data_time) as JSON into ``result``."""
    import warnings
    warnings.simplefilter("ignore")  # the stack's imports and the Runner warn (deprecations)
    import torch
    from mmengine.config import Config
    from mmengine.hooks import Hook
    from mmengine.runner import Runner

    cfg = Config.fromfile(config)
    cfg.work_dir = work_dir
    record: dict[str, Any] = dict(losses={}, iter_s=[], data_time_s=[])

    class Recorder(Hook):  # type: ignore[misc]
        priority = "LOWEST"  # after IterTimerHook has updated data_time

        def before_train(self, runner: Any) -> None:
            self.t = time.perf_counter()

        def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None,
                             outputs: Any = None) -> None:
            now = time.perf_counter()
            record["iter_s"].append(now - self.t)
            self.t = now
            record["data_time_s"].append(runner.message_hub.get_scalar("train/data_time").current())
            for name, value in (outputs or {}).items():
                v = value.detach().float().cpu().item() if torch.is_tensor(value) else float(value)
                record["losses"].setdefault(name, []).append(v)

    if "runner_type" in cfg:  # as mmdet's tools/train.py builds it
        from mmengine.registry import RUNNERS
        runner = RUNNERS.build(cfg)
    else:
        runner = Runner.from_cfg(cfg)
    runner.register_hook(Recorder(), priority="LOWEST")
    if torch.are_deterministic_algorithms_enabled():
        # an op with no deterministic kernel warns instead of stopping the run: the report names
        # it, and the losses' agreement shows what it changed
        torch.use_deterministic_algorithms(True, warn_only=True)
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.filterwarnings("always", message=".*deterministic implementation")
        runner.train()
    record["train_s"] = time.perf_counter() - t0
    record["nondeterministic_ops"] = sorted({str(w.message).splitlines()[0] for w in caught
                                             if "deterministic implementation" in str(w.message)})
    device = next(runner.model.parameters()).device
    record["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    record["loop"] = type(runner.train_loop).__name__
    record["preprocessor"] = type(runner.model.data_preprocessor).__name__
    record["collate_fn"] = str(cfg.train_dataloader.get("collate_fn", "pseudo_collate"))
    with open(result, "w") as f:
        json.dump(record, f)


# ------------------------------------------------------------------------- the report

def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def agreement(losses: dict[str, list[float]], ref: dict[str, list[float]]) -> list[dict]:
    """Per iteration: whether every loss is bitwise equal to ``ref``'s, and the largest
    absolute difference."""
    n = min(len(v) for v in list(losses.values()) + list(ref.values()))
    out = []
    for i in range(n):
        diffs = [abs(losses[k][i] - ref[k][i]) if k in ref else math.inf for k in losses]
        equal = all(k in ref and losses[k][i] == ref[k][i] for k in losses) and set(losses) == set(ref)
        out.append(dict(bitwise=equal, max_abs_diff=max(diffs)))
    return out


def summarise(arm: str, rec: dict, ref: dict, warmup: int) -> dict:
    steady = rec["iter_s"][warmup:] or rec["iter_s"]
    data = rec["data_time_s"][warmup:] or rec["data_time_s"]
    agree = agreement(rec["losses"], ref["losses"])
    first_diff = next((i for i, a in enumerate(agree) if not a["bitwise"]), None)
    return dict(
        arm=arm, iters=len(rec["iter_s"]), device=rec["device"], loop=rec["loop"],
        preprocessor=rec["preprocessor"], train_s=rec["train_s"],
        it_per_s_mean=len(steady) / sum(steady), it_per_s_median=1.0 / statistics.median(steady),
        data_time_ms_mean=1e3 * statistics.fmean(data), data_time_ms_p99=1e3 * percentile(data, 99),
        loss_bitwise=sum(a["bitwise"] for a in agree), loss_compared=len(agree),
        loss_max_abs_diff=max((a["max_abs_diff"] for a in agree), default=0.0),
        loss_first_diff_iter=first_diff, loss_per_iter=agree,
        final_loss=rec["losses"].get("loss", [math.nan])[-1],
        nondeterministic_ops=rec.get("nondeterministic_ops", []),
    )


def print_table(rows: list[dict]) -> None:
    head = (f"{'arm':<12} {'it/s mean':>9} {'it/s p50':>9} {'data ms':>8} {'data p99':>9} "
            f"{'loss bitwise':>13} {'max |diff|':>11} {'final loss':>11}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['arm']:<12} {r['it_per_s_mean']:9.2f} {r['it_per_s_median']:9.2f} "
              f"{r['data_time_ms_mean']:8.2f} {r['data_time_ms_p99']:9.2f} "
              f"{r['loss_bitwise']:>6}/{r['loss_compared']:<6} {r['loss_max_abs_diff']:11.3g} "
              f"{r['final_loss']:11.6g}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda:0", help="cuda:N or cpu (the arms see only this device)")
    p.add_argument("--config", default=DEFAULT_CONFIG,
                   help="an mmdet config: a path, or a name under mmdet/.mim/configs")
    p.add_argument("--iters", type=int, default=300, help="iterations per arm (one epoch)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--images", type=int, default=256, help="JPEG files in the set (entries name them in turn)")
    p.add_argument("--warmup", type=int, default=10, help="iterations left out of the timings")
    p.add_argument("--arms", nargs="+", default=["plain", "switched", "switched", "plain"],
                   choices=["plain", "switched"])
    p.add_argument("--data", default="/tmp/bench_openmmlab_train_data", help="where the set is written")
    p.add_argument("--arm-timeout", type=float, default=300.0, help="seconds one arm may take")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a dry run")
    p.add_argument("--child", nargs=3, metavar=("CONFIG", "WORK_DIR", "RESULT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        run_arm(*args.child)
        return 0
    if args.quick:
        args.iters, args.batch_size, args.workers, args.images, args.warmup = 6, 2, 2, 16, 2
        args.data = args.data.rstrip("/") + "_quick"
    if "plain" not in args.arms:
        raise SystemExit("bench_openmmlab_train: --arms needs a plain arm (the losses' reference)")

    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import mmdet
        import mmengine
        import torch
    t0 = time.perf_counter()
    spec = write_dataset(args.data, args.iters * args.batch_size, args.batch_size, args.images, args.quick)
    print(f"data: {args.data} ({spec['entries']} entries, {args.images} JPEG files; "
          f"{time.perf_counter() - t0:.1f} s)")
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    base = base_config(args.config)
    configs = {}
    for arm in sorted(set(args.arms)):
        configs[arm] = os.path.join(out, f"{arm}.py")
        with open(configs[arm], "w") as f:
            f.write(child_config(arm, base, os.path.abspath(args.data), args))
    print(f"configs: {', '.join(configs.values())} (inheriting {args.config})")

    env = dict(os.environ, PYTHONHASHSEED="0", PYTHONUNBUFFERED="1")
    env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # cuBLAS's deterministic mode (deterministic=True)
    env["CUDA_VISIBLE_DEVICES"] = "" if args.device == "cpu" else args.device.partition(":")[2] or "0"
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    env["PYTHONPATH"] = os.pathsep.join([root] + [x for x in env.get("PYTHONPATH", "").split(os.pathsep) if x])
    records: list[tuple[str, dict]] = []
    for n, arm in enumerate(args.arms, 1):
        name = f"{arm}_{n}"
        work = os.path.join(args.data, "work", name)
        result = os.path.join(work, "record.json")
        os.makedirs(work, exist_ok=True)
        if os.path.exists(result):
            os.remove(result)
        log = os.path.join(out, f"arm_{name}.log")
        t1 = time.perf_counter()
        rc: int | str
        try:
            with open(log, "w") as f:
                rc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", configs[arm], work, result],
                                    env=env, stdout=f, stderr=subprocess.STDOUT, timeout=args.arm_timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        print(f"arm {name}: rc={rc} ({time.perf_counter() - t1:.1f} s; log {log})", flush=True)
        if rc != 0:
            with open(log) as f:
                print("".join(f.readlines()[-25:]))
            continue
        with open(result) as f:
            records.append((name, json.load(f)))
    ref = next((r for name, r in records if name.startswith("plain")), None)
    if ref is None:
        print("bench_openmmlab_train: no plain arm finished; nothing to compare")
        return 1
    rows = [summarise(name, rec, ref, args.warmup) for name, rec in records]
    print(f"\n{args.config} on {rows[0]['device']}: batch {args.batch_size}, {args.workers} workers, "
          f"{args.iters} iterations per arm, timings without the first {args.warmup}; losses against "
          f"{records[0][0] if records[0][1] is ref else 'the first plain arm'}")
    print_table(rows)
    for r in rows:
        for op in r["nondeterministic_ops"]:
            print(f"{r['arm']}: no deterministic kernel: {op}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import mmcv
        import mtc_loader
    report = dict(
        benchmark="bench_openmmlab_train", config=args.config, device=rows[0]["device"],
        batch_size=args.batch_size, workers=args.workers, iters=args.iters, warmup=args.warmup,
        images=args.images, quick=args.quick, arms=args.arms,
        versions=dict(python=platform.python_version(), torch=torch.__version__, mmengine=mmengine.__version__,
                      mmcv=mmcv.__version__, mmdet=mmdet.__version__,
                      mtc_loader=getattr(mtc_loader, "__version__", "?")),
        commit=os.environ.get("MTC_BENCH_COMMIT") or _commit(root),
        results=rows, records={name: rec for name, rec in records},
    )
    path = os.path.join(out, "bench_openmmlab_train.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path}")
    return 0 if len(records) == len(args.arms) else 1


def _commit(root: str) -> str:
    try:
        return subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
