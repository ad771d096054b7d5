"""The robot's client on its own torch against a real offload_server process on the
server's torch, over ROS.

scripts/test_robot_torch21.sh runs this module with the robot's torch 2.1 in the test
process (the client, the transparent launcher) and ``ROBOT_OFFLOAD_SERVER_PYTHON`` naming
the main venv's python, whose torch the server runs; the main suite runs it with one torch
on both sides. Whole-model and operator modes compute what the robot computes locally;
the versions are exchanged at connect, and a client claiming another protocol or other
operator schemas is refused with both versions named."""

import dataclasses
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from robot_offload import compat

pytestmark = pytest.mark.robot_side

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
SERVER_PYTHON = os.environ.get("ROBOT_OFFLOAD_SERVER_PYTHON") or sys.executable
PROGRAM = os.path.join(ROOT, "test", "programs", "classifier_loop.py")
CONV = "aten::conv2d.default"     # what a convolution layer calls under inference_mode


@pytest.fixture(scope="module")
def server(ros_master, tmp_path_factory):
    """An offload_server node run by SERVER_PYTHON (its own torch)."""
    import rospy
    # Earlier tests' launches leave their server parameters on the shared master (a key
    # file, a secret): this server starts from its defaults.
    if rospy.has_param("/offload_server"):
        rospy.delete_param("/offload_server")
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([SERVER_PYTHON, os.path.join(ROOT, "nodes", "offload_server"),
                                 "__name:=offload_server", "_device:=cpu", "_preload:=[]",
                                 "_ops_sandbox:=false"],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        rospy.wait_for_service("/offload_server/ping", timeout=180)
    except rospy.ROSException:
        proc.kill()
        pytest.fail(f"offload_server did not start; log:\n{log_path.read_text()[-3000:]}")
    yield proc
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
    # ... and leaves none behind for later tests' servers (its _ops_sandbox:=false)
    if rospy.has_param("/offload_server"):
        rospy.delete_param("/offload_server")


def _client(mode, **kw):
    from robot_offload.client import ClientConfig, OffloadClient
    from robot_offload.ros.transport import RosServiceTransport
    cfg = ClientConfig(model="resnet18", mode=mode, input_size=(32, 32), timeout_s=60.0,
                       load_timeout_s=180, retry_interval_s=0.2, partition_codecs=("raw",),
                       partition_compressions=("none",), **kw)
    return OffloadClient(cfg, RosServiceTransport("/offload_server"))


def _same(a, b):
    """Another torch computes with other kernels: equal within float32 rounding."""
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()))


def test_versions_are_exchanged_and_the_schemas_agree(server):
    c = _client("full_offload")
    try:
        assert c.connect(), c.link.last_error
        theirs, mine = c.link.server_versions, c.link.versions
        print(f"robot torch {mine.torch}, server torch {theirs.torch} ({theirs.device})")
        assert theirs.protocol == mine.protocol == compat.PROTOCOL_VERSION
        if SERVER_PYTHON != sys.executable:
            # the run of scripts/test_robot_torch21.sh: really two torch releases
            assert theirs.torch != mine.torch
        # every allow-listed operator of the robot's torch binds alike on the server's
        assert c.link.refused_ops == {}
    finally:
        c.close()


@pytest.mark.parametrize("mode", ["full_offload", "transparent", "record_replay", "layer_partition", "lop"])
def test_each_mode_computes_what_the_robot_computes(server, tmp_path, mode):
    c = _client(mode, profile_dir=str(tmp_path))
    try:
        assert c.connect(), c.link.last_error
        if mode in ("layer_partition", "lop"):
            b = c._get_backend(mode)
            b.calibration_inputs, b.profile_repeats = 1, 1
        phases = []
        for seed in range(4 if mode == "record_replay" else 2):
            x = c.spec.example_input(c.input_size, seed=seed % 2)
            y, stats = c.infer(x)
            assert stats.executed_mode == mode and not stats.fallback_reason, stats.fallback_reason
            phases.append(stats.phase)
            print(f"{mode}: plan {stats.plan!r}, {stats.bytes_up} bytes up, {stats.round_trips} round trips")
            with torch.inference_mode():
                _same(y, c.model(x))
        if mode in ("full_offload", "transparent", "record_replay"):
            assert stats.bytes_up > 0 and stats.round_trips >= 1
        if mode == "record_replay":
            assert phases[-1] == "replaying", phases
    finally:
        c.close()


def test_full_offload_sends_the_camera_frame_and_the_server_preprocesses_it(server):
    """The camera's uint8 frame to the server's forward_image: the server preprocesses it
    on its torch with the function the robot's torch runs for local frames."""
    c = _client("full_offload")
    rng = np.random.default_rng(5)
    try:
        assert c.connect(), c.link.last_error
        for frame in (rng.integers(0, 256, (32, 32, 3), dtype=np.uint8),
                      rng.integers(0, 256, (45, 50), dtype=np.uint8)):
            y, stats = c.process(frame)
            assert stats.executed_mode == "full_offload" and not stats.fallback_reason, stats.fallback_reason
            assert stats.plan == "input=frame uint8/none" and stats.bytes_up == frame.nbytes
            with torch.inference_mode():
                _same(y, c.model(c.preprocess(frame)))
    finally:
        c.close()


def test_every_layer_partition_cut_joins_the_two_sides(server, tmp_path):
    """The head on the robot's torch, the tail on the server's: each side cuts its own
    trace of the model at the same node."""
    from robot_offload.partition.planner import plan_for
    from robot_offload.stats import FrameStats
    c = _client("layer_partition", profile_dir=str(tmp_path))
    try:
        assert c.connect(), c.link.last_error
        b = c._get_backend("layer_partition")
        b.calibration_inputs, b.profile_repeats = 1, 1
        x = c.spec.example_input(c.input_size, seed=3)
        st = b.state(x)
        with torch.inference_mode():
            ref = c.model(x)
        inner = [cp for cp in st.profile.candidates if cp.kind not in ("input", "output")]
        assert len(inner) >= 3, [cp.id for cp in st.profile.candidates]
        for cp in st.profile.candidates:
            plan = plan_for(st.profile, cp.id, "raw/none", 20e6, st.cfg)
            stats = FrameStats()
            _same(b.run_plan(x, plan, stats, 60.0), ref)
            assert stats.round_trips == (0 if cp.kind == "output" else 1), plan.describe()
    finally:
        c.close()


def test_a_differing_schema_is_refused_naming_the_operator(server):
    c = _client("record_replay")
    try:
        # a robot whose torch reads conv2d's arguments differently
        v = c.link.versions
        c.link.versions = dataclasses.replace(v, ops=dict(v.ops, **{CONV: "0" * compat.DIGEST_CHARS}))
        assert c.connect(), c.link.last_error
        server_torch = c.link.server_versions.torch
        x = c.spec.example_input(c.input_size, seed=0)
        y, stats = c.infer(x)
        assert stats.executed_mode == "local"
        assert f"{CONV} cannot be offloaded" in stats.fallback_reason
        assert f"server (torch {server_torch})" in stats.fallback_reason
        assert f"robot (torch {torch.__version__})" in stats.fallback_reason
        c.set_mode("full_offload")
        y, stats = c.infer(x)
        assert stats.executed_mode == "full_offload" and not stats.fallback_reason
        with torch.inference_mode():
            _same(y, c.model(x))
    finally:
        c.close()


def test_another_protocol_is_refused_at_connect(server):
    c = _client("full_offload")
    try:
        c.link.versions = dataclasses.replace(c.link.versions, protocol=compat.PROTOCOL_VERSION + 1)
        assert not c.connect()
        error = c.link.last_error
        assert error.startswith("INCOMPATIBLE") and f"protocol {compat.PROTOCOL_VERSION + 1}" in error
        assert f"server protocol {compat.PROTOCOL_VERSION} (robot_offload" in error
        _, stats = c.infer(c.spec.example_input(c.input_size, seed=0))
        assert stats.executed_mode == "local" and "INCOMPATIBLE" in stats.fallback_reason
    finally:
        c.close()


def test_the_launcher_runs_an_unmodified_program(server, tmp_path):
    """``rosrun robot_offload transparent`` on the robot's python (the first on PATH)."""
    plain, out, stats_path = tmp_path / "plain.npz", tmp_path / "rr.npz", tmp_path / "rr.json"
    subprocess.run([sys.executable, PROGRAM, "--out", str(plain), "--frames", "4", "--size", "32"],
                   check=True, timeout=300, capture_output=True)
    t0 = time.monotonic()
    proc = subprocess.run(["rosrun", "robot_offload", "transparent", "--stats-out", str(stats_path), "--",
                           "python", PROGRAM, "--out", str(out), "--frames", "4", "--size", "32"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "refuse" not in proc.stderr and "cannot be offloaded" not in proc.stderr, proc.stderr[-3000:]
    a, b = np.load(plain), np.load(out)
    _same(torch.from_numpy(b["logits"]), torch.from_numpy(a["logits"]))
    import json
    s = json.loads(stats_path.read_text())
    assert s["ops_remote"] > 0 and s["server_losses"] == 0 and s["ops_refused"] == 0, s
    print(f"launcher: {time.monotonic() - t0:.1f} s, {s['round_trips']} round trips")
