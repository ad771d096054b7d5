"""Faults on the real testbed: two network namespaces joined by a tc-shaped veth pair,
roscore and offload_server (server.launch) on one side, camera and offload_client
(robot.launch) on the other, exactly as deployed. Three faults, one after the other:

(a) the link rate dropped to 10 kbit/s for 5 s,
(b) the link taken down (``ip link set veth-robot down``) for 5 s and brought back,
(c) the server node SIGKILLed while frames are being offloaded, then restarted.

In each: no frame's processing time exceeds the deadline (``timeout_s``) plus a margin for
the local inference that follows a miss; frames keep being computed locally during the
fault; every frame is accounted for (at every stats message, received - processed -
dropped is 0 or 1 -- the one frame waiting in the slot -- and exactly 0 once the camera
stops); and offloading resumes within 2 s of the recovery.

Needs root (namespaces, tc); skipped otherwise. Traffic stays inside the namespaces.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from robot_offload.bench.runner import wait_for_master
from robot_offload.testbed import Testbed

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces and tc")

TIMEOUT_S = 1.0          # the client's deadline (timeout_s)
MARGIN_S = 1.0           # room for the local inference after a missed deadline, on a busy 2-core VM
                         # (more where this machine's local inferences are measured slower)
RESUME_S = 2.0           # offloading must be back within this of the recovery
RATE_HZ = 5
FAST_BPS = 50e6
PORT = 23411

# A subscriber in the robot's namespace printing each InferenceStats as one JSON line with
# the monotonic time it arrived (one clock for this process and its children).
STATS_PRINTER = r"""
import json, sys, time, rospy
from robot_offload.msg import InferenceStats
F = ("mode", "executed_mode", "fallback_reason", "latency_s", "queue_s", "round_trips",
     "robot_compute_s", "frames_received", "frames_processed", "frames_dropped", "fallbacks",
     "detail_json")
def cb(m):
    d = {f: getattr(m, f) for f in F}
    d["t"] = time.monotonic()
    d["stamp"] = m.header.stamp.to_sec()
    sys.stdout.write(json.dumps(d) + "\n")
    sys.stdout.flush()
rospy.init_node("fault_stats", anonymous=True)
rospy.Subscriber("/offload_client/stats", InferenceStats, cb, queue_size=200)
print(json.dumps({"ready": True}), flush=True)
rospy.spin()
"""


class StatsTap:
    """Collects the client's stats (arrival time, dict) on a background thread."""

    def __init__(self, proc):
        self.proc = proc
        self.rows = []
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            try:
                d = json.loads(line)
            except ValueError:
                continue
            if "t" in d:
                with self._lock:
                    self.rows.append(d)

    def since(self, t):
        with self._lock:
            return [d for d in self.rows if d["t"] >= t]

    def wait_for(self, predicate, timeout_s, after):
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            for d in self.since(after):
                if predicate(d):
                    return d
            time.sleep(0.05)
        rows = self.since(after)
        pytest.fail(f"no matching stats within {timeout_s} s (after {len(rows)} rows); "
                    f"last: {rows[-3:] if rows else None}")


def _processing_s(d):
    return d["latency_s"] - d["queue_s"]


def _ns_pids(tb, side, fragment):
    """Pids in a side's namespace whose command line contains ``fragment``."""
    out = subprocess.run(["ip", "netns", "pids", tb.ns(side)], capture_output=True, text=True).stdout
    found = []
    for pid in (int(p) for p in out.split() if p.isdigit()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if fragment in cmd:
            found.append(pid)
    return found


class Rig:
    def __init__(self, tb, tmp):
        self.tb = tb
        self.tmp = tmp
        env = {"ROS_MASTER_URI": f"http://{tb.server_ip}:{PORT}", "ROS_HOME": str(tmp),
               "ROS_LOG_DIR": str(tmp / "log"), "PYTHONUNBUFFERED": "1"}
        self.senv = dict(env, ROS_IP=tb.server_ip)
        self.renv = dict(env, ROS_IP=tb.robot_ip)
        self.logs = []
        self.server = None
        self.server_log = None

    def log(self, name):
        f = open(self.tmp / name, "w")
        self.logs.append(f)
        return f

    def start_server(self, n):
        self.server_log = self.tmp / f"server-{n}.log"
        self.server = self.tb.run("server", ["roslaunch", "--screen", "robot_offload", "server.launch",
                                             "preload:=[resnet18]", "device:=cpu"],
                                  env=self.senv, stdout=self.log(self.server_log.name),
                                  stderr=subprocess.STDOUT)
        return self.server

    def wait_server_ready(self, timeout_s=120):
        """Monotonic time at which the server logged that its services are up."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if "ready on" in self.server_log.read_text(errors="replace"):
                return time.monotonic()
            if self.server.poll() is not None:
                pytest.fail(f"server.launch exited; see {self.server_log}")
            time.sleep(0.05)
        pytest.fail("offload_server did not become ready")


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    with Testbed(fallback=False) as tb:
        r = Rig(tb, tmp)
        tb.set_rate(FAST_BPS)
        core = tb.run("server", ["roscore", "-p", str(PORT)], env=r.senv, stdout=r.log("roscore.log"),
                      stderr=subprocess.STDOUT)
        wait_for_master(tb, r.senv, core)
        r.start_server(0)
        tb.run("robot", ["roslaunch", "--screen", "robot_offload", "robot.launch", "model:=resnet18",
                         "mode:=full_offload", f"rate_hz:={RATE_HZ}", "input_size:=[64,64]",
                         f"timeout_s:={TIMEOUT_S}", "bandwidth_monitor:=false", "power_logger:=false"],
               env=r.renv, stdout=r.log("robot.log"), stderr=subprocess.STDOUT)
        printer = tb.run("robot", [sys.executable, "-c", STATS_PRINTER], env=r.renv,
                         stdout=subprocess.PIPE, stderr=r.log("printer.log"), text=True)
        r.stats = StatsTap(printer)
        r.stats.wait_for(lambda d: d["executed_mode"] == "full_offload", 180, after=0)
        r.t_start = time.monotonic()
        yield r
        for f in r.logs:
            f.close()


def _check_fault_window(rig, t_fault, t_recover, what):
    """During and after a fault: deadlines held, local frames kept coming, accounting exact,
    offloading back within RESUME_S of the recovery. Returns the resumed frame."""
    resumed = rig.stats.wait_for(lambda d: d["executed_mode"] == "full_offload", 30, after=t_recover)
    # resumed = the first offloaded frame left for the server (its start: arrival of its
    # stats less its processing time); its completion is reported too
    back_after = resumed["t"] - _processing_s(resumed) - t_recover
    rows = rig.stats.since(t_fault)
    during = [d for d in rows if d["t"] <= resumed["t"]]
    assert during, f"{what}: no stats during the fault"
    # What the deadline bounds is the wait for the server: a frame's time less its own
    # computing (the local inference after a miss, as slow as this machine's load makes it).
    waited = max(during, key=lambda d: _processing_s(d) - d["robot_compute_s"])
    assert _processing_s(waited) - waited["robot_compute_s"] < TIMEOUT_S + MARGIN_S, \
        f"{what}: a frame waited {_processing_s(waited) - waited['robot_compute_s']:.2f} s (deadline {TIMEOUT_S} s): {waited}"
    local_s = max([d["robot_compute_s"] for d in during if d["executed_mode"] == "local"] or [0.0])
    margin_s = max(MARGIN_S, 1.5 * local_s + 0.3)         # one local inference, as measured here
    slowest = max(during, key=_processing_s)
    assert _processing_s(slowest) < TIMEOUT_S + margin_s, \
        f"{what}: a frame took {_processing_s(slowest):.2f} s (deadline {TIMEOUT_S} s, local {local_s:.2f} s): {slowest}"
    fault_rows = [d for d in during if d["t"] < t_recover]
    gaps = [b["t"] - a["t"] for a, b in zip([{"t": t_fault}] + during, during)]
    with open(rig.tmp / f"stats-{what.replace(' ', '_').replace('/', '_')}.json", "w") as f:
        json.dump({"t_fault": t_fault, "t_recover": t_recover, "rows": rows}, f)
    local = [d for d in fault_rows if d["executed_mode"] == "local"]
    span = t_recover - t_fault
    # Frames kept coming: no gap between results longer than one deadline plus one local
    # inference (the link is marked down after the first miss, then frames go local at once).
    assert max(gaps) < TIMEOUT_S + margin_s, (what, local_s, [round(g, 2) for g in gaps])
    # about one local frame per camera period, or per local inference where that is slower
    per_frame_s = max(1.0 / RATE_HZ, local_s)
    assert len(local) >= 0.5 * (span - TIMEOUT_S) / per_frame_s - 1, (what, len(local), span, local_s)
    # each says why: a fallback, or the robot's hedge answered it (the link stalled under
    # the upload, so the robot started before the deadline)
    assert all(d["fallback_reason"] or _hedge_won_locally(d) for d in local), what
    assert all(d["mode"] == "full_offload" for d in rows), what
    _check_accounting(rows, what)
    assert back_after <= RESUME_S, f"{what}: offloading resumed {back_after:.2f} s after recovery"
    print(f"\n{what}: {len(fault_rows)} frames during the fault ({len(local)} local), slowest "
          f"{_processing_s(slowest):.2f} s, longest gap {max(gaps):.2f} s; first frame offloaded again "
          f"{back_after:.2f} s after recovery (its result after {resumed['t'] - t_recover:.2f} s)")
    return resumed


def _hedge_won_locally(d):
    try:
        hedge = json.loads(d.get("detail_json") or "{}").get("hedge", {})
    except (ValueError, AttributeError):
        return False
    return isinstance(hedge, dict) and hedge.get("won") == "local"


def _check_accounting(rows, what):
    prev = None
    for d in rows:
        waiting = d["frames_received"] - d["frames_processed"] - d["frames_dropped"]
        assert waiting in (0, 1), (what, d)
        if prev is not None:
            assert d["frames_processed"] > prev["frames_processed"], (what, prev, d)
            assert d["frames_received"] >= prev["frames_received"], (what, prev, d)
        prev = d


def test_a_link_rate_near_zero_for_5s(rig):
    tb = rig.tb
    t_fault = time.monotonic()
    tb.set_rate(10e3)
    time.sleep(5.0)
    tb.set_rate(FAST_BPS)
    t_recover = time.monotonic()
    _check_fault_window(rig, t_fault, t_recover, "10 kbit/s")


def test_b_link_down_and_up(rig):
    tb = rig.tb
    rig.stats.wait_for(lambda d: d["executed_mode"] == "full_offload", 30, after=time.monotonic())
    t_fault = time.monotonic()
    subprocess.run(["ip", "-n", tb.robot_ns, "link", "set", tb.robot_if, "down"], check=True)
    time.sleep(5.0)
    subprocess.run(["ip", "-n", tb.robot_ns, "link", "set", tb.robot_if, "up"], check=True)
    t_recover = time.monotonic()
    _check_fault_window(rig, t_fault, t_recover, "link down")
    assert tb.qdisc_rate_bps("robot") is not None      # the shaping survived down/up


def test_c_server_killed_mid_inference_and_restarted(rig):
    tb = rig.tb
    # 48 KB per frame at 1 Mbit/s: ~0.4 s on the wire per frame at 5 Hz, so the client is
    # nearly always inside a compute call when the server dies.
    tb.set_rate(1e6)
    t0 = time.monotonic()
    rig.stats.wait_for(lambda d: d["executed_mode"] == "full_offload", 30, after=t0)
    time.sleep(1.0)
    pids = _ns_pids(tb, "server", "__name:=offload_server")
    assert len(pids) == 1, pids
    t_fault = time.monotonic()
    os.kill(pids[0], signal.SIGKILL)
    rig.server.send_signal(signal.SIGKILL)         # its roslaunch too (a crash, nothing unregisters)
    rig.server.wait(10)
    first = rig.stats.wait_for(lambda d: d["executed_mode"] == "local", TIMEOUT_S + MARGIN_S + 30, after=t_fault)
    # the frame in flight (or the next one) failed in its call, not by skipping a down link
    assert not first["fallback_reason"].startswith("server unavailable"), first
    # within a deadline of the crash, less its own local inference
    assert first["t"] - t_fault - first["robot_compute_s"] < TIMEOUT_S + MARGIN_S + 0.5, first
    tb.set_rate(FAST_BPS)
    time.sleep(3.0)                                 # local frames while the server is gone
    rig.start_server(1)
    t_recover = rig.wait_server_ready()
    _check_fault_window(rig, t_fault, t_recover, "server restart")


def test_d_every_frame_accounted_for(rig):
    """Stop the camera: once the last frame is through, received == processed + dropped."""
    rows = rig.stats.since(0)
    _check_accounting(rows, "whole run")
    pids = _ns_pids(rig.tb, "robot", "__name:=camera")
    assert len(pids) == 1, pids
    os.kill(pids[0], signal.SIGINT)
    time.sleep(TIMEOUT_S + MARGIN_S + 1.0)
    last = rig.stats.since(0)[-1]
    assert last["frames_received"] == last["frames_processed"] + last["frames_dropped"], last
    assert last["frames_received"] >= 0.8 * RATE_HZ * (last["t"] - rig.t_start), last
    assert last["fallbacks"] > 0
