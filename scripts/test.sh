#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: the rostest launch tests, then pytest
# (unit tests without a master, then integration tests with a real roscore and the real
# launch files), then the robot-side tests again on the robot's torch 2.1
# (scripts/test_robot_torch21.sh). Exits non-zero when any test fails. Extra arguments go
# to the main pytest run.
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/scripts/setup.sh" || exit 1
set +u; source "$repo/scripts/env.sh"; set -u
cd "$repo"
results="$repo/.catkin_ws/test_results"
mkdir -p "$results"

status=0
for t in test/rostest/*.test; do
  echo "== rostest $(basename "$t")"
  rostest robot_offload "$(basename "$t")" || { echo "rostest $(basename "$t") FAILED"; status=1; }
done

echo "== pytest"
python -m pytest test -q -ra --junitxml="$results/pytest.xml" "$@" || status=1

echo "== robot side on torch 2.1"
bash "$repo/scripts/test_robot_torch21.sh" || { echo "robot-side tests on torch 2.1 FAILED"; status=1; }
exit $status
