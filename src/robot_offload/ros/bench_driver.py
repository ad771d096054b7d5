"""The benchmark's frame driver: a rospy node that feeds offload_client identical frames
closed-loop (the next frame is published when the previous one's stats arrive, or after
its timeout) and records every frame's InferenceStats as JSON lines.

Run by :mod:`robot_offload.bench.runner` inside the robot's namespace:
``python -m robot_offload.ros.bench_driver --mode full_offload --frames 20 --out rows.jsonl``.
It sets the mode through the client's ~set_mode service, runs ``--warmup`` frames that
are not recorded, prints ``READY`` and waits for a line on stdin (the runner starts the
bandwidth trace then) before the measured frames, so that every mode sees the same trace
from its start and the same frames.

With several modes (``--mode local full_offload layer_partition``) every mode is warmed up
in turn, and then the modes take turns frame by frame: frame i in each mode, back to back,
then frame i + 1. On a shared machine whose speed drifts by tens of percent over minutes,
this puts every mode's frame i under about the same load, so the ratios between modes stay
meaningful where one mode after the other would compare different moments. With
``--paired-trace`` (the runner's default for interleaved modes) every mode's frame i also
starts at the same point of the bandwidth trace (:meth:`Driver.seek`); without it the trace
plays on in wall time and four 1 s frames of frame i meet four different seconds of it. The order changes from frame to frame so that every mode follows every
other equally often, from one frame to the next too
(:func:`robot_offload.bench.order.balanced_orders`), and
``--settle-s`` leaves the robot idle between frames (a camera's frames arrive with gaps
too): the next frame starts on a CPU quota no earlier frame has used up. Rows carry
``mode_asked``.
"""

import argparse
import json
import sys
import threading
import time

import numpy as np
import rospy
from sensor_msgs.msg import Image, PointCloud2
from std_msgs.msg import Header

from robot_offload.bench.order import balanced_orders
from robot_offload.camera import open_source
from robot_offload.msg import BandwidthEstimate, InferenceStats, Status
from robot_offload.ros.conversions import xyzi_to_pointcloud2
from robot_offload.srv import SetMode

STATS_FIELDS = ("mode", "executed_mode", "plan", "phase", "fallback_reason", "latency_s", "queue_s",
                "robot_compute_s", "transfer_s", "server_compute_s", "predicted_latency_s",
                "bytes_up", "bytes_down", "round_trips", "energy_j", "energy_modelled",
                "predicted_bandwidth_bps", "detail_json")


class Driver:
    def __init__(self, args):
        self.args = args
        self._cond = threading.Condition()
        self._stats = {}
        self.bandwidth = []
        ns = args.client.rstrip("/")
        topic_type = PointCloud2 if args.input_kind == "pointcloud" else Image
        self.pub = rospy.Publisher(args.input_topic, topic_type, queue_size=1)
        rospy.Subscriber(ns + "/stats", InferenceStats, self._on_stats, queue_size=50)
        rospy.Subscriber(args.bandwidth_topic, BandwidthEstimate, self._on_bandwidth, queue_size=50)
        self.set_mode = rospy.ServiceProxy(ns + "/set_mode", SetMode)
        self.camera = open_source(args.source, args.width, args.height, loop=True, seed=args.seed)
        self._frames = []

    def _on_stats(self, msg):
        with self._cond:
            self._stats[msg.header.stamp.to_nsec()] = (time.monotonic(), msg)
            self._cond.notify_all()

    def _on_bandwidth(self, msg):
        self.bandwidth.append((time.monotonic(), msg.measured_bps, msg.predicted_bps))

    def frame(self, i):
        """Frame i of the run, identical for every mode (``--source``, seeded)."""
        while len(self._frames) <= i:
            if self.args.input_kind == "pointcloud":
                from robot_offload.models.agrnav import synthetic_scene
                self._frames.append(synthetic_scene(self.args.seed + len(self._frames)))
            else:
                self._frames.append(self.camera.read())
        return self._frames[i]

    def publish(self, i):
        """Publish frame i, stamped as it leaves (a camera stamps at capture): the time to
        make or convert the frame is not the frame's latency. Making a natural frame takes
        ~90 ms under the robot's 0.5-CPU quota; stamped before, it went into the latency of
        whichever mode published frame i first."""
        header = Header(frame_id="bench")
        data = self.frame(i)
        if self.args.input_kind == "pointcloud":
            msg = xyzi_to_pointcloud2(data, header)
        else:
            msg = Image(header=header, height=data.shape[0], width=data.shape[1], encoding="rgb8",
                        is_bigendian=0, step=data.shape[1] * 3, data=np.ascontiguousarray(data).tobytes())
        msg.header.stamp = rospy.Time.now()
        self.pub.publish(msg)
        return msg.header.stamp.to_nsec(), time.monotonic()

    def make_frames(self, n):
        """Make frames 0..n-1 now (before the warm-up), so that no measured frame shares the
        robot's CPU quota with making the next one."""
        self.frame(n - 1)

    def wait_stats(self, key, timeout_s):
        end = time.monotonic() + timeout_s
        with self._cond:
            while key not in self._stats:
                left = end - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return self._stats.pop(key)

    def switch(self, mode):
        """Set the client's mode (a service call: it applies from the next frame on)."""
        r = self.set_mode(mode)
        if r.status.code != Status.OK:
            raise ValueError(f"set_mode {mode}: {r.status.text}")

    def run_frames(self, n, record, t_origin, timeout_s=None, modes=None, min_span_s=0.0,
                   max_frames=0):
        """Frames 0..n-1; with ``modes``, each frame once per mode, in the orders of
        :func:`~robot_offload.bench.order.balanced_orders` (the mode is switched before
        every frame when there is more than one). With ``min_span_s``, further frames (all
        modes again) until they span that many seconds, up to ``max_frames``: a cell of a
        30 ms model then holds enough frames for its median to mean something, and a 1 s
        model's cell is not lengthened. The span is of the bandwidth trace where it is
        paired (the position the next frame would start at: a cell of five interleaved
        modes spans a fifth of its wall time or less, and MobileNetV2's 30 frames had seen
        4 s of the rate-step trace, none of its 5 Mbit/s steps), else of the wall time since
        ``t_origin``. ``--settle-s`` of idle precedes every frame."""
        rows = []
        modes = list(modes or [None])
        orders = balanced_orders(len(modes))
        paired = record and self.args.paired_trace
        position_s = 0.0
        i = 0

        def spanned_s():
            return position_s if paired else time.monotonic() - t_origin

        while i < n or (spanned_s() < min_span_s and i < max(n, max_frames)):
            round_s = 0.0
            for k in orders[i % len(orders)]:
                mode = modes[k]
                if mode is not None and len(modes) > 1:
                    self.switch(mode)
                if paired:
                    self.seek(position_s)
                if self.args.settle_s > 0:
                    time.sleep(self.args.settle_s)
                row = self.one_frame(i, t_origin, timeout_s, mode)
                if paired:
                    row["trace_s"] = position_s
                    round_s = max(round_s, row.get("roundtrip_wall_s",
                                                   timeout_s or self.args.frame_timeout_s))
                rows.append(row)
            position_s += self.args.settle_s + round_s
            i += 1
        return rows if record else []

    def seek(self, position_s):
        """Have the runner play the bandwidth trace from ``position_s`` (its seconds) on, and
        wait until it has. With ``--paired-trace`` every mode's frame i starts at the same
        point of the trace, and frame i + 1 where the slowest mode's frame i ended: the
        modes meet the same bandwidth, fades included, frame for frame."""
        print(f"SEEK {position_s:.4f}", flush=True)
        line = sys.stdin.readline().strip()
        if line != "OK":
            raise RuntimeError(f"the runner did not seek the trace to {position_s:.4f} s: {line[:200]!r}")

    def one_frame(self, i, t_origin, timeout_s, mode):
        key, t_pub = self.publish(i)
        got = self.wait_stats(key, timeout_s or self.args.frame_timeout_s)
        row = {"frame": i, "t_s": t_pub - t_origin, "lost": got is None}
        if mode is not None:
            row["mode_asked"] = mode
        if got is not None:
            t_recv, msg = got
            row["roundtrip_wall_s"] = t_recv - t_pub
            row.update({f: getattr(msg, f) for f in STATS_FIELDS})
        return row


def request_rtt_ms(server_ns: str, n: int = 20) -> float:
    """Median time of an empty Ping over the same persistent ROS service connection the
    client uses: the per-request cost a transparent mode pays per operator (ms)."""
    import statistics
    from robot_offload.auth import load_secret
    from robot_offload.errors import OffloadError
    from robot_offload.protocol import PingRequest, raise_for_status
    from robot_offload.ros.transport import RosServiceTransport
    transport = RosServiceTransport(server_ns)
    transport.set_auth_secret(load_secret(""))
    times = []
    try:
        for _ in range(n + 2):
            t0 = time.perf_counter()
            r = transport.call("ping", PingRequest(client_id="bench-rtt"), 2.0)
            raise_for_status(r.status, r.status_text)
            times.append(time.perf_counter() - t0)
    except OffloadError:
        return float("nan")
    finally:
        transport.close()
    return 1e3 * statistics.median(times[2:]) if len(times) > 2 else float("nan")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mode", required=True, nargs="+",
                    help="one mode, or several to run frame by frame in turn")
    ap.add_argument("--frames", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--warmup-for", action="append", default=[], metavar="MODE=N",
                    help="warm-up frames of one mode, instead of --warmup")
    ap.add_argument("--min-span-s", type=float, default=0.0,
                    help="after --frames, keep going (every mode again) until the measured "
                         "frames span this many seconds, up to --max-frames")
    ap.add_argument("--max-frames", type=int, default=0)
    ap.add_argument("--settle-s", type=float, default=0.0,
                    help="idle before every frame (s): at least one period of the robot's CPU "
                         "quota, so that no frame starts on quota the one before it used up")
    ap.add_argument("--out", required=True)
    ap.add_argument("--client", default="/offload_client")
    ap.add_argument("--input-topic", default="/bench/image")
    ap.add_argument("--input-kind", choices=("image", "pointcloud"), default="image")
    ap.add_argument("--bandwidth-topic", default="/bandwidth_monitor/estimate")
    ap.add_argument("--width", type=int, default=640)
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--source", default="natural",
                    help="image frames: natural (1/f statistics and sensor noise: compresses "
                         "like a photograph), synthetic (flat squares: compresses 100x or more), "
                         "a folder of images or a video file (see camera.open_source)")
    ap.add_argument("--frame-timeout-s", type=float, default=30.0)
    ap.add_argument("--warmup-timeout-s", type=float, default=0.0,
                    help="wait per warm-up frame (0: --frame-timeout-s); the first frame of "
                         "layer_partition and lop profiles the model on the robot, minutes at 0.5 CPU")
    ap.add_argument("--no-go", action="store_true", help="do not wait for a line on stdin")
    ap.add_argument("--paired-trace", action="store_true",
                    help="before every measured frame, print 'SEEK <s>' and wait for 'OK' on "
                         "stdin: the runner plays the trace from that point, the same for "
                         "every mode's frame i (see Driver.seek)")
    ap.add_argument("--server-ns", default="/offload_server")
    args = ap.parse_args(rospy.myargv(argv if argv is not None else sys.argv)[1:])

    rospy.init_node("bench_driver", anonymous=True, disable_signals=True)
    d = Driver(args)
    d.set_mode.wait_for_service(60)
    deadline = time.monotonic() + 30
    while d.pub.get_num_connections() == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    d.make_frames(max(args.frames, args.max_frames if args.min_span_s > 0 else 0, args.warmup, 1))
    warmup_for = {m: int(n) for m, _, n in (item.partition("=") for item in args.warmup_for)}
    try:   # switch() raises ValueError when the client refuses a mode
        for mode in args.mode:
            d.switch(mode)
            d.run_frames(warmup_for.get(mode, args.warmup), record=False, t_origin=time.monotonic(),
                         timeout_s=args.warmup_timeout_s or None)
        print("READY", flush=True)
        if not args.no_go:
            sys.stdin.readline()
        t_origin = time.monotonic()
        rows = d.run_frames(args.frames, record=True, t_origin=t_origin, modes=args.mode,
                            min_span_s=args.min_span_s, max_frames=args.max_frames)
    except ValueError as e:
        print(f"ERROR {e}", flush=True)
        return 2
    rtt_ms = request_rtt_ms(args.server_ns)
    for row in rows:
        row["request_rtt_ms"] = rtt_ms
    with open(args.out, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
        for t, measured, predicted in d.bandwidth:
            if t >= t_origin:
                f.write(json.dumps({"bandwidth": True, "t_s": t - t_origin, "measured_bps": measured,
                                    "predicted_bps": predicted}) + "\n")
    print(f"DONE {len(rows)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
