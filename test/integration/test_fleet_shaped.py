"""The fleet benchmark with shaped per-robot links (--robot-links): two robots in their own
namespaces at 5 and 50 Mbit/s share one real offload_server through a real master in the
host namespace. Every frame is accounted for, the report names each robot's trace, the
5 Mbit/s robot's frames take at least their upload at 5 Mbit/s and clearly longer than the
other's, and nothing is left behind. About a minute (40 s of it the robots' start-up)."""

import json
import os
import subprocess
import sys

import pytest

from robot_offload.testbed import netns, star

RATES = (5e6, 50e6)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces")
@pytest.mark.timeout(400)
def test_fleet_with_shaped_robot_links(tmp_path):
    out = tmp_path / "fleet"
    before = set(netns.list_namespaces())
    proc = subprocess.run(
        [sys.executable, "-m", "robot_offload.bench", "--fleet", "2:1", "--model", "mobilenet_v2",
         "--duration-s", "8", "--ready-s", "40", "--rate-hz", "2", "--server-cpus", "0",
         "--timeout-s", "3", "--robot-links", ",".join(f"const:{r / 1e6:g}" for r in RATES),
         "--out", str(out)], capture_output=True, text=True, timeout=360)
    logs = "".join(f"\n--- {p.name}\n{p.read_text()[-2000:]}" for p in (out / "logs").glob("*.log"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + logs

    results = json.loads((out / "results.json").read_text())
    assert "robot0 const:5; robot1 const:50" in results["setup"]["link"]
    assert "robot0 const:5; robot1 const:50" in (out / "report.md").read_text()
    assert [x["error"] for x in results["links"]] == [None, None]
    rows = {r["robot"]: r for r in results["summary"]["robots"]}
    assert results["summary"]["total"]["accounted"]
    for name, row in rows.items():
        assert row["processed"] >= 8 and row["local"] == 0, row
    slow, fast = rows["robot0"]["p50_s"], rows["robot1"]["p50_s"]
    # the upload alone at 5 Mbit/s, less the 20 ms bucket the shaper may start with full
    upload = min(f["bytes_up"] for f in results["robots"][0]["frames"])
    assert upload > 100_000
    assert slow >= (upload - 0.02 * RATES[0] / 8) * 8 / RATES[0]
    assert slow > 3 * fast, (slow, fast)
    # everything of the star is gone again
    assert set(netns.list_namespaces()) <= before
    assert not [a for a, pid in star.list_host_addresses() if not netns.pid_alive(pid)]
