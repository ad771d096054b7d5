#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: the rostest launch tests, then pytest
# (unit tests without a master, then integration tests with a real roscore and the real
# launch files). Exits non-zero when any test fails. Extra arguments go to pytest.
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
exit $status
