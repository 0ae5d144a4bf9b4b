"""Small synthetic datasets in the on-disk formats of OpenMMLab's real dataset classes, for the
tests that train real mmdet3d / mmdet configs (tests/test_openmmlab_models.py).

Each writer lays out a data root as the dataset's own converter would (mmdet3d's
``create_data.py`` for KITTI and nuScenes, COCO's annotation json for mmdet), so that the real
dataset class, its pipeline and its metric read it unchanged. The content is random but seeded,
small (a few samples, a few thousand points, small images) and made so that the models have
positives to learn from: points are dense inside the boxes, boxes lie inside the shrunk ranges.
"""
from __future__ import annotations

import json
import os
import pickle

import numpy as np

# KITTI's calibration: the LiDAR frame (x forward, y left, z up) to the rectified camera frame
# (x right, y down, z forward), the camera 1.5 m above the ground, focal length 720 px
KITTI_CATEGORIES = {"Pedestrian": 0, "Cyclist": 1, "Car": 2, "Van": 3, "Truck": 4,
                    "Person_sitting": 5, "Tram": 6, "Misc": 7}
KITTI_SIZES = {"Pedestrian": (0.8, 0.6, 1.73), "Cyclist": (1.76, 0.6, 1.73), "Car": (3.9, 1.6, 1.56)}


def _kitti_calib(width: int = 1242) -> dict:
    velo_to_cam = np.array([[0, -1, 0, 0], [0, 0, -1, -0.08], [1, 0, 0, -0.27], [0, 0, 0, 1]],
                           dtype=np.float64)
    r0_rect = np.eye(4)
    f = width / 1242  # a smaller camera: the intrinsics scaled with the image
    cam2img = np.array([[720.0 * f, 0, 620 * f, 0], [0, 720.0 * f, 187 * f, 0], [0, 0, 1, 0], [0, 0, 0, 1]])
    lidar2cam = r0_rect @ velo_to_cam
    return dict(velo_to_cam=velo_to_cam, r0_rect=r0_rect, cam2img=cam2img, lidar2cam=lidar2cam,
                lidar2img=cam2img @ lidar2cam)


def _points_in_box(rng: np.random.Generator, box: np.ndarray, n: int) -> np.ndarray:
    """n LiDAR points (x, y, z, intensity) inside a LiDAR box (x, y, z bottom centre, dx, dy, dz,
    yaw), relative to its bottom centre."""
    local = (rng.random((n, 3)) - [0.5, 0.5, 0.0]) * box[3:6]
    c, s = np.cos(box[6]), np.sin(box[6])
    xy = local[:, :2] @ np.array([[c, s], [-s, c]])
    return np.concatenate([xy, local[:, 2:3], rng.random((n, 1))], axis=1).astype(np.float32)


def write_kitti(root: str, n_train: int, n_val: int, xy_range: tuple, image_size: tuple | None = None,
                seed: int = 0) -> None:
    """A KITTI data root as ``tools/create_data.py kitti`` writes it (info version 1.1):
    ``training/velodyne_reduced/NNNNNN.bin`` (float32 x, y, z, intensity),
    ``kitti_infos_{train,val}.pkl``, ``kitti_gt_database/`` and ``kitti_dbinfos_train.pkl`` for
    ``ObjectSample``. Boxes and points lie in ``xy_range`` = (x_min, y_min, x_max, y_max). With
    ``image_size`` (w, h), also the left colour camera's images ``training/image_2/NNNNNN.png``
    and the ``cam_instances`` that monocular 3D detection reads (a camera with KITTI's field of
    view at that size)."""
    import cv2

    from mmdet3d.structures import Box3DMode, CameraInstance3DBoxes, LiDARInstance3DBoxes

    rng = np.random.default_rng(seed)
    width, height = image_size or (1242, 375)
    calib = _kitti_calib(width)
    os.makedirs(os.path.join(root, "training", "image_2"), exist_ok=True)
    x0, y0, x1, y1 = xy_range
    os.makedirs(os.path.join(root, "training", "velodyne_reduced"), exist_ok=True)
    os.makedirs(os.path.join(root, "kitti_gt_database"), exist_ok=True)
    infos: list = []
    dbinfos: dict = {name: [] for name in KITTI_SIZES}
    for idx in range(n_train + n_val):
        names = list(KITTI_SIZES)
        boxes, clouds, instances = [], [], []
        for k, name in enumerate(names):
            dx, dy, dz = KITTI_SIZES[name]
            cx = x0 + 3 + (x1 - x0 - 6) * (k + rng.random()) / len(names)
            cy = y0 + 3 + (y1 - y0 - 6) * rng.random()
            box = np.array([cx, cy, -1.6, dx, dy, dz, rng.uniform(-np.pi, np.pi)])
            boxes.append(box)
            clouds.append(_points_in_box(rng, box, 60) + np.r_[box[:3], 0].astype(np.float32))
        lidar_boxes = LiDARInstance3DBoxes(np.stack(boxes).astype(np.float32))
        cam_boxes = lidar_boxes.convert_to(Box3DMode.CAM, calib["lidar2cam"]).tensor.numpy()
        for k, (name, box) in enumerate(zip(names, cam_boxes)):
            centre = calib["cam2img"][:3, :3] @ box[:3]
            u, v = centre[:2] / centre[2]
            instances.append(dict(
                bbox=[float(u - 0.02 * width), float(v - 0.05 * height), float(u + 0.02 * width),
                      float(v + 0.05 * height)],
                bbox_label=KITTI_CATEGORIES[name], bbox_3d=[float(b) for b in box],
                bbox_label_3d=KITTI_CATEGORIES[name], depth=float(centre[2]),
                center_2d=[float(u), float(v)], num_lidar_pts=60, difficulty=0, truncated=0.0,
                occluded=0, alpha=float(-np.arctan2(-box[0], box[2]) + box[6]), score=0.0,
                index=k, group_id=k))
            if idx < n_train:  # the ground-truth database of the training split
                path = f"kitti_gt_database/{idx}_{name}_{k}.bin"
                (clouds[k] - np.r_[boxes[k][:3], 0].astype(np.float32)).tofile(os.path.join(root, path))
                dbinfos[name].append(dict(
                    name=name, path=path, image_idx=idx, gt_idx=k,
                    box3d_lidar=boxes[k].astype(np.float32), num_points_in_gt=60, difficulty=0,
                    group_id=len(dbinfos[name]), score=0.0))
        ground = np.concatenate([rng.uniform(x0, x1, (1500, 1)), rng.uniform(y0, y1, (1500, 1)),
                                 rng.uniform(-1.7, -1.5, (1500, 1)), rng.random((1500, 1))], axis=1)
        points = np.concatenate([ground.astype(np.float32)] + clouds)
        points.tofile(os.path.join(root, "training", "velodyne_reduced", f"{idx:06d}.bin"))
        if image_size:
            img = rng.integers(0, 64, (height, width, 3), dtype=np.uint8)
            for inst in instances:
                x_a, y_a, x_b, y_b = (int(np.clip(v, 0, lim)) for v, lim in
                                      zip(inst["bbox"], (width, height, width, height)))
                img[y_a:y_b, x_a:x_b] = rng.integers(128, 256, 3, dtype=np.uint8)
            cv2.imwrite(os.path.join(root, "training", "image_2", f"{idx:06d}.png"), img)
        images = {f"CAM{c}": dict(img_path=f"{idx:06d}.png", height=height, width=width,
                                  cam2img=calib["cam2img"].tolist(), lidar2cam=calib["lidar2cam"].tolist(),
                                  lidar2img=calib["lidar2img"].tolist()) for c in range(4)}
        images["R0_rect"] = calib["r0_rect"].tolist()
        infos.append(dict(
            sample_idx=idx, images=images, plane=[0.0, -1.0, 0.0, 1.6],
            lidar_points=dict(num_pts_feats=4, lidar_path=f"{idx:06d}.bin",
                              Tr_velo_to_cam=calib["velo_to_cam"].tolist(),
                              Tr_imu_to_velo=np.eye(4).tolist()),
            instances=instances,
            cam_instances=dict(CAM2=[{k: inst[k] for k in ("bbox", "bbox_label", "bbox_3d", "bbox_label_3d",
                                                           "center_2d", "depth")} for inst in instances])))
    metainfo = dict(categories=KITTI_CATEGORIES, dataset="kitti", info_version="1.1")
    for split, part in (("train", infos[:n_train]), ("val", infos[n_train:])):
        with open(os.path.join(root, f"kitti_infos_{split}.pkl"), "wb") as f:
            pickle.dump(dict(metainfo=metainfo, data_list=part), f)
    with open(os.path.join(root, "kitti_dbinfos_train.pkl"), "wb") as f:
        pickle.dump(dbinfos, f)


def snapshot(x):
    """What a model receives or returns, as comparable values: classes, attributes, and tensors as
    (device, dtype, shape, strides, bytes)."""
    import torch
    from mmengine.structures import BaseDataElement

    if isinstance(x, torch.Tensor):
        t = x.detach().cpu().contiguous()
        return ("tensor", str(x.device), x.dtype, tuple(x.shape), x.stride(),
                t.reshape(-1).view(torch.uint8).clone() if t.numel() else t.clone())
    if isinstance(x, BaseDataElement):
        return (type(x), sorted(((k, sorted(v) if k in ("_metainfo_fields", "_data_fields") else snapshot(v))
                                 for k, v in vars(x).items()), key=lambda kv: kv[0]))
    if isinstance(x, dict):
        return (type(x), [(k, snapshot(v)) for k, v in x.items()])
    if isinstance(x, (list, tuple)):
        return (type(x), [snapshot(v) for v in x])
    if isinstance(x, np.ndarray):
        return ("ndarray", x.dtype.str, x.shape, x.tobytes())
    if hasattr(x, "__dict__") and type(x).__module__.startswith(("mmdet", "mmcv", "mmengine")):
        return (type(x), sorted(((k, snapshot(v)) for k, v in vars(x).items()), key=lambda kv: kv[0]))
    return x


def assert_same(a, b, where: str) -> None:
    """a and b (snapshots) are equal, tensors bitwise; the first difference is named by its path."""
    import torch

    if isinstance(a, tuple) and len(a) == 6 and a[0] == "tensor" and isinstance(a[5], torch.Tensor):
        assert isinstance(b, tuple) and len(b) == 6 and b[0] == "tensor", f"{where}: {b!r:.200} is not a tensor"
        assert a[1:5] == b[1:5], f"{where}: (device, dtype, shape, strides) {b[1:5]} != {a[1:5]}"
        assert torch.equal(a[5], b[5]), f"{where}: values differ"
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: {b!r:.300} != {a!r:.300}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {b!r:.200} != {a!r:.200}"


def write_coco(root: str, n_train: int, n_val: int, size: tuple = (160, 120), seed: int = 0) -> None:
    """A COCO data root: ``{train,val}2017/NNNNNNNNNNNN.png`` images of ``size`` (w, h) with a few
    bright rectangles, and ``annotations/instances_{train,val}2017.json`` boxing them (the 80 COCO
    categories, with COCO's ids)."""
    import cv2
    from mmdet.datasets import CocoDataset

    rng = np.random.default_rng(seed)
    w, h = size
    # COCO's category ids skip numbers: 1..90 for the 80 classes
    coco_ids = [i for i in range(1, 91) if i not in (12, 26, 29, 30, 45, 66, 68, 69, 71, 83)]
    categories = [dict(id=i, name=name, supercategory="thing")
                  for i, name in zip(coco_ids, CocoDataset.METAINFO["classes"])]
    os.makedirs(os.path.join(root, "annotations"), exist_ok=True)
    image_id = ann_id = 0
    for split, n in (("train2017", n_train), ("val2017", n_val)):
        os.makedirs(os.path.join(root, split), exist_ok=True)
        images, annotations = [], []
        for _ in range(n):
            image_id += 1
            img = rng.integers(0, 64, (h, w, 3), dtype=np.uint8)
            for _k in range(3):
                bw, bh = int(rng.integers(20, w // 2)), int(rng.integers(20, h // 2))
                x, y = int(rng.integers(0, w - bw)), int(rng.integers(0, h - bh))
                img[y:y + bh, x:x + bw] = rng.integers(128, 256, 3, dtype=np.uint8)
                ann_id += 1
                annotations.append(dict(id=ann_id, image_id=image_id, category_id=coco_ids[int(rng.integers(0, 3))],
                                        bbox=[x, y, bw, bh], area=bw * bh, iscrowd=0,
                                        segmentation=[[x, y, x + bw, y, x + bw, y + bh, x, y + bh]]))
            name = f"{image_id:012d}.png"
            cv2.imwrite(os.path.join(root, split, name), img)
            images.append(dict(id=image_id, file_name=name, width=w, height=h))
        with open(os.path.join(root, "annotations", f"instances_{split}.json"), "w") as f:
            json.dump(dict(images=images, annotations=annotations, categories=categories), f)


NUS_CLASSES = ["car", "truck", "construction_vehicle", "bus", "trailer", "barrier", "motorcycle",
               "bicycle", "pedestrian", "traffic_cone"]
NUS_SIZES = {"car": (4.0, 1.8, 1.6), "truck": (6.0, 2.4, 2.8), "construction_vehicle": (5.6, 2.6, 3.0),
             "bus": (10.0, 2.8, 3.4), "trailer": (8.0, 2.4, 3.6), "barrier": (0.5, 2.4, 1.0),
             "motorcycle": (2.1, 0.8, 1.5), "bicycle": (1.7, 0.6, 1.3), "pedestrian": (0.7, 0.7, 1.7),
             "traffic_cone": (0.4, 0.4, 1.0)}


def write_nuscenes(root: str, n_train: int, n_val: int, xy_range: tuple, classes: list[list],
                   n_sweeps: int = 2, seed: int = 0) -> None:
    """A nuScenes data root as ``tools/create_data.py nuscenes`` writes it (info version 1.1):
    ``samples/LIDAR_TOP/*.bin`` and ``sweeps/LIDAR_TOP/*.bin`` (float32 x, y, z, intensity, ring),
    ``nuscenes_infos_{train,val}.pkl`` with ``lidar_sweeps``, ``nuscenes_gt_database/`` and
    ``nuscenes_dbinfos_train.pkl``. Sample i holds one box of each class of
    ``classes[i % len(classes)]``, inside ``xy_range`` = (x_min, y_min, x_max, y_max)."""
    rng = np.random.default_rng(seed)
    x0, y0, x1, y1 = xy_range
    for d in ("samples/LIDAR_TOP", "sweeps/LIDAR_TOP", "nuscenes_gt_database"):
        os.makedirs(os.path.join(root, d), exist_ok=True)
    eye = np.eye(4).tolist()

    def cloud(boxes: list, n_ground: int) -> tuple:
        ground = np.stack([rng.uniform(x0, x1, n_ground), rng.uniform(y0, y1, n_ground),
                           rng.uniform(-1.9, -1.7, n_ground), rng.random(n_ground),
                           np.zeros(n_ground)], axis=1).astype(np.float32)
        inside = [np.concatenate([_points_in_box(rng, b, 40) + np.r_[b[:3], 0].astype(np.float32),
                                  np.zeros((40, 1), np.float32)], axis=1) for b in boxes]
        return ground, inside

    infos: list = []
    dbinfos: dict = {name: [] for name in NUS_CLASSES}
    for idx in range(n_train + n_val):
        token = f"{idx:032x}"
        timestamp = 1_533_000_000_000_000 + idx * 500_000
        boxes, instances = [], []
        names = classes[idx % len(classes)]
        for k, name in enumerate(names):
            dx, dy, dz = NUS_SIZES[name]
            cx = x0 + 2 + (x1 - x0 - 4) * (k + 0.5) / len(names)
            cy = y0 + (y1 - y0) * rng.uniform(0.3, 0.7)
            box = np.array([cx, cy, -1.8, dx, dy, dz, rng.uniform(-np.pi, np.pi)])  # bottom centre
            boxes.append(box)
            instances.append(dict(
                bbox_3d=[float(cx), float(cy), float(-1.8 + dz / 2), dx, dy, dz, float(box[6])],  # gravity centre
                bbox_label_3d=NUS_CLASSES.index(name), bbox_3d_isvalid=True,
                velocity=[float(v) for v in rng.normal(0, 1, 2)], num_lidar_pts=40, num_radar_pts=0))
        ground, inside = cloud(boxes, 1500)
        lidar_path = f"n008__LIDAR_TOP__{timestamp}.pcd.bin"
        np.concatenate([ground] + inside).tofile(os.path.join(root, "samples/LIDAR_TOP", lidar_path))
        if idx < n_train:
            for k, (name, box) in enumerate(zip(names, boxes)):
                path = f"nuscenes_gt_database/{token}_{name}_{k}.bin"
                (inside[k] - np.r_[box[:3], 0, 0].astype(np.float32)).tofile(os.path.join(root, path))
                dbinfos[name].append(dict(
                    name=name, path=path, image_idx=idx, gt_idx=k,
                    box3d_lidar=np.r_[box, instances[k]["velocity"]].astype(np.float32),
                    num_points_in_gt=40, difficulty=0, group_id=len(dbinfos[name])))
        sweeps = []
        for s in range(n_sweeps):
            sweep_ts = timestamp - (s + 1) * 50_000
            sweep_path = f"n008__LIDAR_TOP__{sweep_ts}.pcd.bin"
            ground, inside = cloud(boxes, 500)
            np.concatenate([ground] + inside).tofile(os.path.join(root, "sweeps/LIDAR_TOP", sweep_path))
            sweeps.append(dict(
                lidar_points=dict(lidar_path=f"sweeps/LIDAR_TOP/{sweep_path}", lidar2ego=eye,
                                  lidar2sensor=np.eye(4).tolist()),
                ego2global=eye, timestamp=sweep_ts / 1e6, sample_data_token=f"{idx:016x}{s:016x}"))
        infos.append(dict(
            sample_idx=idx, token=token, timestamp=timestamp / 1e6, ego2global=eye,
            lidar_points=dict(num_pts_feats=5, lidar_path=lidar_path, lidar2ego=eye),
            lidar_sweeps=sweeps, instances=instances, images={}))
    metainfo = dict(categories={c: i for i, c in enumerate(NUS_CLASSES)}, dataset="nuscenes",
                    version="v1.0-trainval", info_version="1.1")
    for split, part in (("train", infos[:n_train]), ("val", infos[n_train:])):
        with open(os.path.join(root, f"nuscenes_infos_{split}.pkl"), "wb") as f:
            pickle.dump(dict(metainfo=metainfo, data_list=part), f)
    with open(os.path.join(root, "nuscenes_dbinfos_train.pkl"), "wb") as f:
        pickle.dump(dbinfos, f)
