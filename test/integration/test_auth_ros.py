"""Authentication over real ROS services (real roscore, the package's launch files): server,
client and bandwidth monitor read the secret from a 0600 file; the client offloads, the
monitor's probes are answered, unsigned or wrongly signed service calls get UNAUTHORIZED,
and a second client with a wrong secret computes every frame locally."""

import dataclasses
import math
import os
import time

import pytest
import rospy

from robot_offload import auth
from robot_offload.msg import BandwidthEstimate, InferenceStats, Status
from robot_offload.protocol import ComputeRequest as PureCompute, PingRequest as PurePing
from robot_offload.ros import conversions as conv
from robot_offload.srv import Compute, Ping

SECRET = "c0ffee00" * 8
WRONG = "deadbeef" * 8
ROBOT_ARGS = ["model:=resnet18", "rate_hz:=5", "input_size:=[64,64]", "timeout_s:=1.0"]


def _secret_file(path, text):
    path.write_text(text + "\n")
    os.chmod(path, 0o600)
    return str(path)


class Collector:
    def __init__(self, topic, msg_type):
        self.msgs = []
        self.sub = rospy.Subscriber(topic, msg_type, lambda m: self.msgs.append((time.monotonic(), m)),
                                    queue_size=100)

    def wait_for(self, predicate, timeout_s, start=0):
        """First message (from index ``start`` on) satisfying ``predicate``."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            for _, m in list(self.msgs)[start:]:
                if predicate(m):
                    return m
            time.sleep(0.1)
        last = self.msgs[-1][1] if self.msgs else None
        pytest.fail(f"no matching message within {timeout_s} s; last: {last}")

    def close(self):
        self.sub.unregister()


def test_authenticated_offload_and_wrong_secret_falls_back(launch, tmp_path):
    good = _secret_file(tmp_path / "secret", SECRET)
    bad = _secret_file(tmp_path / "wrong", WRONG)
    launch.start("server.launch", "preload:=[resnet18]", f"auth_secret_file:={good}")
    launch.start("robot.launch", *ROBOT_ARGS, "mode:=full_offload", f"auth_secret_file:={good}",
                 "power_logger:=false", "probe_period_s:=0.5")
    stats = Collector("/offload_client/stats", InferenceStats)
    bad_stats = Collector("/bad_client/stats", InferenceStats)
    estimates = Collector("/bandwidth_monitor/estimate", BandwidthEstimate)
    try:
        ok = stats.wait_for(lambda m: m.executed_mode == "full_offload", 120)
        assert ok.round_trips == 1 and ok.server_compute_s > 0
        # the monitor's pings are signed too: probes measure an RTT
        est = estimates.wait_for(lambda m: not math.isnan(m.rtt_s) and m.source == "probe", 30)
        assert est.rtt_s > 0

        # Raw service calls: unsigned and wrongly signed are refused, signed is answered.
        ping = rospy.ServiceProxy("/offload_server/ping", Ping)
        compute = rospy.ServiceProxy("/offload_server/compute", Compute)
        r = ping(client_id="t", payload=b"hi", auth="")
        assert r.status.code == Status.UNAUTHORIZED and "no authentication token" in r.status.text
        req = PurePing("t", b"hi")
        r = ping(conv.ping_req_to_srv(auth.sign_request(WRONG.encode(), "ping", req)))
        assert r.status.code == Status.UNAUTHORIZED and "bad signature" in r.status.text
        signed = auth.sign_request(SECRET.encode(), "ping", req)
        r = ping(conv.ping_req_to_srv(signed))
        assert r.status.code == Status.OK and bytes(r.payload) == b"hi"
        r = ping(conv.ping_req_to_srv(signed))            # the same token again
        assert r.status.code == Status.UNAUTHORIZED and "replayed" in r.status.text
        from robot_offload import codec
        import torch
        creq = PureCompute("t", "resnet18", "forward", [codec.encode(torch.zeros(1, 3, 64, 64), "input")])
        signed = auth.sign_request(SECRET.encode(), "compute", creq)
        tampered = dataclasses.replace(signed, args_json='{"x": 1}')
        r = compute(conv.compute_req_to_srv(tampered))
        assert r.status.code == Status.UNAUTHORIZED and len(r.tensors) == 0
        r = compute(conv.compute_req_to_srv(signed))
        assert r.status.code == Status.OK and list(r.tensors[0].shape) == [1, 1000]

        # A second robot with the wrong secret: every frame local, and it keeps going.
        launch.start("robot.launch", *ROBOT_ARGS, "mode:=full_offload", f"auth_secret_file:={bad}",
                     "client_name:=bad_client", "camera:=false", "bandwidth_monitor:=false",
                     "power_logger:=false")
        first = bad_stats.wait_for(lambda m: True, 120)
        time.sleep(3.0)
        frames = [m for _, m in bad_stats.msgs]
        assert len(frames) >= 5, len(frames)
        for m in frames:
            assert m.mode == "full_offload" and m.executed_mode == "local", m
            assert "UNAUTHORIZED" in m.fallback_reason or "authentication" in m.fallback_reason, m
        assert frames[-1].frames_processed > first.frames_processed
        # ... while the right-secret client still offloads.
        stats.wait_for(lambda m: m.executed_mode == "full_offload", 10, start=len(stats.msgs))
    finally:
        for c in (stats, bad_stats, estimates):
            c.close()


KEY_A = "a1a1a1a1" * 8
KEY_B = "b2b2b2b2" * 8


def test_per_client_keys_over_ros(launch, tmp_path):
    """Server with ~auth_keys_file: a robot holding robotA's key offloads as robotA; that
    key cannot sign for robotB, an id without a key is refused, and v1 tokens are refused
    with a message saying so."""
    keys = _secret_file(tmp_path / "keys", f"# per-client keys\nrobotA: {KEY_A}\nrobotB: {KEY_B}")
    key_a = _secret_file(tmp_path / "robotA.secret", KEY_A)
    client_cfg = tmp_path / "client.yaml"
    client_cfg.write_text("client_id: robotA\n")
    launch.start("server.launch", "preload:=[resnet18]", f"auth_keys_file:={keys}")
    launch.start("robot.launch", *ROBOT_ARGS, "mode:=full_offload", f"auth_secret_file:={key_a}",
                 f"client_config:={client_cfg}", "power_logger:=false", "bandwidth_monitor:=false")
    stats = Collector("/offload_client/stats", InferenceStats)
    try:
        ok = stats.wait_for(lambda m: m.executed_mode == "full_offload", 120)
        assert ok.round_trips == 1
        ping = rospy.ServiceProxy("/offload_server/ping", Ping)
        r = ping(conv.ping_req_to_srv(auth.sign_request(KEY_A.encode(), "ping", PurePing("robotA", b"a"))))
        assert r.status.code == Status.OK and bytes(r.payload) == b"a"
        r = ping(conv.ping_req_to_srv(auth.sign_request(KEY_A.encode(), "ping", PurePing("robotB", b"b"))))
        assert r.status.code == Status.UNAUTHORIZED and "bad signature" in r.status.text
        r = ping(conv.ping_req_to_srv(auth.sign_request(KEY_A.encode(), "ping", PurePing("robotC", b"c"))))
        assert r.status.code == Status.UNAUTHORIZED and "no key for client_id" in r.status.text
        v1 = f"v1:{int(time.time() * 1000)}:{'0' * 32}:{'0' * 64}"
        r = ping(client_id="robotA", payload=b"", auth=v1)
        assert r.status.code == Status.UNAUTHORIZED and "v1 is no longer accepted" in r.status.text
    finally:
        stats.close()
