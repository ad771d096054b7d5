"""Feeding the real AGRNav perception node (a checkout of github.com/jmwang0117/AGRNav)
unchanged.

AGRNav's SCONet node (``src/perception/SCONet/network/inference_ros.py``) does not
subscribe to a topic: every 0.4 s it rebuilds its model, loads its weights, and runs it on
the first voxel file (``*.bin``, sorted by name) of its dataset folder, publishes the
occupied voxels it predicts on ``/non_intersection_coordinates``
(``std_msgs/Float64MultiArray``) and deletes the file. AGRNav's own ``pointcloud_listener``
writes those files from a point cloud.

:class:`VoxelFolder` writes them here from any ``sensor_msgs/PointCloud2`` source, in the
format the node reads: a SemanticKITTI occupancy grid of 256 x 256 x 32 voxels (x, y, z;
z fastest), one bit per voxel, most significant bit first, with AGRNav's own voxelisation
(0.1 m voxels from the origin (-10, -10, -0.1) m in the sensor frame). One file at a time:
the next is written only after the node has taken the previous one, so the node always
works on the newest sweep and the folder never fills up.

The files are written under a temporary name and renamed, so the node never reads half a
file. Nothing in the checkout is modified or copied.
"""

import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from robot_offload.apps.occupancy import AGRNAV_ORIGIN_M as ORIGIN_M
from robot_offload.apps.occupancy import AGRNAV_VOXEL_SIZE_M as VOXEL_SIZE_M
from robot_offload.errors import ConfigError
from robot_offload.models.agrnav import DEFAULT_GRID

#: The voxel files' grid: counts along x, y, z (AGRNav's point2vox; the registry model's).
GRID_XYZ = DEFAULT_GRID
#: The node's script, relative to the checkout.
NODE_SCRIPT = os.path.join("src", "perception", "SCONet", "network", "inference_ros.py")
#: Where AGRNav's SemanticKITTI loader looks for voxel files, whatever its parameters say.
DEFAULT_DATASET_ROOT = "/root/AGRNav/src/perception/raw_data/voxels"


def node_script(repo: str) -> str:
    """The SCONet node's script in checkout ``repo``; ConfigError when it is not one."""
    path = os.path.join(repo, NODE_SCRIPT)
    if not os.path.isfile(path):
        raise ConfigError(f"agrnav_repo {repo!r} is not an AGRNav checkout (no {NODE_SCRIPT})")
    return path


def occupancy_bits(points: np.ndarray) -> bytes:
    """The voxel file of one sweep: ``points`` (N x 3 or more, metres) voxelised as AGRNav
    does, packed one bit per voxel. Points outside the grid, or not finite, are dropped."""
    pts = np.asarray(points, dtype=np.float64)
    grid = np.zeros(GRID_XYZ, dtype=np.uint8)
    if pts.size:
        if pts.ndim != 2 or pts.shape[1] < 3:
            raise ValueError(f"points must be an N x 3 (or more) array, got shape {pts.shape}")
        xyz = pts[:, :3]
        xyz = xyz[np.all(np.isfinite(xyz), axis=1)]
        idx = np.floor((xyz - np.asarray(ORIGIN_M)) / VOXEL_SIZE_M).astype(np.int64)
        idx = idx[np.all((idx >= 0) & (idx < np.asarray(GRID_XYZ)), axis=1)]
        grid[idx[:, 0], idx[:, 1], idx[:, 2]] = 1
    return np.packbits(grid.reshape(-1)).tobytes()


def occupancy_from_bits(data: bytes) -> np.ndarray:
    """The inverse of :func:`occupancy_bits`: a uint8 grid of GRID_XYZ."""
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8))
    if bits.size != int(np.prod(GRID_XYZ)):
        raise ValueError(f"a voxel file of {len(data)} bytes is not a {GRID_XYZ} occupancy grid")
    return bits.reshape(GRID_XYZ)


@dataclass
class VoxelFolderConfig:
    """Parameters of the agrnav_voxels node."""
    dataset_root: str = DEFAULT_DATASET_ROOT   # the folder the AGRNav node reads
    max_pending: int = 1                       # files not taken yet before a sweep is dropped
    keep_dir: str = ""                         # also keep every file written here ("": no)

    def validate(self) -> "VoxelFolderConfig":
        if not self.dataset_root:
            raise ConfigError("dataset_root must name the folder the AGRNav node reads")
        if int(self.max_pending) < 1:
            raise ConfigError(f"max_pending must be at least 1, got {self.max_pending}")
        self.max_pending = int(self.max_pending)
        return self


class VoxelFolder:
    """Writes voxel files for the AGRNav node into its dataset folder (see the module)."""

    def __init__(self, config: VoxelFolderConfig):
        self.config = config
        os.makedirs(config.dataset_root, exist_ok=True)
        if config.keep_dir:
            os.makedirs(config.keep_dir, exist_ok=True)
        self.written = 0
        self.dropped = 0

    def pending(self) -> int:
        return sum(1 for n in os.listdir(self.config.dataset_root) if n.endswith(".bin"))

    def offer(self, points: np.ndarray) -> Optional[str]:
        """Write one sweep unless ``max_pending`` files wait already; the file's path, or
        None (dropped)."""
        if self.pending() >= self.config.max_pending:
            self.dropped += 1
            return None
        data = occupancy_bits(points)
        name = f"{self.written:06d}.bin"
        path = os.path.join(self.config.dataset_root, name)
        tmp = os.path.join(self.config.dataset_root, f".{name}.partial")
        with open(tmp, "wb") as f:
            f.write(data)
        if self.config.keep_dir:
            with open(os.path.join(self.config.keep_dir, name), "wb") as f:
                f.write(data)
        os.replace(tmp, path)
        self.written += 1
        return path
