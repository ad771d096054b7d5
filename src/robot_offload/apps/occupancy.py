"""AGRNav navigation, the pure part: voxel grid -> metres, occupied voxels, and a moving
synthetic LiDAR for demos (no rospy; the nodes in :mod:`robot_offload.ros` wrap these).

The voxel mapping is the exact inverse of :func:`robot_offload.models.agrnav.voxelize`:
that function puts a point ``p`` (metres) in voxel ``i = floor((p - lo) * n / (hi - lo))``
per axis, and stores it at tensor index ``[0, iz, ix, iy]`` (``1 x Z x X x Y``: height
slices first, then x forward, then y lateral). Voxel ``i``'s centre is therefore
``lo + (i + 0.5) * (hi - lo) / n``, and a tensor index ``(iz, ix, iy)`` is the point
``(x, y, z)`` in the sensor's frame -- note the two different axis orders.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence, Tuple

import numpy as np

from robot_offload.errors import ConfigError
from robot_offload.models.agrnav import DEFAULT_EXTENT, synthetic_scene

__all__ = [
    "OccupancyConfig",
    "LidarConfig",
    "SyntheticSweeps",
    "check_extent",
    "voxel_size",
    "voxel_centres",
    "occupied_voxels",
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


def voxel_centres(indices_zxy: np.ndarray, grid: Sequence[int],
                  extent: Sequence[Sequence[float]] = DEFAULT_EXTENT) -> np.ndarray:
    """Centres (N x 3 float64, columns x, y, z metres) of the voxels at tensor indices
    ``indices_zxy`` (N x 3 integers in the ``Z x X x Y`` order of ``voxelize``'s output, as
    ``np.argwhere`` on one grid gives them). ``grid`` is (X, Y, Z) voxels, ``voxelize``'s."""
    counts = np.asarray(_check_grid(grid), dtype=np.int64)  # x, y, z
    ext = check_extent(extent)
    idx = np.asarray(indices_zxy)
    if idx.ndim != 2 or idx.shape[1] != 3 or not np.issubdtype(idx.dtype, np.integer):
        raise ValueError(f"indices must be an N x 3 integer array (z, x, y), got {idx.dtype} {idx.shape}")
    ixyz = idx[:, [1, 2, 0]].astype(np.int64)  # (z, x, y) -> (x, y, z)
    if ixyz.size and (ixyz.min() < 0 or np.any(ixyz >= counts)):
        raise ValueError(f"voxel index outside the grid (X, Y, Z) = {tuple(counts)}")
    lo, hi = ext[:, 0], ext[:, 1]
    return lo + (ixyz + 0.5) * ((hi - lo) / counts)


def _grid_tensor(name: str, value) -> np.ndarray:
    arr = value.detach().cpu().numpy() if hasattr(value, "detach") else np.asarray(value)
    if arr.ndim == 4:
        if arr.shape[0] != 1:
            raise ValueError(f"{name}: one frame expected, got a batch of {arr.shape[0]}")
        arr = arr[0]
    if arr.ndim != 3 or 0 in arr.shape:
        raise ValueError(f"{name} must be 1 x Z x X x Y, got shape {tuple(arr.shape)}")
    return arr


def occupied_voxels(outputs: dict, threshold_logit: float = 0.0,
                    extent: Sequence[Sequence[float]] = DEFAULT_EXTENT,
                    grid: Sequence[int] = ()) -> Tuple[np.ndarray, np.ndarray]:
    """The occupied voxels of one AGRNav result.

    ``outputs``: ``{"occupancy": 1 x Z x X x Y logits, "labels": 1 x Z x X x Y class ids}``
    (tensors or arrays). A voxel is occupied when its logit is strictly above
    ``threshold_logit``. Returns ``(xyz, label)``: N x 3 float32 voxel centres (x, y, z
    metres, sensor frame) and N float32 class ids, in ``np.argwhere`` order. ``grid`` (X, Y,
    Z), when given, must match the tensors' shape; by default the shape is the grid.
    """
    if not isinstance(outputs, dict) or "occupancy" not in outputs or "labels" not in outputs:
        keys = sorted(outputs) if isinstance(outputs, dict) else type(outputs).__name__
        raise ValueError(f"not an occupancy result: need 'occupancy' and 'labels', got {keys}")
    occ = _grid_tensor("occupancy", outputs["occupancy"])
    labels = _grid_tensor("labels", outputs["labels"])
    if occ.shape != labels.shape:
        raise ValueError(f"occupancy {occ.shape} and labels {labels.shape} differ in shape")
    nz, nx, ny = occ.shape
    if grid and tuple(int(g) for g in grid) != (nx, ny, nz):
        raise ValueError(f"result grid (X, Y, Z) = {(nx, ny, nz)} differs from the configured "
                         f"grid {tuple(grid)}")
    idx = np.argwhere(occ > threshold_logit)
    xyz = voxel_centres(idx, (nx, ny, nz), extent).astype(np.float32)
    return xyz, labels[idx[:, 0], idx[:, 1], idx[:, 2]].astype(np.float32)


@dataclasses.dataclass(frozen=True)
class OccupancyConfig:
    """occupancy_publisher's parameters (``~name``)."""

    threshold_logit: float = 0.0  # a voxel is occupied when its logit is above this
    extent: Tuple = DEFAULT_EXTENT  # metres, the client's voxelisation extent (the model's)
    grid: Tuple = ()  # (X, Y, Z) voxels to expect; () = whatever shape the results have

    def validate(self) -> "OccupancyConfig":
        if not math.isfinite(float(self.threshold_logit)):
            raise ConfigError(f"threshold_logit must be finite, got {self.threshold_logit}")
        ext = check_extent(self.extent)
        grid = _check_grid(self.grid) if len(self.grid) else ()
        return dataclasses.replace(self, threshold_logit=float(self.threshold_logit),
                                   extent=tuple(tuple(float(v) for v in row) for row in ext), grid=grid)


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
