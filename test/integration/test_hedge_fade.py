"""A link that fades under a frame's upload, on the real testbed: tc-shaped veth between
two network namespaces, roscore and offload_server (server.launch) on one side, an
:class:`~robot_offload.client.OffloadClient` over :class:`RosServiceTransport` on the
other. After a dozen frames at 50 Mbit/s the link drops to 300 kbit/s: the 150 KB image
would take 4 s to send. The robot reads the upload's progress from the kernel's TCP
counters, starts on the frame itself a few polls in (long before the call is late by the
percentile rule, which with ResNet-101 waits twice the robot's forward), and its answer,
equal to the local model's, is the frame's.

Needs root (namespaces, tc); skipped otherwise. Traffic stays inside the namespaces.
"""

import json
import os
import subprocess
import sys
import time

import pytest

from robot_offload.bench.runner import wait_for_master
from robot_offload.testbed import Testbed

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces and tc")

PORT = 23417
FAST_BPS, FADED_BPS = 50e6, 300e3

# Runs in the robot's namespace: warm frames at the fast rate, then one under the fade
# (the parent shapes the link when told "fade"), printing one JSON line per result.
ROBOT = r"""
import json, sys, time
import torch, rospy
from robot_offload import structure
from robot_offload.camera import natural_image
from robot_offload.client import ClientConfig, OffloadClient
from robot_offload.pool import MIN_SAMPLES
from robot_offload.ros.transport import RosServiceTransport
model, side = sys.argv[1], int(sys.argv[2])
if len(sys.argv) > 3:           # the late rule pushed back: only a stall starts the robot early
    import robot_offload.local_hedge
    robot_offload.local_hedge.LOCAL_SHARE = float(sys.argv[3])
torch.set_num_threads(1)        # a robot's forward several times the stall window
rospy.init_node("hedge_fade", anonymous=True, disable_signals=True)
transport = RosServiceTransport("/offload_server")
client = OffloadClient(ClientConfig(model=model, mode="full_offload", input_size=(side, side),
                                    load_timeout_s=120, timeout_s=20, hedge_budget=0.5), transport)
assert client.connect(), client.link.last_error
client.warm_up()
# watched calls: a frame's request on a connection already open
for k in range(MIN_SAMPLES + 4):
    _, stats = client.process(natural_image(side, side, seed=k))
    assert stats.executed_mode == "full_offload", (stats.executed_mode, stats.fallback_reason, stats.extra)
print(json.dumps({"warm": True, "local_s": client._ctx.local_hedge._local_s[-1],
                  "bytes_down": stats.bytes_down}), flush=True)
assert sys.stdin.readline().strip() == "faded"
frame = natural_image(side, side, seed=99)
with torch.inference_mode():
    ref = client.model(client.preprocess(frame))
t0 = time.perf_counter()
y, stats = client.process(frame)
same = all(torch.equal(a, b) for a, b in zip(structure.flatten(y)[0], structure.flatten(ref)[0]))
print(json.dumps({"executed_mode": stats.executed_mode, "fallback_reason": stats.fallback_reason,
                  "hedge": stats.extra.get("hedge"), "seconds": time.perf_counter() - t0,
                  "same_as_local": same, "late_s": client._ctx.local_hedge.delay_s("full_offload_image", 20.0)
                  or client._ctx.local_hedge.delay_s("forward_image", 20.0)}), flush=True)
# the link back at its rate: the next frame is offloaded at once, on a fresh connection
# (the abandoned one is closed, its call ended)
assert sys.stdin.readline().strip() == "restored"
time.sleep(0.5)                 # the shaper's queue of the faded rate drained
t0 = time.perf_counter()
_, nxt = client.process(natural_image(side, side, seed=100))
print(json.dumps({"next_mode": nxt.executed_mode, "next_s": time.perf_counter() - t0,
                  "next_fallback": nxt.fallback_reason}), flush=True)
client.close()
"""


# The same for a spatial lop frame the server joins: transfer A goes out before the
# robot computes its stripe, B after it; under the fade both are abandoned.
ROBOT_LOP = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import torch, rospy
from robot_offload.client import ClientConfig, OffloadClient
from robot_offload.pool import MIN_SAMPLES
from robot_offload.ros.transport import RosServiceTransport
from robot_offload.stats import FrameStats
from schedules import lop_schedules
torch.set_num_threads(1)
rospy.init_node("hedge_fade_lop", anonymous=True, disable_signals=True)
client = OffloadClient(ClientConfig(model="resnet101", mode="lop", input_size=(224, 224),
                                    load_timeout_s=120, timeout_s=20, hedge_budget=0.5,
                                    profile_dir=sys.argv[2], partition_codecs=("raw",)),
                       RosServiceTransport("/offload_server"))
assert client.connect(), client.link.last_error
backend, x, ref, plans = lop_schedules(client, client._get_backend("lop"))
plan = plans[False]
for k in range(MIN_SAMPLES + 4):
    stats = FrameStats()
    backend.run_schedule(x, plan, stats, 20.0)
    assert stats.executed_mode != "local" and stats.extra["lop"]["spatial"], stats.extra
lop = stats.extra["lop"]
print(json.dumps({"warm": True, "bytes": lop["bytes_a"] + lop["bytes_b"], "join": lop["join"]}), flush=True)
assert sys.stdin.readline().strip() == "faded"
stats = FrameStats()
t0 = time.perf_counter()
y = backend.run_schedule(x, plan, stats, 20.0)
print(json.dumps({"executed_mode": stats.executed_mode, "hedge": stats.extra.get("hedge"),
                  "lop": stats.extra.get("lop"), "seconds": time.perf_counter() - t0,
                  "same_as_local": bool(torch.equal(y, ref))}), flush=True)
assert sys.stdin.readline().strip() == "restored"
time.sleep(0.5)
stats = FrameStats()
t0 = time.perf_counter()
y = backend.run_schedule(x, plan, stats, 20.0)
print(json.dumps({"next_mode": stats.executed_mode, "next_s": time.perf_counter() - t0,
                  "next_hedge": stats.extra.get("hedge"),
                  "next_same": bool(torch.allclose(y, ref, rtol=1e-4, atol=1e-4))}), flush=True)
client.close()
"""


def _fade(tmp_path, program, model, *args, fast_bps=FAST_BPS, down_only=False):
    """Run ``program`` (with ``args``) in the robot's namespace against server.launch
    (``model`` preloaded): warm at the fast rate, one frame faded (both ways, or
    ``down_only``), one restored; its two JSON lines."""
    env = {"ROS_MASTER_URI": f"http://10.231.0.1:{PORT}", "ROS_HOME": str(tmp_path),
           "ROS_LOG_DIR": str(tmp_path / "log"), "PYTHONUNBUFFERED": "1"}
    logs = []

    def log(name):
        f = open(tmp_path / name, "w")
        logs.append(f)
        return f
    try:
        with Testbed(fallback=False) as tb:
            env["ROS_MASTER_URI"] = f"http://{tb.server_ip}:{PORT}"
            senv, renv = dict(env, ROS_IP=tb.server_ip), dict(env, ROS_IP=tb.robot_ip)
            tb.set_rate(fast_bps)
            core = tb.run("server", ["roscore", "-p", str(PORT)], env=senv, stdout=log("roscore.log"),
                          stderr=subprocess.STDOUT)
            wait_for_master(tb, senv, core)
            server = tb.run("server", ["roslaunch", "--screen", "robot_offload", "server.launch",
                                       f"preload:=[{model}]", "device:=cpu"],
                            env=senv, stdout=log("server.log"), stderr=subprocess.STDOUT)
            end = time.monotonic() + 180
            while "ready on" not in (tmp_path / "server.log").read_text(errors="replace"):
                assert server.poll() is None and time.monotonic() < end, "offload_server did not start"
                time.sleep(0.1)
            robot = tb.run("robot", [sys.executable, "-c", program, *args], env=renv, stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=log("robot.log"), text=True)
            warm = json.loads(robot.stdout.readline() or "{}")
            assert warm.get("warm"), (tmp_path / "robot.log").read_text()[-3000:]
            tb.set_rate(fast_bps, down_bps=FADED_BPS) if down_only else tb.set_rate(FADED_BPS)
            robot.stdin.write("faded\n")
            robot.stdin.flush()
            line = robot.stdout.readline()
            assert line, (tmp_path / "robot.log").read_text()[-3000:]
            got = json.loads(line)
            tb.set_rate(fast_bps)
            robot.stdin.write("restored\n")
            robot.stdin.flush()
            got.update(json.loads(robot.stdout.readline() or "{}"))
            robot.wait(timeout=60)
    finally:
        for f in logs:
            f.close()
    return warm, got


def test_a_fade_under_the_upload_is_answered_by_the_robot_without_waiting_to_be_late(tmp_path):
    warm, got = _fade(tmp_path, ROBOT, "resnet101", "resnet101", "224")
    print("\n", warm, got)
    hedge = got["hedge"] or {}
    assert got["executed_mode"] == "local" and not got["fallback_reason"], got
    assert got.get("next_mode") == "full_offload" and not got["next_fallback"], got
    assert hedge.get("won") == "local" and "upload" in hedge, got
    upload = hedge["upload"]
    assert 0 <= upload["acked_bytes"] < upload["of_bytes"] and upload["rate_bps"] < 2e6, got
    # the late rule would have waited twice the robot's forward at least
    assert hedge["robot_started_after_ms"] / 1e3 < min(2 * warm["local_s"], got["late_s"] or 1e9), (warm, got)
    assert got["same_as_local"], got
    # the rest of the upload was dropped with its connection, not left on the slow link
    assert hedge.get("upload_abandoned") is True, got
    assert got["next_s"] < 2.0, got


def test_a_lop_frame_under_a_fade_is_answered_by_the_robot(tmp_path):
    """A spatial lop frame the server joins, under the fade: the robot runs the rest of
    the model from the region's first cut, its outputs are local's, both uploads are
    dropped with their connections, and the next frame after the fade is the server's."""
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # its raw activations (2 MB a frame) are offloaded at 500 Mbit/s, not at 50
    warm, got = _fade(tmp_path, ROBOT_LOP, "resnet101", tests, str(tmp_path / "profiles"), fast_bps=500e6)
    print("\n", warm, got)
    assert warm["join"] == "server", warm
    hedge = got["hedge"] or {}
    assert got["executed_mode"] == "local" and hedge.get("won") == "local", got
    assert got["lop"]["hedged"] and got["same_as_local"], got
    assert hedge.get("upload_abandoned") is True, got
    assert got["seconds"] < 2.0, got
    assert got.get("next_mode") != "local" and (got["next_hedge"] or {}).get("won", "server") == "server", got
    assert got["next_same"] and got["next_s"] < 2.0, got


def test_a_fade_under_the_answer_is_answered_by_the_robot(tmp_path):
    """The upload goes through, then the answer (KAPAO-L's predictions) crawls: the robot
    reads the bytes arriving, starts once they come slower than the rest could in its own
    time, and its answer, equal to local's, is the frame's; the call is abandoned."""
    # KAPAO-L's predictions: about 1 MB at 256 x 256. The answer is watched from its first
    # bytes, after the server's forward, so the late rule is pushed back to five times the
    # robot's forward (from twice): on a loaded machine it came first at twice.
    warm, got = _fade(tmp_path, ROBOT, "kapao_l", "kapao_l", "256", "0.2", fast_bps=200e6, down_only=True)
    print("\n", warm, got)
    hedge = got["hedge"] or {}
    assert got["executed_mode"] == "local" and not got["fallback_reason"], got
    assert hedge.get("won") == "local" and "download" in hedge and "upload" not in hedge, got
    answer = hedge["download"]
    assert 0 < answer["received_bytes"] < answer["of_bytes"] and answer["rate_bps"] < 2e6, got
    assert hedge["robot_started_after_ms"] / 1e3 < min(5 * warm["local_s"], got["late_s"] or 1e9), (warm, got)
    assert got["same_as_local"] and hedge.get("answer_abandoned") is True, got
    assert got.get("next_mode") == "full_offload" and not got["next_fallback"] and got["next_s"] < 2.0, got
