"""agrnav_voxels: point clouds -> the voxel files the real AGRNav perception node reads.

Subscribes ``points`` (sensor_msgs/PointCloud2 with x, y, z) and writes each sweep into
``~dataset_root`` as AGRNav's voxel file, one at a time (see
:mod:`robot_offload.apps.agrnav_repo`): while ``~max_pending`` files wait, the newest sweep
waits in memory and is written within 20 ms of the AGRNav node taking a file; with no new
sweep by ``~repeat_after_s``, the last one is written again.
"""

import time

import rospy
from sensor_msgs.msg import PointCloud2

from robot_offload.apps.agrnav_repo import VoxelFolder, VoxelFolderConfig
from robot_offload.errors import ConfigError
from robot_offload.ros import conversions as conv
from robot_offload.ros.params import load_params

#: how often the folder is checked for the AGRNav node having taken a file (s)
REFILL_PERIOD_S = 0.02


class AgrnavVoxelsNode:
    def __init__(self):
        try:
            self.folder = VoxelFolder(load_params(VoxelFolderConfig))
        except (ConfigError, OSError) as e:
            raise rospy.ROSInitException(f"agrnav_voxels: {e}") from e
        self.sub = rospy.Subscriber("points", PointCloud2, self._on_points, queue_size=1, buff_size=2 ** 24)
        self._repeated_logged = 0
        self.timer = rospy.Timer(rospy.Duration(REFILL_PERIOD_S), self._refill)
        rospy.loginfo(f"agrnav_voxels: {self.sub.resolved_name} -> {self.folder.config.dataset_root}/*.bin")

    def _on_points(self, msg):
        try:
            path = self.folder.offer(conv.pointcloud2_to_xyzi(msg), time.monotonic())
        except (ValueError, OSError) as e:
            rospy.logwarn_throttle(5.0, f"agrnav_voxels: sweep skipped: {e}")
            return
        if path is not None:
            rospy.logdebug(f"agrnav_voxels: wrote {path}")

    def _refill(self, _event):
        try:
            self.folder.refill(time.monotonic())
        except (ValueError, OSError) as e:
            rospy.logwarn_throttle(5.0, f"agrnav_voxels: sweep skipped: {e}")
            return
        if self.folder.repeated > self._repeated_logged:
            self._repeated_logged = self.folder.repeated
            rospy.logwarn_throttle(
                10.0, f"agrnav_voxels: no new sweep on {self.sub.resolved_name} within "
                      f"{self.folder.config.repeat_after_s} s of the AGRNav node taking a file: the last "
                      f"sweep written again ({self.folder.repeated} times so far), as the node exits "
                      f"on an empty folder")
