"""occupancy_publisher: turns offload_client's AGRNav results into a point cloud of the
occupied voxels, for RViz and planners.

Subscribes ``result`` (InferenceResult with ``{"occupancy", "labels"}``), publishes
``~occupied`` (sensor_msgs/PointCloud2: one point per voxel whose logit is above
``~threshold_logit``, at the voxel centre, fields x, y, z in metres and ``label`` = class
id, all float32) with the result's header, i.e. the input cloud's stamp and frame.
"""

import rospy
from sensor_msgs.msg import PointCloud2

from robot_offload import codec, structure
from robot_offload.apps.occupancy import OccupancyConfig, occupied_voxels
from robot_offload.errors import ConfigError
from robot_offload.msg import InferenceResult
from robot_offload.ros import conversions as conv
from robot_offload.ros.params import load_params


class OccupancyNode:
    def __init__(self):
        try:
            self.config = load_params(OccupancyConfig)
        except ConfigError as e:
            raise rospy.ROSInitException(f"occupancy_publisher: {e}") from e
        self.pub = rospy.Publisher("~occupied", PointCloud2, queue_size=2)
        self.sub = rospy.Subscriber("result", InferenceResult, self._on_result, queue_size=2,
                                    buff_size=2 ** 25)
        rospy.loginfo(f"occupancy_publisher: {self.sub.resolved_name} -> {self.pub.resolved_name}")

    def _on_result(self, msg):
        try:
            leaves = [codec.decode(conv.tensor_from_msg(t)) for t in msg.outputs]
            outputs = structure.unflatten(leaves, msg.structure_json)
            xyz, labels = occupied_voxels(outputs, self.config.threshold_logit, self.config.extent,
                                          self.config.grid)
        except ValueError as e:  # CodecError and ConfigError are ValueErrors too
            rospy.logwarn_throttle(5.0, f"occupancy_publisher: result of {msg.model!r} skipped: {e}")
            return
        self.pub.publish(conv.columns_to_pointcloud2(msg.header, [
            ("x", xyz[:, 0]), ("y", xyz[:, 1]), ("z", xyz[:, 2]), ("label", labels)]))
