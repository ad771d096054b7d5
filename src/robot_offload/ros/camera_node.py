"""camera_node: publishes sensor_msgs/Image (rgb8) from a source at a fixed rate, stamped
with the capture time, so that latency can be measured end to end."""

import rospy
from sensor_msgs.msg import CameraInfo, Image

from robot_offload.camera import SyntheticSource, open_source, pinhole_k


class CameraNode:
    def __init__(self):
        self.source_name = rospy.get_param("~source", "synthetic")
        self.rate_hz = float(rospy.get_param("~rate_hz", 10.0))
        self.frame_id = rospy.get_param("~frame_id", "camera")
        width = int(rospy.get_param("~width", 640))
        height = int(rospy.get_param("~height", 480))
        self.source = open_source(self.source_name, width, height, rospy.get_param("~loop", True),
                                  int(rospy.get_param("~seed", 0)))
        self.pub = rospy.Publisher("image", Image, queue_size=2)
        # camera_info: from ~camera_matrix (row-major K) when given, else an ideal pinhole
        # with ~hfov_deg; depth: only the synthetic source can make one (registered).
        k = rospy.get_param("~camera_matrix", []) or pinhole_k(width, height, float(rospy.get_param("~hfov_deg", 69.4)))
        self.info = CameraInfo(width=width, height=height, K=list(map(float, k)), distortion_model="plumb_bob",
                               D=[0.0] * 5, R=[1, 0, 0, 0, 1, 0, 0, 0, 1],
                               P=[k[0], 0, k[2], 0, 0, k[4], k[5], 0, 0, 0, 1, 0])
        self.info_pub = rospy.Publisher("camera_info", CameraInfo, queue_size=2)
        self.depth_pub = None
        if rospy.get_param("~publish_depth", False):
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
