"""occupancy_publisher: turns offload_client's AGRNav results into a point cloud of the
occupied voxels, for RViz and planners, and into the input of AGRNav's planner.

Subscribes ``result`` (InferenceResult with ``{"occupancy", "labels"}``, each
``1 x 1 x X x Z x Y``), publishes ``~occupied`` (sensor_msgs/PointCloud2: one point per voxel
whose logit is above ``~threshold_logit``, at the voxel centre, fields x, y, z in metres and
``label`` = class id, all float32) with the result's header, i.e. the input cloud's stamp
and frame.

With ``~planner_topic`` set (AGRNav's ``/non_intersection_coordinates`` by default) it also
pairs each result with its input sweep (``points``, by stamp), keeps the occupied voxels
the sweep did not observe, as AGRNav's own network node does, and publishes the voxels of
the planner's map (``~planner_frame``, ``~planner_voxel_size``, ``~planner_origin``,
``~planner_grid``) whose centres lie in them, through TF at the sweep's stamp
(std_msgs/Float64MultiArray, flat x, y, z index triples,
:func:`~robot_offload.apps.occupancy.planner_indices`).
"""

import threading

import numpy as np
import rospy
import tf2_ros
from message_filters import Subscriber
from rospy.numpy_msg import numpy_msg
from sensor_msgs.msg import PointCloud2
from std_msgs.msg import Float64MultiArray, MultiArrayDimension

from robot_offload import codec, structure
from robot_offload.apps.occupancy import (OccupancyConfig, occupied_mask, occupied_voxels, planner_indices,
                                          quaternion_matrix)
from robot_offload.errors import ConfigError
from robot_offload.frames import LatestFrame
from robot_offload.models.agrnav import voxelize
from robot_offload.msg import InferenceResult
from robot_offload.ros import conversions as conv
from robot_offload.ros.params import load_params
from robot_offload.ros.stamp_sync import StampPairing

TF_TIMEOUT_S = 0.5
PAIRING_HINT = ("No planner output for them: check that `points` is the cloud offload_client "
                "voxelises (the launch file's points_topic).")


class OccupancyNode:
    def __init__(self):
        try:
            self.config = c = load_params(OccupancyConfig)
        except ConfigError as e:
            raise rospy.ROSInitException(f"occupancy_publisher: {e}") from e
        self.pub = rospy.Publisher("~occupied", PointCloud2, queue_size=2)
        self.sub = rospy.Subscriber("result", InferenceResult, self._on_result, queue_size=2,
                                    buff_size=2 ** 25)
        rospy.loginfo(f"occupancy_publisher: {self.sub.resolved_name} -> {self.pub.resolved_name}")
        self.planner_pub = None
        if c.planner_topic:
            self.tf = tf2_ros.Buffer()
            self._tf_listener = tf2_ros.TransformListener(self.tf)
            # numpy_msg: the index array is serialised as one buffer, not number by number
            self.planner_pub = rospy.Publisher(c.planner_topic, numpy_msg(Float64MultiArray), queue_size=2)
            # The pairs go to a worker: the result callbacks share one thread, and ~occupied
            # must not wait for the planner's indices.
            self.pairs = LatestFrame()
            self.pairing = StampPairing(
                [Subscriber("result", InferenceResult, queue_size=2, buff_size=2 ** 25),
                 Subscriber("points", PointCloud2, queue_size=c.sync_queue_size, buff_size=2 ** 25)],
                c.sync_queue_size, c.sync_slop_s, lambda msg, cloud: self.pairs.put((msg, cloud)), PAIRING_HINT)
            threading.Thread(target=self._planner_worker, name="planner", daemon=True).start()
            rospy.loginfo(f"occupancy_publisher: planner voxels ({c.planner_voxel_size} m, "
                          f"{c.planner_frame}) -> {self.planner_pub.resolved_name}")

    def _decode(self, msg):
        leaves = [codec.decode(conv.tensor_from_msg(t)) for t in msg.outputs]
        return structure.unflatten(leaves, msg.structure_json)

    def _on_result(self, msg):
        try:
            xyz, labels = occupied_voxels(self._decode(msg), self.config.threshold_logit, self.config.extent,
                                          self.config.grid)
        except ValueError as e:  # CodecError and ConfigError are ValueErrors too
            rospy.logwarn_throttle(5.0, f"occupancy_publisher: result of {msg.model!r} skipped: {e}")
            return
        self.pub.publish(conv.columns_to_pointcloud2(msg.header, [
            ("x", xyz[:, 0]), ("y", xyz[:, 1]), ("z", xyz[:, 2]), ("label", labels)]))

    def _planner_worker(self):
        while not rospy.is_shutdown():
            item = self.pairs.get(timeout_s=0.5)
            if item is not None:
                try:
                    self._on_result_and_sweep(*item[0])
                except Exception as e:  # noqa: BLE001 - one bad frame must not stop the worker
                    rospy.logerr_throttle(5.0, f"occupancy_publisher: planner output skipped: "
                                               f"{type(e).__name__}: {e}")

    def _on_result_and_sweep(self, msg, cloud):
        c = self.config
        try:
            outputs = self._decode(msg)
            occupied, _ = occupied_mask(outputs, c.threshold_logit, c.grid)
            nx, nz, ny = occupied.shape
            seen = voxelize(conv.pointcloud2_to_xyzi(cloud), grid=(nx, ny, nz), extent=c.extent)
            predicted, _ = occupied_mask(outputs, c.threshold_logit, c.grid, exclude=seen)
        except ValueError as e:  # CodecError and ConfigError are ValueErrors too
            rospy.logwarn_throttle(5.0, f"occupancy_publisher: result of {msg.model!r} skipped: {e}")
            return
        rotation, translation = np.eye(3), np.zeros(3)
        if msg.header.frame_id != c.planner_frame:
            try:
                tf = self.tf.lookup_transform(c.planner_frame, msg.header.frame_id, msg.header.stamp,
                                              rospy.Duration.from_sec(TF_TIMEOUT_S)).transform
            except (tf2_ros.LookupException, tf2_ros.ConnectivityException, tf2_ros.ExtrapolationException,
                    tf2_ros.InvalidArgumentException) as e:
                rospy.logwarn_throttle(5.0, f"occupancy_publisher: no planner output: no transform "
                                            f"{msg.header.frame_id!r} -> {c.planner_frame!r}: {e}")
                return
            rotation = quaternion_matrix(tf.rotation.x, tf.rotation.y, tf.rotation.z, tf.rotation.w)
            translation = np.array([tf.translation.x, tf.translation.y, tf.translation.z])
        idx = planner_indices(predicted, c.extent, rotation, translation, c.planner_voxel_size,
                              c.planner_origin, c.planner_grid)
        out = numpy_msg(Float64MultiArray)(data=idx.astype(np.float64).ravel())
        out.layout.dim = [MultiArrayDimension(label="voxel", size=len(idx), stride=3 * len(idx)),
                          MultiArrayDimension(label="xyz", size=3, stride=3)]
        self.planner_pub.publish(out)
