"""``python3 -m mtc_loader.mmengine train CONFIG ...``: trains a config file with mtc_loader's switch
applied (:func:`mtc_loader.mmengine.switch_config`), taking the arguments of the OpenMMLab
projects' ``tools/train.py``."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any, Optional, Sequence


def _parser() -> argparse.ArgumentParser:
    from mmengine.config import DictAction

    parser = argparse.ArgumentParser(
        prog="python3 -m mtc_loader.mmengine",
        description="Train an OpenMMLab config with mtc_loader's switch (packed batches, one DMA each, "
                    "prefetched), the config file left as it is.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a config file (the arguments of tools/train.py)")
    train.add_argument("config", help="train config file path")
    train.add_argument("--work-dir", help="the dir to save logs and models")
    train.add_argument("--amp", action="store_true", default=False,
                       help="enable automatic-mixed-precision training")
    train.add_argument("--sync_bn", choices=["none", "torch", "mmcv"], default="none",
                       help="convert all BatchNorm layers in the model to SyncBatchNorm")
    train.add_argument("--auto-scale-lr", action="store_true", help="enable automatically scaling LR")
    train.add_argument("--resume", nargs="?", type=str, const="auto",
                       help="resume from this checkpoint, or (no value) from the latest in the work dir")
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


def build_config(args: argparse.Namespace) -> Any:
    """The switched config for the parsed arguments, as ``tools/train.py`` prepares it."""
    from mmengine.config import Config
    from mmengine.logging import print_log

    from . import switch_config

    cfg = Config.fromfile(args.config)
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
            raise SystemExit(f"--amp needs the optimizer wrapper type OptimWrapper, the config has {wrapper}")
        else:
            cfg.optim_wrapper.type = "AmpOptimWrapper"
            cfg.optim_wrapper.loss_scale = "dynamic"
    if args.sync_bn != "none":
        cfg.sync_bn = args.sync_bn
    if args.auto_scale_lr:
        scale = cfg.get("auto_scale_lr")
        if not scale or "enable" not in scale or "base_batch_size" not in scale:
            raise SystemExit('--auto-scale-lr needs "auto_scale_lr" with "enable" and "base_batch_size" in the config')
        cfg.auto_scale_lr.enable = True
    if args.resume == "auto":
        cfg.resume = True
        cfg.load_from = None
    elif args.resume is not None:
        cfg.resume = True
        cfg.load_from = args.resume
    return switch_config(cfg, arena_bytes=args.arena_bytes, prefetch_depth=args.prefetch_depth,
                         pack_eval=not args.no_pack_eval)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if "LOCAL_RANK" not in os.environ:
        os.environ["LOCAL_RANK"] = str(args.local_rank)
    from mmengine.registry import RUNNERS
    from mmengine.runner import Runner

    cfg = build_config(args)
    runner = RUNNERS.build(cfg) if "runner_type" in cfg else Runner.from_cfg(cfg)
    runner.train()
    return 0


if __name__ == "__main__":
    sys.exit(main())
