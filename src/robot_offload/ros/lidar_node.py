"""lidar_node: publishes sensor_msgs/PointCloud2 (x, y, z, intensity float32) at a fixed
rate from a moving synthetic scene, stamped with the capture time, so that the AGRNav
pipeline runs without a sensor. A real LiDAR driver or ``rosbag play`` replaces it."""

import rospy
from std_msgs.msg import Header
from sensor_msgs.msg import PointCloud2

from robot_offload.apps.occupancy import LidarConfig, SyntheticSweeps
from robot_offload.errors import ConfigError
from robot_offload.ros import conversions as conv
from robot_offload.ros.params import load_params


class LidarNode:
    def __init__(self):
        try:
            self.config = load_params(LidarConfig)
            self.sweeps = SyntheticSweeps(self.config)
        except ConfigError as e:
            raise rospy.ROSInitException(f"lidar_node: {e}") from e
        self.pub = rospy.Publisher("points", PointCloud2, queue_size=2)
        rospy.loginfo(f"lidar_node: {self.config.source} scene (seed {self.config.seed}, "
                      f"{len(self.sweeps.scene)} points, {int(self.sweeps.moving.sum())} moving) "
                      f"at {self.config.rate_hz} Hz on {self.pub.resolved_name}, frame_id {self.config.frame_id}")

    def spin(self):
        rate = rospy.Rate(self.config.rate_hz)
        while not rospy.is_shutdown():
            header = Header(seq=self.sweeps.index, stamp=rospy.Time.now(), frame_id=self.config.frame_id)
            self.pub.publish(conv.xyzi_to_pointcloud2(self.sweeps.read(), header))
            try:
                rate.sleep()
            except rospy.ROSInterruptException:
                return
