"""A synthetic COCO training set for bench_openmmlab_train.py's YOLOv3: ``annotations/train.json``
and JPEG images of real sizes (640x480 to 1280x720, and 480x640), one to six boxes each, read by
mmdet's ``CocoDataset``."""
from __future__ import annotations

import json
import os
from typing import Any

from . import sets

LANDSCAPE = [(640, 480), (800, 600), (960, 540), (1024, 768), (1280, 720)]
PORTRAIT = [(480, 640)]
QUICK_LANDSCAPE = [(160, 120), (240, 180), (320, 180)]
QUICK_PORTRAIT = [(120, 160)]


def write(root: str, entries: int, batch_size: int, unique: int, quick: bool) -> dict[str, Any]:
    """A COCO-format training set under ``root``: ``unique`` JPEG files and ``entries`` image
    entries in ``annotations/train.json`` naming them in turn, each with its own boxes. In every
    block of 8 batches' worth of entries the first batch's worth is portrait, so that mmdet's
    ``AspectRatioBatchSampler`` yields exactly ``n / batch_size`` full batches of the first ``n``
    entries whenever ``n`` is a multiple of ``8 * batch_size`` (the dataset's ``indices``).
    Returns a summary; kept when ``root`` already holds the same set."""
    import cv2
    import numpy as np

    from mmdet.datasets import CocoDataset

    spec = dict(entries=entries, batch_size=batch_size, unique=unique, quick=quick, version=2)
    summary = sets.kept(root, spec)
    if summary is not None:
        return summary
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
    images: list[dict[str, Any]] = []
    annotations: list[dict[str, Any]] = []
    block = 8 * batch_size
    for i in range(entries // block * block):
        tall = i % block < batch_size
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
    return sets.stamp(root, dict(spec=spec))
