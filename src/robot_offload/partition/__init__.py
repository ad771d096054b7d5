"""Layer partitioning and local-operator parallelism: graph capture and cuts, profiles,
the cost model and the planners.

* :mod:`robot_offload.partition.graph`   -- fx capture, node kinds, cuts, head / tail modules
* :mod:`robot_offload.partition.profile` -- per-node times, crossing bytes per encoding,
  output error per lossy codec; cached on disk
* :mod:`robot_offload.partition.cost`    -- the one latency / energy model of every way to run a frame
* :mod:`robot_offload.partition.planner` -- layer-partition plans per bandwidth bucket, drift tracking
* :mod:`robot_offload.partition.choice`  -- measured latency settles close calls (MeasuredChoice)
* :mod:`robot_offload.partition.spatial`, :mod:`robot_offload.partition.loss` -- lop's row
  stripes and its schedules (LOSS)
* :mod:`robot_offload.server.executors.partition` -- the server's ``partition_tail`` entry

Pure Python + torch, no rospy.
"""
