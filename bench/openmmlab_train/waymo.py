"""A synthetic Waymo training set of real size for bench_openmmlab_train.py's multi-view FCOS3D++
(``MultiViewDfM``): laid out as mmdet3d's ``tools/create_data.py waymo`` writes it
(``kitti_format/training/image_0..4/*.jpg``, ``waymo_infos_train.pkl`` of info version 1.1 with
``images``, ``instances`` and ``cam_sync_instances``), read by mmdet3d's own ``WaymoDataset`` and
the config's pipeline (``LoadMultiViewImageFromFiles``, ``LoadAnnotations3D``,
``MultiViewWrapper`` of the photometric, resize, crop and flip transforms, ...).

A frame has Waymo's five cameras: FRONT, FRONT_LEFT and FRONT_RIGHT of 1920 x 1280, SIDE_LEFT
and SIDE_RIGHT of 1920 x 886, each a JPEG of quality 90 (about 300 KB) of a street-like picture
(sky, road, buildings and vehicles as shapes, sensor noise), from a pinhole camera 2 m out from the
LiDAR in the direction it looks: 0, +-45 and +-90 degrees from the car's heading (``cam2img``,
``lidar2cam``, ``lidar2img``). A frame holds 30 cars, 14 pedestrians and 4 cyclists within the
config's range.
"""
from __future__ import annotations

import os
import pickle
from typing import Any

import numpy as np

from . import sets

CLASSES = ["Car", "Pedestrian", "Cyclist"]  # WaymoDataset's METAINFO order
SIZES = {"Car": (4.7, 2.1, 1.8), "Pedestrian": (0.9, 0.8, 1.75), "Cyclist": (1.8, 0.8, 1.8)}
COUNTS = {"Car": 30, "Pedestrian": 14, "Cyclist": 4}
# name, image folder, yaw (degrees, from the car's heading, to the left), width, height
CAMERAS = [("CAM_FRONT", "image_0", 0.0, 1920, 1280), ("CAM_FRONT_LEFT", "image_1", 45.0, 1920, 1280),
           ("CAM_FRONT_RIGHT", "image_2", -45.0, 1920, 1280), ("CAM_SIDE_LEFT", "image_3", 90.0, 1920, 886),
           ("CAM_SIDE_RIGHT", "image_4", -90.0, 1920, 886)]
FOCAL = 2060.0


def camera(yaw_deg: float, width: int, height: int, scale: float) -> dict[str, Any]:
    """A camera's matrices (4 x 4 lists): ``cam2img`` (focal length and principal point scaled
    with the image), ``lidar2cam`` (LiDAR x forward, y left, z up to the camera's x right, y
    down, z forward, the camera 2 m out from the LiDAR where it looks and 0.3 m below it) and
    ``lidar2img``."""
    yaw = np.deg2rad(yaw_deg)
    c, s = np.cos(yaw), np.sin(yaw)
    to_cam_axes = np.array([[0, -1, 0], [0, 0, -1], [1, 0, 0]], dtype=np.float64)
    rot = to_cam_axes @ np.array([[c, s, 0], [-s, c, 0], [0, 0, 1]])  # the LiDAR frame turned by -yaw
    position = np.array([2.0 * c, 2.0 * s, -0.3])
    lidar2cam = np.eye(4)
    lidar2cam[:3, :3] = rot
    lidar2cam[:3, 3] = -rot @ position
    f = FOCAL * scale
    cam2img = np.array([[f, 0, width / 2, 0], [0, f, height / 2, 0], [0, 0, 1, 0], [0, 0, 0, 1]])
    return dict(cam2img=cam2img.tolist(), lidar2cam=lidar2cam.tolist(), lidar2img=(cam2img @ lidar2cam).tolist())


def _picture(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """A street-like BGR picture: a sky gradient, a road, buildings and vehicles as filled
    shapes, and sensor noise (so a JPEG of it decodes at a photo's cost)."""
    import cv2

    img = np.empty((height, width, 3), np.uint8)
    horizon = int(height * rng.uniform(0.42, 0.55))
    ramp = np.linspace(0, 1, horizon)[:, None, None]
    sky0, sky1 = rng.integers(150, 256, 3), rng.integers(90, 200, 3)
    img[:horizon] = (sky0 * (1 - ramp) + sky1 * ramp).astype(np.uint8)
    img[horizon:] = rng.integers(60, 120, 3, dtype=np.uint8)
    for _ in range(int(rng.integers(6, 14))):  # buildings
        x0 = int(rng.integers(-width // 8, width))
        w, h = int(rng.integers(width // 12, width // 3)), int(rng.integers(height // 8, horizon))
        cv2.rectangle(img, (x0, horizon - h), (x0 + w, horizon), tuple(int(v) for v in rng.integers(40, 220, 3)), -1)
        for _ in range(int(rng.integers(4, 20))):  # windows
            wx, wy = x0 + int(rng.integers(0, max(w, 1))), horizon - int(rng.integers(0, max(h, 1)))
            cv2.rectangle(img, (wx, wy), (wx + width // 80, wy + height // 60),
                          tuple(int(v) for v in rng.integers(20, 120, 3)), -1)
    for _ in range(int(rng.integers(3, 10))):  # vehicles and people
        cx, cy = int(rng.integers(0, width)), int(rng.integers(horizon, height))
        size = int((cy - horizon + 10) * rng.uniform(0.3, 1.2))
        cv2.rectangle(img, (cx - size, cy - size // 2), (cx + size, cy), tuple(int(v) for v in rng.integers(0, 256, 3)), -1)
        cv2.circle(img, (cx - size // 2, cy), max(size // 5, 2), (20, 20, 20), -1)
        cv2.circle(img, (cx + size // 2, cy), max(size // 5, 2), (20, 20, 20), -1)
    noise = rng.normal(0, 3, img.shape)
    return np.clip(img + noise, 0, 255).astype(np.uint8)


def _instances(rng: np.random.Generator, reach: float) -> list[dict[str, Any]]:
    """The frame's LiDAR boxes (x, y, z bottom centre, dx, dy, dz, yaw) in the config's range,
    vehicles along the road, people beside it."""
    boxes: list[np.ndarray] = []
    out: list[dict[str, Any]] = []
    for name, count in COUNTS.items():
        dx, dy, dz = SIZES[name]
        placed = 0
        for _ in range(4000):
            if placed == count:
                break
            if name == "Car":
                x, y = rng.uniform(-0.45 * reach, reach), rng.choice([-5.25, -1.75, 1.75, 5.25, -9.0, 9.0])
                yaw = rng.choice([0.0, np.pi]) + rng.normal(0, 0.05)
            else:
                x, y = rng.uniform(-0.45 * reach, reach), rng.choice([-1.0, 1.0]) * rng.uniform(8.0, 14.0)
                yaw = rng.uniform(-np.pi, np.pi)
            if np.hypot(x, y) < 4 or any(np.hypot(x - b[0], y - b[1]) < (np.hypot(dx, dy) + np.hypot(b[3], b[4])) / 2
                                         for b in boxes):
                continue
            box = np.array([x, y, -2.1 + rng.normal(0, 0.05), dx * rng.uniform(0.9, 1.1),
                            dy * rng.uniform(0.9, 1.1), dz * rng.uniform(0.9, 1.1), yaw])
            boxes.append(box)
            out.append(dict(bbox_3d=[float(v) for v in box], bbox_label_3d=CLASSES.index(name),
                            num_lidar_points_in_box=int(rng.integers(20, 2000)), difficulty=0,
                            camera_id=-1, group_id=len(out)))
            placed += 1
    return out


def write(root: str, frames: int, unique: int, quick: bool) -> dict[str, Any]:
    """The set under ``root`` (a Waymo ``kitti_format`` data root): ``unique`` frames of five
    JPEGs each and ``frames`` infos naming them in turn, each with its own index. Returns a
    summary; kept when ``root`` already holds the same set."""
    import cv2

    spec = dict(frames=frames, unique=unique, quick=quick, version=2)
    summary = sets.kept(root, spec)
    if summary is not None:
        return summary
    scale = 0.1 if quick else 1.0
    rng = np.random.default_rng(0)
    cams = {name: (folder, camera(yaw, round(w * scale), round(h * scale), scale), round(w * scale), round(h * scale))
            for name, folder, yaw, w, h in CAMERAS}
    for folder, *_ in cams.values():
        os.makedirs(os.path.join(root, "training", folder), exist_ok=True)
    jpeg_bytes = 0
    for k in range(unique):
        for folder, _, w, h in cams.values():
            ok, buf = cv2.imencode(".jpg", _picture(rng, w, h), [cv2.IMWRITE_JPEG_QUALITY, 90])
            assert ok
            buf.tofile(os.path.join(root, "training", folder, f"1{k:03d}000.jpg"))
            jpeg_bytes += buf.size
    scenes = [_instances(rng, 75.0) for _ in range(unique)]
    infos = []
    for i in range(frames):
        k = i % unique
        images = {name: dict(img_path=f"1{k:03d}000.jpg", height=h, width=w, **mats)
                  for name, (folder, mats, w, h) in cams.items()}
        infos.append(dict(
            sample_idx=1_000_000 + i, timestamp=1_550_083_467_346_370 + i * 100_000,
            context_name=f"segment-{k:020d}_000_000", ego2global=np.eye(4).tolist(),
            lidar_points=dict(num_pts_feats=6, lidar_path=f"1{k:03d}000.bin"), images=images,
            instances=scenes[k], cam_sync_instances=scenes[k], cam_instances={name: [] for name in cams}))
    metainfo = dict(dataset="WaymoDataset", info_version="1.1", version="1.4",
                    categories={c: i for i, c in enumerate(CLASSES)})
    with open(os.path.join(root, "waymo_infos_train.pkl"), "wb") as f:
        pickle.dump(dict(metainfo=metainfo, data_list=infos), f)
    summary = dict(spec=spec, boxes_per_frame=len(scenes[0]), jpeg_kb_per_frame=round(jpeg_bytes / unique / 1024),
                   image_sizes=[[w, h] for _, _, w, h in cams.values()])
    return sets.stamp(root, summary)
