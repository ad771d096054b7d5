#!/usr/bin/env bash
# Set up (if needed) and run the demo: camera -> offload_client -> offload_server on this
# host, local for the first half, full_offload (switched with rosparam) for the second,
# then a table of median latency and frames per second per mode. Extra arguments go to
# the demo (see: rosrun robot_offload demo --help).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/scripts/setup.sh"
set +u; source "$repo/scripts/env.sh"; set -u
exec rosrun robot_offload demo "$@"
