"""``python3 -m mtc_loader.mmengine train CONFIG ...``: trains a config file with mtc_loader's switch
applied (:func:`mtc_loader.mmengine.switch_config`), taking the arguments of the OpenMMLab
projects' ``tools/train.py``."""
from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import logging
import os
import sys
import sysconfig
import traceback
import warnings
from typing import Any, Iterator, Optional, Sequence


def _parser() -> argparse.ArgumentParser:
    from mmengine.config import DictAction

    parser = argparse.ArgumentParser(
        prog="python3 -m mtc_loader.mmengine",
        description="Train an OpenMMLab config with mtc_loader's switch (packed batches, one DMA each, "
                    "prefetched), the config file left as it is.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a config file (the arguments of tools/train.py)")
    train.set_defaults(error=train.error)  # what build_config reports a bad argument or config with
    train.add_argument("config", help="train config file path")
    train.add_argument("--work-dir", help="the dir to save logs and models")
    train.add_argument("--amp", action="store_true", default=False,
                       help="enable automatic-mixed-precision training")
    train.add_argument("--sync_bn", choices=["none", "torch", "mmcv"], default="none",
                       help="convert all BatchNorm layers in the model to SyncBatchNorm")
    train.add_argument("--auto-scale-lr", action="store_true", help="enable automatically scaling LR")
    train.add_argument("--resume", nargs="?", type=str, const="auto",
                       help="resume from this checkpoint, or (no value) from the latest in the work dir; "
                            "the checkpoint is loaded with torch.load(weights_only=False), as mmengine "
                            "expects: resume only from checkpoints you trust")
    train.add_argument("--cfg-options", nargs="+", action=DictAction,
                       help="override settings of the config, key=value (merged into it before the switch)")
    train.add_argument("--launcher", choices=["none", "pytorch", "slurm", "mpi"], default="none",
                       help="job launcher")
    train.add_argument("--local_rank", "--local-rank", type=int, default=0)
    train.add_argument("--arena-bytes", type=int, default=None,
                       help="size of the shared arena (MTCDataPreprocessor's arena_bytes)")
    train.add_argument("--prefetch-depth", type=int, default=None,
                       help="batches prefetched by the train loop (0: none)")
    train.add_argument("--no-pack-eval", action="store_true",
                       help="leave the validation and test loaders unpacked")
    return parser


def _library(filename: str) -> bool:
    """Whether a traceback's file is mmengine's, the standard library's or this package's (not
    the user's config or a module of theirs)."""
    import mmengine

    if filename.startswith("<"):
        return True
    roots = (os.path.dirname(mmengine.__file__), sysconfig.get_paths()["stdlib"],
             os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.abspath(filename)
    return any(path.startswith(os.path.join(root, "")) for root in roots)


def _syntax_error(path: str, seen: Optional[set[str]] = None) -> Optional[SyntaxError]:
    """The syntax error of a config file or of one of its bases, with its file and line (mmengine
    reports it without them), or None."""
    from mmengine.config import Config

    seen = set() if seen is None else seen
    if path in seen or not os.path.isfile(path):
        return None
    seen.add(path)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        compile(text, path, "exec")
    except SyntaxError as e:
        return e
    try:  # its bases, as mmengine finds them
        bases = [Config._get_cfg_path(b, path)[0] for b in Config._get_base_files(path)]
    except Exception:
        return None
    for base in bases:
        found = _syntax_error(base, seen) if base is not None else None
        if found is not None:
            return found
    return None


def _config_error(path: str, e: BaseException) -> str:
    """What ``error: config file ...`` says of an exception raised while reading a config file:
    where (the config's line, or the file and line of a base or a module it imports) and what."""
    where: Optional[tuple[str, Optional[int]]] = None
    if isinstance(e, SyntaxError):
        found = _syntax_error(path) or e
        where = (found.filename, found.lineno) if found.filename and found.lineno else None
        what = f"SyntaxError: {found.msg}"
    elif isinstance(e, FileNotFoundError) and e.filename is not None:
        return f"config file {path}: no file {e.filename}"
    else:
        frames = [f for f in traceback.extract_tb(e.__traceback__) if not _library(f.filename)]
        if frames:
            where = (frames[-1].filename, frames[-1].lineno)
        what = f"{type(e).__name__}: {e}"
    if where is None or where[1] is None or where[0] in ("<unknown>", "<string>"):
        return f"config file {path}: {what}"
    if os.path.abspath(where[0]) == os.path.abspath(path):
        return f"config file {path}, line {where[1]}: {what}"
    return f"config file {path}: {where[0]}, line {where[1]}: {what}"


def _read_config(args: argparse.Namespace) -> Any:
    """The config file, read; a file that is not there, does not parse or fails to run is
    reported as argparse reports a bad argument (usage, ``error: ...``, exit status 2)."""
    from mmengine.config import Config

    error = args.error
    if not os.path.isfile(args.config):
        error(f"no config file {args.config}")
    try:
        return Config.fromfile(args.config)
    except Exception as e:
        error(_config_error(args.config, e))


def build_config(args: argparse.Namespace) -> Any:
    """The switched config for the parsed arguments, as ``tools/train.py`` prepares it."""
    from mmengine.logging import print_log

    from . import switch_config

    error = args.error
    cfg = _read_config(args)
    cfg.launcher = args.launcher
    if args.cfg_options is not None:
        cfg.merge_from_dict(args.cfg_options)
    if args.work_dir is not None:
        cfg.work_dir = args.work_dir
    elif cfg.get("work_dir", None) is None:
        cfg.work_dir = os.path.join("./work_dirs", os.path.splitext(os.path.basename(args.config))[0])
    if args.amp:
        wrapper = cfg.optim_wrapper.type
        if wrapper == "AmpOptimWrapper":
            print_log("AMP training is already enabled in your config.", logger="current", level=logging.WARNING)
        elif wrapper != "OptimWrapper":
            error(f"--amp needs the optimizer wrapper type OptimWrapper, the config has {wrapper}")
        else:
            cfg.optim_wrapper.type = "AmpOptimWrapper"
            cfg.optim_wrapper.loss_scale = "dynamic"
    if args.sync_bn != "none":
        cfg.sync_bn = args.sync_bn
    if args.auto_scale_lr:
        scale = cfg.get("auto_scale_lr")
        if not scale or "enable" not in scale or "base_batch_size" not in scale:
            error('--auto-scale-lr needs "auto_scale_lr" with "enable" and "base_batch_size" in the config')
        cfg.auto_scale_lr.enable = True
    if args.resume == "auto":
        cfg.resume = True
        cfg.load_from = None
    elif args.resume is not None:
        cfg.resume = True
        cfg.load_from = args.resume
    return switch_config(cfg, arena_bytes=args.arena_bytes, prefetch_depth=args.prefetch_depth,
                         pack_eval=not args.no_pack_eval)


@contextlib.contextmanager
def _environ(name: str, value: str) -> Iterator[None]:
    """``os.environ[name] = value`` for the duration, the previous state put back after."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


# torch's switches of torch.load's default; one the user set stands as they set it
_WEIGHTS_ONLY_SWITCHES = ("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_WEIGHTS_ONLY_LOAD")


def _resume_trusted(runner: Any) -> None:
    """Makes ``runner.resume`` load its checkpoint as mmengine 0.10 expects.

    mmengine's ``load_checkpoint`` calls ``torch.load`` with its defaults, which from torch 2.6
    load weights only and refuse what an mmengine checkpoint holds (the message hub's
    ``HistoryBuffer``, numpy values). Asked to resume, the command loads that one checkpoint
    with ``weights_only=False`` (torch's ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``, set for the
    duration of the resume): the checkpoint the user named, or the latest one of their work
    dir, is trusted as the config file is (which the command runs as Python). Every other load
    (``load_from`` without resuming, a model's pretrained weights) keeps torch's default."""
    if any(name in os.environ for name in _WEIGHTS_ONLY_SWITCHES):
        return
    from mmengine.logging import print_log

    resume = runner.resume

    @functools.wraps(resume)
    def resume_trusted(filename: str, *args: Any, **kwargs: Any) -> Any:
        print_log(f"mtc_loader: resuming from {filename}, loaded with torch.load(weights_only=False) as mmengine "
                  "expects: the command trusts the checkpoint it resumes from", logger="current",
                  level=logging.WARNING)
        with _environ("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1"), warnings.catch_warnings():
            # (torch says so at each load it forces: said once above)
            warnings.filterwarnings("ignore", message="Environment variable TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
            return resume(filename, *args, **kwargs)

    runner.resume = resume_trusted


def _cpu_process_group(cfg: Any) -> None:
    """On a machine without CUDA, with ``--launcher pytorch``: sets up the process group with gloo
    and has the model wrapped in DDP without ``device_ids``.

    mmengine's ``init_dist`` calls ``torch.cuda.set_device`` and its default DDP wrapper names the
    rank's GPU (``device_ids=[LOCAL_RANK]``): neither works without CUDA. The Runner uses a
    process group that is already set up, and a ``model_wrapper_cfg``'s ``device_ids`` over its
    default, so the command does both here: ``dist_cfg``'s backend (gloo where the config names
    nccl, which needs GPUs) and timeout, and mmengine's default wrapper with ``device_ids=None``
    (or that key added to a DDP wrapper the config names)."""
    import torch
    import torch.distributed as dist
    from mmengine.logging import print_log
    from mmengine.registry import MODEL_WRAPPERS

    if torch.cuda.is_available() or not dist.is_available() or dist.is_initialized():
        return
    dist_cfg = dict(cfg.get("env_cfg", {}).get("dist_cfg", {}))
    if dist_cfg.pop("init_backend", "torch") != "torch":
        return  # deepspeed's or colossalai's launch: theirs
    backend = dist_cfg.pop("backend", "nccl")
    if backend == "nccl":
        print_log("mtc_loader: no CUDA device: the process group uses gloo, not the config's nccl",
                  logger="current", level=logging.WARNING)
        backend = "gloo"
    if dist_cfg.get("timeout") is not None:
        dist_cfg["timeout"] = datetime.timedelta(seconds=dist_cfg["timeout"])
    dist.init_process_group(backend=backend, **dist_cfg)
    wrapper = cfg.get("model_wrapper_cfg")
    if wrapper is None:  # mmengine's default wrapper, without device_ids
        cfg.model_wrapper_cfg = dict(type="MMDistributedDataParallel", device_ids=None, broadcast_buffers=False,
                                     find_unused_parameters=cfg.get("find_unused_parameters", False))
        return
    tp = wrapper.get("type", "MMDistributedDataParallel")
    cls = MODEL_WRAPPERS.get(tp) if isinstance(tp, str) else tp
    if isinstance(cls, type) and issubclass(cls, torch.nn.parallel.DistributedDataParallel):
        wrapper.setdefault("device_ids", None)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if "LOCAL_RANK" not in os.environ:
        os.environ["LOCAL_RANK"] = str(args.local_rank)
    from mmengine.registry import RUNNERS
    from mmengine.runner import Runner

    cfg = build_config(args)
    if args.launcher == "pytorch":
        _cpu_process_group(cfg)
    runner = RUNNERS.build(cfg) if "runner_type" in cfg else Runner.from_cfg(cfg)
    if cfg.get("resume"):
        _resume_trusted(runner)
    runner.train()
    return 0


if __name__ == "__main__":
    sys.exit(main())
