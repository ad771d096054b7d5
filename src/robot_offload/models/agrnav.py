"""AGRNav-architecture semantic occupancy model (random weights, no downloads).

AGRNav predicts, from one LiDAR sweep, which voxels of a 3D grid around the robot are occupied
(including those hidden behind obstacles) and their semantic class.  Its network (SCONet) is an
LMSCNet-style lightweight design: the voxel grid is treated as a bird's-eye-view image whose
channels are the height slices, a small 2D UNet processes it, and a thin 3D head lifts the
result back into voxels for the semantic labels.  This module reproduces that structure with
well under 1M parameters so the compute and, importantly for offloading, the input/output data
volumes (a dense voxel grid in, a dense voxel grid plus per-class scores out) match the kind of
workload the Intra-DP paper measures.  Weights are random: outputs mean nothing.

Tensor layout everywhere: ``N x Z x X x Y`` for occupancy (height slices as channels; X is the
forward axis, Y the lateral one) and ``N x C x Z x X x Y`` for per-class semantics.

Only standard modules are used (Conv2d, BatchNorm2d, ReLU, MaxPool2d, ConvTranspose2d, Conv3d,
BatchNorm3d, cat, reshape), and the whole model traces with :func:`torch.fx.symbolic_trace`.
"""

from __future__ import annotations

from typing import Dict, Sequence, Tuple

import numpy as np
import torch
import torch.fx
from torch import nn

__all__ = [
    "DEFAULT_GRID",
    "DEFAULT_EXTENT",
    "AGRNav",
    "build_agrnav",
    "voxelize",
    "synthetic_scene",
]

DEFAULT_GRID: Tuple[int, int, int] = (128, 128, 16)  # X, Y, Z voxels
DEFAULT_EXTENT: Tuple[Tuple[float, float], ...] = ((0.0, 25.6), (-12.8, 12.8), (-2.0, 1.2))  # metres
SPATIAL_MULTIPLE = 8  # three 2x poolings in the UNet


# --------------------------------------------------------------------------------------------
# Voxelisation
# --------------------------------------------------------------------------------------------


def voxelize(
    points: np.ndarray,
    grid: Sequence[int] = DEFAULT_GRID,
    extent: Sequence[Sequence[float]] = DEFAULT_EXTENT,
) -> torch.Tensor:
    """Binary occupancy of ``points`` (N x 3 or N x 4 metres; extra columns ignored).

    Returns a float32 tensor ``1 x Z x X x Y`` with 1.0 in every voxel containing at least one
    point.  Each axis covers the half-open interval ``[min, max)``, split into equal voxels:
    a point exactly on the lower bound is kept, one exactly on the upper bound is dropped, as
    are points outside the extent and points with a NaN/inf coordinate (bounds are compared at
    the points' precision, so float32 points at "-12.8" count as on the bound).  An empty array
    gives an all-zero grid.  Axes: x forward -> tensor dim 2, y lateral -> dim 3, z up -> dim 1.
    """
    nx, ny, nz = (int(g) for g in grid)
    if min(nx, ny, nz) <= 0:
        raise ValueError(f"grid must be three positive voxel counts, got {tuple(grid)}")
    ext = np.asarray(extent, dtype=np.float64)
    if ext.shape != (3, 2) or not np.all(ext[:, 1] > ext[:, 0]):
        raise ValueError(f"extent must be ((xmin, xmax), (ymin, ymax), (zmin, zmax)) with min < max, got {extent}")

    occ = np.zeros((nz, nx, ny), dtype=np.float32)
    pts = np.asarray(points)
    if pts.size == 0:
        return torch.from_numpy(occ).unsqueeze(0)
    if pts.ndim != 2 or pts.shape[1] < 3:
        raise ValueError(f"points must be an N x 3 or N x 4 array, got shape {pts.shape}")

    # Compare the bounds at the points' own precision (a float32 point "at -12.8" is the float32
    # value nearest -12.8, slightly below the float64 one, and should count as on the bound),
    # then do the arithmetic in float64.
    xyz = pts[:, :3].astype(np.float64, copy=False)
    if np.issubdtype(pts.dtype, np.floating):
        ext = ext.astype(pts.dtype).astype(np.float64)
    lo, hi = ext[:, 0], ext[:, 1]
    keep = np.all(np.isfinite(xyz), axis=1) & np.all(xyz >= lo, axis=1) & np.all(xyz < hi, axis=1)
    xyz = xyz[keep]
    if xyz.shape[0] == 0:
        return torch.from_numpy(occ).unsqueeze(0)
    counts = np.array([nx, ny, nz], dtype=np.int64)
    idx = np.floor((xyz - lo) * (counts / (hi - lo))).astype(np.int64)
    # Rounding can push a point just below the upper bound onto index == count.
    idx = np.clip(idx, 0, counts - 1)
    occ[idx[:, 2], idx[:, 0], idx[:, 1]] = 1.0
    return torch.from_numpy(occ).unsqueeze(0)


# --------------------------------------------------------------------------------------------
# Synthetic scene
# --------------------------------------------------------------------------------------------


def synthetic_scene(seed: int, n_points: int = 20000) -> np.ndarray:
    """A deterministic LiDAR-like sweep: ``n_points x 4`` float32 (x, y, z, intensity).

    Ground plane (sensor ~1.7 m above it, gentle slope and noise), a few box obstacles
    (surface points), thin poles and Gaussian "vegetation" clusters -- enough structure for
    demos and for the voxel grid to look like a sparse outdoor scene.  Some points fall outside
    the default extent, as in a real sweep.  Same seed, same points.
    """
    if n_points < 0:
        raise ValueError("n_points must be >= 0")
    rng = np.random.default_rng(seed)
    ground_z = -1.7

    def ground_height(x: np.ndarray, y: np.ndarray, slope: Tuple[float, float]) -> np.ndarray:
        return ground_z + slope[0] * x + slope[1] * y

    slope = (float(rng.uniform(-0.01, 0.01)), float(rng.uniform(-0.01, 0.01)))
    n_box = n_points // 5
    n_pole = n_points // 10
    n_veg = n_points // 5
    n_ground = n_points - n_box - n_pole - n_veg
    parts = []

    # Ground: denser near the sensor, like a spinning LiDAR's rings.
    r = 2.0 + 30.0 * rng.random(n_ground) ** 1.5
    a = rng.uniform(-np.pi / 2, np.pi / 2, n_ground)
    gx, gy = r * np.cos(a), r * np.sin(a)
    gz = ground_height(gx, gy, slope) + rng.normal(0.0, 0.02, n_ground)
    parts.append(np.stack([gx, gy, gz, rng.uniform(0.05, 0.3, n_ground)], axis=1))

    # Boxes (cars, crates): points sampled on the faces of axis-aligned boxes.
    n_boxes = int(rng.integers(3, 6))
    per_box = np.diff(np.linspace(0, n_box, n_boxes + 1).astype(int))
    for k in per_box:
        cx, cy = rng.uniform(4.0, 22.0), rng.uniform(-10.0, 10.0)
        sx, sy, sz = rng.uniform(1.0, 4.5), rng.uniform(1.0, 2.2), rng.uniform(0.8, 2.0)
        u = rng.uniform(-0.5, 0.5, (k, 3))
        face = rng.integers(0, 3, k)  # snap one coordinate to a face: x-face, y-face or top
        u[np.arange(k), face] = np.where(face == 2, 0.5, np.sign(u[np.arange(k), face]) * 0.5)
        bx = cx + u[:, 0] * sx
        by = cy + u[:, 1] * sy
        bz = ground_height(cx, cy, slope) + (u[:, 2] + 0.5) * sz
        parts.append(np.stack([bx, by, bz, rng.uniform(0.3, 0.9, k)], axis=1))

    # Poles (posts, trunks): thin vertical cylinders.
    n_poles = int(rng.integers(3, 8))
    per_pole = np.diff(np.linspace(0, n_pole, n_poles + 1).astype(int))
    for k in per_pole:
        cx, cy = rng.uniform(3.0, 24.0), rng.uniform(-11.0, 11.0)
        rad, h = rng.uniform(0.05, 0.2), rng.uniform(2.0, 3.5)
        t = rng.uniform(0.0, 2 * np.pi, k)
        pz = ground_height(cx, cy, slope) + rng.uniform(0.0, h, k)
        parts.append(np.stack([cx + rad * np.cos(t), cy + rad * np.sin(t), pz, rng.uniform(0.4, 1.0, k)], axis=1))

    # Vegetation: anisotropic Gaussian blobs above the ground (bushes, low canopy).
    n_clusters = int(rng.integers(3, 7))
    per_cluster = np.diff(np.linspace(0, n_veg, n_clusters + 1).astype(int))
    for k in per_cluster:
        cx, cy = rng.uniform(3.0, 24.0), rng.uniform(-11.0, 11.0)
        spread = rng.uniform(0.3, 1.2, 3)
        centre_z = ground_height(cx, cy, slope) + rng.uniform(0.4, 1.8)
        v = rng.normal(0.0, 1.0, (k, 3)) * spread + np.array([cx, cy, centre_z])
        v[:, 2] = np.maximum(v[:, 2], ground_height(v[:, 0], v[:, 1], slope))  # nothing underground
        parts.append(np.concatenate([v, rng.uniform(0.05, 0.5, (k, 1))], axis=1))

    pts = np.concatenate(parts, axis=0) if parts else np.zeros((0, 4))
    pts = pts[rng.permutation(pts.shape[0])]  # a real sweep is not sorted by object
    return np.ascontiguousarray(pts, dtype=np.float32)


# --------------------------------------------------------------------------------------------
# Network
# --------------------------------------------------------------------------------------------


def _check_input(x: torch.Tensor, z: int) -> torch.Tensor:
    """Validate ``N x Z x X x Y``; wrapped for torch.fx so tracing keeps it as one node."""
    if x.dim() != 4:
        raise ValueError(f"AGRNav expects an N x Z x X x Y tensor, got shape {tuple(x.shape)}")
    if x.shape[1] != z:
        raise ValueError(f"AGRNav was built for Z={z} height slices, got {x.shape[1]} channels")
    sx, sy = int(x.shape[2]), int(x.shape[3])
    if sx % SPATIAL_MULTIPLE or sy % SPATIAL_MULTIPLE or sx == 0 or sy == 0:
        raise ValueError(
            f"AGRNav needs X and Y to be positive multiples of {SPATIAL_MULTIPLE} "
            f"(three 2x poolings), got X={sx}, Y={sy}"
        )
    return x


torch.fx.wrap("_check_input")


def _conv_bn_relu(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True))


class _DoubleConv(nn.Sequential):
    """Two 3x3 conv-BN-ReLU, the UNet stage."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__(_conv_bn_relu(c_in, c_out), _conv_bn_relu(c_out, c_out))


class _Up(nn.Module):
    """2x transposed-conv upsample (no halo, so splits cleanly) then concat skip and DoubleConv."""

    def __init__(self, c_in: int, c_skip: int, c_out: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(c_in, c_skip, kernel_size=2, stride=2)
        self.conv = _DoubleConv(2 * c_skip, c_out)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.cat([self.up(x), skip], dim=1))


class AGRNav(nn.Module):
    """BEV 2D UNet (height slices as channels) + occupancy head + 3D semantic head.

    ``forward(x)`` with ``x``: ``N x Z x X x Y`` occupancy (0/1 floats from :func:`voxelize`)
    returns ``{"occupancy": N x Z x X x Y logits, "semantics": N x num_classes x Z x X x Y
    logits}``.  X and Y must be multiples of 8 (they need not equal the build-time grid);
    Z must equal the build-time grid's Z.
    """

    def __init__(
        self,
        grid: Sequence[int] = DEFAULT_GRID,
        num_classes: int = 20,
        widths: Sequence[int] = (32, 48, 64, 96),
        lift_channels: int = 8,
    ) -> None:
        super().__init__()
        if len(grid) != 3 or min(int(g) for g in grid) <= 0:
            raise ValueError(f"grid must be (X, Y, Z) positive voxel counts, got {tuple(grid)}")
        gx, gy, gz = (int(g) for g in grid)
        if gx % SPATIAL_MULTIPLE or gy % SPATIAL_MULTIPLE:
            raise ValueError(
                f"AGRNav needs grid X and Y to be multiples of {SPATIAL_MULTIPLE} (three 2x poolings), got X={gx}, Y={gy}"
            )
        if num_classes < 1:
            raise ValueError("num_classes must be >= 1")
        self.grid = (gx, gy, gz)
        self.num_classes = num_classes
        self.lift_channels = lift_channels
        w1, w2, w3, w4 = widths

        self.enc1 = _DoubleConv(gz, w1)
        self.pool = nn.MaxPool2d(2)
        self.enc2 = _DoubleConv(w1, w2)
        self.enc3 = _DoubleConv(w2, w3)
        self.bottleneck = _DoubleConv(w3, w4)
        self.dec3 = _Up(w4, w3, w3)
        self.dec2 = _Up(w3, w2, w2)
        self.dec1 = _Up(w2, w1, w1)

        # Occupancy: one logit per height slice, i.e. per voxel.
        self.occ_head = nn.Conv2d(w1, gz, 1)
        # Semantics: lift BEV features to lift_channels per height slice, then a small 3D
        # context block (two dilations, like LMSCNet's ASPP-lite) and a per-voxel classifier.
        self.lift = nn.Conv2d(w1, lift_channels * gz, 1)
        self.sem3d_a = nn.Sequential(
            nn.Conv3d(lift_channels, lift_channels, 3, padding=1, bias=False),
            nn.BatchNorm3d(lift_channels),
            nn.ReLU(inplace=True),
        )
        self.sem3d_b = nn.Sequential(
            nn.Conv3d(lift_channels, lift_channels, 3, padding=2, dilation=2, bias=False),
            nn.BatchNorm3d(lift_channels),
            nn.ReLU(inplace=True),
        )
        self.sem_cls = nn.Conv3d(lift_channels, num_classes, 1)

    def forward(self, x: torch.Tensor) -> Dict[str, torch.Tensor]:
        x = _check_input(x, self.grid[2])
        e1 = self.enc1(x)
        e2 = self.enc2(self.pool(e1))
        e3 = self.enc3(self.pool(e2))
        b = self.bottleneck(self.pool(e3))
        d = self.dec1(self.dec2(self.dec3(b, e3), e2), e1)

        occupancy = self.occ_head(d)
        n, _, sx, sy = d.shape
        v = self.lift(d).reshape(n, self.lift_channels, self.grid[2], sx, sy)
        v = self.sem3d_a(v)
        v = v + self.sem3d_b(v)
        semantics = self.sem_cls(v)
        return {"occupancy": occupancy, "semantics": semantics}


def build_agrnav(grid: Sequence[int] = DEFAULT_GRID, num_classes: int = 20) -> nn.Module:
    """Build a randomly initialised AGRNav model in eval mode (< 1M parameters).

    ``grid`` is (X, Y, Z) voxels; X and Y must be multiples of 8.  ``num_classes`` defaults to
    SemanticKITTI's 20.  Seed torch's RNG beforehand for reproducible weights.
    """
    return AGRNav(grid, num_classes).eval()
