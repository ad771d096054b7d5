"""bandwidth_monitor: estimates and predicts the robot-server link's bandwidth.

Passive: every InferenceStats with server round trips is a real transfer (bytes up +
down over the time the radio was busy, less one RTT per round trip). Active (optional,
``~probe_period_s`` > 0): a Ping carrying ``~probe_bytes`` (echoed back) measures goodput,
and a small Ping measures RTT; a probe too short to show a rate (a shaper's burst, a
fast link) doubles, up to ``~probe_bytes_max``; the probes' own traffic is reported as
overhead. Transfers shorter than ``~min_sample_s`` on the link are ignored (see
``bandwidth.MIN_TRANSFER_S``); ``~learn_burst`` learns what a shaper lets through at
line rate after an idle moment and adds it back (``bandwidth.LinkBurst``). The prediction for the next inference comes from
``~predictor`` and is published as BandwidthEstimate at ``~rate_hz`` for the client to
plan with.
"""

import math
import threading
import time

import rospy

from robot_offload.bandwidth import (BandwidthMonitorConfig, PassiveEstimator, TransferSample, frame_transfer,
                                     make_predictor)
from robot_offload.errors import ConfigError, OffloadError
from robot_offload.health import bandwidth_report
from robot_offload.msg import BandwidthEstimate, InferenceStats
from robot_offload.protocol import PingRequest, raise_for_status
from robot_offload.ros import logbridge
from robot_offload.ros.diagnostics import NodeDiagnostics
from robot_offload.ros.params import load_auth_secret, load_params
from robot_offload.ros.transport import RosServiceTransport


def _nan(v):
    return math.nan if v is None else float(v)


class BandwidthMonitorNode:
    def __init__(self):
        logbridge.cache_rosout_flag()
        try:
            c = self.config = load_params(BandwidthMonitorConfig)
        except ConfigError as e:
            raise rospy.ROSInitException(f"bandwidth_monitor: {e}") from e
        self.rate_hz = c.rate_hz
        self.probe_period_s = c.probe_period_s
        self.probe_bytes = c.probe_bytes
        self.probe_bytes_max = c.probe_bytes_max
        self.probe_timeout_s = c.probe_timeout_s
        predictor = make_predictor(c.predictor)
        self.estimator = PassiveEstimator(predictor, min_duration_s=c.min_sample_s,
                                          burst="learn" if c.learn_burst else None)
        self._lock = threading.Lock()
        self.source = BandwidthEstimate.SOURCE_NONE
        self.probe_bytes_total = 0
        self.started = time.monotonic()
        self.last_sample = None          # monotonic time of the last measurement used
        self.probe_error = ""            # the last probe's failure ("" after a success)
        self.pub = rospy.Publisher("~estimate", BandwidthEstimate, queue_size=10)
        self.sub = rospy.Subscriber("stats", InferenceStats, self._on_stats, queue_size=100)
        self.transport = None
        if self.probe_period_s > 0:
            self.transport = RosServiceTransport(c.server_ns,
                                                 auth_secret=load_auth_secret())
            threading.Thread(target=self._probe_loop, name="probe", daemon=True).start()
        # A measurement older than this is stale: several probe periods, at least 10 s.
        self.stale_after_s = max(10.0, 3 * self.probe_period_s)
        self.diagnostics = NodeDiagnostics("bandwidth", self._health_report)
        rospy.loginfo(f"bandwidth_monitor: predictor {predictor.name}, probes "
                      + (f"every {self.probe_period_s} s of {self.probe_bytes} B" if self.transport else "off"))

    def _on_stats(self, msg):
        sample = frame_transfer(msg, msg.header.stamp.to_sec() + msg.latency_s)
        if sample is None:
            return
        base_rtt = self.estimator.min_rtt_s
        with self._lock:
            if self.estimator.add(sample, None if base_rtt is None else base_rtt * msg.round_trips) is not None:
                self.source = BandwidthEstimate.SOURCE_PASSIVE
                self.last_sample = time.monotonic()

    def _ping(self, payload: bytes) -> float:
        t0 = time.perf_counter()
        reply = self.transport.call("ping", PingRequest(client_id=rospy.get_name(), payload=payload),
                                    self.probe_timeout_s)
        raise_for_status(reply.status, reply.status_text)
        self.probe_bytes_total += 2 * len(payload)
        return time.perf_counter() - t0

    def _probe_loop(self):
        while not rospy.is_shutdown():
            try:
                rtt = self._ping(b"")
                with self._lock:
                    self.estimator.observe_rtt(rtt)
                payload = bytes(self.probe_bytes)
                duration = self._ping(payload)
                sample = TransferSample(t_s=time.time(), bytes=2 * len(payload), duration_s=duration)
                with self._lock:
                    self.probe_error = ""
                    if self.estimator.add(sample) is not None:
                        self.source = BandwidthEstimate.SOURCE_PROBE
                        self.last_sample = time.monotonic()
                    elif self.probe_bytes < self.probe_bytes_max:
                        self.probe_bytes = min(2 * self.probe_bytes, self.probe_bytes_max)
                        rospy.loginfo(f"bandwidth_monitor: probe too short to show a rate; "
                                      f"now {self.probe_bytes} B")
            except OffloadError as e:
                self.probe_error = str(e)[:200]
                rospy.logwarn_throttle(10.0, f"bandwidth_monitor: probe failed: {e}")
            time.sleep(self.probe_period_s)

    def _health_report(self):
        now = time.monotonic()
        with self._lock:
            e = self.estimator
            return bandwidth_report(
                predicted_bps=e.predict_bps() if e.used else None, measured_bps=e.last_measured_bps,
                rtt_s=e.srtt_s, sample_age_s=None if self.last_sample is None else now - self.last_sample,
                uptime_s=now - self.started, stale_after_s=self.stale_after_s,
                probing=self.transport is not None, predictor=e.predictor.name,
                samples_used=e.used, samples_ignored=e.ignored, probe_error=self.probe_error,
                burst_s=e.burst_s if e.burst is not None else None)

    def spin(self):
        rate = rospy.Rate(self.rate_hz)
        while not rospy.is_shutdown():
            with self._lock:
                e = self.estimator
                elapsed = max(time.monotonic() - self.started, 1e-9)
                msg = BandwidthEstimate(
                    measured_bps=_nan(e.last_measured_bps),
                    predicted_bps=_nan(e.predict_bps() if e.used else None),
                    rtt_s=_nan(e.srtt_s), source=self.source, predictor=e.predictor.name,
                    probe_overhead_bps=8.0 * self.probe_bytes_total / elapsed,
                    samples_used=e.used, samples_ignored=e.ignored)
            msg.header.stamp = rospy.Time.now()
            self.pub.publish(msg)
            try:
                rate.sleep()
            except rospy.ROSInterruptException:
                return
