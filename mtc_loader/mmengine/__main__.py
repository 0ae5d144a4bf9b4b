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
from typing import Any, Callable, Iterator, Optional, Sequence

from .._options import parse_size


_MAX_ARENA_BYTES = 1 << 46  # the engine's limit (mtc_loader.Arena's)


def _size(text: str) -> int:
    """``--arena-bytes``: bytes, as a number (``536870912``) or with a unit, K, M, G or T, powers
    of 1024 (``512M``, ``512MiB``, ``512MB`` all mean 512 MiB)."""
    n = parse_size(text)
    if n is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: give a number of bytes (536870912) or one with a unit, K, M, G or T, "
            "powers of 1024 (512M, 512MiB)")
    if not 1 <= n <= _MAX_ARENA_BYTES:
        raise argparse.ArgumentTypeError(f"{text!r} is not from 1 byte to 64 TiB (the arena's size)")
    return n


def _count(what: str) -> Callable[[str], int]:
    """An argument that takes an int >= 0 (``what`` says what it counts)."""

    def count(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = -1
        if n < 0:
            raise argparse.ArgumentTypeError(f"{text!r} is not an int >= 0 ({what})")
        return n

    count.__name__ = "int"  # argparse's own word for it
    return count


def _parser() -> argparse.ArgumentParser:
    from mmengine.config import DictAction

    parser = argparse.ArgumentParser(
        prog="python3 -m mtc_loader.mmengine",
        description="Train an OpenMMLab config with mtc_loader's switch (packed batches, one DMA per dtype each, "
                    "prefetched), the config file left as it is.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train", help="train a config file (the arguments of tools/train.py)",
        description="Train a config file with mtc_loader's switch applied (mtc_loader.mmengine.switch_config). "
                    "Every argument is checked before anything starts: a bad one stops the command with "
                    "'error: ...' and exit status 2, nothing created.")
    train.set_defaults(error=train.error)  # what build_config reports a bad argument or config with
    train.add_argument("config", help="train config file path, or a config of an installed package by its scope, "
                                      "as _base_ names one: mmdet3d::pointpillars/pointpillars_hv_secfpn_8xb6-160e_"
                                      "kitti-3d-3class.py (a pip install keeps the configs inside the package)")
    train.add_argument("--work-dir", help="the dir to save logs and models (default: the config's work_dir, "
                                          "else ./work_dirs/<config name>)")
    train.add_argument("--amp", action="store_true", default=False,
                       help="enable automatic-mixed-precision training (the config's optim_wrapper becomes "
                            "AmpOptimWrapper; default: off)")
    train.add_argument("--sync_bn", choices=["none", "torch", "mmcv"], default="none",
                       help="convert all BatchNorm layers in the model to SyncBatchNorm (default: none)")
    train.add_argument("--auto-scale-lr", action="store_true",
                       help="enable automatically scaling LR (the config's auto_scale_lr; default: off)")
    train.add_argument("--resume", nargs="?", type=str, const="auto",
                       help="resume from this checkpoint, or (no value) from the latest in the work dir; "
                            "the checkpoint is loaded with torch.load(weights_only=False), as mmengine "
                            "expects: resume only from checkpoints you trust (default: no resume)")
    train.add_argument("--cfg-options", nargs="+", action=DictAction,
                       help="override settings of the config, key=value (merged into it before the switch)")
    train.add_argument("--launcher", choices=["none", "pytorch", "slurm", "mpi"], default="none",
                       help="job launcher (default: none; pytorch: under torchrun)")
    train.add_argument("--local_rank", "--local-rank", type=_count("the process's rank on its machine"), default=0,
                       help="the process's rank on its machine, where LOCAL_RANK is not set (default: 0)")
    train.add_argument("--arena-bytes", type=_size, default=None, metavar="SIZE",
                       help="size of the shared arena (MTCDataPreprocessor's arena_bytes): bytes, or with a unit "
                            "K, M, G, T, powers of 1024 (512M, 1GiB); it should hold num_workers * prefetch_factor + 1 "
                            "batches, plus depth on a GPU (default: the config's, else 256M)")
    train.add_argument("--prefetch-depth", type=_count("batches prefetched; 0: none"), default=None, metavar="N",
                       help="batches prefetched by the train loop, 0: none (default: the config's, else 2)")
    train.add_argument("--no-pack-eval", action="store_true",
                       help="leave the validation and test loaders unpacked (default: packed)")
    return parser


# what each launcher reads from the environment, which its launch (torchrun, srun, mpirun) sets
_LAUNCH_ENV = {
    "pytorch": (("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"), "torchrun --nproc_per_node=N -m "
                "mtc_loader.mmengine train CONFIG --launcher pytorch"),
    "slurm": (("SLURM_PROCID", "SLURM_NTASKS", "SLURM_NODELIST"), "srun ... python3 -m mtc_loader.mmengine "
              "train CONFIG --launcher slurm"),
    "mpi": (("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "MASTER_ADDR"),
            "mpirun ... python3 -m mtc_loader.mmengine train CONFIG --launcher mpi (with MASTER_ADDR set)"),
}


def _check_arguments(args: argparse.Namespace) -> None:
    """The arguments that need no config, checked before anything starts (argparse's way: the
    usage, ``error: ...``, exit status 2)."""
    error = args.error
    if args.launcher in _LAUNCH_ENV:
        names, how = _LAUNCH_ENV[args.launcher]
        missing = [n for n in names if not os.environ.get(n)]
        if missing:
            error(f"--launcher {args.launcher} reads {', '.join(missing)} from the environment, which "
                  f"{'is' if len(missing) == 1 else 'are'} not set: start the command as {how}")
    if args.resume not in (None, "auto") and "://" not in args.resume and not os.path.isfile(args.resume):
        error(f"--resume {args.resume}: no checkpoint file {args.resume} (no value: the latest checkpoint "
              "of the work dir)")


def _check_work_dir(work_dir: Any, error: Callable[[str], Any]) -> None:
    """A work dir the runner can create (or that is a directory already)."""
    path = os.path.abspath(os.fspath(work_dir))
    if os.path.exists(path) and not os.path.isdir(path):
        error(f"work dir {work_dir} is a file, not a directory: give another --work-dir")
    parent = path
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        error(f"work dir {work_dir} cannot be created: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        error(f"work dir {work_dir} cannot be {'written' if parent == path else 'created'}: "
              f"{parent} is not writable")


def _check_switched(path: str, cfg: Any, error: Callable[[str], Any]) -> None:
    """What the switch put in the config (the command's options, or the config's own values of
    them), checked as the runner would check it once it has started."""
    from .._arena import check_arena_bytes
    from ._loops import _check_depth

    model = cfg.get("model")
    pre = model.get("data_preprocessor") if isinstance(model, dict) else None
    if isinstance(pre, dict) and "arena_bytes" in pre:
        try:
            check_arena_bytes(pre["arena_bytes"])
        except ValueError as e:
            error(f"config file {path}: model.data_preprocessor.arena_bytes={pre['arena_bytes']!r}: "
                  f"{str(e).removeprefix('mtc_loader: ')} (or give --arena-bytes)")
    train = cfg.get("train_cfg")
    if isinstance(train, dict) and "prefetch_depth" in train:
        try:
            _check_depth(train["prefetch_depth"])
        except ValueError as e:
            error(f"config file {path}: train_cfg.prefetch_depth={train['prefetch_depth']!r}: "
                  f"{str(e).removeprefix('mtc_loader: ')} (or give --prefetch-depth)")


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


def _config_error(path: str, e: BaseException, name: Optional[str] = None) -> str:
    """What ``error: config file ...`` says of an exception raised while reading the config file
    at ``path`` (``name``: as the user gave it): where (the config's line, or the file and line of
    a base or a module it imports) and what."""
    name = path if name is None else name
    where: Optional[tuple[str, Optional[int]]] = None
    if isinstance(e, SyntaxError):
        found = _syntax_error(path) or e
        where = (found.filename, found.lineno) if found.filename and found.lineno else None
        what = f"SyntaxError: {found.msg}"
    elif isinstance(e, FileNotFoundError) and e.filename is not None:
        return f"config file {name}: no file {e.filename}"
    else:
        if isinstance(e, ImportError):  # the one that names the module (mmengine's own wraps it)
            from ._switch import _first_import_error

            e = _first_import_error(e)
        frames = [f for f in traceback.extract_tb(e.__traceback__) if not _library(f.filename)]
        if frames:
            where = (frames[-1].filename, frames[-1].lineno)
        what = f"{type(e).__name__}: {e}"
        if isinstance(e, ImportError):
            from ._switch import _import_note

            note = _import_note(e)
            what += f" ({note.removeprefix('mtc_loader: ')})" if note else ""
    if where is None or where[1] is None or where[0] in ("<unknown>", "<string>"):
        return f"config file {name}: {what}"
    if os.path.abspath(where[0]) == os.path.abspath(path):
        return f"config file {name}, line {where[1]}: {what}"
    return f"config file {name}: {where[0]}, line {where[1]}: {what}"


def _read_config(args: argparse.Namespace) -> Any:
    """The config file (a path, or ``<scope>::<path>`` for a config of an installed package),
    read; a config that is not there, does not parse or fails to run is reported as argparse
    reports a bad argument (usage, ``error: ...``, exit status 2)."""
    from mmengine.config import Config

    from ._switch import config_file

    error = args.error
    try:
        path = config_file(args.config)
    except (OSError, ImportError, ValueError) as e:
        error(str(e).removeprefix("mtc_loader: "))
    if not os.path.isfile(path):
        error(f"no config file {args.config}")
    try:
        return Config.fromfile(path)
    except Exception as e:
        error(_config_error(path, e, args.config))


def build_config(args: argparse.Namespace) -> Any:
    """The switched config for the parsed arguments, as ``tools/train.py`` prepares it."""
    from mmengine.logging import print_log

    from . import switch_config

    error = args.error
    cfg = _read_config(args)
    cfg.launcher = args.launcher
    if args.cfg_options is not None:
        try:
            cfg.merge_from_dict(args.cfg_options)
        except Exception as e:
            error(f"--cfg-options {' '.join(f'{k}={v!r}' for k, v in args.cfg_options.items())}: "
                  f"{type(e).__name__}: {e}")
    if args.work_dir is not None:
        cfg.work_dir = args.work_dir
    elif cfg.get("work_dir", None) is None:
        cfg.work_dir = os.path.join("./work_dirs", os.path.splitext(os.path.basename(args.config))[0])
    if args.amp:
        wrapper_cfg = cfg.get("optim_wrapper")
        if not isinstance(wrapper_cfg, dict):
            error(f"--amp needs an optim_wrapper in the config (optim_wrapper=dict(type='OptimWrapper', "
                  f"optimizer=...)); {args.config} has {'none' if wrapper_cfg is None else repr(wrapper_cfg)}")
        wrapper = _type_name(wrapper_cfg.get("type", "OptimWrapper"))  # mmengine's default type
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
    switched = switch_config(cfg, arena_bytes=args.arena_bytes, prefetch_depth=args.prefetch_depth,
                             pack_eval=not args.no_pack_eval)
    _check_switched(args.config, switched, error)
    _check_work_dir(switched.work_dir, error)
    return switched


def _type_name(tp: Any) -> Any:
    """A config's ``type`` by its name (``"mmengine::OptimWrapper"`` scoped or not, or a class)."""
    from ._switch import _name

    return _name(tp)


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
    _check_arguments(args)
    from mmengine.registry import RUNNERS
    from mmengine.runner import Runner

    cfg = build_config(args)  # (checks the config and what depends on it: nothing has started yet)
    if "LOCAL_RANK" not in os.environ:
        os.environ["LOCAL_RANK"] = str(args.local_rank)
    if args.launcher == "pytorch":
        _cpu_process_group(cfg)
    from ._switch import _explained

    __tracebackhide__ = True  # (pytest's word: an import that fails beneath is not the command's)
    try:
        runner = RUNNERS.build(cfg) if "runner_type" in cfg else Runner.from_cfg(cfg)
        if cfg.get("resume"):
            _resume_trusted(runner)
        runner.train()
    except ImportError as e:  # of the config's packages (mmdet3d's datasets), which the runner builds
        out = _explained(e)
        if out is e:
            raise
        raise out from e
    return 0


if __name__ == "__main__":
    sys.exit(main())
