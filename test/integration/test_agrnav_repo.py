"""agrnav_navigation.launch agrnav_repo:=<checkout> runs the checkout's own SCONet node,
unchanged, under the transparent launcher (here the stand-in fixture with AGRNav's layout
and behaviour: a node that builds its model again every loop and reads voxel files from a
folder). In auto (the launch default: record_replay, each inference on the robot or the
server, whichever measured faster) it publishes what the same node publishes alone on the
same voxel files, and once its operator sequence is identified a replayed frame costs at
most two round trips, though its model is a new object every frame."""

import glob
import json
import os
import runpy
import shutil
import subprocess
import sys
import time

import numpy as np
import rospy
import torch
from std_msgs.msg import Float64MultiArray

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "fixtures", "agrnav_repo"))
NODE = os.path.join(REPO, "src", "perception", "SCONet", "network", "inference_ros.py")
FRAMES = 6


def make_weights(path):
    """A checkpoint in AGRNav's format, built with the fixture's own network class."""
    network = runpy.run_path(NODE, run_name="agrnav_fixture")
    torch.manual_seed(3)
    model = network["StandInSSC"]()
    with torch.no_grad():
        model.head.bias[0] -= 0.5          # some voxels free, some occupied
    torch.save({"model": model.state_dict(), "config_dict": {"MODEL": {"TYPE": "SCONet"}}}, path)
    return path


def enough_replays(stats_path, n=2):
    try:
        stats = json.loads(stats_path.read_text())
    except (OSError, ValueError):
        return False
    return sum(i["phase"] == "replaying" for i in stats["inferences"]) >= n


class Outputs:
    def __init__(self):
        self.got = []
        self.sub = rospy.Subscriber("/non_intersection_coordinates", Float64MultiArray,
                                    lambda m: self.got.append(np.asarray(m.data).reshape(-1, 3)),
                                    queue_size=50)

    def wait(self, n, timeout_s, why):
        end = time.monotonic() + timeout_s
        while len(self.got) < n and time.monotonic() < end:
            time.sleep(0.2)
        assert len(self.got) >= n, f"{why}: {len(self.got)} of {n} outputs in {timeout_s} s"
        self.sub.unregister()
        return list(self.got)


def test_real_node_layout_record_replay_equals_the_node_alone(launch, tmp_path):
    weights = make_weights(str(tmp_path / "sconet.pth"))
    keep, stats_path = tmp_path / "keep", tmp_path / "stats.json"
    outputs = Outputs()
    proc = launch.start("agrnav_navigation.launch", f"agrnav_repo:={REPO}", f"agrnav_weights:={weights}",
                        f"agrnav_dataset_root:={tmp_path / 'voxels'}", f"agrnav_keep_dir:={keep}",
                        f"agrnav_stats_out:={stats_path}", f"agrnav_output_path:={tmp_path / 'out'}",
                        "rate_hz:=4", "device:=cpu", "bandwidth_monitor:=false", "power_logger:=false")
    # The node may start before the server answers (it then computes on the robot and
    # probes): run until the launcher's stats (rewritten every 2 s) show replayed frames.
    end = time.monotonic() + 300
    while time.monotonic() < end and not enough_replays(stats_path):
        time.sleep(0.5)
    offloaded = outputs.wait(FRAMES, 60, "record_replay through the launch file")
    launch.stop_all()
    assert proc.poll() is not None
    stats = json.loads(stats_path.read_text())

    # The node alone (the launcher's local mode: nothing intercepted), on the same files:
    # one file per published frame, in order.
    files = sorted(glob.glob(str(keep / "*.bin")))[:len(offloaded)]
    assert len(files) == len(offloaded) >= FRAMES
    alone_dir = tmp_path / "alone"
    alone_dir.mkdir()
    for f in files:
        shutil.copy(f, alone_dir)
    outputs = Outputs()
    log = open(tmp_path / "alone.log", "w")
    alone = subprocess.Popen([sys.executable, "-m", "robot_offload.transparent", "--mode", "local", "--",
                              "python", NODE, "__name:=agrnav_alone", f"_weights_file:={weights}",
                              f"_dataset_root:={alone_dir}", f"_output_path:={tmp_path / 'out2'}"],
                             stdout=log, stderr=subprocess.STDOUT)
    try:
        reference = outputs.wait(len(files), 180, "the node alone")
    finally:
        alone.terminate()
        alone.wait(30)
    for k, (a, b) in enumerate(zip(offloaded, reference)):
        assert a.shape == b.shape and np.array_equal(a, b), f"frame {k}: {len(a)} vs {len(b)} voxels"
    assert any(len(a) for a in reference), "the stand-in predicted nothing: a weak comparison"

    infs = stats["inferences"]
    replayed = [i for i in infs if i["phase"] == "replaying"]
    assert stats["sequences_identified"] >= 1 and len(replayed) >= 2, infs
    assert all(i["round_trips"] <= 2 for i in replayed), infs
    # A recorded inference during which the server was lost (under load a call may time
    # out) finished on the robot, with fewer round trips: it says nothing about replay.
    recorded = [i for i in infs if i["phase"] == "recording" and not i["server_lost"]]
    assert recorded, infs
    assert min(i["round_trips"] for i in recorded) > 5 * max(i["round_trips"] for i in replayed), infs
    # The weights (a new model object every loop, the same content) cross the link once,
    # with the first frame; a replayed frame sends its voxel grid only (compressed).
    weights_bytes = sum(t.numel() * t.element_size() for t in torch.load(weights)["model"].values())
    print("bytes up per frame:", [i["bytes_up"] for i in infs], "weights", weights_bytes)
    with_weights = max(i["bytes_up"] for i in infs if i["phase"] == "recording")
    assert all(i["bytes_up"] < with_weights - 0.9 * weights_bytes for i in replayed), infs
