"""Feeding the real AGRNav perception node (a checkout of github.com/jmwang0117/AGRNav)
unchanged.

AGRNav's SCONet node (``src/perception/SCONet/network/inference_ros.py``) does not
subscribe to a topic: every 0.4 s it rebuilds its model, loads its weights, and runs it on
the first voxel file (``*.bin``, sorted by name) of its dataset folder, publishes the
occupied voxels it predicts on ``/non_intersection_coordinates``
(``std_msgs/Float64MultiArray``) and deletes the file. AGRNav's own ``pointcloud_listener``
writes those files from a point cloud. The node exits (``num_samples=0``) when it finds
the folder empty, about 0.5 s after it took a file.

:class:`VoxelFolder` writes them here from any ``sensor_msgs/PointCloud2`` source, in the
format the node reads: a SemanticKITTI occupancy grid of 256 x 256 x 32 voxels (x, y, z;
z fastest), one bit per voxel, most significant bit first, with AGRNav's own voxelisation
(0.1 m voxels from the origin (-10, -10, -0.1) m in the sensor frame). One file at a time:
the newest sweep waits in memory and is written as soon as the node has taken the
previous file, so the node always works on the newest sweep and the folder never fills
up. When no new sweep has come ``repeat_after_s`` after the node took a file (a lidar
slower than the model), the last sweep is written again, so that the node does not exit.

The files are written under a temporary name and renamed, so the node never reads half a
file. Nothing in the checkout is modified or copied.
"""

import os
import threading
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
    max_pending: int = 1                       # files not taken yet before the next waits in memory
    keep_dir: str = ""                         # also keep every file written here ("": no)
    #: the folder empty this long (s) with no new sweep: the last one is written again
    #: (the node lists the folder 0.4-0.5 s after taking a file, and exits if it is empty)
    repeat_after_s: float = 0.25

    def validate(self) -> "VoxelFolderConfig":
        if not self.dataset_root:
            raise ConfigError("dataset_root must name the folder the AGRNav node reads")
        if int(self.max_pending) < 1:
            raise ConfigError(f"max_pending must be at least 1, got {self.max_pending}")
        if not float(self.repeat_after_s) >= 0:
            raise ConfigError(f"repeat_after_s must be >= 0, got {self.repeat_after_s}")
        self.max_pending = int(self.max_pending)
        self.repeat_after_s = float(self.repeat_after_s)
        return self


class VoxelFolder:
    """Writes voxel files for the AGRNav node into its dataset folder (see the module).
    :meth:`offer` takes each sweep, :meth:`refill` (called often, e.g. every 20 ms) writes
    the waiting one once the node has taken the previous file. Thread-safe."""

    def __init__(self, config: VoxelFolderConfig):
        self.config = config
        os.makedirs(config.dataset_root, exist_ok=True)
        if config.keep_dir:
            os.makedirs(config.keep_dir, exist_ok=True)
        self.written = 0
        self.dropped = 0      # sweeps replaced by a newer one before they were written
        self.repeated = 0     # files that are the last sweep written again
        self._lock = threading.Lock()
        self._waiting: Optional[np.ndarray] = None   # the newest sweep's points, not written yet
        self._last: Optional[bytes] = None      # the last sweep written
        self._empty_since_s: Optional[float] = None

    def pending(self) -> int:
        return sum(1 for n in os.listdir(self.config.dataset_root) if n.endswith(".bin"))

    def offer(self, points: np.ndarray, now_s: float) -> Optional[str]:
        """Take one sweep: written at once when fewer than ``max_pending`` files wait, else
        kept in memory (replacing, and dropping, an older one kept there); a sweep is
        voxelised only when it is written. The path of the file written, or None."""
        points = np.asarray(points)
        with self._lock:
            if self._waiting is not None:
                self.dropped += 1
            self._waiting = points
            return self._refill(now_s)

    def refill(self, now_s: float) -> Optional[str]:
        """Write the waiting sweep if the node has taken the previous file, or the last
        sweep again if the folder has been empty for ``repeat_after_s`` with none waiting.
        The path of the file written, or None."""
        with self._lock:
            return self._refill(now_s)

    def _refill(self, now_s: float) -> Optional[str]:
        pending = self.pending()
        if pending:
            self._empty_since_s = None
        elif self._empty_since_s is None:
            self._empty_since_s = now_s
        if pending >= self.config.max_pending:
            return None
        if self._waiting is not None:
            points, self._waiting = self._waiting, None
            data = occupancy_bits(points)      # ValueError: that sweep is dropped
        elif (self._last is not None and not pending
              and now_s - self._empty_since_s >= self.config.repeat_after_s):
            data = self._last
            self.repeated += 1
        else:
            return None
        path = self._write(data)
        self._last, self._empty_since_s = data, None
        return path

    def _write(self, data: bytes) -> str:
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
