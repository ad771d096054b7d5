"""AGRNav navigation, the pure part: voxel grid -> metres, occupied voxels, the voxel
indices AGRNav's planner reads, and a moving synthetic LiDAR for demos (no rospy; the
nodes in :mod:`robot_offload.ros` wrap these).

The voxel mapping is the exact inverse of :func:`robot_offload.models.agrnav.voxelize`:
that function puts a point ``p`` (metres) in voxel ``i = floor((p - lo) * n / (hi - lo))``
per axis, and stores it at tensor index ``[0, 0, ix, iz, iy]`` (``1 x 1 x X x Z x Y``,
SCONet's layout: x forward, then z up, then y lateral). Voxel ``i``'s centre is therefore
``lo + (i + 0.5) * (hi - lo) / n``, and a grid index ``(ix, iz, iy)`` is the point
``(x, y, z)`` in the sensor's frame -- note the two different axis orders.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence, Tuple

import numpy as np

from robot_offload.errors import ConfigError
from robot_offload.frames import check_pairing
from robot_offload.models.agrnav import DEFAULT_EXTENT, ORIGIN_M, VOXEL_SIZE_M, synthetic_scene

__all__ = [
    "OccupancyConfig",
    "LidarConfig",
    "SyntheticSweeps",
    "check_extent",
    "voxel_size",
    "voxel_centres",
    "occupied_mask",
    "occupied_voxels",
    "quaternion_matrix",
    "planner_indices",
    "split_ground",
]


# --------------------------------------------------------------------------------------------
# Voxel grid <-> metres
# --------------------------------------------------------------------------------------------


def check_extent(extent: Sequence[Sequence[float]]) -> np.ndarray:
    """``((xmin, xmax), (ymin, ymax), (zmin, zmax))`` metres as a 3 x 2 float64 array;
    :class:`ConfigError` unless every ``min < max`` and all are finite."""
    try:
        ext = np.asarray(extent, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"extent must be [[xmin, xmax], [ymin, ymax], [zmin, zmax]] metres, got {extent!r}") from e
    if ext.shape != (3, 2) or not np.all(np.isfinite(ext)) or not np.all(ext[:, 1] > ext[:, 0]):
        raise ConfigError(f"extent must be [[xmin, xmax], [ymin, ymax], [zmin, zmax]] metres with "
                          f"min < max, got {extent!r}")
    return ext


def _check_grid(grid: Sequence[int]) -> Tuple[int, int, int]:
    if len(grid) != 3 or any(int(g) != g or int(g) <= 0 for g in grid):
        raise ConfigError(f"grid must be three positive voxel counts (X, Y, Z), got {list(grid)}")
    return tuple(int(g) for g in grid)


def voxel_size(grid: Sequence[int], extent: Sequence[Sequence[float]] = DEFAULT_EXTENT) -> np.ndarray:
    """Edge lengths (x, y, z) of one voxel in metres for ``grid`` = (X, Y, Z) voxels."""
    ext = check_extent(extent)
    return (ext[:, 1] - ext[:, 0]) / np.asarray(_check_grid(grid), dtype=np.float64)


def voxel_centres(indices_xzy: np.ndarray, grid: Sequence[int],
                  extent: Sequence[Sequence[float]] = DEFAULT_EXTENT) -> np.ndarray:
    """Centres (N x 3 float64, columns x, y, z metres) of the voxels at grid indices
    ``indices_xzy`` (N x 3 integers in the ``X x Z x Y`` order of ``voxelize``'s grid, as
    ``np.argwhere`` on one grid gives them). ``grid`` is (X, Y, Z) voxels, ``voxelize``'s."""
    counts = np.asarray(_check_grid(grid), dtype=np.int64)  # x, y, z
    ext = check_extent(extent)
    idx = np.asarray(indices_xzy)
    if idx.ndim != 2 or idx.shape[1] != 3 or not np.issubdtype(idx.dtype, np.integer):
        raise ValueError(f"indices must be an N x 3 integer array (x, z, y), got {idx.dtype} {idx.shape}")
    ixyz = idx[:, [0, 2, 1]].astype(np.int64)  # (x, z, y) -> (x, y, z)
    if ixyz.size and (ixyz.min() < 0 or np.any(ixyz >= counts)):
        raise ValueError(f"voxel index outside the grid (X, Y, Z) = {tuple(counts)}")
    lo, hi = ext[:, 0], ext[:, 1]
    return lo + (ixyz + 0.5) * ((hi - lo) / counts)


def _grid_tensor(name: str, value) -> np.ndarray:
    """One ``1 x 1 x X x Z x Y`` grid (or its ``X x Z x Y`` content) as ``X x Z x Y``."""
    arr = value.detach().cpu().numpy() if hasattr(value, "detach") else np.asarray(value)
    if arr.ndim == 5:
        if arr.shape[0] != 1:
            raise ValueError(f"{name}: one frame expected, got a batch of {arr.shape[0]}")
        if arr.shape[1] != 1:
            raise ValueError(f"{name}: one value per voxel expected, got {arr.shape[1]} channels")
        arr = arr[0, 0]
    if arr.ndim != 3 or 0 in arr.shape:
        raise ValueError(f"{name} must be 1 x 1 x X x Z x Y, got shape {tuple(arr.shape)}")
    return arr


def occupied_mask(outputs: dict, threshold_logit: float = 0.0, grid: Sequence[int] = (),
                  exclude=None) -> Tuple[np.ndarray, np.ndarray]:
    """``(mask, labels)`` of one AGRNav result: X x Z x Y booleans, True where the voxel is
    occupied (its logit strictly above ``threshold_logit``), and the class ids.

    ``outputs``: ``{"occupancy": 1 x 1 x X x Z x Y logits, "labels": 1 x 1 x X x Z x Y class ids}``
    (tensors or arrays). ``grid`` (X, Y, Z), when given, must match the tensors' shape.
    ``exclude`` (a grid of the same shape, e.g. ``voxelize`` of the input sweep) clears the
    voxels where it is non-zero: what remains is what the model predicts beyond what was
    observed.
    """
    if not isinstance(outputs, dict) or "occupancy" not in outputs or "labels" not in outputs:
        keys = sorted(outputs) if isinstance(outputs, dict) else type(outputs).__name__
        raise ValueError(f"not an occupancy result: need 'occupancy' and 'labels', got {keys}")
    occ = _grid_tensor("occupancy", outputs["occupancy"])
    labels = _grid_tensor("labels", outputs["labels"])
    if occ.shape != labels.shape:
        raise ValueError(f"occupancy {occ.shape} and labels {labels.shape} differ in shape")
    nx, nz, ny = occ.shape
    if grid and tuple(int(g) for g in grid) != (nx, ny, nz):
        raise ValueError(f"result grid (X, Y, Z) = {(nx, ny, nz)} differs from the configured "
                         f"grid {tuple(grid)}")
    mask = occ > threshold_logit
    if exclude is not None:
        seen = _grid_tensor("exclude", exclude)
        if seen.shape != occ.shape:
            raise ValueError(f"exclude {seen.shape} and occupancy {occ.shape} differ in shape")
        mask &= seen == 0
    return mask, labels


def occupied_voxels(outputs: dict, threshold_logit: float = 0.0,
                    extent: Sequence[Sequence[float]] = DEFAULT_EXTENT,
                    grid: Sequence[int] = ()) -> Tuple[np.ndarray, np.ndarray]:
    """The occupied voxels of one AGRNav result (:func:`occupied_mask`): ``(xyz, label)``,
    N x 3 float32 voxel centres (x, y, z metres, sensor frame) and N float32 class ids, in
    ``np.argwhere`` order. By default the tensors' shape is the grid.
    """
    mask, labels = occupied_mask(outputs, threshold_logit, grid)
    nx, nz, ny = mask.shape
    idx = np.argwhere(mask)
    xyz = voxel_centres(idx, (nx, ny, nz), extent).astype(np.float32)
    return xyz, labels[idx[:, 0], idx[:, 1], idx[:, 2]].astype(np.float32)


# --------------------------------------------------------------------------------------------
# AGRNav's planner input
# --------------------------------------------------------------------------------------------

#: what AGRNav's planner (plan_env's SDFMap) subscribes to for the network's predictions:
#: std_msgs/Float64MultiArray, flat (x, y, z) voxel index triples of its map, whose voxels
#: are 0.1 m from (-map_size_x / 2, -map_size_y / 2, ground_height) = (-10, -10, -0.1) in
#: ``world`` with AGRNav's 20 x 20 x 5 m map; the indices are not bounds-checked there
AGRNAV_PLANNER_TOPIC = "/non_intersection_coordinates"
#: AGRNav's voxels: edge (m) and the corner of its grids, the planner's map and the voxel
#: files its network reads (point2vox) alike
AGRNAV_VOXEL_SIZE_M = VOXEL_SIZE_M
AGRNAV_ORIGIN_M = ORIGIN_M


def quaternion_matrix(x: float, y: float, z: float, w: float) -> np.ndarray:
    """3 x 3 rotation matrix of the quaternion (x, y, z, w) (normalised first); refuses a
    zero or non-finite one."""
    q = np.array([x, y, z, w], dtype=np.float64)
    n = float(np.linalg.norm(q))
    if not np.all(np.isfinite(q)) or n < 1e-9:
        raise ValueError(f"not a rotation quaternion: {q.tolist()}")
    x, y, z, w = q / n
    return np.array([
        [1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
        [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
        [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)],
    ])


def planner_indices(occupied_xzy: np.ndarray, extent: Sequence[Sequence[float]], rotation: np.ndarray,
                    translation: Sequence[float], planner_voxel_m: float, planner_origin: Sequence[float],
                    planner_grid: Sequence[int]) -> np.ndarray:
    """The planner's voxels in a model grid's occupied voxels: M x 3 int64 (x, y, z)
    indices, in C order, of the cells of the planner's map (``planner_grid`` voxels of
    ``planner_voxel_m`` from ``planner_origin``, its frame) whose centre, taken into the
    sensor frame, lies in a True voxel of ``occupied_xzy`` (X x Z x Y over ``extent``, as
    ``voxelize`` lays it out). ``rotation`` and ``translation`` map the sensor frame into
    the planner's: ``p -> rotation @ p + translation``. Cells outside ``planner_grid`` are
    never returned (the planner indexes its buffer with them unchecked)."""
    occ = np.asarray(occupied_xzy).astype(bool)
    if occ.ndim != 3:
        raise ValueError(f"occupied grid must be X x Z x Y, got shape {occ.shape}")
    nx, nz, ny = occ.shape
    ext = check_extent(extent)
    lo = ext[:, 0]
    model_counts = np.array([nx, ny, nz], dtype=np.int64)
    edge = (ext[:, 1] - lo) / model_counts
    origin = np.asarray(planner_origin, dtype=np.float64).reshape(3)
    counts = np.asarray(_check_grid(planner_grid), dtype=np.int64)
    voxel = float(planner_voxel_m)
    if not (math.isfinite(voxel) and voxel > 0) or not np.all(np.isfinite(origin)):
        raise ValueError(f"planner voxel size must be positive and its origin finite: {voxel}, {origin.tolist()}")
    rot = np.asarray(rotation, dtype=np.float64).reshape(3, 3)
    t = np.asarray(translation, dtype=np.float64).reshape(3)
    # the planner cells that can meet the model's extent: the box around its corners
    corners = np.array(np.meshgrid(*ext, indexing="ij")).reshape(3, -1).T @ rot.T + t
    first = np.clip(np.floor((corners.min(axis=0) - origin) / voxel), 0, counts).astype(np.int64)
    last = np.clip(np.ceil((corners.max(axis=0) - origin) / voxel), 0, counts).astype(np.int64)
    if not occ.any() or np.any(last <= first):
        return np.zeros((0, 3), dtype=np.int64)
    # A cell (i, j, k) maps to the model's continuous voxel coordinates affinely,
    # u = i a + j b + k c + d, so the (j, k) part is computed once and each x slab adds i a.
    affine = voxel * rot / edge  # row r: the step in model voxels per planner index r
    d = ((origin + 0.5 * voxel - t) @ rot - lo) / edge
    gy, gz = np.meshgrid(np.arange(first[1], last[1]), np.arange(first[2], last[2]), indexing="ij")
    yz = np.stack([gy.ravel(), gz.ravel()], axis=1)
    yz_part = yz @ affine[1:] + d
    out = []
    for i in range(first[0], last[0]):  # one x slab at a time: bounded memory
        m = np.floor(yz_part + i * affine[0]).astype(np.int64)
        inside = np.all((m >= 0) & (m < model_counts), axis=1)
        m = m[inside]
        hit = np.flatnonzero(inside)[occ[m[:, 0], m[:, 2], m[:, 1]]]
        out.append(np.concatenate([np.full((len(hit), 1), i, dtype=np.int64), yz[hit]], axis=1))
    return np.concatenate(out).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class OccupancyConfig:
    """occupancy_publisher's parameters (``~name``)."""

    threshold_logit: float = 0.0  # a voxel is occupied when its logit is above this
    extent: Tuple = DEFAULT_EXTENT  # metres, the client's voxelisation extent (the model's)
    grid: Tuple = ()  # (X, Y, Z) voxels to expect; () = whatever shape the results have
    # AGRNav's planner input ("" = off): the predicted voxels not in the sweep, as indices of
    # the planner's map (its frame, voxel size, origin and size in voxels)
    planner_topic: str = AGRNAV_PLANNER_TOPIC
    planner_frame: str = "world"
    planner_voxel_size: float = AGRNAV_VOXEL_SIZE_M
    planner_origin: Tuple = AGRNAV_ORIGIN_M
    planner_grid: Tuple = (200, 200, 50)
    sync_queue_size: int = 30  # sweeps kept while their result is awaited
    sync_slop_s: float = 0.01  # stamps this close are the same sweep (s)

    def validate(self) -> "OccupancyConfig":
        if not math.isfinite(float(self.threshold_logit)):
            raise ConfigError(f"threshold_logit must be finite, got {self.threshold_logit}")
        ext = check_extent(self.extent)
        grid = _check_grid(self.grid) if len(self.grid) else ()
        if not isinstance(self.planner_topic, str) or any(c.isspace() for c in self.planner_topic):
            raise ConfigError(f"planner_topic must be a topic name or \"\", got {self.planner_topic!r}")
        frame = self.planner_frame
        if not isinstance(frame, str) or not frame or frame.startswith("/") or any(c.isspace() for c in frame):
            raise ConfigError(f"planner_frame must be a TF frame id (no leading '/'), got {frame!r}")
        try:
            voxel = float(self.planner_voxel_size)
            origin = np.asarray(self.planner_origin, dtype=np.float64)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"planner_voxel_size and planner_origin must be numbers: {e}") from e
        if not (math.isfinite(voxel) and voxel > 0):
            raise ConfigError(f"planner_voxel_size must be positive, got {self.planner_voxel_size!r}")
        if origin.shape != (3,) or not np.all(np.isfinite(origin)):
            raise ConfigError(f"planner_origin must be [x, y, z] metres, got {self.planner_origin!r}")
        planner_grid = _check_grid(self.planner_grid)
        _, slop = check_pairing(self.sync_queue_size, self.sync_slop_s)
        return dataclasses.replace(self, threshold_logit=float(self.threshold_logit),
                                   extent=tuple(tuple(float(v) for v in row) for row in ext), grid=grid,
                                   planner_voxel_size=voxel, planner_origin=tuple(origin.tolist()),
                                   planner_grid=planner_grid, sync_slop_s=slop)


# --------------------------------------------------------------------------------------------
# A moving synthetic LiDAR
# --------------------------------------------------------------------------------------------

GROUND_BAND_M = 0.1  # points within this of the fitted ground plane are ground (5 x its noise)


def split_ground(points: np.ndarray, band_m: float = GROUND_BAND_M) -> np.ndarray:
    """Boolean mask of the points above the ground: a plane ``z = a + b x + c y`` fitted to
    the lowest 30 % of the points, then refitted to the points within ``band_m`` of it."""
    xyz = np.asarray(points, dtype=np.float64)[:, :3]
    if xyz.shape[0] < 3:
        return np.zeros(xyz.shape[0], dtype=bool)
    z = xyz[:, 2]
    near = z <= np.quantile(z, 0.3)
    design = np.c_[np.ones(len(z)), xyz[:, 0], xyz[:, 1]]
    residual = np.zeros_like(z)
    for _ in range(4):
        if near.sum() < 3:
            break
        coef, *_ = np.linalg.lstsq(design[near], z[near], rcond=None)
        residual = z - design @ coef
        near = np.abs(residual) < band_m
    return residual > band_m


@dataclasses.dataclass(frozen=True)
class LidarConfig:
    """lidar_node's parameters (``~name``)."""

    source: str = "synthetic"  # only "synthetic" so far; real sensors publish the topic themselves
    rate_hz: float = 10.0  # sweeps per second (Hz)
    frame_id: str = "lidar"
    seed: int = 0  # synthetic scene
    n_points: int = 20000  # points per synthetic sweep
    amplitude_m: float = 2.0  # obstacles sway +-amplitude_m laterally (and half that forward) (m)
    period_s: float = 8.0  # one sway cycle (s)

    def validate(self) -> "LidarConfig":
        if self.source != "synthetic":
            raise ConfigError(f"unknown lidar source {self.source!r}; known: synthetic "
                              "(for a real sensor or a bag, publish the points topic and set lidar:=false)")
        if not self.rate_hz > 0 or not self.period_s > 0:
            raise ConfigError("rate_hz and period_s must be positive")
        if int(self.n_points) < 0 or not self.amplitude_m >= 0:
            raise ConfigError("n_points and amplitude_m must be >= 0")
        return dataclasses.replace(self, rate_hz=float(self.rate_hz), seed=int(self.seed),
                                   n_points=int(self.n_points), amplitude_m=float(self.amplitude_m),
                                   period_s=float(self.period_s))


class SyntheticSweeps:
    """``synthetic_scene(seed)`` with everything above the ground moving along a
    figure-eight: sweep ``k`` describes time ``t = k / rate_hz`` and has its obstacle points
    shifted by ``(amplitude/2 * sin(2 w t), amplitude * sin(w t))`` metres, ``w = 2 pi /
    period``. Deterministic per sweep index (not the wall clock); sweep 0 is the scene as
    generated. ``read()`` returns N x 4 float32 (x, y, z, intensity)."""

    def __init__(self, config: LidarConfig):
        self.config = config.validate()
        self.scene = synthetic_scene(self.config.seed, self.config.n_points)
        self.moving = split_ground(self.scene)
        self.index = 0

    def offset(self, index: int) -> Tuple[float, float]:
        """(dx, dy) metres of the obstacles in sweep ``index``."""
        w = 2.0 * math.pi / self.config.period_s
        t = index / self.config.rate_hz
        a = self.config.amplitude_m
        return 0.5 * a * math.sin(2.0 * w * t), a * math.sin(w * t)

    def sweep(self, index: int) -> np.ndarray:
        pts = self.scene.copy()
        dx, dy = self.offset(index)
        pts[self.moving, 0] += np.float32(dx)
        pts[self.moving, 1] += np.float32(dy)
        return pts

    def read(self) -> np.ndarray:
        pts = self.sweep(self.index)
        self.index += 1
        return pts
