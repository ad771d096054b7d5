"""The README's two-machine guide, run as written: the robot and the GPU PC are two network
namespaces joined by a veth pair (the testbed's), each with its own address.

The commands come from the guide's code blocks, not from this file: step 1's exports
(tagged ``# both``, ``# robot``, ``# GPU PC``) set up each side's shells, step 3's lines
start the master and the launch files on the side their tag names, in the guide's order,
and step 4's lines check the link across the namespaces. Only the values in SUBSTITUTE
change (the guide's example addresses become the namespaces' addresses, the GPU and camera
become a CPU and the synthetic camera, and each `rostopic echo` stops after 5 messages),
each of which must occur in the guide; ROBOT_EXTRA makes the robot's frames small, and the
set_mode call switches back to full_offload. A guide that forgets ``ROS_IP`` on a side,
gives a side the other's address, starts the sides in an order that does not work, or
names a wrong launch file or argument fails here.
"""

import os
import re
import subprocess
import time

import pytest
import yaml

from robot_offload.testbed import Testbed

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces")

README = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                      "README.md")
SECTION = "## Deploying on two machines"
#: the guide's example addresses
ROBOT_IP, GPU_IP = "192.168.1.20", "192.168.1.10"
#: the guide's side tags -> testbed sides
SIDES = {"robot": "robot", "GPU PC": "server"}
#: (in the guide, here): values the guide uses that this machine cannot
SUBSTITUTE = [("device:=cuda", "device:=cpu"), ("resnet101", "resnet18"),
              ("source:=/dev/video0", "source:=synthetic"), ("rostopic echo ", "rostopic echo -n 5 ")]
ROBOT_EXTRA = " input_size:=[64,64] rate_hz:=5 timeout_s:=5"
STATS = "rostopic echo /offload_client/stats"
PING = "rosservice call /offload_server/ping"
SET_MODE = "rosservice call /offload_client/set_mode"
SET_PARAM = "rosparam set /offload_client/mode"


def guide():
    """The section's code lines as (command, tag): tag is the trailing comment, if any."""
    text = open(README).read()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    out = []
    for line in text[start:end].splitlines():
        if line.startswith("    ") and line.strip():
            m = re.match(r"^(.*?)\s{2,}#\s*(.*)$", line.strip())
            out.append((m.group(1), m.group(2)) if m else (line.strip(), ""))
    return out


def one(lines, prefix):
    found = [c for c, _ in lines if c.startswith(prefix)]
    assert len(found) == 1, f"the guide should have one `{prefix} ...` line, has {found}"
    return found[0]


class Guide:
    def __init__(self, tb, tmp_path):
        self.tb, self.tmp = tb, tmp_path
        self.lines = guide()
        text = "\n".join(c for c, _ in self.lines)
        for old, _ in SUBSTITUTE + [(ROBOT_IP, ""), (GPU_IP, "")]:
            assert old in text, f"the guide no longer says {old!r}: update SUBSTITUTE"
        exports = [(c, t) for c, t in self.lines if c.startswith("export ")]
        self.exports = {side: [self.sub(c) for c, t in exports if t in ("both", tag)]
                        for tag, side in SIDES.items()}
        assert all(self.exports.values()), f"step 1 should tag its exports by side: {exports}"
        self.procs = []   # step 3's processes, whose logs a failure shows

    def sub(self, cmd):
        for old, new in SUBSTITUTE:
            cmd = cmd.replace(old, new)
        return cmd.replace(ROBOT_IP, self.tb.robot_ip).replace(GPU_IP, self.tb.server_ip)

    def script(self, side, cmd):
        # a fresh shell set up as in step 1: nothing of this process's ROS network settings
        return "\n".join(["unset ROS_MASTER_URI ROS_IP ROS_HOSTNAME", *self.exports[side],
                          "exec " + cmd])

    def start(self, side, cmd):
        """A long-running command of step 3, its output to a log file."""
        log = open(self.tmp / f"{len(self.procs)}-{side}-{cmd.split()[0]}.log", "w")
        proc = self.tb.run(side, ["bash", "-c", self.script(side, cmd)], env=self.env(),
                           stdout=log, stderr=subprocess.STDOUT)
        log.close()   # the child has its own descriptor
        proc.log_path = log.name
        self.procs.append(proc)
        return proc

    def run(self, side, cmd, timeout_s=60):
        proc = self.tb.run(side, ["bash", "-c", self.script(side, cmd)], env=self.env(),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        return proc.returncode, out

    def env(self):
        return {"ROS_HOME": self.tmp / "ros_home", "ROS_LOG_DIR": self.tmp / "ros_home" / "log"}

    def until(self, side, cmd, accept, timeout_s, what):
        deadline = time.monotonic() + timeout_s
        while True:
            rc, out = self.run(side, cmd, timeout_s=max(5.0, min(60.0, deadline - time.monotonic())))
            if rc == 0 and accept(out):
                return out
            if time.monotonic() > deadline:
                pytest.fail(f"{what}: `{cmd}` on the {side} side gave (exit {rc}):\n{out[-2000:]}"
                            + "".join(f"\n--- {p.log_path}:\n" + open(p.log_path).read()[-2000:]
                                      for p in self.procs))
            time.sleep(1.0)


def stats_of(out):
    return [d for d in yaml.safe_load_all(out) if isinstance(d, dict)]


def test_the_guide_runs_robot_and_gpu_pc_in_two_namespaces(tmp_path):
    with Testbed(fallback=False) as tb:
        g = Guide(tb, tmp_path)
        # step 3, in the guide's order; the next side starts once the master answers
        starts = [(c, t) for c, t in g.lines if c.startswith(("roscore", "roslaunch"))]
        assert [c.split()[0] for c, _ in starts][0] == "roscore", starts
        for cmd, tag in starts:
            assert tag in SIDES, f"step 3's `{cmd}` names no side: {tag!r}"
            cmd = g.sub(cmd).rstrip(" &")
            if "robot.launch" in cmd:
                cmd += ROBOT_EXTRA
            g.start(SIDES[tag], cmd)
            if cmd.startswith("roscore"):
                for side in SIDES.values():   # the master is reachable from both sides
                    g.until(side, "rostopic list", lambda out: "/rosout" in out, 60,
                            "master not reachable")

        # step 4: the server answers the robot, the robot's frames reach the GPU PC
        ping = g.sub(one(g.lines, PING))
        reply = yaml.safe_load(g.until("robot", ping, lambda out: "code: 0" in out, 180,
                                       "the server never answered"))
        assert reply["status"]["code"] == 0 and reply["server_id"] and reply["device"] == "cpu"
        assert "resnet18" in reply["loaded_models"]

        def offloaded(out):
            return sum(1 for m in stats_of(out) if m["executed_mode"] == "full_offload") >= 3

        out = g.until("server", g.sub(one(g.lines, STATS)), offloaded, 180,
                      "no full_offload frames seen from the GPU PC")
        frames = [m for m in stats_of(out) if m["executed_mode"] == "full_offload"]
        for m in frames:
            assert m["mode"] == "full_offload" and m["model"] == "resnet18" and m["round_trips"] == 1
            assert m["server_compute_s"] > 0 and m["bytes_up"] == 3 * 64 * 64 * 4
        rc, out = g.run("server", g.sub(one(g.lines, "rostopic echo /bandwidth_monitor/estimate")))
        assert rc == 0 and len(stats_of(out)) == 5, out[-2000:]

        # the mode, switched from the GPU PC: the parameter, then the service
        rc, out = g.run("server", g.sub(one(g.lines, SET_PARAM)))
        assert rc == 0, out
        g.until("server", g.sub(one(g.lines, STATS)),
                lambda out: any(m["executed_mode"] == "local" for m in stats_of(out)), 60,
                "rosparam set did not switch the robot to local")
        mode = one(g.lines, SET_MODE).split()[-1]
        rc, out = g.run("server", g.sub(one(g.lines, SET_MODE)).replace(mode, "full_offload"))
        assert rc == 0 and yaml.safe_load(out)["mode"] == "full_offload", out
        g.until("server", g.sub(one(g.lines, STATS)), offloaded, 60,
                "set_mode did not switch the robot back to full_offload")
        for p in g.procs:
            assert p.poll() is None, f"{p.log_path} exited: " + open(p.log_path).read()[-2000:]
