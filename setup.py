# Installs the pure-Python package for catkin (catkin_python_setup); not for pip.
from setuptools import setup
from catkin_pkg.python_setup import generate_distutils_setup

setup(**generate_distutils_setup(packages=[
    "robot_offload",
    "robot_offload.models",
    "robot_offload.backends",
    "robot_offload.transport",
    "robot_offload.ros",
    "robot_offload.testbed",
    "robot_offload.bench",
    "robot_offload.partition",
    "robot_offload.apps",
    "robot_offload.transparent",
    "robot_offload.server",
    "robot_offload.server.executors",
    "robot_offload.server.executors.ops",
    "robot_offload.server.fuzz",
], package_dir={"": "src"}))
