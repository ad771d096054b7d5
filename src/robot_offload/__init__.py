"""robot_offload: distributed DNN inference for robots.

Everything in this package except :mod:`robot_offload.ros` is pure Python and torch, with no
rospy import, so it can be unit-tested and reused without a ROS master.
"""

__version__ = "0.1.0"
