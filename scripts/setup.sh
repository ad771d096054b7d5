#!/usr/bin/env bash
# Set up robot_offload from nothing on Debian 12 (as root) or on Ubuntu 20.04 with ROS
# Noetic in /opt/ros/noetic. Idempotent: a second run only checks and returns.
#
#   bash scripts/setup.sh          # apt packages, venv, catkin build
#
# Everything it builds stays inside the repository, in git-ignored folders:
#   .venv/         Python venv (system site packages: Debian's ROS Python modules)
#   .catkin_ws/    catkin workspace whose src/robot_offload links to the repo's entries
# Environment overrides: ROBOT_OFFLOAD_VENV (venv path), ROBOT_OFFLOAD_SKIP_APT=1.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${ROBOT_OFFLOAD_VENV:-$repo/.venv}"
ws="$repo/.catkin_ws"
log() { echo "[setup] $*"; }

apt_packages=(
  python3-rospy python3-rostest python3-rosbag python3-roslaunch python3-cv-bridge
  python3-rostopic python3-rosservice python3-rosparam python3-rosnode python3-rosmsg
  rosbash ros-core-dev catkin ros-message-generation python3-genmsg python3-genpy
  ros-std-msgs ros-sensor-msgs python3-std-msgs python3-sensor-msgs python3-std-srvs
  ros-geometry-msgs python3-geometry-msgs python3-message-filters python3-actionlib-msgs
  python3-tf2-ros python3-tf2-geometry-msgs tf2-tools
  ros-diagnostic-msgs python3-diagnostic-msgs python3-diagnostic-updater
  python3-venv python3-zstandard python3-psutil python3-matplotlib python3-tqdm
  python3-opencv build-essential cmake iproute2 util-linux procps
)

# 1. System packages.
if [ -f /opt/ros/noetic/setup.bash ]; then
  log "ROS Noetic found in /opt/ros/noetic (Ubuntu 20.04 path); using it"
  set +u; source /opt/ros/noetic/setup.bash; set -u
elif [ "${ROBOT_OFFLOAD_SKIP_APT:-0}" != 1 ]; then
  missing=()
  for p in "${apt_packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    [ "$(id -u)" = 0 ] || { echo "[setup] need root to apt-get install: ${missing[*]}" >&2; exit 1; }
    log "apt-get install ${#missing[@]} packages"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
fi

# 2. The venv. Debian's python (ROS tools have #!/usr/bin/python3); a stamp of the
#    requirements file makes a second run a no-op.
py=/usr/bin/python3
stamp="$venv/.requirements.sha256"
want="$(sha256sum "$repo/requirements.txt" | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  log "creating venv $venv"
  "$py" -m venv --system-site-packages "$venv"
  pip_log="$venv/pip.log"
  { "$venv/bin/python" -m pip install -q --upgrade "pip<26" &&
    "$venv/bin/python" -m pip install -q -r "$repo/requirements.txt"; } >"$pip_log" 2>&1 \
    || { tail -30 "$pip_log" >&2; echo "[setup] pip failed; log: $pip_log" >&2; exit 1; }
  echo "$want" > "$stamp"
fi

# 3. The catkin workspace: the repository itself is the package.
# The package folder in the workspace links to each top-level entry of the repository
# rather than being one link to the repository: a link to the repo would put the
# workspace (and the venv) inside the package, and rosrun's `find -L` would walk them and
# loop.
pkg="$ws/src/robot_offload"
[ -L "$pkg" ] && rm -f "$pkg"
mkdir -p "$pkg"
find "$pkg" -maxdepth 1 -type l ! -exec test -e {} \; -delete
for entry in "$repo"/*; do
  ln -sfn "$entry" "$pkg/$(basename "$entry")"
done
set +u; source "$venv/bin/activate"; set -u
export ROS_HOME="$ws/ros_home" ROS_LOG_DIR="$ws/ros_home/log"
srcstamp="$ws/.source.sha256"
srchash="$(cd "$repo" && { cat package.xml CMakeLists.txt setup.py msg/*.msg srv/*.srv; ls nodes test/rostest 2>/dev/null || true; } | sha256sum | cut -d' ' -f1)"
if [ ! -f "$ws/devel/setup.bash" ] || [ "$(cat "$srcstamp" 2>/dev/null)" != "$srchash" ]; then
  log "catkin_make in $ws"
  (cd "$ws" && catkin_make -DPYTHON_EXECUTABLE="$venv/bin/python" >"$ws/catkin_make.log" 2>&1) \
    || { tail -40 "$ws/catkin_make.log" >&2; exit 1; }
  echo "$srchash" > "$srcstamp"
fi
log "ready: source scripts/env.sh"
