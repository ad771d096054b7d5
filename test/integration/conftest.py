"""Fixtures for tests with a real ROS master and the package's real launch files.

A session-wide ``roscore`` on a free port (its own process group, killed at the end),
this pytest process as a rospy node (``disable_signals`` so pytest keeps Ctrl-C), and a
``launch`` factory that runs ``roslaunch robot_offload <file> args...`` (or one node with
``rosrun``) and stops it (SIGINT, then SIGKILL) at the end of the test that started it.
"""

import os
import signal
import subprocess

import pytest


def _stop(proc, sig=signal.SIGINT, wait_s=15):
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
        proc.wait(timeout=wait_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=5)


@pytest.fixture(scope="session")
def ros_master(tmp_path_factory):
    os.environ.setdefault("ROS_HOME", str(tmp_path_factory.mktemp("ros_home")))
    import rospy
    from robot_offload.ros.server_process import wait_master
    from robot_offload.testbed._common import start_on_free_port

    started = []

    def start(port):
        os.environ["ROS_MASTER_URI"] = f"http://127.0.0.1:{port}"
        started.append(subprocess.Popen(["roscore", "-p", str(port)], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.STDOUT, start_new_session=True))
        return started[-1]
    # a free port can be taken before roscore binds it: then another is tried
    try:
        core, _ = start_on_free_port(start, lambda core: wait_master(core, timeout_s=30))
    except RuntimeError as e:
        _stop(started[-1])
        pytest.fail(f"roscore did not start: {e}")
    uri = os.environ["ROS_MASTER_URI"]
    rospy.init_node("pytest_integration", anonymous=True, disable_signals=True)
    yield uri
    _stop(core)


class Launches:
    def __init__(self, log_dir):
        self.procs = []
        self.log_dir = log_dir

    def start(self, launch_file, *args):
        """``roslaunch robot_offload <launch_file>``, or of a path when it is one."""
        where = [launch_file] if os.path.isabs(launch_file) else ["robot_offload", launch_file]
        log = open(os.path.join(self.log_dir, f"{os.path.basename(launch_file)}-{len(self.procs)}.log"), "w")
        proc = subprocess.Popen(["roslaunch", "--screen", *where, *args],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        proc.log_path = log.name
        self.procs.append(proc)
        return proc

    def rosrun(self, package, node_type, *args):
        """One node, ``rosrun package node_type args...`` (remaps, ``_param:=value``,
        ``__name:=...``), stopped like a launch."""
        log = open(os.path.join(self.log_dir, f"{node_type}-{len(self.procs)}.log"), "w")
        proc = subprocess.Popen(["rosrun", package, node_type, *args], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        proc.log_path = log.name
        self.procs.append(proc)
        return proc

    def kill_node(self, proc, node_name):
        """A crash of one node: SIGKILL to its process (asked from the node itself over
        XML-RPC), so nothing unregisters from the master; then its roslaunch goes too.
        roslaunch starts every node in a session of its own, so killing the roslaunch
        process group would leave the node running."""
        import rosnode
        import xmlrpc.client
        import rosgraph
        uri = rosnode.get_api_uri(rosgraph.Master("/pytest"), node_name, skip_cache=True)
        _, _, pid = xmlrpc.client.ServerProxy(uri).getPid("/pytest")
        os.kill(pid, signal.SIGKILL)
        _stop(proc, signal.SIGKILL, wait_s=5)
        return pid

    def stop_all(self):
        for p in reversed(self.procs):
            _stop(p)
        # Nodes of a roslaunch that was SIGKILLed have no parent left to stop them.
        subprocess.run(["rosnode", "cleanup"], input="y\n", text=True, capture_output=True, timeout=30)


@pytest.fixture
def launch(ros_master, tmp_path):
    launches = Launches(str(tmp_path))
    yield launches
    launches.stop_all()
