"""Several offload_server nodes under one namespace, found through a real ROS master: a
client spreads its frames over them, finds a server started later, and keeps offloading
on the other when one is SIGKILLed -- every output the local model's."""

import time

import numpy as np
import pytest
import rospy
import torch

from robot_offload.client import ClientConfig, OffloadClient
from robot_offload.ros.fleet import master_directory, server_namespaces

FLEET = "/offload_servers"
MODEL = "mobilenet_v2"


def _server(launch, name):
    proc = launch.start("server.launch", f"ns:={FLEET}", f"server_name:={name}", "device:=cpu",
                        f"preload:=[{MODEL}]", "respawn:=false")
    rospy.wait_for_service(f"{FLEET}/{name}/ping", 120)
    return proc


def _frames(n, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(n)]


def _run(client, frames):
    """Process ``frames``; the servers that answered each (from the pool's frame report)."""
    served = []
    for frame in frames:
        y, stats = client.process(frame)
        assert stats.executed_mode == "full_offload", stats.fallback_reason
        with torch.inference_mode():
            torch.testing.assert_close(y, client.model(client.preprocess(frame)))
        assert stats.processing_s < client.config.timeout_s + 3.0
        served.append(stats.extra["pool"]["servers"][-1])
    return served


def _until(predicate, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


@pytest.mark.timeout(900)
def test_servers_found_through_the_master_share_the_frames_and_survive_a_kill(launch):
    gpu0 = _server(launch, "gpu0")
    assert server_namespaces(FLEET) == [f"{FLEET}/gpu0"]
    config = ClientConfig(model=MODEL, mode="full_offload", input_size=[64, 64], timeout_s=10.0,
                          balance="round_robin", hedge=False, client_id="robot1")
    client = OffloadClient(config, master_directory(FLEET))
    client.link.rediscover_s = 0.5
    try:
        assert client.connect(120.0)
        assert set(_run(client, _frames(3, 0))) == {f"{FLEET}/gpu0"}
        # a second server started later is found and takes its share
        _server(launch, "gpu1")
        _until(lambda: client.link.figures()["servers"].get(f"{FLEET}/gpu1", {}).get("state") == "up",
               120, "the client never found gpu1")
        assert set(_run(client, _frames(6, 1))) == {f"{FLEET}/gpu0", f"{FLEET}/gpu1"}
        # gpu0 dies: at most the frame that meets it retries on gpu1, none goes local
        launch.kill_node(gpu0, f"{FLEET}/gpu0")
        served = _run(client, _frames(6, 2))
        assert served[-3:] == [f"{FLEET}/gpu1"] * 3, served
        assert client.link.figures().get("failovers", 0) >= 1 or f"{FLEET}/gpu0" not in served
    finally:
        client.close()


@pytest.mark.timeout(900)
def test_two_robots_launched_with_fleet_ns_offload_to_both_servers(launch, tmp_path):
    """robot.launch in two robot namespaces with fleet_ns: each client node finds both
    servers, offloads every frame, and each server's health report names both robots."""
    for name in ("gpu0", "gpu1"):
        _server(launch, name)
    wrapper = tmp_path / "robots.launch"
    robot_args = (f'<arg name="model" value="{MODEL}"/><arg name="mode" value="full_offload"/>'
                  '<arg name="input_size" value="[64,64]"/><arg name="rate_hz" value="5"/>'
                  '<arg name="timeout_s" value="10.0"/><arg name="fleet_ns" value="/offload_servers"/>'
                  '<arg name="bandwidth_monitor" value="false"/><arg name="power_logger" value="false"/>')
    wrapper.write_text("<launch>" + "".join(
        f'<group ns="{r}"><include file="$(find robot_offload)/launch/robot.launch">{robot_args}</include></group>'
        for r in ("robot1", "robot2")) + "</launch>")
    launch.start(str(wrapper))
    from robot_offload.msg import InferenceStats
    got = {"robot1": [], "robot2": []}
    subs = [rospy.Subscriber(f"/{r}/offload_client/stats", InferenceStats, got[r].append, queue_size=100)
            for r in got]
    try:
        _until(lambda: all(sum(1 for s in v if s.executed_mode == "full_offload") >= 10 for v in got.values()),
               300, f"not every robot offloaded 10 frames: { {r: [s.executed_mode for s in v][-5:] for r, v in got.items()} }")
    finally:
        for s in subs:
            s.unregister()
    # each server served both robots (balanced per call), per its own figures
    from diagnostic_msgs.msg import DiagnosticArray
    seen = {}

    def on_diag(msg):
        for status in msg.status:
            if "offload_server" in status.name or "gpu" in status.name:
                seen[status.name] = {kv.key: kv.value for kv in status.values}
    sub = rospy.Subscriber("/diagnostics", DiagnosticArray, on_diag, queue_size=50)
    try:
        _until(lambda: len([s for s in seen.values() if sum(k.startswith("client ") for k in s) >= 2]) >= 2,
               120, f"the servers' diagnostics do not both name two clients: {seen}")
    finally:
        sub.unregister()
