#!/usr/bin/env bash
# Build .gpuros/: what the GPU machine (the `device` tool's Ubuntu 24.04 image: Python 3.12
# with torch, no ROS, no network) needs to run the ROS benchmark with the server on CUDA.
#
#   bash scripts/setup.sh && bash scripts/gpu_machine/prepare.sh     # here (Debian 12)
#   then on the device, with carry [".gpuros"]:  bash scripts/gpu_machine/bench.sh ...
#
# It holds Debian bookworm's ROS 1 Python packages (pure Python: they run under 3.12),
# this package's generated messages, iproute2 (the image has no `ip`/`tc`), and stand-ins
# for what is compiled for Debian's Python 3.11 or missing there (scripts/gpu_machine/shims:
# netifaces, cv_bridge for 8-bit images, distutils.spawn; rosout: a rospy rosout node).
# About 7 MB: the device carries at most 64 MiB with the tracked tree.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
here="$repo/scripts/gpu_machine"
out="$repo/.gpuros"
gen="$repo/.catkin_ws/devel/lib/python3/dist-packages/robot_offload"
[ -d "$gen/srv" ] || { echo "run scripts/setup.sh first (no generated messages in $gen)" >&2; exit 1; }
ros_debs=(catkin-pkg catkin defusedxml empy genmsg genpy geometry-msgs message-filters
          rosgraph-msgs rosgraph roscpp-msg roslaunch roslib rosmaster rosmsg rosnode rosparam
          rospkg rospy rosservice rostopic rosclean rosunit sensor-msgs std-msgs std-srvs dateutil)
ip_debs=(iproute2 libbpf1 libbsd0 libcap2 libdb5.3 libelf1 libmd0 libmnl0 libtirpc3 libxtables12)
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/debs" "$tmp/root"
(cd "$tmp/debs" && apt-get download $(printf 'python3-%s ' "${ros_debs[@]}") "${ip_debs[@]}" >/dev/null 2>&1) || {
  echo "apt-get download failed" >&2; exit 1; }
rm -rf "$out"; mkdir -p "$out/ros" "$out/ipdebs" "$out/gen" "$out/rosfake"
for p in "${ros_debs[@]}"; do dpkg -x "$tmp"/debs/python3-${p}_*.deb "$tmp/root"; done
cp -r "$tmp/root/usr/lib/python3/dist-packages" "$out/ros/py"
cp -r "$tmp/root/usr/bin" "$out/ros/bin"
cp -r "$tmp/root/etc/ros" "$out/etc_ros"
rm -rf "$out"/ros/py/docutils* "$out"/ros/bin/rst* "$out"/ros/bin/docutils
for f in "$out"/ros/bin/*; do   # the image's python3 is the torch venv's, not /usr/bin/python3
  head -1 "$f" | grep -q python && sed -i '1s|.*|#!/usr/bin/env python3|' "$f"
done
# roslaunch finds its own resources (roscore.xml) and nodes through ROS_PACKAGE_PATH
for d in "$tmp"/root/usr/share/*/; do
  [ -f "$d/package.xml" ] || continue
  p="$(basename "$d")"; mkdir -p "$out/rosfake/$p"
  cp -r "$d"/* "$out/rosfake/$p/"; rm -rf "$out/rosfake/$p/cmake" "$out/rosfake/$p/catkin_env_hook"
done
cp -r "$here/rosout" "$out/rosfake/rosout"; chmod +x "$out/rosfake/rosout/rosout"
for p in "${ip_debs[@]}"; do cp "$tmp"/debs/${p}_*.deb "$out/ipdebs/"; done
cp -r "$gen/msg" "$gen/srv" "$out/gen/"
cp -r "$here/shims" "$out/shims"
find "$out" -name __pycache__ -prune -exec rm -rf {} +
echo "[gpu_machine] $(du -sh "$out" | cut -f1) in $out"
