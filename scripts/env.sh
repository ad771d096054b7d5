# Source this to use the built package:  source scripts/env.sh
# (venv + catkin devel space + ROS_HOME inside the build tree).
_ro_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ -f /opt/ros/noetic/setup.bash ] && source /opt/ros/noetic/setup.bash
source "${ROBOT_OFFLOAD_VENV:-$_ro_repo/.venv}/bin/activate"
source "$_ro_repo/.catkin_ws/devel/setup.bash"
export ROS_HOME="$_ro_repo/.catkin_ws/ros_home" ROS_LOG_DIR="$_ro_repo/.catkin_ws/ros_home/log"
export PYTHONUNBUFFERED=1
unset _ro_repo
