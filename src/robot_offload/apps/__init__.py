"""Applications built on the offloaded models (pure Python + torch/numpy, no rospy).

The ROS nodes in :mod:`robot_offload.ros` wrap these; keeping the logic here lets it be
unit-tested without a roscore.
"""
