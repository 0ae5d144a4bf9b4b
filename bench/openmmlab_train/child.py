"""The arms' side of bench_openmmlab_train.py: in one process, arm after arm, a config trained
through mmengine's Runner, recording per iteration the losses, the wall time, mmengine's
``data_time`` and the step's split (the data preprocessor, the rest of ``train_step``)."""
from __future__ import annotations

import gc
import json
import math
import os
import platform
import resource
import statistics
import sys
import threading
import time
from typing import Any

from . import ops
from .models import MODELS


def plan_iters(warm: dict[str, Any], arms: int, seconds_left: float, cap: int, floor: int,
               granularity: int, warmup: int) -> tuple[int, dict[str, float]]:
    """The iterations per arm that let ``arms`` arms fit in ``seconds_left``, from the warm-up
    arm's record: each arm costs its set-up and tear-down and its wait for the first batch (the
    warm-up's, taken as they were: its set-up was the coldest, so this overestimates), and its
    iterations at the warm-up's steady step (its first iteration, which also loaded the device's
    kernels, is not one of them). Rounded down to ``granularity``, within ``floor`` .. ``cap``."""
    steady = warm["iter_s"][warmup:] or warm["iter_s"][1:] or warm["iter_s"]
    step = statistics.median(steady)
    overhead = warm["setup_s"] + warm["teardown_s"] + warm["data_time_s"][0]
    per_arm = seconds_left / arms
    iters = int((per_arm - overhead) / step) if step > 0 else cap
    iters = max(floor, min(cap, iters // granularity * granularity))
    return iters, dict(step_s=step, overhead_s=overhead, per_arm_s=overhead + iters * step)


def census(data: Any) -> dict[str, int]:
    """What a batch holds, as ``cast_data`` walks it: the tensors (a box or points class counts
    as its tensor), their bytes, and the data elements (each of which ``.to`` copies the
    metainfo of)."""
    import torch

    out = dict(tensors=0, bytes=0, elements=0)

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            out["tensors"] += 1
            out["bytes"] += x.numel() * x.element_size()
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        elif hasattr(x, "_data_fields") and hasattr(x, "metainfo"):  # mmengine's BaseDataElement
            out["elements"] += 1
            for k in x._data_fields:
                walk(getattr(x, k))
        elif isinstance(getattr(x, "tensor", None), torch.Tensor):  # boxes, points
            walk(x.tensor)
    walk(data)
    return out


def _children_cpu_s() -> float | None:
    """The CPU time (user + system) of this process's live child processes: the DataLoader
    workers (None without psutil)."""
    try:
        import psutil
    except ImportError:
        return None
    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            t = child.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def _blocks() -> int:
    """The calling thread's voluntary context switches so far (Linux; 0 elsewhere)."""
    who = getattr(resource, "RUSAGE_THREAD", None)
    return resource.getrusage(who).ru_nvcsw if who is not None else 0


def run_arm(config: str, name: str, work_dir: str, overrides: dict[str, Any], device: str) -> dict[str, Any]:
    """Trains ``config`` (with ``overrides`` applied as ``--cfg-options`` applies them) through
    mmengine's Runner in this process; returns what it recorded."""
    import warnings

    import torch
    from mmengine.config import Config
    from mmengine.hooks import Hook
    from mmengine.registry import RUNNERS
    from mmengine.runner import Runner

    t_start = time.perf_counter()
    cfg = Config.fromfile(config)
    cfg.merge_from_dict(overrides)
    cfg.work_dir = work_dir
    cfg.experiment_name = name  # one process runs several runners: each its own logger and hub
    record: dict[str, Any] = dict(losses={}, iter_s=[], data_time_s=[], split={})
    split: dict[str, list[float]] = {k: [] for k in ("cpu_pre_s", "cpu_step_s", "thread_cpu_step_s",
                                                      "thread_off_cpu_s", "thread_blocks_s", "process_cpu_step_s")}
    events: list[tuple[Any, Any, Any]] = []
    cuda = device.startswith("cuda")

    class Recorder(Hook):  # type: ignore[misc]
        priority = "LOWEST"  # after IterTimerHook has updated data_time

        def before_train(self, runner: Any) -> None:
            self.t = time.perf_counter()
            record["setup_s"] = self.t - t_start

        def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None,
                             outputs: Any = None) -> None:
            now = time.perf_counter()
            record["iter_s"].append(now - self.t)
            self.t = now
            record["data_time_s"].append(runner.message_hub.get_scalar("train/data_time").current())
            for key, value in (outputs or {}).items():
                v = value.detach().float().cpu().item() if torch.is_tensor(value) else float(value)
                record["losses"].setdefault(key, []).append(v)

    if "runner_type" in cfg:  # as mmdet's and mmdet3d's tools/train.py build it
        runner = RUNNERS.build(cfg)
    else:
        runner = Runner.from_cfg(cfg)
    runner.register_hook(Recorder(), priority="LOWEST")
    model = runner.model
    pre = model.data_preprocessor
    pre_forward, train_step = pre.forward, model.train_step

    def event() -> Any:
        if not cuda:
            return None
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    marks: dict[str, Any] = {}

    def timed_pre(*args: Any, **kwargs: Any) -> Any:
        if "batch" not in record:
            record["batch"] = census(args[0] if args else kwargs.get("data"))
        t0 = time.perf_counter()
        out = pre_forward(*args, **kwargs)
        marks["pre"] = event()
        split["cpu_pre_s"].append(time.perf_counter() - t0)
        return out

    def timed_step(*args: Any, **kwargs: Any) -> Any:
        t0, c0, p0, b0 = time.perf_counter(), time.thread_time(), time.process_time(), _blocks()
        start = event()
        out = train_step(*args, **kwargs)
        end = event()
        split["cpu_step_s"].append(time.perf_counter() - t0)
        # the CPU time the step took on the training thread, and in the whole process (its other
        # threads: the prefetch service, torch's pools); the training thread's time off the CPU
        # and its blocks (voluntary context switches: waits for the GIL, a lock, the GPU), a
        # count kept in thousands so that the report's ms show it as it is
        split["thread_cpu_step_s"].append(time.thread_time() - c0)
        split["thread_off_cpu_s"].append(split["cpu_step_s"][-1] - split["thread_cpu_step_s"][-1])
        split["thread_blocks_s"].append((_blocks() - b0) / 1e3)
        split["process_cpu_step_s"].append(time.process_time() - p0)
        events.append((start, marks.get("pre"), end))
        return out

    # the split, in the step's own timeline: CUDA events recorded on the current stream (no
    # synchronisation added), read when the arm is done; on the CPU, wall times
    pre.forward, model.train_step = timed_pre, timed_step
    if torch.are_deterministic_algorithms_enabled():
        # an op with no deterministic kernel warns instead of stopping the run: the report names
        # it, and the losses' agreement shows what it changed
        torch.use_deterministic_algorithms(True, warn_only=True)
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught, ops.KernelCounter() as kernels:
        warnings.filterwarnings("always", message=".*deterministic implementation")
        runner.train()
    record["train_s"] = time.perf_counter() - t0
    record["workers_cpu_s"] = _children_cpu_s()  # the DataLoader workers' CPU time over the arm
    t_down = time.perf_counter()
    if cuda:
        torch.cuda.synchronize()
        record["split"]["gpu_pre_s"] = [s.elapsed_time(p) / 1e3 for s, p, _ in events]
        record["split"]["gpu_model_s"] = [p.elapsed_time(e) / 1e3 for _, p, e in events]
        record["split"]["gpu_gap_s"] = [math.nan] + [events[i - 1][2].elapsed_time(events[i][0]) / 1e3
                                                     for i in range(1, len(events))]
    record["split"].update(split)
    record["nondeterministic_ops"] = sorted({str(w.message).splitlines()[0] for w in caught
                                             if "deterministic implementation" in str(w.message)})
    record["mmcv_kernels"] = dict(kernels.calls)
    dev = next(runner.model.parameters()).device
    record["device"] = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu"
    record["loop"] = type(runner.train_loop).__name__
    record["preprocessor"] = type(runner.model.data_preprocessor).__name__
    record["collate_fn"] = str(runner.cfg.train_dataloader.get("collate_fn", "pseudo_collate"))
    stats = getattr(runner.train_loop, "stats", None)
    if callable(stats):
        record["loader_stats"] = {k: v for k, v in stats().items() if isinstance(v, (int, float, str))}
        arena = getattr(sys.modules.get("mtc_loader.mmengine"), "packed_collate", None)
        if arena is not None and arena.arena is not None:
            record["arena_stats"] = arena.arena.stats()  # its waits: workers that found it full
    # the next arm starts from a clean slate: this one's workers stopped, its model freed
    loader = getattr(runner.train_loop, "dataloader", None)
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
    del runner, model, pre, loader, iterator
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    record["teardown_s"] = time.perf_counter() - t_down
    # what the arm left behind (a thread or memory still held would weigh on the next arm)
    record["threads_after"] = sorted(t.name for t in threading.enumerate())
    if cuda:
        record["cuda_allocated_after_mb"] = torch.cuda.memory_allocated() / 2**20
    return record


def prime(config: str) -> float:
    """Builds the config's training set in this process and takes one sample through its
    pipeline: what the pipeline compiles on first use (mmdet3d's numba functions: the points in
    boxes, the boxes' collisions) is then compiled once, here, for the workers every arm forks,
    instead of in each arm's workers. Returns the seconds it took."""
    from mmengine.config import Config
    from mmengine.registry import DATASETS, init_default_scope

    t0 = time.perf_counter()
    cfg = Config.fromfile(config)
    init_default_scope(cfg.get("default_scope", "mmengine"))
    if cfg.get("custom_imports"):
        from mmengine.utils import import_modules_from_strings
        import_modules_from_strings(**cfg.custom_imports)
    DATASETS.build(cfg.train_dataloader.dataset)[0]
    return time.perf_counter() - t0


def main(plan_path: str) -> int:
    """Runs the arms of the plan in ``plan_path`` (JSON, written by bench_openmmlab_train.py) in
    this process and writes their records into its ``result`` file after each arm."""
    import warnings
    warnings.simplefilter("ignore")  # the stack's imports and the Runner warn (deprecations)
    with open(plan_path) as f:
        plan = json.load(f)
    model = MODELS[plan["model"]]
    restore = ops.install(plan["stand_ins"])
    try:
        out: dict[str, Any] = dict(records={}, plan={})
        out["prime_s"] = prime(plan["arms"][0]["config"])
        print(f"primed the pipeline in {out['prime_s']:.1f} s", flush=True)
        iters = plan["iters"]
        for k, arm in enumerate(plan["arms"]):
            name, config = arm["name"], arm["config"]
            if plan["stop_at"] is not None and time.time() > plan["stop_at"]:
                print(f"deadline passed: {len(plan['arms']) - k} arms not run", flush=True)
                break
            if name == "warm-up":
                arm_iters = arm["iters"]
            elif iters is None:  # sized from the warm-up arm to the time left
                left = plan["deadline"] - time.time()
                iters, est = plan_iters(out["records"]["warm-up"], plan["timed_arms"], left, plan["cap"],
                                        plan["floor"], plan["granularity"], plan["warmup"])
                out["plan"] = dict(iters=iters, seconds_left=left, **est)
                print(f"plan: {iters} iterations per arm: {est['step_s'] * 1e3:.1f} ms a step at the warm-up, "
                      f"{est['overhead_s']:.1f} s of set-up and tear-down per arm, about {est['per_arm_s']:.0f} s "
                      f"an arm, {plan['timed_arms']} arms in the {left:.0f} s left", flush=True)
                arm_iters = iters
            else:
                arm_iters = iters
            t0 = time.perf_counter()
            rec = run_arm(config, name, os.path.join(plan["work"], name),
                          model.samples(arm_iters, plan["batch_size"]), plan["device"])
            rec["arm_s"] = time.perf_counter() - t0
            out["records"][name] = rec
            n = len(rec["iter_s"])
            print(f"arm {name}: {n} iterations, {rec['arm_s']:.1f} s (set-up {rec['setup_s']:.1f} s, "
                  f"steady {statistics.median(rec['iter_s'][1:] or rec['iter_s']) * 1e3:.1f} ms/it)", flush=True)
            out["modules"] = sorted({m.partition(".")[0] for m in sys.modules}
                                    - set(sys.stdlib_module_names) - {"__main__"} - {""})
            with open(plan["result"], "w") as f:
                json.dump(out, f)
    finally:
        restore()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
