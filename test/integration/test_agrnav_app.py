"""AGRNav navigation with a real master and the shipped launch files: synthetic LiDAR ->
offload_client (agrnav) -> occupancy_publisher at the LiDAR rate, AGRNav's planner input
in the planner's format, a mode switch through the parameter server, and a bag from
record.launch turned into CSV and PNG by bag_report."""

import csv
import glob
import math
import os
import signal
import subprocess
import time

import numpy as np
import pytest
import rospy
from sensor_msgs.msg import PointCloud2, PointField
from std_msgs.msg import Float64MultiArray, String

from robot_offload import codec, structure
from robot_offload.apps.occupancy import occupied_mask, occupied_voxels, planner_indices, quaternion_matrix
from robot_offload.models.agrnav import DEFAULT_EXTENT, voxelize
from robot_offload.msg import InferenceResult, InferenceStats
from robot_offload.ros import conversions as conv

RATE_HZ = 5.0  # half the default 10 Hz: headroom on a shared 2-core machine
GRID = (32, 16, 32)  # X, Y, Z voxels: the registry's test size, 0.8 x 1.6 x 0.1 m over AGRNav's extent
NAV_ARGS = ["input_size:=[{},{},{}]".format(*GRID), f"rate_hz:={RATE_HZ}", "timeout_s:=1.0"]
LIDAR_TF = (-5.0, 0.3, 1.0, 0.5)  # the LiDAR in `world`: x, y, z (m), yaw (rad)


class Topic:
    """Collects (arrival time, message) from one topic."""

    def __init__(self, name, msg_type):
        self.msgs = []
        self.sub = rospy.Subscriber(name, msg_type, lambda m: self.msgs.append((time.monotonic(), m)),
                                    queue_size=100, buff_size=2 ** 24)

    def wait_for(self, predicate, timeout_s, after=None):
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            for t, m in list(self.msgs):
                if (after is None or t >= after) and predicate(m):
                    return m
            time.sleep(0.05)
        pytest.fail(f"{self.sub.name}: nothing matching within {timeout_s} s "
                    f"({len(self.msgs)} messages; last {self.msgs[-1][1] if self.msgs else None})")

    def count_since(self, t0):
        return sum(1 for t, _ in list(self.msgs) if t >= t0)


@pytest.fixture
def topics():
    made = []

    def make(name, msg_type):
        made.append(Topic(name, msg_type))
        return made[-1]
    yield make
    for t in made:
        t.sub.unregister()


def decode_result(msg):
    return structure.unflatten([codec.decode(conv.tensor_from_msg(t)) for t in msg.outputs], msg.structure_json)


def read_cloud(msg):
    assert [(f.name, f.offset, f.datatype, f.count) for f in msg.fields] == [
        ("x", 0, PointField.FLOAT32, 1), ("y", 4, PointField.FLOAT32, 1),
        ("z", 8, PointField.FLOAT32, 1), ("label", 12, PointField.FLOAT32, 1)]
    assert msg.point_step == 16 and msg.height == 1 and not msg.is_bigendian
    arr = np.frombuffer(bytes(msg.data), dtype=[("x", "<f4"), ("y", "<f4"), ("z", "<f4"), ("label", "<f4")])
    return np.stack([arr["x"], arr["y"], arr["z"]], axis=1), arr["label"]


def stop(proc, timeout_s=30):
    """SIGINT to a roslaunch, as Ctrl-C would: rosbag closes (and indexes) the bag."""
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait(timeout=timeout_s)


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_navigation_flows_switches_mode_and_records(launch, topics, tmp_path):
    # One torch thread: on a busy 2-core machine two threads contend and a 32x16x32 frame
    # takes 10x longer; client_config is the launch file's own way to override client.yaml.
    (tmp_path / "client.yaml").write_text("num_threads: 1\n")
    launch.start("agrnav_navigation.launch", *NAV_ARGS, "mode:=local", f"client_config:={tmp_path}/client.yaml",
                 "lidar_tf:={} {} {} {} 0 0".format(*LIDAR_TF))
    recorder = launch.start("record.launch", f"bag_prefix:={tmp_path}/run", "record_results:=true")
    results = topics("/offload_client/result", InferenceResult)
    occupied = topics("/occupancy_publisher/occupied", PointCloud2)
    stats = topics("/offload_client/stats", InferenceStats)
    planner = topics("/non_intersection_coordinates", Float64MultiArray)
    sweeps = topics("/points", PointCloud2)

    # 1. Results and occupied-voxel clouds at the LiDAR rate.
    occupied.wait_for(lambda m: True, 90)
    time.sleep(1.0)  # the other nodes finish starting
    t0 = time.monotonic()
    time.sleep(4.0)
    span = time.monotonic() - t0
    for topic in (results, occupied):
        rate = topic.count_since(t0) / span
        assert 0.6 * RATE_HZ <= rate <= 1.2 * RATE_HZ, f"{topic.sub.name}: {rate:.1f} Hz"
    stamps = [m.header.stamp.to_sec() for t, m in list(results.msgs) if t >= t0]
    assert abs(np.median(np.diff(stamps)) - 1 / RATE_HZ) < 0.05  # one result per sweep, stamped at capture

    # 2. A cloud holds exactly the result's occupied voxels, at their centres, in the LiDAR's frame.
    by_stamp = {m.header.stamp: m for _, m in list(results.msgs)}
    cloud = next(m for _, m in reversed(list(occupied.msgs)) if m.header.stamp in by_stamp)
    result = by_stamp[cloud.header.stamp]
    assert cloud.header.frame_id == result.header.frame_id == "lidar" and result.model == "agrnav"
    out = decode_result(result)
    nx, ny, nz = GRID
    assert tuple(out["occupancy"].shape) == tuple(out["labels"].shape) == (1, 1, nx, nz, ny)
    xyz, labels = read_cloud(cloud)
    want_xyz, want_labels = occupied_voxels(out)
    assert len(xyz) == int((out["occupancy"] > 0).sum()) > 0
    np.testing.assert_array_equal(xyz, want_xyz)
    np.testing.assert_array_equal(labels, want_labels)
    # 32 x 16 x 32 over 25.6 x 25.6 x 3.2 m from (-10, -10, -0.1): centres at odd multiples of half a voxel
    steps = (xyz - np.array([-10.0, -10.0, -0.1])) / np.array([0.8, 1.6, 0.1]) - 0.5
    np.testing.assert_allclose(steps, np.round(steps), atol=1e-4)

    # 2b. AGRNav's planner input, in its planner's format: Float64MultiArray of x, y, z index
    #     triples of the planner's 0.1 m map in `world` (from -10, -10, -0.1; 200 x 200 x 50):
    #     the cells, through the LiDAR's TF, of the voxels predicted but not in the sweep.
    msg = planner.wait_for(lambda m: len(m.data) > 0, 30)
    idx = np.asarray(msg.data).reshape(-1, 3)
    assert [(d.label, d.size) for d in msg.layout.dim] == [("voxel", len(idx)), ("xyz", 3)]
    assert np.all(idx == np.round(idx)) and idx.min() >= 0 and np.all(idx.max(axis=0) < [200, 200, 50])
    x, y, z, yaw = LIDAR_TF
    rot = quaternion_matrix(0, 0, math.sin(yaw / 2), math.cos(yaw / 2))
    by_stamp = {m.header.stamp: m for _, m in list(sweeps.msgs)}
    for _, result in reversed(list(results.msgs)):
        if result.header.stamp not in by_stamp:
            continue
        out = decode_result(result)
        seen = voxelize(conv.pointcloud2_to_xyzi(by_stamp[result.header.stamp]), grid=GRID)
        predicted, _ = occupied_mask(out, exclude=seen)
        want = planner_indices(predicted, DEFAULT_EXTENT, rot, (x, y, z), 0.1, (-10, -10, -0.1), (200, 200, 50))
        if np.array_equal(idx, want):
            break
    else:
        pytest.fail("the planner message is no result's predicted-only voxels in the planner's map")
    everything = planner_indices(occupied_mask(out)[0], DEFAULT_EXTENT, rot, (x, y, z), 0.1,
                                 (-10, -10, -0.1), (200, 200, 50))
    assert 0 < len(idx) < len(everything)  # the observed voxels are left out
    # A cell's centre, taken back into the LiDAR's frame, lies in a predicted voxel.
    cell = (idx[len(idx) // 2] + 0.5) * 0.1 + np.array([-10, -10, -0.1])
    in_lidar = rot.T @ (cell - np.array([x, y, z]))
    assert voxelize(in_lidar[None], grid=GRID)[0, 0].numpy()[predicted].sum() == 1

    # 3. rosparam set switches the mode; the stats show it.
    local = stats.wait_for(lambda m: m.mode == "local", 10)
    assert local.executed_mode == "local" and local.model == "agrnav" and local.bytes_up == 0
    t_switch = time.monotonic()
    subprocess.run(["rosparam", "set", "/offload_client/mode", "full_offload"], check=True, timeout=20)
    offloaded = stats.wait_for(lambda m: m.mode == "full_offload" and m.executed_mode == "full_offload",
                               60, after=t_switch)
    assert offloaded.bytes_up == nx * ny * nz * 4 and offloaded.round_trips == 1
    assert offloaded.bytes_down == nx * ny * nz * (4 + 1)  # float32 logits + uint8 labels
    time.sleep(2.0)  # some offloaded frames in the bag

    # 4. The bag converts to CSV and PNG.
    stop(recorder)
    bags = glob.glob(f"{tmp_path}/run_*.bag")
    assert len(bags) == 1, os.listdir(tmp_path)
    report = tmp_path / "report"
    proc = subprocess.run(["rosrun", "robot_offload", "bag_report", bags[0], "--out", str(report)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("stats.csv", "bandwidth.csv", "power.csv", "latency.png", "bandwidth.png", "power.png",
                 "mode.png"):
        assert (report / name).stat().st_size > 0, name
    rows = read_csv(report / "stats.csv")
    assert len(rows) >= 3 * RATE_HZ
    assert {"local", "full_offload"} <= {r["executed_mode"] for r in rows}
    for field in ("latency_s", "transfer_s", "bytes_up", "energy_j", "frames_processed", "time_s", "t_s"):
        float(rows[-1][field])
    assert len(read_csv(report / "bandwidth.csv")) > 0 and len(read_csv(report / "power.csv")) > 0


def test_launch_arguments_compose():
    def nodes(*args):
        out = subprocess.run(["roslaunch", "--nodes", "robot_offload", "agrnav_navigation.launch", *args],
                             capture_output=True, text=True, timeout=60, check=True).stdout
        return set(out.split())
    full = {"/offload_server", "/offload_client", "/bandwidth_monitor", "/power_logger", "/lidar",
            "/occupancy_publisher", "/lidar_tf"}
    assert nodes() == full
    assert nodes("lidar:=false", "server:=false") == full - {"/offload_server", "/lidar", "/lidar_tf"}
    assert nodes("lidar:=false", "lidar_tf:=0 0 1 0 0 0") == full - {"/lidar"}
    assert nodes("record:=true") == full | {"/record"}
    recorded = subprocess.run(["roslaunch", "--args", "/record", "robot_offload", "agrnav_navigation.launch",
                               "record:=true"], capture_output=True, text=True, timeout=60, check=True).stdout
    assert " offload_client/stats" in recorded and " power_logger/power" in recorded
    assert "offload_client/result" not in recorded  # heavy, only with record_results:=true
    occ = subprocess.run(["roslaunch", "--args", "/occupancy_publisher", "robot_offload", "agrnav_navigation.launch",
                          "points_topic:=/velodyne_points"], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    assert "points:=/velodyne_points" in occ and "result:=offload_client/result" in occ


def test_bag_report_refuses_missing_empty_and_foreign_bags(tmp_path, capsys):
    import rosbag
    from robot_offload.ros.bag_report import main
    assert main([str(tmp_path / "nope.bag"), "--out", str(tmp_path / "r")]) == 1
    assert "no such bag file" in capsys.readouterr().err
    empty = str(tmp_path / "empty.bag")
    rosbag.Bag(empty, "w").close()
    assert main([empty]) == 1
    assert "the bag is empty" in capsys.readouterr().err
    other = str(tmp_path / "other.bag")
    with rosbag.Bag(other, "w") as bag:
        bag.write("/chatter", String(data="hi"), rospy.Time(1))
    assert main([other]) == 1
    assert "/chatter (std_msgs/String, 1)" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "r") and not os.path.exists(tmp_path / "empty_report")
