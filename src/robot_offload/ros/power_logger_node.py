"""power_logger: publishes the robot's power as PowerSample.

With a sensor (Jetson INA3221 rails, RAPL) it samples it at ``~rate_hz``. Without one it
runs the compute / transmit / idle state model on the client's ``activity`` topic
(RobotActivity, published after every frame); since a frame's activity arrives when the
frame is done, modelled samples are published ``~model_lag_s`` behind real time, stamped
with the time they describe, and labelled ``modelled``.
"""

import time

import rospy

from robot_offload.health import RateMeter, power_report
from robot_offload.msg import PowerSample, RobotActivity
from robot_offload.errors import ConfigError
from robot_offload.power import (JetsonIna3221Source, PowerLoggerConfig, PowerSourceUnavailable, RaplSource,
                                 StateModelSource, detect_source)
from robot_offload.ros.diagnostics import NodeDiagnostics
from robot_offload.ros.params import load_params

_SOURCES = {"jetson": JetsonIna3221Source, "rapl": RaplSource}


class PowerLoggerNode:
    def __init__(self):
        try:
            c = self.config = load_params(PowerLoggerConfig)
        except ConfigError as e:
            raise rospy.ROSInitException(f"power_logger: {e}") from e
        kind, sysfs_root = c.source, c.sysfs_root
        self.rate_hz, self.model_lag_s = c.rate_hz, c.model_lag_s
        watts = dict(compute_w=c.compute_w, transmit_w=c.transmit_w, idle_w=c.idle_w)
        if kind == "auto":
            self.source = detect_source(sysfs_root, clock=time.time, **watts)
        elif kind == "model":
            self.source = StateModelSource(clock=time.time, **watts)
        elif kind in _SOURCES:
            try:
                self.source = _SOURCES[kind](sysfs_root, clock=time.time)
            except PowerSourceUnavailable as e:
                raise rospy.ROSInitException(f"power_logger: {e}") from e
        else:
            raise rospy.ROSInitException(f"power_logger: unknown ~source {kind!r}; "
                                         "use auto, jetson, rapl or model")
        self.modelled = self.source.modelled
        self.energy_j = 0.0
        self.started = time.monotonic()
        self.published = RateMeter(window_s=10.0)
        self.failures = RateMeter(window_s=10.0)
        self.read_failures = 0
        self.last_error = ""
        self.rails = []
        self.pub = rospy.Publisher("power", PowerSample, queue_size=50)
        if self.modelled:
            self.source.set_state("idle", time.time())
            self.sub = rospy.Subscriber("activity", RobotActivity, self._on_activity, queue_size=100)
        self.diagnostics = NodeDiagnostics("power", self._health_report)
        rospy.loginfo(f"power_logger: {self.source.describe()} at {self.rate_hz} Hz"
                      + (" (MODELLED, not measured)" if self.modelled else ""))

    def _on_activity(self, msg):
        events = sorted([(a, 0, act) for act, a, b in zip(msg.activity, msg.start_s, msg.end_s)] +
                        [(b, 1, act) for act, a, b in zip(msg.activity, msg.start_s, msg.end_s)])
        try:
            for t, kind, act in events:
                (self.source.begin if kind == 0 else self.source.end)(act, t)
        except ValueError as e:
            rospy.logwarn_throttle(5.0, f"power_logger: activity out of order, skipped: {e}")

    def spin(self):
        period = 1.0 / self.rate_hz
        last_t, last_w = None, None
        while not rospy.is_shutdown():
            try:
                rospy.sleep(period)
            except rospy.ROSInterruptException:
                return
            if self.modelled:
                t = time.time() - self.model_lag_s
                if last_t is None:
                    last_t = t
                    continue
                joules = self.source.energy_between(last_t, t)
                watts = joules / (t - last_t) if t > last_t else 0.0
                rails = {}
            else:
                try:
                    reading = self.source.read()
                except (OSError, ValueError, PowerSourceUnavailable) as e:
                    self.read_failures += 1
                    self.failures.tick()
                    self.last_error = str(e)[:200]
                    rospy.logwarn_throttle(5.0, f"power_logger: read failed: {e}")
                    continue
                t, watts, rails = reading.t_s, reading.watts, reading.rails
                joules = 0.0 if last_t is None else (t - last_t) * (watts + last_w) / 2.0
            self.energy_j += joules
            last_t, last_w = t, watts
            msg = PowerSample(watts=watts, energy_j=self.energy_j, source=self.source.name,
                              modelled=self.modelled, rail_names=list(rails),
                              rail_watts=[float(v) for v in rails.values()])
            msg.header.stamp = rospy.Time.from_sec(t)
            self.pub.publish(msg)
            self.rails = msg.rail_names
            self.published.tick()

    def _health_report(self):
        now = time.monotonic()
        last = self.published.last
        return power_report(
            source=self.source.name, description=self.source.describe(), modelled=self.modelled,
            rails=self.rails, rate_hz=self.rate_hz, achieved_hz=self.published.rate_hz(now),
            uptime_s=now - self.started, last_sample_age_s=None if last is None else now - last,
            read_failures=self.read_failures, recent_failures=self.failures.count(now),
            last_error=self.last_error)
