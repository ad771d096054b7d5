"""The soak command, short: 100 inferences in every mode over real ROS services (its
own roscore and a real offload_server node), the mode switched every 100, the server
crashed (SIGKILL) and restarted at 300. It must exit 0: no RSS growth over 50 MB, no
thread or fd growth beyond the transport's bounded pools, every output well-formed, every mode run on the server, and
offloading back after the restart."""

import json
import subprocess
import sys

import pytest

from robot_offload import backends
from robot_offload.soak import parse_args


def test_soak_short_over_ros(tmp_path):
    out = tmp_path / "soak.json"
    # every mode runs a segment of 100 inferences (the soak switches in sorted order)
    n = 100 * len(backends.modes())
    cmd = [sys.executable, "-m", "robot_offload.soak", "--inferences", str(n), "--switch-every", "100",
           "--restart-at", "300", "--rate-hz", "20", "--workdir", str(tmp_path / "work"), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] and report["failures"] == []
    assert report["transport"] == "ros" and report["modes"] == backends.modes()
    assert sum(sum(c.values()) for c in report["executed"].values()) == n + 5 * len(report["modes"])
    for mode in report["modes"]:
        assert report["executed"][mode].get(mode, 0) > 0, (mode, report["executed"])
    assert report["after_restart"].get("local", 0) > 0          # computed locally while it was down
    assert report["resume_after_restart_s"] is not None          # and offloaded again afterwards
    assert report["growth"]["rss_mb"] <= 50
    # threads and fds: no growth beyond the transport's pools, which stay within bound
    assert report["leaked"]["threads"] <= 0 and report["leaked"]["fds"] <= 0
    pools = report["transport_pools"]
    for kind in ("threads", "connections"):
        assert 0 < pools["end"][kind] <= pools["limits"][kind], pools
    assert "RSS" in proc.stderr and "OK" in proc.stderr.splitlines()[-1]


@pytest.mark.parametrize("argv", [["--inferences", "0"], ["--inferences", "10", "--restart-at", "10"],
                                  ["--modes", "teleport"], ["--input-size", "32"], ["--switch-every", "-1"]])
def test_soak_refuses_bad_arguments(argv):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
