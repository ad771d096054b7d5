"""AGRNav-architecture semantic occupancy model (random weights, no downloads).

AGRNav predicts, from one LiDAR sweep, which voxels of a 3D grid around the robot are occupied
(including those hidden behind obstacles) and their semantic class. Its network, SCONet, takes
AGRNav's 256 x 256 x 32 voxel grid (0.1 m voxels) as ``N x 1 x X x Z x Y`` and returns 20
class scores per voxel, ``N x 20 x X x Z x Y``. Inside, the grid is a bird's-eye-view image
whose channels are the 32 height slices: an encoder of depthwise-separable convolutions down
to 1/8 scale, criss-cross attention there, a decoder back to full scale with MobileViTv2
blocks at 1/4 and 1/2 scale and skip connections from every scale, then a 3D head (a
dilated-convolution block over the voxels) for the class scores.

:class:`AGRNav` is that network, written here: the same layers, widths, input and output
shapes; 642,433 parameters against SCONet's 646,043, and 72.5 GFLOP per 256 x 256 x 32 grid
against its 67.2 (both mostly the 3D head; torch's FlopCounterMode). Where SCONet is tied to
256 x 256 (its MobileViTv2 blocks are linear layers over the flattened 64 x 64 and 128 x 128
maps), this one uses MobileViTv2's own separable self-attention, over positions with channel
projections, so any X and Y that are multiples of 8 run (small grids in tests) and the
parameters sit in those projections instead. Weights are random: outputs mean nothing.

Tensor layout everywhere, SCONet's: ``N x 1 x X x Z x Y`` for a voxel grid (X forward, Z
up, Y lateral: :func:`voxelize`'s output and the model's input) and ``N x C x X x Z x Y``
for per-class scores.

The model traces with :func:`torch.fx.symbolic_trace`. For local-operator parallelism, rows
are X: every convolution and the 3D head are local along it, the attention is not (it
mixes whole rows and columns), so spatial plans combine the stripes before it.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import numpy as np
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

__all__ = [
    "DEFAULT_GRID",
    "DEFAULT_EXTENT",
    "VOXEL_SIZE_M",
    "ORIGIN_M",
    "NUM_CLASSES",
    "AGRNav",
    "build_agrnav",
    "voxelize",
    "synthetic_scene",
]

#: AGRNav's voxel grid: X, Y, Z voxels of VOXEL_SIZE_M from ORIGIN_M (its point2vox and its
#: planner's map share the voxel size and the corner)
DEFAULT_GRID: Tuple[int, int, int] = (256, 256, 32)
VOXEL_SIZE_M = 0.1
ORIGIN_M: Tuple[float, float, float] = (-10.0, -10.0, -0.1)
#: the grid's x, y, z ranges in metres: ORIGIN_M + DEFAULT_GRID * VOXEL_SIZE_M
DEFAULT_EXTENT: Tuple[Tuple[float, float], ...] = ((-10.0, 15.6), (-10.0, 15.6), (-0.1, 3.1))
NUM_CLASSES = 20  # SemanticKITTI's, class 0 = empty
SPATIAL_MULTIPLE = 8  # three 2x poolings in the encoder
#: the random network's bias for the empty class (class 0): a prior, as a trained one has
EMPTY_PRIOR_LOGIT = 4.0
#: the random classifier's scale relative to He's: class scores of order 1
CLASSIFIER_INIT_SCALE = 0.05


# --------------------------------------------------------------------------------------------
# Voxelisation
# --------------------------------------------------------------------------------------------


def voxelize(
    points: np.ndarray,
    grid: Sequence[int] = DEFAULT_GRID,
    extent: Sequence[Sequence[float]] = DEFAULT_EXTENT,
) -> torch.Tensor:
    """Binary occupancy of ``points`` (N x 3 or N x 4 metres; extra columns ignored).

    Returns a float32 tensor ``1 x 1 x X x Z x Y`` (the model's input) with 1.0 in every voxel
    containing at least one point; ``grid`` is (X, Y, Z) voxel counts. Each axis covers the
    half-open interval ``[min, max)``, split into equal voxels: a point exactly on the lower
    bound is kept, one exactly on the upper bound is dropped, as are points outside the
    extent and points with a NaN/inf coordinate (bounds are compared at the points'
    precision, so float32 points at "-0.1" count as on the bound). An empty array gives an
    all-zero grid. Axes: x forward -> tensor dim 2, z up -> dim 3, y lateral -> dim 4.
    """
    nx, ny, nz = (int(g) for g in grid)
    if min(nx, ny, nz) <= 0:
        raise ValueError(f"grid must be three positive voxel counts, got {tuple(grid)}")
    ext = np.asarray(extent, dtype=np.float64)
    if ext.shape != (3, 2) or not np.all(ext[:, 1] > ext[:, 0]):
        raise ValueError(f"extent must be ((xmin, xmax), (ymin, ymax), (zmin, zmax)) with min < max, got {extent}")

    occ = np.zeros((nx, nz, ny), dtype=np.float32)
    pts = np.asarray(points)
    if pts.size == 0:
        return torch.from_numpy(occ)[None, None]
    if pts.ndim != 2 or pts.shape[1] < 3:
        raise ValueError(f"points must be an N x 3 or N x 4 array, got shape {pts.shape}")

    # Compare the bounds at the points' own precision (a float32 point "at -0.1" is the float32
    # value nearest -0.1, not the float64 one, and should count as on the bound), then do the
    # arithmetic in float64.
    xyz = pts[:, :3].astype(np.float64, copy=False)
    if np.issubdtype(pts.dtype, np.floating):
        ext = ext.astype(pts.dtype).astype(np.float64)
    lo, hi = ext[:, 0], ext[:, 1]
    keep = np.all(np.isfinite(xyz), axis=1) & np.all(xyz >= lo, axis=1) & np.all(xyz < hi, axis=1)
    xyz = xyz[keep]
    if xyz.shape[0] == 0:
        return torch.from_numpy(occ)[None, None]
    counts = np.array([nx, ny, nz], dtype=np.int64)
    idx = np.floor((xyz - lo) * (counts / (hi - lo))).astype(np.int64)
    # Rounding can push a point just below the upper bound onto index == count.
    idx = np.clip(idx, 0, counts - 1)
    occ[idx[:, 0], idx[:, 2], idx[:, 1]] = 1.0
    return torch.from_numpy(occ)[None, None]


# --------------------------------------------------------------------------------------------
# Synthetic scene
# --------------------------------------------------------------------------------------------


def synthetic_scene(seed: int, n_points: int = 20000) -> np.ndarray:
    """A deterministic LiDAR-like sweep: ``n_points x 4`` float32 (x, y, z, intensity).

    In AGRNav's frame convention, z up from the ground (its grid starts 0.1 m below it): a
    ground plane all around the sensor (gentle slope and noise), a few box obstacles (surface
    points), thin poles and Gaussian "vegetation" clusters -- enough structure for demos and
    for the voxel grid to look like a sparse outdoor scene. Some points fall outside the
    default extent, as in a real sweep. Same seed, same points.
    """
    if n_points < 0:
        raise ValueError("n_points must be >= 0")
    rng = np.random.default_rng(seed)
    ground_z = 0.0

    def ground_height(x: np.ndarray, y: np.ndarray, slope: Tuple[float, float]) -> np.ndarray:
        return ground_z + slope[0] * x + slope[1] * y

    slope = (float(rng.uniform(-0.003, 0.003)), float(rng.uniform(-0.003, 0.003)))
    n_box = n_points // 5
    n_pole = n_points // 10
    n_veg = n_points // 5
    n_ground = n_points - n_box - n_pole - n_veg
    parts = []

    # Ground: denser near the sensor, like a spinning LiDAR's rings.
    r = 1.0 + 21.0 * rng.random(n_ground) ** 1.5
    a = rng.uniform(-np.pi, np.pi, n_ground)
    gx, gy = r * np.cos(a), r * np.sin(a)
    gz = ground_height(gx, gy, slope) + rng.normal(0.0, 0.02, n_ground)
    parts.append(np.stack([gx, gy, gz, rng.uniform(0.05, 0.3, n_ground)], axis=1))

    # Boxes (cars, crates): points sampled on the faces of axis-aligned boxes.
    n_boxes = int(rng.integers(3, 6))
    per_box = np.diff(np.linspace(0, n_box, n_boxes + 1).astype(int))
    for k in per_box:
        cx, cy = rng.uniform(3.0, 14.0), rng.uniform(-8.0, 13.0)
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
        cx, cy = rng.uniform(-8.0, 14.0), rng.uniform(-8.0, 14.0)
        rad, h = rng.uniform(0.05, 0.2), rng.uniform(2.0, 3.5)
        t = rng.uniform(0.0, 2 * np.pi, k)
        pz = ground_height(cx, cy, slope) + rng.uniform(0.0, h, k)
        parts.append(np.stack([cx + rad * np.cos(t), cy + rad * np.sin(t), pz, rng.uniform(0.4, 1.0, k)], axis=1))

    # Vegetation: anisotropic Gaussian blobs above the ground (bushes, low canopy).
    n_clusters = int(rng.integers(3, 7))
    per_cluster = np.diff(np.linspace(0, n_veg, n_clusters + 1).astype(int))
    for k in per_cluster:
        cx, cy = rng.uniform(-8.0, 14.0), rng.uniform(-8.0, 14.0)
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


def _check_input(x: torch.Tensor, height: int) -> torch.Tensor:
    """Validate ``N x 1 x X x Z x Y``; wrapped for torch.fx so tracing keeps it as one node."""
    if x.dim() != 5 or x.shape[1] != 1:
        raise ValueError(f"AGRNav expects an N x 1 x X x Z x Y voxel grid, got shape {tuple(x.shape)}")
    if x.shape[3] != height:
        raise ValueError(f"AGRNav was built for Z={height} height slices, got {x.shape[3]}")
    sx, sy = int(x.shape[2]), int(x.shape[4])
    if sx % SPATIAL_MULTIPLE or sy % SPATIAL_MULTIPLE or sx == 0 or sy == 0:
        raise ValueError(
            f"AGRNav needs X and Y to be positive multiples of {SPATIAL_MULTIPLE} "
            f"(three 2x poolings), got X={sx}, Y={sy}"
        )
    return x


torch.fx.wrap("_check_input")


class _SeparableConv(nn.Sequential):
    """Depthwise 3x3 then pointwise 1x1 convolution, no bias."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__(
            nn.Conv2d(c_in, c_in, 3, padding=1, groups=c_in, bias=False),
            nn.Conv2d(c_in, c_out, 1, bias=False),
        )


class _EncoderStage(nn.Sequential):
    """(2x max pooling,) two separable convolutions with ReLU."""

    def __init__(self, c_in: int, c_out: int, pool: bool) -> None:
        layers = [nn.MaxPool2d(2)] if pool else []
        layers += [_SeparableConv(c_in, c_out), nn.ReLU(inplace=True), _SeparableConv(c_out, c_out), nn.ReLU(inplace=True)]
        super().__init__(*layers)


class CrissCrossAttention(nn.Module):
    """Criss-cross attention (CCNet): every position attends to the positions of its own row
    and column, itself once, and adds ``gamma`` times the attended values to its input.

    ``gamma`` starts at 1 (CCNet starts it at 0 and learns it), so that with random weights the
    attention reaches the outputs."""

    def __init__(self, channels: int, reduction: int = 8) -> None:
        super().__init__()
        self.query = nn.Conv2d(channels, channels // reduction, 1)
        self.key = nn.Conv2d(channels, channels // reduction, 1)
        self.value = nn.Conv2d(channels, channels, 1)
        self.gamma = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, _, h, w = x.shape
        q, k, v = self.query(x), self.key(x), self.value(x)
        # energy[n, i, j, t]: position (i, j) against (t, j) of its column, then (i, t) of its row
        along_column = torch.einsum("ncij,nctj->nijt", q, k)
        # (i, ., t = i), built from a tensor rather than torch.eye(h): torch.fx before 2.2
        # cannot pass a traced size to a factory function
        row = torch.ones_like(x[0, 0, :, 0]).cumsum(0)                          # 1 .. h
        itself = (row.unsqueeze(1) == row.unsqueeze(0)).unsqueeze(1)
        along_column = along_column.masked_fill(itself, float("-inf"))        # counted in its row
        along_row = torch.einsum("ncij,ncit->nijt", q, k)
        attention = torch.softmax(torch.cat([along_column, along_row], dim=3), dim=3)
        from_column = torch.einsum("nijt,nctj->ncij", attention.narrow(3, 0, h), v)
        from_row = torch.einsum("nijt,ncit->ncij", attention.narrow(3, h, w), v)
        return self.gamma * (from_column + from_row) + x


class _SeparableSelfAttention(nn.Module):
    """MobileViTv2's separable self-attention over all positions of an ``N x d x H x W`` map:
    softmax scores of one projection weight a context vector of the keys, which gates the
    values; linear in the number of positions."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.qkv = nn.Conv2d(dim, 1 + 2 * dim, 1)
        self.out = nn.Conv2d(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        scores = torch.softmax(qkv[:, :1].flatten(2), dim=-1)                     # N x 1 x HW
        context = (qkv[:, 1:1 + self.dim].flatten(2) * scores).sum(-1, keepdim=True)  # N x d x 1
        return self.out(F.relu(qkv[:, 1 + self.dim:]) * context.unsqueeze(-1))


class _TransformerLayer(nn.Module):
    """Pre-norm: x + attention(norm(x)), then x + feed-forward(norm(x)); LayerNorm over
    channels and positions (GroupNorm with one group, MobileViTv2's norm)."""

    def __init__(self, dim: int, ffn_mult: int = 2) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(1, dim)
        self.attention = _SeparableSelfAttention(dim)
        self.norm2 = nn.GroupNorm(1, dim)
        self.ffn = nn.Sequential(nn.Conv2d(dim, ffn_mult * dim, 1), nn.SiLU(), nn.Conv2d(ffn_mult * dim, dim, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.ffn(self.norm2(x))


class MobileViTv2Block(nn.Module):
    """MobileViTv2 block on a ``c``-channel map: a local representation (depthwise 3x3,
    pointwise to ``dim``), ``layers`` transformer layers of separable self-attention over all
    positions (patches of one position), a norm and a pointwise projection back to ``c``,
    added to the input."""

    def __init__(self, channels: int, dim: int, layers: int) -> None:
        super().__init__()
        self.local = nn.Sequential(
            nn.Conv2d(channels, channels, 3, padding=1, groups=channels, bias=False),
            nn.BatchNorm2d(channels),
            nn.SiLU(),
            nn.Conv2d(channels, dim, 1, bias=False),
        )
        self.layers = nn.Sequential(*[_TransformerLayer(dim) for _ in range(layers)])
        self.norm = nn.GroupNorm(1, dim)
        self.project = nn.Sequential(nn.Conv2d(dim, channels, 1, bias=False), nn.BatchNorm2d(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.project(self.norm(self.layers(self.local(x))))


class _SemanticHead3d(nn.Module):
    """The BEV features (height slices as channels) as a one-channel volume: a 3x3x3
    convolution to ``planes`` channels, a residual block of parallel dilated 3x3x3
    convolution pairs (ASPP-like), and a 3x3x3 classifier. ``N x Z x X x Y`` in,
    ``N x classes x Z x X x Y`` out."""

    def __init__(self, planes: int, num_classes: int, dilations: Sequence[int]) -> None:
        super().__init__()
        self.stem = nn.Conv3d(1, planes, 3, padding=1)
        self.branches = nn.ModuleList(
            nn.Sequential(
                nn.Conv3d(planes, planes, 3, padding=d, dilation=d, bias=False),
                nn.BatchNorm3d(planes),
                nn.ReLU(inplace=True),
                nn.Conv3d(planes, planes, 3, padding=d, dilation=d, bias=False),
                nn.BatchNorm3d(planes),
            )
            for d in dilations
        )
        self.classify = nn.Conv3d(planes, num_classes, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, z, sx, sy = x.shape
        v = F.relu(self.stem(x.reshape(n, 1, z, sx, sy)))
        y = v
        for branch in self.branches:
            y = y + branch(v)
        return self.classify(F.relu(y))


class AGRNav(nn.Module):
    """SCONet's architecture (see the module): ``forward(x)`` with ``x`` an ``N x 1 x X x Z x Y``
    occupancy grid (0/1 floats from :func:`voxelize`) returns ``N x num_classes x X x Z x Y``
    class scores. Z must be ``height``; X and Y any multiples of 8.

    Widths follow SCONet's from the height ``f``: encoder stages of f, 1.5f, 2f and 2.5f
    channels at 1, 1/2, 1/4 and 1/8 scale; decoder outputs of f/8, f/4 and f/2 channels
    lifted to full scale by transposed convolutions; an 8-channel 3D head. The MobileViTv2
    blocks work at ``attention_dims`` channels (1/4 then 1/2 scale), ``attention_layers``
    transformer layers each.
    """

    def __init__(
        self,
        height: int = DEFAULT_GRID[2],
        num_classes: int = NUM_CLASSES,
        attention_dims: Sequence[int] = (172, 64),
        attention_layers: int = 2,
        head_planes: int = 8,
    ) -> None:
        super().__init__()
        f = int(height)
        if f < 8 or f % 8:
            raise ValueError(f"AGRNav needs a height (Z) that is a multiple of 8, got {height}")
        if num_classes < 2:
            raise ValueError("num_classes must be >= 2 (class 0 is empty space)")
        self.height = f
        self.num_classes = num_classes
        c2, c4, c8 = f * 3 // 2, 2 * f, f * 5 // 2
        h8, h4, h2 = f // 8, f // 4, f // 2

        self.encode_1_1 = _EncoderStage(f, f, pool=False)
        self.encode_1_2 = _EncoderStage(f, c2, pool=True)
        self.encode_1_4 = _EncoderStage(c2, c4, pool=True)
        self.encode_1_8 = _EncoderStage(c4, c8, pool=True)
        self.context = CrissCrossAttention(c8)

        self.out_1_8 = nn.Conv2d(c8, h8, 3, padding=1)
        self.up_1_8 = nn.ConvTranspose2d(h8, h8, 6, stride=2, padding=2)
        self.attend_1_4 = MobileViTv2Block(h8, attention_dims[0], attention_layers)
        self.decode_1_4 = nn.Conv2d(c4 + h8, c4, 3, padding=1)
        self.out_1_4 = nn.Conv2d(c4, h4, 3, padding=1)
        self.up_1_4 = nn.ConvTranspose2d(h4, h4, 6, stride=2, padding=2)
        self.attend_1_2 = MobileViTv2Block(h4, attention_dims[1], attention_layers)
        self.lift_1_8_to_1_2 = nn.ConvTranspose2d(h8, h8, 4, stride=4)
        self.decode_1_2 = nn.Conv2d(c2 + h4 + h8, c2, 3, padding=1)
        self.out_1_2 = nn.Conv2d(c2, h2, 3, padding=1)
        self.up_1_2 = nn.ConvTranspose2d(h2, h2, 6, stride=2, padding=2)
        self.lift_1_4_to_1_1 = nn.ConvTranspose2d(h4, h4, 4, stride=4)
        self.lift_1_8_to_1_1 = nn.ConvTranspose2d(h8, h8, 8, stride=8)
        self.decode_1_1 = nn.Conv2d(h8 + h4 + h2 + f, f, 3, padding=1)
        self.head = _SemanticHead3d(head_planes, num_classes, (1, 2, 3))
        self._init_weights()

    def _init_weights(self) -> None:
        """He initialisation (each convolution keeps its input's variance through a ReLU:
        torch's default shrinks it at every layer, and the class scores of a random network
        would be its last biases, the same in every voxel whatever the input), zero biases
        but the empty class's, EMPTY_PRIOR_LOGIT, so that most voxels come out empty."""
        for m in self.modules():
            if isinstance(m, nn.ConvTranspose2d):
                # an output pixel sums (kernel / stride)^2 taps of each input channel
                taps = m.in_channels * (m.kernel_size[0] // m.stride[0]) * (m.kernel_size[1] // m.stride[1])
                nn.init.normal_(m.weight, 0.0, (2.0 / taps) ** 0.5)
            elif isinstance(m, (nn.Conv2d, nn.Conv3d)):
                nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="relu")
            else:
                continue
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        with torch.no_grad():
            self.head.classify.weight.mul_(CLASSIFIER_INIT_SCALE)
            self.head.classify.bias[0] = EMPTY_PRIOR_LOGIT

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _check_input(x, self.height)
        n, _, sx, z, sy = x.shape
        bev = x.reshape(n, sx, z, sy).permute(0, 2, 1, 3)     # N x Z x X x Y: height slices as channels

        s1 = self.encode_1_1(bev)
        s2 = self.encode_1_2(s1)
        s4 = self.encode_1_4(s2)
        s8 = self.context(self.encode_1_8(s4))

        o8 = self.out_1_8(s8)
        y = self.attend_1_4(self.up_1_8(o8))
        y = F.relu(self.decode_1_4(torch.cat([y, s4], 1)))
        o4 = self.out_1_4(y)
        y = self.attend_1_2(self.up_1_4(o4))
        y = F.relu(self.decode_1_2(torch.cat([y, s2, self.lift_1_8_to_1_2(o8)], 1)))
        o2 = self.out_1_2(y)
        y = torch.cat([self.up_1_2(o2), s1, self.lift_1_4_to_1_1(o4), self.lift_1_8_to_1_1(o8)], 1)
        y = F.relu(self.decode_1_1(y))

        scores = self.head(y)                                  # N x C x Z x X x Y
        return scores.permute(0, 1, 3, 2, 4)                   # N x C x X x Z x Y


def build_agrnav(height: int = DEFAULT_GRID[2], num_classes: int = NUM_CLASSES) -> nn.Module:
    """Build a randomly initialised AGRNav network in eval mode (642,433 parameters at the
    default height of 32 and 20 classes). Seed torch's RNG beforehand for reproducible
    weights."""
    return AGRNav(height, num_classes).eval()
