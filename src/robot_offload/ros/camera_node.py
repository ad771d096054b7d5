"""camera_node: publishes sensor_msgs/Image (rgb8) from a source at a fixed rate, stamped
with the capture time, so that latency can be measured end to end."""

import rospy
from sensor_msgs.msg import Image

from robot_offload.camera import open_source


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
            try:
                rate.sleep()
            except rospy.ROSInterruptException:
                return
