"""offload_client: frames in, results and InferenceStats out.

Subscribes to ``image`` (sensor_msgs/Image) or ``points`` (sensor_msgs/PointCloud2),
keeps only the newest frame (counting drops), runs it through
:class:`~robot_offload.client.OffloadClient` on a worker thread and publishes ``result``
(InferenceResult) and ``stats`` (InferenceStats). The mode follows the ``~mode`` parameter
(a cached, master-pushed parameter: ``rosparam set`` takes effect on the next frame at no
per-frame cost) and the ``~set_mode`` service, as ``~mode_control`` allows
(:mod:`robot_offload.mode_control`: ``open``, ``service`` or ``locked``).
"""

import threading
import time

import rospy
from sensor_msgs.msg import Image, PointCloud2

from robot_offload import codec, structure
from robot_offload.client import ClientConfig, OffloadClient
from robot_offload.errors import ConfigError
from robot_offload.frames import LatestFrame
from robot_offload.health import ClientHealth
from robot_offload.mode_control import ModeControl
from robot_offload.msg import (BandwidthEstimate, InferenceResult, InferenceStats, PowerSample,
                               RobotActivity, Status)
from robot_offload.ros import conversions as conv, logbridge
from robot_offload.ros.diagnostics import NodeDiagnostics
from robot_offload.ros.fleet import master_directory
from robot_offload.ros.params import load_auth_secret, load_params
from robot_offload.ros.transport import RosServiceTransport
from robot_offload.srv import SetMode, SetModeResponse


class OffloadClientNode:
    def __init__(self):
        logbridge.install()
        self.config = load_params(ClientConfig)
        self.server_ns = self.config.fleet_ns or self.config.server_ns
        self.publish_outputs = self.config.publish_outputs
        self.result_codec = self.config.result_codec
        transport = None
        if self.config.use_server and self.config.fleet_ns:
            transport = master_directory(self.config.fleet_ns, load_auth_secret())
        elif self.config.use_server:
            transport = RosServiceTransport(self.server_ns, auth_secret=load_auth_secret())
        self.client = OffloadClient(self.config, transport)
        self.mode_control = ModeControl(self.config.mode_control, self.client.mode)
        self._mode_param = rospy.resolve_name("~mode")
        rospy.set_param(self._mode_param, self.client.mode)
        self.slot = LatestFrame()
        self.processed = 0
        self.stats_pub = rospy.Publisher("~stats", InferenceStats, queue_size=50)
        self.result_pub = rospy.Publisher("~result", InferenceResult, queue_size=5)
        self.activity_pub = rospy.Publisher("~activity", RobotActivity, queue_size=50)
        self.bandwidth_sub = rospy.Subscriber("bandwidth", BandwidthEstimate, self._on_bandwidth, queue_size=1)
        self.power_sub = rospy.Subscriber("power", PowerSample, self._on_power, queue_size=100)
        self.mode_srv = rospy.Service("~set_mode", SetMode, self._on_set_mode)
        if self.client.spec.input_kind == "image":
            from cv_bridge import CvBridge
            self._bridge = CvBridge()
            self.sub = rospy.Subscriber("image", Image, self.slot.put, queue_size=2, buff_size=2 ** 24)
        else:
            self.sub = rospy.Subscriber("points", PointCloud2, self.slot.put, queue_size=2, buff_size=2 ** 25)
        self.health = ClientHealth()
        self.diagnostics = NodeDiagnostics("offload", self._health_report)
        if transport is not None:
            threading.Thread(target=self.client.connect, name="connect", daemon=True).start()
        self._worker = threading.Thread(target=self._run, name="inference", daemon=True)
        self._worker.start()
        rospy.on_shutdown(self.client.close)

    # -- mode ---------------------------------------------------------------------------
    def _on_set_mode(self, req):
        previous = self.client.mode
        refusal = self.mode_control.service_refusal(req.mode)
        if refusal is not None:
            rospy.logwarn_throttle(5.0, refusal)
            return SetModeResponse(status=Status(code=Status.UNAUTHORIZED, text=refusal),
                                   previous_mode=previous, mode=previous)
        try:
            self.client.set_mode(req.mode)
        except ConfigError as e:
            rospy.logerr(f"set_mode refused: {e}")
            return SetModeResponse(status=Status(code=Status.BAD_REQUEST, text=str(e)),
                                   previous_mode=previous, mode=previous)
        rospy.set_param(self._mode_param, req.mode)
        return SetModeResponse(status=Status(code=Status.OK, text=""), previous_mode=previous, mode=req.mode)

    def _follow_mode_param(self):
        wanted = self.mode_control.mode_from_param(
            rospy.get_param_cached(self._mode_param, self.client.mode), self.client.mode)
        if wanted is None:
            return
        try:
            self.client.set_mode(str(wanted))
        except ConfigError as e:
            rospy.logerr(f"~mode {wanted!r} refused, keeping {self.client.mode}: {e}")
            rospy.set_param(self._mode_param, self.client.mode)

    # -- link and power ------------------------------------------------------------------
    def _on_bandwidth(self, msg):
        self.client.predicted_bandwidth_bps = msg.predicted_bps

    def _on_power(self, msg):
        # Modelled samples come from this client's own activity: the client models its
        # energy itself. Only a sensor's samples replace the model.
        if not msg.modelled:
            try:
                self.client.measured_power.add(msg.header.stamp.to_sec(), msg.watts)
            except ValueError:
                pass  # out of order: keep the window monotonic

    def _health_report(self):
        link = self.client.link
        return self.health.report(
            mode=self.client.mode, needs_server=self.client.needs_server(),
            link_state=link.state if link is not None else "off",
            link_error=link.last_error if link is not None and link.state != "up" else "",
            server="" if link is None else " ".join(
                p for p in (self.server_ns, link.device and f"on {link.device}",
                            link.server_id and f"(id {link.server_id})") if p),
            received=self.slot.received, processed=self.processed, dropped=self.slot.dropped,
            fallbacks=self.client.fallbacks, input_topic=self.sub.resolved_name)

    # -- frames -------------------------------------------------------------------------
    def _to_frame(self, msg):
        if isinstance(msg, Image):
            return self._bridge.imgmsg_to_cv2(msg, desired_encoding="rgb8")
        return conv.pointcloud2_to_xyzi(msg)

    def _run(self):
        try:
            rospy.loginfo(f"local model warmed up in {self.client.warm_up():.2f} s")
        except Exception as e:  # noqa: BLE001 - only an optimisation
            rospy.logwarn(f"local warm-up failed: {type(e).__name__}: {e}")
        while not rospy.is_shutdown():
            item = self.slot.get(timeout_s=0.2)
            if item is None:
                continue
            msg, arrived = item
            try:
                self._process(msg, arrived)
            except Exception as e:  # noqa: BLE001 - one bad frame must not stop the worker
                rospy.logerr_throttle(2.0, f"frame dropped: {type(e).__name__}: {e}")
                self.slot.dropped += 1

    def _process(self, msg, arrived):
        self._follow_mode_param()
        start = time.monotonic()
        outputs, stats = self.client.process(self._to_frame(msg))
        stats.queue_s = start - arrived
        if stats.fallback_reason:
            rospy.logwarn_throttle(5.0, f"computed locally: {stats.fallback_reason}")
        if self.publish_outputs:
            leaves, spec = structure.flatten(outputs)
            self.result_pub.publish(InferenceResult(
                header=msg.header, model=stats.model, mode=stats.executed_mode, structure_json=spec,
                outputs=[conv.tensor_to_msg(codec.encode(t, f"out{i}", self.result_codec))
                         for i, t in enumerate(leaves)]))
        self.processed += 1
        offset = self.client.wall_offset_s
        self.activity_pub.publish(RobotActivity(
            header=msg.header, activity=[a for a, _, _ in stats.intervals],
            start_s=[t0 + offset for _, t0, _ in stats.intervals],
            end_s=[t1 + offset for _, _, t1 in stats.intervals]))
        latency_s = (rospy.Time.now() - msg.header.stamp).to_sec()
        self.health.frame(stats.executed_mode, stats.fallback_reason, latency_s,
                          self.slot.received, self.slot.dropped)
        self.stats_pub.publish(conv.stats_to_msg(
            stats, msg.header, latency_s,
            (self.slot.received, self.processed, self.slot.dropped, self.client.fallbacks)))
