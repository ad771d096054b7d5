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
