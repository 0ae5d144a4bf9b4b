"""bench_openmmlab_train.py's parts: the models and their synthetic sets (models.py, coco.py,
nuscenes.py, waymo.py, and the stamp they share: sets.py), the arms' process (child.py), the pairs' statistics (paired.py) and the
plain-torch stand-ins for mmcv's device kernels (ops.py)."""
