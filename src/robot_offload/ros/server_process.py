"""A roscore on a free port and a real offload_server node in processes of their own,
for tools that exercise the server from outside (the soak run, the ops fuzzer): the node
can be killed and restarted, and its process watched."""

import os
import signal
import subprocess
import time

import rospy

from robot_offload import auth
from robot_offload.health import process_figures
from robot_offload.testbed._common import start_on_free_port


def wait_master(core, timeout_s=60.0):
    """Return once the master at ``ROS_MASTER_URI`` answers; RuntimeError once ``core``
    (its roscore) has exited or after ``timeout_s``. Asks afresh each time: rospy's own
    master proxy keeps the first URI it saw."""
    import rosgraph
    end = time.monotonic() + timeout_s
    while not rosgraph.is_master_online():
        if time.monotonic() > end or core.poll() is not None:
            raise RuntimeError("roscore did not start; see roscore.log")
        time.sleep(0.2)


class RosServer:
    """roscore on a free port and an offload_server node; restart = SIGKILL + a new node."""

    def __init__(self, secret_file, workdir, threads=0, params=None):
        self.workdir = workdir
        self.threads = threads
        #: extra ~parameters of the node (ServerConfig fields), e.g. smaller limits
        self.params = dict(params or {})
        self.secret_file = secret_file
        os.environ.setdefault("ROS_HOME", os.path.join(workdir, "ros_home"))
        os.environ.setdefault("ROS_LOG_DIR", os.path.join(os.environ["ROS_HOME"], "log"))
        def start(port):
            os.environ["ROS_MASTER_URI"] = f"http://127.0.0.1:{port}"
            return subprocess.Popen(["roscore", "-p", str(port)], stdout=self._log("roscore"),
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.core, _ = start_on_free_port(start, wait_master)
        rospy.init_node("soak_client", anonymous=True, disable_signals=True)
        from robot_offload.ros import logbridge
        logbridge.cache_rosout_flag()
        self.node = None
        self.instances = []          # per server node: figures at first answer and at its end
        self._start()
        try:
            rospy.wait_for_service("/offload_server/load_model", timeout=120)
        except rospy.ROSException as e:
            raise RuntimeError(f"offload_server did not come up: {e}; see server.log") from None
        from robot_offload.ros.transport import RosServiceTransport
        self.transport = RosServiceTransport("/offload_server",
                                             auth_secret=auth.load_secret(secret_file or ""))

    def _log(self, name):
        return open(os.path.join(self.workdir, f"{name}.log"), "a")

    def _start(self):
        params = dict({"device": "cpu", "preload": "[]"}, **self.params)
        argv = ["rosrun", "robot_offload", "offload_server"] + [f"_{k}:={v}" for k, v in params.items()]
        if self.secret_file:
            argv.append(f"_auth_secret_file:={self.secret_file}")
        env = dict(os.environ)
        if self.threads:
            env.update(OMP_NUM_THREADS=str(self.threads), MKL_NUM_THREADS=str(self.threads))
        self.node = subprocess.Popen(argv, stdout=self._log("server"), stderr=subprocess.STDOUT,
                                     start_new_session=True, env=env)
        self.instances.append({"pid": self.node.pid, "baseline": None, "end": None})

    def note_server(self, baseline=False):
        """Record the current server node's figures as its latest (``baseline``: as the
        point its growth is measured from: after it has served every mode once)."""
        inst = self.instances[-1]
        try:
            fig = process_figures(self._node_pid())
        except (OSError, KeyError):
            return
        if baseline:
            inst["baseline"] = fig
        inst["end"] = fig

    def _node_pid(self):
        # rosrun execs the node script, so the Popen's pid is the node's.
        return self.node.pid

    def restart(self):
        self.note_server()
        os.kill(self.node.pid, signal.SIGKILL)
        self.node.wait(10)
        self._start()

    def figures(self):
        return self.instances

    def close(self):
        self.transport.close()
        for proc in (self.node, self.core):
            if proc is not None and proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGINT)
                    proc.wait(15)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
