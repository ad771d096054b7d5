"""The star testbed for real: one namespace per robot, each with its own shaped veth link to
the host namespace, ROS across it, and nothing left behind (after close and after a
SIGKILL).

Needs root (network namespaces, tc); skipped otherwise. Traffic stays on this host: the
star's subnet (10.232.0.0/16 or the next free one) lives only on its veth pairs and lo.
"""

import concurrent.futures
import os
import subprocess
import sys
import time

import pytest

import robot_offload
from robot_offload.testbed import StarTestbed, bulk, cleanup, netns, star

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root: network namespaces and tc qdiscs")

SRC = os.path.dirname(os.path.dirname(os.path.abspath(robot_offload.__file__)))
ENV = {"PYTHONPATH": SRC}
OWNERS = {os.getpid()}


def leftovers(host_ifs=()):
    """Namespaces, host addresses and host veth ends of this process or its helpers."""
    names = [n for n in netns.list_namespaces() if netns.owner_pid(n) in OWNERS]
    addrs = [a for a, pid in star.list_host_addresses() if pid in OWNERS]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return names + addrs + [i for i in host_ifs if f" {i}@" in links or f" {i}:" in links]


@pytest.fixture(scope="module", autouse=True)
def nothing_left_behind():
    yield
    assert leftovers() == []


def test_each_robot_gets_its_own_rate_and_close_removes_everything():
    with StarTestbed(2, fallback=False) as st:
        host_ifs = list(st.host_ifs)
        assert len(set(st.namespaces) & set(netns.list_namespaces())) == 2
        st.set_rate(0, 5e6)
        st.set_rate(1, 40e6, down_bps=20e6)
        for j, up, down in ((0, 5e6, 5e6), (1, 40e6, 20e6)):
            assert st.qdisc_rate_bps(j, "robot") == pytest.approx(st.wire_rate_bps(up), rel=2e-3)
            assert st.qdisc_rate_bps(j, "host") == pytest.approx(st.wire_rate_bps(down), rel=2e-3)
        # both robots upload to the one server address at once: each gets its own rate
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            ups = list(pool.map(lambda j: bulk.measure(st.link(j), "up", duration_s=4.0,
                                                       env=ENV)["bps"], (0, 1)))
        down = bulk.measure(st.link(1), "down", duration_s=3.0, env=ENV)["bps"]
        print(f"robot0 up {ups[0] / 1e6:.2f}, robot1 up {ups[1] / 1e6:.2f}, "
              f"robot1 down {down / 1e6:.2f} Mbit/s")
        assert ups[0] == pytest.approx(5e6, rel=0.15)
        assert ups[1] == pytest.approx(40e6, rel=0.15)
        assert down == pytest.approx(20e6, rel=0.15)
        # a rate change in place (as a trace replay makes) takes effect
        st.set_rate(0, 20e6)
        assert bulk.measure(st.link(0), "up", duration_s=3.0, env=ENV)["bps"] == \
            pytest.approx(20e6, rel=0.15)
        assert leftovers(host_ifs) != []
    assert leftovers(host_ifs) == []


def test_robots_reach_the_server_address_but_not_each_other():
    probe = ("import socket, sys\n"
             "try:\n    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2)\n"
             "except OSError as e:\n    sys.exit(f'no: {e}')\n")
    import socket
    with StarTestbed(2, fallback=False) as st, socket.socket() as lsock:
        lsock.bind((st.server_ip, 0))
        lsock.listen(4)
        port = str(lsock.getsockname()[1])
        for j in range(2):
            assert st.run(j, [sys.executable, "-c", probe, st.server_ip, port]).wait(10) == 0
        other = st.run(0, [sys.executable, "-c", probe, st.robot_ip(1), port],
                       stderr=subprocess.DEVNULL)
        assert other.wait(10) != 0


ROS_SERVER = """
import rospy
from std_srvs.srv import Trigger, TriggerResponse
rospy.init_node("star_server")
rospy.Service("/star/who", Trigger, lambda req: TriggerResponse(True, "server"))
print("up", flush=True)
rospy.spin()
"""

ROS_ROBOT = """
import rospy, time
from std_srvs.srv import Trigger
rospy.init_node("star_robot")
rospy.wait_for_service("/star/who", 30)
print(rospy.ServiceProxy("/star/who", Trigger)().message, flush=True)
time.sleep(60)
"""


def _line(proc, want):
    """Read ``proc``'s lines until one is ``want`` (True) or it closes (False)."""
    for line in proc.stdout:
        if line.strip() == want:
            return True
    return False


@pytest.mark.timeout(180)
def test_ros_master_and_services_work_across_the_star(tmp_path):
    from robot_offload.testbed._common import free_port

    with StarTestbed(1, fallback=False) as st:
        st.set_rate(0, 20e6)
        env = {**ENV, "ROS_IP": st.server_ip, "ROS_HOME": str(tmp_path),
               "ROS_MASTER_URI": f"http://{st.server_ip}:{free_port()}"}
        port = env["ROS_MASTER_URI"].rsplit(":", 1)[1]
        st.run_host(["roscore", "-p", port], env=env, stdout=subprocess.DEVNULL,
                    stderr=subprocess.STDOUT)
        srv = st.run_host([sys.executable, "-c", ROS_SERVER], env=env, stdout=subprocess.PIPE,
                          text=True)
        assert _line(srv, "up")                         # rospy says it waits for the master
        # the robot registers with the master and calls the server, both through its link
        robot = st.run(0, [sys.executable, "-c", ROS_ROBOT], env={**env, "ROS_IP": st.robot_ip(0)},
                       stdout=subprocess.PIPE, text=True)
        assert _line(robot, "server")
        # the other way: the master knows the robot at its own address and reaches its node API
        info = subprocess.run(["rosnode", "info", "/star_robot"], env={**os.environ, **env},
                              capture_output=True, text=True, timeout=30).stdout
        assert f"contacting node http://{st.robot_ip(0)}:" in info and "Pid:" in info, info
        ping = subprocess.run(["rosnode", "ping", "-c", "1", "/star_robot"],
                              env={**os.environ, **env}, capture_output=True, text=True, timeout=30)
        assert ping.returncode == 0 and "reply from" in ping.stdout, ping.stdout + ping.stderr


def _child_with_star():
    """A python that opens a 2-robot star, starts a process in robot 1's namespace, prints
    the names (namespaces, host veth ends, server address) and sleeps."""
    code = ("import sys, time\nfrom robot_offload.testbed import StarTestbed\n"
            "st = StarTestbed(2, fallback=False).open()\n"
            "st.run(1, [sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "print(' '.join(st.namespaces + st.host_ifs + [st.server_ip]), flush=True)\n"
            "time.sleep(60)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, **ENV})
    OWNERS.add(child.pid)
    *names, server_ip = child.stdout.readline().split()
    return child, names, server_ip


def test_sigterm_tears_the_star_down():
    child, names, _ = _child_with_star()
    assert set(names[:2]) <= set(netns.list_namespaces())
    child.terminate()
    assert child.wait(20) == 128 + 15                   # SIGTERM -> SystemExit(143)
    assert leftovers(names[2:]) == []


def test_cleanup_removes_what_a_killed_process_left():
    child, names, server_ip = _child_with_star()
    child.kill()
    child.wait(10)
    assert leftovers(names[2:]) != []                   # SIGKILL: nothing could run
    removed = cleanup()
    assert set(names[:2]) <= set(removed["namespaces"])
    assert f"{server_ip}/32" in removed["host_addrs"]
    deadline = time.monotonic() + 5
    while leftovers(names[2:]) and time.monotonic() < deadline:
        time.sleep(0.1)                                 # veth ends go with their namespace
    assert leftovers(names[2:]) == []
