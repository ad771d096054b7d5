"""transparent / record_replay over real ROS services: the launcher runs an unmodified
program against a real offload_server node, and the offload_client node switches to
record_replay through the parameter server, replays with one round trip per frame, and
rebuilds its server-side state after the server is killed and restarted."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import torch

from test_pipeline import ROBOT_ARGS, stats  # noqa: F401  (fixture)

PROGRAM = os.path.join(os.path.dirname(__file__), "..", "programs", "classifier_loop.py")


def _wait_for_service(name, timeout_s=90):
    import rospy
    rospy.wait_for_service(name, timeout=timeout_s)


def test_launcher_runs_unmodified_program_against_server_node(launch, tmp_path):
    launch.start("server.launch")
    _wait_for_service("/offload_server/compute")
    plain = tmp_path / "plain.npz"
    subprocess.run([sys.executable, PROGRAM, "--out", str(plain), "--frames", "6"], check=True, timeout=300,
                   capture_output=True)
    out, stats_path = tmp_path / "rr.npz", tmp_path / "rr.json"
    proc = subprocess.run(["rosrun", "robot_offload", "transparent", "--mode", "record_replay",
                           "--stats-out", str(stats_path), "--",
                           "python", PROGRAM, "--out", str(out), "--frames", "6"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[transparent] mode=record_replay" in proc.stderr
    a, b = np.load(plain), np.load(out)
    for key in a.files:
        torch.testing.assert_close(torch.from_numpy(b[key]), torch.from_numpy(a[key]), rtol=1e-5, atol=1e-5)
    s = json.loads(stats_path.read_text())
    replayed = [i for i in s["inferences"] if i["phase"] == "replaying"]
    assert s["sequences_identified"] == 1 and len(replayed) >= 2
    assert all(i["round_trips"] <= 2 for i in replayed), s["inferences"]


def test_client_node_record_replay_and_server_restart(launch, stats):  # noqa: F811
    server = launch.start("server.launch")
    launch.start("robot.launch", *[a for a in ROBOT_ARGS if not a.startswith("timeout_s")],
                 "timeout_s:=5.0", "mode:=local")
    stats.wait_for(lambda m: m.mode == "local", 90)
    t_switch = time.monotonic()
    subprocess.run(["rosparam", "set", "/offload_client/mode", "record_replay"], check=True, timeout=20)
    _, m = stats.wait_for(lambda m: m.executed_mode == "record_replay" and m.phase == "replaying", 90,
                          after=t_switch)
    assert m.round_trips <= 2 and m.bytes_up < 3 * 64 * 64 * 4 + 64 * 1024
    recorded = [msg for t, msg in stats.msgs if t > t_switch and msg.phase == "recording"]
    assert recorded and min(msg.round_trips for msg in recorded) > 20
    # The server dies: frames go local within the deadline; after the restart the client
    # records again (new handles, new sequence) and replays, without being restarted.
    t_kill = time.monotonic()
    launch.kill_node(server, "/offload_server")
    stats.wait_for(lambda m: m.executed_mode == "local" and m.mode == "record_replay", 15, after=t_kill)
    t_restart = time.monotonic()
    launch.start("server.launch")
    _, m = stats.wait_for(lambda m: m.executed_mode == "record_replay" and m.phase == "replaying", 120,
                          after=t_restart)
    assert m.round_trips <= 2 and m.fallbacks >= 1


SUBSCRIBER = os.path.join(os.path.dirname(__file__), "programs", "subscriber_inference.py")


def test_inference_in_a_subscriber_callback_is_intercepted(ros_master, tmp_path):
    """rospy runs a subscriber's callback in a thread of its own: the launcher follows the
    program into it (its operators are offloaded) and the outputs are the plain run's."""
    plain = tmp_path / "plain.npz"
    subprocess.run([sys.executable, SUBSCRIBER, "--out", str(plain)], check=True, timeout=300,
                   capture_output=True)
    for mode in ("transparent", "record_replay"):
        out, stats_path = tmp_path / f"{mode}.npz", tmp_path / f"{mode}.json"
        proc = subprocess.run([sys.executable, "-m", "robot_offload.transparent", "--inproc", "--mode", mode,
                               "--stats-out", str(stats_path), "--", "python", SUBSCRIBER, "--out", str(out)],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        np.testing.assert_array_equal(np.load(out)["out"], np.load(plain)["out"])
        s = json.loads(stats_path.read_text())
        assert s["ops_remote"] + s["ops_replayed"] > 0, "the callback's operators were not intercepted"
