"""Voxel files for the real AGRNav node: its format (256 x 256 x 32 bits, x-major, z
fastest, most significant bit first, 0.1 m voxels from (-10, -10, -0.1) m) and the folder
it reads, one file at a time."""

import os

import numpy as np
import pytest

from robot_offload.apps import agrnav_repo as ar
from robot_offload.errors import ConfigError


def test_voxel_file_layout_and_voxelisation():
    points = np.array([[-10.0, -10.0, -0.1],          # voxel (0, 0, 0): the file's first bit
                       [-9.95, -9.85, 0.05],          # voxel (0, 1, 1)
                       [15.59, 15.59, 3.09],          # the last voxel
                       [15.6, 0.0, 0.0],              # just outside x
                       [np.nan, 0.0, 0.0]])           # not finite
    data = ar.occupancy_bits(points)
    assert len(data) == 256 * 256 * 32 // 8
    assert data[0] == 0b1000_0000                      # MSB first
    grid = ar.occupancy_from_bits(data)
    assert grid.shape == (256, 256, 32) and grid.sum() == 3
    assert grid[0, 0, 0] and grid[0, 1, 1] and grid[255, 255, 31]
    flat = np.unpackbits(np.frombuffer(data, dtype=np.uint8))
    assert flat[(0 * 256 + 1) * 32 + 1] == 1           # x-major, z fastest
    assert ar.occupancy_from_bits(ar.occupancy_bits(np.zeros((0, 3)))).sum() == 0
    with pytest.raises(ValueError):
        ar.occupancy_from_bits(b"\0" * 10)


def test_folder_holds_one_file_at_a_time(tmp_path):
    cfg = ar.VoxelFolderConfig(dataset_root=str(tmp_path / "voxels"), keep_dir=str(tmp_path / "keep")).validate()
    folder = ar.VoxelFolder(cfg)
    near, far = np.array([[0.0, 0.0, 0.0]]), np.array([[5.0, 5.0, 1.0]])
    first = folder.offer(near, now_s=0.0)
    assert first and first.endswith("000000.bin") and os.path.isfile(first)
    assert folder.offer(near, now_s=0.1) is None                      # the node has not taken it: waits
    assert folder.offer(far, now_s=0.2) is None and folder.dropped == 1   # replaced by the newer sweep
    assert folder.refill(now_s=0.3) is None
    os.remove(first)                                                   # the node took it
    second = folder.refill(now_s=0.31)                                 # the newest sweep, at once
    assert second.endswith("000001.bin")
    assert open(second, "rb").read() == ar.occupancy_bits(far)
    assert sorted(os.listdir(tmp_path / "keep")) == ["000000.bin", "000001.bin"]
    assert not [n for n in os.listdir(tmp_path / "voxels") if not n.endswith(".bin")]   # no partial file left


def test_the_last_sweep_is_written_again_before_the_node_would_find_the_folder_empty(tmp_path):
    """AGRNav's node exits when it lists an empty folder (0.4-0.5 s after taking a file): a
    lidar slower than the model must not stop it."""
    folder = ar.VoxelFolder(ar.VoxelFolderConfig(dataset_root=str(tmp_path), repeat_after_s=0.25).validate())
    assert folder.refill(now_s=0.0) is None                            # nothing seen yet: nothing to write
    first = folder.offer(np.array([[1.0, 2.0, 0.5]]), now_s=1.0)
    os.remove(first)
    assert folder.refill(now_s=1.1) is None                            # a new sweep may still come
    assert folder.refill(now_s=1.3) is None
    again = folder.refill(now_s=1.36)
    assert again and open(again, "rb").read() == ar.occupancy_bits(np.array([[1.0, 2.0, 0.5]]))
    assert folder.repeated == 1 and folder.refill(now_s=5.0) is None   # one file at a time
    os.remove(again)
    fresh = folder.offer(np.zeros((0, 3)), now_s=5.1)                  # a new sweep goes straight in
    assert fresh and folder.repeated == 1


def test_config_and_checkout_checks(tmp_path):
    with pytest.raises(ConfigError, match="repeat_after_s"):
        ar.VoxelFolderConfig(dataset_root=str(tmp_path), repeat_after_s=-1).validate()
    with pytest.raises(ConfigError, match="max_pending"):
        ar.VoxelFolderConfig(dataset_root=str(tmp_path), max_pending=0).validate()
    with pytest.raises(ConfigError, match="not an AGRNav checkout"):
        ar.node_script(str(tmp_path))
    fixture = os.path.join(os.path.dirname(__file__), "..", "fixtures", "agrnav_repo")
    assert ar.node_script(fixture).endswith("inference_ros.py")
