"""The ROS 1 layer: the only part of robot_offload that imports rospy. Node classes,
parameter loading, and conversions between messages and the pure core's types."""
