"""A synthetic nuScenes training set of real size for bench_openmmlab_train.py's CenterPoint: laid
out as mmdet3d's ``tools/create_data.py nuscenes`` writes it (info version 1.1), read by mmdet3d's
own ``NuScenesDataset`` and the config's pipeline (``LoadPointsFromFile``,
``LoadPointsFromMultiSweeps``, ``ObjectSample`` from the GT database, ...).

Each scene is a simulated 32-beam spinning LiDAR (nuScenes' HDL-32E: 32 rings from -30.67 to
+10.67 degrees, 1084 firings per turn, 1.84 m above the ground, 70 m of range) casting rays at a
street: the ground, facades 13-16 m either side of the road with gaps between the buildings, far
buildings at 60 m, and the scene's 36 annotated objects (at least one of each of nuScenes' 10
classes) as oriented boxes. Every point is (x, y, z, intensity 0..255, ring index) as float32,
about 34,000 per turn. A sample is the key frame and the 10 sweeps before it, 50 ms apart, the car
driving 0.2 m per sweep (their ``lidar2sensor`` says so); the config's pipeline takes 9 of the
sweeps, about 340,000 points. The GT database holds 10 objects of each class seen alone at 6-30 m
(their points of 11 turns, time lag in the 5th column). That every sample holds every class makes
the config's ``CBGSDataset`` resample N entries into exactly 10 N.
"""
from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import pickle
from typing import Any

import numpy as np

from . import sets

CLASSES = ["car", "truck", "construction_vehicle", "bus", "trailer", "barrier", "motorcycle",
           "bicycle", "pedestrian", "traffic_cone"]  # the order of create_data's infos
SIZES = {"car": (4.6, 1.9, 1.7), "truck": (6.9, 2.5, 2.8), "construction_vehicle": (6.4, 2.8, 3.2),
         "bus": (11.0, 2.9, 3.5), "trailer": (12.0, 2.9, 3.9), "barrier": (0.5, 2.5, 1.0),
         "motorcycle": (2.1, 0.8, 1.5), "bicycle": (1.7, 0.6, 1.3), "pedestrian": (0.7, 0.7, 1.8),
         "traffic_cone": (0.4, 0.4, 1.1)}
COUNTS = {"car": 10, "truck": 2, "construction_vehicle": 1, "bus": 1, "trailer": 1, "barrier": 6,
          "motorcycle": 1, "bicycle": 1, "pedestrian": 8, "traffic_cone": 5}
HEIGHT = 1.84  # the sensor above the ground (m)
SWEEPS = 10
SWEEP_DT = 0.05  # s between sweeps (20 Hz)
SPEED = 4.0  # m/s: the car drives along +x
DATABASE = 10  # GT database objects per class


def _boxes(rng: np.random.Generator, reach: float, counts: dict[str, int]) -> tuple[np.ndarray, list[str]] | None:
    """Non-overlapping boxes (x, y, z bottom, dx, dy, dz, yaw), COUNTS of each class, on the
    ground, between 3 m and ``reach`` from the sensor: vehicles along the road's four lanes, the
    others on the pavements either side of it."""
    boxes: list[np.ndarray] = []
    names: list[str] = []
    for name in sorted(counts, key=lambda n: -SIZES[n][0]):  # the longest first
        count = counts[name]
        dx, dy, dz = SIZES[name]
        placed = 0
        for _ in range(2000):
            if placed == count:
                break
            if name in ("car", "truck", "bus", "trailer", "construction_vehicle", "motorcycle"):
                lane = rng.choice([-5.25, -1.75, 1.75, 5.25])
                x, y = rng.uniform(-reach, reach), lane + rng.normal(0, 0.2)
                yaw = (0.0 if lane < 0 else np.pi) + rng.normal(0, 0.05)
            else:
                side = rng.choice([-1.0, 1.0])
                x, y = rng.uniform(-reach, reach), side * rng.uniform(7.5, 12.0)
                yaw = rng.uniform(-np.pi, np.pi)
            r = np.hypot(x, y)
            if not 3.0 < r < reach:
                continue
            radius = np.hypot(dx, dy) / 2
            if any(np.hypot(x - b[0], y - b[1]) < radius + np.hypot(b[3], b[4]) / 2 + 0.3 for b in boxes):
                continue
            boxes.append(np.array([x, y, -HEIGHT, dx, dy, dz, yaw]))
            names.append(name)
            placed += 1
        if placed < count:
            return None  # no room left: the caller draws another scene
    return np.stack(boxes), names


def _facades(rng: np.random.Generator, reach: float) -> list[Any]:
    """Each side's facade: its distance from the road's middle and its buildings (x from, x to,
    height), with gaps between them."""
    sides = []
    for _ in range(2):
        segments, x = [], -reach - 30.0
        while x < reach + 30.0:
            width = rng.uniform(8, 30)
            segments.append((x, x + width, rng.uniform(4, 25)))
            x += width + rng.uniform(0, 6)
        sides.append((rng.uniform(13, 16), segments))
    return sides


def _cast(rng: np.random.Generator, origin: np.ndarray, boxes: np.ndarray, walls: list[Any], far: float,
          azimuths: int, max_range: float, window: tuple[float, float] = (-np.pi, np.pi)) -> np.ndarray:
    """The returns of one turn of the LiDAR at ``origin`` (in the key frame), of the firings
    whose azimuth lies in ``window``: (x, y, z) in the key frame, intensity, ring; rays that hit
    nothing within ``max_range`` give no point."""
    elev = np.deg2rad(np.linspace(-30.67, 10.67, 32))
    az = np.linspace(-np.pi, np.pi, azimuths, endpoint=False) + rng.uniform(0, 2 * np.pi / azimuths)
    az = az[(az >= window[0]) & (az < window[1])]
    rings, a = np.meshgrid(np.arange(32), az, indexing="ij")
    e = elev[rings]
    d = np.stack([np.cos(e) * np.cos(a), np.cos(e) * np.sin(a), np.sin(e)], -1).reshape(-1, 3)
    ring = rings.reshape(-1)
    t = np.full(len(d), np.inf)
    kind = np.zeros(len(d), np.int8)  # 0 none, 1 ground, 2 wall, 3 object
    down = d[:, 2] < 0
    t[down] = (-HEIGHT - origin[2]) / d[down, 2]
    kind[down] = 1
    # the street's facades (y = +-13..16 m), buildings along x with gaps between them, and
    # beyond them (and through the gaps) a far ring of buildings
    for side, (offset, segments) in zip((1.0, -1.0), walls):
        toward = d[:, 1] * side > 0
        with np.errstate(divide="ignore", invalid="ignore"):
            tw = np.where(toward, (side * offset - origin[1]) / d[:, 1], np.inf)
        xw, zw = origin[0] + tw * d[:, 0], origin[2] + tw * d[:, 2]
        onto = np.zeros(len(d), bool)
        for x0, x1, top in segments:
            onto |= (xw >= x0) & (xw < x1) & (zw < top - HEIGHT)
        hit = toward & onto & (tw < t)
        t[hit], kind[hit] = tw[hit], 2
    horiz = np.hypot(d[:, 0], d[:, 1])
    tf = far / np.maximum(horiz, 1e-6)
    hit = (tf < t) & (origin[2] + tf * d[:, 2] < 12.0 - HEIGHT)
    t[hit], kind[hit] = tf[hit], 2
    # objects: the slab test in each box's frame
    for b in boxes:
        c, s = np.cos(-b[6]), np.sin(-b[6])
        o = origin - np.array([b[0], b[1], b[2] + b[5] / 2])
        ol = np.array([c * o[0] - s * o[1], s * o[0] + c * o[1], o[2]])
        dl = np.stack([c * d[:, 0] - s * d[:, 1], s * d[:, 0] + c * d[:, 1], d[:, 2]], -1)
        half = b[3:6] / 2
        with np.errstate(divide="ignore", invalid="ignore"):
            t1 = (-half - ol) / dl
            t2 = (half - ol) / dl
        near = np.nanmax(np.minimum(t1, t2), axis=1)
        far = np.nanmin(np.maximum(t1, t2), axis=1)
        hit = (near <= far) & (near > 0) & (near < t)
        t[hit], kind[hit] = near[hit], 3
    keep = np.isfinite(t) & (t < max_range)
    t, d, kind, ring = t[keep], d[keep], kind[keep], ring[keep]
    t = t + rng.normal(0, 0.02, len(t))
    xyz = origin + d * t[:, None]
    intensity = np.select([kind == 1, kind == 2], [rng.gamma(2.0, 4.0, len(t)), rng.gamma(3.0, 8.0, len(t))],
                          rng.gamma(2.0, 20.0, len(t)))
    intensity[(kind == 3) & (rng.random(len(t)) < 0.02)] = 255.0  # retro-reflectors: plates, signs
    return np.concatenate([xyz, np.clip(intensity, 0, 255)[:, None], ring[:, None]], 1).astype(np.float32)


def _in_box(points: np.ndarray, box: np.ndarray) -> np.ndarray:
    c, s = np.cos(-box[6]), np.sin(-box[6])
    x, y = points[:, 0] - box[0], points[:, 1] - box[1]
    lx, ly = c * x - s * y, s * x + c * y
    lz = points[:, 2] - box[2]
    return (np.abs(lx) <= box[3] / 2) & (np.abs(ly) <= box[4] / 2) & (lz >= 0) & (lz <= box[5])


def _geometry(quick: bool) -> tuple[float, int, float, float]:
    """The scenes' reach (m), the firings per turn, the LiDAR's range (m), the far buildings (m)."""
    return (24.0, 128, 30.0, 26.0) if quick else (45.0, 1084, 70.0, 60.0)


def _scene(job: tuple[str, int, bool]) -> dict[str, Any]:
    """Scene ``k``'s key frame and sweeps written under ``root``; returns its base timestamp,
    its annotations and its point counts (in a worker process: seeded by ``k``)."""
    root, k, quick = job
    rng = np.random.default_rng([1, k])
    reach, azimuths, max_range, far = _geometry(quick)
    base_ts = 1_533_151_600_000_000 + k * 20_000_000
    while True:  # until every class has a box the key frame sees (its valid_flag: CBGSDataset counts those)
        drawn = _boxes(rng, reach, {name: 1 for name in CLASSES} if quick else COUNTS)
        if drawn is None:
            continue
        boxes, names = drawn
        walls = _facades(rng, reach)
        key = _cast(rng, np.zeros(3), boxes, walls, far, azimuths, max_range)
        seen = [int(_in_box(key, box).sum()) for box in boxes]
        if {n for n, c in zip(names, seen) if c > 0} == set(CLASSES):
            break
    clouds = [key]
    for s in range(1, SWEEPS + 1):
        origin = np.array([-SPEED * SWEEP_DT * s, 0.0, 0.0])
        clouds.append(_cast(rng, origin, boxes, walls, far, azimuths, max_range))
    for s, pts in enumerate(clouds):  # s = 0: the key frame
        local = pts.copy()
        local[:, 0] += SPEED * SWEEP_DT * s  # the sweep in its own sensor frame
        name = f"n008-2018-08-01-15-16-36-0400__LIDAR_TOP__{base_ts - s * 50_000}.pcd.bin"
        local.tofile(os.path.join(root, "samples/LIDAR_TOP" if s == 0 else "sweeps/LIDAR_TOP", name))
    instances = []
    for box, name, n_key in zip(boxes, names, seen):
        velocity = (rng.normal(0, 1.5, 2) if name in ("car", "truck", "bus", "motorcycle", "bicycle")
                    else np.zeros(2)).tolist()
        instances.append(dict(
            bbox_3d=[float(box[0]), float(box[1]), float(box[2] + box[5] / 2), *map(float, box[3:6]),
                     float(box[6])],  # nuScenes' boxes: the gravity centre
            bbox_label_3d=CLASSES.index(name), bbox_3d_isvalid=n_key > 0, velocity=velocity,
            num_lidar_pts=n_key, num_radar_pts=int(rng.integers(0, 6)), attr_label=0))
    return dict(base_ts=base_ts, instances=instances, n_points=[len(c) for c in clouds])


def write(root: str, entries: int, unique: int, quick: bool) -> dict[str, Any]:
    """The set under ``root``: ``unique`` scenes (their key frames, sweeps and GT database) and
    ``entries`` training infos naming them in turn, each with its own token. Returns a summary
    (points per sweep, boxes per sample, ...); kept when ``root`` already holds the same set."""
    spec = dict(entries=entries, unique=unique, quick=quick, version=2)
    summary = sets.kept(root, spec)
    if summary is not None:
        return summary
    for d in ("samples/LIDAR_TOP", "sweeps/LIDAR_TOP", "nuscenes_gt_database"):
        os.makedirs(os.path.join(root, d), exist_ok=True)
    rng = np.random.default_rng(0)
    reach, azimuths, max_range, _ = _geometry(quick)
    eye = np.eye(4)
    scenes: list[dict[str, Any]] = []
    dbinfos: dict[str, list[dict[str, Any]]] = {name: [] for name in CLASSES}
    n_points: list[int] = []
    jobs = [(root, k, quick) for k in range(unique)]
    with concurrent.futures.ProcessPoolExecutor(min(unique, os.cpu_count() or 1),
                                                mp_context=multiprocessing.get_context("fork")) as pool:
        for scene in pool.map(_scene, jobs):
            scenes.append(scene)
            n_points += scene["n_points"]
    # the GT database: objects of each class seen alone, 6-30 m away, their points of the 11 turns
    # (the time lag in the 5th column) relative to the box's bottom centre, as create_data's
    # nuScenes database holds them
    for name in CLASSES:
        for j in range(DATABASE):
            dx, dy, dz = SIZES[name]
            r, a = rng.uniform(6, min(30.0, reach)), rng.uniform(-np.pi, np.pi)
            box = np.array([r * np.cos(a), r * np.sin(a), -HEIGHT, dx, dy, dz, rng.uniform(-np.pi, np.pi)])
            a = np.clip(a, -np.pi + 0.5, np.pi - 0.5)  # the window below stays inside (-pi, pi)
            box[:2] = r * np.cos(a), r * np.sin(a)
            window = (a - 0.5, a + 0.5)  # wider than any box seen from 6 m or more
            clouds = [_cast(rng, np.array([-SPEED * SWEEP_DT * s, 0.0, 0.0]), box[None], [], 1e9, azimuths,
                            max_range, window) for s in range(SWEEPS + 1)]
            merged = np.concatenate([np.c_[c[:, :4], np.full(len(c), s * SWEEP_DT, np.float32)]
                                     for s, c in enumerate(clouds)])
            inside = merged[_in_box(merged, box)]
            inside[:, :3] -= box[:3].astype(np.float32)
            path = f"nuscenes_gt_database/{name}_{j}.bin"
            inside.tofile(os.path.join(root, path))
            velocity = rng.normal(0, 1.5, 2) if name in ("car", "truck", "bus", "motorcycle", "bicycle") else np.zeros(2)
            dbinfos[name].append(dict(name=name, path=path, image_idx=-1, gt_idx=j,
                                      box3d_lidar=np.r_[box, velocity].astype(np.float32),
                                      num_points_in_gt=len(inside), difficulty=0,
                                      group_id=sum(len(v) for v in dbinfos.values())))
    infos = []
    for i in range(entries):
        k = i % unique
        base_ts = scenes[k]["base_ts"]
        name = f"n008-2018-08-01-15-16-36-0400__LIDAR_TOP__{base_ts}.pcd.bin"
        sweeps = []
        for s in range(1, SWEEPS + 1):
            lidar2sensor = eye.copy()
            lidar2sensor[0, 3] = SPEED * SWEEP_DT * s  # the sweep's sensor, in the key frame: -this
            sweeps.append(dict(
                lidar_points=dict(lidar_path="sweeps/LIDAR_TOP/n008-2018-08-01-15-16-36-0400__LIDAR_TOP__"
                                             f"{base_ts - s * 50_000}.pcd.bin",
                                  lidar2ego=eye.tolist(), lidar2sensor=lidar2sensor.tolist()),
                ego2global=eye.tolist(), timestamp=(base_ts - s * 50_000) / 1e6,
                sample_data_token=f"{i:016x}{s:016x}"))
        infos.append(dict(sample_idx=i, token=f"{i:032x}", timestamp=base_ts / 1e6, ego2global=eye.tolist(),
                          lidar_points=dict(num_pts_feats=5, lidar_path=name, lidar2ego=eye.tolist()),
                          lidar_sweeps=sweeps, images={}, instances=scenes[k]["instances"]))
    metainfo = dict(categories={c: i for i, c in enumerate(CLASSES)}, dataset="nuscenes",
                    version="v1.0-trainval", info_version="1.1")
    with open(os.path.join(root, "nuscenes_infos_train.pkl"), "wb") as f:
        pickle.dump(dict(metainfo=metainfo, data_list=infos), f)
    with open(os.path.join(root, "nuscenes_dbinfos_train.pkl"), "wb") as f:
        pickle.dump(dbinfos, f)
    summary = dict(spec=spec, points_per_sweep=[min(n_points), int(np.mean(n_points)), max(n_points)],
                   boxes_per_sample=len(scenes[0]["instances"]),
                   database=[len(v) for v in dbinfos.values()])
    return sets.stamp(root, summary)
