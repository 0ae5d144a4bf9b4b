"""OpenMMLab's mmengine: data samples packed, one DMA per dtype of a batch, and the prefetch service, with a
config change.

Importing this module (it needs ``mmengine``; ``import mtc_loader`` never imports it):

- registers mmengine's ``BaseDataElement`` and every subclass (``InstanceData``, ``PixelData``,
  ``Det3DDataSample``, your own) as containers (:func:`mtc_loader.register_container`): their
  data fields holding tensors or other data elements are copied, their metainfo and their other
  data fields (numpy arrays, lists, strings) are kept as they are, which is what
  ``BaseDataElement.to`` does;
- registers ``mtc_packed_collate`` in mmengine's ``FUNCTIONS``: ``pseudo_collate`` (or the
  collate function you name) in the DataLoader worker, its output packed into a shared arena
  (:class:`~mtc_loader.PackedCollate`);
- registers :class:`MTCDataPreprocessor` in ``MODELS``: wraps the model's data preprocessor (any
  ``BaseDataPreprocessor``, e.g. mmdet3d's ``Det3DDataPreprocessor``); a packed batch is moved
  with one DMA per dtype before the wrapped preprocessor runs, whose own ``cast_data`` then has nothing
  left to do; with ``run_ahead=True``, the wrapped preprocessor runs on the prefetch thread, for the
  next batch while the step trains;
- registers :class:`MTCEpochBasedTrainLoop` and :class:`MTCIterBasedTrainLoop` in ``LOOPS``:
  mmengine's loops with the batches prefetched by :class:`~mtc_loader.PrefetchLoader` (batch k+1
  copied on the copy stream while step k trains);
- registers :class:`MTCValLoop` and :class:`MTCTestLoop` in ``LOOPS``, and :class:`MTCRunner`
  in ``RUNNERS``: mmengine's ``Runner`` with all of the above applied to what the config builds
  (:func:`switch_config`);
- wraps ``Runner.from_cfg`` with a check: it ignores ``runner_type``, and warns once when the
  config it builds names ``MTCRunner``.

In a child config of the config you train (see the docs' mmengine recipe)::

    _base_ = ["mmdet3d::pointpillars/pointpillars_hv_secfpn_8xb6-160e_kitti-3d-3class.py"]

    custom_imports = dict(imports=["mtc_loader.mmengine"], allow_failed_imports=False)
    runner_type = "MTCRunner"

or, with the config left as it is, ``python3 -m mtc_loader.mmengine train CONFIG``.
"""

from __future__ import annotations

try:  # the parts of mmengine the rooms below import
    import mmengine.dataset
    import mmengine.hooks
    import mmengine.model
    import mmengine.registry
    import mmengine.runner
    import mmengine.structures  # noqa: F401
except ImportError as e:
    raise ImportError(f"mtc_loader: mtc_loader.mmengine needs mmengine (pip install mmengine): {e}") from None

# each room registers what it defines when it is imported: the data elements and structure types
# as containers, mtc_packed_collate in FUNCTIONS, MTCDataPreprocessor in MODELS, the loops in LOOPS,
# MTCRunner in RUNNERS (and Runner.from_cfg's check)
from . import _elements  # noqa: F401,I100
from ._collate import PackedPseudoCollate, packed_collate
from ._preprocessor import MTCDataPreprocessor
from ._loops import MTCEpochBasedTrainLoop, MTCIterBasedTrainLoop, MTCTestLoop, MTCValLoop
from ._switch import MTCRunner, switch_config

__all__ = ["MTCDataPreprocessor", "MTCEpochBasedTrainLoop", "MTCIterBasedTrainLoop", "MTCRunner", "MTCTestLoop",
           "MTCValLoop", "PackedPseudoCollate", "packed_collate", "switch_config"]
