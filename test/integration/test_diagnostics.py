"""/diagnostics from the real nodes, and the robot side in a namespace.

Every one of offload_client, offload_server, bandwidth_monitor and power_logger publishes
its own status and the machine's; a crashed server (SIGKILL of the node, respawned by
server.launch) turns the client's status to ERROR and its return back to OK. Included in
``<group ns="robot1">``, robot.launch's nodes and topics live under /robot1 and still
offload to the one global server, take their own parameters (the monitor's
``learn_burst``), and a robot node that dies is respawned."""

import os
import signal
import threading
import time
import xmlrpc.client

import pytest
import rosgraph
import rosnode
import rospy
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus

from robot_offload.msg import BandwidthEstimate, InferenceStats, PowerSample

ROBOT_ARGS = ["model:=resnet18", "rate_hz:=5", "input_size:=[64,64]", "timeout_s:=1.0", "mode:=full_offload"]
NODE_TASKS = ("offload_client: offload", "offload_server: server", "bandwidth_monitor: bandwidth",
              "power_logger: power")


class Diagnostics:
    """The latest status of each name on /diagnostics, and every one seen, in order."""

    def __init__(self):
        self.latest = {}
        self.history = []
        self._lock = threading.Lock()
        self.sub = rospy.Subscriber("/diagnostics", DiagnosticArray, self._cb, queue_size=100)

    def _cb(self, msg):
        with self._lock:
            for s in msg.status:
                entry = (time.monotonic(), s)
                self.latest[s.name] = entry
                self.history.append(entry)

    def wait_for(self, name, predicate, timeout_s, after=0.0):
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            with self._lock:
                hit = next((s for t, s in self.history if t >= after and s.name == name and predicate(s)), None)
            if hit is not None:
                return hit
            time.sleep(0.2)
        with self._lock:
            last = self.latest.get(name)
        pytest.fail(f"no matching {name!r} status within {timeout_s} s; last: {last and last[1]}")

    def close(self):
        self.sub.unregister()


@pytest.fixture
def diagnostics():
    d = Diagnostics()
    yield d
    d.close()


def _values(status):
    return {kv.key: kv.value for kv in status.values}


def _pid(name):
    uri = rosnode.get_api_uri(rosgraph.Master("/pytest"), name, skip_cache=True)
    return xmlrpc.client.ServerProxy(uri).getPid("/pytest")[2]


def test_every_node_reports_and_the_client_follows_the_server(launch, diagnostics):
    launch.start("server.launch", "device:=cpu")
    launch.start("robot.launch", *ROBOT_ARGS)
    for name in NODE_TASKS:
        status = diagnostics.wait_for(name, lambda s: True, 180)
        assert status.hardware_id and status.message
        node = name.split(":")[0]
        machine = _values(diagnostics.wait_for(f"{node}: machine", lambda s: True, 30))
        assert int(machine["CPU cores"]) >= 1 and float(machine["this node: RSS (MB)"]) > 0
    server = _values(diagnostics.wait_for("offload_server: server",
                                          lambda s: "resnet18" in _values(s)["models loaded"], 180))
    assert server["device"] == "cpu" and "ops: sandboxes" in server
    ok = diagnostics.wait_for("offload_client: offload", lambda s: s.level == DiagnosticStatus.OK
                              and _values(s)["executed mode (last frame)"] == "full_offload", 180)
    v = _values(ok)
    assert v["server link"] == "up" and v["mode"] == "full_offload" and "/offload_server" in v["server"]
    assert float(v["latency median (s)"]) > 0 and float(v["frame rate (Hz, last 10 s)"]) > 0
    assert _values(diagnostics.wait_for("power_logger: power", lambda s: True, 30))["source"]
    bandwidth = _values(diagnostics.wait_for("bandwidth_monitor: bandwidth", lambda s: True, 30))
    assert "predicted" in bandwidth
    assert "link burst learned (ms at the rate)" not in bandwidth     # ~learn_burst is off by default

    # The server crashes: SIGKILL of the node; server.launch respawns it.
    t_kill = time.monotonic()
    old = _pid("/offload_server")
    os.kill(old, signal.SIGKILL)
    lost = diagnostics.wait_for("offload_client: offload", lambda s: s.level == DiagnosticStatus.ERROR,
                                60, after=t_kill)
    assert "offload server unreachable, frames computed locally" in lost.message
    assert _values(lost)["server link"] == "down"
    back = diagnostics.wait_for("offload_client: offload", lambda s: s.level == DiagnosticStatus.OK,
                                240, after=time.monotonic())
    assert _values(back)["server link"] == "up"
    assert _pid("/offload_server") != old
    assert int(_values(back)["fallbacks (total)"]) >= 1


NS_LAUNCH = """<launch>
  <include file="$(find robot_offload)/launch/server.launch">
    <arg name="device" value="cpu"/>
  </include>
  <group ns="robot1">
    <include file="$(find robot_offload)/launch/robot.launch">
      <arg name="model" value="resnet18"/>
      <arg name="mode" value="full_offload"/>
      <arg name="rate_hz" value="5"/>
      <arg name="input_size" value="[64,64]"/>
    </include>
    <param name="bandwidth_monitor/learn_burst" value="true"/>
  </group>
</launch>
"""


def test_robot_side_in_a_namespace(launch, diagnostics, tmp_path):
    path = tmp_path / "robot1.launch"
    path.write_text(NS_LAUNCH)
    launch.start(str(path))
    got = []
    sub = rospy.Subscriber("/robot1/offload_client/stats", InferenceStats, got.append, queue_size=50)
    try:
        diagnostics.wait_for("robot1/offload_client: offload", lambda s: s.level == DiagnosticStatus.OK
                             and _values(s)["executed mode (last frame)"] == "full_offload", 240)
        assert any(m.executed_mode == "full_offload" for m in got)
    finally:
        sub.unregister()
    rospy.wait_for_message("/robot1/bandwidth_monitor/estimate", BandwidthEstimate, timeout=60)
    rospy.wait_for_message("/robot1/power_logger/power", PowerSample, timeout=60)
    topics = {name for name, _ in rospy.get_published_topics()}
    assert {"/robot1/camera/image", "/robot1/camera/camera_info", "/robot1/offload_client/stats",
            "/robot1/offload_client/activity", "/robot1/offload_client/result"} <= topics, sorted(topics)
    assert not {"/camera/image", "/offload_client/stats", "/bandwidth_monitor/estimate"} & topics
    assert {"/robot1/offload_client", "/robot1/camera", "/robot1/bandwidth_monitor",
            "/robot1/power_logger", "/offload_server"} <= set(rosnode.get_node_names())
    for name in ("robot1/bandwidth_monitor: bandwidth", "robot1/power_logger: power",
                 "offload_server: server"):
        diagnostics.wait_for(name, lambda s: True, 60)
    # the robot's own parameters reach its nodes: this monitor learns the link's burst
    burst = _values(diagnostics.wait_for("robot1/bandwidth_monitor: bandwidth", lambda s: True, 60))
    assert float(burst["link burst learned (ms at the rate)"]) >= 0
    # the robot's mode parameter is the robot's
    assert rospy.get_param("/robot1/offload_client/mode") == "full_offload"
    # a robot node that dies comes back (robot.launch's respawn)
    old = _pid("/robot1/bandwidth_monitor")
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while True:
        try:
            if _pid("/robot1/bandwidth_monitor") != old:
                break
        except Exception:  # noqa: BLE001 - not registered again yet, or the dead one's entry
            pass
        assert time.monotonic() < deadline, "bandwidth_monitor was not respawned"
        time.sleep(0.5)
    diagnostics.wait_for("robot1/bandwidth_monitor: bandwidth", lambda s: True, 60, after=time.monotonic())
