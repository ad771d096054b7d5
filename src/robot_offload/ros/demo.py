"""The demo: run demo.launch for a fixed time, switch the mode through the parameter
server half way, and print median latency and frames per second per mode, read from the
InferenceStats topic.

    rosrun robot_offload demo --duration 40 --model resnet18 --modes local full_offload

It starts its own master on a free port (roslaunch starts it), so it never disturbs a
running ROS system, and stops everything it started on exit.
"""

import argparse
import os
import signal
import subprocess
import sys
import time

import rospy

from robot_offload.msg import InferenceStats
from robot_offload.report import markdown_table, summarise
from robot_offload.testbed._common import free_port


def collect(duration_s: float, modes, client="/offload_client", warmup_s=3.0, warmup_timeout_s=120.0):
    """Subscribe to the client's stats; spend ``duration_s`` split evenly over ``modes``,
    switching with rospy.set_param (what `rosparam set` does). Returns the stats rows."""
    rows = []
    current = {"mode": None}

    def on_stats(msg):
        # Frames computed before the switch took effect belong to the previous mode; keep
        # only frames of the mode the demo is measuring, labelled by what was asked.
        if msg.mode == current["mode"]:
            rows.append({"mode": msg.mode, "executed_mode": msg.executed_mode,
                         "latency_s": msg.latency_s, "t_s": time.monotonic(),
                         "robot_compute_s": msg.robot_compute_s, "transfer_s": msg.transfer_s,
                         "server_compute_s": msg.server_compute_s, "bytes_up": msg.bytes_up,
                         "bytes_down": msg.bytes_down, "round_trips": msg.round_trips,
                         "energy_j": msg.energy_j, "fallback_reason": msg.fallback_reason})

    sub = rospy.Subscriber(client + "/stats", InferenceStats, on_stats, queue_size=100)
    rospy.wait_for_message(client + "/stats", InferenceStats, timeout=warmup_timeout_s)
    time.sleep(warmup_s)  # the first frames pay for lazy initialisation; not measured
    for mode in modes:
        rospy.set_param(client + "/mode", mode)
        current["mode"] = mode
        if mode != "local":
            # Give the server time to build the model: the first frames of a new mode pay it.
            time.sleep(1.0)
        end = time.monotonic() + duration_s / len(modes)
        while time.monotonic() < end and not rospy.is_shutdown():
            time.sleep(0.1)
    sub.unregister()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=40.0, help="total measuring time (s)")
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--modes", nargs="+", default=["local", "full_offload"])
    ap.add_argument("--rate-hz", type=float, default=5.0)
    ap.add_argument("--input-size", default="[]", help="e.g. [224,224]; [] = model default")
    args = ap.parse_args(argv)

    env = dict(os.environ, ROS_MASTER_URI=f"http://127.0.0.1:{free_port()}")
    os.environ["ROS_MASTER_URI"] = env["ROS_MASTER_URI"]
    launch = subprocess.Popen(
        ["roslaunch", "--screen", "robot_offload", "demo.launch",
         f"model:={args.model}", f"mode:={args.modes[0]}", f"rate_hz:={args.rate_hz}",
         f"input_size:={args.input_size}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                rospy.get_master().getSystemState()
                break
            except OSError:
                if time.monotonic() > deadline or launch.poll() is not None:
                    raise SystemExit("demo: roslaunch did not start a master")
                time.sleep(0.3)
        rospy.init_node("demo", anonymous=True, disable_signals=True)
        print(f"demo: {args.model}, modes {' -> '.join(args.modes)}, {args.duration:.0f} s, "
              f"camera {args.rate_hz} Hz", flush=True)
        rows = collect(args.duration, args.modes)
    finally:
        os.killpg(launch.pid, signal.SIGINT)
        try:
            launch.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(launch.pid, signal.SIGKILL)
    summary = summarise(rows)
    print(markdown_table(summary))
    print("fps: frames published per second; below the camera's rate when a frame takes longer than "
          "the camera period (the client then takes the newest frame and drops the rest).\n"
          "fallbacks: frames of an offloading mode computed locally instead (deadline missed, "
          "server not reachable yet); InferenceStats.fallback_reason says why.")
    missing = [m for m in args.modes if m not in {s["mode"] for s in summary}]
    if missing:
        print(f"demo: no frames for {missing}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
