# Source on the GPU machine, from the repository root, after prepare.sh built .gpuros here
# and the device call carried it: ROS 1 beside the image's torch.
R=$(pwd); G=$R/.gpuros
export PATH=$(dirname "$(command -v python3)"):$PATH
if ! command -v ip >/dev/null 2>&1 || ! command -v tc >/dev/null 2>&1; then
  mkdir -p /tmp/iproot /tmp/iplibs /tmp/ipbin
  for f in "$G"/ipdebs/*.deb; do dpkg -x "$f" /tmp/iproot; done
  for b in /tmp/iproot/bin/ip /tmp/iproot/sbin/tc; do   # only the libraries the image lacks
    for l in $(ldd $b | awk '/not found/{print $1}'); do
      cp -L "$(find /tmp/iproot -name "$l*" | head -1)" "/tmp/iplibs/$l"
    done
  done
  printf '#!/bin/sh\nLD_LIBRARY_PATH=/tmp/iplibs exec /tmp/iproot/bin/ip "$@"\n' > /tmp/ipbin/ip
  printf '#!/bin/sh\nLD_LIBRARY_PATH=/tmp/iplibs exec /tmp/iproot/sbin/tc "$@"\n' > /tmp/ipbin/tc
  chmod +x /tmp/ipbin/*; export PATH=/tmp/ipbin:$PATH
fi
# the shims come last: a real netifaces or distutils, where the image has one, wins
export PYTHONPATH=$R/src:$G/ros/py${PYTHONPATH:+:$PYTHONPATH}:$G/shims
cp -r "$G/gen/msg" "$G/gen/srv" "$R/src/robot_offload/"
chmod +x "$G"/ros/bin/* "$R"/nodes/*
export PATH=$G/ros/bin:$PATH
export ROS_PACKAGE_PATH=$R:$G/rosfake ROS_DISTRO=noetic ROS_VERSION=1 ROS_PYTHON_VERSION=3 ROS_ETC_DIR=$G/etc_ros
export ROS_HOME=/tmp/ros_home ROS_LOG_DIR=/tmp/ros_home/log PYTHONUNBUFFERED=1
mkdir -p "$ROS_LOG_DIR"
