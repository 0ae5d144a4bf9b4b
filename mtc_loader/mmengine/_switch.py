"""The switch applied to a whole config: :func:`switch_config` and :class:`MTCRunner`."""
from __future__ import annotations

import copy
import functools
import inspect
import os
import warnings
from collections.abc import MutableMapping
from typing import Any, Optional, Union

from mmengine.config import Config
from mmengine.registry import LOOPS, RUNNERS
from mmengine.runner import Runner

_MODULE = "mtc_loader.mmengine"
_COLLATE = "mtc_packed_collate"
_PRE = "MTCDataPreprocessor"
# mmengine's loops and the ones that take their place
_TRAIN = {"EpochBasedTrainLoop": "MTCEpochBasedTrainLoop", "IterBasedTrainLoop": "MTCIterBasedTrainLoop"}
_EVAL = {"val": ("ValLoop", "MTCValLoop"), "test": ("TestLoop", "MTCTestLoop")}


def _name(tp: Any) -> Any:
    """A config's ``type``: its name, whether given as a string (``"mmdet::ValLoop"`` scoped or
    not) or a class."""
    if isinstance(tp, str):
        return tp.rsplit("::", 1)[-1]
    return getattr(tp, "__name__", tp)


def _packed(collate_fn: Any) -> dict[str, Any]:
    """``mtc_packed_collate`` packing what the loader's ``collate_fn`` (a config, default
    ``pseudo_collate``) makes, with that config's other arguments."""
    if collate_fn is None:
        return dict(type=_COLLATE)
    if not isinstance(collate_fn, dict):  # a callable given in place of a config
        return dict(type=_COLLATE, collate_fn=collate_fn)
    fn = dict(collate_fn)
    tp = fn.pop("type", "pseudo_collate")
    if _name(tp) == _COLLATE:
        return dict(collate_fn)
    if _name(tp) == "pseudo_collate" and not fn:
        return dict(type=_COLLATE)
    return dict(type=_COLLATE, collate_fn=tp, **fn)


def _train_loop(train_cfg: Any, prefetch_depth: Optional[int]) -> Optional[dict[str, Any]]:
    """The prefetching loop's config for a train loop's, or None for a loop of another kind
    (kept as it is)."""
    if not isinstance(train_cfg, dict):
        return None
    cfg = dict(train_cfg)
    tp = cfg.get("type")
    by_epoch = cfg.pop("by_epoch", None)
    if tp is None:
        if by_epoch is None:
            return None  # mmengine's Runner refuses it: left for its message
        cfg["type"] = "MTCEpochBasedTrainLoop" if by_epoch else "MTCIterBasedTrainLoop"
    elif _name(tp) in _TRAIN:
        cfg["type"] = _TRAIN[_name(tp)]
    elif _name(tp) not in _TRAIN.values():
        return None
    if by_epoch is not None and (cfg["type"] == "MTCEpochBasedTrainLoop") is not bool(by_epoch):
        return None  # a contradiction: left for the loop to refuse
    if prefetch_depth is not None:
        cfg["prefetch_depth"] = prefetch_depth
    return cfg


def _eval_loop(loop_cfg: Any, kind: str) -> Optional[dict[str, Any]]:
    if not isinstance(loop_cfg, dict):
        return None
    plain, ours = _EVAL[kind]
    tp = _name(loop_cfg.get("type", plain))
    if tp not in (plain, ours):
        return None
    return dict(loop_cfg, type=ours)


_WRAPPER_KEYS = ("arena_bytes", "run_ahead")  # MTCDataPreprocessor's own, in a child config's line


def _switch(cfg: MutableMapping[str, Any], *, arena_bytes: Optional[int] = None,
            prefetch_depth: Optional[int] = None, pack_eval: bool = True) -> None:
    """Applies the switch, in place, to the runner's arguments in ``cfg`` (a Config or the
    keywords of ``Runner``): the model's data preprocessor wrapped, each loop of mmengine's
    replaced by its counterpart, and the loaders of the replaced loops packed."""
    model = cfg.get("model")
    if isinstance(model, dict):
        # (the Runner's own data_preprocessor argument is the model's when the model names none)
        pre = model.get("data_preprocessor", cfg.get("data_preprocessor"))
        if not (isinstance(pre, dict) and _name(pre.get("type")) == _PRE):
            wrapper: dict[str, Any] = dict(type=_PRE)
            if isinstance(pre, dict) and any(k in pre for k in _WRAPPER_KEYS):
                # a config's own arena or run-ahead line (model=dict(data_preprocessor=dict(
                # arena_bytes=...)), merged into its base's preprocessor) is the wrapper's: no
                # preprocessor of mmengine's or OpenMMLab's takes them
                pre = copy.copy(pre)
                wrapper.update((k, pre.pop(k)) for k in _WRAPPER_KEYS if k in pre)
                pre = pre or None  # the line alone, over a base that names no preprocessor
            if pre is not None:
                wrapper["preprocessor"] = pre
            model["data_preprocessor"] = wrapper
        if arena_bytes is not None:
            model["data_preprocessor"]["arena_bytes"] = arena_bytes  # (a Config holds a copy of what it is given)
    train = _train_loop(cfg.get("train_cfg"), prefetch_depth)
    loader = cfg.get("train_dataloader")
    if train is not None:
        cfg["train_cfg"] = train
        if isinstance(loader, dict):
            loader["collate_fn"] = _packed(loader.get("collate_fn"))
    for kind in ("val", "test"):
        loop = _eval_loop(cfg.get(f"{kind}_cfg"), kind)
        loader = cfg.get(f"{kind}_dataloader")
        if loop is None or not isinstance(loader, dict):
            continue
        cfg[f"{kind}_cfg"] = loop
        if pack_eval:
            loader["collate_fn"] = _packed(loader.get("collate_fn"))


def config_file(path: Union[str, "os.PathLike[str]"]) -> str:
    """The file of a config named as mmengine's ``_base_`` names one: a path, or a config of an
    installed package by its scope, ``"mmdet3d::pointpillars/pointpillars_hv_secfpn_8xb6-160e_kitti-3d-3class.py"``,
    found where mmengine finds it (the package's model index, then its ``.mim/configs``: a pip
    install keeps the configs inside the package).

    Raises FileNotFoundError for a config that is not there, ModuleNotFoundError for a scope
    whose package is not installed, ValueError for a scope mmengine does not know."""
    name = os.fspath(path)
    if "::" not in name or os.path.exists(name):
        return name
    scope, _, rel = name.partition("::")
    from mmengine.config.utils import MODULE2PACKAGE

    if scope not in MODULE2PACKAGE:
        raise ValueError(f"mtc_loader: config {name!r}: mmengine knows no package of scope {scope!r}; the scopes it "
                         f"knows are {', '.join(sorted(MODULE2PACKAGE))} (or give the config file's path)")
    if "/" not in rel or "::" in rel:
        raise ValueError(f"mtc_loader: config {name!r}: a config of an installed package is named "
                         f"'{scope}::<folder>/<file>.py', its path under the package's configs "
                         f"(e.g. 'mmdet3d::pointpillars/pointpillars_hv_secfpn_8xb6-160e_kitti-3d-3class.py')")
    try:
        found, _ = Config._get_cfg_path(name, "")
    except ModuleNotFoundError:
        package = MODULE2PACKAGE[scope]
        absent = ModuleNotFoundError(f"mtc_loader: config {name!r}: its scope {scope!r} is the package {package}, "
                                     f"which is not installed here (pip install {package})", name=package)
        setattr(absent, _SAID, True)  # (said here)
        raise absent from None
    except FileNotFoundError:
        from mmengine.utils import get_installed_path

        configs = os.path.join(get_installed_path(MODULE2PACKAGE[scope]), ".mim", "configs")
        raise FileNotFoundError(f"mtc_loader: config {name!r}: the installed {scope} has no config {rel} "
                                f"(its configs are in {configs})") from None
    except (AssertionError, ValueError) as e:  # mmengine's own checks of the name
        raise ValueError(f"mtc_loader: config {name!r}: {e}") from None
    return str(found)


def switch_config(cfg: Union[Config, str, "os.PathLike[str]"], *, arena_bytes: Optional[int] = None,
                  prefetch_depth: Optional[int] = None, pack_eval: bool = True) -> Config:
    """The config ``cfg`` (a :class:`mmengine.config.Config`, a config file's path, or a config of
    an installed package by its scope, ``"mmdet3d::pointpillars/....py"``, as ``_base_`` names
    one) with mtc_loader's switch applied, as a new Config (``cfg`` is not changed):

    - ``custom_imports`` imports ``mtc_loader.mmengine`` (in every process the config starts);
    - the model's ``data_preprocessor`` is wrapped by ``MTCDataPreprocessor``;
    - the train loop, if mmengine's (``by_epoch=True`` / ``False`` or ``EpochBasedTrainLoop`` /
      ``IterBasedTrainLoop``), becomes ``MTCEpochBasedTrainLoop`` / ``MTCIterBasedTrainLoop``,
      and its loader's ``collate_fn`` becomes ``mtc_packed_collate`` around the one it had;
    - the validation and test loops, if mmengine's (``ValLoop``, ``TestLoop``, or no type),
      become ``MTCValLoop`` / ``MTCTestLoop``, and their loaders are packed too (unless
      ``pack_eval=False``).

    A loop of another kind (a project's own) is kept, and so is its loader's ``collate_fn``.
    Parts already switched are kept as they are, so switching twice changes nothing.

    Args:
        cfg: The config, the path of its file, or ``"<scope>::<path under the package's configs>"``
            found where mmengine finds a ``_base_`` of that form.
        arena_bytes: The shared arena's size (``MTCDataPreprocessor``'s ``arena_bytes``).
        prefetch_depth: The train loop's ``prefetch_depth`` (0: no prefetching).
        pack_eval: Whether validation and test loaders are packed as well.

    Returns:
        The switched config, ready for ``Runner.from_cfg`` (or ``RUNNERS.build``).
    """
    if isinstance(cfg, Config):
        out = copy.deepcopy(cfg)
    else:
        __tracebackhide__ = True  # (pytest's word: an import of the config's is not the switch's)
        try:
            out = Config.fromfile(config_file(cfg))
        except ImportError as e:
            out = _explained(e)
            if out is e:
                raise
            raise out from e
    imports = out.get("custom_imports")
    if imports is None:
        out["custom_imports"] = dict(imports=[_MODULE], allow_failed_imports=False)
    else:
        names = imports.get("imports", [])
        names = [names] if isinstance(names, str) else list(names)
        if _MODULE not in names:
            imports["imports"] = names + [_MODULE]
    _switch(out, arena_bytes=arena_bytes, prefetch_depth=prefetch_depth, pack_eval=pack_eval)
    return out


# ------------------------------------------------------------------------- imports that fail beneath the switch

# what mmdet3d's datasets and models import at run time that a pip install of mmdet3d does not pull
# (the two devkits without their own pins, which would move numpy and others: tools/install_openmmlab.sh)
_MMDET3D_EXTRAS = ("pip install pyquaternion trimesh pandas scikit-learn cachetools && "
                   "pip install --no-deps lyft_dataset_sdk nuscenes-devkit")
_SAID = "_mtc_loader_said"  # an exception already explained (it may pass several of the frames below)


def _importer(e: ImportError) -> Optional[str]:
    """The module whose ``import`` statement raised ``e`` (the innermost frame outside importlib),
    or None where mmengine (or importlib) imported the name itself: a config's ``custom_imports``."""
    frame = None
    tb = e.__traceback__
    while tb is not None:
        if not tb.tb_frame.f_code.co_filename.startswith("<frozen importlib"):
            frame = tb.tb_frame
        tb = tb.tb_next
    name = frame.f_globals.get("__name__") if frame is not None else None
    if not isinstance(name, str) or name.split(".")[0] in ("mmengine", "importlib", "mtc_loader"):
        return None
    return name


def _first_import_error(e: ImportError) -> ImportError:
    """The import error ``e`` was raised for: mmengine raises its own for a ``custom_imports`` that
    fails ("Failed to import custom modules"), in the handling of the one that names the module."""
    while e.name is None and isinstance(e.__cause__ or e.__context__, ImportError):
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return e


def _import_note(e: ImportError) -> Optional[str]:
    """What :func:`_explained` says of ``e``: the missing module and whose dependency it is, or None
    (an import error of mtc_loader's own, or one already explained). mmengine's own error for a
    ``custom_imports`` that fails ("Failed to import custom modules") is read through the error it
    was raised in."""
    if getattr(e, _SAID, False):
        return None
    e = _first_import_error(e)
    if e.name is None or e.name.split(".")[0] == "mtc_loader":
        return None
    importer = _importer(e)
    top = importer.split(".")[0] if importer is not None else None
    if importer is None:
        note = (f"mtc_loader: the module {e.name!r} cannot be imported: the config (its custom_imports, or the "
                "package of a registry scope it uses) names it. mtc_loader's frames in this traceback only pass "
                "the import on: install the module, or fix the name in the config")
    else:
        note = (f"mtc_loader: {importer} imports {e.name!r}, which is not installed: a dependency of {top} "
                f"itself, not of mtc_loader (whose frames in this traceback only pass the import on)")
        if top == "mmdet3d":
            note += (f". A pip install of mmdet3d does not pull what its datasets and models import at run time: "
                     f"{_MMDET3D_EXTRAS}")
        else:
            note += f": install it as {top}'s documentation says"
    return note


def _explained(e: ImportError) -> ImportError:
    """``e`` with a note (:func:`_import_note`) that names the missing module and whose dependency it
    is: an import of the user's config, of its ``custom_imports`` or of the packages they use, which
    mtc_loader's frames only pass on. (Python 3.10, without notes: a new exception of the same
    class, whose cause is ``e``.)"""
    note = _import_note(e)
    if note is None:
        return e
    if hasattr(e, "add_note"):
        e.add_note(note)
        out = e
    else:  # Python 3.10
        out = type(e)(f"{e}\n{note}", name=e.name, path=e.path)
        out.__cause__ = e
    setattr(out, _SAID, True)
    return out


_RUNNER_ARGS = inspect.signature(Runner.__init__)


@RUNNERS.register_module()
class MTCRunner(Runner):  # type: ignore[misc]
    """mmengine's ``Runner`` with mtc_loader's switch applied to its arguments
    (:func:`switch_config`): a config only needs ``runner_type="MTCRunner"`` (with
    ``custom_imports`` importing ``mtc_loader.mmengine``), however its base configs write the
    model's preprocessor and the loops. Explicit switch lines are kept as they are, and a
    ``train_cfg`` with both ``type`` (an mtc_loader loop) and the ``by_epoch`` a base schedule
    sets is accepted.

    ``RUNNERS.build(cfg)`` (what the OpenMMLab projects' ``tools/train.py`` calls when the config
    has a ``runner_type``) and ``MTCRunner.from_cfg(cfg)`` both build it; mmengine's
    ``Runner.from_cfg(cfg)`` ignores ``runner_type`` and builds a plain ``Runner``, which trains
    without the switch: it warns once when the config names ``MTCRunner``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = _RUNNER_ARGS.bind(self, *args, **kwargs)
        arguments = dict(bound.arguments)
        arguments.pop("self")
        for key in ("model", "train_dataloader", "val_dataloader", "test_dataloader", "train_cfg", "val_cfg",
                    "test_cfg"):
            if isinstance(arguments.get(key), dict):
                arguments[key] = copy.deepcopy(arguments[key])
        _switch(arguments)
        __tracebackhide__ = True  # (pytest's word: an import that fails beneath is not the switch's)
        try:
            super().__init__(**arguments)
        except ImportError as e:
            out = _explained(e)
            if out is e:
                raise
            raise out from e

    @classmethod
    def from_cfg(cls, cfg: Config) -> "MTCRunner":
        # the config the runner keeps (and writes to its work_dir) is the switched one
        runner: MTCRunner = super().from_cfg(switch_config(cfg))
        return runner

    def build_train_loop(self, loop: Any) -> Any:
        if isinstance(loop, dict) and "type" in loop and "by_epoch" in loop:
            cls = LOOPS.get(loop["type"]) if isinstance(loop["type"], str) else loop["type"]
            if getattr(cls, "__module__", "").startswith(_MODULE):
                # the pair mmengine's Runner refuses: an mtc_loader loop checks by_epoch itself
                return LOOPS.build(copy.deepcopy(loop),
                                   default_args=dict(runner=self, dataloader=self._train_dataloader))
        return super().build_train_loop(loop)


# ------------------------------------------------------------------------- Runner.from_cfg's check

# A script that builds its runner with mmengine's Runner.from_cfg(cfg) ignores runner_type: a
# config switched by its two lines then trains without the switch, and none of mtc_loader's code
# runs to notice (the config's only trace of the switch is runner_type, which Runner.from_cfg
# never reads, and the module's import by custom_imports happens before any runner exists). So
# the check sits in Runner.from_cfg itself, installed when mtc_loader.mmengine is imported (the
# import that custom_imports makes, which also fills mmengine's registries): it reads the
# config's runner_type and warns once; what from_cfg builds, its signature and its docstring
# stay mmengine's. A process that never imports mtc_loader.mmengine keeps mmengine's Runner
# untouched.

_said_ignored = False  # whether the warning was given (once per process)


def _names_mtc_runner(runner_type: Any) -> bool:
    """Whether a config's ``runner_type`` (a registered name or a class) is MTCRunner or a subclass."""
    cls = runner_type
    if isinstance(runner_type, str):
        try:
            cls = RUNNERS.get(runner_type)
        except Exception:  # a scope that does not import: not ours to report here
            return False
    return isinstance(cls, type) and issubclass(cls, MTCRunner)


def _check_runner_type(cls: Any, cfg: Any) -> None:
    """Warns (once) when ``cls.from_cfg`` builds a runner that is not the MTCRunner ``cfg`` names."""
    global _said_ignored
    if _said_ignored or (isinstance(cls, type) and issubclass(cls, MTCRunner)):
        return
    runner_type = cfg.get("runner_type") if isinstance(cfg, MutableMapping) or hasattr(cfg, "get") else None
    if runner_type is None or not _names_mtc_runner(runner_type):
        return
    _said_ignored = True
    warnings.warn(
        f"mtc_loader: the config names runner_type={_name(runner_type)!r}, which {getattr(cls, '__name__', cls)}"
        ".from_cfg ignores: this run trains without mtc_loader's switch (mmengine's loops, data preprocessor "
        "and collate). Build the runner the config names: RUNNERS.build(cfg) (from mmengine.registry import "
        "RUNNERS; what the OpenMMLab projects' tools/train.py call) or MTCRunner.from_cfg(cfg) (from "
        "mtc_loader.mmengine import MTCRunner)", UserWarning, stacklevel=3)


def _install_runner_check() -> None:
    """Wraps ``Runner.from_cfg`` with :func:`_check_runner_type` (once per process)."""
    plain = Runner.__dict__.get("from_cfg")
    if not isinstance(plain, classmethod) or getattr(plain.__func__, "_mtc_loader_check", False):
        return
    build = plain.__func__

    @functools.wraps(build)
    def from_cfg(cls: Any, cfg: Any) -> Any:
        _check_runner_type(cls, cfg)
        return build(cls, cfg)

    from_cfg._mtc_loader_check = True  # type: ignore[attr-defined]
    Runner.from_cfg = classmethod(from_cfg)


_install_runner_check()
