"""agrnav_voxels: point clouds -> the voxel files the real AGRNav perception node reads.

Subscribes ``points`` (sensor_msgs/PointCloud2 with x, y, z) and writes each sweep into
``~dataset_root`` as AGRNav's voxel file, one at a time (see
:mod:`robot_offload.apps.agrnav_repo`): a sweep that arrives while ``~max_pending`` files
wait is dropped, so the node always works on a recent sweep.
"""

import rospy
from sensor_msgs.msg import PointCloud2

from robot_offload.apps.agrnav_repo import VoxelFolder, VoxelFolderConfig
from robot_offload.errors import ConfigError
from robot_offload.ros import conversions as conv
from robot_offload.ros.params import load_params


class AgrnavVoxelsNode:
    def __init__(self):
        try:
            self.folder = VoxelFolder(load_params(VoxelFolderConfig))
        except (ConfigError, OSError) as e:
            raise rospy.ROSInitException(f"agrnav_voxels: {e}") from e
        self.sub = rospy.Subscriber("points", PointCloud2, self._on_points, queue_size=1, buff_size=2 ** 24)
        rospy.loginfo(f"agrnav_voxels: {self.sub.resolved_name} -> {self.folder.config.dataset_root}/*.bin")

    def _on_points(self, msg):
        try:
            path = self.folder.offer(conv.pointcloud2_to_xyzi(msg))
        except (ValueError, OSError) as e:
            rospy.logwarn_throttle(5.0, f"agrnav_voxels: sweep skipped: {e}")
            return
        if path is not None:
            rospy.logdebug(f"agrnav_voxels: wrote {path}")
