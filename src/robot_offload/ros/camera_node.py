"""camera_node: publishes sensor_msgs/Image (rgb8) from a source at a fixed rate, stamped
with the capture time, so that latency can be measured end to end."""

import rospy
from sensor_msgs.msg import CameraInfo, Image

from robot_offload.camera import CameraConfig, SyntheticSource, open_source, pinhole_k
from robot_offload.errors import ConfigError
from robot_offload.ros.params import load_params


class CameraNode:
    def __init__(self):
        try:
            c = self.config = load_params(CameraConfig)
            self.source = open_source(c.source, c.width, c.height, c.loop, c.seed)
        except ConfigError as e:
            raise rospy.ROSInitException(f"camera_node: {e}") from e
        self.source_name, self.rate_hz, self.frame_id = c.source, c.rate_hz, c.frame_id
        width, height = c.width, c.height
        self.pub = rospy.Publisher("image", Image, queue_size=2)
        # camera_info: from ~camera_matrix (row-major K) when given, else an ideal pinhole
        # with ~hfov_deg; depth: only the synthetic source can make one (registered).
        k = list(c.camera_matrix) or pinhole_k(width, height, c.hfov_deg)
        self.info = CameraInfo(width=width, height=height, K=list(map(float, k)), distortion_model="plumb_bob",
                               D=[0.0] * 5, R=[1, 0, 0, 0, 1, 0, 0, 0, 1],
                               P=[k[0], 0, k[2], 0, 0, k[4], k[5], 0, 0, 0, 1, 0])
        self.info_pub = rospy.Publisher("camera_info", CameraInfo, queue_size=2)
        self.depth_pub = None
        if c.publish_depth:
            if not isinstance(self.source, SyntheticSource):
                raise rospy.ROSInitException("camera_node: ~publish_depth needs the synthetic source; "
                                             "use your depth camera's driver otherwise")
            self.depth_pub = rospy.Publisher("depth", Image, queue_size=2)
        rospy.loginfo(f"camera_node: {self.source_name} {width}x{height} at {self.rate_hz} Hz, "
                      f"frame_id {self.frame_id}")
        rospy.on_shutdown(self.source.close)

    def spin(self):
        rate = rospy.Rate(self.rate_hz)
        seq = 0
        while not rospy.is_shutdown():
            frame = self.source.read()
            if frame is None:
                rospy.loginfo("camera_node: source ended")
                return
            msg = Image(height=frame.shape[0], width=frame.shape[1], encoding="rgb8",
                        is_bigendian=0, step=frame.shape[1] * 3, data=frame.tobytes())
            msg.header.stamp = rospy.Time.now()
            msg.header.frame_id = self.frame_id
            msg.header.seq = seq
            seq += 1
            self.pub.publish(msg)
            self.info.header = msg.header
            self.info_pub.publish(self.info)
            if self.depth_pub is not None:
                d = self.source.depth_m()
                self.depth_pub.publish(Image(header=msg.header, height=d.shape[0], width=d.shape[1],
                                             encoding="32FC1", is_bigendian=0, step=d.shape[1] * 4,
                                             data=d.tobytes()))
            try:
                rate.sleep()
            except rospy.ROSInterruptException:
                return
