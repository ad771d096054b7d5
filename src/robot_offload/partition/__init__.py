"""Layer partitioning: graph capture and cuts, profiles, and the planner.

* :mod:`robot_offload.partition.graph`   -- fx capture, node kinds, cuts, head / tail modules
* :mod:`robot_offload.partition.profile` -- per-node times, crossing bytes per encoding,
  output error per lossy codec; cached on disk
* :mod:`robot_offload.partition.planner` -- latency / energy model, plans per bandwidth bucket
* :mod:`robot_offload.server.executors.partition` -- the server's ``partition_tail`` entry

Pure Python + torch, no rospy.
"""
