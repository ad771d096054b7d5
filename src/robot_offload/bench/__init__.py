"""The benchmark harness: modes x models x traces on the testbed with the real nodes
(``rosrun robot_offload bench`` or ``python -m robot_offload.bench``)."""
